//! Helpers shared by the integration tests: running `pcow-img`, and small
//! image shorthands. Each test binary uses part of them.
#![allow(dead_code)]

pub mod hostile;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

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

/// A run of `pcow-img` with what it cost.
#[derive(Debug)]
pub struct Measured {
    /// Exit code, `None` when a signal ended it (an abort, or the kill
    /// at the time limit).
    pub code: Option<i32>,
    /// The signal that ended it.
    pub signal: Option<i32>,
    /// Wall time from spawn to exit.
    pub wall: Duration,
    /// Peak resident set size in bytes (`ru_maxrss` of this child alone,
    /// from `wait4`).
    pub max_rss: u64,
    pub stderr: String,
}

/// Runs `pcow-img ARGS` in `dir` and measures its wall time and peak
/// RSS; kills it when it runs past `kill_after`.
// The child is reaped by `wait4` (which also gives its own rusage), not by
// `Child::wait`, which clippy cannot see.
#[allow(clippy::zombie_processes)]
pub fn run_measured(dir: &Path, args: &[&str], kill_after: Duration) -> Measured {
    let mut child = Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning pcow-img");
    let start = Instant::now();
    let mut err = child.stderr.take().expect("stderr piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let pid = child.id() as libc::pid_t;
    let mut killed = false;
    let (status, usage) = loop {
        let mut status = 0;
        // SAFETY: an all-zero `rusage` is a valid value of this plain C
        // struct of integers; wait4 overwrites it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `pid` is our own child, not reaped yet (only this loop
        // reaps it, and `child` is never waited on); `status` and `usage`
        // are live, writable locals of the types wait4 expects.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break (status, usage);
        }
        assert_eq!(r, 0, "wait4: {}", std::io::Error::last_os_error());
        if !killed && start.elapsed() > kill_after {
            // Not reaped yet, so the pid is still this child's.
            let _ = child.kill();
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let wall = start.elapsed();
    let stderr = reader.join().unwrap_or_default();
    let exited = libc::WIFEXITED(status);
    Measured {
        code: exited.then(|| libc::WEXITSTATUS(status)),
        signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
        wall,
        max_rss: usage.ru_maxrss as u64 * 1024,
        stderr,
    }
}
