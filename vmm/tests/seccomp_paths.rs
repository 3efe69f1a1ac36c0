//! The seccomp lists hold what the device's code paths make: a pcow region
//! opened as the VMM opens it (the device crate's fault monitor and pool
//! worker confined through the VMM's thread hook), its holes faulted in
//! and written by a thread under the vCPU list, barriers on a thread
//! under the pmem queue list, a snapshot and a live overlay from the
//! thread under the VMM list, all with `--seccomp true`'s trapping
//! filters. A call missing from a list kills the process with the SIGSYS
//! report, so the scenario runs in a child process (this test binary run
//! again for this one test) and the parent reads how it ended.
//!
//! The KVM side (vCPU state captured and restored on vCPU threads under
//! their filters) is `snapshot_kvm.rs`'s
//! `the_round_trips_run_under_the_seccomp_filters`.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use pcow::{CreateOptions, Image};
use virtio_pmem_pcow::{MonitorThread, PcowRegion, RegionOptions, WriteGate};
use vmm::config::options::Seccomp;
use vmm::seccomp_filters::{self, ThreadKind};

const MIB: u64 = 1 << 20;
/// Set in the child: run the scenario instead of starting a child.
const CHILD: &str = "PCOW_SECCOMP_PATHS_CHILD";
/// What the child prints once everything passed.
const DONE: &str = "seccomp scenario done";

#[test]
fn device_threads_serve_faults_barriers_and_overlays_under_their_filters() {
    let name = "device_threads_serve_faults_barriers_and_overlays_under_their_filters";
    if std::env::var_os(CHILD).is_some() {
        scenario();
        println!("{DONE}");
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains(DONE),
        "child: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert!(!stderr.contains("seccomp:"), "{stderr}");
}

/// A thread applying `kind`'s list, then running `f`; joined.
fn on_thread<T: Send + 'static>(kind: ThreadKind, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        seccomp_filters::apply(kind).expect("apply");
        f()
    })
    .join()
    .expect("thread")
}

/// Writes `tag` into the first bytes of every cluster of the region after
/// reading each (a read fault on a hole, then a write fault), as a guest
/// would, on a thread under the vCPU list.
fn guest_writes(region: &Arc<PcowRegion>, tag: u8) {
    let (base, len, cs) = (
        region.host_addr() as usize,
        region.len() as usize,
        region.cluster_size() as usize,
    );
    on_thread(ThreadKind::Vcpu, move || {
        for off in (0..len).step_by(cs) {
            let p = (base + off) as *mut u8;
            // SAFETY: `p` lies in the region's mapping (`off < len`), which
            // the region keeps mapped while the caller holds it; the
            // monitor serves the faults.
            unsafe {
                let _ = std::ptr::read_volatile(p.add(1));
                std::ptr::write_volatile(p, tag);
            }
        }
    });
}

/// The threads of this process named `name`: each must run under at
/// least `filters` stacked filters.
fn assert_confined(name: &str, filters: u32) {
    let mut seen = 0;
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let t = t.unwrap().path();
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(t.join("comm")),
            std::fs::read_to_string(t.join("status")),
        ) else {
            continue;
        };
        if comm.trim() != name {
            continue;
        }
        let field = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .map(|v| v.trim().to_owned())
                .unwrap_or_default()
        };
        assert_eq!(field("Seccomp:"), "2", "{name}");
        let n: u32 = field("Seccomp_filters:").parse().unwrap();
        assert!(n >= filters, "{name}: {n} filters");
        seen += 1;
    }
    assert!(seen > 0, "no thread named {name}");
}

fn scenario() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.pcow");
    let opts = CreateOptions {
        virtual_size: Some(16 * MIB),
        ..Default::default()
    };
    Image::create(&base, &opts).unwrap().close().unwrap();

    // As `main` does: the mode, then the VMM thread's list before any
    // device is opened.
    seccomp_filters::init(Seccomp::True).unwrap();
    seccomp_filters::apply(ThreadKind::Vmm).unwrap();

    let region_opts = RegionOptions {
        thread_hook: Some(seccomp_filters::device_thread_hook()),
        ..RegionOptions::default()
    };
    let (region, monitor) =
        PcowRegion::open(&base, Arc::new(WriteGate::new()), &region_opts).unwrap();
    let region = Arc::new(region);
    let _fault = MonitorThread::spawn("pmem0-fault", Arc::new(monitor), |r| {
        panic!("monitor: {r:?}")
    })
    .unwrap();
    // The VMM's filter and each one's own.
    assert_confined("pmem0-fault", 2);
    assert_confined("pcow-pool", 2);

    guest_writes(&region, 1);
    let r = region.clone();
    on_thread(ThreadKind::PmemQueue, move || r.barrier().unwrap());

    // From the VMM thread: an internal snapshot, then a live overlay (the
    // pool worker restarts on the new top, under its filter again).
    region.snapshot_create("s1").unwrap();
    let top = dir.path().join("top.pcow");
    region.overlay(&top).unwrap();
    assert_confined("pcow-pool", 2);

    guest_writes(&region, 2);
    let r = region.clone();
    on_thread(ThreadKind::PmemQueue, move || r.barrier().unwrap());
    // The same region on the VMM thread (`vm.pmem-flush`).
    region.barrier().unwrap();
    drop(_fault);
    drop(region);

    // What the guest wrote is in the images: 2 on top, 1 in the base.
    let read = |p: &Path| {
        let img = Image::open(
            p,
            pcow::OpenOptions {
                force_share: true,
                ..Default::default()
            },
        )
        .unwrap();
        let mut b = [0u8; 1];
        img.read_at(&mut b, 0).unwrap();
        b[0]
    };
    assert_eq!(read(&top), 2);
    assert_eq!(read(&base), 1);

    deferred_clusters(dir.path());
}

/// An image too scattered to map whole under a small mapping limit: the
/// monitor maps its deferred clusters at their first access, counts the
/// process's mappings near the limit and copies in the clusters past it,
/// all under its filter.
fn deferred_clusters(dir: &Path) {
    let path = dir.join("scattered.pcow");
    let (cs, n) = (4096u64, 1200u64);
    let mut img = Image::create(
        &path,
        &CreateOptions {
            virtual_size: Some(n * cs),
            cluster_size: Some(cs),
            ..Default::default()
        },
    )
    .unwrap();
    // Every other cluster, backwards: no two neighbours in the file.
    for vcn in (0..n / 2).rev().map(|i| 2 * i) {
        img.write_at(&[(vcn % 251) as u8 + 1], vcn * cs).unwrap();
    }
    img.close().unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count() as u64;
    let region_opts = RegionOptions {
        thread_hook: Some(seccomp_filters::device_thread_hook()),
        max_map_count: Some(maps + virtio_pmem_pcow::VMA_MARGIN + 200),
        ..RegionOptions::default()
    };
    let (region, monitor) =
        PcowRegion::open(&path, Arc::new(WriteGate::new()), &region_opts).unwrap();
    let region = Arc::new(region);
    let _fault = MonitorThread::spawn("pmem1-fault", Arc::new(monitor), |r| {
        panic!("monitor: {r:?}")
    })
    .unwrap();
    assert!(region.status().unwrap().deferred_at_open > 0);
    let (base, len) = (region.host_addr() as usize, region.len() as usize);
    let seen: Vec<u8> = on_thread(ThreadKind::Vcpu, move || {
        (0..len)
            .step_by(cs as usize)
            // SAFETY: inside the region's mapping, which the region keeps
            // while the caller holds it; the monitor serves the faults.
            .map(|off| unsafe { std::ptr::read_volatile((base + off) as *const u8) })
            .collect()
    });
    for (vcn, &b) in seen.iter().enumerate() {
        let want = if vcn % 2 == 0 {
            (vcn % 251) as u8 + 1
        } else {
            0
        };
        assert_eq!(b, want, "cluster {vcn}");
    }
    let f = region.status().unwrap().faults;
    assert!(f.deferred_mapped > 0 && f.deferred_copied > 0, "{f:?}");
    guest_writes(&region, 3);
    let r = region.clone();
    on_thread(ThreadKind::PmemQueue, move || r.barrier().unwrap());
    drop(_fault);
    drop(region);
    let img = Image::open(
        &path,
        pcow::OpenOptions {
            force_share: true,
            ..Default::default()
        },
    )
    .unwrap();
    for vcn in 0..n {
        let mut b = [0u8; 1];
        img.read_at(&mut b, vcn * cs).unwrap();
        assert_eq!(b[0], 3, "cluster {vcn} after the barrier");
    }
}
