//! vCPU threads and their pause/resume control.
//!
//! Each vCPU runs [`Vcpu::run_loop`] on its own thread (see [`spawn`]):
//! `KVM_RUN`, then the exit is handled: port I/O goes to a [`PortIo`]
//! handler, MMIO to an [`MmioBus`] (the PCI bus: ECAM and BARs; see
//! [`spawn_with`]); MMIO nothing claims is logged at debug level and
//! ignored (reads return zeros). `HLT` ends the run, a `KVM_RUN` error
//! ends it with the exit reason in the error.
//!
//! [`VcpuControl`] pauses and resumes every vCPU registered with it. A pause
//! sets a flag and kicks each running vCPU thread with a signal
//! ([`kick_signal`], a no-op handler installed without `SA_RESTART`), so
//! `KVM_RUN` returns `EINTR`; the thread sees the flag and waits. A kick
//! that lands between a thread's check of the flag and its entry into
//! `KVM_RUN` would be lost, so the pausing thread kicks again every
//! [`REKICK`] until every vCPU has acknowledged. A vCPU blocked in a
//! userfaultfd fault inside `KVM_RUN` leaves it only when the monitor
//! resolves the fault (then at the pending kick): on the host's KVM the
//! signal does not interrupt that wait (`tests/fault_barrier_kvm.rs`
//! measures it), so the monitor runs on a thread of its own (its device's
//! `pmemN-fault`), never on a thread that pauses the vCPUs.
//!
//! [`VcpuControl::nmi`] injects an NMI into every vCPU. `KVM_NMI` is a
//! vCPU ioctl, so it is issued by the vCPU's own thread: the control marks
//! an NMI pending for each vCPU and kicks the running ones (re-kicking
//! every [`REKICK`], as a pause does); each thread takes its mark before
//! its next `KVM_RUN` and queues the NMI there. A paused vCPU gets it when
//! it resumes.
//!
//! [`VcpuControl::save_states`] and [`VcpuControl::restore_states`]
//! (issue 17 groundwork) capture and restore each vCPU's
//! [`VcpuState`] on the vCPU's own thread: with the vCPUs paused, the
//! control posts a request to every vCPU thread and waits (at most
//! [`STATE_TIMEOUT`]); each thread serves it in its paused wait, outside
//! `KVM_RUN` and without the control's lock, and posts its answer. A
//! restored machine pauses its control before it spawns the vCPU
//! threads, so each applies its state before its first `KVM_RUN`.
//!
//! The control implements the device crate's [`Quiesce`]: `hold` pauses
//! and returns once no vCPU is inside `KVM_RUN`, `release` resumes. Holds
//! nest (a count).
//!
//! A vCPU thread running a port or MMIO handler is outside `KVM_RUN` and
//! checks the flags before it enters again, so a pause counts it as quiet
//! and does not wait for the handler to return. This is what keeps a
//! handler that blocks on something the pausing thread holds (a device
//! lock held across a FLUSH barrier, which pauses the vCPUs) from
//! deadlocking: the pause completes, the barrier runs, the device lock is
//! released, the handler returns, and the vCPU waits for the resume before
//! its next `KVM_RUN`.

use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_ioctls::{VcpuExit, VcpuFd};
// Issue 17: state capture and restore requests served by paused vCPUs.
use crate::dirty_ring::{DirtyRingError, DirtyRings, KVM_EXIT_DIRTY_RING_FULL};
use crate::seccomp_filters::{self, ThreadKind};
use crate::snapshot::cpu_state::{
    CpuStateContext, CpuStateError, StateReply, StateRequest, VcpuState,
};
use virtio_pmem_pcow::{Quiesce, QuiesceError};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

/// How often a pause re-kicks vCPUs that have not acknowledged it.
pub const REKICK: Duration = Duration::from_millis(2);
/// How long [`VcpuControl::pause`] waits for every vCPU to leave
/// `KVM_RUN`: a vCPU that does not is stuck (in a fault nobody serves, or
/// in the kernel), and the pause (or the barrier that asked for it) fails
/// naming it instead of hanging the VMM.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long [`VcpuControl::nmi`] waits for the running vCPUs to take their
/// NMI; one still inside `KVM_RUN` then gets it at its next exit.
pub const NMI_WAIT: Duration = Duration::from_secs(1);
/// How long [`VcpuControl::save_states`] and
/// [`VcpuControl::restore_states`] wait for every vCPU thread to answer.
pub const STATE_TIMEOUT: Duration = Duration::from_secs(5);
/// MMIO exits logged in full; after that, one line per this many.
const MMIO_LOG_EVERY: u64 = 1024;
const MMIO_LOG_FIRST: u64 = 16;

/// Errors of vCPU setup and runs.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("installing the vCPU kick signal handler (signal {signal})")]
    Signal {
        signal: c_int,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
    #[error("vCPU {id}: KVM_RUN failed (exit reason {exit_reason})")]
    Run {
        id: u8,
        exit_reason: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {id}: collecting the dirty rings after a full ring")]
    DirtyRing {
        id: u8,
        #[source]
        source: DirtyRingError,
    },
    #[error("vCPU {id}: unhandled exit {exit}")]
    UnhandledExit { id: u8, exit: String },
    #[error("vCPU {id}: {what}")]
    Registers {
        id: u8,
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("starting the thread of vCPU {id}")]
    Thread {
        id: u8,
        #[source]
        source: std::io::Error,
    },
    #[error("vCPU {id}: its seccomp filter")]
    Seccomp {
        id: u8,
        #[source]
        source: crate::seccomp_filters::SeccompError,
    },
    #[error("the thread of vCPU {0} panicked")]
    Panicked(u8),
    #[error("vCPU(s) {vcpus:?} did not leave KVM_RUN within {} ms of the pause", waited.as_millis())]
    PauseTimeout { vcpus: Vec<usize>, waited: Duration },
    #[error("the vCPUs must be paused to save or restore their state")]
    NotPaused,
    #[error("vCPU thread {0} has exited: its state cannot be saved or restored")]
    Exited(usize),
    #[error("vCPU(s) {vcpus:?} did not answer the state request within {} ms", waited.as_millis())]
    StateTimeout { vcpus: Vec<usize>, waited: Duration },
    #[error("{states} vCPU states for {vcpus} vCPUs")]
    StateCount { states: usize, vcpus: usize },
    #[error("two vCPU states for vCPU {0}")]
    DuplicateState(u8),
    #[error("vCPU state")]
    State(#[source] CpuStateError),
}

/// Port I/O from the guest. The default `io_in` answers zeros.
pub trait PortIo: Send {
    /// The guest wrote `data` to `port`.
    fn io_out(&mut self, port: u16, data: &[u8]);
    /// The guest reads `data.len()` bytes from `port`.
    fn io_in(&mut self, port: u16, data: &mut [u8]) {
        log::debug!("unhandled port read {port:#x} ({} bytes)", data.len());
        data.fill(0);
    }
}

impl<F: FnMut(u16, &[u8]) + Send> PortIo for F {
    fn io_out(&mut self, port: u16, data: &[u8]) {
        self(port, data)
    }
}

/// MMIO from the guest: accesses to guest-physical addresses no memslot
/// backs (the PCI ECAM window, BARs). Each method returns whether
/// something decoded the address; the vCPU logs unclaimed accesses at
/// debug level and answers reads of them with zeros.
///
/// A handler may block (a device lock): the vCPU counts as paused
/// meanwhile (see the module docs), so it must not write guest memory
/// that a barrier harvests (pmem regions) without holding off barriers
/// itself.
pub trait MmioBus: Send {
    /// The guest reads `data.len()` bytes at `addr`.
    fn mmio_read(&mut self, addr: u64, data: &mut [u8]) -> bool;
    /// The guest writes `data` at `addr`.
    fn mmio_write(&mut self, addr: u64, data: &[u8]) -> bool;
}

/// No MMIO device: every access is unclaimed.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoMmio;

impl MmioBus for NoMmio {
    fn mmio_read(&mut self, _addr: u64, _data: &mut [u8]) -> bool {
        false
    }

    fn mmio_write(&mut self, _addr: u64, _data: &[u8]) -> bool {
        false
    }
}

/// Why a run ended normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VcpuStop {
    /// The guest executed `HLT`.
    Halted,
    /// The guest shut down (triple fault).
    Shutdown,
    /// [`VcpuControl::stop`] was called.
    Stopped,
}

/// Exit counters of one run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VcpuStats {
    /// Port writes.
    pub io_out: u64,
    /// Port reads.
    pub io_in: u64,
    /// MMIO reads (claimed or not).
    pub mmio_read: u64,
    /// MMIO writes (claimed or not).
    pub mmio_write: u64,
    /// MMIO accesses no [`MmioBus`] claimed (reads answered with zeros,
    /// writes dropped).
    pub mmio_unclaimed: u64,
    /// `KVM_RUN` returns with `EINTR`/`EAGAIN` (kicks).
    pub interrupted: u64,
    /// Times the vCPU waited paused.
    pub pauses: u64,
    /// NMIs queued with `KVM_NMI` ([`VcpuControl::nmi`]).
    pub nmis: u64,
    /// Exits for a full dirty ring (`crate::dirty_ring`), each followed
    /// by the collection of every ring.
    pub ring_full: u64,
}

/// A vCPU (not yet running).
#[derive(Debug)]
pub struct Vcpu {
    id: u8,
    fd: VcpuFd,
    /// The VM's dirty rings, when it has them: a full ring stops this
    /// vCPU until it is collected.
    rings: Option<Arc<DirtyRings>>,
}

/// The kick signal: the first real-time signal, as Cloud Hypervisor uses.
pub fn kick_signal() -> c_int {
    SIGRTMIN()
}

extern "C" fn kick_handler(_: c_int, _: *mut libc::siginfo_t, _: *mut c_void) {
    // Nothing to do: the signal's only job is to interrupt KVM_RUN.
}

/// Installs the kick signal's handler once per process.
fn install_kick_handler() -> Result<(), VcpuError> {
    static ONCE: Once = Once::new();
    static RESULT: Mutex<Option<i32>> = Mutex::new(None);
    ONCE.call_once(|| {
        if let Err(e) = register_signal_handler(kick_signal(), kick_handler) {
            *RESULT.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.errno());
        }
    });
    match *RESULT.lock().unwrap_or_else(|e| e.into_inner()) {
        Some(errno) => Err(VcpuError::Signal {
            signal: kick_signal(),
            source: vmm_sys_util::errno::Error::new(errno),
        }),
        None => Ok(()),
    }
}

/// Where a registered vCPU thread is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunState {
    /// Registered, thread not yet in its loop (will check the flags
    /// before its first `KVM_RUN`).
    Starting,
    /// In its loop, maybe inside `KVM_RUN`.
    Running(libc::pthread_t),
    /// Outside `KVM_RUN` in a port or MMIO handler; quiet (checks the
    /// flags before its next `KVM_RUN`), not kicked.
    Handling,
    /// Waiting for a resume (outside `KVM_RUN`).
    Paused,
    /// Out of its loop for good.
    Exited,
}

#[derive(Debug, Default)]
struct CtlState {
    holds: usize,
    stop: bool,
    vcpus: Vec<RunState>,
    /// Per vCPU: an NMI to queue before its next `KVM_RUN`.
    nmi: Vec<bool>,
    /// Per vCPU: a state request it serves while paused, and its answer.
    requests: Vec<Option<StateRequest>>,
    replies: Vec<Option<StateReply>>,
}

impl CtlState {
    fn quiet(&self) -> bool {
        self.vcpus
            .iter()
            .all(|s| !matches!(s, RunState::Running(_)))
    }

    /// Whether a vCPU inside (or about to enter) `KVM_RUN` still has to
    /// take its NMI.
    fn nmi_waiting(&self) -> bool {
        self.vcpus
            .iter()
            .zip(&self.nmi)
            .any(|(s, n)| *n && matches!(s, RunState::Running(_)))
    }
}

/// What a vCPU does before its next `KVM_RUN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Leave the loop.
    Stop,
    /// Run; queue an NMI first if `nmi`.
    Run { nmi: bool },
}

/// Pauses, resumes and stops the vCPUs registered with it.
#[derive(Debug, Default)]
pub struct VcpuControl {
    state: Mutex<CtlState>,
    cv: Condvar,
}

impl VcpuControl {
    /// A control with no vCPU; installs the kick signal handler.
    pub fn new() -> Result<Arc<VcpuControl>, VcpuError> {
        install_kick_handler()?;
        Ok(Arc::new(VcpuControl::default()))
    }

    fn lock(&self) -> MutexGuard<'_, CtlState> {
        // The state is counters and small enums, valid after any panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn kick_running(s: &CtlState) {
        Self::kick_where(s, |_| true);
    }

    /// Kicks the running vCPUs whose index `pick` accepts.
    fn kick_where(s: &CtlState, pick: impl Fn(usize) -> bool) {
        for (i, st) in s.vcpus.iter().enumerate() {
            if !pick(i) {
                continue;
            }
            if let RunState::Running(t) = *st {
                // `t` is the pthread of a vCPU thread that has not left its
                // loop: it marks itself `Exited` under the state lock we
                // hold before it ends.
                // SAFETY: so the handle is live; the signal has a no-op
                // handler (installed in `new`).
                let r = unsafe { libc::pthread_kill(t, kick_signal()) };
                if r != 0 {
                    log::warn!(
                        "kicking a vCPU thread: {}",
                        std::io::Error::from_raw_os_error(r)
                    );
                }
            }
        }
    }

    /// Pauses every vCPU; returns once none is inside `KVM_RUN` (vCPUs
    /// started later wait before their first run). Nests with
    /// [`VcpuControl::resume`]. Fails, naming the vCPUs still running and
    /// with the pause undone, when they have not stopped within
    /// [`PAUSE_TIMEOUT`].
    pub fn pause(&self) -> Result<(), VcpuError> {
        self.pause_within(PAUSE_TIMEOUT)
    }

    /// [`VcpuControl::pause`] with a deadline of `limit`.
    pub fn pause_within(&self, limit: Duration) -> Result<(), VcpuError> {
        let start = std::time::Instant::now();
        let mut s = self.lock();
        s.holds += 1;
        while !s.quiet() {
            let waited = start.elapsed();
            if waited >= limit {
                let vcpus = s
                    .vcpus
                    .iter()
                    .enumerate()
                    .filter(|(_, st)| matches!(st, RunState::Running(_)))
                    .map(|(i, _)| i)
                    .collect();
                s.holds -= 1;
                drop(s);
                self.cv.notify_all();
                return Err(VcpuError::PauseTimeout { vcpus, waited });
            }
            Self::kick_running(&s);
            s = self
                .cv
                .wait_timeout(s, REKICK.min(limit - waited))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// Undoes one [`VcpuControl::pause`].
    pub fn resume(&self) {
        let mut s = self.lock();
        s.holds = s.holds.saturating_sub(1);
        drop(s);
        self.cv.notify_all();
    }

    /// Makes every vCPU leave its loop (with [`VcpuStop::Stopped`]) at its
    /// next exit, and kicks the running ones out of `KVM_RUN`.
    pub fn stop(&self) {
        let mut s = self.lock();
        s.stop = true;
        Self::kick_running(&s);
        drop(s);
        self.cv.notify_all();
    }

    /// Injects an NMI into every vCPU that has not exited: each vCPU's
    /// thread queues it (`KVM_NMI`) before its next `KVM_RUN`. Kicks the
    /// running vCPUs and waits (at most [`NMI_WAIT`]) until they have taken
    /// it; paused vCPUs take it when they resume. Returns how many vCPUs
    /// got one pending.
    pub fn nmi(&self) -> usize {
        let mut s = self.lock();
        let mut n = 0;
        for i in 0..s.vcpus.len() {
            if s.vcpus[i] != RunState::Exited {
                s.nmi[i] = true;
                n += 1;
            }
        }
        let deadline = std::time::Instant::now() + NMI_WAIT;
        while s.nmi_waiting() && std::time::Instant::now() < deadline {
            Self::kick_where(&s, |i| s.nmi[i]);
            s = self
                .cv
                .wait_timeout(s, REKICK)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        n
    }

    // --- vCPU state requests (issue 17 groundwork) ---

    /// Asks every paused vCPU thread to capture its state
    /// ([`VcpuState::capture`] on its own thread) and waits for all (at
    /// most [`STATE_TIMEOUT`]); returns the states in vCPU id order. The
    /// caller holds a pause ([`VcpuControl::pause`]) across the call and
    /// until it has everything else it captures (the VM state, the RAM).
    pub fn save_states(&self, ctx: &Arc<CpuStateContext>) -> Result<Vec<VcpuState>, VcpuError> {
        let replies = self.state_requests(|_| StateRequest::Save(ctx.clone()), STATE_TIMEOUT)?;
        let vcpus = replies.len();
        let mut states = Vec::with_capacity(vcpus);
        for r in replies {
            // A save always answers with a state.
            states.extend(r.map_err(VcpuError::State)?);
        }
        if states.len() != vcpus {
            return Err(VcpuError::StateCount {
                states: states.len(),
                vcpus,
            });
        }
        states.sort_by_key(|s| s.id);
        Ok(states)
    }

    /// Asks every paused vCPU thread to restore its state from `states`
    /// (the one with its id, [`VcpuState::restore`] on its own thread) and
    /// waits for all (at most [`STATE_TIMEOUT`]). A restored machine's
    /// control is paused before its vCPU threads start, so each applies
    /// its state before its first `KVM_RUN`; the caller restores the VM
    /// state next, then resumes. Fails, before any vCPU is touched, when
    /// the count of states is not the count of vCPUs or an id appears
    /// twice; otherwise with the first vCPU's error (the vCPUs must then
    /// not run).
    pub fn restore_states(
        &self,
        states: &[VcpuState],
        ctx: &Arc<CpuStateContext>,
    ) -> Result<(), VcpuError> {
        let vcpus = self.lock().vcpus.len();
        if states.len() != vcpus {
            return Err(VcpuError::StateCount {
                states: states.len(),
                vcpus,
            });
        }
        for (i, st) in states.iter().enumerate() {
            if states[..i].iter().any(|o| o.id == st.id) {
                return Err(VcpuError::DuplicateState(st.id));
            }
        }
        let all = Arc::new(states.to_vec());
        let replies = self.state_requests(
            |_| StateRequest::Restore(all.clone(), ctx.clone()),
            STATE_TIMEOUT,
        )?;
        for r in replies {
            r.map_err(VcpuError::State)?;
        }
        Ok(())
    }

    /// Posts `request(i)` to every registered vCPU thread and waits (at
    /// most `limit`) for their replies, in registration order. The vCPUs
    /// must be paused and none may have exited.
    fn state_requests(
        &self,
        request: impl Fn(usize) -> StateRequest,
        limit: Duration,
    ) -> Result<Vec<StateReply>, VcpuError> {
        let start = std::time::Instant::now();
        let mut s = self.lock();
        if s.holds == 0 || s.stop {
            return Err(VcpuError::NotPaused);
        }
        if let Some(i) = s.vcpus.iter().position(|v| *v == RunState::Exited) {
            return Err(VcpuError::Exited(i));
        }
        for i in 0..s.vcpus.len() {
            s.replies[i] = None;
            s.requests[i] = Some(request(i));
        }
        self.cv.notify_all();
        loop {
            if s.replies.iter().all(Option::is_some) {
                return Ok(s.replies.iter_mut().filter_map(Option::take).collect());
            }
            let waiting: Vec<usize> = (0..s.vcpus.len())
                .filter(|&i| s.replies[i].is_none())
                .collect();
            let exited = waiting
                .iter()
                .copied()
                .find(|&i| s.vcpus[i] == RunState::Exited);
            let waited = start.elapsed();
            if exited.is_some() || waited >= limit || s.holds == 0 {
                // Withdraw what is still unserved: a late answer is dropped
                // by the next request.
                for &i in &waiting {
                    s.requests[i] = None;
                }
                return Err(match exited {
                    Some(i) => VcpuError::Exited(i),
                    None if s.holds == 0 => VcpuError::NotPaused,
                    None => VcpuError::StateTimeout {
                        vcpus: waiting,
                        waited,
                    },
                });
            }
            s = self
                .cv
                .wait_timeout(s, limit - waited)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    // --- end of vCPU state requests ---

    /// Number of vCPUs currently paused.
    pub fn paused(&self) -> usize {
        self.lock()
            .vcpus
            .iter()
            .filter(|s| **s == RunState::Paused)
            .count()
    }

    /// Called by vCPU `idx` when `KVM_RUN` returned with an exit to
    /// handle: it no longer needs a kick to be quiet.
    fn handling(&self, idx: usize) {
        self.set(idx, RunState::Handling);
    }

    fn register(&self) -> usize {
        let mut s = self.lock();
        s.vcpus.push(RunState::Starting);
        s.nmi.push(false);
        s.requests.push(None);
        s.replies.push(None);
        s.vcpus.len() - 1
    }

    fn set(&self, idx: usize, st: RunState) {
        let mut s = self.lock();
        s.vcpus[idx] = st;
        drop(s);
        self.cv.notify_all();
    }

    /// [`VcpuControl::may_run_serving`] for a thread that plays a vCPU
    /// (tests): a state request gets an error.
    #[cfg(test)]
    fn may_run(&self, idx: usize, stats: &mut VcpuStats) -> Next {
        self.may_run_serving(idx, stats, &mut |_| {
            Err(CpuStateError::BadField {
                id: 0,
                field: "id",
                why: "not a vCPU".into(),
            })
        })
    }

    /// Called by vCPU `idx` before each `KVM_RUN`: waits while paused,
    /// serving state requests with `serve` meanwhile (without the lock:
    /// KVM ioctls may take a while); says whether to stop, and whether to
    /// queue an NMI first (the NMI is then no longer pending).
    fn may_run_serving(
        &self,
        idx: usize,
        stats: &mut VcpuStats,
        serve: &mut dyn FnMut(&StateRequest) -> StateReply,
    ) -> Next {
        let mut s = self.lock();
        if s.holds > 0 && !s.stop {
            s.vcpus[idx] = RunState::Paused;
            stats.pauses += 1;
            self.cv.notify_all();
            while s.holds > 0 && !s.stop {
                if let Some(req) = s.requests[idx].take() {
                    drop(s);
                    let reply = serve(&req);
                    s = self.lock();
                    s.replies[idx] = Some(reply);
                    self.cv.notify_all();
                    continue;
                }
                s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
            }
        }
        if s.stop {
            return Next::Stop;
        }
        // SAFETY: pthread_self has no preconditions.
        s.vcpus[idx] = RunState::Running(unsafe { libc::pthread_self() });
        let nmi = std::mem::take(&mut s.nmi[idx]);
        if nmi {
            // `nmi` waits for this.
            self.cv.notify_all();
        }
        Next::Run { nmi }
    }
}

impl Quiesce for VcpuControl {
    fn hold(&self) -> Result<(), QuiesceError> {
        self.pause().map_err(|e| QuiesceError(Box::new(e)))
    }

    fn release(&self) {
        self.resume();
    }
}

/// Marks a vCPU `Exited` when its loop ends, also on a panic.
struct ExitMark<'a>(&'a VcpuControl, usize);

impl Drop for ExitMark<'_> {
    fn drop(&mut self) {
        self.0.set(self.1, RunState::Exited);
    }
}

impl Vcpu {
    pub(crate) fn new(id: u8, fd: VcpuFd, rings: Option<Arc<DirtyRings>>) -> Vcpu {
        Vcpu { id, fd, rings }
    }

    /// The vCPU's id.
    pub fn id(&self) -> u8 {
        self.id
    }

    /// The vCPU fd, for register setup.
    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// Sets the special registers (`KVM_SET_SREGS`) after `f` edited the
    /// current ones.
    pub fn update_sregs(
        &self,
        f: impl FnOnce(&mut kvm_bindings::kvm_sregs),
    ) -> Result<(), VcpuError> {
        let reg_err = |what| {
            let id = self.id;
            move |source| VcpuError::Registers { id, what, source }
        };
        let mut sregs = self.fd.get_sregs().map_err(reg_err("KVM_GET_SREGS"))?;
        f(&mut sregs);
        self.fd.set_sregs(&sregs).map_err(reg_err("KVM_SET_SREGS"))
    }

    /// Sets the general registers (`KVM_SET_REGS`).
    pub fn set_regs(&self, regs: &kvm_bindings::kvm_regs) -> Result<(), VcpuError> {
        self.fd
            .set_regs(regs)
            .map_err(|source| VcpuError::Registers {
                id: self.id,
                what: "KVM_SET_REGS",
                source,
            })
    }

    /// Runs the vCPU on the calling thread until it halts, shuts down, is
    /// stopped through `ctl`, or fails. Registers with `ctl` first. No
    /// MMIO handler: every MMIO access is unclaimed.
    pub fn run_loop(
        &mut self,
        ctl: &VcpuControl,
        io: &mut dyn PortIo,
    ) -> Result<(VcpuStop, VcpuStats), VcpuError> {
        self.run_loop_with(ctl, io, &mut NoMmio)
    }

    /// [`Vcpu::run_loop`] with MMIO exits going to `mmio`.
    pub fn run_loop_with(
        &mut self,
        ctl: &VcpuControl,
        io: &mut dyn PortIo,
        mmio: &mut dyn MmioBus,
    ) -> Result<(VcpuStop, VcpuStats), VcpuError> {
        let idx = ctl.register();
        self.run_registered(ctl, idx, io, mmio)
    }

    fn run_registered(
        &mut self,
        ctl: &VcpuControl,
        idx: usize,
        io: &mut dyn PortIo,
        mmio: &mut dyn MmioBus,
    ) -> Result<(VcpuStop, VcpuStats), VcpuError> {
        let _mark = ExitMark(ctl, idx);
        let mut stats = VcpuStats::default();
        let id = self.id;
        // Installed here, after the mark: a refusal ends the run as any
        // failure does (Exited, reported by the join).
        seccomp_filters::apply(ThreadKind::Vcpu)
            .map_err(|source| VcpuError::Seccomp { id, source })?;
        loop {
            let vcpu: &Vcpu = self;
            match ctl.may_run_serving(idx, &mut stats, &mut |req| req.serve(vcpu)) {
                Next::Stop => return Ok((VcpuStop::Stopped, stats)),
                Next::Run { nmi: false } => {}
                Next::Run { nmi: true } => match self.fd.nmi() {
                    Ok(()) => stats.nmis += 1,
                    // Nothing the guest could do about it: the run goes on.
                    Err(e) => log::warn!("vCPU {id}: KVM_NMI: {e}"),
                },
            }
            match self.fd.run() {
                Ok(VcpuExit::IoOut(port, data)) => {
                    stats.io_out += 1;
                    ctl.handling(idx);
                    io.io_out(port, data);
                }
                Ok(VcpuExit::IoIn(port, data)) => {
                    stats.io_in += 1;
                    ctl.handling(idx);
                    io.io_in(port, data);
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    stats.mmio_read += 1;
                    ctl.handling(idx);
                    if !mmio.mmio_read(addr, data) {
                        stats.mmio_unclaimed += 1;
                        let n = stats.mmio_unclaimed;
                        if n <= MMIO_LOG_FIRST || n % MMIO_LOG_EVERY == 0 {
                            log::debug!(
                                "vCPU {id}: unclaimed MMIO read {addr:#x} ({} bytes), {n} so far",
                                data.len()
                            );
                        }
                        data.fill(0);
                    }
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    stats.mmio_write += 1;
                    ctl.handling(idx);
                    if !mmio.mmio_write(addr, data) {
                        stats.mmio_unclaimed += 1;
                        let n = stats.mmio_unclaimed;
                        if n <= MMIO_LOG_FIRST || n % MMIO_LOG_EVERY == 0 {
                            log::debug!(
                                "vCPU {id}: unclaimed MMIO write {addr:#x} {data:x?}, {n} so far"
                            );
                        }
                    }
                }
                Ok(VcpuExit::Hlt) => return Ok((VcpuStop::Halted, stats)),
                Ok(VcpuExit::Shutdown) => return Ok((VcpuStop::Shutdown, stats)),
                Ok(VcpuExit::Intr) => stats.interrupted += 1,
                Ok(VcpuExit::Unsupported(KVM_EXIT_DIRTY_RING_FULL)) => {
                    // Only a VM with rings gets this exit.
                    let Some(rings) = &self.rings else {
                        return Err(VcpuError::UnhandledExit {
                            id,
                            exit: "KVM_EXIT_DIRTY_RING_FULL without a dirty ring".into(),
                        });
                    };
                    stats.ring_full += 1;
                    ctl.handling(idx);
                    rings
                        .collect_full(id)
                        .map_err(|source| VcpuError::DirtyRing { id, source })?;
                }
                Ok(exit) => {
                    return Err(VcpuError::UnhandledExit {
                        id,
                        exit: format!("{exit:?}"),
                    })
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    stats.interrupted += 1;
                }
                Err(source) => {
                    let exit_reason = self.fd.get_kvm_run().exit_reason;
                    return Err(VcpuError::Run {
                        id,
                        exit_reason,
                        source,
                    });
                }
            }
        }
    }
}

/// The outcome of a vCPU thread.
pub type VcpuResult = Result<(VcpuStop, VcpuStats), VcpuError>;

/// A running vCPU thread.
#[derive(Debug)]
pub struct VcpuThread {
    id: u8,
    handle: JoinHandle<VcpuResult>,
}

impl VcpuThread {
    /// Whether the thread has ended.
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the thread and returns how its run ended.
    pub fn join(self) -> VcpuResult {
        self.handle
            .join()
            .unwrap_or(Err(VcpuError::Panicked(self.id)))
    }
}

/// Starts `vcpu` on a new thread named `vcpu<id>`, registered with `ctl`
/// before the thread starts (a pause in force holds it before its first
/// run). No MMIO handler (see [`spawn_with`]).
pub fn spawn(
    vcpu: Vcpu,
    ctl: Arc<VcpuControl>,
    io: Box<dyn PortIo>,
) -> Result<VcpuThread, VcpuError> {
    spawn_with(vcpu, ctl, io, Box::new(NoMmio))
}

/// [`spawn`] with MMIO exits going to `mmio`.
pub fn spawn_with(
    vcpu: Vcpu,
    ctl: Arc<VcpuControl>,
    io: Box<dyn PortIo>,
    mmio: Box<dyn MmioBus>,
) -> Result<VcpuThread, VcpuError> {
    spawn_notifying(vcpu, ctl, io, mmio, None)
}

/// [`spawn_with`], and the thread writes `exited` (an eventfd the control
/// loop polls) when its run ends, whatever the reason.
pub fn spawn_notifying(
    mut vcpu: Vcpu,
    ctl: Arc<VcpuControl>,
    mut io: Box<dyn PortIo>,
    mut mmio: Box<dyn MmioBus>,
    exited: Option<Arc<EventFd>>,
) -> Result<VcpuThread, VcpuError> {
    let id = vcpu.id;
    let idx = ctl.register();
    let c = ctl.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("vcpu{id}"))
        .spawn(move || {
            let r = vcpu.run_registered(&c, idx, &mut *io, &mut *mmio);
            if let Some(e) = exited {
                if let Err(err) = e.write(1) {
                    log::error!("vCPU {id}: signalling its exit: {err}");
                }
            }
            r
        });
    match spawned {
        Ok(handle) => Ok(VcpuThread { id, handle }),
        Err(source) => {
            ctl.set(idx, RunState::Exited);
            Err(VcpuError::Thread { id, source })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::cpu_state::sample_state;

    #[test]
    fn pause_waits_for_running_and_ignores_starting() {
        let ctl = VcpuControl::new().unwrap();
        let a = ctl.register();
        // A starting vCPU does not block a pause.
        ctl.pause().unwrap();
        ctl.resume();
        // A "running" vCPU (a plain thread playing one) must acknowledge.
        let c = ctl.clone();
        let t = std::thread::spawn(move || {
            let mut stats = VcpuStats::default();
            let mut runs = 0;
            while c.may_run(a, &mut stats) != Next::Stop {
                runs += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            c.set(a, RunState::Exited);
            (runs, stats)
        });
        std::thread::sleep(Duration::from_millis(20));
        ctl.pause().unwrap();
        assert_eq!(ctl.paused(), 1);
        ctl.pause().unwrap(); // nested
        ctl.resume();
        assert_eq!(ctl.paused(), 1);
        ctl.resume();
        ctl.stop();
        let (runs, stats) = t.join().unwrap();
        assert!(runs > 0);
        assert!(stats.pauses >= 1);
        // Everything exited: a pause returns at once.
        ctl.pause().unwrap();
        ctl.resume();
    }

    #[test]
    fn a_pause_that_a_vcpu_never_acknowledges_fails_naming_it_and_holds_nothing() {
        let ctl = VcpuControl::new().unwrap();
        let _a = ctl.register();
        let b = ctl.register();
        // vCPU 1 "enters KVM_RUN" and never comes back to check the flags
        // (a vCPU stuck in the kernel); vCPU 0 is still starting.
        let mut stats = VcpuStats::default();
        assert_eq!(ctl.may_run(b, &mut stats), Next::Run { nmi: false });
        let t = std::time::Instant::now();
        let e = ctl.pause_within(Duration::from_millis(50)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2));
        match &e {
            VcpuError::PauseTimeout { vcpus, waited } => {
                assert_eq!(vcpus, &[1]);
                assert!(*waited >= Duration::from_millis(50));
            }
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("[1]"), "{e}");
        // The failed pause is undone: the vCPU runs on without a resume.
        assert_eq!(ctl.may_run(b, &mut stats), Next::Run { nmi: false });
        assert_eq!(stats.pauses, 0);
        ctl.stop();
    }

    #[test]
    fn a_vcpu_in_a_handler_is_quiet_and_waits_before_its_next_run() {
        let ctl = VcpuControl::new().unwrap();
        let a = ctl.register();
        let mut stats = VcpuStats::default();
        assert_eq!(ctl.may_run(a, &mut stats), Next::Run { nmi: false });
        // The "exit": a handler that would block on something the pausing
        // thread holds must not keep the pause waiting.
        ctl.handling(a);
        ctl.pause().unwrap();
        assert_eq!(ctl.paused(), 0, "handling, not paused");
        let c = ctl.clone();
        let t = std::thread::spawn(move || {
            let mut stats = VcpuStats::default();
            let ran = c.may_run(a, &mut stats) != Next::Stop;
            c.set(a, RunState::Exited);
            (ran, stats.pauses)
        });
        let start = std::time::Instant::now();
        while ctl.paused() == 0 && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(ctl.paused(), 1, "the handler's return waits for the resume");
        ctl.resume();
        assert_eq!(t.join().unwrap(), (true, 1));
    }

    #[test]
    fn an_nmi_is_taken_once_before_the_next_run() {
        let ctl = VcpuControl::new().unwrap();
        let (a, b) = (ctl.register(), ctl.register());
        let mut stats = VcpuStats::default();
        // Both still starting: marked, no wait (they check before their
        // first run).
        let start = std::time::Instant::now();
        assert_eq!(ctl.nmi(), 2);
        assert!(
            start.elapsed() < NMI_WAIT,
            "did not wait for starting vCPUs"
        );
        assert_eq!(ctl.may_run(a, &mut stats), Next::Run { nmi: true });
        assert_eq!(ctl.may_run(a, &mut stats), Next::Run { nmi: false });
        // a leaves its "run" for a handler: quiet, it takes the next NMI
        // before it runs again.
        ctl.handling(a);
        // A "running" vCPU (a thread playing one, in and out of its run):
        // the NMI waits for it to take it.
        let c = ctl.clone();
        let t = std::thread::spawn(move || {
            let mut stats = VcpuStats::default();
            let mut nmis = 0;
            loop {
                match c.may_run(b, &mut stats) {
                    Next::Stop => break,
                    Next::Run { nmi } => nmis += u32::from(nmi),
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            c.set(b, RunState::Exited);
            nmis
        });
        // b took the first NMI at its first run; this one too, before
        // `nmi` returns.
        std::thread::sleep(Duration::from_millis(10));
        let start = std::time::Instant::now();
        assert_eq!(ctl.nmi(), 2);
        assert!(start.elapsed() < NMI_WAIT, "b took it: no timeout");
        assert!(!ctl.lock().nmi[b], "b took its NMI before nmi() returned");
        assert!(ctl.lock().nmi[a], "a has not run since");
        assert_eq!(ctl.may_run(a, &mut stats), Next::Run { nmi: true });
        ctl.handling(a);
        ctl.stop();
        assert_eq!(t.join().unwrap(), 2);
        // An exited vCPU gets none.
        assert_eq!(ctl.nmi(), 1);
    }

    // --- vCPU state requests (issue 17 groundwork) ---

    fn ctx() -> Arc<CpuStateContext> {
        Arc::new(CpuStateContext {
            msr_indices: vec![0x10],
            tsc_khz: false,
            xcrs: false,
        })
    }

    #[test]
    fn state_requests_need_a_pause_and_no_exited_vcpu() {
        let ctl = VcpuControl::new().unwrap();
        let (a, _b) = (ctl.register(), ctl.register());
        assert!(matches!(ctl.save_states(&ctx()), Err(VcpuError::NotPaused)));
        ctl.pause().unwrap();
        ctl.set(a, RunState::Exited);
        let e = ctl.save_states(&ctx()).unwrap_err();
        assert!(matches!(e, VcpuError::Exited(0)), "{e:?}");
        assert!(e.to_string().contains("vCPU thread 0 has exited"), "{e}");
        ctl.resume();
        ctl.stop();
    }

    #[test]
    fn restore_checks_the_count_and_the_ids_before_asking_any_vcpu() {
        let ctl = VcpuControl::new().unwrap();
        let _a = ctl.register();
        ctl.pause().unwrap();
        let two = [sample_state(0), sample_state(1)];
        let e = ctl.restore_states(&two, &ctx()).unwrap_err();
        assert_eq!(e.to_string(), "2 vCPU states for 1 vCPUs");
        let _b = ctl.register();
        let dup = [sample_state(1), sample_state(1)];
        let e = ctl.restore_states(&dup, &ctx()).unwrap_err();
        assert!(matches!(e, VcpuError::DuplicateState(1)), "{e:?}");
        assert!(ctl.lock().requests.iter().all(Option::is_none));
        ctl.resume();
        ctl.stop();
    }

    #[test]
    fn a_paused_vcpu_thread_serves_the_request_and_the_answer_comes_back() {
        let ctl = VcpuControl::new().unwrap();
        let a = ctl.register();
        ctl.pause().unwrap();
        // A thread playing a vCPU: it pauses in `may_run` and serves each
        // request with a state of its own (or an error for a restore).
        let c = ctl.clone();
        let t = std::thread::spawn(move || {
            let mut stats = VcpuStats::default();
            let mut served = 0;
            let mut serve = |r: &StateRequest| {
                served += 1;
                match r {
                    StateRequest::Save(_) => Ok(Some(sample_state(5))),
                    StateRequest::Restore(..) => Err(CpuStateError::MsrRejected {
                        id: 5,
                        index: 0x2ff,
                        data: 1,
                    }),
                }
            };
            while c.may_run_serving(a, &mut stats, &mut serve) != Next::Stop {
                std::thread::sleep(Duration::from_millis(1));
            }
            c.set(a, RunState::Exited);
            served
        });
        let states = ctl.save_states(&ctx()).unwrap();
        assert_eq!(states, [sample_state(5)]);
        let e = ctl.restore_states(&states, &ctx()).unwrap_err();
        assert!(
            matches!(
                e,
                VcpuError::State(CpuStateError::MsrRejected { index: 0x2ff, .. })
            ),
            "{e:?}"
        );
        // Both requests were served while the thread stayed paused.
        assert_eq!(ctl.paused(), 1);
        ctl.resume();
        ctl.stop();
        assert_eq!(t.join().unwrap(), 2);
    }

    #[test]
    fn a_vcpu_that_never_comes_back_to_serve_times_out_naming_it() {
        let ctl = VcpuControl::new().unwrap();
        let (a, _b) = (ctl.register(), ctl.register());
        let mut stats = VcpuStats::default();
        // vCPU 0 is in a handler that does not return; vCPU 1 serves (the
        // test wrapper answers with an error).
        assert_eq!(ctl.may_run(a, &mut stats), Next::Run { nmi: false });
        ctl.handling(a);
        ctl.pause().unwrap();
        let c = ctl.clone();
        let t = std::thread::spawn(move || {
            let mut stats = VcpuStats::default();
            while c.may_run(1, &mut stats) != Next::Stop {
                std::thread::sleep(Duration::from_millis(1));
            }
            c.set(1, RunState::Exited);
        });
        let start = std::time::Instant::now();
        let e = ctl
            .state_requests(|_| StateRequest::Save(ctx()), Duration::from_millis(100))
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        match &e {
            VcpuError::StateTimeout { vcpus, waited } => {
                assert_eq!(vcpus, &[0]);
                assert!(*waited >= Duration::from_millis(100));
            }
            other => panic!("{other:?}"),
        }
        assert!(ctl.lock().requests[0].is_none(), "withdrawn");
        ctl.resume();
        ctl.stop();
        t.join().unwrap();
    }
}
