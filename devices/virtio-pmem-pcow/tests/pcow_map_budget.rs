//! The device's mappings at run time stop `VMA_MARGIN` short of the
//! process's limit (`vm.max_map_count`, here a small one given through
//! `RegionOptions::max_map_count`), and the guest's writes past it lose
//! nothing. A test binary of its own: the count is the whole process's,
//! which other tests' regions would change under it.

mod common;

use common::*;

use virtio_pmem_pcow::{RegionOptions, VMA_MARGIN};

fn process_mappings() -> u64 {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count() as u64
}

#[test]
fn write_faults_past_the_mapping_budget_fall_back_and_lose_nothing() {
    if !uffd_or_skip("write_faults_past_the_mapping_budget_fall_back_and_lose_nothing") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("budget.pcow");
    let (cs, n, writes) = (PAGE, 402, 200u64);
    create(&path, n * cs, cs, None).close().unwrap();
    // Room for about 30 more mappings of two VMAs each.
    let limit = process_mappings() + VMA_MARGIN + 60;
    let rig = Rig::open(
        &path,
        &RegionOptions {
            max_map_count: Some(limit),
            ..one_cluster_per_fault()
        },
    )
    .unwrap();
    // Odd clusters in a scattered order: no two written clusters touch,
    // each mapped one would be a mapping of its own.
    let mut order: Vec<u64> = (0..writes).map(|i| 2 * i + 1).collect();
    let mut s = 0x2545_f491_4f6c_dd1du64;
    for i in (1..order.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        order.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let mut model = vec![0u8; (n * cs) as usize];
    for &c in &order {
        let data = pattern(c, 16);
        rig.write(c * cs + 9, &data);
        model[(c * cs + 9) as usize..][..16].copy_from_slice(&data);
    }
    let st = rig.region.status().unwrap();
    let f = st.faults;
    assert_eq!(f.write_faults + f.fallbacks, writes, "{f:?}");
    assert!(f.write_faults >= 5, "some clusters are mapped: {f:?}");
    assert!(f.fallbacks >= writes / 2, "the rest fall back: {f:?}");
    // The device counts the process when it builds the region; the
    // threads it starts after that (a stack and a guard page each) are
    // the margin's, like anything else the process maps later.
    let mappings = process_mappings();
    assert!(
        mappings <= limit - VMA_MARGIN + 16,
        "{mappings} mappings, limit {limit} less the margin {VMA_MARGIN}"
    );
    same(&rig.read(0, model.len()), &model, "region after the writes");

    // The barrier moves every write that fell back into the image; the
    // remaps it may make count against the same budget.
    let b = rig.region.barrier().unwrap();
    assert_eq!(b.clusters_copied, f.fallbacks, "{b:?}");
    assert_eq!(
        b.clusters_remapped + b.remap_failures,
        b.clusters_copied,
        "{b:?}"
    );
    same(&view_forced(&path), &model, "image after the barrier");
    // Written again, found again (the clusters left private are tracked).
    for &c in order.iter().take(50) {
        let data = pattern(c + 1000, 16);
        rig.write(c * cs + 9, &data);
        model[(c * cs + 9) as usize..][..16].copy_from_slice(&data);
    }
    rig.region.barrier().unwrap();
    same(
        &rig.read(0, model.len()),
        &model,
        "region after the second barrier",
    );
    // A snapshot demotes the shared clusters to private mappings over the
    // same runs: not refused at the budget, which is still used up.
    let snapped = model.clone();
    rig.region.snapshot_create("at-the-budget").unwrap();
    assert_eq!(rig.region.status().unwrap().shared, 0);
    for &c in order.iter().skip(50).take(50) {
        let data = pattern(c + 2000, 16);
        rig.write(c * cs + 9, &data);
        model[(c * cs + 9) as usize..][..16].copy_from_slice(&data);
    }
    rig.region.barrier().unwrap();
    same(
        &rig.read(0, model.len()),
        &model,
        "region after the snapshot",
    );
    rig.close();
    check_clean(&path);
    same(&reopen_read(&path), &model, "reopened");
    let mut img = pcow::Image::open(&path, pcow::OpenOptions::read_write()).unwrap();
    img.snapshot_apply("at-the-budget").unwrap();
    let mut v = vec![0u8; model.len()];
    img.read_at(&mut v, 0).unwrap();
    same(&v, &snapped, "the snapshot");
    img.close().unwrap();
}
