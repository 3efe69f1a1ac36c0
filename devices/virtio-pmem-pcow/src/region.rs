//! Building the host region of a pcow device: one reservation of the
//! device's size, with every cluster of the chain mapped where the image
//! says its bytes live.
//!
//! - a whole cluster of the writable layer: `MAP_SHARED` read-write from the
//!   top file (guest writes go straight to the image);
//! - a cluster of a read-only layer (snapshot, base image):
//!   `MAP_PRIVATE` from its file (the host kernel copies a page on write,
//!   without an exit; the barrier moves the copies into the image);
//! - a hole: the reservation's anonymous memory, registered with
//!   userfaultfd for missing pages (the monitor serves it);
//! - a mixed cluster: per page run, file pages `MAP_PRIVATE`, zero pages
//!   anonymous (not registered: a write there is harvested like a
//!   copy-on-write page).
//!
//! Adjacent clusters contiguous in the same file with the same mode share
//! one mapping. Every `MAP_FIXED` goes through [`Reservation`], which checks
//! that it stays inside the reservation.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use pcow::{ClusterSource, Image, PageLocation};

use crate::monitor::{FaultCounters, MonitorError, Uffd};
use crate::pagemap::{PageScanner, PagemapError, WriteTracker, PAGE_SIZE};

/// Alignment of the region (a KVM memslot, as Cloud Hypervisor places it).
pub const REGION_ALIGN: usize = 2 << 20;
/// VMAs kept free for the rest of the process (and for later faults and
/// barriers, which map clusters one at a time).
pub const VMA_MARGIN: u64 = 1024;

/// Errors building a region.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("image")]
    Image(#[from] pcow::Error),
    #[error("the image is not open for writing")]
    ReadOnly,
    #[error("host page size is {0}, only 4096 is supported")]
    PageSize(u64),
    #[error("virtual size {0} does not fit the address space")]
    TooLarge(u64),
    #[error("reserving {len} bytes of address space")]
    Reserve {
        len: u64,
        #[source]
        source: io::Error,
    },
    #[error(
        "mapping the image needs about {needed} memory mappings but only {available} of \
         vm.max_map_count={max} are free ({used} in use, {margin} kept spare): raise \
         vm.max_map_count (sysctl) or defragment the image with `pcow-img compact`"
    )]
    TooManyMappings {
        needed: u64,
        available: u64,
        max: u64,
        used: u64,
        margin: u64,
    },
    #[error("reading {what}")]
    Proc {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("chain file {depth}: {what}")]
    BadLayout { depth: usize, what: String },
    #[error(
        "mapping {len:#x} bytes at region offset {offset:#x} (file {depth} at {file_offset:#x})"
    )]
    Map {
        offset: u64,
        len: u64,
        depth: usize,
        file_offset: u64,
        #[source]
        source: io::Error,
    },
    #[error("userfaultfd")]
    Uffd(#[from] MonitorError),
    #[error("pagemap")]
    Pagemap(#[from] PagemapError),
}

/// How a region is built.
#[derive(Debug, Clone, Default)]
pub struct RegionOptions {
    /// Use this instead of `/proc/sys/vm/max_map_count` (tests).
    pub max_map_count: Option<u64>,
    /// Find written pages by reading `/proc/self/pagemap` instead of the
    /// `PAGEMAP_SCAN` ioctl (tests of the fallback; the ioctl is used when
    /// the kernel has it).
    pub pagemap_read_fallback: bool,
    /// Clusters the image pre-allocates (fallocate) ahead of the last one
    /// in use, see [`pcow::Image::set_pool_clusters`]; `None` is
    /// [`crate::pool::default_pool_bytes`] of the image's size. The pool's
    /// worker refills it; without one, the write fault that runs out does
    /// (about 1.1 ms for 4 MiB on tmpfs).
    pub pool_clusters: Option<u64>,
    /// The longest the monitor keeps reading its userfaultfd after a fault
    /// (see [`crate::fault_poll`]); `None` is
    /// [`crate::fault_poll::DEFAULT_FAULT_POLL`], zero never polls.
    pub fault_poll: Option<std::time::Duration>,
    /// Bytes of zero-mapped holes (holes the guest only read) a barrier
    /// leaves mapped. With write tracking every barrier's scan walks their
    /// page-table entries (its fast path, under 1 ms per GiB here); without
    /// it (a kernel before 6.7, or the pagemap read fallback) it classifies
    /// each of their pages (about 10 ms per GiB); a hole costs it a table
    /// lookup. Past the budget, a barrier turns every zero-mapped cluster
    /// nobody wrote back into a hole; a later read faults it in again.
    /// `None` is [`DEFAULT_ZERO_BUDGET`].
    pub zero_budget: Option<u64>,
}

/// The default of [`RegionOptions::zero_budget`]: 256 MiB, at most about
/// 2.5 ms of every barrier's scan without write tracking (0.1-0.2 ms with
/// it), and 512 KiB of page tables.
pub const DEFAULT_ZERO_BUDGET: u64 = 256 << 20;

/// An anonymous, private, 2 MiB-aligned reservation of address space;
/// unmapped on drop together with everything mapped over it.
#[derive(Debug)]
pub struct Reservation {
    base: usize,
    len: usize,
}

impl Reservation {
    /// Reserves `len` bytes (a multiple of the page size).
    pub fn new(len: usize) -> io::Result<Reservation> {
        let total = len
            .checked_add(REGION_ALIGN)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
        // SAFETY: a fresh anonymous mapping at an address the kernel picks;
        // the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let raw = p as usize;
        let base = raw.next_multiple_of(REGION_ALIGN);
        let head = base - raw;
        let tail = total - head - len;
        // SAFETY: both ranges lie inside the mapping just created and
        // nothing refers to them.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((base + len) as *mut libc::c_void, tail);
            }
            // Page-granular behaviour for the anonymous parts (advisory:
            // the result does not matter).
            libc::madvise(base as *mut libc::c_void, len, libc::MADV_NOHUGEPAGE);
        }
        Ok(Reservation { base, len })
    }

    /// Host address of the first byte.
    pub fn base(&self) -> u64 {
        self.base as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the reservation is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        let ok = offset.is_multiple_of(PAGE_SIZE)
            && len.is_multiple_of(PAGE_SIZE)
            && len > 0
            && offset
                .checked_add(len)
                .is_some_and(|e| e <= self.len as u64);
        if ok {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        }
    }

    /// Maps `len` bytes of `fd` at `file_offset` over region offset
    /// `offset`, shared or private, read-write.
    ///
    /// The content seen through the range changes to the file's: callers
    /// only do this over ranges whose current content is that same data,
    /// or that hold no present page (see the monitor and the barrier).
    pub(crate) fn map_file(
        &self,
        offset: u64,
        len: u64,
        fd: RawFd,
        file_offset: u64,
        shared: bool,
    ) -> io::Result<()> {
        self.check(offset, len)?;
        let off = libc::off_t::try_from(file_offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        let flags = libc::MAP_FIXED
            | libc::MAP_NORESERVE
            | if shared {
                libc::MAP_SHARED
            } else {
                libc::MAP_PRIVATE
            };
        let addr = (self.base as u64 + offset) as *mut libc::c_void;
        // `check` proved `[addr, addr + len)` lies inside this reservation,
        // which this value owns; the region is reached through raw
        // pointers only, so no Rust reference into it exists.
        // SAFETY: MAP_FIXED thus replaces only our own, unborrowed pages;
        // the fd is open for the call.
        let p = unsafe {
            libc::mmap(
                addr,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        if shared {
            // No read-around on the writable layer: a fault there would
            // otherwise read ahead (and zero, for a fresh cluster) up to
            // the file's whole readahead window, in large folios: 160 us
            // more per first write into a 2 MiB cluster on ext4 here. The
            // guest's accesses are random. Every shared mapping gets it,
            // so that neighbours still merge into one VMA.
            // SAFETY: advice on the range just mapped; it changes no
            // content.
            if unsafe { libc::madvise(p, len as usize, libc::MADV_RANDOM) } != 0 {
                log::debug!(
                    "madvise(MADV_RANDOM) at region offset {offset:#x}: {}",
                    io::Error::last_os_error()
                );
            }
        }
        Ok(())
    }

    /// Drops the pages of `[offset, offset + len)` (anonymous memory): the
    /// range holds no page afterwards, and its next access faults.
    ///
    /// Callers only do this over ranges whose pages all read as zeros with
    /// no writer running (see the barrier), so no content is lost.
    pub(crate) fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        let addr = (self.base as u64 + offset) as *mut libc::c_void;
        // SAFETY: `check` proved the range lies inside this reservation,
        // reached through raw pointers only (no Rust reference into it
        // exists); MADV_DONTNEED only empties its page tables.
        if unsafe { libc::madvise(addr, len as usize, libc::MADV_DONTNEED) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// A raw pointer to region offset `offset` (in bounds, checked).
    pub(crate) fn ptr(&self, offset: u64, len: u64) -> io::Result<*mut u8> {
        self.check(offset, len)?;
        Ok((self.base as u64 + offset) as *mut u8)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: `[base, base + len)` is this reservation (and what was
        // mapped over it); nothing refers to it once its owner is dropped.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
        }
    }
}

/// What is mapped over one cluster of the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterState {
    /// Nothing: anonymous, registered with userfaultfd, no page present.
    Hole,
    /// A former hole the monitor filled with the zero page on a read;
    /// writes land in private anonymous pages.
    Zero,
    /// Private mapping(s) of read-only data (and anonymous zero pages for
    /// a mixed cluster): writes land in private pages.
    Private,
    /// The active layer's cluster, mapped shared.
    Shared,
}

/// One planned mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub offset: u64,
    pub len: u64,
    pub kind: RunKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunKind {
    /// Registered anonymous memory.
    Hole,
    /// Plain anonymous memory (zero pages of a mixed cluster).
    Anon,
    File {
        depth: usize,
        offset: u64,
        shared: bool,
    },
}

/// Appends a run, merging it into the previous one when contiguous.
pub(crate) fn push_run(runs: &mut Vec<Run>, r: Run) {
    if let Some(last) = runs.last_mut() {
        if last.offset + last.len == r.offset {
            let merge = match (last.kind, r.kind) {
                (RunKind::Hole, RunKind::Hole) | (RunKind::Anon, RunKind::Anon) => true,
                (
                    RunKind::File {
                        depth: d1,
                        offset: o1,
                        shared: s1,
                    },
                    RunKind::File {
                        depth: d2,
                        offset: o2,
                        shared: s2,
                    },
                ) => d1 == d2 && s1 == s2 && o1 + last.len == o2,
                _ => false,
            };
            if merge {
                last.len += r.len;
                return;
            }
        }
    }
    runs.push(r);
}

/// The plan of a region.
pub(crate) struct Plan {
    pub runs: Vec<Run>,
    pub clusters: Vec<ClusterState>,
}

/// The mappings of a whole image view and the state of every cluster.
pub(crate) fn plan(image: &Image) -> Plan {
    let cs = image.cluster_size();
    let n = image.virtual_size() / cs;
    let mut runs = Vec::new();
    let mut states = Vec::with_capacity(n as usize);
    for vcn in 0..n {
        let at = vcn * cs;
        let (state, kind) = match image.cluster_source(vcn) {
            ClusterSource::Active { offset } => (
                ClusterState::Shared,
                RunKind::File {
                    depth: 0,
                    offset,
                    shared: true,
                },
            ),
            ClusterSource::ReadOnly { depth, offset } => (
                ClusterState::Private,
                RunKind::File {
                    depth,
                    offset,
                    shared: false,
                },
            ),
            ClusterSource::Hole => (ClusterState::Hole, RunKind::Hole),
            ClusterSource::Mixed(pages) => {
                for (i, p) in pages.iter().enumerate() {
                    let kind = match *p {
                        PageLocation::Zero => RunKind::Anon,
                        PageLocation::File { depth, offset } => RunKind::File {
                            depth,
                            offset,
                            shared: false,
                        },
                    };
                    push_run(
                        &mut runs,
                        Run {
                            offset: at + i as u64 * PAGE_SIZE,
                            len: PAGE_SIZE,
                            kind,
                        },
                    );
                }
                states.push(ClusterState::Private);
                continue;
            }
        };
        states.push(state);
        push_run(
            &mut runs,
            Run {
                offset: at,
                len: cs,
                kind,
            },
        );
    }
    Plan {
        runs,
        clusters: states,
    }
}

/// Checks that `needed` more mappings fit under `max` with `used` in use.
pub fn check_map_count(needed: u64, max: u64, used: u64) -> Result<(), RegionError> {
    let available = max.saturating_sub(used).saturating_sub(VMA_MARGIN);
    if needed > available {
        return Err(RegionError::TooManyMappings {
            needed,
            available,
            max,
            used,
            margin: VMA_MARGIN,
        });
    }
    Ok(())
}

fn read_proc(path: &'static str) -> Result<String, RegionError> {
    std::fs::read_to_string(path).map_err(|source| RegionError::Proc { what: path, source })
}

/// `vm.max_map_count`.
pub fn max_map_count() -> Result<u64, RegionError> {
    read_proc("/proc/sys/vm/max_map_count")?
        .trim()
        .parse()
        .map_err(|_| RegionError::Proc {
            what: "/proc/sys/vm/max_map_count",
            source: io::Error::from(io::ErrorKind::InvalidData),
        })
}

/// The process's mappings (lines of `/proc/self/maps`).
pub fn process_map_count() -> Result<u64, RegionError> {
    Ok(read_proc("/proc/self/maps")?.lines().count() as u64)
}

/// The mappings (VMAs) inside `[start, end)`.
pub fn vmas_in(start: u64, end: u64) -> Result<u64, RegionError> {
    let maps = read_proc("/proc/self/maps")?;
    let mut n = 0;
    for line in maps.lines() {
        let range = line.split(' ').next().unwrap_or("");
        let mut it = range.split('-');
        let (Some(a), Some(b)) = (it.next(), it.next()) else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        if a < end && b > start {
            n += 1;
        }
    }
    Ok(n)
}

/// The state the monitor and the barrier share (behind one mutex).
///
/// Field order is drop order and matters: `mapping` is unmapped before
/// `image` closes (closing truncates the pre-allocated pool, which shared
/// mappings of fresh clusters may cover); `uffd` goes with the mapping.
pub(crate) struct RegionState {
    pub(crate) mapping: Reservation,
    pub(crate) uffd: Arc<Uffd>,
    /// Write tracking of the private clusters (WP-async userfaultfd), or
    /// `None`: every barrier then re-copies every private page.
    pub(crate) tracker: Option<WriteTracker>,
    /// Write tracking of the zero-mapped holes, through `uffd` (opened
    /// WP-async, holes registered in write-protect mode too), or `None`:
    /// every barrier then classifies each of their pages.
    pub(crate) zero_tracker: Option<WriteTracker>,
    pub(crate) image: Image,
    pub(crate) clusters: Vec<ClusterState>,
    pub(crate) scanner: PageScanner,
    pub(crate) cs: u64,
    pub(crate) faults: FaultCounters,
    /// Mappings estimated when the region was built.
    pub(crate) planned_vmas: u64,
    /// Pages a failed barrier harvested but did not commit. With write
    /// tracking the harvest re-protected them, so no later scan reports
    /// them again: the next barrier moves them as well.
    pub(crate) unsaved: crate::barrier::Harvest,
    /// Why a write fault got zeros instead of a cluster because the file
    /// system is full (ENOSPC, EDQUOT); cleared by a barrier that succeeds.
    pub(crate) out_of_space: Option<String>,
    /// [`RegionOptions::zero_budget`].
    pub(crate) zero_budget: u64,
    /// Zero-mapped clusters, as the last scan counted them (taken by the
    /// barrier that follows it).
    pub(crate) zero_counted: Option<u64>,
}

impl Drop for RegionState {
    fn drop(&mut self) {
        // Whatever reached the top file through shared mappings is synced
        // before the closing barrier commits metadata.
        self.image.mark_data_written();
    }
}

impl RegionState {
    /// The top file's fd.
    pub(crate) fn top_fd(&self) -> io::Result<RawFd> {
        self.image
            .chain_files()
            .first()
            .map(|f| f.as_raw_fd())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
    }

    /// Builds the region of `image` (opened read-write).
    pub(crate) fn build(
        mut image: Image,
        opts: &RegionOptions,
    ) -> Result<RegionState, RegionError> {
        if !image.is_writable() {
            return Err(RegionError::ReadOnly);
        }
        // SAFETY: sysconf only reads its integer argument.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page != PAGE_SIZE as libc::c_long {
            return Err(RegionError::PageSize(page as u64));
        }
        let size = image.virtual_size();
        let len = usize::try_from(size).map_err(|_| RegionError::TooLarge(size))?;
        if let Some(n) = opts.pool_clusters {
            image.set_pool_clusters(n);
        }
        // Every active cluster whole, so each maps shared as one piece.
        image.complete_active_clusters()?;
        image.flush()?;
        let Plan { runs, clusters } = plan(&image);

        let max = match opts.max_map_count {
            Some(m) => m,
            None => max_map_count()?,
        };
        let planned_vmas = runs.len() as u64;
        check_map_count(planned_vmas, max, process_map_count()?)?;

        // Mapped pages must lie inside their files (a page past the end of
        // a file would raise SIGBUS on access instead of an error here).
        let files = image.chain_files();
        let mut lens = Vec::with_capacity(files.len());
        for (depth, f) in files.iter().enumerate() {
            let l = f
                .metadata()
                .map_err(|e| RegionError::BadLayout {
                    depth,
                    what: format!("stat: {e}"),
                })?
                .len();
            lens.push(l);
        }
        for r in &runs {
            if let RunKind::File { depth, offset, .. } = r.kind {
                let flen = lens.get(depth).copied().ok_or(RegionError::BadLayout {
                    depth,
                    what: "no such file in the chain".into(),
                })?;
                // The kernel zero-fills the tail of a file's last page, so a
                // mapping may end anywhere inside that page.
                let mappable = flen.next_multiple_of(PAGE_SIZE);
                if !offset.is_multiple_of(PAGE_SIZE)
                    || offset.checked_add(r.len).is_none_or(|e| e > mappable)
                {
                    return Err(RegionError::BadLayout {
                        depth,
                        what: format!(
                            "{:#x} bytes at {offset:#x} are not page-aligned inside the file ({flen} bytes)",
                            r.len
                        ),
                    });
                }
            }
        }

        let mapping =
            Reservation::new(len).map_err(|source| RegionError::Reserve { len: size, source })?;
        let uffd = Uffd::for_holes(!opts.pagemap_read_fallback)?;
        for r in &runs {
            match r.kind {
                RunKind::File {
                    depth,
                    offset,
                    shared,
                } => mapping
                    .map_file(r.offset, r.len, files[depth].as_raw_fd(), offset, shared)
                    .map_err(|source| RegionError::Map {
                        offset: r.offset,
                        len: r.len,
                        depth,
                        file_offset: offset,
                        source,
                    })?,
                RunKind::Hole => uffd.register_missing(mapping.base() + r.offset, r.len)?,
                // The reservation is already anonymous, untouched memory.
                RunKind::Anon => {}
            }
        }
        drop(files);
        let scanner = PageScanner::new(opts.pagemap_read_fallback)?;
        let mut st = RegionState {
            cs: image.cluster_size(),
            mapping,
            uffd: Arc::new(uffd),
            tracker: None,
            zero_tracker: None,
            image,
            clusters,
            scanner,
            faults: FaultCounters::default(),
            planned_vmas,
            unsaved: Vec::new(),
            out_of_space: None,
            zero_budget: opts.zero_budget.unwrap_or(DEFAULT_ZERO_BUDGET),
            zero_counted: None,
        };
        st.start_tracking(!opts.pagemap_read_fallback);
        Ok(st)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_only_when_contiguous_in_the_same_file_and_mode() {
        let f = |offset, len, depth, fo, shared| Run {
            offset,
            len,
            kind: RunKind::File {
                depth,
                offset: fo,
                shared,
            },
        };
        let mut runs = Vec::new();
        push_run(&mut runs, f(0, 4096, 0, 8192, true));
        push_run(&mut runs, f(4096, 4096, 0, 12288, true)); // merges
        push_run(&mut runs, f(8192, 4096, 0, 16384, false)); // other mode
        push_run(&mut runs, f(12288, 4096, 1, 20480, false)); // other file
        push_run(&mut runs, f(16384, 4096, 1, 0, false)); // not contiguous
        let hole = |offset| Run {
            offset,
            len: 4096,
            kind: RunKind::Hole,
        };
        push_run(&mut runs, hole(20480));
        push_run(&mut runs, hole(24576)); // merges
        assert_eq!(runs.len(), 5);
        assert_eq!(runs[0].len, 8192);
        assert_eq!(runs[4].len, 8192);
    }

    #[test]
    fn map_count_check_names_the_sysctl_and_compact() {
        assert!(check_map_count(100, 65530, 200).is_ok());
        let e = check_map_count(100, 1200, 150).unwrap_err().to_string();
        assert!(e.contains("vm.max_map_count"), "{e}");
        assert!(e.contains("pcow-img compact"), "{e}");
        assert!(e.contains("needs about 100"), "{e}");
    }
}
