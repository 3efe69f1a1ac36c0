//! Barriers that follow a write log ([`WriteLog`]) instead of scanning the
//! page tables. Host threads play the guest; a fake log stands in for
//! KVM's dirty log and keeps its contract: each guest write names its page
//! in the log before it changes the page (as KVM marks a page dirty when it
//! makes it writable for the guest), inside the writers' gate. Results are
//! read back through the pcow library.
//!
//! The log is what barriers follow once primed: a write the log does not
//! name is not moved (`a_write_the_log_does_not_name_is_not_moved`), so
//! the tests below would fail if a barrier dropped what the log named.

mod common;

use common::*;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pcow::{Image, OpenOptions};
use virtio_pmem_pcow::{RegionOptions, WriteLog, WriteLogError};

/// A write log of pages, as KVM's dirty log behaves without manual
/// protection: a read takes the set and clears it, atomically.
#[derive(Default)]
struct FakeLog {
    pages: Mutex<BTreeSet<u64>>,
    /// The next read fails, losing the pages it took.
    fail_next: AtomicBool,
    reads: AtomicU64,
    /// What [`WriteLog::complete_unheld`] answers (a log without
    /// per-writer buffers: each write is named before it is made).
    unheld: AtomicBool,
}

impl FakeLog {
    fn mark(&self, off: u64, len: u64) {
        let mut p = self.pages.lock().unwrap();
        for page in off / PAGE..(off + len).div_ceil(PAGE) {
            p.insert(page);
        }
    }
}

impl WriteLog for FakeLog {
    fn take_written(&self, into: &mut dyn FnMut(u64)) -> Result<(), WriteLogError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let taken = std::mem::take(&mut *self.pages.lock().unwrap());
        if self.fail_next.swap(false, Ordering::Relaxed) {
            // The worst a failure may do: what it took is gone.
            return Err(WriteLogError {
                what: "fake".into(),
                source: "failing as asked".into(),
            });
        }
        for p in taken {
            into(p);
        }
        Ok(())
    }

    fn complete_unheld(&self) -> bool {
        self.unheld.load(Ordering::Relaxed)
    }
}

/// A guest write: through the gate, named in the log first, then made.
fn w(rig: &Rig, log: &FakeLog, model: &mut [u8], off: u64, seed: u64, len: usize) {
    let d = pattern(seed, len);
    let _in = rig.gate.enter();
    log.mark(off, len as u64);
    gwrite(rig.base(), rig.region.len(), off, &d);
    model[off as usize..][..len].copy_from_slice(&d);
}

/// A top image over a pcow base with data in its first `data` clusters
/// (the rest are holes of both).
fn over_base(dir: &Path, clusters: u64, data: u64) -> (PathBuf, Vec<u8>) {
    let size = clusters * K64;
    let mut model = vec![0u8; size as usize];
    model[..(data * K64) as usize].copy_from_slice(&pattern(7, (data * K64) as usize));
    let mut b = create(&dir.join("base.pcow"), size, K64, None);
    b.write_at(&model[..(data * K64) as usize], 0).unwrap();
    b.close().unwrap();
    let top = dir.join("top.pcow");
    create(&top, size, K64, Some("base.pcow")).close().unwrap();
    (top, model)
}

fn with_log(path: &Path, opts: &RegionOptions) -> (Rig, Arc<FakeLog>) {
    let rig = Rig::open(path, opts).expect("open region");
    let log = Arc::new(FakeLog::default());
    rig.region.attach_write_log(log.clone()).unwrap();
    assert!(rig.region.has_write_log().unwrap());
    (rig, log)
}

fn close_and_compare(rig: Rig, path: &Path, model: &[u8], what: &str) {
    rig.close();
    same(&reopen_read(path), model, what);
    check_clean(path);
}

#[test]
fn the_first_barrier_after_attaching_scans_once_then_follows_the_log() {
    let test = "the_first_barrier_after_attaching_scans_once_then_follows_the_log";
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = over_base(dir.path(), 16, 16);
    let rig = Rig::open(&top, &RegionOptions::default()).unwrap();
    // Written before any log: only a scan can find these.
    rig.write(2 * K64 + 5, b"before the log");
    model[(2 * K64 + 5) as usize..][..14].copy_from_slice(b"before the log");
    let log = Arc::new(FakeLog::default());
    rig.region.attach_write_log(log.clone()).unwrap();
    w(&rig, &log, &mut model, 3 * K64 + PAGE, 1, 10);
    let s = rig.region.barrier().unwrap();
    assert!(
        !s.write_log,
        "the first barrier after attaching scans: {s:?}"
    );
    assert!(s.tracked, "write tracking on this kernel: {s:?}");
    assert_eq!((s.private_pages, s.pages_copied), (2, 2), "{s:?}");
    same(&view_forced(&top), &model, "after the priming barrier");
    // From now on the log: a page written before (already copied, still
    // private) and a new one.
    w(&rig, &log, &mut model, 2 * K64 + 9, 2, 3);
    w(
        &rig,
        &log,
        &mut model,
        7 * K64 + 15 * PAGE,
        3,
        PAGE as usize,
    );
    assert_eq!(rig.region.status().unwrap().pending_private_pages, 2);
    let s = rig.region.barrier().unwrap();
    assert!(s.write_log && !s.tracked, "{s:?}");
    assert_eq!((s.private_pages, s.pages_copied), (2, 2), "{s:?}");
    let s = rig.region.barrier().unwrap();
    assert!(s.write_log, "{s:?}");
    assert_eq!((s.private_pages, s.pages_copied), (0, 0), "{s:?}");
    assert!(log.reads.load(Ordering::Relaxed) >= 4);
    close_and_compare(rig, &top, &model, "image after barriers on the log");
}

#[test]
fn a_write_the_log_does_not_name_is_not_moved() {
    // The negative control: once primed, barriers follow the log alone, so
    // a log that misses a write loses it (which is why its contract says
    // it never may). The other tests pass only because the log is kept.
    let test = "a_write_the_log_does_not_name_is_not_moved";
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = over_base(dir.path(), 8, 8);
    let (rig, log) = with_log(&top, &RegionOptions::default());
    rig.region.barrier().unwrap();
    let committed = model.clone();
    // Not named in the log.
    rig.write(K64 + 100, b"unlogged");
    model[(K64 + 100) as usize..][..8].copy_from_slice(b"unlogged");
    let s = rig.region.barrier().unwrap();
    assert!(s.write_log, "{s:?}");
    assert_eq!(s.pages_copied, 0, "{s:?}");
    same(
        &rig.read(0, model.len()),
        &model,
        "the region shows the write",
    );
    same(&view_forced(&top), &committed, "the image does not have it");
    // Named later: moved then.
    log.mark(K64 + 100, 8);
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.pages_copied, 1, "{s:?}");
    close_and_compare(rig, &top, &model, "image once the log named it");
}

#[test]
fn pages_of_every_kind_are_moved_as_the_log_names_them() {
    let test = "pages_of_every_kind_are_moved_as_the_log_names_them";
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Clusters 0..8 hold base data (private), 8..16 are holes.
    let (top, mut model) = over_base(dir.path(), 16, 8);
    let (rig, log) = with_log(&top, &RegionOptions::default());
    rig.region.barrier().unwrap();
    // A hole written: a fault maps a fresh cluster shared; the log names
    // it, and nothing needs moving.
    w(&rig, &log, &mut model, 9 * K64 + 3 * PAGE, 1, 40);
    // A hole read (zero-mapped), then one of its pages written.
    assert_eq!(rig.read(10 * K64, K64 as usize), vec![0u8; K64 as usize]);
    w(&rig, &log, &mut model, 10 * K64 + 4 * PAGE + 1, 2, 7);
    // A hole only read, but named by the log (KVM names a page it mapped
    // writable on a read): zeros over nothing, not allocated.
    assert_eq!(rig.read(11 * K64, K64 as usize), vec![0u8; K64 as usize]);
    log.mark(11 * K64, K64);
    // Private pages over the base, one written twice.
    w(&rig, &log, &mut model, K64 + 2 * PAGE, 3, 1);
    w(&rig, &log, &mut model, K64 + 2 * PAGE + 9, 4, 1);
    w(
        &rig,
        &log,
        &mut model,
        5 * K64 + 14 * PAGE,
        5,
        2 * PAGE as usize,
    );
    // A page past the region: ignored.
    log.pages.lock().unwrap().insert(16 * K64 / PAGE + 3);
    let before = rig.region.status().unwrap();
    assert_eq!((before.shared, before.zero_mapped), (1, 2), "{before:?}");
    let s = rig.region.barrier().unwrap();
    assert!(s.write_log, "{s:?}");
    // Cluster 10 whole (a former hole), 1 page of cluster 1, 2 of 5.
    assert_eq!(s.clusters_copied, 3, "{s:?}");
    assert_eq!(s.pages_copied, 16 + 1 + 2, "{s:?}");
    let st = rig.region.status().unwrap();
    assert_eq!(
        (st.shared, st.zero_mapped, st.allocated_clusters),
        (2, 1, 4),
        "{st:?}"
    );
    // Pages private before, written again: moved again.
    w(&rig, &log, &mut model, K64 + 2 * PAGE + 100, 6, 5);
    w(&rig, &log, &mut model, 5 * K64 + 15 * PAGE, 7, 8);
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.pages_copied, s.clusters_copied), (2, 2), "{s:?}");
    same(&rig.read(0, model.len()), &model, "region");
    close_and_compare(rig, &top, &model, "image");
    let img = Image::open(&top, OpenOptions::read_only()).unwrap();
    assert_eq!(
        img.allocated_clusters(),
        4,
        "the read hole is not allocated"
    );
}

#[test]
fn holes_returned_past_the_zero_budget_lose_no_logged_write() {
    let test = "holes_returned_past_the_zero_budget_lose_no_logged_write";
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = over_base(dir.path(), 16, 4);
    // No zero budget: every barrier returns the zero-mapped clusters the
    // image has nothing for to holes (MADV_DONTNEED).
    let (rig, log) = with_log(
        &top,
        &RegionOptions {
            zero_budget: Some(0),
            ..one_cluster_per_fault()
        },
    );
    rig.region.barrier().unwrap();
    for vcn in 8..12 {
        assert_eq!(rig.read(vcn * K64, K64 as usize), vec![0u8; K64 as usize]);
    }
    // Cluster 8 written, 9 written with zeros only, 10 and 11 only read.
    w(&rig, &log, &mut model, 8 * K64 + 5 * PAGE + 3, 1, 30);
    {
        let _in = rig.gate.enter();
        log.mark(9 * K64 + 2 * PAGE, 16);
        gwrite(rig.base(), rig.region.len(), 9 * K64 + 2 * PAGE, &[0u8; 16]);
    }
    assert_eq!(rig.region.status().unwrap().zero_mapped, 4);
    let s = rig.region.barrier().unwrap();
    assert!(s.write_log, "{s:?}");
    assert_eq!((s.clusters_copied, s.reholed), (1, 3), "{s:?}");
    let st = rig.region.status().unwrap();
    assert_eq!((st.zero_mapped, st.holes, st.shared), (0, 11, 1), "{st:?}");
    // Writes into a returned hole (a fault maps a cluster shared) and into
    // the moved cluster; a read of another returned hole.
    w(&rig, &log, &mut model, 10 * K64 + 7, 2, 9);
    w(&rig, &log, &mut model, 8 * K64 + 5 * PAGE + 100, 3, 9);
    assert_eq!(rig.read(11 * K64, 64), vec![0u8; 64]);
    let s = rig.region.barrier().unwrap();
    assert!(s.write_log, "{s:?}");
    same(&rig.read(0, model.len()), &model, "region");
    close_and_compare(rig, &top, &model, "image after holes were returned");
    let img = Image::open(&top, OpenOptions::read_only()).unwrap();
    assert_eq!(img.allocated_clusters(), 2, "clusters 8 and 10 only");
}

#[test]
fn a_failed_log_read_makes_the_barrier_scan_and_nothing_is_lost() {
    let test = "a_failed_log_read_makes_the_barrier_scan_and_nothing_is_lost";
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = over_base(dir.path(), 16, 16);
    let (rig, log) = with_log(&top, &RegionOptions::default());
    rig.region.barrier().unwrap();
    w(&rig, &log, &mut model, 4 * K64, 1, 100);
    w(&rig, &log, &mut model, 6 * K64 + 3 * PAGE, 2, 100);
    // The read fails and loses both pages: the scan finds them.
    log.fail_next.store(true, Ordering::Relaxed);
    let s = rig.region.barrier().unwrap();
    assert!(!s.write_log && s.tracked, "{s:?}");
    assert!(s.pages_copied >= 2, "{s:?}");
    same(&view_forced(&top), &model, "after the failed read");
    // The next barrier scans once more (the log is trusted again only
    // after a scan that follows a read that worked), then the log again.
    w(&rig, &log, &mut model, 8 * K64 + 7, 3, 3);
    let s = rig.region.barrier().unwrap();
    assert!(!s.write_log, "{s:?}");
    w(&rig, &log, &mut model, 8 * K64 + 20, 4, 3);
    let s = rig.region.barrier().unwrap();
    assert!(s.write_log, "{s:?}");
    assert_eq!(s.pages_copied, 1, "{s:?}");
    close_and_compare(rig, &top, &model, "image after a failed read");
}

#[test]
fn no_write_is_lost_while_writers_race_barriers_and_status_reads() {
    race(
        "no_write_is_lost_while_writers_race_barriers_and_status_reads",
        false,
        32,
    );
}

/// The race above with a log that vouches for reads with writers running,
/// over holes only: once written, every cluster is shared, and most
/// barriers run without holding the writers.
#[test]
fn no_write_is_lost_while_writers_race_barriers_that_hold_no_writer() {
    race(
        "no_write_is_lost_while_writers_race_barriers_that_hold_no_writer",
        true,
        0,
    );
}

/// Writers rewrite pages of `CLUSTERS` clusters (the first `data` over base
/// data, the rest holes) while barriers and status reads run; every write
/// must be in the image at the end.
fn race(test: &str, unheld: bool, data: u64) {
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    const CLUSTERS: u64 = 64;
    let (top, model) = over_base(dir.path(), CLUSTERS, data);
    let (rig, log) = with_log(&top, &RegionOptions::default());
    log.unheld.store(unheld, Ordering::Relaxed);
    let rig = Arc::new(rig);
    let model = Arc::new(Mutex::new(model));
    let stop = Arc::new(AtomicBool::new(false));
    let pages = CLUSTERS * K64 / PAGE;
    const WRITERS: u64 = 3;
    // Each writer owns the pages p with p % WRITERS == id, and rewrites
    // them over and over (pages it copied before too), in random order.
    let writers: Vec<_> = (0..WRITERS)
        .map(|id| {
            let (rig, log, model, stop) = (rig.clone(), log.clone(), model.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut x = 0x1234_5678_9abc_def1u64 ^ (id << 40);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let page = (x % (pages / WRITERS)) * WRITERS + id;
                    let off = page * PAGE + (x >> 32) % (PAGE - 16);
                    n += 1;
                    let d = (n << 8 | id).to_le_bytes();
                    {
                        let _in = rig.gate.enter();
                        log.mark(off, 8);
                        gwrite(rig.base(), rig.region.len(), off, &d);
                    }
                    model.lock().unwrap()[off as usize..][..8].copy_from_slice(&d);
                }
                n
            })
        })
        .collect();
    // Status reads the log too (its pages kept for the next barrier).
    let status = {
        let (rig, stop) = (rig.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                rig.region.status().unwrap();
                n += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            n
        })
    };
    let start = Instant::now();
    let mut barriers = 0;
    let mut logged = 0;
    let mut without_hold = 0;
    while start.elapsed() < Duration::from_millis(1500) {
        let s = rig.region.barrier().unwrap();
        barriers += 1;
        logged += u64::from(s.write_log);
        without_hold += u64::from(s.unheld);
        // Between barriers, what the last one committed is a state the
        // guest wrote: checked at the end, with every write.
        std::thread::sleep(Duration::from_millis(3));
    }
    stop.store(true, Ordering::Relaxed);
    let writes: u64 = writers.into_iter().map(|t| t.join().unwrap()).sum();
    let statuses = status.join().unwrap();
    rig.region.barrier().unwrap();
    eprintln!(
        "{test}: {writes} writes, {barriers} barriers ({logged} on the log, \
         {without_hold} without holding the writers), {statuses} status reads"
    );
    assert!(
        barriers > 10 && logged >= barriers - 1,
        "{barriers} {logged}"
    );
    if unheld {
        assert!(
            without_hold > 0,
            "no barrier ran without holding the writers"
        );
    } else {
        assert_eq!(without_hold, 0);
    }
    let model = model.lock().unwrap().clone();
    same(&view_forced(&top), &model, "committed image after the race");
    let rig = Arc::into_inner(rig).expect("threads joined");
    close_and_compare(rig, &top, &model, "image after close");
}

#[test]
fn a_failed_barrier_keeps_the_pages_the_log_named() {
    let test = "a_failed_barrier_keeps_the_pages_the_log_named";
    if !uffd_or_skip(test) {
        return;
    }
    let fs = match SmallFs::mount("16M") {
        Ok(fs) => fs,
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "{test}: {e} (under CI)");
            eprintln!("SKIPPED {test}: {e}");
            return;
        }
    };
    // The base on the small file system too (it is written once, before
    // the top), the top's copies of the written pages need clusters.
    const N: u64 = 32;
    let (top, mut model) = over_base(fs.path(), N, N);
    let (rig, log) = with_log(
        &top,
        &RegionOptions {
            pool_clusters: Some(1),
            ..RegionOptions::default()
        },
    );
    rig.region.barrier().unwrap();
    // Fill the file system, then write a page of every cluster.
    let mut n = 0;
    while std::fs::write(fs.path().join(format!("f{n}")), vec![1u8; 64 << 10]).is_ok() {
        n += 1;
    }
    for vcn in 0..N {
        w(
            &rig,
            &log,
            &mut model,
            vcn * K64 + (vcn % 16) * PAGE,
            vcn,
            64,
        );
    }
    let e = rig.region.barrier().unwrap_err();
    eprintln!("{test}: barrier on a full file system: {}", chain(&e));
    // The log was read (and is empty now); its pages are kept.
    assert!(log.pages.lock().unwrap().is_empty());
    for i in 0..n {
        std::fs::remove_file(fs.path().join(format!("f{i}"))).unwrap();
    }
    fs.grow("64M").unwrap();
    let s = rig.region.barrier().unwrap();
    assert!(s.write_log, "{s:?}");
    assert_eq!(s.pages_copied, N, "{s:?}");
    close_and_compare(rig, &top, &model, "image after the failed barrier");
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s += &format!(": {x}");
        src = x.source();
    }
    s
}

/// Runs a barrier on another thread while this one is a writer inside the
/// gate (a vCPU in the guest): `Some(stats)` if the barrier finished
/// without holding the writers (within 2 s), `None` if it waited for the
/// writer, which is then let go so that the barrier finishes.
fn barrier_beside_a_writer(
    rig: &Rig,
) -> (
    Option<virtio_pmem_pcow::BarrierStats>,
    virtio_pmem_pcow::BarrierStats,
) {
    let entry = rig.gate.enter();
    std::thread::scope(|sc| {
        let (tx, rx) = std::sync::mpsc::channel();
        let h = sc.spawn(move || {
            let s = rig.region.barrier().unwrap();
            let _ = tx.send(s);
            s
        });
        let unheld = rx.recv_timeout(Duration::from_secs(2)).ok();
        drop(entry);
        (unheld, h.join().unwrap())
    })
}

/// A barrier whose log (one that vouches for reads with writers running)
/// names only pages of clusters mapped shared from the image holds no
/// writer, and still makes those writes durable; one that names a page of
/// a private cluster, or a log that does not vouch, holds them.
#[test]
fn a_barrier_whose_log_names_only_shared_pages_holds_no_writer() {
    let test = "a_barrier_whose_log_names_only_shared_pages_holds_no_writer";
    if !uffd_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Clusters 0..4 hold base data (private), 4..8 are holes.
    let (top, mut model) = over_base(dir.path(), 8, 4);
    let (rig, log) = with_log(&top, &RegionOptions::default());
    log.unheld.store(true, Ordering::Relaxed);
    // A first write into each hole maps it shared from the image; the
    // first barrier scans once (priming the log).
    for c in 4..8 {
        w(&rig, &log, &mut model, c * K64 + 100, c, 8);
    }
    let s = rig.region.barrier().unwrap();
    assert!(!s.write_log && !s.unheld, "{s:?}");

    // Writes into shared clusters only: no hold, and durable.
    w(&rig, &log, &mut model, 5 * K64 + 3 * PAGE, 51, 100);
    w(&rig, &log, &mut model, 7 * K64, 71, 4096);
    let (unheld, s) = barrier_beside_a_writer(&rig);
    assert!(unheld.is_some(), "the barrier waited for the writer: {s:?}");
    assert!(s.unheld && s.write_log && s.held.is_zero(), "{s:?}");
    assert_eq!(s.pages_copied, 0, "{s:?}");
    same(&view_forced(&top), &model, "after the unheld barrier");

    // A page of a private cluster: the barrier must hold the writers.
    w(&rig, &log, &mut model, 2 * K64 + PAGE, 21, 10);
    w(&rig, &log, &mut model, 6 * K64, 61, 10);
    let (unheld, s) = barrier_beside_a_writer(&rig);
    assert!(
        unheld.is_none(),
        "a private page moved without holding: {s:?}"
    );
    assert!(!s.unheld && s.write_log, "{s:?}");
    assert_eq!(s.pages_copied, 1, "{s:?}");
    same(&view_forced(&top), &model, "after the held barrier");

    // A log that does not vouch for reads with writers running.
    log.unheld.store(false, Ordering::Relaxed);
    w(&rig, &log, &mut model, 4 * K64 + 9, 41, 10);
    let (unheld, s) = barrier_beside_a_writer(&rig);
    assert!(unheld.is_none(), "held without a log that vouches: {s:?}");
    assert!(!s.unheld, "{s:?}");
    close_and_compare(rig, &top, &model, "after all barriers");
}

/// On tmpfs with clusters of 2 MiB (the pool worker's pieces are whole
/// clusters), a FLUSH whose commit meets the worker in a piece writes its
/// metadata beside it instead of waiting for the inode lock, which the
/// worker's `fallocate` holds for the whole call. The worker's piece is
/// held up here behind a long `fallocate` of the image file from outside
/// (1 GiB of tmpfs, about 0.2 s), which the FLUSH must not wait for
/// either.
#[test]
fn on_tmpfs_a_flush_commits_beside_the_pool_workers_piece() {
    const CS: u64 = 2 << 20;
    let test = "on_tmpfs_a_flush_commits_beside_the_pool_workers_piece";
    if !uffd_or_skip(test) {
        return;
    }
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("SKIPPED {test}: no /dev/shm");
        return;
    };
    let path = dir.path().join("img.pcow");
    create(&path, 32 * CS, CS, None).close().unwrap();
    let mut model = vec![0u8; (32 * CS) as usize];
    let opts = RegionOptions {
        pool_clusters: Some(4),
        ..RegionOptions::default()
    };
    let (rig, log) = with_log(&path, &opts);
    log.unheld.store(true, Ordering::Relaxed);
    // The first barrier after attaching scans; the log from then on.
    w(&rig, &log, &mut model, 5, 1, 100);
    rig.region.barrier().unwrap();
    let pool = || rig.region.status().unwrap().pool;
    let wait_for = |what: &str, ok: &dyn Fn(&virtio_pmem_pcow::PoolStatus) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let p = pool();
            if ok(&p) {
                return p;
            }
            assert!(Instant::now() < deadline, "{what}: {p:?}");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    wait_for("the pool did not fill", &|p| {
        p.free_clusters >= 4 && !p.in_flight
    });

    let other = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let end = other.metadata().unwrap().len();
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    let reserver = std::thread::spawn(move || {
        let t = Instant::now();
        let r = pcow::io::allocate_file(&other, end + (64 << 20), 1 << 30);
        d.store(true, Ordering::SeqCst);
        r.map(|()| t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(10));
    // First writes into holes use the pool: the worker's refill starts,
    // and its `fallocate` waits behind the one above.
    for c in 10..12 {
        w(&rig, &log, &mut model, c * CS + 7, c, 10);
    }
    wait_for("no refill asked for", &|p| p.in_flight);
    std::thread::sleep(Duration::from_millis(10));
    assert!(
        !done.load(Ordering::SeqCst),
        "the fallocate ended within 20 ms: too fast for this test"
    );
    let t = Instant::now();
    let stats = rig.region.barrier().unwrap();
    let took = t.elapsed();
    let waited = done.load(Ordering::SeqCst);
    let reserving = reserver.join().unwrap().unwrap();
    assert!(stats.unheld, "{stats:?}");
    // Waiting would have taken what was left of the reservation, well
    // over half of it; the `done` flag alone can be late.
    assert!(
        !waited && took * 2 < reserving,
        "the FLUSH waited for the fallocate in flight ({took:?} of {reserving:?}, {stats:?})"
    );
    close_and_compare(rig, &path, &model, "after the FLUSH beside the piece");
}
