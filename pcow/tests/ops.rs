//! Whole-image operations on real files: overlay + commit, safe and unsafe
//! rebase, compact with snapshots and dead layers, resize.

use std::path::Path;

use pcow::{BaseFormat, BaseRef, CreateOptions, Image, LiveImage, OpenOptions};

const MIB: u64 = 1 << 20;

fn create(path: &Path, size: u64, cluster: u64, base: Option<&str>) -> Image {
    let opts = CreateOptions {
        cluster_size: Some(cluster),
        virtual_size: Some(size),
        base: base.map(|b| BaseRef {
            name: b.into(),
            format: BaseFormat::Probe,
        }),
    };
    Image::create(path, &opts).unwrap()
}

fn read_all(path: &Path) -> Vec<u8> {
    let img = Image::open(path, OpenOptions::read_only()).unwrap();
    let mut buf = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut buf, 0).unwrap();
    buf
}

fn clean(path: &Path) {
    let r = pcow::check::check(path, None, false).unwrap();
    assert!(r.is_clean(), "{r:?}");
}

#[test]
fn commit_copies_overlay_data_into_base_and_empties_overlay() {
    let d = tempfile::tempdir().unwrap();
    let (base, top) = (d.path().join("base.pcow"), d.path().join("top.pcow"));
    let mut b = create(&base, 4 * MIB, 64 << 10, None);
    b.write_at(&[1u8; 100_000], 10_000).unwrap();
    b.close().unwrap();
    let mut t = create(&top, 4 * MIB, 4096, Some("base.pcow"));
    t.write_at(&[2u8; 5000], 50_000).unwrap();
    t.write_at(&[3u8; 10], 3 * MIB).unwrap();
    t.close().unwrap();
    let expected = read_all(&top);
    let r = pcow::ops::commit(&top, false).unwrap();
    assert!(r.emptied);
    assert_eq!(read_all(&base), expected);
    assert_eq!(read_all(&top), expected);
    assert_eq!(
        Image::open(&top, OpenOptions::read_only())
            .unwrap()
            .allocated_clusters(),
        0
    );
    clean(&base);
    clean(&top);
}

#[test]
fn commit_into_raw_base_and_keep_overlay() {
    let d = tempfile::tempdir().unwrap();
    let (base, top) = (d.path().join("base.raw"), d.path().join("top.pcow"));
    std::fs::write(&base, vec![7u8; MIB as usize]).unwrap();
    let mut t = create(&top, 2 * MIB, 64 << 10, Some("base.raw"));
    t.write_at(&[9u8; 4096], MIB - 2048).unwrap();
    t.close().unwrap();
    let expected = read_all(&top);
    let r = pcow::ops::commit(&top, true).unwrap();
    assert!(!r.emptied);
    assert_eq!(std::fs::read(&base).unwrap(), expected);
    assert_eq!(read_all(&top), expected);
}

#[test]
fn safe_rebase_keeps_every_view_and_flatten_drops_the_base() {
    let d = tempfile::tempdir().unwrap();
    let (a, b, top) = (
        d.path().join("a.pcow"),
        d.path().join("b.pcow"),
        d.path().join("top.pcow"),
    );
    let mut ia = create(&a, 2 * MIB, 4096, None);
    ia.write_at(&[0xaa; 300_000], 0).unwrap();
    ia.close().unwrap();
    let mut ib = create(&b, 2 * MIB, 4096, None);
    ib.write_at(&[0xbb; 100_000], 200_000).unwrap();
    ib.close().unwrap();
    let mut t = create(&top, 2 * MIB, 16384, Some("a.pcow"));
    t.write_at(&[1; 5000], 1000).unwrap();
    t.snapshot_create("s1").unwrap();
    t.write_at(&[2; 5000], 290_000).unwrap();
    t.close().unwrap();
    let active = read_all(&top);
    let snap_view = {
        let mut t = Image::open(&top, OpenOptions::read_write()).unwrap();
        t.snapshot_create("now").unwrap();
        t.snapshot_apply("s1").unwrap();
        let mut buf = vec![0u8; 2 * MIB as usize];
        t.read_at(&mut buf, 0).unwrap();
        t.snapshot_apply("now").unwrap();
        buf
    };
    pcow::ops::rebase(
        &top,
        Some(BaseRef {
            name: "b.pcow".into(),
            format: BaseFormat::Pcow,
        }),
        false,
    )
    .unwrap();
    assert_eq!(read_all(&top), active);
    let mut t = Image::open(&top, OpenOptions::read_write()).unwrap();
    assert_eq!(t.base_ref().unwrap().name, "b.pcow");
    t.snapshot_apply("s1").unwrap();
    let mut buf = vec![0u8; 2 * MIB as usize];
    t.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, snap_view);
    t.snapshot_apply("now").unwrap();
    t.close().unwrap();
    pcow::ops::rebase(&top, None, false).unwrap();
    assert_eq!(read_all(&top), active);
    assert!(Image::open(&top, OpenOptions::read_only())
        .unwrap()
        .base_ref()
        .is_none());
    clean(&top);
}

#[test]
fn unsafe_rebase_only_renames() {
    let d = tempfile::tempdir().unwrap();
    let (a, top) = (d.path().join("a.raw"), d.path().join("top.pcow"));
    std::fs::write(&a, vec![5u8; MIB as usize]).unwrap();
    create(&top, MIB, 65536, Some("a.raw")).close().unwrap();
    std::fs::rename(&a, d.path().join("moved.raw")).unwrap();
    assert!(matches!(
        Image::open(&top, OpenOptions::read_only()),
        Err(pcow::Error::BaseMissing { .. })
    ));
    pcow::ops::rebase(
        &top,
        Some(BaseRef {
            name: "moved.raw".into(),
            format: BaseFormat::Raw,
        }),
        true,
    )
    .unwrap();
    assert_eq!(read_all(&top), vec![5u8; MIB as usize]);
}

#[test]
fn compact_keeps_views_and_drops_dead_layers() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("c.pcow");
    let mut img = create(&p, 2 * MIB, 4096, None);
    img.write_at(&[1; 200_000], 0).unwrap();
    img.snapshot_create("one").unwrap();
    img.write_at(&[2; 100_000], 50_000).unwrap();
    img.snapshot_create("two").unwrap();
    img.write_at(&[3; 100_000], 150_000).unwrap();
    // Rollback makes the data written since "two" dead.
    img.snapshot_apply("one").unwrap();
    img.write_at(&[4; 10_000], 1_000_000).unwrap();
    img.snapshot_delete("one").unwrap();
    let mut views = Vec::new();
    let mut buf = vec![0u8; 2 * MIB as usize];
    img.read_at(&mut buf, 0).unwrap();
    views.push(buf.clone());
    img.snapshot_create("tmp").unwrap();
    img.snapshot_apply("two").unwrap();
    img.read_at(&mut buf, 0).unwrap();
    views.push(buf.clone());
    img.snapshot_apply("tmp").unwrap();
    img.snapshot_delete("tmp").unwrap();
    img.close().unwrap();
    let before = std::fs::metadata(&p).unwrap().len();
    let r = pcow::ops::compact(&p).unwrap();
    assert!(r.new_size < before, "{r:?}");
    assert_eq!(read_all(&p), views[0]);
    clean(&p);
    let mut img = Image::open(&p, OpenOptions::read_write()).unwrap();
    let tags: Vec<_> = img.snapshots().into_iter().map(|s| s.tag).collect();
    assert_eq!(tags, ["two"]);
    img.snapshot_apply("two").unwrap();
    img.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, views[1]);
    img.close().unwrap();
    // Compacting again is stable.
    let r2 = pcow::ops::compact(&p).unwrap();
    assert!(r2.new_size <= r.new_size + 8192, "{r2:?}");
    clean(&p);
}

#[test]
fn resize_grows_and_refuses_to_shrink() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("r.pcow");
    let mut img = create(&p, MIB, 65536, None);
    img.write_at(b"end", MIB - 3).unwrap();
    img.close().unwrap();
    pcow::ops::resize(&p, 3 * MIB).unwrap();
    let all = read_all(&p);
    assert_eq!(all.len() as u64, 3 * MIB);
    assert_eq!(&all[MIB as usize - 3..MIB as usize], b"end");
    assert!(pcow::ops::resize(&p, MIB).is_err());
    assert!(pcow::ops::resize(&p, 3 * MIB + 1).is_err());
}

#[test]
fn device_api_allocates_records_pages_and_survives_reopen() {
    use std::os::unix::fs::FileExt;
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("dev.pcow");
    let mut img = create(&p, MIB, 65536, None);
    img.write_at(&[1u8; 65536], 0).unwrap();
    img.snapshot_create("s").unwrap();
    let mut img = LiveImage::new(img).unwrap();
    img.set_pool_clusters(8);
    // A hole: the fresh cluster is the whole truth.
    let hole = img.active_cluster(5).unwrap();
    assert!(hole.fresh && hole.whole);
    assert_eq!(
        img.active_cluster(5).unwrap(),
        pcow::ActiveCluster {
            fresh: false,
            ..hole
        }
    );
    img.file()
        .unwrap()
        .write_all_at(&[9u8; 10], hole.file_offset + 100)
        .unwrap();
    // Over snapshot data: only recorded pages belong to the new layer.
    let cow = img.active_cluster(0).unwrap();
    assert!(cow.fresh && !cow.whole);
    img.file()
        .unwrap()
        .write_all_at(&[2u8; 4096], cow.file_offset + 4096)
        .unwrap();
    img.record_pages(0, 1, 1).unwrap();
    img.mark_data_written();
    assert!(img.record_pages(0, 16, 1).is_err());
    assert!(img.record_pages(3, 0, 1).is_err());
    assert!(img.active_cluster(16).is_err());
    img.flush().unwrap();
    drop(img);
    let all = read_all(&p);
    assert_eq!(&all[..4096], &[1u8; 4096][..]);
    assert_eq!(&all[4096..8192], &[2u8; 4096][..]);
    assert_eq!(&all[8192..65536], &[1u8; 65536 - 8192][..]);
    assert_eq!(&all[5 * 65536 + 100..5 * 65536 + 110], &[9u8; 10][..]);
    clean(&p);
}

#[test]
fn cluster_sources_for_a_device_and_completing_active_clusters() {
    use pcow::{ClusterSource, PageLocation};
    let d = tempfile::tempdir().unwrap();
    let (base, p) = (d.path().join("base.raw"), d.path().join("top.pcow"));
    // A raw base of 2.5 clusters: the third cluster's tail is past its end.
    std::fs::write(&base, vec![3u8; 65536 * 2 + 6000]).unwrap();
    let live = LiveImage::new(create(&p, MIB, 65536, Some("base.raw"))).unwrap();
    assert_eq!(live.chain_files().len(), 2);
    let mut img = live.into_image();
    img.write_at(&[1; 65536], 3 * 65536).unwrap(); // hole below: whole
    img.write_at(&[2; 100], 10).unwrap(); // over the base: page 0 only
    assert_eq!(
        img.cluster_source(3),
        ClusterSource::Active { offset: 2 * 65536 }
    );
    assert_eq!(
        img.cluster_source(1),
        ClusterSource::ReadOnly {
            depth: 1,
            offset: 65536
        }
    );
    assert_eq!(img.cluster_source(9), ClusterSource::Hole);
    let ClusterSource::Mixed(pages) = img.cluster_source(0) else {
        panic!("partial active cluster is mixed");
    };
    assert!(matches!(pages[0], PageLocation::File { depth: 0, .. }));
    assert_eq!(
        pages[1],
        PageLocation::File {
            depth: 1,
            offset: 4096
        }
    );
    let ClusterSource::Mixed(pages) = img.cluster_source(2) else {
        panic!("short raw base is mixed");
    };
    assert_eq!(
        pages[0],
        PageLocation::File {
            depth: 1,
            offset: 2 * 65536
        }
    );
    // The base ends 6000 bytes into the cluster: page 1 is partly covered
    // (a mapping zero-fills its tail), page 2 lies wholly past the end.
    assert_eq!(
        pages[1],
        PageLocation::File {
            depth: 1,
            offset: 2 * 65536 + 4096
        }
    );
    assert_eq!(pages[2], PageLocation::Zero);
    // The batched walk a device's open makes says the same, cluster by
    // cluster, in order.
    let every = |img: &pcow::Image| {
        let mut got = Vec::new();
        img.cluster_sources(0..16, |vcn, s| got.push((vcn, s)));
        let one_by_one: Vec<_> = (0..16).map(|v| (v, img.cluster_source(v))).collect();
        assert_eq!(got, one_by_one);
    };
    every(&img);
    // After a snapshot the whole cluster 3 is read-only history.
    img.snapshot_create("s").unwrap();
    every(&img);
    assert_eq!(
        img.cluster_source(3),
        ClusterSource::ReadOnly {
            depth: 0,
            offset: 2 * 65536
        }
    );
    img.snapshot_apply("s").unwrap();
    let before = {
        let mut b = vec![0u8; MIB as usize];
        img.read_at(&mut b, 0).unwrap();
        b
    };
    img.write_at(&[4; 10], 65536 + 5).unwrap();
    let mut img = LiveImage::new(img).unwrap();
    assert_eq!(img.complete_active_clusters().unwrap(), 1);
    assert!(matches!(
        img.cluster_source(1),
        ClusterSource::Active { .. }
    ));
    img.close().unwrap();
    let mut after = read_all(&p);
    after[65536 + 5..65536 + 15].copy_from_slice(&before[65536 + 5..65536 + 15]);
    assert_eq!(after, before);
    clean(&p);
}

#[test]
fn pool_fill_active_offset_and_chain_paths() {
    let d = tempfile::tempdir().unwrap();
    let (base, p) = (d.path().join("b.raw"), d.path().join("t.pcow"));
    std::fs::write(&base, [1u8; 4096]).unwrap();
    let img = create(&p, MIB, 65536, Some("b.raw"));
    assert_eq!(img.chain_paths(), [p.clone(), base.clone()]);
    let mut img = LiveImage::new(img).unwrap();
    img.set_pool_clusters(8);
    assert_eq!(img.fill_pool().unwrap(), 8);
    assert_eq!(img.fill_pool().unwrap(), 0, "already full");
    let len = std::fs::metadata(&p).unwrap().len();
    assert_eq!(img.active_offset(2), None);
    let c = img.active_cluster(2).unwrap();
    assert_eq!(img.active_offset(2), Some(c.file_offset));
    assert_eq!(
        std::fs::metadata(&p).unwrap().len(),
        len,
        "allocated from the pool"
    );
    img.close().unwrap();
    clean(&p);
}

#[test]
fn pool_worker_protocol() {
    use std::os::unix::io::AsRawFd;
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("w.pcow");
    let mut img = LiveImage::new(create(&p, MIB, 65536, None)).unwrap();
    img.set_pool_clusters(4);
    let (off, len) = img.pool_shortfall().unwrap();
    assert_eq!((off, len), (65536, 4 * 65536));
    // The worker reserves on its own handle of the file.
    let f = img.file().unwrap().try_clone().unwrap();
    // SAFETY: fallocate reads only its integer arguments; `f` is open.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, off as i64, len as i64) };
    assert_eq!(r, 0);
    assert!(
        !img.pool_reserved(off + 65536, len),
        "a range that does not continue the file"
    );
    assert!(img.pool_reserved(off, len));
    assert_eq!(img.pool_shortfall(), None);
    // Header, one meta cluster and three data clusters: the file as reserved.
    for v in 0..3 {
        img.active_cluster(v).unwrap();
    }
    assert_eq!(
        std::fs::metadata(&p).unwrap().len(),
        5 * 65536,
        "served from the reserved pool"
    );
    assert!(img.pool_shortfall().is_some());
    img.close().unwrap();
    // The worker's handle shares the open file description, and with it
    // the writer's lock: it must go before anyone else can open the image.
    drop(f);
    clean(&p);
}

#[test]
fn written_clusters_grow_the_file_sparsely_once_the_pool_is_empty() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let d = tempfile::tempdir().unwrap();
    let (base, p) = (d.path().join("b.raw"), d.path().join("t.pcow"));
    let cs = 65536u64;
    std::fs::write(&base, vec![1u8; MIB as usize]).unwrap();
    let mut img = LiveImage::new(create(&p, MIB, cs, Some("b.raw"))).unwrap();
    img.set_pool_clusters(2);
    // Header + the first segment's metadata cluster + the pool.
    assert_eq!(img.fill_pool().unwrap(), 2);
    let reserved_len = std::fs::metadata(&p).unwrap().len();
    let f = img.file().unwrap().try_clone().unwrap();
    // A refill a worker was asked for before the clusters below were taken.
    let c0 = img.active_cluster_written(0).unwrap();
    f.write_all_at(&[9; 4096], c0.file_offset).unwrap();
    img.record_pages(0, 0, 1).unwrap();
    let stale = img.pool_shortfall().unwrap();
    let mut offsets = vec![];
    for v in 1..6 {
        let c = img.active_cluster_written(v).unwrap();
        assert!(c.fresh && !c.whole, "partial over the base: {c:?}");
        offsets.push(c.file_offset);
        // The device copies one page in, then records it.
        f.write_all_at(&[v as u8 + 10; 4096], c.file_offset + 4096)
            .unwrap();
        img.record_pages(v, 1, 1).unwrap();
    }
    let len = std::fs::metadata(&p).unwrap().len();
    assert_eq!(
        len,
        offsets.last().unwrap() + cs,
        "the file ends with the last cluster: no pool grown ahead"
    );
    assert!(len > reserved_len);
    let blocks = std::fs::metadata(&p).unwrap().blocks() * 512;
    assert!(
        blocks < reserved_len + 4 * 2 * 4096 + 4 * cs,
        "clusters past the pool are sparse: {blocks} bytes allocated of {len}"
    );
    assert!(
        !img.pool_reserved(stale.0, stale.1),
        "a refill asked for before the file grew is stale"
    );
    assert_eq!(img.pool_shortfall(), Some((len, 2 * cs)));
    // A cluster to be mapped is reserved, with the pool ahead of it.
    let c = img.active_cluster(6).unwrap();
    assert_eq!(c.file_offset, len);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), len + 3 * cs);
    f.write_all_at(&[9; 4096], c.file_offset).unwrap();
    img.record_pages(6, 0, 1).unwrap();
    img.flush().unwrap();
    img.close().unwrap();
    drop(f);
    clean(&p);
    let got = read_all(&p);
    assert!(got[..4096].iter().all(|&b| b == 9));
    for v in 1..6u64 {
        let at = (v * cs) as usize;
        assert!(
            got[at..at + 4096].iter().all(|&b| b == 1),
            "page 0 from the base"
        );
        assert!(got[at + 4096..at + 8192].iter().all(|&b| b == v as u8 + 10));
        assert!(got[at + 8192..at + cs as usize].iter().all(|&b| b == 1));
    }
}

/// A worker's refill that went stale (the file grew meanwhile) still
/// extended the file on its own handle; closing must drop it like the
/// pool, or the closed image ends in leaked clusters.
#[test]
fn closing_drops_a_stale_refill_past_the_file() {
    use std::os::unix::io::AsRawFd;
    let d = tempfile::tempdir().unwrap();
    let (base, p) = (d.path().join("b.raw"), d.path().join("t.pcow"));
    let cs = 65536u64;
    std::fs::write(&base, vec![1u8; MIB as usize]).unwrap();
    let mut img = LiveImage::new(create(&p, MIB, cs, Some("b.raw"))).unwrap();
    img.set_pool_clusters(4);
    let stale = img.pool_shortfall().unwrap();
    // The barrier takes clusters first and grows the file page by page.
    for v in 0..2 {
        img.active_cluster_written(v).unwrap();
        img.record_pages(v, 0, 1).unwrap();
    }
    // Then the worker's fallocate of the range it was asked for lands.
    let f = img.file().unwrap().try_clone().unwrap();
    // SAFETY: fallocate reads only its integer arguments; `f` is open.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, stale.0 as i64, stale.1 as i64) };
    assert_eq!(r, 0);
    assert!(!img.pool_reserved(stale.0, stale.1), "stale");
    assert!(std::fs::metadata(&p).unwrap().len() > stale.0 + 2 * cs);
    img.close().unwrap();
    drop(f);
    clean(&p);
}

#[test]
fn inline_growth_caps_what_an_empty_pool_reserves() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("g.pcow");
    let cs = 65536u64;
    let mut img = LiveImage::new(create(&p, MIB, cs, None)).unwrap();
    img.set_pool_clusters(12);
    img.set_inline_growth(2);
    // Header, then the first allocation: a segment's metadata cluster and
    // the data cluster, and 2 clusters ahead instead of the pool's 12.
    let c = img.active_cluster(0).unwrap();
    assert_eq!(c.file_offset, 2 * cs);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 5 * cs);
    assert_eq!(
        img.pool_shortfall(),
        Some((5 * cs, 10 * cs)),
        "the rest is a worker's"
    );
    img.set_inline_growth(100);
    for v in 1..4 {
        img.active_cluster(v).unwrap();
    }
    assert_eq!(
        std::fs::metadata(&p).unwrap().len(),
        (6 + 12) * cs,
        "never more than the pool"
    );
    img.close().unwrap();
    clean(&p);
}

/// Blocks the file at `path` takes on disk, in bytes.
fn on_disk(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn preallocation_allocates_every_cluster_that_reads_as_zeros() {
    use pcow::Preallocation;
    let d = tempfile::tempdir().unwrap();
    let cs = 64u64 << 10;
    for mode in [Preallocation::Falloc, Preallocation::Full] {
        let path = d.path().join(format!("{mode:?}.pcow"));
        let mut img = create(&path, MIB, cs, None);
        img.write_at(&[7u8; 5000], 70_000).unwrap();
        let before = img.allocated_clusters();
        assert_eq!(before, 1);
        assert_eq!(img.preallocate(mode).unwrap(), 15, "{mode:?}");
        assert_eq!(img.allocated_clusters(), 16);
        // Again: nothing left to allocate.
        assert_eq!(img.preallocate(mode).unwrap(), 0);
        img.close().unwrap();
        clean(&path);
        let mut want = vec![0u8; MIB as usize];
        want[70_000..75_000].fill(7);
        assert_eq!(read_all(&path), want, "{mode:?}");
        assert!(
            on_disk(&path) >= 16 * cs,
            "{mode:?}: {} bytes on disk",
            on_disk(&path)
        );
        let img = Image::open(&path, OpenOptions::read_only()).unwrap();
        assert!((0..16).all(|v| img.active_offset(v).is_some()), "{mode:?}");
    }
    // Over a base: the clusters the base has data in are left to
    // copy-on-write; the base's view is unchanged.
    let base = d.path().join("base.pcow");
    let mut b = create(&base, MIB, cs, None);
    b.write_at(&[1u8; 200_000], 0).unwrap(); // clusters 0..=3
    b.close().unwrap();
    let top = d.path().join("top.pcow");
    let mut t = create(&top, MIB, cs, Some("base.pcow"));
    assert_eq!(t.preallocate(Preallocation::Falloc).unwrap(), 12);
    t.close().unwrap();
    clean(&top);
    assert_eq!(read_all(&top), read_all(&base));
    // Off does nothing; a read-only image is refused.
    let mut t = Image::open(&top, OpenOptions::read_write()).unwrap();
    assert_eq!(t.preallocate(Preallocation::Off).unwrap(), 0);
    drop(t);
    let mut ro = Image::open(&top, OpenOptions::read_only()).unwrap();
    assert!(ro.preallocate(Preallocation::Full).is_err());
    // The modes by name, as qemu-img spells them.
    assert_eq!(
        "full".parse::<Preallocation>().unwrap(),
        Preallocation::Full
    );
    let e = "metadata".parse::<Preallocation>().unwrap_err();
    assert!(e.to_string().contains("SIGBUS"), "{e}");
    assert!("sparse".parse::<Preallocation>().is_err());
}

#[test]
fn commit_into_a_deeper_base_makes_it_show_the_top_and_keeps_the_top() {
    let d = tempfile::tempdir().unwrap();
    let p = |n: &str| d.path().join(n);
    let cs = 4096;
    // raw <- base.pcow <- mid.pcow (smaller: it hides base data past its
    // end) <- top.pcow (the full size again).
    std::fs::write(p("r.raw"), vec![9u8; 256 << 10]).unwrap();
    let mut b = create(&p("base.pcow"), 256 << 10, cs, Some("r.raw"));
    b.write_at(&[1u8; 8192], 0).unwrap();
    b.write_at(&[1u8; 4096], 200 << 10).unwrap();
    b.close().unwrap();
    let mut m = create(&p("mid.pcow"), 128 << 10, cs, Some("base.pcow"));
    m.write_at(&[2u8; 4096], 4096).unwrap();
    m.write_at(&[2u8; 4096], 64 << 10).unwrap();
    m.close().unwrap();
    let mut t = create(&p("top.pcow"), 256 << 10, cs, Some("mid.pcow"));
    t.write_at(&[3u8; 100], 64 << 10).unwrap();
    t.write_at(&[3u8; 4096], 240 << 10).unwrap();
    t.close().unwrap();
    let top_view = read_all(&p("top.pcow"));
    // mid's size cuts the base: the top reads zeros past 128 KiB where it
    // holds nothing, not the base's 1s at 200 KiB or the raw's 9s.
    assert_eq!(top_view[200 << 10], 0);
    assert_eq!(top_view[(128 << 10) + 5], 0);
    let r = pcow::ops::commit_into(&p("top.pcow"), &p("base.pcow")).unwrap();
    assert!(!r.emptied);
    assert_eq!(r.base, p("base.pcow"));
    assert_eq!(
        read_all(&p("base.pcow")),
        top_view,
        "the base shows the top"
    );
    assert_eq!(read_all(&p("top.pcow")), top_view, "the top is unchanged");
    let top = Image::open(p("top.pcow"), OpenOptions::read_only()).unwrap();
    assert_eq!(top.allocated_clusters(), 2, "the top keeps its clusters");
    drop(top);
    for f in ["top.pcow", "mid.pcow", "base.pcow"] {
        clean(&p(f));
    }
    // Into the raw file at the bottom, through two pcow images.
    let r = pcow::ops::commit_into(&p("top.pcow"), &p("r.raw")).unwrap();
    assert_eq!(r.base, p("r.raw"));
    assert_eq!(std::fs::read(p("r.raw")).unwrap(), top_view);
    // Not a base of the image: the image itself, an unrelated file, a
    // missing one.
    std::fs::write(p("other.raw"), [0u8; 4096]).unwrap();
    for bad in ["top.pcow", "other.raw"] {
        let e = pcow::ops::commit_into(&p("top.pcow"), &p(bad)).unwrap_err();
        assert!(
            e.to_string().contains("is not a base image of"),
            "{bad}: {e}"
        );
    }
    let e = pcow::ops::commit_into(&p("top.pcow"), &p("missing.pcow")).unwrap_err();
    assert!(e.to_string().contains("missing.pcow"), "{e}");
    assert_eq!(std::fs::read(p("other.raw")).unwrap(), vec![0u8; 4096]);
}

/// Completion finds every partial cluster of the active layer when its
/// entries lie in several segments, written in scattered order, with
/// another layer's segments before them: each is made whole from the view
/// below (the base's bytes, or the snapshot's), and nothing else changes.
#[test]
fn completion_finds_partial_clusters_in_every_segment_of_the_active_layer() {
    const CS: u64 = 8192;
    const CLUSTERS: u64 = 768;
    let d = tempfile::tempdir().unwrap();
    let (base, p) = (d.path().join("b.raw"), d.path().join("t.pcow"));
    let base_bytes: Vec<u8> = (0..CLUSTERS * CS).map(|i| (i / 4096 % 251) as u8).collect();
    std::fs::write(&base, &base_bytes).unwrap();
    let mut img = create(&p, CLUSTERS * CS, CS, Some("b.raw"));
    // Scattered order: 7 is coprime with 768.
    let order: Vec<u64> = (0..CLUSTERS).map(|i| i * 7 % CLUSTERS).collect();
    // Layer 0: the first page of a third of the clusters.
    for &vcn in &order[..256] {
        img.write_at(&[1; 100], vcn * CS).unwrap();
    }
    img.snapshot_create("s").unwrap();
    // The active layer: the second page of 300 clusters (some of them
    // written in layer 0 too), and 50 clusters whole.
    let mut partial = 0;
    for (i, &vcn) in order[200..550].iter().enumerate() {
        if i % 7 == 0 {
            img.write_at(&vec![3; CS as usize], vcn * CS).unwrap();
        } else {
            img.write_at(&[2; 100], vcn * CS + 4096).unwrap();
            partial += 1;
        }
    }
    let before = {
        let mut b = vec![0u8; (CLUSTERS * CS) as usize];
        img.read_at(&mut b, 0).unwrap();
        b
    };
    // The batched walk a device's open makes answers as one cluster at a
    // time does: whole active clusters, partial ones, the snapshot's, the
    // base's.
    let every = |img: &pcow::Image| {
        let mut got = Vec::new();
        img.cluster_sources(0..CLUSTERS, |vcn, s| got.push((vcn, s)));
        let one_by_one: Vec<_> = (0..CLUSTERS).map(|v| (v, img.cluster_source(v))).collect();
        assert_eq!(got, one_by_one);
        got.iter()
            .filter(|(_, s)| matches!(s, pcow::ClusterSource::Active { .. }))
            .count()
    };
    assert_eq!(every(&img), 350 - partial as usize);
    let mut live = LiveImage::new(img).unwrap();
    assert_eq!(live.complete_active_clusters().unwrap(), partial);
    assert_eq!(live.complete_active_clusters().unwrap(), 0, "all whole now");
    assert_eq!(every(&live), 350);
    for &vcn in &order[200..550] {
        assert!(
            matches!(live.cluster_source(vcn), pcow::ClusterSource::Active { .. }),
            "vcn {vcn}"
        );
    }
    live.close().unwrap();
    assert_eq!(read_all(&p), before);
    clean(&p);
}
