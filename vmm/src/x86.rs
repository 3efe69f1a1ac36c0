//! x86 definitions shared by the Linux boot path and the test guest:
//! control-register and EFER bits, GDT descriptors and their KVM view.

use kvm_bindings::kvm_segment;

pub(crate) const CR0_PE: u64 = 1;
pub(crate) const CR0_MP: u64 = 1 << 1;
pub(crate) const CR0_ET: u64 = 1 << 4;
pub(crate) const CR0_NE: u64 = 1 << 5;
pub(crate) const CR0_WP: u64 = 1 << 16;
pub(crate) const CR0_NW: u64 = 1 << 29;
pub(crate) const CR0_CD: u64 = 1 << 30;
pub(crate) const CR0_PG: u64 = 1 << 31;
pub(crate) const CR4_PAE: u64 = 1 << 5;
pub(crate) const EFER_LME: u64 = 1 << 8;
pub(crate) const EFER_LMA: u64 = 1 << 10;

/// A GDT descriptor from flags (bits 40..56 of the descriptor: the access
/// byte, then the G/DB/L/AVL nibble in bits 12..16, as `0xF0FF`), base and
/// limit.
pub(crate) fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (u64::from(flags), u64::from(base), u64::from(limit));
    ((base & 0xff00_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
        | ((limit & 0xf_0000) << 32)
        | ((flags & 0xf0ff) << 40)
}

/// The KVM view of the segment `gdt_entry(flags, base, limit)` loaded
/// through `selector`.
pub(crate) fn segment(selector: u16, flags: u16, base: u32, limit: u32) -> kvm_segment {
    let g = (flags >> 15) & 1;
    kvm_segment {
        base: u64::from(base),
        limit: if g == 1 { (limit << 12) | 0xfff } else { limit },
        selector,
        type_: (flags & 0xf) as u8,
        present: ((flags >> 7) & 1) as u8,
        dpl: ((flags >> 5) & 3) as u8,
        db: ((flags >> 14) & 1) as u8,
        s: ((flags >> 4) & 1) as u8,
        l: ((flags >> 13) & 1) as u8,
        g: g as u8,
        avl: ((flags >> 12) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}
