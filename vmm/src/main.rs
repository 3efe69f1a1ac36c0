//! `cloud-hypervisor`: boots a Linux guest on KVM with virtio-pmem devices
//! backed by pcow images or raw files, with Cloud Hypervisor's command
//! line.
//!
//! Exit codes: 0 when the guest powers off (or the VMM is stopped with
//! SIGTERM/SIGINT after its final barrier); 2 for a command line upstream's
//! argument parser refuses (unknown option, missing value, option twice, a
//! VM option without `--kernel`); 1 on any other error: a bad option value
//! or config (one line, before any guest starts), an option not
//! implemented, a failed vCPU, a failed final barrier.

use std::io::IsTerminal;
use std::os::fd::{AsRawFd, FromRawFd};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use std::time::Duration;

use vmm::api::{self, http::HttpServer};
use vmm::config::cli::{self, Action, ApiSocket, CommandLine};
use vmm::config::options::EventMonitor;
use vmm::config::ConsoleOutputMode;
use vmm::control::{self, Inputs};
use vmm::seccomp_filters::{self, ThreadKind};
use vmm::snapshot::restore::RestoreRequest;
use vmm::vmm::{Vmm, VmmExit};
use vmm_sys_util::terminal::Terminal;

/// Blocks SIGTERM and SIGINT in this thread (and so in every thread
/// spawned later) and returns a signalfd that reads them.
fn signal_fd() -> Result<std::os::fd::OwnedFd> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it below.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t for these calls; the signal
    // numbers are valid; pthread_sigmask only changes this thread's mask.
    let r = unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    if r != 0 {
        bail!(
            "blocking SIGTERM/SIGINT: {}",
            std::io::Error::from_raw_os_error(r)
        );
    }
    // SAFETY: `set` is initialised; -1 asks for a new fd, checked below.
    let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("signalfd");
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Puts the terminal on standard input in raw mode while the guest owns it
/// (`--serial tty` or `--console tty`), and back on drop.
struct RawTerminal(bool);

impl RawTerminal {
    fn new(enable: bool) -> RawTerminal {
        if !enable || !std::io::stdin().is_terminal() {
            return RawTerminal(false);
        }
        match std::io::stdin().lock().set_raw_mode() {
            Ok(()) => RawTerminal(true),
            Err(e) => {
                log::warn!("standard input: raw mode: {e}");
                RawTerminal(false)
            }
        }
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if self.0 {
            let _ = std::io::stdin().lock().set_canon_mode();
        }
    }
}

/// A command-line error, with the exit code upstream gives for it.
#[derive(Debug)]
struct CliExit(cli::CliError);

impl std::fmt::Display for CliExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for CliExit {}

/// The logger (standard error, or `--log-file`), the event monitor
/// (`--event-monitor`), and the `--seccomp` filters.
fn start_outputs(cl: &CommandLine) -> Result<()> {
    let mut logger = env_logger::Builder::new();
    logger
        .filter_level(cli::log_level(cl.verbosity))
        .format_timestamp_millis();
    if let Some(path) = &cl.log_file {
        let file = std::fs::File::create(path)
            .with_context(|| format!("--log-file {}", path.display()))?;
        logger.target(env_logger::Target::Pipe(Box::new(file)));
    }
    logger.init();
    if let Some(monitor) = &cl.event_monitor {
        let file = match monitor {
            EventMonitor::Path(path) => std::fs::File::create(path)
                .with_context(|| format!("--event-monitor path={}", path.display()))?,
            EventMonitor::Fd(fd) => {
                // SAFETY: F_GETFD only asks whether `fd` is open.
                if unsafe { libc::fcntl(*fd, libc::F_GETFD) } < 0 {
                    bail!("--event-monitor fd={fd}: not an open file descriptor");
                }
                // SAFETY: `fd` is open (checked above) and the command line
                // hands it to the event monitor alone.
                unsafe { std::fs::File::from_raw_fd(*fd) }
            }
        };
        vmm::event_monitor::start(file).context("--event-monitor")?;
    }
    // Before the first thread (the event monitor's) starts: each thread
    // installs its own list as it starts.
    seccomp_filters::init(cl.seccomp).context("--seccomp")?;
    vmm::event_monitor::event("vmm", "starting", &[]);
    Ok(())
}

fn run() -> Result<()> {
    // Arguments are taken as they are or refused: a lossy conversion would
    // turn a file name's non-UTF-8 bytes into U+FFFD and open another file.
    let args = std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string().map_err(|a| {
                use std::os::unix::ffi::OsStrExt;
                CliExit(cli::CliError::NotUtf8(
                    a.as_bytes().escape_ascii().to_string(),
                ))
            })
        })
        .collect::<Result<Vec<String>, CliExit>>()?;
    let cl = CommandLine::parse(args).map_err(CliExit)?;
    match cl.action {
        Action::Help => {
            print!("{}", cli::help());
            return Ok(());
        }
        Action::Version => {
            println!("cloud-hypervisor v{}", env!("CARGO_PKG_VERSION"));
            return Ok(());
        }
        Action::Run => {}
    }
    cl.check_supported().map_err(CliExit)?;
    start_outputs(&cl)?;
    if cl.vm.is_none() && cl.api_socket.is_none() && cl.restore.is_none() {
        bail!(
            "nothing to run: give --kernel, --restore, or --api-socket to create a VM through \
             the API"
        );
    }
    let restore = cl
        .restore
        .as_ref()
        .map(RestoreRequest::from_cli)
        .transpose()?;
    // Check the whole config before anything else happens: a bad value is
    // one error line and no guest starts.
    let config = match cl.vm {
        Some(mut c) => {
            c.validate()?;
            Some(c)
        }
        None => None,
    };

    let signals = signal_fd()?;
    // Standard input goes to the serial port or the console on `tty`
    // (chardev::Chardevs::stdin_owner picks which): of the VM booted or
    // restored at start (a snapshot's config says), or of one created or
    // restored later through the API. For a later one only a standard
    // input that is not a terminal is served (a pipe, a FIFO): a terminal
    // is left as it is (non-blocking, raw) for a VM that may never use it.
    let uses_tty = |c: &vmm::config::VmConfig| {
        c.serial.mode == ConsoleOutputMode::Tty || c.console.mode == ConsoleOutputMode::Tty
    };
    let restored_tty = restore.as_ref().is_some_and(|r| {
        vmm::snapshot::dir::SnapshotDir::open(&r.source).is_ok_and(|s| uses_tty(s.config()))
    });
    let tty = config.as_ref().is_some_and(uses_tty) || restored_tty;
    let later = cl.api_socket.is_some() && !std::io::stdin().is_terminal();
    let serve_stdin = tty || later;
    let stdin_fd = std::io::stdin().as_raw_fd();
    if serve_stdin {
        // Non-blocking, so that a read never stalls the control loop.
        // SAFETY: fcntl on standard input with valid flags.
        unsafe {
            let fl = libc::fcntl(stdin_fd, libc::F_GETFL);
            if fl >= 0 {
                libc::fcntl(stdin_fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            }
        }
    }
    let stdin_ok = serve_stdin && control::stdin_pollable(stdin_fd);
    if tty && !stdin_ok {
        log::info!("standard input cannot be polled (a file or /dev/null): no console input");
    }
    let inputs = Inputs {
        signal_fd: signals.as_raw_fd(),
        stdin: stdin_ok.then_some(stdin_fd),
    };

    let (server, receiver) = match &cl.api_socket {
        Some(ApiSocket::Path(path)) => {
            let (tx, rx) = api::channel().context("API channel")?;
            (Some(HttpServer::start(path, tx)?), Some(rx))
        }
        Some(ApiSocket::Fd(fd)) => {
            let (tx, rx) = api::channel().context("API channel")?;
            (Some(HttpServer::from_fd(*fd, tx)?), Some(rx))
        }
        None => (None, None),
    };
    // Read from /sys before Landlock (at boot or restore) shuts it out.
    vmm::dirty_log::host_logs_unbuffered();
    vmm::dirty_ring::host_stops_full_rings();
    // The VMM thread confines itself before it creates, boots or restores
    // anything: every thread it spawns from here on inherits this filter
    // (the device crate's fault and pool threads included) and narrows it.
    seccomp_filters::apply(ThreadKind::Vmm).context("--seccomp")?;
    let mut vmm = Vmm::new(inputs, receiver);
    let _raw = RawTerminal::new(tty);
    if let Some(c) = config {
        vmm.create(c).map_err(vmm_error)?;
        vmm.boot().map_err(vmm_error)?;
    }
    if let Some(r) = &restore {
        vmm.restore(r).map_err(vmm_error)?;
    }
    let exit = vmm.run();
    if let Some(s) = &server {
        // Let the answer to a vmm.shutdown reach its client.
        s.drain(Duration::from_secs(2));
    }
    match exit {
        VmmExit::Done(why) => {
            log::info!("{why}");
            Ok(())
        }
        VmmExit::Failed(msg) => bail!("{msg}"),
    }
}

/// A failed create or boot, on one line (as the API's chain would read).
fn vmm_error(e: vmm::vmm_error::VmmError) -> anyhow::Error {
    anyhow::Error::msg(error_report::chain(&e))
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cloud-hypervisor: {e:#}");
            match e.downcast_ref::<CliExit>() {
                Some(CliExit(c)) => ExitCode::from(c.exit_code()),
                None => ExitCode::FAILURE,
            }
        }
    }
}
