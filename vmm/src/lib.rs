//! The pcow-hypervisor VMM, library part (the first pieces of it).
//!
//! What exists: a KVM VM with guest RAM and memslots for external host
//! regions ([`vm`]), vCPU threads with pause/resume and port/MMIO handler
//! hooks ([`vcpu`]), the project's tiny hand-assembled test guest
//! ([`testguest`]), Cloud Hypervisor's option syntax and VmConfig with
//! validation ([`config`]), the guest memory layout, bzImage/PVH loading
//! with boot parameters and e820 ([`boot`]), ACPI tables ([`acpi`]), a PCI
//! segment with a modern virtio-pci transport driving the pmem device
//! ([`pci`]), and the legacy ports: COM1 8250, the ACPI power port, reset
//! ports, and a port bus composing them ([`legacy`]). On the host's KVM the
//! test guest drives the virtio-pci pmem device itself (ECAM, BAR 0,
//! FLUSH) and the serial and power ports. Not here yet: KVM ioeventfds and
//! irqfds (notifications still arrive as MMIO exits, interrupts are not
//! delivered), the in-kernel irqchip, CPUID/MSR/LAPIC setup, the epoll
//! control loop and the `cloud-hypervisor` binary; no Linux guest has been
//! booted yet.

//! Threads and events, as they are today:
//!
//! 1. The owner (a test, later the VMM thread) creates a [`vm::Vm`]: RAM is
//!    mapped and registered as memslots.
//! 2. It creates a [`vcpu::VcpuControl`] first, because a pmem device's
//!    barrier needs it: `PcowRegion::open` takes it as its
//!    [`virtio_pmem_pcow::Quiesce`].
//! 3. A device region (a `PcowRegion` or `RawRegion`) gets a memslot with
//!    [`vm::Vm::add_region`] at [`vm::Vm::next_region_gpa`] (2 MiB aligned,
//!    above RAM and never below 4 GiB). The region's userfaultfd monitor runs on the owner's side
//!    (its fds polled, `handle_ready` on readiness): a vCPU whose write
//!    faults into a hole blocks inside `KVM_RUN` until the monitor maps a
//!    cluster and wakes it.
//! 4. Each vCPU runs on its own thread ([`vcpu::spawn`]), forwarding port
//!    I/O to a [`vcpu::PortIo`] handler, until `HLT`, shutdown, an error,
//!    or [`vcpu::VcpuControl::stop`].
//! 5. A barrier (`PcowRegion::barrier`) holds the vCPUs through the
//!    control: each is kicked out of `KVM_RUN` by a signal and waits until
//!    the barrier releases it.
#![warn(missing_docs)]

pub mod acpi;
pub mod api;
pub mod boot;
pub mod chardev;
pub mod config;
pub mod control;
pub mod cpu;
pub mod device_tree;
pub mod event_monitor;
pub mod health;
pub mod irq;
pub mod legacy;
pub mod machine;
pub mod pci;
pub mod pmem_threads;
pub mod testguest;
pub mod vcpu;
pub mod vm;
pub mod vmm;
pub mod vmm_error;
mod x86;

pub use vcpu::{MmioBus, PortIo, Vcpu, VcpuControl, VcpuError, VcpuStats, VcpuStop, VcpuThread};
pub use vm::{Memslot, Vm, VmConfig, VmError};
