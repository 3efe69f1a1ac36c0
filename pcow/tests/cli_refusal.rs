//! A refused `pcow-img` command leaves every file as it was: every writing
//! command against images another process holds (here: this test, through
//! a lock on a file description of its own, which conflicts with the
//! child's as another process's would), against arguments it refuses, and
//! with a directory, FIFO, socket, device or symbolic link at the name it
//! writes. Each run has a deadline: a command that blocks (a FIFO opened
//! for writing waits for a reader) fails the test instead of hanging it.
//! In a binary of its own: see the note in tests/cli.rs.

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{ok, BIN};

/// Longer than any lock retry or small image operation takes here, even
/// on a loaded machine; a blocked open never ends.
const DEADLINE: Duration = Duration::from_secs(20);

/// What a directory entry is, as far as a refusal could change it.
#[derive(Debug, PartialEq, Eq)]
enum Entry {
    /// A regular file: its inode (a replacement shows) and its bytes.
    File {
        ino: u64,
        bytes: Vec<u8>,
    },
    Link(std::path::PathBuf),
    Other {
        ino: u64,
        kind: &'static str,
    },
}

/// Every entry of `dir`, by name.
fn state(dir: &Path) -> BTreeMap<String, Entry> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let md = std::fs::symlink_metadata(e.path()).unwrap();
        let t = md.file_type();
        let entry = if t.is_file() {
            Entry::File {
                ino: md.ino(),
                bytes: std::fs::read(e.path()).unwrap(),
            }
        } else if t.is_symlink() {
            Entry::Link(std::fs::read_link(e.path()).unwrap())
        } else {
            let kind = if t.is_dir() {
                "dir"
            } else if t.is_fifo() {
                "fifo"
            } else if t.is_socket() {
                "socket"
            } else {
                "other"
            };
            Entry::Other {
                ino: md.ino(),
                kind,
            }
        };
        m.insert(e.file_name().to_string_lossy().into_owned(), entry);
    }
    m
}

/// Runs `pcow-img args` in `dir`; exit code and stderr. Panics (after
/// killing it) if it outlives [`DEADLINE`].
fn run_timed(dir: &Path, args: &[&str]) -> (i32, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running pcow-img");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pcow-img {args:?} still running after {DEADLINE:?}: blocked");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.code().unwrap_or(-1), err)
}

/// Runs a command that must be refused: exit 1, one `pcow-img: ` line
/// containing `needle`, and every entry of `dir` unchanged. `Err` says
/// what was wrong (`what`: the situation).
fn check_refused(dir: &Path, args: &[&str], what: &str, needle: &str) -> Result<(), String> {
    check_refused_code(dir, args, what, needle, 1)
}

/// [`check_refused`] for a command whose failure exit code is `want`
/// (`compare` exits 2 on an error, as qemu-img does).
fn check_refused_code(
    dir: &Path,
    args: &[&str],
    what: &str,
    needle: &str,
    want: i32,
) -> Result<(), String> {
    let before = state(dir);
    let (code, err) = run_timed(dir, args);
    let fail = |why: String| Err(format!("pcow-img {args:?} ({what}): {why}"));
    if code != want {
        return fail(format!("exit {code}, stderr {err:?}"));
    }
    if !err.starts_with("pcow-img: ") || err.lines().count() != 1 {
        return fail(format!("stderr {err:?}"));
    }
    if !err.contains(needle) {
        return fail(format!("stderr {err:?} lacks {needle:?}"));
    }
    let after = state(dir);
    for (name, b) in &before {
        if after.get(name) != Some(b) {
            return fail(format!("refused ({err:?}) but changed {name}"));
        }
    }
    if before.keys().ne(after.keys()) {
        return fail("refused but added or removed files".into());
    }
    Ok(())
}

/// [`check_refused`], panicking.
fn refused(dir: &Path, args: &[&str], what: &str, needle: &str) {
    if let Err(e) = check_refused(dir, args, what, needle) {
        panic!("{e}");
    }
}

/// Panics listing every failure, if any.
fn all_ok(failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Images for every command: `b.pcow` (data, snapshot `s1`), its overlay
/// `o.pcow` (data), another base `b2.pcow`, a raw `r.raw` as large as
/// them, a pcow `t.pcow` of the same size, a smaller `small.pcow`, and
/// `orphan.pcow`, an overlay whose base is gone.
fn fixture(p: &Path) {
    ok(p, &["create", "-q", "-c", "4k", "b.pcow", "1M"]);
    ok(p, &["io", "b.pcow", "-c", "write -P 0x11 0 64k"]);
    ok(p, &["snapshot", "-c", "s1", "b.pcow"]);
    ok(p, &["io", "b.pcow", "-c", "write -P 0x22 64k 64k"]);
    ok(p, &["create", "-q", "-b", "b.pcow", "-F", "pcow", "o.pcow"]);
    ok(p, &["io", "o.pcow", "-c", "write -P 0x33 128k 8k"]);
    ok(p, &["create", "-q", "b2.pcow", "1M"]);
    ok(p, &["io", "b2.pcow", "-c", "write -P 0x44 0 4k"]);
    ok(p, &["create", "-q", "t.pcow", "1M"]);
    ok(p, &["create", "-q", "small.pcow", "64K"]);
    ok(p, &["create", "-q", "gone.pcow", "1M"]);
    ok(
        p,
        &[
            "create",
            "-q",
            "-b",
            "gone.pcow",
            "-F",
            "pcow",
            "orphan.pcow",
        ],
    );
    std::fs::remove_file(p.join("gone.pcow")).unwrap();
    std::fs::write(p.join("r.raw"), vec![0x55u8; 1 << 20]).unwrap();
}

/// A lock this process holds on `name`, on a file description of its own.
fn hold(dir: &Path, name: &str, exclusive: bool) -> File {
    let f = File::open(dir.join(name)).unwrap();
    if exclusive {
        f.lock().unwrap();
    } else {
        f.lock_shared().unwrap();
    }
    f
}

/// A writing command, the files it writes (refused while anyone holds
/// them) and those it only reads (refused while a writer holds them).
struct Case {
    args: &'static [&'static str],
    writes: &'static [&'static str],
    reads: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        args: &["create", "-f", "raw", "b.pcow", "64M"],
        writes: &["b.pcow"],
        reads: &[],
    },
    Case {
        args: &["create", "b.pcow", "1M"],
        writes: &["b.pcow"],
        reads: &[],
    },
    Case {
        args: &["create", "-f", "raw", "r.raw", "64M"],
        writes: &["r.raw"],
        reads: &[],
    },
    Case {
        args: &["create", "-o", "preallocation=full", "r.raw", "1M"],
        writes: &["r.raw"],
        reads: &[],
    },
    Case {
        args: &["create", "-b", "b.pcow", "-F", "pcow", "o.pcow"],
        writes: &["o.pcow"],
        reads: &["b.pcow"],
    },
    Case {
        args: &["convert", "-O", "raw", "o.pcow", "r.raw"],
        writes: &["r.raw"],
        reads: &["o.pcow", "b.pcow"],
    },
    Case {
        args: &["convert", "-O", "pcow", "o.pcow", "t.pcow"],
        writes: &["t.pcow"],
        reads: &["o.pcow", "b.pcow"],
    },
    Case {
        args: &["convert", "-n", "-O", "raw", "o.pcow", "r.raw"],
        writes: &["r.raw"],
        reads: &["o.pcow", "b.pcow"],
    },
    Case {
        args: &["convert", "-n", "-O", "pcow", "o.pcow", "t.pcow"],
        writes: &["t.pcow"],
        reads: &["o.pcow", "b.pcow"],
    },
    Case {
        args: &["commit", "o.pcow"],
        writes: &["o.pcow", "b.pcow"],
        reads: &[],
    },
    // The overlay is kept, but locked as a writer's would be.
    Case {
        args: &["commit", "-d", "o.pcow"],
        writes: &["o.pcow", "b.pcow"],
        reads: &[],
    },
    Case {
        args: &["commit", "-b", "b.pcow", "o.pcow"],
        writes: &["b.pcow"],
        reads: &["o.pcow"],
    },
    Case {
        args: &["rebase", "-b", "", "o.pcow"],
        writes: &["o.pcow"],
        reads: &["b.pcow"],
    },
    Case {
        args: &["rebase", "-b", "b2.pcow", "-F", "pcow", "o.pcow"],
        writes: &["o.pcow"],
        reads: &["b.pcow", "b2.pcow"],
    },
    Case {
        args: &["rebase", "-u", "-b", "b2.pcow", "-F", "pcow", "o.pcow"],
        writes: &["o.pcow"],
        reads: &[],
    },
    Case {
        args: &["snapshot", "-c", "new", "b.pcow"],
        writes: &["b.pcow"],
        reads: &[],
    },
    Case {
        args: &["snapshot", "-a", "s1", "b.pcow"],
        writes: &["b.pcow"],
        reads: &[],
    },
    Case {
        args: &["snapshot", "-d", "s1", "b.pcow"],
        writes: &["b.pcow"],
        reads: &[],
    },
    Case {
        args: &["rollback", "b.pcow", "s1"],
        writes: &["b.pcow"],
        reads: &[],
    },
    Case {
        args: &["resize", "b.pcow", "+1M"],
        writes: &["b.pcow"],
        reads: &[],
    },
    Case {
        args: &["resize", "-f", "raw", "r.raw", "+1M"],
        writes: &["r.raw"],
        reads: &[],
    },
    Case {
        args: &["compact", "b.pcow"],
        writes: &["b.pcow"],
        reads: &[],
    },
    Case {
        args: &["io", "o.pcow", "-c", "write 0 4k"],
        writes: &["o.pcow"],
        reads: &["b.pcow"],
    },
    // Repairs only when there is something to repair; reads first.
    Case {
        args: &["check", "-r", "all", "b.pcow"],
        writes: &[],
        reads: &["b.pcow"],
    },
];

#[test]
fn every_writing_command_is_refused_unchanged_while_its_images_are_held() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fixture(p);
    let mut failures = Vec::new();
    for case in CASES {
        let held = case
            .writes
            .iter()
            .flat_map(|&f| [(f, true), (f, false)])
            .chain(case.reads.iter().map(|&f| (f, true)));
        for (name, exclusive) in held {
            let lock = hold(p, name, exclusive);
            let what = format!(
                "{name} held {}",
                if exclusive { "exclusively" } else { "shared" }
            );
            let needle = format!("{name}: image is in use");
            failures.extend(check_refused(p, case.args, &what, &needle).err());
            drop(lock);
        }
    }
    all_ok(failures);
    // Nothing held: each command runs (the cases are real).
    for case in CASES {
        let d = tempfile::tempdir().unwrap();
        fixture(d.path());
        ok(d.path(), case.args);
    }
}

#[test]
fn an_image_a_writer_holds_is_not_replaced() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fixture(p);
    // As a VMM holds its disk: a writer of the library, in another
    // process as far as the child is concerned.
    let vmm = pcow::Image::open(p.join("o.pcow"), pcow::OpenOptions::read_write()).unwrap();
    let mut expect = vec![0u8; 1 << 20];
    expect[..64 << 10].fill(0x11);
    expect[64 << 10..128 << 10].fill(0x22);
    expect[128 << 10..136 << 10].fill(0x33);
    let mut failures = Vec::new();
    for args in [
        &["create", "-f", "raw", "o.pcow", "64M"][..],
        &["create", "o.pcow", "64M"],
        &[
            "create", "-f", "pcow", "-b", "b2.pcow", "-F", "pcow", "o.pcow",
        ],
        &["convert", "-O", "raw", "b2.pcow", "o.pcow"],
        &["convert", "-O", "pcow", "b2.pcow", "o.pcow"],
        &["convert", "-n", "-O", "pcow", "b2.pcow", "o.pcow"],
        &["commit", "o.pcow"],
        &["compact", "o.pcow"],
        // The base is read by the running writer: not written either.
        &["commit", "-b", "b.pcow", "o.pcow"],
        &["create", "-f", "raw", "b.pcow", "1M"],
        &["snapshot", "-c", "x", "b.pcow"],
        &["io", "b.pcow", "-c", "write 0 4k"],
    ] {
        failures.extend(check_refused(p, args, "o.pcow open by a writer", "image is in use").err());
    }
    all_ok(failures);
    let mut buf = vec![0u8; 1 << 20];
    vmm.read_at(&mut buf, 0).unwrap();
    assert!(buf == expect, "the writer's view changed");
    vmm.close().unwrap();
    ok(p, &["check", "o.pcow"]);
    ok(p, &["compare", "-q", "o.pcow", "o.pcow"]);
}

#[test]
fn a_commit_into_a_held_base_leaves_the_overlay_unchanged() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fixture(p);
    // As a VMM running on the base holds it.
    let vmm = pcow::Image::open(p.join("b.pcow"), pcow::OpenOptions::read_write()).unwrap();
    refused(
        p,
        &["commit", "o.pcow"],
        "base open by a writer",
        "b.pcow: image is in use",
    );
    refused(
        p,
        &["commit", "-d", "o.pcow"],
        "base open by a writer",
        "b.pcow: image is in use",
    );
    drop(vmm);
    // The images reopen and commit as if nothing had been tried.
    ok(p, &["check", "o.pcow"]);
    ok(p, &["commit", "-q", "o.pcow"]);
    ok(p, &["check", "b.pcow"]);
}

#[test]
fn refused_arguments_leave_every_file_unchanged() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fixture(p);
    let cases: &[(&[&str], &str)] = &[
        (&["snapshot", "-c", "s1", "b.pcow"], "already exists"),
        (&["snapshot", "-c", "", "b.pcow"], "bad snapshot tag"),
        (&["snapshot", "-a", "nope", "b.pcow"], "no snapshot"),
        (&["snapshot", "-d", "nope", "b.pcow"], "no snapshot"),
        (&["rollback", "b.pcow", "nope"], "no snapshot"),
        // 2^57 bytes: past the format's limit.
        (&["resize", "b.pcow", "144115188075855872"], "at most 2^56"),
        (&["resize", "b.pcow", "64K"], "shrinking"),
        (
            &["io", "b.pcow", "-c", "write 0 4k", "-c", "write 2M 1"],
            "beyond the virtual size",
        ),
        (
            &["rebase", "-b", "missing.pcow", "o.pcow"],
            "does not exist",
        ),
        (
            &["rebase", "-b", "r.raw", "-F", "pcow", "o.pcow"],
            "not a pcow image",
        ),
        (&["commit", "b.pcow"], "has no base image"),
        (&["commit", "orphan.pcow"], "does not exist"),
        (&["commit", "-d", "orphan.pcow"], "does not exist"),
        (&["commit", "-b", "r.raw", "o.pcow"], "is not a base image"),
        (
            &["convert", "-n", "-O", "pcow", "o.pcow", "small.pcow"],
            "smaller than the input",
        ),
        (
            &["convert", "-n", "-O", "raw", "o.pcow", "t.pcow"],
            "the target is a pcow image",
        ),
        (
            &["convert", "-n", "-O", "pcow", "o.pcow", "r.raw"],
            "not a pcow image",
        ),
        (
            &["convert", "-O", "raw", "o.pcow", "b.pcow"],
            "is the input",
        ),
        (
            &["create", "-b", "missing.pcow", "-F", "pcow", "t.pcow"],
            "does not exist",
        ),
        (&["create", "-b", "t.pcow", "-F", "pcow", "t.pcow"], "cycle"),
        (
            &["create", "-b", "r.raw", "-F", "pcow", "t.pcow"],
            "not a pcow image",
        ),
    ];
    let failures = cases
        .iter()
        .filter_map(|(args, needle)| check_refused(p, args, "refused argument", needle).err())
        .collect();
    all_ok(failures);
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the
    // call; mkfifo only reads it.
    let r = unsafe { libc::mkfifo(c.as_ptr(), 0o644) };
    assert_eq!(r, 0, "mkfifo: {}", std::io::Error::last_os_error());
}

#[test]
fn special_files_at_the_output_name_are_refused_at_once() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fixture(p);
    mkfifo(&p.join("fifo"));
    std::fs::create_dir(p.join("dir")).unwrap();
    let _socket = std::os::unix::net::UnixListener::bind(p.join("sock")).unwrap();
    std::os::unix::fs::symlink("b.pcow", p.join("to-image")).unwrap();
    std::os::unix::fs::symlink("r.raw", p.join("to-raw")).unwrap();
    std::os::unix::fs::symlink("nowhere", p.join("dangling")).unwrap();
    std::os::unix::fs::symlink("loop", p.join("loop")).unwrap();
    // Held, as an image in use is: a link to it is refused all the same.
    let _b = hold(p, "b.pcow", true);
    let _r = hold(p, "r.raw", true);
    let dev_null = "/dev/null";
    let specials: &[(&str, &str)] = &[
        ("fifo", "is a FIFO"),
        ("dir", "is a directory"),
        ("sock", "is a socket"),
        (dev_null, "is a character device"),
        ("to-image", "is a symbolic link"),
        ("to-raw", "is a symbolic link"),
        ("dangling", "is a symbolic link"),
        ("loop", "is a symbolic link"),
    ];
    let mut failures = Vec::new();
    for &(name, needle) in specials {
        // Replacing a name: nothing but a regular file, never through a link.
        for args in [
            &["create", "-f", "raw", name, "1M"][..],
            &["create", name, "1M"],
            &["convert", "-O", "raw", "b2.pcow", name],
            &["convert", "-O", "pcow", "b2.pcow", name],
        ] {
            failures.extend(check_refused(p, args, name, &format!("{name}: {needle}")).err());
        }
        // Writing in place: a link is followed to a regular file.
        let in_place = match name {
            "to-image" | "to-raw" => "image is in use",
            "dangling" => "No such file",
            "loop" => "Too many levels of symbolic links",
            _ => needle,
        };
        for args in [
            &["convert", "-n", "-O", "raw", "b2.pcow", name][..],
            &["resize", "-f", "raw", name, "+1M"],
        ] {
            failures.extend(check_refused(p, args, name, in_place).err());
        }
    }
    all_ok(failures);
}

#[test]
fn create_replaces_an_unused_regular_file_as_qemu_img_does() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fixture(p);
    let ino = std::fs::metadata(p.join("r.raw")).unwrap().ino();
    ok(p, &["create", "-q", "-f", "raw", "r.raw", "2M"]);
    let bytes = std::fs::read(p.join("r.raw")).unwrap();
    assert_eq!(bytes.len(), 2 << 20);
    assert!(bytes.iter().all(|&b| b == 0), "the old content is gone");
    ok(p, &["create", "-q", "r.raw", "1M"]);
    ok(p, &["check", "r.raw"]);
    ok(p, &["convert", "-O", "raw", "b2.pcow", "r.raw"]);
    // Written in place, not replaced by another file.
    assert_eq!(std::fs::metadata(p.join("r.raw")).unwrap().ino(), ino);
    ok(p, &["compare", "-q", "b2.pcow", "r.raw"]);
}

#[test]
fn a_deferred_writer_writes_nothing_until_its_first_change() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fixture(p);
    let path = p.join("b.pcow");
    let before = std::fs::read(&path).unwrap();
    let mut img = pcow::Image::open(&path, pcow::OpenOptions::read_write_deferred()).unwrap();
    assert!(!img.is_writable());
    // Held exclusively while deferred.
    refused(p, &["info", "b.pcow"], "deferred writer", "image is in use");
    assert!(img.snapshot_create("s1").is_err());
    assert!(img.snapshot_apply("nope").is_err());
    assert!(img.snapshot_delete("nope").is_err());
    assert!(img.grow(1 << 57).is_err());
    assert!(img.write_at(&[1], 1 << 20).is_err());
    img.write_at(&[], 0).unwrap();
    img.flush().unwrap();
    drop(img);
    assert!(
        std::fs::read(&path).unwrap() == before,
        "a refused change wrote"
    );
    // The first change starts the writer.
    let mut img = pcow::Image::open(&path, pcow::OpenOptions::read_write_deferred()).unwrap();
    img.write_at(&[7], 0).unwrap();
    assert!(img.is_writable());
    img.close().unwrap();
    let img = pcow::Image::open(&path, pcow::OpenOptions::read_only()).unwrap();
    let mut b = [0u8];
    img.read_at(&mut b, 0).unwrap();
    assert_eq!(b, [7]);
}

/// A FIFO, directory, socket or device given as an image to read, or met
/// as a base in a chain, is refused at once (a FIFO opened for reading
/// would wait for a writer, possibly forever), naming the path and its
/// type, every file unchanged.
#[test]
fn special_files_as_inputs_and_bases_are_refused_at_once() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fixture(p);
    mkfifo(&p.join("fifo"));
    std::fs::create_dir(p.join("dir")).unwrap();
    let _socket = std::os::unix::net::UnixListener::bind(p.join("sock")).unwrap();
    // Overlays whose base is then replaced by a FIFO / a directory.
    ok(p, &["create", "-q", "bf.pcow", "1M"]);
    ok(
        p,
        &["create", "-q", "-b", "bf.pcow", "-F", "pcow", "ov-f.pcow"],
    );
    std::fs::remove_file(p.join("bf.pcow")).unwrap();
    mkfifo(&p.join("bf.pcow"));
    ok(p, &["create", "-q", "bd.pcow", "1M"]);
    ok(
        p,
        &["create", "-q", "-b", "bd.pcow", "-F", "pcow", "ov-d.pcow"],
    );
    std::fs::remove_file(p.join("bd.pcow")).unwrap();
    std::fs::create_dir(p.join("bd.pcow")).unwrap();
    let specials: &[(&str, &str)] = &[
        ("fifo", "fifo: is a FIFO"),
        ("dir", "dir: is a directory"),
        ("sock", "sock: is a socket"),
        ("/dev/null", "/dev/null: is a character device"),
    ];
    let mut failures = Vec::new();
    for &(name, needle) in specials {
        for args in [
            &["info", name][..],
            &["info", "-f", "raw", name],
            &["check", name],
            &["map", name],
            &["compare", name, "b.pcow"],
            &["compare", "b.pcow", name],
            &["convert", "-O", "raw", name, "out.raw"],
            &["commit", name],
            &["rebase", "-b", "b2.pcow", name],
            &["rebase", "-b", name, "-F", "pcow", "o.pcow"],
            &["resize", name, "+1M"],
            &["resize", "-f", "raw", name, "+1M"],
            &["snapshot", "-l", name],
            &["io", name, "-c", "read 0 4k"],
            &["create", "-b", name, "-F", "pcow", "new.pcow"],
        ] {
            let code = if args[0] == "compare" { 2 } else { 1 };
            failures.extend(check_refused_code(p, args, name, needle, code).err());
        }
    }
    for (overlay, needle) in [
        ("ov-f.pcow", "bf.pcow: is a FIFO"),
        ("ov-d.pcow", "bd.pcow: is a directory"),
    ] {
        for args in [
            &["info", overlay][..],
            &["map", overlay],
            &["compare", overlay, "b.pcow"],
            &["convert", "-O", "raw", overlay, "out.raw"],
            &["commit", overlay],
            &["rebase", "-b", "b2.pcow", "-F", "pcow", overlay],
            &["resize", overlay, "+1M"],
            &["snapshot", "-l", overlay],
            &["io", overlay, "-c", "read 0 4k"],
        ] {
            let code = if args[0] == "compare" { 2 } else { 1 };
            failures.extend(check_refused_code(p, args, overlay, needle, code).err());
        }
        // `check` reports a base it cannot open as an error of the image
        // (exit 2, on stdout): it must do so at once, changing nothing.
        let before = state(p);
        let (code, _) = run_timed(p, &["check", overlay]);
        if code != 2 || state(p) != before {
            failures.push(format!("check {overlay}: exit {code}"));
        }
    }
    all_ok(failures);
}

/// `rebase -u` skips reading the new base's data, not the checks of its
/// identity: the image itself (by its name, a symlink or a hard link), a
/// two-image cycle, a FIFO, a directory and a non-pcow file as pcow are
/// refused, every file unchanged; a base that does not exist is allowed.
#[test]
fn unsafe_rebase_checks_the_new_base() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    fixture(p);
    mkfifo(&p.join("fifo"));
    std::fs::create_dir(p.join("dir")).unwrap();
    std::os::unix::fs::symlink("t.pcow", p.join("t-link.pcow")).unwrap();
    std::fs::hard_link(p.join("t.pcow"), p.join("t-hard.pcow")).unwrap();
    std::fs::write(p.join("passwd"), b"root:x:0:0:root:/root:/bin/sh\n").unwrap();
    let mut failures = Vec::new();
    for (base, needle) in [
        ("t.pcow", "cycle"),
        ("t-link.pcow", "cycle"),
        ("t-hard.pcow", "cycle"),
        ("fifo", "fifo: is a FIFO"),
        ("dir", "dir: is a directory"),
        ("passwd", "passwd"),
    ] {
        let args = ["rebase", "-u", "-b", base, "-F", "pcow", "t.pcow"];
        failures.extend(check_refused(p, &args, base, needle).err());
    }
    // o.pcow's base is b.pcow: o.pcow as b.pcow's base makes a cycle.
    failures.extend(
        check_refused(
            p,
            &["rebase", "-u", "-b", "o.pcow", "-F", "pcow", "b.pcow"],
            "two-image cycle",
            "cycle",
        )
        .err(),
    );
    all_ok(failures);
    ok(
        p,
        &["rebase", "-u", "-b", "not-yet.pcow", "-F", "pcow", "t.pcow"],
    );
    ok(
        p,
        &["rebase", "-u", "-b", "b2.pcow", "-F", "pcow", "t.pcow"],
    );
}

/// The chain depth limit (32 images) holds for every command that makes a
/// chain: `create -b` on a full chain, and `rebase` (safe and `-u`) onto
/// a base whose chain is full, are refused naming the limit and change
/// nothing; `commit` of the top of a full chain works.
#[test]
fn chains_past_the_depth_limit_are_refused_by_every_command() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let name = |i: usize| format!("i{i:02}.pcow");
    ok(p, &["create", "-c", "4k", &name(0), "1M"]);
    for k in 1..32 {
        ok(p, &["create", "-b", &name(k - 1), "-F", "pcow", &name(k)]);
    }
    ok(p, &["create", "-c", "4k", "other.pcow", "1M"]);
    let mut failures = Vec::new();
    for (args, what) in [
        (
            vec!["create", "-b", "i31.pcow", "-F", "pcow", "j.pcow"],
            "create on a full chain",
        ),
        (
            vec!["rebase", "-u", "-b", "i31.pcow", "-F", "pcow", "other.pcow"],
            "unsafe rebase onto a full chain",
        ),
        (
            vec!["rebase", "-b", "i31.pcow", "-F", "pcow", "other.pcow"],
            "safe rebase onto a full chain",
        ),
    ] {
        failures.extend(check_refused(p, &args, what, "32").err());
    }
    all_ok(failures);
    ok(p, &["io", "i31.pcow", "-c", "write -P 9 0 4k"]);
    ok(p, &["commit", "i31.pcow"]);
    ok(p, &["io", "-r", "i30.pcow", "-c", "read -P 9 0 4k"]);
}

/// A raw output the file system cannot hold (`EFBIG`): `create -f raw`
/// and `convert -O raw` fail naming the size, and leave no new file (an
/// existing one is as it was).
#[test]
fn raw_outputs_too_large_for_the_file_system_leave_nothing() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    // 4 PiB: past ext4's largest file, within pcow's limits. A file system
    // that holds it (XFS, tmpfs) cannot show the refusal.
    let probe = std::fs::File::create(p.join("probe")).unwrap();
    if probe.set_len(4096 << 40).is_ok() {
        println!("SKIPPED raw_outputs_too_large_for_the_file_system_leave_nothing: this file system holds a 4 PiB file");
        return;
    }
    drop(probe);
    std::fs::remove_file(p.join("probe")).unwrap();
    ok(p, &["create", "-f", "pcow", "big.pcow", "4096T"]);
    std::fs::write(p.join("old.raw"), b"old").unwrap();
    let mut failures = Vec::new();
    for (args, what) in [
        (
            vec!["create", "-f", "raw", "new.raw", "4096T"],
            "create raw",
        ),
        (
            vec!["create", "-f", "raw", "old.raw", "4096T"],
            "create raw over a file",
        ),
        (
            vec!["convert", "-O", "raw", "big.pcow", "new.raw"],
            "convert to raw",
        ),
        (
            vec!["convert", "-O", "raw", "big.pcow", "old.raw"],
            "convert over a file",
        ),
    ] {
        failures.extend(check_refused(p, &args, what, "sizing").err());
    }
    all_ok(failures);
}
