//! `ch-remote`: drives a running `cloud-hypervisor` through its API socket,
//! with upstream Cloud Hypervisor's command names plus the pmem ones.
//!
//! On success it prints the server's JSON answer (nothing for a 204); on
//! failure it prints the error chain on stderr, one line each, outermost
//! first, and exits with 1 (2 for a command-line error).

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use api_client::{body, Client, PmemConfig, PMEM_SYNTAX};
use clap::{Parser, Subcommand};

/// Drive a cloud-hypervisor VMM through its REST API socket.
#[derive(Debug, Parser)]
#[command(name = "ch-remote", version)]
struct Cli {
    /// The VMM's API socket (its `--api-socket path=...`).
    #[arg(long, value_name = "PATH")]
    api_socket: PathBuf,
    /// Give up on a request after this many seconds (0: wait forever).
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    timeout: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check that the VMM answers (GET vmm.ping).
    Ping,
    /// Stop the VMM process (PUT vmm.shutdown).
    ShutdownVmm,
    /// Create the VM from a VmConfig JSON file, `-` for stdin (PUT vm.create).
    Create {
        /// JSON file with the VmConfig, or `-`.
        #[arg(value_name = "PATH")]
        path: PathBuf,
    },
    /// Boot the created VM (PUT vm.boot).
    Boot,
    /// Print the VM's config, state and device tree (GET vm.info).
    Info,
    /// Pause the VM's vCPUs (PUT vm.pause).
    Pause,
    /// Resume a paused VM (PUT vm.resume).
    Resume,
    /// Stop the VM; it can be booted again (PUT vm.shutdown).
    Shutdown,
    /// Restart the guest (PUT vm.reboot).
    Reboot,
    /// Delete the VM (PUT vm.delete).
    Delete,
    /// Add a pmem device (PUT vm.add-pmem).
    #[command(after_help = format!("Syntax: {PMEM_SYNTAX}"))]
    AddPmem {
        /// Device options, as the VMM's --pmem.
        #[arg(value_name = "PMEM_CONFIG")]
        config: String,
    },
    /// Remove a device by id (PUT vm.remove-device).
    RemoveDevice {
        /// Device id.
        id: String,
    },
    /// Take a live snapshot of a pcow pmem device (PUT vm.pmem-snapshot).
    PmemSnapshot {
        /// pmem device id.
        id: String,
        /// Tag of the new snapshot.
        tag: String,
    },
    /// Continue a pcow pmem device on a new overlay over its current image
    /// (PUT vm.pmem-overlay).
    PmemOverlay {
        /// pmem device id.
        id: String,
        /// New overlay file (resolved by the VMM: prefer an absolute path).
        file: String,
    },
    /// Roll a pcow pmem device back to a snapshot (PUT vm.pmem-rollback).
    PmemRollback {
        /// pmem device id.
        id: String,
        /// Snapshot tag or numeric id.
        snapshot: String,
        /// Allowed on a running or paused VM: roll back and restart the guest.
        #[arg(long)]
        reset: bool,
    },
    /// Delete a snapshot of a pcow pmem device (PUT vm.pmem-snapshot-delete).
    PmemSnapshotDelete {
        /// pmem device id.
        id: String,
        /// Snapshot tag or numeric id.
        snapshot: String,
    },
    /// Force a barrier on a pcow pmem device (PUT vm.pmem-flush).
    PmemFlush {
        /// pmem device id.
        id: String,
    },
    /// Print every pmem device's image state (GET vm.pmem-info).
    PmemInfo,
    /// Press the guest's ACPI power button (PUT vm.power-button).
    PowerButton,
    /// Inject an NMI into every vCPU (PUT vm.nmi).
    Nmi,
}

/// What went wrong, as lines for stderr: the server's error chain as it
/// sent it, or a local error (first line prefixed with `ch-remote: `) and
/// its causes.
#[derive(Debug)]
struct Failure(Vec<String>);

impl From<api_client::Error> for Failure {
    fn from(e: api_client::Error) -> Self {
        let from_server =
            matches!(&e, api_client::Error::Server { chain, .. } if !chain.is_empty());
        let mut lines = e.chain();
        if !from_server {
            lines[0] = format!("ch-remote: {}", lines[0]);
        }
        Failure(lines)
    }
}

fn run(cli: Cli) -> Result<Option<String>, Failure> {
    let timeout = (cli.timeout > 0).then(|| Duration::from_secs(cli.timeout));
    let client = Client::new(cli.api_socket).with_timeout(timeout);
    let answer = match cli.command {
        Command::Ping => client.get("vmm.ping")?,
        Command::ShutdownVmm => client.put("vmm.shutdown")?,
        Command::Create { path } => {
            let config = read_config(&path)?;
            client.call(api_client::Method::Put, "vm.create", Some(&config))?
        }
        Command::Boot => client.put("vm.boot")?,
        Command::Info => client.get("vm.info")?,
        Command::Pause => client.put("vm.pause")?,
        Command::Resume => client.put("vm.resume")?,
        Command::Shutdown => client.put("vm.shutdown")?,
        Command::Reboot => client.put("vm.reboot")?,
        Command::Delete => client.put("vm.delete")?,
        Command::AddPmem { config } => {
            let pmem: PmemConfig = config.parse().map_err(|e| {
                Failure(vec![
                    format!("ch-remote: add-pmem: {e}"),
                    format!("syntax: {PMEM_SYNTAX}"),
                ])
            })?;
            client.put_json("vm.add-pmem", &pmem)?
        }
        Command::RemoveDevice { id } => {
            client.put_json("vm.remove-device", &body::DeviceId { id: &id })?
        }
        Command::PmemSnapshot { id, tag } => client.put_json(
            "vm.pmem-snapshot",
            &body::PmemSnapshot { id: &id, tag: &tag },
        )?,
        Command::PmemOverlay { id, file } => client.put_json(
            "vm.pmem-overlay",
            &body::PmemOverlay {
                id: &id,
                file: &file,
            },
        )?,
        Command::PmemRollback {
            id,
            snapshot,
            reset,
        } => client.put_json(
            "vm.pmem-rollback",
            &body::PmemRollback {
                id: &id,
                snapshot: &snapshot,
                reset,
            },
        )?,
        Command::PmemSnapshotDelete { id, snapshot } => client.put_json(
            "vm.pmem-snapshot-delete",
            &body::PmemSnapshotDelete {
                id: &id,
                snapshot: &snapshot,
            },
        )?,
        Command::PmemFlush { id } => {
            client.put_json("vm.pmem-flush", &body::DeviceId { id: &id })?
        }
        Command::PmemInfo => client.get("vm.pmem-info")?,
        Command::PowerButton => client.put("vm.power-button")?,
        Command::Nmi => client.put("vm.nmi")?,
    };
    Ok(answer)
}

/// The VmConfig bytes, sent as they are: the server judges them.
fn read_config(path: &std::path::Path) -> Result<Vec<u8>, Failure> {
    let read = if path.as_os_str() == "-" {
        let mut buf = Vec::new();
        std::io::stdin().read_to_end(&mut buf).map(|_| buf)
    } else {
        std::fs::read(path)
    };
    read.map_err(|e| {
        Failure(vec![
            format!("ch-remote: cannot read the VM config {}", path.display()),
            e.to_string(),
        ])
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(Some(json)) => {
            if json.ends_with('\n') {
                print!("{json}");
            } else {
                println!("{json}");
            }
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(Failure(lines)) => {
            for line in lines {
                eprintln!("{line}");
            }
            ExitCode::from(1)
        }
    }
}
