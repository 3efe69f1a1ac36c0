//! The staged commit (`begin_commit`, `Commit::write`, `finish_commit` /
//! `abort_commit`) on real files: what changes while a commit is in flight
//! belongs to the next one, an abort loses nothing, and metadata writes
//! are refused while a commit is pending. Crash points of the staged path
//! are covered in `crash.rs` (`crash_staged_commit_*`).

use std::path::{Path, PathBuf};

use pcow::{CreateOptions, Error, Image, OpenOptions};

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

#[test]
fn changes_during_a_commit_belong_to_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let (path, mut img) = create(dir.path());
    img.write_at(&[1; 8192], 0).unwrap();
    img.snapshot_create("s").unwrap();
    img.write_at(&[2; 4096], CS).unwrap();
    let staged = view(&img);
    let mut c = img.begin_commit().unwrap().expect("changes to commit");
    // A fault's work while the commit is in flight: a cluster allocated
    // (pages recorded in it), and a page recorded over snapshot data.
    let ac = img.active_cluster(3).unwrap();
    assert!(ac.fresh);
    img.write_at(&[3; 4096], 3 * CS).unwrap();
    img.write_at(&[4; 100], 4096).unwrap();
    let clusters_before = img.allocated_clusters();
    c.write().unwrap();
    img.write_at(&[5; 10], 5 * CS).unwrap();
    img.finish_commit(c).unwrap();
    let later = view(&img);
    assert_ne!(later, staged);

    // The committed generation is the view as staged at begin.
    let (committed, clusters) = crash_view(&path);
    assert!(
        committed == staged,
        "the commit holds changes made after begin"
    );
    assert!(
        clusters < clusters_before,
        "clusters allocated after begin committed"
    );

    // The next barrier commits the rest.
    img.flush().unwrap();
    let (committed, _) = crash_view(&path);
    assert!(committed == later, "changes made during a commit were lost");
    img.close().unwrap();
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
    let c = img.begin_commit().unwrap().expect("changes to commit");
    img.write_at(&[4; 4096], 6 * CS).unwrap();
    img.abort_commit(c).unwrap();
    assert_eq!(img.generation(), gen + 1, "an abort committed something");
    assert!(crash_view(&path).0 == before);
    // Written but never synced: the next barrier must rewrite it all.
    img.flush().unwrap();
    let all = view(&img);
    assert!(crash_view(&path).0 == all);
    img.close().unwrap();
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
    let mut c = img.begin_commit().unwrap().expect("changes to commit");
    assert!(img.commit_pending());
    let pending = |r: pcow::Result<()>| matches!(r, Err(Error::CommitPending { .. }));
    assert!(pending(img.flush()));
    assert!(pending(img.begin_commit().map(drop)));
    assert!(pending(img.snapshot_create("t").map(drop)));
    assert!(pending(img.snapshot_apply("s").map(drop)));
    assert!(pending(img.snapshot_delete("s").map(drop)));
    assert!(pending(img.grow(2 * VS)));
    assert!(pending(
        img.preallocate(pcow::Preallocation::Falloc).map(drop)
    ));
    // Data writes go on.
    img.write_at(&[3; 4096], CS).unwrap();
    c.write().unwrap();
    img.finish_commit(c).unwrap();
    assert!(!img.commit_pending());
    img.snapshot_create("t").unwrap();
    img.flush().unwrap();
    assert_eq!(img.snapshots().len(), 2);
    img.close().unwrap();
}

#[test]
fn nothing_to_commit_is_none_and_a_stale_commit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (path, mut img) = create(dir.path());
    assert!(img.begin_commit().unwrap().is_none());
    img.write_at(&[1; 10], 0).unwrap();
    let mut c = img.begin_commit().unwrap().expect("changes to commit");
    c.write().unwrap();
    img.finish_commit(c).unwrap();
    assert!(img.begin_commit().unwrap().is_none());

    // A commit of another image is not this one's.
    let other_path = dir.path().join("other.pcow");
    let opts = CreateOptions {
        cluster_size: Some(CS),
        virtual_size: Some(VS),
        ..Default::default()
    };
    let mut other = Image::create(&other_path, &opts).unwrap();
    other.write_at(&[9; 10], 0).unwrap();
    let foreign = other.begin_commit().unwrap().expect("changes to commit");
    img.write_at(&[2; 10], 0).unwrap();
    let mine = img.begin_commit().unwrap().expect("changes to commit");
    assert!(matches!(
        img.finish_commit(foreign),
        Err(Error::CommitNotPending { .. })
    ));
    assert!(img.commit_pending(), "a foreign commit settled ours");
    // Finishing a commit that was not written aborts it.
    assert!(matches!(
        img.finish_commit(mine),
        Err(Error::CommitUnwritten { .. })
    ));
    img.flush().unwrap();
    img.close().unwrap();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    let mut b = [0u8; 10];
    img.read_at(&mut b, 0).unwrap();
    assert_eq!(b, [2; 10]);
}

#[test]
fn closing_with_a_commit_in_flight_cancels_it() {
    let dir = tempfile::tempdir().unwrap();
    let (path, mut img) = create(dir.path());
    img.write_at(&[7; 4096], 0).unwrap();
    let mut c = img.begin_commit().unwrap().expect("changes to commit");
    img.close().unwrap();
    assert!(matches!(c.write(), Err(Error::CommitCancelled { .. })));
    // The handle shares the file, and with it the lock.
    drop(c);
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert!(pcow::check::report(&img).is_clean());
    let mut b = [0u8; 4096];
    img.read_at(&mut b, 0).unwrap();
    assert_eq!(b, [7; 4096], "close lost the cancelled commit's writes");
}

#[test]
fn a_commit_is_written_from_another_thread() {
    let dir = tempfile::tempdir().unwrap();
    let (path, mut img) = create(dir.path());
    img.write_at(&[8; 4096], CS).unwrap();
    let mut c = img.begin_commit().unwrap().expect("changes to commit");
    let c = std::thread::spawn(move || {
        c.write().unwrap();
        c
    })
    .join()
    .unwrap();
    img.finish_commit(c).unwrap();
    let (committed, _) = crash_view(&path);
    assert_eq!(committed[CS as usize..CS as usize + 4096], [8; 4096]);
    img.close().unwrap();
}
