//! The flush barrier: moves every page the guest wrote into private memory
//! (copy-on-write of read-only layers, writes into zero-mapped holes) into
//! the writable layer, then makes data durable, then metadata, in the
//! order the spec defines (the image's own `flush`).
//!
//! The handshake with the VMM: writers are held ([`Quiesce::hold`]) for the
//! whole harvest, so the copy from the region into the file and the remap
//! over the cluster see no concurrent write; nothing a guest wrote can be
//! lost between them. The monitor keeps serving faults while the barrier
//! waits for the hold (the region lock is taken only once writers are
//! held), so a writer blocked in a fault cannot deadlock the barrier.
//! The commit (the syncs) needs no hold: once the pages are copied and
//! their tracking re-armed, a write belongs to the next barrier, so the
//! guest's FLUSH releases the writers before it; only a fault that needs
//! the image (a write into a hole) waits for the region lock meanwhile.
//!
//! Copy-on-write is per 4 KiB page: a cluster with data below gets only
//! its written pages copied into the writable layer's cluster (a partial
//! bitmap on disk, the rest read through from below) and keeps its private
//! mapping; a former hole (nothing below) becomes a whole cluster mapped
//! shared. Pages already copied stay private and may be written again, so
//! a barrier must find the pages written since the previous one, not every
//! private page: private clusters are registered with a WP-async
//! userfaultfd ([`WriteTracker`]); `PAGEMAP_SCAN` reports the pages
//! written since they were last write-protected, and the barrier
//! re-protects them (and the pages the guest faulted in by reading), all
//! while writers are held. The kernel keeps no summary, so the walk still
//! visits every page-table entry present in the private ranges, but only
//! with its fast path (the PTE's write-protect bit, about 0.4 ms per GiB of
//! populated page tables); pages are classified only where something
//! changed. The cost follows the pages written and read since the last
//! barrier, plus that walk. Without WP-async (kernel before 6.7, or the
//! pagemap read fallback) every private page is copied again at every
//! barrier: correct, slower.
//!
//! Zero-mapped holes (holes the guest read) are tracked the same way, but
//! through the monitor's userfaultfd, which their range belongs to: it is
//! opened WP-async too and registers holes in missing and write-protect
//! mode. Missing faults still reach the monitor; the zero pages it maps
//! start unprotected, so the first barrier after a read classifies them
//! once and protects them, and a later write to one is found like a
//! write to a private cluster. A zero-mapped cluster is populated whole,
//! so that protection never leaves a marker on an empty entry (which
//! `UFFDIO_ZEROPAGE` would refuse; the monitor copies zeros there). Without
//! WP-async every barrier classifies each of their pages, about 10 ms per
//! GiB here. Past the zero budget ([`crate::RegionOptions::zero_budget`]) a
//! barrier turns the ones nobody wrote back into holes (`MADV_DONTNEED` of
//! zero pages, writers held), which bounds their page tables and, without
//! tracking, that classification.

use std::os::fd::RawFd;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use pcow::ClusterSource;

use crate::pagemap::{PagemapError, ScanMethod, WriteTracker, PAGE_SIZE};
use crate::region::{ClusterState, RegionState};

/// Holds the guest's writers for a barrier. A VMM pauses its vCPUs; tests
/// use [`WriteGate`].
///
/// The monitor serves faults on a thread of its own, so a writer blocked
/// in a fault is released while `hold` waits for it.
pub trait Quiesce: Send + Sync {
    /// Returns once no writer runs and none will start until `release`;
    /// or fails (a writer did not stop in time) with nothing held.
    fn hold(&self) -> Result<(), QuiesceError>;
    /// Lets writers run again (after a `hold` that succeeded).
    fn release(&self);
}

/// Why the guest's writers could not be held (e.g. a vCPU that did not
/// leave `KVM_RUN` within the VMM's deadline); nothing is held.
#[derive(Debug, thiserror::Error)]
#[error("holding the guest's writers")]
pub struct QuiesceError(#[source] pub Box<dyn std::error::Error + Send + Sync>);

/// Releases the hold when dropped (also on an early error return).
struct Held<'a>(&'a dyn Quiesce);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Holds writers for the lifetime of the returned guard.
pub(crate) fn hold(q: &dyn Quiesce) -> Result<impl Drop + '_, QuiesceError> {
    q.hold()?;
    Ok(Held(q))
}

/// A writer-preferring gate: writers [`enter`](WriteGate::enter) around each
/// write; [`Quiesce::hold`] waits for writers inside to leave and keeps new
/// ones out. Stands in for pausing vCPUs in tests and tools.
#[derive(Debug, Default)]
pub struct WriteGate {
    state: Mutex<GateState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    writers: usize,
    held: bool,
    waiting: usize,
}

/// A writer inside a [`WriteGate`]; leaves on drop.
#[derive(Debug)]
pub struct GateEntry<'a>(&'a WriteGate);

impl WriteGate {
    /// A gate with nobody inside.
    pub fn new() -> WriteGate {
        WriteGate::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // The state is two counters and a flag, valid after any panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enters as a writer (waits while a barrier holds or waits to hold).
    pub fn enter(&self) -> GateEntry<'_> {
        let mut s = self.lock();
        while s.held || s.waiting > 0 {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.writers += 1;
        GateEntry(self)
    }
}

impl Drop for GateEntry<'_> {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.writers -= 1;
        drop(s);
        self.0.cv.notify_all();
    }
}

impl Quiesce for WriteGate {
    fn hold(&self) -> Result<(), QuiesceError> {
        let mut s = self.lock();
        s.waiting += 1;
        while s.held || s.writers > 0 {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.waiting -= 1;
        s.held = true;
        Ok(())
    }

    fn release(&self) {
        let mut s = self.lock();
        s.held = false;
        drop(s);
        self.cv.notify_all();
    }
}

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
    Maps(#[source] Box<crate::region::RegionError>),
}

/// What one barrier did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BarrierStats {
    /// Written private pages found (with write tracking: written since the
    /// previous barrier; without: every private page).
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
    /// Whether a tracked scan took two walks (many present pages
    /// protected; see `PageScanner::written_since`), not one.
    pub two_walks: bool,
    /// Time spent finding the written pages.
    pub scan: Duration,
    /// Time spent copying pages into the image and remapping.
    pub copy: Duration,
    /// Time spent in the image's barrier (syncs and metadata commit).
    pub commit: Duration,
    /// Time writers were held: the scan and the copy. A plain barrier
    /// ([`crate::PcowRegion::barrier`], the guest's FLUSH) releases them
    /// before its commit; snapshots and overlays hold them throughout.
    pub held: Duration,
}

/// Pages to move: (vcn, sorted page indices in the cluster), sorted by vcn.
pub(crate) type Harvest = Vec<(u64, Vec<u32>)>;

/// Merges `more` into `into` (both sorted by vcn, pages sorted and
/// unique): the result is sorted, each page once.
fn merge_harvest(into: &mut Harvest, more: Harvest) {
    if more.is_empty() {
        return;
    }
    let mut pages: Vec<(u64, u32)> = into
        .drain(..)
        .chain(more)
        .flat_map(|(vcn, list)| list.into_iter().map(move |p| (vcn, p)))
        .collect();
    pages.sort_unstable();
    pages.dedup();
    for (vcn, page) in pages {
        match into.last_mut() {
            Some((v, list)) if *v == vcn => list.push(page),
            _ => into.push((vcn, vec![page])),
        }
    }
}

/// Whether an error (or one of its sources) is the file system being out
/// of space (ENOSPC) or quota (EDQUOT): the condition a VMM answers by
/// pausing the guest until space is freed, like QEMU's `werror=enospc`.
pub fn is_out_of_space(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

impl RegionState {
    /// Maximal runs `[first, end)` of clusters in `state`.
    fn cluster_runs(&self, state: ClusterState) -> Vec<(u64, u64)> {
        let ([runs], _) = self.cluster_runs_of([state]);
        runs
    }

    /// Maximal runs of clusters in each of `states`, in one pass over the
    /// clusters (a million at 64 GiB of 64 KiB clusters: a pass is about a
    /// millisecond, which a barrier pays), and the clusters in each.
    fn cluster_runs_of<const N: usize>(
        &self,
        states: [ClusterState; N],
    ) -> ([Vec<(u64, u64)>; N], [u64; N]) {
        let mut runs: [Vec<(u64, u64)>; N] = std::array::from_fn(|_| Vec::new());
        let mut counts = [0u64; N];
        let mut i = 0u64;
        for same in self.clusters.chunk_by(|a, b| a == b) {
            let n = same.len() as u64;
            if let Some(k) = states.iter().position(|s| *s == same[0]) {
                runs[k].push((i, i + n));
                counts[k] += n;
            }
            i += n;
        }
        (runs, counts)
    }

    /// Starts write tracking of every private cluster (called once the
    /// region is built). Without it (`enable` false, or a kernel without
    /// WP-async) every barrier re-copies every private page: correct, but
    /// its cost grows with what was ever written.
    pub(crate) fn start_tracking(&mut self, enable: bool) {
        if !enable {
            return;
        }
        let tracker = match WriteTracker::new() {
            Ok(t) => t,
            Err(e) => {
                log::warn!("no write tracking, barriers re-copy every private page: {e}");
                return;
            }
        };
        let base = self.mapping.base();
        for (a, b) in self.cluster_runs(ClusterState::Private) {
            if let Err(e) = tracker.register(base + a * self.cs, (b - a) * self.cs) {
                log::warn!("no write tracking, barriers re-copy every private page: {e}");
                return;
            }
        }
        self.tracker = Some(tracker);
        self.zero_tracker = self.uffd.write_tracker();
    }

    /// Tracks `[vcn, end)` (just mapped private); on failure gives up
    /// tracking for the whole region (barriers then re-copy every private
    /// page, which stays correct).
    pub(crate) fn track(&mut self, vcn: u64, end: u64) {
        let Some(t) = &self.tracker else {
            return;
        };
        let base = self.mapping.base();
        if let Err(e) = t.register(base + vcn * self.cs, (end - vcn) * self.cs) {
            log::warn!("write tracking stopped, barriers re-copy every private page: {e}");
            self.tracker = None;
        }
    }

    /// The private page runs of the whole region, as addresses.
    fn written_runs(&mut self) -> Result<Vec<(u64, u64)>, PagemapError> {
        let base = self.mapping.base();
        let mut runs = Vec::new();
        self.scanner
            .written(base, base + self.mapping.len() as u64, &mut runs)?;
        Ok(runs)
    }

    /// The scanner's written pages of `[start, end)`, re-protected through
    /// the tracker when `protect` (writers held).
    fn written_since(
        &mut self,
        start: u64,
        end: u64,
        protect: bool,
        runs: &mut Vec<(u64, u64)>,
    ) -> Result<(), PagemapError> {
        let tracker = if protect { self.tracker.as_ref() } else { None };
        self.scanner.written_since(start, end, tracker, runs)
    }

    /// With write tracking: the pages of private clusters written since the
    /// last barrier (write-protected again when `protect`: writers must be
    /// held), then those of zero-mapped holes (likewise through the
    /// monitor's userfaultfd; without it, every private page there), as
    /// addresses, per scan sorted.
    fn tracked_runs(&mut self, protect: bool) -> Result<Vec<(u64, u64)>, PagemapError> {
        let base = self.mapping.base();
        let cs = self.cs;
        let mut runs = Vec::new();
        let ([private_runs, zero_runs], counts) =
            self.cluster_runs_of([ClusterState::Private, ClusterState::Zero]);
        self.zero_counted = Some(counts[1]);
        // Past the budget, this barrier moves each zero-mapped cluster with
        // written pages (remapped shared) and returns the others to holes:
        // protecting their pages would be wasted (a cluster a failure
        // leaves zero-mapped is only reported again).
        let protect_zero = protect && counts[1].saturating_mul(cs) <= self.zero_budget;
        for (a, b) in private_runs {
            let (start, end) = (base + a * cs, base + b * cs);
            match self.written_since(start, end, protect, &mut runs) {
                Err(PagemapError::NotTracked { .. }) => {
                    // A private range nobody registered (a bookkeeping
                    // slip): track it now; until now nothing was
                    // write-protected there, so every private page of it
                    // counts as written, which is what a retry reports.
                    log::warn!("clusters {a}..{b}: private but not tracked; tracking now");
                    self.track(a, b);
                    if self.tracker.is_none() {
                        return Err(PagemapError::NotTracked { start, end });
                    }
                    self.written_since(start, end, protect, &mut runs)?;
                }
                r => r?,
            }
        }
        for (a, b) in zero_runs {
            let (start, end) = (base + a * cs, base + b * cs);
            if let Some(zt) = &self.zero_tracker {
                let protect = if protect_zero { Some(zt) } else { None };
                // A zero-mapped cluster is populated whole (the zero page
                // or the guest's pages), so the protection never reaches
                // an empty entry, whose marker UFFDIO_ZEROPAGE would
                // refuse after a re-hole.
                match self.scanner.written_since(start, end, protect, &mut runs) {
                    Err(PagemapError::NotTracked { .. }) => {
                        log::warn!(
                            "zero-mapped clusters {a}..{b} not write-tracked; \
                             barriers classify their pages"
                        );
                        self.zero_tracker = None;
                    }
                    r => {
                        r?;
                        continue;
                    }
                }
            }
            self.scanner.written(start, end, &mut runs)?;
        }
        Ok(runs)
    }

    /// Private pages not yet moved into the image (pages a failed barrier
    /// left may count twice: an upper bound). Without write tracking,
    /// every private page counts (also those already in the image); with
    /// the pagemap read fallback, zero pages of zero-mapped holes too (an
    /// upper bound).
    pub(crate) fn pending_pages(&mut self) -> Result<u64, PagemapError> {
        let runs = if self.tracker.is_some() {
            match self.tracked_runs(false) {
                Ok(r) => r,
                Err(PagemapError::NotTracked { .. }) => self.written_runs()?,
                Err(e) => return Err(e),
            }
        } else {
            self.written_runs()?
        };
        let unsaved: usize = self.unsaved.iter().map(|(_, p)| p.len()).sum();
        Ok(runs.iter().map(|(a, b)| (b - a) / PAGE_SIZE).sum::<u64>() + unsaved as u64)
    }

    /// Whether the page at region offset `off` is all zeros.
    ///
    /// Only called with writers held, on pages that are present.
    fn page_is_zero(&self, off: u64) -> bool {
        let Ok(p) = self.mapping.ptr(off, PAGE_SIZE) else {
            return false;
        };
        // `p` points to a mapped, readable page of the region (checked in
        // bounds) and the page is present, so reading it cannot wait on
        // the monitor.
        // SAFETY: writers are held, so nothing writes the page while the
        // slice lives.
        let page = unsafe { std::slice::from_raw_parts(p, PAGE_SIZE as usize) };
        page.iter().all(|&b| b == 0)
    }

    /// The written pages to move at this barrier, by cluster. Write
    /// protection is re-armed on the pages returned (with tracking).
    fn harvest(&mut self, stats: &mut BarrierStats) -> Result<Harvest, BarrierError> {
        let base = self.mapping.base();
        let cs = self.cs;
        self.zero_counted = None;
        stats.tracked = self.tracker.is_some();
        let runs = if stats.tracked {
            let before = self.scanner.two_walk_scans();
            let runs = self.tracked_runs(true)?;
            stats.two_walks = self.scanner.two_walk_scans() > before;
            runs
        } else {
            self.written_runs()?
        };
        let fallback = self.scanner.method() == ScanMethod::Read;
        let mut pages: Vec<(u64, u32)> = Vec::new();
        for &(a, b) in &runs {
            let mut p = a;
            while p < b {
                let off = p - base;
                let vcn = off / cs;
                // The read fallback cannot tell the zero page from a written
                // page: an all-zero page over a zero view changes nothing.
                let skip = fallback
                    && self.clusters[vcn as usize] == ClusterState::Zero
                    && self.page_is_zero(off);
                if !skip {
                    pages.push((vcn, ((off % cs) / PAGE_SIZE) as u32));
                }
                p += PAGE_SIZE;
            }
        }
        pages.sort_unstable();
        pages.dedup();
        stats.private_pages = pages.len() as u64;
        let mut out: Harvest = Vec::new();
        for (vcn, page) in pages {
            match out.last_mut() {
                Some((v, list)) if *v == vcn => list.push(page),
                _ => out.push((vcn, vec![page])),
            }
        }
        Ok(out)
    }

    /// Moves every written private page into the writable layer and
    /// commits: the barrier proper. Writers must be held by the caller.
    ///
    /// - a zero-mapped hole (nothing below) becomes a whole fresh cluster:
    ///   copied entirely, recorded entirely, remapped shared;
    /// - a private cluster (data below) gets only its written pages copied
    ///   into the writable layer's cluster and recorded (a partial bitmap:
    ///   the rest still reads from below) and keeps its private mapping, so
    ///   the guest keeps its pages; once the writable layer holds every
    ///   page, the cluster is remapped shared.
    ///
    /// A barrier that fails commits nothing and keeps what it harvested for
    /// the next one ([`RegionState::unsaved`]), so a later barrier that
    /// succeeds moves every page written before it.
    pub(crate) fn barrier_held(&mut self) -> Result<BarrierStats, BarrierError> {
        let mut stats = BarrierStats::default();
        let moved = self.barrier_move(&mut stats)?;
        self.barrier_commit(moved, &mut stats)?;
        Ok(stats)
    }

    /// The first half of a barrier, which needs writers held: finds the
    /// pages written since the last barrier, re-arms their write tracking,
    /// copies them into the writable layer and stages its metadata. After
    /// it, what the guest writes belongs to the next barrier, so writers
    /// may run during [`RegionState::barrier_commit`].
    pub(crate) fn barrier_move(&mut self, stats: &mut BarrierStats) -> Result<Moved, BarrierError> {
        let t = Instant::now();
        let mut harvest = self.harvest(stats)?;
        merge_harvest(&mut harvest, std::mem::take(&mut self.unsaved));
        stats.scan = t.elapsed();
        match self.move_pages(&harvest, stats) {
            Ok(()) => {
                // Only a saving: a barrier does not fail for it.
                if let Err(e) = self.rehole_zero_clusters(stats) {
                    log::warn!("{}", pcow::check::error_chain(&e));
                }
                Ok(Moved { harvest })
            }
            Err(e) => {
                self.unsaved = harvest;
                Err(e)
            }
        }
    }

    /// The second half: makes the moved pages durable and commits the
    /// metadata (the image's barrier: data and slots, sync, header, sync).
    /// On failure the harvest is kept, and the next barrier copies its
    /// pages again (with whatever the guest wrote there since).
    pub(crate) fn barrier_commit(
        &mut self,
        moved: Moved,
        stats: &mut BarrierStats,
    ) -> Result<(), BarrierError> {
        let t = Instant::now();
        // Shared mappings dirty the top file's page cache directly: always
        // sync data before the metadata commit.
        self.image.mark_data_written();
        let r = self.image.flush();
        stats.commit = t.elapsed();
        match r {
            Ok(()) => {
                self.out_of_space = None;
                Ok(())
            }
            Err(e) => {
                self.unsaved = moved.harvest;
                Err(e.into())
            }
        }
    }

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
        let zero = match self.zero_counted.take() {
            Some(n) => n,
            None => self.cluster_runs_of([ClusterState::Zero]).1[0],
        };
        if zero.saturating_mul(self.cs) <= self.zero_budget {
            return Ok(());
        }
        let cs = self.cs;
        for (a, b) in self.cluster_runs(ClusterState::Zero) {
            let mut vcn = a;
            while vcn < b {
                // Runs of clusters the image has nothing for, one madvise
                // each.
                let start = vcn;
                while vcn < b && matches!(self.image.cluster_source(vcn), ClusterSource::Hole) {
                    vcn += 1;
                }
                if vcn > start {
                    self.mapping
                        .discard(start * cs, (vcn - start) * cs)
                        .map_err(|source| BarrierError::Rehole {
                            vcn: start,
                            count: vcn - start,
                            source,
                        })?;
                    for c in &mut self.clusters[start as usize..vcn as usize] {
                        *c = ClusterState::Hole;
                    }
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
        let cs = self.cs;
        let npages = (cs / PAGE_SIZE) as usize;
        let t = Instant::now();
        for (vcn, pages) in harvest {
            let (vcn, pages) = (*vcn, pages.as_slice());
            let state = self.clusters[vcn as usize];
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
            let fd = self.top_fd().map_err(|source| BarrierError::Copy {
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
                let mut i = 0;
                while i < pages.len() {
                    let first = pages[i];
                    let mut n = 1;
                    while i + n < pages.len() && pages[i + n] == first + n as u32 {
                        n += 1;
                    }
                    let from = u64::from(first) * PAGE_SIZE;
                    self.copy_out(vcn, fd, ac.file_offset, from, n as u64 * PAGE_SIZE)?;
                    self.image.record_pages(vcn, first as usize, n)?;
                    i += n;
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
        let cs = self.cs;
        match self.mapping.map_file(vcn * cs, cs, fd, file_offset, true) {
            Ok(()) => {
                self.clusters[vcn as usize] = ClusterState::Shared;
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
        let cs = self.cs;
        let err = |source| BarrierError::Copy {
            vcn,
            file_offset,
            source,
        };
        if from.checked_add(len).is_none_or(|e| e > cs) {
            return Err(err(std::io::Error::from_raw_os_error(libc::EINVAL)));
        }
        let p = self.mapping.ptr(vcn * cs + from, len).map_err(err)?;
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
    /// map it private (same file, same offsets, same content). Writers
    /// must be held.
    pub(crate) fn demote_shared(&mut self) -> Result<u64, BarrierError> {
        let cs = self.cs;
        let n = self.clusters.len() as u64;
        let fd = self
            .top_fd()
            .map_err(|source| BarrierError::Remap { vcn: 0, source })?;
        let mut demoted = 0;
        let mut vcn = 0;
        while vcn < n {
            if self.clusters[vcn as usize] != ClusterState::Shared {
                vcn += 1;
                continue;
            }
            let pcow::ClusterSource::ReadOnly { depth: 0, offset } = self.image.cluster_source(vcn)
            else {
                return Err(BarrierError::Remap {
                    vcn,
                    source: std::io::Error::other("a shared cluster is not in the snapshot"),
                });
            };
            // Extend over following shared clusters contiguous in the file.
            let mut end = vcn + 1;
            while end < n
                && self.clusters[end as usize] == ClusterState::Shared
                && self.image.cluster_source(end)
                    == (pcow::ClusterSource::ReadOnly {
                        depth: 0,
                        offset: offset + (end - vcn) * cs,
                    })
            {
                end += 1;
            }
            self.mapping
                .map_file(vcn * cs, (end - vcn) * cs, fd, offset, false)
                .map_err(|source| BarrierError::Remap { vcn, source })?;
            for v in vcn..end {
                self.clusters[v as usize] = ClusterState::Private;
            }
            // The new private mapping must be tracked: writes to it are
            // copy-on-write from now on.
            self.track(vcn, end);
            demoted += end - vcn;
            vcn = end;
        }
        Ok(demoted)
    }
}

/// A barrier whose pages are moved ([`RegionState::barrier_move`]) but not
/// yet committed.
pub(crate) struct Moved {
    harvest: Harvest,
}

/// Runs `f` with writers held; measures the hold.
pub(crate) fn with_hold<T>(
    q: &dyn Quiesce,
    f: impl FnOnce() -> Result<T, BarrierError>,
) -> Result<(T, Duration), BarrierError> {
    let _held = hold(q)?;
    let t = Instant::now();
    let r = f()?;
    Ok((r, t.elapsed()))
}
