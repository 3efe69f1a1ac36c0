//! Host KVM tier: the hand-assembled test guest on the host's `/dev/kvm`
//! (an emulating KVM on the project's machines, see
//! `shared/design/platform-facts.md`), with its RAM and with a pcow pmem
//! region served by the device crate's userfaultfd monitor.
//!
//! Without a usable `/dev/kvm` a test prints `SKIPPED: no /dev/kvm (...)`
//! and passes, except under CI (`CI` set) when `/dev/kvm` exists: then it
//! must work, and a failure fails the test.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pcow::{CreateOptions, Image, OpenOptions};
use virtio_pmem_pcow::{Monitor, PcowRegion, PmemDevice, RegionOptions};
use virtio_pmem_pcow::{Quiesce, QuiesceError};
use vm_memory::{Bytes, GuestAddress};
use vmm::pci::virtio_pci::{BAR_SIZE, DEVICE_CFG_OFFSET, ISR_OFFSET, NOTIFY_OFFSET};
use vmm::pci::{BarMove, InterruptSink, Mmio64Window, PciBus, PmemVirtio, VirtioPciDevice};
use vmm::testguest::{Check, Report, Step, TestGuest, TEST_PORT};
use vmm::vcpu::{self, MmioBus, PortIo, VcpuControl, VcpuStats, VcpuStop, VcpuThread};
use vmm::Vm;
use vmm_sys_util::eventfd::EventFd;

mod common;
use common::{chain, uffd_or_skip, vm_or_skip};

const K64: u64 = 64 << 10;
const M2: u64 = 2 << 20;
const STRIDE: u64 = 0x9E37_79B9_7F4A_7C15;
/// The whole test must stay well under 30 s; a guest gets this long.
const GUEST_DEADLINE: Duration = Duration::from_secs(20);
/// Bound of the guest's poll of the used ring: about 6 us an iteration on
/// the emulating KVM (12 s, under the deadline), far longer than a FLUSH
/// needs; much faster on real KVM, still far longer than the few steps
/// between the notify and the barrier's hold (the vCPU is held, not
/// polling, during the barrier itself).
const USED_POLL_TRIES: u64 = 2_000_000;

/// The guest's port reports, and the answer to its idle polls.
#[derive(Clone, Default)]
struct Port {
    reports: Arc<Mutex<Vec<Report>>>,
    halt: Arc<AtomicBool>,
}

impl PortIo for Port {
    fn io_out(&mut self, port: u16, data: &[u8]) {
        if port == TEST_PORT && data.len() == 4 {
            let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
            self.reports.lock().unwrap().push(Report::decode(v));
        }
    }

    fn io_in(&mut self, _port: u16, data: &mut [u8]) {
        data.fill(0);
        data[0] = u8::from(self.halt.load(Ordering::Relaxed));
    }
}

impl Port {
    fn reports(&self) -> Vec<Report> {
        self.reports.lock().unwrap().clone()
    }

    /// Waits for the Done report; stops the vCPU on a timeout or an early
    /// end of its thread.
    fn wait_done(&self, t: &VcpuThread, ctl: &VcpuControl, what: &str) {
        let start = Instant::now();
        loop {
            if self.reports().iter().any(|r| matches!(r, Report::Done(_))) {
                return;
            }
            if t.is_finished() {
                panic!("{what}: the vCPU ended early, reports {:?}", self.reports());
            }
            if start.elapsed() > GUEST_DEADLINE {
                ctl.stop();
                panic!(
                    "{what}: no Done report after {GUEST_DEADLINE:?}: {:?}",
                    self.reports()
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Runs `guest` on vCPU 0 of `vm` until it halts; returns its reports.
fn run_to_halt(vm: &Vm, guest: &TestGuest, map_end: u64) -> (Vec<Report>, VcpuStats) {
    let loaded = guest.load(vm.memory(), map_end).expect("load guest");
    let cpu = vm.create_vcpu(0).expect("vcpu");
    loaded.configure(&cpu).expect("configure");
    let ctl = VcpuControl::new().expect("control");
    let port = Port::default();
    let t = vcpu::spawn(cpu, ctl.clone(), Box::new(port.clone())).expect("spawn");
    port.wait_done(&t, &ctl, "guest");
    let (stop, stats) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
    assert_eq!(stop, VcpuStop::Halted);
    (port.reports(), stats)
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

#[test]
fn guest_writes_and_reads_its_ram() {
    let t0 = Instant::now();
    let Some(vm) = vm_or_skip("guest_writes_and_reads_its_ram", M2) else {
        return;
    };
    // The host puts data for a verify-only check; a second verify-only
    // check expects data that is not there and must fail.
    let pre = check(0x18_0000, 16, 77, false);
    vm.memory()
        .write_slice(&pre.bytes(), GuestAddress(pre.gpa))
        .unwrap();
    let checks = [
        check(0x10_0000, 64, 1, true),
        check(0x12_0000 - 8, 3, 2, true),
        pre,
        check(0x1C_0000, 4, 5, false),
    ];
    let guest = TestGuest {
        checks: checks.iter().map(|&c| c.into()).collect(),
        idle: None,
    };
    let (reports, stats) = run_to_halt(&vm, &guest, vm.ram_end());
    assert_eq!(
        reports,
        [
            Report::Pass(0),
            Report::Pass(1),
            Report::Pass(2),
            Report::Fail(3),
            Report::Done(4)
        ]
    );
    for c in &checks[..3] {
        let mut got = vec![0u8; c.len() as usize];
        vm.memory()
            .read_slice(&mut got, GuestAddress(c.gpa))
            .unwrap();
        assert_eq!(got, c.bytes(), "RAM at {:#x}", c.gpa);
    }
    assert_eq!(stats.io_out, 5);
    assert_eq!(stats.mmio_read + stats.mmio_write, 0);
    eprintln!(
        "guest_writes_and_reads_its_ram: {:?}, {stats:?}",
        t0.elapsed()
    );
}

#[test]
fn guest_fault_ends_the_run_and_is_reported() {
    // Long mode with no IDT: `ud2` raises #UD, which cannot be delivered
    // (#GP, then #DF): a triple fault, reported as a shutdown (or, on an
    // emulating KVM, maybe as an error naming the exit).
    let Some(vm) = vm_or_skip("guest_fault_ends_the_run_and_is_reported", M2) else {
        return;
    };
    let loaded = TestGuest::default()
        .load(vm.memory(), vm.ram_end())
        .unwrap();
    vm.memory()
        .write_slice(&[0x0F, 0x0B], GuestAddress(loaded.entry())) // ud2 at the entry
        .unwrap();
    let cpu = vm.create_vcpu(0).expect("vcpu");
    loaded.configure(&cpu).unwrap();
    let ctl = VcpuControl::new().unwrap();
    let t = vcpu::spawn(cpu, ctl.clone(), Box::new(|_: u16, _: &[u8]| {})).unwrap();
    let start = Instant::now();
    while !t.is_finished() && start.elapsed() < GUEST_DEADLINE {
        std::thread::sleep(Duration::from_millis(2));
    }
    ctl.stop();
    match t.join() {
        Ok((stop, _)) => assert_eq!(stop, VcpuStop::Shutdown),
        Err(e) => eprintln!("reported: {}", chain(&e)),
    }
}

#[test]
fn pause_kicks_a_spinning_vcpu_out_of_kvm_run() {
    let test = "pause_kicks_a_spinning_vcpu_out_of_kvm_run";
    let Some(vm) = vm_or_skip(test, M2) else {
        return;
    };
    // No checks; then spin about 2^31 iterations between polls: the vCPU
    // stays inside KVM_RUN unless kicked.
    let guest = TestGuest {
        checks: Vec::new(),
        idle: Some(u32::MAX >> 1),
    };
    let loaded = guest.load(vm.memory(), vm.ram_end()).unwrap();
    let cpu = vm.create_vcpu(0).unwrap();
    loaded.configure(&cpu).unwrap();
    let ctl = VcpuControl::new().unwrap();
    let port = Port::default();
    let t = vcpu::spawn(cpu, ctl.clone(), Box::new(port.clone())).unwrap();
    port.wait_done(&t, &ctl, test);
    let mut worst = Duration::ZERO;
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(20));
        let start = Instant::now();
        ctl.pause().unwrap();
        worst = worst.max(start.elapsed());
        assert_eq!(ctl.paused(), 1);
        ctl.resume();
    }
    assert!(worst < Duration::from_secs(2), "pause took {worst:?}");
    ctl.stop();
    let (stop, stats) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
    assert_eq!(stop, VcpuStop::Stopped);
    assert_eq!(stats.pauses, 3, "{stats:?}");
    // The stop may find the vCPU before its next KVM_RUN (no kick needed).
    assert!(stats.interrupted >= 3, "every pause kicked: {stats:?}");
    assert_eq!(
        stats.io_in, 0,
        "the guest never reached its poll: {stats:?}"
    );
    eprintln!("{test}: worst pause {worst:?}, {stats:?}");
}

/// Waits until the guest has reported `n` NMIs.
fn wait_nmis(port: &Port, t: &VcpuThread, ctl: &VcpuControl, n: usize, what: &str) {
    let start = Instant::now();
    let count = || port.reports().iter().filter(|r| **r == Report::Nmi).count();
    while count() < n {
        if t.is_finished() || start.elapsed() > GUEST_DEADLINE {
            ctl.stop();
            panic!(
                "{what}: {} of {n} NMIs reported after {:?}: {:?}",
                count(),
                start.elapsed(),
                port.reports()
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn nmi_reaches_a_spinning_guest_and_a_paused_one_at_resume() {
    let test = "nmi_reaches_a_spinning_guest_and_a_paused_one_at_resume";
    let Some(vm) = vm_or_skip(test, M2) else {
        return;
    };
    // As in the previous test: the vCPU spins inside KVM_RUN, so the NMI
    // must kick it out, be queued by its thread, and be taken by the
    // guest's vector 2 handler, which reports it and returns to the spin.
    let guest = TestGuest {
        checks: Vec::new(),
        idle: Some(u32::MAX >> 1),
    };
    let loaded = guest.load(vm.memory(), vm.ram_end()).unwrap();
    let cpu = vm.create_vcpu(0).unwrap();
    loaded.configure(&cpu).unwrap();
    let ctl = VcpuControl::new().unwrap();
    let port = Port::default();
    let t = vcpu::spawn(cpu, ctl.clone(), Box::new(port.clone())).unwrap();
    port.wait_done(&t, &ctl, test);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(ctl.nmi(), 1);
    wait_nmis(&port, &t, &ctl, 1, test);
    let first = port.reports().iter().filter(|r| **r == Report::Nmi).count();
    assert_eq!(first, 1, "one NMI, one report: {:?}", port.reports());

    // Paused: the NMI waits for the resume.
    ctl.pause().unwrap();
    let start = Instant::now();
    assert_eq!(ctl.nmi(), 1);
    assert!(
        start.elapsed() < vcpu::NMI_WAIT,
        "nmi() waited for a paused vCPU"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        port.reports().iter().filter(|r| **r == Report::Nmi).count(),
        1,
        "the paused guest took an NMI: {:?}",
        port.reports()
    );
    ctl.resume();
    wait_nmis(&port, &t, &ctl, 2, test);

    // The handler returned to the spin: the vCPU is still in its run.
    std::thread::sleep(Duration::from_millis(20));
    assert!(!t.is_finished(), "the guest died after its NMIs");
    ctl.stop();
    let (stop, stats) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
    assert_eq!(stop, VcpuStop::Stopped);
    assert_eq!(stats.nmis, 2, "{stats:?}");
    assert_eq!(
        stats.io_in, 0,
        "the guest never reached its poll: the NMIs came through kicks: {stats:?}"
    );
    assert_eq!(
        port.reports(),
        [Report::Done(0), Report::Nmi, Report::Nmi],
        "nothing else reported"
    );
    eprintln!("{test}: {stats:?}");
}

/// The monitor on its own thread polling its fds, as the VMM's epoll loop
/// will.
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

fn read_image(path: &Path) -> Vec<u8> {
    let img = Image::open(path, OpenOptions::read_only()).expect("reopen");
    let mut v = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut v, 0).expect("read");
    v
}

#[test]
fn guest_writes_pcow_pmem_across_holes_and_snapshots() {
    let test = "guest_writes_pcow_pmem_across_holes_and_snapshots";
    let t0 = Instant::now();
    let Some(vm) = vm_or_skip(test, M2) else {
        return;
    };
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pmem.pcow");
    make_image(&path);
    let mut model = read_image(&path);

    let ctl = VcpuControl::new().unwrap();
    // One fault per hole written (no expansion window): the counts below.
    let opts = RegionOptions {
        expand_window: Some(0),
        ..RegionOptions::default()
    };
    let (region, monitor) = PcowRegion::open(&path, ctl.clone(), &opts)
        .unwrap_or_else(|e| panic!("open region: {}", chain(&e)));
    let monitor = Arc::new(monitor);
    let mon_thread = MonitorThread::spawn(monitor.clone());
    let gpa = vm.next_region_gpa().unwrap();
    assert_eq!(
        gpa,
        vmm::boot::layout::pmem_area_start(vm.ram_end()),
        "2 MiB aligned above RAM and the 32-bit hole"
    );
    // SAFETY: the region stays mapped until after the memslot is dropped
    // (below, `slot` drops before `region`).
    let slot = unsafe { vm.add_region(gpa, region.host_addr(), region.len()) }.unwrap();

    // Offsets are region offsets; the guest sees them at gpa + offset.
    let at = |c: Check| Check {
        gpa: gpa + c.gpa,
        ..c
    };
    let checks = pmem_checks();
    let guest = TestGuest {
        checks: checks.iter().map(|&c| at(c).into()).collect(),
        idle: Some(2000),
    };
    let loaded = guest
        .load(vm.memory(), gpa + region.len())
        .expect("load guest");
    let cpu = vm.create_vcpu(0).unwrap();
    loaded.configure(&cpu).unwrap();
    let port = Port::default();
    let t = vcpu::spawn(cpu, ctl.clone(), Box::new(port.clone())).unwrap();
    port.wait_done(&t, &ctl, test);
    let t_guest = t0.elapsed();
    let n = checks.len() as u32;
    let want: Vec<Report> = (0..n).map(Report::Pass).chain([Report::Done(n)]).collect();
    assert_eq!(port.reports(), want);
    let faults = monitor.counters().unwrap();
    assert!(faults.write_faults >= 3, "{faults:?}");
    assert!(faults.read_faults >= 1, "{faults:?}");

    // A barrier with the vCPU still running (spinning inside KVM_RUN and
    // polling the port): the hold kicks it out and keeps it out.
    let b = region
        .barrier()
        .unwrap_or_else(|e| panic!("barrier: {}", chain(&e)));
    assert!(b.pages_copied >= 2, "{b:?}");
    // Let it halt.
    port.halt.store(true, Ordering::Relaxed);
    let start = Instant::now();
    while !t.is_finished() && start.elapsed() < GUEST_DEADLINE {
        std::thread::sleep(Duration::from_millis(2));
    }
    ctl.stop();
    let (stop, stats) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
    assert_eq!(stop, VcpuStop::Halted);
    assert!(stats.pauses >= 1, "the barrier held the vCPU: {stats:?}");
    assert_eq!(
        stats.mmio_read + stats.mmio_write,
        0,
        "no exit for copy-on-write"
    );
    assert_eq!(stats.io_out, u64::from(n) + 1);

    // Everything goes: the memslot before the region it points at.
    drop(slot);
    drop(vm);
    drop(mon_thread);
    drop(region);
    drop(monitor);

    let report = pcow::check::check(&path, None, false).expect("check");
    assert!(report.is_clean(), "{report:?}");
    for c in checks.iter().filter(|c| c.write) {
        let o = c.gpa as usize;
        model[o..o + c.len() as usize].copy_from_slice(&c.bytes());
    }
    let got = read_image(&path);
    if let Some(i) = got.iter().zip(&model).position(|(a, b)| a != b) {
        panic!("image differs from the guest's writes first at {i:#x}");
    }
    eprintln!(
        "{test}: guest done after {t_guest:?}, all {:?}; {faults:?}; barrier copied {} pages in {} clusters; {stats:?}",
        t0.elapsed(),
        b.pages_copied,
        b.clusters_copied
    );
}

/// The image: 2 MiB (32 clusters of 64 KiB). Clusters 1..=3 hold data in
/// the snapshot "s" (a pattern seeded 1000); cluster 4 is written after it
/// (writable layer, mapped shared); everything else is a hole.
fn make_image(path: &Path) {
    let host_data = check(K64, 3 * K64 / 8, 1000, false);
    let after_snap = check(4 * K64, K64 / 8, 2000, false);
    let mut img = Image::create(
        path,
        &CreateOptions {
            cluster_size: Some(K64),
            virtual_size: Some(M2),
            base: None,
        },
    )
    .unwrap();
    img.write_at(&host_data.bytes(), K64).unwrap();
    img.snapshot_create("s").unwrap();
    img.write_at(&after_snap.bytes(), 4 * K64).unwrap();
    img.close().unwrap();
}

/// The guest's accesses to the region of [`make_image`], at region
/// offsets: snapshot data read, copy-on-write into snapshotted clusters,
/// writes across the snapshot into the writable layer, faults into holes,
/// a read of a hole then a write there, the region's last bytes.
fn pmem_checks() -> Vec<Check> {
    let host_data = check(K64, 3 * K64 / 8, 1000, false);
    let checks: Vec<Check> = vec![
        // Read the snapshot's data (private mapping of a read-only layer).
        check(
            K64 + 4096,
            64,
            1000u64.wrapping_add(512u64.wrapping_mul(STRIDE)),
            false,
        ),
        // Copy-on-write into a snapshotted cluster: no exit.
        check(2 * K64 + 8192, 128, 11, true),
        // Across the snapshot (cluster 3) into the writable layer (4).
        check(4 * K64 - 256, 64, 12, true),
        // A write fault into a hole: the monitor maps a cluster while the
        // vCPU waits in KVM_RUN.
        check(10 * K64 + 512, 32, 13, true),
        // Across two holes.
        check(13 * K64 - 64, 32, 14, true),
        // A read of a hole sees zeros and allocates nothing.
        Check {
            gpa: 20 * K64,
            qwords: 16,
            seed: 0,
            stride: 0,
            write: false,
        },
        // ... then a write there (zero-mapped: private, harvested by the
        // barrier).
        check(20 * K64 + 64, 16, 15, true),
        // The last bytes of the region.
        check(M2 - 64, 8, 16, true),
    ];
    // The verify-only check of the snapshot data expects its words: the
    // pattern continues from the host's seed.
    assert_eq!(
        checks[0].bytes(),
        host_data.bytes()[4096..4096 + 512],
        "the first check reads what the host wrote"
    );
    checks
}

#[test]
fn guest_steps_write_read_and_poll_ram_and_unclaimed_mmio() {
    let test = "guest_steps_write_read_and_poll_ram_and_unclaimed_mmio";
    let t0 = Instant::now();
    let Some(vm) = vm_or_skip(test, M2) else {
        return;
    };
    const R: u64 = 0x10_0000;
    // Nothing decodes the ECAM window here (no MMIO bus): reads are zeros.
    const UNCLAIMED: u64 = vmm::pci::ECAM_BASE;
    const POLL_TRIES: u64 = 100_000;
    let steps = vec![
        Step::write(R, 8, 0x1122_3344_5566_7788),
        Step::write(R + 8, 4, 0xaabb_ccdd),
        Step::write(R + 12, 2, 0xeeff),
        Step::write(R + 15, 1, 0x99),
        Step::read(R, 8, 0x1122_3344_5566_7788),
        Step::read(R + 8, 8, 0x9900_eeff_aabb_ccdd),
        Step::read(R + 4, 4, 0x1122_3344),
        Step::read(R + 12, 2, 0xeeff),
        Step::read(R + 15, 1, 0x99),
        Step::read_masked(R, 8, 0xff00, 0x7700),
        // A mismatch fails.
        Step::read(R, 4, 0x5566_7789),
        // A poll that matches at once; one that never does.
        Step::poll(R + 12, 2, 0xeeff, 3),
        Step::poll(R, 1, 0x89, POLL_TRIES),
        // Unclaimed MMIO: the write is dropped, the read answers zeros.
        Step::write(UNCLAIMED, 4, 0x1234_5678),
        Step::read(UNCLAIMED, 4, 0),
    ];
    let guest = TestGuest {
        checks: steps.clone(),
        idle: None,
    };
    let (reports, stats) = run_to_halt(&vm, &guest, 4 << 30);
    let n = steps.len() as u32;
    let want: Vec<Report> = (0..n)
        .map(|i| {
            if i == 10 || i == 12 {
                Report::Fail(i)
            } else {
                Report::Pass(i)
            }
        })
        .chain([Report::Done(n)])
        .collect();
    assert_eq!(reports, want);
    let mut got = [0u8; 16];
    vm.memory().read_slice(&mut got, GuestAddress(R)).unwrap();
    assert_eq!(
        got,
        [
            0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0xdd, 0xcc, 0xbb, 0xaa, 0xff, 0xee, 0,
            0x99
        ]
    );
    assert_eq!(
        (stats.mmio_read, stats.mmio_write, stats.mmio_unclaimed),
        (1, 1, 2),
        "{stats:?}"
    );
    eprintln!(
        "{test}: {:?} (a failed poll of {POLL_TRIES} tries included), {stats:?}",
        t0.elapsed()
    );
}

/// The PCI bus as the vCPU's MMIO handler, with the queue notify addresses
/// taken out of the synchronous path: a write there only signals the
/// queue's eventfd (what a KVM ioeventfd does without an exit), and the
/// VMM thread serves the queue. The addresses follow the BAR through the
/// bus's hook, as the ioeventfd registrations will.
struct PciMmio {
    bus: Arc<Mutex<PciBus>>,
    /// (notify address, queue) while BAR 0 decodes.
    notify: Arc<Mutex<Vec<(u64, u16)>>>,
    /// Queue 0's eventfd (the pmem device has one queue).
    kick: Arc<EventFd>,
    /// Spent in each read before it reaches the bus (zero: none): makes
    /// a vCPU polling a register spend nearly all its time in the handler.
    read_delay: Duration,
}

impl MmioBus for PciMmio {
    fn mmio_read(&mut self, addr: u64, data: &mut [u8]) -> bool {
        if !self.read_delay.is_zero() {
            std::thread::sleep(self.read_delay);
        }
        self.bus.lock().unwrap().mmio_read(addr, data)
    }

    fn mmio_write(&mut self, addr: u64, data: &[u8]) -> bool {
        let hit = self.notify.lock().unwrap().iter().any(|&(a, _)| a == addr);
        if hit {
            self.kick.write(1).expect("eventfd");
            return true;
        }
        self.bus.lock().unwrap().mmio_write(addr, data)
    }
}

/// MSI-X is not used by the test guest (it polls): deliveries are counted.
#[derive(Default)]
struct CountingSink(AtomicU64);

impl InterruptSink for CountingSink {
    fn trigger(&self, _vector: u16) -> std::io::Result<()> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// How long the test's VMM thread waits before serving a notification.
const SERVE_DELAY: Duration = Duration::from_millis(5);

/// The test's VMM thread: waits on the queue's eventfd and serves the
/// queue; returns how many notifications it served.
fn vmm_thread(
    dev: Arc<Mutex<VirtioPciDevice>>,
    kick: Arc<EventFd>,
    stop: Arc<AtomicBool>,
) -> JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut served = 0;
        while !stop.load(Ordering::Relaxed) {
            let mut pfd = libc::pollfd {
                fd: kick.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: the pollfd is valid for the call.
            let r = unsafe { libc::poll(&mut pfd, 1, 20) };
            if r > 0 && kick.read().is_ok() {
                // Served at once, the barrier's hold may find the vCPU
                // still in its notify handler (quiet: no kick needed);
                // a moment later it is polling the used ring inside
                // KVM_RUN, the case this test is about.
                std::thread::sleep(SERVE_DELAY);
                // The FLUSH runs the barrier here, holding the vCPU
                // through the VcpuControl: it is kicked out of KVM_RUN,
                // waits, and resumes after the barrier.
                dev.lock().unwrap().notify_queue(0);
                served += 1;
            }
        }
        served
    })
}

#[test]
fn guest_flushes_pcow_pmem_through_virtio_pci() {
    flush_through_virtio_pci("guest_flushes_pcow_pmem_through_virtio_pci", Wait::UsedRing);
}

#[test]
fn guest_polling_the_device_during_a_flush_does_not_deadlock() {
    flush_through_virtio_pci(
        "guest_polling_the_device_during_a_flush_does_not_deadlock",
        Wait::Isr,
    );
}

/// How the guest waits for the FLUSH to complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Polls the used ring's index in RAM: inside KVM_RUN, where the
    /// barrier's hold kicks it out.
    UsedRing,
    /// Polls the ISR register (MMIO): each poll is an exit into the PCI
    /// bus, which blocks on the device lock while the VMM thread holds it
    /// across the barrier; the hold must count that vCPU as quiet (it is
    /// outside KVM_RUN, in a handler) or the two wait on each other.
    Isr,
}

/// The guest writes the pcow region, drives the virtio-pci function up to
/// DRIVER_OK and issues a FLUSH; the test's VMM thread serves it (a
/// barrier holding the vCPU); the guest sees the response; the image
/// checks clean and holds the guest's writes.
fn flush_through_virtio_pci(test: &str, wait: Wait) {
    let t0 = Instant::now();
    let Some(vm) = vm_or_skip(test, M2) else {
        return;
    };
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pmem.pcow");
    make_image(&path);
    let mut model = read_image(&path);

    // The region, its memslot and the monitor, as in the test above.
    let ctl = VcpuControl::new().unwrap();
    let hold = Arc::new(CountingHold {
        ctl: ctl.clone(),
        holds: AtomicU64::new(0),
    });
    let (region, monitor) = PcowRegion::open(&path, hold.clone(), &RegionOptions::default())
        .unwrap_or_else(|e| panic!("open region: {}", chain(&e)));
    let monitor = Arc::new(monitor);
    let mon_thread = MonitorThread::spawn(monitor.clone());
    let gpa = vm.next_region_gpa().unwrap();
    let (host, len) = (region.host_addr(), region.len());
    // SAFETY: the region stays mapped until after the memslot is dropped:
    // the monitor keeps it mapped, and `slot` drops before `monitor`.
    let slot = unsafe { vm.add_region(gpa, host, len) }.unwrap();

    // The device: the region is its FlushBackend (a FLUSH is a barrier
    // holding the vCPUs through `ctl`), behind a virtio-pci function on
    // the bus. The bus pre-assigns BAR 0; the guest moves it.
    let sink = Arc::new(CountingSink::default());
    let pmem = PmemVirtio::new(PmemDevice::new(gpa, len, region));
    let dev = VirtioPciDevice::new(Box::new(pmem), vm.memory().clone(), sink.clone()).unwrap();
    let dev = Arc::new(Mutex::new(dev));
    let mut bus = PciBus::new(Mmio64Window::above(gpa + len));
    let notify = Arc::new(Mutex::new(Vec::new()));
    let n = notify.clone();
    let moves = Arc::new(Mutex::new(Vec::new()));
    let mv = moves.clone();
    bus.set_bar_hook(move |m: BarMove| {
        mv.lock().unwrap().push(m);
        *n.lock().unwrap() = m
            .new
            .map(|base| vec![(base + NOTIFY_OFFSET, 0)])
            .unwrap_or_default();
    });
    let pci = bus.add_device(dev.clone()).unwrap();
    assert_eq!(pci.device, 1);
    let bar = bus.window().base + 0x10_0000;
    let bus = Arc::new(Mutex::new(bus));
    let kick = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    let stop_vmm = Arc::new(AtomicBool::new(false));
    let vmm = vmm_thread(dev.clone(), kick.clone(), stop_vmm.clone());

    // The virtqueue in guest RAM, prepared by the host as plain data: one
    // FLUSH chain (request type 0, then a device-writable status word),
    // its head in avail.ring[0]; the guest publishes it (avail.idx) itself.
    const DESC: u64 = 0x2_0000;
    const AVAIL: u64 = 0x2_1000;
    const USED: u64 = 0x2_2000;
    const REQ: u64 = 0x2_3000;
    const RESP: u64 = 0x2_3100;
    const QSIZE: u64 = 16;
    let mem = vm.memory();
    mem.write_obj(0u32, GuestAddress(REQ)).unwrap();
    mem.write_obj(0xdead_beefu32, GuestAddress(RESP)).unwrap();
    for (i, (addr, len, flags, next)) in [(REQ, 4u32, 1u16, 1u16), (RESP, 4, 2, 0)]
        .into_iter()
        .enumerate()
    {
        let at = DESC + 16 * i as u64;
        mem.write_obj(addr, GuestAddress(at)).unwrap();
        mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        mem.write_obj(next, GuestAddress(at + 14)).unwrap();
    }
    mem.write_obj(0u16, GuestAddress(AVAIL + 4)).unwrap(); // ring[0] = head 0

    // The guest: the pmem writes of the test above, then the driver (all
    // register accesses are guest MMIO), the FLUSH, then the pmem data
    // again.
    const ACK: u64 = 1;
    const DRIVER: u64 = 2;
    const DRIVER_OK: u64 = 4;
    const FEATURES_OK: u64 = 8;
    let ecam = vmm::pci::ECAM_BASE + (u64::from(pci.device) << 15);
    let c = bar; // common configuration at BAR offset 0
    let pmem = pmem_checks();
    let at = |c: Check| Check {
        gpa: gpa + c.gpa,
        ..c
    };
    let mut steps: Vec<Step> = pmem.iter().map(|&c| at(c).into()).collect();
    let driver_from = steps.len();
    steps.extend([
        // Config space through ECAM: the function, BAR 0 moved, memory
        // decoding and bus mastering on.
        Step::read(ecam, 4, 0x105b_1af4),
        Step::write(ecam + 0x10, 4, bar & 0xffff_ffff),
        Step::write(ecam + 0x14, 4, bar >> 32),
        Step::write(ecam + 0x04, 2, 0x0006),
        Step::read_masked(ecam + 0x10, 4, !0xf, bar & 0xffff_fff0),
        Step::read(ecam + 0x14, 4, bar >> 32),
        // Reset, ACKNOWLEDGE, DRIVER.
        Step::write(c + 0x14, 1, 0),
        Step::read(c + 0x14, 1, 0),
        Step::write(c + 0x14, 1, ACK),
        Step::write(c + 0x14, 1, ACK | DRIVER),
        // Features: VERSION_1 (bit 32) offered, accepted, nothing else.
        Step::write(c, 4, 1),
        Step::read_masked(c + 0x04, 4, 1, 1),
        Step::write(c + 0x08, 4, 0),
        Step::write(c + 0x0c, 4, 0),
        Step::write(c + 0x08, 4, 1),
        Step::write(c + 0x0c, 4, 1),
        Step::write(c + 0x14, 1, ACK | DRIVER | FEATURES_OK),
        Step::read(c + 0x14, 1, ACK | DRIVER | FEATURES_OK),
        // Queue 0: one queue, max 256, size 16, ring addresses (desc and
        // device as 64-bit writes, driver in 32-bit halves), enable.
        Step::read(c + 0x12, 2, 1),
        Step::write(c + 0x16, 2, 0),
        Step::read(c + 0x18, 2, 256),
        Step::write(c + 0x18, 2, QSIZE),
        Step::read(c + 0x1e, 2, 0),
        Step::write(c + 0x20, 8, DESC),
        Step::write(c + 0x28, 4, AVAIL),
        Step::write(c + 0x2c, 4, 0),
        Step::write(c + 0x30, 8, USED),
        Step::read(c + 0x28, 8, AVAIL),
        Step::write(c + 0x1c, 2, 1),
        Step::write(c + 0x14, 1, ACK | DRIVER | FEATURES_OK | DRIVER_OK),
        Step::read(c + 0x14, 1, ACK | DRIVER | FEATURES_OK | DRIVER_OK),
        // The device configuration: the region's address and size.
        Step::read(c + DEVICE_CFG_OFFSET, 8, gpa),
        Step::read(c + DEVICE_CFG_OFFSET + 8, 8, len),
    ]);
    let flush_from = steps.len();
    steps.extend([
        // FLUSH: publish the chain, notify queue 0, wait for the used
        // index (see `Wait`), then the response, the used element (id 0,
        // 4 bytes written), and the ISR's queue bit (read clears it).
        Step::write(AVAIL + 2, 2, 1),
        Step::write(c + NOTIFY_OFFSET, 2, 0),
    ]);
    steps.extend(match wait {
        Wait::UsedRing => [
            Step::poll(USED + 2, 2, 1, USED_POLL_TRIES),
            Step::read(c + ISR_OFFSET, 1, 1),
        ],
        Wait::Isr => [
            Step::poll(c + ISR_OFFSET, 1, 1, USED_POLL_TRIES),
            Step::read(USED + 2, 2, 1),
        ],
    });
    steps.extend([
        Step::read(RESP, 4, 0),
        Step::read(USED + 4, 4, 0),
        Step::read(USED + 8, 4, 4),
    ]);
    // The pmem data again, after the barrier moved it into the image (not
    // the zeros of the hole read, which a later write partly covers).
    steps.extend(pmem.iter().filter(|c| c.write || c.seed != 0).map(|&c| {
        Step::Mem(Check {
            write: false,
            ..at(c)
        })
    }));
    let guest = TestGuest {
        checks: steps.clone(),
        idle: None,
    };
    let loaded = guest.load(vm.memory(), bar + BAR_SIZE).expect("load guest");
    let cpu = vm.create_vcpu(0).unwrap();
    loaded.configure(&cpu).unwrap();
    let port = Port::default();
    let mmio = PciMmio {
        bus: bus.clone(),
        notify: notify.clone(),
        kick: kick.clone(),
        // Polling the ISR, the vCPU is nearly always in its handler when
        // the barrier's hold comes, then blocks on the device lock.
        read_delay: match wait {
            Wait::UsedRing => Duration::ZERO,
            Wait::Isr => Duration::from_millis(1),
        },
    };
    let t = vcpu::spawn_with(cpu, ctl.clone(), Box::new(port.clone()), Box::new(mmio)).unwrap();
    port.wait_done(&t, &ctl, test);
    let t_guest = t0.elapsed();
    let (stop, stats) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
    assert_eq!(stop, VcpuStop::Halted);
    let n = steps.len() as u32;
    let want: Vec<Report> = (0..n).map(Report::Pass).chain([Report::Done(n)]).collect();
    let got = port.reports();
    if got != want {
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        panic!(
            "{test}: reports differ first at {first:?} (driver steps from {driver_from}, FLUSH from {flush_from}): {got:?}"
        );
    }
    stop_vmm.store(true, Ordering::Relaxed);
    let served = vmm.join().unwrap();
    assert_eq!(served, 1, "one notification, served by the VMM thread");
    // The FLUSH's barrier held the vCPU: kicked out of its poll and
    // paused before its next KVM_RUN, or found outside KVM_RUN (in its
    // MMIO handler, after the notify; polling the ISR, blocked on the
    // device lock) and kept there. Which of the two depends on the
    // scheduler, so the hold is counted, not the pause.
    assert!(
        hold.holds.load(Ordering::Relaxed) >= 1,
        "the FLUSH barrier did not hold the vCPU: {stats:?}"
    );
    assert_eq!(stats.mmio_unclaimed, 0, "{stats:?}");
    {
        let d = dev.lock().unwrap();
        assert!(d.is_active());
        assert_eq!(d.status() & 0x40, 0, "no NEEDS_RESET");
        assert_eq!(d.notify_addresses(), [(bar + NOTIFY_OFFSET, 0)]);
    }
    let moves = moves.lock().unwrap().clone();
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!((moves[0].old, moves[0].new), (None, Some(bar)));
    assert_eq!(sink.0.load(Ordering::Relaxed), 0, "no MSI-X vector set");

    // Everything goes: the memslot before the region it points at. The
    // region is closed without a barrier of its own (only shared clusters
    // reach the file on close): the guest's copy-on-write and zero-page
    // writes are in the image only because the FLUSH moved them.
    drop(slot);
    drop(vm);
    drop(bus);
    drop(dev);
    drop(mon_thread);
    drop(monitor);

    let report = pcow::check::check(&path, None, false).expect("check");
    assert!(report.is_clean(), "{report:?}");
    for c in pmem.iter().filter(|c| c.write) {
        let o = c.gpa as usize;
        model[o..o + c.len() as usize].copy_from_slice(&c.bytes());
    }
    let got = read_image(&path);
    if let Some(i) = got.iter().zip(&model).position(|(a, b)| a != b) {
        panic!("image differs from the guest's writes first at {i:#x}");
    }
    eprintln!(
        "{test}: guest done after {t_guest:?}, all {:?}; {} steps; {stats:?}",
        t0.elapsed(),
        n
    );
}

/// The vCPU control as a region's `Quiesce`, counting the holds that
/// succeeded.
struct CountingHold {
    ctl: Arc<VcpuControl>,
    holds: AtomicU64,
}

impl Quiesce for CountingHold {
    fn hold(&self) -> Result<(), QuiesceError> {
        Quiesce::hold(&*self.ctl)?;
        self.holds.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn release(&self) {
        Quiesce::release(&*self.ctl);
    }
}
