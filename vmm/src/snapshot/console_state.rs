//! Capture and restore of the virtio console's input waiting for the
//! guest (a child module of `pci::console`, kept under `snapshot/`). Its
//! queues are saved with its virtio-pci function.

use serde::{Deserialize, Serialize};

use super::{ConsoleInput, INPUT_BUFFER};
use crate::snapshot::device_state::StateError;
use crate::snapshot::hex_bytes;

/// The saved console input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleInputState {
    /// Bytes the guest has not received yet, hex.
    #[serde(with = "hex_bytes")]
    pub pending: Vec<u8>,
}

impl ConsoleInput {
    /// The bytes waiting.
    pub fn state(&self) -> ConsoleInputState {
        ConsoleInputState {
            pending: self.buf.iter().copied().collect(),
        }
    }

    /// Replaces the bytes waiting with `s`'s (checked first).
    pub fn restore(&mut self, s: &ConsoleInputState) -> Result<(), StateError> {
        if s.pending.len() > INPUT_BUFFER {
            return Err(StateError::TooLong {
                field: "pending",
                len: s.pending.len(),
                max: INPUT_BUFFER,
            });
        }
        self.buf.clear();
        self.buf.extend(&s.pending);
        Ok(())
    }
}
