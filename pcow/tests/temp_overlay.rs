//! Temporary overlays (`Image::create_temporary`): writes land in an
//! unlinked file, the base chain is never written and is held under shared
//! locks, and nothing is left in the directory after a close or a SIGKILL.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;
use pcow::{BaseFormat, Error, Image, OpenOptions, TempOptions};

const MIB: u64 = 1 << 20;

/// A pcow base with data in its first cluster, over a raw file: a chain
/// of two.
fn chain(dir: &Path) -> PathBuf {
    let raw = dir.join("bottom.raw");
    let mut bytes = vec![0u8; 4 * MIB as usize];
    bytes[3 * MIB as usize..3 * MIB as usize + 4].copy_from_slice(b"RAW!");
    std::fs::write(&raw, bytes).unwrap();
    let base = dir.join("base.pcow");
    let mut img = overlay(&base, "bottom.raw", BaseFormat::Raw, 64 << 10);
    img.write_at(b"BASE", 0).unwrap();
    img.close().unwrap();
    base
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn locked_for_writers(path: &Path) -> bool {
    match Image::open(path, OpenOptions::read_write()) {
        Err(Error::Locked { .. }) => true,
        Ok(_) => false,
        Err(e) => panic!("unexpected error opening {}: {e}", path.display()),
    }
}

/// Whether no process holds any lock on the file (a writer could open
/// it), found without opening it as an image (which would write it).
fn free(path: &Path) -> bool {
    let f = std::fs::File::open(path).unwrap();
    f.try_lock().is_ok()
}

/// The file's bytes, compared by value without printing them.
fn same_bytes(path: &Path, before: &[u8]) -> bool {
    std::fs::read(path).unwrap() == before
}

fn both_modes(f: impl Fn(bool)) {
    f(false);
    f(true);
}

#[test]
fn writes_stay_in_the_overlay_and_the_chain_is_untouched() {
    both_modes(|named| {
        let dir = tmp();
        let base = chain(dir.path());
        let before = std::fs::read(&base).unwrap();
        let raw_before = std::fs::read(dir.path().join("bottom.raw")).unwrap();
        let files = listing(dir.path());
        let opts = TempOptions { dir: None, named };
        let mut a = Image::create_temporary(&base, &opts).unwrap();
        let mut b = Image::create_temporary(&base, &opts).unwrap();
        assert!(a.is_temporary() && b.is_temporary());
        assert_eq!(a.virtual_size(), 4 * MIB);
        assert_eq!(a.cluster_size(), 64 << 10);
        // Nothing named in the directory while both are open.
        assert_eq!(listing(dir.path()), files, "named={named}");
        a.write_at(b"aaaa", 0).unwrap();
        b.write_at(b"bbbb", 0).unwrap();
        a.write_at(b"AAAA", 3 * MIB).unwrap();
        a.flush().unwrap();
        b.flush().unwrap();
        assert_eq!(read(&a, 0, 4), b"aaaa");
        assert_eq!(read(&b, 0, 4), b"bbbb");
        assert_eq!(read(&a, 3 * MIB, 4), b"AAAA");
        assert_eq!(read(&b, 3 * MIB, 4), b"RAW!");
        // The chain: the overlay (named as deleted), then the base's own.
        let paths = a.chain_paths();
        assert_eq!(paths.len(), 3);
        assert!(
            paths[0].to_string_lossy().ends_with(" (deleted)"),
            "{paths:?}"
        );
        assert!(paths[0].starts_with(dir.path().canonicalize().unwrap()));
        assert_eq!(paths[1], base.canonicalize().unwrap());
        // Readers may share the base, writers may not.
        assert!(locked_for_writers(&base));
        // The raw bottom of the chain is held shared too.
        assert!(matches!(
            pcow::RawImage::open(&dir.path().join("bottom.raw"), true, false),
            Err(Error::Locked { .. })
        ));
        drop(ro(&base));
        let report = pcow::check::check(&base, None, false).unwrap();
        assert!(report.is_clean(), "{report:?}");
        a.close().unwrap();
        assert!(locked_for_writers(&base), "b still holds the base");
        drop(b);
        assert!(free(&base));
        assert!(same_bytes(&base, &before));
        assert!(same_bytes(&dir.path().join("bottom.raw"), &raw_before));
        assert_eq!(listing(dir.path()), files);
    });
}

#[test]
fn a_raw_base_and_a_directory_of_ones_own() {
    let dir = tmp();
    let other = tmp();
    let raw = dir.path().join("disk.raw");
    // Not a whole cluster: the overlay rounds up and reads zeros past it.
    std::fs::write(&raw, vec![7u8; 100_000]).unwrap();
    let opts = TempOptions {
        dir: Some(other.path().to_owned()),
        named: false,
    };
    let mut t = Image::create_temporary(&raw, &opts).unwrap();
    assert_eq!(t.virtual_size(), 128 << 10);
    assert_eq!(read(&t, 99_998, 4), [7, 7, 0, 0]);
    t.write_at(&[1, 2, 3], 5).unwrap();
    assert_eq!(read(&t, 4, 5), [7, 1, 2, 3, 7]);
    assert!(t.chain_paths()[0].starts_with(other.path().canonicalize().unwrap()));
    assert!(matches!(
        pcow::RawImage::open(&raw, true, false),
        Err(Error::Locked { .. })
    ));
    drop(t);
    assert!(same_bytes(&raw, &[7u8; 100_000]));
    assert!(listing(other.path()).is_empty());
}

#[test]
fn refusals_name_what_is_wrong() {
    let dir = tmp();
    let base = chain(dir.path());
    // A writer holds the base: refused, and no file is left.
    let w = Image::open(&base, OpenOptions::read_write()).unwrap();
    let files = listing(dir.path());
    for named in [false, true] {
        let e = Image::create_temporary(&base, &TempOptions { dir: None, named }).unwrap_err();
        assert!(matches!(e, Error::Locked { .. }), "{e}");
        assert_eq!(listing(dir.path()), files);
    }
    drop(w);
    let missing = dir.path().join("nope.pcow");
    let e = Image::create_temporary(&missing, &TempOptions::default()).unwrap_err();
    assert!(e.to_string().contains("nope.pcow"), "{e}");
    let e = Image::create_temporary(
        &base,
        &TempOptions {
            dir: Some(dir.path().join("no-such-dir")),
            named: false,
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("no-such-dir"), "{e}");
    // An empty raw file has no content to overlay.
    let empty = dir.path().join("empty.raw");
    std::fs::write(&empty, b"").unwrap();
    assert!(Image::create_temporary(&empty, &TempOptions::default()).is_err());
    assert_eq!(listing(dir.path()), {
        let mut f = files.clone();
        f.push("empty.raw".into());
        f.sort();
        f
    });
}

#[test]
fn a_snapshot_of_the_overlay_only_writes_the_overlay() {
    let dir = tmp();
    let base = chain(dir.path());
    let before = std::fs::read(&base).unwrap();
    let mut t = Image::create_temporary(&base, &TempOptions::default()).unwrap();
    t.write_at(b"one", 0).unwrap();
    t.snapshot_create("s").unwrap();
    t.write_at(b"two", 0).unwrap();
    t.snapshot_apply("s").unwrap();
    assert_eq!(read(&t, 0, 4), b"oneE");
    drop(t);
    assert!(same_bytes(&base, &before));
}

const CHILD_ENV: &str = "PCOW_TEMP_OVERLAY_CHILD";

/// Not a test: the process `killed_holders_leave_nothing_behind` starts
/// and kills. It opens a temporary overlay on the base named in the
/// environment, writes to it, says "ready" and waits to be killed.
#[test]
#[ignore = "helper process of killed_holders_leave_nothing_behind"]
fn child_holding_a_temporary_overlay() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (named, base) = spec.split_once(':').unwrap();
    let opts = TempOptions {
        dir: None,
        named: named == "named",
    };
    let mut t = Image::create_temporary(Path::new(base), &opts).unwrap();
    t.write_at(&[0xee; 8192], 0).unwrap();
    t.flush().unwrap();
    println!("ready");
    std::thread::sleep(std::time::Duration::from_secs(120));
}

/// Kills the child if the test fails before it does.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn killed_holders_leave_nothing_behind() {
    both_modes(|named| {
        let dir = tmp();
        let base = chain(dir.path());
        let before = std::fs::read(&base).unwrap();
        let files = listing(dir.path());
        let mode = if named { "named" } else { "tmpfile" };
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "child_holding_a_temporary_overlay",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, format!("{mode}:{}", base.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut child = KillOnDrop(child);
        let mut ready = false;
        let mut line = String::new();
        while out.read_line(&mut line).unwrap() > 0 {
            // libtest may print "test NAME ... " on the same line first.
            if line.trim_end().ends_with("ready") {
                ready = true;
                break;
            }
            line.clear();
        }
        assert!(ready, "the child did not open its overlay ({mode})");
        // The child holds the base shared: writers are refused, readers
        // and other temporary overlays are not.
        assert!(locked_for_writers(&base), "{mode}");
        drop(ro(&base));
        // pcow-img: writers refused, readers served.
        fails(dir.path(), &["snapshot", "-c", "s", "base.pcow"], "in use");
        fails(dir.path(), &["resize", "base.pcow", "8M"], "in use");
        ok(dir.path(), &["info", "base.pcow"]);
        ok(dir.path(), &["check", "base.pcow"]);
        drop(Image::create_temporary(&base, &TempOptions::default()).unwrap());
        assert_eq!(listing(dir.path()), files, "{mode}");
        // SIGKILL: no close, no cleanup code runs.
        // SAFETY: kill only sends a signal to the child we started.
        assert_eq!(unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) }, 0);
        child.0.wait().unwrap();
        assert_eq!(listing(dir.path()), files, "{mode}");
        assert!(free(&base), "{mode}");
        assert!(same_bytes(&base, &before), "{mode}");
        let report = pcow::check::check(&base, None, false).unwrap();
        assert!(report.is_clean(), "{report:?}");
    });
}

#[test]
fn leftover_names_are_skipped_and_a_directory_full_of_them_is_an_error() {
    let dir = tmp();
    let base = chain(dir.path());
    let pid = std::process::id();
    // Files of a crashed process whose id this one now has: every name
    // this process could pick, but one in eight.
    let leftover = |n: u64| dir.path().join(format!(".base.pcow.discard-{pid}-{n}"));
    for n in (0..4096).filter(|n| n % 8 != 7) {
        std::fs::write(leftover(n), b"leftover").unwrap();
    }
    let files = listing(dir.path());
    let named = TempOptions {
        dir: None,
        named: true,
    };
    let mut t = Image::create_temporary(&base, &named).unwrap();
    t.write_at(b"mine", 0).unwrap();
    assert_eq!(read(&t, 0, 4), b"mine");
    drop(t);
    assert_eq!(listing(dir.path()), files, "leftovers kept, nothing added");
    // Every name taken: a clear error, nothing removed.
    for n in (0..4096).filter(|n| n % 8 == 7) {
        std::fs::write(leftover(n), b"leftover").unwrap();
    }
    let files = listing(dir.path());
    let e = Image::create_temporary(&base, &named).unwrap_err();
    assert!(e.to_string().contains(".base.pcow.discard-"), "{e}");
    assert_eq!(listing(dir.path()), files);
}
