//! The COM1 serial port: an 8250/16550A UART at [`COM1_BASE`]..=0x3ff
//! (IRQ [`COM1_IRQ`]), emulated by vm-superio's [`Serial`].
//!
//! - **Output** (the guest writes THR) goes to a [`SerialOutput`] chosen
//!   from the `--serial` [`ConsoleConfig`]: `tty` is the VMM's standard
//!   output, `file=PATH` a file created if missing and appended to, `null`
//!   discards it, `off` builds no device at all (the ports are then
//!   unknown ports), `pty` and `socket=PATH` go through the bounded
//!   buffer of their [`crate::chardev`] backend (a pty nobody reads, or a
//!   socket without client, never blocks the vCPU). A write to the sink
//!   that fails loses the byte: the guest cannot be blocked, so THR still
//!   reads empty; the error is logged (the first, then one line per
//!   [`LOG_EVERY`]) and counted.
//! - **Input**: the VMM's control loop reads its input (stdin for `tty`,
//!   the pty, the socket's client) and feeds the bytes with
//!   [`SerialDevice::enqueue_input`], up to
//!   [`SerialDevice::input_capacity`] (the 64-byte receive FIFO); the guest
//!   reads them from RBR with LSR's data-ready bit set while any is left.
//! - **Interrupts**: the UART raises IRQ 4 through an [`IrqTrigger`], a
//!   trait object: KVM's side is an `EventFd` registered as an irqfd on
//!   GSI 4 (the trait is implemented for [`EventFd`]). It fires when the
//!   guest has enabled the interrupt in IER: received data available, or
//!   THR empty (after each byte written, and when the interrupt is
//!   enabled).
//!
//! The device is shared between the vCPU threads (port I/O through the
//! [`PortIo`] implementation, registered with the [`super::ports`]
//! composer) and the control loop (input): [`SharedSerial`].

use std::fmt;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use vm_superio::serial::{Error as UartError, NoEvents};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::chardev::Backend;
use crate::config::{ConsoleConfig, ConsoleOutputMode};
use crate::vcpu::PortIo;

/// First port of COM1.
pub const COM1_BASE: u16 = 0x3f8;
/// Number of COM1 ports (0x3f8..=0x3ff).
pub const COM1_SIZE: u16 = 8;
/// COM1's ISA IRQ (also its GSI: the MADT overrides IRQ 4 -> GSI 4).
pub const COM1_IRQ: u32 = 4;
/// Output or interrupt errors logged in full once, then one line per this
/// many.
pub const LOG_EVERY: u64 = 1024;

/// Errors of building the serial port and of feeding it input.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum SerialError {
    #[error("serial output file {}: cannot open it for appending", path.display())]
    OpenFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("serial mode File without a file path (file=PATH)")]
    MissingFile,
    #[error("serial mode {0:?}: its backend was not opened")]
    NoBackend(ConsoleOutputMode),
    #[error("serial port: raising IRQ {COM1_IRQ} for received data")]
    Interrupt(#[source] io::Error),
}

/// An interrupt line the UART raises (edge: one call, one interrupt).
/// The KVM implementation is an irqfd on GSI [`COM1_IRQ`].
pub trait IrqTrigger: Send + Sync {
    /// Raises the interrupt.
    fn trigger(&self) -> io::Result<()>;
}

impl IrqTrigger for EventFd {
    fn trigger(&self) -> io::Result<()> {
        self.write(1)
    }
}

/// The trait object as vm-superio's [`Trigger`].
// An `Arc` so that a snapshot restore can rebuild the UART on the same line.
struct Irq(Arc<dyn IrqTrigger>);

impl Trigger for Irq {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        self.0.trigger()
    }
}

/// Where the guest's serial output goes.
pub enum SerialOutput {
    /// The VMM's standard output (`--serial tty`).
    Stdout(io::Stdout),
    /// A file opened for appending (`--serial file=PATH`).
    File {
        /// The open file.
        file: File,
        /// Its path, for messages.
        path: PathBuf,
    },
    /// Discarded (`--serial null`).
    Null,
    /// Any writer (tests, a future pty or socket).
    Writer(Box<dyn Write + Send>),
}

impl fmt::Debug for SerialOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SerialOutput::Stdout(_) => f.write_str("Stdout"),
            SerialOutput::File { path, .. } => write!(f, "File({})", path.display()),
            SerialOutput::Null => f.write_str("Null"),
            SerialOutput::Writer(_) => f.write_str("Writer"),
        }
    }
}

impl SerialOutput {
    /// Opens `path` for appending, creating it if missing: a regular file
    /// or a character device; a FIFO, socket or directory is refused at
    /// once ([`crate::chardev::open_output_file`]).
    pub fn file(path: &Path) -> Result<SerialOutput, SerialError> {
        let file = crate::chardev::open_output_file(path, true).map_err(|source| {
            SerialError::OpenFile {
                path: path.to_path_buf(),
                source,
            }
        })?;
        Ok(SerialOutput::File {
            file,
            path: path.to_path_buf(),
        })
    }

    /// The sink `--serial` asks for; `None` for `off` (no device). `pty`
    /// and `socket` write into `backend`'s buffered output.
    pub fn from_config(
        cfg: &ConsoleConfig,
        backend: &Backend,
    ) -> Result<Option<SerialOutput>, SerialError> {
        match cfg.mode {
            ConsoleOutputMode::Off => Ok(None),
            ConsoleOutputMode::Null => Ok(Some(SerialOutput::Null)),
            ConsoleOutputMode::Tty => Ok(Some(SerialOutput::Stdout(io::stdout()))),
            ConsoleOutputMode::File => {
                let path = cfg.file.as_deref().ok_or(SerialError::MissingFile)?;
                SerialOutput::file(path).map(Some)
            }
            mode @ (ConsoleOutputMode::Pty | ConsoleOutputMode::Socket) => match backend {
                Backend::Pty(_, out) | Backend::Socket(_, out) => {
                    Ok(Some(SerialOutput::Writer(Box::new(out.writer()))))
                }
                _ => Err(SerialError::NoBackend(mode)),
            },
        }
    }
}

impl Write for SerialOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            SerialOutput::Stdout(s) => s.write(buf),
            SerialOutput::File { file, .. } => file.write(buf),
            SerialOutput::Null => Ok(buf.len()),
            SerialOutput::Writer(w) => w.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            SerialOutput::Stdout(s) => s.flush(),
            SerialOutput::File { file, .. } => file.flush(),
            SerialOutput::Null => Ok(()),
            SerialOutput::Writer(w) => w.flush(),
        }
    }
}

/// Counters of a serial port.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SerialStats {
    /// Bytes the guest wrote that reached the sink.
    pub out_bytes: u64,
    /// Bytes lost because the sink failed.
    pub lost_bytes: u64,
    /// Interrupts that could not be raised.
    pub irq_errors: u64,
    /// Accesses inside the range that are not byte-wide (ignored; reads
    /// answer all ones).
    pub bad_width: u64,
}

/// COM1, shared between the vCPU threads and the control loop.
pub type SharedSerial = Arc<Mutex<SerialDevice>>;

/// The COM1 UART.
pub struct SerialDevice {
    uart: Serial<Irq, NoEvents, SerialOutput>,
    stats: SerialStats,
}

impl fmt::Debug for SerialDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SerialDevice")
            .field("output", self.uart.writer())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl SerialDevice {
    /// A UART writing to `output` and raising `irq`.
    pub fn new(output: SerialOutput, irq: Box<dyn IrqTrigger>) -> SerialDevice {
        SerialDevice {
            uart: Serial::new(Irq(Arc::from(irq)), output),
            stats: SerialStats::default(),
        }
    }

    /// The device `--serial` asks for; `None` for `off`.
    pub fn from_config(
        cfg: &ConsoleConfig,
        backend: &Backend,
        irq: Box<dyn IrqTrigger>,
    ) -> Result<Option<SerialDevice>, SerialError> {
        Ok(SerialOutput::from_config(cfg, backend)?.map(|out| SerialDevice::new(out, irq)))
    }

    /// The device wrapped for sharing.
    pub fn shared(self) -> SharedSerial {
        Arc::new(Mutex::new(self))
    }

    /// The output sink.
    pub fn output(&self) -> &SerialOutput {
        self.uart.writer()
    }

    /// Counters so far.
    pub fn stats(&self) -> SerialStats {
        self.stats
    }

    /// Room left in the receive FIFO.
    pub fn input_capacity(&self) -> usize {
        self.uart.fifo_capacity()
    }

    /// Queues input bytes for the guest: as many as the receive FIFO takes
    /// (the count is returned; 0 when it is full: the caller keeps the rest
    /// and retries after the guest has read). Raises the interrupt if the
    /// guest enabled it. An interrupt error is returned after the bytes
    /// were queued.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> Result<usize, SerialError> {
        if bytes.is_empty() || self.uart.fifo_capacity() == 0 {
            return Ok(0);
        }
        let n = bytes.len().min(self.uart.fifo_capacity());
        match self.uart.enqueue_raw_bytes(&bytes[..n]) {
            Ok(n) => Ok(n),
            Err(UartError::Trigger(e)) => {
                self.stats.irq_errors += 1;
                Err(SerialError::Interrupt(e))
            }
            // Neither happens for a non-empty slice that fits.
            Err(UartError::FullFifo) => Ok(0),
            Err(UartError::IOError(e)) => Err(SerialError::Interrupt(e)),
        }
    }

    /// The register offset of `port` for a byte access, if it is one.
    fn offset(&mut self, port: u16, len: usize) -> Option<u8> {
        let off = port.checked_sub(COM1_BASE).filter(|o| *o < COM1_SIZE)?;
        if len != 1 {
            self.stats.bad_width += 1;
            log::debug!("serial: {len}-byte access at {port:#x} ignored");
            return None;
        }
        u8::try_from(off).ok()
    }

    fn write_register(&mut self, offset: u8, value: u8) {
        match self.uart.write(offset, value) {
            Ok(()) => {
                if offset == 0 && !self.is_dlab_or_loop() {
                    self.stats.out_bytes += 1;
                }
            }
            Err(UartError::IOError(e)) => {
                self.stats.lost_bytes += 1;
                let n = self.stats.lost_bytes;
                if n == 1 || n.is_multiple_of(LOG_EVERY) {
                    log::warn!(
                        "serial output to {:?} failed, {n} byte(s) lost so far: {e}",
                        self.uart.writer()
                    );
                }
            }
            Err(UartError::Trigger(e)) => self.irq_error(&e),
            Err(UartError::FullFifo) => {}
        }
    }

    fn irq_error(&mut self, e: &io::Error) {
        self.stats.irq_errors += 1;
        let n = self.stats.irq_errors;
        if n == 1 || n.is_multiple_of(LOG_EVERY) {
            log::warn!("serial: raising IRQ {COM1_IRQ} failed ({n} so far): {e}");
        }
    }

    /// Whether a data write goes to the divisor latch or the loopback
    /// FIFO rather than the sink (LCR bit 7, MCR bit 4).
    fn is_dlab_or_loop(&mut self) -> bool {
        const LCR: u8 = 3;
        const MCR: u8 = 4;
        self.uart.read(LCR) & 0x80 != 0 || self.uart.read(MCR) & 0x10 != 0
    }
}

impl PortIo for SerialDevice {
    fn io_out(&mut self, port: u16, data: &[u8]) {
        if let (Some(off), Some(&value)) = (self.offset(port, data.len()), data.first()) {
            self.write_register(off, value);
        }
    }

    fn io_in(&mut self, port: u16, data: &mut [u8]) {
        data.fill(0xff);
        if let Some(off) = self.offset(port, data.len()) {
            data[0] = self.uart.read(off);
        }
    }
}

// Snapshot state (issue 17): capture and restore, kept under snapshot/.
#[path = "../snapshot/serial_state.rs"]
mod state;
pub use state::SerialDeviceState;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    const THR: u16 = COM1_BASE;
    const RBR: u16 = COM1_BASE;
    const IER: u16 = COM1_BASE + 1;
    const IIR: u16 = COM1_BASE + 2;
    const LCR: u16 = COM1_BASE + 3;
    const MCR: u16 = COM1_BASE + 4;
    const LSR: u16 = COM1_BASE + 5;
    const LSR_DR: u8 = 0x01;
    const LSR_THRE: u8 = 0x20;
    const LSR_TEMT: u8 = 0x40;
    const IER_RDA: u8 = 0x01;
    const IER_THRE: u8 = 0x02;

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

    /// A sink that always fails.
    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from_raw_os_error(libc::ENOSPC))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Counts interrupts.
    #[derive(Clone, Default)]
    struct Count(Arc<AtomicU64>);

    impl IrqTrigger for Count {
        fn trigger(&self) -> io::Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    impl Count {
        fn get(&self) -> u64 {
            self.0.load(Ordering::SeqCst)
        }
    }

    fn dev() -> (SerialDevice, Buf, Count) {
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
    fn output_bytes_reach_the_sink_and_thr_reads_empty() {
        let (mut d, buf, irq) = dev();
        assert_eq!(
            inb(&mut d, LSR) & (LSR_THRE | LSR_TEMT),
            LSR_THRE | LSR_TEMT
        );
        for &b in b"hello\n" {
            // the guest polls LSR for THRE before each byte, as 8250 does
            assert_ne!(inb(&mut d, LSR) & LSR_THRE, 0);
            outb(&mut d, THR, b);
        }
        assert_eq!(&*buf.0.lock().unwrap(), b"hello\n");
        assert_eq!(d.stats().out_bytes, 6);
        assert_ne!(inb(&mut d, LSR) & LSR_THRE, 0);
        // no interrupt enabled: none raised
        assert_eq!(irq.get(), 0);
    }

    #[test]
    fn divisor_latch_and_loopback_writes_do_not_reach_the_sink() {
        let (mut d, buf, _) = dev();
        outb(&mut d, LCR, 0x83); // DLAB
        outb(&mut d, THR, 0x01); // divisor low
        outb(&mut d, LCR, 0x03);
        outb(&mut d, MCR, 0x10); // loopback
        outb(&mut d, THR, b'x');
        assert_eq!(inb(&mut d, LSR) & LSR_DR, LSR_DR);
        assert_eq!(inb(&mut d, RBR), b'x');
        outb(&mut d, MCR, 0x08);
        outb(&mut d, THR, b'y');
        assert_eq!(&*buf.0.lock().unwrap(), b"y");
        assert_eq!(d.stats().out_bytes, 1);
    }

    #[test]
    fn input_bytes_are_read_from_rbr_with_data_ready() {
        let (mut d, _, irq) = dev();
        assert_eq!(inb(&mut d, LSR) & LSR_DR, 0);
        assert_eq!(d.enqueue_input(b"ok").unwrap(), 2);
        assert_eq!(irq.get(), 0, "RDA interrupt not enabled");
        let mut got = Vec::new();
        while inb(&mut d, LSR) & LSR_DR != 0 {
            got.push(inb(&mut d, RBR));
        }
        assert_eq!(got, b"ok");
        assert_eq!(d.enqueue_input(b"").unwrap(), 0);
    }

    #[test]
    fn input_stops_at_the_fifo_size() {
        let (mut d, _, _) = dev();
        let cap = d.input_capacity();
        assert_eq!(cap, 64);
        let big = vec![b'a'; cap + 10];
        assert_eq!(d.enqueue_input(&big).unwrap(), cap);
        assert_eq!(d.input_capacity(), 0);
        assert_eq!(d.enqueue_input(b"b").unwrap(), 0);
        inb(&mut d, RBR);
        assert_eq!(d.enqueue_input(b"bc").unwrap(), 1);
    }

    #[test]
    fn interrupts_fire_when_enabled() {
        let (mut d, _, irq) = dev();
        // RDA enabled: input raises IRQ 4, IIR says "received data"
        outb(&mut d, IER, IER_RDA);
        assert_eq!(inb(&mut d, IER), IER_RDA);
        d.enqueue_input(b"k").unwrap();
        assert_eq!(irq.get(), 1);
        assert_eq!(inb(&mut d, IIR) & 0x0f, 0x04);
        assert_eq!(inb(&mut d, RBR), b'k');
        assert_eq!(inb(&mut d, IIR) & 0x0f, 0x01, "no interrupt pending");
        // THRE enabled: raised at once (THR is empty) and after a byte
        outb(&mut d, IER, IER_RDA | IER_THRE);
        assert_eq!(irq.get(), 2);
        assert_eq!(inb(&mut d, IIR) & 0x0f, 0x02);
        outb(&mut d, THR, b'z');
        assert_eq!(irq.get(), 3);
        // disabled again: nothing more
        outb(&mut d, IER, 0);
        outb(&mut d, THR, b'z');
        d.enqueue_input(b"q").unwrap();
        assert_eq!(irq.get(), 3);
    }

    #[test]
    fn eventfd_is_a_trigger() {
        let efd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut d = SerialDevice::new(SerialOutput::Null, Box::new(efd.try_clone().unwrap()));
        outb(&mut d, IER, IER_RDA);
        d.enqueue_input(b"1").unwrap();
        assert_eq!(efd.read().unwrap(), 1);
    }

    #[test]
    fn failing_trigger_is_counted_and_returned_for_input() {
        struct Fails;
        impl IrqTrigger for Fails {
            fn trigger(&self) -> io::Result<()> {
                Err(io::Error::from_raw_os_error(libc::EBADF))
            }
        }
        let mut d = SerialDevice::new(SerialOutput::Null, Box::new(Fails));
        outb(&mut d, IER, IER_THRE);
        assert_eq!(d.stats().irq_errors, 1);
        outb(&mut d, IER, IER_RDA);
        let e = d.enqueue_input(b"1").unwrap_err();
        assert!(matches!(e, SerialError::Interrupt(_)), "{e}");
        assert_eq!(d.stats().irq_errors, 2);
        // the byte is there anyway
        assert_eq!(inb(&mut d, RBR), b'1');
    }

    #[test]
    fn sink_errors_lose_the_byte_but_not_the_guest() {
        let mut d = SerialDevice::new(
            SerialOutput::Writer(Box::new(Broken)),
            Box::new(Count::default()),
        );
        outb(&mut d, THR, b'a');
        outb(&mut d, THR, b'b');
        assert_eq!(d.stats().lost_bytes, 2);
        assert_eq!(d.stats().out_bytes, 0);
        assert_ne!(inb(&mut d, LSR) & LSR_THRE, 0);
    }

    #[test]
    fn wide_and_outside_accesses_are_ignored() {
        let (mut d, buf, _) = dev();
        d.io_out(THR, b"ab");
        let mut w = [0u8; 2];
        d.io_in(LSR, &mut w);
        assert_eq!(w, [0xff, 0xff]);
        assert_eq!(d.stats().bad_width, 2);
        let mut b = [0u8];
        d.io_in(COM1_BASE + COM1_SIZE, &mut b);
        assert_eq!(b, [0xff]);
        d.io_out(COM1_BASE - 1, b"c");
        assert!(buf.0.lock().unwrap().is_empty());
    }

    #[test]
    fn config_modes_pick_the_sink() {
        let irq = || Box::new(Count::default()) as Box<dyn IrqTrigger>;
        let none = Backend::Null;
        let off = ConsoleConfig::parse_serial("off").unwrap();
        assert!(SerialDevice::from_config(&off, &none, irq())
            .unwrap()
            .is_none());
        let null = ConsoleConfig::parse_serial("null").unwrap();
        let d = SerialDevice::from_config(&null, &none, irq())
            .unwrap()
            .unwrap();
        assert!(matches!(d.output(), SerialOutput::Null));
        let tty = ConsoleConfig::parse_serial("tty").unwrap();
        let d = SerialDevice::from_config(&tty, &none, irq())
            .unwrap()
            .unwrap();
        assert!(matches!(d.output(), SerialOutput::Stdout(_)));
        let pty = ConsoleConfig::with_mode(ConsoleOutputMode::Pty);
        let e = SerialDevice::from_config(&pty, &none, irq()).unwrap_err();
        assert_eq!(e.to_string(), "serial mode Pty: its backend was not opened");
        let no_path = ConsoleConfig::with_mode(ConsoleOutputMode::File);
        assert!(matches!(
            SerialDevice::from_config(&no_path, &none, irq()),
            Err(SerialError::MissingFile)
        ));
    }

    #[test]
    fn file_sink_is_created_then_appended() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.log");
        for text in [&b"one\n"[..], b"two\n"] {
            let cfg = ConsoleConfig::parse_serial(&format!("file={}", path.display())).unwrap();
            let mut d = SerialDevice::from_config(&cfg, &Backend::Null, Box::new(Count::default()))
                .unwrap()
                .unwrap();
            for &b in text {
                outb(&mut d, THR, b);
            }
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"one\ntwo\n");
    }

    #[test]
    fn file_sink_errors_name_the_file_and_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("serial.log");
        let e = SerialOutput::file(&path).unwrap_err();
        let msg = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert_eq!(
            msg,
            format!(
                "serial output file {}: cannot open it for appending: No such file or directory (os error 2)",
                path.display()
            )
        );
        // a directory is not a file
        let e = SerialOutput::file(dir.path()).unwrap_err();
        assert!(
            matches!(&e, SerialError::OpenFile { source, .. }
            if source.raw_os_error() == Some(libc::EISDIR)),
            "{e:?}"
        );
    }

    /// `--serial file=` on a FIFO (that nobody reads, or that a reader
    /// has open), a socket or a directory is refused at once naming the
    /// type; /dev/null (a character device) is accepted.
    #[test]
    fn file_sink_refuses_special_files_at_once() {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path living through the call;
        // mkfifo only reads it.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let kind = |p: &Path| {
            let e = SerialOutput::file(p).unwrap_err();
            let SerialError::OpenFile { source, .. } = &e else {
                panic!("{e:?}")
            };
            let t = source
                .get_ref()
                .and_then(|s| s.downcast_ref::<crate::chardev::OutputFileType>())
                .unwrap_or_else(|| panic!("{e:?}"));
            assert!(format!("{e}").contains(&p.display().to_string()));
            t.0
        };
        let t0 = std::time::Instant::now();
        assert_eq!(kind(&fifo), "FIFO");
        let _reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        assert_eq!(kind(&fifo), "FIFO");
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        let sock = dir.path().join("sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        assert_eq!(kind(&sock), "socket");
        assert!(SerialOutput::file(Path::new("/dev/null")).is_ok());
        // The console's truncating open follows the same rule.
        let e = crate::chardev::open_output_file(&fifo, false).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        assert!(crate::chardev::open_output_file(Path::new("/dev/null"), false).is_ok());
    }
}
