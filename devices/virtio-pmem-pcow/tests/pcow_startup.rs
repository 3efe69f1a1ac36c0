//! The region's open (issue 20, part 4): what it maps, and how.

mod common;

use common::*;

use virtio_pmem_pcow::RegionOptions;

/// The mappings of `[start, end)` in `/proc/self/smaps`: (shared, file
/// backed, random-read advice) of each.
fn smaps_in(start: u64, end: u64) -> Vec<(bool, bool, bool)> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut out = Vec::new();
    let mut current: Option<(bool, bool)> = None;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                let perms = fields.next().unwrap_or("");
                let inode = fields.nth(2).unwrap_or("0");
                current = (a < end && b > start).then(|| (perms.ends_with('s'), inode != "0"));
                continue;
            }
        }
        if first == "VmFlags:" {
            if let Some((shared, file)) = current.take() {
                out.push((shared, file, line.split_whitespace().any(|f| f == "rr")));
            }
        }
    }
    out
}

/// Every kind of run the planner makes, at 4 KiB clusters so that the
/// first layer holds enough entries for the pcow library's dense vcn
/// table: clusters written in reverse (a mapping each), holes, clusters
/// written in order (one mapping), a snapshot below rewritten clusters
/// (private runs beside shared ones). The region shows what the library
/// reads, mapped as planned, and only the writable layer's mappings carry
/// the no-read-around advice (given once for all of them at the open).
#[test]
fn the_open_maps_every_run_as_planned_and_advises_only_the_shared_ones() {
    if !uffd_or_skip("the_open_maps_every_run_as_planned_and_advises_only_the_shared_ones") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("runs.pcow");
    let cs = PAGE;
    let n = 4096;
    let mut img = create(&path, n * cs, cs, None);
    for c in (0..1500).rev() {
        img.write_at(&pattern(c, 64), c * cs + 8).unwrap();
    }
    for c in 2000..3500 {
        img.write_at(&pattern(c, 64), c * cs + 8).unwrap();
    }
    img.snapshot_create("below").unwrap();
    for c in (100..200).rev() {
        img.write_at(&pattern(c + n, 32), c * cs + 100).unwrap();
    }
    img.close().unwrap();

    let rig = Rig::open(&path, &RegionOptions::default()).unwrap();
    let st = rig.region.status().unwrap();
    let (base, end) = (rig.base() as u64, rig.base() as u64 + rig.region.len());
    let maps = smaps_in(base, end);
    assert_eq!(st.vmas, st.planned_vmas, "{st:?}");
    assert_eq!(maps.len() as u64, st.vmas, "{st:?}");
    let shared = maps.iter().filter(|m| m.0).count();
    let private = maps.iter().filter(|m| !m.0 && m.1).count();
    // 100 shared clusters in reverse order in the file (a mapping each),
    // private: 0..100 and 200..1500 reversed (a mapping each) and
    // 2000..3500 in order, a mapping per segment it spans (the meta
    // clusters sit between): the 1500 reversed ones left room for some in
    // the last segment they filled.
    let per_segment = u64::from(pcow::Geometry::from_cluster_size(cs).unwrap().capacity());
    let room = (per_segment - 1500 % per_segment) % per_segment;
    let in_order_runs = 1 + (1500 - room).div_ceil(per_segment);
    assert_eq!(shared, 100, "{maps:?}");
    assert_eq!(private as u64, 100 + 1300 + in_order_runs, "{maps:?}");
    assert_eq!(maps.len(), shared + private + 2, "{maps:?}");
    for (i, &(shared, file, random)) in maps.iter().enumerate() {
        assert_eq!(
            random, shared,
            "mapping {i} of the region (shared {shared}, file {file}): random-read advice {random}"
        );
    }
    let want = view_forced(&path);
    same(
        &rig.read(0, rig.region.len() as usize),
        &want,
        "the region against the library's view",
    );
    rig.close();
    same(&reopen_read(&path), &want, "reopened");
}
