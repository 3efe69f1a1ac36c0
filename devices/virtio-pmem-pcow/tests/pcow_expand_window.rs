//! Expansion windows (`RegionOptions::expand_window`): the second write
//! fault in an aligned window (or the first, right after a cluster the
//! guest wrote in the window before) maps every hole of the window, so a
//! guest filling new space takes one or two faults per window instead of
//! one per cluster; a window written once stays thin, and clusters that
//! may hold the guest's pages (zero-mapped, private) are never remapped.

mod common;

use common::*;
use std::sync::Arc;

use virtio_pmem_pcow::{PcowRegion, PoolOptions, RegionOptions, WriteGate, DEFAULT_EXPAND_WINDOW};

/// Clusters of 64 KiB in the default window.
const W: u64 = DEFAULT_EXPAND_WINDOW / K64;

#[test]
fn the_second_write_fault_in_a_window_maps_its_holes() {
    if !uffd_or_skip("the_second_write_fault_in_a_window_maps_its_holes") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.pcow");
    create(&path, 4 * W * K64, K64, None).close().unwrap();
    // An inline pool of 4 windows: each fill finds the whole window above
    // the low water mark (a worker's refill could still be in flight).
    let rig = inline_pool_rig(&path, 4 * W, None);
    let mut model = vec![0u8; (4 * W * K64) as usize];
    let mut write = |off: u64, data: &[u8]| {
        rig.write(off, data);
        model[off as usize..][..data.len()].copy_from_slice(data);
    };

    // The first write into a window maps its own cluster only.
    write(K64 + 100, b"first");
    let st = rig.region.status().unwrap();
    assert_eq!(
        (st.faults.write_faults, st.faults.clusters_ahead),
        (1, 0),
        "{st:?}"
    );
    assert_eq!(st.allocated_clusters, 1);
    let vmas_one = st.vmas;

    // The second maps the rest of the window, the holes before it too.
    write(5 * K64, b"second");
    let st = rig.region.status().unwrap();
    assert_eq!(
        (st.faults.write_faults, st.faults.clusters_ahead),
        (2, W - 2),
        "{st:?}"
    );
    assert_eq!((st.allocated_clusters, st.shared), (W, W));
    // The window's clusters are consecutive in the file: one mapping with
    // the first cluster's (the kernel merges them).
    assert!(
        st.vmas <= vmas_one + 1,
        "a filled window costs at most one more mapping: {vmas_one} -> {}",
        st.vmas
    );

    // Every other cluster of the window is written without a fault.
    for c in 0..W {
        write(c * K64 + 3 * PAGE + c, &pattern(c, 64));
    }
    let st = rig.region.status().unwrap();
    assert_eq!(st.faults.write_faults, 2, "{st:?}");
    // The next window is untouched; a single write into the third stays
    // a single cluster.
    write(2 * W * K64 + 7 * K64, b"alone");
    let st = rig.region.status().unwrap();
    assert_eq!(
        (st.faults.write_faults, st.allocated_clusters, st.holes),
        (3, W + 1, 3 * W - 1),
        "{st:?}"
    );
    // A writer going on from the end of the full first window into the
    // second fills the second with its first fault there.
    write(W * K64 + 1, b"onwards");
    let st = rig.region.status().unwrap();
    assert_eq!(
        (st.faults.write_faults, st.faults.clusters_ahead),
        (4, 2 * W - 3),
        "{st:?}"
    );
    assert_eq!(st.allocated_clusters, 2 * W + 1);
    // Not so into the fourth: the third's last cluster is a hole.
    write(3 * W * K64, b"gap");
    let st = rig.region.status().unwrap();
    assert_eq!(
        (st.faults.write_faults, st.allocated_clusters),
        (5, 2 * W + 2),
        "{st:?}"
    );

    rig.region.barrier().unwrap();
    rig.close();
    check_clean(&path);
    same(&reopen_read(&path), &model, "reopened");
    let img = pcow::Image::open(&path, pcow::OpenOptions::read_only()).unwrap();
    assert_eq!(img.allocated_clusters(), 2 * W + 2);
}

#[test]
fn a_window_never_remaps_zero_mapped_or_private_clusters() {
    if !uffd_or_skip("a_window_never_remaps_zero_mapped_or_private_clusters") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 2 * W * K64;
    let base = dir.path().join("base.pcow");
    let mut b = create(&base, size, K64, None);
    b.write_at(&pattern(9, K64 as usize), 3 * K64).unwrap();
    b.close().unwrap();
    let path = dir.path().join("top.pcow");
    create(&path, size, K64, Some("base.pcow")).close().unwrap();
    // An inline pool of 4 windows: each fill finds the whole window above
    // the low water mark (a worker's refill could still be in flight).
    let rig = inline_pool_rig(&path, 4 * W, None);
    let mut model = vec![0u8; size as usize];
    model[(3 * K64) as usize..][..K64 as usize].copy_from_slice(&pattern(9, K64 as usize));

    // Cluster 4 zero-mapped by a read, then written: a private page.
    assert_eq!(rig.read(4 * K64, 8), vec![0u8; 8]);
    rig.write(4 * K64 + PAGE, b"private");
    model[(4 * K64 + PAGE) as usize..][..7].copy_from_slice(b"private");
    // Cluster 3 (the base's) written: a private copy.
    rig.write(3 * K64 + 10, b"cow");
    model[(3 * K64 + 10) as usize..][..3].copy_from_slice(b"cow");
    // Two write faults in holes: the second fills the window around 3, 4.
    rig.write(0, b"a");
    rig.write(9 * K64, b"b");
    model[0] = b'a';
    model[(9 * K64) as usize] = b'b';
    let st = rig.region.status().unwrap();
    assert_eq!(
        (st.faults.write_faults, st.faults.clusters_ahead),
        (2, W - 4),
        "{st:?}"
    );
    assert_eq!(st.zero_mapped, 1, "{st:?}");
    same(&rig.read(0, size as usize), &model, "live view");

    rig.region.barrier().unwrap();
    rig.close();
    check_clean(&path);
    same(&reopen_read(&path), &model, "reopened");
}

#[test]
fn racing_writers_fill_a_window_once() {
    if !uffd_or_skip("racing_writers_fill_a_window_once") {
        return;
    }
    const THREADS: u64 = 4;
    let clusters = 3 * W;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.pcow");
    create(&path, clusters * K64, K64, None).close().unwrap();
    let rig = Rig::open(&path, &RegionOptions::default()).unwrap();
    race_writers(rig.base(), rig.region.len(), THREADS, clusters, 5, 11);
    let st = rig.region.status().unwrap();
    // Each cluster was allocated once: by its own fault or ahead.
    assert_eq!(
        st.faults.write_faults + st.faults.clusters_ahead,
        clusters,
        "{st:?}"
    );
    assert!(
        st.faults.write_faults < clusters,
        "no window filled: {st:?}"
    );
    assert_eq!((st.allocated_clusters, st.shared), (clusters, clusters));
    rig.region.barrier().unwrap();
    rig.close();
    check_clean(&path);
    check_raced(&reopen_read(&path), THREADS, clusters);
}

#[test]
fn a_window_of_one_cluster_maps_each_hole_on_its_own_fault() {
    if !uffd_or_skip("a_window_of_one_cluster_maps_each_hole_on_its_own_fault") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.pcow");
    create(&path, W * K64, K64, None).close().unwrap();
    for window in [0, K64, K64 + 1] {
        let opts = RegionOptions {
            expand_window: Some(window),
            ..RegionOptions::default()
        };
        let rig = Rig::open(&path, &opts).unwrap();
        for c in 0..8 {
            rig.write(c * K64, &[1]);
        }
        let st = rig.region.status().unwrap();
        assert_eq!(
            (st.faults.write_faults, st.faults.clusters_ahead),
            (8, 0),
            "window {window}"
        );
        rig.close();
        std::fs::remove_file(&path).unwrap();
        create(&path, W * K64, K64, None).close().unwrap();
    }
}

#[test]
fn a_window_takes_only_what_the_pool_holds() {
    if !uffd_or_skip("a_window_takes_only_what_the_pool_holds") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.pcow");
    create(&path, 2 * W * K64, K64, None).close().unwrap();
    let opts = RegionOptions {
        pool_clusters: Some(8),
        ..RegionOptions::default()
    };
    let rig = Rig::open(&path, &opts).unwrap();
    // The worker fills the pool after the open; a first fault before that
    // finds it dry and deepens it (seen under load: 16 clusters, 11 taken
    // ahead), which is another test's matter.
    assert_eq!(wait_pool_full(&rig.region).pool.pool_clusters, 8);
    rig.write(0, b"a");
    rig.write(K64, b"b");
    let st = rig.region.status().unwrap();
    assert_eq!(st.faults.write_faults, 2, "{st:?}");
    assert!(
        (1..8).contains(&st.faults.clusters_ahead),
        "at most the pool's 8 clusters, less one kept: {st:?}"
    );
    assert_eq!(st.pool.inline_allocations, 0, "{:?}", st.pool);
    rig.close();
    check_clean(&path);
}

/// A region over the image at `path` whose pool has no worker: faults
/// refill it inline, so what each fault takes from it is exact. Its low
/// water mark is `low_water`, or a quarter of the pool.
fn inline_pool_rig(path: &std::path::Path, pool_clusters: u64, low_water: Option<u64>) -> Rig {
    let gate = Arc::new(WriteGate::new());
    let opts = RegionOptions {
        pool_clusters: Some(pool_clusters),
        ..RegionOptions::default()
    };
    let (region, monitor) = PcowRegion::open_with(
        path,
        gate.clone(),
        &opts,
        &PoolOptions {
            low_water,
            ..PoolOptions::inline()
        },
    )
    .unwrap();
    Rig {
        region,
        monitor: serve(monitor),
        gate,
    }
}

#[test]
fn a_window_leaves_the_pool_its_low_water_mark() {
    if !uffd_or_skip("a_window_leaves_the_pool_its_low_water_mark") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.pcow");
    create(&path, 8 * W * K64, K64, None).close().unwrap();
    // A pool of 16 clusters: its low water mark is 4.
    let rig = inline_pool_rig(&path, 16, None);
    rig.write(0, b"a"); // refills the pool inline
    let grew = rig.region.status().unwrap().pool.inline_allocations;
    assert_eq!(grew, 1);
    rig.write(K64, b"b"); // fills the window from the pool
    let st = rig.region.status().unwrap();
    assert!(
        (1..W - 2).contains(&st.faults.clusters_ahead),
        "a short pool cuts the window: {st:?}"
    );
    assert!(st.pool.free_clusters >= 4, "{:?}", st.pool);
    // The faults after the fill still find clusters in the pool.
    for w in 2..6 {
        rig.write(w * W * K64, b"c");
    }
    let st = rig.region.status().unwrap();
    assert_eq!(st.faults.write_faults, 6, "{st:?}");
    assert_eq!(st.pool.inline_allocations, grew, "{:?}", st.pool);
    rig.close();
    check_clean(&path);
}

#[test]
fn a_window_of_small_clusters_counts_its_metadata_segments() {
    if !uffd_or_skip("a_window_of_small_clusters_counts_its_metadata_segments") {
        return;
    }
    // 4 KiB clusters: a window is 512 clusters, and a metadata segment
    // holds about 126, so a fill starts several segments.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.pcow");
    let clusters = 4 * DEFAULT_EXPAND_WINDOW / PAGE;
    create(&path, clusters * PAGE, PAGE, None).close().unwrap();
    // A pool of 300 clusters for a window of 512, with a low water mark of
    // one cluster: the fill takes nearly all the pool, so the metadata
    // clusters it needs must be counted.
    let rig = inline_pool_rig(&path, 300, Some(1));
    rig.write(0, b"a");
    let len = std::fs::metadata(&path).unwrap().len();
    let grew = rig.region.status().unwrap().pool.inline_allocations;
    rig.write(PAGE, b"b");
    let st = rig.region.status().unwrap();
    assert!(st.faults.clusters_ahead > 126, "{st:?}");
    assert_eq!(st.pool.inline_allocations, grew, "{:?}", st.pool);
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        len,
        "the fill grew the file"
    );
    rig.close();
    check_clean(&path);
}
