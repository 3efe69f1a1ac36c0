//! The state of every device of a machine, as serde structs keyed by
//! device id, and the errors of restoring one.
//!
//! Ids follow upstream's device tree: `__serial`, `__console` (the
//! console's own state: input waiting for the guest), and
//! `_virtio-pci-<id>` for each virtio-pci function (`__console`, `__rng`,
//! each pmem id); ours has two more with no upstream counterpart,
//! [`POWER_ID`] and [`PCI_BUS_ID`]. Each device's capture and restore is
//! a `state()` / `restore()` pair next to the device (see
//! [`crate::snapshot`]); [`crate::machine::Machine::device_states`] and
//! [`crate::machine::Machine::restore_devices`] walk them all.
//!
//! A state read back from disk is outside data: every restore validates
//! every field against the device it is restored into (a machine built
//! from the same config) before changing anything, and answers a
//! [`StateError`] naming the field; [`DeviceStatesError`] adds the device
//! id.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::legacy::power::PowerState;
use crate::legacy::serial::SerialDeviceState;
use crate::pci::bus::PciBusState;
use crate::pci::console::ConsoleInputState;
use crate::pci::virtio_pci::{VirtioError, VirtioPciState};

/// Id of the power ports' state (0xcf9's register).
pub const POWER_ID: &str = "__power";
/// Id of the PCI bus's state (host bridge, 0xcf8 latch).
pub const PCI_BUS_ID: &str = "__pci_bus0";
/// Id of the serial port's state (upstream's).
pub const SERIAL_ID: &str = "__serial";

/// The id of the virtio-pci function of device `id` (upstream's).
pub fn virtio_pci_id(id: &str) -> String {
    format!("_virtio-pci-{id}")
}

/// Why a saved state cannot be restored into a device.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{field}: {value:#x} is not valid: {rule}")]
    Field {
        field: String,
        value: u64,
        rule: &'static str,
    },
    #[error("{field}: {got} entries, the device has {expected}")]
    Count {
        field: String,
        got: usize,
        expected: usize,
    },
    #[error("queue {queue}: size {size} must be a power of two of at most {max}")]
    QueueSize { queue: usize, size: u16, max: u16 },
    #[error("queue {queue}: {ring} ring at {addr:#x} is not aligned to {align} bytes")]
    QueueAlign {
        queue: usize,
        ring: &'static str,
        addr: u64,
        align: u64,
    },
    #[error("queue {queue}: rings (descriptors {desc:#x}, driver {driver:#x}, device {device:#x}) do not fit in guest memory")]
    QueueMemory {
        queue: usize,
        desc: u64,
        driver: u64,
        device: u64,
    },
    #[error("{field}: MSI-X vector {vector} is beyond the table of {table}")]
    Vector {
        field: String,
        vector: u16,
        table: u16,
    },
    #[error("BAR {index}: {addr:#x}..+{size:#x} is outside the window {base:#x}..{end:#x}")]
    Bar {
        index: usize,
        addr: u64,
        size: u64,
        base: u64,
        end: u64,
    },
    #[error("config space byte {offset:#x} is read-only: saved {saved:#04x}, device {device:#04x} (a different device?)")]
    ReadOnlyConfig {
        offset: usize,
        saved: u8,
        device: u8,
    },
    #[error("device type {saved}, the device is of type {device}")]
    DeviceType { saved: u32, device: u32 },
    #[error("{field}: {len} bytes, at most {max}")]
    TooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("activating the device with its saved queues")]
    Activate(#[source] VirtioError),
    #[error("raising the serial interrupt pending in the restored state (the state is restored)")]
    SerialIrq(#[source] std::io::Error),
}

impl StateError {
    /// A field whose value breaks `rule`.
    pub fn field(field: impl Into<String>, value: u64, rule: &'static str) -> StateError {
        StateError::Field {
            field: field.into(),
            value,
            rule,
        }
    }
}

/// Why a [`DeviceStates`] cannot be restored into a machine.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum DeviceStatesError {
    #[error("device {id}")]
    Device {
        id: String,
        #[source]
        source: StateError,
    },
    #[error("device {id}: no saved state (the machine has it, the snapshot does not)")]
    Missing { id: String },
    #[error("device {id}: saved state of kind {got}, the device needs {expected}")]
    Kind {
        id: String,
        expected: &'static str,
        got: &'static str,
    },
    #[error("saved state of device(s) {ids:?} that this machine does not have")]
    Unknown { ids: Vec<String> },
}

/// One device's saved state.
#[allow(missing_docs)] // each variant holds its device's state type
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceState {
    Serial(SerialDeviceState),
    Power(PowerState),
    PciBus(PciBusState),
    VirtioPci(Box<VirtioPciState>),
    ConsoleInput(ConsoleInputState),
}

impl DeviceState {
    /// The variant's name, as serialized.
    pub fn kind(&self) -> &'static str {
        match self {
            DeviceState::Serial(_) => "serial",
            DeviceState::Power(_) => "power",
            DeviceState::PciBus(_) => "pci_bus",
            DeviceState::VirtioPci(_) => "virtio_pci",
            DeviceState::ConsoleInput(_) => "console_input",
        }
    }
}

/// The saved state of every device, by device id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DeviceStates {
    devices: BTreeMap<String, DeviceState>,
}

macro_rules! take_kind {
    ($name:ident, $variant:ident, $ty:ty, $kind:literal) => {
        /// Takes the state of `id`, which must be of this kind.
        pub fn $name(&mut self, id: &str) -> Result<$ty, DeviceStatesError> {
            match self.take(id)? {
                DeviceState::$variant(s) => Ok(s),
                other => Err(DeviceStatesError::Kind {
                    id: id.to_owned(),
                    expected: $kind,
                    got: other.kind(),
                }),
            }
        }
    };
}

impl DeviceStates {
    /// No state.
    pub fn new() -> DeviceStates {
        DeviceStates::default()
    }

    /// Sets the state of `id`.
    pub fn insert(&mut self, id: impl Into<String>, state: DeviceState) {
        self.devices.insert(id.into(), state);
    }

    /// The state of `id`.
    pub fn get(&self, id: &str) -> Option<&DeviceState> {
        self.devices.get(id)
    }

    /// The state of `id`, mutably.
    pub fn get_mut(&mut self, id: &str) -> Option<&mut DeviceState> {
        self.devices.get_mut(id)
    }

    /// The ids, sorted.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.devices.keys().map(String::as_str)
    }

    /// Removes and returns the state of `id`.
    pub fn take(&mut self, id: &str) -> Result<DeviceState, DeviceStatesError> {
        self.devices
            .remove(id)
            .ok_or_else(|| DeviceStatesError::Missing { id: id.to_owned() })
    }

    take_kind!(take_serial, Serial, SerialDeviceState, "serial");
    take_kind!(take_power, Power, PowerState, "power");
    take_kind!(take_pci_bus, PciBus, PciBusState, "pci_bus");
    take_kind!(
        take_virtio_pci,
        VirtioPci,
        Box<VirtioPciState>,
        "virtio_pci"
    );
    take_kind!(
        take_console_input,
        ConsoleInput,
        ConsoleInputState,
        "console_input"
    );

    /// An error if states are left (a restore took every one it knows).
    pub fn finish(self) -> Result<(), DeviceStatesError> {
        if self.devices.is_empty() {
            Ok(())
        } else {
            Err(DeviceStatesError::Unknown {
                ids: self.devices.into_keys().collect(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_garbage() {
        assert_eq!(
            crate::snapshot::hex_bytes::decode("00ff7a").unwrap(),
            vec![0, 0xff, 0x7a]
        );
        assert!(crate::snapshot::hex_bytes::decode("0").is_err());
        assert!(crate::snapshot::hex_bytes::decode("zz").is_err());
        assert!(crate::snapshot::hex_bytes::decode("é0").is_err());
    }

    #[test]
    fn take_checks_presence_and_kind_and_finish_names_leftovers() {
        let mut s = DeviceStates::new();
        s.insert(
            POWER_ID,
            DeviceState::Power(PowerState { reset_control: 2 }),
        );
        s.insert("extra", DeviceState::Power(PowerState { reset_control: 0 }));
        let json = serde_json::to_string(&s).unwrap();
        let mut back: DeviceStates = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
        assert!(matches!(
            back.take_serial(POWER_ID),
            Err(DeviceStatesError::Kind {
                expected: "serial",
                got: "power",
                ..
            })
        ));
        assert!(matches!(
            back.take_power(SERIAL_ID),
            Err(DeviceStatesError::Missing { .. })
        ));
        let e = back.finish().unwrap_err();
        assert_eq!(
            e.to_string(),
            "saved state of device(s) [\"extra\"] that this machine does not have"
        );
        // An unknown kind is a parse error, not a panic.
        assert!(serde_json::from_str::<DeviceStates>(r#"{"x": {"gpu": {}}}"#).is_err());
    }
}
