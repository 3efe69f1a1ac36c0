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
