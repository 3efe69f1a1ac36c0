//! The staged commit (`LiveImage::begin_commit`, `Commit::write`,
//! `finish_commit` / `abort_commit`) on real files, with writes made as a
//! device makes them (a cluster from `active_cluster`, the page written
//! into the file, `record_pages`): what changes while a commit is in flight
//! belongs to the next one, an abort loses nothing, and metadata writes
//! are refused while a commit is pending. Crash points of the staged path
//! are covered in `crash.rs` (`crash_staged_commit_*`).

use std::path::{Path, PathBuf};

use std::os::unix::fs::FileExt;

use pcow::{CreateOptions, Error, Image, LiveImage, OpenOptions};

const CS: u64 = 64 << 10;
const VS: u64 = 4 << 20;

fn create(dir: &Path) -> (PathBuf, Image) {
    let path = dir.join("img.pcow");
    let opts = CreateOptions {
        cluster_size: Some(CS),
        virtual_size: Some(VS),
        ..Default::default()
    };
    let img = Image::create(&path, &opts).unwrap();
    (path, img)
}

/// Opens a copy of the file as it is now, as a crash at this point would
/// leave it; checks it has no corruption and returns its view.
fn crash_view(path: &Path) -> (Vec<u8>, u64) {
    let copy = path.with_extension("copy");
    std::fs::copy(path, &copy).unwrap();
    let opts = OpenOptions {
        lenient: true,
        force_share: true,
        ..OpenOptions::default()
    };
    let img = Image::open(&copy, opts).unwrap();
    let r = pcow::check::report(&img);
    assert!(r.corruptions.is_empty(), "corruption: {:?}", r.corruptions);
    let mut buf = vec![0u8; VS as usize];
    img.read_at(&mut buf, 0).unwrap();
    let clusters = img.allocated_clusters();
    drop(img);
    // A writer that opens it repairs the residue and leaves it clean.
    Image::open(&copy, OpenOptions::read_write())
        .unwrap()
        .close()
        .unwrap();
    let img = Image::open(&copy, OpenOptions::read_only()).unwrap();
    let r = pcow::check::report(&img);
    assert!(r.is_clean(), "not clean: {:?} {:?}", r.corruptions, r.leaks);
    let mut again = vec![0u8; VS as usize];
    img.read_at(&mut again, 0).unwrap();
    assert_eq!(again, buf, "a writer's repair changed the view");
    (buf, clusters)
}

fn view(img: &Image) -> Vec<u8> {
    let mut buf = vec![0u8; VS as usize];
    img.read_at(&mut buf, 0).unwrap();
    buf
}

/// Writes page `page` of virtual cluster `vcn` as a device does: into the
/// active layer's cluster in the file, then recorded.
fn device_write(live: &mut LiveImage, vcn: u64, page: usize, byte: u8) {
    let ac = live.active_cluster(vcn).unwrap();
    let at = ac.file_offset + page as u64 * 4096;
    live.chain_files()[0]
        .write_all_at(&[byte; 4096], at)
        .unwrap();
    live.record_pages(vcn, page, 1).unwrap();
    live.mark_data_written();
}

fn page_of(v: &[u8], vcn: u64, page: usize) -> &[u8] {
    let at = (vcn * CS) as usize + page * 4096;
    &v[at..at + 4096]
}

#[test]
fn changes_during_a_commit_belong_to_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let (path, mut img) = create(dir.path());
    img.write_at(&[1; 8192], 0).unwrap();
    img.snapshot_create("s").unwrap();
    img.write_at(&[2; 4096], CS).unwrap();
    // Cluster 0 of the active layer holds page 0 only; page 1 is the
    // snapshot's.
    img.write_at(&[7; 10], 0).unwrap();
    let mut live = LiveImage::new(img).unwrap();
    let staged = view(&live);
    let mut c = live.begin_commit().unwrap().expect("changes to commit");
    // A fault's work while the commit is in flight: a cluster allocated
    // with a page recorded in it, a page recorded over snapshot data in a
    // cluster the commit covers, a page written in place.
    assert!(live.active_cluster(3).unwrap().fresh);
    device_write(&mut live, 3, 0, 3);
    device_write(&mut live, 0, 1, 4);
    device_write(&mut live, 1, 2, 6);
    let clusters_before = live.allocated_clusters();
    c.write().unwrap();
    device_write(&mut live, 5, 0, 5);
    live.finish_commit(c).unwrap();
    let later = view(&live);
    assert_eq!(page_of(&later, 3, 0), [3; 4096]);
    assert_eq!(page_of(&later, 0, 1), [4; 4096]);
    assert_eq!(page_of(&later, 1, 2), [6; 4096]);
    assert_eq!(page_of(&later, 5, 0), [5; 4096]);

    // The committed generation is the view as staged at begin: the new
    // clusters and the recorded page are not in it. Data written in place
    // into a cluster it holds is not versioned: that page may show either.
    let (mut committed, clusters) = crash_view(&path);
    let in_place = page_of(&committed, 1, 2).to_vec();
    assert!(in_place == page_of(&staged, 1, 2) || in_place == [6; 4096]);
    let at = (CS + 2 * 4096) as usize;
    committed[at..at + 4096].copy_from_slice(page_of(&staged, 1, 2));
    assert_eq!(
        page_of(&committed, 0, 1),
        [1; 4096],
        "a page recorded after begin"
    );
    assert!(
        committed == staged,
        "the commit holds changes made after begin"
    );
    assert!(
        clusters < clusters_before,
        "clusters allocated after begin committed"
    );

    // The next barrier commits the rest.
    live.flush().unwrap();
    let (committed, _) = crash_view(&path);
    assert!(committed == later, "changes made during a commit were lost");
    live.close().unwrap();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(pcow::check::report(&img).is_clean());
    assert!(view(&img) == later);
}

#[test]
fn an_aborted_commit_is_committed_by_the_next_barrier() {
    let dir = tempfile::tempdir().unwrap();
    let (path, mut img) = create(dir.path());
    img.write_at(&[1; 4096], 0).unwrap();
    img.flush().unwrap();
    let gen = img.generation();
    img.write_at(&[2; 4096], 2 * CS).unwrap();
    img.snapshot_create("s").unwrap();
    img.write_at(&[3; 50], 10).unwrap();
    let before = crash_view(&path).0;
    let mut live = LiveImage::new(img).unwrap();
    let c = live.begin_commit().unwrap().expect("changes to commit");
    device_write(&mut live, 6, 3, 4);
    live.abort_commit(c).unwrap();
    assert_eq!(live.generation(), gen + 1, "an abort committed something");
    assert!(crash_view(&path).0 == before);
    // Written but never synced: the next barrier must rewrite it all.
    live.flush().unwrap();
    let all = view(&live);
    assert_eq!(page_of(&all, 6, 3), [4; 4096]);
    assert_eq!(all[10..60], [3; 50]);
    assert!(crash_view(&path).0 == all);
    live.close().unwrap();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(pcow::check::report(&img).is_clean());
    assert!(view(&img) == all);
}

#[test]
fn metadata_writes_are_refused_while_a_commit_is_pending() {
    let dir = tempfile::tempdir().unwrap();
    let (_path, mut img) = create(dir.path());
    img.write_at(&[1; 4096], 0).unwrap();
    img.snapshot_create("s").unwrap();
    img.write_at(&[2; 4096], 0).unwrap();
    let mut live = LiveImage::new(img).unwrap();
    let mut c = live.begin_commit().unwrap().expect("changes to commit");
    assert!(live.commit_pending());
    let pending = |r: pcow::Result<()>| matches!(r, Err(Error::CommitPending { .. }));
    assert!(pending(live.flush()));
    assert!(pending(live.begin_commit().map(drop)));
    assert!(pending(live.snapshot_create("t").map(drop)));
    assert!(pending(live.snapshot_delete("s").map(drop)));
    // The image's other metadata changes, on the image itself.
    let mut img = live.into_image();
    assert!(pending(img.snapshot_apply("s").map(drop)));
    assert!(pending(img.grow(2 * VS)));
    assert!(pending(
        img.preallocate(pcow::Preallocation::Falloc).map(drop)
    ));
    // Data writes go on.
    img.write_at(&[3; 4096], CS).unwrap();
    let mut live = LiveImage::new(img).unwrap();
    device_write(&mut live, 4, 0, 9);
    c.write().unwrap();
    live.finish_commit(c).unwrap();
    assert!(!live.commit_pending());
    live.snapshot_create("t").unwrap();
    live.flush().unwrap();
    assert_eq!(live.snapshots().len(), 2);
    live.close().unwrap();
}

#[test]
fn nothing_to_commit_is_none_and_a_stale_commit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (path, img) = create(dir.path());
    let mut live = LiveImage::new(img).unwrap();
    assert!(live.begin_commit().unwrap().is_none());
    device_write(&mut live, 0, 0, 1);
    let mut c = live.begin_commit().unwrap().expect("changes to commit");
    c.write().unwrap();
    live.finish_commit(c).unwrap();
    assert!(live.begin_commit().unwrap().is_none());

    // A commit of another image is not this one's.
    let other_path = dir.path().join("other.pcow");
    let opts = CreateOptions {
        cluster_size: Some(CS),
        virtual_size: Some(VS),
        ..Default::default()
    };
    let mut other = LiveImage::new(Image::create(&other_path, &opts).unwrap()).unwrap();
    device_write(&mut other, 0, 0, 9);
    let foreign = other.begin_commit().unwrap().expect("changes to commit");
    device_write(&mut live, 0, 0, 2);
    let mine = live.begin_commit().unwrap().expect("changes to commit");
    assert!(matches!(
        live.finish_commit(foreign),
        Err(Error::CommitNotPending { .. })
    ));
    assert!(live.commit_pending(), "a foreign commit settled ours");
    // Finishing a commit that was not written aborts it.
    assert!(matches!(
        live.finish_commit(mine),
        Err(Error::CommitUnwritten { .. })
    ));
    assert!(!live.commit_pending());
    live.flush().unwrap();
    live.close().unwrap();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(pcow::check::report(&img).is_clean());
    assert_eq!(page_of(&view(&img), 0, 0), [2; 4096]);
}

#[test]
fn a_cancelled_commit_stays_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let (path, img) = create(dir.path());
    let mut live = LiveImage::new(img).unwrap();
    device_write(&mut live, 1, 0, 7);
    let mut c = live.begin_commit().unwrap().expect("changes to commit");
    // Closing cancels the commit; the handle's write is refused and stays
    // refused.
    let img = live.into_image();
    img.close().unwrap();
    assert!(matches!(c.write(), Err(Error::CommitCancelled { .. })));
    assert!(matches!(c.write(), Err(Error::CommitCancelled { .. })));
    drop(c);
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(pcow::check::report(&img).is_clean());
    assert_eq!(page_of(&view(&img), 1, 0), [7; 4096]);
}

#[test]
fn closing_with_a_commit_in_flight_cancels_it() {
    let dir = tempfile::tempdir().unwrap();
    let (path, img) = create(dir.path());
    let mut live = LiveImage::new(img).unwrap();
    device_write(&mut live, 0, 0, 7);
    let mut c = live.begin_commit().unwrap().expect("changes to commit");
    live.close().unwrap();
    assert!(matches!(c.write(), Err(Error::CommitCancelled { .. })));
    // The handle shares the file, and with it the lock.
    drop(c);
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(pcow::check::report(&img).is_clean());
    assert_eq!(
        page_of(&view(&img), 0, 0),
        [7; 4096],
        "close lost the cancelled commit's writes"
    );
}

#[test]
fn closing_after_the_write_publishes_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let (path, img) = create(dir.path());
    let mut live = LiveImage::new(img).unwrap();
    device_write(&mut live, 2, 1, 8);
    let mut c = live.begin_commit().unwrap().expect("changes to commit");
    c.write().unwrap();
    // Never handed back: closing must take the written header as
    // committed, not write the same generation again over it.
    live.close().unwrap();
    drop(c);
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(pcow::check::report(&img).is_clean());
    assert_eq!(page_of(&view(&img), 2, 1), [8; 4096]);
}

#[test]
fn a_commit_is_written_from_another_thread() {
    let dir = tempfile::tempdir().unwrap();
    let (path, img) = create(dir.path());
    let mut live = LiveImage::new(img).unwrap();
    device_write(&mut live, 1, 0, 8);
    let mut c = live.begin_commit().unwrap().expect("changes to commit");
    let c = std::thread::spawn(move || {
        c.write().unwrap();
        c
    })
    .join()
    .unwrap();
    live.finish_commit(c).unwrap();
    let (committed, _) = crash_view(&path);
    assert_eq!(page_of(&committed, 1, 0), [8; 4096]);
    live.close().unwrap();
}

#[test]
fn a_read_only_image_is_not_live() {
    let dir = tempfile::tempdir().unwrap();
    let (path, img) = create(dir.path());
    img.close().unwrap();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(matches!(LiveImage::new(img), Err(Error::ReadOnly { .. })));
}

#[test]
fn a_dropped_commit_does_not_block_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let (path, img) = create(dir.path());
    let mut live = LiveImage::new(img).unwrap();
    let gen = live.generation();
    // Dropped before its write: undone, the next barrier commits it all.
    device_write(&mut live, 1, 0, 1);
    let c = live.begin_commit().unwrap().expect("changes to commit");
    assert!(live.commit_pending());
    drop(c);
    assert!(!live.commit_pending());
    live.flush().unwrap();
    assert_eq!(live.generation(), gen + 1);
    assert_eq!(page_of(&crash_view(&path).0, 1, 0), [1; 4096]);
    // Dropped after its write: it is durable, so it is published, and the
    // next barrier takes the next generation.
    device_write(&mut live, 2, 0, 2);
    let mut c = live.begin_commit().unwrap().expect("changes to commit");
    c.write().unwrap();
    drop(c);
    device_write(&mut live, 3, 0, 3);
    live.flush().unwrap();
    assert_eq!(live.generation(), gen + 3);
    let committed = crash_view(&path).0;
    assert_eq!(page_of(&committed, 2, 0), [2; 4096]);
    assert_eq!(page_of(&committed, 3, 0), [3; 4096]);
    live.close().unwrap();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(pcow::check::report(&img).is_clean());
}

/// Staging does no I/O: the file is byte for byte what it was until the
/// commit writes (a device stages under its state lock, and a `pwrite`
/// there would make its faults wait for whatever holds the file's inode
/// lock, the pool worker's `fallocate`). The commit then writes the slots
/// and the header, and the image reopens with the changes.
#[test]
fn staging_writes_nothing_and_the_commit_writes_the_slots() {
    let dir = tempfile::tempdir().unwrap();
    let (path, mut img) = create(dir.path());
    img.write_at(&[1; 8192], 0).unwrap();
    img.snapshot_create("s").unwrap();
    let mut live = LiveImage::new(img).unwrap();
    // New metadata in the active layer's segment and a new layer's slot:
    // a whole cluster, and a page over the snapshot's data.
    device_write(&mut live, 2, 0, 9);
    device_write(&mut live, 0, 1, 8);
    let before = std::fs::read(&path).unwrap();
    let mut c = live.begin_commit().unwrap().expect("changes to commit");
    assert!(
        std::fs::read(&path).unwrap() == before,
        "begin_commit wrote to the file"
    );
    c.write().unwrap();
    assert!(
        std::fs::read(&path).unwrap() != before,
        "the commit wrote nothing"
    );
    live.finish_commit(c).unwrap();
    let (committed, _) = crash_view(&path);
    assert_eq!(page_of(&committed, 2, 0), [9; 4096]);
    assert_eq!(page_of(&committed, 0, 1), [8; 4096]);
    assert_eq!(page_of(&committed, 0, 0), [1; 4096]);
    live.close().unwrap();
}

/// On tmpfs a commit told that an `fallocate` of the same file is in
/// flight (a device's pool worker reserving clusters) does not wait for
/// it: `fallocate` holds the inode lock for the whole call, and `pwrite`
/// waits for it, so the commit stores its slots and header through a
/// mapping instead.
#[test]
fn on_tmpfs_a_commit_beside_an_fallocate_does_not_wait_for_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let shm = Path::new("/dev/shm");
    let on_tmpfs = is_tmpfs(shm);
    if !on_tmpfs {
        eprintln!("skipped: /dev/shm is not tmpfs here");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let (path, mut img) = create(dir.path());
    img.write_at(&[1; 4096], 0).unwrap();
    img.flush().unwrap();
    img.write_at(&[2; 4096], 0).unwrap();
    img.flush().unwrap();
    let mut live = LiveImage::new(img).unwrap();
    device_write(&mut live, 0, 1, 3);
    device_write(&mut live, 5, 0, 4);
    let mut c = live.begin_commit().unwrap().expect("changes to commit");

    // 1 GiB beyond the image's end: about 0.2 s of zeroed pages here,
    // with the inode lock held throughout.
    let other = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let end = other.metadata().unwrap().len();
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    let reserver = std::thread::spawn(move || {
        let t = Instant::now();
        let r = pcow::io::allocate_file(&other, end, 1 << 30);
        d.store(true, Ordering::SeqCst);
        r.map(|()| t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        !done.load(Ordering::SeqCst),
        "the fallocate ended within 20 ms: too fast for this test"
    );
    c.beside_fallocate();
    let t = Instant::now();
    c.write().unwrap();
    let took = t.elapsed();
    let waited = done.load(Ordering::SeqCst);
    let reserving = reserver.join().unwrap().unwrap();
    // Waiting would have taken what was left of the reservation, well
    // over half of it; the `done` flag alone can be late.
    assert!(
        !waited && took * 2 < reserving,
        "the commit waited for the fallocate in flight ({took:?} of {reserving:?})"
    );
    live.finish_commit(c).unwrap();
    let (committed, _) = crash_view(&path);
    assert_eq!(page_of(&committed, 0, 0), [2; 4096]);
    assert_eq!(page_of(&committed, 0, 1), [3; 4096]);
    assert_eq!(page_of(&committed, 5, 0), [4; 4096]);
    live.close().unwrap();
}

fn is_tmpfs(p: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else {
        return false;
    };
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: statfs reads the NUL-terminated path and fills `st`.
    let r = unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) };
    // SAFETY: statfs succeeded, so it initialized `st`.
    r == 0 && unsafe { st.assume_init() }.f_type == libc::TMPFS_MAGIC
}
