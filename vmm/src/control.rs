//! The VMM thread's epoll loop, and how a machine's work is split over
//! threads.
//!
//! | thread | owns |
//! |---|---|
//! | the VMM thread (this loop, [`crate::vmm::Vmm::run`]) | the API, power events, signals, serial and console input, the entropy and console queues, pausing the guest when a device waits for space, stopping the machine |
//! | `vcpuN` | `KVM_RUN` of one vCPU, its port I/O and MMIO exits ([`crate::vcpu`]) |
//! | `pmemN-queue` | the queue of pmem device N (pcow or raw): a FLUSH runs its barrier there, holding the vCPUs ([`crate::pmem_threads`]) |
//! | `pmemN-fault` | the userfaultfd and pool eventfd of pcow device N: maps a cluster, wakes the vCPU ([`virtio_pmem_pcow::MonitorThread`]) |
//! | `http-api`, `http-conn` | accepting API connections, reading and answering requests; the requests go to this loop ([`crate::api`]) |
//!
//! A FLUSH on one device therefore never delays another device's faults
//! or queue, and a vCPU blocked in a fault is released by its device's
//! fault thread whatever this thread or a barrier is doing.
//!
//! What this loop reacts to:
//!
//! | source | action |
//! |---|---|
//! | the pmem alert eventfd (device threads) | a monitor failed: the VM fails; a device waits for space: pause |
//! | the power eventfd (ACPI port, 0xcf9, i8042) | power off or reset |
//! | the vCPU exit eventfd | a vCPU ended: triple fault (reset) or error |
//! | the signalfd (SIGTERM, SIGINT) | clean exit |
//! | a queue notification of the console or the entropy device | serve the queue |
//! | standard input (`--serial tty`, else `--console tty`) | bytes for that device |
//! | a pty's main side (`--serial pty`, `--console pty`) | bytes for that device |
//! | the serial socket (`--serial socket=`) and its client | a new client replaces the old; its bytes for the serial port |
//! | the API eventfd | return: the VMM serves the requests, then runs the loop again |
//!
//! The registrations ([`EventLoop`]) are made once per boot and kept
//! across API requests. A device that found its file system full (a FLUSH
//! stalled in its queue, or a write fault that got no cluster) makes the
//! loop end with [`Outcome::OutOfSpace`]: the VMM pauses the guest until
//! `vm.resume` finds space (QEMU's `werror=enospc`).
//!
//! [`EventLoop::run`] returns why the machine should end; [`stop`] then
//! stops the vCPUs (the fault threads still serve, so that a vCPU blocked
//! in a fault can leave), the device threads, and runs the final barriers.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::chardev::{Backend, StdinOwner};
use crate::health::OutOfSpace;
use crate::legacy::power::PowerEvent;
use crate::machine::{Machine, VirtioFn};
use crate::pmem_threads::MonitorFailed;
use crate::vcpu::{VcpuError, VcpuStop};

/// Why the control loop ended.
#[derive(Debug)]
pub enum Outcome {
    /// The guest powered off.
    PowerOff,
    /// The guest asked for a reset (or triple-faulted): boot it again.
    Reset,
    /// SIGTERM or SIGINT.
    Signal(i32),
    /// Something failed (a vCPU, a monitor, the loop itself).
    Failed(VmFailure),
    /// The API has requests queued (the machine keeps running).
    Api,
    /// A pmem device waits for free space: pause the guest.
    OutOfSpace(OutOfSpace),
}

/// Why a running VM failed (the VMM then ends, exit code 1).
#[derive(Debug, thiserror::Error)]
pub enum VmFailure {
    /// A pcow device's monitor failed: a vCPU may be stuck in a fault.
    #[error(transparent)]
    Monitor(#[from] MonitorFailed),
    /// A vCPU's run failed.
    #[error(transparent)]
    Vcpu(VcpuError),
    /// Every vCPU ended (halted) with nothing else to end the VM.
    #[error("every vCPU has ended")]
    VcpusEnded,
    /// The VMM thread's loop itself failed.
    #[error(transparent)]
    Loop(#[from] ControlError),
}

/// Errors of the loop's own machinery.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("epoll: {what}")]
    Epoll {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug, Clone, Copy)]
enum Token {
    Power,
    VcpuExit,
    Signal,
    Stdin,
    Api,
    /// The pmem device threads' eventfd ([`crate::pmem_threads`]).
    PmemAlert,
    /// A queue of the entropy device or the console.
    Own {
        dev: Own,
        queue: u16,
    },
    /// A pty's main side or a socket client: input for `to`.
    Input {
        to: StdinOwner,
        fd: RawFd,
    },
    /// The serial socket's listener.
    SerialListen,
}

/// The VMM's own virtio functions.
#[derive(Debug, Clone, Copy)]
enum Own {
    Rng,
    Console,
}

impl Own {
    fn function(self, m: &Machine) -> Option<&VirtioFn> {
        match self {
            Own::Rng => Some(&m.rng),
            Own::Console => m.console.as_ref().map(|c| &c.function),
        }
    }
}

/// The loop's registrations. They live as long as the machine's loop, so
/// the slot of an input that went away (a serial socket client replaced)
/// is reused by a later one, but not within the batch of events that
/// removed it (an event of the old fd in the same batch must find no
/// token, not the new one).
struct Registry {
    epoll: Epoll,
    /// By the registration's data; `None`: a removed input.
    tokens: Vec<Option<Token>>,
    /// Slots removed during the current batch of events.
    retired: Vec<usize>,
    /// Slots free for the next registration.
    free: Vec<usize>,
}

impl Registry {
    fn add(&mut self, fd: RawFd, token: Token) -> Result<(), ControlError> {
        let slot = self.free.pop().unwrap_or(self.tokens.len());
        self.epoll
            .ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, slot as u64),
            )
            .map_err(|source| ControlError::Epoll {
                what: "registering an fd",
                source,
            })?;
        match self.tokens.get_mut(slot) {
            Some(t) => *t = Some(token),
            None => self.tokens.push(Some(token)),
        }
        Ok(())
    }

    /// Before the next wait: the slots removed meanwhile may be reused.
    fn next_batch(&mut self) {
        self.free.append(&mut self.retired);
    }

    /// The token registered with `data`.
    fn token(&self, data: u64) -> Option<Token> {
        self.tokens
            .get(usize::try_from(data).ok()?)
            .copied()
            .flatten()
    }

    /// Removes `fd` (an input: a pty, a socket client, standard input).
    fn remove(&mut self, fd: RawFd) {
        if let Err(e) = self
            .epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default())
        {
            log::warn!("epoll: removing fd {fd}: {e}");
        }
        // An event already read for it finds no token.
        for (slot, t) in self.tokens.iter_mut().enumerate() {
            if matches!(t, Some(Token::Input { fd: f, .. }) if *f == fd) {
                *t = None;
                self.retired.push(slot);
            }
        }
    }
}

/// What the loop reads besides the machine: the signalfd and standard
/// input (when the serial port or the console is the terminal).
pub struct Inputs {
    /// A signalfd for SIGTERM and SIGINT (blocked in every thread).
    pub signal_fd: RawFd,
    /// Standard input, for the serial port (`--serial tty`) or else the
    /// console (`--console tty`).
    pub stdin: Option<RawFd>,
}

/// Serial input not yet taken by the guest (its FIFO holds 64 bytes).
#[derive(Default)]
struct PendingInput(VecDeque<u8>);

impl PendingInput {
    fn feed(&mut self, m: &Machine) {
        let Some(serial) = &m.serial else {
            self.0.clear();
            return;
        };
        let mut s = serial.lock().unwrap_or_else(|e| e.into_inner());
        while !self.0.is_empty() {
            let (a, _) = self.0.as_slices();
            match s.enqueue_input(a) {
                Ok(0) => break,
                Ok(n) => {
                    self.0.drain(..n);
                }
                Err(e) => {
                    log::warn!("serial input: {e}");
                    break;
                }
            }
        }
    }
}

/// Whether `fd` can be polled: a regular file or /dev/null cannot (epoll
/// refuses them with EPERM); serial input then stays off, as with a closed
/// input.
pub fn stdin_pollable(fd: RawFd) -> bool {
    let Ok(epoll) = Epoll::new() else {
        return false;
    };
    epoll
        .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, 0))
        .is_ok()
}

fn read_fd(fd: RawFd, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length for the call.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The signal number a signalfd read returns, if one was pending.
pub fn read_signal(fd: RawFd) -> Option<i32> {
    // SAFETY: signalfd_siginfo is plain data; all-zero is a valid value.
    let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::signalfd_siginfo>();
    // SAFETY: `info` is valid for writes of `size` bytes for the call.
    let n = unsafe { libc::read(fd, (&raw mut info).cast(), size) };
    (n as usize == size).then_some(info.ssi_signo as i32)
}

fn registry(m: &Machine, inputs: &Inputs, api_fd: Option<RawFd>) -> Result<Registry, ControlError> {
    let epoll = Epoll::new().map_err(|source| ControlError::Epoll {
        what: "epoll_create",
        source,
    })?;
    let mut r = Registry {
        epoll,
        tokens: Vec::new(),
        retired: Vec::new(),
        free: Vec::new(),
    };
    use std::os::fd::AsRawFd;
    r.add(m.power.as_raw_fd(), Token::Power)?;
    r.add(m.vcpu_exit_fd(), Token::VcpuExit)?;
    r.add(inputs.signal_fd, Token::Signal)?;
    if let Some(fd) = api_fd {
        r.add(fd, Token::Api)?;
    }
    if let (Some(fd), Some(_)) = (inputs.stdin, stdin_target(m)) {
        // The VMM checked that it can be polled (`stdin_pollable`).
        r.add(fd, Token::Stdin)?;
    }
    for (dev, f) in [
        (Own::Rng, Some(&m.rng)),
        (Own::Console, Own::Console.function(m)),
    ] {
        for (queue, fd) in f.iter().flat_map(|f| f.notify.iter().enumerate()) {
            r.add(
                fd.as_raw_fd(),
                Token::Own {
                    dev,
                    queue: queue as u16,
                },
            )?;
        }
    }
    match &m.chardevs.serial {
        Backend::Pty(pty, _) if m.serial.is_some() => r.add(
            pty.main_fd(),
            Token::Input {
                to: StdinOwner::Serial,
                fd: pty.main_fd(),
            },
        )?,
        Backend::Socket(sock, _) if m.serial.is_some() => {
            r.add(sock.listen_fd(), Token::SerialListen)?;
            if let Some(fd) = sock.client_fd() {
                r.add(
                    fd,
                    Token::Input {
                        to: StdinOwner::Serial,
                        fd,
                    },
                )?;
            }
        }
        _ => {}
    }
    if let (Backend::Pty(pty, _), Some(_)) = (&m.chardevs.console, &m.console) {
        r.add(
            pty.main_fd(),
            Token::Input {
                to: StdinOwner::Console,
                fd: pty.main_fd(),
            },
        )?;
    }
    r.add(m.alerts.fd(), Token::PmemAlert)?;
    Ok(r)
}

/// The device standard input feeds, if it exists in this machine.
fn stdin_target(m: &Machine) -> Option<StdinOwner> {
    match m.chardevs.stdin_owner()? {
        StdinOwner::Serial => m.serial.as_ref().map(|_| StdinOwner::Serial),
        StdinOwner::Console => m.console.as_ref().map(|_| StdinOwner::Console),
    }
}

/// Input bytes for `to`.
fn deliver(m: &Machine, pending: &mut PendingInput, to: StdinOwner, bytes: &[u8]) {
    match to {
        StdinOwner::Serial => {
            pending.0.extend(bytes);
            pending.feed(m);
        }
        StdinOwner::Console => {
            if let Some(c) = &m.console {
                c.input
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(bytes);
                c.function.serve(crate::pci::console::RX_QUEUE);
            }
        }
    }
}

/// The VMM thread's loop over one booted machine: its registrations are
/// made once, when the machine has started, and kept across API requests
/// (and across pauses) until the machine is stopped.
pub struct EventLoop {
    reg: Registry,
    events: Vec<EpollEvent>,
    /// Serial input the guest's FIFO has not taken yet.
    pending: PendingInput,
    /// Standard input until EOF or an error.
    stdin_open: bool,
}

impl EventLoop {
    /// Registers every fd the VMM thread serves for `m` (see the module
    /// docs), the API's eventfd `api_fd` among them.
    pub fn new(
        m: &Machine,
        inputs: &Inputs,
        api_fd: Option<RawFd>,
    ) -> Result<EventLoop, ControlError> {
        Ok(EventLoop {
            reg: registry(m, inputs, api_fd)?,
            events: vec![EpollEvent::default(); 32],
            pending: PendingInput::default(),
            stdin_open: true,
        })
    }

    /// Runs the machine until it should end, or until the API has
    /// requests. Events not handled yet when it returns stay pending (the
    /// fds stay readable) for the next call.
    pub fn run(&mut self, m: &mut Machine, inputs: &Inputs) -> Result<Outcome, ControlError> {
        let EventLoop {
            reg,
            events,
            pending,
            stdin_open,
        } = self;
        run(reg, events, pending, stdin_open, m, inputs)
    }
}

fn run(
    reg: &mut Registry,
    events: &mut [EpollEvent],
    pending: &mut PendingInput,
    stdin_open: &mut bool,
    m: &mut Machine,
    inputs: &Inputs,
) -> Result<Outcome, ControlError> {
    loop {
        // Input the guest's FIFO could not take yet is retried shortly.
        let timeout = if pending.0.is_empty() { -1 } else { 10 };
        reg.next_batch();
        let n = match reg.epoll.wait(timeout, events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(ControlError::Epoll {
                    what: "epoll_wait",
                    source,
                })
            }
        };
        pending.feed(m);
        for ev in &events[..n] {
            let Some(token) = reg.token(ev.data()) else {
                continue;
            };
            match token {
                Token::PmemAlert => {
                    if let Some(f) = m.alerts.take() {
                        return Ok(Outcome::Failed(f.into()));
                    }
                    if m.pause_reason.is_none() {
                        if let Some(why) = m.out_of_space() {
                            return Ok(Outcome::OutOfSpace(why));
                        }
                    }
                }
                Token::Power => {
                    if let Some(e) = m.power.try_recv() {
                        log::info!("guest power event: {e:?}");
                        return Ok(match e {
                            PowerEvent::PowerOff => Outcome::PowerOff,
                            PowerEvent::Reset => Outcome::Reset,
                        });
                    }
                }
                Token::VcpuExit => {
                    for r in m.reap_vcpus() {
                        match r {
                            Ok((VcpuStop::Shutdown, _)) => {
                                log::info!("a vCPU shut down (triple fault): reset");
                                return Ok(Outcome::Reset);
                            }
                            Ok((stop, stats)) => {
                                log::info!("a vCPU ended: {stop:?} ({stats:?})");
                            }
                            Err(e) => return Ok(Outcome::Failed(VmFailure::Vcpu(e))),
                        }
                    }
                    if !m.vcpus_running() {
                        return Ok(Outcome::Failed(VmFailure::VcpusEnded));
                    }
                }
                Token::Own { dev, queue } => {
                    if let Some(f) = dev.function(m) {
                        if let Some(fd) = f.notify.get(usize::from(queue)) {
                            let _ = fd.read();
                        }
                        f.serve(queue);
                    }
                }
                Token::SerialListen => {
                    if let Backend::Socket(sock, out) = &m.chardevs.serial {
                        let old = sock.client_fd();
                        if let Some(fd) = sock.accept(out) {
                            if let Some(old) = old {
                                reg.remove(old);
                            }
                            reg.add(
                                fd,
                                Token::Input {
                                    to: StdinOwner::Serial,
                                    fd,
                                },
                            )?;
                        }
                    }
                }
                Token::Input { to, fd } => {
                    let mut buf = [0u8; 256];
                    if let (StdinOwner::Serial, Backend::Socket(sock, out)) =
                        (to, &m.chardevs.serial)
                    {
                        if sock.client_fd() != Some(fd) {
                            // A client replaced meanwhile: its fd is gone.
                            continue;
                        }
                        match sock.read_client(out, &mut buf) {
                            Some(n) => deliver(m, pending, to, &buf[..n]),
                            None => reg.remove(fd),
                        }
                        continue;
                    }
                    match crate::chardev::read_fd(fd, &mut buf) {
                        Ok(n) => deliver(m, pending, to, &buf[..n]),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            log::warn!("{to:?} input: {e}; input stops");
                            reg.remove(fd);
                        }
                    }
                }
                Token::Api => return Ok(Outcome::Api),
                Token::Signal => {
                    if let Some(sig) = read_signal(inputs.signal_fd) {
                        log::info!("signal {sig}: stopping the VM");
                        return Ok(Outcome::Signal(sig));
                    }
                }
                Token::Stdin => {
                    let Some(fd) = inputs.stdin.filter(|_| *stdin_open) else {
                        continue;
                    };
                    let mut buf = [0u8; 256];
                    match read_fd(fd, &mut buf) {
                        Ok(0) => {
                            // EOF: the guest keeps running without input.
                            reg.remove(fd);
                            *stdin_open = false;
                        }
                        Ok(k) => {
                            if let Some(to) = stdin_target(m) {
                                deliver(m, pending, to, &buf[..k]);
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            log::warn!("standard input: {e}; input stops");
                            reg.remove(fd);
                            *stdin_open = false;
                        }
                    }
                }
            }
        }
    }
}

/// How long [`stop`] waits for the vCPUs to leave `KVM_RUN`.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Why [`stop`] could not stop the machine cleanly.
#[derive(Debug, thiserror::Error)]
pub enum StopError {
    /// A vCPU thread did not end (stuck in the kernel).
    #[error("the vCPUs did not stop within {} s", STOP_TIMEOUT.as_secs())]
    VcpusRunning,
}

/// Stops the machine: the vCPUs first (the pmem fault threads keep
/// serving, so a vCPU blocked in a fault can leave), then the device
/// threads (a FLUSH in progress completes), then runs the final barrier of
/// every device on this thread. Returns how many barriers failed, or an
/// error when the vCPUs did not stop in time (the device threads then stop
/// when the machine drops).
pub fn stop(m: &mut Machine) -> Result<usize, StopError> {
    let deadline = Instant::now() + STOP_TIMEOUT;
    while m.vcpus_running() {
        if Instant::now() > deadline {
            return Err(StopError::VcpusRunning);
        }
        // Again each round: a kick can land just before a vCPU enters
        // KVM_RUN; the stop flag catches it at its next exit.
        m.stop_vcpus();
        std::thread::sleep(Duration::from_millis(2));
    }
    for r in m.reap_vcpus() {
        if let Err(e) = r {
            log::warn!("{}", error_report::chain(&e));
        }
    }
    m.stop_device_threads();
    Ok(m.final_barriers())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use vmm_sys_util::eventfd::EventFd;

    fn input(fd: RawFd) -> Token {
        Token::Input {
            to: StdinOwner::Serial,
            fd,
        }
    }

    #[test]
    fn a_removed_input_finds_no_token_in_its_batch_and_its_slot_is_reused_after() {
        let mut reg = Registry {
            epoll: Epoll::new().unwrap(),
            tokens: Vec::new(),
            retired: Vec::new(),
            free: Vec::new(),
        };
        let (a, b, c) = (
            EventFd::new(0).unwrap(),
            EventFd::new(0).unwrap(),
            EventFd::new(0).unwrap(),
        );
        reg.add(a.as_raw_fd(), Token::Api).unwrap();
        reg.add(b.as_raw_fd(), input(b.as_raw_fd())).unwrap();
        reg.remove(b.as_raw_fd());
        assert!(reg.token(1).is_none(), "removed");
        // Same batch: a new input gets a new slot.
        reg.add(c.as_raw_fd(), input(c.as_raw_fd())).unwrap();
        assert!(matches!(reg.token(2), Some(Token::Input { fd, .. }) if fd == c.as_raw_fd()));
        assert!(reg.token(1).is_none());
        // Next batch: the removed slot is reused.
        reg.remove(c.as_raw_fd());
        reg.next_batch();
        reg.add(b.as_raw_fd(), input(b.as_raw_fd())).unwrap();
        assert_eq!(reg.tokens.len(), 3, "no growth");
        assert!(matches!(reg.token(0), Some(Token::Api)));
        assert!(reg.token(99).is_none());
    }
}
