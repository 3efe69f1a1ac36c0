//! Capture and restore of the power ports' one register, 0xcf9's last
//! value (a child module of `legacy::power`, kept under `snapshot/`). The
//! ACPI shutdown port (0x3c0) and the i8042 command port hold nothing;
//! the GED's interrupt is an irqfd whose pending state is the in-kernel
//! irqchip's, saved with the VM state.

use serde::{Deserialize, Serialize};

use super::{PowerDevice, RST_CPU};
use crate::snapshot::device_state::StateError;

/// The saved power ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PowerState {
    /// The last value written to 0xcf9, without the reset bit.
    pub reset_control: u8,
}

impl PowerDevice {
    /// The registers.
    pub fn state(&self) -> PowerState {
        PowerState {
            reset_control: self.reset_control,
        }
    }

    /// Restores `s` (checked first).
    pub fn restore(&mut self, s: &PowerState) -> Result<(), StateError> {
        if s.reset_control & RST_CPU != 0 {
            return Err(StateError::field(
                "reset_control",
                u64::from(s.reset_control),
                "the reset bit (2) is never kept: writing it resets",
            ));
        }
        self.reset_control = s.reset_control;
        Ok(())
    }
}
