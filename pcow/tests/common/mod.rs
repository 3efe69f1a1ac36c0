//! Helpers shared by the integration tests: running `pcow-img`, and small
//! image shorthands. Each test binary uses part of them.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

use pcow::{BaseFormat, BaseRef, CreateOptions, Image, OpenOptions};

pub const BIN: &str = env!("CARGO_BIN_EXE_pcow-img");

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

pub fn run_in(dir: &Path, args: &[&str]) -> Run {
    let out: Output = Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env_remove("RUST_LOG")
        .output()
        .expect("running pcow-img");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs and expects success.
pub fn ok(dir: &Path, args: &[&str]) -> String {
    let r = run_in(dir, args);
    assert_eq!(
        r.code, 0,
        "pcow-img {args:?} failed: stdout {:?} stderr {:?}",
        r.stdout, r.stderr
    );
    r.stdout
}

/// Runs and expects exit code 1 with one `pcow-img: ` line on stderr
/// containing `needle`.
pub fn fails(dir: &Path, args: &[&str], needle: &str) -> String {
    let r = run_in(dir, args);
    assert_eq!(
        r.code, 1,
        "pcow-img {args:?}: expected exit 1, got {}: stdout {:?} stderr {:?}",
        r.code, r.stdout, r.stderr
    );
    assert!(
        r.stderr.starts_with("pcow-img: "),
        "stderr of {args:?}: {:?}",
        r.stderr
    );
    assert_eq!(
        r.stderr.lines().count(),
        1,
        "stderr of {args:?}: {:?}",
        r.stderr
    );
    assert!(
        r.stderr.contains(needle),
        "stderr of {args:?} lacks {needle:?}: {:?}",
        r.stderr
    );
    r.stderr
}

/// A fresh temporary directory.
pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Creates an overlay of `base` (stored as given) with the base's size.
pub fn overlay(path: &Path, base: &str, format: BaseFormat, cluster_size: u64) -> Image {
    Image::create(
        path,
        &CreateOptions {
            cluster_size: Some(cluster_size),
            virtual_size: None,
            base: Some(BaseRef {
                name: base.to_owned(),
                format,
            }),
        },
    )
    .unwrap()
}

/// Opens read-only.
pub fn ro(path: &Path) -> Image {
    Image::open(path, OpenOptions::read_only()).unwrap()
}

/// Reads `len` bytes at `offset` of the image's view.
pub fn read(img: &Image, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    img.read_at(&mut buf, offset).unwrap();
    buf
}
