//! Model-based property tests: random sequences of operations on real image
//! files, compared byte for byte after every step with a plain in-memory
//! model (the content of each image of the chain and of each snapshot).
//!
//! Every step is followed by a full comparison of the open image with the
//! model; most steps are also followed by a close, a `check` of the closed
//! file and a reopen (the others keep staged state across steps on purpose).
//! At the end of a case every file of the chain is checked, read back and
//! has each of its snapshots applied on a scratch copy.

use std::path::PathBuf;

use pcow::{BaseFormat, BaseRef, CreateOptions, Image, OpenOptions};
use proptest::prelude::*;
use proptest::test_runner::Config;

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;
/// The cluster sizes under test.
const CLUSTERS: [u64; 4] = [4 << 10, 16 << 10, 64 << 10, 2 << 20];
/// Chains are kept well under the 32-image limit.
const MAX_DEPTH: usize = 6;

// ----- operations, with positions resolved against the image at run time -----

/// A byte offset, relative to the image's geometry when the step runs
/// (clamped into the image).
#[derive(Clone, Debug)]
enum Pos {
    /// Cluster boundary `k % clusters`, plus a delta.
    Cluster(u32, i32),
    /// Page boundary `k % pages`, plus a delta.
    Page(u32, i32),
    /// The end of the image, plus a (usually negative) delta.
    End(i32),
    /// Anywhere.
    Any(u32),
}

/// A length, relative to the geometry (clamped to the end of the image).
#[derive(Clone, Debug)]
enum Len {
    Bytes(u32),
    /// One page plus a delta.
    Page(i32),
    Pages(u8),
    /// `n` clusters plus a delta.
    Clusters(u8, i32),
    /// Up to the next cluster boundary.
    ToClusterEnd,
    /// Up to the end of the image.
    ToEnd,
}

#[derive(Clone, Debug)]
enum Data {
    Fill(u8),
    Random(u64),
}

/// Size of an independent base for a safe rebase, relative to the image.
#[derive(Clone, Copy, Debug)]
enum Size {
    Smaller,
    Same,
    Larger,
}

#[derive(Clone, Debug)]
enum Op {
    Write(Pos, Len, Data),
    Flush,
    SnapCreate,
    /// Apply snapshot `k % count`, by id or by tag.
    SnapApply(usize, bool),
    /// Delete snapshot `k % count`, by id or by tag.
    SnapDelete(usize, bool),
    /// Close and reopen read-write (after a read-only look when set).
    Reopen(bool),
    /// Continue on a new overlay of the image (one cluster larger when set),
    /// with the same cluster size or `CLUSTERS[k % 4]`.
    Overlay(bool, Option<usize>),
    /// `ops::commit(path, keep)`.
    Commit(bool),
    /// Drop the overlay and continue on its (pcow) base.
    Down,
    /// Safe rebase onto a new independent file (raw when set), built from a seed.
    RebaseSafe(bool, Size, u64),
    RebaseFlatten,
    /// Unsafe rebase onto a byte-identical copy of the base.
    RebaseUnsafeCopy,
    Compact,
    /// Grow by `n` clusters, on the open image or with `ops::resize` when set.
    Resize(u8, bool),
}

#[derive(Clone, Debug)]
struct Step {
    op: Op,
    /// Close, check and reopen after the step.
    reopen: bool,
}

fn delta() -> impl Strategy<Value = i32> {
    prop_oneof![
        4 => Just(0),
        2 => Just(-1),
        2 => Just(1),
        1 => Just(-2048),
        2 => -5000i32..5000,
    ]
}

fn pos() -> impl Strategy<Value = Pos> {
    prop_oneof![
        3 => (any::<u32>(), delta()).prop_map(|(k, d)| Pos::Cluster(k, d)),
        3 => (any::<u32>(), delta()).prop_map(|(k, d)| Pos::Page(k, d)),
        1 => prop_oneof![Just(-1), Just(-4096), Just(-4097), -70_000i32..0].prop_map(Pos::End),
        2 => any::<u32>().prop_map(Pos::Any),
    ]
}

fn len() -> impl Strategy<Value = Len> {
    prop_oneof![
        3 => prop_oneof![Just(1u32), Just(2u32), 1u32..600].prop_map(Len::Bytes),
        3 => delta().prop_map(Len::Page),
        1 => (1u8..5).prop_map(Len::Pages),
        2 => (0u8..3, delta()).prop_map(|(n, d)| Len::Clusters(n, d)),
        1 => Just(Len::ToClusterEnd),
        1 => Just(Len::ToEnd),
    ]
}

fn data() -> impl Strategy<Value = Data> {
    prop_oneof![
        1 => Just(Data::Fill(0)),
        3 => any::<u8>().prop_map(Data::Fill),
        3 => any::<u64>().prop_map(Data::Random),
    ]
}

fn op(chains: bool) -> BoxedStrategy<Op> {
    let local = prop_oneof![
        12 => (pos(), len(), data()).prop_map(|(p, l, d)| Op::Write(p, l, d)),
        2 => Just(Op::Flush),
        3 => Just(Op::SnapCreate),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(k, id)| Op::SnapApply(k, id)),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(k, id)| Op::SnapDelete(k, id)),
        2 => any::<bool>().prop_map(Op::Reopen),
        2 => Just(Op::Compact),
        1 => (1u8..3, any::<bool>()).prop_map(|(n, closed)| Op::Resize(n, closed)),
    ];
    if !chains {
        return local.boxed();
    }
    let size = prop_oneof![Just(Size::Smaller), Just(Size::Same), Just(Size::Larger)];
    prop_oneof![
        10 => local,
        2 => (any::<bool>(), prop_oneof![3 => Just(None), 1 => any::<usize>().prop_map(Some)])
            .prop_map(|(larger, cs)| Op::Overlay(larger, cs)),
        2 => any::<bool>().prop_map(Op::Commit),
        1 => Just(Op::Down),
        1 => (any::<bool>(), size, any::<u64>()).prop_map(|(raw, s, seed)| Op::RebaseSafe(raw, s, seed)),
        1 => Just(Op::RebaseFlatten),
        1 => Just(Op::RebaseUnsafeCopy),
    ]
    .boxed()
}

fn steps(chains: bool) -> impl Strategy<Value = Vec<Step>> {
    let step =
        (op(chains), proptest::bool::weighted(0.6)).prop_map(|(op, reopen)| Step { op, reopen });
    proptest::collection::vec(step, 5..=40)
}

/// Cluster size (index into [`CLUSTERS`], below 2 MiB) and virtual size in
/// clusters, up to 2 MiB, biased to small images.
fn small_geometry() -> impl Strategy<Value = (u64, u64)> {
    (0usize..3).prop_flat_map(|i| {
        let cs = CLUSTERS[i];
        let max = (2 * MIB / cs).max(1);
        (Just(cs), prop_oneof![1..=max.min(4), 1..=max])
    })
}

// ----- the model -----

/// A deterministic byte stream (splitmix64).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

#[derive(Clone, Debug)]
struct Snap {
    tag: String,
    id: u32,
    content: Vec<u8>,
}

/// One file of the chain: its content (the view it gives, of its own size)
/// and, for pcow, its snapshots.
#[derive(Debug)]
struct Level {
    name: String,
    raw: bool,
    /// Cluster size (pcow).
    cs: u64,
    content: Vec<u8>,
    snaps: Vec<Snap>,
}

fn assert_same(actual: &[u8], expected: &[u8], what: &str) {
    if actual == expected {
        return;
    }
    assert_eq!(actual.len(), expected.len(), "{what}: length differs");
    let first = actual
        .iter()
        .zip(expected)
        .position(|(a, e)| a != e)
        .unwrap();
    let last = actual
        .iter()
        .zip(expected)
        .rposition(|(a, e)| a != e)
        .unwrap();
    let pages = (0..actual.len().div_ceil(PAGE as usize))
        .filter(|p| {
            let r = p * PAGE as usize..((p + 1) * PAGE as usize).min(actual.len());
            actual[r.clone()] != expected[r]
        })
        .count();
    panic!(
        "{what}: content differs in bytes {first}..={last} ({pages} page(s)); \
         at {first}: got {:#04x}, expected {:#04x}",
        actual[first], expected[first]
    );
}

fn read_all(img: &Image) -> Vec<u8> {
    let mut buf = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut buf, 0).unwrap();
    buf
}

struct Run {
    dir: tempfile::TempDir,
    max_vs: u64,
    stack: Vec<Level>,
    img: Option<Image>,
    seq: u32,
}

impl Run {
    fn new(cs: u64, vs: u64) -> Run {
        // Real files; on tmpfs when there is one, since every barrier syncs.
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm).or_else(|_| tempfile::tempdir())
        } else {
            tempfile::tempdir()
        }
        .unwrap();
        let name = "img0.pcow".to_owned();
        let opts = CreateOptions {
            cluster_size: Some(cs),
            virtual_size: Some(vs),
            base: None,
        };
        let img = Image::create(dir.path().join(&name), &opts).unwrap();
        Run {
            dir,
            max_vs: if cs >= 2 * MIB { 10 * cs } else { 4 * MIB },
            stack: vec![Level {
                name,
                raw: false,
                cs,
                content: vec![0; vs as usize],
                snaps: Vec::new(),
            }],
            img: Some(img),
            seq: 0,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn top(&self) -> &Level {
        self.stack.last().unwrap()
    }

    fn top_mut(&mut self) -> &mut Level {
        self.stack.last_mut().unwrap()
    }

    fn top_path(&self) -> PathBuf {
        self.path(&self.top().name)
    }

    fn base(&self) -> Option<&Level> {
        self.stack.len().checked_sub(2).map(|i| &self.stack[i])
    }

    fn cs(&self) -> u64 {
        self.top().cs
    }

    fn vs(&self) -> u64 {
        self.top().content.len() as u64
    }

    fn fresh(&mut self, prefix: &str, ext: &str) -> String {
        self.seq += 1;
        format!("{prefix}{}.{ext}", self.seq)
    }

    fn img(&mut self) -> &mut Image {
        self.img.as_mut().expect("the top image is open")
    }

    fn close(&mut self) {
        if let Some(img) = self.img.take() {
            img.close().unwrap();
        }
    }

    fn open(&mut self) {
        assert!(self.img.is_none());
        self.img = Some(Image::open(self.top_path(), OpenOptions::read_write()).unwrap());
    }

    /// What the top image shows where it holds nothing: its base's view,
    /// zeros past the base's end.
    fn base_view(&self, off: usize, len: usize) -> Vec<u8> {
        self.view_below(self.stack.len() - 1, off, len)
    }

    /// What level `i` shows where it holds nothing.
    fn view_below(&self, i: usize, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        if let Some(b) = i.checked_sub(1).map(|j| &self.stack[j]) {
            let end = (off + len).min(b.content.len());
            if off < end {
                v[..end - off].copy_from_slice(&b.content[off..end]);
            }
        }
        v
    }

    fn check_clean(&self, name: &str) {
        let r = pcow::check::check(&self.path(name), None, false).unwrap();
        assert!(r.is_clean(), "check {name}: {r:?}");
    }

    /// The open image against the model: content and snapshot list.
    fn verify(&self, img: &Image, when: &str) {
        let top = self.top();
        assert_eq!(img.virtual_size(), top.content.len() as u64, "{when}: size");
        assert_same(&read_all(img), &top.content, when);
        let mut got: Vec<(u32, String)> =
            img.snapshots().into_iter().map(|s| (s.id, s.tag)).collect();
        got.sort();
        let mut want: Vec<(u32, String)> =
            top.snaps.iter().map(|s| (s.id, s.tag.clone())).collect();
        want.sort();
        assert_eq!(got, want, "{when}: snapshots");
    }

    fn verify_open(&self, when: &str) {
        self.verify(self.img.as_ref().unwrap(), when);
    }

    /// The view of every snapshot of level `i`, by applying each on a scratch
    /// copy in the same directory (so that its base name resolves the same).
    fn snapshot_views(&self, i: usize) -> Vec<Vec<u8>> {
        let level = &self.stack[i];
        if level.snaps.is_empty() {
            return Vec::new();
        }
        let scratch = self.path("scratch.pcow");
        std::fs::copy(self.path(&level.name), &scratch).unwrap();
        let mut img = Image::open(&scratch, OpenOptions::read_write()).unwrap();
        let views = level
            .snaps
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let key = if k % 2 == 0 {
                    s.tag.clone()
                } else {
                    s.id.to_string()
                };
                img.snapshot_apply(&key).unwrap();
                read_all(&img)
            })
            .collect();
        img.close().unwrap();
        std::fs::remove_file(&scratch).unwrap();
        views
    }

    fn verify_snapshots(&self, i: usize, when: &str) {
        for (s, view) in self.stack[i].snaps.iter().zip(self.snapshot_views(i)) {
            assert_same(
                &view,
                &s.content,
                &format!("{when}: snapshot {} of {}", s.tag, self.stack[i].name),
            );
        }
    }

    /// A closed lower level (or the closed top) against the model.
    fn verify_level(&self, i: usize, when: &str) {
        let level = &self.stack[i];
        let what = format!("{when}: {}", level.name);
        if level.raw {
            assert_same(
                &std::fs::read(self.path(&level.name)).unwrap(),
                &level.content,
                &what,
            );
            return;
        }
        self.check_clean(&level.name);
        let img = Image::open(self.path(&level.name), OpenOptions::read_only()).unwrap();
        assert_same(&read_all(&img), &level.content, &what);
        drop(img);
        self.verify_snapshots(i, when);
    }

    fn run(&mut self, steps: &[Step]) {
        self.verify_open("after create");
        for (n, step) in steps.iter().enumerate() {
            let when = format!("step {n} ({:?})", step.op);
            self.step(&step.op, &when);
            if self.img.is_none() {
                self.open();
            }
            self.verify_open(&when);
            if step.reopen {
                self.close();
                self.check_clean(&self.top().name.clone());
                self.open();
                self.verify_open(&format!("{when}, reopened"));
            }
        }
        self.close();
        for i in (0..self.stack.len()).rev() {
            self.verify_level(i, "at the end");
        }
    }

    fn step(&mut self, op: &Op, when: &str) {
        match op {
            Op::Write(p, l, d) => self.write(p, l, d),
            Op::Flush => self.img().flush().unwrap(),
            Op::SnapCreate => {
                let tag = format!("s{}", self.seq + 1);
                self.seq += 1;
                let info = self.img().snapshot_create(&tag).unwrap();
                assert_eq!(info.tag, tag);
                assert!(
                    self.top().snaps.iter().all(|s| s.id != info.id),
                    "{when}: id reused"
                );
                let content = self.top().content.clone();
                self.top_mut().snaps.push(Snap {
                    tag,
                    id: info.id,
                    content,
                });
            }
            Op::SnapApply(k, by_id) => {
                let Some(s) = self.pick(*k) else { return };
                let key = if *by_id {
                    s.id.to_string()
                } else {
                    s.tag.clone()
                };
                let info = self.img().snapshot_apply(&key).unwrap();
                assert_eq!((info.id, &info.tag), (s.id, &s.tag), "{when}");
                self.top_mut().content = s.content;
            }
            Op::SnapDelete(k, by_id) => {
                let Some(s) = self.pick(*k) else { return };
                let key = if *by_id {
                    s.id.to_string()
                } else {
                    s.tag.clone()
                };
                self.img().snapshot_delete(&key).unwrap();
                self.top_mut().snaps.retain(|x| x.id != s.id);
            }
            Op::Reopen(ro) => {
                self.close();
                self.check_clean(&self.top().name.clone());
                if *ro {
                    let mut img = Image::open(self.top_path(), OpenOptions::read_only()).unwrap();
                    self.verify(&img, &format!("{when}, read-only"));
                    assert!(img.write_at(&[1], 0).is_err(), "{when}: read-only write");
                    drop(img);
                }
                self.open();
            }
            Op::Overlay(larger, k) => {
                if self.stack.len() >= MAX_DEPTH {
                    return;
                }
                self.close();
                let base = self.top().name.clone();
                let name = self.fresh("o", "pcow");
                let cs = k.map_or(self.cs(), |k| CLUSTERS[k % CLUSTERS.len()]);
                // Without a size, the overlay takes its base's, rounded up.
                let mut vs = self.vs().next_multiple_of(cs);
                if *larger && vs < self.max_vs {
                    vs += cs;
                }
                let opts = CreateOptions {
                    cluster_size: Some(cs),
                    virtual_size: larger.then_some(vs),
                    base: Some(BaseRef {
                        name: base,
                        format: BaseFormat::Pcow,
                    }),
                };
                let img = Image::create(self.path(&name), &opts).unwrap();
                self.stack.push(Level {
                    name,
                    raw: false,
                    cs,
                    content: Vec::new(),
                    snaps: Vec::new(),
                });
                self.top_mut().content = self.base_view(0, vs as usize);
                self.img = Some(img);
            }
            Op::Commit(keep) => self.commit(*keep, when),
            Op::Down => {
                if self.base().is_none_or(|b| b.raw) {
                    return;
                }
                self.close();
                std::fs::remove_file(self.top_path()).unwrap();
                self.stack.pop();
            }
            Op::RebaseSafe(raw, size, seed) => self.rebase_safe(*raw, *size, *seed, when),
            Op::RebaseFlatten => {
                self.close();
                pcow::ops::rebase(&self.top_path(), None, false).unwrap();
                let top = self.stack.pop().unwrap();
                self.stack = vec![top];
                self.check_clean(&self.top().name.clone());
            }
            Op::RebaseUnsafeCopy => {
                let Some(base) = self.base() else { return };
                let (old, raw) = (base.name.clone(), base.raw);
                self.close();
                let copy = self.fresh("copy", if raw { "raw" } else { "pcow" });
                std::fs::copy(self.path(&old), self.path(&copy)).unwrap();
                let format = if raw {
                    BaseFormat::Raw
                } else {
                    BaseFormat::Pcow
                };
                let new = BaseRef {
                    name: copy.clone(),
                    format,
                };
                pcow::ops::rebase(&self.top_path(), Some(new), true).unwrap();
                // The old base must not be needed any more.
                std::fs::remove_file(self.path(&old)).unwrap();
                let i = self.stack.len() - 2;
                self.stack[i].name = copy;
                self.check_clean(&self.top().name.clone());
            }
            Op::Compact => {
                self.close();
                pcow::ops::compact(&self.top_path()).unwrap();
                self.check_clean(&self.top().name.clone());
                self.verify_snapshots(self.stack.len() - 1, &format!("{when}, after compact"));
            }
            Op::Resize(n, closed) => {
                let new = self.vs() + u64::from(*n) * self.cs();
                if new > self.max_vs {
                    return;
                }
                if *closed {
                    self.close();
                    pcow::ops::resize(&self.top_path(), new).unwrap();
                } else {
                    self.img().grow(new).unwrap();
                }
                let old = self.vs() as usize;
                // Grown space reads as zeros, whatever the base holds there.
                let tail = vec![0u8; new as usize - old];
                let top = self.top_mut();
                top.content.extend_from_slice(&tail);
                // Snapshots share the header's virtual size.
                for s in &mut top.snaps {
                    s.content.extend_from_slice(&tail);
                }
            }
        }
    }

    fn pick(&self, k: usize) -> Option<Snap> {
        let snaps = &self.top().snaps;
        (!snaps.is_empty()).then(|| snaps[k % snaps.len()].clone())
    }

    fn write(&mut self, p: &Pos, l: &Len, d: &Data) {
        let (vs, cs) = (self.vs() as i64, self.cs() as i64);
        let page = PAGE as i64;
        let off = match *p {
            Pos::Cluster(k, dl) => (i64::from(k) % (vs / cs)) * cs + i64::from(dl),
            Pos::Page(k, dl) => (i64::from(k) % (vs / page)) * page + i64::from(dl),
            Pos::End(dl) => vs + i64::from(dl),
            Pos::Any(x) => i64::from(x) % vs,
        }
        .clamp(0, vs - 1);
        let len = match *l {
            Len::Bytes(n) => i64::from(n),
            Len::Page(dl) => page + i64::from(dl),
            Len::Pages(n) => i64::from(n) * page,
            Len::Clusters(n, dl) => i64::from(n) * cs + i64::from(dl),
            Len::ToClusterEnd => cs - off % cs,
            Len::ToEnd => vs - off,
        }
        .clamp(1, vs - off) as usize;
        let buf = match *d {
            Data::Fill(b) => vec![b; len],
            Data::Random(seed) => bytes(seed, len),
        };
        self.img().write_at(&buf, off as u64).unwrap();
        let off = off as usize;
        self.top_mut().content[off..off + len].copy_from_slice(&buf);
    }

    fn commit(&mut self, keep: bool, when: &str) {
        let Some(base) = self.base() else { return };
        let base_name = base.name.clone();
        let base_raw = base.raw;
        self.close();
        let r = pcow::ops::commit(&self.top_path(), keep).unwrap();
        let has_snaps = !self.top().snaps.is_empty();
        assert_eq!(r.emptied, !keep && !has_snaps, "{when}: {r:?}");
        // The base now holds the overlay's content (grown to its size).
        let content = self.top().content.clone();
        let i = self.stack.len() - 2;
        let old_len = self.stack[i].content.len();
        if old_len < content.len() {
            // Growing the base grows its snapshots too (one virtual size).
            let new_len = if base_raw {
                content.len()
            } else {
                content.len().next_multiple_of(self.stack[i].cs as usize)
            };
            // Grown space reads as zeros, whatever lies below the base.
            let tail = vec![0u8; new_len - old_len];
            let b = &mut self.stack[i];
            b.content.extend_from_slice(&tail);
            for s in &mut b.snaps {
                s.content.extend_from_slice(&tail);
            }
        }
        let b = &mut self.stack[i];
        b.content[..content.len()].copy_from_slice(&content);
        let b = &self.stack[i];
        let what = format!("{when}: base {base_name} right after commit");
        if base_raw {
            assert_same(
                &std::fs::read(self.path(&base_name)).unwrap(),
                &b.content,
                &what,
            );
        } else {
            self.check_clean(&base_name);
            let img = Image::open(self.path(&base_name), OpenOptions::read_only()).unwrap();
            assert_same(&read_all(&img), &b.content, &what);
        }
        self.check_clean(&self.top().name.clone());
        // A page of an overlay snapshot that no layer of it holds now shows
        // the new base; one that it holds is unchanged.
        let views = self.snapshot_views(self.stack.len() - 1);
        let top = self.stack.len() - 1;
        for (k, view) in views.into_iter().enumerate() {
            let s = &self.stack[top].snaps[k];
            let new_base = &self.stack[top - 1].content;
            for (p, (got, old)) in view
                .chunks(PAGE as usize)
                .zip(s.content.chunks(PAGE as usize))
                .enumerate()
            {
                let at = p * PAGE as usize;
                let nb = &new_base[at..at + got.len()];
                assert!(
                    got == old || got == nb,
                    "{when}: snapshot {} page {p} is neither its old content nor the new base's",
                    s.tag
                );
            }
            self.stack[top].snaps[k].content = view;
        }
    }

    fn rebase_safe(&mut self, raw: bool, size: Size, seed: u64, when: &str) {
        let vs = self.vs();
        let cs = self.cs();
        self.close();
        let name = self.fresh("b", if raw { "raw" } else { "pcow" });
        let path = self.path(&name);
        let mut snaps = Vec::new();
        let content = if raw {
            let len = match size {
                Size::Smaller => vs.saturating_sub(1000).max(1),
                Size::Same => vs,
                Size::Larger => vs + 777,
            } as usize;
            let mut c = bytes(seed, len);
            // Some runs of zeros, page-aligned and not.
            let z = bytes(seed ^ 1, 8);
            for w in z.chunks(2) {
                let at = usize::from(w[0]) * len / 256;
                let n = (usize::from(w[1]) * 97).min(len - at);
                c[at..at + n].fill(0);
            }
            std::fs::write(&path, &c).unwrap();
            c
        } else {
            let bvs = match size {
                Size::Smaller => vs.saturating_sub(cs).max(cs),
                Size::Same => vs,
                Size::Larger => vs + cs,
            };
            let opts = CreateOptions {
                cluster_size: Some(cs),
                virtual_size: Some(bvs),
                base: None,
            };
            let mut img = Image::create(&path, &opts).unwrap();
            let mut c = vec![0u8; bvs as usize];
            let r = bytes(seed, 32);
            for (k, w) in r.chunks(8).enumerate() {
                let at = (u64::from(u32::from_le_bytes(w[..4].try_into().unwrap())) % bvs) as usize;
                let n = (u64::from(u16::from_le_bytes(w[4..6].try_into().unwrap())) * 7 + 1)
                    .min(bvs - at as u64) as usize;
                let d = bytes(seed.wrapping_add(k as u64), n);
                img.write_at(&d, at as u64).unwrap();
                c[at..at + n].copy_from_slice(&d);
                if k == 1 && w[6] & 1 == 1 {
                    let info = img.snapshot_create("b").unwrap();
                    snaps.push(Snap {
                        tag: "b".into(),
                        id: info.id,
                        content: c.clone(),
                    });
                }
            }
            img.close().unwrap();
            c
        };
        let format = if raw {
            BaseFormat::Raw
        } else {
            BaseFormat::Pcow
        };
        let new = BaseRef {
            name: name.clone(),
            format,
        };
        pcow::ops::rebase(&self.top_path(), Some(new), false)
            .unwrap_or_else(|e| panic!("{when}: {e}"));
        let top = self.stack.pop().unwrap();
        self.stack = vec![
            Level {
                name,
                raw,
                cs,
                content,
                snaps,
            },
            top,
        ];
        self.check_clean(&self.top().name.clone());
        self.verify_snapshots(1, &format!("{when}, after safe rebase"));
    }
}

fn run_case(cs: u64, vs: u64, steps: &[Step]) {
    Run::new(cs, vs).run(steps);
}

/// `cases`, times `PCOW_MODEL_SCALE` when set (for longer bug hunts).
fn config(cases: u32) -> Config {
    let scale = std::env::var("PCOW_MODEL_SCALE")
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .unwrap_or(1);
    Config {
        cases: cases * scale.max(1),
        failure_persistence: None,
        max_shrink_time: 120_000,
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config(300))]
    /// One file: I/O, barriers, snapshots, reopen, compact, resize.
    #[test]
    fn model_single_file((cs, clusters) in small_geometry(), steps in steps(false)) {
        run_case(cs, clusters * cs, &steps);
    }
}

proptest! {
    #![proptest_config(config(500))]
    /// Everything, chains included (overlay, commit, rebase).
    #[test]
    fn model_chains((cs, clusters) in small_geometry(), steps in steps(true)) {
        run_case(cs, clusters * cs, &steps);
    }
}

proptest! {
    #![proptest_config(config(32))]
    /// Everything, with 2 MiB clusters (2 to 8 of them).
    #[test]
    fn model_2m_clusters(clusters in 2u64..=8, steps in steps(true)) {
        run_case(CLUSTERS[3], clusters * CLUSTERS[3], &steps);
    }
}

// ----- deterministic regressions (shrunk cases) -----

fn write_step(p: Pos, l: Len, d: Data) -> Step {
    Step {
        op: Op::Write(p, l, d),
        reopen: false,
    }
}

fn step(op: Op, reopen: bool) -> Step {
    Step { op, reopen }
}

/// Shrunk from `model_chains`: a commit that grows a smaller pcow base grows
/// the base's snapshots too (the model once forgot them).
#[test]
fn regression_commit_grows_base_and_its_snapshots() {
    let steps = [
        write_step(
            Pos::Cluster(132_866_242, 0),
            Len::Clusters(2, 0),
            Data::Random(7_461_424_430_035_839_736),
        ),
        step(Op::SnapDelete(7_172_813_871_147_087_797, true), true),
        step(Op::Compact, false),
        step(
            Op::RebaseSafe(false, Size::Smaller, 15_642_540_847_561_038_070),
            false,
        ),
        step(Op::Commit(true), true),
    ];
    run_case(4096, 2 * 4096, &steps);
}

/// Growing an image whose base is larger shows zeros in the new range (the
/// spec's "Grow"), for the image and for its snapshots, not the base's data.
#[test]
fn regression_grow_over_a_larger_base() {
    let steps = [
        step(Op::SnapCreate, false),
        step(Op::RebaseSafe(false, Size::Larger, 0), false),
        step(Op::Resize(1, false), true),
        step(Op::SnapApply(0, true), false),
        step(Op::RebaseSafe(true, Size::Larger, 1), false),
        step(Op::Resize(1, true), true),
    ];
    run_case(4096, 4096, &steps);
}

/// Shrunk from `model_chains` and `model_2m_clusters` (`RebaseSafe(Larger)`,
/// `Overlay(larger)`, `Commit`): when commit grows a base that itself has a
/// larger base, the grown region of the base once showed the data of the
/// base's base instead of what the overlay showed there (zeros).
#[test]
fn commit_growing_base_exposes_its_base() {
    let d = tempfile::tempdir().unwrap();
    let path = |n: &str| d.path().join(n);
    let create = |n: &str, vs: u64, base: Option<&str>| {
        let opts = CreateOptions {
            cluster_size: Some(4096),
            virtual_size: Some(vs),
            base: base.map(|b| BaseRef {
                name: b.into(),
                format: BaseFormat::Pcow,
            }),
        };
        Image::create(path(n), &opts).unwrap()
    };
    let read = |n: &str| read_all(&Image::open(path(n), OpenOptions::read_only()).unwrap());
    // low: 8 KiB of 0x51; mid: 4 KiB over it; top: 8 KiB over mid.
    let mut low = create("low.pcow", 8192, None);
    low.write_at(&[0x51; 8192], 0).unwrap();
    low.close().unwrap();
    create("mid.pcow", 4096, Some("low.pcow")).close().unwrap();
    create("top.pcow", 8192, Some("mid.pcow")).close().unwrap();
    let mut expected = vec![0x51u8; 4096];
    expected.resize(8192, 0);
    assert_same(&read("top.pcow"), &expected, "top before commit");
    pcow::ops::commit(&path("top.pcow"), false).unwrap();
    assert_same(&read("mid.pcow"), &expected, "mid after commit");
    assert_same(&read("top.pcow"), &expected, "top after commit");
}
