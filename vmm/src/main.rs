//! `cloud-hypervisor`: boots a Linux guest on KVM with virtio-pmem devices
//! backed by pcow images or raw files, with Cloud Hypervisor's command
//! line.
//!
//! Exit codes: 0 when the guest powers off (or the VMM is stopped with
//! SIGTERM/SIGINT after its final barrier), 1 on any error: a bad command
//! line or config (one line, before any guest starts), a failed vCPU, a
//! failed final barrier.

use std::io::IsTerminal;
use std::os::fd::AsRawFd;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use std::time::Duration;

use vmm::api::{self, http::HttpServer};
use vmm::config::cli::{self, Action, ApiSocket, CommandLine};
use vmm::config::ConsoleOutputMode;
use vmm::control::{self, Inputs};
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

fn run() -> Result<()> {
    let cl = CommandLine::parse(
        std::env::args_os()
            .skip(1)
            .map(|a| a.to_string_lossy().into_owned()),
    )?;
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
    env_logger::Builder::new()
        .filter_level(cli::log_level(cl.verbosity))
        .format_timestamp_millis()
        .init();
    if cl.vm.is_none() && cl.api_socket.is_none() {
        bail!("nothing to run: give --kernel, or --api-socket to create a VM through the API");
    }
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
    // (chardev::Chardevs::stdin_owner picks which).
    let tty = config.as_ref().is_some_and(|c| {
        c.serial.mode == ConsoleOutputMode::Tty || c.console.mode == ConsoleOutputMode::Tty
    });
    let stdin_fd = std::io::stdin().as_raw_fd();
    if tty {
        // Non-blocking, so that a read never stalls the control loop.
        // SAFETY: fcntl on standard input with valid flags.
        unsafe {
            let fl = libc::fcntl(stdin_fd, libc::F_GETFL);
            if fl >= 0 {
                libc::fcntl(stdin_fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            }
        }
    }
    let stdin_ok = tty && control::stdin_pollable(stdin_fd);
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
            bail!("--api-socket fd={fd}: an inherited socket is not supported yet, use path=")
        }
        None => (None, None),
    };
    let mut vmm = Vmm::new(inputs, receiver);
    let _raw = RawTerminal::new(tty);
    if let Some(c) = config {
        vmm.create(c).map_err(api_error)?;
        vmm.boot().map_err(api_error)?;
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

fn api_error(e: vmm::api::ApiError) -> anyhow::Error {
    anyhow::Error::msg(e.chain.join(": "))
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cloud-hypervisor: {e:#}");
            ExitCode::FAILURE
        }
    }
}
