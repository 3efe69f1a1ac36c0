//! A function's PCI configuration space (type 0 header), as a register file
//! with per-byte write masks.
//!
//! A read returns the stored bytes; a write changes only the bits its write
//! mask allows, so read-only registers (ids, class, status, capability
//! bodies) ignore writes and BAR sizing works by construction: a BAR's mask
//! covers only its address bits above its size, so writing all-ones and
//! reading back gives `!(size - 1)` plus the read-only flag bits.

/// Config space size through ECAM (4 KiB); mechanism #1 reaches the first
/// 256 bytes.
pub const CONFIG_SPACE_SIZE: usize = 4096;

/// Vendor ID (u16).
pub const VENDOR_ID: usize = 0x00;
/// Device ID (u16).
pub const DEVICE_ID: usize = 0x02;
/// Command register (u16).
pub const COMMAND: usize = 0x04;
/// Status register (u16).
pub const STATUS: usize = 0x06;
/// Revision ID (u8), then prog-if, subclass, class.
pub const REVISION: usize = 0x08;
/// Header type (u8).
pub const HEADER_TYPE: usize = 0x0e;
/// BAR 0 (u32); BAR n at `BAR0 + 4 * n`.
pub const BAR0: usize = 0x10;
/// Subsystem vendor ID (u16).
pub const SUBSYSTEM_VENDOR_ID: usize = 0x2c;
/// Subsystem ID (u16).
pub const SUBSYSTEM_ID: usize = 0x2e;
/// Capabilities pointer (u8).
pub const CAPABILITIES_POINTER: usize = 0x34;
/// Interrupt line (u8), then interrupt pin (u8).
pub const INTERRUPT_LINE: usize = 0x3c;

/// Command: memory space decoding enabled.
pub const COMMAND_MEMORY: u16 = 1 << 1;
/// Command bits a guest may change: memory space, bus master, parity
/// error response, SERR#, INTx disable. I/O space stays 0 (no I/O BARs).
const COMMAND_WRITABLE: u16 = (1 << 1) | (1 << 2) | (1 << 6) | (1 << 8) | (1 << 10);
/// Status: capabilities list present.
const STATUS_CAPABILITIES: u16 = 1 << 4;
/// First capability offset (the header ends at 0x40).
const FIRST_CAPABILITY: usize = 0x40;
/// Standard config space end: capabilities must fit below it.
const STANDARD_END: usize = 0x100;

/// BAR flag bits: 64-bit memory BAR (type 0b10 in bits 2:1).
const BAR_MEM64: u32 = 0b100;

/// The identity of a function, written into its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciIds {
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Revision ID.
    pub revision: u8,
    /// Class code: base class, subclass, programming interface.
    pub class: (u8, u8, u8),
    /// Subsystem vendor ID.
    pub subsystem_vendor: u16,
    /// Subsystem ID.
    pub subsystem: u16,
}

/// A memory BAR a function asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarSpec {
    /// BAR index (0..=4 for 64-bit BARs, which use two slots).
    pub index: usize,
    /// Size in bytes: a power of two, at least 4 KiB.
    pub size: u64,
    /// Prefetchable.
    pub prefetchable: bool,
}

/// Errors of building a config space (programming errors of a device
/// model, reported rather than panicking).
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("BAR {index}: size {size:#x} must be a power of two of at least 4 KiB")]
    BarSize { index: usize, size: u64 },
    #[error("BAR {index}: a 64-bit BAR needs slots {index} and {index}+1 free, both below 6")]
    BarSlot { index: usize },
    #[error("capability of {len} bytes does not fit in the standard config space")]
    CapabilityFull { len: usize },
    #[error("capability body of {len} bytes: must be at least 2 (id and next)")]
    CapabilityLength { len: usize },
}

/// Config space contents and write masks.
#[derive(Clone)]
pub struct ConfigSpace {
    bytes: Box<[u8; CONFIG_SPACE_SIZE]>,
    wmask: Box<[u8; CONFIG_SPACE_SIZE]>,
    /// Size of each 64-bit BAR by its first index.
    bars: [Option<BarSpec>; 6],
    /// Offset of the last capability (its next pointer is patched).
    last_capability: Option<usize>,
    next_capability: usize,
}

impl std::fmt::Debug for ConfigSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigSpace")
            .field("vendor", &self.read_u16(VENDOR_ID))
            .field("device", &self.read_u16(DEVICE_ID))
            .field("bars", &self.bars)
            .finish()
    }
}

impl ConfigSpace {
    /// A type 0 header with the given identity, no BARs, no capabilities,
    /// no INTx pin.
    pub fn new(ids: PciIds) -> ConfigSpace {
        let mut c = ConfigSpace {
            bytes: Box::new([0; CONFIG_SPACE_SIZE]),
            wmask: Box::new([0; CONFIG_SPACE_SIZE]),
            bars: [None; 6],
            last_capability: None,
            next_capability: FIRST_CAPABILITY,
        };
        c.set_u16(VENDOR_ID, ids.vendor);
        c.set_u16(DEVICE_ID, ids.device);
        c.bytes[REVISION] = ids.revision;
        c.bytes[REVISION + 1] = ids.class.2;
        c.bytes[REVISION + 2] = ids.class.1;
        c.bytes[REVISION + 3] = ids.class.0;
        c.bytes[HEADER_TYPE] = 0;
        c.set_u16(SUBSYSTEM_VENDOR_ID, ids.subsystem_vendor);
        c.set_u16(SUBSYSTEM_ID, ids.subsystem);
        c.set_wmask_u16(COMMAND, COMMAND_WRITABLE);
        c.wmask[INTERRUPT_LINE] = 0xff;
        c
    }

    /// Declares a 64-bit memory BAR at `spec.index` (and `index + 1`).
    pub fn add_bar64(&mut self, spec: BarSpec) -> Result<(), ConfigError> {
        if !spec.size.is_power_of_two() || spec.size < 4096 {
            return Err(ConfigError::BarSize {
                index: spec.index,
                size: spec.size,
            });
        }
        let i = spec.index;
        if i >= 5 || self.bar_slot_used(i) || self.bar_slot_used(i + 1) {
            return Err(ConfigError::BarSlot { index: i });
        }
        let flags = BAR_MEM64 | if spec.prefetchable { 1 << 3 } else { 0 };
        let mask = !(spec.size - 1);
        let off = BAR0 + 4 * i;
        self.set_u32(off, flags);
        self.set_wmask_u32(off, (mask as u32) & !0xf);
        self.set_wmask_u32(off + 4, (mask >> 32) as u32);
        self.bars[i] = Some(spec);
        Ok(())
    }

    fn bar_slot_used(&self, i: usize) -> bool {
        self.bars[i].is_some() || (i > 0 && self.bars[i - 1].is_some())
    }

    /// The declared BARs.
    pub fn bars(&self) -> impl Iterator<Item = BarSpec> + '_ {
        self.bars.iter().flatten().copied()
    }

    /// The address BAR `index` holds now (whatever its decoding state).
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let spec = self.bars.get(index).copied().flatten()?;
        let off = BAR0 + 4 * spec.index;
        let lo = u64::from(self.read_u32(off) & !0xf);
        let hi = u64::from(self.read_u32(off + 4));
        Some((hi << 32) | lo)
    }

    /// Programs BAR `index` to `addr` (the bus's allocation; the low bits
    /// below the BAR's size are dropped as the hardware would).
    pub fn set_bar_address(&mut self, index: usize, addr: u64) {
        if self.bars.get(index).copied().flatten().is_some() {
            let off = BAR0 + 4 * index;
            self.write(off, &(addr as u32).to_le_bytes());
            self.write(off + 4, &((addr >> 32) as u32).to_le_bytes());
        }
    }

    /// Whether memory space decoding is on (command bit 1).
    pub fn memory_enabled(&self) -> bool {
        self.read_u16(COMMAND) & COMMAND_MEMORY != 0
    }

    /// Appends a capability. `body` starts with the capability id and a
    /// placeholder next pointer (patched here); `wmask` (same length or
    /// shorter, missing bytes read-only) says which bits the guest may
    /// change. Returns the capability's offset.
    pub fn add_capability(&mut self, body: &[u8], wmask: &[u8]) -> Result<usize, ConfigError> {
        if body.len() < 2 {
            return Err(ConfigError::CapabilityLength { len: body.len() });
        }
        let off = self.next_capability;
        let end = off + body.len();
        if end > STANDARD_END {
            return Err(ConfigError::CapabilityFull { len: body.len() });
        }
        self.bytes[off..end].copy_from_slice(body);
        self.bytes[off + 1] = 0;
        let n = wmask.len().min(body.len());
        self.wmask[off..off + n].copy_from_slice(&wmask[..n]);
        // id and next are never writable
        self.wmask[off] = 0;
        self.wmask[off + 1] = 0;
        match self.last_capability {
            None => {
                self.bytes[CAPABILITIES_POINTER] = off as u8;
                let status = self.read_u16(STATUS) | STATUS_CAPABILITIES;
                self.set_u16(STATUS, status);
            }
            Some(last) => self.bytes[last + 1] = off as u8,
        }
        self.last_capability = Some(off);
        self.next_capability = (end + 3) & !3;
        Ok(off)
    }

    /// Reads `data.len()` bytes at `offset`; bytes past the end read as
    /// all-ones (as a master abort would).
    pub fn read(&self, offset: usize, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i)
                .and_then(|o| self.bytes.get(o))
                .copied()
                .unwrap_or(0xff);
        }
    }

    /// Writes `data` at `offset` through the write mask; bytes past the end
    /// are dropped.
    pub fn write(&mut self, offset: usize, data: &[u8]) {
        for (i, &v) in data.iter().enumerate() {
            let Some(o) = offset.checked_add(i) else {
                return;
            };
            if let (Some(b), Some(&m)) = (self.bytes.get_mut(o), self.wmask.get(o)) {
                *b = (*b & !m) | (v & m);
            }
        }
    }

    /// The u16 at `offset` (0 past the end).
    pub fn read_u16(&self, offset: usize) -> u16 {
        let mut b = [0; 2];
        self.read(offset, &mut b);
        u16::from_le_bytes(b)
    }

    /// The u32 at `offset` (all-ones past the end).
    pub fn read_u32(&self, offset: usize) -> u32 {
        let mut b = [0; 4];
        self.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    /// Sets a u16 regardless of the write mask (device side).
    pub fn set_u16(&mut self, offset: usize, v: u16) {
        self.set_bytes(offset, &v.to_le_bytes());
    }

    /// Sets a u32 regardless of the write mask (device side).
    pub fn set_u32(&mut self, offset: usize, v: u32) {
        self.set_bytes(offset, &v.to_le_bytes());
    }

    fn set_bytes(&mut self, offset: usize, v: &[u8]) {
        if let Some(dst) = offset
            .checked_add(v.len())
            .and_then(|end| self.bytes.get_mut(offset..end))
        {
            dst.copy_from_slice(v);
        }
    }

    fn set_wmask_u16(&mut self, offset: usize, v: u16) {
        self.wmask[offset..offset + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn set_wmask_u32(&mut self, offset: usize, v: u32) {
        self.wmask[offset..offset + 4].copy_from_slice(&v.to_le_bytes());
    }
}

// Snapshot state (issue 17): capture and restore, kept under snapshot/.
#[path = "../snapshot/pci_config_state.rs"]
mod state;
pub use state::ConfigSpaceState;

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> PciIds {
        PciIds {
            vendor: 0x1234,
            device: 0x5678,
            revision: 2,
            class: (0x06, 0x00, 0x00),
            subsystem_vendor: 0x1234,
            subsystem: 1,
        }
    }

    #[test]
    fn header_is_read_only_and_bar_sizing_gives_the_size_mask() {
        let mut c = ConfigSpace::new(ids());
        c.add_bar64(BarSpec {
            index: 0,
            size: 0x8000,
            prefetchable: false,
        })
        .unwrap();
        c.write(VENDOR_ID, &[0, 0, 0, 0]);
        assert_eq!(c.read_u32(VENDOR_ID), 0x5678_1234);
        assert_eq!(c.read_u32(REVISION), 0x0600_0002);
        c.write(BAR0, &[0xff; 8]);
        assert_eq!(c.read_u32(BAR0), 0xffff_8004);
        assert_eq!(c.read_u32(BAR0 + 4), 0xffff_ffff);
        c.set_bar_address(0, 0x10_0000_8000);
        assert_eq!(c.bar_address(0), Some(0x10_0000_8000));
        assert_eq!(c.read_u32(BAR0), 0x8004);
        // BAR 2..5 unimplemented: read as 0, writes ignored
        c.write(BAR0 + 8, &[0xff; 4]);
        assert_eq!(c.read_u32(BAR0 + 8), 0);
        assert_eq!(c.read_u32(0x1000), 0xffff_ffff);
    }

    #[test]
    fn capabilities_chain_and_bad_bars_are_refused() {
        let mut c = ConfigSpace::new(ids());
        assert_eq!(c.add_capability(&[0x09, 0xaa, 3], &[]), Ok(0x40));
        assert_eq!(c.add_capability(&[0x11, 0, 0, 0], &[0, 0, 0xff]), Ok(0x44));
        assert_eq!(c.bytes[CAPABILITIES_POINTER], 0x40);
        assert_eq!(c.bytes[0x41], 0x44);
        assert_eq!(c.bytes[0x45], 0);
        assert_ne!(c.read_u16(STATUS) & STATUS_CAPABILITIES, 0);
        c.write(0x44, &[0xff; 4]);
        assert_eq!(c.read_u32(0x44), 0x00ff_0011);
        assert!(c.add_capability(&[0; 200], &[]).is_err());
        assert!(c.add_capability(&[0], &[]).is_err());
        let bar = |index, size| BarSpec {
            index,
            size,
            prefetchable: true,
        };
        assert!(c.add_bar64(bar(0, 0x1000)).is_ok());
        assert!(c.add_bar64(bar(1, 0x1000)).is_err());
        assert!(c.add_bar64(bar(5, 0x1000)).is_err());
        assert!(c.add_bar64(bar(2, 0x1800)).is_err());
        assert!(c.add_bar64(bar(2, 0x800)).is_err());
    }
}
