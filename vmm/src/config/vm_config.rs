//! `VmConfig` and its parts, with Cloud Hypervisor's JSON field names,
//! defaults, key order and serde attributes (upstream v54), and the parsers
//! that build them from command-line options.
//!
//! As upstream, unknown JSON fields are ignored ([`super::from_json`] logs
//! each one), keys whose value is `None` are left out when serializing, and
//! so is `iommu: false` on PCI devices. Fields upstream has and we do not
//! support are declared (so that a config upstream wrote or echoes parses
//! and round-trips), and [`VmConfig::validate`](super::VmConfig::validate)
//! accepts them only at upstream's default value or at a value that
//! describes what this VMM does anyway. Devices this VMM does not have are
//! kept as raw JSON ([`Value`]): any non-empty value is refused.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::option_parser::OptionParser;
use super::{OptionError, ParseError};

/// Upstream's default number of vCPUs.
pub const DEFAULT_VCPUS: u8 = 1;
/// Upstream's default guest RAM (512 MiB).
pub const DEFAULT_MEMORY_SIZE: u64 = 512 << 20;
/// Upstream's default `max_phys_bits`.
pub const DEFAULT_MAX_PHYS_BITS: u8 = 46;
/// Largest vCPU count accepted (`boot` and `max`).
pub const MAX_VCPUS: u8 = 254;
/// Upstream's default debug-console I/O port.
pub const DEFAULT_DEBUG_CONSOLE_PORT: u16 = 0xe9;

fn default_true() -> bool {
    true
}

fn default_max_phys_bits() -> u8 {
    DEFAULT_MAX_PHYS_BITS
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// What the guest boots: upstream's `PayloadConfig`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayloadConfig {
    /// Firmware image (not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<PathBuf>,
    /// Kernel: a bzImage or an ELF vmlinux with a PVH note.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// Kernel command line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    /// Initial ramdisk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<PathBuf>,
    /// IGVM file (upstream's `igvm` build feature; not supported: must be
    /// absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub igvm: Option<Value>,
    /// SEV-SNP host data (upstream's `sev_snp` build feature; not
    /// supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_data: Option<Value>,
    /// fw_cfg items (upstream's `fw_cfg` build feature; not supported: must
    /// be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fw_cfg_config: Option<Value>,
}

/// Upstream's `CpuFeatures`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuFeatures {
    /// AMX (not supported: must be false).
    #[serde(default)]
    pub amx: bool,
}

/// Upstream's `CpuTopology`: `threads_per_core:cores_per_die:dies_per_package:packages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuTopology {
    /// Threads per core.
    pub threads_per_core: u16,
    /// Cores per die.
    pub cores_per_die: u16,
    /// Dies per package.
    pub dies_per_package: u16,
    /// Packages (sockets).
    pub packages: u16,
}

/// Upstream's `CpuAffinity`: the host CPUs one vCPU may run on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuAffinity {
    /// The vCPU.
    pub vcpu: u32,
    /// Host CPUs.
    pub host_cpus: Vec<usize>,
}

/// Upstream's `CoreScheduling`: which vCPU threads share a core-scheduling
/// cookie.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CoreScheduling {
    /// One cookie for the whole VM (upstream's default).
    #[default]
    Vm,
    /// One cookie per vCPU.
    Vcpu,
    /// No cookie.
    Off,
}

/// Upstream's `CpuProfile` (only `Host` exists).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CpuProfile {
    /// The host's CPUID as KVM supports it.
    #[default]
    Host,
}

/// vCPUs: upstream's `CpusConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpusConfig {
    /// vCPUs started at boot.
    pub boot_vcpus: u8,
    /// vCPUs the guest may have; kept in the config, but there is no vCPU
    /// hot-plug: the guest gets `boot_vcpus`.
    pub max_vcpus: u8,
    /// Topology (accepted only as the flat one this VMM gives: one thread
    /// per core, `boot_vcpus` cores, one die, one package).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<CpuTopology>,
    /// Hyper-V enlightenments (not supported: must be false).
    #[serde(default)]
    pub kvm_hyperv: bool,
    /// Physical address bits advertised (only upstream's default, 46).
    #[serde(default = "default_max_phys_bits")]
    pub max_phys_bits: u8,
    /// vCPU affinity (not supported: must be absent or empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Vec<CpuAffinity>>,
    /// CPU features.
    #[serde(default)]
    pub features: CpuFeatures,
    /// Nested virtualization (true: the guest sees VMX/SVM when KVM offers
    /// it, which is what this VMM does; false is not supported).
    #[serde(default = "default_true")]
    pub nested: bool,
    /// Core scheduling (`Vm` and `Off` accepted: this VMM sets no cookie).
    #[serde(default)]
    pub core_scheduling: CoreScheduling,
    /// CPU profile.
    #[serde(default)]
    pub profile: CpuProfile,
}

impl Default for CpusConfig {
    fn default() -> Self {
        CpusConfig {
            boot_vcpus: DEFAULT_VCPUS,
            max_vcpus: DEFAULT_VCPUS,
            topology: None,
            kvm_hyperv: false,
            max_phys_bits: DEFAULT_MAX_PHYS_BITS,
            affinity: None,
            features: CpuFeatures::default(),
            nested: true,
            core_scheduling: CoreScheduling::Vm,
            profile: CpuProfile::Host,
        }
    }
}

impl CpusConfig {
    /// The `--cpus` syntax (upstream's keys).
    pub const SYNTAX: &'static str = "boot=<boot_vcpus>,max=<max_vcpus>,\
        topology=<threads_per_core>:<cores_per_die>:<dies_per_package>:<packages>,\
        kvm_hyperv=on|off,max_phys_bits=<maximum_number_of_physical_bits>,\
        affinity=<list_of_vcpus_with_their_associated_cpuset>,\
        features=<list_of_features_to_enable>,nested=on|off,\
        core_scheduling=vm|vcpu|off,profile=Host";

    /// Parses a `--cpus` value: `boot=N[,max=M]`, 1 <= N <= M <= 254, and
    /// upstream's other keys (checked against what this VMM can do by
    /// validation).
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("cpus", s, Self::SYNTAX, kind);
        let invalid = |key: &str, value: &str, expected: &str| {
            err(ParseError::InvalidValue {
                key: key.to_owned(),
                value: value.to_owned(),
                expected: expected.to_owned(),
            })
        };
        let mut p = OptionParser::new();
        p.add("boot")
            .add("max")
            .add("topology")
            .add("kvm_hyperv")
            .add("max_phys_bits")
            .add("affinity")
            .add("features")
            .add("nested")
            .add("core_scheduling")
            .add("profile");
        p.parse(s).map_err(err)?;
        const EXPECTED: &str = "an integer from 1 to 254";
        let count = |key: &str| -> Result<Option<u8>, ParseError> {
            let v = p.convert::<u8>(key, EXPECTED)?;
            match v {
                Some(n) if n == 0 || n > MAX_VCPUS => Err(ParseError::InvalidValue {
                    key: key.to_owned(),
                    value: p.get(key).unwrap_or_default().to_owned(),
                    expected: EXPECTED.to_owned(),
                }),
                v => Ok(v),
            }
        };
        let boot = count("boot").map_err(err)?.unwrap_or(DEFAULT_VCPUS);
        let max = count("max").map_err(err)?.unwrap_or(boot);
        if max < boot {
            return Err(invalid(
                "max",
                &max.to_string(),
                &format!("at least boot ({boot})"),
            ));
        }
        let topology = match p.get("topology") {
            None => None,
            Some(t) => Some(CpuTopology::parse(t).ok_or_else(|| {
                invalid(
                    "topology",
                    t,
                    "four integers from 0 to 65535 separated by `:` (threads_per_core:\
                     cores_per_die:dies_per_package:packages)",
                )
            })?),
        };
        let kvm_hyperv = p.toggle("kvm_hyperv").map_err(err)?.unwrap_or(false);
        let max_phys_bits = p
            .convert::<u8>("max_phys_bits", "an integer from 0 to 255")
            .map_err(err)?
            .unwrap_or(DEFAULT_MAX_PHYS_BITS);
        let affinity = match p.get("affinity") {
            None => None,
            Some(a) => Some(parse_affinity(a).map_err(|item| {
                invalid(
                    "affinity",
                    &item,
                    "[<vcpu>@[<host_cpu>,<first>-<last>,...],...]",
                )
            })?),
        };
        let mut features = CpuFeatures::default();
        if let Some(f) = p.get("features") {
            for name in super::option_parser::string_list(f).map_err(err)? {
                match name.as_str() {
                    "amx" => features.amx = true,
                    _ => return Err(invalid("features", &name, "amx")),
                }
            }
        }
        let nested = p.toggle("nested").map_err(err)?.unwrap_or(true);
        let core_scheduling = match p.get("core_scheduling") {
            None => CoreScheduling::Vm,
            Some(v) => match v.to_ascii_lowercase().as_str() {
                "vm" => CoreScheduling::Vm,
                "vcpu" => CoreScheduling::Vcpu,
                "off" => CoreScheduling::Off,
                _ => return Err(invalid("core_scheduling", v, "vm, vcpu or off")),
            },
        };
        let profile = match p.get("profile") {
            None | Some("Host") => CpuProfile::Host,
            Some(v) => return Err(invalid("profile", v, "Host")),
        };
        Ok(CpusConfig {
            boot_vcpus: boot,
            max_vcpus: max,
            topology,
            kvm_hyperv,
            max_phys_bits,
            affinity,
            features,
            nested,
            core_scheduling,
            profile,
        })
    }
}

impl CpuTopology {
    /// `a:b:c:d`, each a u16.
    fn parse(s: &str) -> Option<Self> {
        let parts: Vec<u16> = s
            .split(':')
            .map(|p| p.trim().parse().ok())
            .collect::<Option<_>>()?;
        match parts[..] {
            [threads_per_core, cores_per_die, dies_per_package, packages] => Some(CpuTopology {
                threads_per_core,
                cores_per_die,
                dies_per_package,
                packages,
            }),
            _ => None,
        }
    }
}

/// `[0@[0,2],1@[1-3]]`; the error is the offending item.
fn parse_affinity(s: &str) -> Result<Vec<CpuAffinity>, String> {
    super::option_parser::tuple_list(s)?
        .into_iter()
        .map(|(vcpu, cpus)| {
            let vcpu = vcpu.trim().parse::<u32>().map_err(|_| vcpu.clone())?;
            let host_cpus = super::option_parser::integer_list(&cpus)?
                .into_iter()
                .map(|c| usize::try_from(c).map_err(|_| c.to_string()))
                .collect::<Result<_, _>>()?;
            Ok(CpuAffinity { vcpu, host_cpus })
        })
        .collect()
}

/// Upstream's `HotplugMethod`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum HotplugMethod {
    /// ACPI memory hot-plug (upstream's default).
    #[default]
    Acpi,
    /// virtio-mem.
    VirtioMem,
}

/// Guest RAM: upstream's `MemoryConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryConfig {
    /// RAM size in bytes.
    pub size: u64,
    /// KSM merging (not supported: must be false).
    #[serde(default)]
    pub mergeable: bool,
    /// Hot-plug method (irrelevant without `hotplug_size`).
    #[serde(default)]
    pub hotplug_method: HotplugMethod,
    /// Hot-plug size (not supported: must be absent or 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotplug_size: Option<u64>,
    /// Hot-plugged size (not supported: must be absent or 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotplugged_size: Option<u64>,
    /// Shared mapping (not supported: must be false).
    #[serde(default)]
    pub shared: bool,
    /// Huge pages (not supported: must be false).
    #[serde(default)]
    pub hugepages: bool,
    /// Huge page size (not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugepage_size: Option<u64>,
    /// Prefault (not supported: must be false).
    #[serde(default)]
    pub prefault: bool,
    /// Map RAM without `MAP_NORESERVE` (not supported: must be false; RAM
    /// is mapped with `MAP_NORESERVE`, upstream's default).
    #[serde(default)]
    pub reserve: bool,
    /// Memory zones (not supported: must be absent or empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zones: Option<Value>,
    /// Transparent huge pages: upstream advises THP on guest RAM when true.
    /// This VMM never does (the host's THP policy applies), so both values
    /// are accepted.
    #[serde(default = "default_true")]
    pub thp: bool,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            size: DEFAULT_MEMORY_SIZE,
            mergeable: false,
            hotplug_method: HotplugMethod::Acpi,
            hotplug_size: None,
            hotplugged_size: None,
            shared: false,
            hugepages: false,
            hugepage_size: None,
            prefault: false,
            reserve: false,
            zones: None,
            thp: true,
        }
    }
}

impl MemoryConfig {
    /// The `--memory` syntax (upstream's keys).
    pub const SYNTAX: &'static str = "size=<guest_memory_size>,mergeable=on|off,shared=on|off,\
        hugepages=on|off,hugepage_size=<hugepage_size>,hotplug_method=acpi|virtio-mem,\
        hotplug_size=<hotpluggable_memory_size>,hotplugged_size=<hotplugged_memory_size>,\
        prefault=on|off,reserve=on|off,thp=on|off";

    /// Parses a `--memory` value: `size=SIZE` (default 512M when absent)
    /// and upstream's other keys. `file=` is accepted and ignored, as
    /// upstream does.
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("memory", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add("size")
            .add("file")
            .add("mergeable")
            .add("hotplug_method")
            .add("hotplug_size")
            .add("hotplugged_size")
            .add("shared")
            .add("hugepages")
            .add("hugepage_size")
            .add("prefault")
            .add("reserve")
            .add("thp");
        p.parse(s).map_err(err)?;
        let size = p.size("size").map_err(err)?.unwrap_or(DEFAULT_MEMORY_SIZE);
        if size == 0 {
            return Err(err(ParseError::InvalidValue {
                key: "size".into(),
                value: p.get("size").unwrap_or_default().to_owned(),
                expected: "a size greater than 0".into(),
            }));
        }
        let flag = |key: &str| p.toggle(key).map(Option::unwrap_or_default);
        let hotplug_method = match p.get("hotplug_method") {
            None => HotplugMethod::Acpi,
            Some(v) => match v.to_ascii_lowercase().as_str() {
                "acpi" => HotplugMethod::Acpi,
                "virtio-mem" => HotplugMethod::VirtioMem,
                _ => {
                    return Err(err(ParseError::InvalidValue {
                        key: "hotplug_method".into(),
                        value: v.to_owned(),
                        expected: "acpi or virtio-mem".into(),
                    }))
                }
            },
        };
        Ok(MemoryConfig {
            size,
            mergeable: flag("mergeable").map_err(err)?,
            hotplug_method,
            hotplug_size: p.size("hotplug_size").map_err(err)?,
            hotplugged_size: p.size("hotplugged_size").map_err(err)?,
            shared: flag("shared").map_err(err)?,
            hugepages: flag("hugepages").map_err(err)?,
            hugepage_size: p.size("hugepage_size").map_err(err)?,
            prefault: flag("prefault").map_err(err)?,
            reserve: flag("reserve").map_err(err)?,
            zones: None,
            thp: p.toggle("thp").map_err(err)?.unwrap_or(true),
        })
    }
}

/// One virtio-pmem device: upstream's `PmemConfig` (its
/// `PciDeviceCommonConfig` fields first, as upstream's flattening puts
/// them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PmemConfig {
    /// Device id; absent: `_pmemN` is assigned by validation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Behind a virtual IOMMU (not supported: must be false).
    #[serde(default, skip_serializing_if = "is_false")]
    pub iommu: bool,
    /// PCI segment (only segment 0 exists).
    #[serde(default)]
    pub pci_segment: u16,
    /// PCI slot asked for (not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_device_id: Option<u8>,
    /// Backing file: a pcow image (recognised by its magic) or a raw file.
    pub file: PathBuf,
    /// Device size in bytes; absent: the file's size (raw) or the image's
    /// virtual size (pcow).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Guest writes are not written back to the file.
    #[serde(default)]
    pub discard_writes: bool,
}

impl PmemConfig {
    /// The `--pmem` syntax.
    pub const SYNTAX: &'static str = "file=<backing_file_path>,size=<persistent_memory_size>,\
                                      iommu=on|off,discard_writes=on|off,id=<device_id>,\
                                      pci_segment=<segment_id>,pci_device_id=<pci_slot>";

    /// Parses one `--pmem` value.
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("pmem", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add("file")
            .add("size")
            .add("iommu")
            .add("discard_writes")
            .add("id")
            .add("pci_segment")
            .add("pci_device_id");
        p.parse(s).map_err(err)?;
        let file = PathBuf::from(p.require("file").map_err(err)?);
        let size = p.size("size").map_err(err)?;
        if size == Some(0) {
            return Err(err(ParseError::InvalidValue {
                key: "size".into(),
                value: p.get("size").unwrap_or_default().to_owned(),
                expected: "a size greater than 0".into(),
            }));
        }
        let iommu = p.toggle("iommu").map_err(err)?.unwrap_or(false);
        let discard_writes = p.toggle("discard_writes").map_err(err)?.unwrap_or(false);
        let id = match p.get("id") {
            Some("") => {
                return Err(err(ParseError::MissingValue { key: "id".into() }));
            }
            id => id.map(str::to_owned),
        };
        let pci_segment = p
            .convert::<u16>("pci_segment", "an integer from 0 to 65535")
            .map_err(err)?
            .unwrap_or(0);
        let pci_device_id = p
            .convert::<u8>("pci_device_id", "a PCI slot number from 0 to 31")
            .map_err(err)?;
        if let Some(slot) = pci_device_id.filter(|s| *s > 31) {
            return Err(err(ParseError::InvalidValue {
                key: "pci_device_id".into(),
                value: slot.to_string(),
                expected: "a PCI slot number from 0 to 31".into(),
            }));
        }
        Ok(PmemConfig {
            id,
            iommu,
            pci_segment,
            pci_device_id,
            file,
            size,
            discard_writes,
        })
    }
}

/// Where a console's output goes: upstream's `ConsoleOutputMode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConsoleOutputMode {
    /// No device.
    Off,
    /// A new pseudo-terminal; its path goes into `file`.
    Pty,
    /// The VMM's standard input and output.
    Tty,
    /// Output to a file.
    File,
    /// A Unix socket (serial port only): one client at a time gets its
    /// input and output.
    Socket,
    /// Device present, output discarded.
    Null,
}

/// The serial port or the virtio console: upstream's `SerialConfig`
/// (`file`, `mode`, `socket`) and `ConsoleConfig` (the same, then its
/// `PciDeviceCommonConfig` fields). [`VmConfig`] serializes the serial
/// port without the PCI fields, as upstream (v52 on) does; on the serial
/// port they are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleConfig {
    /// Output file, with mode `File`; with `Pty`, the terminal's path
    /// once the VM has booted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// Output mode.
    pub mode: ConsoleOutputMode,
    /// Unix socket, with mode `Socket`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    /// Device id (virtio console only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Behind a virtual IOMMU (virtio console only; not supported: must be
    /// false).
    #[serde(default, skip_serializing_if = "is_false")]
    pub iommu: bool,
    /// PCI segment (virtio console only; only segment 0 exists).
    #[serde(default)]
    pub pci_segment: u16,
    /// PCI slot asked for (virtio console only; not supported: must be
    /// absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_device_id: Option<u8>,
}

impl ConsoleConfig {
    /// The `--serial` syntax.
    pub const SERIAL_SYNTAX: &'static str =
        "off|null|pty|tty|file=</path/to/a/file>|socket=</path/to/a/socket>";
    /// The `--console` syntax.
    pub const CONSOLE_SYNTAX: &'static str = "off|null|pty|tty|file=</path/to/a/file>";

    /// A config with `mode` and nothing else.
    pub fn with_mode(mode: ConsoleOutputMode) -> Self {
        ConsoleConfig {
            file: None,
            mode,
            socket: None,
            id: None,
            iommu: false,
            pci_segment: 0,
            pci_device_id: None,
        }
    }

    /// Upstream's default serial port: `Null`.
    pub fn default_serial() -> Self {
        Self::with_mode(ConsoleOutputMode::Null)
    }

    /// Upstream's default virtio console: `Tty`.
    pub fn default_console() -> Self {
        Self::with_mode(ConsoleOutputMode::Tty)
    }

    /// Parses a `--serial` value.
    pub fn parse_serial(s: &str) -> Result<Self, OptionError> {
        Self::parse(s, "serial", Self::SERIAL_SYNTAX, true)
    }

    /// Parses a `--console` value (no `socket=`: upstream's virtio console
    /// has none).
    pub fn parse_console(s: &str) -> Result<Self, OptionError> {
        Self::parse(s, "console", Self::CONSOLE_SYNTAX, false)
    }

    fn parse(
        s: &str,
        option: &'static str,
        syntax: &'static str,
        socket: bool,
    ) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new(option, s, syntax, kind);
        let mut p = OptionParser::new();
        p.add_valueless("off")
            .add_valueless("pty")
            .add_valueless("tty")
            .add_valueless("null")
            .add("file");
        if socket {
            p.add("socket");
        }
        p.parse(s).map_err(err)?;
        let modes = [
            ("off", ConsoleOutputMode::Off),
            ("pty", ConsoleOutputMode::Pty),
            ("tty", ConsoleOutputMode::Tty),
            ("null", ConsoleOutputMode::Null),
            ("file", ConsoleOutputMode::File),
            ("socket", ConsoleOutputMode::Socket),
        ];
        let mut given = modes.iter().filter(|(k, _)| p.is_set(k));
        // Upstream takes the first mode in this order and ignores the rest;
        // two modes are an error here.
        let expected = if socket {
            "off|null|pty|tty|file|socket"
        } else {
            "off|null|pty|tty|file"
        };
        let (key, mode) = given.next().copied().ok_or(err(ParseError::Missing {
            key: expected.into(),
        }))?;
        if let Some((other, _)) = given.next() {
            return Err(err(ParseError::Conflict {
                first: key.into(),
                second: (*other).into(),
            }));
        }
        let file = if mode == ConsoleOutputMode::File {
            Some(PathBuf::from(p.require("file").map_err(err)?))
        } else {
            None
        };
        let socket = if mode == ConsoleOutputMode::Socket {
            Some(PathBuf::from(p.require("socket").map_err(err)?))
        } else {
            None
        };
        Ok(ConsoleConfig {
            file,
            socket,
            ..Self::with_mode(mode)
        })
    }
}

/// The virtio-rng device upstream always gives a guest: upstream's
/// `RngConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngConfig {
    /// Device id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Behind a virtual IOMMU.
    #[serde(default, skip_serializing_if = "is_false")]
    pub iommu: bool,
    /// PCI segment.
    #[serde(default)]
    pub pci_segment: u16,
    /// PCI slot asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_device_id: Option<u8>,
    /// Entropy source.
    pub src: PathBuf,
}

impl RngConfig {
    /// The `--rng` syntax.
    pub const SYNTAX: &'static str = "src=<entropy_source_path>,iommu=on|off";

    /// Parses a `--rng` value (`src` defaults to `/dev/urandom`).
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("rng", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add("src").add("iommu");
        p.parse(s).map_err(err)?;
        let src = match p.get("src") {
            Some("") => return Err(err(ParseError::MissingValue { key: "src".into() })),
            Some(v) => PathBuf::from(v),
            None => Self::default().src,
        };
        let iommu = p.toggle("iommu").map_err(err)?.unwrap_or(false);
        Ok(RngConfig {
            src,
            iommu,
            ..Self::default()
        })
    }
}

impl Default for RngConfig {
    fn default() -> Self {
        RngConfig {
            id: None,
            iommu: false,
            pci_segment: 0,
            pci_device_id: None,
            src: PathBuf::from("/dev/urandom"),
        }
    }
}

/// Upstream's `DebugConsoleConfig`: the debug port (0xe9 by default).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DebugConsoleConfig {
    /// Output file, with mode `File`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// Output mode (only `Off` is supported: there is no debug port).
    pub mode: ConsoleOutputMode,
    /// The I/O port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iobase: Option<u16>,
}

impl Default for DebugConsoleConfig {
    fn default() -> Self {
        DebugConsoleConfig {
            file: None,
            mode: ConsoleOutputMode::Off,
            iobase: Some(DEFAULT_DEBUG_CONSOLE_PORT),
        }
    }
}

fn default_num_pci_segments() -> u16 {
    1
}

fn default_iommu_address_width_bits() -> u8 {
    64
}

/// Upstream's `PlatformConfig`. This VMM has one PCI segment, no IOMMU and
/// no SMBIOS tables: only values that describe that are accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlatformConfig {
    /// PCI segments (only 1).
    #[serde(default = "default_num_pci_segments")]
    pub num_pci_segments: u16,
    /// Segments behind the IOMMU (must be absent or empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iommu_segments: Option<Vec<u16>>,
    /// IOMMU address width (no IOMMU: any value describes nothing).
    #[serde(default = "default_iommu_address_width_bits")]
    pub iommu_address_width_bits: u8,
    /// SMBIOS system serial number (not supported: must be absent).
    #[serde(
        default,
        alias = "serial_number",
        skip_serializing_if = "Option::is_none"
    )]
    pub system_serial_number: Option<String>,
    /// SMBIOS system UUID (not supported: must be absent).
    #[serde(default, alias = "uuid", skip_serializing_if = "Option::is_none")]
    pub system_uuid: Option<String>,
    /// SMBIOS OEM strings (not supported: must be absent or empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oem_strings: Option<Vec<String>>,
    /// SMBIOS manufacturer (not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_manufacturer: Option<String>,
    /// SMBIOS product name (not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_product_name: Option<String>,
    /// SMBIOS version (not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_version: Option<String>,
    /// SMBIOS family (not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_family: Option<String>,
    /// SMBIOS SKU number (not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_sku_number: Option<String>,
    /// SMBIOS chassis asset tag (not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chassis_asset_tag: Option<String>,
    /// TDX (upstream's `tdx` build feature; not supported: must be false).
    #[serde(default, skip_serializing_if = "is_false")]
    pub tdx: bool,
    /// SEV-SNP (upstream's `sev_snp` build feature; not supported: must be
    /// false).
    #[serde(default, skip_serializing_if = "is_false")]
    pub sev_snp: bool,
    /// iommufd for VFIO (no VFIO: must be false).
    #[serde(default)]
    pub iommufd: bool,
    /// An inherited iommufd (no VFIO: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iommufd_fd: Option<i32>,
    /// Peer-to-peer DMA between VFIO devices (no VFIO: any value describes
    /// nothing).
    #[serde(default = "default_true")]
    pub vfio_p2p_dma: bool,
}

impl Default for PlatformConfig {
    fn default() -> Self {
        PlatformConfig {
            num_pci_segments: 1,
            iommu_segments: None,
            iommu_address_width_bits: 64,
            system_serial_number: None,
            system_uuid: None,
            oem_strings: None,
            system_manufacturer: None,
            system_product_name: None,
            system_version: None,
            system_family: None,
            system_sku_number: None,
            chassis_asset_tag: None,
            tdx: false,
            sev_snp: false,
            iommufd: false,
            iommufd_fd: None,
            vfio_p2p_dma: true,
        }
    }
}

fn default_aperture_weight() -> u32 {
    1
}

/// Upstream's `PciSegmentConfig` (only segment 0 exists; with one segment
/// the aperture weights describe nothing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciSegmentConfig {
    /// The segment.
    #[serde(default)]
    pub pci_segment: u16,
    /// Its share of the 32-bit MMIO aperture.
    #[serde(default = "default_aperture_weight")]
    pub mmio32_aperture_weight: u32,
    /// Its share of the 64-bit MMIO aperture.
    #[serde(default = "default_aperture_weight")]
    pub mmio64_aperture_weight: u32,
}

/// The serial port as upstream (v52 on) serializes it: no PCI fields.
fn serialize_serial<S: serde::Serializer>(c: &ConsoleConfig, s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Serial<'a> {
        #[serde(skip_serializing_if = "Option::is_none")]
        file: &'a Option<PathBuf>,
        mode: ConsoleOutputMode,
        #[serde(skip_serializing_if = "Option::is_none")]
        socket: &'a Option<PathBuf>,
    }
    Serial {
        file: &c.file,
        mode: c.mode,
        socket: &c.socket,
    }
    .serialize(s)
}

/// The whole VM: upstream's `VmConfig`, the body of `vm.create` and the
/// `config` of `vm.info`, in upstream's key order. Devices this VMM does
/// not have are raw JSON, refused by validation unless absent or empty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmConfig {
    /// vCPUs.
    #[serde(default)]
    pub cpus: CpusConfig,
    /// Guest RAM.
    #[serde(default)]
    pub memory: MemoryConfig,
    /// Kernel, initramfs, command line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<PayloadConfig>,
    /// Rate-limit groups (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit_groups: Option<Value>,
    /// Block devices (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disks: Option<Value>,
    /// Network devices (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<Value>,
    /// virtio-rng.
    #[serde(default)]
    pub rng: RngConfig,
    /// Balloon (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balloon: Option<Value>,
    /// Generic vhost-user devices (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generic_vhost_user: Option<Value>,
    /// virtio-fs (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs: Option<Value>,
    /// virtio-pmem devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pmem: Option<Vec<PmemConfig>>,
    /// The 8250 serial port on 0x3f8.
    #[serde(
        default = "ConsoleConfig::default_serial",
        serialize_with = "serialize_serial"
    )]
    pub serial: ConsoleConfig,
    /// The virtio console.
    #[serde(default = "ConsoleConfig::default_console")]
    pub console: ConsoleConfig,
    /// Debug port (not supported: mode `Off`).
    #[serde(default)]
    pub debug_console: DebugConsoleConfig,
    /// VFIO devices (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Value>,
    /// vhost-user devices (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_devices: Option<Value>,
    /// vDPA devices (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vdpa: Option<Value>,
    /// vsock (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<Value>,
    /// pvmemcontrol (upstream's `pvmemcontrol` build feature; not
    /// supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pvmemcontrol: Option<Value>,
    /// pvpanic (not supported: false).
    #[serde(default)]
    pub pvpanic: bool,
    /// Virtual IOMMU (not supported: false).
    #[serde(default)]
    pub iommu: bool,
    /// NUMA (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<Value>,
    /// Watchdog (not supported: false).
    #[serde(default)]
    pub watchdog: bool,
    /// virtio-rtc (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rtc: Option<Value>,
    /// GDB stub (upstream's `guest_debug` build feature; not supported:
    /// false).
    #[serde(default, skip_serializing_if = "is_false")]
    pub gdb: bool,
    /// PCI segments (only segment 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_segments: Option<Vec<PciSegmentConfig>>,
    /// Platform.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<PlatformConfig>,
    /// TPM (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<Value>,
    /// Landlock confinement of the VMM once the VM's config is known.
    #[serde(default)]
    pub landlock_enable: bool,
    /// Extra Landlock rules: `[{"path": .., "access": "r"|"w"|"rw"}]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub landlock_rules: Option<Value>,
    /// ivshmem (upstream's `ivshmem` build feature; not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ivshmem: Option<Value>,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            cpus: CpusConfig::default(),
            memory: MemoryConfig::default(),
            payload: None,
            rate_limit_groups: None,
            disks: None,
            net: None,
            rng: RngConfig::default(),
            balloon: None,
            generic_vhost_user: None,
            fs: None,
            pmem: None,
            serial: ConsoleConfig::default_serial(),
            console: ConsoleConfig::default_console(),
            debug_console: DebugConsoleConfig::default(),
            devices: None,
            user_devices: None,
            vdpa: None,
            vsock: None,
            pvmemcontrol: None,
            pvpanic: false,
            iommu: false,
            numa: None,
            watchdog: false,
            rtc: None,
            gdb: false,
            pci_segments: None,
            platform: None,
            tpm: None,
            landlock_enable: false,
            landlock_rules: None,
            ivshmem: None,
        }
    }
}

impl VmConfig {
    /// The pmem devices (empty when absent).
    pub fn pmem(&self) -> &[PmemConfig] {
        self.pmem.as_deref().unwrap_or_default()
    }

    /// The payload, created empty when absent.
    pub fn payload_mut(&mut self) -> &mut PayloadConfig {
        self.payload.get_or_insert_with(PayloadConfig::default)
    }
}
