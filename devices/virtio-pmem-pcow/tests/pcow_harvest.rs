//! Per-4-KiB copy-on-write at the barrier: a cluster with data below gets
//! only its written pages copied into the writable layer (a partial bitmap
//! on disk) and keeps its private mapping; write tracking (WP-async
//! userfaultfd + `PAGEMAP_SCAN`) makes each barrier find the pages written
//! since the previous one. Host threads play the guest; results are read
//! back through the pcow library.

mod common;

use common::*;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use pcow::{ClusterSource, Image, OpenOptions, PageLocation};
use virtio_pmem_pcow::pagemap::PageScanner;
use virtio_pmem_pcow::{PcowRegion, RegionOptions, WriteGate};

fn open_rig(path: &Path) -> Rig {
    Rig::open(path, &RegionOptions::default()).expect("open region")
}

/// Closes, then the image at `path` shows `model` in `allocated`
/// clusters and checks clean.
fn close_and_expect(rig: Rig, path: &Path, model: &[u8], allocated: u64) {
    rig.close();
    let img = Image::open(path, OpenOptions::read_only()).unwrap();
    assert_eq!(view(&img), model);
    assert_eq!(img.allocated_clusters(), allocated);
    drop(img);
    check_clean(path);
}

/// A top image over a pcow base holding data in every cluster.
fn over_full_base(dir: &Path, clusters: u64, cs: u64) -> (PathBuf, Vec<u8>) {
    let size = clusters * cs;
    let model = pattern(7, size as usize);
    let mut b = create(&dir.join("base.pcow"), size, cs, None);
    b.write_at(&model, 0).unwrap();
    b.close().unwrap();
    let top = dir.join("top.pcow");
    create(&top, size, cs, Some("base.pcow")).close().unwrap();
    (top, model)
}

/// The committed image as another process would see it (no lock).
fn open_shared(path: &Path) -> Image {
    Image::open(
        path,
        OpenOptions {
            force_share: true,
            ..OpenOptions::default()
        },
    )
    .expect("reopen")
}

fn view(img: &Image) -> Vec<u8> {
    let mut v = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut v, 0).unwrap();
    v
}

/// Pages of cluster `vcn` that the active layer holds (its bitmap).
fn top_pages(img: &Image, vcn: u64) -> Vec<usize> {
    let Some(at) = img.active_offset(vcn) else {
        return Vec::new();
    };
    let n = (img.cluster_size() / PAGE) as usize;
    let mine = |i: usize| PageLocation::File {
        depth: 0,
        offset: at + i as u64 * PAGE,
    };
    match img.cluster_source(vcn) {
        ClusterSource::Active { offset } => {
            assert_eq!(offset, at);
            (0..n).collect()
        }
        ClusterSource::Mixed(pages) => (0..n).filter(|&i| pages[i] == mine(i)).collect(),
        other => panic!("cluster {vcn} has an active cluster but reads as {other:?}"),
    }
}

#[test]
fn the_bitmap_of_a_copied_cluster_holds_exactly_the_written_pages() {
    if !uffd_or_skip("the_bitmap_of_a_copied_cluster_holds_exactly_the_written_pages") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = over_full_base(dir.path(), 16, K64);
    let rig = open_rig(&top);
    // Pages 1, 3 and 4 of cluster 2 (partial pages, one write spanning 3
    // and 4), page 15 of cluster 5 (its last byte).
    let writes: &[(u64, usize)] = &[
        (2 * K64 + PAGE + 100, 10),
        (2 * K64 + 4 * PAGE - 5, 9),
        (6 * K64 - 1, 1),
    ];
    for (i, &(off, len)) in writes.iter().enumerate() {
        let d = pattern(100 + i as u64, len);
        rig.write(off, &d);
        model[off as usize..][..len].copy_from_slice(&d);
    }
    let s = rig.region.barrier().unwrap();
    assert!(s.tracked, "write tracking (WP-async) on this kernel");
    assert_eq!(
        (s.private_pages, s.pages_copied, s.clusters_copied),
        (4, 4, 2)
    );
    assert_eq!((s.clusters_partial, s.clusters_remapped), (2, 0));
    let st = rig.region.status().unwrap();
    assert_eq!((st.private, st.shared), (16, 0), "no remap: still private");
    assert_eq!(st.pending_private_pages, 0);
    // On disk (committed): exactly the written pages in the top file.
    let img = open_shared(&top);
    assert_eq!(top_pages(&img, 2), vec![1, 3, 4]);
    assert_eq!(top_pages(&img, 5), vec![15]);
    for vcn in (0..16).filter(|v| ![2, 5].contains(v)) {
        assert!(top_pages(&img, vcn).is_empty(), "cluster {vcn}");
    }
    assert_eq!(img.allocated_clusters(), 2);
    assert_eq!(view(&img), model);
    let ext = img.extents();
    let top_bytes: u64 = ext.iter().filter(|e| e.depth == 0).map(|e| e.length).sum();
    assert_eq!(top_bytes, 4 * PAGE, "{ext:?}");
    drop(img);
    assert_eq!(rig.read(0, model.len()), model);
    rig.close();
    // Reopened offline (no region: partial clusters stay partial).
    let img = Image::open(&top, OpenOptions::read_only()).unwrap();
    assert_eq!(top_pages(&img, 2), vec![1, 3, 4]);
    assert_eq!(view(&img), model);
}

#[test]
fn pages_written_again_are_persisted_and_unchanged_pages_are_not_copied_again() {
    if !uffd_or_skip("pages_written_again_are_persisted_and_unchanged_pages_are_not_copied_again") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = over_full_base(dir.path(), 16, K64);
    let rig = open_rig(&top);
    w(&rig, &mut model, 3 * K64 + 2 * PAGE, 1, 100);
    w(&rig, &mut model, 3 * K64 + 7 * PAGE, 2, 100);
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.pages_copied), (2, 2));
    // Nothing written: nothing copied.
    let s = rig.region.barrier().unwrap();
    assert_eq!(
        (s.private_pages, s.pages_copied, s.clusters_copied),
        (0, 0, 0)
    );
    // The same page again (already private, already in the image), and a
    // page of another cluster.
    w(&rig, &mut model, 3 * K64 + 2 * PAGE + 50, 3, 20);
    w(&rig, &mut model, 9 * K64, 4, 1);
    assert_eq!(rig.region.status().unwrap().pending_private_pages, 2);
    let s = rig.region.barrier().unwrap();
    assert_eq!(
        (s.private_pages, s.pages_copied, s.clusters_copied),
        (2, 2, 2)
    );
    let img = open_shared(&top);
    assert_eq!(view(&img), model, "the rewrite is in the committed image");
    assert_eq!(top_pages(&img, 3), vec![2, 7]);
    assert_eq!(top_pages(&img, 9), vec![0]);
    drop(img);
    // Rewritten many times between barriers: copied once.
    for i in 0..50 {
        w(&rig, &mut model, 3 * K64 + 7 * PAGE + i, 10 + i, 1);
    }
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.pages_copied, 1);
    assert_eq!(rig.read(0, model.len()), model);
    rig.close();
    let img = Image::open(&top, OpenOptions::read_only()).unwrap();
    assert_eq!(view(&img), model);
    assert_eq!(img.allocated_clusters(), 2);
}

/// The barrier write-protects the file pages a guest faulted in by reading
/// (so later walks skip them): reads are never reported as written, and a
/// write to a page read (and protected) before is still found, whether it
/// comes right after that barrier, after more reads, or pages later.
#[test]
fn pages_read_before_a_barrier_and_written_after_it_are_found() {
    if !uffd_or_skip("pages_read_before_a_barrier_and_written_after_it_are_found") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = over_full_base(dir.path(), 16, K64);
    let rig = open_rig(&top);
    let len = model.len();
    // Read every other cluster: file pages in the private mapping.
    for vcn in (0..16).step_by(2) {
        assert_eq!(
            rig.read(vcn * K64, K64 as usize),
            model[(vcn * K64) as usize..][..K64 as usize]
        );
    }
    let s = rig.region.barrier().unwrap();
    assert!(s.tracked, "this test needs WP-async write tracking");
    assert_eq!(
        (s.private_pages, s.pages_copied),
        (0, 0),
        "reads are not writes"
    );
    assert_eq!(rig.region.status().unwrap().pending_private_pages, 0);
    // Writes into pages read (and protected) at the last barrier, into
    // pages never touched, and a read of the rest.
    w(&rig, &mut model, 2 * K64 + 3 * PAGE, 1, 10);
    w(&rig, &mut model, 4 * K64, 2, 2 * PAGE as usize);
    w(&rig, &mut model, 5 * K64 + 9 * PAGE, 3, 1);
    assert_eq!(rig.read(0, len), model);
    assert_eq!(rig.region.status().unwrap().pending_private_pages, 4);
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.pages_copied), (4, 4));
    let s = rig.region.barrier().unwrap();
    assert_eq!(
        (s.private_pages, s.pages_copied),
        (0, 0),
        "everything read is protected now"
    );
    // Every page of the region was read and protected; each write is found.
    for (i, vcn) in (0..16u64).enumerate() {
        w(
            &rig,
            &mut model,
            vcn * K64 + (i as u64 % 16) * PAGE + 100,
            10 + i as u64,
            8,
        );
    }
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.pages_copied), (16, 16));
    rig.close();
    let img = Image::open(&top, OpenOptions::read_only()).unwrap();
    assert_eq!(view(&img), model);
    check_clean(&top);
}

#[test]
fn after_a_live_snapshot_rewrites_of_private_pages_go_to_the_new_layer() {
    if !uffd_or_skip("after_a_live_snapshot_rewrites_of_private_pages_go_to_the_new_layer") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = over_full_base(dir.path(), 8, K64);
    let rig = open_rig(&top);
    // Every cluster has data below: page 1 of cluster 4 is copied by the
    // snapshot's barrier; after the snapshot it is written again (already
    // private) together with page 2.
    let d = pattern(1, 64);
    rig.write(4 * K64 + PAGE, &d);
    model[(4 * K64 + PAGE) as usize..][..64].copy_from_slice(&d);
    rig.region.snapshot_create("s").unwrap();
    let at_snapshot = model.clone();
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.pages_copied, 0, "the snapshot's barrier copied the page");
    for (i, off) in [4 * K64 + PAGE + 8, 4 * K64 + 2 * PAGE]
        .into_iter()
        .enumerate()
    {
        let d = pattern(20 + i as u64, 32);
        rig.write(off, &d);
        model[off as usize..][..32].copy_from_slice(&d);
    }
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.pages_copied), (2, 2));
    rig.close();
    let img = Image::open(&top, OpenOptions::read_only()).unwrap();
    assert_eq!(view(&img), model);
    assert_eq!(top_pages(&img, 4), vec![1, 2], "the new layer's bitmap");
    drop(img);
    let mut img = Image::open(&top, OpenOptions::read_write()).unwrap();
    img.snapshot_apply("s").unwrap();
    assert_eq!(view(&img), at_snapshot);
}

#[test]
fn two_mib_clusters_copy_only_their_written_pages() {
    if !uffd_or_skip("two_mib_clusters_copy_only_their_written_pages") {
        return;
    }
    const M2: u64 = 2 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.pcow");
    let mut img = create(&path, 4 * M2, M2, None);
    img.write_at(&pattern(1, 2 * M2 as usize), 0).unwrap();
    img.snapshot_create("s").unwrap();
    img.close().unwrap();
    let mut model = view(&Image::open(&path, OpenOptions::read_only()).unwrap());
    let rig = open_rig(&path);
    w(&rig, &mut model, 3, 2, 10); // page 0 of cluster 0 (snapshot data)
    w(&rig, &mut model, M2 - 1, 3, 2); // last page of cluster 0, first of cluster 1
    w(&rig, &mut model, M2 + 300 * PAGE, 4, 8192); // pages 300, 301 of cluster 1
    w(&rig, &mut model, 2 * M2 + 17, 5, 3); // a hole: a whole fresh cluster
    let s = rig.region.barrier().unwrap();
    assert_eq!(
        s.private_pages, 5,
        "the hole's page went in by a write fault"
    );
    assert_eq!((s.clusters_partial, s.pages_copied), (2, 5));
    let st = rig.region.status().unwrap();
    assert_eq!((st.private, st.shared), (2, 1));
    w(&rig, &mut model, M2 + 300 * PAGE + 1, 6, 1);
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.pages_copied, 1);
    assert_eq!(rig.read(0, model.len()), model);
    rig.close();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert_eq!(top_pages(&img, 0), vec![0, 511]);
    assert_eq!(top_pages(&img, 1), vec![0, 300, 301]);
    assert_eq!(top_pages(&img, 2).len(), 512);
    assert_eq!(view(&img), model);
}

#[test]
fn a_cluster_whose_every_page_was_written_is_remapped_shared() {
    if !uffd_or_skip("a_cluster_whose_every_page_was_written_is_remapped_shared") {
        return;
    }
    const K16: u64 = 16 << 10;
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = over_full_base(dir.path(), 8, K16);
    let rig = open_rig(&top);
    for (round, pages) in [[0u64, 2], [1, 3]].into_iter().enumerate() {
        for p in pages {
            let off = 5 * K16 + p * PAGE + 9;
            let d = pattern(round as u64 * 10 + p, 5);
            rig.write(off, &d);
            model[off as usize..][..5].copy_from_slice(&d);
        }
        let s = rig.region.barrier().unwrap();
        assert_eq!(s.pages_copied, 2);
        assert_eq!(s.clusters_remapped, round as u64, "round {round}");
    }
    let st = rig.region.status().unwrap();
    assert_eq!((st.private, st.shared), (7, 1));
    // Shared now: writes go straight to the image, nothing to harvest.
    rig.write(5 * K16 + 1, &[0xAB]);
    model[(5 * K16 + 1) as usize] = 0xAB;
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.private_pages, 0);
    assert_eq!(rig.read(0, model.len()), model);
    rig.close();
    let img = Image::open(&top, OpenOptions::read_only()).unwrap();
    assert_eq!(view(&img), model);
}

#[test]
fn a_zero_mapped_hole_still_becomes_a_whole_shared_cluster() {
    if !uffd_or_skip("a_zero_mapped_hole_still_becomes_a_whole_shared_cluster") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.pcow");
    create(&path, 8 * K64, K64, None).close().unwrap();
    let rig = open_rig(&path);
    assert_eq!(rig.read(2 * K64, 4), vec![0; 4]); // zero-mapped
    rig.write(2 * K64 + 3 * PAGE, b"zz");
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.private_pages, 1);
    assert_eq!(
        (s.pages_copied, s.clusters_partial, s.clusters_remapped),
        (16, 0, 1)
    );
    rig.close();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(matches!(
        img.cluster_source(2),
        ClusterSource::Active { .. }
    ));
}

/// The scan takes one walk while few pages are protected and two once
/// many are (see `PageScanner::written_since`); the two protect
/// differently (the pages found, or whole page tables), and every write is
/// found before, at and after the switch: into pages written before, next
/// to them, into pages read, and into pages never touched.
#[test]
fn writes_are_found_across_the_switch_from_one_scan_walk_to_two() {
    if !uffd_or_skip("writes_are_found_across_the_switch_from_one_scan_walk_to_two") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // 32 MiB: 16 page tables, so one walk while at most 16 pages are
    // protected.
    let (top, mut model) = over_full_base(dir.path(), 512, K64);
    let rig = open_rig(&top);
    let len = model.len();
    let table: u64 = 2 << 20;
    let mut seed = 100;
    let mut write_pages = |rig: &Rig, model: &mut Vec<u8>, pages: &[u64]| {
        for &p in pages {
            seed += 1;
            w(rig, model, p * PAGE + 17, seed, 9);
        }
        pages.len() as u64
    };
    for round in 0..3u64 {
        // One page in each of four tables.
        let pages: Vec<u64> = (0..4)
            .map(|t| (t * 4 + round) * (table / PAGE) + 7 * round + 1)
            .collect();
        let n = write_pages(&rig, &mut model, &pages);
        let s = rig.region.barrier().unwrap();
        assert!(s.tracked, "this test needs WP-async write tracking");
        assert_eq!((s.private_pages, s.two_walks), (n, false), "round {round}");
    }
    // Read 8 MiB: 2048 file pages to protect, which ends the one walk.
    assert_eq!(
        rig.read(4 * table, (4 * table) as usize),
        model[(4 * table) as usize..][..(4 * table) as usize]
    );
    let s = rig.region.barrier().unwrap();
    assert_eq!(
        (s.private_pages, s.two_walks),
        (0, false),
        "reads are not writes"
    );
    // Into a page written before, next to written pages (empty entries the
    // one walk left unprotected), into read pages, into untouched tables.
    let pages = [
        1,
        2,
        3,
        table / PAGE + 9,
        4 * table / PAGE + 5,
        6 * table / PAGE + 300,
        14 * table / PAGE + 1,
        15 * table / PAGE + 511,
    ];
    let n = write_pages(&rig, &mut model, &pages);
    assert_eq!(rig.region.status().unwrap().pending_private_pages, n);
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.two_walks), (n, true));
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.two_walks), (0, true), "nothing new");
    // Again next to everything written so far, and into read pages.
    let pages = [
        4,
        table / PAGE + 10,
        4 * table / PAGE + 6,
        7 * table / PAGE + 2,
        14 * table / PAGE + 2,
        15 * table / PAGE + 510,
    ];
    let n = write_pages(&rig, &mut model, &pages);
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.two_walks), (n, true));
    assert_eq!(rig.read(0, len), model);
    rig.close();
    let img = Image::open(&top, OpenOptions::read_only()).unwrap();
    assert_eq!(view(&img), model);
    check_clean(&top);
}

/// A guest write of `pattern(seed, len)` at `off`, mirrored in `model`.
fn w(rig: &Rig, model: &mut [u8], off: u64, seed: u64, len: usize) {
    let d = pattern(seed, len);
    rig.write(off, &d);
    model[off as usize..][..len].copy_from_slice(&d);
}

/// One barrier measurement.
fn time_barrier(rig: &Rig, label: &str, k: u64, next: &mut dyn FnMut() -> u64) {
    for i in 0..k {
        rig.write(next() * PAGE + (i % 4000), &[(i as u8) | 1]);
    }
    let t = Instant::now();
    let s = rig.region.barrier().unwrap();
    let total = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "  {label:<28} {k:>6} pages written: barrier {total:8.2} ms (scan {:.2} ms, copy {:.2} ms, \
         commit {:.2} ms; {} pages found, {} copied, tracked={})",
        s.scan.as_secs_f64() * 1e3,
        s.copy.as_secs_f64() * 1e3,
        s.commit.as_secs_f64() * 1e3,
        s.private_pages,
        s.pages_copied,
        s.tracked
    );
    assert_eq!(s.private_pages, k);
}

/// Barrier cost against the pages written since the last barrier, on a
/// 1 GiB and a 16 GiB region of read-only data (a sparse raw base on the
/// disk), with the private mapping's page tables empty and populated by
/// reads; next to a bare `fdatasync` and the old full scan (every private
/// page of the region). Prints, asserts nothing about time.
///
/// `cargo test -p virtio-pmem-pcow --test pcow_harvest -- --ignored --nocapture`
#[test]
#[ignore = "benchmark: minutes and several GiB of page cache"]
fn barrier_cost_follows_the_pages_written() {
    if !uffd_or_skip("barrier_cost_follows_the_pages_written") {
        return;
    }
    for (gib, read_gib) in [(1u64, 1u64), (16, 4)] {
        let dir =
            tempfile::tempdir_in(std::env::var_os("PCOW_BENCH_DIR").unwrap_or("/var/tmp".into()))
                .unwrap();
        let size = gib << 30;
        let base = dir.path().join("base.raw");
        let f = std::fs::File::create(&base).unwrap();
        f.set_len(size).unwrap();
        drop(f);
        let top = dir.path().join("top.pcow");
        create(&top, size, K64, Some("base.raw")).close().unwrap();
        let t = Instant::now();
        let rig = open_rig(&top);
        println!(
            "{gib} GiB region of read-only data, 64 KiB clusters (opened in {:.0} ms):",
            t.elapsed().as_secs_f64() * 1e3
        );
        // Distinct pages, never written before, spread over the region.
        let pages = size / PAGE;
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut used = std::collections::HashSet::new();
        let mut next = move || loop {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let p = x % pages;
            if used.insert(p) {
                return p;
            }
        };
        for k in [0, 1, 1000, 100_000] {
            time_barrier(&rig, "page tables empty", k, &mut next);
        }
        // Populate the page tables of `read_gib` GiB (reads: file pages).
        let t = Instant::now();
        let mut sum = 0u64;
        for off in (0..read_gib << 30).step_by(PAGE as usize) {
            // SAFETY: in bounds of the live region; a read.
            sum += u64::from(unsafe { rig.region.host_addr().add(off as usize).read_volatile() });
        }
        println!(
            "  (read {read_gib} GiB through the region in {:.0} ms, sum {sum})",
            t.elapsed().as_secs_f64() * 1e3
        );
        let label = format!("{read_gib} GiB page tables full");
        for k in [0, 1, 1000, 100_000] {
            time_barrier(&rig, &label, k, &mut next);
        }
        // The old barrier's scan: every private page of the region.
        let mut sc = PageScanner::new(false).unwrap();
        let mut runs = Vec::new();
        let a = rig.region.host_addr() as u64;
        let t = Instant::now();
        sc.written(a, a + size, &mut runs).unwrap();
        let n: u64 = runs.iter().map(|(s, e)| (e - s) / PAGE).sum();
        println!(
            "  old full scan (every private page, {n} found): {:.2} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        // The same data as a raw file would take it: k random 4 KiB
        // pwrites into a fresh file, then fdatasync.
        for k in [1000u64, 100_000] {
            let raw = dir.path().join("raw.img");
            let f = std::fs::File::create(&raw).unwrap();
            f.set_len(size).unwrap();
            let page = vec![0x5Au8; PAGE as usize];
            let mut y = 0x1234_5678_9ABC_DEF1u64;
            let t = Instant::now();
            for _ in 0..k {
                y ^= y << 13;
                y ^= y >> 7;
                y ^= y << 17;
                std::os::unix::fs::FileExt::write_all_at(&f, &page, (y % pages) * PAGE).unwrap();
            }
            let w = t.elapsed();
            f.sync_data().unwrap();
            println!(
                "  raw file: {k} random 4 KiB pwrites {:.2} ms + fdatasync {:.2} ms",
                w.as_secs_f64() * 1e3,
                (t.elapsed() - w).as_secs_f64() * 1e3
            );
            drop(f);
            std::fs::remove_file(&raw).unwrap();
        }
        // A bare fdatasync of the image file.
        let f = std::fs::OpenOptions::new().write(true).open(&top).unwrap();
        let t = Instant::now();
        f.sync_data().unwrap();
        println!(
            "  bare fdatasync of the image: {:.3} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        rig.close();
    }
}

/// Holes the guest only read are zero-mapped, and every barrier's scan
/// pays for each of their pages; past the zero budget a barrier turns the
/// ones nobody wrote back into holes. What was written into zero-mapped
/// holes is moved as before, a re-read of a returned hole faults in zeros
/// again, and a write there allocates.
#[test]
fn zero_mapped_holes_past_the_budget_return_to_holes() {
    if !uffd_or_skip("zero_mapped_holes_past_the_budget_return_to_holes") {
        return;
    }
    // PAGEMAP_SCAN, and the pagemap read fallback (which cannot tell the
    // zero page from a written page).
    for fallback in [false, true] {
        zero_budget_case(fallback);
    }
}

fn zero_budget_case(fallback: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("z.pcow");
    let clusters = 64u64;
    create(&path, clusters * K64, K64, None).close().unwrap();
    let gate = Arc::new(WriteGate::new());
    let opts = RegionOptions {
        zero_budget: Some(8 * K64),
        pagemap_read_fallback: fallback,
        ..one_cluster_per_fault()
    };
    let (region, monitor) = PcowRegion::open(&path, gate.clone(), &opts).unwrap();
    let rig = Rig {
        region,
        monitor: serve(monitor),
        gate,
    };
    let mut model = vec![0u8; (clusters * K64) as usize];
    // Read 6 clusters (within the budget): they stay zero-mapped.
    for vcn in 0..6 {
        assert_eq!(rig.read(vcn * K64 + 100, 8), vec![0; 8]);
    }
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.reholed, 0);
    assert_eq!(rig.region.status().unwrap().zero_mapped, 6);
    // Read all of them (past the budget), then write into 3.
    for vcn in 0..clusters {
        assert_eq!(rig.read(vcn * K64 + 4 * PAGE, 8), vec![0; 8]);
    }
    for vcn in [3u64, 17, 40] {
        w(&rig, &mut model, vcn * K64 + 2 * PAGE + 9, vcn, 100);
    }
    let st = rig.region.status().unwrap();
    assert_eq!((st.zero_mapped, st.faults.read_faults), (64, 64));
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.reholed, 61, "{s:?}");
    assert_eq!((s.private_pages, s.clusters_remapped), (3, 3));
    let st = rig.region.status().unwrap();
    assert_eq!((st.zero_mapped, st.shared, st.holes), (0, 3, 61));
    // A returned hole reads zeros through a new fault, and a write into
    // one allocates.
    assert_eq!(rig.read(5 * K64, 4096), vec![0; 4096]);
    w(&rig, &mut model, 50 * K64 + 7, 9, 30);
    let st = rig.region.status().unwrap();
    assert_eq!(st.faults.read_faults, 65);
    assert_eq!(st.faults.write_faults, 1);
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.reholed, 0, "one zero-mapped cluster is within the budget");
    assert_eq!(rig.read(0, model.len()), model);
    close_and_expect(rig, &path, &model, 4);
}

/// Zero-mapped holes are write-tracked through the monitor's userfaultfd:
/// the first barrier after the reads protects their zero pages, later
/// barriers see only what was written since, and a write into a protected
/// zero page is found and saved.
#[test]
fn writes_into_zero_pages_a_barrier_protected_are_found() {
    if !uffd_or_skip("writes_into_zero_pages_a_barrier_protected_are_found") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("zt.pcow");
    let clusters = 32u64;
    create(&path, clusters * K64, K64, None).close().unwrap();
    let gate = Arc::new(WriteGate::new());
    let (region, monitor) =
        PcowRegion::open(&path, gate.clone(), &RegionOptions::default()).unwrap();
    let rig = Rig {
        region,
        monitor: serve(monitor),
        gate,
    };
    if !rig.region.barrier().unwrap().tracked {
        eprintln!("SKIPPED writes_into_zero_pages_a_barrier_protected_are_found: no WP-async");
        return;
    }
    let base = rig.region.host_addr() as u64;
    let mut scanner = PageScanner::new(false).unwrap();
    // Private pages of clusters [a, b) not write-protected; the scan fails
    // on a range the monitor's userfaultfd does not track.
    let mut unprotected = |a: u64, b: u64| -> u64 {
        let mut out = Vec::new();
        scanner
            .written_since(base + a * K64, base + b * K64, None, &mut out)
            .expect("zero-mapped holes are registered for write tracking");
        out.iter().map(|(a, b)| (b - a) / PAGE).sum()
    };
    let mut model = vec![0u8; (clusters * K64) as usize];
    let entries = |a: u64, b: u64| {
        PageScanner::new(false)
            .unwrap()
            .unprotected_entries(base + a * K64, base + b * K64)
            .unwrap()
    };
    for vcn in 0..clusters {
        assert_eq!(rig.read(vcn * K64 + 300, 4), vec![0; 4]);
    }
    assert_eq!(rig.region.status().unwrap().zero_mapped, clusters);
    // The zero pages the reads mapped are unprotected until a barrier.
    assert_eq!(entries(0, clusters), clusters * K64 / PAGE);
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.reholed), (0, 0), "{s:?}");
    assert_eq!(entries(0, clusters), 0, "the barrier protects them");
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.private_pages, 0, "{s:?}");
    // Writes into protected zero pages: private pages, unprotected.
    for (vcn, page) in [(2u64, 0u64), (9, 7), (9, 8), (31, 15)] {
        w(
            &rig,
            &mut model,
            vcn * K64 + page * PAGE + 11,
            vcn + page,
            50,
        );
    }
    assert_eq!(unprotected(0, clusters), 4);
    assert_eq!(entries(0, clusters), 4);
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.clusters_remapped), (4, 3), "{s:?}");
    let st = rig.region.status().unwrap();
    assert_eq!((st.zero_mapped, st.shared), (clusters - 3, 3));
    assert_eq!((unprotected(10, 31), entries(10, 31)), (0, 0));
    // A whole page, then nothing: the next barrier finds only that page,
    // the one after nothing.
    w(&rig, &mut model, 20 * K64 + 5 * PAGE, 77, 4096);
    assert_eq!(unprotected(10, 31), 1);
    let s = rig.region.barrier().unwrap();
    assert_eq!((s.private_pages, s.clusters_remapped), (1, 1), "{s:?}");
    let s = rig.region.barrier().unwrap();
    assert_eq!(s.private_pages, 0, "{s:?}");
    assert_eq!(rig.read(0, model.len()), model);
    close_and_expect(rig, &path, &model, 4);
}
