//! VM snapshots (`vm.snapshot`) and restores (`vm.restore`, `--restore`),
//! with each pmem device's content captured at the same instant
//! (`docs/snapshots.md`):
//!
//! - [`capture`]: a paused machine written into a snapshot directory;
//! - [`restore_machine`]: a machine built back from one, paused;
//! - [`pmem_state`]: what a snapshot records of each pmem device's content
//!   (pcow: frozen under a new overlay; raw: referenced) and how a restore
//!   gives it back (clones, or the config's file rolled back);
//! - [`dir`]: the snapshot directory (`config.json`, the versioned
//!   `state.json` envelope, `memory-ranges`), written crash-safely and read
//!   with validation (`docs/snapshot-format.md`);
//! - [`memory`]: guest RAM in `memory-ranges` (sparse) and its restore
//!   modes (Copy, CopyOnWrite; OnDemand refused);
//! - [`restore`]: what a restore asks for (upstream's RestoreConfig from
//!   JSON or `--restore`, plus our pmem clones);
//! - [`cpu_state`]: every register set of a vCPU, captured and restored on
//!   the vCPU's own thread (`VcpuControl::save_states`/`restore_states`);
//! - [`vm_state`]: the in-kernel irqchip (PICs, IOAPIC) and the KVM clock;
//! - [`device_state`]: the state of every device as serde structs, keyed by
//!   device id ([`device_state::DeviceStates`]), captured from a machine
//!   and restored into a machine built from the same config. The capture
//!   and restore code of each device lives next to the device it reaches
//!   into (`pci_config_state.rs`, `msix_state.rs`, `virtio_pci_state.rs`,
//!   `pci_bus_state.rs`, `serial_state.rs`, `power_state.rs`,
//!   `console_state.rs`, included by the device modules as child modules);
//! - [`hex_bytes`]: byte strings as hex in the JSON.

pub mod capture;
pub mod cpu_state;
pub mod device_state;
pub mod dir;
pub mod hex_bytes;
pub mod memory;
pub mod pmem_state;
pub mod restore;
pub mod restore_machine;
pub mod vm_state;
