//! The port I/O bus: one [`PortIo`] that dispatches each access by its
//! first port to the handler registered for the range holding it, and is
//! what every vCPU thread gets (a clone each: the table is shared, the
//! handlers are `Arc<Mutex<_>>`).
//!
//! Ranges do not overlap. Handlers see the absolute port, as
//! [`PortIo`] says. The standard ones:
//!
//! | ports | handler |
//! |---|---|
//! | 0x3f8..=0x3ff | COM1 ([`super::SerialDevice`]), unless `--serial off` |
//! | 0x3c0, 0xcf9, 0x64 | power off / reset ([`PowerDevice`]) |
//! | 0xcf8, 0xcfa..=0xcff | PCI configuration mechanism #1 ([`PciConfigIo`]); 0xcf9 between them is the reset control register |
//! | 0x61 | system control port B ([`SystemControlB`]): the NMI status |
//!
//! Anything else is an unknown port, as upstream: a write is ignored, a
//! read answers all ones (a floating ISA bus), and the access is logged at
//! debug level: the first [`UNKNOWN_LOG_FIRST`] in full, then one line per
//! [`UNKNOWN_LOG_EVERY`], with the count (all clones share it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::boot::layout;
use crate::pci::PciConfigIo;
use crate::vcpu::PortIo;

use super::power::{PowerDevice, POWER_PORTS};
use super::serial::{SharedSerial, COM1_BASE, COM1_SIZE};

/// Unknown port accesses logged in full.
pub const UNKNOWN_LOG_FIRST: u64 = 16;
/// After the first ones, one unknown access in this many is logged.
pub const UNKNOWN_LOG_EVERY: u64 = 1024;

/// A registered handler.
pub type PortHandler = Arc<Mutex<dyn PortIo>>;

/// System control port B (the PC's "NMI status and control" port).
pub const SYSTEM_CONTROL_B_PORT: u16 = 0x61;
/// What [`SystemControlB`] reads: bit 5 (the PIT's channel 2 output) set,
/// bits 6 and 7 (I/O channel check, PCI SERR) clear; upstream Cloud
/// Hypervisor's value.
pub const SYSTEM_CONTROL_B_VALUE: u8 = 0x20;

/// Port 0x61. Linux reads it to find the source of an NMI (`vm.nmi`): with
/// the all-ones answer of an unknown port it would take every NMI for a
/// PCI system error (bit 7) and an I/O channel check (bit 6); with
/// [`SYSTEM_CONTROL_B_VALUE`] it reports an NMI of unknown reason and goes
/// on. Writes (speaker gate, NMI mask bits) are ignored.
#[derive(Debug, Default)]
pub struct SystemControlB;

impl PortIo for SystemControlB {
    fn io_out(&mut self, _port: u16, _data: &[u8]) {}

    fn io_in(&mut self, _port: u16, data: &mut [u8]) {
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = SYSTEM_CONTROL_B_VALUE;
        }
    }
}

/// Errors of registering port ranges.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum PortsError {
    #[error("port range {name} at {base:#x}: empty")]
    Empty { name: &'static str, base: u16 },
    #[error("port range {name} at {base:#x} (+{len:#x}) goes past 0xffff")]
    Wraps {
        name: &'static str,
        base: u16,
        len: u16,
    },
    #[error(
        "port range {name} at {base:#x} (+{len:#x}) overlaps {other} at {other_base:#x} (+{other_len:#x})"
    )]
    Overlap {
        name: &'static str,
        base: u16,
        len: u16,
        other: &'static str,
        other_base: u16,
        other_len: u16,
    },
}

struct Range {
    name: &'static str,
    base: u16,
    len: u16,
    handler: PortHandler,
}

impl Range {
    /// One past the last port (fits: checked at registration).
    fn end(&self) -> u32 {
        u32::from(self.base) + u32::from(self.len)
    }
}

/// Builds a [`PortBus`].
#[derive(Default)]
pub struct PortBusBuilder {
    ranges: Vec<Range>,
}

impl std::fmt::Debug for PortBusBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.ranges.iter().map(|r| (r.name, r.base, r.len)))
            .finish()
    }
}

impl PortBusBuilder {
    /// An empty bus.
    pub fn new() -> PortBusBuilder {
        PortBusBuilder::default()
    }

    /// Registers `handler` for ports `base..base + len`.
    pub fn add(
        &mut self,
        name: &'static str,
        base: u16,
        len: u16,
        handler: PortHandler,
    ) -> Result<&mut Self, PortsError> {
        if len == 0 {
            return Err(PortsError::Empty { name, base });
        }
        if u32::from(base) + u32::from(len) > 0x1_0000 {
            return Err(PortsError::Wraps { name, base, len });
        }
        let new = Range {
            name,
            base,
            len,
            handler,
        };
        if let Some(o) = self
            .ranges
            .iter()
            .find(|o| u32::from(o.base) < new.end() && u32::from(new.base) < o.end())
        {
            return Err(PortsError::Overlap {
                name,
                base,
                len,
                other: o.name,
                other_base: o.base,
                other_len: o.len,
            });
        }
        let at = self.ranges.partition_point(|r| r.base < base);
        self.ranges.insert(at, new);
        Ok(self)
    }

    /// COM1 at 0x3f8..=0x3ff.
    pub fn add_serial(&mut self, serial: SharedSerial) -> Result<&mut Self, PortsError> {
        self.add("serial", COM1_BASE, COM1_SIZE, serial)
    }

    /// The power ports ([`POWER_PORTS`]), one handler for all.
    pub fn add_power(&mut self, power: Arc<Mutex<PowerDevice>>) -> Result<&mut Self, PortsError> {
        for port in POWER_PORTS {
            self.add("power", port, 1, power.clone())?;
        }
        Ok(self)
    }

    /// System control port B at 0x61 ([`SystemControlB`]).
    pub fn add_system_control_b(&mut self) -> Result<&mut Self, PortsError> {
        self.add(
            "system-control-b",
            SYSTEM_CONTROL_B_PORT,
            1,
            Arc::new(Mutex::new(SystemControlB)),
        )
    }

    /// PCI configuration mechanism #1: 0xcf8 (CONFIG_ADDRESS, dword
    /// accesses start there) and 0xcfa..=0xcff (0xcfc..=0xcff CONFIG_DATA;
    /// the bus answers 0xcfa/0xcfb itself), leaving 0xcf9 to the reset
    /// control register.
    pub fn add_pci_config(&mut self, pci: PciConfigIo) -> Result<&mut Self, PortsError> {
        let start = layout::PCI_CONFIG_IO_START;
        let pci: PortHandler = Arc::new(Mutex::new(pci));
        self.add("pci-config", start, 1, pci.clone())?;
        let after_reset = layout::RESET_CONTROL_PORT + 1;
        self.add(
            "pci-config",
            after_reset,
            start + layout::PCI_CONFIG_IO_SIZE - after_reset,
            pci,
        )
    }

    /// The bus.
    pub fn build(self) -> PortBus {
        PortBus {
            ranges: self.ranges.into(),
            unknown: Arc::new(AtomicU64::new(0)),
        }
    }
}

/// The port I/O bus (cheap to clone: one clone per vCPU).
#[derive(Clone)]
pub struct PortBus {
    ranges: Arc<[Range]>,
    unknown: Arc<AtomicU64>,
}

impl std::fmt::Debug for PortBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortBus")
            .field(
                "ranges",
                &self
                    .ranges
                    .iter()
                    .map(|r| (r.name, r.base, r.len))
                    .collect::<Vec<_>>(),
            )
            .field("unknown", &self.unknown_accesses())
            .finish()
    }
}

fn lock<'a>(m: &'a Mutex<dyn PortIo + 'static>) -> MutexGuard<'a, dyn PortIo + 'static> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PortBus {
    /// The handler of `port`.
    fn find(&self, port: u16) -> Option<&Range> {
        let i = self.ranges.partition_point(|r| r.base <= port);
        let r = self.ranges.get(i.checked_sub(1)?)?;
        (u32::from(port) < r.end()).then_some(r)
    }

    /// Unknown port accesses so far.
    pub fn unknown_accesses(&self) -> u64 {
        self.unknown.load(Ordering::Relaxed)
    }

    /// The name of the handler of `port`, if any.
    pub fn handler_name(&self, port: u16) -> Option<&'static str> {
        self.find(port).map(|r| r.name)
    }

    fn unknown(&self, what: std::fmt::Arguments<'_>) {
        let n = self.unknown.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= UNKNOWN_LOG_FIRST || n.is_multiple_of(UNKNOWN_LOG_EVERY) {
            log::debug!("unknown port {what} ignored ({n} unknown accesses so far)");
        }
    }
}

impl PortIo for PortBus {
    fn io_out(&mut self, port: u16, data: &[u8]) {
        match self.find(port) {
            Some(r) => lock(&r.handler).io_out(port, data),
            None => self.unknown(format_args!("write {port:#x} {data:02x?}")),
        }
    }

    fn io_in(&mut self, port: u16, data: &mut [u8]) {
        match self.find(port) {
            Some(r) => lock(&r.handler).io_in(port, data),
            None => {
                data.fill(0xff);
                self.unknown(format_args!("read {port:#x} ({} bytes)", data.len()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::power::{power_channel, PowerEvent, I8042_COMMAND_PORT};
    use crate::legacy::serial::{IrqTrigger, SerialDevice, SerialOutput};
    use crate::pci::{Mmio64Window, PciBus};
    use std::io;

    /// Records accesses.
    #[derive(Default)]
    struct Rec(Vec<(u16, Vec<u8>)>);

    impl PortIo for Rec {
        fn io_out(&mut self, port: u16, data: &[u8]) {
            self.0.push((port, data.to_vec()));
        }
        fn io_in(&mut self, port: u16, data: &mut [u8]) {
            data.fill(port as u8);
        }
    }

    struct NoIrq;

    impl IrqTrigger for NoIrq {
        fn trigger(&self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn dispatch_by_range_with_absolute_ports() {
        let (a, b) = (
            Arc::new(Mutex::new(Rec::default())),
            Arc::new(Mutex::new(Rec::default())),
        );
        let mut builder = PortBusBuilder::new();
        builder
            .add("b", 0x20, 4, b.clone())
            .unwrap()
            .add("a", 0x10, 0x10, a.clone())
            .unwrap();
        let mut bus = builder.build();
        bus.io_out(0x10, &[1]);
        bus.io_out(0x1f, &[2, 3]);
        bus.io_out(0x23, &[4]);
        let mut d = [0u8; 2];
        bus.io_in(0x21, &mut d);
        assert_eq!(d, [0x21, 0x21]);
        assert_eq!(a.lock().unwrap().0, [(0x10, vec![1]), (0x1f, vec![2, 3])]);
        assert_eq!(b.lock().unwrap().0, [(0x23, vec![4])]);
        assert_eq!(bus.handler_name(0x1f), Some("a"));
        assert_eq!(bus.handler_name(0x24), None);
        assert_eq!(bus.handler_name(0x0f), None);
        assert_eq!(bus.unknown_accesses(), 0);
    }

    #[test]
    fn unknown_ports_read_all_ones_and_are_counted() {
        let mut bus = PortBusBuilder::new().build();
        let mut d = [0u8; 4];
        bus.io_in(0x80, &mut d);
        assert_eq!(d, [0xff; 4]);
        bus.io_out(0x80, &[0x12]);
        // a clone (another vCPU) shares the count
        let mut other = bus.clone();
        for _ in 0..(2 * UNKNOWN_LOG_EVERY) {
            other.io_out(0x2f8, &[0]);
        }
        assert_eq!(bus.unknown_accesses(), 2 + 2 * UNKNOWN_LOG_EVERY);
    }

    #[test]
    fn bad_ranges_are_refused() {
        let h = || Arc::new(Mutex::new(Rec::default())) as PortHandler;
        let mut b = PortBusBuilder::new();
        b.add("x", 0x100, 0x10, h()).unwrap();
        let e = b.add("y", 0x10f, 1, h()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "port range y at 0x10f (+0x1) overlaps x at 0x100 (+0x10)"
        );
        assert!(matches!(
            b.add("y", 0xf8, 0x9, h()),
            Err(PortsError::Overlap { .. })
        ));
        b.add("y", 0xf8, 0x8, h()).unwrap();
        b.add("z", 0x110, 1, h()).unwrap();
        assert!(matches!(
            b.add("e", 0x200, 0, h()),
            Err(PortsError::Empty { .. })
        ));
        assert!(matches!(
            b.add("w", 0xfff0, 0x11, h()),
            Err(PortsError::Wraps { .. })
        ));
        b.add("top", 0xfff0, 0x10, h()).unwrap();
        let bus = b.build();
        assert_eq!(bus.handler_name(0xffff), Some("top"));
    }

    #[test]
    fn the_standard_devices_together() {
        let out = tempfile::NamedTempFile::new().unwrap();
        let serial =
            SerialDevice::new(SerialOutput::file(out.path()).unwrap(), Box::new(NoIrq)).shared();
        let (tx, rx) = power_channel().unwrap();
        let pci_bus = Arc::new(Mutex::new(PciBus::new(Mmio64Window::above(0))));
        let mut b = PortBusBuilder::new();
        b.add_serial(serial.clone())
            .unwrap()
            .add_power(PowerDevice::new(tx).shared())
            .unwrap()
            .add_pci_config(PciConfigIo::new(pci_bus))
            .unwrap();
        let mut bus = b.build();
        let mut vcpu1 = bus.clone();

        // serial output and input
        for &c in b"hi" {
            bus.io_out(COM1_BASE, &[c]);
        }
        assert_eq!(std::fs::read(out.path()).unwrap(), b"hi");
        serial.lock().unwrap().enqueue_input(b"!").unwrap();
        let mut d = [0u8];
        vcpu1.io_in(COM1_BASE + 5, &mut d);
        assert_eq!(d[0] & 1, 1);
        vcpu1.io_in(COM1_BASE, &mut d);
        assert_eq!(d, *b"!");

        // PCI: the host bridge's vendor id through 0xcf8/0xcfc
        bus.io_out(layout::PCI_CONFIG_IO_START, &0x8000_0000u32.to_le_bytes());
        let mut id = [0u8; 4];
        bus.io_in(0xcfc, &mut id);
        assert_ne!(id, [0xff; 4]);
        let mut a = [0u8; 4];
        bus.io_in(layout::PCI_CONFIG_IO_START, &mut a);
        assert_eq!(u32::from_le_bytes(a), 0x8000_0000);

        // power: 0xcf9 is the reset register, not PCI
        bus.io_out(layout::RESET_CONTROL_PORT, &[0x06]);
        vcpu1.io_out(layout::ACPI_SHUTDOWN_PORT, &[0x34]);
        bus.io_out(I8042_COMMAND_PORT, &[0xfe]);
        let got: Vec<_> = std::iter::from_fn(|| rx.try_recv()).collect();
        assert_eq!(
            got,
            [PowerEvent::Reset, PowerEvent::PowerOff, PowerEvent::Reset]
        );
        assert_eq!(bus.unknown_accesses(), 0);

        // COM2 is not there
        bus.io_in(0x2f8 + 5, &mut d);
        assert_eq!(d, [0xff]);
        assert_eq!(bus.unknown_accesses(), 1);
    }

    #[test]
    fn serial_off_leaves_its_ports_unknown() {
        let cfg = crate::config::ConsoleConfig::parse_serial("off").unwrap();
        assert!(
            SerialDevice::from_config(&cfg, &crate::chardev::Backend::Null, Box::new(NoIrq))
                .unwrap()
                .is_none()
        );
        let mut bus = PortBusBuilder::new().build();
        let mut d = [0u8];
        bus.io_in(COM1_BASE + 5, &mut d);
        assert_eq!(d, [0xff]);
        bus.io_out(COM1_BASE, b"x");
        assert_eq!(bus.unknown_accesses(), 2);
    }

    #[test]
    fn system_control_b_reports_no_nmi_source() {
        let mut b = PortBusBuilder::new();
        b.add_system_control_b().unwrap();
        let mut bus = b.build();
        bus.io_out(SYSTEM_CONTROL_B_PORT, &[0x0c]);
        let mut d = [0xaa];
        bus.io_in(SYSTEM_CONTROL_B_PORT, &mut d);
        assert_eq!(d, [0x20]);
        assert_eq!(d[0] & 0xc0, 0, "no SERR, no IOCHK");
        let mut d = [0xaa; 2];
        bus.io_in(SYSTEM_CONTROL_B_PORT, &mut d);
        assert_eq!(d, [0x20, 0]);
        assert_eq!(bus.unknown_accesses(), 0);
        assert_eq!(bus.handler_name(0x60), None);
        assert_eq!(bus.handler_name(0x62), None);
    }
}
