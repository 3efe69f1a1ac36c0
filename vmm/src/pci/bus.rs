//! PCI segment 0, bus 0: configuration access (mechanism #1 on ports
//! 0xcf8/0xcfc and the ECAM window), the host bridge, device slots, and
//! 64-bit BAR allocation and decoding.
//!
//! Guest-physical layout (x86_64, see also the module docs of [`super`]):
//!
//! | Range | What |
//! |---|---|
//! | `0 .. RAM end` (at most 3 GiB, [`crate::vm::MAX_RAM`]) | guest RAM |
//! | above RAM, 2 MiB aligned | pmem regions ([`crate::vm::Vm::next_region_gpa`]) |
//! | [`ECAM_BASE`] `..+` [`ECAM_SIZE`] (0xe800_0000, 1 MiB) | ECAM, bus 0 only |
//! | [`Mmio64Window::above`] the last pmem region, at least 4 GiB, 1 GiB aligned, [`MMIO64_SIZE`] long | 64-bit memory BARs |
//!
//! The ECAM window sits in the 32-bit hole below 4 GiB (RAM stops at
//! 3 GiB); no pmem region may overlap it ([`overlaps_reserved`]). BARs are
//! pre-assigned by [`PciBus::add_device`] (there is no firmware); a guest
//! that sizes and reprograms them is followed, and every change of what a
//! BAR decodes is reported to the hook set with [`PciBus::set_bar_hook`]
//! (where the KVM side moves its ioeventfds).

use crate::boot::layout;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::config::{BarSpec, ConfigSpace, PciIds, CONFIG_SPACE_SIZE, HEADER_TYPE, VENDOR_ID};
use crate::vcpu::PortIo;

/// Mechanism #1 CONFIG_ADDRESS port (dword access only).
pub const CONFIG_ADDRESS_PORT: u16 = 0xcf8;
/// Mechanism #1 CONFIG_DATA port (0xcfc..=0xcff, any width).
pub const CONFIG_DATA_PORT: u16 = 0xcfc;
/// ECAM (PCIe MMCONFIG) base, from the guest memory layout.
pub const ECAM_BASE: u64 = layout::PCI_ECAM_START;
/// ECAM size: bus 0 only (32 devices x 8 functions x 4 KiB); the ACPI
/// MCFG table describes the same buses.
pub const ECAM_SIZE: u64 = layout::PCI_ECAM_SIZE;
/// Start of the reserved 32-bit hole no pmem region may overlap (ECAM,
/// 32-bit BARs, IO-APIC, LAPIC).
pub const HOLE_START: u64 = layout::MEM_32BIT_HOLE_START;
/// End of the 32-bit hole.
pub const HOLE_END: u64 = 1 << 32;
/// Size of the 64-bit BAR window.
pub const MMIO64_SIZE: u64 = 64 << 30;
/// Alignment of the 64-bit BAR window's base.
pub const MMIO64_ALIGN: u64 = 1 << 30;
/// Host bridge vendor: Red Hat (the QEMU PCIe host bridge's ids, which
/// Linux drives with no quirk).
pub const HOST_BRIDGE_VENDOR: u16 = 0x1b36;
/// Host bridge device: "QEMU PCIe Host bridge".
pub const HOST_BRIDGE_DEVICE: u16 = 0x0008;
/// Slots on the bus; slot 0 is the host bridge.
pub const SLOTS: usize = 32;

/// Whether `[start, start + len)` overlaps the 32-bit hole (ECAM).
pub fn overlaps_reserved(start: u64, len: u64) -> bool {
    start < HOLE_END && start.saturating_add(len) > HOLE_START
}

/// Errors of setting up the bus.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciError {
    #[error("no free PCI slot on bus 0 ({SLOTS} slots)")]
    NoFreeSlot,
    #[error(
        "BAR {index} of {size:#x} bytes does not fit in the 64-bit window {base:#x}..{end:#x}"
    )]
    WindowFull {
        index: usize,
        size: u64,
        base: u64,
        end: u64,
    },
}

/// The 64-bit window BARs are allocated from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mmio64Window {
    /// First address.
    pub base: u64,
    /// Size in bytes.
    pub size: u64,
}

impl Mmio64Window {
    /// The window above `regions_end` (the end of the last pmem region, or
    /// of RAM): at least 4 GiB, [`MMIO64_ALIGN`] aligned, [`MMIO64_SIZE`]
    /// long. The ACPI `_CRS` of the host bridge must describe it.
    pub fn above(regions_end: u64) -> Mmio64Window {
        let base = regions_end
            .max(HOLE_END)
            .div_ceil(MMIO64_ALIGN)
            .saturating_mul(MMIO64_ALIGN);
        Mmio64Window {
            base,
            size: MMIO64_SIZE,
        }
    }

    /// End (exclusive).
    pub fn end(&self) -> u64 {
        self.base.saturating_add(self.size)
    }
}

/// A bus/device/function on segment 0 (bus always 0 here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciAddress {
    /// Device (slot) number, 0..32.
    pub device: u8,
    /// Function number (always 0 for the devices added here).
    pub function: u8,
}

impl std::fmt::Display for PciAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "0000:00:{:02x}.{}", self.device, self.function)
    }
}

/// A PCI function the bus dispatches to. Devices keep their registers in
/// a [`ConfigSpace`]; they may intercept config accesses (capabilities
/// with side effects) by overriding `read_config`/`write_config`.
pub trait PciDevice: Send {
    /// The config space.
    fn config(&self) -> &ConfigSpace;
    /// The config space, mutably (the bus programs BARs through it).
    fn config_mut(&mut self) -> &mut ConfigSpace;
    /// A guest config read at `offset` (0..4096, the access inside one
    /// dword).
    fn read_config(&mut self, offset: usize, data: &mut [u8]) {
        self.config().read(offset, data)
    }
    /// A guest config write at `offset`.
    fn write_config(&mut self, offset: usize, data: &[u8]) {
        self.config_mut().write(offset, data)
    }
    /// A guest read at `offset` inside BAR `bar`.
    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]);
    /// A guest write at `offset` inside BAR `bar`.
    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]);
}

/// A change of what a BAR decodes: `None` means not decoding (memory
/// space disabled, or the BAR being sized).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarMove {
    /// The function.
    pub address: PciAddress,
    /// BAR index.
    pub bar: usize,
    /// Decoded base before.
    pub old: Option<u64>,
    /// Decoded base after.
    pub new: Option<u64>,
}

type SharedDevice = Arc<Mutex<dyn PciDevice>>;
type BarHook = Box<dyn FnMut(BarMove) + Send>;

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The range BAR `spec` decodes now, if any: memory space enabled and an
/// address that does not wrap (all-ones while sizing does).
fn decoded(config: &ConfigSpace, spec: BarSpec) -> Option<u64> {
    if !config.memory_enabled() {
        return None;
    }
    let addr = config.bar_address(spec.index)?;
    if addr == 0 || addr.checked_add(spec.size).is_none() {
        return None;
    }
    Some(addr)
}

/// Bus 0 of segment 0, with its host bridge at 00:00.0.
pub struct PciBus {
    bridge: ConfigSpace,
    slots: Vec<Option<SharedDevice>>,
    config_address: u32,
    window: Mmio64Window,
    next_bar: u64,
    bar_hook: Option<BarHook>,
}

impl std::fmt::Debug for PciBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let used: Vec<usize> = (0..SLOTS).filter(|&i| self.slots[i].is_some()).collect();
        f.debug_struct("PciBus")
            .field("slots", &used)
            .field("window", &self.window)
            .field("next_bar", &self.next_bar)
            .finish()
    }
}

impl PciBus {
    /// A bus with only the host bridge; BARs come from `window`.
    pub fn new(window: Mmio64Window) -> PciBus {
        let bridge = ConfigSpace::new(PciIds {
            vendor: HOST_BRIDGE_VENDOR,
            device: HOST_BRIDGE_DEVICE,
            revision: 0,
            class: (0x06, 0x00, 0x00),
            subsystem_vendor: HOST_BRIDGE_VENDOR,
            subsystem: 0x1100,
        });
        PciBus {
            bridge,
            slots: (0..SLOTS).map(|_| None).collect(),
            config_address: 0,
            window,
            next_bar: window.base,
            bar_hook: None,
        }
    }

    /// The BAR window.
    pub fn window(&self) -> Mmio64Window {
        self.window
    }

    /// Sets the hook told of every change of what a BAR decodes.
    pub fn set_bar_hook(&mut self, hook: impl FnMut(BarMove) + Send + 'static) {
        self.bar_hook = Some(Box::new(hook));
    }

    /// Puts `device` in the first free slot (from 1) and assigns its BARs
    /// from the window, each aligned to its size. Memory decoding stays
    /// off until the guest enables it.
    pub fn add_device(&mut self, device: SharedDevice) -> Result<PciAddress, PciError> {
        let slot = (1..SLOTS)
            .find(|&i| self.slots[i].is_none())
            .ok_or(PciError::NoFreeSlot)?;
        {
            let mut dev = lock(&device);
            let specs: Vec<BarSpec> = dev.config().bars().collect();
            let mut next = self.next_bar;
            let mut assigned = Vec::with_capacity(specs.len());
            for spec in specs {
                let full = || PciError::WindowFull {
                    index: spec.index,
                    size: spec.size,
                    base: self.window.base,
                    end: self.window.end(),
                };
                let addr = next.checked_next_multiple_of(spec.size).ok_or_else(full)?;
                let end = addr.checked_add(spec.size).ok_or_else(full)?;
                if end > self.window.end() {
                    return Err(full());
                }
                assigned.push((spec.index, addr));
                next = end;
            }
            for (index, addr) in assigned {
                dev.config_mut().set_bar_address(index, addr);
            }
            self.next_bar = next;
        }
        self.slots[slot] = Some(device);
        Ok(PciAddress {
            device: slot as u8,
            function: 0,
        })
    }

    /// The device at `slot`, if any.
    pub fn device(&self, slot: u8) -> Option<SharedDevice> {
        self.slots.get(usize::from(slot)).cloned().flatten()
    }

    /// A config read of function `device.function` at `offset` (inside
    /// one dword). Absent functions read all-ones.
    pub fn config_read(&mut self, device: u8, function: u8, offset: usize, data: &mut [u8]) {
        data.fill(0xff);
        if function != 0 || offset.saturating_add(data.len()) > CONFIG_SPACE_SIZE {
            return;
        }
        if device == 0 {
            self.bridge.read(offset, data);
        } else if let Some(dev) = self.device(device) {
            lock(&dev).read_config(offset, data);
        }
    }

    /// A config write; writes to absent functions are dropped.
    pub fn config_write(&mut self, device: u8, function: u8, offset: usize, data: &[u8]) {
        if function != 0 || offset.saturating_add(data.len()) > CONFIG_SPACE_SIZE {
            return;
        }
        if device == 0 {
            self.bridge.write(offset, data);
            return;
        }
        let Some(dev) = self.device(device) else {
            return;
        };
        let moves = {
            let mut d = lock(&dev);
            let before: Vec<(BarSpec, Option<u64>)> = d
                .config()
                .bars()
                .map(|s| (s, decoded(d.config(), s)))
                .collect();
            d.write_config(offset, data);
            let cfg = d.config();
            before
                .into_iter()
                .filter_map(|(s, old)| {
                    let new = decoded(cfg, s);
                    (new != old).then_some(BarMove {
                        address: PciAddress { device, function },
                        bar: s.index,
                        old,
                        new,
                    })
                })
                .collect::<Vec<_>>()
        };
        if let Some(hook) = self.bar_hook.as_mut() {
            for m in moves {
                hook(m);
            }
        }
    }

    /// Port read on 0xcf8..=0xcff. Returns false for other ports.
    pub fn io_read(&mut self, port: u16, data: &mut [u8]) -> bool {
        match port {
            CONFIG_ADDRESS_PORT if data.len() == 4 => {
                data.copy_from_slice(&self.config_address.to_le_bytes());
            }
            CONFIG_ADDRESS_PORT..=0xcfb => data.fill(0xff),
            CONFIG_DATA_PORT..=0xcff => {
                let byte = usize::from(port - CONFIG_DATA_PORT);
                match self.mechanism1_target(byte, data.len()) {
                    Some((dev, func, off)) => self.config_read(dev, func, off, data),
                    None => data.fill(0xff),
                }
            }
            _ => return false,
        }
        true
    }

    /// Port write on 0xcf8..=0xcff. Returns false for other ports.
    pub fn io_write(&mut self, port: u16, data: &[u8]) -> bool {
        match port {
            CONFIG_ADDRESS_PORT => {
                if let Ok(v) = <[u8; 4]>::try_from(data) {
                    // bits 1:0 are reserved (read as 0), 30:24 reserved
                    self.config_address = u32::from_le_bytes(v) & 0x80ff_fffc;
                }
            }
            0xcf9..=0xcfb => {}
            CONFIG_DATA_PORT..=0xcff => {
                let byte = usize::from(port - CONFIG_DATA_PORT);
                if let Some((dev, func, off)) = self.mechanism1_target(byte, data.len()) {
                    self.config_write(dev, func, off, data);
                }
            }
            _ => return false,
        }
        true
    }

    /// (device, function, offset) CONFIG_ADDRESS selects, if enabled, on
    /// bus 0, and the access stays inside the dword.
    fn mechanism1_target(&self, byte: usize, len: usize) -> Option<(u8, u8, usize)> {
        let a = self.config_address;
        if a & 0x8000_0000 == 0 || (a >> 16) & 0xff != 0 || byte + len > 4 {
            return None;
        }
        let device = ((a >> 11) & 0x1f) as u8;
        let function = ((a >> 8) & 0x7) as u8;
        Some((device, function, (a & 0xfc) as usize + byte))
    }

    /// The ECAM target of `addr`, if it is inside the window and the access
    /// stays inside one dword.
    fn ecam_target(addr: u64, len: usize) -> Option<(u8, u8, usize)> {
        let off = addr.checked_sub(ECAM_BASE).filter(|&o| o < ECAM_SIZE)?;
        let reg = (off & 0xfff) as usize;
        if (reg & 3) + len > 4 {
            return None;
        }
        Some((((off >> 15) & 0x1f) as u8, ((off >> 12) & 0x7) as u8, reg))
    }

    /// An MMIO read: ECAM or a decoded BAR. Returns false if nothing
    /// claims `addr` (the caller logs it and answers zeros).
    pub fn mmio_read(&mut self, addr: u64, data: &mut [u8]) -> bool {
        if (ECAM_BASE..ECAM_BASE + ECAM_SIZE).contains(&addr) {
            match Self::ecam_target(addr, data.len()) {
                Some((dev, func, off)) => self.config_read(dev, func, off, data),
                None => data.fill(0xff),
            }
            return true;
        }
        match self.bar_target(addr, data.len()) {
            Some((dev, bar, off)) => {
                lock(&dev).read_bar(bar, off, data);
                true
            }
            None => false,
        }
    }

    /// An MMIO write: ECAM or a decoded BAR. Returns false if nothing
    /// claims `addr`.
    pub fn mmio_write(&mut self, addr: u64, data: &[u8]) -> bool {
        if (ECAM_BASE..ECAM_BASE + ECAM_SIZE).contains(&addr) {
            if let Some((dev, func, off)) = Self::ecam_target(addr, data.len()) {
                self.config_write(dev, func, off, data);
            }
            return true;
        }
        match self.bar_target(addr, data.len()) {
            Some((dev, bar, off)) => {
                lock(&dev).write_bar(bar, off, data);
                true
            }
            None => false,
        }
    }

    /// The device, BAR and offset decoding `[addr, addr + len)`.
    fn bar_target(&self, addr: u64, len: usize) -> Option<(SharedDevice, usize, u64)> {
        let last = addr.checked_add(len.max(1) as u64 - 1)?;
        for dev in self.slots.iter().flatten() {
            let d = lock(dev);
            for spec in d.config().bars() {
                if let Some(base) = decoded(d.config(), spec) {
                    if addr >= base && last < base + spec.size {
                        return Some((dev.clone(), spec.index, addr - base));
                    }
                }
            }
        }
        None
    }

    /// Whether function `device` exists (for tests and the ACPI builder).
    pub fn present(&mut self, device: u8) -> bool {
        let mut v = [0u8; 2];
        self.config_read(device, 0, VENDOR_ID, &mut v);
        u16::from_le_bytes(v) != 0xffff
    }

    /// The header type of the host bridge (always 0: single function).
    pub fn bridge_header_type(&self) -> u8 {
        let mut b = [0u8];
        self.bridge.read(HEADER_TYPE, &mut b);
        b[0]
    }
}

/// Mechanism #1 as a [`PortIo`] handler over a shared bus (each vCPU holds
/// a clone). Other ports are logged at debug level; reads answer zeros.
#[derive(Debug, Clone)]
pub struct PciConfigIo {
    bus: Arc<Mutex<PciBus>>,
}

impl PciConfigIo {
    /// A handler for `bus`.
    pub fn new(bus: Arc<Mutex<PciBus>>) -> PciConfigIo {
        PciConfigIo { bus }
    }
}

impl PortIo for PciConfigIo {
    fn io_out(&mut self, port: u16, data: &[u8]) {
        if !lock(&self.bus).io_write(port, data) {
            log::debug!("unhandled port write {port:#x} {data:x?}");
        }
    }

    fn io_in(&mut self, port: u16, data: &mut [u8]) {
        if !lock(&self.bus).io_read(port, data) {
            log::debug!("unhandled port read {port:#x} ({} bytes)", data.len());
            data.fill(0);
        }
    }
}

// Snapshot state (issue 17): capture and restore, kept under snapshot/.
#[path = "../snapshot/pci_bus_state.rs"]
mod state;
pub use state::PciBusState;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_is_above_4g_and_the_regions_and_aligned() {
        assert_eq!(Mmio64Window::above(0).base, 4 << 30);
        assert_eq!(Mmio64Window::above((4 << 30) + 1).base, 5 << 30);
        assert_eq!(Mmio64Window::above(7 << 30).base, 7 << 30);
        assert!(overlaps_reserved(0xe000_0000, 0x1000));
        assert!(overlaps_reserved(0x8000_0000, 0x8000_0000));
        assert!(!overlaps_reserved(0x8000_0000, 0x4000_0000));
        assert!(!overlaps_reserved(4 << 30, 1 << 30));
    }

    #[test]
    fn absent_functions_and_bad_accesses_read_all_ones() {
        let mut bus = PciBus::new(Mmio64Window::above(0));
        assert!(bus.present(0));
        assert!(!bus.present(1));
        assert_eq!(bus.bridge_header_type(), 0);
        let mut d = [0u8; 4];
        // disabled CONFIG_ADDRESS
        bus.io_write(CONFIG_ADDRESS_PORT, &0u32.to_le_bytes());
        bus.io_read(CONFIG_DATA_PORT, &mut d);
        assert_eq!(d, [0xff; 4]);
        // bus 1
        bus.io_write(CONFIG_ADDRESS_PORT, &0x8001_0000u32.to_le_bytes());
        bus.io_read(CONFIG_DATA_PORT, &mut d);
        assert_eq!(d, [0xff; 4]);
        // a byte write to 0xcf8 does not change the latch
        bus.io_write(CONFIG_ADDRESS_PORT, &[0]);
        let mut a = [0u8; 4];
        bus.io_read(CONFIG_ADDRESS_PORT, &mut a);
        assert_eq!(u32::from_le_bytes(a), 0x8001_0000);
        // an access crossing the dword
        bus.io_write(CONFIG_ADDRESS_PORT, &0x8000_0000u32.to_le_bytes());
        let mut w = [0u8; 4];
        bus.io_read(CONFIG_DATA_PORT + 2, &mut w);
        assert_eq!(w, [0xff; 4]);
        // ECAM past the bridge's config space end, and a crossing access
        let mut e = [0u8; 4];
        assert!(bus.mmio_read(ECAM_BASE + 0xffe, &mut e));
        assert_eq!(e, [0xff; 4]);
        assert!(!bus.mmio_read(ECAM_BASE + ECAM_SIZE, &mut e));
        assert!(!bus.io_read(0x3f8, &mut e));
    }
}
