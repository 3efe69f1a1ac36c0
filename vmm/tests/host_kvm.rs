//! Host KVM tier: the hand-assembled test guest on the host's `/dev/kvm`
//! (an emulating KVM on the project's machines, see
//! `shared/design/platform-facts.md`), with its RAM and with a pcow pmem
//! region served by the device crate's userfaultfd monitor.
//!
//! Without a usable `/dev/kvm` a test prints `SKIPPED: no /dev/kvm (...)`
//! and passes, except under CI (`CI` set) when `/dev/kvm` exists: then it
//! must work, and a failure fails the test.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pcow::{CreateOptions, Image, OpenOptions};
use virtio_pmem_pcow::monitor::Uffd;
use virtio_pmem_pcow::{Monitor, PcowRegion, RegionOptions};
use vm_memory::{Bytes, GuestAddress};
use vmm::testguest::{Check, Report, TestGuest, TEST_PORT};
use vmm::vcpu::{self, PortIo, VcpuControl, VcpuStats, VcpuStop, VcpuThread};
use vmm::{Vm, VmConfig, VmError};

const K64: u64 = 64 << 10;
const M2: u64 = 2 << 20;
const STRIDE: u64 = 0x9E37_79B9_7F4A_7C15;
/// The whole test must stay well under 30 s; a guest gets this long.
const GUEST_DEADLINE: Duration = Duration::from_secs(20);

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s += ": ";
        s += &c.to_string();
        src = c.source();
    }
    s
}

/// A VM, or `None` (printed as SKIPPED) when KVM is not usable here. Under
/// CI a `/dev/kvm` that exists must work.
fn vm_or_skip(test: &str, ram_size: u64) -> Option<Vm> {
    match Vm::new(&VmConfig { ram_size }) {
        Ok(vm) => Some(vm),
        Err(e) => {
            let dev = Path::new("/dev/kvm").exists();
            let under_ci = std::env::var_os("CI").is_some();
            if dev && under_ci {
                panic!(
                    "{test}: /dev/kvm exists but does not work under CI: {}",
                    chain(&e)
                );
            }
            if !matches!(e, VmError::OpenKvm(_)) && dev {
                eprintln!("{test}: note: /dev/kvm opened but the VM failed");
            }
            println!("SKIPPED: no /dev/kvm ({})", chain(&e));
            None
        }
    }
}

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
    let checks = vec![
        check(0x10_0000, 64, 1, true),
        check(0x12_0000 - 8, 3, 2, true),
        pre,
        check(0x1C_0000, 4, 5, false),
    ];
    let guest = TestGuest {
        checks: checks.clone(),
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
        ctl.pause();
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

fn uffd_or_skip(test: &str) -> bool {
    match Uffd::new() {
        Ok(_) => true,
        Err(e) => {
            println!("SKIPPED: {test}: userfaultfd unavailable ({})", chain(&e));
            false
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
    // The image: 2 MiB (32 clusters of 64 KiB). Clusters 1..=3 hold data
    // in the snapshot "s"; cluster 4 is written after it (writable layer,
    // mapped shared); everything else is a hole.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pmem.pcow");
    let host_data = check(K64, 3 * K64 / 8, 1000, false);
    let after_snap = check(4 * K64, K64 / 8, 2000, false);
    {
        let mut img = Image::create(
            &path,
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
    let mut model = read_image(&path);

    let ctl = VcpuControl::new().unwrap();
    let (region, monitor) = PcowRegion::open(&path, ctl.clone(), &RegionOptions::default())
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
    let guest = TestGuest {
        checks: checks.iter().map(|&c| at(c)).collect(),
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
