//! Loading a Linux kernel and filling its boot parameters.
//!
//! Two ways in, chosen by the kernel file's first bytes:
//!
//! - **bzImage** (Linux boot protocol 2.12+, 64-bit entry): linux-loader's
//!   [`BzImage`] loads the protected-mode kernel at `code32_start` (1 MiB);
//!   the zero page at [`layout::ZERO_PAGE_START`] gets the image's setup
//!   header, `type_of_loader`, the command line and initramfs, the RSDP
//!   address and the e820 map. The vCPU starts in long mode at
//!   `load address + 0x200` with `rsi` = zero page, the boot GDT
//!   (`__BOOT_CS` = 0x10, `__BOOT_DS` = 0x18) and identity page tables for
//!   the first 4 GiB.
//! - **ELF vmlinux with a PVH note**: linux-loader's [`Elf`] loads the
//!   segments at their physical addresses; the `hvm_start_info` at
//!   [`layout::PVH_INFO_START`] points at the command line, the initramfs
//!   (one module), the RSDP and the memory map. The vCPU starts in 32-bit
//!   protected mode, paging off, at the PVH entry with `rbx` = start info.

use crate::x86::{self, CR0_CD, CR0_ET, CR0_NW, CR0_PE, CR0_PG, CR4_PAE, EFER_LMA, EFER_LME};
use std::fs::File;
use std::io::Read;
use std::path::Path;

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use linux_loader::bootparam::{
    boot_e820_entry, boot_params, setup_header, LOADED_HIGH, XLF_KERNEL_64,
};
use linux_loader::loader::{BzImage, Elf, KernelLoader, PvhBootCapability};
use linux_loader::start_info::{hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryBackend};

use super::initramfs::{self, InitramfsPlacement};
use super::layout::{self, E820Entry};
use super::BootError;

/// Offset of the setup header in a bzImage (and of `hdr` in the zero page).
const SETUP_HEADER_OFFSET: usize = 0x1f1;
/// The boot sector signature at 0x1fe.
const BOOT_FLAG: u16 = 0xaa55;
/// "HdrS" at 0x202.
const HDRS_MAGIC: u32 = 0x5372_6448;
/// Oldest boot protocol with a 64-bit entry point (`XLF_KERNEL_64`).
const MIN_BOOT_PROTOCOL: u16 = 0x020c;
/// `type_of_loader` for a boot loader without an assigned id.
const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// The 64-bit entry is 0x200 bytes into the protected-mode kernel.
const STARTUP_64_OFFSET: u64 = 0x200;
/// `hvm_start_info.magic`.
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
/// Maximum e820 entries in the zero page.
const E820_MAX_ZEROPAGE: usize = 128;

/// Selector of the 64-bit code segment (the boot protocol's `__BOOT_CS`).
pub const BOOT_CS64: u16 = 0x10;
/// Selector of the flat data segment (`__BOOT_DS`).
pub const BOOT_DS: u16 = 0x18;
/// Selector of the boot TSS.
pub const BOOT_TSS: u16 = 0x20;
/// Selector of the 32-bit code segment for PVH entry.
pub const BOOT_CS32: u16 = 0x28;

/// `(selector, flags, base, limit)` of the boot GDT entries after the two
/// null ones. Flags are the descriptor's bits 40..56 (access byte, then
/// the G/DB/L/AVL nibble in bits 12..16).
const GDT: [(u16, u16, u32, u32); 4] = [
    (BOOT_CS64, 0xa09b, 0, 0xfffff), // present, code exec/read, L, G
    (BOOT_DS, 0xc093, 0, 0xfffff),   // present, data read/write, DB, G
    (BOOT_TSS, 0x008b, 0, 0x67),     // present, busy 32/64-bit TSS
    (BOOT_CS32, 0xc09b, 0, 0xfffff), // present, code exec/read, DB, G
];

/// What to boot.
#[derive(Debug, Clone, Copy)]
pub struct BootSource<'a> {
    /// bzImage or ELF vmlinux with a PVH note.
    pub kernel: &'a Path,
    /// Optional initramfs (cpio archive, possibly compressed).
    pub initramfs: Option<&'a Path>,
    /// Kernel command line.
    pub cmdline: &'a str,
    /// Guest RAM size (laid out by [`layout::ram_ranges`]).
    pub ram_size: u64,
}

/// How the kernel is entered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootProtocol {
    /// bzImage, 64-bit Linux boot protocol: long mode, `rsi` = zero page.
    Linux64,
    /// ELF vmlinux, PVH: 32-bit protected mode, `rbx` = start info.
    Pvh,
}

/// The boot vCPU's initial register state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootVcpuState {
    /// Entry protocol (decides the segments and control registers).
    pub protocol: BootProtocol,
    /// Entry point.
    pub rip: u64,
    /// Stack pointer.
    pub rsp: u64,
    /// Zero page address (Linux64), else 0.
    pub rsi: u64,
    /// `hvm_start_info` address (PVH), else 0.
    pub rbx: u64,
}

/// The KVM view of a boot GDT entry.
fn segment(selector: u16) -> kvm_segment {
    let (sel, flags, base, limit) = GDT
        .iter()
        .copied()
        .find(|e| e.0 == selector)
        .unwrap_or((0, 0, 0, 0));
    x86::segment(sel, flags, base, limit)
}

impl BootVcpuState {
    /// General-purpose registers for `KVM_SET_REGS`.
    pub fn regs(&self) -> kvm_regs {
        kvm_regs {
            rip: self.rip,
            rsp: self.rsp,
            rbp: self.rsp,
            rsi: self.rsi,
            rbx: self.rbx,
            rflags: 0x2,
            ..Default::default()
        }
    }

    /// Sets segments, descriptor tables, control registers and EFER in
    /// `sregs` (read from the vCPU first: the rest stays as KVM reset it).
    pub fn apply_sregs(&self, sregs: &mut kvm_sregs) {
        let data = segment(BOOT_DS);
        sregs.ds = data;
        sregs.es = data;
        sregs.fs = data;
        sregs.gs = data;
        sregs.ss = data;
        sregs.tr = segment(BOOT_TSS);
        sregs.gdt.base = layout::BOOT_GDT_START;
        sregs.gdt.limit = (layout::BOOT_GDT_ENTRIES * 8 - 1) as u16;
        sregs.idt.base = layout::BOOT_IDT_START;
        sregs.idt.limit = 7;
        match self.protocol {
            BootProtocol::Linux64 => {
                sregs.cs = segment(BOOT_CS64);
                sregs.cr0 = (sregs.cr0 | CR0_PE | CR0_PG | CR0_ET) & !(CR0_CD | CR0_NW);
                sregs.cr3 = layout::PML4_START;
                sregs.cr4 |= CR4_PAE;
                sregs.efer |= EFER_LME | EFER_LMA;
            }
            BootProtocol::Pvh => {
                // PVH: CR0.PE (and the read-only ET) set, every other
                // writable bit of CR0 and CR4 clear, EFER clear.
                sregs.cs = segment(BOOT_CS32);
                sregs.cr0 = CR0_PE | CR0_ET;
                sregs.cr3 = 0;
                sregs.cr4 = 0;
                sregs.efer = 0;
            }
        }
    }
}

/// What [`load`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootInfo {
    /// How the kernel is entered.
    pub protocol: BootProtocol,
    /// Where the kernel image was loaded.
    pub kernel_load: u64,
    /// First address after the memory the kernel needs (for a bzImage:
    /// its decompression and run area, `init_size` at its run address).
    pub kernel_end: u64,
    /// Where the initramfs went.
    pub initramfs: Option<InitramfsPlacement>,
    /// The memory map given to the guest.
    pub e820: Vec<E820Entry>,
    /// The boot vCPU's state.
    pub vcpu: BootVcpuState,
}

fn mem_err(addr: u64) -> impl FnOnce(vm_memory::GuestMemoryError) -> BootError {
    move |source| BootError::GuestMemory { addr, source }
}

/// Loads the kernel, initramfs and command line of `src` into `mem` and
/// writes the boot parameters, GDT and page tables (see the module docs).
/// The ACPI tables are written separately
/// ([`crate::acpi::create_acpi_tables`]).
pub fn load<M: GuestMemoryBackend>(mem: &M, src: &BootSource) -> Result<BootInfo, BootError> {
    let path = src.kernel;
    let io = |source| BootError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut head = vec![0u8; SETUP_HEADER_OFFSET + std::mem::size_of::<setup_header>()];
    let mut got = 0;
    while got < head.len() {
        match file.read(&mut head[got..]).map_err(io)? {
            0 => break,
            n => got += n,
        }
    }
    head.truncate(got);
    if head.starts_with(b"\x7fELF") {
        load_pvh(mem, src, &mut file)
    } else if head.len() >= 0x206 && head[0x202..0x206] == HDRS_MAGIC.to_le_bytes() {
        load_bzimage(mem, src, &mut file, &head, file_len)
    } else {
        Err(BootError::NotAKernel {
            path: path.to_owned(),
        })
    }
}

/// Checks the bzImage setup header and returns it with the memory the
/// kernel needs: `(header, load address, end of the kernel's memory)`.
fn check_bzimage(
    path: &Path,
    head: &[u8],
    file_len: u64,
    ram_size: u64,
) -> Result<(setup_header, u64, u64), BootError> {
    let invalid = |reason: &str| BootError::InvalidBzImage {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    let bytes = head
        .get(SETUP_HEADER_OFFSET..)
        .ok_or_else(|| invalid("file shorter than the setup header"))?;
    let hdr = setup_header::from_slice(bytes)
        .copied()
        .ok_or_else(|| invalid("file shorter than the setup header"))?;
    if hdr.boot_flag != BOOT_FLAG {
        return Err(invalid("no 0xaa55 boot sector signature"));
    }
    if hdr.version < MIN_BOOT_PROTOCOL {
        return Err(BootError::OldBootProtocol {
            path: path.to_owned(),
            version: hdr.version,
        });
    }
    if hdr.xloadflags & XLF_KERNEL_64 == 0 {
        return Err(invalid("no 64-bit entry point (XLF_KERNEL_64 clear)"));
    }
    if hdr.loadflags & LOADED_HIGH == 0 {
        return Err(invalid("not loaded high (LOADED_HIGH clear)"));
    }
    let setup_sects = if hdr.setup_sects == 0 {
        4
    } else {
        u64::from(hdr.setup_sects)
    };
    let setup_size = (setup_sects + 1) * 512;
    let payload = file_len
        .checked_sub(setup_size)
        .filter(|&p| p > 0)
        .ok_or_else(|| invalid("no protected-mode kernel after the setup sectors"))?;
    let load = u64::from(hdr.code32_start);
    if load < layout::HIGH_RAM_START {
        return Err(invalid("code32_start below 1 MiB"));
    }
    // The decompressor runs the kernel at its preferred address (relocatable
    // kernels: at least there, aligned), needing init_size bytes there.
    let align = u64::from(hdr.kernel_alignment).max(1);
    let run = load.next_multiple_of(align).max(hdr.pref_address);
    let needed = (load + payload).max(run + u64::from(hdr.init_size));
    let available = layout::ram_ranges(ram_size)[0].end();
    if needed > available {
        return Err(BootError::KernelTooLarge {
            path: path.to_owned(),
            needed,
            available,
        });
    }
    Ok((hdr, load, needed))
}

fn load_bzimage<M: GuestMemoryBackend>(
    mem: &M,
    src: &BootSource,
    file: &mut File,
    head: &[u8],
    file_len: u64,
) -> Result<BootInfo, BootError> {
    let path = src.kernel;
    let (hdr, load, kernel_end) = check_bzimage(path, head, file_len, src.ram_size)?;
    // Linux counts cmdline_size without the terminating NUL.
    let max = u64::from(hdr.cmdline_size).min(layout::CMDLINE_MAX_SIZE - 1);
    write_cmdline(mem, src.cmdline, max)?;
    let initramfs = match src.initramfs {
        Some(p) => Some(initramfs::load(
            mem,
            p,
            src.ram_size,
            kernel_end,
            u64::from(hdr.initrd_addr_max) + 1,
        )?),
        None => None,
    };
    let result = BzImage::load(mem, None, file, Some(GuestAddress(layout::HIGH_RAM_START)))
        .map_err(|source| BootError::Loader {
            path: path.to_owned(),
            source,
        })?;

    let mut params = boot_params {
        hdr: result.setup_header.unwrap_or(hdr),
        ..Default::default()
    };
    params.hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    params.hdr.cmd_line_ptr = layout::CMDLINE_START as u32;
    params.ext_cmd_line_ptr = 0;
    if let Some(i) = initramfs {
        // Below the 32-bit hole: the high halves (ext_ramdisk_*) stay 0.
        params.hdr.ramdisk_image = i.addr as u32;
        params.hdr.ramdisk_size = i.size as u32;
    }
    params.acpi_rsdp_addr = layout::ACPI_RSDP_START;
    let e820 = layout::e820_map(src.ram_size);
    if e820.len() > E820_MAX_ZEROPAGE {
        return Err(BootError::TooManyE820Entries {
            entries: e820.len(),
            max: E820_MAX_ZEROPAGE,
        });
    }
    let mut table = params.e820_table;
    for (slot, e) in table.iter_mut().zip(&e820) {
        *slot = boot_e820_entry {
            addr: e.addr,
            size: e.size,
            r#type: e.kind as u32,
        };
    }
    params.e820_table = table;
    params.e820_entries = e820.len() as u8;
    mem.write_obj(params, GuestAddress(layout::ZERO_PAGE_START))
        .map_err(mem_err(layout::ZERO_PAGE_START))?;
    write_gdt(mem)?;
    write_page_tables(mem)?;

    Ok(BootInfo {
        protocol: BootProtocol::Linux64,
        kernel_load: load,
        kernel_end,
        initramfs,
        e820,
        vcpu: BootVcpuState {
            protocol: BootProtocol::Linux64,
            rip: result.kernel_load.0 + STARTUP_64_OFFSET,
            rsp: layout::BOOT_STACK_POINTER,
            rsi: layout::ZERO_PAGE_START,
            rbx: 0,
        },
    })
}

fn load_pvh<M: GuestMemoryBackend>(
    mem: &M,
    src: &BootSource,
    file: &mut File,
) -> Result<BootInfo, BootError> {
    let path = src.kernel;
    let available = layout::ram_ranges(src.ram_size)[0].end();
    let result = Elf::load(mem, None, file, Some(GuestAddress(layout::HIGH_RAM_START))).map_err(
        |source| match source {
            // A segment outside guest memory.
            linux_loader::loader::Error::Elf(linux_loader::loader::elf::Error::ReadKernelImage)
                if file.metadata().is_ok_and(|m| m.len() > available) =>
            {
                BootError::KernelTooLarge {
                    path: path.to_owned(),
                    needed: layout::HIGH_RAM_START + file.metadata().map_or(0, |m| m.len()),
                    available,
                }
            }
            source => BootError::Loader {
                path: path.to_owned(),
                source,
            },
        },
    )?;
    let PvhBootCapability::PvhEntryPresent(entry) = result.pvh_boot_cap else {
        return Err(BootError::NoPvhNote {
            path: path.to_owned(),
        });
    };
    if result.kernel_end > available {
        return Err(BootError::KernelTooLarge {
            path: path.to_owned(),
            needed: result.kernel_end,
            available,
        });
    }
    write_cmdline(mem, src.cmdline, layout::CMDLINE_MAX_SIZE - 1)?;
    let initramfs = match src.initramfs {
        Some(p) => Some(initramfs::load(
            mem,
            p,
            src.ram_size,
            result.kernel_end,
            u64::MAX,
        )?),
        None => None,
    };

    let e820 = layout::e820_map(src.ram_size);
    if e820.len() > layout::PVH_MEMMAP_MAX_ENTRIES {
        return Err(BootError::TooManyE820Entries {
            entries: e820.len(),
            max: layout::PVH_MEMMAP_MAX_ENTRIES,
        });
    }
    for (i, e) in e820.iter().enumerate() {
        let addr = layout::PVH_MEMMAP_START + (i * 24) as u64;
        let entry = hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind as u32,
            reserved: 0,
        };
        mem.write_obj(entry, GuestAddress(addr))
            .map_err(mem_err(addr))?;
    }
    let mut start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: layout::CMDLINE_START,
        rsdp_paddr: layout::ACPI_RSDP_START,
        memmap_paddr: layout::PVH_MEMMAP_START,
        memmap_entries: e820.len() as u32,
        ..Default::default()
    };
    if let Some(i) = initramfs {
        let module = hvm_modlist_entry {
            paddr: i.addr,
            size: i.size,
            ..Default::default()
        };
        mem.write_obj(module, GuestAddress(layout::PVH_MODLIST_START))
            .map_err(mem_err(layout::PVH_MODLIST_START))?;
        start_info.nr_modules = 1;
        start_info.modlist_paddr = layout::PVH_MODLIST_START;
    }
    mem.write_obj(start_info, GuestAddress(layout::PVH_INFO_START))
        .map_err(mem_err(layout::PVH_INFO_START))?;
    write_gdt(mem)?;

    Ok(BootInfo {
        protocol: BootProtocol::Pvh,
        kernel_load: result.kernel_load.0,
        kernel_end: result.kernel_end,
        initramfs,
        e820,
        vcpu: BootVcpuState {
            protocol: BootProtocol::Pvh,
            rip: entry.0,
            rsp: layout::BOOT_STACK_POINTER,
            rsi: 0,
            rbx: layout::PVH_INFO_START,
        },
    })
}

/// Writes `cmdline` and its NUL at [`layout::CMDLINE_START`]; `max` is the
/// longest accepted length without the NUL.
fn write_cmdline<M: GuestMemoryBackend>(mem: &M, cmdline: &str, max: u64) -> Result<(), BootError> {
    if cmdline.len() as u64 > max {
        return Err(BootError::CmdlineTooLong {
            len: cmdline.len(),
            max,
        });
    }
    if cmdline.contains('\0') {
        return Err(BootError::CmdlineNul);
    }
    let mut bytes = cmdline.as_bytes().to_vec();
    bytes.push(0);
    mem.write_slice(&bytes, GuestAddress(layout::CMDLINE_START))
        .map_err(mem_err(layout::CMDLINE_START))
}

/// Writes the boot GDT (two null entries, then [`GDT`]) and an empty IDT.
fn write_gdt<M: GuestMemoryBackend>(mem: &M) -> Result<(), BootError> {
    let mut table = [0u64; layout::BOOT_GDT_ENTRIES];
    for &(sel, flags, base, limit) in &GDT {
        table[usize::from(sel / 8)] = x86::gdt_entry(flags, base, limit);
    }
    for (i, e) in table.iter().enumerate() {
        let addr = layout::BOOT_GDT_START + 8 * i as u64;
        mem.write_obj(*e, GuestAddress(addr))
            .map_err(mem_err(addr))?;
    }
    mem.write_obj(0u64, GuestAddress(layout::BOOT_IDT_START))
        .map_err(mem_err(layout::BOOT_IDT_START))
}

/// Identity-maps 0..4 GiB with 2 MiB pages: one PML4 entry, four PDPT
/// entries, four page directories.
fn write_page_tables<M: GuestMemoryBackend>(mem: &M) -> Result<(), BootError> {
    const PRESENT_RW: u64 = 0x3;
    const PAGE_SIZE_2M: u64 = 0x80;
    let pml4 = layout::PDPTE_START | PRESENT_RW;
    mem.write_obj(pml4, GuestAddress(layout::PML4_START))
        .map_err(mem_err(layout::PML4_START))?;
    for d in 0..layout::PDE_COUNT {
        let pd = layout::PDE_START + d * 0x1000;
        let addr = layout::PDPTE_START + d * 8;
        mem.write_obj(pd | PRESENT_RW, GuestAddress(addr))
            .map_err(mem_err(addr))?;
        let entries: Vec<u8> = (0..512u64)
            .flat_map(|i| (((d * 512 + i) << 21) | PRESENT_RW | PAGE_SIZE_2M).to_le_bytes())
            .collect();
        mem.write_slice(&entries, GuestAddress(pd))
            .map_err(mem_err(pd))?;
    }
    Ok(())
}

/// Reads the zero page back (for tests and diagnostics).
pub fn read_zero_page<M: GuestMemoryBackend>(mem: &M) -> Result<boot_params, BootError> {
    mem.read_obj(GuestAddress(layout::ZERO_PAGE_START))
        .map_err(mem_err(layout::ZERO_PAGE_START))
}

// `hvm_start_info` etc. are ByteValued through linux-loader; make sure the
// zero page is too (it is, in linux-loader's loader module).
const _: fn() = || {
    fn byte_valued<T: ByteValued>() {}
    byte_valued::<boot_params>();
    byte_valued::<hvm_start_info>();
};

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::path::PathBuf;
    use vm_memory::GuestMemoryMmap;

    const MIB: u64 = 1 << 20;

    fn mem(ram: u64) -> GuestMemoryMmap {
        let ranges: Vec<_> = layout::ram_ranges(ram)
            .iter()
            .map(|r| (GuestAddress(r.start), r.len as usize))
            .collect();
        GuestMemoryMmap::from_ranges(&ranges).unwrap()
    }

    fn put(b: &mut [u8], off: usize, v: &[u8]) {
        b[off..off + v.len()].copy_from_slice(v);
    }

    /// A minimal bzImage: one setup sector after the boot sector, then
    /// `payload` bytes of "kernel".
    struct FakeBz {
        version: u16,
        boot_flag: u16,
        xloadflags: u16,
        cmdline_size: u32,
        init_size: u32,
        payload: usize,
    }

    impl Default for FakeBz {
        fn default() -> Self {
            FakeBz {
                version: 0x020f,
                boot_flag: BOOT_FLAG,
                xloadflags: XLF_KERNEL_64,
                cmdline_size: 2047,
                init_size: MIB as u32,
                payload: 8192,
            }
        }
    }

    impl FakeBz {
        fn bytes(&self) -> Vec<u8> {
            let mut b = vec![0u8; 1024];
            put(&mut b, 0x1f1, &[1]); // setup_sects: 1 (+ the boot sector)
            put(&mut b, 0x1fe, &self.boot_flag.to_le_bytes()); // boot_flag
            put(&mut b, 0x202, b"HdrS"); // header magic
            put(&mut b, 0x206, &self.version.to_le_bytes()); // version
            put(&mut b, 0x211, &[LOADED_HIGH]); // loadflags
            put(&mut b, 0x214, &0x10_0000u32.to_le_bytes()); // code32_start
            put(&mut b, 0x22c, &0x37ff_ffffu32.to_le_bytes()); // initrd_addr_max
            put(&mut b, 0x230, &0x20_0000u32.to_le_bytes()); // kernel_alignment
            put(&mut b, 0x234, &[1]); // relocatable_kernel
            put(&mut b, 0x236, &self.xloadflags.to_le_bytes()); // xloadflags
            put(&mut b, 0x238, &self.cmdline_size.to_le_bytes()); // cmdline_size
            put(&mut b, 0x258, &0x100_0000u64.to_le_bytes()); // pref_address
            put(&mut b, 0x260, &self.init_size.to_le_bytes()); // init_size
            b.extend((0..self.payload).map(|i| (i * 7 + 3) as u8));
            b
        }
    }

    fn file(dir: &tempfile::TempDir, name: &str, data: &[u8]) -> PathBuf {
        let p = dir.path().join(name);
        std::fs::File::create(&p).unwrap().write_all(data).unwrap();
        p
    }

    fn read(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn check_e820(params: &boot_params, ram: u64) {
        let n = params.e820_entries as usize;
        let table = params.e820_table;
        let got: Vec<_> = table[..n]
            .iter()
            .map(|e| (e.addr, e.size, e.r#type))
            .collect();
        let want: Vec<_> = layout::e820_map(ram)
            .iter()
            .map(|e| (e.addr, e.size, e.kind as u32))
            .collect();
        assert_eq!(got, want);
        for w in got.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlap: {got:x?}");
        }
        let ram_total: u64 = got.iter().filter(|e| e.2 == 1).map(|e| e.1).sum();
        assert_eq!(
            ram_total,
            ram - (layout::HIGH_RAM_START - layout::EBDA_START)
        );
        for e in got.iter().filter(|e| e.2 == 1) {
            let end = e.0 + e.1;
            assert!(end <= layout::MEM_32BIT_HOLE_START || e.0 >= layout::RAM_64BIT_START);
        }
    }

    #[test]
    fn synthetic_bzimage_boot_params() {
        let dir = tempfile::tempdir().unwrap();
        let bz = FakeBz::default();
        let kernel = file(&dir, "bzImage", &bz.bytes());
        let initrd_data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let initrd = file(&dir, "initrd", &initrd_data);
        let ram = 256 * MIB;
        let mem = mem(ram);
        let cmdline = "console=ttyS0 reboot=k panic=1";
        let info = load(
            &mem,
            &BootSource {
                kernel: &kernel,
                initramfs: Some(&initrd),
                cmdline,
                ram_size: ram,
            },
        )
        .unwrap();
        assert_eq!(info.protocol, BootProtocol::Linux64);
        assert_eq!(info.kernel_load, 0x10_0000);
        // Relocated to pref_address (16 MiB), init_size there.
        assert_eq!(info.kernel_end, 0x100_0000 + MIB);
        assert_eq!(info.vcpu.rip, 0x10_0200);
        assert_eq!(info.vcpu.rsi, layout::ZERO_PAGE_START);

        // The protected-mode kernel is at 1 MiB.
        assert_eq!(read(&mem, 0x10_0000, bz.payload), bz.bytes()[1024..]);

        let p = read_zero_page(&mem).unwrap();
        let hdr = p.hdr;
        assert_eq!({ hdr.header }, HDRS_MAGIC);
        assert_eq!({ hdr.boot_flag }, BOOT_FLAG);
        assert_eq!({ hdr.version }, 0x020f);
        assert_eq!(hdr.type_of_loader, LOADER_TYPE_UNDEFINED);
        assert_eq!({ hdr.code32_start }, 0x10_0000);
        assert_eq!(u64::from(hdr.cmd_line_ptr), layout::CMDLINE_START);
        assert_eq!({ p.acpi_rsdp_addr }, layout::ACPI_RSDP_START);

        // Command line, NUL terminated.
        let got = read(&mem, layout::CMDLINE_START, cmdline.len() + 1);
        assert_eq!(&got[..cmdline.len()], cmdline.as_bytes());
        assert_eq!(got[cmdline.len()], 0);

        // Initramfs: top of RAM, page aligned, above the kernel, content.
        let i = info.initramfs.unwrap();
        assert_eq!(u64::from(hdr.ramdisk_image), i.addr);
        assert_eq!(u64::from(hdr.ramdisk_size), initrd_data.len() as u64);
        assert_eq!(i.addr % 4096, 0);
        assert!(i.addr + i.size <= ram && i.addr + i.size + 4096 > ram);
        assert!(i.addr >= info.kernel_end);
        assert_eq!(read(&mem, i.addr, initrd_data.len()), initrd_data);

        check_e820(&p, ram);

        // GDT in memory matches the segments given to the vCPU.
        let mut sregs = kvm_sregs {
            cr0: 0x6000_0010,
            ..Default::default()
        };
        info.vcpu.apply_sregs(&mut sregs);
        assert_eq!(sregs.cs.selector, 0x10);
        assert_eq!((sregs.cs.l, sregs.cs.db, sregs.cs.type_), (1, 0, 0xb));
        assert_eq!(sregs.ds.selector, 0x18);
        assert_eq!(sregs.ds.limit, 0xffff_ffff);
        assert_eq!(sregs.cr0 & (CR0_PE | CR0_PG | CR0_CD), CR0_PE | CR0_PG);
        assert_eq!(sregs.cr3, layout::PML4_START);
        assert_ne!(sregs.cr4 & CR4_PAE, 0);
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        let gdt = read(&mem, sregs.gdt.base, usize::from(sregs.gdt.limit) + 1);
        let entry = |sel: u16| {
            let o = usize::from(sel);
            u64::from_le_bytes(gdt[o..o + 8].try_into().unwrap())
        };
        assert_eq!(entry(0), 0);
        assert_eq!(entry(BOOT_CS64), 0x00af_9b00_0000_ffff);
        assert_eq!(entry(BOOT_DS), 0x00cf_9300_0000_ffff);
        let regs = info.vcpu.regs();
        assert_eq!(
            (regs.rip, regs.rsi, regs.rflags),
            (0x10_0200, layout::ZERO_PAGE_START, 2)
        );

        // Identity page tables: 0..4 GiB with 2 MiB pages.
        let pml4 = read(&mem, layout::PML4_START, 8);
        assert_eq!(
            u64::from_le_bytes(pml4.try_into().unwrap()),
            layout::PDPTE_START | 3
        );
        let pde = |gib: u64, i: u64| {
            let b = read(&mem, layout::PDE_START + gib * 0x1000 + i * 8, 8);
            u64::from_le_bytes(b.try_into().unwrap())
        };
        assert_eq!(pde(0, 0), 0x83);
        assert_eq!(pde(3, 511), ((4 << 30) - (2 << 20)) | 0x83);
    }

    fn load_err(bz: &[u8], cmdline: &str, initrd: Option<&[u8]>, ram: u64) -> BootError {
        let dir = tempfile::tempdir().unwrap();
        let kernel = file(&dir, "k", bz);
        let initrd = initrd.map(|d| file(&dir, "i", d));
        load(
            &mem(ram),
            &BootSource {
                kernel: &kernel,
                initramfs: initrd.as_deref(),
                cmdline,
                ram_size: ram,
            },
        )
        .unwrap_err()
    }

    #[test]
    fn bzimage_errors() {
        let ram = 64 * MIB;
        let e = load_err(b"#!/bin/sh\necho not a kernel\n", "", None, ram);
        assert!(matches!(e, BootError::NotAKernel { .. }), "{e}");
        let e = load_err(&[], "", None, ram);
        assert!(matches!(e, BootError::NotAKernel { .. }), "{e}");

        let bad_flag = FakeBz {
            boot_flag: 0x1234,
            ..Default::default()
        };
        let e = load_err(&bad_flag.bytes(), "", None, ram);
        assert!(matches!(e, BootError::InvalidBzImage { .. }), "{e}");

        let old = FakeBz {
            version: 0x0209,
            ..Default::default()
        };
        let e = load_err(&old.bytes(), "", None, ram);
        assert!(
            matches!(
                e,
                BootError::OldBootProtocol {
                    version: 0x0209,
                    ..
                }
            ),
            "{e}"
        );

        let no64 = FakeBz {
            xloadflags: 0,
            ..Default::default()
        };
        let e = load_err(&no64.bytes(), "", None, ram);
        assert!(matches!(e, BootError::InvalidBzImage { .. }), "{e}");

        let no_payload = FakeBz {
            payload: 0,
            ..Default::default()
        };
        let e = load_err(&no_payload.bytes(), "", None, ram);
        assert!(matches!(e, BootError::InvalidBzImage { .. }), "{e}");

        // The limit is the header's cmdline_size, without the NUL.
        let ok = FakeBz::default().bytes();
        let dir = tempfile::tempdir().unwrap();
        let k = file(&dir, "k", &ok);
        let long = "x".repeat(2047);
        let src = BootSource {
            kernel: &k,
            initramfs: None,
            cmdline: &long,
            ram_size: ram,
        };
        load(&mem(ram), &src).unwrap();
        let e = load_err(&ok, &"x".repeat(2048), None, ram);
        assert!(
            matches!(
                e,
                BootError::CmdlineTooLong {
                    len: 2048,
                    max: 2047
                }
            ),
            "{e}"
        );
        let e = load_err(&ok, "a\0b", None, ram);
        assert!(matches!(e, BootError::CmdlineNul), "{e}");

        // Kernel end 17 MiB: 47 MiB of room, initramfs 48 MiB.
        let big = vec![0u8; 48 * MIB as usize];
        let e = load_err(&ok, "", Some(&big), ram);
        assert!(matches!(e, BootError::InitramfsTooLarge { .. }), "{e}");

        let huge = FakeBz {
            init_size: 64 * MIB as u32,
            ..Default::default()
        };
        let e = load_err(&huge.bytes(), "", None, ram);
        assert!(
            matches!(e, BootError::KernelTooLarge { needed, available, .. }
                if needed == 80 * MIB && available == ram),
            "{e}"
        );

        let missing = Path::new("/nonexistent/bzImage");
        let src = BootSource {
            kernel: missing,
            initramfs: None,
            cmdline: "",
            ram_size: ram,
        };
        assert!(matches!(load(&mem(ram), &src), Err(BootError::Io { .. })));
    }

    /// A minimal ELF vmlinux: one PT_LOAD segment at 16 MiB and, if `pvh`,
    /// a PT_NOTE with XEN_ELFNOTE_PHYS32_ENTRY.
    fn fake_elf(pvh: bool) -> Vec<u8> {
        let mut b = vec![0u8; 0x200];
        put(&mut b, 0, b"\x7fELF"); // magic
        put(&mut b, 4, &[2, 1, 1]); // 64-bit, little endian, version 1
        put(&mut b, 16, &2u16.to_le_bytes()); // e_type: executable
        put(&mut b, 18, &0x3eu16.to_le_bytes()); // e_machine: x86-64
        put(&mut b, 20, &1u32.to_le_bytes()); // e_version
        put(&mut b, 24, &0x100_0000u64.to_le_bytes()); // e_entry
        put(&mut b, 32, &64u64.to_le_bytes()); // e_phoff
        put(&mut b, 52, &64u16.to_le_bytes()); // e_ehsize
        put(&mut b, 54, &56u16.to_le_bytes()); // e_phentsize
        put(&mut b, 56, &2u16.to_le_bytes()); // e_phnum
                                              // Program header 0: PT_LOAD, offset 0x200, paddr 16 MiB, 4 KiB
                                              // in the file, 8 KiB in memory.
        put(&mut b, 64, &1u32.to_le_bytes());
        put(&mut b, 64 + 8, &0x200u64.to_le_bytes());
        put(&mut b, 64 + 16, &0x100_0000u64.to_le_bytes());
        put(&mut b, 64 + 24, &0x100_0000u64.to_le_bytes());
        put(&mut b, 64 + 32, &0x1000u64.to_le_bytes());
        put(&mut b, 64 + 40, &0x2000u64.to_le_bytes());
        // Program header 1: PT_NOTE at 176, 20 bytes.
        put(&mut b, 120, &4u32.to_le_bytes());
        put(&mut b, 120 + 8, &176u64.to_le_bytes());
        put(&mut b, 120 + 32, &20u64.to_le_bytes());
        // The note: namesz 4, descsz 4, type 18 (or 17: another note),
        // "Xen\0", the 32-bit entry.
        put(&mut b, 176, &4u32.to_le_bytes());
        put(&mut b, 180, &4u32.to_le_bytes());
        put(&mut b, 184, &(if pvh { 18u32 } else { 17 }).to_le_bytes());
        put(&mut b, 188, b"Xen\0");
        put(&mut b, 192, &0x100_0040u32.to_le_bytes());
        b.extend(std::iter::repeat_n(0x90u8, 0x1000));
        b
    }

    #[test]
    fn pvh_elf_start_info() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = file(&dir, "vmlinux", &fake_elf(true));
        let initrd = file(&dir, "initrd", &[0x5a; 5000]);
        let ram = 128 * MIB;
        let mem = mem(ram);
        let info = load(
            &mem,
            &BootSource {
                kernel: &kernel,
                initramfs: Some(&initrd),
                cmdline: "console=ttyS0",
                ram_size: ram,
            },
        )
        .unwrap();
        assert_eq!(info.protocol, BootProtocol::Pvh);
        assert_eq!(info.vcpu.rip, 0x100_0040);
        assert_eq!(info.vcpu.rbx, layout::PVH_INFO_START);
        assert_eq!(info.kernel_end, 0x100_2000);
        let si: hvm_start_info = mem.read_obj(GuestAddress(layout::PVH_INFO_START)).unwrap();
        assert_eq!(si.magic, XEN_HVM_START_MAGIC);
        assert_eq!(si.cmdline_paddr, layout::CMDLINE_START);
        assert_eq!(si.rsdp_paddr, layout::ACPI_RSDP_START);
        assert_eq!(si.nr_modules, 1);
        let m: hvm_modlist_entry = mem.read_obj(GuestAddress(si.modlist_paddr)).unwrap();
        let i = info.initramfs.unwrap();
        assert_eq!((m.paddr, m.size), (i.addr, 5000));
        assert!(i.addr + 4096 + 5000 > ram);
        assert_eq!(si.memmap_entries as usize, layout::e820_map(ram).len());
        for (n, e) in layout::e820_map(ram).iter().enumerate() {
            let addr = si.memmap_paddr + 24 * n as u64;
            let got: hvm_memmap_table_entry = mem.read_obj(GuestAddress(addr)).unwrap();
            assert_eq!(
                (got.addr, got.size, got.type_),
                (e.addr, e.size, e.kind as u32)
            );
        }
        let mut sregs = kvm_sregs::default();
        info.vcpu.apply_sregs(&mut sregs);
        assert_eq!(sregs.cs.selector, BOOT_CS32);
        assert_eq!((sregs.cs.l, sregs.cs.db), (0, 1));
        assert_eq!((sregs.cr0, sregs.cr4, sregs.efer), (CR0_PE | CR0_ET, 0, 0));
        assert_eq!(info.vcpu.regs().rbx, layout::PVH_INFO_START);

        let no_note = file(&dir, "plain", &fake_elf(false));
        let src = BootSource {
            kernel: &no_note,
            initramfs: None,
            cmdline: "",
            ram_size: ram,
        };
        assert!(matches!(load(&mem, &src), Err(BootError::NoPvhNote { .. })));
    }

    /// Debian's guest kernel, when the sandbox cache has it.
    fn cached_debian_kernel() -> Option<PathBuf> {
        let x = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/sandbox/x");
        for pkg in std::fs::read_dir(x).ok()?.flatten() {
            let name = pkg.file_name().to_string_lossy().into_owned();
            if !(name.starts_with("linux-image-6.1.0-") && name.ends_with("-cloud-amd64")) {
                continue;
            }
            for f in std::fs::read_dir(pkg.path().join("boot")).ok()?.flatten() {
                if f.file_name().to_string_lossy().starts_with("vmlinuz-") {
                    return Some(f.path());
                }
            }
        }
        None
    }

    #[test]
    fn debian_kernel_when_cached() {
        let Some(kernel) = cached_debian_kernel() else {
            eprintln!("no cached Debian 6.1 kernel: skipped");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let initrd = file(&dir, "initrd", &[0u8; 100_000]);
        let ram = 512 * MIB;
        let mem = mem(ram);
        let src = BootSource {
            kernel: &kernel,
            initramfs: Some(&initrd),
            cmdline: "console=ttyS0 panic=-1",
            ram_size: ram,
        };
        let info = load(&mem, &src).unwrap();
        assert_eq!(info.protocol, BootProtocol::Linux64);
        assert_eq!(info.vcpu.rip, 0x10_0200);
        let p = read_zero_page(&mem).unwrap();
        let hdr = p.hdr;
        assert!({ hdr.version } >= MIN_BOOT_PROTOCOL);
        assert_ne!({ hdr.xloadflags } & XLF_KERNEL_64, 0);
        assert_eq!({ hdr.cmdline_size }, 2047);
        assert_eq!(hdr.type_of_loader, LOADER_TYPE_UNDEFINED);
        let i = info.initramfs.unwrap();
        assert!(i.addr >= info.kernel_end);
        assert!(i.addr + i.size <= u64::from(hdr.initrd_addr_max) + 1);
        assert_eq!(u64::from(hdr.ramdisk_image), i.addr);
        check_e820(&p, ram);
        // The compressed kernel is in memory as in the file.
        let bytes = std::fs::read(&kernel).unwrap();
        let setup = (usize::from(hdr.setup_sects) + 1) * 512;
        assert_eq!(read(&mem, 0x10_0000, 4096), bytes[setup..setup + 4096]);

        // Too little RAM for its init_size: a clear error.
        let small = 16 * MIB;
        let src = BootSource {
            ram_size: small,
            initramfs: None,
            ..src
        };
        assert!(matches!(
            load(&self::mem(small), &src),
            Err(BootError::KernelTooLarge { .. })
        ));
    }
}
