//! `pcow-img` against an image another process (here: this test) holds.
//! In a binary of its own: see the note in tests/cli.rs.

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_pcow-img");

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run_in(dir: &Path, args: &[&str]) -> Run {
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
fn ok(dir: &Path, args: &[&str]) -> String {
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
fn fails(dir: &Path, args: &[&str], needle: &str) -> String {
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

#[test]
fn locked_image_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    ok(p, &["create", "a.pcow", "1M"]);
    let img = pcow::Image::open(p.join("a.pcow"), pcow::OpenOptions::read_write()).unwrap();
    fails(p, &["io", "a.pcow", "-c", "write 0 1"], "in use");
    fails(p, &["snapshot", "-c", "x", "a.pcow"], "in use");
    fails(p, &["info", "a.pcow"], "in use");
    ok(p, &["info", "-U", "a.pcow"]);
    drop(img);
    ok(p, &["info", "a.pcow"]);
}
