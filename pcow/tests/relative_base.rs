//! The prototype resolved a relative base name against the VMM's working
//! directory; pcow resolves it against the naming image's directory.
//!
//! This test re-runs its own binary in a child process (the working
//! directory is process-global). It lives in a test binary of its own:
//! between fork and exec a child holds copies of every file descriptor of
//! the parent, and with them the flock locks of images that other tests in
//! the same binary have open.

mod common;

use std::path::{Path, PathBuf};

use common::{overlay, read, ro, tmp};
use pcow::{BaseFormat, Error, Image, OpenOptions};

const CHILD_ROOT: &str = "PCOW_PROTOTYPE_BUGS_ROOT";

/// `root/sub/top.pcow` names `base.raw` (holding "R..."); `root/base.raw`
/// (holding "D...") is a decoy in what will be the working directory.
fn relative_base_layout(root: &Path) {
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::write(root.join("sub/base.raw"), vec![b'R'; 8192]).unwrap();
    std::fs::write(root.join("base.raw"), vec![b'D'; 8192]).unwrap();
    overlay(
        &root.join("sub/top.pcow"),
        "base.raw",
        BaseFormat::Raw,
        4096,
    )
    .close()
    .unwrap();
    // sub2/top.pcow names only-here.raw, which exists only in the working
    // directory.
    std::fs::create_dir_all(root.join("sub2")).unwrap();
    std::fs::write(root.join("sub2/only-here.raw"), b"x").unwrap();
    overlay(
        &root.join("sub2/top.pcow"),
        "only-here.raw",
        BaseFormat::Raw,
        4096,
    )
    .close()
    .unwrap();
    std::fs::remove_file(root.join("sub2/only-here.raw")).unwrap();
    std::fs::write(root.join("only-here.raw"), b"decoy").unwrap();
}

#[test]
fn relative_base_is_resolved_against_the_image_directory() {
    let dir = tmp();
    let root = dir.path();
    relative_base_layout(root);
    let top = root.join("sub/top.pcow");
    assert_eq!(
        pcow::resolve_base(&top, "base.raw"),
        root.join("sub/base.raw")
    );
    assert_eq!(
        pcow::resolve_base(&top, "/abs/base.raw"),
        Path::new("/abs/base.raw")
    );
    // This process's working directory is elsewhere (the crate directory).
    let img = ro(&top);
    assert_eq!(img.base().unwrap().path(), root.join("sub/base.raw"));
    assert_eq!(read(&img, 0, 4), b"RRRR");
    drop(img);

    // The working directory is process-global: the rest runs in a child
    // process (this test binary, running the ignored test below) whose
    // working directory is `root`, where the decoys are.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "relative_base_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ROOT, root)
        .current_dir(root)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed:\n{stdout}\n{stderr}"
    );
}

/// Runs only as the child of the test above.
#[test]
#[ignore = "run by relative_base_is_resolved_against_the_image_directory"]
fn relative_base_child() {
    let Some(root) = std::env::var_os(CHILD_ROOT) else {
        return;
    };
    let root = PathBuf::from(root);
    assert_eq!(
        std::env::current_dir().unwrap().canonicalize().unwrap(),
        root.canonicalize().unwrap()
    );
    // By absolute path and by a path relative to the working directory.
    for top in [root.join("sub/top.pcow"), PathBuf::from("sub/top.pcow")] {
        let img = ro(&top);
        assert_eq!(read(&img, 0, 4), b"RRRR", "{}", top.display());
    }
    // A new overlay in sub/ naming "base.raw" gets sub/base.raw too.
    let mut img = overlay(Path::new("sub/new.pcow"), "base.raw", BaseFormat::Raw, 4096);
    assert_eq!(read(&img, 100, 2), b"RR");
    img.write_at(b"n", 0).unwrap();
    img.close().unwrap();
    assert_eq!(read(&ro(&root.join("sub/new.pcow")), 0, 2), b"nR");
    // A base that exists only in the working directory is missing.
    for top in [root.join("sub2/top.pcow"), PathBuf::from("sub2/top.pcow")] {
        match Image::open(&top, OpenOptions::read_only()) {
            Err(Error::BaseMissing { resolved, .. }) => {
                assert_eq!(resolved, top.parent().unwrap().join("only-here.raw"))
            }
            other => panic!("{}: expected BaseMissing, got {other:?}", top.display()),
        }
    }
}
