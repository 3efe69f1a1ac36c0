//! Capture and restore of an [`Msix`] table, PBA and control bits (a child
//! module of `pci::msix`, kept under `snapshot/`).

use serde::{Deserialize, Serialize};

use super::{InterruptSink, Msix, MsixEntry, MSIX_ENABLE, MSIX_FUNCTION_MASK};
use crate::snapshot::device_state::StateError;

/// One saved table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MsixEntryState {
    /// Message address.
    pub addr: u64,
    /// Message data.
    pub data: u32,
    /// The entry's mask bit.
    pub masked: bool,
}

/// The saved MSI-X state of a function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MsixState {
    /// Message control's enable and function mask bits.
    pub control: u16,
    /// The table, one entry per vector.
    pub entries: Vec<MsixEntryState>,
    /// The vectors pending (raised while masked), ascending.
    pub pending: Vec<u16>,
}

impl Msix {
    /// The table, PBA and control bits.
    pub fn state(&self) -> MsixState {
        MsixState {
            control: self.control,
            entries: self
                .entries
                .iter()
                .map(|e| MsixEntryState {
                    addr: e.addr,
                    data: e.data,
                    masked: e.masked,
                })
                .collect(),
            pending: (0..self.len()).filter(|&v| self.is_pending(v)).collect(),
        }
    }

    /// Checks `state` against this table (its size, the control bits, the
    /// pending vectors). Changes nothing.
    pub fn check_state(&self, state: &MsixState) -> Result<(), StateError> {
        if state.entries.len() != self.entries.len() {
            return Err(StateError::Count {
                field: "msix.entries".into(),
                got: state.entries.len(),
                expected: self.entries.len(),
            });
        }
        if state.control & !(MSIX_ENABLE | MSIX_FUNCTION_MASK) != 0 {
            return Err(StateError::field(
                "msix.control",
                u64::from(state.control),
                "only the enable (bit 15) and function mask (bit 14) bits are kept",
            ));
        }
        for &v in &state.pending {
            if v >= self.len() {
                return Err(StateError::Vector {
                    field: "msix.pending".into(),
                    vector: v,
                    table: self.len(),
                });
            }
        }
        Ok(())
    }

    /// Restores `state` (checked first) and programs every entry into
    /// `sink` (a KVM sink sets the GSI routes). Pending vectors stay
    /// pending until the guest unmasks them, as before the snapshot.
    pub fn restore(
        &mut self,
        state: &MsixState,
        sink: &dyn InterruptSink,
    ) -> Result<(), StateError> {
        self.check_state(state)?;
        self.control = state.control;
        for (e, s) in self.entries.iter_mut().zip(&state.entries) {
            *e = MsixEntry {
                addr: s.addr,
                data: s.data,
                masked: s.masked,
            };
        }
        self.pending.fill(false);
        for &v in &state.pending {
            self.pending[usize::from(v)] = true;
        }
        for (v, e) in self.entries.iter().enumerate() {
            sink.program(v as u16, *e);
        }
        Ok(())
    }
}
