//! The pcow region on real files with a real userfaultfd: host threads play
//! the guest (writing and reading the region through raw pointers), the
//! monitor runs on its own thread polling the userfaultfd as the VMM's
//! epoll loop would, and every result is checked against a model and
//! against the image reopened with the pcow library.

mod common;

use common::*;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pcow::{Image, OpenOptions};
use virtio_pmem_pcow::{Monitor, PcowRegion, PmemDevice, Quiesce, RegionOptions, WriteGate};

/// A 3-deep chain: raw base0 (short, ends mid-page) <- base1.pcow <-
/// top.pcow (with a snapshot). Returns the top path and the model of the
/// top's view.
fn three_deep_chain(dir: &Path) -> (PathBuf, Vec<u8>) {
    let size = 32 * K64;
    let mut model = vec![0u8; size as usize];
    // base0: raw, 5 clusters and 5000 bytes (the last page is partial:
    // the cluster holding it is a mixed one).
    let b0 = pattern(1, (5 * K64 + 5000) as usize);
    std::fs::write(dir.join("base0.raw"), &b0).unwrap();
    let mut b1 = create(&dir.join("base1.pcow"), size, K64, Some("base0.raw"));
    b1.write_at(&pattern(2, 3 * K64 as usize), 8 * K64).unwrap();
    b1.write_at(&pattern(3, 4096), 2 * K64 + 8192).unwrap(); // partial over base0
    b1.close().unwrap();
    let top = dir.join("top.pcow");
    let mut t = create(&top, size, K64, Some("base1.pcow"));
    t.write_at(&pattern(4, 2 * K64 as usize), 12 * K64).unwrap();
    t.snapshot_create("s1").unwrap();
    t.write_at(&pattern(5, K64 as usize), 13 * K64).unwrap(); // over snapshot
    t.write_at(&pattern(6, K64 as usize), 20 * K64).unwrap(); // fresh
    t.write_at(&pattern(7, 100), 3 * K64 + 50).unwrap(); // partial over base1/base0
    t.close().unwrap();
    let img = Image::open(&top, OpenOptions::read_only()).unwrap();
    img.read_at(&mut model, 0).unwrap();
    drop(img);
    (top, model)
}

#[test]
fn patterns_across_holes_snapshots_and_a_3_deep_chain() {
    if !uffd_or_skip("patterns_across_holes_snapshots_and_a_3_deep_chain") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = three_deep_chain(dir.path());
    let before_base1 = std::fs::read(dir.path().join("base1.pcow")).unwrap();
    let before_base0 = std::fs::read(dir.path().join("base0.raw")).unwrap();
    let rig = Rig::open(&top, &RegionOptions::default()).unwrap();
    assert_eq!(rig.base() % (2 << 20), 0, "2 MiB aligned");
    // The region shows the image's view before anything is written
    // (reading holes faults in zeros and allocates nothing).
    let alloc0 = rig.region.status().unwrap().allocated_clusters;
    same(&rig.read(0, model.len()), &model, "region");
    assert_eq!(rig.region.status().unwrap().allocated_clusters, alloc0);
    // Writes: into a hole, a read-only (zero-mapped) hole, base0 data,
    // the mixed cluster, base1 data, the snapshot, the active layer,
    // across cluster boundaries.
    let writes: &[(u64, usize)] = &[
        (25 * K64 + 10, 3000),     // hole, never read before? read above: zero-mapped
        (0, 1),                    // base0
        (K64 - 2, 4),              // base0 across a boundary
        (5 * K64 + 4000, 2000),    // mixed cluster (base0's partial page)
        (8 * K64 + 100, 70_000),   // base1 over two clusters
        (12 * K64 + 4096, 8192),   // snapshot s1 data
        (13 * K64, K64 as usize),  // active over the snapshot
        (20 * K64 + 65_000, 1000), // active into the next hole
        (3 * K64 + 40, 200),       // partial active (completed at open)
        (31 * K64 + K64 - 1, 1),   // last byte
    ];
    for (i, &(off, len)) in writes.iter().enumerate() {
        let data = pattern(100 + i as u64, len);
        rig.write(off, &data);
        model[off as usize..off as usize + len].copy_from_slice(&data);
    }
    same(&rig.read(0, model.len()), &model, "region");
    let st = rig.region.status().unwrap();
    assert!(st.pending_private_pages > 0);
    assert_eq!(st.chain_depth, 3);
    let stats = rig.region.barrier().unwrap();
    assert!(stats.clusters_copied > 0);
    assert_eq!(rig.region.status().unwrap().pending_private_pages, 0);
    // Writes after the barrier: cluster 8 was written whole, so the barrier
    // remapped it shared (the write lands in the image); cluster 9 was
    // written in part, stays private, and its rewritten page is found again
    // by write tracking.
    let data = pattern(999, 5000);
    rig.write(8 * K64 + 200, &data);
    model[(8 * K64 + 200) as usize..][..5000].copy_from_slice(&data);
    rig.write(9 * K64 + 10, &data[..100]);
    model[(9 * K64 + 10) as usize..][..100].copy_from_slice(&data[..100]);
    assert_eq!(rig.region.barrier().unwrap().pages_copied, 1);
    same(&rig.read(0, model.len()), &model, "region");
    rig.close();
    same(&reopen_read(&top), &model, "reopened");
    // The bases were not touched.
    assert_eq!(
        std::fs::read(dir.path().join("base1.pcow")).unwrap(),
        before_base1
    );
    assert_eq!(
        std::fs::read(dir.path().join("base0.raw")).unwrap(),
        before_base0
    );
    // The snapshot still shows its old content.
    let mut t = Image::open(&top, OpenOptions::read_write()).unwrap();
    t.snapshot_apply("s1").unwrap();
    let mut b = vec![0u8; 2 * K64 as usize];
    t.read_at(&mut b, 12 * K64).unwrap();
    assert_eq!(b, pattern(4, 2 * K64 as usize));
}

#[test]
fn racing_write_faults_allocate_one_cluster_each() {
    if !uffd_or_skip("racing_write_faults_allocate_one_cluster_each") {
        return;
    }
    const THREADS: u64 = 4;
    const CLUSTERS: u64 = 64;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.pcow");
    create(&path, CLUSTERS * K64, K64, None).close().unwrap();
    // Without windows (pcow_expand_window races them).
    let rig = Rig::open(&path, &one_cluster_per_fault()).unwrap();
    // Everyone hits every cluster, in different orders.
    race_writers(rig.base(), rig.region.len(), THREADS, CLUSTERS, 1, 7);
    let st = rig.region.status().unwrap();
    assert_eq!(
        st.allocated_clusters, CLUSTERS,
        "one allocation per cluster"
    );
    assert_eq!(st.faults.write_faults, CLUSTERS);
    assert_eq!(st.shared, CLUSTERS);
    rig.region.barrier().unwrap();
    rig.close();
    check_raced(&reopen_read(&path), THREADS, CLUSTERS);
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert_eq!(img.allocated_clusters(), CLUSTERS);
}

#[test]
fn read_fault_then_write_in_a_hole_survives_barrier_and_reopen() {
    if !uffd_or_skip("read_fault_then_write_in_a_hole_survives_barrier_and_reopen") {
        return;
    }
    for fallback in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.pcow");
        create(&path, 8 * K64, K64, None).close().unwrap();
        let opts = RegionOptions {
            pagemap_read_fallback: fallback,
            ..RegionOptions::default()
        };
        let rig = Rig::open(&path, &opts).unwrap();
        assert_eq!(rig.read(3 * K64 + 7, 10), vec![0u8; 10]);
        assert_eq!(rig.read(5 * K64, 10), vec![0u8; 10]); // read only
        let st = rig.region.status().unwrap();
        assert_eq!((st.zero_mapped, st.allocated_clusters), (2, 0));
        assert_eq!(st.faults.read_faults, 2);
        // A barrier over zero-mapped holes allocates nothing.
        rig.region.barrier().unwrap();
        assert_eq!(rig.region.status().unwrap().allocated_clusters, 0);
        // The write lands in a private page: no fault, pending.
        rig.write(3 * K64 + 4096 + 1, b"survives");
        let st = rig.region.status().unwrap();
        assert_eq!(st.faults.write_faults, 0);
        if fallback {
            // Reading pagemap cannot tell the zero page apart: an upper bound.
            assert!(st.pending_private_pages >= 1);
        } else {
            assert_eq!(st.pending_private_pages, 1);
        }
        let stats = rig.region.barrier().unwrap();
        assert_eq!((stats.private_pages, stats.clusters_copied), (1, 1));
        let st = rig.region.status().unwrap();
        assert_eq!(
            (st.allocated_clusters, st.shared, st.zero_mapped),
            (1, 1, 1)
        );
        rig.close();
        let v = reopen_read(&path);
        assert_eq!(&v[(3 * K64 + 4097) as usize..][..8], b"survives");
        assert!(v.iter().filter(|&&b| b != 0).count() <= 8);
    }
}

/// Writers own disjoint slots spread over every kind of cluster; each
/// write is logged (under the gate) so the expected content is exact.
fn writer_threads(
    rig: &Rig,
    threads: u64,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<(u64, u8)>>>,
) -> Vec<JoinHandle<u64>> {
    let (base, len) = (rig.base(), rig.region.len());
    let slots = len / 512;
    (0..threads)
        .map(|t| {
            let gate = rig.gate.clone();
            let stop = stop.clone();
            let log = log.clone();
            std::thread::spawn(move || {
                let mut n = 0u64;
                let mut x = t + 1;
                while !stop.load(Ordering::Relaxed) || n < 200 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    // slot s belongs to thread s % threads
                    let s = (x >> 33) % (slots / threads) * threads + t;
                    let off = s * 512 + (x >> 20) % 500;
                    let v = (x >> 56) as u8 | 1;
                    let _in = gate.enter();
                    gwrite(base, len, off, &[v]);
                    log.lock().unwrap().push((off, v));
                    n += 1;
                }
                n
            })
        })
        .collect()
}

/// A top image over a base whose every cluster holds data: every cluster
/// of the region starts private (copy-on-write).
fn populated_base(dir: &Path, clusters: u64) -> (PathBuf, Vec<u8>) {
    let size = clusters * K64;
    let model = pattern(77, size as usize);
    let mut b = create(&dir.join("base.pcow"), size, K64, None);
    b.write_at(&model, 0).unwrap();
    b.close().unwrap();
    let top = dir.join("top.pcow");
    create(&top, size, K64, Some("base.pcow")).close().unwrap();
    (top, model)
}

#[test]
fn writers_racing_barriers_lose_nothing() {
    if !uffd_or_skip("writers_racing_barriers_lose_nothing") {
        return;
    }
    for (name, chain) in [("3-deep chain", 0), ("populated base", 1)] {
        let dir = tempfile::tempdir().unwrap();
        let (top, mut model) = if chain == 0 {
            three_deep_chain(dir.path())
        } else {
            populated_base(dir.path(), 256)
        };
        let rig = Rig::open(&top, &RegionOptions::default()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let writers = writer_threads(&rig, 3, stop.clone(), log.clone());
        let t0 = Instant::now();
        let (mut barriers, mut copied, mut snaps) = (0, 0, 0);
        while t0.elapsed() < Duration::from_millis(1500) {
            // Snapshots make every cluster private again, so that barriers
            // keep copying (and remapping) clusters under the writers.
            if barriers % 8 == 7 {
                rig.region.snapshot_create(&format!("s{barriers}")).unwrap();
                snaps += 1;
            }
            copied += rig.region.barrier().unwrap().clusters_copied;
            barriers += 1;
        }
        stop.store(true, Ordering::Relaxed);
        let writes: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum();
        rig.region.barrier().unwrap();
        for &(off, v) in log.lock().unwrap().iter() {
            model[off as usize] = v;
        }
        same(&rig.read(0, model.len()), &model, name);
        let st = rig.region.status().unwrap();
        eprintln!(
            "{name}: {writes} writes, {barriers} barriers ({snaps} snapshots) copying {copied} \
             clusters, {} clusters allocated, {} vmas",
            st.allocated_clusters, st.vmas
        );
        assert!(copied > 0);
        rig.close();
        same(&reopen_read(&top), &model, name);
    }
}

/// Records the log length at each hold: the state a snapshot captured.
struct MarkingGate {
    gate: Arc<WriteGate>,
    log: Arc<Mutex<Vec<(u64, u8)>>>,
    marks: Mutex<Vec<usize>>,
}

impl Quiesce for MarkingGate {
    fn hold(&self) -> Result<(), virtio_pmem_pcow::QuiesceError> {
        self.gate.hold()?;
        let n = self.log.lock().unwrap().len();
        self.marks.lock().unwrap().push(n);
        Ok(())
    }
    fn release(&self) {
        self.gate.release();
    }
}

#[test]
fn snapshot_taken_while_writers_run() {
    if !uffd_or_skip("snapshot_taken_while_writers_run") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, model0) = three_deep_chain(dir.path());
    let gate = Arc::new(WriteGate::new());
    let log = Arc::new(Mutex::new(Vec::new()));
    let marking = Arc::new(MarkingGate {
        gate: gate.clone(),
        log: log.clone(),
        marks: Mutex::new(Vec::new()),
    });
    let (region, monitor) =
        PcowRegion::open(&top, marking.clone(), &RegionOptions::default()).unwrap();
    let rig = Rig {
        region,
        monitor: serve(monitor),
        gate,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let writers = writer_threads(&rig, 3, stop.clone(), log.clone());
    std::thread::sleep(Duration::from_millis(300));
    let info = rig.region.snapshot_create("live").unwrap();
    assert_eq!(info.tag, "live");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    let st = rig.region.status().unwrap();
    assert_eq!(st.shared, 0, "every shared cluster became history");
    assert!(
        st.pending_private_pages > 0,
        "writes after the snapshot are private"
    );
    rig.region.barrier().unwrap();
    let marks = marking.marks.lock().unwrap().clone();
    assert_eq!(
        marks.len(),
        2,
        "one hold for the snapshot, one for the barrier"
    );
    let log = log.lock().unwrap().clone();
    let replay = |n: usize| {
        let mut m = model0.clone();
        for &(off, v) in &log[..n] {
            m[off as usize] = v;
        }
        m
    };
    let now = replay(log.len());
    same(&rig.read(0, now.len()), &now, "region");
    assert!(
        marks[0] > 0 && marks[0] < log.len(),
        "writers ran on both sides"
    );
    assert!(
        rig.region.snapshot_apply("live").is_err(),
        "live rollback refused"
    );
    rig.close();
    same(&reopen_read(&top), &now, "reopened");
    let mut img = Image::open(&top, OpenOptions::read_write()).unwrap();
    img.snapshot_apply("live").unwrap();
    let mut v = vec![0u8; now.len()];
    img.read_at(&mut v, 0).unwrap();
    same(&v, &replay(marks[0]), "snapshot");
}

#[test]
fn two_mib_clusters() {
    if !uffd_or_skip("two_mib_clusters") {
        return;
    }
    const M2: u64 = 2 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.pcow");
    let mut img = create(&path, 8 * M2, M2, None);
    img.write_at(&pattern(1, M2 as usize), M2).unwrap();
    img.snapshot_create("s").unwrap();
    img.close().unwrap();
    let rig = Rig::open(&path, &RegionOptions::default()).unwrap();
    let mut model = reopen_read_forced(&path);
    let writes: &[(u64, usize)] = &[
        (M2 + 4096 * 3 + 1, 10), // copy-on-write into the snapshot
        (3 * M2 + 5, 100),       // write fault in a hole
        (6 * M2 - 3, 6),         // across two holes
    ];
    assert_eq!(rig.read(5 * M2, 4), vec![0; 4]); // read fault: zeros
    for (i, &(off, len)) in writes.iter().enumerate() {
        let d = pattern(50 + i as u64, len);
        rig.write(off, &d);
        model[off as usize..][..len].copy_from_slice(&d);
    }
    rig.write(5 * M2 + M2 - 1, &[9]); // into the zero-mapped hole
    model[(6 * M2 - 1) as usize] = 9;
    let st = rig.region.status().unwrap();
    assert_eq!(st.faults.write_faults, 2);
    rig.region.barrier().unwrap();
    same(&rig.read(0, model.len()), &model, "region");
    rig.close();
    same(&reopen_read(&path), &model, "reopened");
}

/// The image's view while a region holds its lock.
fn reopen_read_forced(path: &Path) -> Vec<u8> {
    let img = Image::open(
        path,
        OpenOptions {
            force_share: true,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    let mut v = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut v, 0).unwrap();
    v
}

#[test]
fn vma_limit_is_a_clear_error_and_vmas_are_reported() {
    if !uffd_or_skip("vma_limit_is_a_clear_error_and_vmas_are_reported") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("frag.pcow");
    // Every other cluster written, in reverse order: no two mappings merge.
    let mut img = create(&path, 64 * K64, K64, None);
    for c in (0..64).rev().step_by(2) {
        img.write_at(&[1], c * K64).unwrap();
    }
    img.close().unwrap();
    let e = match Rig::open(
        &path,
        &RegionOptions {
            max_map_count: Some(100),
            ..RegionOptions::default()
        },
    ) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a limit of 100 must be refused"),
    };
    assert!(
        e.contains("vm.max_map_count") && e.contains("pcow-img compact"),
        "{e}"
    );
    // The image is intact and opens with the real limit.
    let rig = Rig::open(&path, &RegionOptions::default()).unwrap();
    let st = rig.region.status().unwrap();
    assert_eq!(st.planned_vmas, 64);
    assert_eq!(st.vmas, 64, "32 shared clusters, 32 registered holes");
    // Expansion in a hole next to a shared cluster: the new mapping is
    // contiguous in neither file nor address with its neighbours here.
    rig.write(K64, &[2]);
    let st2 = rig.region.status().unwrap();
    assert!(st2.vmas >= 64);
    rig.close();
}

#[test]
fn flush_through_a_virtqueue_is_answered_after_the_data_is_durable() {
    use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    if !uffd_or_skip("flush_through_a_virtqueue_is_answered_after_the_data_is_durable") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.pcow");
    let mut img = create(&path, 16 * K64, K64, None);
    img.write_at(b"old", 2 * K64).unwrap();
    img.snapshot_create("s").unwrap();
    img.close().unwrap();
    let rig = Rig::open(&path, &RegionOptions::default()).unwrap();
    let Rig {
        region,
        monitor,
        gate,
    } = rig;
    let (base, len) = (region.host_addr() as usize, region.len());
    {
        let _in = gate.enter();
        gwrite(base, len, 2 * K64, b"new"); // copy-on-write
        gwrite(base, len, 9 * K64, b"hole"); // expansion
    }
    let mut dev = PmemDevice::new(0x1_0000_0000, len, region);

    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
    let vq = MockSplitQueue::new(&mem, 16);
    let (req, resp) = (0x10_0000u64, 0x20_0000u64);
    mem.write_obj(0u32.to_le(), GuestAddress(req)).unwrap();
    mem.write_obj(0xdead_beefu32, GuestAddress(resp)).unwrap();
    let chain = [
        RawDescriptor::from(SplitDescriptor::new(req, 4, VRING_DESC_F_NEXT as u16, 1)),
        RawDescriptor::from(SplitDescriptor::new(resp, 4, VRING_DESC_F_WRITE as u16, 0)),
    ];
    vq.add_desc_chains(&chain, 0).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    dev.process_queue(&mem, &mut q).unwrap();
    let ret: u32 = mem.read_obj(GuestAddress(resp)).unwrap();
    assert_eq!(u32::from_le(ret), 0, "FLUSH answered OK");
    assert_eq!(dev.metrics().flushes, 1);
    // Answered: the committed image on disk already has both writes.
    let v = reopen_read_forced(&path);
    assert_eq!(&v[(2 * K64) as usize..][..3], b"new");
    assert_eq!(&v[(9 * K64) as usize..][..4], b"hole");
    monitor.stop();
    drop(dev);
    let v = reopen_read(&path);
    assert_eq!(&v[(9 * K64) as usize..][..4], b"hole");
}

/// Fault latency as the writer sees it, on tmpfs (reported, not asserted).
#[test]
fn expansion_and_cow_latency_on_tmpfs() {
    if !uffd_or_skip("expansion_and_cow_latency_on_tmpfs") {
        return;
    }
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("SKIPPED expansion_and_cow_latency_on_tmpfs: no /dev/shm");
        return;
    };
    const N: u64 = 512;
    let path = dir.path().join("lat.pcow");
    let mut img = create(&path, 2 * N * K64, K64, None);
    for c in N..2 * N {
        img.write_at(&[1], c * K64).unwrap();
    }
    img.snapshot_create("s").unwrap();
    img.close().unwrap();
    // A pool for every cluster: no refill in a fault (default 4 MiB).
    let opts = RegionOptions {
        pool_clusters: Some(2 * N + 8),
        ..RegionOptions::default()
    };
    let rig = Rig::open(&path, &opts).unwrap();
    let (base, len) = (rig.base(), rig.region.len());
    let lat = |range: std::ops::Range<u64>| {
        let mut v: Vec<f64> = range
            .map(|c| {
                let t = Instant::now();
                gwrite(base, len, c * K64 + 100, &[7]);
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        (v[v.len() / 2], v[v.len() * 99 / 100])
    };
    let (e50, e99) = lat(0..N);
    let (c50, c99) = lat(N..2 * N);
    eprintln!(
        "tmpfs 64 KiB clusters: expansion p50 {e50:.1} us p99 {e99:.1} us; \
         copy-on-write p50 {c50:.1} us p99 {c99:.1} us"
    );
    let t = Instant::now();
    let stats = rig.region.barrier().unwrap();
    eprintln!(
        "barrier: {} private pages, {} clusters copied, {:.2} ms",
        stats.private_pages,
        stats.clusters_copied,
        t.elapsed().as_secs_f64() * 1e3
    );
    rig.close();
}

/// The VMM moves the device to its device thread and the monitor to its
/// event loop.
#[test]
fn region_and_monitor_are_send() {
    fn send<T: Send>() {}
    send::<PcowRegion>();
    send::<Monitor>();
    send::<PmemDevice<PcowRegion>>();
}

/// The committed generation as the file holds it (the higher of the two
/// header slots that decode), read behind the writer's back.
fn generation_on_disk(path: &Path, cs: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).unwrap();
    let slot = cs / 2;
    let mut buf = vec![0u8; slot as usize];
    (0..2u64)
        .filter_map(|i| {
            f.read_exact_at(&mut buf, i * slot).ok()?;
            pcow::Header::decode(&buf, i * slot).ok()
        })
        .map(|h| h.generation)
        .max()
        .expect("a valid header slot")
}

/// Records, at each release, the generation committed on disk.
struct CommitAtRelease {
    gate: Arc<WriteGate>,
    path: PathBuf,
    at_release: Mutex<Vec<u64>>,
}

impl Quiesce for CommitAtRelease {
    fn hold(&self) -> Result<(), virtio_pmem_pcow::QuiesceError> {
        self.gate.hold()?;
        Ok(())
    }
    fn release(&self) {
        let g = generation_on_disk(&self.path, K64);
        self.at_release.lock().unwrap().push(g);
        self.gate.release();
    }
}

/// A FLUSH lets the guest run again before its commit (the syncs need no
/// hold: the pages are copied and their tracking re-armed), while a
/// snapshot holds writers until it is committed and its clusters are
/// remapped. Writes made while the commit runs are kept and belong to the
/// next barrier.
#[test]
fn a_flush_releases_writers_before_its_commit_a_snapshot_after() {
    if !uffd_or_skip("a_flush_releases_writers_before_its_commit_a_snapshot_after") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("top.pcow");
    create(&top, 16 * K64, K64, None).close().unwrap();
    let gate = Arc::new(WriteGate::new());
    let q = Arc::new(CommitAtRelease {
        gate: gate.clone(),
        path: top.clone(),
        at_release: Mutex::new(Vec::new()),
    });
    let (region, monitor) = PcowRegion::open(&top, q.clone(), &RegionOptions::default()).unwrap();
    let rig = Rig {
        region,
        monitor: serve(monitor),
        gate,
    };
    let mut model = vec![0u8; (16 * K64) as usize];
    let mut put = |rig: &Rig, off: u64, seed: u64| {
        let d = pattern(seed, 3000);
        rig.write(off, &d);
        model[off as usize..off as usize + d.len()].copy_from_slice(&d);
    };
    put(&rig, 5000, 1);
    let g0 = generation_on_disk(&top, K64);
    let s = rig.region.barrier().unwrap();
    assert!(s.held <= s.scan + s.copy + s.commit, "{s:?}");
    let g1 = generation_on_disk(&top, K64);
    assert_eq!(g1, g0 + 1, "the barrier committed");
    put(&rig, 3 * K64 + 100, 2);
    rig.region.snapshot_create("s").unwrap();
    let g2 = generation_on_disk(&top, K64);
    assert!(g2 > g1, "the snapshot committed");
    let at_release = q.at_release.lock().unwrap().clone();
    assert_eq!(
        at_release,
        vec![g0, g2],
        "the flush released before its commit, the snapshot after"
    );
    put(&rig, 9 * K64, 3);
    rig.region.barrier().unwrap();
    same(&rig.read(0, model.len()), &model, "region");
    rig.close();
    same(&reopen_read(&top), &model, "reopened");
    check_clean(&top);
}

/// Writers and a reader race barriers over an image of holes with a zero
/// budget of 4 clusters: the reader keeps zero-mapping holes, writers land
/// in zero-mapped holes (private pages) and in holes (write faults), and
/// barriers keep turning the zero-mapped clusters nobody wrote back into
/// holes. Every written byte is there afterwards, and after a reopen.
#[test]
fn writers_and_a_reader_racing_barriers_past_the_zero_budget_lose_nothing() {
    if !uffd_or_skip("writers_and_a_reader_racing_barriers_past_the_zero_budget_lose_nothing") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("holes.pcow");
    let clusters = 256u64;
    create(&top, clusters * K64, K64, None).close().unwrap();
    let opts = RegionOptions {
        zero_budget: Some(4 * K64),
        // Windows would let the writers fill every hole before the reader
        // zero-maps enough of them.
        ..one_cluster_per_fault()
    };
    let rig = Rig::open(&top, &opts).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Vec::new()));
    let writers = writer_threads(&rig, 2, stop.clone(), log.clone());
    let reader = {
        let (base, len, stop) = (rig.base(), rig.region.len(), stop.clone());
        std::thread::spawn(move || {
            let (mut n, mut x) = (0u64, 99u64);
            while !stop.load(Ordering::Relaxed) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let _ = gread(base, len, (x >> 20) % (len - 8), 8);
                n += 1;
            }
            n
        })
    };
    let mut model = vec![0u8; (clusters * K64) as usize];
    let t0 = Instant::now();
    let (mut barriers, mut reholed) = (0u64, 0u64);
    // 1.5 s at least, and until a barrier returned clusters to holes (on
    // a loaded machine the writers may reach every cluster before the
    // reader zero-maps enough of them), 10 s at most.
    while t0.elapsed() < Duration::from_millis(1500)
        || (reholed == 0 && t0.elapsed() < Duration::from_secs(10))
    {
        reholed += rig.region.barrier().unwrap().reholed;
        barriers += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let writes: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum();
    let reads = reader.join().unwrap();
    rig.region.barrier().unwrap();
    for &(off, v) in log.lock().unwrap().iter() {
        model[off as usize] = v;
    }
    let st = rig.region.status().unwrap();
    eprintln!(
        "{writes} writes, {reads} reads, {barriers} barriers returning {reholed} zero-mapped \
         clusters to holes; {} read faults, {} write faults",
        st.faults.read_faults, st.faults.write_faults
    );
    assert!(reholed > 0, "the budget was never exceeded");
    same(&rig.read(0, model.len()), &model, "region");
    rig.close();
    same(&reopen_read(&top), &model, "reopened");
    check_clean(&top);
}

/// An image preallocated up front (`pcow-img create -o
/// preallocation=falloc`) is mapped shared as a whole: the guest's writes
/// take no fault, and a barrier has nothing to copy.
#[test]
fn a_preallocated_image_is_mapped_shared_and_writes_take_no_fault() {
    if !uffd_or_skip("a_preallocated_image_is_mapped_shared_and_writes_take_no_fault") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pre.pcow");
    let clusters = 32;
    let mut img = create(&path, clusters * K64, K64, None);
    assert_eq!(
        img.preallocate(pcow::Preallocation::Falloc).unwrap(),
        clusters
    );
    img.close().unwrap();
    let rig = Rig::open(&path, &RegionOptions::default()).unwrap();
    let st = rig.region.status().unwrap();
    assert_eq!(
        (st.shared, st.holes, st.private),
        (clusters, 0, 0),
        "{st:?}"
    );
    let mut model = vec![0u8; (clusters * K64) as usize];
    for c in 0..clusters {
        let d = pattern(c, 5000);
        let off = c * K64 + 300;
        rig.write(off, &d);
        model[off as usize..][..d.len()].copy_from_slice(&d);
    }
    let b = rig.region.barrier().unwrap();
    assert_eq!(b.pages_copied, 0, "{b:?}");
    let st = rig.region.status().unwrap();
    assert_eq!(st.faults.write_faults + st.faults.read_faults, 0, "{st:?}");
    assert_eq!(st.allocated_clusters, clusters, "{st:?}");
    same(&rig.read(0, model.len()), &model, "region");
    rig.close();
    same(&reopen_read(&path), &model, "reopened");
    check_clean(&path);
}
