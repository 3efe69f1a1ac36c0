//! The `ioctl` request numbers the filters name that no crate exports:
//! KVM's (kvm-ioctls keeps its own private), encoded as `linux/kvm.h`
//! defines them (`_IO`/`_IOR`/`_IOW`/`_IOWR` of `KVMIO` with the size of
//! the argument's struct from `kvm-bindings`, the same layouts the kernel
//! checks). The others come from `libc` and the device crate.
//!
//! The tests compare a sample with the values the kernel's headers give
//! (`tests.rs`), and the binary's suites run under the filters: a wrong
//! number would kill them.

use std::mem::size_of;

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_dirty_log, kvm_enable_cap,
    kvm_fpu, kvm_ioeventfd, kvm_irq_routing, kvm_irqchip, kvm_irqfd, kvm_lapic_state, kvm_mp_state,
    kvm_msr_list, kvm_msrs, kvm_regs, kvm_sregs, kvm_userspace_memory_region, kvm_vcpu_events,
    kvm_xcrs, kvm_xsave, KVMIO,
};

/// `_IOC_WRITE` and `_IOC_READ` (`asm-generic/ioctl.h`).
const WRITE: u32 = 1;
const READ: u32 = 2;

/// `_IOC(dir, KVMIO, nr, size)`: direction in bits 30-31, the argument's
/// size in bits 16-29, the type in 8-15, the number in 0-7.
const fn kvm(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (KVMIO << 8) | nr
}
const fn io(nr: u32) -> u32 {
    kvm(0, nr, 0)
}
const fn ior(nr: u32, size: usize) -> u32 {
    kvm(READ, nr, size)
}
const fn iow(nr: u32, size: usize) -> u32 {
    kvm(WRITE, nr, size)
}
const fn iowr(nr: u32, size: usize) -> u32 {
    kvm(READ | WRITE, nr, size)
}

// The system fd (/dev/kvm).
pub const KVM_GET_API_VERSION: u32 = io(0x00);
pub const KVM_CREATE_VM: u32 = io(0x01);
pub const KVM_GET_MSR_INDEX_LIST: u32 = iowr(0x02, size_of::<kvm_msr_list>());
/// Also answered by the VM fd (`check_extension` on a `VmFd`).
pub const KVM_CHECK_EXTENSION: u32 = io(0x03);
pub const KVM_GET_VCPU_MMAP_SIZE: u32 = io(0x04);
pub const KVM_GET_SUPPORTED_CPUID: u32 = iowr(0x05, size_of::<kvm_cpuid2>());

// The VM fd.
pub const KVM_CREATE_VCPU: u32 = io(0x41);
/// A pcow memslot's dirty log (`dirty_log.rs`): barriers and status reads.
pub const KVM_GET_DIRTY_LOG: u32 = iow(0x42, size_of::<kvm_dirty_log>());
/// With manual protection of the dirty log, what a read took is cleared
/// apart (`dirty_log.rs`).
pub const KVM_CLEAR_DIRTY_LOG: u32 = iowr(0xc0, size_of::<kvm_clear_dirty_log>());
/// KVM's dirty ring (`dirty_ring.rs`): collected entries re-protected, by
/// barriers, status reads and a vCPU whose ring is full.
pub const KVM_RESET_DIRTY_RINGS: u32 = io(0xc7);
/// Set-up of a VM: manual dirty-log protection (`dirty_log.rs`), the
/// dirty ring (`dirty_ring.rs`).
pub const KVM_ENABLE_CAP: u32 = iow(0xa3, size_of::<kvm_enable_cap>());
pub const KVM_SET_USER_MEMORY_REGION: u32 = iow(0x46, size_of::<kvm_userspace_memory_region>());
pub const KVM_SET_TSS_ADDR: u32 = io(0x47);
pub const KVM_CREATE_IRQCHIP: u32 = io(0x60);
pub const KVM_GET_IRQCHIP: u32 = iowr(0x62, size_of::<kvm_irqchip>());
pub const KVM_SET_IRQCHIP: u32 = ior(0x63, size_of::<kvm_irqchip>());
pub const KVM_SET_GSI_ROUTING: u32 = iow(0x6a, size_of::<kvm_irq_routing>());
pub const KVM_IRQFD: u32 = iow(0x76, size_of::<kvm_irqfd>());
pub const KVM_IOEVENTFD: u32 = iow(0x79, size_of::<kvm_ioeventfd>());
pub const KVM_SET_CLOCK: u32 = iow(0x7b, size_of::<kvm_clock_data>());
pub const KVM_GET_CLOCK: u32 = ior(0x7c, size_of::<kvm_clock_data>());

// A vCPU fd.
pub const KVM_RUN: u32 = io(0x80);
pub const KVM_GET_REGS: u32 = ior(0x81, size_of::<kvm_regs>());
pub const KVM_SET_REGS: u32 = iow(0x82, size_of::<kvm_regs>());
pub const KVM_GET_SREGS: u32 = ior(0x83, size_of::<kvm_sregs>());
pub const KVM_SET_SREGS: u32 = iow(0x84, size_of::<kvm_sregs>());
pub const KVM_GET_MSRS: u32 = iowr(0x88, size_of::<kvm_msrs>());
pub const KVM_SET_MSRS: u32 = iow(0x89, size_of::<kvm_msrs>());
pub const KVM_GET_FPU: u32 = ior(0x8c, size_of::<kvm_fpu>());
pub const KVM_SET_FPU: u32 = iow(0x8d, size_of::<kvm_fpu>());
pub const KVM_GET_LAPIC: u32 = ior(0x8e, size_of::<kvm_lapic_state>());
pub const KVM_SET_LAPIC: u32 = iow(0x8f, size_of::<kvm_lapic_state>());
pub const KVM_SET_CPUID2: u32 = iow(0x90, size_of::<kvm_cpuid2>());
pub const KVM_GET_CPUID2: u32 = iowr(0x91, size_of::<kvm_cpuid2>());
pub const KVM_GET_MP_STATE: u32 = ior(0x98, size_of::<kvm_mp_state>());
pub const KVM_SET_MP_STATE: u32 = iow(0x99, size_of::<kvm_mp_state>());
pub const KVM_NMI: u32 = io(0x9a);
pub const KVM_GET_VCPU_EVENTS: u32 = ior(0x9f, size_of::<kvm_vcpu_events>());
pub const KVM_SET_VCPU_EVENTS: u32 = iow(0xa0, size_of::<kvm_vcpu_events>());
pub const KVM_GET_DEBUGREGS: u32 = ior(0xa1, size_of::<kvm_debugregs>());
pub const KVM_SET_DEBUGREGS: u32 = iow(0xa2, size_of::<kvm_debugregs>());
pub const KVM_SET_TSC_KHZ: u32 = io(0xa2);
pub const KVM_GET_TSC_KHZ: u32 = io(0xa3);
pub const KVM_GET_XSAVE: u32 = ior(0xa4, size_of::<kvm_xsave>());
pub const KVM_SET_XSAVE: u32 = iow(0xa5, size_of::<kvm_xsave>());
pub const KVM_GET_XCRS: u32 = ior(0xa6, size_of::<kvm_xcrs>());
pub const KVM_SET_XCRS: u32 = iow(0xa7, size_of::<kvm_xcrs>());
