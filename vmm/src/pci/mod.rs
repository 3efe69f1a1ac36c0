//! PCI: segment 0 with a host bridge, configuration access through ports
//! 0xcf8/0xcfc and ECAM ([`bus`]), and modern virtio-pci functions with
//! MSI-X ([`virtio_pci`], [`msix`]) driving a [`VirtioDevice`]: the pmem
//! adapter ([`pmem`]), the entropy device ([`rng`]) and the console
//! ([`console`]).
//!
//! How accesses flow (the KVM wiring is not here yet):
//!
//! 1. The owner builds a [`PciBus`] over the 64-bit BAR window
//!    ([`Mmio64Window::above`] the last pmem region) and adds each
//!    [`VirtioPciDevice`] (shared as `Arc<Mutex<_>>`); the bus pre-assigns
//!    its BAR (there is no firmware).
//! 2. vCPU threads forward port I/O on 0xcf8..=0xcff ([`PciConfigIo`], a
//!    [`crate::PortIo`]) and MMIO exits ([`PciBus::mmio_read`] /
//!    [`PciBus::mmio_write`]) for ECAM and the BARs to the bus, which locks
//!    the addressed device.
//! 3. Queue notifications: a guest write in the notify region reaches
//!    [`VirtioPciDevice::notify`], either through an MMIO exit or, once
//!    wired, from the epoll loop when the queue's ioeventfd (registered at
//!    [`VirtioPciDevice::notify_addresses`], moved when the bar hook
//!    reports a [`BarMove`]) fires.
//! 4. The device serves the queue; an interrupt goes through MSI-X
//!    masking to the [`InterruptSink`] (later: irqfd + `KVM_SET_GSI_ROUTING`).
//!
//! Guest-physical layout: see [`bus`].

pub mod bus;
pub mod config;
pub mod console;
pub mod msix;
pub mod pmem;
pub mod rng;
pub mod virtio_pci;

pub use bus::{
    BarMove, Mmio64Window, PciAddress, PciBus, PciConfigIo, PciDevice, PciError, ECAM_BASE,
    ECAM_SIZE,
};
pub use config::{ConfigSpace, PciIds};
pub use console::{ConsoleDevice, ConsoleInput};
pub use msix::{InterruptSink, MsixEntry};
pub use pmem::PmemVirtio;
pub use rng::RngDevice;
pub use virtio_pci::{VirtioDevice, VirtioError, VirtioPciDevice, VirtioPciError};
