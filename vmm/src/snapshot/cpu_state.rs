//! The state of one x86_64 vCPU, everything KVM needs for an exact resume
//! in a fresh vCPU ([`VcpuState`]), captured and restored through the
//! vCPU's fd. The calls run on the vCPU's own thread (see
//! [`crate::vcpu::VcpuControl::save_states`] and
//! [`crate::vcpu::VcpuControl::restore_states`]), while the vCPU is paused.
//!
//! What is captured, in this order:
//!
//! 1. `mp_state` first: `KVM_GET_MP_STATE` makes the in-kernel LAPIC
//!    accept pending INIT/SIPI events (`kvm_apic_accept_events`), which
//!    can change the vCPU's registers and LAPIC; everything read after it
//!    agrees with it.
//! 2. CPUID (`KVM_GET_CPUID2`, what the VMM set) and the TSC frequency.
//! 3. regs, sregs, FPU, XSAVE (4 KiB: the VMM never asks for the dynamic
//!    AMX state, so the guest's XSAVE area fits, see
//!    [`CpuStateContext`]), XCRs, the LAPIC page.
//! 4. MSRs: every index `KVM_GET_MSR_INDEX_LIST` reports plus the MTRRs it
//!    leaves out (as upstream does), filtered to the ones this vCPU can
//!    read (KVM stops at the first it refuses; the rest are read again
//!    past it). This includes `IA32_TSC`, `TSC_DEADLINE`, `TSC_ADJUST`,
//!    the kvmclock MSRs (`0x4b564d00`, `0x4b564d01`, and the old `0x11`,
//!    `0x12`) and the other paravirtual ones (async PF, steal time, PV EOI).
//! 5. debug registers, then the vCPU events last: pending exceptions,
//!    interrupts, NMIs and SMIs are the most volatile state, and other
//!    GET ioctls may settle some of them.
//!
//! Restore order ([`VcpuState::restore`]), and why:
//!
//! 1. CPUID: it defines the guest features every later SET is checked
//!    against (XSAVE components, which MSRs exist, x2APIC).
//! 2. TSC frequency, before `IA32_TSC` is written: the value is scaled
//!    by it.
//! 3. sregs: EFER, CR0/CR4 (the mode) and `apic_base` (the APIC base MSR:
//!    xAPIC or x2APIC), which the LAPIC and several MSRs depend on.
//! 4. regs (after sregs, so the mode the registers belong to is set),
//!    then the FPU and XSAVE (the superset last: both write the same FPU
//!    state), then the XCRs.
//! 5. LAPIC: after sregs (its mode comes from `apic_base`), before the
//!    MSRs (KVM keeps `TSC_DEADLINE` only while the LVT timer is in
//!    TSC-deadline mode).
//! 6. MSRs, `IA32_TSC` first (`TSC_DEADLINE` is a point in guest TSC
//!    time), strictly: one KVM refuses fails the restore naming it.
//! 7. debug registers.
//! 8. `mp_state`, then the vCPU events last: `KVM_SET_REGS` and
//!    `KVM_SET_SREGS` clear or queue exceptions and interrupts, and the
//!    events put back exactly what was pending at the capture.
//!
//! The guest RAM must be in place before the restore: KVM writes guest
//! pages the restored MSRs point at (the kvmclock page, steal time) when
//! the vCPU next enters the guest. The VM-wide state (irqchip, clock) is in
//! [`super::vm_state`]: restore it after the vCPUs, just before they
//! resume.

use std::sync::Arc;

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_dtable, kvm_fpu, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, kvm_vcpu_events, kvm_xcr, kvm_xcrs, kvm_xsave,
    CpuId, Msrs, KVM_MAX_CPUID_ENTRIES, KVM_MAX_MSR_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd};
use serde::{Deserialize, Serialize};

use super::hex_bytes::HexBytes;
use crate::vcpu::Vcpu;
use crate::vm::Vm;

/// Size of `kvm_xsave`: the XSAVE area `KVM_GET_XSAVE`/`KVM_SET_XSAVE`
/// move.
pub const XSAVE_SIZE: usize = std::mem::size_of::<kvm_xsave>();
/// Size of the LAPIC register page.
pub const LAPIC_SIZE: usize = 1024;
/// Most XCRs `kvm_xcrs` holds.
pub const MAX_XCRS: usize = 16;
/// The guest's time stamp counter.
const MSR_IA32_TSC: u32 = 0x10;
/// The highest `KVM_MP_STATE_*` value (`KVM_MP_STATE_SUSPENDED`).
const MAX_MP_STATE: u32 = kvm_bindings::KVM_MP_STATE_SUSPENDED;

/// MTRR MSRs, which `KVM_GET_MSR_INDEX_LIST` does not list but firmware
/// and the guest kernel program: the default type, the variable ranges
/// and the fixed ranges.
const MTRR_MSRS: [u32; 28] = [
    0x2ff, 0x200, 0x201, 0x202, 0x203, 0x204, 0x205, 0x206, 0x207, 0x208, 0x209, 0x20a, 0x20b,
    0x20c, 0x20d, 0x20e, 0x20f, 0x250, 0x258, 0x259, 0x268, 0x269, 0x26a, 0x26b, 0x26c, 0x26d,
    0x26e, 0x26f,
];

/// Errors of capturing, validating and restoring a vCPU's state.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum CpuStateError {
    #[error("KVM_GET_MSR_INDEX_LIST")]
    MsrIndexList(#[source] kvm_ioctls::Error),
    #[error(
        "KVM's XSAVE area is {size} bytes, more than the {XSAVE_SIZE} of KVM_GET_XSAVE \
         (dynamic XSAVE features are not supported)"
    )]
    XsaveTooLarge { size: usize },
    #[error("vCPU {id}: {what}")]
    Ioctl {
        id: u8,
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {id}: KVM refused MSR {index:#x} = {data:#x}")]
    MsrRejected { id: u8, index: u32, data: u64 },
    #[error("vCPU {id}: field {field}: {why}")]
    BadField {
        id: u8,
        field: &'static str,
        why: String,
    },
    #[error(
        "vCPU {id}: the state's TSC runs at {saved} kHz, this vCPU at {host} kHz, and KVM \
         cannot scale it"
    )]
    TscFrequency { id: u8, saved: u32, host: u32 },
}

/// What a capture and a restore need from the VM (computed once for all
/// the vCPUs, on the thread that owns the VM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuStateContext {
    /// MSRs to try to capture.
    pub msr_indices: Vec<u32>,
    /// Whether KVM reports the TSC frequency and can set it.
    pub tsc_khz: bool,
    /// Whether KVM has `KVM_GET_XCRS`/`KVM_SET_XCRS`.
    pub xcrs: bool,
}

impl CpuStateContext {
    /// The context of `vm`: the MSR index list of its `/dev/kvm` plus the
    /// MTRRs, and KVM's capabilities. Fails if KVM's XSAVE area for this
    /// process is larger than `kvm_xsave` (the process asked for dynamic
    /// XSAVE features, which this module does not carry).
    pub fn new(vm: &Vm) -> Result<Arc<CpuStateContext>, CpuStateError> {
        let size = vm.fd().check_extension_int(Cap::Xsave2);
        // 0: no KVM_CAP_XSAVE2, the area is `kvm_xsave`'s.
        if usize::try_from(size).is_ok_and(|s| s > XSAVE_SIZE) {
            return Err(CpuStateError::XsaveTooLarge {
                size: size as usize,
            });
        }
        Ok(Arc::new(CpuStateContext {
            msr_indices: msr_indices(vm.kvm())?,
            tsc_khz: vm.fd().check_extension(Cap::GetTscKhz),
            xcrs: vm.fd().check_extension(Cap::Xcrs),
        }))
    }
}

/// The MSRs a capture tries: KVM's index list and the MTRRs, without
/// duplicates, in KVM's order.
pub fn msr_indices(kvm: &Kvm) -> Result<Vec<u32>, CpuStateError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(CpuStateError::MsrIndexList)?;
    let mut out: Vec<u32> = Vec::with_capacity(list.as_slice().len() + MTRR_MSRS.len());
    for &i in list.as_slice().iter().chain(MTRR_MSRS.iter()) {
        if !out.contains(&i) {
            out.push(i);
        }
    }
    Ok(out)
}

/// One CPUID entry (`kvm_cpuid_entry2` without its padding).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuidEntry {
    pub function: u32,
    pub index: u32,
    pub flags: u32,
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

/// The general registers (`kvm_regs`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Regs {
    pub rax: u64,
    pub rbx: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub rsp: u64,
    pub rbp: u64,
    pub r8: u64,
    pub r9: u64,
    pub r10: u64,
    pub r11: u64,
    pub r12: u64,
    pub r13: u64,
    pub r14: u64,
    pub r15: u64,
    pub rip: u64,
    pub rflags: u64,
}

impl From<&kvm_regs> for Regs {
    fn from(r: &kvm_regs) -> Regs {
        Regs {
            rax: r.rax,
            rbx: r.rbx,
            rcx: r.rcx,
            rdx: r.rdx,
            rsi: r.rsi,
            rdi: r.rdi,
            rsp: r.rsp,
            rbp: r.rbp,
            r8: r.r8,
            r9: r.r9,
            r10: r.r10,
            r11: r.r11,
            r12: r.r12,
            r13: r.r13,
            r14: r.r14,
            r15: r.r15,
            rip: r.rip,
            rflags: r.rflags,
        }
    }
}

impl From<&Regs> for kvm_regs {
    fn from(r: &Regs) -> kvm_regs {
        kvm_regs {
            rax: r.rax,
            rbx: r.rbx,
            rcx: r.rcx,
            rdx: r.rdx,
            rsi: r.rsi,
            rdi: r.rdi,
            rsp: r.rsp,
            rbp: r.rbp,
            r8: r.r8,
            r9: r.r9,
            r10: r.r10,
            r11: r.r11,
            r12: r.r12,
            r13: r.r13,
            r14: r.r14,
            r15: r.r15,
            rip: r.rip,
            rflags: r.rflags,
        }
    }
}

/// A segment register (`kvm_segment`; the flag bytes are 0 or 1 for KVM,
/// kept as captured).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Segment {
    pub base: u64,
    pub limit: u32,
    pub selector: u16,
    #[serde(rename = "type")]
    pub type_: u8,
    pub present: u8,
    pub dpl: u8,
    pub db: u8,
    pub s: u8,
    pub l: u8,
    pub g: u8,
    pub avl: u8,
    pub unusable: u8,
}

impl From<&kvm_segment> for Segment {
    fn from(s: &kvm_segment) -> Segment {
        Segment {
            base: s.base,
            limit: s.limit,
            selector: s.selector,
            type_: s.type_,
            present: s.present,
            dpl: s.dpl,
            db: s.db,
            s: s.s,
            l: s.l,
            g: s.g,
            avl: s.avl,
            unusable: s.unusable,
        }
    }
}

impl From<&Segment> for kvm_segment {
    fn from(s: &Segment) -> kvm_segment {
        kvm_segment {
            base: s.base,
            limit: s.limit,
            selector: s.selector,
            type_: s.type_,
            present: s.present,
            dpl: s.dpl,
            db: s.db,
            s: s.s,
            l: s.l,
            g: s.g,
            avl: s.avl,
            unusable: s.unusable,
            padding: 0,
        }
    }
}

/// A descriptor table register (GDTR, IDTR).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorTable {
    pub base: u64,
    pub limit: u16,
}

/// The special registers (`kvm_sregs`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sregs {
    pub cs: Segment,
    pub ds: Segment,
    pub es: Segment,
    pub fs: Segment,
    pub gs: Segment,
    pub ss: Segment,
    pub tr: Segment,
    pub ldt: Segment,
    pub gdt: DescriptorTable,
    pub idt: DescriptorTable,
    pub cr0: u64,
    pub cr2: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub cr8: u64,
    pub efer: u64,
    pub apic_base: u64,
    /// The external interrupt pending injection, as a 256-bit map (at most
    /// one bit set; the vCPU events carry it too).
    pub interrupt_bitmap: [u64; 4],
}

impl From<&kvm_sregs> for Sregs {
    fn from(s: &kvm_sregs) -> Sregs {
        let dt = |d: &kvm_dtable| DescriptorTable {
            base: d.base,
            limit: d.limit,
        };
        Sregs {
            cs: (&s.cs).into(),
            ds: (&s.ds).into(),
            es: (&s.es).into(),
            fs: (&s.fs).into(),
            gs: (&s.gs).into(),
            ss: (&s.ss).into(),
            tr: (&s.tr).into(),
            ldt: (&s.ldt).into(),
            gdt: dt(&s.gdt),
            idt: dt(&s.idt),
            cr0: s.cr0,
            cr2: s.cr2,
            cr3: s.cr3,
            cr4: s.cr4,
            cr8: s.cr8,
            efer: s.efer,
            apic_base: s.apic_base,
            interrupt_bitmap: s.interrupt_bitmap,
        }
    }
}

impl From<&Sregs> for kvm_sregs {
    fn from(s: &Sregs) -> kvm_sregs {
        let dt = |d: &DescriptorTable| kvm_dtable {
            base: d.base,
            limit: d.limit,
            padding: [0; 3],
        };
        kvm_sregs {
            cs: (&s.cs).into(),
            ds: (&s.ds).into(),
            es: (&s.es).into(),
            fs: (&s.fs).into(),
            gs: (&s.gs).into(),
            ss: (&s.ss).into(),
            tr: (&s.tr).into(),
            ldt: (&s.ldt).into(),
            gdt: dt(&s.gdt),
            idt: dt(&s.idt),
            cr0: s.cr0,
            cr2: s.cr2,
            cr3: s.cr3,
            cr4: s.cr4,
            cr8: s.cr8,
            efer: s.efer,
            apic_base: s.apic_base,
            interrupt_bitmap: s.interrupt_bitmap,
        }
    }
}

/// The x87/SSE state (`kvm_fpu`): `fpr` is the 8 x87 registers and `xmm`
/// the 16 XMM registers, 16 bytes each.
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fpu {
    pub fpr: HexBytes,
    pub fcw: u16,
    pub fsw: u16,
    pub ftwx: u8,
    pub last_opcode: u16,
    pub last_ip: u64,
    pub last_dp: u64,
    pub xmm: HexBytes,
    pub mxcsr: u32,
}

const FPR_BYTES: usize = 8 * 16;
const XMM_BYTES: usize = 16 * 16;

impl From<&kvm_fpu> for Fpu {
    fn from(f: &kvm_fpu) -> Fpu {
        Fpu {
            fpr: HexBytes(f.fpr.iter().flatten().copied().collect()),
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: HexBytes(f.xmm.iter().flatten().copied().collect()),
            mxcsr: f.mxcsr,
        }
    }
}

impl Fpu {
    /// The `kvm_fpu` (lengths checked by [`VcpuState::validate`]).
    fn to_kvm(&self) -> kvm_fpu {
        let mut f = kvm_fpu {
            fcw: self.fcw,
            fsw: self.fsw,
            ftwx: self.ftwx,
            last_opcode: self.last_opcode,
            last_ip: self.last_ip,
            last_dp: self.last_dp,
            mxcsr: self.mxcsr,
            ..Default::default()
        };
        for (reg, bytes) in f.fpr.iter_mut().zip(self.fpr.0.chunks_exact(16)) {
            reg.copy_from_slice(bytes);
        }
        for (reg, bytes) in f.xmm.iter_mut().zip(self.xmm.0.chunks_exact(16)) {
            reg.copy_from_slice(bytes);
        }
        f
    }
}

/// One extended control register (XCR0 is the only one today).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Xcr {
    pub xcr: u32,
    pub value: u64,
}

/// The debug registers (`kvm_debugregs`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebugRegs {
    pub db: [u64; 4],
    pub dr6: u64,
    pub dr7: u64,
    pub flags: u64,
}

/// A pending or injected exception.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExceptionEvent {
    pub injected: u8,
    pub nr: u8,
    pub has_error_code: u8,
    pub pending: u8,
    pub error_code: u32,
    /// Whether `payload` holds the exception's payload (CR2 of a #PF, DR6
    /// of a #DB), valid with `KVM_VCPUEVENT_VALID_PAYLOAD`.
    pub has_payload: u8,
    pub payload: u64,
}

/// An injected external interrupt and the interrupt shadow.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterruptEvent {
    pub injected: u8,
    pub nr: u8,
    pub soft: u8,
    pub shadow: u8,
}

/// NMI state.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NmiEvent {
    pub injected: u8,
    pub pending: u8,
    pub masked: u8,
}

/// SMM state.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SmiEvent {
    pub smm: u8,
    pub pending: u8,
    pub smm_inside_nmi: u8,
    pub latched_init: u8,
}

/// Pending and injected events (`kvm_vcpu_events`). `flags` says which
/// optional parts KVM filled (`KVM_VCPUEVENT_VALID_*`); KVM restores only
/// those.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuEvents {
    pub exception: ExceptionEvent,
    pub interrupt: InterruptEvent,
    pub nmi: NmiEvent,
    pub sipi_vector: u32,
    pub flags: u32,
    pub smi: SmiEvent,
    pub triple_fault_pending: u8,
}

/// The `KVM_VCPUEVENT_VALID_*` bits this module knows.
const EVENT_FLAGS: u32 = kvm_bindings::KVM_VCPUEVENT_VALID_NMI_PENDING
    | kvm_bindings::KVM_VCPUEVENT_VALID_SIPI_VECTOR
    | kvm_bindings::KVM_VCPUEVENT_VALID_SHADOW
    | kvm_bindings::KVM_VCPUEVENT_VALID_SMM
    | kvm_bindings::KVM_VCPUEVENT_VALID_PAYLOAD
    | kvm_bindings::KVM_VCPUEVENT_VALID_TRIPLE_FAULT;

impl From<&kvm_vcpu_events> for VcpuEvents {
    fn from(e: &kvm_vcpu_events) -> VcpuEvents {
        VcpuEvents {
            exception: ExceptionEvent {
                injected: e.exception.injected,
                nr: e.exception.nr,
                has_error_code: e.exception.has_error_code,
                pending: e.exception.pending,
                error_code: e.exception.error_code,
                has_payload: e.exception_has_payload,
                payload: e.exception_payload,
            },
            interrupt: InterruptEvent {
                injected: e.interrupt.injected,
                nr: e.interrupt.nr,
                soft: e.interrupt.soft,
                shadow: e.interrupt.shadow,
            },
            nmi: NmiEvent {
                injected: e.nmi.injected,
                pending: e.nmi.pending,
                masked: e.nmi.masked,
            },
            sipi_vector: e.sipi_vector,
            flags: e.flags,
            smi: SmiEvent {
                smm: e.smi.smm,
                pending: e.smi.pending,
                smm_inside_nmi: e.smi.smm_inside_nmi,
                latched_init: e.smi.latched_init,
            },
            triple_fault_pending: e.triple_fault.pending,
        }
    }
}

impl From<&VcpuEvents> for kvm_vcpu_events {
    fn from(e: &VcpuEvents) -> kvm_vcpu_events {
        let mut k = kvm_vcpu_events::default();
        k.exception.injected = e.exception.injected;
        k.exception.nr = e.exception.nr;
        k.exception.has_error_code = e.exception.has_error_code;
        k.exception.pending = e.exception.pending;
        k.exception.error_code = e.exception.error_code;
        k.exception_has_payload = e.exception.has_payload;
        k.exception_payload = e.exception.payload;
        k.interrupt.injected = e.interrupt.injected;
        k.interrupt.nr = e.interrupt.nr;
        k.interrupt.soft = e.interrupt.soft;
        k.interrupt.shadow = e.interrupt.shadow;
        k.nmi.injected = e.nmi.injected;
        k.nmi.pending = e.nmi.pending;
        k.nmi.masked = e.nmi.masked;
        k.sipi_vector = e.sipi_vector;
        k.flags = e.flags;
        k.smi.smm = e.smi.smm;
        k.smi.pending = e.smi.pending;
        k.smi.smm_inside_nmi = e.smi.smm_inside_nmi;
        k.smi.latched_init = e.smi.latched_init;
        k.triple_fault.pending = e.triple_fault_pending;
        k
    }
}

/// One MSR and its value.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Msr {
    pub index: u32,
    pub data: u64,
}

/// Everything KVM needs to resume an x86_64 vCPU exactly where it was
/// paused, in a fresh vCPU of a fresh VM (with the VM's
/// [`super::vm_state::VmState`] and its RAM). Versioned by the envelope of
/// `state.json` that holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuState {
    /// The vCPU's id (its APIC id).
    pub id: u8,
    /// The CPUID the VMM set (empty if it set none).
    pub cpuid: Vec<CpuidEntry>,
    /// The guest TSC frequency, if KVM reports it.
    pub tsc_khz: Option<u32>,
    /// `KVM_MP_STATE_*`.
    pub mp_state: u32,
    /// General registers.
    pub regs: Regs,
    /// Special registers.
    pub sregs: Sregs,
    /// x87 and SSE registers.
    pub fpu: Fpu,
    /// The XSAVE area, [`XSAVE_SIZE`] bytes.
    pub xsave: HexBytes,
    /// XCR0 (and any other XCR KVM reports).
    pub xcrs: Vec<Xcr>,
    /// The local APIC's register page, [`LAPIC_SIZE`] bytes.
    pub lapic: HexBytes,
    /// The MSRs, in capture order.
    pub msrs: Vec<Msr>,
    /// Debug registers.
    pub debugregs: DebugRegs,
    /// Pending and injected events.
    pub events: VcpuEvents,
}

fn ioctl(id: u8, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> CpuStateError {
    move |source| CpuStateError::Ioctl { id, what, source }
}

/// Reads `indices` on `fd`, skipping the MSRs KVM refuses to read (KVM
/// stops at the first: the read goes on past it).
fn read_msrs(fd: &VcpuFd, id: u8, indices: &[u32]) -> Result<Vec<Msr>, CpuStateError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        // A chunk is at most KVM_MAX_MSR_ENTRIES long: never too many.
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| CpuStateError::BadField {
            id,
            field: "msrs",
            why: "too many MSRs".into(),
        })?;
        let n = fd.get_msrs(&mut msrs).map_err(ioctl(id, "KVM_GET_MSRS"))?;
        let n = n.min(chunk.len());
        out.extend(msrs.as_slice()[..n].iter().map(|e| Msr {
            index: e.index,
            data: e.data,
        }));
        if n < chunk.len() {
            log::debug!("vCPU {id}: MSR {:#x} cannot be read, not saved", chunk[n]);
            rest = &rest[n + 1..];
        } else {
            rest = &rest[chunk.len()..];
        }
    }
    Ok(out)
}

impl VcpuState {
    /// Captures the state of `vcpu`, which must not be inside `KVM_RUN`
    /// (paused), on its own thread. See the module docs for the order.
    pub fn capture(vcpu: &Vcpu, ctx: &CpuStateContext) -> Result<VcpuState, CpuStateError> {
        let id = vcpu.id();
        let fd = vcpu.fd();
        let mp_state = fd
            .get_mp_state()
            .map_err(ioctl(id, "KVM_GET_MP_STATE"))?
            .mp_state;
        let cpuid = fd
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl(id, "KVM_GET_CPUID2"))?
            .as_slice()
            .iter()
            .map(|e| CpuidEntry {
                function: e.function,
                index: e.index,
                flags: e.flags,
                eax: e.eax,
                ebx: e.ebx,
                ecx: e.ecx,
                edx: e.edx,
            })
            .collect();
        let tsc_khz = if ctx.tsc_khz {
            Some(fd.get_tsc_khz().map_err(ioctl(id, "KVM_GET_TSC_KHZ"))?)
        } else {
            None
        };
        let regs = (&fd.get_regs().map_err(ioctl(id, "KVM_GET_REGS"))?).into();
        let sregs = (&fd.get_sregs().map_err(ioctl(id, "KVM_GET_SREGS"))?).into();
        let fpu = (&fd.get_fpu().map_err(ioctl(id, "KVM_GET_FPU"))?).into();
        let xsave = fd.get_xsave().map_err(ioctl(id, "KVM_GET_XSAVE"))?;
        let xsave = HexBytes(xsave.region.iter().flat_map(|w| w.to_le_bytes()).collect());
        let xcrs = if ctx.xcrs {
            let x = fd.get_xcrs().map_err(ioctl(id, "KVM_GET_XCRS"))?;
            let n = (x.nr_xcrs as usize).min(MAX_XCRS);
            x.xcrs[..n]
                .iter()
                .map(|x| Xcr {
                    xcr: x.xcr,
                    value: x.value,
                })
                .collect()
        } else {
            Vec::new()
        };
        let lapic = fd.get_lapic().map_err(ioctl(id, "KVM_GET_LAPIC"))?;
        let lapic = HexBytes(lapic.regs.iter().map(|&b| b as u8).collect());
        let msrs = read_msrs(fd, id, &ctx.msr_indices)?;
        let d = fd
            .get_debug_regs()
            .map_err(ioctl(id, "KVM_GET_DEBUGREGS"))?;
        let debugregs = DebugRegs {
            db: d.db,
            dr6: d.dr6,
            dr7: d.dr7,
            flags: d.flags,
        };
        let events = (&fd
            .get_vcpu_events()
            .map_err(ioctl(id, "KVM_GET_VCPU_EVENTS"))?)
            .into();
        Ok(VcpuState {
            id,
            cpuid,
            tsc_khz,
            mp_state,
            regs,
            sregs,
            fpu,
            xsave,
            xcrs,
            lapic,
            msrs,
            debugregs,
            events,
        })
    }

    /// Checks what KVM cannot check for us (sizes, counts, known values),
    /// naming the first bad field. KVM checks the values themselves when
    /// [`VcpuState::restore`] sets them.
    pub fn validate(&self) -> Result<(), CpuStateError> {
        let bad = |field, why: String| {
            Err(CpuStateError::BadField {
                id: self.id,
                field,
                why,
            })
        };
        let len = |field, b: &HexBytes, want: usize| {
            if b.0.len() == want {
                Ok(())
            } else {
                bad(field, format!("{} bytes, expected {want}", b.0.len()))
            }
        };
        if self.cpuid.len() > KVM_MAX_CPUID_ENTRIES {
            return bad(
                "cpuid",
                format!(
                    "{} entries, at most {KVM_MAX_CPUID_ENTRIES}",
                    self.cpuid.len()
                ),
            );
        }
        if self.tsc_khz == Some(0) {
            return bad("tsc_khz", "zero".into());
        }
        if self.mp_state > MAX_MP_STATE {
            return bad(
                "mp_state",
                format!("{} is not a KVM_MP_STATE value", self.mp_state),
            );
        }
        len("fpu.fpr", &self.fpu.fpr, FPR_BYTES)?;
        len("fpu.xmm", &self.fpu.xmm, XMM_BYTES)?;
        len("xsave", &self.xsave, XSAVE_SIZE)?;
        if self.xcrs.len() > MAX_XCRS {
            return bad(
                "xcrs",
                format!("{} entries, at most {MAX_XCRS}", self.xcrs.len()),
            );
        }
        len("lapic", &self.lapic, LAPIC_SIZE)?;
        for (i, m) in self.msrs.iter().enumerate() {
            if self.msrs[..i].iter().any(|o| o.index == m.index) {
                return bad("msrs", format!("MSR {:#x} appears twice", m.index));
            }
        }
        if self.events.flags & !EVENT_FLAGS != 0 {
            return bad(
                "events.flags",
                format!("unknown bits {:#x}", self.events.flags & !EVENT_FLAGS),
            );
        }
        Ok(())
    }

    /// Puts this state into `vcpu` (a fresh vCPU of the VM that gets the
    /// captured RAM and VM state, not inside `KVM_RUN`), on its own thread,
    /// in the order the module docs give. Validates first; fails naming
    /// the ioctl or the MSR KVM refused. A failed restore leaves the vCPU
    /// partly set: it must not run.
    pub fn restore(&self, vcpu: &Vcpu, ctx: &CpuStateContext) -> Result<(), CpuStateError> {
        let id = vcpu.id();
        if self.id != id {
            return Err(CpuStateError::BadField {
                id,
                field: "id",
                why: format!("state of vCPU {} given to vCPU {id}", self.id),
            });
        }
        self.validate()?;
        let fd = vcpu.fd();
        if !self.cpuid.is_empty() {
            let entries: Vec<kvm_cpuid_entry2> = self
                .cpuid
                .iter()
                .map(|e| kvm_cpuid_entry2 {
                    function: e.function,
                    index: e.index,
                    flags: e.flags,
                    eax: e.eax,
                    ebx: e.ebx,
                    ecx: e.ecx,
                    edx: e.edx,
                    padding: [0; 3],
                })
                .collect();
            // At most KVM_MAX_CPUID_ENTRIES: checked by `validate`.
            let cpuid = CpuId::from_entries(&entries).map_err(|_| CpuStateError::BadField {
                id,
                field: "cpuid",
                why: "too many entries".into(),
            })?;
            fd.set_cpuid2(&cpuid).map_err(ioctl(id, "KVM_SET_CPUID2"))?;
        }
        if let Some(saved) = self.tsc_khz {
            let host = if ctx.tsc_khz {
                fd.get_tsc_khz().map_err(ioctl(id, "KVM_GET_TSC_KHZ"))?
            } else {
                0
            };
            if host != saved {
                fd.set_tsc_khz(saved)
                    .map_err(|_| CpuStateError::TscFrequency { id, saved, host })?;
            }
        }
        fd.set_sregs(&(&self.sregs).into())
            .map_err(ioctl(id, "KVM_SET_SREGS"))?;
        fd.set_regs(&(&self.regs).into())
            .map_err(ioctl(id, "KVM_SET_REGS"))?;
        fd.set_fpu(&self.fpu.to_kvm())
            .map_err(ioctl(id, "KVM_SET_FPU"))?;
        let mut xsave = kvm_xsave::default();
        for (w, b) in xsave.region.iter_mut().zip(self.xsave.0.chunks_exact(4)) {
            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        // `CpuStateContext::new` checked (KVM_CAP_XSAVE2) that the guest's
        // XSAVE size is at most `size_of::<kvm_xsave>()`, the size of `xsave`.
        // SAFETY: so KVM_SET_XSAVE reads only inside `xsave`.
        unsafe { fd.set_xsave(&xsave) }.map_err(ioctl(id, "KVM_SET_XSAVE"))?;
        if !self.xcrs.is_empty() {
            let mut x = kvm_xcrs {
                nr_xcrs: self.xcrs.len() as u32,
                ..Default::default()
            };
            for (k, s) in x.xcrs.iter_mut().zip(&self.xcrs) {
                *k = kvm_xcr {
                    xcr: s.xcr,
                    reserved: 0,
                    value: s.value,
                };
            }
            fd.set_xcrs(&x).map_err(ioctl(id, "KVM_SET_XCRS"))?;
        }
        let mut lapic = kvm_lapic_state::default();
        for (r, &b) in lapic.regs.iter_mut().zip(&self.lapic.0) {
            *r = b as std::os::raw::c_char;
        }
        fd.set_lapic(&lapic).map_err(ioctl(id, "KVM_SET_LAPIC"))?;
        // IA32_TSC first, whatever the order in the state: the values of
        // TSC_DEADLINE (and the TSC-relative kvmclock data) are read
        // against the guest TSC at the time they are written.
        let msrs: Vec<Msr> = self
            .msrs
            .iter()
            .filter(|m| m.index == MSR_IA32_TSC)
            .chain(self.msrs.iter().filter(|m| m.index != MSR_IA32_TSC))
            .copied()
            .collect();
        for chunk in msrs.chunks(KVM_MAX_MSR_ENTRIES) {
            let entries: Vec<kvm_msr_entry> = chunk
                .iter()
                .map(|m| kvm_msr_entry {
                    index: m.index,
                    data: m.data,
                    ..Default::default()
                })
                .collect();
            // A chunk is at most KVM_MAX_MSR_ENTRIES long.
            let msrs = Msrs::from_entries(&entries).map_err(|_| CpuStateError::BadField {
                id,
                field: "msrs",
                why: "too many MSRs".into(),
            })?;
            let n = fd.set_msrs(&msrs).map_err(ioctl(id, "KVM_SET_MSRS"))?;
            if let Some(m) = chunk.get(n) {
                return Err(CpuStateError::MsrRejected {
                    id,
                    index: m.index,
                    data: m.data,
                });
            }
        }
        let d = &self.debugregs;
        fd.set_debug_regs(&kvm_debugregs {
            db: d.db,
            dr6: d.dr6,
            dr7: d.dr7,
            flags: d.flags,
            reserved: [0; 9],
        })
        .map_err(ioctl(id, "KVM_SET_DEBUGREGS"))?;
        fd.set_mp_state(kvm_mp_state {
            mp_state: self.mp_state,
        })
        .map_err(ioctl(id, "KVM_SET_MP_STATE"))?;
        fd.set_vcpu_events(&(&self.events).into())
            .map_err(ioctl(id, "KVM_SET_VCPU_EVENTS"))?;
        Ok(())
    }
}

/// What the VMM asks of a paused vCPU thread (see
/// [`crate::vcpu::VcpuControl::save_states`]).
#[derive(Debug, Clone)]
pub(crate) enum StateRequest {
    /// Capture the vCPU's state.
    Save(Arc<CpuStateContext>),
    /// Restore the state in the list whose id is the vCPU's.
    Restore(Arc<Vec<VcpuState>>, Arc<CpuStateContext>),
}

/// A vCPU thread's answer: the state it captured, or `None` after a
/// restore.
pub(crate) type StateReply = Result<Option<VcpuState>, CpuStateError>;

impl StateRequest {
    /// Serves the request on `vcpu`'s thread.
    pub(crate) fn serve(&self, vcpu: &Vcpu) -> StateReply {
        match self {
            StateRequest::Save(ctx) => VcpuState::capture(vcpu, ctx).map(Some),
            StateRequest::Restore(states, ctx) => {
                let id = vcpu.id();
                let state =
                    states
                        .iter()
                        .find(|s| s.id == id)
                        .ok_or_else(|| CpuStateError::BadField {
                            id,
                            field: "id",
                            why: "no state for this vCPU".into(),
                        })?;
                state.restore(vcpu, ctx).map(|()| None)
            }
        }
    }
}

/// A valid state built without KVM, for tests of the code around it.
#[cfg(test)]
pub(crate) fn sample_state(id: u8) -> VcpuState {
    VcpuState {
        id,
        cpuid: vec![CpuidEntry {
            function: 1,
            index: 0,
            flags: 0,
            eax: 0x806f8,
            ebx: u32::from(id) << 24,
            ecx: 0x8000_0000,
            edx: 0,
        }],
        tsc_khz: Some(2_000_000),
        mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
        regs: Regs {
            rip: 0xc000,
            rsp: 0x1000,
            rflags: 2,
            rax: 7,
            ..Default::default()
        },
        sregs: Sregs {
            cr0: 0x8000_0031,
            efer: 0x500,
            ..Default::default()
        },
        fpu: Fpu {
            fpr: HexBytes(vec![1; FPR_BYTES]),
            fcw: 0x37f,
            xmm: HexBytes(vec![2; XMM_BYTES]),
            mxcsr: 0x1f80,
            ..Default::default()
        },
        xsave: HexBytes(vec![3; XSAVE_SIZE]),
        xcrs: vec![Xcr { xcr: 0, value: 7 }],
        lapic: HexBytes(vec![4; LAPIC_SIZE]),
        msrs: vec![
            Msr {
                index: 0x10,
                data: 12345,
            },
            Msr {
                index: 0x4b56_4d01,
                data: 0x5001,
            },
        ],
        debugregs: DebugRegs {
            dr6: 0xffff_0ff0,
            dr7: 0x400,
            ..Default::default()
        },
        events: VcpuEvents {
            flags: kvm_bindings::KVM_VCPUEVENT_VALID_SHADOW,
            nmi: NmiEvent {
                masked: 1,
                ..Default::default()
            },
            ..Default::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(e: CpuStateError) -> &'static str {
        match e {
            CpuStateError::BadField { field, .. } => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_valid_state_round_trips_through_json() {
        let s = sample_state(2);
        s.validate().unwrap();
        let j = serde_json::to_string(&s).unwrap();
        let back: VcpuState = serde_json::from_str(&j).unwrap();
        assert_eq!(back, s);
        // Segments name their type field `type`.
        assert!(j.contains("\"type\":0"), "{j}");
    }

    #[test]
    fn unknown_fields_and_bad_hex_are_refused_by_the_reader() {
        let s = sample_state(0);
        let mut v = serde_json::to_value(&s).unwrap();
        v["regs"]["rzz"] = 1.into();
        let e = serde_json::from_value::<VcpuState>(v).unwrap_err();
        assert!(e.to_string().contains("unknown field `rzz`"), "{e}");
        let mut v = serde_json::to_value(&s).unwrap();
        v["lapic"] = "0x12".into();
        let e = serde_json::from_value::<VcpuState>(v).unwrap_err();
        assert!(e.to_string().contains("not a hex digit"), "{e}");
        let mut v = serde_json::to_value(&s).unwrap();
        v["mp_state"] = (-1).into();
        assert!(serde_json::from_value::<VcpuState>(v).is_err());
        let mut v = serde_json::to_value(&s).unwrap();
        v.as_object_mut().unwrap().remove("events");
        let e = serde_json::from_value::<VcpuState>(v).unwrap_err();
        assert!(e.to_string().contains("missing field `events`"), "{e}");
    }

    /// A field's name and how to spoil it.
    type Spoil = (&'static str, Box<dyn Fn(&mut VcpuState)>);

    #[test]
    fn validate_names_each_bad_field() {
        let cases: Vec<Spoil> = vec![
            (
                "fpu.fpr",
                Box::new(|s| s.fpu.fpr.0.pop().map(drop).unwrap()),
            ),
            ("fpu.xmm", Box::new(|s| s.fpu.xmm.0.push(0))),
            ("xsave", Box::new(|s| s.xsave.0.truncate(512))),
            ("lapic", Box::new(|s| s.lapic.0.clear())),
            (
                "xcrs",
                Box::new(|s| s.xcrs = vec![Xcr { xcr: 0, value: 1 }; MAX_XCRS + 1]),
            ),
            (
                "cpuid",
                Box::new(|s| s.cpuid = vec![s.cpuid[0]; KVM_MAX_CPUID_ENTRIES + 1]),
            ),
            ("mp_state", Box::new(|s| s.mp_state = MAX_MP_STATE + 1)),
            ("tsc_khz", Box::new(|s| s.tsc_khz = Some(0))),
            ("msrs", Box::new(|s| s.msrs.push(s.msrs[0]))),
            ("events.flags", Box::new(|s| s.events.flags |= 1 << 20)),
        ];
        for (field, spoil) in cases {
            let mut s = sample_state(1);
            spoil(&mut s);
            let e = s.validate().unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.starts_with(&format!("vCPU 1: field {field}: ")),
                "{msg}"
            );
            assert_eq!(field_of(e), field);
        }
        let mut s = sample_state(1);
        s.tsc_khz = None;
        s.cpuid.clear();
        s.xcrs.clear();
        s.msrs.clear();
        s.validate().unwrap();
    }

    #[test]
    fn kvm_structs_convert_both_ways_without_loss() {
        let s = sample_state(0);
        let regs: kvm_regs = (&s.regs).into();
        assert_eq!(Regs::from(&regs), s.regs);
        let mut sregs = s.sregs;
        sregs.cs = Segment {
            base: 1,
            limit: 2,
            selector: 8,
            type_: 11,
            present: 1,
            dpl: 3,
            db: 0,
            s: 1,
            l: 1,
            g: 1,
            avl: 1,
            unusable: 0,
        };
        sregs.idt = DescriptorTable {
            base: 0x1800,
            limit: 47,
        };
        sregs.interrupt_bitmap = [0, 1 << 3, 0, 0];
        let k: kvm_sregs = (&sregs).into();
        assert_eq!(Sregs::from(&k), sregs);
        let fpu = s.fpu.to_kvm();
        assert_eq!(fpu.fpr[7], [1; 16]);
        assert_eq!(fpu.xmm[15], [2; 16]);
        assert_eq!(Fpu::from(&fpu), s.fpu);
        let mut ev = s.events;
        ev.exception = ExceptionEvent {
            injected: 1,
            nr: 14,
            has_error_code: 1,
            pending: 0,
            error_code: 2,
            has_payload: 1,
            payload: 0xdead_b000,
        };
        ev.interrupt.nr = 0x30;
        ev.smi.latched_init = 1;
        ev.sipi_vector = 9;
        ev.triple_fault_pending = 1;
        let k: kvm_vcpu_events = (&ev).into();
        assert_eq!(VcpuEvents::from(&k), ev);
    }
}
