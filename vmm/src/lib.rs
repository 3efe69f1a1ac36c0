//! The pcow-hypervisor VMM, library part; `src/main.rs` is the
//! `cloud-hypervisor` binary on top of it.
//!
//! What is here: Cloud Hypervisor's command line, VmConfig and validation
//! ([`config`]); the KVM VM with guest RAM and memslots for device regions
//! ([`vm`]), a pcow region's memslot with KVM's dirty log, which its
//! barriers follow ([`dirty_log`]); CPUID and vCPU setup ([`cpu`]) and vCPU threads with
//! pause/resume/stop and NMIs ([`vcpu`]); the guest memory layout and
//! bzImage/PVH loading ([`boot`]); ACPI tables ([`acpi`]); interrupts
//! (in-kernel irqchip, irqfds, MSI-X routes: [`irq`]); a PCI segment with
//! modern virtio-pci functions for the pmem devices, the entropy device and
//! the console ([`pci`]); the legacy ports: COM1, the ACPI power port,
//! reset ports ([`legacy`]); the serial and console backends ([`chardev`]);
//! the whole machine built from a config ([`machine`]) and the threads of
//! its pmem devices ([`pmem_threads`]); the VMM thread's epoll loop
//! ([`control`]); the VM's lifecycle and the API actions ([`vmm`], failing
//! with [`vmm_error::VmmError`]), the HTTP API ([`api`]); what the VMM
//! tracks of its devices' health ([`health`]); upstream's event monitor
//! ([`event_monitor`]); `vm.info`'s device tree ([`device_tree`]); and the
//! project's hand-assembled test guest for host KVM tests ([`testguest`]).
//!
//! Threads of a running VMM (each owns what is listed; see
//! [`control`] for the events):
//!
//! | thread | owns |
//! |---|---|
//! | the VMM thread ([`vmm::Vmm::run`], [`control::EventLoop`]) | the VM's state, the API actions, power events, signals, serial and console input, the entropy and console queues, pausing the guest when a pmem device waits for space, stopping the machine and the final barriers |
//! | `vcpuN` ([`vcpu`]) | `KVM_RUN` of one vCPU; its port I/O and MMIO exits (the PCI bus, the legacy ports) |
//! | `pmemN-queue` ([`pmem_threads::QueueThread`]) | pmem device N's queue: each FLUSH runs the device's barrier (pauses the vCPUs through the [`vcpu::VcpuControl`], moves pages, syncs) |
//! | `pmemN-fault` (the device crate's `MonitorThread`, pcow only) | the image's userfaultfd and pool eventfd: maps clusters into holes and wakes the faulting vCPU |
//! | `http-api`, `http-conn` ([`api::http`]) | accepting API connections, reading requests and writing answers; the actions run on the VMM thread |
//! | `<backend>-out` ([`chardev`]), `event-monitor` | writing guest output and events without blocking a device |
//!
//! The device threads report to the VMM thread through one eventfd
//! ([`pmem_threads::DeviceAlerts`]): a monitor that failed ends the VM, a
//! device out of space pauses it.
//!
//! Order of a boot: [`machine::Machine::build`] creates the VM, the
//! [`vcpu::VcpuControl`] (the pmem barriers hold the vCPUs through it,
//! as the device crate's `Quiesce`), the regions and their memslots (2 MiB
//! aligned above RAM), the PCI functions and the vCPUs;
//! [`machine::Machine::start`] spawns each pmem device's fault and queue
//! threads, then the vCPU threads; the VMM thread registers its loop once
//! ([`control::EventLoop`]). [`control::stop`] undoes it in order: the
//! vCPUs (the fault threads still serve, so a vCPU blocked in a fault can
//! leave), the device threads, then each device's final barrier.
#![warn(missing_docs)]

pub mod acpi;
pub mod api;
pub mod boot;
pub mod chardev;
pub mod config;
pub mod control;
pub mod cpu;
pub mod device_tree;
pub mod dirty_log;
pub mod dirty_ring;
pub mod event_monitor;
pub mod health;
pub mod irq;
pub mod landlock_rules;
pub mod legacy;
pub mod machine;
pub mod pci;
pub mod pmem_threads;
pub mod seccomp_filters;
pub mod snapshot;
pub mod testguest;
pub mod vcpu;
pub mod vm;
pub mod vmm;
pub mod vmm_error;
mod x86;

pub use vcpu::{MmioBus, PortIo, Vcpu, VcpuControl, VcpuError, VcpuStats, VcpuStop, VcpuThread};
pub use vm::{Memslot, Vm, VmConfig, VmError};
