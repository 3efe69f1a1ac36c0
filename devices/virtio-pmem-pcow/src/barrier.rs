//! The flush barrier: moves every page the guest wrote into private memory
//! (copy-on-write of read-only layers, writes into zero-mapped holes) into
//! the writable layer, then makes data durable, then metadata, in the
//! order the spec defines (the image's commit).
//!
//! A barrier runs on its caller's thread (the device's queue, the API):
//!
//! 1. the barrier lock ([`Shared::serialize`]): one barrier, snapshot or
//!    overlay at a time; then, with a write log that vouches for reads
//!    made while writers run ([`crate::WriteLog::complete_unheld`]), the
//!    log is read under the state lock, and when it names no page that
//!    needs a move (only pages of clusters mapped shared from the image,
//!    whose writes the commit's sync covers), steps 2-4 are skipped: the
//!    commit is staged at once, writers never held (an fsync in the guest
//!    ends in two FLUSHes, the second of which usually finds only such
//!    pages);
//! 2. writers held ([`Quiesce::hold`]): the copy from the region into the
//!    file and the remap over the cluster see no concurrent write, so
//!    nothing a guest wrote can be lost between them. The state lock is
//!    not taken yet: the monitor serves the faults of writers the hold
//!    waits for;
//! 3. under the state lock: the harvest ([`crate::harvest`]: the pages
//!    written since the last barrier, their tracking re-armed, or the
//!    pages the write log names, read with writers held), the copy into
//!    the writable layer and its metadata staged;
//! 4. writers released, the state lock dropped: once the pages are copied
//!    and their tracking re-armed, a write belongs to the next barrier;
//! 5. the commit: the metadata slots, the syncs and the header (no lock
//!    held: a `pwrite` waits for the pool worker's `fallocate` in flight;
//!    on tmpfs, where the worker reserves in long pieces, it starts none
//!    meanwhile, and one in flight has the commit write beside it through
//!    a mapping: [`pcow::Commit::beside_fallocate`]);
//! 6. the state lock again to publish the commit (or, on failure, to keep
//!    the harvest for the next barrier).
//!
//! Snapshots and overlays run the same harvest and copy, then keep writers
//! held and the state lock through their commit and their own change of
//! the image (faults wait for them meanwhile).
//!
//! Copy-on-write is per 4 KiB page: a cluster with data below gets only
//! its written pages copied into the writable layer's cluster (a partial
//! bitmap on disk, the rest read through from below) and keeps its private
//! mapping; a former hole (nothing below) becomes a whole cluster mapped
//! shared. Past the zero budget ([`crate::RegionOptions::zero_budget`]) a
//! barrier turns the zero-mapped clusters nobody wrote back into holes
//! (`MADV_DONTNEED` of zero pages, writers held), which bounds their page
//! tables and, without tracking, the classification of their pages.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use pcow::{ClusterSource, Commit, LiveImage};

use crate::clusters::{index_runs, push_run, ClusterState, FileRun};
use crate::harvest::{merge_harvest, Harvest, Tracking};
use crate::mapping::{MapsError, PAGE_SIZE};
use crate::pagemap::PagemapError;
use crate::pool::Quiet;
use crate::quiesce::{hold, Quiesce, QuiesceError};
use crate::state::{top_fd, NoImage, RegionState, Shared, Writable};
use crate::view::View;

/// Errors of a barrier.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum BarrierError {
    #[error("finding written pages")]
    Pagemap(#[from] PagemapError),
    #[error("image")]
    Image(#[from] pcow::Error),
    #[error("copying cluster {vcn} into the image at {file_offset:#x}")]
    Copy {
        vcn: u64,
        file_offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("remapping cluster {vcn}")]
    Remap {
        vcn: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("returning zero-mapped clusters {vcn}..+{count} to holes")]
    Rehole {
        vcn: u64,
        count: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("region state lock poisoned by a panic")]
    Poisoned,
    #[error("barrier")]
    Quiesce(#[from] QuiesceError),
    #[error(
        "rollback of a running device is refused: it would replace what the guest sees; \
         stop the VM and use `pcow-img snapshot -a`"
    )]
    LiveRollback,
    #[error(
        "the device runs with discard_writes: the image is never written and the guest's \
         writes are discarded, so snapshots of it are refused; shut the VM down to \
         snapshot the image offline"
    )]
    Discarding,
    #[error("reading the process's mappings")]
    Maps(#[source] MapsError),
    #[error("no writable image")]
    NoImage(#[from] NoImage),
}

/// What one barrier did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BarrierStats {
    /// Written private pages found (with a write log or write tracking:
    /// written since the previous barrier; without: every private page).
    pub private_pages: u64,
    /// Pages written into the image (a whole cluster counts all its pages).
    pub pages_copied: u64,
    /// Clusters that received pages.
    pub clusters_copied: u64,
    /// Clusters copied into the writable layer with only their written
    /// pages (a partial bitmap; the region keeps its private mapping).
    pub clusters_partial: u64,
    /// Clusters remapped shared from the writable layer (former holes, and
    /// clusters whose every page the writable layer now holds).
    pub clusters_remapped: u64,
    /// Clusters left private because remapping them failed (they are in
    /// the image; the next barrier copies them again).
    pub remap_failures: u64,
    /// Zero-mapped clusters nobody wrote, turned back into holes because
    /// they exceeded the zero budget
    /// ([`crate::RegionOptions::zero_budget`]).
    pub reholed: u64,
    /// Whether write tracking (WP-async) found the pages.
    pub tracked: bool,
    /// Whether the write log ([`crate::WriteLog`]) named the pages (no
    /// page-table scan ran).
    pub write_log: bool,
    /// Whether a tracked scan took two walks (many present pages
    /// protected; see `PageScanner::written_since`), not one.
    pub two_walks: bool,
    /// Time spent finding the written pages.
    pub scan: Duration,
    /// Time spent copying pages into the image and remapping.
    pub copy: Duration,
    /// Time spent in the image's barrier (syncs and metadata commit).
    pub commit: Duration,
    /// Time spent staging the commit (metadata slots encoded, the next
    /// header built), inside [`BarrierStats::held`] for a plain barrier.
    pub stage: Duration,
    /// Time from the barrier's start until writers were held and the state
    /// lock taken (pausing the vCPUs, waiting for a barrier or fault in
    /// progress).
    pub wait: Duration,
    /// Time after the commit's syncs until the barrier returned (the state
    /// lock again, publishing the commit, asking for a refill).
    pub publish: Duration,
    /// Whether the barrier ran without holding writers: the write log,
    /// read with them running, named no page that needed a move
    /// ([`crate::WriteLog::complete_unheld`]).
    pub unheld: bool,
    /// Time writers were held: the scan and the copy. A plain barrier
    /// ([`crate::PcowRegion::barrier`], the guest's FLUSH) releases them
    /// before its commit; snapshots and overlays hold them throughout.
    pub held: Duration,
}

/// The parts of the state a barrier works on.
struct Parts<'a> {
    view: &'a mut View,
    tracking: &'a mut Tracking,
    image: &'a mut LiveImage,
}

fn parts(st: &mut RegionState) -> Result<Parts<'_>, NoImage> {
    let RegionState {
        view,
        tracking,
        image,
        ..
    } = st;
    match image {
        Writable::Open(image) => Ok(Parts {
            view,
            tracking,
            image,
        }),
        Writable::Switching => Err(NoImage::Switching),
        Writable::Detached(why) => Err(NoImage::Detached(why.clone())),
    }
}

/// Before a barrier: fails when the device has no writable image, then
/// gives the image the clusters the pool worker reserved since.
fn prepare(st: &mut RegionState) -> Result<(), BarrierError> {
    let RegionState { image, pool, .. } = st;
    match image {
        Writable::Open(image) => {
            pool.apply(image);
            Ok(())
        }
        Writable::Switching => Err(NoImage::Switching.into()),
        Writable::Detached(why) => Err(NoImage::Detached(why.clone()).into()),
    }
}

/// Whether a commit writes beside the pool worker's piece in flight rather
/// than wait for it: the image is on tmpfs (where a store through a
/// mapping needs nothing from the file system) and the pieces are long.
fn commit_beside_pieces(st: &mut RegionState) -> bool {
    st.pool.long_pieces() && st.image_mut().is_ok_and(|i| i.on_tmpfs())
}

/// Asks the pool worker for a refill if the pool is low.
fn request_refill(st: &mut RegionState) {
    if let Some((image, pool)) = st.image_and_pool() {
        pool.request(image);
    }
}

/// A barrier whose pages are moved ([`move_held`]) but not yet committed.
pub(crate) struct Moved {
    harvest: Harvest,
}

/// The first half of a barrier, which needs writers held: finds the pages
/// written since the last barrier, re-arms their write tracking, copies
/// them into the writable layer and stages its metadata. After it, what
/// the guest writes belongs to the next barrier.
///
/// - a zero-mapped hole (nothing below) becomes a whole fresh cluster:
///   copied entirely, recorded entirely, remapped shared;
/// - a private cluster (data below) gets only its written pages copied
///   into the writable layer's cluster and recorded (a partial bitmap: the
///   rest still reads from below) and keeps its private mapping, so the
///   guest keeps its pages; once the writable layer holds every page, the
///   cluster is remapped shared.
///
/// On failure the harvest is kept ([`Tracking::unsaved`]) for the next
/// barrier.
fn move_held(st: &mut RegionState, stats: &mut BarrierStats) -> Result<Moved, BarrierError> {
    let t = Instant::now();
    let mut p = parts(st)?;
    let found = p.tracking.harvest(p.view, p.image)?;
    stats.private_pages = found.pages;
    stats.tracked = found.tracked;
    stats.two_walks = found.two_walks;
    stats.write_log = found.logged;
    let harvest = found.harvest;
    stats.scan = t.elapsed();
    match p.move_pages(&harvest, stats) {
        Ok(()) => {
            // Only a saving: a barrier does not fail for it.
            if let Err(e) = p.rehole_zero_clusters(stats) {
                log::warn!("{}", error_report::chain(&e));
            }
            Ok(Moved { harvest })
        }
        Err(e) => {
            p.tracking.unsaved = harvest;
            Err(e)
        }
    }
}

/// The second half for snapshots and overlays, all under the state lock:
/// makes the moved pages durable and commits the metadata (the image's
/// `flush`: the syncs included). On failure the harvest is kept, and the next
/// barrier copies its pages again (with whatever the guest wrote there
/// since).
fn commit_locked(
    st: &mut RegionState,
    moved: Moved,
    stats: &mut BarrierStats,
) -> Result<(), BarrierError> {
    let t = Instant::now();
    let image = st.image_mut()?;
    // Shared mappings dirty the top file's page cache directly: always
    // sync data before the metadata commit.
    image.mark_data_written();
    let r = image.flush();
    stats.commit = t.elapsed();
    match r {
        Ok(()) => {
            st.out_of_space = None;
            Ok(())
        }
        Err(e) => {
            merge_harvest(&mut st.tracking.unsaved, moved.harvest);
            Err(e.into())
        }
    }
}

/// A barrier's commit, staged under the state lock and not yet written.
struct Staged {
    commit: Commit,
    moved: Moved,
    /// Write faults that had fallen back to zeros when it was staged.
    fallbacks: u64,
}

/// Stages the commit of a barrier whose pages are moved: the metadata
/// slots encoded, the next header built (no I/O: the commit writes them).
/// `None` when nothing is left to make durable. On failure the harvest is
/// kept for the next barrier.
fn stage(st: &mut RegionState, moved: Moved) -> Result<Option<Staged>, BarrierError> {
    let fallbacks = st.counters.faults.fallbacks;
    let image = st.image_mut()?;
    // Shared mappings dirty the top file's page cache directly: always
    // sync data before the metadata commit.
    image.mark_data_written();
    match image.begin_commit() {
        Ok(Some(commit)) => Ok(Some(Staged {
            commit,
            moved,
            fallbacks,
        })),
        Ok(None) => Ok(None),
        Err(e) => {
            merge_harvest(&mut st.tracking.unsaved, moved.harvest);
            Err(e.into())
        }
    }
}

/// Publishes a commit [`Commit::write`] made durable (or gives it back to
/// the image when the write failed, keeping the harvest for the next
/// barrier). Under the state lock.
fn finish(
    st: &mut RegionState,
    staged: Staged,
    written: Result<(), pcow::Error>,
) -> Result<(), BarrierError> {
    let Staged {
        commit,
        moved,
        fallbacks,
    } = staged;
    let image = st.image_mut()?;
    let r = match written {
        Ok(()) => image.finish_commit(commit),
        Err(e) => {
            if let Err(a) = image.abort_commit(commit) {
                log::error!("{}", error_report::chain(&a));
            }
            Err(e)
        }
    };
    match r {
        Ok(()) => {
            // A write fault that fell back to zeros while the commit was
            // written left a page this barrier did not move: its failure
            // stays reported until the next barrier.
            if st.counters.faults.fallbacks == fallbacks {
                st.out_of_space = None;
            }
            Ok(())
        }
        Err(e) => {
            merge_harvest(&mut st.tracking.unsaved, moved.harvest);
            Err(e.into())
        }
    }
}

/// A barrier (the guest's FLUSH, the API's): see the module documentation
/// for its steps and locks. The commit's syncs run with neither writers
/// nor the state lock held.
pub(crate) fn barrier(
    shared: &Shared,
    quiesce: &dyn Quiesce,
) -> Result<BarrierStats, BarrierError> {
    let t0 = Instant::now();
    let mut serial = shared.serialize();
    let mut stats = BarrierStats::default();
    let mut st = shared.lock().map_err(|_| BarrierError::Poisoned)?;
    prepare(&mut st)?;
    let beside = commit_beside_pieces(&mut st);
    let unheld = {
        let s = &mut *st;
        s.tracking.nothing_to_move(&s.view)
    };
    let staged = if unheld {
        // The log, read with writers running, vouches for every write
        // before it, and names none that needs a move: what the guest
        // wrote is in the image's file already, and the commit's sync
        // makes it durable. Nothing to hold the writers for.
        stats.unheld = true;
        stats.write_log = true;
        stats.wait = t0.elapsed();
        let ts = Instant::now();
        let r = stage(
            &mut st,
            Moved {
                harvest: Harvest::default(),
            },
        );
        stats.stage = ts.elapsed();
        r
    } else {
        // The pool worker starts no new piece of a refill while the pages
        // are copied and the commit staged, and the piece in flight ends
        // before the writers are held: the copy's writes to the file would
        // wait for its `fallocate` (the inode lock), and the writers with
        // them. It refills again during the syncs, for the faults served
        // meanwhile.
        let quiet = st.pool.quiet();
        drop(st);
        quiet.settle();
        // Hold first, lock second: the monitor must be able to serve a
        // writer's fault while the hold waits for that writer.
        let held = hold(quiesce)?;
        let t = Instant::now();
        st = shared.lock().map_err(|_| BarrierError::Poisoned)?;
        stats.wait = t0.elapsed();
        prepare(&mut st)?;
        let staged = move_held(&mut st, &mut stats).and_then(|moved| {
            let ts = Instant::now();
            let r = stage(&mut st, moved);
            stats.stage = ts.elapsed();
            r
        });
        drop(quiet);
        // Copied and re-protected: what the guest writes from here on
        // belongs to the next barrier.
        drop(held);
        stats.held = t.elapsed();
        staged
    };
    let mut tp = Instant::now();
    let r = match staged {
        Err(e) => Err(e),
        Ok(None) => {
            st.out_of_space = None;
            Ok(())
        }
        Ok(Some(mut staged)) => {
            // No piece starts during the commit (its syncs cost nothing on
            // tmpfs), and a piece in flight has it write beside rather than
            // wait for the inode lock.
            let quiet = beside.then(|| st.pool.quiet());
            drop(st);
            if quiet.as_ref().is_some_and(Quiet::piece_in_flight) {
                staged.commit.beside_fallocate();
            }
            let tc = Instant::now();
            let written = staged.commit.write();
            stats.commit = tc.elapsed();
            drop(quiet);
            tp = Instant::now();
            st = shared.lock().map_err(|_| BarrierError::Poisoned)?;
            finish(&mut st, staged, written)
        }
    };
    request_refill(&mut st);
    r?;
    stats.publish = tp.elapsed();
    serial.barriers += 1;
    serial.pages_copied += stats.pages_copied;
    Ok(stats)
}

/// A whole barrier with writers held and the state lock held throughout
/// (snapshots and overlays, which change the image right after it).
pub(crate) fn barrier_locked(st: &mut RegionState) -> Result<BarrierStats, BarrierError> {
    prepare(st)?;
    let _quiet = st.pool.quiet();
    let mut stats = BarrierStats::default();
    let moved = move_held(st, &mut stats)?;
    commit_locked(st, moved, &mut stats)?;
    Ok(stats)
}

/// Holds the writers, runs a barrier, then `op` on the state (so what
/// `op` commits to the image's metadata points only at durable data), and
/// refills the pool; writers and the state lock are held throughout.
pub(crate) fn after_barrier<T>(
    shared: &Shared,
    quiesce: &dyn Quiesce,
    op: impl FnOnce(&mut RegionState) -> Result<T, BarrierError>,
) -> Result<T, BarrierError> {
    let _serial = shared.serialize();
    let _held = hold(quiesce)?;
    let mut st = shared.lock().map_err(|_| BarrierError::Poisoned)?;
    barrier_locked(&mut st)?;
    let r = op(&mut st)?;
    request_refill(&mut st);
    Ok(r)
}

/// After a snapshot: every shared cluster is read-only history now; map it
/// private (same file, same offsets, same content). Writers must be held.
pub(crate) fn demote_shared(st: &mut RegionState) -> Result<u64, BarrierError> {
    parts(st)?.demote_shared()
}

impl Parts<'_> {
    /// Past the zero budget, turns every zero-mapped cluster that the image
    /// holds nothing for back into a hole: its page tables go, so the next
    /// scans skip it. Writers must be held, and the barrier's pages moved:
    /// a zero-mapped cluster the guest wrote is then either shared (moved
    /// and remapped) or in the image (moved, its remap failed), and only
    /// one whose pages all read as zeros is left to return. On an error the
    /// clusters not yet returned stay zero-mapped, which is correct.
    fn rehole_zero_clusters(&mut self, stats: &mut BarrierStats) -> Result<(), BarrierError> {
        // Counted by this barrier's scan (an upper bound: the move may
        // have turned some into shared clusters); counted here otherwise.
        let zero = match self.tracking.zero_counted.take() {
            Some(n) => n,
            None => self.view.clusters.runs_of([ClusterState::Zero]).1[0],
        };
        if zero.saturating_mul(self.view.cs) <= self.tracking.zero_budget {
            return Ok(());
        }
        let cs = self.view.cs;
        for (a, b) in self.view.clusters.runs(ClusterState::Zero) {
            let mut vcn = a;
            while vcn < b {
                // Runs of clusters the image has nothing for, one madvise
                // each.
                let start = vcn;
                while vcn < b && matches!(self.image.cluster_source(vcn), ClusterSource::Hole) {
                    vcn += 1;
                }
                if vcn > start {
                    self.view
                        .mapping
                        .discard(start * cs, (vcn - start) * cs)
                        .map_err(|source| BarrierError::Rehole {
                            vcn: start,
                            count: vcn - start,
                            source,
                        })?;
                    self.view.clusters.set(start, vcn, ClusterState::Hole);
                    stats.reholed += vcn - start;
                }
                vcn += u64::from(vcn < b);
            }
        }
        Ok(())
    }

    /// Moves the harvested pages into the writable layer.
    fn move_pages(
        &mut self,
        harvest: &Harvest,
        stats: &mut BarrierStats,
    ) -> Result<(), BarrierError> {
        let cs = self.view.cs;
        let npages = (cs / PAGE_SIZE) as usize;
        let t = Instant::now();
        for (vcn, pages) in harvest {
            let (vcn, pages) = (*vcn, pages.as_slice());
            let state = self.view.clusters.get(vcn);
            match state {
                ClusterState::Zero | ClusterState::Private => {}
                // Carried over from a failed barrier that had already
                // moved the cluster and mapped it shared: in the image.
                ClusterState::Shared => continue,
                // Shared clusters have no private pages and holes have no
                // pages at all; anything else is a bookkeeping bug.
                other => {
                    log::error!("cluster {vcn}: private pages in a {other:?} cluster, skipped");
                    continue;
                }
            }
            // Every page is copied (pwrite) before the cluster is mapped:
            // only those pages need space.
            let ac = self.image.active_cluster_written(vcn)?;
            let fd = top_fd(self.image).map_err(|source| BarrierError::Copy {
                vcn,
                file_offset: ac.file_offset,
                source,
            })?;
            if ac.whole {
                // Nothing below (a former hole): the cluster is the
                // writable layer's whole, as the region shows it.
                self.copy_out(vcn, fd, ac.file_offset, 0, cs)?;
                self.image.record_pages(vcn, 0, npages)?;
                stats.pages_copied += npages as u64;
                self.remap_shared(vcn, fd, ac.file_offset, stats)?;
            } else {
                for (first, end) in index_runs(pages.iter().map(|&p| u64::from(p))) {
                    let n = end - first;
                    self.copy_out(vcn, fd, ac.file_offset, first * PAGE_SIZE, n * PAGE_SIZE)?;
                    self.image.record_pages(vcn, first as usize, n as usize)?;
                }
                stats.pages_copied += pages.len() as u64;
                stats.clusters_partial += 1;
                // Every page written at some barrier: the file holds what
                // the region shows (each page was copied when last
                // written), so a shared mapping changes nothing.
                if self.image.active_cluster(vcn)?.whole {
                    self.remap_shared(vcn, fd, ac.file_offset, stats)?;
                }
            }
            stats.clusters_copied += 1;
        }
        stats.copy = t.elapsed();
        Ok(())
    }

    /// Maps cluster `vcn` shared from the top file at `file_offset`, whose
    /// content equals what the region shows there. Writers must be held.
    fn remap_shared(
        &mut self,
        vcn: u64,
        fd: RawFd,
        file_offset: u64,
        stats: &mut BarrierStats,
    ) -> Result<(), BarrierError> {
        let cs = self.view.cs;
        match self
            .view
            .mapping
            .map_file(vcn * cs, cs, fd, file_offset, true)
        {
            Ok(()) => {
                self.view.clusters.set(vcn, vcn + 1, ClusterState::Shared);
                stats.clusters_remapped += 1;
                Ok(())
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => {
                // Out of mappings (vm.max_map_count): the data is in the
                // image; the cluster stays private, its pages protected
                // like every page harvested, so the next write there is
                // found and copied, and the remap tried again
                // (`a_remap_refused_at_the_vma_limit_leaves_the_data_in_the_image`).
                if stats.remap_failures == 0 {
                    log::warn!("cluster {vcn}: left unmapped from the image: {e}");
                }
                stats.remap_failures += 1;
                Ok(())
            }
            Err(source) => Err(BarrierError::Remap { vcn, source }),
        }
    }

    /// Writes `len` bytes at byte `from` of cluster `vcn` as the region
    /// shows them into the top file's cluster at `file_offset`.
    fn copy_out(
        &self,
        vcn: u64,
        fd: RawFd,
        file_offset: u64,
        from: u64,
        len: u64,
    ) -> Result<(), BarrierError> {
        let cs = self.view.cs;
        let err = |source| BarrierError::Copy {
            vcn,
            file_offset,
            source,
        };
        if from.checked_add(len).is_none_or(|e| e > cs) {
            return Err(err(std::io::Error::from_raw_os_error(libc::EINVAL)));
        }
        let p = self.view.mapping.ptr(vcn * cs + from, len).map_err(err)?;
        let mut done = 0u64;
        while done < len {
            let off = libc::off_t::try_from(file_offset + from + done)
                .map_err(|_| err(std::io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
            // `p + done .. p + len` is mapped region memory (checked in
            // bounds by `ptr`). Writers are held, and the cluster is private
            // or zero-mapped, so every page is present or file-backed and
            // reading it never waits on the monitor (which may need the lock
            // we hold); a read does not trip write protection.
            // SAFETY: so the kernel only reads valid, quiescent memory.
            let n = unsafe {
                libc::pwrite(fd, p.add(done as usize).cast(), (len - done) as usize, off)
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err(e));
            }
            if n == 0 {
                return Err(err(std::io::Error::from(std::io::ErrorKind::WriteZero)));
            }
            done += n as u64;
        }
        Ok(())
    }

    /// After a snapshot: every shared cluster is read-only history now;
    /// map it private (same file, same offsets, same content), in runs
    /// contiguous in the file. Writers must be held.
    fn demote_shared(&mut self) -> Result<u64, BarrierError> {
        let cs = self.view.cs;
        let fd = top_fd(self.image).map_err(|source| BarrierError::Remap { vcn: 0, source })?;
        let mut runs = Vec::new();
        for (a, b) in self.view.clusters.runs(ClusterState::Shared) {
            for vcn in a..b {
                let ClusterSource::ReadOnly { depth: 0, offset } = self.image.cluster_source(vcn)
                else {
                    return Err(BarrierError::Remap {
                        vcn,
                        source: std::io::Error::other("a shared cluster is not in the snapshot"),
                    });
                };
                push_run(
                    &mut runs,
                    FileRun {
                        vcn,
                        end: vcn + 1,
                        offset,
                        cs,
                    },
                );
            }
        }
        let mut demoted = 0;
        for r in runs {
            self.view
                .map_clusters(r.vcn, r.end, fd, r.offset, false)
                .map_err(|source| BarrierError::Remap { vcn: r.vcn, source })?;
            // The new private mapping must be tracked: writes to it are
            // copy-on-write from now on.
            self.tracking.track(self.view, r.vcn, r.end);
            demoted += r.end - r.vcn;
        }
        Ok(demoted)
    }
}
