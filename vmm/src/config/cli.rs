//! The `cloud-hypervisor` command line: upstream's option names and value
//! syntax, parsed by hand so that every error is one line.
//!
//! Every option upstream's `cloud-hypervisor` (v54, default build) has is
//! known here, with upstream's value syntax. Accepted forms: `--opt VALUE`
//! and `--opt=VALUE`; the device-list options (`--pmem`, `--disk`, ...)
//! may be given several times and, as upstream (clap `num_args(1..)`),
//! take several values in a row (`--pmem file=a file=b`); `--rtc` takes an
//! optional value; `-v` counts (`-v -v`, `-vv`). Every other option may be
//! given once.
//!
//! Options of devices and features this VMM does not have are parsed into
//! the [`VmConfig`] and refused by its validation, naming the field and the
//! option. Exit codes follow upstream: 2 for what clap refuses there (an
//! unknown option, a missing or unexpected value, an option given twice,
//! a VM option without `--kernel`/`--firmware`, a bad `--seccomp` value),
//! 1 for a bad `key=value` inside an option's value and for options that
//! are not supported ([`CommandLine::check_supported`]).

use std::path::PathBuf;

use super::options::{
    check_log_format, DeviceOption, EventMonitor, RestoreConfig, Seccomp, DEVICE_OPTIONS,
};
use super::vm_config::{
    ConsoleConfig, CpusConfig, DebugConsoleConfig, MemoryConfig, PciSegmentConfig, PlatformConfig,
    PmemConfig, RngConfig, VmConfig,
};
use super::{OptionError, OptionParser, ParseError};

/// Where the API socket is: `--api-socket path=PATH`, `fd=FD`, or a bare
/// path (upstream falls back to the whole value as a path when it is not
/// `path=` or `fd=`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiSocket {
    /// A socket to create at this path.
    Path(std::path::PathBuf),
    /// An already bound socket inherited as this fd.
    Fd(i32),
}

impl ApiSocket {
    /// The `--api-socket` syntax.
    pub const SYNTAX: &'static str = "path=</path/to/a/file>|fd=<fd>|</path/to/a/file>";

    /// Parses an `--api-socket` value.
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        let err = |kind| OptionError::new("api-socket", s, Self::SYNTAX, kind);
        if s.is_empty() {
            return Err(err(ParseError::Empty));
        }
        let mut p = OptionParser::new();
        p.add("path").add("fd");
        if !s.starts_with("path=") && !s.starts_with("fd=") {
            return Ok(ApiSocket::Path(s.into()));
        }
        p.parse(s).map_err(err)?;
        match (p.get("path"), p.get("fd")) {
            (Some(_), Some(_)) => Err(err(ParseError::Conflict {
                first: "path".into(),
                second: "fd".into(),
            })),
            (Some(_), None) => Ok(ApiSocket::Path(p.require("path").map_err(err)?.into())),
            _ => {
                let fd = p
                    .convert::<i32>("fd", "a file descriptor number (0 or more)")
                    .map_err(err)?
                    .filter(|fd| *fd >= 0);
                fd.map(ApiSocket::Fd).ok_or(err(ParseError::InvalidValue {
                    key: "fd".into(),
                    value: p.get("fd").unwrap_or_default().into(),
                    expected: "a file descriptor number (0 or more)".into(),
                }))
            }
        }
    }
}

/// What the command line asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Run the VMM.
    Run,
    /// Print [`help`] and exit 0.
    Help,
    /// Print the version and exit 0.
    Version,
}

/// A parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandLine {
    /// What to do.
    pub action: Action,
    /// The VM to create and boot at start (present when `--kernel` or
    /// `--firmware` is given); not yet validated ([`VmConfig::validate`]).
    pub vm: Option<VmConfig>,
    /// The API socket.
    pub api_socket: Option<ApiSocket>,
    /// How many `-v`.
    pub verbosity: u8,
    /// `--event-monitor`: where to write events.
    pub event_monitor: Option<EventMonitor>,
    /// `--log-file`: where logs go (standard error when absent).
    pub log_file: Option<PathBuf>,
    /// `--log-format`, checked against upstream's tokens.
    pub log_format: Option<String>,
    /// `--seccomp` (upstream's default: `true`).
    pub seccomp: Seccomp,
    /// `--no-shutdown`.
    pub no_shutdown: bool,
    /// `--restore`.
    pub restore: Option<RestoreConfig>,
}

/// A bad command line.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error("unknown argument `{}` (see --help)", super::option_parser::esc(.0))]
    Unknown(String),
    #[error("--{0} needs a value (syntax: --{0} {1})")]
    MissingValue(&'static str, &'static str),
    #[error("--{0} given twice")]
    Duplicate(&'static str),
    #[error(
        "argument `{0}` is not valid UTF-8: this VMM's options are text, so a file \
         name holding other bytes cannot be given (it is refused, never altered into \
         another name); rename the file or link to it under a UTF-8 name"
    )]
    NotUtf8(String),
    #[error("--{0} takes no value")]
    UnexpectedValue(&'static str),
    #[error("--{0} needs --kernel (or --firmware)")]
    NeedsKernel(&'static str),
    #[error(
        "--seccomp {:?}: invalid value (accepted: {})",
        super::option_parser::esc(.0),
        Seccomp::SYNTAX
    )]
    Seccomp(String),
    #[error("--{option}: {why}")]
    Unsupported {
        option: &'static str,
        why: &'static str,
    },
}

impl CliError {
    /// The exit code upstream gives for this kind of error: 2 where its
    /// argument parser (clap) refuses the command line, 1 for a bad option
    /// value found later and for what is not supported.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Option(_) | CliError::Unsupported { .. } => 1,
            _ => 2,
        }
    }
}

/// How an option takes its value.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `--opt VALUE`.
    Value,
    /// `--opt VALUE [VALUE...]`, repeatable.
    Many,
    /// `--opt [VALUE]`.
    Optional,
    /// `--opt`.
    Flag,
}

/// Upstream's argument groups: VM options need a payload option.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Group {
    Vm,
    Payload,
    Other,
}

/// One option: name, value syntax, help line, how it takes its value, its
/// group.
struct Opt {
    name: &'static str,
    syntax: &'static str,
    help: &'static str,
    kind: Kind,
    group: Group,
}

const fn opt(
    name: &'static str,
    syntax: &'static str,
    help: &'static str,
    kind: Kind,
    group: Group,
) -> Opt {
    Opt {
        name,
        syntax,
        help,
        kind,
        group,
    }
}

/// Options of devices this VMM does not have, refused by validation.
const NO_DEVICE: &str = "not supported by this VMM: refused";

/// Every option, in upstream's (alphabetical) `--help` order. The syntax
/// of device options not listed here is in [`DEVICE_OPTIONS`].
const OPTIONS: &[Opt] = &[
    opt(
        "api-socket",
        ApiSocket::SYNTAX,
        "HTTP API socket (UNIX domain socket)",
        Kind::Value,
        Group::Other,
    ),
    opt("balloon", "", NO_DEVICE, Kind::Value, Group::Vm),
    opt(
        "cmdline",
        "<cmdline>",
        "Kernel command line",
        Kind::Value,
        Group::Vm,
    ),
    opt(
        "console",
        ConsoleConfig::CONSOLE_SYNTAX,
        "virtio-console, hvc0 in the guest (default tty)",
        Kind::Value,
        Group::Vm,
    ),
    opt(
        "cpus",
        CpusConfig::SYNTAX,
        "vCPUs (default boot=1); max above boot is kept in the config, the guest gets boot \
         (no vCPU hot-plug); topology, affinity, kvm_hyperv, amx, nested=off and \
         core_scheduling=vcpu are refused",
        Kind::Value,
        Group::Vm,
    ),
    opt(
        "debug-console",
        DebugConsoleConfig::SYNTAX,
        "Debug port (default off,iobase=0xe9): only off (there is no debug port)",
        Kind::Value,
        Group::Vm,
    ),
    opt("device", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt("disk", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt(
        "event-monitor",
        EventMonitor::SYNTAX,
        "Where to report events: path=<path> or fd=<fd>",
        Kind::Value,
        Group::Other,
    ),
    opt(
        "firmware",
        "<path>",
        "Firmware to boot: not supported (refused; use --kernel)",
        Kind::Value,
        Group::Payload,
    ),
    opt("fs", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt("generic-vhost-user", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt(
        "initramfs",
        "<path>",
        "Initial ramdisk",
        Kind::Value,
        Group::Vm,
    ),
    opt(
        "kernel",
        "<path>",
        "Kernel to boot: a bzImage or an ELF vmlinux with a PVH note",
        Kind::Value,
        Group::Payload,
    ),
    opt(
        "landlock",
        "",
        "Confine the VMM with Landlock to its VM's files and the --landlock-rules",
        Kind::Flag,
        Group::Vm,
    ),
    opt(
        "landlock-rules",
        "",
        "More paths for --landlock: path=<file or dir>,access=r|w|rw",
        Kind::Many,
        Group::Vm,
    ),
    opt(
        "log-file",
        "<path>",
        "Log file (standard error when absent)",
        Kind::Value,
        Group::Other,
    ),
    opt(
        "log-format",
        "<format>",
        "Log format with upstream's {tokens}: checked, then refused (not supported)",
        Kind::Value,
        Group::Other,
    ),
    opt(
        "memory",
        MemoryConfig::SYNTAX,
        "Guest RAM, sizes in bytes or with K, M, G (default size=512M); mergeable, shared, \
         hugepages, hotplug, prefault and reserve=on are refused",
        Kind::Value,
        Group::Vm,
    ),
    opt("memory-zone", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt("net", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt(
        "no-shutdown",
        "",
        "Keep the VMM when the guest shuts down: not supported (refused)",
        Kind::Flag,
        Group::Other,
    ),
    opt("numa", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt(
        "pci-segment",
        PciSegmentConfig::SYNTAX,
        "PCI segment: only segment 0 exists",
        Kind::Many,
        Group::Vm,
    ),
    opt(
        "platform",
        PlatformConfig::SYNTAX,
        "Platform: only num_pci_segments=1, no IOMMU segments, no iommufd, no SMBIOS fields",
        Kind::Value,
        Group::Vm,
    ),
    opt(
        "pmem",
        PmemConfig::SYNTAX,
        "virtio-pmem device on a pcow image or a raw file (repeatable)",
        Kind::Many,
        Group::Vm,
    ),
    opt(
        "pvpanic",
        "",
        "pvpanic device: not supported (refused)",
        Kind::Flag,
        Group::Vm,
    ),
    opt("rate-limit-group", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt(
        "restore",
        RestoreConfig::SYNTAX,
        "Restore a VM from a snapshot directory (Paused unless resume=on)",
        Kind::Value,
        Group::Other,
    ),
    opt(
        "rng",
        RngConfig::SYNTAX,
        "virtio-rng (default src=/dev/urandom)",
        Kind::Value,
        Group::Vm,
    ),
    opt("rtc", "", NO_DEVICE, Kind::Optional, Group::Vm),
    opt(
        "seccomp",
        Seccomp::SYNTAX,
        "System call filtering (default true)",
        Kind::Value,
        Group::Other,
    ),
    opt(
        "serial",
        ConsoleConfig::SERIAL_SYNTAX,
        "8250 serial port on 0x3f8 (default null)",
        Kind::Value,
        Group::Vm,
    ),
    opt("tpm", "", NO_DEVICE, Kind::Value, Group::Vm),
    opt("user-device", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt(
        "v",
        "",
        "More logging, repeatable: warn, -v info, -vv debug, -vvv trace",
        Kind::Flag,
        Group::Other,
    ),
    opt("vdpa", "", NO_DEVICE, Kind::Many, Group::Vm),
    opt(
        "version",
        "",
        "Print the version and exit",
        Kind::Flag,
        Group::Other,
    ),
    opt("vsock", "", NO_DEVICE, Kind::Value, Group::Vm),
    opt(
        "watchdog",
        "",
        "virtio-watchdog: not supported (refused)",
        Kind::Flag,
        Group::Vm,
    ),
    opt(
        "help",
        "",
        "Print this help and exit",
        Kind::Flag,
        Group::Other,
    ),
];

impl Opt {
    /// The value syntax (device options: upstream's, from
    /// [`DEVICE_OPTIONS`]).
    fn syntax(&self) -> &'static str {
        match DeviceOption::find(self.name) {
            Some(d) if self.syntax.is_empty() => d.syntax,
            _ => self.syntax,
        }
    }
}

/// The option names, without `--` (`v` is `-v`), in `--help` order.
pub fn option_names() -> impl Iterator<Item = &'static str> {
    OPTIONS.iter().map(|o| o.name)
}

/// The `--help` text, built from the same `SYNTAX` strings as the errors.
pub fn help() -> String {
    let mut s = String::from("Usage: cloud-hypervisor [OPTIONS]\n\nOptions:\n");
    for o in OPTIONS {
        let flag = match (o.name, o.kind) {
            ("v", _) => "-v".to_owned(),
            ("version", _) => "-V, --version".to_owned(),
            ("help", _) => "-h, --help".to_owned(),
            (n, Kind::Flag) => format!("--{n}"),
            (n, Kind::Optional) => format!("--{n} [{}]", o.syntax()),
            (n, _) => format!("--{n} {}", o.syntax()),
        };
        s.push_str(&format!("  {flag}\n          {}\n", o.help));
    }
    s
}

/// The log level for `verbosity` `-v` flags, as upstream maps them.
pub fn log_level(verbosity: u8) -> log::LevelFilter {
    match verbosity {
        0 => log::LevelFilter::Warn,
        1 => log::LevelFilter::Info,
        2 => log::LevelFilter::Debug,
        _ => log::LevelFilter::Trace,
    }
}

fn find(name: &str) -> Option<&'static Opt> {
    OPTIONS.iter().find(|o| o.name == name)
}

/// Whether `v` can be an option's value rather than the next option.
fn is_value(v: &str) -> bool {
    !v.starts_with('-')
}

impl CommandLine {
    /// Parses the arguments after the program name.
    pub fn parse<I, S>(args: I) -> Result<Self, CliError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let args: Vec<String> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
        let mut values: Vec<(&'static Opt, String)> = Vec::new();
        let mut verbosity = 0u8;
        let mut action = Action::Run;
        let mut i = 0;
        while i < args.len() {
            let arg = &args[i];
            i += 1;
            match arg.as_str() {
                "-h" | "--help" => {
                    action = Action::Help;
                    continue;
                }
                "-V" | "--version" => {
                    if action == Action::Run {
                        action = Action::Version;
                    }
                    continue;
                }
                a if a.len() > 1 && a.starts_with('-') && a[1..].bytes().all(|b| b == b'v') => {
                    verbosity = verbosity.saturating_add((a.len() - 1) as u8);
                    continue;
                }
                _ => {}
            }
            let Some(long) = arg.strip_prefix("--") else {
                return Err(CliError::Unknown(arg.clone()));
            };
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_owned())),
                None => (long, None),
            };
            let o = find(name)
                .filter(|o| !matches!(o.name, "v" | "version" | "help"))
                .ok_or_else(|| match find(name) {
                    Some(o) if inline.is_some() => CliError::UnexpectedValue(o.name),
                    _ => CliError::Unknown(arg.clone()),
                })?;
            let value = match (o.kind, inline) {
                (Kind::Flag, Some(_)) => return Err(CliError::UnexpectedValue(o.name)),
                (Kind::Flag, None) => String::new(),
                (_, Some(v)) => v,
                (Kind::Optional, None) => match args.get(i).filter(|v| is_value(v)) {
                    Some(v) => {
                        i += 1;
                        v.clone()
                    }
                    None => String::new(),
                },
                (_, None) => match args.get(i) {
                    Some(v) if is_value(v) || (o.name == "cmdline" && !v.starts_with("--")) => {
                        i += 1;
                        v.clone()
                    }
                    _ => return Err(CliError::MissingValue(o.name, o.syntax())),
                },
            };
            if o.kind != Kind::Many && values.iter().any(|(n, _)| n.name == o.name) {
                return Err(CliError::Duplicate(o.name));
            }
            values.push((o, value));
            if o.kind == Kind::Many {
                while let Some(v) = args.get(i).filter(|v| is_value(v)) {
                    values.push((o, v.clone()));
                    i += 1;
                }
            }
        }
        let mut cl = CommandLine {
            action,
            vm: None,
            api_socket: None,
            verbosity,
            event_monitor: None,
            log_file: None,
            log_format: None,
            seccomp: Seccomp::default(),
            no_shutdown: false,
            restore: None,
        };
        if action != Action::Run {
            return Ok(cl);
        }
        let payload = values.iter().any(|(o, _)| o.group == Group::Payload);
        if let Some((o, _)) = values.iter().find(|(o, _)| o.group == Group::Vm) {
            if !payload {
                return Err(CliError::NeedsKernel(o.name));
            }
        }
        let mut vm = VmConfig::default();
        for (o, v) in &values {
            cl.apply(&mut vm, o.name, v)?;
        }
        if payload {
            cl.vm = Some(vm);
        }
        Ok(cl)
    }

    /// Applies one option to the command line or the VM config.
    fn apply(&mut self, vm: &mut VmConfig, name: &'static str, v: &str) -> Result<(), CliError> {
        let push = |list: &mut Option<serde_json::Value>, item: serde_json::Value| match list
            .get_or_insert_with(|| serde_json::Value::Array(Vec::new()))
        {
            serde_json::Value::Array(a) => a.push(item),
            other => *other = serde_json::Value::Array(vec![item]),
        };
        match name {
            "kernel" => vm.payload_mut().kernel = Some(v.into()),
            "firmware" => vm.payload_mut().firmware = Some(v.into()),
            "initramfs" => vm.payload_mut().initramfs = Some(v.into()),
            "cmdline" => vm.payload_mut().cmdline = Some(v.to_owned()),
            "cpus" => vm.cpus = CpusConfig::parse(v)?,
            "memory" => vm.memory = MemoryConfig::parse(v)?,
            "pmem" => vm
                .pmem
                .get_or_insert_with(Vec::new)
                .push(PmemConfig::parse(v)?),
            "serial" => vm.serial = ConsoleConfig::parse_serial(v)?,
            "console" => vm.console = ConsoleConfig::parse_console(v)?,
            "rng" => vm.rng = RngConfig::parse(v)?,
            "debug-console" => vm.debug_console = DebugConsoleConfig::parse(v)?,
            "platform" => vm.platform = Some(PlatformConfig::parse(v)?),
            "pci-segment" => vm
                .pci_segments
                .get_or_insert_with(Vec::new)
                .push(PciSegmentConfig::parse(v)?),
            "pvpanic" => vm.pvpanic = true,
            "watchdog" => vm.watchdog = true,
            "landlock" => vm.landlock_enable = true,
            "api-socket" => self.api_socket = Some(ApiSocket::parse(v)?),
            "event-monitor" => self.event_monitor = Some(EventMonitor::parse(v)?),
            "log-file" => {
                if v.is_empty() {
                    return Err(CliError::MissingValue("log-file", "<path>"));
                }
                self.log_file = Some(v.into());
            }
            "log-format" => {
                check_log_format(v)?;
                self.log_format = Some(v.to_owned());
            }
            "seccomp" => {
                self.seccomp = Seccomp::parse(v).ok_or_else(|| CliError::Seccomp(v.to_owned()))?
            }
            "no-shutdown" => self.no_shutdown = true,
            "restore" => self.restore = Some(RestoreConfig::parse(v)?),
            name => {
                let Some(d) = DEVICE_OPTIONS.iter().find(|d| d.name == name) else {
                    return Err(CliError::Unknown(format!("--{name}")));
                };
                let item = d.parse(v)?;
                let field = match name {
                    "balloon" => &mut vm.balloon,
                    "device" => &mut vm.devices,
                    "disk" => &mut vm.disks,
                    "fs" => &mut vm.fs,
                    "generic-vhost-user" => &mut vm.generic_vhost_user,
                    "landlock-rules" => &mut vm.landlock_rules,
                    "memory-zone" => &mut vm.memory.zones,
                    "net" => &mut vm.net,
                    "numa" => &mut vm.numa,
                    "rate-limit-group" => &mut vm.rate_limit_groups,
                    "rtc" => &mut vm.rtc,
                    "tpm" => &mut vm.tpm,
                    "user-device" => &mut vm.user_devices,
                    "vdpa" => &mut vm.vdpa,
                    _ => &mut vm.vsock,
                };
                if d.many {
                    push(field, item);
                } else {
                    *field = Some(item);
                }
            }
        }
        Ok(())
    }

    /// Refuses options that parse but whose behaviour is not supported
    /// yet (exit 1, as upstream's errors after parsing).
    pub fn check_supported(&self) -> Result<(), CliError> {
        if self.restore.is_some() && self.vm.is_some() {
            return Err(CliError::Unsupported {
                option: "restore",
                why: "--restore takes the whole VM from the snapshot: it cannot be combined \
                      with --kernel, --firmware or other VM options",
            });
        }
        if self.no_shutdown {
            return Err(CliError::Unsupported {
                option: "no-shutdown",
                why: "not supported yet: the VMM exits when the guest shuts down",
            });
        }
        if self.log_format.is_some() {
            return Err(CliError::Unsupported {
                option: "log-format",
                why: "custom log formats are not supported yet (logs use this VMM's format)",
            });
        }
        Ok(())
    }
}
