//! One input as a chain of 2 or 3 image files `a`, `b` (and `c`) in a
//! scratch directory, so base names in the headers ("b", "c", "a", ...)
//! refer to each other: opening `a` through `Image::open` (read-only,
//! locked) exercises base resolution, probing, raw bases, cycles and the
//! depth limit. Every file that opens is read (first 16 MiB, checked
//! against `extents()`) and reported on.
//!
//! Layout (see `pcow_fuzz::split_parts`): byte 0 picks the count (bit 0
//! clear: 2 files, set: 3), whether `b` is opened too (bit 1), whether
//! CRCs are left as they are (bit 2; clear: `fix_crcs` on every file),
//! then `count - 1` little-endian u32 lengths, then the files.
//!
//! Inputs whose header slots name a base with a `/` are skipped: such a
//! name could reach any file of the machine (a FIFO would block the open).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use pcow::{check, Header, Image, OpenOptions};
use pcow_fuzz::{check_extents, debug, fix_crcs, read_prefix, scratch_dir, split_parts};

const NAMES: [&str; 3] = ["a", "b", "c"];

/// Whether any header slot (slot A, or slot B for any cluster size) of
/// `file` names a base outside the scratch directory.
fn names_outside(file: &[u8]) -> bool {
    let slots = std::iter::once(0).chain((12..=21).map(|bits| 1usize << (bits - 1)));
    slots.filter(|&at| at < file.len()).any(|at| {
        matches!(Header::decode(&file[at..], at as u64),
            Ok(h) if h.base.as_ref().is_some_and(|b| b.name.contains('/')))
    })
}

fn inspect(img: &Image) {
    if let Some(read) = read_prefix(img) {
        let file = std::fs::read(img.path()).ok();
        check_extents(img, &read, file.as_deref());
    }
    let _ = check::report(img);
    let _ = img.snapshots();
    let _ = img.base().map(|b| (b.depth(), b.size(), b.format()));
}

fn open(path: &Path, lenient: bool) {
    let opts = OpenOptions {
        lenient,
        ..OpenOptions::read_only()
    };
    match Image::open(path, opts) {
        Ok(img) => {
            if debug() {
                eprintln!("{}: opened, lenient {lenient}: {img:?}", path.display());
            }
            inspect(&img);
        }
        Err(e) if debug() => eprintln!("{}: lenient {lenient}: {e}", path.display()),
        Err(_) => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let n = 2 + usize::from(sel & 1);
    let mut files: Vec<Vec<u8>> = split_parts(rest, n)
        .into_iter()
        .map(<[u8]>::to_vec)
        .collect();
    if sel & 4 == 0 {
        files.iter_mut().for_each(|f| fix_crcs(f));
    }
    if files.iter().any(|f| names_outside(f)) {
        if debug() {
            eprintln!("skipped: a base name with '/'");
        }
        return;
    }
    let dir = scratch_dir();
    for name in NAMES {
        let _ = std::fs::remove_file(dir.join(name));
    }
    for (name, f) in NAMES.iter().zip(&files) {
        std::fs::write(dir.join(name), f).expect("writing a scratch file");
    }
    open(&dir.join("a"), false);
    open(&dir.join("a"), true);
    if sel & 2 != 0 {
        open(&dir.join("b"), false);
    }
});
