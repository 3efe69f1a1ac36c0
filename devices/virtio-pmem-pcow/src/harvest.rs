//! Finding the pages a barrier must move: write tracking of the private
//! and zero-mapped clusters, and the harvest.
//!
//! Copy-on-write is per 4 KiB page, and pages already moved stay private
//! and may be written again, so a barrier must find the pages written
//! since the previous one, not every private page: private clusters are
//! registered with a WP-async userfaultfd ([`WriteTracker`]);
//! `PAGEMAP_SCAN` reports the pages written since they were last
//! write-protected, and the harvest re-protects them (and the pages the
//! guest faulted in by reading), all while writers are held. The kernel
//! keeps no summary, so the walk still visits every page-table entry
//! present in the private ranges, but only with its fast path (the PTE's
//! write-protect bit, about 0.4 ms per GiB of populated page tables);
//! pages are classified only where something changed. Without WP-async
//! (kernel before 6.7, or the pagemap read fallback) every private page is
//! found again at every barrier: correct, slower.
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
//! GiB here.
//!
//! With a write log ([`WriteLog`], KVM's dirty log of the memslot in a
//! VMM) none of that walks: a barrier reads the log and classifies only
//! the pages it names (those of private and zero-mapped clusters are
//! moved; shared clusters need nothing, and a hole has no page). The walk
//! runs once more at the first barrier after the log was attached (writes
//! before it are not in the log) and after a read of the log failed (it
//! may have lost what it took); it then finds every page written since
//! its own last protection, a superset, so nothing is missed while the
//! log is not trusted. A zero page the log names in a cluster the image
//! has nothing for is not moved when it still reads as zeros (KVM names
//! a page it mapped writable on a read, which the copied zeros of a
//! former protected entry are): a read never allocates.

use std::sync::Arc;

use pcow::{ClusterSource, Image};

use crate::clusters::ClusterState;
use crate::mapping::PAGE_SIZE;
use crate::pagemap::{PageScanner, PagemapError, ScanMethod, WriteTracker};
use crate::view::View;
use crate::write_log::WriteLog;

/// Pages to move: (vcn, sorted page indices in the cluster), sorted by vcn.
pub(crate) type Harvest = Vec<(u64, Vec<u32>)>;

/// Groups sorted, unique (vcn, page) pairs by cluster.
fn group(pages: impl IntoIterator<Item = (u64, u32)>) -> Harvest {
    let mut out: Harvest = Vec::new();
    for (vcn, page) in pages {
        match out.last_mut() {
            Some((v, list)) if *v == vcn => list.push(page),
            _ => out.push((vcn, vec![page])),
        }
    }
    out
}

/// Merges `more` into `into` (both sorted by vcn, pages sorted and
/// unique): the result is sorted, each page once.
pub(crate) fn merge_harvest(into: &mut Harvest, more: Harvest) {
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
    *into = group(pages);
}

/// What a harvest found.
#[derive(Debug, Default)]
pub(crate) struct Found {
    pub(crate) harvest: Harvest,
    /// Pages in the harvest.
    pub(crate) pages: u64,
    /// Write tracking found them.
    pub(crate) tracked: bool,
    /// A tracked scan took two walks.
    pub(crate) two_walks: bool,
    /// The write log named them (no scan ran).
    pub(crate) logged: bool,
}

/// Write tracking and the scanner, and what a failed barrier left.
pub(crate) struct Tracking {
    /// Write tracking of the private clusters (WP-async userfaultfd), or
    /// `None`: every barrier then re-copies every private page.
    tracker: Option<WriteTracker>,
    /// Write tracking of the zero-mapped holes, through the view's
    /// userfaultfd (opened WP-async, holes registered in write-protect
    /// mode too), or `None`: every barrier then classifies each of their
    /// pages.
    zero_tracker: Option<WriteTracker>,
    scanner: PageScanner,
    /// [`crate::RegionOptions::zero_budget`].
    pub(crate) zero_budget: u64,
    /// Zero-mapped clusters, as the last scan counted them (taken by the
    /// barrier that follows it).
    pub(crate) zero_counted: Option<u64>,
    /// Pages a failed barrier harvested but did not commit. With write
    /// tracking the harvest re-protected them, so no later scan reports
    /// them again: the next barrier moves them as well.
    pub(crate) unsaved: Harvest,
    /// The write log attached by the device's user, if any.
    log: Option<Arc<dyn WriteLog>>,
    /// Whether a full scan ran since the log was attached or last failed:
    /// until one has, the log cannot vouch for the writes before it.
    log_primed: bool,
    /// Pages the log named that no barrier has moved yet (sorted, unique,
    /// in pages from the region's start): a read of the log is never lost.
    logged: Vec<u64>,
    /// The last read of the log failed (reported once per streak).
    log_failing: bool,
}

impl Tracking {
    /// Starts write tracking of every private cluster of `view` (when
    /// `enable`). Without it (or on a kernel without WP-async) every
    /// barrier re-copies every private page: correct, but its cost grows
    /// with what was ever written.
    pub(crate) fn start(
        view: &View,
        scanner: PageScanner,
        zero_budget: u64,
        enable: bool,
    ) -> Tracking {
        let mut t = Tracking {
            tracker: None,
            zero_tracker: None,
            scanner,
            zero_budget,
            zero_counted: None,
            unsaved: Vec::new(),
            log: None,
            log_primed: false,
            logged: Vec::new(),
            log_failing: false,
        };
        if !enable {
            return t;
        }
        let tracker = match WriteTracker::new() {
            Ok(t) => t,
            Err(e) => {
                log::warn!("no write tracking, barriers re-copy every private page: {e}");
                return t;
            }
        };
        for (a, b) in view.clusters.runs(ClusterState::Private) {
            let (start, len) = view.span(a, b);
            if let Err(e) = tracker.register(start, len) {
                log::warn!("no write tracking, barriers re-copy every private page: {e}");
                return t;
            }
        }
        t.tracker = Some(tracker);
        t.zero_tracker = view.uffd.wp_async_fd().map(WriteTracker::from_fd);
        t
    }

    /// Tracks clusters `[vcn, end)` (just mapped private); on failure gives
    /// up tracking for the whole region (barriers then re-copy every
    /// private page, which stays correct).
    pub(crate) fn track(&mut self, view: &View, vcn: u64, end: u64) {
        let Some(t) = &self.tracker else {
            return;
        };
        let (start, len) = view.span(vcn, end);
        if let Err(e) = t.register(start, len) {
            log::warn!("write tracking stopped, barriers re-copy every private page: {e}");
            self.tracker = None;
        }
    }

    /// Follows `log` from the next barrier on: that barrier still scans
    /// once (the log does not know what was written before it).
    pub(crate) fn attach_log(&mut self, log: Arc<dyn WriteLog>) {
        self.log = Some(log);
        self.log_primed = false;
    }

    /// Whether a write log is attached.
    pub(crate) fn has_log(&self) -> bool {
        self.log.is_some()
    }

    /// Reads the log into [`Tracking::logged`]; whether it was read. A
    /// failure is reported once per streak and makes the next barrier scan
    /// again (the call may have lost pages it took).
    fn read_log(&mut self) -> bool {
        let Some(log) = &self.log else {
            return false;
        };
        let logged = &mut self.logged;
        let r = log.take_written(&mut |page| logged.push(page));
        logged.sort_unstable();
        logged.dedup();
        match r {
            Ok(()) => {
                if self.log_failing {
                    log::info!("the write log works again");
                    self.log_failing = false;
                }
                true
            }
            Err(e) => {
                if !self.log_failing {
                    log::warn!(
                        "{}; barriers scan the page tables until it works again",
                        error_report::chain(&e)
                    );
                    self.log_failing = true;
                }
                self.log_primed = false;
                false
            }
        }
    }

    /// The written page runs of the whole region, as addresses.
    fn written_runs(&mut self, view: &View) -> Result<Vec<(u64, u64)>, PagemapError> {
        let mut runs = Vec::new();
        self.scanner
            .written(view.base(), view.base() + view.len(), &mut runs)?;
        Ok(runs)
    }

    /// With write tracking: the pages of private clusters written since the
    /// last barrier (write-protected again when `protect`: writers must be
    /// held), then those of zero-mapped holes (likewise through the
    /// monitor's userfaultfd; without it, every private page there), as
    /// addresses, per scan sorted.
    fn tracked_runs(
        &mut self,
        view: &View,
        protect: bool,
    ) -> Result<Vec<(u64, u64)>, PagemapError> {
        let cs = view.cs;
        let mut runs = Vec::new();
        let ([private_runs, zero_runs], counts) = view
            .clusters
            .runs_of([ClusterState::Private, ClusterState::Zero]);
        self.zero_counted = Some(counts[1]);
        // Past the budget, this barrier moves each zero-mapped cluster with
        // written pages (remapped shared) and returns the others to holes:
        // protecting their pages would be wasted (a cluster a failure
        // leaves zero-mapped is only reported again).
        let protect_zero = protect && counts[1].saturating_mul(cs) <= self.zero_budget;
        for (a, b) in private_runs {
            let (start, len) = view.span(a, b);
            let end = start + len;
            let tracker = if protect { self.tracker.as_ref() } else { None };
            match self.scanner.written_since(start, end, tracker, &mut runs) {
                Err(PagemapError::NotTracked { .. }) => {
                    // A private range nobody registered (a bookkeeping
                    // slip): track it now; until now nothing was
                    // write-protected there, so every private page of it
                    // counts as written, which is what a retry reports.
                    log::warn!("clusters {a}..{b}: private but not tracked; tracking now");
                    self.track(view, a, b);
                    if self.tracker.is_none() {
                        return Err(PagemapError::NotTracked { start, end });
                    }
                    let tracker = if protect { self.tracker.as_ref() } else { None };
                    self.scanner.written_since(start, end, tracker, &mut runs)?;
                }
                r => r?,
            }
        }
        for (a, b) in zero_runs {
            let (start, len) = view.span(a, b);
            let end = start + len;
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

    /// Before a barrier holds the writers: reads the log (writers
    /// running) when it vouches for such reads, and whether every page
    /// written since the last barrier needs no move (all in shared
    /// clusters, none left by a failed barrier): then the barrier
    /// needs no hold. The pages read are kept for the held harvest
    /// otherwise.
    pub(crate) fn nothing_to_move(&mut self, view: &View) -> bool {
        let ready = self.log_primed
            && self.unsaved.is_empty()
            && self.log.as_ref().is_some_and(|l| l.complete_unheld());
        if !ready || !self.read_log() {
            return false;
        }
        // Only pages of shared clusters: the guest wrote into the image's
        // file, whatever the page holds and whenever the write ends (a
        // cluster leaves that state only under a held barrier). A
        // zero-mapped page is classified by its content, which writers may
        // be changing, and a write the log named into a hole may still be
        // on its way through a fault that maps it private: those take the
        // held path.
        let cs = view.cs;
        let none = self.logged.iter().all(|&p| {
            p.checked_mul(PAGE_SIZE)
                .filter(|&off| off < view.len())
                .is_none_or(|off| view.clusters.get(off / cs) == ClusterState::Shared)
        });
        if none {
            self.logged.clear();
        }
        none
    }

    /// The written pages to move at this barrier, by cluster, and the
    /// pages a failed barrier left: the pages the write log named, or,
    /// without a log it can trust yet, those a scan finds (write
    /// protection re-armed on them: writers must be held).
    pub(crate) fn harvest(&mut self, view: &View, image: &Image) -> Result<Found, PagemapError> {
        self.zero_counted = None;
        let read = self.read_log();
        let mut pages: Vec<(u64, u32)> = Vec::new();
        let mut found = Found::default();
        if read && self.log_primed {
            found.logged = true;
            self.zero_counted = Some(view.clusters.count(ClusterState::Zero));
        } else {
            self.scan_pages(view, image, &mut found, &mut pages)?;
            // From here the log holds every write the scan did not see.
            self.log_primed = read;
        }
        let mut outside = 0u64;
        for page in std::mem::take(&mut self.logged) {
            match logged_page(view, image, page) {
                Named::Move(vcn, index) => pages.push((vcn, index)),
                Named::Nothing => {}
                Named::Outside => outside += 1,
            }
        }
        if outside > 0 {
            log::warn!("the write log named {outside} pages outside the region; ignored");
        }
        pages.sort_unstable();
        pages.dedup();
        found.pages = pages.len() as u64;
        let mut harvest = group(pages);
        merge_harvest(&mut harvest, std::mem::take(&mut self.unsaved));
        found.harvest = harvest;
        Ok(found)
    }

    /// The scan of the pages written since the last barrier: with write
    /// tracking those it reports (re-protected), otherwise every private
    /// page of the region.
    fn scan_pages(
        &mut self,
        view: &View,
        image: &Image,
        found: &mut Found,
        pages: &mut Vec<(u64, u32)>,
    ) -> Result<(), PagemapError> {
        let base = view.base();
        let cs = view.cs;
        found.tracked = self.tracker.is_some();
        let runs = if found.tracked {
            let before = self.scanner.two_walk_scans();
            let runs = self.tracked_runs(view, true)?;
            found.two_walks = self.scanner.two_walk_scans() > before;
            runs
        } else {
            self.written_runs(view)?
        };
        let fallback = self.scanner.method() == ScanMethod::Read;
        for &(a, b) in &runs {
            let mut p = a;
            while p < b {
                let off = p - base;
                let vcn = off / cs;
                // The read fallback cannot tell the zero page from a written
                // page: an all-zero page over a zero view changes nothing.
                let skip = fallback
                    && view.clusters.get(vcn) == ClusterState::Zero
                    && zeros_over_a_hole(view, image, vcn, off);
                if !skip {
                    pages.push((vcn, ((off % cs) / PAGE_SIZE) as u32));
                }
                p += PAGE_SIZE;
            }
        }
        Ok(())
    }
}

/// What a page the write log named needs.
enum Named {
    /// Moving: page `.1` of cluster `.0`.
    Move(u64, u32),
    /// Nothing: a shared cluster (the file holds it), a hole (no page), or
    /// zeros over a cluster the image has nothing for.
    Nothing,
    /// The page is not in the region (a log of a larger memslot).
    Outside,
}

/// Classifies page `page` (from the region's start) that the log named.
/// Writers must be held.
fn logged_page(view: &View, image: &Image, page: u64) -> Named {
    let cs = view.cs;
    let Some(off) = page.checked_mul(PAGE_SIZE).filter(|&o| o < view.len()) else {
        return Named::Outside;
    };
    let vcn = off / cs;
    let index = ((off % cs) / PAGE_SIZE) as u32;
    match view.clusters.get(vcn) {
        ClusterState::Private => Named::Move(vcn, index),
        ClusterState::Zero if zeros_over_a_hole(view, image, vcn, off) => Named::Nothing,
        ClusterState::Zero => Named::Move(vcn, index),
        ClusterState::Shared | ClusterState::Hole => Named::Nothing,
    }
}

/// Whether zero-mapped cluster `vcn`'s page at region offset `off` reads
/// as zeros and the image has nothing for the cluster: then the page
/// needs no move (a zero-mapped cluster whose remap failed after a move
/// is in the image, and zeros written there must be moved).
fn zeros_over_a_hole(view: &View, image: &Image, vcn: u64, off: u64) -> bool {
    matches!(image.cluster_source(vcn), ClusterSource::Hole) && page_is_zero(view, off)
}

/// Whether the page at region offset `off` is all zeros.
///
/// Only called with writers held, on pages that are present.
fn page_is_zero(view: &View, off: u64) -> bool {
    let Ok(p) = view.mapping.ptr(off, PAGE_SIZE) else {
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

/// What [`pending_pages`] needs of the state, taken under the state lock
/// so that the scan itself runs without it.
#[derive(Debug)]
pub(crate) struct PendingScan {
    base: u64,
    len: u64,
    /// Address ranges of the private and zero-mapped clusters.
    ranges: Vec<(u64, u64)>,
    tracked: bool,
    zero_tracked: bool,
    zero_ranges: Vec<(u64, u64)>,
    unsaved: u64,
    force_read: bool,
    /// With a write log that a scan has primed: the pages of private and
    /// zero-mapped clusters it named (no scan needed).
    logged: Option<u64>,
}

impl Tracking {
    /// What a status scan of `view` needs. With a primed write log, reads
    /// it (its pages are kept for the next barrier) and counts what it
    /// named instead.
    pub(crate) fn pending_scan(&mut self, view: &View) -> PendingScan {
        let logged = (self.log_primed && self.read_log()).then(|| {
            self.logged
                .iter()
                .filter(|&&page| {
                    let off = page.saturating_mul(PAGE_SIZE);
                    off < view.len()
                        && matches!(
                            view.clusters.get(off / view.cs),
                            ClusterState::Private | ClusterState::Zero
                        )
                })
                .count() as u64
        });
        let ([private, zero], _) = view
            .clusters
            .runs_of([ClusterState::Private, ClusterState::Zero]);
        let addr = |runs: Vec<(u64, u64)>| {
            runs.into_iter()
                .map(|(a, b)| {
                    let (s, l) = view.span(a, b);
                    (s, s + l)
                })
                .collect::<Vec<_>>()
        };
        PendingScan {
            base: view.base(),
            len: view.len(),
            ranges: addr(private),
            tracked: self.tracker.is_some(),
            zero_tracked: self.zero_tracker.is_some(),
            zero_ranges: addr(zero),
            unsaved: self.unsaved.iter().map(|(_, p)| p.len() as u64).sum(),
            force_read: self.scanner.method() == ScanMethod::Read,
            logged,
        }
    }
}

/// Private pages not yet moved into the image (pages a failed barrier left
/// may count twice: an upper bound), from a [`PendingScan`], without the
/// state lock: the scan protects nothing, and what the guest or the
/// monitor change meanwhile only makes the count a moment old. Without
/// write tracking, every private page counts (also those already in the
/// image); with the pagemap read fallback, zero pages of zero-mapped holes
/// too (an upper bound). With a primed write log, the pages it named in
/// private and zero-mapped clusters (zero pages it named too: an upper
/// bound), without a scan.
pub(crate) fn pending_pages(scan: &PendingScan) -> Result<u64, PagemapError> {
    if let Some(n) = scan.logged {
        return Ok(n + scan.unsaved);
    }
    let mut scanner = PageScanner::new(scan.force_read)?;
    let mut runs = Vec::new();
    let whole = |scanner: &mut PageScanner, runs: &mut Vec<(u64, u64)>| {
        runs.clear();
        scanner.written(scan.base, scan.base + scan.len, runs)
    };
    if scan.tracked {
        let mut tracked = || -> Result<(), PagemapError> {
            for &(a, b) in &scan.ranges {
                scanner.written_since(a, b, None, &mut runs)?;
            }
            for &(a, b) in &scan.zero_ranges {
                if scan.zero_tracked {
                    scanner.written_since(a, b, None, &mut runs)?;
                } else {
                    scanner.written(a, b, &mut runs)?;
                }
            }
            Ok(())
        };
        match tracked() {
            Ok(()) => {}
            Err(PagemapError::NotTracked { .. }) => whole(&mut scanner, &mut runs)?,
            Err(e) => return Err(e),
        }
    } else {
        whole(&mut scanner, &mut runs)?;
    }
    Ok(runs.iter().map(|(a, b)| (b - a) / PAGE_SIZE).sum::<u64>() + scan.unsaved)
}
