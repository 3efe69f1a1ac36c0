//! The object a VMM holds for a pcow-backed device: the region (for the
//! memslot), the barrier behind FLUSH, live snapshots and overlays, and
//! status. Its [`Monitor`] half goes to the VMM's event loop.
//!
//! # Live overlay
//!
//! [`PcowRegion::overlay`] switches the running device to a new top file
//! whose base is the current image, with writers held throughout:
//!
//! 1. barrier: every private page is in the image, data and metadata are
//!    durable;
//! 2. the pre-allocation worker stops (its handle shares the writer's
//!    open file description and so its `flock`);
//! 3. the image closes (DIRTY cleared, pool dropped) and the writer's
//!    exclusive lock is released explicitly: the region's mappings keep the
//!    old open file description, and with it the lock, alive after the fd
//!    closes;
//! 4. the overlay is created with the old top as its base (the name stored
//!    relative when both files share a directory, else absolute), which
//!    opens the whole chain again, the old top read-only at depth 1 under a
//!    shared lock;
//! 5. every shared range of the region (the old top's active clusters) is
//!    mapped `MAP_PRIVATE` from the new chain's depth-1 file at the same
//!    offsets: the same bytes, now read-only history; writes to them are
//!    copy-on-write, holes fault into the overlay;
//! 6. the worker restarts on the overlay's file.
//!
//! If a step after the close fails, the overlay file (new, so ours) is
//! closed and removed, the old image is reopened read-write, ranges already
//! remapped are mapped shared again from it, and the worker restarts: the
//! device continues on the old image with the region's content unchanged
//! (writers were held, every remap maps the same file bytes). A range
//! that cannot be mapped shared again stays private over the same bytes,
//! which the next barrier copies back (correct, a little slower). Only if
//! the old image cannot be reopened (another process took its lock in the
//! moment it was free, or the disk failed) is the device left without a
//! writable image: faults map zeros, barriers fail with an error naming the
//! cause, and the status reports it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pcow::{
    BaseFormat, BaseRef, ClusterSource, CreateOptions, Image, OpenOptions, SnapshotInfo,
    TempOptions,
};

use crate::barrier::{hold, with_hold, BarrierError, BarrierStats, Quiesce};
use crate::device::{FlushBackend, FlushError};
use crate::fault_poll::{FaultPoll, DEFAULT_FAULT_POLL};
use crate::monitor::{FaultCounters, Monitor};
use crate::pool::{default_pool_bytes, PoolCtl, PoolOptions, PoolStatus};
use crate::region::{vmas_in, ClusterState, RegionError, RegionOptions, RegionState};
use pcow::check::error_chain;

/// What the monitor and the device share, behind one lock.
///
/// Dropping it stops the pool worker (closing its handle of the top file
/// and giving its last refills to the image) before the fields drop:
/// `region` then unmaps the region and closes the image.
pub(crate) struct DeviceState {
    pub(crate) pool: PoolCtl,
    pub(crate) region: RegionState,
    /// Live overlays done.
    pub(crate) overlays: u64,
    /// Set when a failed overlay could not reopen the old image.
    pub(crate) detached: Option<String>,
}

impl Drop for DeviceState {
    fn drop(&mut self) {
        self.pool.stop(&mut self.region.image);
    }
}

impl DeviceState {
    /// The region's barrier, with the pool worker kept from starting a new
    /// piece of a refill meanwhile (see [`PoolCtl::quiet`]).
    fn barrier_quiet(&mut self) -> Result<BarrierStats, BarrierError> {
        let _quiet = self.pool.quiet();
        self.region.barrier_held()
    }

    /// Before a barrier: fails when the device has no writable image, then
    /// gives the image the clusters the pool worker reserved since.
    fn prepare(&mut self) -> Result<(), BarrierError> {
        if let Some(why) = &self.detached {
            return Err(BarrierError::Image(pcow::Error::Io {
                path: self.region.image.path().to_owned(),
                op: "the device has no writable image since a failed overlay",
                source: io::Error::other(why.clone()),
            }));
        }
        self.pool.apply(&mut self.region.image);
        Ok(())
    }
}

/// A pcow chain mapped as one host region, with its barrier.
///
/// The region stays mapped while this value or its [`Monitor`] lives.
pub struct PcowRegion {
    dev: Arc<Mutex<DeviceState>>,
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
    /// Private pages a barrier would move now.
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
    pub pool_error: Option<String>,
    /// Live overlays done on this device.
    pub overlays: u64,
    /// Set when the device lost its writable image (a failed overlay whose
    /// rollback could not reopen the old image): barriers fail.
    pub detached: Option<String>,
    /// Why a write fault found the file system full since the last barrier
    /// that succeeded ([`PcowRegion::out_of_space`]).
    pub out_of_space: Option<String>,
}

/// What a live overlay did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayInfo {
    /// The new top image (absolute path).
    pub file: PathBuf,
    /// The base name stored in the overlay (relative to the overlay's
    /// directory, or absolute).
    pub base: String,
    /// The base (the former top image), absolute.
    pub base_path: PathBuf,
    /// Clusters remapped from shared to private (read-only history).
    pub remapped_clusters: u64,
    /// The barrier that preceded the switch.
    pub barrier: BarrierStats,
    /// Time writers were held.
    pub held: Duration,
}

/// Errors of a live overlay.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error("barrier before the overlay")]
    Barrier(#[source] Box<BarrierError>),
    #[error("{path}: the overlay file exists already (a live overlay creates a new file)")]
    Exists { path: PathBuf },
    #[error("{path}: {what}")]
    Path {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not valid UTF-8 (base names are stored as UTF-8)")]
    NotUtf8 { path: PathBuf },
    #[error("{path}: {what}")]
    Image {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: Box<pcow::Error>,
    },
    #[error("cluster {vcn}: {what}")]
    Layout { vcn: u64, what: String },
    #[error("remapping clusters {vcn}..{end} private from the base")]
    Remap {
        vcn: u64,
        end: u64,
        #[source]
        source: io::Error,
    },
    #[error(
        "overlay failed ({cause}) and the old image {path} could not be reopened for \
         writing: the device has no writable image"
    )]
    Reopen {
        path: PathBuf,
        cause: String,
        #[source]
        source: Box<pcow::Error>,
    },
    #[error("the device has no writable image since a failed overlay: {0}")]
    Detached(String),
    #[error(
        "the device runs with discard_writes: its writes go to a temporary overlay that \
         is discarded, and the image is never written; shut the VM down and overlay \
         the image offline (`pcow-img create -b IMAGE -F pcow FILE`)"
    )]
    Discarding,
    #[error("region state lock poisoned by a panic")]
    Poisoned,
}

impl From<BarrierError> for OverlayError {
    fn from(e: BarrierError) -> Self {
        OverlayError::Barrier(Box::new(e))
    }
}

/// Shared clusters contiguous in the region and in the top file.
#[derive(Debug, Clone, Copy)]
struct SharedRun {
    vcn: u64,
    count: u64,
    offset: u64,
}

/// Where the overlay goes and what it names as its base, decided before
/// anything changes.
#[derive(Debug)]
struct OverlayPlan {
    file: PathBuf,
    base: String,
    base_path: PathBuf,
}

impl OverlayPlan {
    fn new(image: &Image, new_file: &Path) -> Result<OverlayPlan, OverlayError> {
        let perr = |path: &Path, what| {
            let path = path.to_owned();
            move |source| OverlayError::Path { path, what, source }
        };
        match std::fs::symlink_metadata(new_file) {
            Ok(_) => {
                return Err(OverlayError::Exists {
                    path: new_file.to_owned(),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(perr(new_file, "checking the overlay file")(e)),
        }
        let name = new_file.file_name().ok_or_else(|| OverlayError::Path {
            path: new_file.to_owned(),
            what: "the overlay path names no file",
            source: io::Error::from(io::ErrorKind::InvalidInput),
        })?;
        let parent = match new_file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = parent
            .canonicalize()
            .map_err(perr(parent, "the overlay's directory"))?;
        let base_path = image
            .path()
            .canonicalize()
            .map_err(perr(image.path(), "resolving the image's path"))?;
        let stored: &Path = match (base_path.parent(), base_path.file_name()) {
            (Some(d), Some(n)) if d == dir => Path::new(n),
            _ => &base_path,
        };
        let base = stored
            .to_str()
            .ok_or_else(|| OverlayError::NotUtf8 {
                path: base_path.clone(),
            })?
            .to_owned();
        Ok(OverlayPlan {
            file: dir.join(name),
            base,
            base_path,
        })
    }
}

/// A byte vector standing in for a file: the image the region holds while
/// the real one is closed during an overlay (never used for I/O by the
/// device: the state lock is held until the real image is back).
#[derive(Debug, Default, Clone)]
struct MemStorage(Arc<Mutex<Vec<u8>>>);

impl MemStorage {
    fn bytes(&self) -> MutexGuard<'_, Vec<u8>> {
        // A plain byte vector: a panic while holding it leaves it whole.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl pcow::io::Storage for MemStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let eof = || io::Error::from(io::ErrorKind::UnexpectedEof);
        let bytes = self.bytes();
        let start = usize::try_from(offset).map_err(|_| eof())?;
        let end = start
            .checked_add(buf.len())
            .filter(|&e| e <= bytes.len())
            .ok_or_else(eof)?;
        buf.copy_from_slice(&bytes[start..end]);
        Ok(())
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let big = || io::Error::from_raw_os_error(libc::EFBIG);
        let mut bytes = self.bytes();
        let start = usize::try_from(offset).map_err(|_| big())?;
        let end = start.checked_add(buf.len()).ok_or_else(big)?;
        if end > bytes.len() {
            bytes.resize(end, 0);
        }
        bytes[start..end].copy_from_slice(buf);
        Ok(())
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.bytes().len() as u64)
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        self.bytes().resize(len, 0);
        Ok(())
    }
    /// The same bytes (a clone shares them).
    fn commit_io(&self) -> io::Result<Box<dyn pcow::io::CommitIo>> {
        Ok(Box::new(self.clone()))
    }
}

impl pcow::io::CommitIo for MemStorage {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        pcow::io::Storage::write_at(self, buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn placeholder() -> Result<Image, pcow::Error> {
    Image::create_storage(
        Box::<MemStorage>::default(),
        "(no image: overlay in progress)",
        4096,
        4096,
    )
}

/// The top file of `image`.
fn top_file(image: &Image) -> io::Result<&File> {
    image
        .file()
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
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
        let image = Image::open(path, OpenOptions::read_write())?;
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
        let pool_clusters = opts
            .pool_clusters
            .unwrap_or((default_pool_bytes(image.virtual_size()) / cs).max(1));
        let opts = RegionOptions {
            pool_clusters: Some(pool_clusters),
            ..opts.clone()
        };
        let fault_poll = opts.fault_poll.unwrap_or(DEFAULT_FAULT_POLL);
        let mut st = RegionState::build(image, &opts)?;
        let mut pool = PoolCtl::new(pool_opts, cs, pool_clusters);
        if let Err(e) = pool.start(&st.image) {
            log::warn!("no pre-allocation worker ({e}), the pool refills inline");
        }
        pool.configure(&mut st.image);
        // The pool is empty after the open: fill it before the first fault.
        pool.request(&st.image);
        let uffd = st.uffd.clone();
        let pool_efd = pool.efd();
        let (base, len) = (st.mapping.base(), st.mapping.len() as u64);
        let dev = Arc::new(Mutex::new(DeviceState {
            pool,
            region: st,
            overlays: 0,
            detached: None,
        }));
        Ok((
            PcowRegion {
                dev: dev.clone(),
                quiesce,
                base,
                len,
                cluster_size: cs,
            },
            Monitor {
                dev,
                uffd,
                pool_efd,
                poll: Mutex::new(FaultPoll::new(fault_poll)),
                space_alert: Default::default(),
            },
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

    fn lock(&self) -> Result<MutexGuard<'_, DeviceState>, BarrierError> {
        self.dev.lock().map_err(|_| BarrierError::Poisoned)
    }

    /// Runs a barrier: holds writers, moves private pages into the image,
    /// releases the writers, then syncs data and commits metadata. Only a
    /// fault that needs the image (a write into a hole) waits for the
    /// commit; the guest's other writes go on, and belong to the next
    /// barrier.
    pub fn barrier(&self) -> Result<BarrierStats, BarrierError> {
        // Hold first, lock second: the monitor must be able to serve a
        // writer's fault while the hold waits for that writer.
        let held = hold(&*self.quiesce)?;
        let t = Instant::now();
        let mut g = self.lock()?;
        let dev = &mut *g;
        dev.prepare()?;
        let mut stats = BarrierStats::default();
        let r = {
            let _quiet = dev.pool.quiet();
            match dev.region.barrier_move(&mut stats) {
                Ok(moved) => {
                    drop(held);
                    stats.held = t.elapsed();
                    dev.region.barrier_commit(moved, &mut stats)
                }
                Err(e) => Err(e),
            }
        };
        dev.pool.request(&dev.region.image);
        r.map(|()| stats)
    }

    /// Takes a snapshot of the running device: barrier, snapshot cluster,
    /// then the writable clusters become read-only history (mapped private,
    /// same content). No data is copied.
    pub fn snapshot_create(&self, tag: &str) -> Result<SnapshotInfo, BarrierError> {
        self.refuse_if_discarding()?;
        self.after_barrier(|region| {
            let info = region.image.snapshot_create(tag)?;
            region.demote_shared()?;
            Ok(info)
        })
    }

    /// Deletes snapshot `snap` (a tag or an id) of the running device. Only
    /// the snapshot record goes: its data stays where the guest's view (or
    /// another snapshot) still uses it, so no mapping changes. A barrier
    /// runs first, so the deletion commits only durable data.
    pub fn snapshot_delete(&self, snap: &str) -> Result<SnapshotInfo, BarrierError> {
        self.refuse_if_discarding()?;
        self.after_barrier(|region| Ok(region.image.snapshot_delete(snap)?))
    }

    /// Whether the guest writes into a temporary overlay
    /// ([`PcowRegion::open_discarding`]).
    pub fn is_discarding(&self) -> Result<bool, BarrierError> {
        Ok(self.lock()?.region.image.is_temporary())
    }

    /// The image operations a discarding device refuses: they would write
    /// the image, which it never writes, or a file that goes with it.
    fn refuse_if_discarding(&self) -> Result<(), BarrierError> {
        if self.is_discarding()? {
            return Err(BarrierError::Discarding);
        }
        Ok(())
    }

    /// Holds the writers, runs a barrier, then `op` on the region (so what
    /// `op` commits to the image's metadata points only at durable data),
    /// and refills the pool.
    fn after_barrier<T>(
        &self,
        op: impl FnOnce(&mut RegionState) -> Result<T, BarrierError>,
    ) -> Result<T, BarrierError> {
        let (r, _) = with_hold(&*self.quiesce, || {
            let mut g = self.lock()?;
            let dev = &mut *g;
            dev.prepare()?;
            dev.barrier_quiet()?;
            let r = op(&mut dev.region)?;
            dev.pool.request(&dev.region.image);
            Ok(r)
        })?;
        Ok(r)
    }

    /// Rollback replaces what the guest sees: refused while the device runs.
    pub fn snapshot_apply(&self, _tag: &str) -> Result<SnapshotInfo, BarrierError> {
        Err(BarrierError::LiveRollback)
    }

    /// The image's snapshots.
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>, BarrierError> {
        Ok(self.lock()?.region.image.snapshots())
    }

    /// Live overlay: the current image becomes the read-only base of a new
    /// top image at `new_file` (which must not exist), and the guest
    /// continues on it. See the module documentation for the steps and
    /// what a failure leaves.
    pub fn overlay(&self, new_file: &Path) -> Result<OverlayInfo, OverlayError> {
        let _held = hold(&*self.quiesce).map_err(BarrierError::from)?;
        let t = Instant::now();
        let mut g = self.dev.lock().map_err(|_| OverlayError::Poisoned)?;
        let dev = &mut *g;
        if let Some(why) = &dev.detached {
            return Err(OverlayError::Detached(why.clone()));
        }
        if dev.region.image.is_temporary() {
            return Err(OverlayError::Discarding);
        }
        let plan = OverlayPlan::new(&dev.region.image, new_file)?;
        dev.pool.apply(&mut dev.region.image);
        let barrier = dev.barrier_quiet()?;
        let runs = shared_runs(&dev.region)?;
        let remapped = switch(dev, &plan, &runs)?;
        dev.overlays += 1;
        Ok(OverlayInfo {
            file: plan.file,
            base: plan.base,
            base_path: plan.base_path,
            remapped_clusters: remapped,
            barrier,
            held: t.elapsed(),
        })
    }

    /// Why a write fault could not get a cluster because the file system
    /// is full, if one could not since the last barrier that succeeded.
    /// The guest's writes there are held in memory until a barrier moves
    /// them: a VMM pauses the guest until space is freed.
    pub fn out_of_space(&self) -> Result<Option<String>, BarrierError> {
        Ok(self.lock()?.region.out_of_space.clone())
    }

    /// Status for the API (does not hold writers).
    pub fn status(&self) -> Result<Status, BarrierError> {
        let mut g = self.lock()?;
        let dev = &mut *g;
        let st = &mut dev.region;
        let pending = st.pending_pages()?;
        let count = |s| st.clusters.iter().filter(|&&c| c == s).count() as u64;
        let (holes, zero_mapped, private, shared) = (
            count(ClusterState::Hole),
            count(ClusterState::Zero),
            count(ClusterState::Private),
            count(ClusterState::Shared),
        );
        let vmas = vmas_in(self.base, self.base + self.len)
            .map_err(|e| BarrierError::Maps(Box::new(e)))?;
        Ok(Status {
            allocated_clusters: st.image.allocated_clusters(),
            pending_private_pages: pending,
            snapshots: st.image.snapshots(),
            chain_depth: st.image.chain_files().len(),
            chain: st.image.chain_paths(),
            vmas,
            planned_vmas: st.planned_vmas,
            holes,
            zero_mapped,
            private,
            shared,
            faults: st.faults,
            pool: dev.pool.status(&st.image),
            pool_error: dev.pool.error(),
            overlays: dev.overlays,
            detached: dev.detached.clone(),
            out_of_space: st.out_of_space.clone(),
        })
    }
}

/// The shared clusters of the region, in runs contiguous in the top file.
fn shared_runs(st: &RegionState) -> Result<Vec<SharedRun>, OverlayError> {
    let cs = st.cs;
    let mut runs: Vec<SharedRun> = Vec::new();
    for (i, &c) in st.clusters.iter().enumerate() {
        if c != ClusterState::Shared {
            continue;
        }
        let vcn = i as u64;
        let offset = st.image.active_offset(vcn).ok_or(OverlayError::Layout {
            vcn,
            what: "mapped shared but the active layer has no cluster there".into(),
        })?;
        match runs.last_mut() {
            Some(r) if r.vcn + r.count == vcn && r.offset + r.count * cs == offset => r.count += 1,
            _ => runs.push(SharedRun {
                vcn,
                count: 1,
                offset,
            }),
        }
    }
    Ok(runs)
}

/// Steps 2 to 6 of an overlay (writers held, barrier done); on failure
/// after the close, [`recover`] puts the old image back.
fn switch(
    dev: &mut DeviceState,
    plan: &OverlayPlan,
    runs: &[SharedRun],
) -> Result<u64, OverlayError> {
    let old_path = plan.base_path.clone();
    let img_err = |path: &Path, what| {
        let path = path.to_owned();
        move |source| OverlayError::Image {
            path,
            what,
            source: Box::new(source),
        }
    };
    let cs = dev.region.cs;
    let virtual_size = dev.region.image.virtual_size();
    // Failures up to the close leave everything as it was.
    let lock_handle = top_file(&dev.region.image)
        .and_then(|f| f.try_clone())
        .map_err(|source| OverlayError::Path {
            path: old_path.clone(),
            what: "a handle for the writer's lock",
            source,
        })?;
    let stand_in = placeholder().map_err(img_err(&old_path, "a stand-in image"))?;
    dev.pool.stop(&mut dev.region.image);
    let old = std::mem::replace(&mut dev.region.image, stand_in);

    // From here on, a failure reopens the old image.
    let mut created = false;
    let mut new: Option<Image> = None;
    let mut remapped: Vec<SharedRun> = Vec::new();
    let result = (|| {
        old.close()
            .map_err(img_err(&old_path, "closing the image"))?;
        // The region's mappings keep the old open file description alive,
        // and a flock lives as long as its description: release it, or the
        // overlay could not open its base.
        lock_handle.unlock().map_err(|source| OverlayError::Path {
            path: old_path.clone(),
            what: "releasing the writer's lock",
            source,
        })?;
        // The file did not exist: whatever is there from now on is ours.
        created = true;
        let img = Image::create(
            &plan.file,
            &CreateOptions {
                cluster_size: Some(cs),
                virtual_size: Some(virtual_size),
                base: Some(BaseRef {
                    name: plan.base.clone(),
                    format: BaseFormat::Pcow,
                }),
            },
        )
        .map_err(img_err(&plan.file, "creating the overlay"))?;
        let img = new.insert(img);
        dev.pool.configure(img);
        let base_fd = img
            .chain_files()
            .get(1)
            .map(|f| f.as_raw_fd())
            .ok_or_else(|| OverlayError::Layout {
                vcn: 0,
                what: "the overlay's chain has no base file".into(),
            })?;
        // The overlay must show each run's first cluster where the old top
        // had it (the rest of a run follows from the same file layout).
        for r in runs {
            let want = ClusterSource::ReadOnly {
                depth: 1,
                offset: r.offset,
            };
            let got = img.cluster_source(r.vcn);
            if got != want {
                return Err(OverlayError::Layout {
                    vcn: r.vcn,
                    what: format!("the overlay shows {got:?}, expected {want:?}"),
                });
            }
        }
        for r in runs {
            dev.region
                .mapping
                .map_file(r.vcn * cs, r.count * cs, base_fd, r.offset, false)
                .map_err(|source| OverlayError::Remap {
                    vcn: r.vcn,
                    end: r.vcn + r.count,
                    source,
                })?;
            remapped.push(*r);
            for v in r.vcn..r.vcn + r.count {
                dev.region.clusters[v as usize] = ClusterState::Private;
            }
            dev.region.track(r.vcn, r.vcn + r.count);
        }
        Ok(())
    })();
    match result {
        Ok(()) => {
            drop(lock_handle);
            let img = new.take().ok_or_else(|| OverlayError::Layout {
                vcn: 0,
                what: "no overlay image".into(),
            })?;
            dev.region.image = img;
            if let Err(e) = dev.pool.start(&dev.region.image) {
                log::warn!(
                    "no pre-allocation worker after the overlay ({e}), the pool refills inline"
                );
            }
            dev.pool.request(&dev.region.image);
            Ok(remapped.iter().map(|r| r.count).sum())
        }
        Err(cause) => Err(recover(
            dev,
            plan,
            cause,
            &lock_handle,
            new,
            created,
            &remapped,
        )),
    }
}

/// Undoes a failed overlay after the old image was closed: closes and
/// removes the new file, reopens the old image read-write, maps the ranges
/// already remapped shared again, restarts the worker. Returns the error
/// to report.
fn recover(
    dev: &mut DeviceState,
    plan: &OverlayPlan,
    cause: OverlayError,
    lock_handle: &File,
    new: Option<Image>,
    created: bool,
    remapped: &[SharedRun],
) -> OverlayError {
    let cause_msg = error_chain(&cause);
    log::error!(
        "overlay onto {}: {cause_msg}; reopening the old image",
        plan.file.display()
    );
    let cs = dev.region.cs;
    // Our own locks would stop the reopen: the old description's (if the
    // failure came before its release), and the overlay's shared lock on
    // its base, whose description the remapped ranges keep alive.
    if let Err(e) = lock_handle.unlock() {
        log::warn!("{}: releasing the lock: {e}", plan.base_path.display());
    }
    if let Some(img) = new {
        if let Some(f) = img.chain_files().get(1) {
            if let Err(e) = f.unlock() {
                log::warn!(
                    "{}: releasing the base's lock: {e}",
                    plan.base_path.display()
                );
            }
        }
        if let Err(e) = img.close() {
            log::warn!("{}: closing the overlay: {e}", plan.file.display());
        }
    }
    if created {
        match std::fs::remove_file(&plan.file) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                log::warn!("{}: removing the overlay: {e}", plan.file.display())
            }
            _ => {}
        }
    }
    let mut img = match Image::open(&plan.base_path, OpenOptions::read_write()) {
        Ok(img) => img,
        Err(source) => {
            let why = format!(
                "reopening {} after a failed overlay ({cause_msg}): {}",
                plan.base_path.display(),
                error_chain(&source)
            );
            log::error!("{why}");
            dev.detached = Some(why);
            return OverlayError::Reopen {
                path: plan.base_path.clone(),
                cause: cause_msg,
                source: Box::new(source),
            };
        }
    };
    dev.pool.configure(&mut img);
    dev.region.image = img;
    // Same file, same offsets: map shared again what was remapped. A range
    // that fails stays private over the same bytes (the barrier copies its
    // written pages back into the same cluster).
    match top_file(&dev.region.image).map(|f| f.as_raw_fd()) {
        Ok(fd) => {
            for r in remapped {
                match dev
                    .region
                    .mapping
                    .map_file(r.vcn * cs, r.count * cs, fd, r.offset, true)
                {
                    Ok(()) => {
                        for v in r.vcn..r.vcn + r.count {
                            dev.region.clusters[v as usize] = ClusterState::Shared;
                        }
                    }
                    Err(e) => log::warn!(
                        "clusters {}..{}: left private after the failed overlay: {e}",
                        r.vcn,
                        r.vcn + r.count
                    ),
                }
            }
        }
        Err(e) => log::warn!("no top file after reopening: {e}"),
    }
    if let Err(e) = dev.pool.start(&dev.region.image) {
        log::warn!("no pre-allocation worker ({e}), the pool refills inline");
    }
    dev.pool.request(&dev.region.image);
    cause
}

impl FlushBackend for PcowRegion {
    fn flush(&mut self) -> Result<(), FlushError> {
        self.barrier()
            .map(|_| ())
            .map_err(|e| FlushError::from_error(Box::new(e)))
    }
}
