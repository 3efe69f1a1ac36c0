//! Legacy devices on I/O ports, and the port bus every vCPU gets.
//!
//! - [`serial`]: COM1, the 8250 UART at 0x3f8 (IRQ 4) from vm-superio,
//!   output to the `--serial` sink, input fed by the control loop.
//! - [`power`]: power off and reset ports (ACPI 0x3c0, 0xcf9, i8042 0x64)
//!   turned into [`PowerEvent`]s for the control loop.
//! - [`ports`]: the [`PortBus`] composing them with PCI configuration
//!   ports; unknown ports are ignored (reads all ones), logged at debug.
//!
//! Wiring, as the VMM does it (not here yet): build the serial from the
//! config with an `EventFd` registered as KVM irqfd on GSI 4, a
//! [`power::power_channel`] whose receiver's fd joins the epoll loop, a
//! [`ports::PortBusBuilder`] with [`ports::PortBusBuilder::add_serial`],
//! [`ports::PortBusBuilder::add_power`] and
//! [`ports::PortBusBuilder::add_pci_config`], and give each vCPU a clone
//! of the built bus as its [`crate::PortIo`].

pub mod ports;
pub mod power;
pub mod serial;

pub use ports::{PortBus, PortBusBuilder, PortsError};
pub use power::{power_channel, PowerDevice, PowerEvent, PowerEventReceiver, PowerEvents};
pub use serial::{IrqTrigger, SerialDevice, SerialError, SerialOutput, SharedSerial};
