//! Barriers that follow KVM's dirty log, on the host's KVM with the test
//! guest writing a pcow region (the real device crate, the real memslot
//! registered with `KVM_MEM_LOG_DIRTY_PAGES` by `Vm::add_logged_region`,
//! the vCPUs held by `VcpuControl` during each barrier).
//!
//! The guest writes pages of private clusters (over a base image), a hole
//! and reads another hole; the host runs the first barrier (which scans,
//! once). The guest then writes again, pages it wrote before (private and
//! already copied) and new ones; the host's barrier must follow the log.
//! Last, the guest counts forever into a pmem word while the host runs
//! barriers and status reads (which read the log with the vCPU running):
//! each write lands between two barriers, or while one holds the vCPU, and
//! none may be lost. With the vCPU paused, a last barrier; the
//! image is reopened with pcow, checks clean, and holds every page the
//! guest wrote and the count's last value; the hole only read is not
//! allocated.
//!
//! Without a usable `/dev/kvm` or userfaultfd the test prints SKIPPED and
//! passes, except under CI (`CI` set) with a `/dev/kvm` that exists; a KVM
//! without a dirty log prints SKIPPED with the reason (the nested
//! sandbox's stock KVM has one, and so has this project's `kvm_pvm`).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pcow::{CreateOptions, Image, OpenOptions};
use virtio_pmem_pcow::{MonitorReport, MonitorThread, PcowRegion, RegionOptions};
use vm_memory::{Bytes, GuestAddress};
use vmm::dirty_log::LogChoice;
use vmm::dirty_ring::{host_stops_full_rings, DEFAULT_RING_BYTES};
use vmm::testguest::{Check, Report, Step, TestGuest};
use vmm::vcpu::{self, VcpuControl, VcpuStats, VcpuStop};
use vmm::vm::Vm;

mod common;
use common::{chain, uffd_or_skip, vm_with_log_or_skip, Port};

const K64: u64 = 64 << 10;
const M2: u64 = 2 << 20;
const PAGE: u64 = 4096;
const STRIDE: u64 = 0x9E37_79B9_7F4A_7C15;
/// Clusters of the region: 0..24 hold base data, 24..32 are holes.
const CLUSTERS: u64 = 32;
const DATA: u64 = 24;
/// The RAM word the guest polls between phases.
const PHASE: u64 = 0x1_8000;
/// How long the guest polls it at most (about 6 us a read on the
/// emulating KVM).
const POLL_TRIES: u64 = 2_000_000;
const DEADLINE: Duration = Duration::from_secs(20);

impl Port {
    /// Waits for `n` reports; all must be passes.
    fn wait(&self, n: usize, t: &vcpu::VcpuThread, what: &str) {
        let start = Instant::now();
        loop {
            let r = self.0.lock().unwrap().clone();
            assert!(
                r.iter().all(|x| matches!(x, Report::Pass(_))),
                "{what}: {r:?}"
            );
            if r.len() >= n {
                return;
            }
            assert!(!t.is_finished(), "{what}: the vCPU ended: {r:?}");
            assert!(
                start.elapsed() < DEADLINE,
                "{what}: {r:?} after {DEADLINE:?}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

fn make_image(dir: &Path) -> std::path::PathBuf {
    let size = CLUSTERS * K64;
    let mut base = Image::create(
        dir.join("base.pcow"),
        &CreateOptions {
            cluster_size: Some(K64),
            virtual_size: Some(size),
            base: None,
        },
    )
    .unwrap();
    let data: Vec<u8> = (0..DATA * K64).map(|i| (i * 7 % 251) as u8).collect();
    base.write_at(&data, 0).unwrap();
    base.close().unwrap();
    let top = dir.join("top.pcow");
    Image::create(
        &top,
        &CreateOptions {
            cluster_size: Some(K64),
            virtual_size: Some(size),
            base: Some(pcow::BaseRef {
                name: "base.pcow".into(),
                format: pcow::BaseFormat::Probe,
            }),
        },
    )
    .unwrap()
    .close()
    .unwrap();
    top
}

fn read_all(path: &Path) -> Vec<u8> {
    let img = Image::open(path, OpenOptions::read_only()).unwrap();
    let mut v = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut v, 0).unwrap();
    v
}

/// Writes `c`'s pattern into `model` at region offset `off`.
fn apply(model: &mut [u8], off: u64, c: &Check) {
    model[off as usize..][..c.bytes().len()].copy_from_slice(&c.bytes());
}

/// A VM whose logged slots are read as `choice` says; `None` (SKIPPED
/// printed) when there is no KVM, or when the ring was asked for and this
/// KVM has none.
fn vm_for(test: &str, choice: LogChoice) -> Option<Vm> {
    let vm = vm_with_log_or_skip(test, M2, choice)?;
    match choice {
        LogChoice::Ring(_) if vm.dirty_rings().is_none() => {
            println!("SKIPPED: {test}: this KVM gives no dirty ring (see the VMM's info log)");
            None
        }
        LogChoice::Bitmap => {
            assert!(vm.dirty_rings().is_none());
            Some(vm)
        }
        _ => Some(vm),
    }
}

#[test]
fn barriers_on_the_dirty_ring_miss_no_guest_write() {
    barriers_miss_no_guest_write(
        "barriers_on_the_dirty_ring_miss_no_guest_write",
        LogChoice::Ring(DEFAULT_RING_BYTES),
    );
}

#[test]
fn barriers_on_the_dirty_bitmap_miss_no_guest_write() {
    barriers_miss_no_guest_write(
        "barriers_on_the_dirty_bitmap_miss_no_guest_write",
        LogChoice::Bitmap,
    );
}

fn barriers_miss_no_guest_write(test: &str, choice: LogChoice) {
    let Some(vm) = vm_for(test, choice) else {
        return;
    };
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path());
    let mut model = read_all(&path);

    let ctl = VcpuControl::new().unwrap();
    let (region, monitor) = PcowRegion::open(&path, ctl.clone(), &RegionOptions::default())
        .unwrap_or_else(|e| panic!("open region: {}", chain(&e)));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let f = failures.clone();
    let monitor = MonitorThread::spawn("pmem0-fault", Arc::new(monitor), move |r| {
        if let MonitorReport::Failed(e) = r {
            f.lock().unwrap().push(chain(&e));
        }
    })
    .unwrap();
    let gpa = vm.next_region_gpa().unwrap();
    let (host, len) = (region.host_addr(), region.len());
    // SAFETY: the region stays mapped until after the memslot is dropped:
    // `slot` drops before `monitor` and `region` (declared after them).
    let slot = unsafe { vm.add_logged_region(gpa, host, len) }.unwrap();
    let Some(log) = slot.write_log() else {
        println!("SKIPPED: {test}: this KVM gives no dirty log (see the VMM's info log)");
        return;
    };
    region.attach_write_log(Arc::new(log)).unwrap();

    // Region offsets; the guest sees them at gpa + offset.
    let check = |off: u64, qwords: u64, seed: u64| Check {
        gpa: gpa + off,
        qwords,
        seed,
        stride: STRIDE,
        write: true,
    };
    let zeros = |off: u64| Check {
        gpa: gpa + off,
        qwords: K64 / 8,
        seed: 0,
        stride: 0,
        write: false,
    };
    // Phase 1: private pages over the base (one spans two pages), a hole
    // written (a fault maps a fresh cluster shared), a hole read.
    let phase1 = [
        (3 * K64 + 5 * PAGE, check(3 * K64 + 5 * PAGE, 4, 11)),
        (7 * K64 + PAGE - 16, check(7 * K64 + PAGE - 16, 4, 12)),
        (20 * K64 + 15 * PAGE, check(20 * K64 + 15 * PAGE, 512, 13)),
        (25 * K64 + 2 * PAGE, check(25 * K64 + 2 * PAGE, 8, 14)),
    ];
    // Phase 2: pages written (and copied) before, and new ones.
    let phase2 = [
        (3 * K64 + 5 * PAGE + 8, check(3 * K64 + 5 * PAGE + 8, 2, 21)),
        (20 * K64 + 15 * PAGE, check(20 * K64 + 15 * PAGE, 1, 22)),
        (K64, check(K64, 16, 23)),
        (25 * K64 + 9 * PAGE, check(25 * K64 + 9 * PAGE, 8, 24)),
    ];
    let counter = 11 * K64 + 3 * PAGE + 64;
    let base_word = model[counter as usize..][..8].to_vec();
    let mut steps: Vec<Step> = phase1.iter().map(|(_, c)| (*c).into()).collect();
    steps.push(zeros(28 * K64).into());
    steps.push(Step::poll(PHASE, 8, 1, POLL_TRIES));
    steps.extend(phase2.iter().map(|(_, c)| Step::from(*c)));
    steps.push(Step::poll(PHASE, 8, 2, POLL_TRIES));
    steps.push(Step::Count { gpa: gpa + counter });
    let guest = TestGuest {
        checks: steps,
        idle: None,
    };
    let (t, port) = start(&vm, &guest, gpa + len, 0, ctl.clone());

    port.wait(phase1.len() + 1, &t, "phase 1");
    for (off, c) in &phase1 {
        apply(&mut model, *off, c);
    }
    let s = region.barrier().unwrap();
    eprintln!("{test}: first barrier {s:?}");
    assert!(
        !s.write_log,
        "the first barrier after attaching scans: {s:?}"
    );
    // Page 5 of cluster 3, pages 0 and 1 of cluster 7, 15 of 20 (cluster
    // 25 is shared).
    assert_eq!((s.private_pages, s.pages_copied), (4, 4), "{s:?}");
    vm.memory().write_obj(1u64, GuestAddress(PHASE)).unwrap();

    port.wait(phase1.len() + 2 + phase2.len(), &t, "phase 2");
    for (off, c) in &phase2 {
        apply(&mut model, *off, c);
    }
    let s = region.barrier().unwrap();
    eprintln!("{test}: second barrier {s:?}");
    assert!(s.write_log && !s.tracked, "the log, no scan: {s:?}");
    // Pages 5 of cluster 3, 15 of 20, 0 of 1 (cluster 25 is shared).
    assert_eq!((s.private_pages, s.pages_copied), (3, 3), "{s:?}");
    vm.memory().write_obj(2u64, GuestAddress(PHASE)).unwrap();

    // The guest counts; barriers run meanwhile, and status reads, which
    // read (and with manual protection clear) the log while the guest
    // runs: the pages they take are kept for the next barrier.
    let start = Instant::now();
    let mut barriers = 0;
    let mut copied = 0;
    while start.elapsed() < Duration::from_millis(600) {
        std::thread::sleep(Duration::from_millis(5));
        if barriers % 2 == 0 {
            region.status().unwrap();
        }
        let s = region.barrier().unwrap();
        assert!(s.write_log, "{s:?}");
        barriers += 1;
        copied += s.pages_copied;
    }
    ctl.pause().unwrap();
    let s = region.barrier().unwrap();
    copied += s.pages_copied;
    let mut word = [0u8; 8];
    // SAFETY: the word is inside the mapped region, the only writer (the
    // vCPU) is paused, and the read is of plain bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(host.add(counter as usize), word.as_mut_ptr(), 8);
    }
    let count = u64::from_le_bytes(word);
    eprintln!(
        "{test}: {barriers} barriers while the guest counted to {count}, {copied} pages copied"
    );
    assert_ne!(word.as_slice(), base_word.as_slice(), "the guest counted");
    assert!(
        copied >= 2,
        "the counting page was copied at more than one barrier"
    );
    model[counter as usize..][..8].copy_from_slice(&word);
    ctl.stop();
    ctl.resume();
    let (stop, _) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
    assert_eq!(stop, VcpuStop::Stopped);
    drop(slot);
    drop(monitor);
    drop(region);
    let failures = failures.lock().unwrap().clone();
    assert!(failures.is_empty(), "the monitor failed: {failures:?}");

    let got = read_all(&path);
    if let Some(i) = got.iter().zip(&model).position(|(a, b)| a != b) {
        panic!(
            "image differs at {i:#x} (cluster {}, page {}): got {:?} want {:?}",
            i as u64 / K64,
            (i as u64 % K64) / PAGE,
            &got[i..i + 8],
            &model[i..i + 8]
        );
    }
    let r = pcow::check::check(&path, None, false).unwrap();
    assert!(r.is_clean(), "check: {r:?}");
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    // Clusters 1, 3, 7, 11, 20, 25 hold the guest's writes; not 28.
    assert!(
        matches!(img.cluster_source(28), pcow::ClusterSource::Hole),
        "the hole read is not allocated"
    );
    eprintln!("{test}: {} clusters allocated", img.allocated_clusters());
}

/// Loads `guest` (its page tables reaching `end`) and runs it on a new
/// vCPU `id` under `ctl`: the vCPU's thread and the port it reports to.
fn start(
    vm: &Vm,
    guest: &TestGuest,
    end: u64,
    id: u8,
    ctl: Arc<VcpuControl>,
) -> (vcpu::VcpuThread, Port) {
    let loaded = guest.load(vm.memory(), end).unwrap();
    let cpu = vm.create_vcpu(id).unwrap();
    loaded.configure(&cpu).unwrap();
    let port = Port::default();
    let t = vcpu::spawn(cpu, ctl, Box::new(port.clone())).unwrap();
    (t, port)
}

/// Runs the test guest once on a new vCPU: one byte into each of `pages`
/// (page numbers of the slot at `gpa`), then halts. The vCPU's exit
/// counters.
fn write_pages(vm: &Vm, id: u8, gpa: u64, len: u64, pages: &[u64], value: u64) -> VcpuStats {
    let guest = TestGuest {
        checks: pages
            .iter()
            .map(|p| Step::write(gpa + p * PAGE + 9, 1, value))
            .collect(),
        idle: None,
    };
    let (t, port) = start(vm, &guest, gpa + len, id, VcpuControl::new().unwrap());
    let (_, stats) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
    let r = port.0.lock().unwrap().clone();
    assert!(
        matches!(r.last(), Some(Report::Done(n)) if *n as usize == pages.len()),
        "the guest did not finish its writes: {r:?}"
    );
    stats
}

/// An anonymous mapping of `len` bytes as a logged slot of `vm`; the host
/// address. The caller unmaps it after the slot is dropped.
fn anon_slot(vm: &Vm, len: u64) -> (*mut libc::c_void, u64, vmm::vm::Memslot) {
    // SAFETY: a new private anonymous mapping at no fixed address; it
    // replaces nothing and is unmapped by the caller after the slot is gone.
    let host = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(host, libc::MAP_FAILED);
    let gpa = vm.next_region_gpa().unwrap();
    // SAFETY: the mapping outlives the slot (the caller drops the slot
    // before the munmap).
    let slot = unsafe { vm.add_logged_region(gpa, host.cast(), len) }.unwrap();
    (host, gpa, slot)
}

/// The log names each page the guest wrote, once: a second read names
/// nothing (with manual protection that needs the read's clear: without
/// it, the same pages came back; with the ring, the reset), and a page
/// written again after a read is named again (the clear or the reset
/// re-protected it). Pages far apart, past the first 64 of the slot (a
/// clear spans words of the bitmap).
fn names_each_write_once(test: &str, choice: LogChoice) {
    let Some(vm) = vm_for(test, choice) else {
        return;
    };
    const LEN: u64 = 64 << 20;
    let (host, gpa, slot) = anon_slot(&vm, LEN);
    let Some(log) = slot.write_log() else {
        println!("SKIPPED {test}: this KVM gives no dirty log");
        return;
    };
    println!(
        "manual protection: {}, ring: {:?}",
        vm.dirty_log_manual(),
        vm.dirty_rings().map(|r| r.entries())
    );
    let take = || {
        let mut v = Vec::new();
        log.take(&mut |p| v.push(p)).unwrap();
        v.sort_unstable();
        v
    };
    let first = [0, 3, 100, 5000, 16383];
    write_pages(&vm, 0, gpa, LEN, &first, 1);
    assert_eq!(take(), first);
    assert_eq!(take(), Vec::<u64>::new(), "a second read names nothing");
    write_pages(&vm, 1, gpa, LEN, &[3, 16383], 2);
    assert_eq!(take(), [3, 16383], "pages written after a read");
    assert_eq!(take(), Vec::<u64>::new());
    drop(slot);
    // SAFETY: the slot that pointed at it is deleted; nothing else uses it.
    unsafe { libc::munmap(host, LEN as usize) };
}

#[test]
fn the_dirty_ring_names_each_write_once_and_again_after_a_new_write() {
    names_each_write_once(
        "the_dirty_ring_names_each_write_once_and_again_after_a_new_write",
        LogChoice::Ring(DEFAULT_RING_BYTES),
    );
}

#[test]
fn the_dirty_bitmap_names_each_write_once_and_again_after_a_new_write() {
    names_each_write_once(
        "the_dirty_bitmap_names_each_write_once_and_again_after_a_new_write",
        LogChoice::Bitmap,
    );
}

/// A ring smaller than what the guest writes fills up: KVM stops the
/// vCPU (`KVM_EXIT_DIRTY_RING_FULL`), its thread collects every ring and
/// the guest goes on; the pages collected then are kept for the next
/// read, which names every page written, once. A KVM that writes past a
/// full ring instead (the host's `kvm_pvm`) must make the next read of
/// every slot fail, never pass with pages missing. Two slots: each read
/// names only its own slot's pages. The smallest ring KVM takes (a page,
/// or the next power of two it accepts), and four times as many pages
/// written.
#[test]
fn a_full_dirty_ring_stops_the_vcpu_and_loses_no_page() {
    let test = "a_full_dirty_ring_stops_the_vcpu_and_loses_no_page";
    let mut found = None;
    for bytes in [4096u32, 8192, 16384, 32768, 65536] {
        let Some(vm) = vm_with_log_or_skip(test, M2, LogChoice::Ring(bytes)) else {
            return;
        };
        if let Some(entries) = vm.dirty_rings().map(|r| r.entries()) {
            found = Some((vm, entries));
            break;
        }
    }
    let Some((vm, entries)) = found else {
        println!("SKIPPED: {test}: this KVM gives no dirty ring of 4-64 KiB");
        return;
    };
    const LEN: u64 = 64 << 20;
    let (host_a, gpa_a, slot_a) = anon_slot(&vm, LEN);
    let (host_b, gpa_b, slot_b) = anon_slot(&vm, LEN);
    let (log_a, log_b) = (slot_a.write_log().unwrap(), slot_b.write_log().unwrap());
    let take = |log: &vmm::dirty_log::KvmDirtyLog| {
        let mut v = Vec::new();
        log.take(&mut |p| v.push(p)).unwrap();
        v.sort_unstable();
        v
    };
    // Four runs of a ring's worth of pages each, spread over the slot
    // (every word of each page written: one entry per page).
    let n = u64::from(entries);
    let runs = [(7, n), (3000, n), (9001, n), (LEN / PAGE - n, n)];
    let pages: Vec<u64> = runs.iter().flat_map(|&(p, c)| p..p + c).collect();
    let guest = TestGuest {
        checks: runs
            .iter()
            .map(|&(p, c)| {
                Step::from(Check {
                    gpa: gpa_a + p * PAGE,
                    qwords: c * PAGE / 8,
                    seed: p,
                    stride: STRIDE,
                    write: true,
                })
            })
            .collect(),
        idle: None,
    };
    let (t, port) = start(&vm, &guest, gpa_a + LEN, 0, VcpuControl::new().unwrap());
    let run = t.join();
    let rings = vm.dirty_rings().unwrap();
    let rs = rings.stats();
    let try_take = |log: &vmm::dirty_log::KvmDirtyLog| {
        let mut v = Vec::new();
        log.take(&mut |p| v.push(p)).map(|()| {
            v.sort_unstable();
            v
        })
    };
    eprintln!(
        "{test}: {entries} entries per ring, {} pages written, vCPU {}, rings {rs:?}",
        pages.len(),
        match &run {
            Ok(r) => format!("{r:?}"),
            Err(e) => chain(e),
        }
    );
    if rs.overflows == 0 {
        let (_, stats) = run.unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
        let r = port.0.lock().unwrap().clone();
        assert!(
            matches!(r.last(), Some(Report::Done(4)))
                && r.iter().filter(|x| matches!(x, Report::Pass(_))).count() == 4,
            "the guest did not finish its writes: {r:?}"
        );
        assert!(stats.ring_full >= 1, "the ring never filled: {stats:?}");
        assert_eq!(rs.full_exits, stats.ring_full);
        assert_eq!(take(&log_b), Vec::<u64>::new(), "slot b was not written");
        assert_eq!(take(&log_a), pages, "every page of slot a, once");
    } else {
        // KVM wrote past the ring. Such a KVM also never frees it again
        // (its reset stops where entries were overwritten), so the vCPU
        // must stop with an error rather than spin, and no read may pass
        // for complete: each slot's next read fails (its reader scans).
        assert!(
            !host_stops_full_rings(),
            "a KVM trusted to stop at a full ring overflowed it: {rs:?}"
        );
        if let Err(e) = &run {
            assert!(chain(e).contains("dirty ring full"), "{}", chain(e));
        }
        for log in [&log_a, &log_b] {
            let e = try_take(log).expect_err("a read after an overflow must fail");
            assert!(chain(&e).contains("overflowed"), "{}", chain(&e));
        }
        eprintln!("{test}: this KVM overflowed the ring; both slots reported it");
    }
    assert_eq!(take(&log_a), Vec::<u64>::new());
    // Both slots, after pages of each were written by other vCPUs: the
    // log works again (reading whole rings, after an overflow).
    write_pages(&vm, 1, gpa_b, LEN, &[9, 12345], 2);
    write_pages(&vm, 2, gpa_a, LEN, &[pages[0], pages[pages.len() - 1]], 3);
    assert_eq!(take(&log_b), [9, 12345]);
    assert_eq!(take(&log_a), [pages[0], pages[pages.len() - 1]]);
    assert_eq!(rings.stats().strays, 0, "{:?}", rings.stats());
    drop(slot_a);
    drop(slot_b);
    // SAFETY: the slots that pointed at them are deleted.
    unsafe {
        libc::munmap(host_a, LEN as usize);
        libc::munmap(host_b, LEN as usize);
    }
}

/// A barrier after the guest wrote more pages than its ring holds: every
/// page of private clusters (over the base) written once. Where KVM stops
/// the vCPU at a full ring (upstream's kvm-amd), the vCPU's thread
/// collects, the guest finishes and the barrier follows the log; where KVM
/// overflows the ring (the host's kvm_pvm), the vCPU ends with an error
/// and the barrier must scan instead. Either way the image afterwards
/// holds exactly what the region showed before it was closed, and checks
/// clean.
#[test]
fn a_barrier_after_a_full_ring_keeps_every_write() {
    let test = "a_barrier_after_a_full_ring_keeps_every_write";
    let Some(vm) = vm_for(test, LogChoice::Ring(4096)) else {
        return;
    };
    if !uffd_or_skip(test) {
        return;
    }
    let entries = vm.dirty_rings().map_or(0, |r| r.entries());
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path());
    let ctl = VcpuControl::new().unwrap();
    let (region, monitor) = PcowRegion::open(&path, ctl.clone(), &RegionOptions::default())
        .unwrap_or_else(|e| panic!("open region: {}", chain(&e)));
    let monitor = MonitorThread::spawn("pmem0-fault", Arc::new(monitor), |_| {}).unwrap();
    let gpa = vm.next_region_gpa().unwrap();
    let (host, len) = (region.host_addr(), region.len());
    // SAFETY: the region stays mapped until after the memslot is dropped
    // (`slot` is dropped first, below).
    let slot = unsafe { vm.add_logged_region(gpa, host, len) }.unwrap();
    region
        .attach_write_log(Arc::new(slot.write_log().unwrap()))
        .unwrap();
    // The first barrier after attaching scans; the next follow the log.
    region.barrier().unwrap();
    // Every page of the base's clusters: more pages than the ring holds.
    let pages = DATA * K64 / PAGE;
    assert!(pages > u64::from(entries), "{pages} pages, ring {entries}");
    let guest = TestGuest {
        checks: vec![Step::from(Check {
            gpa,
            qwords: DATA * K64 / 8,
            seed: 77,
            stride: STRIDE,
            write: true,
        })],
        idle: None,
    };
    let (t, port) = start(&vm, &guest, gpa + len, 0, ctl.clone());
    let run = t.join();
    let rs = vm.dirty_rings().unwrap().stats();
    let s = region
        .barrier()
        .unwrap_or_else(|e| panic!("barrier: {}", chain(&e)));
    eprintln!(
        "{test}: ring {entries}, {pages} pages, vCPU {}, rings {rs:?}, barrier {s:?}",
        match &run {
            Ok(r) => format!("{r:?}"),
            Err(e) => chain(e),
        }
    );
    if rs.overflows == 0 {
        let (stop, stats) = run.unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
        assert_eq!(stop, VcpuStop::Halted);
        let r = port.0.lock().unwrap().clone();
        assert!(
            matches!(r.as_slice(), [Report::Pass(_), Report::Done(1)]),
            "the guest's writes: {r:?}"
        );
        assert!(stats.ring_full >= 1, "{stats:?}");
        assert!(s.write_log, "the barrier followed the log: {s:?}");
        assert_eq!(s.pages_copied, pages, "{s:?}");
    } else {
        assert!(!host_stops_full_rings(), "{rs:?}");
        assert!(!s.write_log, "after an overflow the barrier scans: {s:?}");
    }
    let mut shown = vec![0u8; (CLUSTERS * K64) as usize];
    // SAFETY: the region is mapped for `len` bytes (at least the image's
    // virtual size) and its only writer, the vCPU, has ended.
    unsafe { std::ptr::copy_nonoverlapping(host, shown.as_mut_ptr(), shown.len()) };
    drop(slot);
    drop(monitor);
    drop(region);
    let got = read_all(&path);
    if let Some(i) = got.iter().zip(&shown).position(|(a, b)| a != b) {
        panic!(
            "image differs from what the guest saw at {i:#x} (page {})",
            i as u64 / PAGE
        );
    }
    let r = pcow::check::check(&path, None, false).unwrap();
    assert!(r.is_clean(), "check: {r:?}");
}

/// What a full-ring exit that finds its ring empty means: once, another
/// thread collected the ring between the exit and the vCPU's own
/// collection (a race, nothing lost); twice in a row for the same vCPU,
/// KVM wrote past the ring (every slot's next read fails). Driven through
/// `collect_full` directly, as the vCPU thread calls it.
#[test]
fn one_empty_full_ring_exit_is_a_race_two_are_an_overflow() {
    let test = "one_empty_full_ring_exit_is_a_race_two_are_an_overflow";
    let Some(vm) = vm_for(test, LogChoice::Ring(DEFAULT_RING_BYTES)) else {
        return;
    };
    const LEN: u64 = 2 << 20;
    let (host, gpa, slot) = anon_slot(&vm, LEN);
    let log = slot.write_log().unwrap();
    let rings = vm.dirty_rings().unwrap();
    let take = || {
        let mut v = Vec::new();
        log.take(&mut |p| v.push(p)).map(|()| {
            v.sort_unstable();
            v
        })
    };
    write_pages(&vm, 0, gpa, LEN, &[1, 2], 1);
    // A full exit that finds entries, then one that finds the ring empty
    // (another thread's collection in between): nothing is lost.
    rings.collect_full(0).unwrap();
    rings.collect_full(0).unwrap();
    assert_eq!(rings.stats().overflows, 0, "{:?}", rings.stats());
    assert_eq!(take().unwrap(), [1, 2]);
    // The same vCPU again with nothing in its ring: an overflow.
    rings.collect_full(0).unwrap();
    assert_eq!(rings.stats().overflows, 1, "{:?}", rings.stats());
    let e = take().expect_err("a read after an overflow must fail");
    assert!(chain(&e).contains("overflowed"), "{}", chain(&e));
    // Read whole from now on, the log goes on.
    write_pages(&vm, 1, gpa, LEN, &[7], 2);
    assert_eq!(take().unwrap(), [7]);
    drop(slot);
    // SAFETY: the slot that pointed at it is deleted.
    unsafe { libc::munmap(host, LEN as usize) };
}

/// A guest on KVM reading and writing an image too scattered to map whole
/// (a small mapping limit given to the region): the open leaves most of
/// its clusters unmapped, and the guest's first access to each (a KVM
/// fault on the region's anonymous memory, served by the monitor) maps it
/// shared (written after the snapshot), private (the snapshot's), or
/// copies it in past the limit. Every value the guest reads is the
/// image's; its writes, found through the write log, reach the image.
#[test]
fn a_guest_on_kvm_uses_clusters_left_unmapped_at_open() {
    let test = "a_guest_on_kvm_uses_clusters_left_unmapped_at_open";
    let Some(vm) = vm_for(test, LogChoice::default()) else {
        return;
    };
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scattered.pcow");
    // 256 clusters: a read of each and a write into every sixth fit the
    // test guest's table of checks.
    let size = M2 / 2;
    let n = size / PAGE;
    let data = |vcn: u64, seed: u64| Check {
        gpa: vcn * PAGE,
        qwords: 2,
        seed: seed * 1000 + vcn,
        stride: STRIDE,
        write: false,
    };
    // Even clusters written in a scattered order, then a snapshot, then
    // every fourth again (the writable layer's): shared, private and
    // hole clusters side by side, no two neighbours in the file.
    let mut img = Image::create(
        &path,
        &CreateOptions {
            cluster_size: Some(PAGE),
            virtual_size: Some(size),
            base: None,
        },
    )
    .unwrap();
    let scattered = |step: u64| {
        let mut v: Vec<u64> = (0..n).step_by(step as usize).collect();
        let mut s = 0x9e37_79b9u64 ^ step;
        for i in (1..v.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            v.swap(i, (s % (i as u64 + 1)) as usize);
        }
        v
    };
    for vcn in scattered(2) {
        img.write_at(&data(vcn, 1).bytes(), vcn * PAGE).unwrap();
    }
    img.snapshot_create("s").unwrap();
    for vcn in scattered(4) {
        img.write_at(&data(vcn, 2).bytes(), vcn * PAGE).unwrap();
    }
    img.close().unwrap();
    let mut model = read_all(&path);

    let maps = std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count() as u64;
    let opts = RegionOptions {
        max_map_count: Some(maps + virtio_pmem_pcow::VMA_MARGIN + 80),
        ..RegionOptions::default()
    };
    let ctl = VcpuControl::new().unwrap();
    let (region, monitor) = PcowRegion::open(&path, ctl.clone(), &opts)
        .unwrap_or_else(|e| panic!("open region: {}", chain(&e)));
    let deferred = region.status().unwrap().deferred_at_open;
    assert!(deferred > 0, "the open defers the short runs");
    let monitor = Arc::new(monitor);
    let served = MonitorThread::spawn("pmem0-fault", monitor.clone(), |_| {}).unwrap();
    let gpa = vm.next_region_gpa().unwrap();
    let (host, len) = (region.host_addr(), region.len());
    // SAFETY: the region stays mapped until after the memslot is dropped
    // (`slot` is dropped first, below).
    let slot = unsafe { vm.add_logged_region(gpa, host, len) }.unwrap();
    if let Some(log) = slot.write_log() {
        region.attach_write_log(Arc::new(log)).unwrap();
    }
    region.barrier().unwrap();

    let at = |c: Check| Check {
        gpa: gpa + c.gpa,
        ..c
    };
    let mut steps: Vec<Step> = Vec::new();
    for vcn in 0..n {
        let want = match vcn % 4 {
            0 => data(vcn, 2),
            2 => data(vcn, 1),
            _ => Check {
                seed: 0,
                stride: 0,
                ..data(vcn, 0)
            },
        };
        steps.push(at(want).into());
    }
    let mut writes = Vec::new();
    for vcn in (0..n).step_by(6) {
        let w = Check {
            gpa: vcn * PAGE + 64,
            qwords: 1,
            seed: 0x5a5a_0000 + vcn,
            stride: 0,
            write: true,
        };
        steps.push(at(w).into());
        writes.push(w);
    }
    let guest = TestGuest {
        checks: steps.clone(),
        idle: None,
    };
    let (t, port) = start(&vm, &guest, gpa + len, 0, ctl.clone());
    let (stop, _) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
    assert_eq!(stop, VcpuStop::Halted);
    let r = port.0.lock().unwrap().clone();
    let want: Vec<Report> = (0..steps.len() as u32)
        .map(Report::Pass)
        .chain([Report::Done(steps.len() as u32)])
        .collect();
    assert_eq!(r, want, "every read saw the image's data");
    let f = monitor.counters().unwrap();
    assert!(
        f.deferred_mapped + f.deferred_copied >= deferred,
        "each deferred cluster resolved at its first access: {f:?}, {deferred} deferred"
    );
    let s = region
        .barrier()
        .unwrap_or_else(|e| panic!("barrier: {}", chain(&e)));
    eprintln!("{test}: {deferred} deferred at open; {f:?}; barrier {s:?}");
    drop(slot);
    drop(served);
    drop(monitor);
    drop(region);
    for w in &writes {
        apply(&mut model, w.gpa, w);
    }
    let got = read_all(&path);
    if let Some(i) = got.iter().zip(&model).position(|(a, b)| a != b) {
        panic!("image differs at {i:#x} (cluster {})", i as u64 / PAGE);
    }
    let r = pcow::check::check(&path, None, false).unwrap();
    assert!(r.is_clean(), "check: {r:?}");
}
