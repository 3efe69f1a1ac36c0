//! The PCI bus and a virtio-pmem virtio-pci function, driven the way
//! firmware and the Linux virtio-pci driver drive them: enumeration through
//! 0xcf8/0xcfc, BAR sizing and programming, the capability walk, feature
//! negotiation, queue setup, a FLUSH through a split queue in guest
//! memory, MSI-X delivery and masking; then malformed accesses.

use std::sync::{Arc, Mutex};

use virtio_pmem_pcow::{FlushBackend, FlushError, PmemDevice};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::pci::bus::{CONFIG_ADDRESS_PORT, CONFIG_DATA_PORT};
use vmm::pci::virtio_pci::{NOTIFY_OFFSET, NO_VECTOR};
use vmm::pci::{
    BarMove, InterruptSink, Mmio64Window, MsixEntry, PciBus, PciConfigIo, PmemVirtio,
    VirtioPciDevice, ECAM_BASE,
};
use vmm::PortIo;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MEM: u64 = 0x100_0000;
const PMEM_START: u64 = 0x1_0000_0000;
const PMEM_SIZE: u64 = 0x20_0000;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;
const REQ: u64 = 0x10_0000;
const RESP: u64 = 0x20_0000;
const QSIZE: u16 = 16;

// Common configuration offsets (virtio 1.2, 4.1.4.3).
const DFSEL: u64 = 0x00;
const DF: u64 = 0x04;
const GFSEL: u64 = 0x08;
const GF: u64 = 0x0c;
const MSIX_CONFIG: u64 = 0x10;
const NUM_QUEUES: u64 = 0x12;
const STATUS: u64 = 0x14;
const Q_SELECT: u64 = 0x16;
const Q_SIZE: u64 = 0x18;
const Q_MSIX: u64 = 0x1a;
const Q_ENABLE: u64 = 0x1c;
const Q_NOTIFY_OFF: u64 = 0x1e;
const Q_DESC: u64 = 0x20;
const Q_DRIVER: u64 = 0x28;
const Q_DEVICE: u64 = 0x30;

const ACK: u8 = 1;
const DRIVER: u8 = 2;
const DRIVER_OK: u8 = 4;
const FEATURES_OK: u8 = 8;
const NEEDS_RESET: u8 = 64;

#[derive(Default)]
struct Sink {
    fired: Mutex<Vec<u16>>,
    programmed: Mutex<Vec<(u16, MsixEntry)>>,
}

impl InterruptSink for Sink {
    fn trigger(&self, vector: u16) -> std::io::Result<()> {
        self.fired.lock().unwrap().push(vector);
        Ok(())
    }
    fn program(&self, vector: u16, entry: MsixEntry) {
        self.programmed.lock().unwrap().push((vector, entry));
    }
}

impl Sink {
    fn take(&self) -> Vec<u16> {
        std::mem::take(&mut *self.fired.lock().unwrap())
    }
}

#[derive(Clone, Default)]
struct Backend(Arc<Mutex<u32>>);

impl FlushBackend for Backend {
    fn flush(&mut self) -> Result<(), FlushError> {
        *self.0.lock().unwrap() += 1;
        Ok(())
    }
}

/// The machine as a guest sees it, plus handles for the checks.
struct Machine {
    mem: GuestMemoryMmap,
    bus: Arc<Mutex<PciBus>>,
    io: PciConfigIo,
    dev: Arc<Mutex<VirtioPciDevice>>,
    sink: Arc<Sink>,
    flushes: Arc<Mutex<u32>>,
    moves: Arc<Mutex<Vec<BarMove>>>,
}

impl Machine {
    fn new() -> Machine {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
        let backend = Backend::default();
        let flushes = backend.0.clone();
        let pmem = PmemVirtio::new(PmemDevice::new(PMEM_START, PMEM_SIZE, backend));
        let sink = Arc::new(Sink::default());
        let dev = VirtioPciDevice::new(Box::new(pmem), mem.clone(), sink.clone()).unwrap();
        let dev = Arc::new(Mutex::new(dev));
        let mut bus = PciBus::new(Mmio64Window::above(PMEM_START + PMEM_SIZE));
        let moves = Arc::new(Mutex::new(Vec::new()));
        let m = moves.clone();
        bus.set_bar_hook(move |mv| m.lock().unwrap().push(mv));
        let addr = bus.add_device(dev.clone()).unwrap();
        assert_eq!(addr.to_string(), "0000:00:01.0");
        let bus = Arc::new(Mutex::new(bus));
        Machine {
            mem,
            io: PciConfigIo::new(bus.clone()),
            bus,
            dev,
            sink,
            flushes,
            moves,
        }
    }

    fn select(&mut self, dev: u8, off: u8) {
        let a = 0x8000_0000u32 | (u32::from(dev) << 11) | u32::from(off & 0xfc);
        self.io.io_out(CONFIG_ADDRESS_PORT, &a.to_le_bytes());
    }

    fn cfg_read(&mut self, dev: u8, off: u8, len: usize) -> u32 {
        self.select(dev, off);
        let mut b = [0u8; 4];
        self.io
            .io_in(CONFIG_DATA_PORT + u16::from(off & 3), &mut b[..len]);
        u32::from_le_bytes(b)
    }

    fn cfg_write(&mut self, dev: u8, off: u8, len: usize, v: u32) {
        self.select(dev, off);
        self.io.io_out(
            CONFIG_DATA_PORT + u16::from(off & 3),
            &v.to_le_bytes()[..len],
        );
    }

    fn read(&self, addr: u64, len: usize) -> u64 {
        let mut b = [0u8; 8];
        assert!(self.bus.lock().unwrap().mmio_read(addr, &mut b[..len]));
        u64::from_le_bytes(b)
    }

    fn write(&self, addr: u64, len: usize, v: u64) {
        assert!(self
            .bus
            .lock()
            .unwrap()
            .mmio_write(addr, &v.to_le_bytes()[..len]));
    }
}

/// A capability found by the walk.
#[derive(Debug)]
struct Cap {
    at: u8,
    id: u8,
    cfg_type: u8,
    bar: u8,
    offset: u32,
    length: u32,
}

fn walk_caps(m: &mut Machine, dev: u8) -> Vec<Cap> {
    assert_ne!(
        m.cfg_read(dev, 0x06, 2) & (1 << 4),
        0,
        "capability list bit"
    );
    let mut caps = Vec::new();
    let mut at = m.cfg_read(dev, 0x34, 1) as u8 & 0xfc;
    while at != 0 {
        assert!(caps.len() < 48, "capability loop");
        let id = m.cfg_read(dev, at, 1) as u8;
        let next = m.cfg_read(dev, at + 1, 1) as u8;
        let cap = Cap {
            at,
            id,
            cfg_type: m.cfg_read(dev, at + 3, 1) as u8,
            bar: m.cfg_read(dev, at + 4, 1) as u8,
            offset: m.cfg_read(dev, at + 8, 4),
            length: m.cfg_read(dev, at + 12, 4),
        };
        caps.push(cap);
        at = next & 0xfc;
    }
    caps
}

/// Enumerates, sizes and programs BAR 0 at `base`, enables memory and bus
/// mastering; returns the capabilities.
fn enumerate(m: &mut Machine, base: u64) -> Vec<Cap> {
    let mut found = Vec::new();
    for dev in 0..32u8 {
        let id = m.cfg_read(dev, 0, 4);
        if id & 0xffff != 0xffff {
            found.push((dev, id, m.cfg_read(dev, 0x08, 4)));
        }
    }
    assert_eq!(
        found,
        [(0, 0x0008_1b36, 0x0600_0000), (1, 0x105b_1af4, 0xff00_0001)]
    );
    assert_eq!(m.cfg_read(0, 0x0e, 1), 0);
    assert_eq!(m.cfg_read(1, 0x2c, 4), 0x0040_1af4, "subsystem ids");
    assert_eq!(m.cfg_read(1, 0x3d, 1), 0, "no INTx pin");

    // BAR 0 is pre-assigned in the window; size it as firmware does.
    let window = m.bus.lock().unwrap().window();
    let lo = m.cfg_read(1, 0x10, 4);
    let hi = m.cfg_read(1, 0x14, 4);
    assert_eq!(lo & 0xf, 0b0100, "64-bit, non-prefetchable memory BAR");
    let pre = (u64::from(hi) << 32) | u64::from(lo & !0xf);
    assert!(pre >= window.base && pre < window.end(), "{pre:#x}");
    assert!(
        pre >= PMEM_START + PMEM_SIZE,
        "above the pmem region and 4 GiB"
    );
    m.cfg_write(1, 0x10, 4, 0xffff_ffff);
    m.cfg_write(1, 0x14, 4, 0xffff_ffff);
    let mask = (u64::from(m.cfg_read(1, 0x14, 4)) << 32) | u64::from(m.cfg_read(1, 0x10, 4) & !0xf);
    assert_eq!(!mask + 1, 0x8000, "BAR size");
    for bar in 1..6u8 {
        if bar != 1 {
            m.cfg_write(1, 0x10 + 4 * bar, 4, 0xffff_ffff);
            assert_eq!(
                m.cfg_read(1, 0x10 + 4 * bar, 4),
                0,
                "BAR {bar} unimplemented"
            );
        }
    }
    m.cfg_write(1, 0x10, 4, base as u32);
    m.cfg_write(1, 0x14, 4, (base >> 32) as u32);
    assert!(m.moves.lock().unwrap().is_empty(), "no decoding yet");
    let mut probe = [0u8; 4];
    assert!(!m.bus.lock().unwrap().mmio_read(base, &mut probe));
    m.cfg_write(1, 0x04, 2, 0x0006);
    assert_eq!(m.cfg_read(1, 0x04, 2), 0x0006);
    let moves = m.moves.lock().unwrap().clone();
    assert_eq!(moves.len(), 1);
    assert_eq!(
        (moves[0].bar, moves[0].old, moves[0].new),
        (0, None, Some(base))
    );
    let notify: Vec<_> = m.dev.lock().unwrap().notify_addresses();
    assert_eq!(notify, [(base + NOTIFY_OFFSET, 0)]);

    // The same header through ECAM.
    let mut id = [0u8; 4];
    assert!(m
        .bus
        .lock()
        .unwrap()
        .mmio_read(ECAM_BASE + (1 << 15), &mut id));
    assert_eq!(u32::from_le_bytes(id), 0x105b_1af4);

    walk_caps(m, 1)
}

/// Offsets of the structures the vendor capabilities name.
struct Layout {
    common: u64,
    isr: u64,
    device: u64,
    notify: u64,
    multiplier: u32,
    msix_cap: u8,
    table: u64,
    pba: u64,
}

fn layout(m: &mut Machine, caps: &[Cap], base: u64) -> Layout {
    let vendor = |t: u8| {
        caps.iter()
            .find(|c| c.id == 0x09 && c.cfg_type == t)
            .unwrap_or_else(|| panic!("no virtio capability of type {t}"))
    };
    for t in 1..=5 {
        let c = vendor(t);
        assert_eq!(c.bar, 0, "type {t}");
    }
    assert!(vendor(1).length >= 0x38);
    assert!(vendor(3).length >= 1);
    assert_eq!(vendor(4).length, 16);
    let notify = vendor(2);
    let multiplier = m.cfg_read(1, notify.at + 16, 4);
    assert_eq!(m.cfg_read(1, notify.at + 2, 1), 20, "notify cap_len");
    let msix = caps
        .iter()
        .find(|c| c.id == 0x11)
        .expect("MSI-X capability");
    let control = m.cfg_read(1, msix.at + 2, 2);
    assert_eq!(control & 0x7ff, 1, "two vectors: queue 0 and config");
    let table = m.cfg_read(1, msix.at + 4, 4);
    let pba = m.cfg_read(1, msix.at + 8, 4);
    assert_eq!((table & 7, pba & 7), (0, 0), "both in BAR 0");
    Layout {
        common: base + u64::from(vendor(1).offset),
        isr: base + u64::from(vendor(3).offset),
        device: base + u64::from(vendor(4).offset),
        notify: base + u64::from(notify.offset),
        multiplier,
        msix_cap: msix.at,
        table: base + u64::from(table & !7),
        pba: base + u64::from(pba & !7),
    }
}

/// Lays out descriptors `2 * slot`, `2 * slot + 1` as a FLUSH request and
/// publishes the chain as avail entry `slot`.
fn post_flush(mem: &GuestMemoryMmap, slot: u16) {
    let head = 2 * slot;
    let req = REQ + 0x100 * u64::from(slot);
    let resp = RESP + 0x100 * u64::from(slot);
    mem.write_obj(0u32, GuestAddress(req)).unwrap(); // type 0: FLUSH
    mem.write_obj(0xdead_beefu32, GuestAddress(resp)).unwrap();
    let desc = |i: u16, addr: u64, len: u32, flags: u16, next: u16| {
        let at = DESC + 16 * u64::from(i);
        mem.write_obj(addr, GuestAddress(at)).unwrap();
        mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        mem.write_obj(next, GuestAddress(at + 14)).unwrap();
    };
    desc(head, req, 4, 1, head + 1); // NEXT
    desc(head + 1, resp, 4, 2, 0); // WRITE
    mem.write_obj(head, GuestAddress(AVAIL + 4 + 2 * u64::from(slot % QSIZE)))
        .unwrap();
    mem.write_obj(slot + 1, GuestAddress(AVAIL + 2)).unwrap();
}

fn used(mem: &GuestMemoryMmap) -> (u16, Vec<(u32, u32)>) {
    let idx: u16 = mem.read_obj(GuestAddress(USED + 2)).unwrap();
    let elems = (0..u64::from(idx))
        .map(|i| {
            let at = USED + 4 + 8 * i;
            (
                mem.read_obj(GuestAddress(at)).unwrap(),
                mem.read_obj(GuestAddress(at + 4)).unwrap(),
            )
        })
        .collect();
    (idx, elems)
}

fn response(mem: &GuestMemoryMmap, slot: u16) -> u32 {
    mem.read_obj(GuestAddress(RESP + 0x100 * u64::from(slot)))
        .unwrap()
}

/// The Linux driver's probe up to DRIVER_OK, queue 0 on vector 1, config
/// on vector 0, MSI-X enabled and both entries unmasked.
fn probe(m: &mut Machine, l: &Layout) {
    let c = l.common;
    m.write(c + STATUS, 1, 0);
    assert_eq!(m.read(c + STATUS, 1), 0);
    m.write(c + STATUS, 1, u64::from(ACK));
    m.write(c + STATUS, 1, u64::from(ACK | DRIVER));
    m.write(c + DFSEL, 4, 0);
    let lo = m.read(c + DF, 4);
    m.write(c + DFSEL, 4, 1);
    let hi = m.read(c + DF, 4);
    let features = (hi << 32) | lo;
    assert_ne!(features & (1 << 32), 0, "VERSION_1 offered");
    m.write(c + GFSEL, 4, 0);
    m.write(c + GF, 4, features & 0xffff_ffff);
    m.write(c + GFSEL, 4, 1);
    m.write(c + GF, 4, features >> 32);
    m.write(c + STATUS, 1, u64::from(ACK | DRIVER | FEATURES_OK));
    assert_eq!(m.read(c + STATUS, 1), u64::from(ACK | DRIVER | FEATURES_OK));

    // MSI-X: enable with the function masked, program, unmask (as Linux).
    m.cfg_write(1, l.msix_cap + 2, 2, 0xc000);
    for v in 0..2u64 {
        let e = l.table + 16 * v;
        m.write(e, 4, 0xfee0_0000);
        m.write(e + 4, 4, 0);
        m.write(e + 8, 4, 0x4040 + v);
        m.write(e + 12, 4, 0);
    }
    m.cfg_write(1, l.msix_cap + 2, 2, 0x8000);
    let programmed = m.sink.programmed.lock().unwrap().clone();
    assert!(programmed.contains(&(
        1,
        MsixEntry {
            addr: 0xfee0_0000,
            data: 0x4041,
            masked: false
        }
    )));
    m.write(c + MSIX_CONFIG, 2, 0);
    assert_eq!(m.read(c + MSIX_CONFIG, 2), 0);

    assert_eq!(m.read(c + NUM_QUEUES, 2), 1);
    m.write(c + Q_SELECT, 2, 0);
    assert_eq!(m.read(c + Q_SIZE, 2), 256);
    m.write(c + Q_SIZE, 2, u64::from(QSIZE));
    assert_eq!(m.read(c + Q_SIZE, 2), u64::from(QSIZE));
    m.write(c + Q_MSIX, 2, 1);
    assert_eq!(m.read(c + Q_MSIX, 2), 1);
    assert_eq!(m.read(c + Q_NOTIFY_OFF, 2), 0);
    // 64-bit fields as two 32-bit halves (vp_iowrite64_twopart)
    for (reg, addr) in [(Q_DESC, DESC), (Q_DRIVER, AVAIL), (Q_DEVICE, USED)] {
        m.write(c + reg, 4, addr & 0xffff_ffff);
        m.write(c + reg + 4, 4, addr >> 32);
        assert_eq!(m.read(c + reg, 4), addr);
    }
    m.write(c + Q_ENABLE, 2, 1);
    assert_eq!(m.read(c + Q_ENABLE, 2), 1);
    m.write(
        c + STATUS,
        1,
        u64::from(ACK | DRIVER | FEATURES_OK | DRIVER_OK),
    );
    assert_eq!(
        m.read(c + STATUS, 1),
        u64::from(ACK | DRIVER | FEATURES_OK | DRIVER_OK)
    );
    assert!(m.dev.lock().unwrap().is_active());
}

#[test]
fn enumerate_probe_and_flush_like_linux() {
    let mut m = Machine::new();
    let window = m.bus.lock().unwrap().window();
    let base = window.base + 0x10_0000;
    let caps = enumerate(&mut m, base);
    let l = layout(&mut m, &caps, base);
    assert_eq!(l.multiplier, 4);
    probe(&mut m, &l);

    // Device config: start and size, read in 32-bit halves.
    let rd64 =
        |m: &Machine, off: u64| m.read(l.device + off, 4) | (m.read(l.device + off + 4, 4) << 32);
    assert_eq!(rd64(&m, 0), PMEM_START);
    assert_eq!(rd64(&m, 8), PMEM_SIZE);

    // FLUSH, notified through the BAR (the MMIO exit path).
    post_flush(&m.mem, 0);
    m.write(l.notify, 2, 0);
    assert_eq!(response(&m.mem, 0), 0);
    assert_eq!(used(&m.mem), (1, vec![(0, 4)]));
    assert_eq!(*m.flushes.lock().unwrap(), 1);
    assert_eq!(m.sink.take(), [1]);
    assert_eq!(m.read(l.isr, 1), 1, "ISR queue bit");
    assert_eq!(m.read(l.isr, 1), 0, "ISR cleared by the read");

    // The ioeventfd path, with entry 1 masked: pending, then delivered on
    // unmask.
    m.write(l.table + 16 + 12, 4, 1);
    post_flush(&m.mem, 1);
    m.dev.lock().unwrap().notify(0);
    assert_eq!(response(&m.mem, 1), 0);
    assert_eq!(used(&m.mem).0, 2);
    assert!(m.sink.take().is_empty());
    assert_eq!(m.read(l.pba, 8), 0b10);
    m.write(l.table + 16 + 12, 4, 0);
    assert_eq!(m.sink.take(), [1]);
    assert_eq!(m.read(l.pba, 8), 0);

    // Function mask holds it too.
    let ctrl = u32::from(l.msix_cap) + 2;
    m.cfg_write(1, ctrl as u8, 2, 0xc000);
    post_flush(&m.mem, 2);
    m.dev.lock().unwrap().notify_queue(0);
    assert!(m.sink.take().is_empty());
    m.cfg_write(1, ctrl as u8, 2, 0x8000);
    assert_eq!(m.sink.take(), [1]);
    assert_eq!(*m.flushes.lock().unwrap(), 3);

    // The PCI-cfg access capability reaches the same registers.
    let pcicfg = caps.iter().find(|c| c.id == 9 && c.cfg_type == 5).unwrap();
    m.cfg_write(1, pcicfg.at + 4, 1, 0);
    m.cfg_write(1, pcicfg.at + 8, 4, 0x12); // num_queues
    m.cfg_write(1, pcicfg.at + 12, 4, 2);
    assert_eq!(m.cfg_read(1, pcicfg.at + 16, 4) & 0xffff, 1);

    // Reset: inactive, queue registers back to defaults.
    m.write(l.common + STATUS, 1, 0);
    assert_eq!(m.read(l.common + STATUS, 1), 0);
    assert!(!m.dev.lock().unwrap().is_active());
    assert_eq!(m.read(l.common + Q_SIZE, 2), 256);
    assert_eq!(m.read(l.common + Q_MSIX, 2), u64::from(NO_VECTOR));
    post_flush(&m.mem, 3);
    m.write(l.notify, 2, 0);
    assert_eq!(*m.flushes.lock().unwrap(), 3, "no service after reset");

    // Memory decoding off: the BAR no longer answers, the hook saw it.
    m.cfg_write(1, 0x04, 2, 0);
    let mut b = [0u8; 4];
    assert!(!m.bus.lock().unwrap().mmio_read(l.common, &mut b));
    let last = *m.moves.lock().unwrap().last().unwrap();
    assert_eq!((last.old, last.new), (Some(base), None));
}

/// A function whose queue has its own thread (a VMM's pmem queue): a
/// notification written to the BAR, as a vCPU's MMIO exit delivers it when
/// no ioeventfd is registered, kicks that thread's eventfd and is not
/// served on the writer's thread; the thread then serves it.
#[test]
fn a_notification_written_to_the_bar_kicks_the_queues_own_thread() {
    let mut m = Machine::new();
    let kick = EventFd::new(EFD_NONBLOCK).unwrap();
    m.dev
        .lock()
        .unwrap()
        .set_queue_kicks(vec![kick.try_clone().unwrap()]);
    let base = m.bus.lock().unwrap().window().base + 0x10_0000;
    let caps = enumerate(&mut m, base);
    let l = layout(&mut m, &caps, base);
    probe(&mut m, &l);

    post_flush(&m.mem, 0);
    m.write(l.notify, 2, 0);
    assert_eq!(*m.flushes.lock().unwrap(), 0, "served on the vCPU's thread");
    assert_eq!(kick.read().unwrap(), 1, "the queue's thread was not kicked");
    // The queue's thread, woken, serves it.
    m.dev.lock().unwrap().notify(0);
    assert_eq!(*m.flushes.lock().unwrap(), 1);
    assert_eq!(response(&m.mem, 0), 0);
    assert_eq!(used(&m.mem), (1, vec![(0, 4)]));

    // An unaligned write inside the notify region is no kick.
    m.write(l.notify + 2, 2, 0);
    assert!(kick.read().is_err(), "an unaligned write kicked the queue");
    assert_eq!(*m.flushes.lock().unwrap(), 1);
}

#[test]
fn malformed_accesses_are_refused_without_panicking() {
    let mut m = Machine::new();
    let base = m.bus.lock().unwrap().window().base;
    let caps = enumerate(&mut m, base);
    let l = layout(&mut m, &caps, base);
    let c = l.common;

    // Read-only config space registers.
    m.cfg_write(1, 0x00, 4, 0);
    m.cfg_write(1, 0x08, 4, 0);
    m.cfg_write(1, 0x2c, 4, 0);
    assert_eq!(m.cfg_read(1, 0, 4), 0x105b_1af4);
    assert_eq!(m.cfg_read(1, 0x08, 4), 0xff00_0001);
    assert_eq!(m.cfg_read(1, 0x2c, 4), 0x0040_1af4);
    m.cfg_write(1, caps[0].at + 8, 4, 0x1234);
    assert_eq!(m.cfg_read(1, caps[0].at + 8, 4), caps[0].offset);
    m.cfg_write(1, l.msix_cap + 2, 2, 0x07ff);
    assert_eq!(
        m.cfg_read(1, l.msix_cap + 2, 2),
        1,
        "table size is read-only"
    );

    // Read-only common registers.
    m.write(c + NUM_QUEUES, 2, 7);
    assert_eq!(m.read(c + NUM_QUEUES, 2), 1);
    m.write(c + DF, 4, 0);
    m.write(c + DFSEL, 4, 1);
    assert_eq!(m.read(c + DF, 4), 1, "VERSION_1 still offered");
    m.write(c + DFSEL, 4, 7);
    assert_eq!(m.read(c + DF, 4), 0, "no features past the second window");
    m.write(c + Q_NOTIFY_OFF, 2, 9);
    assert_eq!(m.read(c + Q_NOTIFY_OFF, 2), 0);

    // Out-of-range and odd-width accesses.
    for off in [0x38u64, 0x7ffc, 0x6000, 0x1004, 0x3004] {
        m.write(base + off, 4, u64::MAX);
        assert_eq!(m.read(base + off, 4), 0, "{off:#x}");
    }
    m.write(c + Q_SELECT, 1, 3);
    assert_eq!(m.read(c + Q_SELECT, 2), 0, "1-byte write to a u16 dropped");
    m.write(l.table + 2, 2, 0xffff);
    m.write(l.pba, 8, u64::MAX);
    assert_eq!(m.read(l.pba, 8), 0, "PBA is read-only");
    let mut past = [0u8; 8];
    assert!(
        !m.bus.lock().unwrap().mmio_read(base + 0x7ffc, &mut past),
        "crosses the BAR end"
    );
    m.notify_edge_cases();

    // queue_select beyond num_queues: size 0, writes go nowhere.
    m.write(c + Q_SELECT, 2, 5);
    assert_eq!(m.read(c + Q_SIZE, 2), 0);
    assert_eq!(m.read(c + Q_MSIX, 2), u64::from(NO_VECTOR));
    m.write(c + Q_SIZE, 2, 8);
    m.write(c + Q_ENABLE, 2, 1);
    m.write(c + Q_DESC, 4, 0x1000);
    assert_eq!(m.read(c + Q_DESC, 4), 0);
    m.write(c + Q_SELECT, 2, 0);
    assert_eq!(m.read(c + Q_SIZE, 2), 256);
    assert_eq!(m.read(c + Q_ENABLE, 2), 0);
    // invalid queue sizes and vectors
    m.write(c + Q_SIZE, 2, 300);
    m.write(c + Q_SIZE, 2, 24);
    m.write(c + Q_SIZE, 2, 0);
    assert_eq!(m.read(c + Q_SIZE, 2), 256);
    m.write(c + Q_MSIX, 2, 2);
    assert_eq!(m.read(c + Q_MSIX, 2), u64::from(NO_VECTOR));
    m.write(c + MSIX_CONFIG, 2, 40);
    assert_eq!(m.read(c + MSIX_CONFIG, 2), u64::from(NO_VECTOR));

    // FEATURES_OK with an unsupported feature, then without VERSION_1.
    m.write(c + STATUS, 1, u64::from(ACK | DRIVER));
    m.write(c + GFSEL, 4, 0);
    m.write(c + GF, 4, 1 << 5);
    m.write(c + GFSEL, 4, 1);
    m.write(c + GF, 4, 1);
    m.write(c + STATUS, 1, u64::from(ACK | DRIVER | FEATURES_OK));
    assert_eq!(m.read(c + STATUS, 1), u64::from(ACK | DRIVER), "refused");
    m.write(c + GFSEL, 4, 0);
    m.write(c + GF, 4, 0);
    m.write(c + GFSEL, 4, 1);
    m.write(c + GF, 4, 0);
    m.write(c + STATUS, 1, u64::from(ACK | DRIVER | FEATURES_OK));
    assert_eq!(
        m.read(c + STATUS, 1),
        u64::from(ACK | DRIVER),
        "legacy refused"
    );
    // DRIVER_OK without FEATURES_OK
    m.write(c + STATUS, 1, u64::from(ACK | DRIVER | DRIVER_OK));
    assert_eq!(m.read(c + STATUS, 1), u64::from(ACK | DRIVER));
    assert!(!m.dev.lock().unwrap().is_active());
    // now accepted
    m.write(c + GF, 4, 1);
    m.write(c + STATUS, 1, u64::from(ACK | DRIVER | FEATURES_OK));
    assert_eq!(m.read(c + STATUS, 1), u64::from(ACK | DRIVER | FEATURES_OK));
    // features are frozen after FEATURES_OK
    m.write(c + GF, 4, 0);
    assert_eq!(m.read(c + GF, 4), 1);
    // clearing a bit without reset is ignored
    m.write(c + STATUS, 1, u64::from(ACK));
    assert_eq!(m.read(c + STATUS, 1), u64::from(ACK | DRIVER | FEATURES_OK));

    // A notify before DRIVER_OK does nothing.
    post_flush(&m.mem, 0);
    m.write(l.notify, 2, 0);
    assert_eq!(*m.flushes.lock().unwrap(), 0);

    // A queue outside guest memory: DRIVER_OK leads to NEEDS_RESET.
    m.write(c + Q_DESC, 8, MEM + 0x1000);
    m.write(c + Q_DRIVER, 8, AVAIL);
    m.write(c + Q_DEVICE, 8, USED);
    m.write(c + Q_ENABLE, 2, 1);
    m.write(
        c + STATUS,
        1,
        u64::from(ACK | DRIVER | FEATURES_OK | DRIVER_OK),
    );
    assert_ne!(m.read(c + STATUS, 1) as u8 & NEEDS_RESET, 0);
    assert!(!m.dev.lock().unwrap().is_active());
    m.write(l.notify, 2, 0);
    assert_eq!(*m.flushes.lock().unwrap(), 0);
    // and a reset recovers
    m.write(c + STATUS, 1, 0);
    assert_eq!(m.read(c + STATUS, 1), 0);
    probe(&mut m, &l);
    m.write(l.notify, 2, 0);
    assert_eq!(*m.flushes.lock().unwrap(), 1);
    assert_eq!(response(&m.mem, 0), 0);
    // queue registers are frozen after DRIVER_OK
    m.write(c + Q_SIZE, 2, 8);
    assert_eq!(m.read(c + Q_SIZE, 2), u64::from(QSIZE));
}

impl Machine {
    fn notify_edge_cases(&mut self) {
        let mut d = self.dev.lock().unwrap();
        d.notify(2); // unaligned
        d.notify(4); // queue 1 does not exist
        d.notify(u64::MAX);
        d.notify_queue(u16::MAX);
    }
}
