//! Convert: copy an image's content (raw, or a pcow image's view through
//! its whole chain, current or a snapshot's) into a raw or pcow file.
//!
//! The output is written only where it would otherwise show something
//! else, one 4 KiB page at a time:
//! - a new file without a base shows zeros, so only non-zero pages are
//!   written: a pcow output allocates no cluster for zeros, a raw output
//!   stays sparse;
//! - a new pcow overlay over `base` (`-B`) shows its base, so only pages
//!   that differ from the base are written. Unlike qemu-img, which copies
//!   what the input's top image holds and trusts the base to equal the
//!   input's base, the result is right for any base. When the base is a
//!   file of the input's own chain, only what the input holds above it is
//!   compared;
//! - an existing target (`-n`) shows what it holds: pages that differ are
//!   written, and where it holds data the input has zeros, a raw target
//!   gets a hole punched and a pcow target gets zeros.
//!
//! `sparse_size` (`-S`) asks for allocated zeros: 0 writes every page; a
//! larger size writes runs of zero pages shorter than it between written
//! pages (judged within each read chunk, as qemu-img judges within its
//! buffer).
//!
//! Ranges where neither the input nor the output holds data are not read.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::alloc::Preallocation;
use crate::chain::Backing;
use crate::error::io_err;
use crate::error::{Error, Result};
use crate::format::{BaseRef, Geometry, PAGE_SIZE};
use crate::header::is_pcow;
use crate::image::{CreateOptions, Image, OpenOptions, DEFAULT_CLUSTER_SIZE};

pub(crate) use super::source::{extent_data_ranges, file_data_ranges, is_zero, Source};
pub use super::source::{ImageFormat, SnapshotSel};

/// `-S`'s default: zero runs of a page or more stay sparse.
pub const DEFAULT_SPARSE_SIZE: u64 = PAGE_SIZE;
/// The largest `-S` (qemu-img's limit).
pub const MAX_SPARSE_SIZE: u64 = 16 << 20;

/// How to convert.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// Input format; `None` probes the file's magic.
    pub input_format: Option<ImageFormat>,
    /// Output format.
    pub output_format: ImageFormat,
    /// Cluster size of a new pcow output (default 64 KiB).
    pub cluster_size: Option<u64>,
    /// Open the input without locks (`-U`).
    pub force_share: bool,
    /// Convert this snapshot of a pcow input instead of its current
    /// content (`-l`, `-s`).
    pub snapshot: Option<SnapshotSel>,
    /// Make a new pcow output an overlay of this base (`-B`, `-F`).
    pub base: Option<BaseRef>,
    /// Write into the existing output instead of creating it (`-n`).
    pub existing_target: bool,
    /// With `existing_target`: trust that the target reads as zeros
    /// (`--target-is-zero`), so its content is not read.
    pub target_is_zero: bool,
    /// Zero runs shorter than this are written (allocated); 0 allocates
    /// everything (`-S`). A multiple of 4096, at most 16 MiB.
    pub sparse_size: u64,
    /// Allocate a new output up front (`-o preallocation=`).
    pub preallocation: Preallocation,
}

impl ConvertOptions {
    /// A plain conversion into a new `output_format` file.
    pub fn new(output_format: ImageFormat) -> ConvertOptions {
        ConvertOptions {
            input_format: None,
            output_format,
            cluster_size: None,
            force_share: false,
            snapshot: None,
            base: None,
            existing_target: false,
            target_is_zero: false,
            sparse_size: DEFAULT_SPARSE_SIZE,
            preallocation: Preallocation::Off,
        }
    }

    /// Refuses combinations that cannot mean anything.
    fn validate(&self) -> Result<()> {
        let bad = |s: &str| Err(Error::Invalid(s.into()));
        let raw = self.output_format == ImageFormat::Raw;
        if raw && self.cluster_size.is_some() {
            return bad("a cluster size only applies to a pcow output");
        }
        if raw && self.base.is_some() {
            return bad("a raw output has no base image (-B is for a pcow output)");
        }
        if self.existing_target && self.cluster_size.is_some() {
            return bad("the target exists (-n): it keeps its own cluster size");
        }
        if self.existing_target && self.base.is_some() {
            return bad("the target exists (-n): it keeps its own base (rebase changes it)");
        }
        if self.existing_target && self.preallocation != Preallocation::Off {
            return bad("the target exists (-n): preallocation applies to a new output");
        }
        if self.target_is_zero && !self.existing_target {
            return bad("--target-is-zero only applies to an existing target (-n)");
        }
        let s = self.sparse_size;
        if !s.is_multiple_of(PAGE_SIZE) || s > MAX_SPARSE_SIZE {
            return Err(Error::Invalid(format!(
                "invalid sparse size {s}: valid sizes are multiples of 4096 up to 16777216; \
                 0 disables sparse detection (fully allocates the output)"
            )));
        }
        Ok(())
    }
}

/// What a conversion did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvertReport {
    /// Input format (probed or given).
    pub input_format: ImageFormat,
    /// Size of the input's content in bytes.
    pub input_size: u64,
    /// Size of the output's content: the input size, rounded up to the
    /// cluster size for a new pcow output; an existing target's own size.
    pub output_size: u64,
    /// Bytes written to the output, allocated zeros included.
    pub bytes_written: u64,
    /// Bytes of the output turned into zeros where it held data (holes
    /// punched in a raw target, zeros written into a pcow one).
    pub bytes_zeroed: u64,
}

impl ConvertReport {
    /// Whether a new output's size was rounded up from the input's.
    pub fn rounded(&self) -> bool {
        self.output_size != self.input_size
    }
}

/// The unit read and compared at a time (at least a cluster and the
/// sparse size). Small enough that what was read is still in the cache
/// when it is compared and written: 1 MiB chunks made a conversion half
/// again as slow.
const CHUNK: u64 = 64 << 10;

/// The virtual size of a pcow image holding `input_size` bytes: rounded up
/// to the cluster size.
pub fn pcow_size(input_size: u64, cluster_size: u64) -> u64 {
    input_size.next_multiple_of(cluster_size)
}

/// The geometry of an optional cluster size (default 64 KiB), with a clear
/// error for a bad one.
pub fn geometry(cluster_size: Option<u64>) -> Result<Geometry> {
    let cs = cluster_size.unwrap_or(DEFAULT_CLUSTER_SIZE);
    Geometry::from_cluster_size(cs).ok_or_else(|| {
        Error::Invalid(format!(
            "cluster size {cs} must be a power of two from 4096 to 2097152"
        ))
    })
}

/// Refuses an output that is the input file or any image of its chain
/// (creating the output truncates it).
fn check_distinct(src: &Source, output: &Path) -> Result<()> {
    let Ok(out) = std::fs::metadata(output) else {
        return Ok(());
    };
    let paths = match src {
        Source::Pcow { image, .. } => image.chain_paths(),
        Source::Raw(r) => vec![r.path().to_owned()],
    };
    for p in paths {
        let Ok(md) = std::fs::metadata(&p) else {
            continue;
        };
        if md.dev() == out.dev() && md.ino() == out.ino() {
            return Err(Error::Invalid(format!(
                "output {} is the input image {} (or in its base chain)",
                output.display(),
                p.display()
            )));
        }
    }
    Ok(())
}

/// Converts the image at `input` into the image at `output`: a new file
/// (replacing any file there), or with `existing_target` the image there.
/// `progress(done, total)` follows the walk over the input's content, in
/// bytes.
pub fn convert(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ConvertReport> {
    opts.validate()?;
    let g = geometry(opts.cluster_size)?;
    let src = Source::open_snapshot(
        input,
        opts.input_format,
        opts.force_share,
        opts.snapshot.as_ref(),
    )?;
    check_distinct(&src, output)?;
    let input_size = src.size();
    let mut target = if opts.existing_target {
        Target::open(output, opts.output_format, input_size)?
    } else {
        Target::create(output, opts, g, &src)?
    };
    let mut report = ConvertReport {
        input_format: src.format(),
        input_size,
        output_size: target.size(),
        bytes_written: 0,
        bytes_zeroed: 0,
    };
    let plan = Plan::new(&src, &target, opts)?;
    plan.copy(&src, &mut target, &mut report, progress)?;
    target.finish()?;
    Ok(report)
}

/// The output being written.
enum Target {
    Raw(RawOutput),
    Pcow(Box<Image>),
}

impl Target {
    /// A new output for `src`'s content.
    fn create(path: &Path, opts: &ConvertOptions, g: Geometry, src: &Source) -> Result<Target> {
        let size = src.size();
        Ok(match opts.output_format {
            ImageFormat::Raw => {
                let out = RawOutput::create(path, size)?;
                if opts.preallocation != Preallocation::Off {
                    let full = opts.preallocation == Preallocation::Full;
                    crate::io::preallocate_file(&out.file, size, full)
                        .map_err(io_err(path, "preallocating"))?;
                }
                Target::Raw(out)
            }
            ImageFormat::Pcow => {
                if size == 0 {
                    return Err(Error::Invalid(format!(
                        "{}: the input is empty; a pcow image needs a non-zero size",
                        src.path().display()
                    )));
                }
                let create = CreateOptions {
                    cluster_size: Some(g.cluster_size()),
                    virtual_size: Some(pcow_size(size, g.cluster_size())),
                    base: opts.base.clone(),
                };
                let mut img = Image::create(path, &create)?;
                img.preallocate(opts.preallocation)?;
                Target::Pcow(Box::new(img))
            }
        })
    }

    /// The existing output at `path`, which must be in `format` and hold at
    /// least `size` bytes.
    /// Nothing is written before every check has passed (the pcow target
    /// is opened with its writer deferred to the first write).
    fn open(path: &Path, format: ImageFormat, size: u64) -> Result<Target> {
        let file = crate::output_file::open_in_place(path)?;
        let pcow = is_pcow(&file).map_err(io_err(path, "reading the target"))?;
        let target = match (format, pcow) {
            (ImageFormat::Pcow, true) => Target::Pcow(Box::new(Image::open_locked(
                file,
                path,
                OpenOptions::read_write_deferred(),
            )?)),
            (ImageFormat::Raw, false) => Target::Raw(RawOutput::open(file, path)?),
            (ImageFormat::Pcow, false) => {
                return Err(Error::Invalid(format!(
                    "{}: the target is not a pcow image (-n writes into an image of the -O format)",
                    path.display()
                )))
            }
            (ImageFormat::Raw, true) => {
                return Err(Error::Invalid(format!(
                    "{}: the target is a pcow image: writing it as raw would overwrite its \
                     metadata (use -O pcow)",
                    path.display()
                )))
            }
        };
        if target.size() < size {
            return Err(Error::Invalid(format!(
                "{}: the target ({} bytes) is smaller than the input ({size} bytes)",
                path.display(),
                target.size()
            )));
        }
        Ok(target)
    }

    fn size(&self) -> u64 {
        match self {
            Target::Raw(r) => r.len,
            Target::Pcow(i) => i.virtual_size(),
        }
    }

    /// The ranges where the target may show non-zero bytes.
    fn data_ranges(&self) -> Result<Vec<(u64, u64)>> {
        match self {
            Target::Raw(r) => file_data_ranges(&r.file, r.len, &r.path),
            Target::Pcow(i) => Ok(extent_data_ranges(&i.extents())),
        }
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
        match self {
            Target::Raw(r) => r
                .file
                .read_exact_at(buf, off)
                .map_err(io_err(&r.path, "reading the target")),
            Target::Pcow(i) => i.read_at(buf, off),
        }
    }

    fn write(&mut self, data: &[u8], off: u64, how: Action) -> Result<()> {
        match (self, how) {
            (Target::Raw(r), Action::Zero) => r.zero(off, data.len() as u64),
            (Target::Raw(r), _) => r
                .file
                .write_all_at(data, off)
                .map_err(io_err(&r.path, "writing")),
            (Target::Pcow(i), _) => i.write_at(data, off),
        }
    }

    fn finish(self) -> Result<()> {
        match self {
            Target::Raw(r) => r.file.sync_all().map_err(io_err(&r.path, "syncing")),
            Target::Pcow(i) => i.close(),
        }
    }
}

/// What to do with one page of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// It already shows the input's bytes.
    Skip,
    /// Write the input's bytes (zeros too, to allocate them).
    Data,
    /// The input has zeros where the target shows data.
    Zero,
}

/// Where to look and how to write.
struct Plan {
    /// Bytes to convert: the input's size.
    size: u64,
    /// Where the output may end up differing from what it shows now (or
    /// everything, when every page is allocated).
    candidates: Vec<(u64, u64)>,
    /// Where the input may be non-zero, among the candidates.
    src_ranges: Vec<(u64, u64)>,
    /// Where the output may show non-zero bytes now, among the candidates.
    out_ranges: Vec<(u64, u64)>,
    /// `-S`.
    sparse_size: u64,
    /// Bytes read and compared at a time.
    chunk: u64,
}

impl Plan {
    fn new(src: &Source, target: &Target, opts: &ConvertOptions) -> Result<Plan> {
        // A new output shows zeros past the input's end (a pcow output is
        // rounded up to its cluster size); an existing one keeps what it
        // has there.
        let src_size = src.size();
        let size = if opts.existing_target {
            src_size
        } else {
            target.size()
        };
        let clip = |v: Vec<(u64, u64)>| -> Vec<(u64, u64)> {
            v.into_iter()
                .filter(|r| r.0 < size)
                .map(|(s, e)| (s, e.min(size)))
                .collect()
        };
        let shows_zeros = opts.target_is_zero || (!opts.existing_target && opts.base.is_none());
        let src_ranges = clip(src.data_ranges()?);
        let out_ranges = if shows_zeros {
            Vec::new()
        } else {
            clip(target.data_ranges()?)
        };
        // Over a base from the input's own chain, only what the input holds
        // above it can differ.
        let above = match target {
            Target::Pcow(out) if opts.base.is_some() => shared_base_depth(src, out),
            _ => None,
        };
        let candidates = if opts.sparse_size == 0 {
            vec![(0, size)]
        } else if let Some(depth) = above {
            // Above the shared base: what the images there hold, and the
            // zeros they show past a size smaller than the base's.
            let mut held: Vec<(u64, u64)> = src
                .extents()
                .unwrap_or_default()
                .into_iter()
                .filter(|e| e.depth < depth)
                .map(|e| (e.offset, e.offset + e.length))
                .collect();
            if size > src_size {
                held.push((src_size, size));
            }
            union(&held, &[])
        } else {
            union(&src_ranges, &out_ranges)
        };
        let cluster = match target {
            Target::Pcow(i) => i.cluster_size(),
            Target::Raw(_) => PAGE_SIZE,
        };
        let chunk = CHUNK.max(cluster).max(opts.sparse_size);
        let candidates = clip(candidates);
        Ok(Plan {
            size,
            src_ranges: intersect(&src_ranges, &candidates),
            out_ranges: intersect(&out_ranges, &candidates),
            candidates,
            sparse_size: opts.sparse_size,
            chunk,
        })
    }

    /// Walks the candidate chunks: reads the input and what the output
    /// shows, and writes what differs.
    fn copy(
        &self,
        src: &Source,
        target: &mut Target,
        report: &mut ConvertReport,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<()> {
        let chunk = self.chunk;
        let mut sbuf = vec![0u8; chunk as usize];
        let mut obuf = vec![0u8; chunk as usize];
        let mut walk_src = RangeReader::new(&self.src_ranges);
        let mut walk_out = RangeReader::new(&self.out_ranges);
        let mut actions = Vec::with_capacity((chunk / PAGE_SIZE) as usize);
        let mut next_chunk = 0u64;
        progress(0, self.size);
        for (i, &(start, end)) in self.candidates.iter().enumerate() {
            let mut c = (start / chunk).max(next_chunk);
            while c * chunk < end {
                let (cs, ce) = (c * chunk, ((c + 1) * chunk).min(self.size));
                let n = (ce - cs) as usize;
                if !walk_src.read(cs, &mut sbuf[..n], &mut |b, o| src.read_at(b, o))? {
                    sbuf[..n].fill(0);
                }
                // Where the output holds nothing here, it shows zeros.
                let shown = walk_out
                    .read(cs, &mut obuf[..n], &mut |b, o| target.read_at(b, o))?
                    .then_some(&obuf[..n]);
                // Pages outside every candidate show the input already.
                let mut inside = vec![false; n.div_ceil(PAGE_SIZE as usize)];
                for &(s, e) in &self.candidates[i..] {
                    if s >= ce {
                        break;
                    }
                    let (s, e) = (s.max(cs) - cs, e.min(ce) - cs);
                    if s < e {
                        let first = (s / PAGE_SIZE) as usize;
                        let last = ((e - 1) / PAGE_SIZE) as usize;
                        inside[first..=last].fill(true);
                    }
                }
                self.decide(&sbuf[..n], shown, &inside, &mut actions);
                let mut p = 0;
                while p < actions.len() {
                    let a = actions[p];
                    let q = p + actions[p..].iter().take_while(|&&x| x == a).count();
                    let (s, e) = (p * PAGE_SIZE as usize, (q * PAGE_SIZE as usize).min(n));
                    if a != Action::Skip {
                        target.write(&sbuf[s..e], cs + s as u64, a)?;
                        match a {
                            Action::Zero => report.bytes_zeroed += (e - s) as u64,
                            _ => report.bytes_written += (e - s) as u64,
                        }
                    }
                    p = q;
                }
                progress(ce, self.size);
                c += 1;
            }
            next_chunk = c;
        }
        progress(self.size, self.size);
        Ok(())
    }

    /// One action per page of `input` (the last page may be partial), given
    /// what the output shows there (`None`: zeros); pages not `inside` a
    /// candidate range (whose bytes were not read) are skipped.
    fn decide(
        &self,
        input: &[u8],
        shown: Option<&[u8]>,
        inside: &[bool],
        actions: &mut Vec<Action>,
    ) {
        actions.clear();
        // Pages where both read as zeros: sparse unless `-S` asks for them.
        let mut both_zero = Vec::with_capacity(inside.len());
        let page = PAGE_SIZE as usize;
        for (k, (i, &inside)) in input.chunks(page).zip(inside).enumerate() {
            if !inside {
                actions.push(Action::Skip);
                both_zero.push(false);
                continue;
            }
            let zero = is_zero(i);
            let differs = match shown {
                Some(o) => i != &o[k * page..k * page + i.len()],
                None => !zero,
            };
            let a = if differs {
                if zero {
                    Action::Zero
                } else {
                    Action::Data
                }
            } else if zero && self.sparse_size == 0 {
                Action::Data
            } else {
                Action::Skip
            };
            actions.push(a);
            both_zero.push(zero && !differs);
        }
        if self.sparse_size <= PAGE_SIZE {
            return;
        }
        // Short zero runs between written pages are written too.
        let short = (self.sparse_size / PAGE_SIZE) as usize;
        let mut p = 0;
        while p < actions.len() {
            let q = p + actions[p..]
                .iter()
                .zip(&both_zero[p..])
                .take_while(|(a, z)| **a == Action::Skip && **z)
                .count();
            let bounded = p > 0 && q < actions.len() && actions[p - 1] != Action::Skip;
            if q > p && bounded && actions[q] != Action::Skip && q - p < short {
                actions[p..q].fill(Action::Data);
            }
            p = q.max(p + 1);
        }
    }
}

/// Fills chunk buffers from a reader, reading only inside sorted ranges
/// (zeros elsewhere); chunks must come in increasing order.
struct RangeReader<'a> {
    ranges: &'a [(u64, u64)],
    next: usize,
}

impl<'a> RangeReader<'a> {
    fn new(ranges: &'a [(u64, u64)]) -> Self {
        RangeReader { ranges, next: 0 }
    }

    /// Fills `buf` (the bytes at `at`) and returns true, or returns false
    /// without touching it when no range reaches into it (all zeros).
    fn read(
        &mut self,
        at: u64,
        buf: &mut [u8],
        read: &mut dyn FnMut(&mut [u8], u64) -> Result<()>,
    ) -> Result<bool> {
        let end = at + buf.len() as u64;
        while self.next < self.ranges.len() && self.ranges[self.next].1 <= at {
            self.next += 1;
        }
        let mut done = 0usize;
        for &(s, e) in &self.ranges[self.next..] {
            if s >= end {
                break;
            }
            let (s, e) = ((s.max(at) - at) as usize, (e.min(end) - at) as usize);
            buf[done..s].fill(0);
            read(&mut buf[s..e], at + s as u64)?;
            done = e;
        }
        if done == 0 {
            return Ok(false);
        }
        buf[done..].fill(0);
        Ok(true)
    }
}

/// Sorted, disjoint ranges covering either input.
fn union(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut all: Vec<(u64, u64)> = a.iter().chain(b).copied().collect();
    all.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in all {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Sorted, disjoint ranges covered by both inputs (each sorted, disjoint).
fn intersect(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::new();
    while i < a.len() && j < b.len() {
        let (s, e) = (a[i].0.max(b[j].0), a[i].1.min(b[j].1));
        if s < e {
            out.push((s, e));
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// One image of a chain: its file (if any) and format.
struct Level<'a> {
    file: Option<&'a File>,
    pcow: bool,
}

fn levels(img: &Image) -> Vec<Level<'_>> {
    let mut v = vec![Level {
        file: img.file(),
        pcow: true,
    }];
    let mut cur = img.base();
    while let Some(b) = cur {
        cur = match b {
            Backing::Pcow(i) => {
                v.push(Level {
                    file: i.file(),
                    pcow: true,
                });
                i.base()
            }
            Backing::Raw(r) => {
                v.push(Level {
                    file: Some(r.file()),
                    pcow: false,
                });
                None
            }
        };
    }
    v
}

fn same_file(a: &File, b: &File) -> bool {
    match (a.metadata(), b.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The depth in the input's chain of the output's base, when the input's
/// view takes everything it does not hold above that depth from it, as the
/// output does: the same file in the same format, read at its active view
/// (the input's top only when the input is not a snapshot). Where an image
/// above it is smaller and so hides part of it, the extents show zeros at
/// that image's depth.
fn shared_base_depth(src: &Source, out: &Image) -> Option<usize> {
    let Source::Pcow { image, layer } = src else {
        return None;
    };
    let out_levels = levels(out);
    let base = out_levels.get(1)?;
    let base_file = base.file?;
    let in_levels = levels(image);
    let depth = in_levels
        .iter()
        .position(|l| l.pcow == base.pcow && l.file.is_some_and(|f| same_file(f, base_file)))?;
    (depth > 0 || *layer == image.active_layer()).then_some(depth)
}

/// A raw output file, exclusively locked.
struct RawOutput {
    path: PathBuf,
    file: File,
    len: u64,
}

impl RawOutput {
    /// A new file of `size` bytes, sparse (replacing any file at `path`).
    fn create(path: &Path, size: u64) -> Result<RawOutput> {
        let (file, created) = crate::output_file::open_output_noting(path)?;
        if let Err(e) = crate::output_file::reset_len(&file, path, size) {
            // A size the file system cannot hold: no file is left where
            // there was none (an existing one is as it was).
            if created {
                let _ = std::fs::remove_file(path);
            }
            return Err(e);
        }
        Ok(RawOutput {
            path: path.to_owned(),
            file,
            len: size,
        })
    }

    /// The existing file at `path`, opened and locked by
    /// [`crate::output_file::open_in_place`], kept as it is.
    fn open(file: File, path: &Path) -> Result<RawOutput> {
        let len = file
            .metadata()
            .map_err(io_err(path, "reading metadata"))?
            .len();
        Ok(RawOutput {
            path: path.to_owned(),
            file,
            len,
        })
    }

    /// Makes `[off, off + len)` read as zeros: a punched hole, or written
    /// zeros where the file system cannot punch.
    fn zero(&mut self, off: u64, len: u64) -> Result<()> {
        let (Ok(o), Ok(l)) = (libc::off_t::try_from(off), libc::off_t::try_from(len)) else {
            return Err(Error::Invalid(format!(
                "{}: range [{off}, +{len}) is beyond what the system can address",
                self.path.display()
            )));
        };
        // SAFETY: fallocate only reads its integer arguments; the fd is
        // owned by `self.file`, open for the call. KEEP_SIZE leaves the
        // file's length as it is.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                o,
                l,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(io_err(&self.path, "punching a hole")(e));
        }
        crate::io::write_zeros(&self.file, off, len)
            .map_err(io_err(&self.path, "writing zeros"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::BaseFormat;
    use crate::ops::source::next_data;

    fn opts(out: ImageFormat) -> ConvertOptions {
        ConvertOptions::new(out)
    }

    fn base_ref(name: &str, format: BaseFormat) -> Option<BaseRef> {
        Some(BaseRef {
            name: name.into(),
            format,
        })
    }

    fn run(input: &Path, output: &Path, o: &ConvertOptions) -> Result<ConvertReport> {
        convert(input, output, o, &mut |_, _| {})
    }

    /// A pcow image of `size` bytes with 4 KiB clusters and the given writes.
    fn pcow(path: &Path, size: u64, base: Option<&str>, writes: &[(u64, &[u8])]) -> Image {
        let mut img = Image::create(
            path,
            &CreateOptions {
                cluster_size: Some(4096),
                virtual_size: Some(size),
                base: base.map(|b| BaseRef {
                    name: b.into(),
                    format: BaseFormat::Probe,
                }),
            },
        )
        .unwrap();
        for (off, data) in writes {
            img.write_at(data, *off).unwrap();
        }
        img
    }

    fn view(path: &Path) -> Vec<u8> {
        let img = Image::open(path, OpenOptions::read_only()).unwrap();
        let mut v = vec![0u8; img.virtual_size() as usize];
        img.read_at(&mut v, 0).unwrap();
        v
    }

    /// Where the top image of `path` holds data: (offset, length) pairs.
    fn own_extents(path: &Path) -> Vec<(u64, u64)> {
        let img = Image::open(path, OpenOptions::read_only()).unwrap();
        img.extents()
            .into_iter()
            .filter(|e| e.depth == 0 && e.file_offset.is_some())
            .map(|e| (e.offset, e.length))
            .collect()
    }

    #[test]
    fn zero_detection() {
        let mut v = vec![0u8; 100];
        assert!(is_zero(&v));
        v[99] = 1;
        assert!(!is_zero(&v));
        assert!(is_zero(&[]));
    }

    #[test]
    fn ranges_union_and_intersect() {
        assert_eq!(
            union(&[(0, 5), (10, 20)], &[(3, 8), (20, 25)]),
            [(0, 8), (10, 25)]
        );
        assert_eq!(
            intersect(&[(0, 5), (10, 20)], &[(3, 12), (15, 30)]),
            [(3, 5), (10, 12), (15, 20)]
        );
        assert!(intersect(&[(0, 5)], &[(5, 9)]).is_empty());
    }

    #[test]
    fn raw_round_trip_through_pcow() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("in.raw");
        let mut data = vec![0u8; 300_000];
        data[5000..9000].fill(7);
        data[299_999] = 1;
        std::fs::write(&raw, &data).unwrap();
        let pc = dir.path().join("out.pcow");
        let o = ConvertOptions {
            cluster_size: Some(4096),
            ..opts(ImageFormat::Pcow)
        };
        let r = run(&raw, &pc, &o).unwrap();
        assert_eq!(r.input_format, ImageFormat::Raw);
        assert_eq!(r.output_size, 303_104);
        assert!(r.rounded());
        // Pages 1 and 2 hold the 7s, page 73 the last byte (the output
        // is rounded up to whole clusters, zeros past the input's end).
        assert_eq!(r.bytes_written, 3 * 4096);
        let back = dir.path().join("back.raw");
        let r = run(&pc, &back, &opts(ImageFormat::Raw)).unwrap();
        assert_eq!(r.input_format, ImageFormat::Pcow);
        let got = std::fs::read(&back).unwrap();
        assert_eq!(got.len(), 303_104);
        assert_eq!(&got[..data.len()], &data[..]);
        assert!(got[data.len()..].iter().all(|&b| b == 0));
    }

    #[test]
    fn same_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("in.raw");
        std::fs::write(&raw, [1u8; 4096]).unwrap();
        for existing_target in [false, true] {
            let o = ConvertOptions {
                existing_target,
                ..opts(ImageFormat::Raw)
            };
            assert!(matches!(run(&raw, &raw, &o), Err(Error::Invalid(_))));
        }
        assert_eq!(std::fs::read(&raw).unwrap(), vec![1u8; 4096]);
    }

    #[test]
    fn a_snapshot_is_converted_by_id_or_name() {
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path().join("top.pcow");
        let mut img = pcow(&top, 64 << 10, None, &[(0, &[1; 4096])]);
        img.snapshot_create("first").unwrap();
        img.write_at(&[2; 4096], 0).unwrap();
        img.write_at(&[3; 4096], 8192).unwrap();
        img.snapshot_create("second").unwrap();
        img.write_at(&[4; 4096], 0).unwrap();
        img.close().unwrap();
        let out = dir.path().join("out.raw");
        let first = |o: &ConvertOptions| {
            run(&top, &out, o).unwrap();
            std::fs::read(&out).unwrap()
        };
        for sel in [
            SnapshotSel::IdOrTag("1".into()),
            SnapshotSel::IdOrTag("first".into()),
            SnapshotSel::parse_load("snapshot.name=first").unwrap(),
            SnapshotSel::parse_load("snapshot.id=1,snapshot.name=first").unwrap(),
        ] {
            let v = first(&ConvertOptions {
                snapshot: Some(sel.clone()),
                ..opts(ImageFormat::Raw)
            });
            assert!(v[..4096].iter().all(|&b| b == 1), "{sel}");
            assert!(v[4096..].iter().all(|&b| b == 0), "{sel}");
        }
        let v = first(&ConvertOptions {
            snapshot: Some(SnapshotSel::parse_load("snapshot.id=2").unwrap()),
            ..opts(ImageFormat::Raw)
        });
        assert_eq!((v[0], v[8192]), (2, 3));
        // The current content, without a snapshot.
        assert_eq!(first(&opts(ImageFormat::Raw))[0], 4);
        // A snapshot into an overlay of the image itself: the overlay shows
        // the current content, so the snapshot's differences are written.
        let o = ConvertOptions {
            snapshot: Some(SnapshotSel::IdOrTag("first".into())),
            cluster_size: Some(4096),
            base: base_ref("top.pcow", BaseFormat::Pcow),
            ..opts(ImageFormat::Pcow)
        };
        let over = dir.path().join("over.pcow");
        run(&top, &over, &o).unwrap();
        let v = view(&over);
        assert!(v[..4096].iter().all(|&b| b == 1));
        assert!(v[4096..].iter().all(|&b| b == 0));
        // What matches nothing, and raw inputs, are errors.
        for bad in [
            SnapshotSel::IdOrTag("third".into()),
            SnapshotSel::parse_load("snapshot.id=1,snapshot.name=second").unwrap(),
            SnapshotSel::Exact {
                id: None,
                tag: None,
            },
        ] {
            let o = ConvertOptions {
                snapshot: Some(bad.clone()),
                ..opts(ImageFormat::Raw)
            };
            assert!(run(&top, &out, &o).is_err(), "{bad}");
        }
        let o = ConvertOptions {
            snapshot: Some(SnapshotSel::IdOrTag("1".into())),
            ..opts(ImageFormat::Raw)
        };
        let e = run(&out, &dir.path().join("x.raw"), &o).unwrap_err();
        assert!(
            e.to_string().contains("a raw image has no snapshots"),
            "{e}"
        );
        for bad in [
            "",
            "snapshot.id=x",
            "snapshot.id=1,snapshot.id=2",
            "snapshot.tag=a",
            "snapshot.name=",
        ] {
            assert!(SnapshotSel::parse_load(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn over_any_base_only_the_difference_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // A base that is not the input's: the output must still equal the
        // input, where the base has data the input lacks too.
        let mut base = vec![5u8; 64 << 10];
        base[40960..].fill(0);
        std::fs::write(d.join("base.raw"), &base).unwrap();
        let mut input = base.clone();
        input[4096..8192].fill(6); // differs
        input[16384..20480].fill(0); // base data the input lacks
        input[50000] = 9; // where the base is zero
        std::fs::write(d.join("in.raw"), &input).unwrap();
        let o = ConvertOptions {
            cluster_size: Some(4096),
            base: base_ref("base.raw", BaseFormat::Raw),
            ..opts(ImageFormat::Pcow)
        };
        let out = d.join("out.pcow");
        let r = run(&d.join("in.raw"), &out, &o).unwrap();
        assert_eq!(view(&out), input);
        assert_eq!(
            own_extents(&out),
            [(4096, 4096), (16384, 4096), (49152, 4096)]
        );
        assert_eq!((r.bytes_written, r.bytes_zeroed), (8192, 4096));
    }

    #[test]
    fn over_a_base_of_the_inputs_chain_only_the_layers_above_it_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let size = 64 << 10;
        pcow(&d.join("b.pcow"), size, None, &[(0, &[1; 32768])])
            .close()
            .unwrap();
        pcow(
            &d.join("m.pcow"),
            size,
            Some("b.pcow"),
            &[(8192, &[2; 4096])],
        )
        .close()
        .unwrap();
        let mut t = pcow(
            &d.join("t.pcow"),
            size,
            Some("m.pcow"),
            &[(20480, &[3; 4096])],
        );
        // Written back to the base's bytes: compared, and not written.
        t.write_at(&[1; 4096], 0).unwrap();
        t.close().unwrap();
        let o = ConvertOptions {
            cluster_size: Some(4096),
            base: base_ref("b.pcow", BaseFormat::Pcow),
            ..opts(ImageFormat::Pcow)
        };
        let out = d.join("out.pcow");
        let r = run(&d.join("t.pcow"), &out, &o).unwrap();
        assert_eq!(view(&out), view(&d.join("t.pcow")));
        assert_eq!(own_extents(&out), [(8192, 4096), (20480, 4096)]);
        assert_eq!(r.bytes_written, 8192);
        // -S 16K fills short zero runs between written pages, but never
        // where the output shows the base (pages 3 and 4 hold its 1s).
        let o16 = ConvertOptions {
            sparse_size: 16384,
            ..o.clone()
        };
        let out16 = d.join("out16.pcow");
        run(&d.join("t.pcow"), &out16, &o16).unwrap();
        assert_eq!(view(&out16), view(&d.join("t.pcow")));
        // The input as its own base: nothing to write.
        let o = ConvertOptions {
            base: base_ref("t.pcow", BaseFormat::Pcow),
            ..o16
        };
        let r = run(&d.join("t.pcow"), &d.join("same.pcow"), &o).unwrap();
        assert_eq!(r.bytes_written, 0);
        assert_eq!(view(&d.join("same.pcow")), view(&d.join("t.pcow")));
    }

    #[test]
    fn what_the_input_shows_as_zeros_past_a_size_hides_the_base() {
        // m (8 KiB) over b (16 KiB, all 1s), t (16 KiB) over m: t reads
        // zeros past 8 KiB, where b has data and t holds nothing. An
        // overlay of b must write those zeros.
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        pcow(&d.join("b.pcow"), 16384, None, &[(0, &[1; 16384])])
            .close()
            .unwrap();
        pcow(&d.join("m.pcow"), 8192, Some("b.pcow"), &[])
            .close()
            .unwrap();
        pcow(&d.join("t.pcow"), 16384, Some("m.pcow"), &[])
            .close()
            .unwrap();
        assert!(own_extents(&d.join("t.pcow")).is_empty());
        let want = view(&d.join("t.pcow"));
        assert!(want[8192..].iter().all(|&b| b == 0));
        let o = ConvertOptions {
            cluster_size: Some(4096),
            base: base_ref("b.pcow", BaseFormat::Pcow),
            ..opts(ImageFormat::Pcow)
        };
        let out = d.join("out.pcow");
        run(&d.join("t.pcow"), &out, &o).unwrap();
        assert_eq!(view(&out), want);
        // A 12 KiB input over b into 16 KiB clusters: the output's last 4
        // KiB lie past the input's end and read as zeros, not as b.
        pcow(&d.join("short.pcow"), 12288, Some("b.pcow"), &[])
            .close()
            .unwrap();
        let o = ConvertOptions {
            cluster_size: Some(16384),
            ..o
        };
        run(&d.join("short.pcow"), &out, &o).unwrap();
        let v = view(&out);
        assert_eq!(v.len(), 16384);
        assert!(v[..12288].iter().all(|&b| b == 1));
        assert!(v[12288..].iter().all(|&b| b == 0));
    }

    #[test]
    fn into_an_existing_target_what_differs_is_written_and_zeros_punched() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let mut input = vec![0u8; 64 << 10];
        input[0..4096].fill(1);
        input[8192..12288].fill(2);
        std::fs::write(d.join("in.raw"), &input).unwrap();
        // A raw target twice the size, data everywhere: the first half
        // becomes the input (holes where it has zeros), the rest stays.
        let mut old = vec![7u8; 128 << 10];
        old[8192..12288].fill(2); // already right: not written
        std::fs::write(d.join("t.raw"), &old).unwrap();
        let o = ConvertOptions {
            existing_target: true,
            ..opts(ImageFormat::Raw)
        };
        let r = run(&d.join("in.raw"), &d.join("t.raw"), &o).unwrap();
        assert_eq!((r.bytes_written, r.bytes_zeroed), (4096, (64 << 10) - 8192));
        assert_eq!(r.output_size, 128 << 10);
        let got = std::fs::read(d.join("t.raw")).unwrap();
        assert_eq!(&got[..64 << 10], &input[..]);
        assert!(got[64 << 10..].iter().all(|&b| b == 7));
        let f = File::open(d.join("t.raw")).unwrap();
        let holes = next_data(&f, 4096, 64 << 10).unwrap();
        assert_eq!(holes, Some((8192, 12288)), "zeros are holes");

        // A pcow target with its own base: zeros are written over it.
        pcow(&d.join("b.pcow"), 64 << 10, None, &[(0, &[9; 65536])])
            .close()
            .unwrap();
        pcow(&d.join("t.pcow"), 64 << 10, Some("b.pcow"), &[])
            .close()
            .unwrap();
        let o = ConvertOptions {
            existing_target: true,
            ..opts(ImageFormat::Pcow)
        };
        run(&d.join("in.raw"), &d.join("t.pcow"), &o).unwrap();
        assert_eq!(view(&d.join("t.pcow")), input);

        // --target-is-zero trusts the target: its data stays.
        std::fs::write(d.join("z.raw"), vec![7u8; 64 << 10]).unwrap();
        let o = ConvertOptions {
            existing_target: true,
            target_is_zero: true,
            ..opts(ImageFormat::Raw)
        };
        run(&d.join("in.raw"), &d.join("z.raw"), &o).unwrap();
        let got = std::fs::read(d.join("z.raw")).unwrap();
        assert_eq!((got[0], got[5000], got[8192]), (1, 7, 2));
    }

    #[test]
    fn an_existing_target_must_fit_and_be_of_the_output_format() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("in.raw"), vec![1u8; 8192]).unwrap();
        std::fs::write(d.join("small.raw"), vec![2u8; 4096]).unwrap();
        pcow(&d.join("p.pcow"), 8192, None, &[]).close().unwrap();
        let pcow_header = std::fs::read(d.join("p.pcow")).unwrap();
        let o = |f| ConvertOptions {
            existing_target: true,
            ..opts(f)
        };
        let e = run(
            &d.join("in.raw"),
            &d.join("small.raw"),
            &o(ImageFormat::Raw),
        )
        .unwrap_err();
        assert!(e.to_string().contains("smaller than the input"), "{e}");
        let e = run(&d.join("in.raw"), &d.join("p.pcow"), &o(ImageFormat::Raw)).unwrap_err();
        assert!(
            e.to_string().contains("would overwrite its metadata"),
            "{e}"
        );
        let e = run(
            &d.join("in.raw"),
            &d.join("small.raw"),
            &o(ImageFormat::Pcow),
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a pcow image"), "{e}");
        let e = run(
            &d.join("in.raw"),
            &d.join("missing.raw"),
            &o(ImageFormat::Raw),
        )
        .unwrap_err();
        assert!(e.to_string().contains("missing.raw"), "{e}");
        // Nothing was touched.
        assert_eq!(std::fs::read(d.join("small.raw")).unwrap(), vec![2u8; 4096]);
        assert_eq!(std::fs::read(d.join("p.pcow")).unwrap(), pcow_header);
    }

    #[test]
    fn sparse_size_allocates_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // Data pages 0, 3 and 10 of 16; holes between.
        let mut input = vec![0u8; 16 * 4096];
        for p in [0, 3, 10] {
            input[p * 4096..][..4096].fill(1);
        }
        std::fs::write(d.join("in.raw"), &input).unwrap();
        let written = |sparse_size| {
            let o = ConvertOptions {
                cluster_size: Some(4096),
                sparse_size,
                ..opts(ImageFormat::Pcow)
            };
            let out = d.join(format!("s{sparse_size}.pcow"));
            let r = run(&d.join("in.raw"), &out, &o).unwrap();
            assert_eq!(view(&out), input);
            (r.bytes_written / 4096, own_extents(&out))
        };
        assert_eq!(
            written(4096),
            (3, vec![(0, 4096), (12288, 4096), (40960, 4096)])
        );
        // 0: every page.
        assert_eq!(written(0), (16, vec![(0, 16 * 4096)]));
        // 12 KiB: the 2-page run between 0 and 3 is filled, the 6-page run
        // between 3 and 10 and the tail are not.
        assert_eq!(written(12288), (5, vec![(0, 16384), (40960, 4096)]));
        // Raw output with -S 0: fully allocated.
        let o = ConvertOptions {
            sparse_size: 0,
            ..opts(ImageFormat::Raw)
        };
        run(&d.join("in.raw"), &d.join("full.raw"), &o).unwrap();
        let f = File::open(d.join("full.raw")).unwrap();
        assert_eq!(next_data(&f, 0, 16 * 4096).unwrap(), Some((0, 16 * 4096)));
        assert!(f.metadata().unwrap().blocks() * 512 >= 16 * 4096);
        for bad in [1000, 17 << 20] {
            let o = ConvertOptions {
                sparse_size: bad,
                ..opts(ImageFormat::Raw)
            };
            let e = run(&d.join("in.raw"), &d.join("x.raw"), &o).unwrap_err();
            assert!(e.to_string().contains("invalid sparse size"), "{e}");
        }
    }

    #[test]
    fn meaningless_combinations_are_refused_before_anything_is_opened() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let cases = [
            (
                ConvertOptions {
                    cluster_size: Some(4096),
                    ..opts(ImageFormat::Raw)
                },
                "cluster size",
            ),
            (
                ConvertOptions {
                    base: base_ref("b", BaseFormat::Raw),
                    ..opts(ImageFormat::Raw)
                },
                "a raw output has no base",
            ),
            (
                ConvertOptions {
                    existing_target: true,
                    base: base_ref("b", BaseFormat::Raw),
                    ..opts(ImageFormat::Pcow)
                },
                "keeps its own base",
            ),
            (
                ConvertOptions {
                    existing_target: true,
                    cluster_size: Some(4096),
                    ..opts(ImageFormat::Pcow)
                },
                "keeps its own cluster size",
            ),
            (
                ConvertOptions {
                    target_is_zero: true,
                    ..opts(ImageFormat::Pcow)
                },
                "--target-is-zero",
            ),
        ];
        for (o, want) in cases {
            let e = run(&missing, &missing, &o).unwrap_err();
            assert!(e.to_string().contains(want), "{o:?}: {e}");
        }
    }
}
