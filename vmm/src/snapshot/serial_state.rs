//! Capture and restore of the COM1 UART's registers and receive FIFO
//! through vm-superio's [`vm_superio::serial::SerialState`] (a child module
//! of `legacy::serial`, kept under `snapshot/`).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::Serial;

use super::{Irq, IrqTrigger, SerialDevice, SerialOutput};
use crate::snapshot::device_state::StateError;
use crate::snapshot::hex_bytes;

/// The receive FIFO's size (vm-superio's 16550A).
const FIFO_SIZE: usize = 64;
/// IER bits a 16550A has.
const IER_VALID: u8 = 0x0f;
/// LSR data ready.
const LSR_DR: u8 = 0x01;

/// The UART's line while a restore rebuilds it: edges are counted until
/// it opens, then passed on.
struct Gate {
    line: Arc<dyn IrqTrigger>,
    open: AtomicBool,
    held: AtomicU64,
}

impl IrqTrigger for Gate {
    fn trigger(&self) -> io::Result<()> {
        if self.open.load(Ordering::SeqCst) {
            self.line.trigger()
        } else {
            self.held.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }
}

/// The saved UART (vm-superio's [`SerialState`], in serde form).
#[allow(missing_docs)] // the 8250 register names
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerialDeviceState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    /// Received bytes the guest has not read yet, hex.
    #[serde(with = "hex_bytes")]
    pub in_buffer: Vec<u8>,
}

impl SerialDevice {
    /// The UART's registers and receive FIFO.
    pub fn state(&self) -> SerialDeviceState {
        let s = self.uart.state();
        SerialDeviceState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    /// Restores `s` (checked first), keeping this device's output and
    /// interrupt line. An interrupt the guest had pending and enabled is
    /// raised again (vm-superio's `from_state`); if raising it fails, the
    /// state is restored all the same and the error says so.
    pub fn restore(&mut self, s: &SerialDeviceState) -> Result<(), StateError> {
        if s.in_buffer.len() > FIFO_SIZE {
            return Err(StateError::TooLong {
                field: "in_buffer",
                len: s.in_buffer.len(),
                max: FIFO_SIZE,
            });
        }
        if s.interrupt_enable & !IER_VALID != 0 {
            return Err(StateError::field(
                "interrupt_enable",
                u64::from(s.interrupt_enable),
                "only bits 0..=3 exist on a 16550A",
            ));
        }
        if (s.line_status & LSR_DR != 0) == s.in_buffer.is_empty() {
            return Err(StateError::field(
                "line_status",
                u64::from(s.line_status),
                "data ready (bit 0) must be set exactly when in_buffer holds bytes",
            ));
        }
        let state = SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        };
        let line = self.uart.interrupt_evt().0.clone();
        // vm-superio's `from_state` raises the interrupts the state has
        // pending and enabled, and on a failed edge would drop the output
        // with its error: the gate holds the edges until the UART is
        // whole, then passes them (and every later one) to the line.
        let gate = Arc::new(Gate {
            line: line.clone(),
            open: AtomicBool::new(false),
            held: AtomicU64::new(0),
        });
        let old = std::mem::replace(&mut self.uart, Serial::new(Irq(line), SerialOutput::Null));
        let out = old.into_writer();
        // Neither error can happen: the FIFO length was checked and the
        // gate's trigger never fails while closed.
        self.uart =
            Serial::from_state(&state, Irq(gate.clone()), NoEvents, out).map_err(|e| match e {
                vm_superio::serial::Error::Trigger(e) | vm_superio::serial::Error::IOError(e) => {
                    StateError::SerialIrq(e)
                }
                vm_superio::serial::Error::FullFifo => StateError::TooLong {
                    field: "in_buffer",
                    len: state.in_buffer.len(),
                    max: FIFO_SIZE,
                },
            })?;
        gate.open.store(true, Ordering::SeqCst);
        for _ in 0..gate.held.swap(0, Ordering::SeqCst) {
            if let Err(e) = gate.line.trigger() {
                self.stats.irq_errors += 1;
                return Err(StateError::SerialIrq(e));
            }
        }
        Ok(())
    }
}
