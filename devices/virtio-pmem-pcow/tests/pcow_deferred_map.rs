//! An image whose clusters lie scattered over its file needs a mapping per
//! cluster. Past half of the mappings the process has left under its limit
//! (`vm.max_map_count`, here a small one given through
//! `RegionOptions::max_map_count`) the open leaves the shortest runs
//! unmapped, and the first access to each maps it (or, with no mapping
//! left, copies its data in). The guest must see every byte it would have
//! seen, its writes must reach the image, and nothing may be lost across a
//! snapshot, a barrier or a reopen. A test binary of its own, its tests
//! one at a time ([`ONE_AT_A_TIME`]): the mapping budget is the whole
//! process's.

mod common;

use common::*;

use pcow::{Image, OpenOptions};
use virtio_pmem_pcow::{RegionOptions, READ_AHEAD_BYTES, VMA_MARGIN};

/// Held by each test: a region another test opens meanwhile would change
/// the process's mappings under the budget.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn process_mappings() -> u64 {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count() as u64
}

/// `0..n` in a scattered order (a fixed xorshift shuffle).
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..n).collect();
    let mut s = seed;
    for i in (1..order.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        order.swap(i, (s % (i as u64 + 1)) as usize);
    }
    order
}

/// Writes 24 bytes into each of clusters `vcns` of `img`, in that order,
/// and into `model`.
fn write_clusters(
    img: &mut Image,
    vcns: impl IntoIterator<Item = u64>,
    cs: u64,
    seed: u64,
    model: &mut [u8],
) {
    for vcn in vcns {
        let data = pattern(vcn + seed, 24);
        let at = vcn * cs + 100;
        img.write_at(&data, at).unwrap();
        model[at as usize..][..24].copy_from_slice(&data);
    }
}

/// Writes every even cluster of `img` in a scattered order (so no two
/// are neighbours in the file).
fn scatter(img: &mut Image, clusters: u64, cs: u64, seed: u64, model: &mut [u8]) {
    let evens = shuffled(clusters / 2, seed).into_iter().map(|c| 2 * c);
    write_clusters(img, evens, cs, seed, model);
}

/// Room for about 2 * `half` mappings past the margin.
fn tight(half: u64) -> RegionOptions {
    RegionOptions {
        max_map_count: Some(process_mappings() + VMA_MARGIN + 2 * half),
        ..RegionOptions::default()
    }
}

fn write_some(rig: &Rig, clusters: u64, cs: u64, seed: u64, model: &mut [u8]) {
    // Deferred clusters (even) and holes beside them (odd).
    for vcn in (0..clusters).step_by(7) {
        let data = pattern(vcn * 31 + seed, 40);
        let at = vcn * cs + 2000;
        rig.write(at, &data);
        model[at as usize..][..40].copy_from_slice(&data);
    }
}

#[test]
fn a_scattered_image_opens_with_its_short_runs_mapped_at_first_access() {
    if !uffd_or_skip("a_scattered_image_opens_with_its_short_runs_mapped_at_first_access") {
        return;
    }
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scattered.pcow");
    let (cs, n) = (PAGE, 1200u64);
    let mut model = vec![0u8; (n * cs) as usize];
    let mut img = create(&path, n * cs, cs, None);
    scatter(&mut img, n, cs, 7, &mut model);
    img.close().unwrap();

    let before = process_mappings();
    let rig = Rig::open(&path, &tight(100)).unwrap();
    let st = rig.region.status().unwrap();
    assert!(
        st.deferred_at_open >= n / 2 - 100,
        "most of the {} scattered clusters wait: {st:?}",
        n / 2
    );
    assert!(
        st.planned_vmas <= 100 + 2,
        "the open maps at most half its room: {st:?}"
    );
    assert!(process_mappings() <= before + 100 + 16);

    // Every byte as the image holds it: each deferred cluster's first
    // read maps it, or past the limit copies it in.
    same(
        &rig.read(0, model.len()),
        &model,
        "region read after the open",
    );
    let f = rig.region.status().unwrap().faults;
    assert_eq!(
        f.deferred_mapped + f.deferred_copied,
        st.deferred_at_open,
        "each deferred cluster resolved once: {f:?}"
    );
    assert!(f.deferred_mapped > 0, "some fit under the limit: {f:?}");
    assert!(f.deferred_copied > 0, "the rest are copied in: {f:?}");
    assert_eq!(
        f.read_faults,
        n / 2,
        "only the holes (odd clusters) read as zeros: {f:?}"
    );

    // Writes into mapped, copied and hole clusters reach the image.
    write_some(&rig, n, cs, 1, &mut model);
    rig.region.barrier().unwrap();
    same(&view_forced(&path), &model, "image after the barrier");

    // A snapshot keeps what it saw; writes after it copy.
    let snapped = model.clone();
    rig.region.snapshot_create("scattered").unwrap();
    write_some(&rig, n, cs, 2, &mut model);
    rig.region.barrier().unwrap();
    same(
        &rig.read(0, model.len()),
        &model,
        "region after the snapshot",
    );
    rig.close();
    check_clean(&path);
    same(&reopen_read(&path), &model, "reopened");

    // Reopened past the limit again, now with the snapshot below: the
    // deferred clusters come from both layers.
    let rig = Rig::open(&path, &tight(100)).unwrap();
    assert!(rig.region.status().unwrap().deferred_at_open > 0);
    same(&rig.read(0, model.len()), &model, "second open");
    write_some(&rig, n, cs, 3, &mut model);
    rig.region.barrier().unwrap();
    rig.close();
    check_clean(&path);
    same(&reopen_read(&path), &model, "reopened twice");
    let mut img = Image::open(&path, OpenOptions::read_write()).unwrap();
    img.snapshot_apply("scattered").unwrap();
    let mut v = vec![0u8; model.len()];
    img.read_at(&mut v, 0).unwrap();
    same(&v, &snapped, "the snapshot");
    img.close().unwrap();
}

#[test]
fn deferred_clusters_of_a_base_map_private_and_writes_copy() {
    if !uffd_or_skip("deferred_clusters_of_a_base_map_private_and_writes_copy") {
        return;
    }
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.pcow");
    let top = dir.path().join("top.pcow");
    let (cs, n) = (PAGE, 1000u64);
    let mut model = vec![0u8; (n * cs) as usize];
    let mut img = create(&base, n * cs, cs, None);
    scatter(&mut img, n, cs, 11, &mut model);
    img.close().unwrap();
    let base_view = model.clone();
    create(&top, n * cs, cs, Some("base.pcow")).close().unwrap();

    let rig = Rig::open(&top, &tight(80)).unwrap();
    let st = rig.region.status().unwrap();
    assert!(st.deferred_at_open > 0, "{st:?}");
    // Writes first: a write fault in a deferred cluster maps the base's
    // data private (or copies it), never a fresh cluster of zeros.
    write_some(&rig, n, cs, 5, &mut model);
    same(&rig.read(0, model.len()), &model, "region after the writes");
    let f = rig.region.status().unwrap().faults;
    assert!(f.deferred_mapped + f.deferred_copied > 0, "{f:?}");
    rig.region.barrier().unwrap();
    rig.close();
    check_clean(&top);
    same(&reopen_read(&top), &model, "the overlay reopened");
    same(&reopen_read(&base), &base_view, "the base is untouched");
}

#[test]
fn an_image_that_fits_is_mapped_whole_at_open() {
    if !uffd_or_skip("an_image_that_fits_is_mapped_whole_at_open") {
        return;
    }
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fits.pcow");
    let (cs, n) = (PAGE, 200u64);
    let mut model = vec![0u8; (n * cs) as usize];
    let mut img = create(&path, n * cs, cs, None);
    scatter(&mut img, n, cs, 3, &mut model);
    img.close().unwrap();
    let rig = Rig::open(&path, &tight(400)).unwrap();
    let st = rig.region.status().unwrap();
    assert_eq!(st.deferred_at_open, 0, "{st:?}");
    same(&rig.read(0, model.len()), &model, "region");
    let f = rig.region.status().unwrap().faults;
    assert_eq!(f.deferred_mapped + f.deferred_copied, 0, "{f:?}");
    rig.close();
    check_clean(&path);
}

#[test]
fn a_guest_reading_in_order_gets_deferred_clusters_resolved_ahead_of_its_faults() {
    if !uffd_or_skip("a_guest_reading_in_order_gets_deferred_clusters_resolved_ahead_of_its_faults")
    {
        return;
    }
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("every.pcow");
    let (cs, n) = (PAGE, 1500u64);
    // Every cluster holds data, written in a scattered order: few
    // neighbours are neighbours in the file, so the open defers nearly
    // all.
    let mut model = vec![0u8; (n * cs) as usize];
    let mut img = create(&path, n * cs, cs, None);
    write_clusters(&mut img, shuffled(n, 5), cs, 77, &mut model);
    img.close().unwrap();
    let ahead = READ_AHEAD_BYTES / cs;

    // In order: one fault per read-ahead window, not one per cluster.
    let rig = Rig::open(&path, &tight(100)).unwrap();
    let deferred = rig.region.status().unwrap().deferred_at_open;
    assert!(deferred >= n - 100, "nearly all deferred: {deferred}");
    // One cluster (a page) at a time: a single `memcpy` of the whole
    // region may touch it from the end (glibc picks a backward loop on
    // some machines, by the buffers' addresses), which is not in order.
    let in_order: Vec<u8> = (0..n)
        .flat_map(|vcn| rig.read(vcn * cs, cs as usize))
        .collect();
    same(&in_order, &model, "read in order");
    let f = rig.region.status().unwrap().faults;
    assert_eq!(
        f.deferred_mapped + f.deferred_copied,
        deferred,
        "each once: {f:?}"
    );
    assert!(f.deferred_copied > 0, "past the budget too: {f:?}");
    let faulted = deferred - f.deferred_ahead;
    assert!(
        faulted <= n / (ahead + 1) + 2 * (n - deferred) + 3,
        "{faulted} faults for {deferred} clusters with {ahead} read ahead: {f:?}"
    );
    // Written after, through clusters mapped and copied ahead.
    write_some(&rig, n, cs, 9, &mut model);
    rig.region.barrier().unwrap();
    rig.close();
    check_clean(&path);
    same(&reopen_read(&path), &model, "image after writes");

    // At random: every cluster still read as the image holds it, each
    // resolved once, whether by its own fault or by one before it.
    let rig = Rig::open(&path, &tight(100)).unwrap();
    let deferred = rig.region.status().unwrap().deferred_at_open;
    assert!(deferred >= n - 100, "nearly all deferred: {deferred}");
    for vcn in shuffled(n, 6) {
        let at = vcn * cs;
        same(
            &rig.read(at, cs as usize),
            &model[at as usize..][..cs as usize],
            &format!("cluster {vcn} read at random"),
        );
    }
    let f = rig.region.status().unwrap().faults;
    assert_eq!(
        f.deferred_mapped + f.deferred_copied,
        deferred,
        "each once: {f:?}"
    );
    assert!(
        f.deferred_ahead < n / 2,
        "a random reader gets little read ahead: {f:?}"
    );
    rig.close();
    check_clean(&path);
}
