//! Capture and restore of a [`ConfigSpace`] (a child module of
//! `pci::config`, kept under `snapshot/`).
//!
//! The state is the standard 256-byte header and capability area (every
//! writable bit lives there). A restore writes only the bits the write
//! mask lets the guest change, and refuses a saved byte whose read-only
//! bits differ from the device's: that state is not this device's.

use serde::{Deserialize, Serialize};

use super::{ConfigSpace, STANDARD_END};
use crate::snapshot::device_state::StateError;
use crate::snapshot::hex_bytes;

/// The saved config space of a function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigSpaceState {
    /// Bytes 0..0x100, hex.
    #[serde(with = "hex_bytes")]
    pub bytes: Vec<u8>,
}

impl ConfigSpace {
    /// The guest-visible state (the standard area).
    pub fn state(&self) -> ConfigSpaceState {
        ConfigSpaceState {
            bytes: self.bytes[..STANDARD_END].to_vec(),
        }
    }

    /// Checks `state` against this device: its length, and that every
    /// read-only bit matches. Changes nothing.
    pub fn check_state(&self, state: &ConfigSpaceState) -> Result<(), StateError> {
        if state.bytes.len() != STANDARD_END {
            return Err(StateError::Count {
                field: "config space bytes".into(),
                got: state.bytes.len(),
                expected: STANDARD_END,
            });
        }
        for (offset, &saved) in state.bytes.iter().enumerate() {
            let ro = !self.wmask[offset];
            if saved & ro != self.bytes[offset] & ro {
                return Err(StateError::ReadOnlyConfig {
                    offset,
                    saved,
                    device: self.bytes[offset],
                });
            }
        }
        Ok(())
    }

    /// The address BAR `index` would hold with `state` (checked with
    /// [`ConfigSpace::check_state`] first).
    pub fn state_bar_address(&self, state: &ConfigSpaceState, index: usize) -> Option<u64> {
        let mut c = self.clone();
        c.apply_state(state);
        c.bar_address(index)
    }

    /// Whether memory decoding is on in `state`.
    pub fn state_memory_enabled(state: &ConfigSpaceState) -> bool {
        let cmd = state
            .bytes
            .get(super::COMMAND..super::COMMAND + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .unwrap_or(0);
        cmd & super::COMMAND_MEMORY != 0
    }

    /// Restores `state`, checked first.
    pub fn restore(&mut self, state: &ConfigSpaceState) -> Result<(), StateError> {
        self.check_state(state)?;
        self.apply_state(state);
        Ok(())
    }

    fn apply_state(&mut self, state: &ConfigSpaceState) {
        for (offset, &saved) in state.bytes.iter().enumerate().take(STANDARD_END) {
            let m = self.wmask[offset];
            self.bytes[offset] = (self.bytes[offset] & !m) | (saved & m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BarSpec, PciIds, BAR0, COMMAND, INTERRUPT_LINE, VENDOR_ID};
    use super::*;

    fn space() -> ConfigSpace {
        let mut c = ConfigSpace::new(PciIds {
            vendor: 0x1af4,
            device: 0x1044,
            revision: 1,
            class: (0xff, 0, 0),
            subsystem_vendor: 0x1af4,
            subsystem: 0x40,
        });
        c.add_bar64(BarSpec {
            index: 0,
            size: 0x8000,
            prefetchable: false,
        })
        .unwrap();
        c
    }

    #[test]
    fn writable_registers_survive_and_read_only_ones_are_checked() {
        let mut a = space();
        a.write(COMMAND, &[0x06, 0x00]);
        a.write(INTERRUPT_LINE, &[0x0b]);
        a.set_bar_address(0, 0x1_4000_8000);
        let s = a.state();
        let json = serde_json::to_string(&s).unwrap();
        let s: ConfigSpaceState = serde_json::from_str(&json).unwrap();
        let mut b = space();
        assert_eq!(b.state_bar_address(&s, 0), Some(0x1_4000_8000));
        assert!(ConfigSpace::state_memory_enabled(&s));
        b.restore(&s).unwrap();
        assert_eq!(b.read_u16(COMMAND), 0x06);
        assert_eq!(b.read_u32(INTERRUPT_LINE) & 0xff, 0x0b);
        assert_eq!(b.bar_address(0), Some(0x1_4000_8000));
        assert_eq!(b.state(), a.state());

        let mut bad = s.clone();
        bad.bytes[VENDOR_ID] ^= 1;
        assert!(matches!(
            b.restore(&bad),
            Err(StateError::ReadOnlyConfig { offset: 0, .. })
        ));
        // BAR flag bits (64-bit memory) are read-only too.
        let mut bad = s.clone();
        bad.bytes[BAR0] &= !0b100;
        assert!(matches!(
            b.restore(&bad),
            Err(StateError::ReadOnlyConfig { offset: BAR0, .. })
        ));
        let mut short = s;
        short.bytes.truncate(10);
        assert!(matches!(
            b.restore(&short),
            Err(StateError::Count { got: 10, .. })
        ));
        assert!(serde_json::from_str::<ConfigSpaceState>(r#"{"bytes": "0g"}"#).is_err());
    }
}
