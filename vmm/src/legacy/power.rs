//! Power off and reset requests from the guest: the ports a guest uses,
//! turned into [`PowerEvent`]s for the control loop.
//!
//! - [`layout::ACPI_SHUTDOWN_PORT`] (0x3c0), the FADT's sleep control and
//!   reset register (see [`crate::acpi`]): a byte decoded with
//!   [`decode_shutdown_port_write`], 0x34 (S5 | `SLP_EN`) powers off, 1
//!   resets; anything else is ignored. Reads answer 0.
//! - [`layout::RESET_CONTROL_PORT`] (0xcf9, `reboot=pci` and Linux's
//!   fallback): a write with [`RST_CPU`] (bit 2) set resets. Reads answer
//!   the last value written without that bit (Linux reads it before its
//!   two writes).
//! - The i8042 command port [`I8042_COMMAND_PORT`] (0x64, `reboot=kbd`
//!   and Linux's fallback when the ACPI reset did not take): the
//!   [`I8042_RESET`] command (0xfe, pulse the CPU reset line) resets. Reads
//!   answer 0: the status of a controller with empty buffers, so the
//!   kernel's wait for an empty input buffer ends at once.
//!
//! Events go through a channel whose receiving side also has an eventfd
//! ([`PowerEventReceiver`] is `AsRawFd`) for the control loop's epoll. The
//! guest's vCPUs keep running after the write; stopping them is the
//! control loop's job. A guest may ask more than once (Linux tries ACPI,
//! then the keyboard controller, then 0xcf9, ... until it is reset): the
//! loop acts on the first event and discards the rest.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::acpi::{decode_shutdown_port_write, ShutdownRequest};
use crate::boot::layout;
use crate::vcpu::PortIo;

/// The i8042 keyboard controller's command (write) and status (read) port.
pub const I8042_COMMAND_PORT: u16 = 0x64;
/// The i8042 command that pulses the CPU reset line.
pub const I8042_RESET: u8 = 0xfe;
/// Reset control register (0xcf9): reset the CPU.
pub const RST_CPU: u8 = 1 << 2;
/// The ports [`PowerDevice`] handles, each one byte wide.
pub const POWER_PORTS: [u16; 3] = [
    layout::ACPI_SHUTDOWN_PORT,
    layout::RESET_CONTROL_PORT,
    I8042_COMMAND_PORT,
];

/// What the guest asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PowerEvent {
    /// Power off: the VMM ends with exit code 0.
    PowerOff,
    /// Reset: the VMM restarts the guest.
    Reset,
}

impl From<ShutdownRequest> for PowerEvent {
    fn from(r: ShutdownRequest) -> PowerEvent {
        match r {
            ShutdownRequest::PowerOff => PowerEvent::PowerOff,
            ShutdownRequest::Reset => PowerEvent::Reset,
        }
    }
}

/// Errors of the power event channel.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum PowerError {
    #[error("creating the power event eventfd")]
    EventFd(#[source] io::Error),
}

/// The sending side of the power event channel (cloneable).
#[derive(Debug, Clone)]
pub struct PowerEvents {
    tx: Sender<PowerEvent>,
    wake: Arc<EventFd>,
}

/// The control loop's side: poll [`AsRawFd::as_raw_fd`] for readability,
/// then [`PowerEventReceiver::try_recv`] until `None`.
#[derive(Debug)]
pub struct PowerEventReceiver {
    rx: Receiver<PowerEvent>,
    wake: Arc<EventFd>,
}

/// A new power event channel.
pub fn power_channel() -> Result<(PowerEvents, PowerEventReceiver), PowerError> {
    let wake = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(PowerError::EventFd)?);
    let (tx, rx) = mpsc::channel();
    Ok((
        PowerEvents {
            tx,
            wake: wake.clone(),
        },
        PowerEventReceiver { rx, wake },
    ))
}

impl PowerEvents {
    /// Sends `event` and wakes the receiver's eventfd. A receiver that is
    /// gone (the VMM is shutting down) is not an error.
    pub fn send(&self, event: PowerEvent) {
        if self.tx.send(event).is_err() {
            log::debug!("power event {event:?} after the control loop ended");
            return;
        }
        if let Err(e) = self.wake.write(1) {
            log::warn!("power event {event:?}: waking the control loop failed: {e}");
        }
    }
}

impl PowerEventReceiver {
    /// The next event, if one is waiting (also clears the eventfd).
    pub fn try_recv(&self) -> Option<PowerEvent> {
        // Clear the eventfd before looking: an event sent after this read
        // is either seen below or wakes the loop again.
        let _ = self.wake.read();
        self.rx.try_recv().ok()
    }

    /// Waits up to `timeout` for an event (tests, simple loops).
    pub fn recv_timeout(&self, timeout: Duration) -> Option<PowerEvent> {
        self.rx.recv_timeout(timeout).ok()
    }
}

impl AsRawFd for PowerEventReceiver {
    fn as_raw_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }
}

/// The power ports as one [`PortIo`] handler (share it between vCPUs as
/// `Arc<Mutex<_>>`; see [`super::ports::PortBusBuilder::add_power`]).
#[derive(Debug)]
pub struct PowerDevice {
    events: PowerEvents,
    /// Last value written to 0xcf9, without [`RST_CPU`].
    reset_control: u8,
}

impl PowerDevice {
    /// A device sending to `events`.
    pub fn new(events: PowerEvents) -> PowerDevice {
        PowerDevice {
            events,
            reset_control: 0,
        }
    }

    /// The device wrapped for sharing.
    pub fn shared(self) -> Arc<Mutex<PowerDevice>> {
        Arc::new(Mutex::new(self))
    }

    /// What a byte written to `port` asks for, updating the registers.
    fn decode(&mut self, port: u16, value: u8) -> Option<PowerEvent> {
        match port {
            layout::ACPI_SHUTDOWN_PORT => decode_shutdown_port_write(value).map(PowerEvent::from),
            layout::RESET_CONTROL_PORT => {
                self.reset_control = value & !RST_CPU;
                (value & RST_CPU != 0).then_some(PowerEvent::Reset)
            }
            I8042_COMMAND_PORT => (value == I8042_RESET).then_some(PowerEvent::Reset),
            _ => None,
        }
    }
}

impl PortIo for PowerDevice {
    /// The low byte of a write counts (the registers are one byte).
    fn io_out(&mut self, port: u16, data: &[u8]) {
        let Some(&value) = data.first() else {
            return;
        };
        match self.decode(port, value) {
            Some(event) => {
                log::info!("guest requested {event:?} (port {port:#x} value {value:#x})");
                self.events.send(event);
            }
            None => log::debug!("power port {port:#x}: value {value:#x} ignored"),
        }
    }

    fn io_in(&mut self, port: u16, data: &mut [u8]) {
        data.fill(0);
        if port == layout::RESET_CONTROL_PORT {
            if let Some(b) = data.first_mut() {
                *b = self.reset_control;
            }
        }
    }
}

// Snapshot state (issue 17): capture and restore, kept under snapshot/.
#[path = "../snapshot/power_state.rs"]
mod state;
pub use state::PowerState;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acpi::{RESET_VALUE, S5_SLEEP_TYPE, SLP_EN};

    fn dev() -> (PowerDevice, PowerEventReceiver) {
        let (tx, rx) = power_channel().unwrap();
        (PowerDevice::new(tx), rx)
    }

    fn drain(rx: &PowerEventReceiver) -> Vec<PowerEvent> {
        std::iter::from_fn(|| rx.try_recv()).collect()
    }

    #[test]
    fn acpi_port_poweroff_and_reset() {
        let (mut d, rx) = dev();
        assert_eq!((S5_SLEEP_TYPE << 2) | SLP_EN, 0x34);
        d.io_out(layout::ACPI_SHUTDOWN_PORT, &[0x34]);
        assert_eq!(drain(&rx), [PowerEvent::PowerOff]);
        d.io_out(layout::ACPI_SHUTDOWN_PORT, &[RESET_VALUE]);
        assert_eq!(drain(&rx), [PowerEvent::Reset]);
        // another sleep state, SLP_EN clear: nothing
        d.io_out(layout::ACPI_SHUTDOWN_PORT, &[(3 << 2) | SLP_EN]);
        d.io_out(layout::ACPI_SHUTDOWN_PORT, &[S5_SLEEP_TYPE << 2]);
        d.io_out(layout::ACPI_SHUTDOWN_PORT, &[]);
        assert_eq!(drain(&rx), []);
        let mut b = [0xaa];
        d.io_in(layout::ACPI_SHUTDOWN_PORT, &mut b);
        assert_eq!(b, [0]);
    }

    #[test]
    fn reset_control_port_as_linux_uses_it() {
        let (mut d, rx) = dev();
        // Linux: cf9 = inb(0xcf9) & ~6; outb(cf9 | 2); udelay; outb(cf9 | 6)
        let mut b = [0xaa];
        d.io_in(layout::RESET_CONTROL_PORT, &mut b);
        let cf9 = b[0] & !6;
        d.io_out(layout::RESET_CONTROL_PORT, &[cf9 | 2]);
        assert_eq!(drain(&rx), []);
        d.io_in(layout::RESET_CONTROL_PORT, &mut b);
        assert_eq!(b, [2]);
        d.io_out(layout::RESET_CONTROL_PORT, &[cf9 | 6]);
        assert_eq!(drain(&rx), [PowerEvent::Reset]);
        d.io_in(layout::RESET_CONTROL_PORT, &mut b);
        assert_eq!(b, [2]);
    }

    #[test]
    fn i8042_reset_command() {
        let (mut d, rx) = dev();
        let mut status = [0xaa];
        d.io_in(I8042_COMMAND_PORT, &mut status);
        assert_eq!(status, [0], "buffers empty");
        d.io_out(I8042_COMMAND_PORT, &[0x20]); // read CTR: not a reset
        assert_eq!(drain(&rx), []);
        d.io_out(I8042_COMMAND_PORT, &[I8042_RESET]);
        assert_eq!(drain(&rx), [PowerEvent::Reset]);
    }

    #[test]
    fn receiver_eventfd_wakes_and_clears() {
        let (tx, rx) = power_channel().unwrap();
        let poll = |rx: &PowerEventReceiver| {
            let mut p = libc::pollfd {
                fd: rx.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, a zero timeout.
            let n = unsafe { libc::poll(&mut p, 1, 0) };
            n == 1 && p.revents & libc::POLLIN != 0
        };
        assert!(!poll(&rx));
        let tx2 = tx.clone();
        std::thread::spawn(move || tx2.send(PowerEvent::PowerOff))
            .join()
            .unwrap();
        tx.send(PowerEvent::Reset);
        assert!(poll(&rx));
        assert_eq!(drain(&rx), [PowerEvent::PowerOff, PowerEvent::Reset]);
        assert!(!poll(&rx));
        tx.send(PowerEvent::Reset);
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(1)),
            Some(PowerEvent::Reset)
        );
        // a sender after the receiver is gone: no panic, no error
        drop(rx);
        tx.send(PowerEvent::PowerOff);
    }
}
