//! Device state round trips (issue 17 groundwork): each device is driven to
//! a non-trivial state through its register interface as a guest driver
//! would, captured, serialized to JSON and back, restored into a fresh
//! device built the same way, and must then go on as if nothing happened.
//! Then hostile states: each validation rule answers its error, nothing
//! panics and the fresh device is left untouched.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use virtio_pmem_pcow::{FlushBackend, FlushError, PmemDevice};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::legacy::power::{power_channel, PowerState};
use vmm::legacy::serial::{IrqTrigger, SerialDeviceState};
use vmm::legacy::{PowerDevice, SerialDevice, SerialOutput};
use vmm::pci::bus::{PciBusState, CONFIG_ADDRESS_PORT};
use vmm::pci::console::ConsoleInputState;
use vmm::pci::virtio_pci::{VirtioPciState, COMMON_OFFSET, ISR_OFFSET, NOTIFY_OFFSET};
use vmm::pci::{
    BarMove, ConsoleDevice, ConsoleInput, InterruptSink, Mmio64Window, MsixEntry, PciBus,
    PciDevice, PmemVirtio, VirtioPciDevice,
};
use vmm::snapshot::device_state::{
    DeviceState, DeviceStates, DeviceStatesError, StateError, POWER_ID,
};
use vmm::PortIo;

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
const STATUS: u64 = 0x14;
const Q_SELECT: u64 = 0x16;
const Q_SIZE: u64 = 0x18;
const Q_MSIX: u64 = 0x1a;
const Q_ENABLE: u64 = 0x1c;
const Q_DESC: u64 = 0x20;
const Q_DRIVER: u64 = 0x28;
const Q_DEVICE: u64 = 0x30;
const ALL_OK: u8 = 1 | 2 | 8 | 4; // ACK, DRIVER, FEATURES_OK, DRIVER_OK

#[derive(Default)]
struct Sink {
    fired: Mutex<Vec<u16>>,
    programmed: Mutex<Vec<(u16, MsixEntry)>>,
}

impl InterruptSink for Sink {
    fn trigger(&self, vector: u16) -> io::Result<()> {
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

/// A bus with one virtio-pmem function at 00:01.0, and guest RAM.
struct Bench {
    mem: GuestMemoryMmap,
    bus: PciBus,
    dev: Arc<Mutex<VirtioPciDevice>>,
    sink: Arc<Sink>,
    flushes: Arc<Mutex<u32>>,
    moves: Arc<Mutex<Vec<BarMove>>>,
    base: u64,
    msix_cap: usize,
}

impl Bench {
    fn new() -> Bench {
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
        bus.add_device(dev.clone()).unwrap();
        let base = bus.window().base;
        // The MSI-X capability, by walking the list.
        let mut msix_cap = 0;
        let mut at = usize::from(cfg8(&mut bus, 0x34));
        while at != 0 {
            if cfg8(&mut bus, at) == 0x11 {
                msix_cap = at;
            }
            at = usize::from(cfg8(&mut bus, at + 1));
        }
        assert_ne!(msix_cap, 0);
        Bench {
            mem,
            bus,
            dev,
            sink,
            flushes,
            moves,
            base,
            msix_cap,
        }
    }

    fn cfg_write(&mut self, off: usize, data: &[u8]) {
        self.bus.config_write(1, 0, off, data);
    }

    fn read(&mut self, off: u64, len: usize) -> u64 {
        let mut b = [0u8; 8];
        assert!(self.bus.mmio_read(self.base + off, &mut b[..len]));
        u64::from_le_bytes(b)
    }

    fn write(&mut self, off: u64, len: usize, v: u64) {
        assert!(self
            .bus
            .mmio_write(self.base + off, &v.to_le_bytes()[..len]));
    }

    fn table(&mut self, vector: u64, word: u64, v: u32) {
        self.write(0x4000 + 16 * vector + 4 * word, 4, u64::from(v));
    }

    /// The Linux driver's probe: memory decoding, features, MSI-X with
    /// the config vector 0 left masked and queue 0 on vector 1, the queue
    /// of QSIZE, DRIVER_OK.
    fn probe(&mut self) {
        self.cfg_write(0x04, &[0x06, 0x00]);
        let c = COMMON_OFFSET;
        self.write(c + STATUS, 1, 0);
        self.write(c + STATUS, 1, 1);
        self.write(c + STATUS, 1, 3);
        self.write(c + DFSEL, 4, 1);
        let hi = self.read(c + DF, 4);
        self.write(c + DFSEL, 4, 0);
        let lo = self.read(c + DF, 4);
        self.write(c + GFSEL, 4, 0);
        self.write(c + GF, 4, lo);
        self.write(c + GFSEL, 4, 1);
        self.write(c + GF, 4, hi);
        self.write(c + STATUS, 1, 11);
        let cap = self.msix_cap;
        self.cfg_write(cap + 2, &0xc000u16.to_le_bytes());
        for v in 0..2 {
            self.table(v, 0, 0xfee0_0000);
            self.table(v, 1, 0);
            self.table(v, 2, 0x4040 + v as u32);
        }
        self.table(1, 3, 0); // vector 1 unmasked; vector 0 stays masked
        self.cfg_write(cap + 2, &0x8000u16.to_le_bytes());
        self.write(c + MSIX_CONFIG, 2, 0);
        self.write(c + Q_SELECT, 2, 0);
        self.write(c + Q_SIZE, 2, u64::from(QSIZE));
        self.write(c + Q_MSIX, 2, 1);
        for (reg, addr) in [(Q_DESC, DESC), (Q_DRIVER, AVAIL), (Q_DEVICE, USED)] {
            self.write(c + reg, 8, addr);
        }
        self.write(c + Q_ENABLE, 2, 1);
        self.write(c + STATUS, 1, u64::from(ALL_OK));
        assert!(self.dev.lock().unwrap().is_active());
    }

    fn notify(&mut self) {
        self.write(NOTIFY_OFFSET, 2, 0);
    }
}

fn cfg8(bus: &mut PciBus, off: usize) -> u8 {
    let mut b = [0u8];
    bus.config_read(1, 0, off, &mut b);
    b[0]
}

/// Publishes a FLUSH request as avail entry `slot` (descriptors 2*slot,
/// 2*slot + 1; slots below QSIZE/2).
fn post_flush(mem: &GuestMemoryMmap, slot: u16) {
    let head = 2 * slot;
    let req = REQ + 0x100 * u64::from(slot);
    let resp = RESP + 0x100 * u64::from(slot);
    mem.write_obj(0u32, GuestAddress(req)).unwrap();
    mem.write_obj(0xdead_beefu32, GuestAddress(resp)).unwrap();
    let desc = |i: u16, addr: u64, len: u32, flags: u16, next: u16| {
        let at = DESC + 16 * u64::from(i);
        mem.write_obj(addr, GuestAddress(at)).unwrap();
        mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        mem.write_obj(next, GuestAddress(at + 14)).unwrap();
    };
    desc(head, req, 4, 1, head + 1);
    desc(head + 1, resp, 4, 2, 0);
    mem.write_obj(head, GuestAddress(AVAIL + 4 + 2 * u64::from(slot % QSIZE)))
        .unwrap();
    mem.write_obj(slot + 1, GuestAddress(AVAIL + 2)).unwrap();
}

fn used_idx(mem: &GuestMemoryMmap) -> u16 {
    mem.read_obj(GuestAddress(USED + 2)).unwrap()
}

fn used_elem(mem: &GuestMemoryMmap, i: u64) -> (u32, u32) {
    let at = USED + 4 + 8 * i;
    (
        mem.read_obj(GuestAddress(at)).unwrap(),
        mem.read_obj(GuestAddress(at + 4)).unwrap(),
    )
}

fn copy_ram(from: &GuestMemoryMmap, to: &GuestMemoryMmap) {
    let mut ram = vec![0u8; MEM as usize];
    from.read_slice(&mut ram, GuestAddress(0)).unwrap();
    to.write_slice(&ram, GuestAddress(0)).unwrap();
}

fn json<T: serde::Serialize + serde::de::DeserializeOwned>(v: &T) -> T {
    serde_json::from_str(&serde_json::to_string(v).unwrap()).unwrap()
}

/// A bench served two FLUSHes, with a config interrupt pending behind the
/// masked vector 0, and an unread ISR.
fn busy_bench() -> Bench {
    let mut a = Bench::new();
    a.probe();
    post_flush(&a.mem, 0);
    a.notify();
    post_flush(&a.mem, 1);
    a.notify();
    assert_eq!(used_idx(&a.mem), 2);
    assert_eq!(a.sink.take(), vec![1, 1]);
    a.dev.lock().unwrap().config_changed();
    assert!(a.sink.take().is_empty(), "vector 0 is masked: pending");
    a
}

#[test]
fn virtio_pci_function_continues_after_a_restore() {
    let mut a = busy_bench();
    let saved = a.dev.lock().unwrap().state();
    assert!(saved.activated);
    assert_eq!(
        (saved.queues[0].next_avail, saved.queues[0].next_used),
        (2, 2)
    );
    assert_eq!(saved.msix.pending, vec![0]);
    let saved_bus = a.bus.state();

    let mut b = Bench::new();
    copy_ram(&a.mem, &b.mem);
    let window = b.bus.window();
    b.bus.restore(&json(&saved_bus)).unwrap();
    b.dev.lock().unwrap().restore(json(&saved), window).unwrap();
    b.bus.announce_bars();
    assert_eq!(b.dev.lock().unwrap().state(), saved);
    assert!(b.dev.lock().unwrap().is_active());
    // The KVM side learns where the BAR decodes, and every MSI-X route.
    assert_eq!(
        b.moves.lock().unwrap().last().map(|m| (m.old, m.new)),
        Some((None, Some(b.base)))
    );
    assert!(b.sink.programmed.lock().unwrap().contains(&(
        1,
        MsixEntry {
            addr: 0xfee0_0000,
            data: 0x4041,
            masked: false
        }
    )));

    // The next request is served, and only it: the used index goes on.
    post_flush(&b.mem, 2);
    b.notify();
    assert_eq!(used_idx(&b.mem), 3);
    assert_eq!(used_elem(&b.mem, 2), (4, 4));
    let resp: u32 = b.mem.read_obj(GuestAddress(RESP + 0x200)).unwrap();
    assert_eq!(resp, 0, "FLUSH answered OK");
    assert_eq!(
        *b.flushes.lock().unwrap(),
        1,
        "slots 0 and 1 not served again"
    );
    assert_eq!(b.sink.take(), vec![1], "on the restored vector");
    // ISR: queue and config bits, as unread before the snapshot.
    assert_eq!(b.read(ISR_OFFSET, 1), 3);
    // The pending config interrupt is delivered when the guest unmasks it.
    b.table(0, 3, 0);
    assert_eq!(b.sink.take(), vec![0]);
    // The original goes on the same way (same memory layout).
    post_flush(&a.mem, 2);
    a.notify();
    assert_eq!(used_idx(&a.mem), 3);
}

#[test]
fn an_inactive_function_restores_inactive() {
    let mut a = Bench::new();
    a.cfg_write(0x04, &[0x06, 0x00]);
    a.write(COMMON_OFFSET + STATUS, 1, 3);
    a.write(COMMON_OFFSET + Q_SIZE, 2, 32);
    let saved = a.dev.lock().unwrap().state();
    assert!(!saved.activated);
    let b = Bench::new();
    let window = b.bus.window();
    b.dev.lock().unwrap().restore(json(&saved), window).unwrap();
    assert!(!b.dev.lock().unwrap().is_active());
    assert_eq!(b.dev.lock().unwrap().state(), saved);
}

/// Restores `state` into a fresh bench: the error, and the device must
/// be untouched.
fn refused(state: VirtioPciState) -> StateError {
    let b = Bench::new();
    let fresh = b.dev.lock().unwrap().state();
    let window = b.bus.window();
    let e = b
        .dev
        .lock()
        .unwrap()
        .restore(state, window)
        .expect_err("a hostile state was restored");
    assert_eq!(
        b.dev.lock().unwrap().state(),
        fresh,
        "changed before the error"
    );
    assert!(!b.dev.lock().unwrap().is_active());
    e
}

#[test]
fn hostile_virtio_pci_states_are_refused_naming_the_field() {
    let a = busy_bench();
    let good = a.dev.lock().unwrap().state();
    let with = |f: &dyn Fn(&mut VirtioPciState)| {
        let mut s = good.clone();
        f(&mut s);
        refused(s)
    };
    let e = with(&|s| s.queues[0].size = 3);
    assert!(
        matches!(
            e,
            StateError::QueueSize {
                queue: 0,
                size: 3,
                max: 256
            }
        ),
        "{e}"
    );
    let e = with(&|s| s.queues[0].size = 512);
    assert!(matches!(e, StateError::QueueSize { size: 512, .. }), "{e}");
    let e = with(&|s| s.queues[0].desc_table = MEM - 0x10);
    assert!(matches!(e, StateError::QueueMemory { queue: 0, .. }), "{e}");
    let e = with(&|s| s.queues[0].used_ring = u64::MAX - 3);
    assert!(matches!(e, StateError::QueueMemory { .. }), "{e}");
    let e = with(&|s| s.queues[0].avail_ring = AVAIL + 1);
    assert!(
        matches!(e, StateError::QueueAlign { ring: "driver", .. }),
        "{e}"
    );
    let e = with(&|s| s.queues[0].msix_vector = 2);
    assert!(
        matches!(
            e,
            StateError::Vector {
                vector: 2,
                table: 2,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "queue 0: msix_vector: MSI-X vector 2 is beyond the table of 2"
    );
    let e = with(&|s| s.config_msix_vector = 0x7ff);
    assert!(matches!(e, StateError::Vector { .. }), "{e}");
    let e = with(&|s| s.msix.pending = vec![9]);
    assert!(matches!(e, StateError::Vector { vector: 9, .. }), "{e}");
    let e = with(&|s| s.msix.entries.pop().map(drop).unwrap_or(()));
    assert!(
        matches!(
            e,
            StateError::Count {
                got: 1,
                expected: 2,
                ..
            }
        ),
        "{e}"
    );
    let e = with(&|s| s.msix.control = 0x0001);
    assert!(matches!(e, StateError::Field { .. }), "{e}");
    let e = with(&|s| s.msix.control = 0);
    assert!(e.to_string().contains("msix.control"), "{e}");
    let e = with(&|s| s.queues.push(s.queues[0]));
    assert!(
        matches!(
            e,
            StateError::Count {
                got: 2,
                expected: 1,
                ..
            }
        ),
        "{e}"
    );
    let e = with(&|s| s.device_type = 4);
    assert!(
        matches!(
            e,
            StateError::DeviceType {
                saved: 4,
                device: 27
            }
        ),
        "{e}"
    );
    let e = with(&|s| s.config.bytes[0] ^= 0xff);
    assert!(
        matches!(e, StateError::ReadOnlyConfig { offset: 0, .. }),
        "{e}"
    );
    // BAR 0 in the 32-bit hole, outside the 64-bit window.
    let e = with(&|s| {
        s.config.bytes[0x10..0x14].copy_from_slice(&0xc000_0004u32.to_le_bytes());
        s.config.bytes[0x14..0x18].fill(0);
    });
    assert!(
        matches!(
            e,
            StateError::Bar {
                index: 0,
                addr: 0xc000_0000,
                ..
            }
        ),
        "{e}"
    );
    // ... and past its end.
    let e = with(&|s| s.config.bytes[0x14..0x18].copy_from_slice(&0xffffu32.to_le_bytes()));
    assert!(matches!(e, StateError::Bar { .. }), "{e}");
    let e = with(&|s| s.driver_features |= 1 << 50);
    assert!(e.to_string().starts_with("driver_features"), "{e}");
    let e = with(&|s| s.status = 0);
    assert!(e.to_string().starts_with("status"), "{e}");
    let e = with(&|s| s.isr = 0x80);
    assert!(e.to_string().starts_with("isr"), "{e}");

    // Malformed JSON is a parse error, never a panic.
    let text = serde_json::to_string(&good).unwrap();
    let bad_hex = text.replacen("\"bytes\":\"", "\"bytes\":\"zz", 1);
    assert!(serde_json::from_str::<VirtioPciState>(&bad_hex).is_err());
    let extra = text.replacen('{', "{\"surprise\":1,", 1);
    assert!(serde_json::from_str::<VirtioPciState>(&extra).is_err());
    let huge = text.replacen("\"queue_select\":0", "\"queue_select\":70000", 1);
    assert!(serde_json::from_str::<VirtioPciState>(&huge).is_err());
}

/// An in-memory sink.
#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// An interrupt line counting its edges.
#[derive(Clone, Default)]
struct Count(Arc<AtomicU64>);

impl IrqTrigger for Count {
    fn trigger(&self) -> io::Result<()> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn serial() -> (SerialDevice, Buf, Count) {
    let (buf, irq) = (Buf::default(), Count::default());
    let d = SerialDevice::new(
        SerialOutput::Writer(Box::new(buf.clone())),
        Box::new(irq.clone()),
    );
    (d, buf, irq)
}

fn inb(d: &mut SerialDevice, port: u16) -> u8 {
    let mut b = [0u8];
    d.io_in(port, &mut b);
    b[0]
}

fn outb(d: &mut SerialDevice, port: u16, v: u8) {
    d.io_out(port, &[v]);
}

#[test]
fn serial_registers_and_fifo_survive_a_restore() {
    let (mut a, _, _) = serial();
    outb(&mut a, 0x3fb, 0x83); // DLAB
    outb(&mut a, 0x3f8, 0x0c); // divisor 12: 9600 baud
    outb(&mut a, 0x3f9, 0x00);
    outb(&mut a, 0x3fb, 0x1b); // 8E1
    outb(&mut a, 0x3fc, 0x0b); // DTR, RTS, OUT2
    outb(&mut a, 0x3ff, 0x5a); // scratch
    outb(&mut a, 0x3f9, 0x01); // IER: received data
    a.enqueue_input(b"xyz").unwrap();
    let saved = a.state();
    assert_eq!(saved.in_buffer, b"xyz");

    let (mut b, out, irq) = serial();
    b.restore(&json(&saved)).unwrap();
    assert_eq!(b.state(), saved);
    assert_eq!(irq.0.load(Ordering::SeqCst), 1, "pending RDA raised again");
    assert_eq!(inb(&mut b, 0x3fb), 0x1b);
    assert_eq!(inb(&mut b, 0x3f9), 0x01);
    assert_eq!(inb(&mut b, 0x3fc), 0x0b);
    assert_eq!(inb(&mut b, 0x3ff), 0x5a);
    assert_eq!(inb(&mut b, 0x3fa) & 0x0f, 0x04, "IIR: received data");
    assert_eq!(inb(&mut b, 0x3fd) & 1, 1);
    assert_eq!(inb(&mut b, 0x3f8), b'x');
    assert_eq!(inb(&mut b, 0x3f8), b'y');
    assert_eq!(inb(&mut b, 0x3f8), b'z');
    assert_eq!(inb(&mut b, 0x3fd) & 1, 0);
    outb(&mut b, 0x3fb, 0x9b);
    assert_eq!(inb(&mut b, 0x3f8), 0x0c, "divisor latch");
    outb(&mut b, 0x3fb, 0x1b);
    outb(&mut b, 0x3f8, b'!');
    assert_eq!(&*out.0.lock().unwrap(), b"!", "output goes to the new sink");
    assert_eq!(b.enqueue_input(b"more").unwrap(), 4);
    assert_eq!(
        irq.0.load(Ordering::SeqCst),
        2,
        "later edges reach the line"
    );

    // A line that fails: the state is restored all the same, the output
    // kept, and the error says why.
    struct Fails;
    impl IrqTrigger for Fails {
        fn trigger(&self) -> io::Result<()> {
            Err(io::Error::other("irqfd gone"))
        }
    }
    let out = Buf::default();
    let mut c = SerialDevice::new(SerialOutput::Writer(Box::new(out.clone())), Box::new(Fails));
    let e = c.restore(&saved).unwrap_err();
    assert!(matches!(e, StateError::SerialIrq(_)), "{e}");
    assert_eq!(c.state(), saved);
    outb(&mut c, 0x3f8, b'k');
    assert_eq!(&*out.0.lock().unwrap(), b"k");

    let with = |f: &dyn Fn(&mut SerialDeviceState)| {
        let mut s = saved.clone();
        f(&mut s);
        let (mut d, _, _) = serial();
        let fresh = d.state();
        let e = d.restore(&s).expect_err("hostile serial state restored");
        assert_eq!(d.state(), fresh);
        e
    };
    let e = with(&|s| s.in_buffer = vec![b'a'; 65]);
    assert!(
        matches!(
            e,
            StateError::TooLong {
                field: "in_buffer",
                len: 65,
                max: 64
            }
        ),
        "{e}"
    );
    let e = with(&|s| s.interrupt_enable = 0x10);
    assert!(e.to_string().starts_with("interrupt_enable"), "{e}");
    let e = with(&|s| s.in_buffer.clear());
    assert!(e.to_string().starts_with("line_status"), "{e}");
}

#[test]
fn power_pci_bus_and_console_input_survive_a_restore() {
    let (tx, _rx) = power_channel().unwrap();
    let mut p = PowerDevice::new(tx.clone());
    p.io_out(0xcf9, &[0x02]);
    let saved: PowerState = json(&p.state());
    let mut q = PowerDevice::new(tx.clone());
    q.restore(&saved).unwrap();
    let mut b = [0u8];
    q.io_in(0xcf9, &mut b);
    assert_eq!(b[0], 0x02);
    let e = q
        .restore(&PowerState {
            reset_control: 0x06,
        })
        .unwrap_err();
    assert!(e.to_string().starts_with("reset_control"), "{e}");

    let window = Mmio64Window::above(0);
    let mut bus = PciBus::new(window);
    assert!(bus.io_write(CONFIG_ADDRESS_PORT, &0x8000_0810u32.to_le_bytes()));
    let saved: PciBusState = json(&bus.state());
    let mut fresh = PciBus::new(window);
    fresh.restore(&saved).unwrap();
    let mut a = [0u8; 4];
    fresh.io_read(CONFIG_ADDRESS_PORT, &mut a);
    assert_eq!(u32::from_le_bytes(a), 0x8000_0810);
    let mut bad = saved.clone();
    bad.config_address = 0x0100_0000;
    assert!(fresh.restore(&bad).is_err());

    let mut input = ConsoleInput::default();
    input.push(b"typed ahead");
    let saved: ConsoleInputState = json(&input.state());
    let mut other = ConsoleInput::default();
    other.restore(&saved).unwrap();
    assert_eq!(other.len(), 11);
    let big = ConsoleInputState {
        pending: vec![0; 64 * 1024 + 1],
    };
    assert!(matches!(
        other.restore(&big),
        Err(StateError::TooLong {
            field: "pending",
            ..
        })
    ));
    assert_eq!(other.len(), 11, "untouched by the refused state");

    // Through the collection, keyed by id.
    let mut all = DeviceStates::new();
    all.insert(POWER_ID, DeviceState::Power(p.state()));
    let mut all = json(&all);
    assert!(matches!(
        all.take_console_input(POWER_ID),
        Err(DeviceStatesError::Kind { .. })
    ));
}

/// A virtio console function (no bus: driven through its BAR directly),
/// its input, and its RAM.
fn console_fn() -> (VirtioPciDevice, Arc<Mutex<ConsoleInput>>, GuestMemoryMmap) {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    let input = ConsoleInput::shared();
    let dev = ConsoleDevice::new(None, input.clone());
    let f = VirtioPciDevice::new(Box::new(dev), mem.clone(), Arc::new(Sink::default())).unwrap();
    (f, input, mem)
}

/// A device-writable receive buffer of `len` bytes at `addr` as
/// descriptor and avail entry `slot` of the receive queue.
fn post_rx(mem: &GuestMemoryMmap, slot: u16, addr: u64, len: u32) {
    let at = DESC + 16 * u64::from(slot);
    mem.write_obj(addr, GuestAddress(at)).unwrap();
    mem.write_obj(len, GuestAddress(at + 8)).unwrap();
    mem.write_obj(2u16, GuestAddress(at + 12)).unwrap(); // WRITE
    mem.write_obj(slot, GuestAddress(AVAIL + 4 + 2 * u64::from(slot)))
        .unwrap();
    mem.write_obj(slot + 1, GuestAddress(AVAIL + 2)).unwrap();
}

#[test]
fn console_queues_and_pending_input_continue_after_a_restore() {
    let (mut a, input, mem) = console_fn();
    let w = |f: &mut VirtioPciDevice, off: u64, v: &[u8]| f.write_bar(0, off, v);
    w(&mut a, STATUS, &[3]);
    w(&mut a, GFSEL, &1u32.to_le_bytes());
    w(&mut a, GF, &1u32.to_le_bytes()); // VERSION_1
    w(&mut a, STATUS, &[11]);
    for (q, base) in [(0u16, 0u64), (1, 0x8000)] {
        w(&mut a, Q_SELECT, &q.to_le_bytes());
        w(&mut a, Q_SIZE, &QSIZE.to_le_bytes());
        w(&mut a, Q_DESC, &(DESC + base).to_le_bytes());
        w(&mut a, Q_DRIVER, &(AVAIL + base).to_le_bytes());
        w(&mut a, Q_DEVICE, &(USED + base).to_le_bytes());
        w(&mut a, Q_ENABLE, &1u16.to_le_bytes());
    }
    w(&mut a, STATUS, &[ALL_OK]);
    assert!(a.is_active());
    post_rx(&mem, 0, REQ, 4);
    post_rx(&mem, 1, REQ + 0x1000, 8);
    input.lock().unwrap().push(b"abcd");
    a.notify_queue(0);
    assert_eq!(used_idx(&mem), 1);
    // Typed while the VM is paused: waits in the input.
    input.lock().unwrap().push(b"ef");
    let saved = json(&a.state());
    let saved_input = json(&input.lock().unwrap().state());
    assert_eq!(saved.queues.len(), 2);
    assert_eq!(
        (saved.queues[0].next_avail, saved.queues[0].next_used),
        (1, 1)
    );

    let (mut b, input_b, mem_b) = console_fn();
    copy_ram(&mem, &mem_b);
    b.restore(saved.clone(), Mmio64Window::above(0)).unwrap();
    input_b.lock().unwrap().restore(&saved_input).unwrap();
    assert_eq!(b.state(), saved);
    b.notify_queue(0);
    assert_eq!(used_idx(&mem_b), 2);
    assert_eq!(used_elem(&mem_b, 1), (1, 2), "slot 1, the two bytes typed");
    let mut got = [0u8; 2];
    mem_b
        .read_slice(&mut got, GuestAddress(REQ + 0x1000))
        .unwrap();
    assert_eq!(&got, b"ef");
    assert!(input_b.lock().unwrap().is_empty());
}

#[test]
fn a_request_pending_at_the_snapshot_is_served_after_the_restore() {
    let a = busy_bench();
    // Made available, its notification not yet served by the device.
    post_flush(&a.mem, 2);
    let saved = a.dev.lock().unwrap().state();
    let b = Bench::new();
    copy_ram(&a.mem, &b.mem);
    let window = b.bus.window();
    b.dev.lock().unwrap().restore(saved, window).unwrap();
    assert_eq!(used_idx(&b.mem), 2);
    b.dev.lock().unwrap().serve_restored_queues();
    assert_eq!(used_idx(&b.mem), 3);
    assert_eq!(*b.flushes.lock().unwrap(), 1);
    assert_eq!(b.sink.take(), vec![1]);
    // Nothing more to serve: a second call changes nothing.
    b.dev.lock().unwrap().serve_restored_queues();
    assert_eq!(used_idx(&b.mem), 3);
    // An inactive function serves nothing.
    let c = Bench::new();
    c.dev.lock().unwrap().serve_restored_queues();
    assert_eq!(*c.flushes.lock().unwrap(), 0);
}

/// Every number of `v` replaced, one at a time, by each extreme value.
fn mutations(v: &serde_json::Value) -> Vec<serde_json::Value> {
    const EXTREMES: [u64; 7] = [0, 1, 3, 0xff, 0xffff, 0xffff_ffff, u64::MAX];
    fn walk(v: &serde_json::Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    path.push(k.clone());
                    walk(x, path, out);
                    path.pop();
                }
            }
            serde_json::Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    path.push(i.to_string());
                    walk(x, path, out);
                    path.pop();
                }
            }
            serde_json::Value::Number(_) | serde_json::Value::Bool(_) => out.push(path.clone()),
            _ => {}
        }
    }
    let mut paths = Vec::new();
    walk(v, &mut Vec::new(), &mut paths);
    let mut out = Vec::new();
    for p in paths {
        let pointer = format!("/{}", p.join("/"));
        for x in EXTREMES {
            let mut m = v.clone();
            *m.pointer_mut(&pointer).unwrap() = serde_json::json!(x);
            out.push(m);
        }
    }
    out
}

#[test]
fn no_mutated_state_panics_a_restore() {
    let a = busy_bench();
    let good = serde_json::to_value(a.dev.lock().unwrap().state()).unwrap();
    let mut tried = 0;
    let mut refused = 0;
    let mut cases = mutations(&good);
    // And every config space byte set to all ones.
    let hex = good["config"]["bytes"].as_str().unwrap().to_owned();
    for i in 0..hex.len() / 2 {
        let mut m = good.clone();
        let mut h = hex.clone();
        h.replace_range(2 * i..2 * i + 2, "ff");
        m["config"]["bytes"] = serde_json::json!(h);
        cases.push(m);
    }
    for m in cases {
        let Ok(state) = serde_json::from_value::<VirtioPciState>(m) else {
            continue;
        };
        let b = Bench::new();
        let window = b.bus.window();
        tried += 1;
        if b.dev.lock().unwrap().restore(state, window).is_err() {
            refused += 1;
        } else {
            // Whatever was accepted, the function keeps answering.
            b.dev.lock().unwrap().serve_restored_queues();
            let _ = b.dev.lock().unwrap().state();
        }
    }
    assert!(tried > 300, "{tried} states tried");
    assert!(refused > 50, "{refused} of {tried} refused");

    let (s, _, _) = serial();
    let good = serde_json::to_value(s.state()).unwrap();
    for m in mutations(&good) {
        if let Ok(state) = serde_json::from_value::<SerialDeviceState>(m) {
            let (mut d, _, _) = serial();
            let _ = d.restore(&state);
            inb(&mut d, 0x3f8);
        }
    }
}
