//! The guest physical memory map, in one place.
//!
//! Every fixed guest address the VMM uses is a constant here; other modules
//! (PCI, the device manager, the VM) import them instead of choosing their
//! own. The map follows Cloud Hypervisor's x86_64 layout where it can.
//!
//! ```text
//! 0x0000_0000  real-mode IVT / BDA (RAM, untouched)
//! 0x0000_0500  BOOT_GDT_START     GDT for 64-bit and PVH entry (6 entries)
//! 0x0000_0530  BOOT_IDT_START     empty IDT
//! 0x0000_6000  PVH_INFO_START     hvm_start_info (PVH boot)
//! 0x0000_6040  PVH_MODLIST_START  hvm_modlist_entry for the initramfs
//! 0x0000_6100  PVH_MEMMAP_START   hvm_memmap_table_entry[] (PVH e820)
//! 0x0000_7000  ZERO_PAGE_START    boot_params (Linux boot protocol)
//! 0x0000_8ff0  BOOT_STACK_POINTER initial rsp/esp
//! 0x0000_9000  PML4_START         identity page tables for 64-bit entry:
//! 0x0000_a000  PDPTE_START          PML4 -> PDPT -> 4 page directories of
//! 0x0000_b000  PDE_START            2 MiB pages mapping 0..4 GiB
//! 0x0002_0000  CMDLINE_START      kernel command line (NUL terminated)
//! 0x0009_fc00  EBDA_START         reserved up to 1 MiB (EBDA, VGA, BIOS)
//! 0x000e_0000  ACPI_RSDP_START    RSDP, then the other ACPI tables up to
//! 0x000f_fff0  RESET_VECTOR       ACPI_TABLES_END; the reset stub (a reboot
//!                                 through the BIOS lands here)
//! 0x0010_0000  HIGH_RAM_START     bzImage protected-mode kernel load address
//!   ...        RAM                  (ELF kernels load at their own addresses)
//!   ...        initramfs          at the top of RAM below the hole, 4 KiB
//!                                 aligned (and below the header's limit)
//! 0xc000_0000  MEM_32BIT_HOLE_START: no RAM from here to 4 GiB
//! 0xc000_0000  PCI_MMIO32_START   32-bit PCI BAR window (512 MiB)
//! 0xe000_0000  (free)
//! 0xe800_0000  PCI_ECAM_START     PCI ECAM (MMCONFIG), bus 0 only (1 MiB),
//!                                 Cloud Hypervisor's address
//! 0xe810_0000  (free for platform MMIO)
//! 0xfec0_0000  IOAPIC_START       IO-APIC
//! 0xfee0_0000  LAPIC_START        local APICs
//! 0xfffb_c000  KVM_IDENTITY_MAP_START / KVM_TSS_START (Intel only)
//! 0x1_0000_0000 RAM_64BIT_START   RAM above the hole (guest RAM > 3 GiB)
//!   ...        pmem regions       from pmem_area_start(), 2 MiB aligned,
//!                                 never below 4 GiB
//!   ...        64-bit PCI BARs    the pci module's Mmio64Window::above(end
//!                                 of the last pmem region): 1 GiB aligned,
//!                                 64 GiB; the ACPI _CRS takes it from
//!                                 AcpiConfig. PCI_MMIO64_START is only a
//!                                 fallback (just below 1 TiB).
//! ```
//!
//! I/O ports with a fixed meaning: [`ACPI_SHUTDOWN_PORT`] (power off and
//! reboot, see [`crate::acpi`]), [`PCI_CONFIG_IO_START`] (0xcf8, legacy PCI
//! configuration mechanism #1), [`RESET_CONTROL_PORT`] (0xcf9, reset), and
//! the serial port at 0x3f8 (IRQ 4).

/// Start of the boot GDT.
pub const BOOT_GDT_START: u64 = 0x500;
/// Number of entries in the boot GDT: null, null, 64-bit code (selector
/// 0x10, the boot protocol's `__BOOT_CS`), data (0x18, `__BOOT_DS`), TSS
/// (0x20), 32-bit code (0x28, for PVH entry).
pub const BOOT_GDT_ENTRIES: usize = 6;
/// Start of the (empty) boot IDT.
pub const BOOT_IDT_START: u64 = 0x530;

/// PVH `hvm_start_info`, handed to the kernel in `rbx`.
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH module list (one entry: the initramfs).
pub const PVH_MODLIST_START: u64 = 0x6040;
/// PVH memory map (`hvm_memmap_table_entry` array, 24 bytes each).
pub const PVH_MEMMAP_START: u64 = 0x6100;
/// Maximum number of PVH memory map entries that fit before the zero page.
pub const PVH_MEMMAP_MAX_ENTRIES: usize = ((ZERO_PAGE_START - PVH_MEMMAP_START) / 24) as usize;

/// The Linux zero page (`struct boot_params`), handed to the kernel in `rsi`.
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer for the boot vCPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;

/// Identity-mapping PML4 for 64-bit entry (`cr3`).
pub const PML4_START: u64 = 0x9000;
/// The PML4's one page-directory-pointer table.
pub const PDPTE_START: u64 = 0xa000;
/// First of [`PDE_COUNT`] page directories (2 MiB pages).
pub const PDE_START: u64 = 0xb000;
/// Page directories: each maps 1 GiB, so the boot tables map 0..4 GiB.
pub const PDE_COUNT: u64 = 4;

/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Room for the command line, NUL included (the kernel's own limit, the
/// setup header's `cmdline_size`, is usually smaller: 2048 on 6.1).
pub const CMDLINE_MAX_SIZE: u64 = 0x10000;

/// Extended BIOS data area: from here to 1 MiB is reserved in the e820 map.
pub const EBDA_START: u64 = 0x9fc00;
/// The ACPI RSDP (in the 0xe0000..0x100000 range the kernel also scans).
pub const ACPI_RSDP_START: u64 = 0xe0000;
/// End (exclusive) of the room for the ACPI tables, which follow the RSDP.
pub const ACPI_TABLES_END: u64 = RESET_VECTOR;
/// The x86 reset vector (F000:FFF0, 16 bytes below 1 MiB): a guest that
/// reboots "through the BIOS" jumps here in real mode; the VMM puts a
/// stub there ([`crate::boot::RESET_STUB`]).
pub const RESET_VECTOR: u64 = 0xf_fff0;

/// First RAM above 1 MiB; a bzImage's protected-mode kernel loads here.
pub const HIGH_RAM_START: u64 = 0x10_0000;

/// Start of the 32-bit MMIO hole: guest RAM below 4 GiB ends here at most.
pub const MEM_32BIT_HOLE_START: u64 = 0xc000_0000;
/// Size of the 32-bit MMIO hole (up to 4 GiB).
pub const MEM_32BIT_HOLE_SIZE: u64 = RAM_64BIT_START - MEM_32BIT_HOLE_START;

/// 32-bit PCI MMIO window (non-prefetchable BARs below 4 GiB).
pub const PCI_MMIO32_START: u64 = 0xc000_0000;
/// Size of the 32-bit PCI MMIO window.
pub const PCI_MMIO32_SIZE: u64 = 0x2000_0000;
/// PCI Express ECAM (MMCONFIG) window of PCI segment 0.
pub const PCI_ECAM_START: u64 = 0xe800_0000;
/// Size of the ECAM window: 1 MiB per bus.
pub const PCI_ECAM_SIZE: u64 = (PCI_BUS_END as u64 + 1) << 20;
/// First PCI bus number the ECAM window decodes.
pub const PCI_BUS_START: u8 = 0;
/// Last PCI bus number the ECAM window decodes.
pub const PCI_BUS_END: u8 = 0;
/// PCI segment (MCFG and `_SEG`).
pub const PCI_SEGMENT: u16 = 0;

/// IO-APIC registers.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Size of the IO-APIC register window.
pub const IOAPIC_SIZE: u64 = 0x1000;
/// Number of IO-APIC pins (KVM's in-kernel IO-APIC).
pub const IOAPIC_PINS: u32 = 24;
/// Local APIC registers (every vCPU's, at the same address).
pub const LAPIC_START: u64 = 0xfee0_0000;
/// Size of the local APIC window.
pub const LAPIC_SIZE: u64 = 0x10_0000;
/// KVM's identity map page on Intel hosts (`KVM_SET_IDENTITY_MAP_ADDR`).
pub const KVM_IDENTITY_MAP_START: u64 = 0xfffb_c000;
/// KVM's TSS on Intel hosts (`KVM_SET_TSS_ADDR`, three pages).
pub const KVM_TSS_START: u64 = 0xfffb_d000;

/// RAM that does not fit below the hole continues here.
pub const RAM_64BIT_START: u64 = 0x1_0000_0000;

/// Alignment of pmem regions (and of their area's start).
pub const PMEM_ALIGN: u64 = 2 << 20;

/// A fixed 64-bit PCI MMIO window, for callers without the pci module's
/// dynamic `Mmio64Window` (which the VMM uses and gives to the ACPI tables).
pub const PCI_MMIO64_START: u64 = 0xf0_0000_0000;
/// Size of the 64-bit PCI MMIO window (ends at 1 TiB).
pub const PCI_MMIO64_SIZE: u64 = 0x10_0000_0000;

/// PCI I/O port window given to the host bridge (`_CRS`), after the
/// configuration ports.
pub const PCI_IO_START: u16 = 0x1000;
/// Size of the PCI I/O port window.
pub const PCI_IO_SIZE: u16 = 0xf000;
/// Legacy PCI configuration ports (0xcf8 address, 0xcfc..0xcff data).
pub const PCI_CONFIG_IO_START: u16 = 0xcf8;
/// Size of the legacy PCI configuration port range.
pub const PCI_CONFIG_IO_SIZE: u16 = 8;

/// The VMM's power-off/reboot port: the FADT's sleep control, sleep status
/// and reset registers all point at this one byte (as Cloud Hypervisor).
/// A write of [`crate::acpi::RESET_VALUE`] reboots; a write with `SLP_EN`
/// (bit 5) and `SLP_TYP` (bits 2..4) = [`crate::acpi::S5_SLEEP_TYPE`]
/// powers off.
pub const ACPI_SHUTDOWN_PORT: u16 = 0x3c0;
/// The "reset control register" a guest may use with `reboot=pci`: a write
/// with bit 2 set resets.
pub const RESET_CONTROL_PORT: u16 = 0xcf9;

// Compile-time checks of the fixed layout.
const _: () = {
    assert!(BOOT_STACK_POINTER > ZERO_PAGE_START + 0x1000);
    assert!(BOOT_STACK_POINTER < PML4_START);
    assert!(ACPI_RSDP_START >= EBDA_START && ACPI_TABLES_END <= HIGH_RAM_START);
    assert!(PCI_ECAM_START + PCI_ECAM_SIZE <= IOAPIC_START);
    assert!(PCI_MMIO32_START >= MEM_32BIT_HOLE_START);
    assert!(PCI_MMIO32_START + PCI_MMIO32_SIZE <= PCI_ECAM_START);
    assert!(PCI_MMIO64_START.is_multiple_of(1 << 30));
};

/// One range of guest RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RamRange {
    /// Guest-physical start.
    pub start: u64,
    /// Size in bytes.
    pub len: u64,
}

impl RamRange {
    /// First address after the range.
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// Where `ram_size` bytes of guest RAM go: from 0 up to the 32-bit hole,
/// the rest from [`RAM_64BIT_START`]. One or two ranges.
pub fn ram_ranges(ram_size: u64) -> Vec<RamRange> {
    let low = ram_size.min(MEM_32BIT_HOLE_START);
    let mut ranges = vec![RamRange { start: 0, len: low }];
    if ram_size > low {
        ranges.push(RamRange {
            start: RAM_64BIT_START,
            len: ram_size - low,
        });
    }
    ranges
}

/// First address after guest RAM.
pub fn ram_end(ram_size: u64) -> u64 {
    ram_ranges(ram_size).last().map_or(0, RamRange::end)
}

/// Where the first pmem region goes: above RAM, 2 MiB aligned, and never
/// below 4 GiB (so the 32-bit hole stays free); later regions follow, each
/// 2 MiB aligned, below [`PCI_MMIO64_START`].
pub fn pmem_area_start(ram_size: u64) -> u64 {
    ram_end(ram_size)
        .max(RAM_64BIT_START)
        .next_multiple_of(PMEM_ALIGN)
}

/// The kind of an [`E820Entry`] (the values of the BIOS e820 call, also
/// used by the PVH memory map).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum E820Kind {
    /// Usable RAM.
    Ram = 1,
    /// Reserved: the guest must not use it as RAM.
    Reserved = 2,
}

/// One entry of the guest's memory map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    /// Guest-physical start.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// What the range is.
    pub kind: E820Kind,
}

/// The guest's memory map for `ram_size` bytes of RAM, sorted by address,
/// without overlaps:
///
/// - RAM `0..EBDA_START`, reserved `EBDA_START..HIGH_RAM_START` (EBDA, VGA,
///   BIOS area, ACPI tables), RAM from `HIGH_RAM_START` to the end of RAM
///   below the hole;
/// - reserved: the PCI ECAM window (Linux only trusts an MCFG area that the
///   firmware reserves) and `IOAPIC_START..4 GiB` (APICs, KVM's TSS);
/// - RAM above 4 GiB when there is more than fits below the hole.
///
/// The PCI MMIO windows are *not* reserved: Linux clips e820-reserved
/// ranges out of host bridge windows (`pci_use_e820`), which would leave
/// PCI without room for BARs. pmem regions are not in the map either: the
/// guest learns about them from the virtio-pmem device.
pub fn e820_map(ram_size: u64) -> Vec<E820Entry> {
    let ram = ram_ranges(ram_size);
    let low_end = ram[0].end();
    let mut map = vec![E820Entry {
        addr: 0,
        size: EBDA_START.min(low_end),
        kind: E820Kind::Ram,
    }];
    map.push(E820Entry {
        addr: EBDA_START,
        size: HIGH_RAM_START - EBDA_START,
        kind: E820Kind::Reserved,
    });
    if low_end > HIGH_RAM_START {
        map.push(E820Entry {
            addr: HIGH_RAM_START,
            size: low_end - HIGH_RAM_START,
            kind: E820Kind::Ram,
        });
    }
    map.push(E820Entry {
        addr: PCI_ECAM_START,
        size: PCI_ECAM_SIZE,
        kind: E820Kind::Reserved,
    });
    map.push(E820Entry {
        addr: IOAPIC_START,
        size: RAM_64BIT_START - IOAPIC_START,
        kind: E820Kind::Reserved,
    });
    if let Some(high) = ram.get(1) {
        map.push(E820Entry {
            addr: high.start,
            size: high.len,
            kind: E820Kind::Ram,
        });
    }
    map.retain(|e| e.size > 0);
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_areas_do_not_overlap() {
        let areas = [
            (BOOT_GDT_START, BOOT_GDT_ENTRIES as u64 * 8),
            (BOOT_IDT_START, 8),
            (PVH_INFO_START, 0x40),
            (PVH_MODLIST_START, 0x20),
            (PVH_MEMMAP_START, PVH_MEMMAP_MAX_ENTRIES as u64 * 24),
            (ZERO_PAGE_START, 0x1000),
            (PML4_START, 0x1000),
            (PDPTE_START, 0x1000),
            (PDE_START, PDE_COUNT * 0x1000),
            (CMDLINE_START, CMDLINE_MAX_SIZE),
            (EBDA_START, HIGH_RAM_START - EBDA_START),
            (PCI_MMIO32_START, PCI_MMIO32_SIZE),
            (PCI_ECAM_START, PCI_ECAM_SIZE),
            (IOAPIC_START, IOAPIC_SIZE),
            (LAPIC_START, LAPIC_SIZE),
            (KVM_IDENTITY_MAP_START, 0x4000),
            (PCI_MMIO64_START, PCI_MMIO64_SIZE),
        ];
        for (i, a) in areas.iter().enumerate() {
            for b in &areas[i + 1..] {
                assert!(a.0 + a.1 <= b.0, "{a:x?} overlaps {b:x?}");
            }
        }
    }

    #[test]
    fn ram_split_around_the_hole() {
        assert_eq!(
            ram_ranges(1 << 30),
            vec![RamRange {
                start: 0,
                len: 1 << 30
            }]
        );
        assert_eq!(
            ram_ranges(4 << 30),
            vec![
                RamRange {
                    start: 0,
                    len: 3 << 30
                },
                RamRange {
                    start: 4 << 30,
                    len: 1 << 30
                }
            ]
        );
        assert_eq!(ram_end(4 << 30), 5 << 30);
        assert_eq!(pmem_area_start(1 << 30), 4 << 30);
        assert_eq!(pmem_area_start((4 << 30) + 1), (5 << 30) + (2 << 20));
    }

    #[test]
    fn e820_is_sorted_disjoint_and_covers_ram() {
        for ram in [64 << 20, 1 << 30, 3 << 30, (3 << 30) + (2 << 20), 6 << 30] {
            let map = e820_map(ram);
            for w in map.windows(2) {
                assert!(w[0].addr + w[0].size <= w[1].addr, "{map:x?}");
            }
            let ram_bytes: u64 = map
                .iter()
                .filter(|e| e.kind == E820Kind::Ram)
                .map(|e| e.size)
                .sum();
            // Only the EBDA..1 MiB part of RAM is withheld.
            assert_eq!(ram_bytes, ram - (HIGH_RAM_START - EBDA_START));
            for e in &map {
                let end = e.addr + e.size;
                if e.kind == E820Kind::Ram {
                    assert!(end <= MEM_32BIT_HOLE_START || e.addr >= RAM_64BIT_START);
                    assert!(end <= ram_end(ram));
                }
            }
            let reserved = |a: u64, l: u64| {
                map.iter().any(|e| {
                    e.kind == E820Kind::Reserved && e.addr <= a && a + l <= e.addr + e.size
                })
            };
            assert!(reserved(PCI_ECAM_START, PCI_ECAM_SIZE));
            assert!(reserved(IOAPIC_START, IOAPIC_SIZE));
            assert!(reserved(LAPIC_START, LAPIC_SIZE));
            assert!(reserved(ACPI_RSDP_START, ACPI_TABLES_END - ACPI_RSDP_START));
            assert!(!map
                .iter()
                .any(|e| e.addr < PCI_MMIO32_START + PCI_MMIO32_SIZE
                    && PCI_MMIO32_START < e.addr + e.size));
        }
    }
}
