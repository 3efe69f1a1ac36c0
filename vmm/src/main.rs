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
use vmm::config::cli::{self, Action, CommandLine};
use vmm::config::ConsoleOutputMode;
use vmm::control::{self, Inputs, Outcome};
use vmm::machine::Machine;
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
/// (`--serial tty`), and back on drop.
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
    if cl.api_socket.is_some() {
        bail!("--api-socket: the HTTP API is not implemented in this build yet");
    }
    let Some(mut config) = cl.vm else {
        bail!("nothing to run: give --kernel (the HTTP API that could create a VM later is not implemented yet)");
    };
    let pmem = config.validate()?;
    if config.console.mode != ConsoleOutputMode::Off {
        log::info!(
            "--console {:?}: there is no virtio-console device; use --serial",
            config.console.mode
        );
    }

    let signals = signal_fd()?;
    let tty = config.serial.mode == ConsoleOutputMode::Tty;
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
    let _raw = RawTerminal::new(tty);
    let inputs = Inputs {
        signal_fd: signals.as_raw_fd(),
        stdin: tty.then_some(stdin_fd),
    };

    let mut boots = 0u64;
    loop {
        boots += 1;
        let mut machine = Machine::build(&config, &pmem).context("building the VM")?;
        machine.start().context("starting the vCPUs")?;
        log::info!("guest started (boot {boots})");
        let outcome = control::run(&mut machine, &inputs).context("control loop")?;
        let stopped = control::stop(&mut machine);
        drop(machine);
        let failed = stopped.map_err(anyhow::Error::msg)?;
        if failed > 0 {
            bail!("{failed} pmem device(s) failed their final barrier");
        }
        match outcome {
            Outcome::PowerOff => {
                log::info!("guest powered off");
                return Ok(());
            }
            Outcome::Signal(sig) => {
                log::info!("stopped by signal {sig}");
                return Ok(());
            }
            Outcome::Reset => log::info!("guest reset: booting again"),
            Outcome::Failed(msg) => bail!("{msg}"),
        }
    }
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
