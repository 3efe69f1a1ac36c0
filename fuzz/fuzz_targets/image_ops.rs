//! Structured operation sequences on a valid small image, compared byte
//! for byte with a plain `Vec<u8>` model of the content and a list of
//! snapshots: write, read, flush, snapshot create/apply/delete, reopen,
//! compact and resize. Any mismatch, and any error of an operation the
//! model says is valid, panics. At the end the image must reopen strictly,
//! `check::report` must find no corruption, and every snapshot must read as
//! the model's copy.
#![no_main]

use std::path::Path;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pcow::{check, CreateOptions, Image, OpenOptions};
use pcow_fuzz::scratch_dir;

const CLUSTERS: [u64; 4] = [4 << 10, 16 << 10, 64 << 10, 2 << 20];
/// Resize never grows the image past this (the model is a Vec).
const MAX_SIZE: u64 = 16 << 20;
/// Whether the snapshot list must be in the model's order (oldest first,
/// as `Image::snapshots` documents). Finding 1 (compact reordered
/// snapshots; pcow/tests/fuzz_regressions.rs) is fixed; set this to false
/// to compare the list as a set if an order bug has to be parked again.
const STRICT_SNAPSHOT_ORDER: bool = true;

#[derive(Arbitrary, Debug)]
enum Op {
    /// `len % 20000 + 1` bytes at `off % virtual size` (clipped), a pattern
    /// that depends on `seed` and the position.
    Write {
        off: u32,
        len: u16,
        seed: u8,
    },
    /// Compares `[off, +len)` with the model.
    Read {
        off: u32,
        len: u16,
    },
    Flush,
    SnapCreate,
    /// Applies the `i % count`-th live snapshot.
    SnapApply(u8),
    /// Deletes the `i % count`-th live snapshot.
    SnapDelete(u8),
    /// Close and open again (read-write); compares everything.
    Reopen,
    /// `pcow::ops::compact` on the closed image.
    Compact,
    /// Grows by `1 + n % 4` clusters (`pcow::ops::resize`, or `Image::grow`).
    Resize {
        n: u8,
        offline: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    cluster: u8,
    size: u8,
    ops: Vec<Op>,
}

struct Snap {
    id: u32,
    tag: String,
    content: Vec<u8>,
}

struct Model {
    content: Vec<u8>,
    snaps: Vec<Snap>,
    next_tag: u32,
}

fn pattern(seed: u8, off: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let p = off + i as u64;
            seed ^ (p as u8) ^ ((p >> 9) as u8).wrapping_mul(31) ^ 0x5c
        })
        .collect()
}

fn ok<T>(r: pcow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what} failed on a valid image: {e}"))
}

fn open_rw(path: &Path) -> Image {
    ok(
        Image::open(path, OpenOptions::read_write()),
        "open read-write",
    )
}

fn read(img: &Image, off: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    ok(img.read_at(&mut b, off), "read");
    b
}

/// Compares the whole content and the snapshot list with the model.
fn compare(img: &Image, m: &Model, what: &str) {
    assert_eq!(
        img.virtual_size(),
        m.content.len() as u64,
        "{what}: virtual size"
    );
    let got = read(img, 0, m.content.len());
    if got != m.content {
        let i = got.iter().zip(&m.content).position(|(a, b)| a != b);
        panic!("{what}: content differs from the model, first at byte {i:?}");
    }
    let mut snaps: Vec<(u32, String)> =
        img.snapshots().into_iter().map(|s| (s.id, s.tag)).collect();
    let mut want: Vec<(u32, String)> = m.snaps.iter().map(|s| (s.id, s.tag.clone())).collect();
    if !STRICT_SNAPSHOT_ORDER {
        snaps.sort();
        want.sort();
    }
    assert_eq!(snaps, want, "{what}: snapshot list");
}

fn run(input: Input) {
    let cs = CLUSTERS[usize::from(input.cluster % 4)];
    let size = ((1 + u64::from(input.size % 16)) * (64 << 10)).next_multiple_of(cs);
    let path = scratch_dir().join("ops.pcow");
    let opts = CreateOptions {
        cluster_size: Some(cs),
        virtual_size: Some(size),
        base: None,
    };
    let mut img = Some(ok(Image::create(&path, &opts), "create"));
    let mut m = Model {
        content: vec![0; size as usize],
        snaps: Vec::new(),
        next_tag: 0,
    };
    for op in input.ops {
        let Some(cur) = img.as_mut() else {
            unreachable!()
        };
        match op {
            Op::Write { off, len, seed } => {
                let vs = m.content.len() as u64;
                let off = u64::from(off) % vs;
                let len = (u64::from(len) % 20000 + 1).min(vs - off) as usize;
                let data = pattern(seed, off, len);
                ok(cur.write_at(&data, off), "write");
                m.content[off as usize..off as usize + len].copy_from_slice(&data);
            }
            Op::Read { off, len } => {
                let vs = m.content.len() as u64;
                let off = u64::from(off) % vs;
                let len = (u64::from(len) + 1).min(vs - off) as usize;
                let got = read(cur, off, len);
                assert!(
                    got == m.content[off as usize..off as usize + len],
                    "read [{off}, +{len}) differs from the model"
                );
            }
            Op::Flush => ok(cur.flush(), "flush"),
            Op::SnapCreate => {
                let tag = format!("snap-{}", m.next_tag);
                m.next_tag += 1;
                let info = ok(cur.snapshot_create(&tag), "snapshot create");
                assert_eq!(info.tag, tag);
                assert!(
                    m.snaps.iter().all(|s| s.id != info.id),
                    "snapshot id {} reused",
                    info.id
                );
                m.snaps.push(Snap {
                    id: info.id,
                    tag,
                    content: m.content.clone(),
                });
            }
            Op::SnapApply(i) if !m.snaps.is_empty() => {
                let s = &m.snaps[usize::from(i) % m.snaps.len()];
                let info = ok(cur.snapshot_apply(&s.id.to_string()), "snapshot apply");
                assert_eq!((info.id, &info.tag), (s.id, &s.tag), "applied snapshot");
                // A snapshot taken before a resize is smaller than the
                // image: the grown part reads as zeros.
                let mut c = s.content.clone();
                c.resize(m.content.len().max(c.len()), 0);
                m.content = c;
                assert_eq!(
                    cur.virtual_size(),
                    m.content.len() as u64,
                    "size after apply"
                );
            }
            Op::SnapDelete(i) if !m.snaps.is_empty() => {
                let k = usize::from(i) % m.snaps.len();
                let s = m.snaps.remove(k);
                let info = ok(cur.snapshot_delete(&s.tag), "snapshot delete");
                assert_eq!(info.id, s.id, "deleted snapshot");
            }
            Op::SnapApply(_) | Op::SnapDelete(_) => {
                let r = cur.snapshot_apply("no-such-snapshot");
                assert!(r.is_err(), "applying a missing snapshot succeeded");
            }
            Op::Reopen => {
                ok(img.take().expect("open").close(), "close");
                let i = open_rw(&path);
                compare(&i, &m, "after reopen");
                img = Some(i);
            }
            Op::Compact => {
                ok(img.take().expect("open").close(), "close");
                ok(pcow::ops::compact(&path), "compact");
                let i = open_rw(&path);
                compare(&i, &m, "after compact");
                img = Some(i);
            }
            Op::Resize { n, offline } => {
                let new = m.content.len() as u64 + (1 + u64::from(n % 4)) * cs;
                if new > MAX_SIZE {
                    continue;
                }
                if offline {
                    ok(img.take().expect("open").close(), "close");
                    ok(pcow::ops::resize(&path, new), "resize");
                    img = Some(open_rw(&path));
                } else {
                    ok(cur.grow(new), "grow");
                }
                m.content.resize(new as usize, 0);
            }
        }
    }
    let Some(cur) = img.take() else {
        unreachable!()
    };
    compare(&cur, &m, "at the end");
    ok(cur.close(), "close");
    let strict = ok(
        Image::open(&path, OpenOptions::read_only()),
        "strict reopen at the end",
    );
    compare(&strict, &m, "strict reopen");
    drop(strict);
    let lenient = ok(
        Image::open(
            &path,
            OpenOptions {
                lenient: true,
                ..OpenOptions::read_only()
            },
        ),
        "lenient reopen",
    );
    let rep = check::report(&lenient);
    assert!(
        rep.corruptions.is_empty() && rep.leaks.is_empty(),
        "a valid operation sequence left findings: {:?} {:?}",
        rep.corruptions,
        rep.leaks
    );
    // Every snapshot still reads as it was taken: apply each on a writer.
    drop(lenient);
    if !m.snaps.is_empty() {
        let mut w = open_rw(&path);
        for s in &m.snaps {
            ok(w.snapshot_apply(&s.id.to_string()), "final snapshot apply");
            let got = read(&w, 0, s.content.len());
            assert!(
                got == s.content,
                "snapshot {} differs from the model",
                s.tag
            );
        }
        ok(w.close(), "close");
    }
}

fuzz_target!(|input: Input| run(input));
