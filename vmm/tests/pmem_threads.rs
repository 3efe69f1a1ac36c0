//! The pmem queue threads without KVM: virtio-pmem functions on a PCI bus,
//! driven from the host as a driver would, each queue served by its own
//! `pmemN-queue` thread ([`vmm::pmem_threads::QueueThread`]).
//!
//! - A FLUSH that blocks in its barrier (a sync that does not return) on
//!   one device never delays a FLUSH on another device.
//! - A FLUSH that finds the file system full stays unanswered in its
//!   queue, and the thread wakes the VMM thread through the alert eventfd
//!   (which then pauses the guest).
//! - Dropping the thread stops it, also with a notification pending.

use std::os::fd::RawFd;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use virtio_pmem_pcow::{FlushBackend, FlushError, PmemDevice};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::pci::{InterruptSink, Mmio64Window, PciBus, PmemVirtio, VirtioPciDevice, ECAM_BASE};
use vmm::pmem_threads::{DeviceAlerts, QueueThread};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MEM: u64 = 0x10_0000;
const PMEM_START: u64 = 0x1_0000_0000;
const PMEM_SIZE: u64 = 0x20_0000;
const QSIZE: u16 = 16;
const DEADLINE: Duration = Duration::from_secs(10);

struct NoIrq;

impl InterruptSink for NoIrq {
    fn trigger(&self, _vector: u16) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a test's backend does at a FLUSH.
#[derive(Clone)]
enum Backend {
    /// Answers at once.
    Quick(Arc<Mutex<u32>>),
    /// Waits until the test says go (a sync stuck on a slow disk).
    Blocked(Arc<Mutex<mpsc::Receiver<()>>>),
    /// The file system is full.
    Full,
}

impl FlushBackend for Backend {
    fn flush(&mut self) -> Result<(), FlushError> {
        match self {
            Backend::Quick(n) => {
                *n.lock().unwrap() += 1;
                Ok(())
            }
            Backend::Blocked(rx) => {
                rx.lock().unwrap().recv().unwrap();
                Ok(())
            }
            Backend::Full => Err(FlushError::NoSpace(Box::new(
                std::io::Error::from_raw_os_error(libc::ENOSPC),
            ))),
        }
    }
}

/// One activated device at PCI slot `slot`, its queue rings in its own
/// part of guest memory.
struct Dev {
    dev: Arc<Mutex<VirtioPciDevice>>,
    base: u64,
    notify: EventFd,
}

impl Dev {
    fn desc(&self) -> u64 {
        self.base
    }
    fn avail(&self) -> u64 {
        self.base + 0x1000
    }
    fn used(&self) -> u64 {
        self.base + 0x2000
    }
    fn req(&self) -> u64 {
        self.base + 0x3000
    }
    fn resp(&self) -> u64 {
        self.base + 0x3100
    }
}

fn add(bus: &mut PciBus, mem: &GuestMemoryMmap, backend: Backend, index: u64) -> Dev {
    let pmem = PmemVirtio::new(PmemDevice::new(PMEM_START, PMEM_SIZE, backend));
    let dev = VirtioPciDevice::new(Box::new(pmem), mem.clone(), Arc::new(NoIrq)).unwrap();
    let dev = Arc::new(Mutex::new(dev));
    let addr = bus.add_device(dev.clone()).unwrap();
    let bar = bus.window().base + 0x10_0000 * (index + 1);
    let mut w = |a: u64, bytes: &[u8]| assert!(bus.mmio_write(a, bytes), "{a:#x}");
    let ecam = ECAM_BASE + (u64::from(addr.device) << 15);
    w(ecam + 0x10, &((bar & 0xffff_ffff) as u32).to_le_bytes());
    w(ecam + 0x14, &((bar >> 32) as u32).to_le_bytes());
    w(ecam + 0x04, &0x0006u16.to_le_bytes());
    let d = Dev {
        dev,
        base: 0x1_0000 + index * 0x1_0000,
        notify: EventFd::new(EFD_NONBLOCK).unwrap(),
    };
    for s in [0u8, 1, 3] {
        w(bar + 0x14, &[s]);
    }
    w(bar + 0x08, &0u32.to_le_bytes());
    w(bar + 0x0c, &0u32.to_le_bytes());
    w(bar + 0x08, &1u32.to_le_bytes());
    w(bar + 0x0c, &1u32.to_le_bytes());
    w(bar + 0x14, &[1 | 2 | 8]);
    w(bar + 0x16, &0u16.to_le_bytes());
    w(bar + 0x18, &QSIZE.to_le_bytes());
    w(bar + 0x20, &d.desc().to_le_bytes());
    w(bar + 0x28, &d.avail().to_le_bytes());
    w(bar + 0x30, &d.used().to_le_bytes());
    w(bar + 0x1c, &1u16.to_le_bytes());
    w(bar + 0x14, &[1 | 2 | 8 | 4]);
    // One FLUSH chain: the request (type 0), then the status word.
    mem.write_obj(0u32, GuestAddress(d.req())).unwrap();
    for (i, (a, len, flags, next)) in [(d.req(), 4u32, 1u16, 1u16), (d.resp(), 4, 2, 0)]
        .into_iter()
        .enumerate()
    {
        let at = d.desc() + 16 * i as u64;
        mem.write_obj(a, GuestAddress(at)).unwrap();
        mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        mem.write_obj(next, GuestAddress(at + 14)).unwrap();
    }
    d
}

/// Publishes FLUSH number `n` of `d` and notifies its queue thread.
fn publish(mem: &GuestMemoryMmap, d: &Dev, n: u16) {
    mem.write_obj(0xdead_beefu32, GuestAddress(d.resp()))
        .unwrap();
    let slot = u64::from((n - 1) % QSIZE);
    mem.write_obj(0u16, GuestAddress(d.avail() + 4 + 2 * slot))
        .unwrap();
    mem.write_obj(n, GuestAddress(d.avail() + 2)).unwrap();
    d.notify.write(1).unwrap();
}

fn used(mem: &GuestMemoryMmap, d: &Dev) -> u16 {
    mem.read_obj(GuestAddress(d.used() + 2)).unwrap()
}

fn wait_used(mem: &GuestMemoryMmap, d: &Dev, n: u16) -> Duration {
    let start = Instant::now();
    while used(mem, d) != n {
        assert!(start.elapsed() < DEADLINE, "FLUSH {n}: no answer");
        std::thread::sleep(Duration::from_millis(1));
    }
    start.elapsed()
}

fn readable(fd: RawFd, limit: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is a valid pollfd for the call.
    unsafe { libc::poll(&mut p, 1, limit.as_millis() as i32) > 0 }
}

fn setup() -> (GuestMemoryMmap, PciBus) {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    let bus = PciBus::new(Mmio64Window::above(PMEM_START + PMEM_SIZE));
    (mem, bus)
}

fn spawn(name: &str, d: &Dev, alerts: &Arc<DeviceAlerts>) -> QueueThread {
    QueueThread::spawn(
        name,
        d.dev.clone(),
        vec![d.notify.try_clone().unwrap()],
        alerts.clone(),
    )
    .unwrap()
}

#[test]
fn a_flush_blocked_on_one_device_never_delays_another_devices_flush() {
    let (mem, mut bus) = setup();
    let (go, wait) = mpsc::channel();
    let slow = add(
        &mut bus,
        &mem,
        Backend::Blocked(Arc::new(Mutex::new(wait))),
        0,
    );
    let flushes = Arc::new(Mutex::new(0));
    let quick = add(&mut bus, &mem, Backend::Quick(flushes.clone()), 1);
    let alerts = Arc::new(DeviceAlerts::new().unwrap());
    let t0 = spawn("pmem0-queue", &slow, &alerts);
    let t1 = spawn("pmem1-queue", &quick, &alerts);

    publish(&mem, &slow, 1);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(used(&mem, &slow), 0, "the blocked FLUSH was answered");
    // Device 1's FLUSHes complete while device 0's barrier is stuck.
    for n in 1..=3 {
        publish(&mem, &quick, n);
        let took = wait_used(&mem, &quick, n);
        assert!(took < Duration::from_secs(1), "FLUSH {n} took {took:?}");
        let resp: u32 = mem.read_obj(GuestAddress(quick.resp())).unwrap();
        assert_eq!(resp, 0, "answered OK");
    }
    assert_eq!(*flushes.lock().unwrap(), 3);
    assert_eq!(used(&mem, &slow), 0, "device 0 is still in its barrier");
    // Its sync returns: its FLUSH is answered too.
    go.send(()).unwrap();
    wait_used(&mem, &slow, 1);
    let resp: u32 = mem.read_obj(GuestAddress(slow.resp())).unwrap();
    assert_eq!(resp, 0);
    assert!(
        !readable(alerts.fd(), Duration::ZERO),
        "nothing to tell the VMM"
    );
    drop(t0);
    drop(t1);
}

#[test]
fn a_flush_that_finds_the_disk_full_waits_and_wakes_the_vmm_thread() {
    let (mem, mut bus) = setup();
    let full = add(&mut bus, &mem, Backend::Full, 0);
    let alerts = Arc::new(DeviceAlerts::new().unwrap());
    let t = spawn("pmem0-queue", &full, &alerts);
    assert!(!readable(alerts.fd(), Duration::ZERO));
    publish(&mem, &full, 1);
    assert!(
        readable(alerts.fd(), DEADLINE),
        "the VMM thread was not woken"
    );
    // The VMM thread's side: no monitor failure, the device waits.
    assert!(alerts.take().is_none());
    assert!(!readable(alerts.fd(), Duration::ZERO), "the alert was read");
    let why = full.dev.lock().unwrap().stalled();
    assert!(
        why.as_deref()
            .is_some_and(|w| w.contains("No space left on device")),
        "{why:?}"
    );
    assert_eq!(used(&mem, &full), 0, "the FLUSH waits, unanswered");
    // A notification while stalled serves nothing and wakes it again.
    full.notify.write(1).unwrap();
    assert!(readable(alerts.fd(), DEADLINE));
    assert_eq!(used(&mem, &full), 0);
    // Stopping the thread with a notification pending.
    full.notify.write(1).unwrap();
    let start = Instant::now();
    drop(t);
    assert!(start.elapsed() < Duration::from_secs(1));
}
