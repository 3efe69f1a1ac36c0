//! [`VmConfig::validate`]: checks on the whole config, after option
//! parsing or JSON deserialization and before any device is built. It runs
//! at `vm.create` (and at start for the command line) and again at
//! `vm.boot`.
//!
//! Rules (upstream's unless marked *ours*):
//! - every field of upstream's config is accepted at upstream's default
//!   value, and at values that describe what this VMM does anyway (listed
//!   in `docs/vmm.md`); any other value is an error naming the field
//!   (*ours*: upstream has the feature). A device this VMM does not have
//!   (`disks`, `net`, `balloon`, ...) is refused unless absent, `null` or an
//!   empty list, with an error naming the field and its option;
//! - `landlock_rules`: each `{path, access}` with an existing path and
//!   `access` `r`, `w` or `rw` (as upstream);
//! - `boot_vcpus` 1..=254 and `max_vcpus >= boot_vcpus`; with `max_vcpus >
//!   boot_vcpus` the guest gets `boot_vcpus` (*ours*: there is no vCPU
//!   hot-plug, `max_vcpus` is only kept in the config);
//! - RAM: a non-zero multiple of 4 KiB, at most [`crate::vm::MAX_RAM`]
//!   (*ours*: the VM places RAM below the 32-bit hole);
//! - a kernel is given and is a readable regular file, and so is the
//!   initramfs when given; the command line has no NUL byte;
//! - serial and console: `file` required with mode `File`, and given
//!   otherwise only with `Pty` (where it is the terminal's path, as
//!   upstream reports it); `socket` required with mode `Socket`, which
//!   only the serial port has (upstream refuses it for the console at
//!   boot); both on `Tty` is accepted with a warning, as upstream does
//!   (the serial port then reads standard input, see [`crate::chardev`]);
//! - rng: `iommu` false (*ours*); the source is opened at boot;
//! - device ids (pmem, console, rng) are unique and do not start with `__`; pmem devices
//!   without one get `_pmem0`, `_pmem1`, ... (skipping ids in use);
//! - each pmem file exists, is a regular file, and no two devices use the
//!   same file (*ours*); a pcow image (recognised by its magic) opens with
//!   its chain, has a virtual size that is a multiple of 2 MiB, and `size=`
//!   equals that virtual size (with `discard_writes` the guest writes
//!   into a temporary overlay, see [`crate::machine`]); a raw file's
//!   device size (`size=`, else the file's length) is a non-zero multiple
//!   of 2 MiB; `size=`
//!   larger than a raw file is refused (*ours*: upstream maps past the end
//!   of the file and the guest faults there; it grows only its temporary
//!   files).

use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::option_parser::esc;
use super::vm_config::{
    ConsoleConfig, ConsoleOutputMode, CoreScheduling, PmemConfig, VmConfig, DEFAULT_MAX_PHYS_BITS,
    MAX_VCPUS,
};

/// pmem devices are sized and placed in 2 MiB units, as upstream does.
pub const PMEM_ALIGN: u64 = 2 << 20;
const PAGE: u64 = 4096;
const PMEM_PREFIX: &str = "_pmem";

/// Why a config is refused.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    #[error(
        "`{field}` = {value} is not supported (accepted only at upstream's default: {default})"
    )]
    Unsupported {
        field: String,
        value: String,
        default: &'static str,
    },
    #[error("`{field}` ({option}): this VMM has no {what}; remove it")]
    NoDevice {
        field: &'static str,
        option: &'static str,
        what: &'static str,
    },
    #[error("`landlock_rules` (--landlock-rules)")]
    Landlock(#[source] crate::landlock_rules::LandlockError),
    #[error("cpus: boot_vcpus {0} must be from 1 to {MAX_VCPUS}")]
    BootVcpus(u8),
    #[error("cpus: max_vcpus {max} must be from boot_vcpus ({boot}) to {MAX_VCPUS}")]
    MaxVcpus { boot: u8, max: u8 },
    #[error("memory: size {size} must be a non-zero multiple of 4 KiB up to {max}")]
    MemorySize { size: u64, max: u64 },
    #[error("no kernel given (--kernel, payload.kernel)")]
    KernelMissing,
    #[error("{what} {path}: cannot be read")]
    PayloadFile {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {path}: not a regular file")]
    PayloadNotFile { what: &'static str, path: PathBuf },
    #[error("payload.cmdline contains a NUL byte")]
    CmdlineNul,
    #[error("invalid string: {0}")]
    InvalidString(String),
    #[error("{what}: mode File needs a file")]
    ConsoleFileMissing { what: &'static str },
    #[error("{what}: a file is given but the mode is {mode:?}, not File")]
    ConsoleFileWithoutFileMode {
        what: &'static str,
        mode: ConsoleOutputMode,
    },
    #[error("{what}: mode Socket needs a socket path")]
    ConsoleSocketMissing { what: &'static str },
    #[error("{what}: a socket is given but the mode is {mode:?}, not Socket")]
    ConsoleSocketWithoutSocketMode {
        what: &'static str,
        mode: ConsoleOutputMode,
    },
    #[error(
        "device id `{}`: ids starting with `__` are reserved and ids must not be empty",
        esc(.0)
    )]
    InvalidId(String),
    #[error("device id `{}` is used twice", esc(.0))]
    DuplicateId(String),
    #[error("pmem {id}: {path}: cannot open")]
    PmemOpen {
        id: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "pmem {id}: {path} is not a regular file (upstream's temporary-file pmem in a \
         directory is not supported)"
    )]
    PmemNotFile { id: String, path: PathBuf },
    #[error("pmem {id} and pmem {other} use the same file {path}")]
    PmemSameFile {
        id: String,
        other: String,
        path: PathBuf,
    },
    #[error("pmem {id}: pcow image {path}")]
    PcowOpen {
        id: String,
        path: PathBuf,
        #[source]
        source: Box<pcow::Error>,
    },
    #[error(
        "pmem {id}: pcow image {path} has a virtual size of {size} bytes, not a non-zero \
         multiple of 2 MiB (fix it with `pcow-img resize`)"
    )]
    PcowVirtualSize {
        id: String,
        path: PathBuf,
        size: u64,
    },
    #[error(
        "pmem {id}: size={size} does not match the virtual size {virtual_size} of pcow \
         image {path} (omit size= or use `pcow-img resize`)"
    )]
    PcowSizeMismatch {
        id: String,
        path: PathBuf,
        size: u64,
        virtual_size: u64,
    },
    #[error("pmem {id}: raw file {path}: size {size} is not a non-zero multiple of 2 MiB")]
    RawSize {
        id: String,
        path: PathBuf,
        size: u64,
    },
    #[error(
        "pmem {id}: size={size} is larger than raw file {path} ({len} bytes); the file is \
         not grown (truncate it to the size first)"
    )]
    RawSizeBeyondFile {
        id: String,
        path: PathBuf,
        size: u64,
        len: u64,
    },
}

/// The format of a pmem backing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PmemFormat {
    /// A pcow image (by its magic).
    Pcow,
    /// Anything else: mapped as it is, as upstream does.
    Raw,
}

/// What validation learnt about one pmem device, in config order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidatedPmem {
    /// The device id (given or assigned).
    pub id: String,
    /// Backing file as configured.
    pub file: PathBuf,
    /// Its format.
    pub format: PmemFormat,
    /// The device (region) size in bytes, a multiple of 2 MiB.
    pub size: u64,
}

type Result<T> = std::result::Result<T, ValidationError>;

/// At most this many characters of a refused value go into the error.
const MAX_SHOWN: usize = 200;

fn unsupported(
    field: impl Into<String>,
    value: impl ToString,
    default: &'static str,
) -> Result<()> {
    let mut value = esc(&value.to_string());
    if value.chars().count() > MAX_SHOWN {
        value = value.chars().take(MAX_SHOWN).collect::<String>() + "...";
    }
    Err(ValidationError::Unsupported {
        field: field.into(),
        value,
        default,
    })
}

fn only_false(field: &str, v: bool) -> Result<()> {
    if v {
        return unsupported(field, v, "false");
    }
    Ok(())
}

fn only_absent<T: std::fmt::Debug>(field: &str, v: &Option<T>) -> Result<()> {
    match v {
        Some(v) => unsupported(field, format!("{v:?}"), "absent"),
        None => Ok(()),
    }
}

/// Absent, `null` or an empty list.
fn is_empty(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    }
}

fn only_empty(field: &str, v: &Option<Value>) -> Result<()> {
    match v {
        v if is_empty(v) => Ok(()),
        Some(v) => unsupported(field, v, "absent or empty"),
        None => Ok(()),
    }
}

fn only_empty_list<T>(field: &str, v: &Option<Vec<T>>) -> Result<()>
where
    T: std::fmt::Debug,
{
    match v {
        Some(l) if !l.is_empty() => unsupported(field, format!("{l:?}"), "absent or empty"),
        _ => Ok(()),
    }
}

/// Devices (and device-like features) this VMM does not have: the field,
/// its command-line option and what it is.
const NO_DEVICE: &[(&str, &str, &str)] = &[
    ("rate_limit_groups", "--rate-limit-group", "rate limiter"),
    ("disks", "--disk", "virtio-block device"),
    ("net", "--net", "virtio-net device"),
    ("balloon", "--balloon", "virtio-balloon device"),
    (
        "generic_vhost_user",
        "--generic-vhost-user",
        "generic vhost-user device",
    ),
    ("fs", "--fs", "virtio-fs device"),
    ("devices", "--device", "VFIO device assignment"),
    ("user_devices", "--user-device", "vfio-user device"),
    ("vdpa", "--vdpa", "vDPA device"),
    ("vsock", "--vsock", "virtio-vsock device"),
    ("pvmemcontrol", "--pvmemcontrol", "pvmemcontrol device"),
    ("numa", "--numa", "NUMA support"),
    ("rtc", "--rtc", "virtio-rtc device"),
    ("tpm", "--tpm", "TPM device"),
    ("ivshmem", "--ivshmem", "ivshmem device"),
    ("memory.zones", "--memory-zone", "memory zones"),
];

fn no_device(
    (field, option, what): (&'static str, &'static str, &'static str),
    v: &Option<Value>,
) -> Result<()> {
    if is_empty(v) {
        return Ok(());
    }
    Err(ValidationError::NoDevice {
        field,
        option,
        what,
    })
}

/// The PCI fields every device has (`PciDeviceCommonConfig`): one segment,
/// no IOMMU, no slot choice.
fn check_pci(what: &str, iommu: bool, pci_segment: u16, pci_device_id: Option<u8>) -> Result<()> {
    only_false(&format!("{what}.iommu"), iommu)?;
    if pci_segment != 0 {
        return unsupported(format!("{what}.pci_segment"), pci_segment, "0");
    }
    only_absent(&format!("{what}.pci_device_id"), &pci_device_id)
}

fn check_console(what: &'static str, c: &ConsoleConfig, virtio: bool) -> Result<()> {
    if virtio {
        // upstream's serial port has no PCI fields (ignored there).
        check_pci(what, c.iommu, c.pci_segment, c.pci_device_id)?;
    }
    if virtio && c.mode == ConsoleOutputMode::Socket {
        return unsupported(
            format!("{what}.mode"),
            "Socket",
            "Tty (also Off, Null, Pty, File; Socket is for the serial port)",
        );
    }
    match (c.mode, &c.file) {
        (ConsoleOutputMode::File, None) => {
            return Err(ValidationError::ConsoleFileMissing { what })
        }
        (ConsoleOutputMode::File | ConsoleOutputMode::Pty, _) | (_, None) => {}
        (mode, Some(_)) => return Err(ValidationError::ConsoleFileWithoutFileMode { what, mode }),
    }
    match (c.mode, &c.socket) {
        (ConsoleOutputMode::Socket, None) => Err(ValidationError::ConsoleSocketMissing { what }),
        (ConsoleOutputMode::Socket, Some(_)) | (_, None) => Ok(()),
        (mode, Some(_)) => Err(ValidationError::ConsoleSocketWithoutSocketMode { what, mode }),
    }
}

fn check_payload_file(what: &'static str, path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|source| ValidationError::PayloadFile {
        what,
        path: path.to_owned(),
        source,
    })?;
    if !meta.is_file() {
        return Err(ValidationError::PayloadNotFile {
            what,
            path: path.to_owned(),
        });
    }
    Ok(())
}

/// Which files a validation looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileChecks {
    /// The kernel, the initramfs and every pmem file.
    All,
    /// The pmem files only: a restored VM's RAM holds its kernel already.
    Pmem,
    /// None: a snapshot's config, before the restore decides which pmem
    /// files the VM gets.
    None,
}

impl VmConfig {
    /// Checks the whole config (the rules are in this module's docs) and
    /// assigns `_pmemN` ids to pmem devices without one. On error the
    /// config is unchanged. Returns what it learnt about each pmem device.
    pub fn validate(&mut self) -> Result<Vec<ValidatedPmem>> {
        self.validate_checking(FileChecks::All)
    }

    /// [`VmConfig::validate`] of a snapshot's config: every rule but those
    /// about files (the pmem files a restored VM gets are decided later,
    /// its kernel is in its RAM). Assigns the pmem ids.
    pub fn validate_snapshot_config(&mut self) -> Result<()> {
        self.validate_checking(FileChecks::None).map(|_| ())
    }

    /// [`VmConfig::validate`] of a restored VM's config: its pmem files
    /// (clones, rolled-back images) are checked, its kernel and initramfs
    /// are not read (its RAM holds them; a reboot checks them again).
    pub fn validate_restored(&mut self) -> Result<Vec<ValidatedPmem>> {
        self.validate_checking(FileChecks::Pmem)
    }

    fn validate_checking(&mut self, files: FileChecks) -> Result<Vec<ValidatedPmem>> {
        self.check_unsupported()?;
        self.check_cpus_memory()?;
        if files == FileChecks::All {
            self.check_payload()?;
        } else if self
            .payload
            .as_ref()
            .and_then(|p| p.kernel.as_ref())
            .is_none()
        {
            return Err(ValidationError::KernelMissing);
        }
        check_console("serial", &self.serial, false)?;
        check_console("console", &self.console, true)?;
        if self.serial.mode == ConsoleOutputMode::Tty && self.console.mode == ConsoleOutputMode::Tty
        {
            log::warn!(
                "serial and console both on tty: both write to standard output, \
                 the serial port alone reads standard input"
            );
        }
        // Every id and path bounded and printable (the API's rules, for
        // the command line too), before an id is echoed or a file opened.
        if let Ok(v) = serde_json::to_value(&*self) {
            crate::api::routes::check_strings(&v)
                .map_err(|e| ValidationError::InvalidString(e.chain[1..].join(": ")))?;
        }
        let ids = self.pmem_ids()?;
        let mut out = Vec::with_capacity(ids.len());
        let mut seen: Vec<((u64, u64), String)> = Vec::new();
        for (cfg, id) in self.pmem().iter().zip(&ids) {
            if files == FileChecks::None {
                continue;
            }
            let (v, key) = check_pmem(cfg, id)?;
            if let Some((_, other)) = seen.iter().find(|(k, _)| *k == key) {
                return Err(ValidationError::PmemSameFile {
                    id: id.clone(),
                    other: other.clone(),
                    path: cfg.file.clone(),
                });
            }
            seen.push((key, id.clone()));
            out.push(v);
        }
        if let Some(pmem) = self.pmem.as_mut() {
            for (cfg, id) in pmem.iter_mut().zip(ids) {
                cfg.id = Some(id);
            }
        }
        Ok(out)
    }

    /// Adds a pmem device (`vm.add-pmem` on a VM not booted yet) and
    /// validates the config with it; on error the config is unchanged.
    /// Returns what validation learnt about the new device.
    pub fn add_pmem(&mut self, pmem: PmemConfig) -> Result<ValidatedPmem> {
        let mut next = self.clone();
        next.pmem.get_or_insert_with(Vec::new).push(pmem);
        let mut checked = next.validate()?;
        *self = next;
        Ok(checked
            .pop()
            .expect("validate returns one entry per pmem device, and there is one"))
    }

    fn check_unsupported(&self) -> Result<()> {
        crate::landlock_rules::parse_rules(&self.landlock_rules)
            .map_err(ValidationError::Landlock)?;
        let devices: [&Option<Value>; 16] = [
            &self.rate_limit_groups,
            &self.disks,
            &self.net,
            &self.balloon,
            &self.generic_vhost_user,
            &self.fs,
            &self.devices,
            &self.user_devices,
            &self.vdpa,
            &self.vsock,
            &self.pvmemcontrol,
            &self.numa,
            &self.rtc,
            &self.tpm,
            &self.ivshmem,
            &self.memory.zones,
        ];
        for (entry, v) in NO_DEVICE.iter().zip(devices) {
            no_device(*entry, v)?;
        }
        self.check_cpus_unsupported()?;
        let m = &self.memory;
        only_false("memory.mergeable", m.mergeable)?;
        if m.hotplug_size.is_some_and(|s| s != 0) {
            return unsupported(
                "memory.hotplug_size",
                m.hotplug_size.unwrap_or_default(),
                "absent (no memory hot-plug)",
            );
        }
        if m.hotplugged_size.is_some_and(|s| s != 0) {
            return unsupported(
                "memory.hotplugged_size",
                m.hotplugged_size.unwrap_or_default(),
                "absent (no memory hot-plug)",
            );
        }
        only_false("memory.shared", m.shared)?;
        only_false("memory.hugepages", m.hugepages)?;
        only_absent("memory.hugepage_size", &m.hugepage_size)?;
        only_false("memory.prefault", m.prefault)?;
        only_false("memory.reserve", m.reserve)?;
        if let Some(p) = &self.payload {
            only_absent("payload.firmware", &p.firmware)?;
            only_empty("payload.igvm", &p.igvm)?;
            only_empty("payload.host_data", &p.host_data)?;
            only_empty("payload.fw_cfg_config", &p.fw_cfg_config)?;
        }
        let r = &self.rng;
        // The source itself is opened (and checked) at boot.
        check_pci("rng", r.iommu, r.pci_segment, r.pci_device_id)?;
        if self.debug_console.mode != ConsoleOutputMode::Off {
            return unsupported(
                "debug_console.mode",
                format!("{:?}", self.debug_console.mode),
                "Off (there is no debug port)",
            );
        }
        for (name, v) in [
            ("pvpanic", self.pvpanic),
            ("iommu", self.iommu),
            ("watchdog", self.watchdog),
            ("gdb", self.gdb),
        ] {
            only_false(name, v)?;
        }
        for (i, s) in self.pci_segments.iter().flatten().enumerate() {
            if s.pci_segment != 0 {
                return unsupported(
                    format!("pci_segments[{i}].pci_segment"),
                    s.pci_segment,
                    "0 (the only PCI segment)",
                );
            }
        }
        if let Some(p) = &self.platform {
            if p.num_pci_segments != 1 {
                return unsupported("platform.num_pci_segments", p.num_pci_segments, "1");
            }
            only_empty_list("platform.iommu_segments", &p.iommu_segments)?;
            for (field, v) in [
                ("platform.system_serial_number", &p.system_serial_number),
                ("platform.system_uuid", &p.system_uuid),
                ("platform.system_manufacturer", &p.system_manufacturer),
                ("platform.system_product_name", &p.system_product_name),
                ("platform.system_version", &p.system_version),
                ("platform.system_family", &p.system_family),
                ("platform.system_sku_number", &p.system_sku_number),
                ("platform.chassis_asset_tag", &p.chassis_asset_tag),
            ] {
                only_absent(field, v)?;
            }
            only_empty_list("platform.oem_strings", &p.oem_strings)?;
            only_false("platform.tdx", p.tdx)?;
            only_false("platform.sev_snp", p.sev_snp)?;
            only_false("platform.iommufd", p.iommufd)?;
            only_absent("platform.iommufd_fd", &p.iommufd_fd)?;
        }
        for (i, p) in self.pmem().iter().enumerate() {
            check_pci(
                &format!("pmem[{i}]"),
                p.iommu,
                p.pci_segment,
                p.pci_device_id,
            )?;
        }
        Ok(())
    }

    fn check_cpus_unsupported(&self) -> Result<()> {
        let c = &self.cpus;
        if let Some(t) = &c.topology {
            let flat = t.threads_per_core == 1
                && t.dies_per_package == 1
                && t.packages == 1
                && t.cores_per_die == u16::from(c.boot_vcpus)
                && c.max_vcpus == c.boot_vcpus;
            if !flat {
                return unsupported(
                    "cpus.topology",
                    format!("{t:?}"),
                    "absent, or 1 thread per core, boot_vcpus cores per die, 1 die, 1 \
                     package (with max_vcpus = boot_vcpus)",
                );
            }
        }
        only_false("cpus.kvm_hyperv", c.kvm_hyperv)?;
        if c.max_phys_bits != DEFAULT_MAX_PHYS_BITS {
            return unsupported("cpus.max_phys_bits", c.max_phys_bits, "46");
        }
        only_empty_list("cpus.affinity", &c.affinity)?;
        only_false("cpus.features.amx", c.features.amx)?;
        if !c.nested {
            return unsupported("cpus.nested", false, "true");
        }
        if c.core_scheduling == CoreScheduling::Vcpu {
            return unsupported("cpus.core_scheduling", "Vcpu", "Vm (also Off)");
        }
        Ok(())
    }

    fn check_cpus_memory(&self) -> Result<()> {
        let (boot, max) = (self.cpus.boot_vcpus, self.cpus.max_vcpus);
        if boot == 0 || boot > MAX_VCPUS {
            return Err(ValidationError::BootVcpus(boot));
        }
        if max < boot || max > MAX_VCPUS {
            return Err(ValidationError::MaxVcpus { boot, max });
        }
        let size = self.memory.size;
        let limit = crate::vm::MAX_RAM;
        if size == 0 || !size.is_multiple_of(PAGE) || size > limit {
            return Err(ValidationError::MemorySize { size, max: limit });
        }
        Ok(())
    }

    fn check_payload(&self) -> Result<()> {
        let p = self.payload.as_ref();
        let kernel = p
            .and_then(|p| p.kernel.as_deref())
            .ok_or(ValidationError::KernelMissing)?;
        check_payload_file("kernel", kernel)?;
        if let Some(initramfs) = p.and_then(|p| p.initramfs.as_deref()) {
            check_payload_file("initramfs", initramfs)?;
        }
        if p.and_then(|p| p.cmdline.as_deref())
            .is_some_and(|c| c.contains('\0'))
        {
            return Err(ValidationError::CmdlineNul);
        }
        Ok(())
    }

    /// The pmem ids, given or assigned, in config order.
    fn pmem_ids(&self) -> Result<Vec<String>> {
        let mut used = BTreeSet::new();
        let others = [self.console.id.as_ref(), self.rng.id.as_ref()];
        let given = self.pmem().iter().filter_map(|p| p.id.as_ref());
        for id in others.into_iter().flatten().chain(given) {
            if id.is_empty() || id.starts_with("__") {
                return Err(ValidationError::InvalidId(id.clone()));
            }
            if !used.insert(id.clone()) {
                return Err(ValidationError::DuplicateId(id.clone()));
            }
        }
        let mut next = 0usize;
        let mut ids = Vec::new();
        for p in self.pmem() {
            let id = match &p.id {
                Some(id) => id.clone(),
                None => loop {
                    let id = format!("{PMEM_PREFIX}{next}");
                    next += 1;
                    if used.insert(id.clone()) {
                        break id;
                    }
                },
            };
            ids.push(id);
        }
        Ok(ids)
    }
}

/// Checks one pmem device's file; returns what it learnt and the file's
/// identity (device, inode).
fn check_pmem(cfg: &PmemConfig, id: &str) -> Result<(ValidatedPmem, (u64, u64))> {
    let path = &cfg.file;
    let open_err = |source| ValidationError::PmemOpen {
        id: id.to_owned(),
        path: path.clone(),
        source,
    };
    // O_NONBLOCK: a FIFO must not block the open (and the API thread
    // with it, vmm.ping included); fstat then refuses it. Only reads of a
    // regular file follow, which O_NONBLOCK does not affect.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(open_err)?;
    let meta = file.metadata().map_err(open_err)?;
    if !meta.is_file() {
        return Err(ValidationError::PmemNotFile {
            id: id.to_owned(),
            path: path.clone(),
        });
    }
    let key = (meta.dev(), meta.ino());
    let is_pcow = pcow::is_pcow(&file).map_err(open_err)?;
    drop(file);
    let (format, size) = if is_pcow {
        let opts = pcow::OpenOptions {
            force_share: true,
            ..pcow::OpenOptions::default()
        };
        let img = pcow::Image::open(path, opts).map_err(|source| ValidationError::PcowOpen {
            id: id.to_owned(),
            path: path.clone(),
            source: Box::new(source),
        })?;
        let vs = img.virtual_size();
        drop(img);
        if vs == 0 || !vs.is_multiple_of(PMEM_ALIGN) {
            return Err(ValidationError::PcowVirtualSize {
                id: id.to_owned(),
                path: path.clone(),
                size: vs,
            });
        }
        if let Some(size) = cfg.size.filter(|s| *s != vs) {
            return Err(ValidationError::PcowSizeMismatch {
                id: id.to_owned(),
                path: path.clone(),
                size,
                virtual_size: vs,
            });
        }
        (PmemFormat::Pcow, vs)
    } else {
        let len = meta.len();
        let size = cfg.size.unwrap_or(len);
        if size > len {
            return Err(ValidationError::RawSizeBeyondFile {
                id: id.to_owned(),
                path: path.clone(),
                size,
                len,
            });
        }
        if size == 0 || !size.is_multiple_of(PMEM_ALIGN) {
            return Err(ValidationError::RawSize {
                id: id.to_owned(),
                path: path.clone(),
                size,
            });
        }
        (PmemFormat::Raw, size)
    };
    Ok((
        ValidatedPmem {
            id: id.to_owned(),
            file: path.clone(),
            format,
            size,
        },
        key,
    ))
}
