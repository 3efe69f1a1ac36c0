//! `discard_writes` on pcow with real guests: two KVM VMs in this process,
//! each with the project's test guest and a discarding region
//! (`PcowRegion::open_discarding`) on the same image, run at once. Each
//! guest writes its own pattern over the image's data and into holes and
//! reads it back; after barriers each region still shows its own writes
//! and none of the other's; the image is byte-identical afterwards and
//! checks clean, and no file is left in its directory.
//!
//! Without a usable `/dev/kvm` or userfaultfd the test prints SKIPPED.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pcow::{CreateOptions, Image, OpenOptions, TempOptions};
use virtio_pmem_pcow::Uffd;
use virtio_pmem_pcow::{Monitor, PcowRegion, RegionOptions};
use vmm::testguest::{Check, Report, TestGuest};
use vmm::vcpu::{self, VcpuControl, VcpuStop};
use vmm::{Vm, VmConfig};

mod common;
use common::{chain, Port};

const K64: u64 = 64 << 10;
const M2: u64 = 2 << 20;
const STRIDE: u64 = 0x9E37_79B9_7F4A_7C15;
const GUEST_DEADLINE: Duration = Duration::from_secs(20);

struct MonitorThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl MonitorThread {
    fn spawn(m: Arc<Monitor>) -> MonitorThread {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let fds = m.fds();
            while !s.load(Ordering::Relaxed) {
                let mut pfds: Vec<libc::pollfd> = fds
                    .iter()
                    .map(|&fd| libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    })
                    .collect();
                // SAFETY: the pollfds are valid for the call.
                let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as _, 20) };
                if r > 0 {
                    for p in &pfds {
                        if p.revents != 0 {
                            m.handle_fd(p.fd).expect("monitor");
                        }
                    }
                }
            }
        });
        MonitorThread {
            stop,
            handle: Some(handle),
        }
    }
}

impl Drop for MonitorThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn check(gpa: u64, qwords: u64, seed: u64, write: bool) -> Check {
    Check {
        gpa,
        qwords,
        seed,
        stride: STRIDE,
        write,
    }
}

/// 2 MiB, 64 KiB clusters: clusters 1..=3 in a snapshot, cluster 4 in the
/// writable layer, the rest holes.
fn make_image(path: &Path) {
    let mut img = Image::create(
        path,
        &CreateOptions {
            cluster_size: Some(K64),
            virtual_size: Some(M2),
            base: None,
        },
    )
    .unwrap();
    img.write_at(&check(0, 3 * K64 / 8, 1000, false).bytes(), K64)
        .unwrap();
    img.snapshot_create("s").unwrap();
    img.write_at(&check(0, K64 / 8, 2000, false).bytes(), 4 * K64)
        .unwrap();
    img.close().unwrap();
}

/// One guest's writes (region offsets), seeded apart per guest: over the
/// snapshot's data, over the writable layer, into holes, at the end.
fn writes(seed: u64) -> Vec<Check> {
    vec![
        check(2 * K64 + 8192, 128, seed, true),
        check(4 * K64 - 256, 64, seed + 1, true),
        check(4 * K64 + 4096, 64, seed + 2, true),
        check(10 * K64 + 512, 32, seed + 3, true),
        check(13 * K64 - 64, 32, seed + 4, true),
        check(M2 - 64, 8, seed + 5, true),
    ]
}

struct Guest {
    vm: Vm,
    ctl: Arc<VcpuControl>,
    region: Arc<PcowRegion>,
    _monitor: MonitorThread,
    slot: Option<vmm::vm::Memslot>,
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn two_guests_on_one_image_with_discard_writes() {
    let test = "two_guests_on_one_image_with_discard_writes";
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("root.pcow");
    make_image(&path);
    let bytes = std::fs::read(&path).unwrap();
    let files = listing(dir.path());
    let view = {
        let img = Image::open(&path, OpenOptions::read_only()).unwrap();
        let mut v = vec![0u8; M2 as usize];
        img.read_at(&mut v, 0).unwrap();
        v
    };

    let mut guests = Vec::new();
    for _ in 0..2 {
        let vm = match Vm::new(&VmConfig { ram_size: M2 }) {
            Ok(vm) => vm,
            Err(e) => {
                assert!(
                    !(Path::new("/dev/kvm").exists() && std::env::var_os("CI").is_some()),
                    "{test}: /dev/kvm does not work under CI: {}",
                    chain(&e)
                );
                println!("SKIPPED: {test}: no usable /dev/kvm ({})", chain(&e));
                return;
            }
        };
        if let Err(e) = Uffd::new() {
            println!("SKIPPED: {test}: userfaultfd unavailable ({})", chain(&e));
            return;
        }
        let ctl = VcpuControl::new().unwrap();
        let (region, monitor) = PcowRegion::open_discarding(
            &path,
            &TempOptions::default(),
            ctl.clone(),
            &RegionOptions::default(),
        )
        .unwrap_or_else(|e| panic!("open a discarding region: {}", chain(&e)));
        let region = Arc::new(region);
        let gpa = vm.next_region_gpa().unwrap();
        // SAFETY: `Guest` drops the memslot (taken out below) before the
        // region, which keeps the mapping alive until then.
        let slot = unsafe { vm.add_region(gpa, region.host_addr(), region.len()) }.unwrap();
        guests.push(Guest {
            vm,
            ctl,
            region,
            _monitor: MonitorThread::spawn(Arc::new(monitor)),
            slot: Some(slot),
        });
    }
    assert_eq!(listing(dir.path()), files);

    // Both guests run at once, each writing and reading back its own data.
    let plans = [writes(100), writes(200)];
    let mut threads = Vec::new();
    for (g, plan) in guests.iter().zip(&plans) {
        let gpa = g.slot.as_ref().unwrap().gpa();
        let guest = TestGuest {
            checks: plan
                .iter()
                .map(|c| {
                    Check {
                        gpa: gpa + c.gpa,
                        ..*c
                    }
                    .into()
                })
                .collect(),
            idle: None,
        };
        let loaded = guest.load(g.vm.memory(), gpa + M2).expect("load guest");
        let cpu = g.vm.create_vcpu(0).unwrap();
        loaded.configure(&cpu).unwrap();
        let port = Port::default();
        let t = vcpu::spawn(cpu, g.ctl.clone(), Box::new(port.clone())).unwrap();
        threads.push((t, port));
    }
    for (i, (t, port)) in threads.into_iter().enumerate() {
        let start = Instant::now();
        while !t.is_finished() && start.elapsed() < GUEST_DEADLINE {
            std::thread::sleep(Duration::from_millis(2));
        }
        guests[i].ctl.stop();
        let (stop, _) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
        assert_eq!(stop, VcpuStop::Halted, "guest {i}");
        let n = plans[i].len() as u32;
        let want: Vec<Report> = (0..n).map(Report::Pass).chain([Report::Done(n)]).collect();
        assert_eq!(*port.0.lock().unwrap(), want, "guest {i}");
    }

    // After barriers (the writes move into each overlay) each region shows
    // its own writes over the image, and only those.
    for (i, g) in guests.iter().enumerate() {
        g.region.barrier().unwrap();
        g.region.barrier().unwrap();
        let mut model = view.clone();
        for c in &plans[i] {
            let o = c.gpa as usize;
            model[o..o + c.len() as usize].copy_from_slice(&c.bytes());
        }
        let mut got = vec![0u8; M2 as usize];
        // SAFETY: the region is mapped for `len` bytes while `g.region`
        // lives, and no vCPU runs any more.
        unsafe {
            std::ptr::copy_nonoverlapping(g.region.host_addr(), got.as_mut_ptr(), M2 as usize)
        };
        if let Some(o) = got.iter().zip(&model).position(|(a, b)| a != b) {
            panic!("guest {i}: region differs from its writes first at {o:#x}");
        }
        let st = g.region.status().unwrap();
        assert!(st.chain[0].to_string_lossy().ends_with(" (deleted)"));
    }
    assert!(matches!(
        Image::open(&path, OpenOptions::read_write()),
        Err(pcow::Error::Locked { .. })
    ));

    for mut g in guests {
        drop(g.slot.take());
        drop(g);
    }
    assert!(std::fs::read(&path).unwrap() == bytes, "the image changed");
    assert_eq!(listing(dir.path()), files, "left behind");
    let report = pcow::check::check(&path, None, false).unwrap();
    assert!(report.is_clean(), "{report:?}");
}
