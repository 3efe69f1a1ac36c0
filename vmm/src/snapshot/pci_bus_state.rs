//! Capture and restore of the [`PciBus`]'s own state: the host bridge's
//! config space and the 0xcf8 address latch (a child module of
//! `pci::bus`, kept under `snapshot/`). The functions on the bus are
//! saved one by one ([`crate::pci::VirtioPciDevice::state`]).

use serde::{Deserialize, Serialize};

use super::{decoded, lock, BarMove, PciAddress, PciBus};
use crate::pci::config::ConfigSpaceState;
use crate::snapshot::device_state::StateError;

/// Bits of CONFIG_ADDRESS the latch keeps (enable, bus, device, function,
/// register); the others read 0.
const CONFIG_ADDRESS_BITS: u32 = 0x80ff_fffc;

/// The saved state of the bus.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciBusState {
    /// The CONFIG_ADDRESS latch (0xcf8).
    pub config_address: u32,
    /// The host bridge's config space.
    pub bridge: ConfigSpaceState,
}

impl PciBus {
    /// The latch and the host bridge.
    pub fn state(&self) -> PciBusState {
        PciBusState {
            config_address: self.config_address,
            bridge: self.bridge.state(),
        }
    }

    /// Restores the latch and the host bridge (checked first).
    pub fn restore(&mut self, s: &PciBusState) -> Result<(), StateError> {
        if s.config_address & !CONFIG_ADDRESS_BITS != 0 {
            return Err(StateError::field(
                "config_address",
                u64::from(s.config_address),
                "reserved bits (30:24, 1:0) set",
            ));
        }
        self.bridge.restore(&s.bridge)?;
        self.config_address = s.config_address;
        Ok(())
    }

    /// Tells the BAR hook of every BAR that decodes now, as a move from
    /// "not decoding": after functions were restored into a fresh bus (on
    /// which nothing decoded), so the KVM side registers their notify
    /// ioeventfds where the guest left the BARs.
    pub fn announce_bars(&mut self) {
        let mut moves = Vec::new();
        for (slot, dev) in self.slots.iter().enumerate() {
            let Some(dev) = dev else { continue };
            let d = lock(dev);
            for spec in d.config().bars() {
                if let Some(base) = decoded(d.config(), spec) {
                    moves.push(BarMove {
                        address: PciAddress {
                            device: slot as u8,
                            function: 0,
                        },
                        bar: spec.index,
                        old: None,
                        new: Some(base),
                    });
                }
            }
        }
        if let Some(hook) = self.bar_hook.as_mut() {
            for m in moves {
                hook(m);
            }
        }
    }
}
