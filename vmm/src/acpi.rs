//! ACPI tables, built with `acpi_tables` and written into guest memory.
//!
//! Where: the RSDP at [`layout::ACPI_RSDP_START`] (0xe0000, inside the
//! range the kernel scans, and given to it directly through the zero page's
//! `acpi_rsdp_addr` or PVH's `rsdp_paddr`); then DSDT, FADT, MADT, MCFG and
//! the XSDT, each 16-byte aligned, up to [`layout::ACPI_TABLES_END`]. The
//! e820 map reserves the whole range.
//!
//! What the guest learns:
//!
//! - **FADT**: hardware-reduced ACPI (no PM1 blocks, no SCI, no legacy
//!   PIT/PIC setup by the guest), no VGA, no CMOS RTC, no i8042, no fixed
//!   power/sleep buttons.
//! - **Power off and reboot**, as upstream Cloud Hypervisor: the FADT's
//!   sleep control, sleep status and reset registers are all the one-byte
//!   I/O port [`layout::ACPI_SHUTDOWN_PORT`] (0x3c0). The DSDT declares
//!   `\_S5_` = [`S5_SLEEP_TYPE`], so a guest `poweroff` writes
//!   `SLP_TYP << 2 | SLP_EN` (0x34); a guest `reboot` (x86 default
//!   `reboot=acpi`) writes [`RESET_VALUE`]. The VMM's port handler decodes
//!   writes with [`decode_shutdown_port_write`]: power off ends the VMM with
//!   exit code 0, reset restarts the guest. Reads return 0. If the ACPI
//!   reset fails the kernel falls back to the keyboard controller (port
//!   0x64, value 0xfe) and then [`layout::RESET_CONTROL_PORT`] (0xcf9): a
//!   VMM may treat those as reset too.
//! - **MADT**: one enabled local APIC per vCPU (APIC id = processor uid =
//!   vCPU index), the IO-APIC at [`layout::IOAPIC_START`] with GSI base 0,
//!   and an interrupt source override ISA IRQ 4 -> GSI 4 (the serial port).
//! - **MCFG**: the ECAM window (the same as the pci module's `ECAM_BASE`,
//!   `ECAM_SIZE`: bus 0 only) [`layout::PCI_ECAM_START`], segment 0, buses
//!   [`layout::PCI_BUS_START`]..=[`layout::PCI_BUS_END`].
//! - **DSDT**: `\_SB_.PCI0` (PNP0A08, compatible PNP0A03) with `_CRS`: the
//!   bus range, the configuration ports 0xcf8..0xcff, the I/O window, the
//!   32-bit MMIO window and the 64-bit one given in [`AcpiConfig`]; `\_SB_.MBRD` (PNP0C02) reserving the
//!   ECAM window (Linux wants MCFG areas reserved by the firmware);
//!   `\_SB_.COM1`; the power button (below); `\_S5_`.
//! - **Power button**, for `vm.power-button`: hardware-reduced ACPI has no
//!   fixed power button and no GPEs, so the button is a control-method
//!   device `\_SB_.PWRB` (`PNP0C0C`, which Linux's `button` driver binds)
//!   and the event comes through a Generic Event Device `\_SB_.GED_`
//!   (`ACPI0013`, bound by Linux's built-in `evged`): its `_CRS` names one
//!   edge-triggered, active-high interrupt, GSI [`GED_GSI`], and its
//!   `_EVT(gsi)` method does `Notify(\_SB_.PWRB, 0x80)` ("button pressed")
//!   for that GSI. The VMM raises the GSI through an irqfd; the guest's
//!   `button` driver turns the notification into a `KEY_POWER` input event
//!   (what `acpid` or systemd-logind act on).

use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{aml, Aml};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::boot::layout;
use crate::legacy::serial::{COM1_BASE, COM1_IRQ, COM1_SIZE};

/// OEM id in every table.
pub const OEM_ID: [u8; 6] = *b"PCOWHV";
/// OEM revision in every table.
const OEM_REVISION: u32 = 1;
/// Value the guest writes to the reset register to reboot.
pub const RESET_VALUE: u8 = 1;
/// `SLP_TYP` of S5 (soft off), from the DSDT's `\_S5_` package.
pub const S5_SLEEP_TYPE: u8 = 5;
/// `SLP_EN` in the sleep control register.
pub const SLP_EN: u8 = 1 << 5;
/// The GSI of the Generic Event Device (the power button's interrupt): an
/// IO-APIC pin no other device uses (COM1 has 4, virtio-pci functions use
/// MSI-X), the one upstream Cloud Hypervisor gives its GED on x86.
pub const GED_GSI: u32 = 5;
/// `Notify` value of a control-method power button: pressed.
const NOTIFY_BUTTON_PRESSED: u8 = 0x80;
/// Alignment of each table.
const TABLE_ALIGN: u64 = 16;
/// FADT `IAPC_BOOT_ARCH`: VGA not present.
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
/// FADT `IAPC_BOOT_ARCH`: CMOS RTC not present.
const IAPC_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;
/// MADT interrupt source override: ISA IRQ -> GSI, flags (0: bus default).
const ISA_OVERRIDES: [(u8, u32, u16); 1] = [(4, 4, 0)];

/// Errors of ACPI table creation.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("{0} vCPUs: between 1 and 255 are supported")]
    VcpuCount(usize),
    #[error("64-bit PCI window at {start:#x} size {size:#x}: empty or wrapping")]
    Mmio64Window { start: u64, size: u64 },
    #[error("ACPI tables need {end:#x}, the room ends at {limit:#x}")]
    TooLarge { end: u64, limit: u64 },
    #[error("writing ACPI table {signature} at {addr:#x}")]
    GuestMemory {
        signature: String,
        addr: u64,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// What a guest write to [`layout::ACPI_SHUTDOWN_PORT`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownRequest {
    /// S5: power off (the VMM exits with code 0).
    PowerOff,
    /// Reset (the VMM restarts the guest).
    Reset,
}

/// Decodes a byte written to [`layout::ACPI_SHUTDOWN_PORT`]; `None` for
/// anything else (another sleep state, `SLP_EN` clear): ignored.
pub fn decode_shutdown_port_write(value: u8) -> Option<ShutdownRequest> {
    if value == RESET_VALUE {
        Some(ShutdownRequest::Reset)
    } else if value & SLP_EN != 0 && (value >> 2) & 0x7 == S5_SLEEP_TYPE {
        Some(ShutdownRequest::PowerOff)
    } else {
        None
    }
}

/// Where the tables went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcpiTables {
    /// Address of the RSDP.
    pub rsdp: u64,
    /// `(signature, address, length)` of every table the XSDT lists, and of
    /// the DSDT (listed by the FADT), then the XSDT.
    pub tables: Vec<([u8; 4], u64, u64)>,
}

fn to_bytes(t: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    t.to_aml_bytes(&mut v);
    v
}

fn table_id(signature: &[u8; 4]) -> [u8; 8] {
    let mut id = *b"PCOW    ";
    id[4..].copy_from_slice(signature);
    id
}

/// The DSDT: PCI host bridge, motherboard resources, `\_S5_`.
fn dsdt(cfg: &AcpiConfig) -> Vec<u8> {
    let mmio32_end = (layout::PCI_MMIO32_START + layout::PCI_MMIO32_SIZE - 1) as u32;
    let mmio64_end = cfg.pci_mmio64_start + cfg.pci_mmio64_size - 1;
    let io_end = layout::PCI_IO_START + (layout::PCI_IO_SIZE - 1);
    let bus_range = aml::AddressSpace::new_bus_number(
        u16::from(layout::PCI_BUS_START),
        u16::from(layout::PCI_BUS_END),
    );
    let config_io = aml::IO::new(
        layout::PCI_CONFIG_IO_START,
        layout::PCI_CONFIG_IO_START,
        1,
        layout::PCI_CONFIG_IO_SIZE as u8,
    );
    let io_window = aml::AddressSpace::new_io(layout::PCI_IO_START, io_end, None);
    let mmio32 = aml::AddressSpace::new_memory(
        aml::AddressSpaceCacheable::NotCacheable,
        true,
        layout::PCI_MMIO32_START as u32,
        mmio32_end,
        None,
    );
    let mmio64 = aml::AddressSpace::new_memory(
        aml::AddressSpaceCacheable::NotCacheable,
        true,
        cfg.pci_mmio64_start,
        mmio64_end,
        None,
    );
    let crs =
        aml::ResourceTemplate::new(vec![&bus_range, &config_io, &io_window, &mmio32, &mmio64]);
    let pci_hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A08"));
    let pci_cid = aml::Name::new("_CID".into(), &aml::EISAName::new("PNP0A03"));
    let adr = aml::Name::new("_ADR".into(), &aml::ZERO);
    let seg = aml::Name::new("_SEG".into(), &layout::PCI_SEGMENT);
    let uid = aml::Name::new("_UID".into(), &aml::ZERO);
    let bbn = aml::Name::new("_BBN".into(), &layout::PCI_BUS_START);
    let pci_crs = aml::Name::new("_CRS".into(), &crs);
    let pci0 = aml::Device::new(
        "PCI0".into(),
        vec![&pci_hid, &pci_cid, &adr, &seg, &uid, &bbn, &pci_crs],
    );

    let ecam = aml::Memory32Fixed::new(
        false,
        layout::PCI_ECAM_START as u32,
        layout::PCI_ECAM_SIZE as u32,
    );
    let mbrd_crs = aml::ResourceTemplate::new(vec![&ecam]);
    let mbrd_hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C02"));
    let mbrd_crs = aml::Name::new("_CRS".into(), &mbrd_crs);
    let mbrd = aml::Device::new("MBRD".into(), vec![&mbrd_hid, &uid, &mbrd_crs]);

    // COM1 as an ACPI device: Linux maps its IRQ through the IO-APIC only
    // for an interrupt some device's _CRS names (hardware-reduced ACPI has
    // no legacy ISA IRQ table), and without that the port's interrupt
    // (which drives every byte user space writes) never arrives.
    let com1_hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0501"));
    let com1_irq = aml::Interrupt::new(true, true, false, false, COM1_IRQ);
    let com1_io = aml::IO::new(COM1_BASE, COM1_BASE, 1, COM1_SIZE as u8);
    let com1_crs = aml::ResourceTemplate::new(vec![&com1_irq, &com1_io]);
    let com1_crs = aml::Name::new("_CRS".into(), &com1_crs);
    let com1 = aml::Device::new("COM1".into(), vec![&com1_hid, &uid, &com1_crs]);

    // The power button and the Generic Event Device that notifies it (see
    // the module docs).
    let pwrb_hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C0C"));
    let pwrb = aml::Device::new("PWRB".into(), vec![&pwrb_hid, &uid]);
    let ged_hid = aml::Name::new("_HID".into(), &"ACPI0013");
    let ged_irq = aml::Interrupt::new(true, true, false, false, GED_GSI);
    let ged_crs = aml::ResourceTemplate::new(vec![&ged_irq]);
    let ged_crs = aml::Name::new("_CRS".into(), &ged_crs);
    let pwrb_path = aml::Path::new("\\_SB_.PWRB");
    let notify = aml::Notify::new(&pwrb_path, &NOTIFY_BUTTON_PRESSED);
    let is_ours = aml::Equal::new(&aml::Arg(0), &GED_GSI);
    let if_ours = aml::If::new(&is_ours, vec![&notify]);
    let evt = aml::Method::new("_EVT".into(), 1, true, vec![&if_ours]);
    let ged = aml::Device::new("GED_".into(), vec![&ged_hid, &uid, &ged_crs, &evt]);

    let sb = aml::Scope::new("\\_SB_".into(), vec![&pci0, &mbrd, &com1, &pwrb, &ged]);
    let s5_package = aml::Package::new(vec![&S5_SLEEP_TYPE]);
    let s5 = aml::Name::new("_S5_".into(), &s5_package);

    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, table_id(b"DSDT"), OEM_REVISION);
    dsdt.append_slice(&to_bytes(&sb));
    dsdt.append_slice(&to_bytes(&s5));
    dsdt.as_slice().to_vec()
}

/// The FADT: hardware-reduced, shutdown/reset through the VMM's port.
fn fadt(dsdt_addr: u64) -> Vec<u8> {
    let port = GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        u64::from(layout::ACPI_SHUTDOWN_PORT),
    );
    let mut fadt = FADTBuilder::new(OEM_ID, table_id(b"FACP"), OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    fadt.reset_reg = port;
    fadt.reset_value = RESET_VALUE;
    fadt.sleep_control_reg = port;
    fadt.sleep_status_reg = port;
    fadt.iapc_boot_arch = (IAPC_VGA_NOT_PRESENT | IAPC_CMOS_RTC_NOT_PRESENT).into();
    to_bytes(&fadt.finalize())
}

/// The MADT: local APICs, the IO-APIC, ISA overrides.
fn madt(vcpus: u8) -> Vec<u8> {
    let mut madt = Sdt::new(*b"APIC", 44, 5, OEM_ID, table_id(b"APIC"), OEM_REVISION);
    madt.write_u32(36, layout::LAPIC_START as u32);
    madt.write_u32(40, 0); // flags: no PC-AT dual 8259 setup wanted
    for id in 0..vcpus {
        // type 0, length 8, processor uid, APIC id, flags (enabled)
        let mut e = vec![0, 8, id, id];
        e.extend_from_slice(&1u32.to_le_bytes());
        madt.append_slice(&e);
    }
    // type 1, length 12, IO-APIC id 0, reserved, address, GSI base
    let mut ioapic = vec![1, 12, 0, 0];
    ioapic.extend_from_slice(&(layout::IOAPIC_START as u32).to_le_bytes());
    ioapic.extend_from_slice(&0u32.to_le_bytes());
    madt.append_slice(&ioapic);
    for (irq, gsi, flags) in ISA_OVERRIDES {
        // type 2, length 10, bus 0 (ISA), source IRQ, GSI, flags
        let mut e = vec![2, 10, 0, irq];
        e.extend_from_slice(&gsi.to_le_bytes());
        e.extend_from_slice(&flags.to_le_bytes());
        madt.append_slice(&e);
    }
    madt.as_slice().to_vec()
}

/// The MCFG: the one ECAM window.
fn mcfg() -> Vec<u8> {
    let mut mcfg = MCFG::new(OEM_ID, table_id(b"MCFG"), OEM_REVISION);
    mcfg.add_ecam(
        layout::PCI_ECAM_START,
        layout::PCI_SEGMENT,
        layout::PCI_BUS_START,
        layout::PCI_BUS_END,
    );
    to_bytes(&mcfg)
}

/// What the tables describe that is not fixed by [`layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcpiConfig {
    /// Number of vCPUs (1..=255).
    pub vcpus: usize,
    /// Start of the 64-bit PCI BAR window (the pci module's
    /// `Mmio64Window::base`).
    pub pci_mmio64_start: u64,
    /// Size of the 64-bit PCI BAR window (non-zero).
    pub pci_mmio64_size: u64,
}

impl AcpiConfig {
    /// `vcpus` vCPUs and the fixed fallback window
    /// [`layout::PCI_MMIO64_START`].
    pub fn new(vcpus: usize) -> AcpiConfig {
        AcpiConfig {
            vcpus,
            pci_mmio64_start: layout::PCI_MMIO64_START,
            pci_mmio64_size: layout::PCI_MMIO64_SIZE,
        }
    }
}

/// Builds the tables for `cfg` and writes them into `mem` (see the module
/// docs for the layout). Returns where they went.
pub fn create_acpi_tables<M: GuestMemoryBackend>(
    mem: &M,
    cfg: &AcpiConfig,
) -> Result<AcpiTables, AcpiError> {
    let vcpus = cfg.vcpus;
    let n = u8::try_from(vcpus)
        .ok()
        .filter(|&n| n > 0)
        .ok_or(AcpiError::VcpuCount(vcpus))?;
    if cfg.pci_mmio64_size == 0
        || cfg
            .pci_mmio64_start
            .checked_add(cfg.pci_mmio64_size)
            .is_none()
    {
        return Err(AcpiError::Mmio64Window {
            start: cfg.pci_mmio64_start,
            size: cfg.pci_mmio64_size,
        });
    }
    let mut cursor = (layout::ACPI_RSDP_START + Rsdp::len() as u64).next_multiple_of(TABLE_ALIGN);
    let mut tables = Vec::new();
    let mut place =
        |bytes: Vec<u8>, tables: &mut Vec<([u8; 4], u64, u64)>| -> Result<u64, AcpiError> {
            let addr = cursor;
            let end = addr + bytes.len() as u64;
            if end > layout::ACPI_TABLES_END {
                return Err(AcpiError::TooLarge {
                    end,
                    limit: layout::ACPI_TABLES_END,
                });
            }
            let mut signature = [0u8; 4];
            signature.copy_from_slice(&bytes[..4]);
            mem.write_slice(&bytes, GuestAddress(addr))
                .map_err(|source| AcpiError::GuestMemory {
                    signature: String::from_utf8_lossy(&signature).into_owned(),
                    addr,
                    source,
                })?;
            tables.push((signature, addr, bytes.len() as u64));
            cursor = end.next_multiple_of(TABLE_ALIGN);
            Ok(addr)
        };
    let dsdt_addr = place(dsdt(cfg), &mut tables)?;
    let fadt_addr = place(fadt(dsdt_addr), &mut tables)?;
    let madt_addr = place(madt(n), &mut tables)?;
    let mcfg_addr = place(mcfg(), &mut tables)?;
    let mut xsdt = XSDT::new(OEM_ID, table_id(b"XSDT"), OEM_REVISION);
    for addr in [fadt_addr, madt_addr, mcfg_addr] {
        xsdt.add_entry(addr);
    }
    let xsdt_addr = place(to_bytes(&xsdt), &mut tables)?;
    let rsdp = Rsdp::new(OEM_ID, xsdt_addr);
    mem.write_slice(&to_bytes(&rsdp), GuestAddress(layout::ACPI_RSDP_START))
        .map_err(|source| AcpiError::GuestMemory {
            signature: "RSD PTR ".to_owned(),
            addr: layout::ACPI_RSDP_START,
            source,
        })?;
    Ok(AcpiTables {
        rsdp: layout::ACPI_RSDP_START,
        tables,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap()
    }

    fn read(mem: &GuestMemoryMmap, addr: u64, len: u64) -> Vec<u8> {
        let mut v = vec![0u8; len as usize];
        mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    /// Reads a table at `addr`: checks its length field fits and its
    /// checksum, returns its bytes.
    fn table(mem: &GuestMemoryMmap, addr: u64) -> Vec<u8> {
        let hdr = read(mem, addr, 36);
        let len = u64::from(u32_at(&hdr, 4));
        assert!(len >= 36);
        assert!(addr + len <= layout::ACPI_TABLES_END);
        let t = read(mem, addr, len);
        assert_eq!(
            sum(&t),
            0,
            "checksum of {:?}",
            String::from_utf8_lossy(&t[..4])
        );
        t
    }

    fn parse(mem: &GuestMemoryMmap) -> Vec<Vec<u8>> {
        let rsdp = read(mem, layout::ACPI_RSDP_START, 36);
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(sum(&rsdp[..20]), 0);
        assert_eq!(sum(&rsdp), 0);
        assert_eq!(rsdp[15], 2, "revision");
        let xsdt = table(mem, u64_at(&rsdp, 24));
        assert_eq!(&xsdt[..4], b"XSDT");
        (36..xsdt.len())
            .step_by(8)
            .map(|off| table(mem, u64_at(&xsdt, off)))
            .collect()
    }

    #[test]
    fn tables_parse_back() {
        for vcpus in [1usize, 2, 8, 255] {
            let mem = mem();
            let cfg = AcpiConfig {
                pci_mmio64_start: 0x2_4000_0000,
                ..AcpiConfig::new(vcpus)
            };
            let placed = create_acpi_tables(&mem, &cfg).unwrap();
            assert_eq!(placed.rsdp, layout::ACPI_RSDP_START);
            let tables = parse(&mem);
            let sigs: Vec<&[u8]> = tables.iter().map(|t| &t[..4]).collect();
            assert_eq!(sigs, [&b"FACP"[..], b"APIC", b"MCFG"]);

            // Placed tables do not overlap.
            let mut spans: Vec<_> = placed.tables.iter().map(|t| (t.1, t.1 + t.2)).collect();
            spans.sort();
            assert!(spans[0].0 >= layout::ACPI_RSDP_START + 36);
            for w in spans.windows(2) {
                assert!(w[0].1 <= w[1].0);
            }

            // FADT: hardware reduced, reset and sleep registers on the port.
            let fadt = &tables[0];
            assert_eq!(fadt.len(), 276);
            let flags = u32_at(fadt, 112);
            assert_ne!(flags & Flags::HwReducedAcpi as u32, 0);
            assert_ne!(flags & Flags::ResetRegSup as u32, 0);
            let port = u64::from(layout::ACPI_SHUTDOWN_PORT);
            assert_eq!(fadt[116], 1, "reset register in I/O space");
            assert_eq!(u64_at(fadt, 120), port);
            assert_eq!(fadt[128], RESET_VALUE);
            assert_eq!(fadt[244], 1, "sleep control in I/O space");
            assert_eq!(u64_at(fadt, 248), port);
            assert_eq!(u64_at(fadt, 260), port);

            // MADT: N local APICs, one IO-APIC, the overrides.
            let madt = &tables[1];
            assert_eq!(u64::from(u32_at(madt, 36)), layout::LAPIC_START);
            let mut off = 44;
            let (mut lapics, mut ioapics, mut isos) = (Vec::new(), 0, 0);
            while off < madt.len() {
                let (ty, len) = (madt[off], madt[off + 1] as usize);
                match ty {
                    0 => {
                        assert_eq!(len, 8);
                        assert_eq!(u32_at(madt, off + 4), 1, "enabled");
                        lapics.push(madt[off + 3]);
                    }
                    1 => {
                        assert_eq!(u64::from(u32_at(madt, off + 4)), layout::IOAPIC_START);
                        ioapics += 1;
                    }
                    2 => {
                        assert_eq!(len, 10);
                        isos += 1;
                    }
                    t => panic!("unexpected MADT entry type {t}"),
                }
                off += len;
            }
            assert_eq!(off, madt.len());
            assert_eq!(lapics, (0..vcpus as u8).collect::<Vec<_>>());
            assert_eq!((ioapics, isos), (1, ISA_OVERRIDES.len()));

            // MCFG: the ECAM constants.
            let mcfg = &tables[2];
            assert_eq!(mcfg.len(), 44 + 16);
            assert_eq!(u64_at(mcfg, 44), layout::PCI_ECAM_START);
            assert_eq!(
                u16::from_le_bytes([mcfg[52], mcfg[53]]),
                layout::PCI_SEGMENT
            );
            assert_eq!(
                (mcfg[54], mcfg[55]),
                (layout::PCI_BUS_START, layout::PCI_BUS_END)
            );
            let ecam_buses = u64::from(mcfg[55] - mcfg[54]) + 1;
            assert_eq!(ecam_buses << 20, layout::PCI_ECAM_SIZE);

            // DSDT through the FADT's X_DSDT.
            let dsdt = table(&mem, u64_at(fadt, 140));
            assert_eq!(&dsdt[..4], b"DSDT");
            let contains = |needle: &[u8]| dsdt.windows(needle.len()).any(|w| w == needle);
            assert!(contains(&to_bytes(&aml::EISAName::new("PNP0A08"))));
            assert!(contains(&to_bytes(&aml::EISAName::new("PNP0C02"))));
            assert!(contains(b"PCI0"));
            assert!(contains(b"_S5_"));
            assert!(contains(&0x2_4000_0000u64.to_le_bytes()));
            assert!(contains(&(layout::PCI_MMIO32_START as u32).to_le_bytes()));
        }
    }

    /// The DSDT's bytes as the guest gets them (checked by `table`).
    fn placed_dsdt() -> Vec<u8> {
        let mem = mem();
        let placed = create_acpi_tables(&mem, &AcpiConfig::new(2)).unwrap();
        let (_, addr, _) = placed
            .tables
            .iter()
            .find(|t| &t.0 == b"DSDT")
            .copied()
            .unwrap();
        table(&mem, addr)
    }

    /// Reads an AML PkgLength at `b[0..]`: (value, bytes it took).
    fn pkg_length(b: &[u8]) -> (usize, usize) {
        let extra = usize::from(b[0] >> 6);
        if extra == 0 {
            return (usize::from(b[0] & 0x3f), 1);
        }
        let mut v = usize::from(b[0] & 0x0f);
        for (i, x) in b[1..=extra].iter().enumerate() {
            v |= usize::from(*x) << (4 + 8 * i);
        }
        (v, extra + 1)
    }

    /// The body of the `Device` named `name` (a 4-character NameSeg)
    /// inside `aml`, checking that its PkgLength ends inside `aml`.
    fn device_body<'a>(aml: &'a [u8], name: &[u8; 4]) -> &'a [u8] {
        // ExtOpPrefix DeviceOp, PkgLength (1..4 bytes), the name.
        let at = (0..aml.len().saturating_sub(2))
            .find(|&i| {
                aml[i] == 0x5b && aml[i + 1] == 0x82 && {
                    let (_, n) = pkg_length(&aml[i + 2..]);
                    aml.get(i + 2 + n..i + 6 + n) == Some(&name[..])
                }
            })
            .unwrap_or_else(|| panic!("no Device {:?}", String::from_utf8_lossy(name)));
        let (len, n) = pkg_length(&aml[at + 2..]);
        let end = at + 2 + len;
        assert!(end <= aml.len(), "Device {name:?} runs past the table");
        &aml[at + 2 + n + 4..end]
    }

    #[test]
    fn power_button_and_its_event_device() {
        let dsdt = placed_dsdt();
        let aml = &dsdt[36..];
        let contains = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);

        // \_SB_.PWRB: a control-method power button.
        let pwrb = device_body(aml, b"PWRB");
        assert!(contains(pwrb, &to_bytes(&aml::EISAName::new("PNP0C0C"))));

        // \_SB_.GED_: ACPI0013, one edge/high interrupt on GED_GSI, _EVT.
        let ged = device_body(aml, b"GED_");
        assert!(contains(ged, b"_HID\x0dACPI0013\x00"), "string _HID");
        let irq = [0x89, 6, 0, 0b0011, 1, GED_GSI as u8, 0, 0, 0];
        assert!(
            contains(ged, &irq),
            "Interrupt(consumer, edge, high) {{{GED_GSI}}}"
        );
        // Method (_EVT, 1 argument, serialized): If (Arg0 == GED_GSI)
        // Notify (\_SB_.PWRB, 0x80).
        let evt = ged
            .windows(5)
            .position(|w| w[0] == 0x14 && &w[2..5] == b"_EV")
            .expect("_EVT method");
        assert_eq!(ged[evt + 5], b'T');
        assert_eq!(ged[evt + 6], 0x09, "1 argument, serialized");
        let body = &ged[evt + 7..];
        let arg0_is_gsi = [0x93, 0x68, 0x0a, GED_GSI as u8]; // LEqual Arg0 ByteConst
        assert!(contains(body, &arg0_is_gsi));
        let mut notify = vec![0x86, b'\\', 0x2e];
        notify.extend_from_slice(b"_SB_PWRB");
        notify.extend_from_slice(&[0x0a, NOTIFY_BUTTON_PRESSED]);
        assert!(contains(body, &notify), "Notify (\\_SB_.PWRB, 0x80)");
        // The interrupt is free: not COM1's, an IO-APIC pin, no override.
        const { assert!(GED_GSI != COM1_IRQ && GED_GSI < layout::IOAPIC_PINS) };
        assert!(ISA_OVERRIDES.iter().all(|o| o.1 != GED_GSI));
    }

    /// ACPICA's disassembler and compiler (Debian's `acpica-tools`) on the
    /// DSDT: it must disassemble, name the devices, and compile back
    /// without errors (every name it references resolves).
    #[test]
    fn dsdt_round_trips_through_iasl() {
        let iasl = std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("iasl"))
                .find(|f| f.is_file())
        });
        let Some(iasl) = iasl else {
            println!("SKIPPED: no iasl (apt-get install acpica-tools)");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let dat = dir.path().join("dsdt.dat");
        std::fs::write(&dat, placed_dsdt()).unwrap();
        let out = std::process::Command::new(&iasl)
            .current_dir(dir.path())
            .args(["-d", "dsdt.dat"])
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "iasl -d: {log}");
        let dsl = std::fs::read_to_string(dir.path().join("dsdt.dsl")).unwrap();
        for needle in [
            "Device (PWRB)",
            "EisaId (\"PNP0C0C\")",
            "Device (GED)",
            "Name (_HID, \"ACPI0013\"",
            "Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, )",
            "0x00000005,",
            "Method (_EVT, 1, Serialized)",
            "If ((Arg0 == 0x05))",
            "Notify (\\_SB.PWRB, 0x80)",
            "Device (PCI0)",
            "Device (COM1)",
        ] {
            assert!(dsl.contains(needle), "no {needle:?} in:\n{dsl}");
        }
        let out = std::process::Command::new(&iasl)
            .current_dir(dir.path())
            .args(["-p", "recompiled", "dsdt.dsl"])
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "iasl (compile): {log}");
        assert!(log.contains(" 0 Errors"), "iasl (compile): {log}");
    }

    #[test]
    fn vcpu_count_checked() {
        assert!(matches!(
            create_acpi_tables(&mem(), &AcpiConfig::new(0)),
            Err(AcpiError::VcpuCount(0))
        ));
        assert!(matches!(
            create_acpi_tables(&mem(), &AcpiConfig::new(256)),
            Err(AcpiError::VcpuCount(256))
        ));
    }

    #[test]
    fn shutdown_port_decoding() {
        assert_eq!(
            decode_shutdown_port_write(RESET_VALUE),
            Some(ShutdownRequest::Reset)
        );
        assert_eq!(
            decode_shutdown_port_write((S5_SLEEP_TYPE << 2) | SLP_EN),
            Some(ShutdownRequest::PowerOff)
        );
        assert_eq!(decode_shutdown_port_write(S5_SLEEP_TYPE << 2), None);
        assert_eq!(decode_shutdown_port_write((3 << 2) | SLP_EN), None);
    }
}
