//! Live overlays and the pre-allocation worker on real files with a real
//! userfaultfd: host threads play the guest, the monitor runs on its own
//! thread polling both of its fds (the userfaultfd and the pool's eventfd)
//! as the VMM's epoll loop would, and results are checked against a model
//! and against the images reopened with the pcow library.

mod common;

use common::*;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pcow::{Image, OpenOptions};
use virtio_pmem_pcow::{
    OverlayError, PcowRegion, PoolOptions, Quiesce, RegionOptions, Status, WriteGate,
};

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s += &format!(": {c}");
        src = c.source();
    }
    s
}

/// Records the log length at each hold: the state an overlay captured.
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

/// A region, its monitor thread and the gate the "guest" writes through.
struct Rig {
    region: PcowRegion,
    monitor: Served,
    gate: Arc<WriteGate>,
    marking: Arc<MarkingGate>,
    log: Arc<Mutex<Vec<(u64, u8)>>>,
}

impl Rig {
    fn open(path: &Path) -> Rig {
        // The pool's tests count one allocation per fault.
        Self::open_with(path, &one_cluster_per_fault(), &PoolOptions::default())
    }

    fn open_with(path: &Path, opts: &RegionOptions, pool: &PoolOptions) -> Rig {
        let gate = Arc::new(WriteGate::new());
        let log = Arc::new(Mutex::new(Vec::new()));
        let marking = Arc::new(MarkingGate {
            gate: gate.clone(),
            log: log.clone(),
            marks: Mutex::new(Vec::new()),
        });
        let (region, monitor) =
            PcowRegion::open_with(path, marking.clone(), opts, pool).expect("open region");
        Rig {
            region,
            monitor: serve(monitor),
            gate,
            marking,
            log,
        }
    }

    fn base(&self) -> usize {
        self.region.host_addr() as usize
    }

    /// A logged guest write (under the gate).
    fn write(&self, off: u64, data: &[u8]) {
        let _in = self.gate.enter();
        gwrite(self.base(), self.region.len(), off, data);
        let mut log = self.log.lock().unwrap();
        for (i, &b) in data.iter().enumerate() {
            log.push((off + i as u64, b));
        }
    }

    fn read(&self, off: u64, len: usize) -> Vec<u8> {
        gread(self.base(), self.region.len(), off, len)
    }

    fn marks(&self) -> Vec<usize> {
        self.marking.marks.lock().unwrap().clone()
    }

    fn status(&self) -> Status {
        self.region.status().expect("status")
    }

    /// Drops the region and the monitor (the image closes).
    fn close(self) {
        let Rig {
            region, monitor, ..
        } = self;
        monitor.stop();
        drop(region);
    }
}

/// The view of an image in use (no locks).
fn base_name(path: &Path) -> Option<String> {
    let img = Image::open(
        path,
        OpenOptions {
            force_share: true,
            skip_base: true,
            ..OpenOptions::read_only()
        },
    )
    .expect("open");
    img.base_ref().map(|b| b.name.clone())
}

#[track_caller]
/// base.pcow (data in the first half) <- top.pcow (data in a quarter, so
/// the region starts with shared, private and hole clusters). Returns the
/// top and the model of its view.
fn chain_with_every_kind(dir: &Path, clusters: u64) -> (PathBuf, Vec<u8>) {
    let size = clusters * K64;
    let mut model = vec![0u8; size as usize];
    let half = (size / 2) as usize;
    let mut b = create(&dir.join("base.pcow"), size, K64, None);
    let data = pattern(1, half);
    b.write_at(&data, 0).unwrap();
    model[..half].copy_from_slice(&data);
    b.close().unwrap();
    let top = dir.join("top.pcow");
    let mut t = create(&top, size, K64, Some("base.pcow"));
    let (a, n) = ((size / 4) as usize, (size / 4) as usize);
    let data = pattern(2, n);
    t.write_at(&data, a as u64).unwrap();
    model[a..a + n].copy_from_slice(&data);
    t.close().unwrap();
    (top, model)
}

/// Writers own disjoint slots spread over every kind of cluster; each
/// write is logged under the gate, so the content at each hold is exact.
fn writer_threads(rig: &Rig, threads: u64, stop: Arc<AtomicBool>) -> Vec<JoinHandle<u64>> {
    let (base, len) = (rig.base(), rig.region.len());
    let slots = len / 512;
    (0..threads)
        .map(|t| {
            let gate = rig.gate.clone();
            let stop = stop.clone();
            let log = rig.log.clone();
            std::thread::spawn(move || {
                let mut n = 0u64;
                let mut x = t + 1;
                while !stop.load(Ordering::Relaxed) || n < 200 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
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

fn replay(model0: &[u8], log: &[(u64, u8)]) -> Vec<u8> {
    let mut m = model0.to_vec();
    for &(off, v) in log {
        m[off as usize] = v;
    }
    m
}

#[test]
fn overlays_taken_while_writers_run_capture_exactly_the_held_state() {
    if !uffd_or_skip("overlays_taken_while_writers_run_capture_exactly_the_held_state") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, model0) = chain_with_every_kind(dir.path(), 256);
    let (ov1, ov2) = (dir.path().join("ov1.pcow"), dir.path().join("ov2.pcow"));
    let rig = Rig::open(&top);
    let st = rig.status();
    assert!(st.shared > 0 && st.private > 0 && st.holes > 0, "{st:?}");
    let stop = Arc::new(AtomicBool::new(false));
    let writers = writer_threads(&rig, 3, stop.clone());
    std::thread::sleep(Duration::from_millis(250));
    let i1 = rig.region.overlay(&ov1).expect("overlay 1");
    std::thread::sleep(Duration::from_millis(250));
    // A barrier between the overlays, so the second one remaps clusters
    // the first overlay's top received.
    rig.region.barrier().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let i2 = rig.region.overlay(&ov2).expect("overlay 2");
    std::thread::sleep(Duration::from_millis(250));
    stop.store(true, Ordering::Relaxed);
    let writes: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum();
    rig.region.barrier().unwrap();
    let st = rig.status();
    let marks = rig.marks();
    let log = rig.log.lock().unwrap().clone();
    eprintln!(
        "{writes} writes; overlay 1: {} clusters remapped, held {:?}; overlay 2: {} remapped, \
         held {:?}; marks {marks:?}",
        i1.remapped_clusters, i1.held, i2.remapped_clusters, i2.held
    );
    assert_eq!(marks.len(), 4, "holds: overlay, barrier, overlay, barrier");
    assert!(
        marks[0] > 0 && marks[0] < marks[2] && marks[2] < log.len(),
        "writers ran around both overlays: {marks:?} of {}",
        log.len()
    );
    assert!(i1.remapped_clusters > 0 && i2.remapped_clusters > 0);
    assert_eq!(
        (i1.base.as_str(), i2.base.as_str()),
        ("top.pcow", "ov1.pcow")
    );
    assert_eq!(i1.file, ov1.canonicalize().unwrap());
    assert_eq!(st.overlays, 2);
    assert_eq!(st.detached, None);
    let canon = |p: &Path| p.canonicalize().unwrap();
    assert_eq!(
        st.chain.iter().map(|p| canon(p)).collect::<Vec<_>>(),
        [&ov2, &ov1, &top, &dir.path().join("base.pcow")].map(|p| canon(p)),
    );
    assert_eq!(st.chain_depth, 4);
    let now = replay(&model0, &log);
    same(&rig.read(0, now.len()), &now, "region");
    // The bases can be read (shared locks) while the device runs.
    same(
        &reopen_read(&top),
        &replay(&model0, &log[..marks[0]]),
        "top at overlay 1",
    );
    same(
        &reopen_read(&ov1),
        &replay(&model0, &log[..marks[2]]),
        "ov1 at overlay 2",
    );
    rig.close();
    same(&reopen_read(&ov2), &now, "ov2 reopened");
    same(
        &reopen_read(&top),
        &replay(&model0, &log[..marks[0]]),
        "top after close",
    );
    same(
        &reopen_read(&ov1),
        &replay(&model0, &log[..marks[2]]),
        "ov1 after close",
    );
    assert_eq!(base_name(&ov1).as_deref(), Some("top.pcow"));
    assert_eq!(base_name(&ov2).as_deref(), Some("ov1.pcow"));
    for p in [&top, &ov1, &ov2] {
        check_clean(p);
    }
}

#[test]
fn after_an_overlay_the_base_never_changes_and_the_overlay_reopens() {
    if !uffd_or_skip("after_an_overlay_the_base_never_changes_and_the_overlay_reopens") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (top, mut model) = chain_with_every_kind(dir.path(), 64);
    let sub = dir.path().join("overlays");
    std::fs::create_dir(&sub).unwrap();
    let ov = sub.join("ov.pcow");
    let rig = Rig::open(&top);
    let w = |rig: &Rig, model: &mut Vec<u8>, off: u64, seed: u64, n: usize| {
        let d = pattern(seed, n);
        rig.write(off, &d);
        model[off as usize..off as usize + n].copy_from_slice(&d);
    };
    // Before: into base data, shared top data, holes.
    for (i, c) in [1u64, 20, 40, 50, 60].into_iter().enumerate() {
        w(&rig, &mut model, c * K64 + 100, 10 + i as u64, 5000);
    }
    // A snapshot first: its history is mapped private from the old top,
    // which the overlay then keeps as a base.
    rig.region.snapshot_create("before").unwrap();
    let at_snapshot = model.clone();
    w(&rig, &mut model, 20 * K64 + 100, 30, 100);
    rig.region.barrier().unwrap();
    let info = rig.region.overlay(&ov).expect("overlay");
    let top_view = model.clone();
    // Another directory: the base is named by its absolute path.
    assert_eq!(
        PathBuf::from(&info.base),
        top.canonicalize().unwrap(),
        "absolute base name"
    );
    assert_eq!(base_name(&ov).as_deref(), Some(info.base.as_str()));
    let top_bytes = std::fs::read(&top).unwrap();
    // After: every kind again, page-crossing writes, a barrier, a snapshot
    // of the overlay, more writes.
    for (i, c) in [1u64, 2, 20, 21, 40, 41, 50, 60, 63]
        .into_iter()
        .enumerate()
    {
        w(&rig, &mut model, c * K64 - 3, 20 + i as u64, 9000);
    }
    rig.region.barrier().unwrap();
    assert_eq!(std::fs::read(&top).unwrap(), top_bytes, "base unchanged");
    rig.region.snapshot_create("after-overlay").unwrap();
    w(&rig, &mut model, 21 * K64, 40, 3 * K64 as usize);
    rig.region.barrier().unwrap();
    same(&rig.read(0, model.len()), &model, "region");
    let st = rig.status();
    assert_eq!(st.chain.len(), 3);
    rig.close();
    assert_eq!(std::fs::read(&top).unwrap(), top_bytes, "base unchanged");
    same(&reopen_read(&top), &top_view, "base view");
    same(&reopen_read(&ov), &model, "overlay view");
    check_clean(&top);
    check_clean(&ov);
    // The snapshot, on a copy (rolling back a base would change its
    // overlay's view).
    let copy = dir.path().join("top-copy.pcow");
    std::fs::copy(&top, &copy).unwrap();
    let mut img = Image::open(&copy, OpenOptions::read_write()).unwrap();
    assert_eq!(img.snapshots().len(), 1);
    img.snapshot_apply("before").unwrap();
    let mut v = vec![0u8; model.len()];
    img.read_at(&mut v, 0).unwrap();
    same(&v, &at_snapshot, "the base's snapshot");
    drop(img);
    // Reopen the overlay as a device: it shows everything; more writes.
    let rig = Rig::open(&ov);
    same(&rig.read(0, model.len()), &model, "reopened region");
    w(&rig, &mut model, 5 * K64 + 7, 50, 200);
    w(&rig, &mut model, 55 * K64 + 7, 51, 200);
    rig.region.barrier().unwrap();
    rig.close();
    same(&reopen_read(&ov), &model, "overlay reopened twice");
    assert_eq!(std::fs::read(&top).unwrap(), top_bytes, "base unchanged");
}

#[test]
fn refused_and_failed_overlays_leave_the_device_on_its_image() {
    if !uffd_or_skip("refused_and_failed_overlays_leave_the_device_on_its_image") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The image lives so deep that its absolute path is longer than a base
    // name may be (1023 bytes): an overlay elsewhere fails in the library
    // after the image was closed, which exercises the reopen.
    let mut deep = dir.path().to_path_buf();
    for i in 0..6 {
        deep.push(format!("{i}{}", "d".repeat(199)));
    }
    std::fs::create_dir_all(&deep).unwrap();
    let (top, mut model) = chain_with_every_kind(&deep, 32);
    let rig = Rig::open(&top);
    let d = pattern(3, 3 * K64 as usize);
    rig.write(4 * K64, &d);
    model[4 * K64 as usize..7 * K64 as usize].copy_from_slice(&d);

    // Refused before anything changes: an existing file, a missing
    // directory.
    let existing = dir.path().join("exists.pcow");
    std::fs::write(&existing, b"precious").unwrap();
    let e = rig.region.overlay(&existing).unwrap_err();
    assert!(matches!(e, OverlayError::Exists { .. }), "{e:?}");
    assert_eq!(std::fs::read(&existing).unwrap(), b"precious");
    let e = rig
        .region
        .overlay(&dir.path().join("no/such/dir/ov.pcow"))
        .unwrap_err();
    assert!(matches!(e, OverlayError::Path { .. }), "{e:?}");

    // Fails after the close: the old image is reopened.
    let ov = dir.path().join("ov.pcow");
    let e = rig.region.overlay(&ov).unwrap_err();
    eprintln!("failed overlay: {}", chain(&e));
    assert!(matches!(e, OverlayError::Image { .. }), "{e:?}");
    assert!(!ov.exists(), "the half-made overlay is removed");
    let st = rig.status();
    assert_eq!((st.overlays, st.detached.clone()), (0, None));
    assert_eq!(st.chain.len(), 2);
    same(
        &rig.read(0, model.len()),
        &model,
        "region after the failure",
    );
    // The device goes on: faults, barriers.
    for c in [0u64, 9, 20, 31] {
        let d = pattern(100 + c, 777);
        rig.write(c * K64 + 3, &d);
        model[(c * K64 + 3) as usize..][..777].copy_from_slice(&d);
    }
    rig.region.barrier().unwrap();
    same(&rig.read(0, model.len()), &model, "region");
    // ... and a later overlay (same directory) works.
    let ov_ok = deep.join("ov.pcow");
    let info = rig.region.overlay(&ov_ok).expect("overlay");
    assert_eq!(info.base, "top.pcow");
    let at_overlay = model.clone();
    rig.write(30 * K64, b"after");
    model[30 * K64 as usize..][..5].copy_from_slice(b"after");
    rig.region.barrier().unwrap();
    rig.close();
    same(&reopen_read(&ov_ok), &model, "overlay");
    same(&reopen_read(&top), &at_overlay, "top");
    check_clean(&top);
    check_clean(&ov_ok);
}

/// Waits until no refill is in flight.
fn wait_idle(rig: &Rig) {
    let t = Instant::now();
    while rig.status().pool.in_flight {
        assert!(t.elapsed() < Duration::from_secs(10), "refill stuck");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Waits until the pool is full (the worker's refill was taken).
fn wait_pool_full(rig: &Rig) -> Status {
    common::wait_pool_full(&rig.region)
}

#[test]
fn with_the_worker_write_faults_never_allocate_inline() {
    if !uffd_or_skip("with_the_worker_write_faults_never_allocate_inline") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.pcow");
    const N: u64 = 1024;
    create(&path, N * K64, K64, None).close().unwrap();
    let rig = Rig::open(&path);
    assert!(rig.status().pool.worker);
    let st = wait_pool_full(&rig);
    assert_eq!(st.pool.pool_clusters, 64, "the default 4 MiB pool");
    assert_eq!(st.pool.refills, 1, "filled by the worker after the open");
    let mut model = vec![0u8; (N * K64) as usize];
    // Bursts of 12 faults (a refill is asked for after 16 clusters are
    // used: the pool never runs dry if the worker finishes in between).
    for burst in 0..N / 12 {
        for c in burst * 12..(burst + 1) * 12 {
            let d = [c as u8 | 1, 2, 3];
            rig.write(c * K64 + 9, &d);
            model[(c * K64 + 9) as usize..][..3].copy_from_slice(&d);
        }
        wait_idle(&rig);
    }
    let st = rig.status();
    eprintln!("{:?}", st.pool);
    let done = N / 12 * 12;
    assert_eq!(st.faults.write_faults, done);
    assert_eq!(st.pool.inline_allocations, 0, "{:?}", st.pool);
    assert!(st.pool.refills >= done / 32, "{:?}", st.pool);
    assert_eq!(st.pool_error, None);
    rig.region.barrier().unwrap();
    rig.close();
    same(&reopen_read(&path), &model, "reopened");
    check_clean(&path);

    // Without the worker, the same faults refill inline every 64 clusters.
    let path2 = dir.path().join("inline.pcow");
    create(&path2, N * K64, K64, None).close().unwrap();
    let rig = Rig::open_with(&path2, &RegionOptions::default(), &PoolOptions::inline());
    for c in 0..N {
        rig.write(c * K64, &[1]);
    }
    let st = rig.status();
    assert!(!st.pool.worker);
    assert!(st.pool.inline_allocations >= N / 64, "{:?}", st.pool);
    rig.close();
    check_clean(&path2);
}

/// A write fault that finds the pool dry while the worker refills it
/// waits for the worker's next piece instead of growing the file itself
/// (on tmpfs a 2 MiB piece is hundreds of microseconds of page allocation,
/// so back-to-back faults outrun the worker), and the pool deepens, up to
/// four times its configured size. Before, every other fault here grew the
/// file inline while the worker's refill, reserved whole and only then
/// taken, came back stale.
#[test]
fn a_fault_that_finds_the_pool_dry_waits_for_the_workers_next_piece() {
    let name = "a_fault_that_finds_the_pool_dry_waits_for_the_workers_next_piece";
    if !uffd_or_skip(name) {
        return;
    }
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("SKIPPED {name}: no /dev/shm");
        return;
    };
    const M2: u64 = 2 << 20;
    const N: u64 = 32;
    let path = dir.path().join("dry.pcow");
    create(&path, N * M2, M2, None).close().unwrap();
    let opts = RegionOptions {
        pool_clusters: Some(1),
        ..RegionOptions::default()
    };
    let rig = Rig::open_with(&path, &opts, &PoolOptions::default());
    let st = wait_pool_full(&rig);
    assert_eq!(st.pool.pool_clusters, 1);
    let model = write_into_each_cluster(&rig, N, M2, 300, |c| [c as u8 | 0x80, 0x11]);
    let st = rig.status();
    eprintln!("{:?}", st.pool);
    assert_eq!(st.faults.write_faults, N);
    assert_eq!(st.faults.fallbacks, 0);
    assert!(st.pool.piece_waits > 0, "{:?}", st.pool);
    // A worker that gets no CPU for 10 ms lets a fault grow the file
    // itself: rare, never half of them.
    assert!(st.pool.inline_allocations <= N / 8, "{:?}", st.pool);
    assert_eq!(
        st.pool.pool_clusters, 4,
        "deepened to 4 times: {:?}",
        st.pool
    );
    assert_eq!(st.pool_error, None);
    rig.region.barrier().unwrap();
    rig.close();
    same(&reopen_read(&path), &model, "reopened");
    check_clean(&path);
}

/// The default pool of a 1 GiB device with 2 MiB clusters holds 64 of
/// them, so a burst of 63 first writes, one byte into each cluster, and
/// the meta cluster their entries need find a reserved cluster every
/// time, however slow the worker is: none waits for it or grows the file
/// itself. With the old default (64 MiB: 32 clusters) a third of such a
/// burst found the pool dry: on tmpfs a 2 MiB reservation takes 0.35 ms,
/// a write fault about 0.06 ms.
#[test]
fn a_burst_of_first_writes_as_deep_as_the_default_pool_never_waits_for_the_worker() {
    let name = "a_burst_of_first_writes_as_deep_as_the_default_pool_never_waits_for_the_worker";
    if !uffd_or_skip(name) {
        return;
    }
    const M2: u64 = 2 << 20;
    const SIZE: u64 = 1 << 30;
    const N: u64 = virtio_pmem_pcow::DEFAULT_POOL_MIN_CLUSTERS - 1;
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let path = dir.path().join("burst.pcow");
    create(&path, SIZE, M2, None).close().unwrap();
    let rig = Rig::open_with(&path, &RegionOptions::default(), &PoolOptions::default());
    let st = wait_pool_full(&rig);
    assert_eq!(
        st.pool.pool_clusters,
        virtio_pmem_pcow::DEFAULT_POOL_MIN_CLUSTERS,
        "{:?}",
        st.pool
    );
    // Every 16th cluster, as a file system's metadata lies over a device.
    let at = |c: u64| c * 8 * M2 + 4096 + c;
    for c in 0..N {
        rig.write(at(c), &[c as u8 | 0x40]);
    }
    let st = rig.status();
    eprintln!("{:?}", st.pool);
    assert_eq!(st.faults.write_faults, N);
    assert_eq!(st.pool.piece_waits, 0, "{:?}", st.pool);
    assert_eq!(st.pool.inline_allocations, 0, "{:?}", st.pool);
    assert_eq!(st.pool_error, None);
    rig.region.barrier().unwrap();
    rig.close();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    for c in 0..N {
        let mut b = [0u8; 2];
        img.read_at(&mut b, at(c)).unwrap();
        assert_eq!(b, [c as u8 | 0x40, 0], "cluster {}", c * 8);
    }
    drop(img);
    check_clean(&path);
}

/// After a fault the monitor keeps reading its userfaultfd for a while
/// (`RegionOptions::fault_poll`): faults read while it polls are resolved
/// like any other, and a zero window never polls.
#[test]
fn the_monitor_reads_a_bursts_faults_while_it_polls() {
    if !uffd_or_skip("the_monitor_reads_a_bursts_faults_while_it_polls") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    const N: u64 = 256;
    for (name, window) in [
        ("polls", Duration::from_millis(2)),
        ("never", Duration::ZERO),
    ] {
        let path = dir.path().join(format!("{name}.pcow"));
        create(&path, N * K64, K64, None).close().unwrap();
        let opts = RegionOptions {
            fault_poll: Some(window),
            ..one_cluster_per_fault()
        };
        let rig = Rig::open_with(&path, &opts, &PoolOptions::default());
        wait_pool_full(&rig);
        let model = write_into_each_cluster(&rig, N, K64, 4000, |c| [c as u8 | 1, 0x5a]);
        let st = rig.status();
        eprintln!("{name}: {:?}", st.faults);
        assert_eq!(st.faults.write_faults, N, "{name}");
        // How many faults a window catches depends on the scheduler (one
        // CI run of the debug build caught none of 256, while local runs
        // catch about half): only the zero window's count is asserted.
        // The bench reports the counts of the release build.
        if window.is_zero() {
            assert_eq!(st.faults.polled, 0, "{name}");
        }
        rig.region.barrier().unwrap();
        rig.close();
        same(&reopen_read(&path), &model, name);
        check_clean(&path);
    }
}

/// Expansion latency (first write into a hole) with and without the
/// worker, side by side: tmpfs, 64 KiB clusters, a 4 MiB pool.
/// Reported, not asserted.
#[test]
fn expansion_latency_with_and_without_the_worker() {
    if !uffd_or_skip("expansion_latency_with_and_without_the_worker") {
        return;
    }
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("SKIPPED expansion_latency_with_and_without_the_worker: no /dev/shm");
        return;
    };
    const N: u64 = 4096;
    // `fill`: after each first write, the writer fills the rest of the
    // cluster (as a guest writing data does), which gives the worker time.
    let run = |name: &str, pool: &PoolOptions, fill: bool| {
        let path = dir.path().join(format!("{name}.pcow"));
        create(&path, N * K64, K64, None).close().unwrap();
        let opts = RegionOptions {
            pool_clusters: Some(4 * 1024 * 1024 / K64),
            ..RegionOptions::default()
        };
        let rig = Rig::open_with(&path, &opts, pool);
        if pool.worker {
            wait_pool_full(&rig);
        }
        let (base, len) = (rig.base(), rig.region.len());
        let mut v: Vec<f64> = (0..N)
            .map(|c| {
                let t = Instant::now();
                gwrite(base, len, c * K64 + 100, &[7]);
                let us = t.elapsed().as_secs_f64() * 1e6;
                if fill {
                    gwrite(base, len, c * K64 + 4096, &[5u8; (K64 - 4096) as usize]);
                }
                us
            })
            .collect();
        let st = rig.status();
        rig.close();
        v.sort_by(|a, b| a.total_cmp(b));
        let p = |q: usize| v[(v.len() * q / 100).min(v.len() - 1)];
        eprintln!(
            "{name}: expansion p50 {:.1} us p99 {:.1} us max {:.1} us; {} inline \
             allocations, {} refills by the worker",
            p(50),
            p(99),
            v[v.len() - 1],
            st.pool.inline_allocations,
            st.pool.refills
        );
        (p(99), st.pool.inline_allocations)
    };
    for fill in [false, true] {
        let what = if fill {
            "filling each cluster"
        } else {
            "back to back"
        };
        let (inline99, inline_n) = run(&format!("inline, {what}"), &PoolOptions::inline(), fill);
        let (worker99, worker_n) = run(&format!("worker, {what}"), &PoolOptions::default(), fill);
        eprintln!(
            "tmpfs 64 KiB clusters, 4 MiB pool, {N} faults {what}: p99 inline \
             {inline99:.1} us, with the worker {worker99:.1} us"
        );
        assert!(inline_n >= N / 64);
        assert!(worker_n < inline_n);
    }
}

#[test]
fn a_full_disk_is_reported_and_nothing_is_lost_once_space_is_freed() {
    if !uffd_or_skip("a_full_disk_is_reported_and_nothing_is_lost_once_space_is_freed") {
        return;
    }
    let fs = match SmallFs::mount("8M") {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!(
                "SKIPPED a_full_disk_is_reported_and_nothing_is_lost_once_space_is_freed: {e}"
            );
            return;
        }
    };
    let path = fs.path().join("full.pcow");
    const N: u64 = 512; // 32 MiB of clusters on an 8 MiB file system
    create(&path, N * K64, K64, None).close().unwrap();
    let rig = Rig::open(&path);
    let mut model = vec![0u8; (N * K64) as usize];
    for c in 0..N {
        let d = [c as u8 | 1; 3];
        rig.write(c * K64 + 11, &d);
        model[(c * K64 + 11) as usize..][..3].copy_from_slice(&d);
    }
    // Let the last refill come back.
    std::thread::sleep(Duration::from_millis(50));
    let st = rig.status();
    eprintln!(
        "full disk: {} write faults, {} fallbacks, pool {:?}, error {:?}",
        st.faults.write_faults, st.faults.fallbacks, st.pool, st.pool_error
    );
    assert!(st.faults.fallbacks > 0, "{st:?}");
    assert!(st.faults.write_faults > 0 && st.faults.write_faults < N);
    let err = st.pool_error.clone().expect("pool_error set");
    assert!(err.is_out_of_space(), "{}", chain(&err));
    assert!(
        chain(&err).contains("No space left on device"),
        "{}",
        chain(&err)
    );
    // The guest still sees its writes (the fallback clusters hold them in
    // private memory) ...
    same(&rig.read(0, model.len()), &model, "region on a full disk");
    // The region says why (a VMM pauses the guest on it) ...
    let why = rig
        .region
        .out_of_space()
        .unwrap()
        .expect("out_of_space set");
    assert!(why.is_out_of_space(), "{}", chain(&why));
    assert!(
        chain(&why).contains("No space left on device"),
        "{}",
        chain(&why)
    );
    assert_eq!(st.out_of_space, Some(why));
    // ... a barrier cannot move them into the image: an error, not a
    // crash, and the device keeps running.
    let e = rig.region.barrier().unwrap_err();
    eprintln!("barrier on a full disk: {}", chain(&e));
    assert!(virtio_pmem_pcow::is_out_of_space(&e), "{}", chain(&e));
    rig.write(0, b"still");
    model[..5].copy_from_slice(b"still");
    assert_eq!(rig.read(0, 5), b"still");
    // The image on disk is consistent meanwhile.
    let r = pcow::check::check(&path, None, true).unwrap();
    assert!(r.corruptions.is_empty(), "{:?}", r.corruptions);
    // While the disk is full, space cannot be reserved again (a VMM keeps
    // the guest paused on it) and the condition stays.
    let e = rig.region.reserve_space().unwrap_err();
    assert!(virtio_pmem_pcow::is_out_of_space(&e), "{}", chain(&e));
    assert!(rig.region.out_of_space().unwrap().is_some());
    // Space is freed: the pool can be reserved again, the next barrier
    // moves everything the guest wrote while the disk was full (also what
    // the failed barrier had harvested), and the condition clears.
    fs.grow("64M").unwrap();
    rig.region
        .reserve_space()
        .expect("reserve after space was freed");
    let s = rig.region.barrier().expect("barrier after space was freed");
    eprintln!("barrier after space was freed: {s:?}");
    assert_eq!(rig.region.out_of_space().unwrap(), None);
    rig.close();
    same(&view_forced(&path), &model, "image after space was freed");
    check_clean(&path);
    drop(fs);
}

#[test]
fn the_worker_restarts_on_the_overlay() {
    if !uffd_or_skip("the_worker_restarts_on_the_overlay") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.pcow");
    let ov = dir.path().join("b.pcow");
    create(&path, 256 * K64, K64, None).close().unwrap();
    let rig = Rig::open(&path);
    wait_pool_full(&rig);
    // Paced like the writes after the overlay: unpaced, a starved worker
    // let the pool run dry here (one inline allocation, then its refill
    // came back stale), which is the designed fallback, not what this test
    // is about.
    for c in 0..100 {
        rig.write(c * K64, &[1]);
        if c % 12 == 0 {
            wait_idle(&rig);
        }
    }
    rig.region.overlay(&ov).unwrap();
    let st = wait_pool_full(&rig);
    assert!(st.pool.worker);
    for c in 100..200 {
        rig.write(c * K64, &[2]);
        if c % 12 == 0 {
            wait_idle(&rig);
        }
    }
    let st = rig.status();
    assert_eq!(st.pool.inline_allocations, 0, "{:?}", st.pool);
    assert_eq!(st.pool_error, None);
    rig.region.barrier().unwrap();
    rig.close();
    let v = reopen_read(&ov);
    for c in 0..200u64 {
        assert_eq!(v[(c * K64) as usize], if c < 100 { 1 } else { 2 });
    }
    check_clean(&path);
    check_clean(&ov);
}

/// Writes `data(c)` at byte `at` of each of the first `n` clusters of
/// `cs` bytes (a first write into each: one fault apiece); the model of
/// the region afterwards.
fn write_into_each_cluster(
    rig: &Rig,
    n: u64,
    cs: u64,
    at: u64,
    data: impl Fn(u64) -> [u8; 2],
) -> Vec<u8> {
    let mut model = vec![0u8; (n * cs) as usize];
    for c in 0..n {
        let d = data(c);
        rig.write(c * cs + at, &d);
        model[(c * cs + at) as usize..][..2].copy_from_slice(&d);
    }
    model
}

/// On a full tmpfs a store through a mapping into a page that needs
/// allocating declines (the populate fails; no SIGBUS at the store), so
/// the barrier's and the commit's writes fall back to `pwrite`, which
/// reports ENOSPC; pages already allocated still take the store.
#[test]
fn on_a_full_tmpfs_a_store_through_a_mapping_declines_instead_of_raising_sigbus() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let test = "on_a_full_tmpfs_a_store_through_a_mapping_declines_instead_of_raising_sigbus";
    let fs = match SmallFs::mount("1M") {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            return;
        }
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(fs.path().join("f"))
        .unwrap();
    f.set_len(4 << 20).unwrap();
    // Fill the file system: the first 1 MiB of the file is allocated.
    pcow::io::allocate_file(&f, 0, 1 << 20).unwrap();
    let r = pcow::io::allocate_file(&f, 1 << 20, 4096);
    assert!(r.is_err(), "more than 1 MiB fit into a 1 MiB tmpfs");
    f.write_all_at(&[1; 4096], 0).unwrap();
    let data = [9u8; 4096];
    let fd = f.as_raw_fd();
    // SAFETY: `data` is valid for reads of its length; nothing shrinks
    // the file.
    let stored = unsafe { pcow::io::store_through_mapping(fd, data.as_ptr(), 4096, 3 << 20) };
    assert!(!stored, "a store into a page tmpfs has no room for");
    let e = f.write_all_at(&data, 3 << 20).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
    // SAFETY: as above.
    assert!(unsafe { pcow::io::store_through_mapping(fd, data.as_ptr(), 4096, 0) });
    let mut back = [0u8; 4096];
    f.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(back, data);
    drop(f);
    drop(fs);
}
