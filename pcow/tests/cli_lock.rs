//! `pcow-img` against an image another process (here: this test) holds.
//! In a binary of its own: see the note in tests/cli.rs.

mod common;

use common::{fails, ok};

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

/// `check -U` on an image a writer holds: its DIRTY flag and the clusters
/// it allocated since its last commit read as leaks, which the check says
/// can be stale instead of failing with 3 (a writer that died leaves no
/// lock, and its leaks still fail with 3).
#[test]
fn check_u_on_an_image_in_use_says_leaks_can_be_stale() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    ok(p, &["create", "a.pcow", "4M"]);
    let mut img = pcow::Image::open(p.join("a.pcow"), pcow::OpenOptions::read_write()).unwrap();
    img.write_at(&[7u8; 65536], 0).unwrap();
    fails(p, &["check", "a.pcow"], "in use");
    let out = ok(p, &["check", "-U", "a.pcow"]);
    assert!(out.contains("Leaked"), "{out}");
    assert!(out.contains("in use by another process"), "{out}");
    let json = ok(p, &["check", "-U", "--output=json", "a.pcow"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["in-use"], true, "{json}");
    assert!(v["leaks"].as_u64().unwrap_or(0) > 0, "{json}");
    // Closed, the writer committed what it wrote: clean, and no note.
    img.close().unwrap();
    let out = ok(p, &["check", "-U", "a.pcow"]);
    assert!(out.contains("No errors were found"), "{out}");
    assert!(!out.contains("in use"), "{out}");
}
