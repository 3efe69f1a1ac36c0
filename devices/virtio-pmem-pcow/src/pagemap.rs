//! Finding the pages of a range that a writer made private: a thin wrapper
//! over the `PAGEMAP_SCAN` ioctl on `/proc/self/pagemap` (Linux 6.7+), with
//! a fallback that reads the pagemap entries one by one; and write tracking
//! ([`WriteTracker`]): a userfaultfd with `UFFD_FEATURE_WP_ASYNC` whose
//! registered ranges make `PAGEMAP_SCAN` report the pages written since they
//! were last write-protected ([`PageScanner::written_since`]), and
//! write-protect them again in the same call.
//!
//! A page is "written" when it is present (or swapped out), not backed by a
//! file page and not the shared zero page: exactly the pages the host kernel
//! copied on a write into a `MAP_PRIVATE` file mapping, or allocated on a
//! write into anonymous memory. The structures below are those of the
//! kernel's `include/uapi/linux/fs.h`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

use crate::clusters::push_run;
pub use crate::mapping::PAGE_SIZE;
use crate::uffd;

const PAGE_IS_WRITTEN: u64 = 1 << 1;
const PAGE_IS_FILE: u64 = 1 << 2;
const PAGE_IS_PRESENT: u64 = 1 << 3;
const PAGE_IS_SWAPPED: u64 = 1 << 4;
const PAGE_IS_PFNZERO: u64 = 1 << 5;

/// `struct page_region`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// `struct pm_scan_arg`.
#[repr(C)]
#[derive(Debug, Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `PAGEMAP_SCAN` on `/proc/self/pagemap`: `_IOWR('f', 16, struct
/// pm_scan_arg)`.
pub const PAGEMAP_SCAN: libc::c_ulong = (3 << 30)
    | ((std::mem::size_of::<PmScanArg>() as libc::c_ulong) << 16)
    | ((b'f' as libc::c_ulong) << 8)
    | 16;

/// Fail (EPERM) on a range not registered with a WP-async userfaultfd.
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;

/// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE: u64 = 1 << 61;

/// Errors of the scanner.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum PagemapError {
    #[error("opening /proc/self/pagemap")]
    Open(#[source] std::io::Error),
    #[error("PAGEMAP_SCAN over {start:#x}..{end:#x}")]
    Scan {
        start: u64,
        end: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("reading /proc/self/pagemap at {addr:#x}")]
    Read {
        addr: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("range {start:#x}..{end:#x} is not page aligned")]
    Unaligned { start: u64, end: u64 },
    #[error("write tracking (userfaultfd with UFFD_FEATURE_WP_ASYNC, Linux 6.7+): {what}")]
    Track {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{start:#x}..{end:#x} is not registered for write tracking")]
    NotTracked { start: u64, end: u64 },
}

/// How the scanner finds written pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanMethod {
    /// The `PAGEMAP_SCAN` ioctl: exact (the zero page is told apart).
    Ioctl,
    /// Reading pagemap entries: the zero page cannot be told apart from a
    /// written anonymous page without the PFN, so callers must treat an
    /// all-zero page over a zero view as unwritten.
    Read,
}

/// The page categories a scan asks for (`pm_scan_arg`'s masks): pages
/// whose categories, XOR `inverted`, have all of `required` and one of
/// `any_of` (when not 0); `returned` is what each run reports.
#[derive(Debug, Clone, Copy)]
struct Categories {
    inverted: u64,
    required: u64,
    any_of: u64,
    returned: u64,
}

/// Entries without write protection, and nothing else asked of them: the
/// kernel's fast path (it reads the PTE, never the page).
const UNPROTECTED_ONLY: Categories = Categories {
    inverted: 0,
    required: PAGE_IS_WRITTEN,
    any_of: 0,
    returned: PAGE_IS_WRITTEN,
};

/// Page-table coverage of one PTE page: 2 MiB on x86-64.
const TABLE_SPAN: u64 = 2 << 20;

/// What to write-protect after a two-walk scan of `[start, end)`: the
/// unprotected entries (sorted runs) that lie in a page table holding one
/// of the `classified` pages, or in a table where an unprotected run
/// begins or ends inside `[start, end)`. That covers the pages found, and
/// the empty entries around them, which get uffd-wp markers: the kernel's
/// fast path skips protected entries but reports empty ones, so a page
/// table holding one written page would otherwise cost 511 reported
/// entries at every barrier. A run that begins or ends off a table
/// boundary is such a table too (a one-walk scan protected only the pages
/// it found; a table with no page table below it is a whole aligned run).
/// Empty entries outside such tables are left alone: protecting them
/// would allocate page tables for ranges nobody touched.
fn to_protect(
    start: u64,
    end: u64,
    unprotected: &[(u64, u64, u64)],
    classified: &[(u64, u64, u64)],
) -> Vec<(u64, u64)> {
    let table = |a: u64| a - a % TABLE_SPAN;
    let mut spans: Vec<(u64, u64)> = classified
        .iter()
        .map(|&(a, b, _)| (table(a), b.div_ceil(TABLE_SPAN) * TABLE_SPAN))
        .collect();
    for &(a, b, _) in unprotected {
        if a != start && !a.is_multiple_of(TABLE_SPAN) {
            spans.push((table(a), table(a) + TABLE_SPAN));
        }
        if b != end && !b.is_multiple_of(TABLE_SPAN) {
            spans.push((table(b), table(b) + TABLE_SPAN));
        }
    }
    spans.sort_unstable();
    let mut tables: Vec<(u64, u64)> = Vec::new();
    for (ta, tb) in spans {
        match tables.last_mut() {
            Some(last) if last.1 >= ta => last.1 = last.1.max(tb),
            _ => tables.push((ta, tb)),
        }
    }
    let mut out = Vec::new();
    let mut t = 0;
    for &(a, b, _) in unprotected {
        while t < tables.len() && tables[t].1 <= a {
            t += 1;
        }
        let mut k = t;
        while k < tables.len() && tables[k].0 < b {
            let (x, y) = (a.max(tables[k].0), b.min(tables[k].1));
            if x < y {
                push_run(&mut out, (x, y));
            }
            k += 1;
        }
    }
    out
}

/// A handle on `/proc/self/pagemap`.
#[derive(Debug)]
pub struct PageScanner {
    file: File,
    method: ScanMethod,
    /// Upper bound on the present pages that [`PageScanner::written_since`]
    /// has write-protected: what a one-walk scan must classify. Pages
    /// leave (reclaim, remaps) without it going down; an overestimate only
    /// picks the two-walk scan, which is correct as well.
    protected_present: u64,
    /// Scans of [`PageScanner::written_since`] that took two walks.
    two_walk_scans: u64,
}

impl PageScanner {
    /// Opens the pagemap; uses the ioctl unless `force_read` (or the
    /// kernel lacks it, found at the first scan).
    pub fn new(force_read: bool) -> Result<PageScanner, PagemapError> {
        let file = File::open("/proc/self/pagemap").map_err(PagemapError::Open)?;
        Ok(PageScanner {
            file,
            method: if force_read {
                ScanMethod::Read
            } else {
                ScanMethod::Ioctl
            },
            protected_present: 0,
            two_walk_scans: 0,
        })
    }

    /// The method in use.
    pub fn method(&self) -> ScanMethod {
        self.method
    }

    /// How many scans of [`PageScanner::written_since`] took two walks.
    pub fn two_walk_scans(&self) -> u64 {
        self.two_walk_scans
    }

    /// Appends to `out` the written page runs `[start, end)` (addresses) in
    /// `[start, end)`, ascending.
    ///
    /// The range must be mapped memory of this process; the scan only
    /// reads page tables, never the pages.
    pub fn written(
        &mut self,
        start: u64,
        end: u64,
        out: &mut Vec<(u64, u64)>,
    ) -> Result<(), PagemapError> {
        if !start.is_multiple_of(PAGE_SIZE) || !end.is_multiple_of(PAGE_SIZE) || end < start {
            return Err(PagemapError::Unaligned { start, end });
        }
        if self.method == ScanMethod::Ioctl {
            match self.scan_ioctl(start, end, out) {
                Ok(()) => return Ok(()),
                Err(PagemapError::Scan { source, .. })
                    if matches!(source.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) =>
                {
                    log::warn!("PAGEMAP_SCAN unavailable ({source}); reading pagemap instead");
                    self.method = ScanMethod::Read;
                }
                Err(e) => return Err(e),
            }
        }
        self.scan_read(start, end, out)
    }

    /// Appends to `out` the page runs of `[start, end)` written since they
    /// were last write-protected: private (anonymous, not the zero page)
    /// pages whose userfaultfd write-protection a write removed. With
    /// `protect`, every present page of the range found unprotected (the
    /// written ones, and file pages the guest faulted in by reading) is
    /// write-protected again through `protect`'s userfaultfd, so the next
    /// call skips it. The caller must keep writers out from the scan to the
    /// end of the call: a write between the two would be protected without
    /// being reported.
    ///
    /// The range must be registered with a [`WriteTracker`]
    /// (`PM_SCAN_CHECK_WPASYNC`): otherwise [`PagemapError::NotTracked`].
    /// Pages present before the registration count as written. Needs the
    /// ioctl (no fallback: the read method cannot see write protection).
    ///
    /// Two ways to walk, picked by how many present pages the range may
    /// hold protected, since the kernel classifies every present page it
    /// meets unless it runs its fast path:
    /// - one walk classifying the range (present, unprotected pages only):
    ///   cheapest while few pages are present, since holes cost a table
    ///   lookup and protected empty entries a PTE read (64 GiB mapped,
    ///   nothing read: 0.5-1.0 ms here against 2.0-2.6 ms for two walks);
    /// - two walks: the first asks only for unprotected entries
    ///   (`PAGE_IS_WRITTEN` alone, the kernel's fast path: it reads the PTE
    ///   and never the page, about 0.4 ms per GiB of populated page tables
    ///   here, against 15 ms for a full classification); only what it
    ///   reports is classified by the second. It wins once many pages are
    ///   present (1 GiB of the base read: 3 ms against 14 ms).
    ///
    /// The one walk is taken while the protected present pages could be at
    /// most one per page table of the range; it protects only the pages it
    /// found (an empty entry costs it no more than a protected one), the
    /// two walks also the empty entries around them (see `to_protect`). Once read pages are protected
    /// too, either way follows what changed since the last call, not what
    /// the guest ever read.
    pub fn written_since(
        &mut self,
        start: u64,
        end: u64,
        protect: Option<&WriteTracker>,
        out: &mut Vec<(u64, u64)>,
    ) -> Result<(), PagemapError> {
        if !start.is_multiple_of(PAGE_SIZE) || !end.is_multiple_of(PAGE_SIZE) || end < start {
            return Err(PagemapError::Unaligned { start, end });
        }
        // Requiring PAGE_IS_WRITTEN keeps out protected pages, and the
        // entries a protection left on a zapped page (uffd-wp markers, which
        // the kernel reports as swapped).
        let present = Categories {
            inverted: 0,
            required: PAGE_IS_WRITTEN,
            any_of: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            returned: PAGE_IS_FILE | PAGE_IS_PFNZERO | PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        };
        let one_walk = self.protected_present <= (end - start) / TABLE_SPAN;
        let mut classified = Vec::new();
        let protect_runs = if one_walk {
            self.scan_tracked(start, end, present, &mut classified)?;
            // Only the pages found: the walk passes over the empty entries
            // around them as cheaply as over protected ones, and every
            // protection is a page-table walk and a TLB flush of its own.
            let mut runs = Vec::new();
            for &(a, b, _) in &classified {
                push_run(&mut runs, (a, b));
            }
            runs
        } else {
            self.two_walk_scans += 1;
            let mut unprotected = Vec::new();
            self.scan_tracked(start, end, UNPROTECTED_ONLY, &mut unprotected)?;
            // Unprotected entries include holes (no page, or no page
            // table), which the classification skips at the cost of a
            // table lookup.
            for &(a, b, _) in &unprotected {
                self.scan_ioctl_with(a, b, 0, present, &mut classified)?;
            }
            to_protect(start, end, &unprotected, &classified)
        };
        for &(a, b, cat) in &classified {
            if cat & (PAGE_IS_FILE | PAGE_IS_PFNZERO) == 0 {
                push_run(out, (a, b));
            }
        }
        if let Some(tracker) = protect {
            for (a, b) in protect_runs {
                tracker.protect(a, b - a)?;
            }
            let pages: u64 = classified
                .iter()
                .map(|&(a, b, _)| (b - a) / PAGE_SIZE)
                .sum();
            self.protected_present = self.protected_present.saturating_add(pages);
        }
        Ok(())
    }

    /// Page-table entries of `[start, end)` (registered for write tracking)
    /// not write-protected: the pages written or faulted in since they were
    /// last protected, and empty entries inside populated page tables. What
    /// the first walk of a two-walk [`PageScanner::written_since`] reports
    /// (the kernel's fast path).
    pub fn unprotected_entries(&self, start: u64, end: u64) -> Result<u64, PagemapError> {
        if !start.is_multiple_of(PAGE_SIZE) || !end.is_multiple_of(PAGE_SIZE) || end < start {
            return Err(PagemapError::Unaligned { start, end });
        }
        let mut runs = Vec::new();
        self.scan_tracked(start, end, UNPROTECTED_ONLY, &mut runs)?;
        Ok(runs.iter().map(|&(a, b, _)| (b - a) / PAGE_SIZE).sum())
    }

    /// A scan of a range registered with a [`WriteTracker`]
    /// (`PM_SCAN_CHECK_WPASYNC`; [`PagemapError::NotTracked`] otherwise).
    fn scan_tracked(
        &self,
        start: u64,
        end: u64,
        cat: Categories,
        out: &mut Vec<(u64, u64, u64)>,
    ) -> Result<(), PagemapError> {
        match self.scan_ioctl_with(start, end, PM_SCAN_CHECK_WPASYNC, cat, out) {
            Err(PagemapError::Scan { source, .. })
                if source.raw_os_error() == Some(libc::EPERM) =>
            {
                Err(PagemapError::NotTracked { start, end })
            }
            r => r,
        }
    }

    fn scan_ioctl(
        &self,
        start: u64,
        end: u64,
        out: &mut Vec<(u64, u64)>,
    ) -> Result<(), PagemapError> {
        // present or swapped, and neither a file page nor the zero page
        let private = Categories {
            inverted: PAGE_IS_FILE | PAGE_IS_PFNZERO,
            required: PAGE_IS_FILE | PAGE_IS_PFNZERO,
            any_of: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            returned: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        };
        let mut runs = Vec::new();
        self.scan_ioctl_with(start, end, 0, private, &mut runs)?;
        for (a, b, _) in runs {
            push_run(out, (a, b));
        }
        Ok(())
    }

    /// `PAGEMAP_SCAN` over `[start, end)` for the pages in `cat`; appends
    /// the runs with their returned categories (adjacent runs of equal
    /// categories merged).
    fn scan_ioctl_with(
        &self,
        start: u64,
        end: u64,
        flags: u64,
        cat: Categories,
        out: &mut Vec<(u64, u64, u64)>,
    ) -> Result<(), PagemapError> {
        let mut vec = [PageRegion::default(); 256];
        let mut cur = start;
        while cur < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags,
                start: cur,
                end,
                vec: vec.as_mut_ptr() as u64,
                vec_len: vec.len() as u64,
                category_inverted: cat.inverted,
                category_mask: cat.required,
                category_anyof_mask: cat.any_of,
                return_mask: cat.returned,
                ..PmScanArg::default()
            };
            // `arg` is a correctly sized `pm_scan_arg` the kernel reads and
            // updates (`walk_end`); `vec` points to `vec_len` writable
            // `page_region`s that outlive the call. No flag here changes
            // page tables (no PM_SCAN_WP_MATCHING).
            // SAFETY: so the ioctl writes only `arg` and `vec`, and reads
            // page tables, never the scanned memory.
            let n = unsafe { libc::ioctl(self.file.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
            if n < 0 {
                return Err(PagemapError::Scan {
                    start: cur,
                    end,
                    source: std::io::Error::last_os_error(),
                });
            }
            let n = (n as usize).min(vec.len());
            for r in &vec[..n] {
                match out.last_mut() {
                    Some(last) if last.1 == r.start && last.2 == r.categories => last.1 = r.end,
                    _ => out.push((r.start, r.end, r.categories)),
                }
            }
            // A vector not filled means the walk reached `end`. Only a full
            // one says to go on from `walk_end`: some kernels leave
            // `walk_end` at the last point their own smaller buffer
            // filled, and resuming there would report runs twice.
            if n < vec.len() || arg.walk_end <= cur {
                break;
            }
            cur = arg.walk_end;
        }
        Ok(())
    }

    fn scan_read(
        &self,
        start: u64,
        end: u64,
        out: &mut Vec<(u64, u64)>,
    ) -> Result<(), PagemapError> {
        const CHUNK: u64 = 4096;
        let mut buf = vec![0u8; (CHUNK * 8) as usize];
        let mut page = start / PAGE_SIZE;
        let last = end / PAGE_SIZE;
        while page < last {
            let n = (last - page).min(CHUNK);
            let bytes = &mut buf[..(n * 8) as usize];
            self.file
                .read_exact_at(bytes, page * 8)
                .map_err(|source| PagemapError::Read {
                    addr: page * PAGE_SIZE,
                    source,
                })?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let mut w = [0u8; 8];
                w.copy_from_slice(e);
                let v = u64::from_ne_bytes(w);
                if v & (PM_PRESENT | PM_SWAPPED) != 0 && v & PM_FILE == 0 {
                    let a = (page + i as u64) * PAGE_SIZE;
                    match out.last_mut() {
                        Some(l) if l.1 == a => l.1 = a + PAGE_SIZE,
                        _ => out.push((a, a + PAGE_SIZE)),
                    }
                }
            }
            page += n;
        }
        Ok(())
    }
}

/// Write tracking: a userfaultfd opened with `UFFD_FEATURE_WP_ASYNC` (and
/// `WP_UNPOPULATED`, so anonymous ranges qualify too). Ranges registered
/// with it in write-protect mode never produce events: the kernel resolves
/// a write to a protected page itself and marks the page written, which
/// [`PageScanner::written_since`] reports. Separate from the monitor's
/// userfaultfd (missing faults of holes), which stays as it is; a range
/// belongs to at most one of them. Closing it drops every registration.
#[derive(Debug)]
pub struct WriteTracker {
    fd: std::os::fd::OwnedFd,
}

impl WriteTracker {
    /// Opens the userfaultfd; fails when the kernel lacks WP-async
    /// (before Linux 6.7) or userfaultfd is not allowed.
    pub fn new() -> Result<WriteTracker, PagemapError> {
        let fd = uffd::open(uffd::FEATURE_WP_ASYNC | uffd::FEATURE_WP_UNPOPULATED).map_err(
            |e| match e {
                uffd::OpenError::Create(source) => PagemapError::Track {
                    what: "creating a userfaultfd",
                    source,
                },
                uffd::OpenError::Api(source) => PagemapError::Track {
                    what: "UFFDIO_API with UFFD_FEATURE_WP_ASYNC",
                    source,
                },
            },
        )?;
        Ok(WriteTracker { fd })
    }

    /// Write protection through another WP-async userfaultfd (the
    /// monitor's, whose holes are registered in write-protect mode too);
    /// ranges are registered through that userfaultfd, not this handle.
    pub(crate) fn from_fd(fd: std::os::fd::OwnedFd) -> WriteTracker {
        WriteTracker { fd }
    }

    /// Registers `[start, start + len)` (mapped memory: private file
    /// mappings or anonymous memory not registered elsewhere) for write
    /// tracking. Registering a range again is harmless.
    pub fn register(&self, start: u64, len: u64) -> Result<(), PagemapError> {
        // WP-async: the kernel resolves write faults in the range itself,
        // without events; the content does not change.
        uffd::register(&self.fd, start, len, uffd::MODE_WP).map_err(|source| PagemapError::Track {
            what: "UFFDIO_REGISTER (write-protect mode)",
            source,
        })
    }

    /// Write-protects `[start, start + len)` (registered): a later write
    /// there makes its page written again.
    pub fn protect(&self, start: u64, len: u64) -> Result<(), PagemapError> {
        uffd::write_protect(&self.fd, start, len).map_err(|source| PagemapError::Track {
            what: "UFFDIO_WRITEPROTECT",
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M2: u64 = TABLE_SPAN;

    #[test]
    fn protection_covers_the_unprotected_entries_of_tables_with_pages_found() {
        // Unprotected: a hole spanning three tables, a run in a fourth.
        let unprotected = [(0, 3 * M2, 2), (5 * M2 + 4096, 5 * M2 + 8192, 2)];
        // Pages found in the second table and in the fourth.
        let classified = [
            (M2 + 40960, M2 + 45056, 8),
            (5 * M2 + 4096, 5 * M2 + 8192, 8),
        ];
        assert_eq!(
            to_protect(0, 8 * M2, &unprotected, &classified),
            vec![(M2, 2 * M2), (5 * M2 + 4096, 5 * M2 + 8192)]
        );
        // The fourth table holds entries protected around the run.
        assert_eq!(
            to_protect(0, 8 * M2, &unprotected, &[]),
            vec![(5 * M2 + 4096, 5 * M2 + 8192)]
        );
    }

    #[test]
    fn protection_of_a_run_across_tables_covers_each_table_once() {
        let unprotected = [(M2 - 4096, M2 + 4096, 2), (M2 + 8192, 4 * M2, 2)];
        let classified = [(M2 - 4096, M2 + 4096, 8)];
        assert_eq!(
            to_protect(0, 8 * M2, &unprotected, &classified),
            vec![(M2 - 4096, M2 + 4096), (M2 + 8192, 2 * M2)]
        );
    }

    #[test]
    fn protection_completes_tables_a_run_ends_in_but_not_at_the_range_ends() {
        // Between the runs a protected page: its table gets the rest of
        // its entries protected. The range's own ends (64 KiB clusters)
        // say nothing about a table.
        let unprotected = [(65536, M2 + 4096, 2), (M2 + 8192, 3 * M2 - 65536, 2)];
        assert_eq!(
            to_protect(65536, 3 * M2 - 65536, &unprotected, &[]),
            vec![(M2, M2 + 4096), (M2 + 8192, 2 * M2)]
        );
    }
}
