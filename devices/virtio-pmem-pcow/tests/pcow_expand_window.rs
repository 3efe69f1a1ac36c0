//! Expansion windows (`RegionOptions::expand_window`): the second write
//! fault in an aligned window (or the first, right after a cluster the
//! guest wrote in the window before) maps every hole of the window, so a
//! guest filling new space takes one or two faults per window instead of
//! one per cluster; a window written once stays thin, and clusters that
//! may hold the guest's pages (zero-mapped, private) are never remapped.

mod common;

use common::*;
use virtio_pmem_pcow::{RegionOptions, DEFAULT_EXPAND_WINDOW};

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
    let rig = Rig::open(&path, &RegionOptions::default()).unwrap();
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
    let rig = Rig::open(&path, &RegionOptions::default()).unwrap();
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
