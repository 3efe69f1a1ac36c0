//! The object a VMM holds for a pcow-backed device: the region (for the
//! memslot), the barrier behind FLUSH, live snapshots and status. Its
//! [`Monitor`] half goes to the VMM's event loop.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use pcow::{Image, OpenOptions, SnapshotInfo};

use crate::barrier::{with_hold, BarrierError, BarrierStats, Quiesce};
use crate::device::FlushBackend;
use crate::monitor::{FaultCounters, Monitor};
use crate::region::{vmas_in, ClusterState, RegionError, RegionOptions, RegionState};

/// A pcow chain mapped as one host region, with its barrier.
///
/// The region stays mapped while this value or its [`Monitor`] lives.
pub struct PcowRegion {
    state: Arc<Mutex<RegionState>>,
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
}

impl PcowRegion {
    /// Opens the image at `path` read-write (exclusive lock) with its base
    /// chain and builds the region.
    pub fn open(
        path: &Path,
        quiesce: Arc<dyn Quiesce>,
        opts: &RegionOptions,
    ) -> Result<(PcowRegion, Monitor), RegionError> {
        let image = Image::open(path, OpenOptions::read_write())?;
        Self::from_image(image, quiesce, opts)
    }

    /// Builds the region of an image opened read-write.
    pub fn from_image(
        image: Image,
        quiesce: Arc<dyn Quiesce>,
        opts: &RegionOptions,
    ) -> Result<(PcowRegion, Monitor), RegionError> {
        let st = RegionState::build(image, opts)?;
        let uffd = st.uffd.clone();
        let (base, len, cluster_size) = (st.mapping.base(), st.mapping.len() as u64, st.cs);
        let state = Arc::new(Mutex::new(st));
        Ok((
            PcowRegion {
                state: state.clone(),
                quiesce,
                base,
                len,
                cluster_size,
            },
            Monitor { state, uffd },
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

    fn lock(&self) -> Result<MutexGuard<'_, RegionState>, BarrierError> {
        self.state.lock().map_err(|_| BarrierError::Poisoned)
    }

    /// Runs a barrier: holds writers, moves private pages into the image,
    /// syncs data, commits metadata, releases.
    pub fn barrier(&self) -> Result<BarrierStats, BarrierError> {
        // Hold first, lock second: the monitor must be able to serve a
        // writer's fault while the hold waits for that writer.
        let (mut stats, held) = with_hold(&*self.quiesce, || self.lock()?.barrier_held())?;
        stats.held = held;
        Ok(stats)
    }

    /// Takes a snapshot of the running device: barrier, snapshot cluster,
    /// then the writable clusters become read-only history (mapped private,
    /// same content). No data is copied.
    pub fn snapshot_create(&self, tag: &str) -> Result<SnapshotInfo, BarrierError> {
        let (info, _) = with_hold(&*self.quiesce, || {
            let mut st = self.lock()?;
            st.barrier_held()?;
            let info = st.image.snapshot_create(tag)?;
            st.demote_shared()?;
            Ok(info)
        })?;
        Ok(info)
    }

    /// Rollback replaces what the guest sees: refused while the device runs.
    pub fn snapshot_apply(&self, _tag: &str) -> Result<SnapshotInfo, BarrierError> {
        Err(BarrierError::LiveRollback)
    }

    /// The image's snapshots.
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>, BarrierError> {
        Ok(self.lock()?.image.snapshots())
    }

    /// Status for the API (does not hold writers).
    pub fn status(&self) -> Result<Status, BarrierError> {
        let mut st = self.lock()?;
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
            vmas,
            planned_vmas: st.planned_vmas,
            holes,
            zero_mapped,
            private,
            shared,
            faults: st.faults,
        })
    }
}

impl FlushBackend for PcowRegion {
    fn flush(&mut self) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.barrier()?;
        Ok(())
    }
}
