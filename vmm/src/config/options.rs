//! Parsers of upstream's other command-line options: those that fill a
//! [`VmConfig`](super::VmConfig) field this VMM accepts only at values that
//! describe what it does (`--platform`, `--pci-segment`,
//! `--debug-console`), those of devices it does not have (`--disk`,
//! `--net`, ...: syntax-checked against upstream's keys, kept as JSON, then
//! refused by validation naming the field), and the VMM's own options
//! (`--event-monitor`, `--seccomp`, `--log-format`, `--restore`).

use std::path::PathBuf;

use serde_json::{Map, Value};

use super::option_parser::{esc, integer_list, string_list, tuple_list, OptionParser};
use super::vm_config::{
    ConsoleOutputMode, DebugConsoleConfig, PciSegmentConfig, PlatformConfig,
    DEFAULT_DEBUG_CONSOLE_PORT,
};
use super::{OptionError, ParseError};

fn invalid(key: &str, value: &str, expected: &str) -> ParseError {
    ParseError::InvalidValue {
        key: key.to_owned(),
        value: value.to_owned(),
        expected: expected.to_owned(),
    }
}

/// Upstream's keys shared by PCI devices.
const PCI: &[&str] = &["id", "pci_segment", "pci_device_id"];
/// The same with `iommu`.
const PCI_IOMMU: &[&str] = &["id", "iommu", "pci_segment", "pci_device_id"];

/// An option for a device this VMM does not have: its name, upstream's
/// syntax, its own keys (then `extra`, upstream's PCI keys), and whether it
/// may be given several times.
pub struct DeviceOption {
    /// The option, without `--`.
    pub name: &'static str,
    /// Upstream's value syntax.
    pub syntax: &'static str,
    keys: &'static [&'static str],
    extra: &'static [&'static str],
    /// Whether the option may be repeated (and takes several values).
    pub many: bool,
}

/// Upstream's options for devices this VMM does not have.
pub const DEVICE_OPTIONS: &[DeviceOption] = &[
    DeviceOption {
        name: "balloon",
        syntax: "size=<balloon_size>,deflate_on_oom=on|off,free_page_reporting=on|off,\
                 iommu=on|off,id=<device_id>,pci_segment=<segment_id>,pci_device_id=<pci_slot>",
        keys: &["size", "deflate_on_oom", "free_page_reporting"],
        extra: PCI_IOMMU,
        many: false,
    },
    DeviceOption {
        name: "device",
        syntax: "path=<device_path>,fd=<vfio_cdev_fd>,iommu=on|off,id=<device_id>,\
                 pci_segment=<segment_id>,pci_device_id=<pci_slot>,\
                 x_nv_gpudirect_clique=<clique_id>,x_exclude_mmap_bars=[<bar>...]",
        keys: &["path", "fd", "x_nv_gpudirect_clique", "x_exclude_mmap_bars"],
        extra: PCI_IOMMU,
        many: true,
    },
    DeviceOption {
        name: "disk",
        syntax: "path=<disk_image_path>,readonly=on|off,direct=on|off,iommu=on|off,\
                 num_queues=<number_of_queues>,queue_size=<size_of_each_queue>,\
                 vhost_user=on|off,socket=<vhost_user_socket_path>,bw_size=<bytes>,\
                 bw_one_time_burst=<bytes>,bw_refill_time=<ms>,ops_size=<io_ops>,\
                 ops_one_time_burst=<io_ops>,ops_refill_time=<ms>,id=<device_id>,\
                 pci_segment=<segment_id>,pci_device_id=<pci_slot>,\
                 rate_limit_group=<group_id>,queue_affinity=<list_of_queue_indices_with_their_associated_cpuset>,\
                 serial=<serial_number>,backing_files=on|off,sparse=on|off,\
                 image_type=<raw,qcow2,vhd,vhdx>,lock_granularity=byte-range|full",
        keys: &[
            "path",
            "readonly",
            "direct",
            "queue_size",
            "num_queues",
            "vhost_user",
            "socket",
            "bw_size",
            "bw_one_time_burst",
            "bw_refill_time",
            "ops_size",
            "ops_one_time_burst",
            "ops_refill_time",
            "_disable_io_uring",
            "_disable_aio",
            "serial",
            "rate_limit_group",
            "queue_affinity",
            "backing_files",
            "sparse",
            "image_type",
            "lock_granularity",
        ],
        extra: PCI_IOMMU,
        many: true,
    },
    DeviceOption {
        name: "fs",
        syntax: "tag=<tag_name>,socket=<socket_path>,num_queues=<number_of_queues>,\
                 queue_size=<size_of_each_queue>,id=<device_id>,pci_segment=<segment_id>,\
                 pci_device_id=<pci_slot>",
        keys: &["tag", "queue_size", "num_queues", "socket"],
        extra: PCI,
        many: true,
    },
    DeviceOption {
        name: "generic-vhost-user",
        syntax: "device_type=<virtio device type>,socket=<socket_path>,\
                 queue_sizes=<list of queue sizes>,id=<device_id>,pci_segment=<segment_id>,\
                 pci_device_id=<pci_slot>",
        keys: &["device_type", "virtio_id", "queue_sizes", "socket"],
        extra: PCI,
        many: true,
    },
    DeviceOption {
        name: "landlock-rules",
        syntax: "path=<path/to/{file/dir}>,access=[rw]",
        keys: &["path", "access"],
        extra: &[],
        many: true,
    },
    DeviceOption {
        name: "memory-zone",
        syntax: "size=<guest_memory_region_size>,file=<backing_file>,shared=on|off,\
                 hugepages=on|off,hugepage_size=<hugepage_size>,host_numa_node=<node_id>,\
                 id=<zone_identifier>,hotplug_size=<hotpluggable_memory_size>,\
                 hotplugged_size=<hotplugged_memory_size>,prefault=on|off,reserve=on|off,\
                 mergeable=on|off",
        keys: &[
            "id",
            "size",
            "file",
            "shared",
            "hugepages",
            "hugepage_size",
            "host_numa_node",
            "hotplug_size",
            "hotplugged_size",
            "prefault",
            "reserve",
            "mergeable",
        ],
        extra: &[],
        many: true,
    },
    DeviceOption {
        name: "net",
        syntax: "tap=<if_name>,ip=<ip_addr>,mask=<net_mask>,mac=<mac_addr>,fd=<[fd1,fd2,...]>,\
                 iommu=on|off,num_queues=<number_of_queues>,queue_size=<size_of_each_queue>,\
                 id=<device_id>,vhost_user=<vhost_user_enable>,socket=<vhost_user_socket_path>,\
                 vhost_mode=client|server,bw_size=<bytes>,bw_one_time_burst=<bytes>,\
                 bw_refill_time=<ms>,ops_size=<io_ops>,ops_one_time_burst=<io_ops>,\
                 ops_refill_time=<ms>,pci_segment=<segment_id>,pci_device_id=<pci_slot>,\
                 offload_tso=on|off,offload_ufo=on|off,offload_csum=on|off",
        keys: &[
            "tap",
            "ip",
            "mask",
            "mac",
            "host_mac",
            "offload_tso",
            "offload_ufo",
            "offload_csum",
            "mtu",
            "queue_size",
            "num_queues",
            "vhost_user",
            "socket",
            "vhost_mode",
            "fd",
            "bw_size",
            "bw_one_time_burst",
            "bw_refill_time",
            "ops_size",
            "ops_one_time_burst",
            "ops_refill_time",
        ],
        extra: PCI_IOMMU,
        many: true,
    },
    DeviceOption {
        name: "numa",
        syntax: "guest_numa_id=<node_id>,cpus=<cpus_id>,\
                 distances=<list_of_distances_to_destination_nodes>,device_id=<device_id>,\
                 memory_zones=<list_of_memory_zones>,pci_segments=<list_of_pci_segments>",
        keys: &[
            "guest_numa_id",
            "cpus",
            "distances",
            "device_id",
            "memory_zones",
            "pci_segments",
        ],
        extra: &[],
        many: true,
    },
    DeviceOption {
        name: "rate-limit-group",
        syntax: "bw_size=<bytes>,bw_one_time_burst=<bytes>,bw_refill_time=<ms>,\
                 ops_size=<io_ops>,ops_one_time_burst=<io_ops>,ops_refill_time=<ms>,\
                 id=<device_id>",
        keys: &[
            "bw_size",
            "bw_one_time_burst",
            "bw_refill_time",
            "ops_size",
            "ops_one_time_burst",
            "ops_refill_time",
            "id",
        ],
        extra: &[],
        many: true,
    },
    DeviceOption {
        name: "rtc",
        syntax: "[iommu=on|off,id=<device_id>,pci_segment=<segment_id>,pci_device_id=<pci_slot>]",
        keys: &[],
        extra: PCI_IOMMU,
        many: false,
    },
    DeviceOption {
        name: "tpm",
        syntax: "socket=</path/to/a/socket>",
        keys: &["socket"],
        extra: &[],
        many: false,
    },
    DeviceOption {
        name: "user-device",
        syntax: "socket=<socket_path>,id=<device_id>,pci_segment=<segment_id>,\
                 pci_device_id=<pci_slot>",
        keys: &["socket"],
        extra: PCI,
        many: true,
    },
    DeviceOption {
        name: "vdpa",
        syntax: "path=<device_path>,num_queues=<number_of_queues>,iommu=on|off,\
                 id=<device_id>,pci_segment=<segment_id>,pci_device_id=<pci_slot>",
        keys: &["path", "num_queues"],
        extra: PCI_IOMMU,
        many: true,
    },
    DeviceOption {
        name: "vsock",
        syntax: "cid=<context_id>,socket=<socket_path>,iommu=on|off,id=<device_id>,\
                 pci_segment=<segment_id>,pci_device_id=<pci_slot>",
        keys: &["socket", "cid"],
        extra: PCI_IOMMU,
        many: false,
    },
];

impl DeviceOption {
    /// The option named `name`.
    pub fn find(name: &str) -> Option<&'static DeviceOption> {
        DEVICE_OPTIONS.iter().find(|o| o.name == name)
    }

    /// Checks `s` against upstream's keys for this option and returns the
    /// keys given as a JSON object of strings (`--rtc` without a value: an
    /// empty object). Values are not converted: the device does not exist
    /// here, so validation refuses the field whatever they are.
    pub fn parse(&self, s: &str) -> Result<Value, OptionError> {
        let err = |kind| OptionError::new(self.name, s, self.syntax, kind);
        if self.name == "rtc" && s.is_empty() {
            return Ok(Value::Object(Map::new()));
        }
        let mut p = OptionParser::new();
        for k in self.keys.iter().chain(self.extra) {
            p.add(k);
        }
        p.parse(s).map_err(err)?;
        let mut m = Map::new();
        for k in self.keys.iter().chain(self.extra) {
            if let Some(v) = p.get(k) {
                m.insert((*k).to_owned(), Value::String(v.to_owned()));
            }
        }
        Ok(Value::Object(m))
    }
}

impl PlatformConfig {
    /// The `--platform` syntax (upstream's keys).
    pub const SYNTAX: &'static str = "num_pci_segments=<num_pci_segments>,\
        iommu_segments=<list_of_segments>,iommu_address_width=<bits>,iommufd=on|off,\
        iommufd_fd=<fd>,vfio_p2p_dma=on|off,system_manufacturer=<dmi_system_manufacturer>,\
        system_product_name=<dmi_system_product_name>,system_version=<dmi_system_version>,\
        system_serial_number=<dmi_system_serial_number>,system_uuid=<dmi_system_uuid>,\
        system_sku_number=<dmi_system_sku_number>,system_family=<dmi_system_family>,\
        oem_strings=<list_of_strings>,chassis_asset_tag=<dmi_chassis_asset_tag>";

    /// Parses a `--platform` value (`serial_number` and `uuid` are
    /// upstream's old names of `system_serial_number` and `system_uuid`).
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("platform", s, Self::SYNTAX, kind);
        const STRINGS: &[&str] = &[
            "system_manufacturer",
            "system_product_name",
            "system_version",
            "system_serial_number",
            "system_uuid",
            "system_sku_number",
            "system_family",
            "chassis_asset_tag",
        ];
        let mut p = OptionParser::new();
        p.add("num_pci_segments")
            .add("iommu_segments")
            .add("iommu_address_width")
            .add("serial_number")
            .add("uuid")
            .add("oem_strings")
            .add("iommufd")
            .add("iommufd_fd")
            .add("vfio_p2p_dma");
        for k in STRINGS {
            p.add(k);
        }
        p.parse(s).map_err(err)?;
        let mut c = PlatformConfig::default();
        if let Some(n) = p
            .convert::<u16>("num_pci_segments", "an integer from 1 to 65535")
            .map_err(err)?
        {
            c.num_pci_segments = n;
        }
        if let Some(l) = p.get("iommu_segments") {
            let segs = integer_list(l)
                .map_err(|item| err(invalid("iommu_segments", &item, "a list of segments")))?;
            c.iommu_segments = Some(
                segs.into_iter()
                    .map(|v| u16::try_from(v).map_err(|_| v))
                    .collect::<Result<_, _>>()
                    .map_err(|v| {
                        err(invalid(
                            "iommu_segments",
                            &v.to_string(),
                            "segments from 0 to 65535",
                        ))
                    })?,
            );
        }
        if let Some(b) = p
            .convert::<u8>("iommu_address_width", "an integer from 0 to 255")
            .map_err(err)?
        {
            c.iommu_address_width_bits = b;
        }
        if let Some(l) = p.get("oem_strings") {
            c.oem_strings = Some(string_list(l).map_err(err)?);
        }
        c.iommufd_fd = p
            .convert::<i32>("iommufd_fd", "a file descriptor number")
            .map_err(err)?;
        c.iommufd = p
            .toggle("iommufd")
            .map_err(err)?
            .unwrap_or(c.iommufd_fd.is_some());
        c.vfio_p2p_dma = p.toggle("vfio_p2p_dma").map_err(err)?.unwrap_or(true);
        let get = |k: &str| p.get(k).map(str::to_owned);
        c.system_manufacturer = get("system_manufacturer");
        c.system_product_name = get("system_product_name");
        c.system_version = get("system_version");
        c.system_serial_number = get("system_serial_number").or(get("serial_number"));
        c.system_uuid = get("system_uuid").or(get("uuid"));
        c.system_sku_number = get("system_sku_number");
        c.system_family = get("system_family");
        c.chassis_asset_tag = get("chassis_asset_tag");
        Ok(c)
    }
}

impl PciSegmentConfig {
    /// The `--pci-segment` syntax.
    pub const SYNTAX: &'static str = "pci_segment=<segment_id>,\
        mmio32_aperture_weight=<scale>,mmio64_aperture_weight=<scale>";

    /// Parses one `--pci-segment` value (weights at least 1, as upstream).
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("pci-segment", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add("mmio32_aperture_weight")
            .add("mmio64_aperture_weight")
            .add("pci_segment");
        p.parse(s).map_err(err)?;
        let weight = |k: &str| -> Result<u32, OptionError> {
            match p
                .convert::<u32>(k, "an integer from 1 to 4294967295")
                .map_err(err)?
            {
                None => Ok(1),
                Some(0) => Err(err(invalid(k, "0", "an integer from 1 to 4294967295"))),
                Some(w) => Ok(w),
            }
        };
        Ok(PciSegmentConfig {
            pci_segment: p
                .convert::<u16>("pci_segment", "an integer from 0 to 65535")
                .map_err(err)?
                .unwrap_or(0),
            mmio32_aperture_weight: weight("mmio32_aperture_weight")?,
            mmio64_aperture_weight: weight("mmio64_aperture_weight")?,
        })
    }
}

impl DebugConsoleConfig {
    /// The `--debug-console` syntax.
    pub const SYNTAX: &'static str = "off|pty|tty|null|file=<path>,iobase=<port in hex>";

    /// Parses a `--debug-console` value: a mode (upstream takes the first
    /// of off, pty, tty, null, file; two are an error here) and an
    /// optional `iobase=0x..`.
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("debug-console", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add_valueless("off")
            .add_valueless("pty")
            .add_valueless("tty")
            .add_valueless("null")
            .add("file")
            .add("iobase");
        p.parse(s).map_err(err)?;
        let modes = [
            ("off", ConsoleOutputMode::Off),
            ("pty", ConsoleOutputMode::Pty),
            ("tty", ConsoleOutputMode::Tty),
            ("null", ConsoleOutputMode::Null),
            ("file", ConsoleOutputMode::File),
        ];
        let mut given = modes.iter().filter(|(k, _)| p.is_set(k));
        let (key, mode) = given.next().copied().ok_or(err(ParseError::Missing {
            key: "off|pty|tty|null|file".into(),
        }))?;
        if let Some((other, _)) = given.next() {
            return Err(err(ParseError::Conflict {
                first: key.into(),
                second: (*other).into(),
            }));
        }
        let file = match mode {
            ConsoleOutputMode::File => Some(PathBuf::from(p.require("file").map_err(err)?)),
            _ => None,
        };
        let iobase = match p.get("iobase") {
            None => Some(DEFAULT_DEBUG_CONSOLE_PORT),
            Some(v) => Some(
                v.strip_prefix("0x")
                    .and_then(|h| u16::from_str_radix(h, 16).ok())
                    .ok_or_else(|| err(invalid("iobase", v, "a port in hex, 0x0 to 0xffff")))?,
            ),
        };
        Ok(DebugConsoleConfig { file, mode, iobase })
    }
}

/// Where `--event-monitor` writes events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventMonitor {
    /// A file to create (truncated).
    Path(PathBuf),
    /// An inherited file descriptor.
    Fd(i32),
}

impl EventMonitor {
    /// The `--event-monitor` syntax.
    pub const SYNTAX: &'static str = "path=<path>|fd=<fd>";

    /// Parses an `--event-monitor` value (`fd` wins over `path`, as
    /// upstream).
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("event-monitor", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add("path").add("fd");
        p.parse(s).map_err(err)?;
        const FD: &str = "a file descriptor number (0 or more)";
        if p.is_set("fd") {
            let fd = p.convert::<i32>("fd", FD).map_err(err)?.unwrap_or(-1);
            if fd < 0 {
                return Err(err(invalid("fd", p.get("fd").unwrap_or_default(), FD)));
            }
            return Ok(EventMonitor::Fd(fd));
        }
        if p.is_set("path") {
            return Ok(EventMonitor::Path(p.require("path").map_err(err)?.into()));
        }
        Err(err(ParseError::Missing {
            key: "path|fd".into(),
        }))
    }
}

/// `--seccomp`: what upstream does on a system call outside its filter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Seccomp {
    /// Kill the thread (upstream's default).
    #[default]
    True,
    /// No filter.
    False,
    /// Log the call and allow it.
    Log,
    /// Fail the call with EPERM.
    Errno,
}

impl Seccomp {
    /// The accepted values.
    pub const SYNTAX: &'static str = "true|false|log|errno";

    /// Parses a `--seccomp` value (exactly upstream's four words).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "true" => Some(Seccomp::True),
            "false" => Some(Seccomp::False),
            "log" => Some(Seccomp::Log),
            "errno" => Some(Seccomp::Errno),
            _ => None,
        }
    }
}

/// Upstream's `--log-format` default.
pub const DEFAULT_LOG_FORMAT: &str =
    "cloud-hypervisor: {boottime}s: <{thread}> {level}:{location} -- {msg}";

/// Upstream's `--log-format` tokens (a `local` prefix on the date and time
/// fields gives local time).
const LOG_TOKENS: &[&str] = &[
    "boottime",
    "wallclock",
    "glog",
    "localglog",
    "pid",
    "tid",
    "thread",
    "level",
    "levelchar",
    "location",
    "msg",
    "year",
    "month",
    "day",
    "hour",
    "minute",
    "second",
    "micros",
    "offset",
];

/// Checks a `--log-format` string: `{token}`s from upstream's list, `{{`
/// and `}}` for braces. The error names the bad token.
pub fn check_log_format(s: &str) -> Result<(), OptionError> {
    let err = |kind| OptionError::new("log-format", s, "<format with {tokens}>", kind);
    let mut rest = s;
    while let Some(i) = rest.find(['{', '}']) {
        let c = rest.as_bytes()[i];
        let after = &rest[i + 1..];
        if after.as_bytes().first() == Some(&c) {
            rest = &after[1..];
            continue;
        }
        if c == b'}' {
            return Err(err(ParseError::Unbalanced(s.to_owned())));
        }
        let end = after
            .find('}')
            .ok_or_else(|| err(ParseError::Unbalanced(s.to_owned())))?;
        let token = &after[..end];
        let base = token.strip_prefix("local").unwrap_or(token);
        let known = LOG_TOKENS.contains(&token)
            || (token.starts_with("local") && LOG_TOKENS[11..].contains(&base));
        if !known {
            return Err(err(invalid(
                "token",
                &format!("{{{}}}", esc(token)),
                "one of {boottime}, {wallclock}, {glog}, {localglog}, {pid}, {tid}, \
                 {thread}, {level}, {levelchar}, {location}, {msg}, {year}...{offset}",
            )));
        }
        rest = &after[end + 1..];
    }
    Ok(())
}

/// How `--restore` brings guest RAM back (upstream's `MemoryRestoreMode`;
/// its JSON spelling is the variant's name: `"Copy"`, `"OnDemand"`,
/// `"CopyOnWrite"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum MemoryRestoreMode {
    /// Copy the snapshot into RAM before resuming.
    #[default]
    Copy,
    /// Fault pages in on demand.
    OnDemand,
    /// Map `memory-ranges` `MAP_PRIVATE` as guest RAM: VMs restored from
    /// one snapshot share its page cache.
    CopyOnWrite,
}

/// `--restore`: upstream's `RestoreConfig` as its command line gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreConfig {
    /// Where the snapshot is (`file:///DIR`).
    pub source_url: PathBuf,
    /// Prefault guest RAM.
    pub prefault: bool,
    /// How RAM is restored.
    pub memory_restore_mode: MemoryRestoreMode,
    /// New fds of fd-backed net devices: `(id, fds)`.
    pub net_fds: Option<Vec<(String, Vec<u64>)>>,
    /// New fds of VFIO devices: `(id, fd)`.
    pub vfio_fds: Option<Vec<(String, u64)>>,
    /// A new iommufd.
    pub iommufd_fd: Option<i32>,
    /// Resume the VM once restored.
    pub resume: bool,
    /// NUMA zone updates: `(zone id, host node)`.
    pub zone_updates: Vec<(String, u32)>,
    /// This VMM's clone extension (`pmem=[<id>@<path>,...]`): each pmem
    /// device named gets its own writable file, `(pmem id, file)`.
    pub pmem: Vec<(String, PathBuf)>,
}

impl RestoreConfig {
    /// The `--restore` syntax.
    pub const SYNTAX: &'static str = "source_url=<source_url>,prefault=on|off,\
        memory_restore_mode=copy|ondemand|copyonwrite,net_fds=<list_of_net_ids_with_their_associated_fds>,\
        vfio_fds=<list_of_vfio_ids_with_their_associated_fd>,iommufd_fd=<fd>,\
        resume=true|false,zone_updates=<list_of_updates>,pmem=[<pmem_id>@<clone_file>,...]";

    /// Parses a `--restore` value with upstream's keys.
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("restore", s, Self::SYNTAX, kind);
        let mut p = OptionParser::new();
        p.add("source_url")
            .add("prefault")
            .add("memory_restore_mode")
            .add("net_fds")
            .add("vfio_fds")
            .add("iommufd_fd")
            .add("resume")
            .add("zone_updates")
            .add("pmem");
        p.parse(s).map_err(err)?;
        let source_url = PathBuf::from(p.require("source_url").map_err(err)?);
        let memory_restore_mode = match p.get("memory_restore_mode") {
            None => MemoryRestoreMode::Copy,
            Some(v) => match v.to_ascii_lowercase().as_str() {
                "copy" => MemoryRestoreMode::Copy,
                "ondemand" => MemoryRestoreMode::OnDemand,
                "copyonwrite" => MemoryRestoreMode::CopyOnWrite,
                _ => {
                    return Err(err(invalid(
                        "memory_restore_mode",
                        v,
                        "copy, ondemand or copyonwrite",
                    )))
                }
            },
        };
        let tuples = |key: &str, expected: &str| -> Result<Option<Vec<(String, String)>>, _> {
            p.get(key)
                .map(|v| tuple_list(v).map_err(|item| err(invalid(key, &item, expected))))
                .transpose()
        };
        let net_fds = tuples("net_fds", "[<net_id>@[<fd>,...],...]")?
            .map(|l| {
                l.into_iter()
                    .map(|(id, fds)| {
                        integer_list(&fds)
                            .map(|fds| (id, fds))
                            .map_err(|item| err(invalid("net_fds", &item, "fd numbers")))
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        let vfio_fds = tuples("vfio_fds", "[<vfio_id>@<fd>,...]")?
            .map(|l| {
                l.into_iter()
                    .map(|(id, fd)| {
                        fd.trim()
                            .parse::<u64>()
                            .map(|fd| (id, fd))
                            .map_err(|_| err(invalid("vfio_fds", &fd, "an fd number")))
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        let zone_updates = tuples("zone_updates", "[<zone_id>@<host_numa_node>,...]")?
            .unwrap_or_default()
            .into_iter()
            .map(|(id, node)| {
                node.trim()
                    .parse::<u32>()
                    .map(|n| (id, n))
                    .map_err(|_| err(invalid("zone_updates", &node, "a host NUMA node")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let pmem = tuples("pmem", "[<pmem_id>@<clone_file>,...]")?
            .unwrap_or_default()
            .into_iter()
            .map(|(id, file)| {
                let file = file.trim();
                if file.is_empty() {
                    return Err(err(invalid("pmem", &id, "<pmem_id>@<clone_file>")));
                }
                Ok((id.trim().to_owned(), PathBuf::from(file)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RestoreConfig {
            source_url,
            prefault: p.toggle("prefault").map_err(err)?.unwrap_or(false),
            memory_restore_mode,
            net_fds,
            vfio_fds,
            iommufd_fd: p
                .convert::<i32>("iommufd_fd", "a file descriptor number")
                .map_err(err)?,
            resume: p.toggle("resume").map_err(err)?.unwrap_or(false),
            zone_updates,
            pmem,
        })
    }
}
