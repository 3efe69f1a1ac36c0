//! Freezing a running device's top image for a VM snapshot, on real files
//! with a real userfaultfd and the monitor on its own thread: the content
//! through the mapping, the frozen file byte for byte (hashed) while the
//! guest goes on, refusals that change nothing, a failure after the link
//! that leaves the device on its image, and each state a crash can leave
//! on disk.

mod common;

use common::*;

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pcow::replace::{temp_name, TempPurpose};
use pcow::{BaseFormat, BaseRef, CreateOptions, FileIdentity, Image, OpenOptions};
use virtio_pmem_pcow::{
    fail_next_freeze, FreezeError, FreezeStep, PcowRegion, Quiesce, RegionOptions, WriteGate,
};

fn hash_file(path: &Path) -> u64 {
    let mut h = DefaultHasher::new();
    std::fs::read(path).unwrap().hash(&mut h);
    h.finish()
}

/// Every entry of `dir` with a hash of its content (a type for others).
fn listing(dir: &Path) -> BTreeMap<String, u64> {
    listing_beside(dir, None)
}

/// [`listing`], with the inode instead of the content for the image a
/// running device writes (its pool worker may extend it at any time).
fn listing_beside(dir: &Path, running: Option<&Path>) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        let h = if running.is_some_and(|r| r.file_name() == Some(&e.file_name())) {
            FileIdentity::of_path(&e.path()).unwrap().ino
        } else if t.is_file() {
            hash_file(&e.path())
        } else {
            let mut h = DefaultHasher::new();
            format!("{t:?}").hash(&mut h);
            h.finish()
        };
        m.insert(e.file_name().to_string_lossy().into_owned(), h);
    }
    m
}

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

/// base.pcow (first half written) <- disk.pcow (a quarter written): the
/// region starts with shared, private and hole clusters. Returns X and
/// the model of its view.
fn two_level(dir: &Path, clusters: u64) -> (PathBuf, Vec<u8>) {
    let size = clusters * K64;
    let mut model = vec![0u8; size as usize];
    let half = (size / 2) as usize;
    let mut b = create(&dir.join("base.pcow"), size, K64, None);
    let data = pattern(1, half);
    b.write_at(&data, 0).unwrap();
    model[..half].copy_from_slice(&data);
    b.close().unwrap();
    let x = dir.join("disk.pcow");
    let mut t = create(&x, size, K64, Some("base.pcow"));
    let (a, n) = ((size / 4) as usize, (size / 4) as usize);
    let data = pattern(2, n);
    t.write_at(&data, a as u64).unwrap();
    model[a..a + n].copy_from_slice(&data);
    t.close().unwrap();
    (x, model)
}

/// Writes through the region in every kind of cluster (shared, private
/// from the base, hole), unflushed.
fn scribble(rig: &Rig, model: &mut [u8], seed: u64) {
    let clusters = model.len() as u64 / K64;
    for c in [1, clusters / 2 - 1, clusters / 2 + 1, clusters - 2] {
        let off = c * K64 + 100 + seed;
        let d = pattern(seed * 100 + c, 5000);
        rig.write(off, &d);
        model[off as usize..][..d.len()].copy_from_slice(&d);
    }
}

fn canon(p: &Path) -> PathBuf {
    p.canonicalize().unwrap()
}

#[test]
fn a_freeze_keeps_the_content_and_later_writes_go_to_the_top_only() {
    if !uffd_or_skip("a_freeze_keeps_the_content_and_later_writes_go_to_the_top_only") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (x, mut model) = two_level(dir.path(), 64);
    let rig = Rig::open(&x, &RegionOptions::default()).expect("region");
    same(&rig.read(0, model.len()), &model, "region at open");
    scribble(&rig, &mut model, 1);
    let x_ino = FileIdentity::of_path(&x).unwrap();

    let f = dir.path().join("disk.pcow.snap-1");
    let info = rig.region.freeze(&f).expect("freeze");
    eprintln!("freeze: {info:?}");
    assert_eq!(info.frozen, canon(&f));
    assert_eq!(info.top, canon(&x));
    assert_eq!(info.identity, FileIdentity::of_path(&f).unwrap());
    assert!(info.identity.same_file(&x_ino), "F is X's old inode");
    assert!(!FileIdentity::of_path(&x).unwrap().same_file(&x_ino));
    assert!(info.barrier.private_pages > 0, "{:?}", info.barrier);
    let at_freeze = model.clone();
    same(&rig.read(0, model.len()), &model, "region after the freeze");
    let st = rig.region.status().unwrap();
    assert_eq!(
        st.chain.iter().map(|p| canon(p)).collect::<Vec<_>>(),
        [&x, &f, &dir.path().join("base.pcow")].map(|p| canon(p))
    );
    assert_eq!(st.detached, None);
    assert_eq!(base_name(&x).as_deref(), Some("disk.pcow.snap-1"));
    let names: Vec<String> = listing(dir.path()).into_keys().collect();
    assert_eq!(names, ["base.pcow", "disk.pcow", "disk.pcow.snap-1"]);
    // F is complete and clean while the device runs (shared locks).
    check_clean(&f);
    same(&reopen_read(&f), &at_freeze, "F's view");
    let f_hash = hash_file(&f);

    // The guest goes on: everything it writes goes to X.
    scribble(&rig, &mut model, 2);
    rig.region.barrier().unwrap();
    scribble(&rig, &mut model, 3);
    rig.region.barrier().unwrap();
    same(
        &rig.read(0, model.len()),
        &model,
        "region after more writes",
    );
    assert_eq!(hash_file(&f), f_hash, "F byte-identical");
    assert_eq!(FileIdentity::of_path(&f).unwrap(), info.identity);
    same(&reopen_read(&f), &at_freeze, "F's view after more writes");

    // A second freeze stacks one more level.
    let f2 = dir.path().join("disk.pcow.snap-2");
    let info2 = rig.region.freeze(&f2).expect("second freeze");
    let at_freeze2 = model.clone();
    scribble(&rig, &mut model, 4);
    rig.region.barrier().unwrap();
    assert_eq!(base_name(&f2).as_deref(), Some("disk.pcow.snap-1"));
    assert_eq!(rig.region.status().unwrap().chain_depth, 4);
    rig.close();
    same(&reopen_read(&x), &model, "X reopened");
    same(&reopen_read(&f2), &at_freeze2, "F2");
    same(&reopen_read(&f), &at_freeze, "F");
    assert_eq!(hash_file(&f), f_hash, "F byte-identical at the end");
    assert_eq!(FileIdentity::of_path(&f2).unwrap(), info2.identity);
    for p in [&x, &f, &f2, &dir.path().join("base.pcow")] {
        check_clean(p);
    }
}

#[test]
fn refused_freezes_change_nothing() {
    if !uffd_or_skip("refused_freezes_change_nothing") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (x, mut model) = two_level(dir.path(), 16);
    let other = tempfile::tempdir().unwrap();
    let rig = Rig::open(&x, &RegionOptions::default()).expect("region");
    scribble(&rig, &mut model, 1);
    rig.region.barrier().unwrap();
    let refuse = |f: &Path| {
        let before = listing_beside(dir.path(), Some(&x));
        let others = listing(other.path());
        let x_view = view_forced(&x);
        let e = rig.region.freeze(f).unwrap_err();
        eprintln!("refused: {}", error_report::chain(&e));
        assert_eq!(
            listing_beside(dir.path(), Some(&x)),
            before,
            "nothing changed"
        );
        assert_eq!(listing(other.path()), others);
        same(&view_forced(&x), &x_view, "X's content");
        e
    };
    let exists = dir.path().join("precious");
    std::fs::write(&exists, b"precious").unwrap();
    assert!(matches!(refuse(&exists), FreezeError::Exists { .. }));
    std::os::unix::fs::symlink("nowhere", dir.path().join("dangling")).unwrap();
    let e = refuse(&dir.path().join("dangling"));
    assert!(matches!(e, FreezeError::Exists { .. }), "{e:?}");
    let e = refuse(&x);
    assert!(matches!(e, FreezeError::Exists { .. }), "{e:?}");
    let e = refuse(&other.path().join("snap"));
    assert!(matches!(e, FreezeError::NotInImageDir { .. }), "{e:?}");
    let e = refuse(&dir.path().join("no/such/dir/snap"));
    assert!(matches!(e, FreezeError::Path { .. }), "{e:?}");
    let own_temp = temp_name(&canon(&x), TempPurpose::Freeze).unwrap();
    let e = refuse(&own_temp);
    assert!(matches!(e, FreezeError::BadName { .. }), "{e:?}");
    let e = refuse(&dir.path().join(".disk.pcow.reset-12.tmp"));
    assert!(matches!(e, FreezeError::BadName { .. }), "{e:?}");
    // The device goes on, and a freeze works.
    scribble(&rig, &mut model, 2);
    same(&rig.read(0, model.len()), &model, "region");
    let st = rig.region.status().unwrap();
    assert_eq!((st.chain_depth, st.detached), (2, None));
    rig.region.freeze(&dir.path().join("ok")).expect("freeze");
    rig.close();
    same(&reopen_read(&x), &model, "X");
}

#[test]
fn a_chain_at_the_depth_limit_is_refused() {
    if !uffd_or_skip("a_chain_at_the_depth_limit_is_refused") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let limit = pcow::format::MAX_CHAIN_DEPTH;
    let mut prev: Option<String> = None;
    for i in 0..limit {
        let name = format!("l{i:02}.pcow");
        let mut img = create(&dir.path().join(&name), 4 * K64, K64, prev.as_deref());
        img.write_at(&[i as u8 + 1], i as u64 * 100).unwrap();
        img.close().unwrap();
        prev = Some(name);
    }
    let top = dir.path().join(prev.unwrap());
    let rig = Rig::open(&top, &RegionOptions::default()).expect("region");
    assert_eq!(rig.region.status().unwrap().chain_depth, limit);
    let before = listing_beside(dir.path(), Some(&top));
    let e = rig.region.freeze(&dir.path().join("snap")).unwrap_err();
    let msg = error_report::chain(&e);
    eprintln!("refused: {msg}");
    assert!(matches!(e, FreezeError::ChainTooDeep { .. }), "{e:?}");
    assert!(msg.contains(&limit.to_string()) && msg.contains("pcow-img commit"));
    assert_eq!(listing_beside(dir.path(), Some(&top)), before);
    rig.write(5, b"x");
    rig.region.barrier().unwrap();
    rig.close();
    check_clean(&top);
}

#[test]
fn a_failure_after_the_link_leaves_the_device_on_its_image() {
    if !uffd_or_skip("a_failure_after_the_link_leaves_the_device_on_its_image") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (x, mut model) = two_level(dir.path(), 32);
    let rig = Rig::open(&x, &RegionOptions::default()).expect("region");
    scribble(&rig, &mut model, 1);
    let x_ino = FileIdentity::of_path(&x).unwrap();
    // Something that is not ours at the freeze's temporary name: creating
    // the overlay fails after the link (the stale-file cleanup leaves a
    // directory alone).
    let t = temp_name(&canon(&x), TempPurpose::Freeze).unwrap();
    std::fs::create_dir(&t).unwrap();
    let f = dir.path().join("snap");
    let e = rig.region.freeze(&f).unwrap_err();
    eprintln!("failed freeze: {}", error_report::chain(&e));
    assert!(matches!(e, FreezeError::Path { .. }), "{e:?}");
    assert!(!f.exists(), "the link is taken back");
    assert!(t.is_dir(), "what was not ours stays");
    assert!(FileIdentity::of_path(&x).unwrap().same_file(&x_ino));
    let st = rig.region.status().unwrap();
    assert_eq!((st.chain_depth, st.detached), (2, None));
    same(
        &rig.read(0, model.len()),
        &model,
        "region after the failure",
    );
    // The device goes on: faults, barriers, and a later freeze.
    scribble(&rig, &mut model, 2);
    rig.region.barrier().unwrap();
    std::fs::remove_dir(&t).unwrap();
    let at_freeze = model.clone();
    rig.region.freeze(&f).expect("freeze");
    scribble(&rig, &mut model, 3);
    rig.region.barrier().unwrap();
    rig.close();
    same(&reopen_read(&x), &model, "X");
    same(&reopen_read(&f), &at_freeze, "F");
    check_clean(&x);
    check_clean(&f);
}

/// Creates the freeze's overlay at `t` over `f` (as step 4 does) and
/// closes it.
fn overlay_at(t: &Path, f: &str, size: u64) {
    Image::create_new(
        t,
        &CreateOptions {
            cluster_size: Some(K64),
            virtual_size: Some(size),
            base: Some(BaseRef {
                name: f.into(),
                format: BaseFormat::Pcow,
            }),
        },
    )
    .expect("overlay")
    .close()
    .unwrap();
}

#[test]
fn every_state_a_crash_can_leave_opens_with_the_data() {
    if !uffd_or_skip("every_state_a_crash_can_leave_opens_with_the_data") {
        return;
    }
    // X as step 2 leaves it: closed after the barrier, with the data.
    let fresh = |dir: &Path| {
        let (x, mut model) = two_level(dir, 16);
        let mut img = Image::open(&x, OpenOptions::read_write()).unwrap();
        let d = pattern(9, 3000);
        img.write_at(&d, 3 * K64).unwrap();
        model[(3 * K64) as usize..][..d.len()].copy_from_slice(&d);
        img.close().unwrap();
        (x, model)
    };
    let size = 16 * K64;
    for state in ["after link", "T empty", "T made", "after rename"] {
        let dir = tempfile::tempdir().unwrap();
        let (x, model) = fresh(dir.path());
        let f = dir.path().join("snap");
        let t = temp_name(&canon(&x), TempPurpose::Freeze).unwrap();
        // The temporary of a process that died: another pid.
        let t_dead = dir.path().join(".disk.pcow.freeze-999999.tmp");
        std::fs::hard_link(&x, &f).unwrap();
        match state {
            "after link" => {}
            "T empty" => std::fs::write(&t_dead, b"").unwrap(),
            "T made" => {
                overlay_at(&t, "snap", size);
                std::fs::rename(&t, &t_dead).unwrap();
            }
            "after rename" => {
                overlay_at(&t, "snap", size);
                std::fs::rename(&t, &x).unwrap();
            }
            _ => unreachable!(),
        }
        eprintln!("{state}: {:?}", listing(dir.path()).keys());
        check_clean(&x);
        check_clean(&f);
        same(&reopen_read(&x), &model, state);
        same(&reopen_read(&f), &model, state);

        // The device runs on X again; its next freeze removes the stale
        // temporary and works.
        let rig = Rig::open(&x, &RegionOptions::default()).expect("region");
        same(&rig.read(0, model.len()), &model, state);
        let f2 = dir.path().join("snap2");
        rig.region.freeze(&f2).expect("freeze after the crash");
        rig.close();
        assert!(!t_dead.exists(), "{state}: stale temporary removed");
        let names: Vec<String> = listing(dir.path()).into_keys().collect();
        assert_eq!(
            names,
            ["base.pcow", "disk.pcow", "snap", "snap2"],
            "{state}"
        );
        same(&reopen_read(&x), &model, state);
        same(&reopen_read(&f2), &model, state);
        check_clean(&x);
        check_clean(&f2);
    }
}

/// The cost of a freeze follows what was written, not the image's size:
/// a 1 GiB and a 16 GiB thin image with the same written set (16 MiB in
/// the top, 4 MiB of unflushed writes) freeze in about the same time,
/// and no file grows with the size.
#[test]
fn freeze_cost_does_not_grow_with_the_virtual_size() {
    if !uffd_or_skip("freeze_cost_does_not_grow_with_the_virtual_size") {
        return;
    }
    let mut lines = Vec::new();
    let mut sizes = Vec::new();
    for gib in [1u64, 16] {
        let dir = tempfile::tempdir().unwrap();
        let x = dir.path().join("disk.pcow");
        let size = gib << 30;
        let mut img = create(&x, size, K64, None);
        img.write_at(&pattern(1, 16 << 20), 0).unwrap();
        img.close().unwrap();
        // A small pool: the file's length below is then what the image
        // holds, not the pool's reserve (which deepens, up to 4x, when
        // faults outrun its worker on a loaded machine).
        let opts = RegionOptions {
            pool_clusters: Some(16),
            ..RegionOptions::default()
        };
        let rig = Rig::open(&x, &opts).expect("region");
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        // 4 MiB of unflushed writes, same offsets for both sizes.
        let dirty = |i: u64| {
            for p in 0..1024u64 {
                rig.write(p * 16 * PAGE + i % 4000, &[i as u8 + 1]);
            }
        };
        let (mut freeze, mut rest, mut barrier, mut found) = (vec![], vec![], vec![], 0);
        for i in 0..7u64 {
            dirty(2 * i);
            let t = Instant::now();
            rig.region.barrier().expect("barrier");
            barrier.push(ms(t.elapsed()));
            dirty(2 * i + 1);
            let t = Instant::now();
            let info = rig
                .region
                .freeze(&dir.path().join(format!("snap{i}")))
                .expect("freeze");
            freeze.push(ms(t.elapsed()));
            let b = &info.barrier;
            rest.push(ms(info.held) - ms(b.scan + b.copy + b.commit));
            found = b.private_pages;
        }
        lines.push(format!(
            "{gib:>2} GiB: freeze {:.2} ms, of which {:.2} ms besides its barrier; a plain \
             barrier of the same writes {:.2} ms ({found} pages found; medians of 7)",
            median(freeze),
            median(rest),
            median(barrier)
        ));
        let top_len = std::fs::metadata(&x).unwrap().len();
        sizes.push((
            std::fs::metadata(dir.path().join("snap0")).unwrap().len(),
            top_len,
        ));
        rig.close();
    }
    for l in &lines {
        eprintln!("{l}");
    }
    assert_eq!(
        sizes[0].0, sizes[1].0,
        "F holds what was written: {sizes:?}"
    );
    assert!(
        sizes[1].1 < 64 << 20,
        "the 16 GiB top stays thin: {sizes:?}"
    );
}

/// Records the log length at each hold: the state a freeze captured.
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

fn replay(model0: &[u8], log: &[(u64, u8)]) -> Vec<u8> {
    let mut m = model0.to_vec();
    for &(off, v) in log {
        m[off as usize] = v;
    }
    m
}

#[test]
fn freezes_taken_while_writers_run_capture_exactly_the_held_state() {
    if !uffd_or_skip("freezes_taken_while_writers_run_capture_exactly_the_held_state") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (x, model0) = two_level(dir.path(), 128);
    let gate = Arc::new(WriteGate::new());
    let log = Arc::new(Mutex::new(Vec::new()));
    let marking = Arc::new(MarkingGate {
        gate: gate.clone(),
        log: log.clone(),
        marks: Mutex::new(Vec::new()),
    });
    let (region, monitor) =
        PcowRegion::open(&x, marking.clone(), &RegionOptions::default()).expect("region");
    let monitor = serve(monitor);
    let (base, len) = (region.host_addr() as usize, region.len());
    let stop = Arc::new(AtomicBool::new(false));
    let threads = 3u64;
    let slots = len / 512;
    let writers: Vec<_> = (0..threads)
        .map(|t| {
            let (gate, stop, log) = (gate.clone(), stop.clone(), log.clone());
            std::thread::spawn(move || {
                let (mut n, mut r) = (0u64, t + 1);
                while !stop.load(Ordering::Relaxed) || n < 200 {
                    r = r
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let s = (r >> 33) % (slots / threads) * threads + t;
                    let off = s * 512 + (r >> 20) % 500;
                    let v = (r >> 56) as u8 | 1;
                    let _in = gate.enter();
                    gwrite(base, len, off, &[v]);
                    log.lock().unwrap().push((off, v));
                    n += 1;
                }
                n
            })
        })
        .collect();
    let (f1, f2) = (dir.path().join("snap1"), dir.path().join("snap2"));
    std::thread::sleep(Duration::from_millis(200));
    let i1 = region.freeze(&f1).expect("freeze 1");
    std::thread::sleep(Duration::from_millis(200));
    region.barrier().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let i2 = region.freeze(&f2).expect("freeze 2");
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let writes: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum();
    region.barrier().unwrap();
    let marks = marking.marks.lock().unwrap().clone();
    let log = log.lock().unwrap().clone();
    eprintln!(
        "{writes} writes; freeze 1 held {:?}, freeze 2 held {:?}; marks {marks:?}",
        i1.held, i2.held
    );
    assert_eq!(marks.len(), 4, "holds: freeze, barrier, freeze, barrier");
    assert!(
        marks[0] > 0 && marks[0] < marks[2] && marks[2] < log.len(),
        "writers ran around both freezes: {marks:?} of {}",
        log.len()
    );
    let now = replay(&model0, &log);
    same(&gread(base, len, 0, now.len()), &now, "region");
    let at1 = replay(&model0, &log[..marks[0]]);
    let at2 = replay(&model0, &log[..marks[2]]);
    same(&reopen_read(&f1), &at1, "F1 while running");
    same(&reopen_read(&f2), &at2, "F2 while running");
    monitor.stop();
    drop(region);
    same(&reopen_read(&x), &now, "X reopened");
    same(&reopen_read(&f1), &at1, "F1");
    same(&reopen_read(&f2), &at2, "F2");
    assert_eq!(FileIdentity::of_path(&f1).unwrap(), i1.identity);
    assert_eq!(FileIdentity::of_path(&f2).unwrap(), i2.identity);
    for p in [&x, &f1, &f2] {
        check_clean(p);
    }
}

#[test]
fn a_failure_at_each_step_leaves_the_device_on_its_image() {
    if !uffd_or_skip("a_failure_at_each_step_leaves_the_device_on_its_image") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (x, mut model) = two_level(dir.path(), 32);
    let rig = Rig::open(&x, &RegionOptions::default()).expect("region");
    let x_ino = FileIdentity::of_path(&x).unwrap();
    let f = dir.path().join("snap");
    let steps = [
        FreezeStep::Linked,
        FreezeStep::Created,
        FreezeStep::Remapped,
        FreezeStep::Renamed,
    ];
    for (i, step) in steps.into_iter().enumerate() {
        scribble(&rig, &mut model, i as u64 + 1);
        let shared_before = rig.region.status().unwrap().shared;
        assert!(shared_before > 0, "the freeze has ranges to remap");
        fail_next_freeze(step);
        let e = rig.region.freeze(&f).unwrap_err();
        eprintln!("{step:?}: {}", error_report::chain(&e));
        assert!(matches!(e, FreezeError::Path { .. }), "{step:?}: {e:?}");
        let names: Vec<String> = listing(dir.path()).into_keys().collect();
        assert_eq!(names, ["base.pcow", "disk.pcow"], "{step:?}: F and T gone");
        assert!(
            FileIdentity::of_path(&x).unwrap().same_file(&x_ino),
            "{step:?}: X is the device's file"
        );
        let st = rig.region.status().unwrap();
        assert_eq!((st.chain_depth, st.detached), (2, None), "{step:?}");
        assert!(
            st.shared >= shared_before,
            "{step:?}: remapped ranges mapped shared again ({} < {shared_before})",
            st.shared
        );
        same(
            &rig.read(0, model.len()),
            &model,
            "region after the failure",
        );
        // The device goes on: faults and barriers into X.
        scribble(&rig, &mut model, 10 + i as u64);
        rig.region.barrier().unwrap();
        same(&view_forced(&x), &model, "X after the failure");
    }
    let at_freeze = model.clone();
    let info = rig.region.freeze(&f).expect("freeze");
    assert!(info.identity.same_file(&x_ino));
    scribble(&rig, &mut model, 20);
    rig.region.barrier().unwrap();
    rig.close();
    same(&reopen_read(&x), &model, "X");
    same(&reopen_read(&f), &at_freeze, "F");
    check_clean(&x);
    check_clean(&f);
}
