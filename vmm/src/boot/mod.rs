//! Booting Linux: the guest memory map ([`layout`]), loading the kernel and
//! filling the boot parameters ([`linux`]), and placing the initramfs
//! ([`initramfs`]).
//!
//! The steps, as the VMM runs them before the first `KVM_RUN`:
//!
//! 1. [`linux::load`] reads the kernel (a bzImage, booted through the
//!    64-bit Linux boot protocol, or an ELF vmlinux with a PVH note, booted
//!    through PVH), the initramfs and the command line into guest RAM, and
//!    writes the zero page (or the PVH start info), the e820 map, the boot
//!    GDT and the identity page tables.
//! 2. [`crate::acpi::create_acpi_tables`] writes the ACPI tables at
//!    [`layout::ACPI_RSDP_START`] (the zero page and the PVH start info
//!    already point there).
//! 3. The boot vCPU gets [`linux::BootVcpuState`]: `regs()` for
//!    `KVM_SET_REGS`, `apply_sregs()` inside `Vcpu::update_sregs`. The other
//!    vCPUs wait for the guest's INIT/SIPI.

pub mod initramfs;
pub mod layout;
pub mod linux;

use std::path::PathBuf;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

/// Errors of kernel, initramfs and command line loading.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("opening or reading {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a Linux kernel (neither a bzImage nor an ELF vmlinux)")]
    NotAKernel { path: PathBuf },
    #[error("{path}: invalid bzImage: {reason}")]
    InvalidBzImage { path: PathBuf, reason: String },
    #[error(
        "{path}: boot protocol version {version:#06x} too old: a bzImage needs 2.12 (0x020c) \
         or later with a 64-bit entry point"
    )]
    OldBootProtocol { path: PathBuf, version: u16 },
    #[error("{path}: ELF kernel without a PVH entry point note (XEN_ELFNOTE_PHYS32_ENTRY)")]
    NoPvhNote { path: PathBuf },
    #[error("{path}: loading the kernel")]
    Loader {
        path: PathBuf,
        #[source]
        source: linux_loader::loader::Error,
    },
    #[error(
        "{path}: the kernel needs guest memory up to {needed:#x}, but RAM below the 32-bit \
         hole ends at {available:#x}"
    )]
    KernelTooLarge {
        path: PathBuf,
        needed: u64,
        available: u64,
    },
    #[error("kernel command line is {len} bytes, the kernel accepts at most {max}")]
    CmdlineTooLong { len: usize, max: u64 },
    #[error("kernel command line contains a NUL byte")]
    CmdlineNul,
    #[error(
        "{path}: initramfs of {size:#x} bytes does not fit between the kernel's end {low:#x} \
         and {high:#x}"
    )]
    InitramfsTooLarge {
        path: PathBuf,
        size: u64,
        low: u64,
        high: u64,
    },
    #[error("writing boot data to guest memory at {addr:#x}")]
    GuestMemory {
        addr: u64,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    #[error("{entries} memory map entries, at most {max} fit")]
    TooManyE820Entries { entries: usize, max: usize },
}

impl BootError {
    /// Whether the cause is in what the config names (a file that is not a
    /// kernel, a command line or initramfs the kernel cannot take, too
    /// little RAM for the kernel) rather than in the host: the API answers
    /// these with 400.
    pub fn is_config_error(&self) -> bool {
        !matches!(
            self,
            BootError::GuestMemory { .. } | BootError::TooManyE820Entries { .. }
        )
    }
}

/// The code at [`layout::RESET_VECTOR`]: `mov al, 0xfe; out 0x64, al;
/// hlt; jmp hlt`. There is no BIOS, and Linux on hardware-reduced ACPI
/// without EFI reboots by default through the BIOS (a real-mode jump to
/// the reset vector), which would run zeroed RAM forever. The stub pulses
/// the i8042 reset line, which the VMM turns into a reset.
pub const RESET_STUB: [u8; 7] = [0xb0, 0xfe, 0xe6, 0x64, 0xf4, 0xeb, 0xfd];

// The stub fits below 1 MiB, after the ACPI tables.
const _: () = assert!(layout::RESET_VECTOR + RESET_STUB.len() as u64 <= 1 << 20);
const _: () = assert!(layout::ACPI_TABLES_END <= layout::RESET_VECTOR);

/// Writes [`RESET_STUB`] at the reset vector (in the reserved area below
/// 1 MiB, which the e820 map keeps from the guest's allocator).
pub fn write_reset_stub<M: GuestMemoryBackend>(mem: &M) -> Result<(), BootError> {
    mem.write_slice(&RESET_STUB, GuestAddress(layout::RESET_VECTOR))
        .map_err(|source| BootError::GuestMemory {
            addr: layout::RESET_VECTOR,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    #[test]
    fn reset_stub_sits_in_reserved_memory_after_the_acpi_tables() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        write_reset_stub(&mem).unwrap();
        let mut b = [0u8; 7];
        mem.read_slice(&mut b, GuestAddress(layout::RESET_VECTOR))
            .unwrap();
        assert_eq!(b, RESET_STUB);
        let reserved = layout::e820_map(256 << 20).into_iter().any(|e| {
            e.kind == layout::E820Kind::Reserved
                && e.addr <= layout::RESET_VECTOR
                && layout::RESET_VECTOR + 16 <= e.addr + e.size
        });
        assert!(
            reserved,
            "the reset vector must be reserved in the e820 map"
        );
    }
}
