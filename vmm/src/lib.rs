//! The pcow-hypervisor VMM, library part (the first pieces of it).
//!
//! What exists: a KVM VM with guest RAM and memslots for external host
//! regions ([`vm`]), vCPU threads with pause/resume ([`vcpu`]), and the
//! project's tiny hand-assembled test guest ([`testguest`]). Not here yet:
//! kernel loading, ACPI, PCI and virtio-pci, the serial console, the
//! command line, the epoll control loop and the `cloud-hypervisor` binary.
//!
//! Threads and events, as they are today:
//!
//! 1. The owner (a test, later the VMM thread) creates a [`vm::Vm`]: RAM is
//!    mapped and registered as memslots.
//! 2. It creates a [`vcpu::VcpuControl`] first, because a pmem device's
//!    barrier needs it: `PcowRegion::open` takes it as its
//!    [`virtio_pmem_pcow::Quiesce`].
//! 3. A device region (a `PcowRegion` or `RawRegion`) gets a memslot with
//!    [`vm::Vm::add_region`] at [`vm::Vm::next_region_gpa`] (2 MiB aligned
//!    above RAM). The region's userfaultfd monitor runs on the owner's side
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

pub mod testguest;
pub mod vcpu;
pub mod vm;

pub use vcpu::{PortIo, Vcpu, VcpuControl, VcpuError, VcpuStats, VcpuStop, VcpuThread};
pub use vm::{Memslot, Vm, VmConfig, VmError};
