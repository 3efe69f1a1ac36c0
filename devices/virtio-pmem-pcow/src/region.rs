//! [`PcowRegion`], what a VMM holds for a pcow-backed device: the region
//! (for the memslot), the barrier behind FLUSH ([`crate::barrier`]), live
//! snapshots and overlays ([`crate::overlay`]), status and health. A thin
//! facade over the shared state ([`crate::state`]); its [`Monitor`] half
//! serves the faults ([`crate::fault`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pcow::{Image, OpenOptions, SnapshotInfo, TempOptions};

use crate::barrier::{self, after_barrier, demote_shared, BarrierError, BarrierStats};
use crate::build::{build, RegionError, RegionOptions};
use crate::clusters::ClusterState;
use crate::device::{FlushBackend, FlushError};
use crate::fault::Monitor;
use crate::fault_poll::{FaultPoll, DEFAULT_FAULT_POLL};
use crate::freeze::{self, FreezeError, FreezeInfo};
use crate::harvest::pending_pages;
use crate::health::Failure;
use crate::mapping::vmas_in;
use crate::overlay::{self, OverlayError, OverlayInfo};
use crate::pool::{PoolOptions, PoolStatus};
use crate::quiesce::Quiesce;
use crate::raw::RawRegion;
use crate::state::{BarrierTotals, FaultCounters, Shared, Writable};
use crate::write_log::WriteLog;

/// A pcow chain mapped as one host region, with its barrier.
///
/// The region stays mapped while this value or its [`Monitor`] lives.
pub struct PcowRegion {
    shared: Arc<Shared>,
    quiesce: Arc<dyn Quiesce>,
    base: u64,
    len: u64,
    cluster_size: u64,
}

impl std::fmt::Debug for PcowRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PcowRegion")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("cluster_size", &self.cluster_size)
            .finish()
    }
}

/// What the API reports about a running device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Data clusters in the image file, all layers.
    pub allocated_clusters: u64,
    /// Private pages a barrier would move now (with a write log: the
    /// pages it named in private and zero-mapped clusters, an upper bound).
    pub pending_private_pages: u64,
    /// Snapshots of the image.
    pub snapshots: Vec<SnapshotInfo>,
    /// Files in the chain (the image and its bases).
    pub chain_depth: usize,
    /// The chain's files by depth: 0 is the top (written) image, then its
    /// bases.
    pub chain: Vec<PathBuf>,
    /// Mappings (VMAs) inside the region now.
    pub vmas: u64,
    /// Mappings planned when the region was built.
    pub planned_vmas: u64,
    /// Clusters with data the open left unmapped, too scattered to map
    /// them all (their first fault maps them: see
    /// [`FaultCounters::deferred_mapped`]).
    pub deferred_at_open: u64,
    /// Clusters by state: holes, zero-mapped, private, shared.
    pub holes: u64,
    /// Former holes read as zeros.
    pub zero_mapped: u64,
    /// Clusters mapped private.
    pub private: u64,
    /// Clusters mapped shared from the writable layer.
    pub shared: u64,
    /// Monitor counters.
    pub faults: FaultCounters,
    /// The pre-allocated pool and its worker.
    pub pool: PoolStatus,
    /// The last pre-allocation or write-fault allocation failure (a full
    /// disk: the VMM may pause the guest), cleared by a refill that
    /// succeeds. While set, writes into holes may land in private memory
    /// that the next barrier fails to move.
    pub pool_error: Option<Failure>,
    /// Live overlays done on this device.
    pub overlays: u64,
    /// Set when the device lost its writable image (a failed overlay whose
    /// rollback could not reopen the old image): barriers fail.
    pub detached: Option<Failure>,
    /// Why a write fault found the file system full since the last barrier
    /// that succeeded ([`PcowRegion::out_of_space`]).
    pub out_of_space: Option<Failure>,
}

impl PcowRegion {
    /// Opens the image at `path` read-write (exclusive lock) with its base
    /// chain and builds the region; the pool has a worker.
    pub fn open(
        path: &Path,
        quiesce: Arc<dyn Quiesce>,
        opts: &RegionOptions,
    ) -> Result<(PcowRegion, Monitor), RegionError> {
        Self::open_with(path, quiesce, opts, &PoolOptions::default())
    }

    /// [`PcowRegion::open`] with a choice of pool refilling.
    pub fn open_with(
        path: &Path,
        quiesce: Arc<dyn Quiesce>,
        opts: &RegionOptions,
        pool: &PoolOptions,
    ) -> Result<(PcowRegion, Monitor), RegionError> {
        // Deferred: a region refused for its size leaves the file as it was.
        let image = Image::open(path, OpenOptions::read_write_deferred())?;
        Self::from_image_with(image, quiesce, opts, pool)
    }

    /// Builds the region of an image opened read-write; the pool has a
    /// worker.
    pub fn from_image(
        image: Image,
        quiesce: Arc<dyn Quiesce>,
        opts: &RegionOptions,
    ) -> Result<(PcowRegion, Monitor), RegionError> {
        Self::from_image_with(image, quiesce, opts, &PoolOptions::default())
    }

    /// Opens the image at `path` with its base chain read-only under
    /// shared locks, and builds the region on a temporary overlay of it
    /// (see [`Image::create_temporary`]): the guest's writes go into an
    /// unlinked file that closes with the region, the image is never
    /// written, and any number of regions may run on it at once. Barriers
    /// still move and commit the guest's writes, into the overlay, without
    /// syncs. Snapshots, snapshot deletion and live overlays are refused.
    pub fn open_discarding(
        path: &Path,
        temp: &TempOptions,
        quiesce: Arc<dyn Quiesce>,
        opts: &RegionOptions,
    ) -> Result<(PcowRegion, Monitor), RegionError> {
        let image = Image::create_temporary(path, temp)?;
        Self::from_image_with(image, quiesce, opts, &PoolOptions::default())
    }

    /// [`PcowRegion::from_image`] with a choice of pool refilling. A worker
    /// that cannot start (no eventfd, no thread) is logged and the pool is
    /// refilled inline instead.
    pub fn from_image_with(
        image: Image,
        quiesce: Arc<dyn Quiesce>,
        opts: &RegionOptions,
        pool_opts: &PoolOptions,
    ) -> Result<(PcowRegion, Monitor), RegionError> {
        let cs = image.cluster_size();
        let fault_poll = opts.fault_poll.unwrap_or(DEFAULT_FAULT_POLL);
        let st = build(image, opts, pool_opts)?;
        let uffd = st.view.uffd.clone();
        let pool_efd = st.pool.efd();
        let (base, len) = (st.view.base(), st.view.len());
        let shared = Arc::new(Shared::new(st));
        let monitor = Monitor::new(
            shared.clone(),
            uffd,
            pool_efd,
            FaultPoll::new(fault_poll),
            opts.thread_hook.clone(),
        );
        Ok((
            PcowRegion {
                shared,
                quiesce,
                base,
                len,
                cluster_size: cs,
            },
            monitor,
        ))
    }

    /// Host address of the region (2 MiB aligned): the memslot's start.
    pub fn host_addr(&self) -> *mut u8 {
        self.base as *mut u8
    }

    /// Size of the region (the image's virtual size).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never: images have a size).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The image's cluster size.
    pub fn cluster_size(&self) -> u64 {
        self.cluster_size
    }

    /// Runs a barrier: holds writers, moves private pages into the image,
    /// releases the writers, then syncs data and commits metadata without
    /// the state lock: faults are served throughout, and the guest's
    /// writes after the release belong to the next barrier.
    pub fn barrier(&self) -> Result<BarrierStats, BarrierError> {
        barrier::barrier(&self.shared, &*self.quiesce)
    }

    /// Takes a snapshot of the running device: barrier, snapshot cluster,
    /// then the writable clusters become read-only history (mapped private,
    /// same content). No data is copied. Writers and the state lock are
    /// held throughout, the commits' syncs included.
    pub fn snapshot_create(&self, tag: &str) -> Result<SnapshotInfo, BarrierError> {
        self.refuse_if_discarding()?;
        after_barrier(&self.shared, &*self.quiesce, |st| {
            let info = st.image_mut()?.snapshot_create(tag)?;
            demote_shared(st)?;
            Ok(info)
        })
    }

    /// Deletes snapshot `snap` (a tag or an id) of the running device. Only
    /// the snapshot record goes: its data stays where the guest's view (or
    /// another snapshot) still uses it, so no mapping changes. A barrier
    /// runs first, so the deletion commits only durable data. Writers and
    /// the state lock are held throughout.
    pub fn snapshot_delete(&self, snap: &str) -> Result<SnapshotInfo, BarrierError> {
        self.refuse_if_discarding()?;
        after_barrier(&self.shared, &*self.quiesce, |st| {
            Ok(st.image_mut()?.snapshot_delete(snap)?)
        })
    }

    /// Whether the guest writes into a temporary overlay
    /// ([`PcowRegion::open_discarding`]).
    pub fn is_discarding(&self) -> Result<bool, BarrierError> {
        Ok(self.lock()?.image()?.is_temporary())
    }

    /// The image operations a discarding device refuses: they would write
    /// the image, which it never writes, or a file that goes with it.
    fn refuse_if_discarding(&self) -> Result<(), BarrierError> {
        if self.is_discarding()? {
            return Err(BarrierError::Discarding);
        }
        Ok(())
    }

    /// Rollback replaces what the guest sees: refused while the device runs.
    pub fn snapshot_apply(&self, _tag: &str) -> Result<SnapshotInfo, BarrierError> {
        Err(BarrierError::LiveRollback)
    }

    /// The image's snapshots.
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>, BarrierError> {
        Ok(self.lock()?.image()?.snapshots())
    }

    /// Live overlay: the current image becomes the read-only base of a new
    /// top image at `new_file` (which must not exist), and the guest
    /// continues on it. Writers and the state lock are held throughout:
    /// a barrier, the old image closed, the overlay created, the old top's
    /// shared clusters remapped private from it. A failure after the close
    /// reopens the old image and restores the mappings; only if it cannot
    /// be reopened is the device left without a writable image
    /// ([`OverlayError::Reopen`], then [`Status::detached`]). The steps are
    /// documented in the crate's `overlay` module.
    pub fn overlay(&self, new_file: &Path) -> Result<OverlayInfo, OverlayError> {
        overlay::overlay(&self.shared, &*self.quiesce, new_file)
    }

    /// Freezes the device's top image for a VM snapshot: the image as it
    /// is now (after a barrier) keeps living, immutable, under `frozen`, a
    /// new name in its directory (a hard link: no data is copied), and
    /// the image's path names a new empty overlay over it, on which the
    /// guest continues. Writers and the state lock are held throughout.
    /// Refused before any change: `frozen` exists or is in another
    /// directory, the chain is at its depth limit, the device discards
    /// its writes. A failure later undoes the new names and reopens the
    /// image (see [`PcowRegion::overlay`] for what is left if it cannot
    /// be). The steps and the files a crash leaves are documented in the
    /// crate's `freeze` module and `docs/snapshots.md`.
    pub fn freeze(&self, frozen: &Path) -> Result<FreezeInfo, FreezeError> {
        freeze::freeze(&self.shared, &*self.quiesce, frozen)
    }

    /// Why a write fault could not get a cluster because the file system
    /// is full, if one could not since the last barrier that succeeded.
    /// The guest's writes there are held in memory until a barrier moves
    /// them: a VMM pauses the guest until space is freed.
    pub fn out_of_space(&self) -> Result<Option<Failure>, BarrierError> {
        Ok(self.lock()?.out_of_space.clone())
    }

    /// After a write fault found the file system full: reserves the
    /// image's pool again (`fallocate`), which fails with the file
    /// system's error while there is still no space. A VMM calls it before
    /// it lets a guest paused for space run again. A barrier alone proves
    /// nothing there: a write that fell back to zeros may not have reached
    /// its page yet (the vCPU was paused inside the fault), so a barrier
    /// can find nothing to move on a file system that is still full.
    pub fn reserve_space(&self) -> Result<(), BarrierError> {
        let mut st = self.lock()?;
        if st.out_of_space.is_none() {
            return Ok(());
        }
        st.image_mut()?.fill_pool()?;
        Ok(())
    }

    /// Gives the region a write log of the guest's writes (a VMM: KVM's
    /// dirty log of the region's memslot), which barriers then follow
    /// instead of scanning the page tables: the first barrier after it
    /// still scans once, for what was written before. A log that fails
    /// later makes barriers scan again until it works (see
    /// [`WriteLog::take_written`]). Replaces a log attached before.
    pub fn attach_write_log(&self, log: Arc<dyn WriteLog>) -> Result<(), BarrierError> {
        self.lock()?.tracking.attach_log(log);
        Ok(())
    }

    /// Whether a write log is attached.
    pub fn has_write_log(&self) -> Result<bool, BarrierError> {
        Ok(self.lock()?.tracking.has_log())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, crate::state::RegionState>, BarrierError> {
        self.shared.lock().map_err(|_| BarrierError::Poisoned)
    }

    /// Status for the API (does not hold writers). The state lock is held
    /// only to copy what the status reports (and to read the write log,
    /// whose pages are kept for the next barrier); the scan of the written
    /// pages and the read of the process's mappings run without it.
    pub fn status(&self) -> Result<Status, BarrierError> {
        let (mut status, scan) = {
            let mut guard = self.lock()?;
            let st = &mut *guard;
            let (allocated_clusters, snapshots, chain) = match &st.image {
                Writable::Open(image) => (
                    image.allocated_clusters(),
                    image.snapshots(),
                    image.chain_paths(),
                ),
                Writable::Switching | Writable::Detached(_) => (0, Vec::new(), Vec::new()),
            };
            let detached = match &st.image {
                Writable::Detached(why) => Some(why.clone()),
                _ => None,
            };
            let pool = match &st.image {
                Writable::Open(image) => st.pool.status(image),
                _ => PoolStatus::default(),
            };
            let count = |s| st.view.clusters.count(s);
            let status = Status {
                allocated_clusters,
                pending_private_pages: 0,
                snapshots,
                chain_depth: chain.len(),
                chain,
                vmas: 0,
                planned_vmas: st.counters.planned_vmas,
                deferred_at_open: st.counters.deferred,
                holes: count(ClusterState::Hole),
                zero_mapped: count(ClusterState::Zero),
                private: count(ClusterState::Private),
                shared: count(ClusterState::Shared),
                faults: st.counters.faults,
                pool,
                pool_error: st.pool.error(),
                overlays: st.counters.overlays,
                detached,
                out_of_space: st.out_of_space.clone(),
            };
            (status, st.tracking.pending_scan(&st.view))
        };
        status.pending_private_pages = pending_pages(&scan)?;
        status.vmas = vmas_in(self.base, self.base + self.len).map_err(BarrierError::Maps)?;
        Ok(status)
    }
}

impl PcowRegion {
    /// What the barriers that succeeded did so far.
    pub fn barrier_totals(&self) -> BarrierTotals {
        *self.shared.serialize()
    }

    /// The guest's FLUSH: a barrier, logged at debug level (one line per
    /// FLUSH: what write tracking found is otherwise invisible; the
    /// sandbox's scenario 12 reads it).
    fn flush_request(&self) -> Result<(), FlushError> {
        let s = self
            .barrier()
            .map_err(|e| FlushError::from_error(Box::new(e)))?;
        log::debug!(
            "pmem FLUSH barrier: found={} copied={} tracked={} logged={} held_us={} scan_us={} unheld={}",
            s.private_pages,
            s.pages_copied,
            s.tracked,
            s.write_log,
            s.held.as_micros(),
            s.scan.as_micros(),
            s.unheld
        );
        Ok(())
    }
}

impl FlushBackend for PcowRegion {
    fn flush(&mut self) -> Result<(), FlushError> {
        self.flush_request()
    }
}

/// The backend of a device that may be either kind, shared with whoever
/// runs host-initiated barriers and reads the status (a VMM).
#[derive(Debug, Clone)]
pub enum PmemBackend {
    /// A pcow chain.
    Pcow(Arc<PcowRegion>),
    /// A raw file (upstream's behaviour).
    Raw(Arc<RawRegion>),
}

impl FlushBackend for PmemBackend {
    fn flush(&mut self) -> Result<(), FlushError> {
        match self {
            PmemBackend::Pcow(r) => r.flush_request(),
            PmemBackend::Raw(r) => r.flush_request(),
        }
    }
}
