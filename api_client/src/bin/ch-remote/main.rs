//! `ch-remote`: drives a `cloud-hypervisor` through its API socket with
//! upstream Cloud Hypervisor's `ch-remote` commands and argument styles,
//! plus the pcow pmem ones.
//!
//! Every command takes at most one positional argument: a `key=value,...`
//! string (`add-*`, `restore`, `send-migration`, `receive-migration`,
//! `pmem-snapshot`, ...) or one value (`remove-device ID`, `snapshot URL`,
//! `create [PATH]`, `pmem-flush ID`); `resize`, `resize-disk` and
//! `resize-zone` take named flags. As upstream: a 200 answer's body is
//! printed as it came, followed by a newline; a 204 prints nothing; an
//! error prints `Error: ch-remote exited with the following chain of
//! errors:` and the chain, numbered, on stderr, and exits 1. A command line
//! clap refuses exits 2.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use api_client::{commands, Client, Method, OptionError};
use clap::{Args, Parser, Subcommand};

/// Remotely control a cloud-hypervisor VMM.
#[derive(Debug, Parser)]
#[command(name = "ch-remote", version, arg_required_else_help = true)]
struct Cli {
    /// HTTP API socket path (UNIX domain socket).
    #[arg(long = "api-socket", value_name = "api-socket")]
    api_socket: Option<PathBuf>,
    /// Upstream's D-Bus options: this ch-remote has no D-Bus client.
    #[command(flatten)]
    dbus: Dbus,
    /// Give up on a request after this many seconds (0: wait forever).
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    timeout: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args)]
struct Dbus {
    #[arg(long, hide = true)]
    dbus_service_name: Option<String>,
    #[arg(long, hide = true)]
    dbus_object_path: Option<String>,
    #[arg(long, hide = true)]
    dbus_system_bus: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Add VFIO device
    AddDevice {
        #[arg(value_name = "device_config", help = commands::DEVICE_SYNTAX)]
        config: String,
    },
    /// Add block device
    AddDisk {
        #[arg(value_name = "disk_config", help = commands::DISK_SYNTAX)]
        config: String,
    },
    /// Add virtio-fs backed fs device
    AddFs {
        #[arg(value_name = "fs_config", help = commands::FS_SYNTAX)]
        config: String,
    },
    /// Add generic vhost-user device
    AddGenericVhostUser {
        #[arg(value_name = "generic_vhost_user_config", help = commands::GENERIC_VHOST_USER_SYNTAX)]
        config: String,
    },
    /// Add network device
    AddNet {
        #[arg(value_name = "net_config", help = commands::NET_SYNTAX)]
        config: String,
    },
    /// Add persistent memory device
    AddPmem {
        #[arg(value_name = "pmem_config", help = commands::PMEM_SYNTAX)]
        config: String,
    },
    /// Add userspace device
    AddUserDevice {
        #[arg(value_name = "device_config", help = commands::USER_DEVICE_SYNTAX)]
        config: String,
    },
    /// Add vDPA device
    AddVdpa {
        #[arg(value_name = "vdpa_config", help = commands::VDPA_SYNTAX)]
        config: String,
    },
    /// Add vsock device
    AddVsock {
        #[arg(value_name = "vsock_config", help = commands::VSOCK_SYNTAX)]
        config: String,
    },
    /// Boot a created VM
    Boot,
    /// Create a coredump from VM
    Coredump {
        #[arg(value_name = "coredump_config", help = "<file_path>")]
        url: String,
    },
    /// Counters from the VM
    Counters,
    /// Create VM from a JSON configuration (standard input when PATH is `-`)
    Create {
        #[arg(value_name = "path", default_value = "-")]
        path: String,
    },
    /// Delete a VM
    Delete,
    /// Info on the VM
    Info,
    /// Trigger NMI
    Nmi,
    /// Pause the VM
    Pause,
    /// Ping the VMM to check for API server availability
    Ping,
    /// Trigger a power button in the VM
    PowerButton,
    /// Reboot the VM
    Reboot,
    /// Receive a VM migration
    ReceiveMigration {
        #[arg(value_name = "receive_migration_config", help = commands::RECEIVE_MIGRATION_SYNTAX)]
        config: String,
    },
    /// Remove VFIO and PCI device
    RemoveDevice {
        #[arg(value_name = "id", help = "<device_id>")]
        id: String,
    },
    /// Resize the VM
    Resize {
        /// New balloon size in bytes (supports K/M/G suffix)
        #[arg(long)]
        balloon: Option<String>,
        /// New vCPUs count
        #[arg(long)]
        cpus: Option<String>,
        /// New memory size in bytes (supports K/M/G suffix)
        #[arg(long)]
        memory: Option<String>,
    },
    /// Resize an attached disk
    ResizeDisk {
        /// Disk identifier
        #[arg(long, required = true)]
        disk: String,
        /// New disk size
        #[arg(long, required = true)]
        size: String,
    },
    /// Resize a memory zone
    ResizeZone {
        /// Memory zone identifier
        #[arg(long, required = true)]
        id: String,
        /// New memory zone size in bytes (supports K/M/G suffix)
        #[arg(long, required = true)]
        size: String,
    },
    /// Restore VM from a snapshot
    Restore {
        #[arg(value_name = "restore_config", help = commands::RESTORE_SYNTAX)]
        config: String,
    },
    /// Resume the VM
    Resume,
    /// Initiate a VM migration
    SendMigration {
        #[arg(value_name = "send_migration_config", help = commands::SEND_MIGRATION_SYNTAX)]
        config: String,
    },
    /// Shutdown the VM
    Shutdown,
    /// Shutdown the VMM
    ShutdownVmm,
    /// Create a snapshot from VM
    Snapshot {
        #[arg(value_name = "snapshot_config", help = "<destination_url>")]
        url: String,
    },
    /// Take a live snapshot of a pcow pmem device
    PmemSnapshot {
        #[arg(value_name = "pmem_snapshot_config", help = commands::PMEM_SNAPSHOT_SYNTAX)]
        config: String,
    },
    /// Continue a pcow pmem device on a new overlay over its current image
    PmemOverlay {
        #[arg(value_name = "pmem_overlay_config", help = commands::PMEM_OVERLAY_SYNTAX)]
        config: String,
    },
    /// Roll a pcow pmem device back to a snapshot (reset=on: on a running
    /// or paused VM, and restart the guest)
    PmemRollback {
        #[arg(value_name = "pmem_rollback_config", help = commands::PMEM_ROLLBACK_SYNTAX)]
        config: String,
    },
    /// Delete a snapshot of a pcow pmem device
    PmemSnapshotDelete {
        #[arg(value_name = "pmem_snapshot_delete_config", help = commands::PMEM_SNAPSHOT_DELETE_SYNTAX)]
        config: String,
    },
    /// Force a barrier on a pcow pmem device
    PmemFlush {
        #[arg(value_name = "id", help = commands::PMEM_FLUSH_SYNTAX)]
        id: String,
    },
    /// Every pmem device's image state
    PmemInfo,
}

/// Largest VM config `create` reads: far above any real one, and a file
/// or pipe that never ends cannot fill memory.
const MAX_CONFIG_LEN: u64 = 16 << 20;

/// What failed, as upstream's numbered chain: the outermost line first.
/// A `raw` line is printed as it is (upstream's `X:` line for an error
/// body that is not a chain).
#[derive(Debug)]
struct Failure {
    lines: Vec<String>,
    raw: Option<String>,
}

impl Failure {
    fn local(top: &str, cause: impl ToString, syntax: Option<&str>) -> Failure {
        let mut lines = vec![top.to_owned(), cause.to_string()];
        if let Some(s) = syntax {
            lines.push(format!("syntax: {s}"));
        }
        Failure { lines, raw: None }
    }

    fn print(&self) {
        eprint!("Error: ch-remote exited with the following ");
        if self.lines.len() == 1 && self.raw.is_none() {
            eprintln!("error:");
            eprintln!("  {}", self.lines[0]);
            return;
        }
        eprintln!("chain of errors:");
        for (level, line) in self.lines.iter().enumerate() {
            eprintln!("  {level}: {line}");
        }
        if let Some(raw) = &self.raw {
            eprintln!("  {raw}");
        }
    }
}

impl From<api_client::Error> for Failure {
    fn from(e: api_client::Error) -> Self {
        let mut lines = vec!["http client error".to_owned()];
        let chain = e.chain();
        let raw = match &e {
            api_client::Error::Server { .. } if chain.len() == 1 && chain[0].starts_with("X: ") => {
                chain.into_iter().next()
            }
            _ => {
                lines.extend(chain);
                None
            }
        };
        Failure { lines, raw }
    }
}

/// An option string's refusal under upstream's top line for the command.
fn parsing(top: &'static str, syntax: &'static str) -> impl FnOnce(OptionError) -> Failure {
    move |e| Failure::local(top, e, Some(syntax))
}

/// The request a command makes: method, endpoint, body.
fn request(command: Command) -> Result<(Method, &'static str, Option<String>), Failure> {
    use Command as C;
    use Method::{Get, Put};
    let put = |endpoint, body| Ok((Put, endpoint, Some(body)));
    match command {
        C::Ping => Ok((Get, "vmm.ping", None)),
        C::ShutdownVmm => Ok((Put, "vmm.shutdown", None)),
        C::Boot => Ok((Put, "vm.boot", None)),
        C::Delete => Ok((Put, "vm.delete", None)),
        C::Pause => Ok((Put, "vm.pause", None)),
        C::Resume => Ok((Put, "vm.resume", None)),
        C::Shutdown => Ok((Put, "vm.shutdown", None)),
        C::Reboot => Ok((Put, "vm.reboot", None)),
        C::PowerButton => Ok((Put, "vm.power-button", None)),
        C::Nmi => Ok((Put, "vm.nmi", None)),
        C::Info => Ok((Get, "vm.info", None)),
        C::Counters => Ok((Get, "vm.counters", None)),
        C::PmemInfo => Ok((Get, "vm.pmem-info", None)),
        C::Create { path } => put("vm.create", read_config(&path)?),
        C::AddPmem { config } => put(
            "vm.add-pmem",
            commands::add_pmem(&config).map_err(parsing(
                "Error parsing persistent memory syntax",
                commands::PMEM_SYNTAX,
            ))?,
        ),
        C::AddDisk { config } => put(
            "vm.add-disk",
            commands::add_disk(&config)
                .map_err(parsing("Error parsing disk syntax", commands::DISK_SYNTAX))?,
        ),
        C::AddNet { config } => put(
            "vm.add-net",
            commands::add_net(&config).map_err(parsing(
                "Error parsing network syntax",
                commands::NET_SYNTAX,
            ))?,
        ),
        C::AddFs { config } => put(
            "vm.add-fs",
            commands::add_fs(&config).map_err(parsing(
                "Error parsing filesystem syntax",
                commands::FS_SYNTAX,
            ))?,
        ),
        C::AddVsock { config } => put(
            "vm.add-vsock",
            commands::add_vsock(&config).map_err(parsing(
                "Error parsing vsock syntax",
                commands::VSOCK_SYNTAX,
            ))?,
        ),
        C::AddDevice { config } => put(
            "vm.add-device",
            commands::add_device(&config).map_err(parsing(
                "Error parsing device syntax",
                commands::DEVICE_SYNTAX,
            ))?,
        ),
        C::AddVdpa { config } => put(
            "vm.add-vdpa",
            commands::add_vdpa(&config).map_err(parsing(
                "Error parsing vDPA device syntax",
                commands::VDPA_SYNTAX,
            ))?,
        ),
        C::AddUserDevice { config } => put(
            "vm.add-user-device",
            commands::add_user_device(&config).map_err(parsing(
                "Error parsing user device syntax",
                commands::USER_DEVICE_SYNTAX,
            ))?,
        ),
        C::AddGenericVhostUser { config } => put(
            "vm.add-generic-vhost-user",
            commands::add_generic_vhost_user(&config).map_err(parsing(
                "Error parsing generic vhost-user syntax",
                commands::GENERIC_VHOST_USER_SYNTAX,
            ))?,
        ),
        C::RemoveDevice { id } => put(
            "vm.remove-device",
            commands::remove_device(&id)
                .map_err(|e| Failure::local("Error parsing device id", e, None))?,
        ),
        C::Snapshot { url } => put(
            "vm.snapshot",
            commands::destination_url(&url)
                .map_err(|e| Failure::local("Error parsing snapshot destination", e, None))?,
        ),
        C::Coredump { url } => put(
            "vm.coredump",
            commands::destination_url(&url)
                .map_err(|e| Failure::local("Error parsing coredump destination", e, None))?,
        ),
        C::Restore { config } => put(
            "vm.restore",
            commands::restore(&config).map_err(parsing(
                "Error parsing restore syntax",
                commands::RESTORE_SYNTAX,
            ))?,
        ),
        C::SendMigration { config } => put(
            "vm.send-migration",
            commands::send_migration(&config).map_err(parsing(
                "Error parsing send migration configuration",
                commands::SEND_MIGRATION_SYNTAX,
            ))?,
        ),
        C::ReceiveMigration { config } => put(
            "vm.receive-migration",
            commands::receive_migration(&config).map_err(parsing(
                "Error parsing receive migration configuration",
                commands::RECEIVE_MIGRATION_SYNTAX,
            ))?,
        ),
        C::Resize {
            balloon,
            cpus,
            memory,
        } => put(
            "vm.resize",
            commands::resize(cpus.as_deref(), memory.as_deref(), balloon.as_deref()).map_err(
                |e| {
                    // Upstream's top line names the flag that failed.
                    let top = match &e {
                        OptionError::InvalidValue { key, .. } if key == "--cpus" => {
                            "Error parsing CPU count"
                        }
                        OptionError::InvalidValue { key, .. } if key == "--balloon" => {
                            "Error parsing balloon size"
                        }
                        _ => "Error parsing memory size",
                    };
                    Failure::local(top, e, None)
                },
            )?,
        ),
        C::ResizeDisk { disk, size } => put(
            "vm.resize-disk",
            commands::resize_disk(&disk, &size)
                .map_err(|e| Failure::local("Invalid disk size", e, None))?,
        ),
        C::ResizeZone { id, size } => put(
            "vm.resize-zone",
            commands::resize_zone(&id, &size)
                .map_err(|e| Failure::local("Error parsing memory size", e, None))?,
        ),
        C::PmemSnapshot { config } => put(
            "vm.pmem-snapshot",
            commands::pmem_snapshot(&config).map_err(parsing(
                "Error parsing pmem-snapshot syntax",
                commands::PMEM_SNAPSHOT_SYNTAX,
            ))?,
        ),
        C::PmemOverlay { config } => put(
            "vm.pmem-overlay",
            commands::pmem_overlay(&config).map_err(parsing(
                "Error parsing pmem-overlay syntax",
                commands::PMEM_OVERLAY_SYNTAX,
            ))?,
        ),
        C::PmemRollback { config } => put(
            "vm.pmem-rollback",
            commands::pmem_rollback(&config).map_err(parsing(
                "Error parsing pmem-rollback syntax",
                commands::PMEM_ROLLBACK_SYNTAX,
            ))?,
        ),
        C::PmemSnapshotDelete { config } => put(
            "vm.pmem-snapshot-delete",
            commands::pmem_snapshot_delete(&config).map_err(parsing(
                "Error parsing pmem-snapshot-delete syntax",
                commands::PMEM_SNAPSHOT_DELETE_SYNTAX,
            ))?,
        ),
        C::PmemFlush { id } => put(
            "vm.pmem-flush",
            commands::pmem_flush(&id).map_err(parsing(
                "Error parsing pmem-flush syntax",
                commands::PMEM_FLUSH_SYNTAX,
            ))?,
        ),
    }
}

/// The VmConfig text, sent as it is: the server judges it. UTF-8, as
/// upstream reads it.
fn read_config(path: &str) -> Result<String, Failure> {
    let (top, reader): (&str, Box<dyn Read>) = if path == "-" {
        ("Error reading from stdin", Box::new(std::io::stdin()))
    } else {
        let file = std::fs::File::open(path)
            .map_err(|e| Failure::local("Error reading from file", format!("{path}: {e}"), None))?;
        ("Error reading from file", Box::new(file))
    };
    let mut text = String::new();
    reader
        .take(MAX_CONFIG_LEN + 1)
        .read_to_string(&mut text)
        .map_err(|e| Failure::local(top, e, None))?;
    if text.len() as u64 > MAX_CONFIG_LEN {
        return Err(Failure::local(
            top,
            format!("the VM config is over {MAX_CONFIG_LEN} bytes"),
            None,
        ));
    }
    Ok(text)
}

fn run(cli: Cli) -> Result<Option<String>, Failure> {
    let Some(socket) = cli.api_socket else {
        return Err(Failure::local(
            "Please provide the api-socket option",
            "--api-socket <path> is required",
            None,
        ));
    };
    let (method, endpoint, body) = request(cli.command)?;
    let timeout = (cli.timeout > 0).then(|| Duration::from_secs(cli.timeout));
    let client = Client::new(socket).with_timeout(timeout);
    Ok(client.call(method, endpoint, body.as_deref().map(str::as_bytes))?)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let d = &cli.dbus;
    if d.dbus_service_name.is_some() || d.dbus_object_path.is_some() || d.dbus_system_bus {
        eprintln!(
            "error: this ch-remote has no D-Bus client (--dbus-service-name, \
             --dbus-object-path, --dbus-system-bus): use --api-socket"
        );
        return ExitCode::from(2);
    }
    match run(cli) {
        Ok(Some(body)) => {
            // As upstream: the body as it came, and a newline.
            println!("{body}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(f) => {
            f.print();
            ExitCode::from(1)
        }
    }
}
