//! The region state: everything the monitor, the barrier and an overlay
//! change, behind the state lock ([`Shared::lock`]), in a few groups: the
//! [`View`] (mapping, userfaultfd, cluster states), the write [`Tracking`],
//! the writable image ([`Writable`]), the [`PoolCtl`], the health the
//! faults record and the counters. The lock order is in the crate's
//! documentation.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Mutex, MutexGuard};

use pcow::LiveImage;

use crate::harvest::Tracking;
use crate::health::Failure;
use crate::pool::PoolCtl;
use crate::view::View;

/// The image the guest writes into, or why there is none.
pub(crate) enum Writable {
    /// The image, open read-write.
    Open(Box<LiveImage>),
    /// Closed by a live overlay in progress (which holds the state lock
    /// until it puts an image back or detaches).
    Switching,
    /// A failed overlay could not reopen the old image: faults map zeros,
    /// barriers fail with this cause.
    Detached(Failure),
}

/// Why the device has no writable image.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum NoImage {
    #[error("the device has no writable image since a failed overlay")]
    Detached(#[source] Failure),
    #[error("the image is closed for a live overlay in progress")]
    Switching,
}

/// Counters of the monitor (cumulative).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FaultCounters {
    /// Write faults that mapped a cluster of the image.
    pub write_faults: u64,
    /// Read faults that mapped zeros.
    pub read_faults: u64,
    /// Faults in clusters already resolved (woken only).
    pub wake_only: u64,
    /// Write faults resolved with zeros because mapping the cluster failed
    /// (the write is then harvested by the next barrier).
    pub fallbacks: u64,
    /// Faults the monitor read while it polled after an earlier one, so
    /// without being woken (see [`crate::fault_poll`]).
    pub polled: u64,
    /// Hole clusters mapped by a write fault in a neighbouring cluster of
    /// their expansion window (see [`crate::RegionOptions::expand_window`]):
    /// faults the guest did not take.
    pub clusters_ahead: u64,
    /// Clusters with data the region had left unmapped (the open, for an
    /// image too scattered to map whole, see
    /// [`crate::RegionOptions::max_map_count`], or a window's fill whose
    /// mapping failed) that a fault mapped, theirs or one reading ahead.
    pub deferred_mapped: u64,
    /// Such clusters that could not be mapped (no mapping left under the
    /// process's limit): their data was copied into the region's
    /// anonymous memory instead, like a zero-mapped hole's zeros.
    pub deferred_copied: u64,
    /// Of the deferred clusters mapped or copied, those resolved by the
    /// fault of the cluster before them while the guest read in order
    /// (see [`crate::READ_AHEAD_BYTES`]): faults the guest did not take.
    pub deferred_ahead: u64,
}

/// Counters the status reports.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) faults: FaultCounters,
    /// Live overlays done.
    pub(crate) overlays: u64,
    /// Mappings estimated when the region was built.
    pub(crate) planned_vmas: u64,
    /// Clusters with data the open left unmapped (too many mappings, see
    /// [`crate::plan::Deferral`]): their first fault maps them.
    pub(crate) deferred: u64,
}

/// What the monitor, the barrier and an overlay share.
///
/// Dropping it stops the pool worker (closing its handle of the top file
/// and giving its last refills to the image), then the fields drop in
/// order: the view unmaps the region before the image closes (closing
/// truncates the pre-allocated pool, which shared mappings of fresh
/// clusters may cover).
pub(crate) struct RegionState {
    pub(crate) view: View,
    pub(crate) tracking: Tracking,
    pub(crate) image: Writable,
    pub(crate) pool: PoolCtl,
    /// Why a write fault got zeros instead of a cluster because the file
    /// system is full (ENOSPC, EDQUOT); cleared by a barrier that succeeds.
    pub(crate) out_of_space: Option<Failure>,
    pub(crate) counters: Counters,
    /// Clusters per expansion window (1: every write fault maps its own
    /// cluster only), see [`crate::RegionOptions::expand_window`].
    pub(crate) expand_window: u64,
    /// The deferred cluster a guest reading in order faults in next: the
    /// one after the last fault's, or after what it read ahead (see
    /// [`crate::READ_AHEAD_BYTES`]).
    pub(crate) read_ahead_next: u64,
}

impl Drop for RegionState {
    fn drop(&mut self) {
        if let Writable::Open(image) = &mut self.image {
            self.pool.stop(image);
            // Whatever reached the top file through shared mappings is
            // synced before the image's closing barrier commits metadata.
            image.mark_data_written();
        }
    }
}

impl RegionState {
    /// The writable image.
    pub(crate) fn image(&self) -> Result<&LiveImage, NoImage> {
        match &self.image {
            Writable::Open(i) => Ok(i),
            Writable::Switching => Err(NoImage::Switching),
            Writable::Detached(why) => Err(NoImage::Detached(why.clone())),
        }
    }

    /// The writable image, mutably.
    pub(crate) fn image_mut(&mut self) -> Result<&mut LiveImage, NoImage> {
        match &mut self.image {
            Writable::Open(i) => Ok(i),
            Writable::Switching => Err(NoImage::Switching),
            Writable::Detached(why) => Err(NoImage::Detached(why.clone())),
        }
    }

    /// The image and the pool, both borrowed (the pool takes refills into
    /// the image), when there is an image.
    pub(crate) fn image_and_pool(&mut self) -> Option<(&mut LiveImage, &mut PoolCtl)> {
        match &mut self.image {
            Writable::Open(i) => Some((i, &mut self.pool)),
            _ => None,
        }
    }

    /// Takes the worker's finished refills into the image and asks for the
    /// next one when the pool is low; returns the refills taken (none
    /// without an image).
    pub(crate) fn refill_pool(&mut self) -> usize {
        match self.image_and_pool() {
            Some((image, pool)) => {
                let n = pool.apply(image);
                // A range that just failed is not asked for again (see
                // `PoolCtl::request`): a full disk does not make the
                // worker spin.
                pool.request(image);
                n
            }
            None => 0,
        }
    }
}

/// The top file's fd of `image`.
pub(crate) fn top_fd(image: &pcow::Image) -> io::Result<RawFd> {
    image
        .file()
        .map(|f| f.as_raw_fd())
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
}

/// The region state and the barrier lock, shared by the region's facade
/// and its monitor.
pub(crate) struct Shared {
    state: Mutex<RegionState>,
    /// Serializes barriers, snapshots and overlays (taken before writers
    /// are held and before the state lock), and counts the barriers that
    /// succeeded.
    barriers: Mutex<BarrierTotals>,
}

/// What the barriers of a device did so far (FLUSHes and host-initiated
/// barriers that succeeded; snapshots and overlays not counted).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BarrierTotals {
    /// Barriers that succeeded.
    pub barriers: u64,
    /// Pages they wrote into the image.
    pub pages_copied: u64,
}

/// The region state lock was poisoned by a panic.
#[derive(Debug, thiserror::Error)]
#[error("region state lock poisoned by a panic")]
pub(crate) struct Poisoned;

impl Shared {
    pub(crate) fn new(state: RegionState) -> Shared {
        Shared {
            state: Mutex::new(state),
            barriers: Mutex::new(BarrierTotals::default()),
        }
    }

    /// The state lock: never held across a sync, except by snapshots and
    /// overlays (see the crate's lock order).
    pub(crate) fn lock(&self) -> Result<MutexGuard<'_, RegionState>, Poisoned> {
        self.state.lock().map_err(|_| Poisoned)
    }

    /// The barrier lock: one barrier, snapshot or overlay at a time; it
    /// holds the barrier totals.
    pub(crate) fn serialize(&self) -> MutexGuard<'_, BarrierTotals> {
        // It guards the order and two counters: a panic leaves nothing
        // broken.
        self.barriers.lock().unwrap_or_else(|e| e.into_inner())
    }
}
