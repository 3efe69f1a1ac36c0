//! Fault resolution and the [`Monitor`], the fd-driven half of a region
//! that serves its userfaultfd (on [`crate::MonitorThread`], a thread of
//! its own). [`Monitor::handle_ready`] drains the pending faults and
//! resolves each under the state lock, which a FLUSH barrier never holds
//! across a sync (snapshots and overlays do, see the crate's lock order):
//!
//! - a write fault in a hole cluster gets the active layer's cluster
//!   (allocated from the image's pool), mapped `MAP_FIXED|MAP_SHARED` over
//!   the cluster, then `UFFDIO_WAKE`: the waiter retries on the file page.
//!   Nothing is lost by the remap: a hole cluster has no present page (any
//!   access to it faults and waits for us), so the mapping replaced is empty.
//!   When the guest already wrote into the cluster's expansion window
//!   ([`crate::RegionOptions::expand_window`]), the window's other holes
//!   get theirs in the same mapping: the faults they would have cost are
//!   the guest's largest cost of filling new space.
//! - a read fault in a hole gets `UFFDIO_ZEROPAGE` over the whole cluster:
//!   nothing is allocated. Later writes there land in private anonymous
//!   pages without a fault; the barrier moves them into the image (and,
//!   past the zero budget, returns the clusters nobody wrote to holes).
//! - a fault in a cluster already resolved (several threads faulted it, or
//!   a queued event raced a resolution) only wakes: one allocation per
//!   cluster however many threads fault it.
//! - a write fault that cannot get a cluster (a full disk, no writable
//!   image) gets zeros: the guest keeps running, its write lands in a
//!   private page that the next barrier moves (or fails to, reporting it).
//! - any fault in a hole whose cluster the image holds (the open left it
//!   unmapped because a scattered image needs too many mappings, see
//!   [`crate::plan::Deferral`], or a window's cluster allocated
//!   ahead whose mapping failed) maps it as the open would have: shared
//!   from the writable layer, private from a read-only one. When no
//!   mapping is left under the process's limit, its data is copied into
//!   the region's anonymous memory instead (`UFFDIO_COPY`), and the
//!   cluster is handled from then on like a zero-mapped hole: a write
//!   lands in a private page that the barrier moves.
//!   A guest that reads such clusters in order (its fault is in the
//!   cluster after the last such fault, or after what that one read
//!   ahead) gets the next ones resolved with it, up to
//!   [`READ_AHEAD_BYTES`]: on a scattered image every cluster would
//!   otherwise cost a fault of its own.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use vmm_sys_util::eventfd::EventFd;

use pcow::{ClusterSource, LiveImage};

use crate::clusters::{push_run, ClusterState, FileRun};
use crate::fault_poll::FaultPoll;
use crate::health::{is_out_of_space, Failure};
use crate::plan::{plan_cluster, Run, RunKind};
use crate::state::{top_fd, FaultCounters, NoImage, RegionState, Shared, Writable};
use crate::thread_hook::ThreadHook;
use crate::uffd::{Uffd, UffdError, EVENT_PAGEFAULT, MSG_SIZE, PAGEFAULT_FLAG_WRITE};

/// Errors of fault resolution.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error(transparent)]
    Uffd(#[from] UffdError),
    #[error("fault at {addr:#x} outside the region")]
    OutsideRegion { addr: u64 },
    #[error("region state lock poisoned by a panic")]
    Poisoned,
    #[error("fault at {addr:#x} left unresolved")]
    Unresolved {
        addr: u64,
        #[source]
        source: Box<MonitorError>,
    },
    #[error(
        "fault at {addr:#x} in a cluster the region left unmapped, with no image to map it from"
    )]
    NoImage {
        addr: u64,
        #[source]
        source: NoImage,
    },
    #[error("cluster {vcn}: reading its data to copy it into the region")]
    ReadCluster {
        vcn: u64,
        #[source]
        source: pcow::Error,
    },
    #[error("cluster {vcn}: restoring its hole after a mapping failed halfway")]
    Restore {
        vcn: u64,
        #[source]
        source: std::io::Error,
    },
}

/// Why a write fault in a hole got zeros instead of a cluster.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum NoCluster {
    #[error("cluster {vcn}: no cluster for a write fault, zeros mapped")]
    Image {
        vcn: u64,
        #[source]
        source: pcow::Error,
    },
    #[error("cluster {vcn}: no cluster for a write fault, zeros mapped")]
    NoImage {
        vcn: u64,
        #[source]
        source: NoImage,
    },
    #[error("cluster {vcn} is a hole but the image's cluster is partial; zeros mapped")]
    Partial { vcn: u64 },
    #[error("cluster {vcn}: mapping the image's cluster failed, zeros mapped")]
    Map {
        vcn: u64,
        #[source]
        source: std::io::Error,
    },
}

/// The fd-driven half of a pcow region, served by a
/// [`crate::MonitorThread`] (or a VMM's own event loop).
///
/// Two fds to poll for reading ([`Monitor::fds`]): the userfaultfd
/// ([`Monitor::fd`], handled by [`Monitor::handle_ready`]) and, when the
/// pool has a worker, its eventfd ([`Monitor::pool_fd`], handled by
/// [`Monitor::handle_pool_ready`]); [`Monitor::handle_fd`] dispatches.
///
/// Holds the region's shared state: the region's address space stays
/// reserved while the monitor lives, so a late fault can never map
/// into memory that was given back.
pub struct Monitor {
    shared: Arc<Shared>,
    uffd: Arc<Uffd>,
    pool_efd: Option<Arc<EventFd>>,
    /// Only the thread handling the userfaultfd takes it.
    poll: Mutex<FaultPoll>,
    /// Set when a write fault found the file system full and the region
    /// had no such failure recorded yet; taken by the monitor thread.
    space_alert: AtomicBool,
    /// Runs first on the monitor's thread ([`crate::MonitorThread`]).
    hook: Option<ThreadHook>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("fd", &self.uffd.as_raw_fd())
            .field("pool_fd", &self.pool_fd())
            .finish()
    }
}

impl Monitor {
    pub(crate) fn new(
        shared: Arc<Shared>,
        uffd: Arc<Uffd>,
        pool_efd: Option<Arc<EventFd>>,
        poll: FaultPoll,
        hook: Option<ThreadHook>,
    ) -> Monitor {
        Monitor {
            shared,
            uffd,
            pool_efd,
            poll: Mutex::new(poll),
            space_alert: AtomicBool::new(false),
            hook,
        }
    }

    /// The hook the monitor's thread runs first.
    pub(crate) fn thread_hook(&self) -> Option<ThreadHook> {
        self.hook.clone()
    }

    /// The userfaultfd to poll for reading (non-blocking).
    pub fn fd(&self) -> RawFd {
        self.uffd.as_raw_fd()
    }

    /// The pre-allocation worker's eventfd to poll for reading
    /// (non-blocking; the same fd for the monitor's whole life, also across
    /// live overlays), or `None` when the pool has no worker.
    pub fn pool_fd(&self) -> Option<RawFd> {
        self.pool_efd.as_ref().map(|e| e.as_raw_fd())
    }

    /// Every fd to register for reading: the userfaultfd, then the pool's
    /// eventfd if any.
    pub fn fds(&self) -> Vec<RawFd> {
        std::iter::once(self.fd()).chain(self.pool_fd()).collect()
    }

    /// Handles readiness of `fd` (one of [`Monitor::fds`]); an unknown fd
    /// does nothing. Returns the events handled.
    pub fn handle_fd(&self, fd: RawFd) -> Result<usize, MonitorError> {
        if fd == self.fd() {
            self.handle_ready()
        } else if Some(fd) == self.pool_fd() {
            self.handle_pool_ready()
        } else {
            Ok(0)
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, RegionState>, MonitorError> {
        self.shared.lock().map_err(|_| MonitorError::Poisoned)
    }

    /// Drains and resolves every pending fault; returns how many were
    /// handled. Call when [`Monitor::fd`] is readable. The first error is
    /// returned after every event read was tried (an event is never left
    /// half-done: a fault that cannot be mapped gets zeros). After each
    /// batch, takes finished refills and asks the worker for one if the
    /// pool is low. When nothing is pending any more, keeps reading for the
    /// adaptive poll window ([`crate::fault_poll`], at most 50 µs by
    /// default) before it returns, without holding the state lock.
    pub fn handle_ready(&self) -> Result<usize, MonitorError> {
        let mut buf = [0u8; MSG_SIZE * 32];
        let mut handled = 0;
        let mut first_err = None;
        let mut poll = self.poll.lock().map_err(|_| MonitorError::Poisoned)?;
        let mut n = self.uffd.read_msgs(&mut buf)?;
        if n == 0 {
            return Ok(0);
        }
        poll.fault_at(Instant::now());
        let mut polled = false;
        loop {
            let mut st = self.lock()?;
            if polled {
                st.counters.faults.polled += n as u64;
            }
            for m in buf[..n * MSG_SIZE].chunks_exact(MSG_SIZE) {
                if m[0] != EVENT_PAGEFAULT {
                    continue;
                }
                let word = |at: usize| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&m[at..at + 8]);
                    u64::from_ne_bytes(w)
                };
                let (flags, addr) = (word(8), word(16));
                handled += 1;
                match resolve_fault(&mut st, addr, flags & PAGEFAULT_FLAG_WRITE != 0) {
                    Ok(Resolved::Fallback(why)) => {
                        if st.out_of_space.is_some() {
                            self.space_alert.store(true, Ordering::Release);
                        }
                        st.pool.note_failure(why)
                    }
                    Ok(
                        Resolved::Allocated
                        | Resolved::Zeroed
                        | Resolved::Woken
                        | Resolved::Mapped
                        | Resolved::Copied,
                    ) => {}
                    Err(e) => {
                        log::error!("userfaultfd: {e}");
                        first_err.get_or_insert(e);
                    }
                }
            }
            st.refill_pool();
            drop(st);
            n = self.uffd.read_msgs(&mut buf)?;
            if n > 0 {
                continue;
            }
            // Everything pending is handled: keep reading for the window
            // (without the state lock), the next fault of a burst is
            // likely on its way.
            poll.idle_at(Instant::now());
            n = self.uffd.read_msgs_within(&mut buf, poll.window())?;
            if n == 0 {
                break;
            }
            poll.fault_at(Instant::now());
            polled = true;
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(handled),
        }
    }

    /// Takes the worker's finished refills (the image's pool grows by what
    /// was reserved) and asks for the next one if the pool is still low.
    /// Call when [`Monitor::pool_fd`] is readable; returns the refills
    /// taken.
    pub fn handle_pool_ready(&self) -> Result<usize, MonitorError> {
        if let Some(e) = &self.pool_efd {
            // Resets the counter; EAGAIN (nothing pending) is fine.
            let _ = e.read();
        }
        Ok(self.lock()?.refill_pool())
    }

    /// Whether a write fault found the file system full since the last
    /// call (then [`crate::PcowRegion::out_of_space`] says why).
    pub fn take_space_alert(&self) -> bool {
        self.space_alert.swap(false, Ordering::AcqRel)
    }

    /// Counters so far.
    pub fn counters(&self) -> Result<FaultCounters, MonitorError> {
        Ok(self.lock()?.counters.faults)
    }
}

/// How a fault was resolved.
#[derive(Debug)]
enum Resolved {
    /// A hole got the active layer's cluster, mapped shared.
    Allocated,
    /// A read in a hole got zeros.
    Zeroed,
    /// The cluster was resolved already: woken only.
    Woken,
    /// A write in a hole got zeros because no cluster could be mapped.
    Fallback(Failure),
    /// A hole whose cluster the image holds got it mapped.
    Mapped,
    /// A hole whose cluster the image holds got its data copied in.
    Copied,
}

/// Resolves one fault at `addr`.
fn resolve_fault(st: &mut RegionState, addr: u64, write: bool) -> Result<Resolved, MonitorError> {
    let vcn = st
        .view
        .vcn_at(addr)
        .ok_or(MonitorError::OutsideRegion { addr })?;
    let (start, cs) = st.view.span(vcn, vcn + 1);
    if st.view.clusters.get(vcn) == ClusterState::Hole {
        if let Some(source) = held_by_image(st, vcn, addr)? {
            let resolved = map_held(st, vcn, source)?;
            read_ahead(st, vcn)?;
            return Ok(resolved);
        }
    }
    match st.view.clusters.get(vcn) {
        ClusterState::Hole if write => {
            match map_fresh(st, vcn) {
                Ok(Fresh { grew, ahead }) => {
                    st.counters.faults.write_faults += 1;
                    st.counters.faults.clusters_ahead += ahead;
                    st.view.uffd.wake(start, cs)?;
                    if grew {
                        st.pool.note_inline();
                    }
                    Ok(Resolved::Allocated)
                }
                Err(e) => {
                    // Zeros keep the guest running; its write lands in a
                    // private page that the next barrier moves into the
                    // image (or reports the same error).
                    let faults = &mut st.counters.faults;
                    if faults.fallbacks.is_power_of_two() {
                        log::warn!("{}", error_report::chain(&e));
                    }
                    faults.fallbacks += 1;
                    st.view
                        .uffd
                        .zeropage(start, cs)
                        .map_err(|z| MonitorError::Unresolved {
                            addr,
                            source: Box::new(z.into()),
                        })?;
                    st.view.clusters.set(vcn, vcn + 1, ClusterState::Zero);
                    let why = Failure::new(e);
                    if is_out_of_space(&why) && st.out_of_space.is_none() {
                        st.out_of_space = Some(why.clone());
                    }
                    Ok(Resolved::Fallback(why))
                }
            }
        }
        ClusterState::Hole => {
            st.view.uffd.zeropage(start, cs)?;
            st.view.clusters.set(vcn, vcn + 1, ClusterState::Zero);
            st.counters.faults.read_faults += 1;
            Ok(Resolved::Zeroed)
        }
        _ => {
            st.counters.faults.wake_only += 1;
            st.view.uffd.wake(start, cs)?;
            Ok(Resolved::Woken)
        }
    }
}

/// Where the image holds hole `vcn`'s data, or `None` when it holds
/// none (a true hole: zeros). Without an image to ask, only a region
/// whose open mapped every cluster with data can tell.
fn held_by_image(
    st: &RegionState,
    vcn: u64,
    addr: u64,
) -> Result<Option<ClusterSource>, MonitorError> {
    match open_image(&st.image, addr) {
        Ok(image) => Ok(match image.cluster_source(vcn) {
            ClusterSource::Hole => None,
            source => Some(source),
        }),
        Err(e) if st.counters.deferred > 0 => Err(e),
        Err(_) => Ok(None),
    }
}

/// The image, or why a fault at `addr` has none to map from.
fn open_image(image: &Writable, addr: u64) -> Result<&LiveImage, MonitorError> {
    match image {
        Writable::Open(image) => Ok(image),
        Writable::Switching => Err(MonitorError::NoImage {
            addr,
            source: NoImage::Switching,
        }),
        Writable::Detached(why) => Err(MonitorError::NoImage {
            addr,
            source: NoImage::Detached(why.clone()),
        }),
    }
}

/// Maps hole `vcn`, whose data the image holds at `source`, as the open
/// would have; when the mappings do not fit under the process's limit,
/// copies the data in instead. Wakes the waiters either way.
fn map_held(
    st: &mut RegionState,
    vcn: u64,
    source: ClusterSource,
) -> Result<Resolved, MonitorError> {
    let (start, cs) = st.view.span(vcn, vcn + 1);
    let mut runs = Vec::new();
    let state = plan_cluster(source, vcn * cs, cs, |r| runs.push(r));
    match map_runs(st, &runs) {
        Ok(()) => {
            st.view.clusters.set(vcn, vcn + 1, state);
            if state == ClusterState::Private {
                st.tracking.track(&st.view, vcn, vcn + 1);
            }
            st.counters.faults.deferred_mapped += 1;
            st.view.uffd.wake(start, cs)?;
            Ok(Resolved::Mapped)
        }
        Err((e, halfway)) => {
            let copied = &mut st.counters.faults.deferred_copied;
            if copied.is_power_of_two() || *copied == 0 {
                log::warn!("cluster {vcn}: not mapped ({e}), its data copied into the region");
            }
            *copied += 1;
            if halfway {
                // Back to an empty, registered hole, so that the copy
                // fills every page of it.
                st.view
                    .mapping
                    .map_anon(vcn * cs, cs)
                    .map_err(|source| MonitorError::Restore { vcn, source })?;
                st.view.uffd.register_missing(start, cs)?;
            }
            let image = open_image(&st.image, start)?;
            let mut data = vec![0u8; cs as usize];
            image
                .read_at(&mut data, vcn * cs)
                .map_err(|source| MonitorError::ReadCluster { vcn, source })?;
            st.view.uffd.copy(start, &data)?;
            st.view.clusters.set(vcn, vcn + 1, ClusterState::Zero);
            Ok(Resolved::Copied)
        }
    }
}

/// How far past a deferred cluster's fault a guest reading in order gets
/// the clusters the open left unmapped resolved too (Linux reads ahead
/// 128 KiB of a file by default; a fault here costs 30-150 us).
pub const READ_AHEAD_BYTES: u64 = 256 << 10;

/// After the fault that resolved deferred cluster `vcn`: when it is the
/// cluster a guest reading in order would fault in next (the one after
/// the last such fault, or after what that one read ahead), resolves the
/// deferred clusters after it, up to [`READ_AHEAD_BYTES`] (at least one
/// cluster), as their own faults would have. A guest reading at random
/// seldom faults there, and so gets little it did not ask for.
fn read_ahead(st: &mut RegionState, vcn: u64) -> Result<(), MonitorError> {
    if vcn != st.read_ahead_next {
        st.read_ahead_next = vcn.saturating_add(1);
        return Ok(());
    }
    let ahead = (READ_AHEAD_BYTES / st.view.cs).max(1);
    let end = vcn
        .saturating_add(1)
        .saturating_add(ahead)
        .min(st.view.clusters.len());
    st.read_ahead_next = end;
    for c in vcn + 1..end {
        if st.view.clusters.get(c) != ClusterState::Hole {
            continue;
        }
        let Writable::Open(image) = &st.image else {
            break;
        };
        match image.cluster_source(c) {
            ClusterSource::Hole => {}
            source => {
                map_held(st, c, source)?;
                st.counters.faults.deferred_ahead += 1;
            }
        }
    }
    Ok(())
}

/// Maps the planned `runs` of one cluster; on an error, says whether some
/// were mapped already. Private runs ask the mapping budget for all of
/// them first (a shared one asks in [`crate::mapping::Reservation::map_file`]),
/// so a refusal maps nothing.
fn map_runs(st: &RegionState, runs: &[Run]) -> Result<(), (std::io::Error, bool)> {
    let image = open_image(
        &st.image,
        st.view.base() + runs.first().map_or(0, |r| r.offset),
    )
    .map_err(|e| (std::io::Error::other(e), false))?;
    let files = image.chain_files();
    let mapping = &st.view.mapping;
    let private = runs
        .iter()
        .filter(|r| !matches!(r.kind, RunKind::File { shared: true, .. }))
        .count() as u64;
    if !mapping.admit(private) {
        return Err((std::io::Error::from_raw_os_error(libc::ENOMEM), false));
    }
    for (i, r) in runs.iter().enumerate() {
        let done = match r.kind {
            RunKind::File {
                depth,
                offset,
                shared,
            } => match files.get(depth) {
                Some(f) => mapping.map_file(r.offset, r.len, f.as_raw_fd(), offset, shared),
                None => Err(std::io::Error::other(format!(
                    "no file at depth {depth} of the chain"
                ))),
            },
            RunKind::Anon => mapping.map_anon(r.offset, r.len),
            RunKind::Hole => Ok(()),
        };
        done.map_err(|e| (e, i > 0))?;
    }
    Ok(())
}

/// What a write fault's mapping did.
#[derive(Debug, Clone, Copy)]
struct Fresh {
    /// The allocation grew the file itself (the pool was empty).
    grew: bool,
    /// Hole clusters of the window mapped besides the faulting one.
    ahead: u64,
}

/// The hole clusters a write fault at hole `vcn` fills, ascending: `vcn`
/// alone, or every hole of its expansion window once the guest has
/// written into that window (a cluster of it is the active layer's,
/// mapped shared), or when `vcn` opens the window right after such a
/// cluster of the window before (a writer going forward across the
/// boundary). Zero-mapped and private clusters are never taken: they may
/// hold pages the guest wrote, which a remap would drop.
fn fill_targets(st: &RegionState, vcn: u64) -> Vec<u64> {
    let w = st.expand_window;
    if w <= 1 {
        return vec![vcn];
    }
    let first = vcn - vcn % w;
    let end = first.saturating_add(w).min(st.view.clusters.len());
    let clusters = &st.view.clusters;
    let continues = vcn == first && vcn > 0 && clusters.get(vcn - 1) == ClusterState::Shared;
    if !continues && !(first..end).any(|c| clusters.get(c) == ClusterState::Shared) {
        return vec![vcn];
    }
    // Holes the image holds data for are mapped by their own fault.
    let empty = |c: u64| match &st.image {
        Writable::Open(image) => matches!(image.cluster_source(c), ClusterSource::Hole),
        _ => true,
    };
    (first..end)
        .filter(|&c| c == vcn || (clusters.get(c) == ClusterState::Hole && empty(c)))
        .collect()
}

/// At most `room` of `targets` (ascending, holding `vcn`), `vcn` always
/// among them: those after it first (writers tend to go forward), then
/// those before.
fn within_pool(targets: &[u64], vcn: u64, room: u64) -> Vec<u64> {
    let room = usize::try_from(room).unwrap_or(usize::MAX).max(1);
    if targets.len() <= room {
        return targets.to_vec();
    }
    let at = targets.iter().position(|&t| t == vcn).unwrap_or(0);
    let end = (at + room).min(targets.len());
    targets[end - room..end].to_vec()
}

/// Allocates the active cluster for hole `vcn`, and for the other holes of
/// its window when [`fill_targets`] says so, and maps them shared (one
/// mapping per run of consecutive clusters of the file, which allocation
/// in ascending order makes one run in the common case). The neighbours
/// are best effort: one that cannot be allocated or mapped stays a hole,
/// and the fault fails only for `vcn`'s own cluster.
fn map_fresh(st: &mut RegionState, vcn: u64) -> Result<Fresh, NoCluster> {
    let targets = fill_targets(st, vcn);
    let image = match &mut st.image {
        Writable::Open(i) => i,
        Writable::Switching => {
            return Err(NoCluster::NoImage {
                vcn,
                source: NoImage::Switching,
            })
        }
        Writable::Detached(why) => {
            return Err(NoCluster::NoImage {
                vcn,
                source: NoImage::Detached(why.clone()),
            })
        }
    };
    st.pool.before_allocation(image);
    // The pool's shortfall starts at the file's end: an allocation that
    // moves it (or fills the pool whole) grew the file itself.
    let end_before = image.pool_shortfall().map(|(at, _)| at);
    // Neighbours take only what the pool holds above its low water mark,
    // the metadata segments they start counted: growing the file for
    // clusters nobody wrote yet would put the slow path of a dry pool into
    // this fault, and draining the pool would put it into the next ones.
    let room = image.data_clusters_within(st.pool.spare_clusters(image));
    let targets = within_pool(&targets, vcn, room);
    let cs = st.view.cs;
    let mut runs: Vec<FileRun> = Vec::new();
    let mut has_vcn = false;
    for &t in &targets {
        match image.active_cluster(t) {
            Ok(ac) if ac.whole => {
                push_run(&mut runs, FileRun::one(t, ac.file_offset, cs));
                has_vcn |= t == vcn;
            }
            Ok(_) if t == vcn => return Err(NoCluster::Partial { vcn }),
            Err(source) if t == vcn => return Err(NoCluster::Image { vcn, source }),
            Ok(_) => break,
            Err(e) => {
                log::debug!("cluster {t}: not allocated ahead of cluster {vcn}: {e}");
                break;
            }
        }
    }
    if !has_vcn {
        // A neighbour before `vcn` could not be allocated: the fault still
        // needs its own cluster.
        let ac = image
            .active_cluster(vcn)
            .map_err(|source| NoCluster::Image { vcn, source })?;
        if !ac.whole {
            return Err(NoCluster::Partial { vcn });
        }
        push_run(&mut runs, FileRun::one(vcn, ac.file_offset, cs));
    }
    let grew = end_before.is_some() && image.pool_shortfall().map(|(at, _)| at) != end_before;
    let fd = top_fd(image).map_err(|source| NoCluster::Map { vcn, source })?;
    // `vcn`'s own run first: when it cannot be mapped, nothing else is
    // (the others stay allocated holes), so the fault's zeros fallback
    // leaves the counters exact.
    runs.sort_by_key(|r| !(r.vcn..r.end).contains(&vcn));
    let mut ahead = 0;
    for r in runs {
        let holds_vcn = (r.vcn..r.end).contains(&vcn);
        match st.view.map_clusters(r.vcn, r.end, fd, r.offset, true) {
            Ok(()) => ahead += r.end - r.vcn - u64::from(holds_vcn),
            Err(source) if holds_vcn => return Err(NoCluster::Map { vcn, source }),
            // Allocated but still a hole: its own fault maps it later.
            Err(e) => log::debug!(
                "clusters {}..{}: not mapped ahead of cluster {vcn}: {e}",
                r.vcn,
                r.end
            ),
        }
    }
    Ok(Fresh { grew, ahead })
}

#[cfg(test)]
mod tests {
    use super::within_pool;

    #[test]
    fn a_short_pool_keeps_the_faulting_cluster_and_what_follows_it() {
        let t: Vec<u64> = (10..20).collect();
        assert_eq!(within_pool(&t, 12, 100), t);
        assert_eq!(within_pool(&t, 12, 3), vec![12, 13, 14]);
        // Near the window's end the rest comes from before the fault.
        assert_eq!(within_pool(&t, 18, 4), vec![16, 17, 18, 19]);
        // An empty pool still allocates the faulting cluster.
        assert_eq!(within_pool(&t, 15, 0), vec![15]);
    }
}
