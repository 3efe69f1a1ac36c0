//! Crash-injection tests for the barrier (docs/pcow-format.md: "Slots and
//! generations", "Updates: the barrier", "Consistency rules").
//!
//! Each scenario runs on a [`CrashDisk`], a `Storage` that records every
//! write, sync and length change. Afterwards the log is replayed: for every
//! prefix of it (every crash point) several crash states are built from the
//! durable bytes plus a subset of the writes issued since the last sync, each
//! applied fully or torn at 512-byte sector granularity (none, all, each
//! write alone, all torn at a middle sector either way, seeded-random
//! subsets with random sector masks). `set_len` and `allocate` are file
//! system metadata and take effect at once.
//!
//! Every crash state must:
//! - open (lenient, read-only) with no corruption in `check::report` (leaks
//!   L1-L3 are allowed);
//! - hold, at every byte, the content of the last completed barrier, unless
//!   the byte was written since, when it may hold any value written since;
//!   while a barrier is in flight the state may instead be the barrier's
//!   outcome (a rollback's content, a snapshot's new tag list);
//! - list exactly the snapshots of that state;
//! - open read-write with the same content, take a new write and a barrier,
//!   show each snapshot's content at its creation (by applying it), close;
//! - then check fully clean (`is_clean`) with the content left by that
//!   session.
//!
//! Run with `--nocapture` to see how many crash states each scenario
//! verified.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use pcow::io::Storage;
use pcow::{BaseFormat, BaseRef, CreateOptions, Image, LiveImage, OpenOptions};

const SECTOR: u64 = 512;
/// Seeded-random subsets of the pending writes tried at each crash point.
const RANDOM_SUBSETS: usize = 5;
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------------------
// The recording disk
// ---------------------------------------------------------------------------

/// One recorded storage call. `Write` and `Sync` are events; `SetLen` is
/// file-system metadata and durable at once.
#[derive(Clone, Debug)]
enum Op {
    Write { off: u64, data: Arc<[u8]> },
    Sync,
    SetLen(u64),
}

#[derive(Default)]
struct DiskState {
    /// What reads see: every write applied.
    bytes: Vec<u8>,
    /// The log, when recording.
    log: Option<Vec<Op>>,
}

/// A `Storage` in memory. Clones share the bytes, so a test keeps a handle
/// while the image owns its box. A recording disk logs every call; the
/// crash states themselves are produced by replaying the log (see
/// [`Replay`]): the durable bytes plus any chosen subset of the writes issued
/// since the last sync.
#[derive(Clone, Default)]
struct CrashDisk {
    inner: Arc<Mutex<DiskState>>,
}

impl CrashDisk {
    fn recording(bytes: Vec<u8>) -> Self {
        CrashDisk {
            inner: Arc::new(Mutex::new(DiskState {
                bytes,
                log: Some(Vec::new()),
            })),
        }
    }

    fn plain(bytes: Vec<u8>) -> Self {
        CrashDisk {
            inner: Arc::new(Mutex::new(DiskState { bytes, log: None })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, DiskState> {
        self.inner.lock().unwrap()
    }

    /// Log position: number of recorded calls so far.
    fn pos(&self) -> usize {
        self.lock().log.as_ref().map_or(0, Vec::len)
    }

    fn log(&self) -> Vec<Op> {
        self.lock().log.clone().unwrap_or_default()
    }

    fn record(&self, op: Op) {
        if let Some(log) = &mut self.lock().log {
            log.push(op);
        }
    }
}

impl Storage for CrashDisk {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let s = self.lock();
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= s.bytes.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        buf.copy_from_slice(&s.bytes[offset as usize..end as usize]);
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        {
            let mut s = self.lock();
            let end = offset as usize + buf.len();
            if end > s.bytes.len() {
                s.bytes.resize(end, 0);
            }
            s.bytes[offset as usize..end].copy_from_slice(buf);
        }
        self.record(Op::Write {
            off: offset,
            data: buf.into(),
        });
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        self.record(Op::Sync);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.lock().bytes.len() as u64)
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.lock().bytes.resize(len as usize, 0);
        self.record(Op::SetLen(len));
        Ok(())
    }
    // `allocate`: the default (extend with zeros through `set_len`).

    /// The same disk: a staged commit's writes and syncs land in the same
    /// log, in the order they are issued.
    fn commit_io(&self) -> io::Result<Box<dyn pcow::io::CommitIo>> {
        Ok(Box::new(self.clone()))
    }
}

impl pcow::io::CommitIo for CrashDisk {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        Storage::write_at(self, buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        Storage::sync(self)
    }
}

// ---------------------------------------------------------------------------
// Replaying the log into crash states
// ---------------------------------------------------------------------------

/// A write issued since the last sync, clipped by later truncations.
#[derive(Clone)]
struct Pending {
    /// Log position of the write.
    pos: usize,
    off: u64,
    data: Arc<[u8]>,
    len: usize,
}

/// How much of a pending write reaches the disk.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Part {
    Full,
    /// The sectors before the middle one.
    Head,
    /// The middle sector and after.
    Tail,
    /// A random subset of its sectors.
    Sectors(u64),
}

impl Pending {
    fn sector_range(&self) -> (u64, u64) {
        let first = self.off / SECTOR;
        let last = (self.off + self.len as u64 - 1) / SECTOR;
        (first, last - first + 1)
    }

    fn apply(&self, img: &mut [u8], part: Part) {
        if self.len == 0 {
            return;
        }
        let end = self.off + self.len as u64;
        let mut copy = |from: u64, to: u64| {
            let (a, b) = (from.max(self.off), to.min(end));
            if a < b {
                img[a as usize..b as usize]
                    .copy_from_slice(&self.data[(a - self.off) as usize..(b - self.off) as usize]);
            }
        };
        let (first, n) = self.sector_range();
        let mid = first + n / 2;
        match part {
            Part::Full => copy(self.off, end),
            Part::Head => copy(self.off, mid * SECTOR),
            Part::Tail => copy(mid * SECTOR, end),
            Part::Sectors(seed) => {
                for s in first..first + n {
                    if mix(seed ^ s.wrapping_mul(0x2545_f491_4f6c_dd1d)) & 1 == 1 {
                        copy(s * SECTOR, (s + 1) * SECTOR);
                    }
                }
            }
        }
    }

    fn describe(&self, part: Part) -> String {
        format!(
            "write@log{} [{:#x}, +{:#x}) {part:?}",
            self.pos, self.off, self.len
        )
    }
}

/// The durable bytes and the pending writes at one crash point.
struct Replay {
    durable: Vec<u8>,
    pending: Vec<Pending>,
    /// Bumped whenever `durable` changes: with the applied subset it
    /// identifies a crash image.
    version: u64,
    /// Syncs at or after this log position are ignored (a disk that lies
    /// about flushes; only the self-test uses it).
    honor_syncs_before: usize,
}

impl Replay {
    fn new(initial: Vec<u8>, honor_syncs_before: usize) -> Self {
        Replay {
            durable: initial,
            pending: Vec::new(),
            version: 0,
            honor_syncs_before,
        }
    }

    fn step(&mut self, pos: usize, op: &Op) {
        match op {
            Op::Write { off, data } => {
                let end = *off as usize + data.len();
                if end > self.durable.len() {
                    // The size is metadata: the file is longer at once, the
                    // new bytes read as zeros until the data is durable.
                    self.durable.resize(end, 0);
                    self.version += 1;
                }
                self.pending.push(Pending {
                    pos,
                    off: *off,
                    data: data.clone(),
                    len: data.len(),
                });
            }
            Op::Sync => {
                if pos < self.honor_syncs_before {
                    for p in std::mem::take(&mut self.pending) {
                        p.apply(&mut self.durable, Part::Full);
                    }
                }
                self.version += 1;
            }
            Op::SetLen(len) => {
                self.durable.resize(*len as usize, 0);
                self.pending.retain_mut(|p| {
                    if p.off >= *len {
                        return false;
                    }
                    p.len = p.len.min((*len - p.off) as usize);
                    true
                });
                self.version += 1;
            }
        }
    }

    /// The subsets of pending writes to try at this crash point.
    fn subsets(&self, rng: &mut Rng) -> Vec<Vec<(usize, Part)>> {
        let k = self.pending.len();
        let mut out = vec![Vec::new()];
        if k == 0 {
            return out;
        }
        out.push((0..k).map(|i| (i, Part::Full)).collect());
        if k > 1 {
            out.extend((0..k).map(|i| vec![(i, Part::Full)]));
        }
        out.push((0..k).map(|i| (i, Part::Head)).collect());
        out.push((0..k).map(|i| (i, Part::Tail)).collect());
        for _ in 0..RANDOM_SUBSETS {
            let mut s = Vec::new();
            for i in 0..k {
                match rng.next() % 5 {
                    0 | 1 => {}
                    2 => s.push((i, Part::Full)),
                    3 => s.push((i, Part::Sectors(rng.next()))),
                    _ => s.push((
                        i,
                        if rng.next() & 1 == 0 {
                            Part::Head
                        } else {
                            Part::Tail
                        },
                    )),
                }
            }
            out.push(s);
        }
        out
    }

    fn key(&self, subset: &[(usize, Part)]) -> u64 {
        let mut h = DefaultHasher::new();
        self.version.hash(&mut h);
        for &(i, part) in subset {
            let p = &self.pending[i];
            (p.pos, p.len, part).hash(&mut h);
        }
        h.finish()
    }

    fn image(&self, subset: &[(usize, Part)]) -> Vec<u8> {
        let mut img = self.durable.clone();
        for &(i, part) in subset {
            self.pending[i].apply(&mut img, part);
        }
        img
    }

    fn describe(&self, subset: &[(usize, Part)]) -> String {
        if subset.is_empty() {
            return format!(
                "durable bytes only ({} pending writes dropped)",
                self.pending.len()
            );
        }
        let parts: Vec<String> = subset
            .iter()
            .map(|&(i, part)| self.pending[i].describe(part))
            .collect();
        format!(
            "durable bytes + {} of {} pending writes: {}",
            subset.len(),
            self.pending.len(),
            parts.join(", ")
        )
    }
}

// ---------------------------------------------------------------------------
// Randomness and patterns
// ---------------------------------------------------------------------------

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
}

fn seed_of(name: &str) -> u64 {
    let mut h = DefaultHasher::new();
    name.hash(&mut h);
    h.finish()
}

/// Deterministic, mostly non-zero bytes.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (mix(seed ^ (i as u64 / 8)) >> ((i % 8) * 8)) as u8 | 1)
        .collect()
}

// ---------------------------------------------------------------------------
// The content model
// ---------------------------------------------------------------------------

type Bytes = Arc<Vec<u8>>;

/// The image as a completed barrier leaves it.
#[derive(Clone)]
struct State {
    content: Bytes,
    /// Snapshot tag -> content of the snapshot.
    snaps: BTreeMap<String, Bytes>,
}

impl State {
    fn tags(&self) -> BTreeSet<String> {
        self.snaps.keys().cloned().collect()
    }
}

/// A guest write, issued at log position `start`.
struct WriteRec {
    start: usize,
    off: u64,
    data: Vec<u8>,
}

/// A barrier operation: issued at `start`, durable once the log reaches
/// `done` (just after its last sync).
struct Barrier {
    what: String,
    start: usize,
    done: usize,
    state: State,
    /// Writes issued after this barrier: `writes[writes_from..]`.
    writes_from: usize,
}

#[derive(Default)]
struct Model {
    writes: Vec<WriteRec>,
    barriers: Vec<Barrier>,
}

/// What a crash state may look like: `state`, where the bytes of `writes`
/// may also hold the written values.
struct Candidate<'a> {
    what: String,
    state: &'a State,
    writes: Vec<&'a WriteRec>,
}

impl Model {
    fn any_completed(&self, p: usize) -> bool {
        self.barriers.iter().any(|b| b.done <= p)
    }

    fn candidates(&self, p: usize) -> Vec<Candidate<'_>> {
        let mut out = Vec::new();
        if let Some(b) = self.barriers.iter().rev().find(|b| b.done <= p) {
            out.push(Candidate {
                what: format!(
                    "last completed barrier '{}' (done at log {})",
                    b.what, b.done
                ),
                state: &b.state,
                writes: self.writes[b.writes_from..]
                    .iter()
                    .filter(|w| w.start < p)
                    .collect(),
            });
        }
        // A staged commit lets writes in while it is in flight: they may
        // show over its state too (a barrier made by one call has none).
        for b in self.barriers.iter().filter(|b| b.start < p && p < b.done) {
            out.push(Candidate {
                what: format!(
                    "in-flight barrier '{}' (log {}..{})",
                    b.what, b.start, b.done
                ),
                state: &b.state,
                writes: self.writes[b.writes_from..]
                    .iter()
                    .filter(|w| w.start < p)
                    .collect(),
            });
        }
        out
    }
}

impl Candidate<'_> {
    /// The first byte of `actual` the candidate does not allow.
    fn mismatch(&self, actual: &[u8]) -> Option<String> {
        let expect = &self.state.content;
        if actual.len() != expect.len() {
            return Some(format!("virtual size {} != {}", actual.len(), expect.len()));
        }
        for (c, (a, e)) in actual.chunks(4096).zip(expect.chunks(4096)).enumerate() {
            if a == e {
                continue;
            }
            for (j, (&x, &y)) in a.iter().zip(e).enumerate() {
                let i = (c * 4096 + j) as u64;
                if x == y {
                    continue;
                }
                let written = self.writes.iter().any(|w| {
                    i >= w.off
                        && i < w.off + w.data.len() as u64
                        && w.data[(i - w.off) as usize] == x
                });
                if !written {
                    return Some(format!(
                        "byte at virtual offset {i:#x} is {x:#04x}, expected {y:#04x} \
                         (or a value written since: {} writes allowed)",
                        self.writes.len()
                    ));
                }
            }
        }
        None
    }
}

// ---------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------

/// A scenario in progress: the image on a recording disk and the model.
struct Run {
    name: String,
    dir: tempfile::TempDir,
    path: PathBuf,
    /// Bytes of the disk when recording started.
    initial: Vec<u8>,
    disk: CrashDisk,
    img: Option<Image>,
    cur: Vec<u8>,
    snaps: BTreeMap<String, Bytes>,
    model: Model,
    honor_syncs_before: usize,
}

fn lenient() -> OpenOptions {
    OpenOptions {
        lenient: true,
        ..OpenOptions::default()
    }
}

fn err(e: pcow::Error) -> String {
    error_report::chain(&e)
}

fn read_all(img: &Image) -> Result<Vec<u8>, String> {
    let mut buf = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut buf, 0).map_err(err)?;
    Ok(buf)
}

fn tags_of(img: &Image) -> BTreeSet<String> {
    img.snapshots().into_iter().map(|s| s.tag).collect()
}

impl Run {
    /// A new image made by `Image::create_storage` on a recording disk.
    fn create(name: &str, cluster_size: u64, virtual_size: u64) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("crash.pcow");
        let disk = CrashDisk::recording(Vec::new());
        let img = Image::create_storage(Box::new(disk.clone()), &path, cluster_size, virtual_size)
            .unwrap();
        let mut run = Run {
            name: name.to_owned(),
            dir,
            path,
            initial: Vec::new(),
            disk,
            img: Some(img),
            cur: vec![0u8; virtual_size as usize],
            snaps: BTreeMap::new(),
            model: Model::default(),
            honor_syncs_before: usize::MAX,
        };
        // Creation is durable at its first sync; opening it for writing
        // (the DIRTY header) is a second barrier.
        let log = run.disk.log();
        let first = log.iter().position(|o| matches!(o, Op::Sync)).unwrap() + 1;
        run.push_barrier("create".into(), 0, first);
        run.push_barrier("open read-write".into(), first, log.len());
        run
    }

    /// Continues on a recording disk holding `bytes` (an image closed or
    /// crashed earlier, whose content is `content` and snapshots `snaps`),
    /// opened read-write at `path`.
    fn resume(
        name: &str,
        dir: tempfile::TempDir,
        path: PathBuf,
        bytes: Vec<u8>,
        content: Vec<u8>,
        snaps: BTreeMap<String, Bytes>,
    ) -> Run {
        let disk = CrashDisk::recording(bytes.clone());
        let mut run = Run {
            name: name.to_owned(),
            dir,
            path,
            initial: bytes,
            disk,
            img: None,
            cur: content,
            snaps,
            model: Model::default(),
            honor_syncs_before: usize::MAX,
        };
        run.push_barrier("initial bytes".into(), 0, 0);
        let img = Image::open_storage(
            Box::new(run.disk.clone()),
            &run.path,
            OpenOptions::read_write(),
        )
        .unwrap();
        run.img = Some(img);
        run.record_barrier("open read-write", 0);
        run
    }

    fn img(&mut self) -> &mut Image {
        self.img.as_mut().expect("image is open")
    }

    /// Runs `f` on the image as a device holds it.
    fn live<T>(&mut self, f: impl FnOnce(&mut LiveImage) -> T) -> T {
        let img = self.img.take().expect("image is open");
        let mut live = LiveImage::new(img).unwrap();
        let t = f(&mut live);
        self.img = Some(live.into_image());
        t
    }

    fn state(&self) -> State {
        State {
            content: Arc::new(self.cur.clone()),
            snaps: self.snaps.clone(),
        }
    }

    fn push_barrier(&mut self, what: String, start: usize, done: usize) {
        let state = self.state();
        self.model.barriers.push(Barrier {
            what,
            start,
            done,
            state,
            writes_from: self.model.writes.len(),
        });
    }

    /// Records the barrier issued at `start` (after the model was updated).
    fn record_barrier(&mut self, what: &str, start: usize) {
        let log = self.disk.log();
        let done = log[start..]
            .iter()
            .rposition(|o| matches!(o, Op::Sync))
            .map_or(start, |i| start + i + 1);
        self.push_barrier(what.to_owned(), start, done);
    }

    fn write(&mut self, off: u64, data: Vec<u8>) {
        let start = self.disk.pos();
        self.img().write_at(&data, off).unwrap();
        self.cur[off as usize..off as usize + data.len()].copy_from_slice(&data);
        self.model.writes.push(WriteRec { start, off, data });
    }

    /// Writes `len` pattern bytes at `off`.
    fn fill(&mut self, off: u64, len: u64) {
        let seed = seed_of(&self.name) ^ mix(off) ^ mix(self.model.writes.len() as u64);
        self.write(off, pattern(seed, len as usize));
    }

    fn flush(&mut self) {
        let start = self.disk.pos();
        self.img().flush().unwrap();
        self.record_barrier("flush", start);
    }

    /// A barrier in the three steps of a staged commit (through
    /// [`LiveImage`], as a device runs it), with `between` run after
    /// `begin_commit` and `after` after `Commit::write` (the
    /// writes a device's faults make while the commit is in flight).
    fn staged(&mut self, between: impl FnOnce(&mut Run), after: impl FnOnce(&mut Run)) {
        let start = self.disk.pos();
        let mut c = self
            .live(|l| l.begin_commit())
            .unwrap()
            .expect("something to commit");
        // The commit holds the state as staged at begin.
        let state = self.state();
        let writes_from = self.model.writes.len();
        between(self);
        c.write().unwrap();
        let written = self.disk.pos();
        after(self);
        self.live(|l| l.finish_commit(c)).unwrap();
        let log = self.disk.log();
        let done = log[start..written]
            .iter()
            .rposition(|o| matches!(o, Op::Sync))
            .map_or(start, |i| start + i + 1);
        self.model.barriers.push(Barrier {
            what: "staged commit".into(),
            start,
            done,
            state,
            writes_from,
        });
    }

    /// A staged commit begun, `between` run, then aborted: nothing
    /// committed, the next barrier commits it all.
    fn staged_abort(&mut self, between: impl FnOnce(&mut Run)) {
        let c = self
            .live(|l| l.begin_commit())
            .unwrap()
            .expect("something to commit");
        between(self);
        self.live(|l| l.abort_commit(c)).unwrap();
    }

    fn snapshot_create(&mut self, tag: &str) {
        let start = self.disk.pos();
        self.img().snapshot_create(tag).unwrap();
        self.snaps
            .insert(tag.to_owned(), Arc::new(self.cur.clone()));
        self.record_barrier(&format!("snapshot create {tag}"), start);
    }

    fn snapshot_apply(&mut self, tag: &str) {
        let start = self.disk.pos();
        self.img().snapshot_apply(tag).unwrap();
        self.cur = self.snaps[tag].to_vec();
        self.record_barrier(&format!("snapshot apply {tag}"), start);
    }

    fn snapshot_delete(&mut self, tag: &str) {
        let start = self.disk.pos();
        self.img().snapshot_delete(tag).unwrap();
        self.snaps.remove(tag);
        self.record_barrier(&format!("snapshot delete {tag}"), start);
    }

    fn grow(&mut self, new_size: u64) {
        let start = self.disk.pos();
        self.img().grow(new_size).unwrap();
        self.cur.resize(new_size as usize, 0);
        self.record_barrier(&format!("grow to {new_size}"), start);
    }

    fn close(&mut self) {
        let start = self.disk.pos();
        self.img.take().expect("image is open").close().unwrap();
        self.record_barrier("close", start);
    }

    /// Closes the image if still open and verifies every crash state.
    fn verify(mut self) -> Result<Stats, String> {
        if self.img.is_some() {
            self.close();
        }
        let t = Instant::now();
        let log = self.disk.log();
        let mut stats = Stats {
            log_entries: log.len(),
            events: log.iter().filter(|o| !matches!(o, Op::SetLen(_))).count(),
            ..Stats::default()
        };
        let mut rng = Rng(seed_of(&self.name));
        let mut seen = HashSet::new();
        let mut replay = Replay::new(self.initial.clone(), self.honor_syncs_before);
        for p in 0..=log.len() {
            stats.points += 1;
            for subset in replay.subsets(&mut rng) {
                stats.states += 1;
                if !seen.insert(replay.key(&subset)) {
                    continue;
                }
                let bytes = replay.image(&subset);
                match self.check_state(p, bytes) {
                    Ok(true) => stats.distinct += 1,
                    Ok(false) => stats.unopenable += 1,
                    Err(e) => {
                        return Err(format!(
                            "[{}] crash after log entry {p} of {} ({} events): {}\n  {e}",
                            self.name,
                            log.len(),
                            log[..p]
                                .iter()
                                .filter(|o| !matches!(o, Op::SetLen(_)))
                                .count(),
                            replay.describe(&subset),
                        ))
                    }
                }
            }
            if p < log.len() {
                replay.step(p, &log[p]);
            }
        }
        stats.elapsed = t.elapsed();
        Ok(stats)
    }

    /// Checks one crash image; `Ok(false)`: it does not open, which is
    /// allowed only before the first barrier completed.
    fn check_state(&self, p: usize, bytes: Vec<u8>) -> Result<bool, String> {
        let cands = self.model.candidates(p);
        let disk = CrashDisk::plain(bytes);
        let img = match Image::open_storage(Box::new(disk.clone()), &self.path, lenient()) {
            Ok(img) => img,
            Err(_) if !self.model.any_completed(p) => return Ok(false),
            Err(e) => return Err(format!("lenient open failed: {}", err(e))),
        };
        let r = pcow::check::report(&img);
        if !r.corruptions.is_empty() {
            return Err(format!("check reports corruption: {:?}", r.corruptions));
        }
        let actual = read_all(&img)?;
        let tags = tags_of(&img);
        drop(img);
        let Some(cand) = cands
            .iter()
            .find(|c| c.state.tags() == tags && c.mismatch(&actual).is_none())
        else {
            let why: Vec<String> = cands
                .iter()
                .map(|c| {
                    let m = c.mismatch(&actual).unwrap_or_else(|| "content ok".into());
                    format!(
                        "vs {}: {m}; snapshots {:?}, expected {:?}",
                        c.what,
                        tags,
                        c.state.tags()
                    )
                })
                .collect();
            return Err(format!("wrong content:\n    {}", why.join("\n    ")));
        };

        // Recovery: a writer opens it, writes, takes a barrier, reads every
        // snapshot back and closes.
        let mut img = Image::open_storage(
            Box::new(disk.clone()),
            &self.path,
            OpenOptions::read_write(),
        )
        .map_err(|e| format!("read-write open failed: {}", err(e)))?;
        let ctx = |what: &'static str| move |e: pcow::Error| format!("{what}: {}", err(e));
        if read_all(&img)? != actual {
            return Err("a read-write open shows other content than a read-only open".into());
        }
        let vs = actual.len() as u64;
        let moff = vs / 2 + 1000;
        let marker = pattern(mix(p as u64), 3000);
        img.write_at(&marker, moff)
            .map_err(ctx("writing after recovery"))?;
        img.flush().map_err(ctx("flush after recovery"))?;
        let mut expect = actual;
        expect[moff as usize..moff as usize + marker.len()].copy_from_slice(&marker);
        for (tag, content) in &cand.state.snaps {
            img.snapshot_apply(tag)
                .map_err(ctx("applying a snapshot after recovery"))?;
            if read_all(&img)? != **content {
                return Err(format!(
                    "snapshot {tag} does not hold its content (matched {})",
                    cand.what
                ));
            }
            expect = content.to_vec();
        }
        img.close().map_err(ctx("close after recovery"))?;

        let img = Image::open_storage(Box::new(disk), &self.path, lenient())
            .map_err(|e| format!("reopen after recovery failed: {}", err(e)))?;
        let r = pcow::check::report(&img);
        if !r.is_clean() {
            return Err(format!(
                "not clean after a read-write open and close: corruptions {:?}, leaks {:?}",
                r.corruptions, r.leaks
            ));
        }
        if read_all(&img)? != expect {
            return Err("wrong content after a read-write open and close".into());
        }
        if tags_of(&img) != cand.state.tags() {
            return Err("snapshots lost by a read-write open and close".into());
        }
        Ok(true)
    }
}

#[derive(Default, Debug)]
struct Stats {
    log_entries: usize,
    events: usize,
    points: usize,
    /// Crash states enumerated.
    states: usize,
    /// Distinct crash images checked (identical images at later crash
    /// points, whose model is only more permissive, are skipped).
    distinct: usize,
    /// States that do not open, before creation was durable.
    unopenable: usize,
    elapsed: std::time::Duration,
}

fn run(r: Run) -> Stats {
    let name = r.name.clone();
    let stats = r.verify().unwrap_or_else(|e| panic!("{e}"));
    println!(
        "{name}: {} events ({} log entries), {} crash points, {} crash states, \
         {} distinct images verified ({} unopenable before creation was durable) in {:.2?}",
        stats.events,
        stats.log_entries,
        stats.points,
        stats.states,
        stats.distinct,
        stats.unopenable,
        stats.elapsed
    );
    stats
}

/// Writes into holes, overwrites in place, partial pages and a write across
/// a cluster boundary; snapshots; partial pages over snapshot data (4 KiB
/// copy-on-write fill); rollback; delete. Used for each cluster size.
fn mixed(name: &str, cluster: u64, vs: u64) -> Run {
    let mut r = Run::create(name, cluster, vs);
    let c = cluster;
    // Holes.
    r.fill(0, 4096);
    r.fill(c + 5000 % c, 100);
    r.fill(vs - c / 2 - 10_000, 10_000);
    r.flush();
    // In place, and across a cluster boundary.
    r.fill(0, 4096);
    r.fill(c - 10, 50);
    r.fill(100, 300);
    r.flush();
    r.snapshot_create("s1");
    // Partial pages over data in s1: each fills its page from below.
    r.fill(7, 10);
    r.fill(4096 + 100, 5000);
    r.fill(c + 5000 % c + 1, 3);
    r.fill(c - 20, 40);
    r.flush();
    r.fill(9, 1);
    r.snapshot_create("s2");
    r.fill(3 * 4096 + 11, 4096);
    r.snapshot_apply("s1");
    r.fill(50, 60);
    r.fill(vs - 100, 100);
    r.flush();
    r.snapshot_delete("s2");
    r.fill(4096 * 2 + 1, 2);
    r.snapshot_apply("s1");
    r.snapshot_delete("s1");
    r.fill(5, 5);
    r.close();
    r
}

/// Writes into holes, in place, across clusters; a grow (header-only
/// barrier) and writes past the old size.
#[test]
fn crash_writes_into_holes() {
    let mut r = Run::create("holes-4k", 4096, 256 * KIB);
    r.fill(0, 4096);
    r.fill(5000, 100);
    r.fill(20_000, 10_000);
    r.flush();
    r.fill(0, 4096);
    r.fill(8190, 50);
    r.fill(200_000, 777);
    r.flush();
    r.fill(100, 300);
    r.fill(255 * KIB, 1024);
    r.grow(512 * KIB);
    r.fill(300 * KIB, 4096);
    r.fill(255 * KIB + 1000, 100);
    r.close();
    run(r);
}

/// Staged commits (`begin_commit`, `Commit::write`, `finish_commit`) with
/// writes in flight: clusters allocated and pages recorded between the
/// steps belong to the next barrier; an aborted commit is committed by the
/// next one. Every crash point of begin, write and finish must leave the
/// old or the new generation.
fn staged(name: &str, cluster: u64, vs: u64) -> Run {
    let mut r = Run::create(name, cluster, vs);
    let c = cluster;
    r.fill(0, 4096);
    r.fill(3 * c, 8192);
    r.flush();
    r.snapshot_create("s1");
    r.fill(100, 50);
    r.fill(5 * c, 4096);
    r.staged(
        |r| {
            // A new cluster, a page in a cluster the commit covers, a
            // partial page over snapshot data (filled from below).
            r.fill(7 * c, 4096);
            r.fill(200, 10);
            r.fill(3 * c + 4096 + 1, 10);
        },
        |r| {
            r.fill(9 * c, 100);
            r.fill(5 * c + 1, 1);
        },
    );
    r.flush();
    r.fill(11 * c, 4096);
    r.staged_abort(|r| {
        r.fill(13 * c, 4096);
        r.fill(1, 1);
    });
    r.fill(2 * c, 10);
    r.flush();
    r.fill(4 * c, 10);
    r.staged(|_| {}, |_| {});
    r.close();
    r
}

#[test]
fn crash_staged_commit_4k() {
    run(staged("staged-4k", 4096, 256 * KIB));
}

#[test]
fn crash_staged_commit_64k() {
    run(staged("staged-64k", 64 * KIB, MIB));
}

#[test]
fn crash_partial_pages_over_snapshot() {
    // 64 KiB clusters: 16 pages each, so partial bitmaps.
    let mut r = Run::create("cow-64k", 64 * KIB, MIB);
    r.fill(0, 64 * KIB);
    r.fill(128 * KIB, 64 * KIB);
    r.fill(300 * KIB, 8 * KIB);
    r.flush();
    r.snapshot_create("base");
    r.fill(4096 + 7, 10);
    r.fill(3 * 4096 + 100, 5000);
    r.fill(8 * 4096, 4096);
    r.fill(300 * KIB + 4000, 200);
    r.flush();
    r.fill(4096 + 2000, 20);
    r.fill(192 * KIB - 50, 100);
    r.snapshot_create("second");
    r.fill(4096 + 8, 1);
    r.fill(15 * 4096 + 4000, 96);
    r.close();
    run(r);
}

#[test]
fn crash_partial_pages_over_snapshot_4k() {
    // 4 KiB clusters: the fill covers the whole cluster.
    let mut r = Run::create("cow-4k", 4096, 256 * KIB);
    r.fill(0, 32 * KIB);
    r.flush();
    r.snapshot_create("base");
    r.fill(5, 10);
    r.fill(3 * 4096 - 100, 200);
    r.fill(40 * KIB, 100);
    r.flush();
    r.fill(6, 1);
    r.close();
    run(r);
}

#[test]
fn crash_second_segment() {
    // 4 KiB clusters: 126 entries per meta cluster; 140 clusters need a
    // second segment, and the snapshot starts a third.
    let mut r = Run::create("segments-4k", 4096, MIB);
    // A small pool: the file grows (allocate) every few clusters.
    r.live(|l| l.set_pool_clusters(5));
    let mut rng = Rng(7);
    let mut vcns: Vec<u64> = (0..256).collect();
    for i in (1..vcns.len()).rev() {
        vcns.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    for (i, &v) in vcns[..140].iter().enumerate() {
        let len = [4096, 1000, 17][i % 3];
        r.fill(v * 4096 + (4096 - len), len);
        if i % 24 == 23 {
            r.flush();
        }
    }
    r.flush();
    r.snapshot_create("after");
    for &v in &vcns[120..132] {
        r.fill(v * 4096 + 33, 64);
    }
    r.snapshot_apply("after");
    r.fill(vcns[200] * 4096, 4096);
    r.close();
    run(r);
}

#[test]
fn crash_snapshot_create_apply_delete() {
    let mut r = Run::create("snapshots-4k", 4096, 512 * KIB);
    r.fill(0, 16 * KIB);
    r.flush();
    r.snapshot_create("a");
    r.fill(4 * KIB, 8 * KIB);
    r.fill(100 * KIB, 4 * KIB);
    r.snapshot_create("b");
    r.fill(8 * KIB, 100);
    r.fill(200 * KIB, 4 * KIB);
    // Unflushed writes, then a rollback that drops them.
    r.snapshot_apply("a");
    r.fill(12 * KIB, 4 * KIB);
    r.flush();
    r.snapshot_delete("b");
    r.fill(1, 1);
    r.snapshot_apply("a");
    r.snapshot_create("c");
    r.snapshot_delete("a");
    r.fill(300 * KIB, 5000);
    r.snapshot_apply("c");
    r.close();
    run(r);
}

#[test]
fn crash_mixed_4k_clusters() {
    run(mixed("mixed-4k", 4096, 512 * KIB));
}

#[test]
fn crash_mixed_64k_clusters() {
    run(mixed("mixed-64k", 64 * KIB, 2 * MIB));
}

#[test]
fn crash_mixed_2m_clusters() {
    run(mixed("mixed-2m", 2 * MIB, 4 * MIB));
}

#[test]
fn crash_overlay_on_pcow_base() {
    let dir = tempfile::tempdir().unwrap();
    let vs = MIB;
    let mut content = vec![0u8; vs as usize];
    let mut put = |img: &mut Image, off: u64, len: usize, seed: u64| {
        let d = pattern(seed, len);
        img.write_at(&d, off).unwrap();
        content[off as usize..off as usize + len].copy_from_slice(&d);
    };
    let base = dir.path().join("base.pcow");
    let mut b = Image::create(
        &base,
        &CreateOptions {
            cluster_size: Some(64 * KIB),
            virtual_size: Some(vs),
            base: None,
        },
    )
    .unwrap();
    put(&mut b, 0, 200 * 1024, 1);
    put(&mut b, 512 * KIB, 64 * 1024, 2);
    b.close().unwrap();
    let top = dir.path().join("top.pcow");
    let mut t = Image::create(
        &top,
        &CreateOptions {
            cluster_size: Some(64 * KIB),
            virtual_size: None,
            base: Some(BaseRef {
                name: "base.pcow".into(),
                format: BaseFormat::Pcow,
            }),
        },
    )
    .unwrap();
    put(&mut t, 64 * KIB + 10, 100, 3);
    t.close().unwrap();
    let bytes = std::fs::read(&top).unwrap();
    let mut r = Run::resume("overlay-64k", dir, top, bytes, content, BTreeMap::new());
    // Partial pages over the base: filled from it.
    r.fill(5, 10);
    r.fill(64 * KIB + 4096 * 3 + 1, 4096);
    r.fill(300 * KIB, 4096);
    r.fill(520 * KIB + 1, 7);
    r.flush();
    r.fill(6, 2);
    r.fill(700 * KIB, 100);
    r.snapshot_create("top-1");
    r.fill(5, 4096 * 2);
    r.fill(64 * KIB + 10, 10);
    r.snapshot_apply("top-1");
    r.fill(513 * KIB, 3);
    r.close();
    assert!(r.dir.path().join("base.pcow").exists());
    run(r);
}

/// A crash just before a barrier's header write leaves stale slots and
/// uncommitted clusters; the writer that opens it next (zeroing, truncating,
/// its DIRTY header) and everything after is itself crash-tested.
#[test]
fn crash_during_recovery() {
    let mut r = Run::create("recovery-setup", 4096, 256 * KIB);
    r.fill(0, 8 * KIB);
    r.flush();
    r.fill(4 * KIB + 1, 10);
    r.fill(64 * KIB, 4096);
    let start = r.disk.pos();
    r.flush();
    let log = r.disk.log();
    // The flush: data sync, meta slots, sync, header, sync. Stop before the
    // header write with everything before it durable.
    let header = start
        + log[start..]
            .iter()
            .rposition(|o| matches!(o, Op::Write { .. }))
            .unwrap();
    assert!(matches!(log[header - 1], Op::Sync));
    let mut replay = Replay::new(Vec::new(), usize::MAX);
    for (p, op) in log[..header].iter().enumerate() {
        replay.step(p, op);
    }
    assert!(replay.pending.is_empty());
    let crashed = replay.durable.clone();
    let img = Image::open_storage(
        Box::new(CrashDisk::plain(crashed.clone())),
        &r.path,
        lenient(),
    )
    .unwrap();
    let rep = pcow::check::report(&img);
    assert!(rep.corruptions.is_empty(), "{rep:?}");
    assert!(
        rep.leaks.iter().any(|l| l.rule == "L2"),
        "expected stale slots: {rep:?}"
    );
    let content = read_all(&img).unwrap();
    drop(img);
    // The crashed content is the first flush's, with the in-place write
    // that reached the disk before the interrupted barrier.
    let cands = r.model.candidates(header);
    assert!(cands.iter().any(|c| c.mismatch(&content).is_none()));
    let first = &r
        .model
        .barriers
        .iter()
        .find(|b| b.what == "flush")
        .unwrap()
        .state;
    assert_ne!(
        content, *first.content,
        "no in-place write reached the disk"
    );
    assert_eq!(content[64 * KIB as usize..68 * KIB as usize], [0u8; 4096]);
    let Run { dir, path, .. } = r;
    let mut r = Run::resume("recovery-4k", dir, path, crashed, content, BTreeMap::new());
    r.fill(4 * KIB + 2, 10);
    r.fill(64 * KIB, 4096);
    r.fill(68 * KIB, 100);
    r.flush();
    r.snapshot_create("x");
    r.fill(3, 3);
    r.close();
    run(r);
}

/// The check itself must be able to fail: on a disk that ignores syncs
/// (so a header can be durable before the metadata and data it names), some
/// crash state must be rejected.
#[test]
fn checker_rejects_disk_that_ignores_syncs() {
    let build = || {
        let mut r = Run::create("lying-disk", 4096, 256 * KIB);
        r.fill(0, 8 * KIB);
        r.fill(64 * KIB + 3, 5);
        r.flush();
        r.fill(0, 100);
        r.snapshot_create("s");
        r.fill(1, 1);
        r
    };
    let honest = build();
    honest.verify().unwrap_or_else(|e| panic!("{e}"));
    let mut lying = build();
    // Syncs after creation are ignored.
    lying.honor_syncs_before = lying.model.barriers[1].done;
    match lying.verify() {
        Ok(s) => panic!("a disk that ignores syncs passed {s:?}"),
        Err(e) => println!("lying disk rejected as expected: {e}"),
    }
}

#[test]
fn crash_disk_tears_and_clips() {
    // The replay itself: torn halves, random sectors, truncation.
    let w = Pending {
        pos: 0,
        off: 100,
        data: pattern(1, 2000).into(),
        len: 2000,
    };
    let (first, n) = w.sector_range();
    assert_eq!((first, n), (0, 5));
    let mut head = vec![0u8; 4096];
    w.apply(&mut head, Part::Head);
    assert_eq!(&head[100..1024], &w.data[..924]);
    assert!(head[1024..].iter().all(|&b| b == 0));
    let mut tail = vec![0u8; 4096];
    w.apply(&mut tail, Part::Tail);
    assert!(tail[..1024].iter().all(|&b| b == 0));
    assert_eq!(&tail[1024..2100], &w.data[924..]);
    let mut r = Replay::new(vec![0u8; 4096], usize::MAX);
    r.step(
        0,
        &Op::Write {
            off: 100,
            data: w.data.clone(),
        },
    );
    r.step(1, &Op::SetLen(1000));
    assert_eq!(r.durable.len(), 1000);
    assert_eq!(r.pending[0].len, 900);
    r.step(2, &Op::SetLen(4096));
    let img = r.image(&[(0, Part::Full)]);
    assert_eq!(&img[100..1000], &w.data[..900]);
    assert!(img[1000..].iter().all(|&b| b == 0));
    r.step(3, &Op::Sync);
    assert!(r.pending.is_empty());
    assert_eq!(&r.durable[100..1000], &w.data[..900]);
}

/// A barrier writes only the part of each metadata slot that can differ
/// from the file (a slot is 1 MiB at 2 MiB clusters, its content a few
/// KiB), and the slots still read back whole: every slot of the final file
/// is what a whole-slot write would have left (the scan checks each CRC
/// over all `S` bytes), also after content shrank (a tag deleted).
#[test]
fn barriers_write_only_the_changed_prefix_of_each_slot() {
    let cs = 2 * MIB;
    let disk = CrashDisk::recording(Vec::new());
    let mut img = Image::create_storage(Box::new(disk.clone()), "short.pcow", cs, 64 * cs).unwrap();
    let mut barrier_bytes = Vec::new();
    for round in 0..10u64 {
        let before = disk.pos();
        img.write_at(&pattern(round, 4096), round * cs + 4096)
            .unwrap();
        if round == 3 {
            img.snapshot_create(&"t".repeat(200)).unwrap();
        }
        if round == 5 {
            img.snapshot_delete(&"t".repeat(200)).unwrap();
        }
        img.flush().unwrap();
        let written: u64 = disk.log()[before..]
            .iter()
            .map(|op| match op {
                Op::Write { data, .. } => data.len() as u64,
                _ => 0,
            })
            .sum();
        barrier_bytes.push(written);
    }
    img.close().unwrap();
    // A slot not seen yet (header slot B, both slots of a new structure:
    // the snapshot's layer, the new layer's meta cluster) is written whole
    // the first time; after that a barrier is its data page plus a page or
    // two per slot, also when the deleted tag shrank the layer's slot.
    for round in [2, 7, 8, 9] {
        let b = barrier_bytes[round];
        assert!(
            b <= 4 * 4096,
            "barrier {round} wrote {b} bytes: {barrier_bytes:?}"
        );
    }
    assert!(barrier_bytes[0] >= MIB, "{barrier_bytes:?}");
    let img = Image::open_storage(
        Box::new(CrashDisk::plain(disk.lock().bytes.clone())),
        "short.pcow",
        OpenOptions::read_only(),
    )
    .unwrap();
    assert!(pcow::check::report(&img).is_clean());
    let mut buf = vec![0u8; 4096];
    for round in 0..10u64 {
        img.read_at(&mut buf, round * cs + 4096).unwrap();
        assert_eq!(buf, pattern(round, 4096), "round {round}");
    }
}
