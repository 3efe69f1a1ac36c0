//! `VmConfig` and its parts, with Cloud Hypervisor's JSON field names and
//! defaults, and the parsers that build them from command-line options.
//!
//! Every struct is `deny_unknown_fields`. Fields upstream has and we do not
//! support are still declared (so that a config upstream wrote or echoes
//! parses), and [`VmConfig::validate`](super::VmConfig::validate) accepts
//! them only at upstream's default value.

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

fn default_true() -> bool {
    true
}

fn default_max_phys_bits() -> u8 {
    DEFAULT_MAX_PHYS_BITS
}

/// What the guest boots: upstream's `PayloadConfig`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PayloadConfig {
    /// Firmware image (not supported: must be absent).
    #[serde(default)]
    pub firmware: Option<PathBuf>,
    /// Kernel: a bzImage or an ELF vmlinux with a PVH note.
    #[serde(default)]
    pub kernel: Option<PathBuf>,
    /// Kernel command line.
    #[serde(default)]
    pub cmdline: Option<String>,
    /// Initial ramdisk.
    #[serde(default)]
    pub initramfs: Option<PathBuf>,
    /// IGVM file (upstream feature; not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub igvm: Option<Value>,
    /// SEV-SNP host data (upstream feature; not supported: must be absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_data: Option<Value>,
}

/// Upstream's `CpuFeatures`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuFeatures {
    /// AMX (not supported: must be false).
    #[serde(default)]
    pub amx: bool,
}

/// vCPUs: upstream's `CpusConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpusConfig {
    /// vCPUs started at boot.
    pub boot_vcpus: u8,
    /// vCPUs the guest may have (no CPU hot-plug yet: validation requires
    /// `max_vcpus == boot_vcpus`).
    pub max_vcpus: u8,
    /// Topology (not supported: must be absent).
    #[serde(default)]
    pub topology: Option<Value>,
    /// Hyper-V enlightenments (not supported: must be false).
    #[serde(default)]
    pub kvm_hyperv: bool,
    /// Physical address bits advertised (only upstream's default, 46).
    #[serde(default = "default_max_phys_bits")]
    pub max_phys_bits: u8,
    /// vCPU affinity (not supported: must be absent or empty).
    #[serde(default)]
    pub affinity: Option<Value>,
    /// CPU features.
    #[serde(default)]
    pub features: CpuFeatures,
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
        }
    }
}

impl CpusConfig {
    /// The `--cpus` syntax.
    pub const SYNTAX: &'static str = "boot=<boot_vcpus>,max=<max_vcpus>";

    /// Parses a `--cpus` value: `boot=N[,max=M]`, 1 <= N <= M <= 254.
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("cpus", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add("boot").add("max");
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
            return Err(err(ParseError::InvalidValue {
                key: "max".into(),
                value: max.to_string(),
                expected: format!("at least boot ({boot})"),
            }));
        }
        Ok(CpusConfig {
            boot_vcpus: boot,
            max_vcpus: max,
            ..Self::default()
        })
    }
}

/// Guest RAM: upstream's `MemoryConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// RAM size in bytes.
    pub size: u64,
    /// KSM merging (not supported: must be false).
    #[serde(default)]
    pub mergeable: bool,
    /// Hot-plug method (only upstream's default, `Acpi`, without hot-plug).
    #[serde(default = "default_hotplug_method")]
    pub hotplug_method: String,
    /// Hot-plug size (not supported: must be absent).
    #[serde(default)]
    pub hotplug_size: Option<u64>,
    /// Hot-plugged size (not supported: must be absent).
    #[serde(default)]
    pub hotplugged_size: Option<u64>,
    /// Shared mapping (not supported: must be false).
    #[serde(default)]
    pub shared: bool,
    /// Huge pages (not supported: must be false).
    #[serde(default)]
    pub hugepages: bool,
    /// Huge page size (not supported: must be absent).
    #[serde(default)]
    pub hugepage_size: Option<u64>,
    /// Prefault (not supported: must be false).
    #[serde(default)]
    pub prefault: bool,
    /// Memory zones (not supported: must be absent or empty).
    #[serde(default)]
    pub zones: Option<Value>,
    /// Transparent huge pages (only upstream's default, true).
    #[serde(default = "default_true")]
    pub thp: bool,
}

fn default_hotplug_method() -> String {
    "Acpi".to_owned()
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            size: DEFAULT_MEMORY_SIZE,
            mergeable: false,
            hotplug_method: default_hotplug_method(),
            hotplug_size: None,
            hotplugged_size: None,
            shared: false,
            hugepages: false,
            hugepage_size: None,
            prefault: false,
            zones: None,
            thp: true,
        }
    }
}

impl MemoryConfig {
    /// The `--memory` syntax.
    pub const SYNTAX: &'static str = "size=<guest_memory_size>";

    /// Parses a `--memory` value: `size=SIZE` (default 512M when absent).
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("memory", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add("size");
        p.parse(s).map_err(err)?;
        let size = p.size("size").map_err(err)?.unwrap_or(DEFAULT_MEMORY_SIZE);
        if size == 0 {
            return Err(err(ParseError::InvalidValue {
                key: "size".into(),
                value: p.get("size").unwrap_or_default().to_owned(),
                expected: "a size greater than 0".into(),
            }));
        }
        Ok(MemoryConfig {
            size,
            ..Self::default()
        })
    }
}

/// One virtio-pmem device: upstream's `PmemConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemConfig {
    /// Backing file: a pcow image (recognised by its magic) or a raw file.
    pub file: PathBuf,
    /// Device size in bytes; absent: the file's size (raw) or the image's
    /// virtual size (pcow).
    #[serde(default)]
    pub size: Option<u64>,
    /// Behind a virtual IOMMU (not supported: must be false).
    #[serde(default)]
    pub iommu: bool,
    /// Guest writes are not written back to the file.
    #[serde(default)]
    pub discard_writes: bool,
    /// Device id; absent: `_pmemN` is assigned by validation.
    #[serde(default)]
    pub id: Option<String>,
    /// PCI segment (only segment 0 exists).
    #[serde(default)]
    pub pci_segment: u16,
}

impl PmemConfig {
    /// The `--pmem` syntax.
    pub const SYNTAX: &'static str = "file=<backing_file_path>,size=<persistent_memory_size>,\
                                      iommu=on|off,discard_writes=on|off,id=<device_id>,\
                                      pci_segment=<segment_id>";

    /// Parses one `--pmem` value.
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("pmem", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add("file")
            .add("size")
            .add("iommu")
            .add("discard_writes")
            .add("id")
            .add("pci_segment");
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
        Ok(PmemConfig {
            file,
            size,
            iommu,
            discard_writes,
            id,
            pci_segment,
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

/// The serial port or the virtio console: upstream's `ConsoleConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleConfig {
    /// Output file, with mode `File`; with `Pty`, the terminal's path
    /// once the VM has booted.
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// Output mode.
    pub mode: ConsoleOutputMode,
    /// Behind a virtual IOMMU (not supported: must be false).
    #[serde(default)]
    pub iommu: bool,
    /// Listening Unix socket, with mode `Socket` (serial port only).
    #[serde(default)]
    pub socket: Option<PathBuf>,
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
            iommu: false,
            socket: None,
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
#[serde(deny_unknown_fields)]
pub struct RngConfig {
    /// Entropy source, opened at boot (a file or a character device).
    pub src: PathBuf,
    /// Behind a virtual IOMMU (not supported: must be false).
    #[serde(default)]
    pub iommu: bool,
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
        Ok(RngConfig { src, iommu })
    }
}

impl Default for RngConfig {
    fn default() -> Self {
        RngConfig {
            src: PathBuf::from("/dev/urandom"),
            iommu: false,
        }
    }
}

/// The whole VM: upstream's `VmConfig`, the body of `vm.create` and the
/// `config` of `vm.info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// vCPUs.
    #[serde(default)]
    pub cpus: CpusConfig,
    /// Guest RAM.
    #[serde(default)]
    pub memory: MemoryConfig,
    /// Kernel, initramfs, command line.
    #[serde(default)]
    pub payload: Option<PayloadConfig>,
    /// virtio-pmem devices.
    #[serde(default)]
    pub pmem: Option<Vec<PmemConfig>>,
    /// The 8250 serial port on 0x3f8.
    #[serde(default = "ConsoleConfig::default_serial")]
    pub serial: ConsoleConfig,
    /// The virtio console.
    #[serde(default = "ConsoleConfig::default_console")]
    pub console: ConsoleConfig,
    /// Rate-limit groups (not supported: absent or empty).
    #[serde(default)]
    pub rate_limit_groups: Option<Value>,
    /// Block devices (not supported: absent or empty).
    #[serde(default)]
    pub disks: Option<Value>,
    /// Network devices (not supported: absent or empty).
    #[serde(default)]
    pub net: Option<Value>,
    /// virtio-rng (not supported: only upstream's default).
    #[serde(default)]
    pub rng: RngConfig,
    /// Balloon (not supported: absent).
    #[serde(default)]
    pub balloon: Option<Value>,
    /// virtio-fs (not supported: absent or empty).
    #[serde(default)]
    pub fs: Option<Value>,
    /// Debug console on port 0xe9 (not supported: absent or mode `Off`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debug_console: Option<Value>,
    /// VFIO devices (not supported: absent or empty).
    #[serde(default)]
    pub devices: Option<Value>,
    /// vhost-user devices (not supported: absent or empty).
    #[serde(default)]
    pub user_devices: Option<Value>,
    /// vDPA devices (not supported: absent or empty).
    #[serde(default)]
    pub vdpa: Option<Value>,
    /// vsock (not supported: absent).
    #[serde(default)]
    pub vsock: Option<Value>,
    /// pvpanic (not supported: false).
    #[serde(default)]
    pub pvpanic: bool,
    /// Virtual IOMMU (not supported: false).
    #[serde(default)]
    pub iommu: bool,
    /// SGX EPC (not supported: absent or empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sgx_epc: Option<Value>,
    /// NUMA (not supported: absent or empty).
    #[serde(default)]
    pub numa: Option<Value>,
    /// Watchdog (not supported: false).
    #[serde(default)]
    pub watchdog: bool,
    /// GDB stub (not supported: false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gdb: bool,
    /// PCI segments (not supported: absent or empty).
    #[serde(default)]
    pub pci_segments: Option<Value>,
    /// Platform (not supported: absent).
    #[serde(default)]
    pub platform: Option<Value>,
    /// TPM (not supported: absent).
    #[serde(default)]
    pub tpm: Option<Value>,
    /// Landlock sandboxing (not supported: false).
    #[serde(default)]
    pub landlock_enable: bool,
    /// Landlock rules (not supported: absent or empty).
    #[serde(default)]
    pub landlock_rules: Option<Value>,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            cpus: CpusConfig::default(),
            memory: MemoryConfig::default(),
            payload: None,
            pmem: None,
            serial: ConsoleConfig::default_serial(),
            console: ConsoleConfig::default_console(),
            rate_limit_groups: None,
            disks: None,
            net: None,
            rng: RngConfig::default(),
            balloon: None,
            fs: None,
            debug_console: None,
            devices: None,
            user_devices: None,
            vdpa: None,
            vsock: None,
            pvpanic: false,
            iommu: false,
            sgx_epc: None,
            numa: None,
            watchdog: false,
            gdb: false,
            pci_segments: None,
            platform: None,
            tpm: None,
            landlock_enable: false,
            landlock_rules: None,
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
