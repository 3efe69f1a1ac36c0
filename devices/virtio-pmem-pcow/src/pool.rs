//! The pre-allocation worker: keeps the image's pool of reserved clusters
//! full off the fault path, so that a write fault takes a cluster that is
//! already backed by the file system instead of calling `fallocate` itself.
//!
//! The protocol ([`pcow::Image::pool_shortfall`] /
//! [`pcow::Image::pool_reserved`]):
//!
//! 1. after serving faults (or a barrier), the monitor asks the image what
//!    range of the file the pool lacks; when a quarter of the pool or more
//!    is used and no request is in flight, it hands that range to the
//!    worker;
//! 2. the worker, a thread owning its own handle of the top file (a
//!    `try_clone`: same open file description), `fallocate`s the range in
//!    pieces of 256 KiB (or one larger cluster), posts each piece as it is
//!    reserved, and signals an eventfd when the range is done;
//! 3. the monitor, when the eventfd is readable or whenever it serves
//!    faults, takes the pieces posted so far and tells the image: only a
//!    piece that continues the file exactly is taken (a fault that ran the
//!    pool dry may have grown the file itself meanwhile, and the worker's
//!    piece is then inside what the fault reserved). A long refill thus
//!    feeds faults from its first piece on.
//!
//! A write fault that finds the pool dry while a refill is under way waits
//! for the worker's next piece ([`PoolCtl::before_allocation`], at most
//! [`PIECE_WAIT`]) instead of growing the file itself: file systems
//! serialize `fallocate` calls on one file (tmpfs and ext4 hold the inode
//! lock across the call), so the fault's own `fallocate` would wait for the
//! worker's piece anyway and then pay its own on top. Such a fault also
//! doubles the pool, up to [`MAX_GROWTH`] times its configured size and
//! at most a quarter of the device ([`growth_limit`]): a
//! guest whose first writes outrun the worker gets a deeper pool for its
//! next burst (on tmpfs, reserving 2 MiB allocates 512 pages, about 0.75 ms
//! here, while a fault that maps a reserved cluster takes 0.03-0.1 ms).
//!
//! A failed `fallocate` (ENOSPC) is reported, not retried in a loop: the
//! same range is not asked for again until the shortfall changes (a fault
//! that manages to grow the file inline, once space was freed, changes
//! it). A fault that then needs a cluster fails to grow the file, gets
//! zeros (the monitor's fallback) and the condition shows in the device's
//! status for the VMM.
//!
//! The worker's handle shares the writer's open file description, and so
//! its `flock`: it must be closed (the worker stopped and joined) before
//! the image closes or anyone reopens it. `PoolCtl::stop` does that and
//! takes the last completions, so that the image's idea of its length
//! covers everything the worker extended.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pcow::LiveImage;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::health::Failure;
use crate::thread_hook::{self, DeviceThread, ThreadHook};

/// A refill the worker could not reserve.
#[derive(Debug, thiserror::Error)]
#[error("{}: pre-allocating {len} bytes at {offset:#x}", path.display())]
pub(crate) struct ReserveError {
    path: PathBuf,
    offset: u64,
    len: u64,
    #[source]
    source: io::Error,
}

/// The smallest default pool in bytes (the library's pool size).
pub const DEFAULT_POOL_MIN_BYTES: u64 = 4 << 20;

/// The largest default pool in bytes, unless [`DEFAULT_POOL_MIN_CLUSTERS`]
/// needs more.
pub const DEFAULT_POOL_MAX_BYTES: u64 = 64 << 20;

/// What a write fault that finds the pool empty reserves beyond its own
/// cluster when a worker refills the pool (the rest is the worker's).
const INLINE_BYTES: u64 = 4 << 20;

/// How long a write fault that finds the pool dry waits for the worker's
/// next piece before it grows the file itself. A piece of 2 MiB (a
/// cluster of 2 MiB) takes 0.5-3 ms on tmpfs here (memory allocation),
/// well under 0.1 ms on ext4;
/// the bound is for a worker that does not get a CPU.
pub(crate) const PIECE_WAIT: Duration = Duration::from_millis(10);

/// The most a barrier waits for the worker's piece in flight before it
/// holds the writers ([`Quiet::settle`]): far longer than a piece takes
/// (milliseconds, hundreds under emulation), bounded for a worker that
/// died in one.
const SETTLE_WAIT: Duration = Duration::from_secs(2);

/// How many times its configured size the pool may grow to when faults
/// find it dry (at most a quarter of the device: [`growth_limit`]).
pub(crate) const MAX_GROWTH: u64 = 4;

/// The most a pool of `pool_clusters` grows to on a device of
/// `device_clusters`: [`MAX_GROWTH`] times its size, and no more than a
/// quarter of the device unless it starts larger. A default pool of a
/// sixteenth deepens to a quarter; one that [`DEFAULT_POOL_MIN_CLUSTERS`]
/// starts deeper (large clusters) deepens to a quarter too, so the most a
/// pool holds (on tmpfs, in memory) is what it was before that minimum.
pub(crate) fn growth_limit(pool_clusters: u64, device_clusters: u64) -> u64 {
    pool_clusters
        .saturating_mul(MAX_GROWTH)
        .min(device_clusters / 4)
        .max(pool_clusters)
}

/// The fewest clusters a default pool holds, unless that is more than a
/// quarter of the device (what a default pool may deepen to anyway:
/// [`MAX_GROWTH`] times a sixteenth). A burst of first writes is counted
/// in faults, not bytes: `mkfs.ext4` of a 64 GiB device writes into 48
/// clusters of 2 MiB scattered over it, a writer that touches one byte per
/// cluster takes one every 60 µs here, and the worker reserves a 2 MiB
/// cluster on tmpfs in 0.35 ms. With 2 MiB clusters the 64 MiB cap is 32
/// clusters: a burst of 64 ran it dry before the worker had reserved ten,
/// and 16-35 of its faults waited 0.5-0.9 ms each for the worker
/// (docs/pmem-benchmarks.md, "A pool of at least 64 clusters").
pub const DEFAULT_POOL_MIN_CLUSTERS: u64 = 64;

/// Clusters a device of `virtual_size` with clusters of `cluster_size`
/// pre-allocates by default: a sixteenth of the device, between 4 and
/// 64 MiB, and at least [`DEFAULT_POOL_MIN_CLUSTERS`] where those are at
/// most a quarter of the device. A pool of a few clusters does not outlast
/// a burst of first writes while the worker reserves the next range; the
/// pool costs its size in the file (on tmpfs, in memory) until the image
/// closes.
pub fn default_pool_clusters(virtual_size: u64, cluster_size: u64) -> u64 {
    let cs = cluster_size.max(1);
    let bytes = (virtual_size / 16).clamp(DEFAULT_POOL_MIN_BYTES, DEFAULT_POOL_MAX_BYTES);
    let fewest = DEFAULT_POOL_MIN_CLUSTERS.min(virtual_size / 4 / cs);
    (bytes / cs).max(fewest).max(1)
}

/// How a device keeps its pool of pre-allocated clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolOptions {
    /// Refill the pool from a worker thread (the default). Without it, the
    /// write fault that runs the pool dry refills it inline.
    pub worker: bool,
    /// Clusters used before a refill is requested; default a quarter of
    /// the pool (at least 1).
    pub low_water: Option<u64>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            worker: true,
            low_water: None,
        }
    }
}

impl PoolOptions {
    /// No worker: faults refill the pool inline (the old behaviour).
    pub fn inline() -> Self {
        PoolOptions {
            worker: false,
            low_water: None,
        }
    }
}

/// The pool as the API reports it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PoolStatus {
    /// A worker thread refills the pool.
    pub worker: bool,
    /// Clusters the pool holds when full: the configured size, doubled
    /// each time a write fault found the pool dry, up to four times it (and
    /// at most a quarter of the device, unless configured larger).
    pub pool_clusters: u64,
    /// Reserved clusters not yet used (at least; exact unless the pool was
    /// shrunk).
    pub free_clusters: u64,
    /// A refill is being reserved by the worker now.
    pub in_flight: bool,
    /// Refills the worker finished (ranges asked for and reserved).
    pub refills: u64,
    /// Bytes of the refills' pieces the image took.
    pub refill_bytes: u64,
    /// Pieces the worker reserved that the image no longer needed.
    pub stale_refills: u64,
    /// Write faults that had to grow the file themselves (the pool was
    /// empty): each paid for a `fallocate` while the writer waited.
    pub inline_allocations: u64,
    /// Write faults that found the pool dry and waited for the worker's
    /// next piece instead.
    pub piece_waits: u64,
    /// Refills that failed (`fallocate` errors such as ENOSPC).
    pub failures: u64,
}

/// One piece of a request, reserved or failed.
#[derive(Debug)]
struct Done {
    offset: u64,
    len: u64,
    result: io::Result<()>,
    /// The request's last piece (or the one that failed): the worker is
    /// idle after it.
    last: bool,
}

#[derive(Debug, Default)]
struct ChanState {
    request: Option<(u64, u64)>,
    stop: bool,
    /// A barrier runs: the worker starts no `fallocate` (stopping
    /// overrides it).
    quiet: bool,
    /// The worker is in a piece's `fallocate` (and holds the file's inode
    /// lock, which every `pwrite` to the image waits for).
    reserving: bool,
    done: Vec<Done>,
}

impl ChanState {
    /// The worker is in a piece and not stopped.
    fn in_piece(&self) -> bool {
        self.reserving && !self.stop
    }
}

/// Between the device and its worker thread.
#[derive(Debug, Default)]
struct Chan {
    state: Mutex<ChanState>,
    /// The worker waits on it for a request, the end of a quiet time or
    /// the stop.
    cv: Condvar,
    /// A fault that found the pool dry waits on it for the next piece.
    piece: Condvar,
}

impl Chan {
    fn lock(&self) -> MutexGuard<'_, ChanState> {
        // The state is plain data, valid after any panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Before a piece: waits while a barrier runs, then marks the worker
    /// reserving (in the same lock, so a barrier that asks for quiet
    /// after it sees the piece and waits for it); returns whether the
    /// worker is stopped (and then reserves nothing).
    fn start_piece(&self) -> bool {
        let mut s = self.lock();
        while s.quiet && !s.stop {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.reserving = !s.stop;
        s.stop
    }

    /// Posts a reserved (or failed) piece and wakes a fault waiting for it
    /// and a barrier waiting for the piece to end.
    fn post(&self, d: Done) {
        let mut s = self.lock();
        s.done.push(d);
        s.reserving = false;
        drop(s);
        self.piece.notify_all();
        self.cv.notify_all();
    }

    /// Waits until no piece is in flight (or the worker is stopped), at
    /// most `bound`: a worker that died in a piece must not hang the
    /// barrier (which then writes, and waits in the file system if the
    /// piece is really still in flight). Returns whether it settled.
    fn settle(&self, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        let mut s = self.lock();
        while s.in_piece() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s = self
                .cv
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    fn set_quiet(&self, quiet: bool) {
        self.lock().quiet = quiet;
        self.cv.notify_all();
    }
}

/// While it lives, the worker starts no new piece of a refill (see
/// [`PoolCtl::quiet`]).
#[derive(Debug)]
pub(crate) struct Quiet(Option<Arc<Chan>>);

impl Quiet {
    /// Whether the worker is in a piece now (its `fallocate` holds the
    /// inode lock). While this lives no new piece starts, so once false it
    /// stays false.
    pub(crate) fn piece_in_flight(&self) -> bool {
        self.0.as_ref().is_some_and(|c| c.lock().in_piece())
    }

    /// Waits for the worker's piece in flight, if any: after it, a
    /// `pwrite` to the image does not wait for the worker (it starts no
    /// new piece while this lives). A barrier settles before it holds the
    /// writers, so that they do not wait for the piece too.
    pub(crate) fn settle(&self) {
        if let Some(c) = &self.0 {
            if !c.settle(SETTLE_WAIT) {
                log::warn!(
                    "the pool worker's piece did not end within {SETTLE_WAIT:?}; the barrier goes on"
                );
            }
        }
    }
}

impl Drop for Quiet {
    fn drop(&mut self) {
        if let Some(c) = &self.0 {
            c.set_quiet(false);
        }
    }
}

#[derive(Debug)]
struct Worker {
    chan: Arc<Chan>,
    handle: JoinHandle<()>,
}

/// The most one `fallocate` of the worker reserves, unless a cluster is
/// larger. File systems hold the inode's lock across the call, and every
/// `pwrite` to the image waits for it (a barrier's copied pages, a
/// commit's slots and header): on tmpfs, where reserving allocates every
/// page, a piece of 2 MiB holds it for 0.35-0.75 ms here and 8-18 ms
/// under the nested sandbox's emulation, a piece of 256 KiB an eighth of
/// that. Smaller pieces cost the worker more calls, not more work.
const RESERVE_PIECE: u64 = 256 << 10;

/// The shortest piece a commit writes beside instead of waiting for
/// ([`PoolCtl::long_pieces`]). A store through a mapping costs 4-6 times a
/// `pwrite` of a page (27 against 6 us on this host's tmpfs, 230 against
/// 40 us in the nested sandbox's L1: `pcow/examples/beside_fallocate.rs`).
/// Reserving 2 MiB of tmpfs takes 0.35-0.75 ms here; waiting for the rest
/// of a 256 KiB piece, an eighth of that, costs about what the mapping
/// does (docs/pmem-benchmarks.md, "Commits beside the pool worker's
/// piece").
const LONG_PIECE: u64 = 1 << 20;

/// The worker's piece for clusters of `cs` bytes: [`RESERVE_PIECE`], or
/// one cluster when a cluster is larger (the image takes whole clusters).
fn piece_bytes(cs: u64) -> u64 {
    if cs >= RESERVE_PIECE {
        cs
    } else {
        RESERVE_PIECE - RESERVE_PIECE % cs.max(1)
    }
}

/// `fallocate` of `[offset, offset + len)` in pieces of at most `piece`
/// bytes ([`piece_bytes`]), as the library's storage does it (a file system
/// without fallocate gets the file extended instead), each posted to the
/// channel when done. Before each piece, waits while a barrier runs
/// ([`PoolCtl::quiet`]); stops early when the worker is stopped.
fn reserve(file: &File, offset: u64, len: u64, piece: u64, chan: &Chan) {
    let Some(end) = offset.checked_add(len) else {
        chan.post(Done {
            offset,
            len,
            result: Err(io::Error::from_raw_os_error(libc::EFBIG)),
            last: true,
        });
        return;
    };
    let mut at = offset;
    while at < end {
        if chan.start_piece() {
            return;
        }
        let n = (end - at).min(piece);
        let result = reserve_piece(file, at, n);
        let last = result.is_err() || at + n == end;
        chan.post(Done {
            offset: at,
            len: n,
            result,
            last,
        });
        if last {
            return;
        }
        at += n;
    }
}

fn reserve_piece(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(off), Ok(l)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(io::Error::from_raw_os_error(libc::EFBIG));
    };
    loop {
        // SAFETY: fallocate only reads its integer arguments; `file` is
        // open for the call.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, off, l) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP) => {
                if offset + len > file.metadata()?.len() {
                    file.set_len(offset + len)?;
                }
                return Ok(());
            }
            _ => return Err(e),
        }
    }
}

fn worker_loop(file: File, piece: u64, chan: Arc<Chan>, efd: Arc<EventFd>) {
    loop {
        let (offset, len) = {
            let mut s = chan.lock();
            loop {
                if s.stop {
                    return;
                }
                if let Some(r) = s.request.take() {
                    break r;
                }
                s = chan.cv.wait(s).unwrap_or_else(|e| e.into_inner());
            }
        };
        reserve(&file, offset, len, piece, &chan);
        if let Err(e) = efd.write(1) {
            // Only EAGAIN (counter at its maximum) is possible, and then
            // the fd is readable anyway.
            log::debug!("pool eventfd: {e}");
        }
    }
}

/// The device's side of the pool: the worker, its eventfd and counters.
/// Lives next to the region state, under the same lock.
#[derive(Debug)]
pub(crate) struct PoolCtl {
    efd: Option<Arc<EventFd>>,
    worker: Option<Worker>,
    in_flight: bool,
    cs: u64,
    pool_clusters: u64,
    /// The most `pool_clusters` grows to ([`growth_limit`]).
    max_clusters: u64,
    /// Clusters used before a refill is requested; a quarter of the pool
    /// unless the options set it.
    low_water: u64,
    low_water_fixed: bool,
    stats: PoolStatus,
    /// The last refill or allocation failure, cleared by a refill that
    /// succeeds.
    error: Option<Failure>,
    /// The range whose reservation failed last: not asked for again until
    /// the shortfall changes (a fault that gets a cluster inline after
    /// space was freed changes it), so a full disk costs one failed
    /// `fallocate` per change, not one per fault.
    failed: Option<(u64, u64)>,
    /// Runs first on each worker thread.
    hook: Option<ThreadHook>,
}

impl PoolCtl {
    /// A pool for clusters of `cs` bytes, `pool_clusters` of them when full,
    /// on a device of `device_clusters`.
    /// Creates the eventfd (stable across worker restarts: the VMM
    /// registers it once); the worker starts with [`PoolCtl::start`].
    /// Without an eventfd (logged) the pool refills inline.
    pub(crate) fn new(
        opts: &PoolOptions,
        cs: u64,
        pool_clusters: u64,
        device_clusters: u64,
        hook: Option<ThreadHook>,
    ) -> PoolCtl {
        let efd = match opts
            .worker
            .then(|| EventFd::new(EFD_NONBLOCK | libc::EFD_CLOEXEC))
        {
            Some(Ok(e)) => Some(Arc::new(e)),
            Some(Err(e)) => {
                log::warn!("no pre-allocation worker (eventfd: {e}), the pool refills inline");
                None
            }
            None => None,
        };
        PoolCtl {
            efd,
            worker: None,
            in_flight: false,
            cs,
            pool_clusters,
            max_clusters: growth_limit(pool_clusters, device_clusters),
            low_water: opts
                .low_water
                .unwrap_or(pool_clusters / 4)
                .clamp(1, pool_clusters.max(1)),
            low_water_fixed: opts.low_water.is_some(),
            stats: PoolStatus {
                pool_clusters,
                ..PoolStatus::default()
            },
            error: None,
            failed: None,
            hook,
        }
    }

    pub(crate) fn efd(&self) -> Option<Arc<EventFd>> {
        self.efd.clone()
    }

    /// Starts a worker on its own handle of `image`'s file (no-op without
    /// a worker, or when one runs).
    pub(crate) fn start(&mut self, image: &LiveImage) -> io::Result<()> {
        let Some(efd) = self.efd.clone() else {
            return Ok(());
        };
        if self.worker.is_some() {
            return Ok(());
        }
        let file = image
            .file()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?
            .try_clone()?;
        let chan = Arc::new(Chan::default());
        let c = chan.clone();
        let piece = piece_bytes(self.cs);
        let handle = thread_hook::spawn(
            "pcow-pool".into(),
            DeviceThread::Pool,
            self.hook.clone(),
            move || worker_loop(file, piece, c, efd),
        )?;
        self.worker = Some(Worker { chan, handle });
        self.in_flight = false;
        Ok(())
    }

    /// Stops and joins the worker (its file handle closes with it) and
    /// gives its last completions to `image`.
    pub(crate) fn stop(&mut self, image: &mut LiveImage) {
        let Some(w) = self.worker.take() else {
            return;
        };
        {
            let mut s = w.chan.lock();
            s.stop = true;
            s.request = None;
        }
        w.chan.cv.notify_all();
        if w.handle.join().is_err() {
            log::error!("pool worker panicked");
        }
        let done = std::mem::take(&mut w.chan.lock().done);
        self.take_done(done, image);
        self.in_flight = false;
    }

    /// Gives the pieces the worker reserved so far to `image`; returns how
    /// many.
    pub(crate) fn apply(&mut self, image: &mut LiveImage) -> usize {
        let Some(w) = &self.worker else {
            return 0;
        };
        let done = std::mem::take(&mut w.chan.lock().done);
        self.take_done(done, image)
    }

    /// Gives posted pieces to `image`; returns how many pieces.
    fn take_done(&mut self, done: Vec<Done>, image: &mut LiveImage) -> usize {
        let n = done.len();
        for d in done {
            if d.last {
                self.in_flight = false;
            }
            match d.result {
                Ok(()) => {
                    if d.last {
                        self.stats.refills += 1;
                    }
                    if image.pool_reserved(d.offset, d.len) {
                        self.stats.refill_bytes += d.len;
                        self.error = None;
                        self.failed = None;
                    } else {
                        self.stats.stale_refills += 1;
                    }
                }
                Err(source) => {
                    self.stats.failures += 1;
                    let e = Failure::new(ReserveError {
                        path: image.path().to_owned(),
                        offset: d.offset,
                        len: d.len,
                        source,
                    });
                    if self.error.is_none() {
                        log::error!("{}", error_report::chain(&e));
                    }
                    self.error = Some(e);
                    self.failed = Some((d.offset, d.len));
                }
            }
        }
        n
    }

    /// Asks the worker to refill when the pool is low and no request is in
    /// flight. Returns whether a request was made.
    pub(crate) fn request(&mut self, image: &LiveImage) -> bool {
        let Some(w) = &self.worker else {
            return false;
        };
        if self.in_flight {
            return false;
        }
        let Some((offset, len)) = image.pool_shortfall() else {
            return false;
        };
        if len / self.cs < self.low_water || self.failed == Some((offset, len)) {
            return false;
        }
        w.chan.lock().request = Some((offset, len));
        w.chan.cv.notify_one();
        self.in_flight = true;
        true
    }

    /// Clusters the pool can give beyond what one fault needs without
    /// running it low: what it holds above its low water mark (an
    /// expansion window takes only these, so that the faults after it
    /// still find clusters while the worker refills).
    pub(crate) fn spare_clusters(&self, image: &LiveImage) -> u64 {
        self.free_clusters(image).saturating_sub(self.low_water)
    }

    /// Clusters the pool holds now (reserved, not yet used).
    fn free_clusters(&self, image: &LiveImage) -> u64 {
        let missing = image.pool_shortfall().map_or(0, |(_, len)| len / self.cs);
        self.pool_clusters.saturating_sub(missing)
    }

    /// Before a write fault allocates a cluster: takes the pieces reserved
    /// so far, and when the pool is still dry while the worker refills it,
    /// waits for the next piece (at most [`PIECE_WAIT`] in all) rather
    /// than let the fault grow the file itself, and deepens the pool (see
    /// the module's documentation). Without a worker, or when the worker
    /// cannot help (its refill failed, a barrier keeps it quiet), returns
    /// at once: the allocation then grows the file inline.
    pub(crate) fn before_allocation(&mut self, image: &mut LiveImage) {
        if self.worker.is_none() {
            return;
        }
        self.apply(image);
        if self.free_clusters(image) > 0 {
            return;
        }
        self.grow(image);
        self.request(image);
        let Some(w) = &self.worker else {
            return;
        };
        let chan = w.chan.clone();
        let deadline = Instant::now() + PIECE_WAIT;
        let mut waited = false;
        while self.in_flight && self.free_clusters(image) == 0 {
            let done = {
                let mut s = chan.lock();
                loop {
                    // A barrier sets the quiet time under the state lock,
                    // which the fault holds: it is never set here, but a
                    // quiet worker would not post anything.
                    if !s.done.is_empty() || s.quiet || s.stop {
                        break;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        break;
                    }
                    waited = true;
                    s = chan
                        .piece
                        .wait_timeout(s, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                std::mem::take(&mut s.done)
            };
            if done.is_empty() {
                break;
            }
            self.take_done(done, image);
        }
        if waited {
            self.stats.piece_waits += 1;
        }
    }

    /// Doubles the pool (up to [`growth_limit`]):
    /// a fault found it dry.
    fn grow(&mut self, image: &mut LiveImage) {
        let grown = self.pool_clusters.saturating_mul(2).min(self.max_clusters);
        if grown <= self.pool_clusters {
            return;
        }
        self.pool_clusters = grown;
        self.stats.pool_clusters = grown;
        if !self.low_water_fixed {
            self.low_water = (grown / 4).max(1);
        }
        image.set_pool_clusters(grown);
    }

    /// Whether the worker's pieces are long enough to write beside them
    /// rather than wait for them ([`pcow::Commit::beside_fallocate`]): at
    /// least [`LONG_PIECE`] bytes.
    pub(crate) fn long_pieces(&self) -> bool {
        piece_bytes(self.cs) >= LONG_PIECE
    }

    /// Keeps the worker from starting a new piece of a refill until the
    /// guard drops: a barrier's writes to the file then wait for at most
    /// the piece in flight, not for a whole refill.
    pub(crate) fn quiet(&self) -> Quiet {
        let chan = self.worker.as_ref().map(|w| w.chan.clone());
        if let Some(c) = &chan {
            c.set_quiet(true);
        }
        Quiet(chan)
    }

    /// Sets `image`'s pool to this pool's size; when a worker refills it, a
    /// fault that finds the pool empty reserves little beyond its own
    /// cluster.
    pub(crate) fn configure(&self, image: &mut LiveImage) {
        image.set_pool_clusters(self.pool_clusters);
        if self.efd.is_some() {
            image.set_inline_growth((INLINE_BYTES / self.cs).max(1));
        }
    }

    /// A write fault grew the file itself.
    pub(crate) fn note_inline(&mut self) {
        self.stats.inline_allocations += 1;
    }

    /// A write fault could not get a cluster.
    pub(crate) fn note_failure(&mut self, e: Failure) {
        self.error = Some(e);
    }

    /// The last refill or allocation failure.
    pub(crate) fn error(&self) -> Option<Failure> {
        self.error.clone()
    }

    pub(crate) fn status(&self, image: &LiveImage) -> PoolStatus {
        PoolStatus {
            worker: self.worker.is_some(),
            free_clusters: self.free_clusters(image),
            in_flight: self.in_flight,
            ..self.stats.clone()
        }
    }
}

impl Drop for PoolCtl {
    fn drop(&mut self) {
        // Normally stopped by the device state (which gives the last
        // completions to the image); never leave the thread behind.
        if let Some(w) = self.worker.take() {
            w.chan.lock().stop = true;
            w.chan.cv.notify_all();
            let _ = w.handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        default_pool_clusters, growth_limit, piece_bytes, Chan, Done, Quiet, RESERVE_PIECE,
    };
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn done() -> Done {
        Done {
            offset: 0,
            len: 0,
            result: Ok(()),
            last: false,
        }
    }

    #[test]
    fn a_default_pool_holds_a_sixteenth_and_at_least_64_clusters_within_a_quarter() {
        const K64: u64 = 64 << 10;
        const M2: u64 = 2 << 20;
        const GIB: u64 = 1 << 30;
        // (device, cluster) -> clusters
        for (size, cs, want) in [
            // A sixteenth between 4 and 64 MiB, as before, where that is
            // 64 clusters or more.
            (GIB, K64, 1024),
            (64 * GIB, K64, 1024),
            (64 << 20, K64, 64),
            // 2 MiB clusters: 64 of them (128 MiB), not the 32 of 64 MiB.
            (GIB, M2, 64),
            (64 * GIB, M2, 64),
            // ... unless that is more than a quarter of the device.
            (256 << 20, M2, 32),
            (64 << 20, M2, 8),
            (4 << 20, M2, 2),
            // Never empty, whatever the sizes.
            (2 << 20, M2, 2),
            (0, M2, 2),
            (GIB, 0, 64 << 20),
        ] {
            assert_eq!(
                default_pool_clusters(size, cs),
                want,
                "device {size} clusters of {cs}"
            );
        }
    }

    #[test]
    fn a_pool_deepens_to_four_times_its_size_within_a_quarter_of_the_device() {
        // (pool, device) -> most
        for (pool, device, most) in [
            // A sixteenth of the device: four times it is a quarter.
            (1024, 16384, 4096),
            (32, 512, 128),
            // 64 clusters of 2 MiB on 1 GiB: a quarter, as a sixteenth
            // deepened to before.
            (64, 512, 128),
            // A small pool on a large device: four times.
            (1, 32, 4),
            (64, 32768, 256),
            // Configured larger than a quarter: it keeps its size.
            (300, 512, 300),
            (8, 8, 8),
            (1, 0, 1),
        ] {
            assert_eq!(growth_limit(pool, device), most, "pool {pool} of {device}");
        }
    }

    #[test]
    fn a_quiet_barrier_settles_after_the_piece_in_flight_and_no_new_piece_starts() {
        let chan = Arc::new(Chan::default());
        assert!(!chan.start_piece(), "not stopped");
        let c = chan.clone();
        let worker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            c.post(done());
            // The next piece waits for the quiet time to end.
            let stopped = c.start_piece();
            c.post(done());
            stopped
        });
        chan.set_quiet(true);
        let quiet = Quiet(Some(chan.clone()));
        let t = Instant::now();
        quiet.settle();
        assert!(
            t.elapsed() >= Duration::from_millis(80),
            "settled before the piece in flight ended: {:?}",
            t.elapsed()
        );
        // Quiet: the worker's next piece has not started.
        std::thread::sleep(Duration::from_millis(50));
        assert!(!chan.lock().reserving, "a piece started while quiet");
        drop(quiet);
        assert!(!worker.join().expect("worker"), "not stopped");
        assert!(!chan.lock().reserving);
        assert_eq!(chan.lock().done.len(), 2);
        // Nothing in flight: settling returns at once.
        let t = Instant::now();
        Quiet(Some(chan.clone())).settle();
        assert!(t.elapsed() < Duration::from_millis(50));
        // A piece that never ends (a worker that died in it): the wait is
        // bounded.
        assert!(!chan.start_piece());
        let t = Instant::now();
        assert!(!chan.settle(Duration::from_millis(100)), "settled");
        assert!(t.elapsed() >= Duration::from_millis(100));
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_piece_is_whole_clusters() {
        for shift in 12..=21 {
            let cs = 1u64 << shift;
            let p = piece_bytes(cs);
            assert_eq!(p % cs, 0, "cluster {cs}");
            assert_eq!(p, RESERVE_PIECE.max(cs), "cluster {cs}");
        }
        // Not a power of two (the format refuses it; the worker still
        // hands out whole clusters).
        assert_eq!(piece_bytes(96 << 10), 192 << 10);
    }

    #[test]
    fn only_clusters_of_a_mebibyte_or_more_make_long_pieces() {
        for (shift, long) in [
            (12, false),
            (16, false),
            (19, false),
            (20, true),
            (21, true),
        ] {
            let cs = 1u64 << shift;
            let pool = super::PoolCtl::new(&super::PoolOptions::default(), cs, 4, 1 << 20, None);
            assert_eq!(pool.long_pieces(), long, "cluster {cs}");
        }
    }
}
