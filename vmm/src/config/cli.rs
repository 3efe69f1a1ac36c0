//! The `cloud-hypervisor` command line: upstream's option names and value
//! syntax, parsed by hand so that every error is one line.
//!
//! Accepted forms: `--opt VALUE` and `--opt=VALUE`; `--pmem` may be given
//! several times and, as upstream (clap `num_args(1..)`), takes several
//! values in a row (`--pmem file=a file=b`); `-v` counts (`-v -v`, `-vv`).
//! Every other option may be given once.

use super::vm_config::{ConsoleConfig, CpusConfig, MemoryConfig, PmemConfig, RngConfig, VmConfig};
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
    /// The VM to create and boot at start (present when `--kernel` is
    /// given); not yet validated ([`VmConfig::validate`]).
    pub vm: Option<VmConfig>,
    /// The API socket.
    pub api_socket: Option<ApiSocket>,
    /// How many `-v`.
    pub verbosity: u8,
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
    #[error("--{0} takes no value")]
    UnexpectedValue(&'static str),
    #[error("--{0} needs --kernel")]
    NeedsKernel(&'static str),
}

/// One option: name, value syntax (empty: a flag), help line.
struct Opt {
    name: &'static str,
    syntax: &'static str,
    help: &'static str,
}

const OPTIONS: &[Opt] = &[
    Opt {
        name: "kernel",
        syntax: "<path>",
        help: "Kernel to boot: a bzImage or an ELF vmlinux with a PVH note",
    },
    Opt {
        name: "initramfs",
        syntax: "<path>",
        help: "Initial ramdisk",
    },
    Opt {
        name: "cmdline",
        syntax: "<cmdline>",
        help: "Kernel command line",
    },
    Opt {
        name: "cpus",
        syntax: CpusConfig::SYNTAX,
        help: "vCPUs (default boot=1)",
    },
    Opt {
        name: "memory",
        syntax: MemoryConfig::SYNTAX,
        help: "Guest RAM, sizes in bytes or with K, M, G (default size=512M)",
    },
    Opt {
        name: "pmem",
        syntax: PmemConfig::SYNTAX,
        help: "virtio-pmem device on a pcow image or a raw file (repeatable)",
    },
    Opt {
        name: "serial",
        syntax: ConsoleConfig::SERIAL_SYNTAX,
        help: "8250 serial port on 0x3f8 (default null)",
    },
    Opt {
        name: "console",
        syntax: ConsoleConfig::CONSOLE_SYNTAX,
        help: "virtio console, hvc0 in a Linux guest (default tty)",
    },
    Opt {
        name: "rng",
        syntax: RngConfig::SYNTAX,
        help: "virtio-rng entropy source (default src=/dev/urandom)",
    },
    Opt {
        name: "api-socket",
        syntax: ApiSocket::SYNTAX,
        help: "HTTP API socket (UNIX domain socket)",
    },
    Opt {
        name: "v",
        syntax: "",
        help: "More logging, repeatable: warn, -v info, -vv debug, -vvv trace",
    },
    Opt {
        name: "version",
        syntax: "",
        help: "Print the version and exit",
    },
    Opt {
        name: "help",
        syntax: "",
        help: "Print this help and exit",
    },
];

/// The `--help` text, built from the same `SYNTAX` strings as the errors.
pub fn help() -> String {
    let mut s = String::from("Usage: cloud-hypervisor [OPTIONS]\n\nOptions:\n");
    for o in OPTIONS {
        let flag = match o.name {
            "v" => "-v".to_owned(),
            "version" => "-V, --version".to_owned(),
            "help" => "-h, --help".to_owned(),
            n => format!("--{n} {}", o.syntax),
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

fn opt(name: &str) -> Option<&'static Opt> {
    OPTIONS.iter().find(|o| o.name == name)
}

impl CommandLine {
    /// Parses the arguments after the program name.
    pub fn parse<I, S>(args: I) -> Result<Self, CliError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let args: Vec<String> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
        let mut values: Vec<(&'static str, String)> = Vec::new();
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
            let o = opt(name)
                .filter(|o| !o.syntax.is_empty())
                .ok_or_else(|| match opt(name) {
                    Some(o) if inline.is_some() => CliError::UnexpectedValue(o.name),
                    _ => CliError::Unknown(arg.clone()),
                })?;
            let value = match inline {
                Some(v) => v,
                None => match args.get(i) {
                    Some(v)
                        if !v.starts_with('-') || (o.name == "cmdline" && !v.starts_with("--")) =>
                    {
                        i += 1;
                        v.clone()
                    }
                    _ => return Err(CliError::MissingValue(o.name, o.syntax)),
                },
            };
            if o.name != "pmem" && values.iter().any(|(n, _)| *n == o.name) {
                return Err(CliError::Duplicate(o.name));
            }
            values.push((o.name, value));
            if o.name == "pmem" {
                while let Some(v) = args.get(i).filter(|v| !v.starts_with('-')) {
                    values.push(("pmem", v.clone()));
                    i += 1;
                }
            }
        }
        let mut cl = CommandLine {
            action,
            vm: None,
            api_socket: None,
            verbosity,
        };
        if action != Action::Run {
            return Ok(cl);
        }
        let kernel = values.iter().any(|(n, _)| *n == "kernel");
        let mut vm = VmConfig::default();
        for (name, v) in &values {
            match *name {
                "kernel" => vm.payload_mut().kernel = Some(v.into()),
                "initramfs" => vm.payload_mut().initramfs = Some(v.into()),
                "cmdline" => vm.payload_mut().cmdline = Some(v.clone()),
                "cpus" => vm.cpus = CpusConfig::parse(v)?,
                "memory" => vm.memory = MemoryConfig::parse(v)?,
                "pmem" => vm
                    .pmem
                    .get_or_insert_with(Vec::new)
                    .push(PmemConfig::parse(v)?),
                "serial" => vm.serial = ConsoleConfig::parse_serial(v)?,
                "console" => vm.console = ConsoleConfig::parse_console(v)?,
                "rng" => vm.rng = RngConfig::parse(v)?,
                "api-socket" => {
                    cl.api_socket = Some(ApiSocket::parse(v)?);
                    continue;
                }
                _ => continue,
            }
            if !kernel {
                return Err(CliError::NeedsKernel(name));
            }
        }
        if kernel {
            cl.vm = Some(vm);
        }
        Ok(cl)
    }
}
