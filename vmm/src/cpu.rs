//! Per-vCPU architectural setup before the first `KVM_RUN`: CPUID from
//! what KVM supports (with the topology and the hypervisor bits patched),
//! boot MSRs, the FPU control words, and the local APIC's LINT pins.
//!
//! Every vCPU gets this; the boot vCPU also gets the registers of
//! [`crate::boot::linux::BootVcpuState`]. The other vCPUs wait in the
//! in-kernel local APIC for the guest's INIT/SIPI.

use kvm_bindings::{kvm_fpu, kvm_msr_entry, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Cap, Kvm};

use crate::vcpu::Vcpu;

/// Errors of vCPU setup.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("KVM_GET_SUPPORTED_CPUID")]
    SupportedCpuid(#[source] kvm_ioctls::Error),
    #[error("vCPU {id}: {what}")]
    Ioctl {
        id: u8,
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("building the MSR list")]
    MsrList,
}

/// CPUID leaf 1 ECX: TSC-deadline timer.
const LEAF1_ECX_TSC_DEADLINE: u32 = 1 << 24;
/// CPUID leaf 1 ECX: running under a hypervisor.
const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
/// CPUID leaf 1 EDX: HTT (the logical-processor count in EBX is valid).
const LEAF1_EDX_HTT: u32 = 1 << 28;

/// Boot MSRs (Linux's startup code relies on nothing else being set).
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MISC_ENABLE_FAST_STRING: u64 = 1;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// MTRRs enabled, default type write-back.
const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

/// Local APIC register offsets and LVT delivery modes.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// The CPUID every vCPU starts from: what KVM supports on this host.
pub fn supported_cpuid(kvm: &Kvm) -> Result<CpuId, CpuError> {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(CpuError::SupportedCpuid)
}

/// Whether KVM emulates the TSC-deadline timer of the in-kernel APIC
/// (Linux then needs no other timer to calibrate the APIC timer).
pub fn tsc_deadline(kvm: &Kvm) -> bool {
    kvm.check_extension(Cap::TscDeadlineTimer)
}

/// Patches `base` for vCPU `id` of `count`: APIC ids, the logical
/// processor count, the hypervisor bit, and the TSC-deadline timer.
pub fn patch_cpuid(base: &CpuId, id: u8, count: u8, tsc_deadline: bool) -> CpuId {
    let mut cpuid = base.clone();
    let apic_id = u32::from(id);
    // Bits of the APIC id that number the vCPUs (x2APIC topology, leaf 0xb).
    let shift = u32::from(count).next_power_of_two().trailing_zeros();
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | (apic_id << 24) | (u32::from(count) << 16);
                e.ecx |= LEAF1_ECX_HYPERVISOR;
                if tsc_deadline {
                    e.ecx |= LEAF1_ECX_TSC_DEADLINE;
                }
                if count > 1 {
                    e.edx |= LEAF1_EDX_HTT;
                }
            }
            0xb => {
                // Level 0: one thread per core; level 1: `count` cores.
                e.edx = apic_id;
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = (1 << 8) | e.index;
                    }
                    1 => {
                        e.eax = shift;
                        e.ebx = u32::from(count);
                        e.ecx = (2 << 8) | e.index;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index;
                    }
                }
            }
            0x8000_001e => {
                // AMD extended APIC id.
                e.eax = apic_id;
            }
            _ => {}
        }
    }
    cpuid
}

fn ioctl_err(id: u8, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> CpuError {
    move |source| CpuError::Ioctl { id, what, source }
}

/// Sets CPUID, boot MSRs, FPU and the LINT pins of `vcpu`.
pub fn configure(vcpu: &Vcpu, cpuid: &CpuId) -> Result<(), CpuError> {
    let id = vcpu.id();
    let fd = vcpu.fd();
    fd.set_cpuid2(cpuid)
        .map_err(ioctl_err(id, "KVM_SET_CPUID2"))?;

    let entries: Vec<kvm_msr_entry> = [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
    .iter()
    .map(|&(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    })
    .collect();
    let msrs = Msrs::from_entries(&entries).map_err(|_| CpuError::MsrList)?;
    let set = fd.set_msrs(&msrs).map_err(ioctl_err(id, "KVM_SET_MSRS"))?;
    if set != entries.len() {
        // KVM stops at the first MSR it refuses; the rest are optional for
        // Linux, so a host without one of them still boots.
        log::warn!(
            "vCPU {id}: KVM took {set} of {} boot MSRs (refused {:#x})",
            entries.len(),
            entries[set].index
        );
    }

    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    fd.set_fpu(&fpu).map_err(ioctl_err(id, "KVM_SET_FPU"))?;

    let mut lapic = fd.get_lapic().map_err(ioctl_err(id, "KVM_GET_LAPIC"))?;
    for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let mut b = [0u8; 4];
        for (i, v) in b.iter_mut().enumerate() {
            *v = lapic.regs[reg + i] as u8;
        }
        let v = u32::from_le_bytes(b);
        // Delivery mode is bits 8..11.
        let v = (v & !0x700) | (mode << 8);
        for (i, byte) in v.to_le_bytes().iter().enumerate() {
            lapic.regs[reg + i] = *byte as std::os::raw::c_char;
        }
    }
    fd.set_lapic(&lapic)
        .map_err(ioctl_err(id, "KVM_SET_LAPIC"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn base() -> CpuId {
        let e = |function, index| kvm_cpuid_entry2 {
            function,
            index,
            ebx: 0x0008_0800,
            ..Default::default()
        };
        CpuId::from_entries(&[e(0, 0), e(1, 0), e(0xb, 0), e(0xb, 1), e(0x8000_001e, 0)]).unwrap()
    }

    #[test]
    fn apic_ids_and_counts_follow_the_vcpu() {
        let c = patch_cpuid(&base(), 3, 4, true);
        let get = |f, i| {
            *c.as_slice()
                .iter()
                .find(|e| e.function == f && e.index == i)
                .unwrap()
        };
        let l1 = get(1, 0);
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_eq!(l1.ebx & 0xffff, 0x0800, "CLFLUSH size kept");
        assert_ne!(l1.ecx & LEAF1_ECX_HYPERVISOR, 0);
        assert_ne!(l1.ecx & LEAF1_ECX_TSC_DEADLINE, 0);
        assert_ne!(l1.edx & LEAF1_EDX_HTT, 0);
        assert_eq!(get(0xb, 0).edx, 3);
        assert_eq!(get(0xb, 1).eax, 2);
        assert_eq!(get(0xb, 1).ebx, 4);
        assert_eq!(get(0x8000_001e, 0).eax, 3);
        let one = patch_cpuid(&base(), 0, 1, false);
        let l1 = one.as_slice().iter().find(|e| e.function == 1).unwrap();
        assert_eq!(l1.ecx & LEAF1_ECX_TSC_DEADLINE, 0);
        assert_eq!(l1.edx & LEAF1_EDX_HTT, 0);
    }
}
