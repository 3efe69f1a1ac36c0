//! Clones of and resets to a frozen image (a VM snapshot's pmem content):
//! the happy paths read back through the library and checked, and every
//! refusal shown to change nothing (the directory listed and every file
//! hashed before and after).

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};

use pcow::{
    create_clone, reset_to_frozen, BaseFormat, BaseRef, CreateOptions, FileIdentity, FrozenError,
    Image, OpenOptions,
};

const K64: u64 = 64 << 10;
const SIZE: u64 = 16 * K64;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn create(path: &Path, base: Option<&str>) -> Image {
    Image::create(
        path,
        &CreateOptions {
            cluster_size: Some(K64),
            virtual_size: Some(SIZE),
            base: base.map(|b| BaseRef {
                name: b.into(),
                format: BaseFormat::Pcow,
            }),
        },
    )
    .expect("create")
}

fn view(path: &Path) -> Vec<u8> {
    let img = Image::open(path, OpenOptions::read_only()).expect("open");
    let mut v = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut v, 0).expect("read");
    v
}

fn base_name(path: &Path) -> Option<String> {
    let img = Image::open(
        path,
        OpenOptions {
            skip_base: true,
            ..OpenOptions::read_only()
        },
    )
    .expect("open");
    img.base_ref().map(|b| b.name.clone())
}

#[track_caller]
fn check_clean(path: &Path) {
    let r = pcow::check::check(path, None, false).expect("check");
    assert!(r.is_clean(), "{}: {r:?}", path.display());
}

/// Every entry of `dir` (links not followed) with a hash of its content.
fn listing(dir: &Path) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let mut h = DefaultHasher::new();
        if e.file_type().unwrap().is_file() {
            std::fs::read(e.path()).unwrap().hash(&mut h);
        } else {
            format!("{:?}", e.file_type().unwrap()).hash(&mut h);
        }
        m.insert(e.file_name().to_string_lossy().into_owned(), h.finish());
    }
    m
}

/// base.pcow (data) <- frozen.pcow (more data), the frozen image a VM
/// snapshot leaves; returns its path, identity and view.
fn frozen_chain(dir: &Path) -> (PathBuf, FileIdentity, Vec<u8>) {
    let mut b = create(&dir.join("base.pcow"), None);
    b.write_at(&pattern(1, (8 * K64) as usize), 0).unwrap();
    b.close().unwrap();
    let f = dir.join("frozen.pcow");
    let mut t = create(&f, Some("base.pcow"));
    t.write_at(&pattern(2, (4 * K64) as usize), 6 * K64)
        .unwrap();
    t.close().unwrap();
    let id = FileIdentity::of_path(&f).unwrap();
    let v = view(&f);
    (f, id, v)
}

#[test]
fn clones_share_the_frozen_image_and_never_change_it() {
    let dir = tempfile::tempdir().unwrap();
    let (f, id, frozen_view) = frozen_chain(dir.path());
    let c1 = dir.path().join("clone1.pcow");
    let other = dir.path().join("elsewhere");
    std::fs::create_dir(&other).unwrap();
    let c2 = other.join("clone2.pcow");
    create_clone(&f, &id, &c1).expect("clone 1");
    create_clone(&f, &id, &c2).expect("clone 2");
    assert_eq!(base_name(&c1).as_deref(), Some("frozen.pcow"));
    let abs = f.canonicalize().unwrap();
    assert_eq!(base_name(&c2).as_deref(), abs.to_str());
    assert_eq!(view(&c1), frozen_view);
    assert_eq!(view(&c2), frozen_view);
    // Both clones open for writing at once (they only share-lock F).
    let mut w1 = Image::open(&c1, OpenOptions::read_write()).unwrap();
    let mut w2 = Image::open(&c2, OpenOptions::read_write()).unwrap();
    w1.write_at(b"one", 7 * K64).unwrap();
    w2.write_at(b"two", 7 * K64).unwrap();
    w1.close().unwrap();
    w2.close().unwrap();
    assert_eq!(&view(&c1)[(7 * K64) as usize..][..3], b"one");
    assert_eq!(&view(&c2)[(7 * K64) as usize..][..3], b"two");
    assert_eq!(view(&f), frozen_view);
    assert_eq!(FileIdentity::of_path(&f).unwrap(), id, "F untouched");
    for p in [&f, &c1, &c2] {
        check_clean(p);
    }
}

#[test]
fn refused_clones_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (f, id, _) = frozen_chain(dir.path());
    let clone = dir.path().join("clone.pcow");
    let refuse = |frozen: &Path, expect: &FileIdentity, clone: &Path| {
        let before = listing(dir.path());
        let e = create_clone(frozen, expect, clone).unwrap_err();
        eprintln!("refused: {}", error_report::chain(&e));
        assert_eq!(listing(dir.path()), before, "nothing changed");
        e
    };

    // The clone's path exists: a file, a dangling link.
    std::fs::write(&clone, b"precious").unwrap();
    let e = refuse(&f, &id, &clone);
    assert!(matches!(e, FrozenError::Exists { .. }), "{e:?}");
    std::fs::remove_file(&clone).unwrap();
    std::os::unix::fs::symlink("nowhere", &clone).unwrap();
    let e = refuse(&f, &id, &clone);
    assert!(matches!(e, FrozenError::Exists { .. }), "{e:?}");
    std::fs::remove_file(&clone).unwrap();

    // Not a pcow image.
    let raw = dir.path().join("raw.img");
    std::fs::write(&raw, vec![0u8; 4096]).unwrap();
    let raw_id = FileIdentity::of_path(&raw).unwrap();
    let e = refuse(&raw, &raw_id, &clone);
    assert!(matches!(e, FrozenError::NotPcow { .. }), "{e:?}");

    // Open for writing by a "process" (another open file description).
    let writer = Image::open(&f, OpenOptions::read_write_deferred()).unwrap();
    let e = refuse(&f, &id, &clone);
    assert!(matches!(e, FrozenError::FrozenLocked { .. }), "{e:?}");
    drop(writer);
    assert_eq!(FileIdentity::of_path(&f).unwrap(), id);

    // Changed since the snapshot: touched, then replaced by a copy.
    let file = std::fs::File::options().write(true).open(&f).unwrap();
    let t = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
    file.set_modified(t).unwrap();
    drop(file);
    let e = refuse(&f, &id, &clone);
    assert!(matches!(e, FrozenError::IdentityChanged { .. }), "{e:?}");
    let copy = dir.path().join("copy.pcow");
    std::fs::copy(&f, &copy).unwrap();
    std::fs::rename(&copy, &f).unwrap();
    let e = refuse(&f, &id, &clone);
    assert!(matches!(e, FrozenError::IdentityChanged { .. }), "{e:?}");
    // ... and with the right identity the same call works.
    let now = FileIdentity::of_path(&f).unwrap();
    create_clone(&f, &now, &clone).expect("clone");
    check_clean(&clone);
}

/// frozen_chain, then X: an overlay over frozen.pcow written past the
/// snapshot.
fn source_top(dir: &Path) -> (PathBuf, PathBuf, FileIdentity, Vec<u8>) {
    let (f, id, frozen_view) = frozen_chain(dir);
    let x = dir.join("disk.pcow");
    let mut t = create(&x, Some("frozen.pcow"));
    t.write_at(&pattern(3, (3 * K64) as usize), 12 * K64)
        .unwrap();
    t.close().unwrap();
    assert_ne!(view(&x), frozen_view);
    (x, f, id, frozen_view)
}

#[test]
fn reset_puts_the_image_back_to_the_frozen_content() {
    let dir = tempfile::tempdir().unwrap();
    let (x, f, id, frozen_view) = source_top(dir.path());
    let old_ino = FileIdentity::of_path(&x).unwrap();
    // A temporary a crashed reset left, and one of another image.
    let stale = dir.path().join(".disk.pcow.reset-99999.tmp");
    std::fs::write(&stale, b"stale").unwrap();
    let unrelated = dir.path().join(".other.pcow.reset-99999.tmp");
    std::fs::write(&unrelated, b"other").unwrap();

    let info = reset_to_frozen(&x, &f, &id).expect("reset");
    eprintln!("{info:?}");
    assert_eq!(info.base, "frozen.pcow");
    assert_eq!(info.discarded_clusters, 3);
    assert!(info.discarded_bytes >= 3 * K64);
    assert!(info.dropped_layers.is_empty());
    assert!(!FileIdentity::of_path(&x).unwrap().same_file(&old_ino));
    assert_eq!(view(&x), frozen_view);
    assert_eq!(base_name(&x).as_deref(), Some("frozen.pcow"));
    assert_eq!(FileIdentity::of_path(&f).unwrap(), id, "F untouched");
    assert!(!stale.exists(), "the stale temporary is removed");
    assert!(unrelated.exists(), "another image's temporary stays");
    check_clean(&x);
    check_clean(&f);
    let names: Vec<String> = listing(dir.path()).into_keys().collect();
    assert_eq!(
        names,
        [
            ".other.pcow.reset-99999.tmp",
            "base.pcow",
            "disk.pcow",
            "frozen.pcow"
        ]
    );

    // Through a symbolic link: the file it leads to is reset, the link
    // stays.
    let link = dir.path().join("link.pcow");
    std::os::unix::fs::symlink("disk.pcow", &link).unwrap();
    let mut w = Image::open(&link, OpenOptions::read_write()).unwrap();
    w.write_at(b"past", 0).unwrap();
    w.close().unwrap();
    let info = reset_to_frozen(&link, &f, &id).expect("reset through a link");
    assert_eq!(info.image, x.canonicalize().unwrap());
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(view(&link), frozen_view);
    std::fs::remove_file(&link).unwrap();

    // A second level between X and F: it leaves the chain.
    let mid = dir.path().join("mid.pcow");
    std::fs::rename(&x, &mid).unwrap();
    let mut t = create(&x, Some("mid.pcow"));
    t.write_at(b"later", 0).unwrap();
    t.close().unwrap();
    let info = reset_to_frozen(&x, &f, &id).expect("reset over two levels");
    assert_eq!(info.dropped_layers, vec![mid.canonicalize().unwrap()]);
    assert_eq!(view(&x), frozen_view);
    check_clean(&x);
}

#[test]
fn refused_resets_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (x, f, id, _) = source_top(dir.path());
    let x_view = view(&x);
    let refuse = |image: &Path, frozen: &Path, expect: &FileIdentity| {
        let before = listing(dir.path());
        let e = reset_to_frozen(image, frozen, expect).unwrap_err();
        eprintln!("refused: {}", error_report::chain(&e));
        assert_eq!(listing(dir.path()), before, "nothing changed");
        e
    };

    // The source VM still runs on X.
    let vm = Image::open(&x, OpenOptions::read_write()).unwrap();
    let e = refuse(&x, &f, &id);
    assert!(matches!(e, FrozenError::InUse { .. }), "{e:?}");
    assert!(e.to_string().contains("clone"), "{e}");
    vm.close().unwrap();

    // X's chain does not contain F: another image, and F's base.
    let lone = dir.path().join("lone.pcow");
    create(&lone, None).close().unwrap();
    let e = refuse(&lone, &f, &id);
    assert!(matches!(e, FrozenError::NotInChain { .. }), "{e:?}");
    let e = refuse(&dir.path().join("base.pcow"), &f, &id);
    assert!(matches!(e, FrozenError::NotInChain { .. }), "{e:?}");
    let e = refuse(&f, &f, &id);
    assert!(matches!(e, FrozenError::NotInChain { .. }), "{e:?}");

    // Not pcow images.
    let raw = dir.path().join("raw.img");
    std::fs::write(&raw, vec![0u8; 4096]).unwrap();
    let raw_id = FileIdentity::of_path(&raw).unwrap();
    let e = refuse(&raw, &f, &id);
    assert!(matches!(e, FrozenError::NotPcow { .. }), "{e:?}");
    let e = refuse(&x, &raw, &raw_id);
    assert!(matches!(e, FrozenError::NotPcow { .. }), "{e:?}");

    // F changed since the snapshot.
    let file = std::fs::File::options().write(true).open(&f).unwrap();
    let t = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
    file.set_modified(t).unwrap();
    drop(file);
    let e = refuse(&x, &f, &id);
    assert!(matches!(e, FrozenError::IdentityChanged { .. }), "{e:?}");

    assert_eq!(view(&x), x_view);
    check_clean(&x);
}

#[test]
fn reset_takes_the_image_of_a_killed_vm() {
    let dir = tempfile::tempdir().unwrap();
    let (x, f, id, frozen_view) = source_top(dir.path());
    // A VM that was killed: X open for writing (DIRTY on disk, a pool
    // past the committed end), data written, never closed; its lock goes
    // with the process (released here through a second handle on the
    // same open file description).
    let mut vm = Image::open(&x, OpenOptions::read_write()).unwrap();
    vm.write_at(b"unflushed", 2 * K64).unwrap();
    vm.flush().unwrap();
    vm.write_at(b"lost", 3 * K64).unwrap();
    let handle = vm.file().unwrap().try_clone().unwrap();
    std::mem::forget(vm);
    handle.unlock().unwrap();
    let dirty = pcow::check::check(&x, None, false).unwrap();
    assert!(
        !dirty.is_clean(),
        "the killed VM's image is DIRTY: {dirty:?}"
    );
    let info = reset_to_frozen(&x, &f, &id).expect("reset");
    assert!(info.discarded_clusters >= 4, "{info:?}");
    assert_eq!(view(&x), frozen_view);
    check_clean(&x);
    assert_eq!(FileIdentity::of_path(&f).unwrap(), id);
}
