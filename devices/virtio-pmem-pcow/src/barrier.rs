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
//!
//! This barrier copies whole clusters: a cluster with one written private
//! page is copied entirely into a new cluster of the writable layer (all of
//! its pages recorded). Storing only the written 4 KiB pages (a partial
//! bitmap, the rest read through from below) is a later improvement.

use std::os::fd::RawFd;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::pagemap::{PagemapError, ScanMethod, PAGE_SIZE};
use crate::region::{ClusterState, RegionState};

/// Holds the guest's writers for a barrier. A VMM pauses its vCPUs; tests
/// use [`WriteGate`].
///
/// `hold` must not wait for something that only the monitor can release
/// unless the monitor runs on another thread (a vCPU blocked in a fault
/// inside `KVM_RUN` is released by the monitor, or interrupted by the
/// pause signal).
pub trait Quiesce: Send + Sync {
    /// Returns once no writer runs and none will start until `release`.
    fn hold(&self);
    /// Lets writers run again.
    fn release(&self);
}

/// Releases the hold when dropped (also on an early error return).
struct Held<'a>(&'a dyn Quiesce);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Holds writers for the lifetime of the returned guard.
pub(crate) fn hold(q: &dyn Quiesce) -> impl Drop + '_ {
    q.hold();
    Held(q)
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
    fn hold(&self) {
        let mut s = self.lock();
        s.waiting += 1;
        while s.held || s.writers > 0 {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.waiting -= 1;
        s.held = true;
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
    #[error("region state lock poisoned by a panic")]
    Poisoned,
    #[error(
        "rollback of a running device is refused: it would replace what the guest sees; \
         stop the VM and use `pcow-img snapshot -a`"
    )]
    LiveRollback,
    #[error("reading the process's mappings")]
    Maps(#[source] Box<crate::region::RegionError>),
}

/// What one barrier did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BarrierStats {
    /// Private pages found.
    pub private_pages: u64,
    /// Clusters copied into the writable layer.
    pub clusters_copied: u64,
    /// Clusters left private because remapping them failed (they are in
    /// the image; the next barrier copies them again).
    pub remap_failures: u64,
    /// Time spent holding writers.
    pub held: Duration,
}

impl RegionState {
    /// The private page runs of the whole region, as addresses.
    fn written_runs(&mut self) -> Result<Vec<(u64, u64)>, PagemapError> {
        let base = self.mapping.base();
        let mut runs = Vec::new();
        self.scanner
            .written(base, base + self.mapping.len() as u64, &mut runs)?;
        Ok(runs)
    }

    /// Private pages not yet moved into the image. With the pagemap read
    /// fallback, zero pages of zero-mapped holes count too (an upper bound).
    pub(crate) fn pending_pages(&mut self) -> Result<u64, PagemapError> {
        Ok(self
            .written_runs()?
            .iter()
            .map(|(a, b)| (b - a) / PAGE_SIZE)
            .sum())
    }

    /// Whether the page at region offset `off` is all zeros.
    ///
    /// Only called with writers held, on pages that are present.
    fn page_is_zero(&self, off: u64) -> bool {
        let Ok(p) = self.mapping.ptr(off, PAGE_SIZE) else {
            return false;
        };
        // SAFETY: `p` points to a mapped, readable page of the region
        // (checked in bounds); writers are held, so nothing writes it while
        // the slice lives; the page is present, so reading it cannot wait
        // on the monitor.
        let page = unsafe { std::slice::from_raw_parts(p, PAGE_SIZE as usize) };
        page.iter().all(|&b| b == 0)
    }

    /// Moves every private page into the writable layer and commits: the
    /// barrier proper. Writers must be held by the caller.
    pub(crate) fn barrier_held(&mut self) -> Result<BarrierStats, BarrierError> {
        let mut stats = BarrierStats::default();
        let base = self.mapping.base();
        let cs = self.cs;
        let runs = self.written_runs()?;
        let fallback = self.scanner.method() == ScanMethod::Read;
        let mut vcns: Vec<u64> = Vec::new();
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
                    stats.private_pages += 1;
                    if vcns.last() != Some(&vcn) {
                        vcns.push(vcn);
                    }
                }
                p += PAGE_SIZE;
            }
        }
        let pages = (cs / PAGE_SIZE) as usize;
        for vcn in vcns {
            match self.clusters[vcn as usize] {
                ClusterState::Zero | ClusterState::Private => {}
                // Shared clusters have no private pages and holes have no
                // pages at all; anything else is a bookkeeping bug.
                other => {
                    log::error!("cluster {vcn}: private pages in a {other:?} cluster, skipped");
                    continue;
                }
            }
            let ac = self.image.active_cluster(vcn)?;
            let fd = self.top_fd().map_err(|source| BarrierError::Copy {
                vcn,
                file_offset: ac.file_offset,
                source,
            })?;
            self.copy_out(vcn, fd, ac.file_offset)?;
            self.image.record_pages(vcn, 0, pages)?;
            match self
                .mapping
                .map_file(vcn * cs, cs, fd, ac.file_offset, true)
            {
                Ok(()) => self.clusters[vcn as usize] = ClusterState::Shared,
                Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => {
                    // Out of mappings (vm.max_map_count): the data is in the
                    // image; the cluster stays private and is copied again
                    // at the next barrier.
                    if stats.remap_failures == 0 {
                        log::warn!("cluster {vcn}: left private: {e}");
                    }
                    stats.remap_failures += 1;
                }
                Err(source) => return Err(BarrierError::Remap { vcn, source }),
            }
            stats.clusters_copied += 1;
        }
        // Shared mappings dirty the top file's page cache directly: always
        // sync data before the metadata commit.
        self.image.mark_data_written();
        self.image.flush()?;
        Ok(stats)
    }

    /// Writes cluster `vcn` as the region shows it into the top file.
    fn copy_out(&self, vcn: u64, fd: RawFd, file_offset: u64) -> Result<(), BarrierError> {
        let cs = self.cs;
        let err = |source| BarrierError::Copy {
            vcn,
            file_offset,
            source,
        };
        let p = self.mapping.ptr(vcn * cs, cs).map_err(err)?;
        let mut done = 0u64;
        while done < cs {
            let off = libc::off_t::try_from(file_offset + done)
                .map_err(|_| err(std::io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
            // SAFETY: `p + done .. p + cs` is mapped region memory (checked
            // in bounds by `ptr`); the kernel only reads it. Writers are
            // held, and the cluster is private or zero-mapped, so every page
            // is present or file-backed and reading it never waits on the
            // monitor (which may need the lock we hold).
            let n =
                unsafe { libc::pwrite(fd, p.add(done as usize).cast(), (cs - done) as usize, off) };
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
            demoted += end - vcn;
            vcn = end;
        }
        Ok(demoted)
    }
}

/// Runs `f` with writers held; measures the hold.
pub(crate) fn with_hold<T>(
    q: &dyn Quiesce,
    f: impl FnOnce() -> Result<T, BarrierError>,
) -> Result<(T, Duration), BarrierError> {
    let _held = hold(q);
    let t = Instant::now();
    let r = f()?;
    Ok((r, t.elapsed()))
}
