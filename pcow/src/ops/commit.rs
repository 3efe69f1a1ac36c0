//! `commit`: copy what an overlay holds into its base.

use std::path::{Path, PathBuf};

use std::os::unix::fs::MetadataExt;

use crate::chain::{open_base_writable, resolve_base, Backing};
use crate::error::io_err;
use crate::error::{Error, Result};
use crate::format::{MAX_CHAIN_DEPTH, PAGE_SIZE};
use crate::header::is_pcow;
use crate::image::{Image, OpenOptions};
use crate::ops::convert::is_zero;

/// What a commit did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CommitReport {
    /// The base written to.
    pub base: PathBuf,
    /// Bytes copied into the base.
    pub bytes_copied: u64,
    /// Whether the overlay was emptied afterwards.
    pub emptied: bool,
}

/// Copies every page that the overlay's active view holds itself into its
/// base (through the base's own barrier), then empties the overlay unless
/// `keep_overlay` is set or the overlay has snapshots (emptying would
/// change them). Either way the overlay's content is unchanged.
pub fn commit(path: &Path, keep_overlay: bool) -> Result<CommitReport> {
    // Both images are locked exclusively and checked before either is
    // written: a refusal (the base in use, missing, of the wrong format, a
    // size it cannot grow to) leaves both as they were. The overlay is
    // only written if it is emptied.
    let opts = OpenOptions {
        skip_base: true,
        ..OpenOptions::read_write_deferred()
    };
    let mut top = Image::open(path, opts)?;
    let base_ref = top.base_ref().cloned().ok_or_else(|| Error::NoBase {
        path: path.to_owned(),
    })?;
    let mut base = open_base_writable(path, &base_ref)?;
    let vs = top.virtual_size();
    if base.size() < vs {
        match &mut base {
            Backing::Pcow(b) => {
                let size = vs.next_multiple_of(b.cluster_size());
                b.grow(size)?;
            }
            Backing::Raw(r) => r.set_len(vs)?,
        }
    }
    let cs = top.cluster_size();
    let mut buf = vec![0u8; cs as usize];
    let mut copied = 0u64;
    let active = top.active_layer();
    for vcn in held_vcns(&top, active) {
        let held = held_pages(&top, active, vcn);
        top.read_view(Some(active), &mut buf, vcn * cs)?;
        for (start, end) in page_runs(&held) {
            let (a, b) = (start as u64 * PAGE_SIZE, end as u64 * PAGE_SIZE);
            base.write_at(&buf[a as usize..b as usize], vcn * cs + a)?;
            copied += b - a;
        }
    }
    base.flush()?;
    let emptied = !keep_overlay && top.snapshots().is_empty();
    if emptied {
        top.begin_writing()?;
        top.reset_empty()?;
    }
    let base_path = base.path().to_owned();
    drop(base);
    top.close()?;
    Ok(CommitReport {
        base: base_path,
        bytes_copied: copied,
        emptied,
    })
}

/// Commits the overlay at `path` into `base`, an image anywhere in its
/// chain (qemu-img's `commit -b`): afterwards `base` shows what the overlay
/// shows. The overlay is kept as it is (as qemu-img keeps it when `-b` is
/// given); images between the two now read the base's new content where
/// they hold nothing themselves.
pub fn commit_into(path: &Path, base: &Path) -> Result<CommitReport> {
    let not_in_chain = || {
        Error::Invalid(format!(
            "{} is not a base image of {}",
            base.display(),
            path.display()
        ))
    };
    let target = std::fs::metadata(base).map_err(io_err(base, "opening the base image"))?;
    let same = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.dev() == target.dev() && m.ino() == target.ino())
    };
    if same(path) {
        return Err(not_in_chain());
    }
    // The images above the base, top first, each opened without its own
    // base (the base is opened once, for writing).
    let above = OpenOptions {
        skip_base: true,
        ..OpenOptions::read_only()
    };
    let mut levels = vec![Image::open(path, above)?];
    let base_ref = loop {
        let Some(level) = levels.last() else {
            return Err(not_in_chain());
        };
        let Some(r) = level.base_ref().cloned() else {
            return Err(not_in_chain());
        };
        let next = resolve_base(level.path(), &r.name);
        if same(&next) {
            break r;
        }
        if levels.len() >= MAX_CHAIN_DEPTH || !is_pcow_file(&next) {
            return Err(not_in_chain());
        }
        levels.push(Image::open(&next, above)?);
    };
    let last = levels.last().map_or(path, |l| l.path()).to_owned();
    let mut target = open_base_writable(&last, &base_ref)?;
    let vs = levels[0].virtual_size();
    if target.size() < vs {
        match &mut target {
            Backing::Pcow(b) => {
                let size = vs.next_multiple_of(b.cluster_size());
                b.grow(size)?;
            }
            Backing::Raw(r) => r.set_len(vs)?,
        }
    }
    // Deepest first, so that each image's pages overwrite those below it.
    // Past an image's size everything above it reads zeros where it holds
    // nothing: those zeros go into the base first.
    let mut copied = 0u64;
    let mut chunk = vec![0u8; 1 << 20];
    for level in levels.iter().rev() {
        let end = vs.min(target.size());
        let mut off = level.virtual_size();
        while off < end {
            let n = (end - off).min(chunk.len() as u64) as usize;
            target.read_at(&mut chunk[..n], off)?;
            if !is_zero(&chunk[..n]) {
                chunk[..n].fill(0);
                target.write_at(&chunk[..n], off)?;
                copied += n as u64;
            }
            off += n as u64;
        }
        let cs = level.cluster_size();
        let mut buf = vec![0u8; cs as usize];
        let active = level.active_layer();
        for vcn in held_vcns(level, active) {
            level.read_view(Some(active), &mut buf, vcn * cs)?;
            for (start, stop) in page_runs(&held_pages(level, active, vcn)) {
                let (a, b) = (start as u64 * PAGE_SIZE, stop as u64 * PAGE_SIZE);
                target.write_at(&buf[a as usize..b as usize], vcn * cs + a)?;
                copied += b - a;
            }
        }
    }
    target.flush()?;
    Ok(CommitReport {
        base: target.path().to_owned(),
        bytes_copied: copied,
        emptied: false,
    })
}

fn is_pcow_file(path: &Path) -> bool {
    crate::output_file::open_regular_input(path).is_ok_and(|f| is_pcow(&f).unwrap_or(false))
}

/// Virtual clusters that any layer on `layer`'s path holds, in order.
pub(crate) fn held_vcns(img: &Image, layer: u32) -> Vec<u64> {
    let mut v: Vec<u64> = img
        .meta
        .path_of(Some(layer))
        .flat_map(|l| img.meta.layers[l as usize].map.keys())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// For each page of `vcn`: whether a layer on `layer`'s path holds it.
pub(crate) fn held_pages(img: &Image, layer: u32, vcn: u64) -> Vec<bool> {
    let pages = img.geometry().pages();
    let mut held = vec![false; pages];
    for l in img.meta.path_of(Some(layer)) {
        if let Some(&e) = img.meta.layers[l as usize].map.get(&vcn) {
            for (p, h) in held.iter_mut().enumerate() {
                *h |= img.meta.bit(e, p);
            }
        }
    }
    held
}

/// Runs `[start, end)` of consecutive `true` pages.
pub(crate) fn page_runs(held: &[bool]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut start = None;
    for (p, &h) in held.iter().chain(std::iter::once(&false)).enumerate() {
        match (h, start) {
            (true, None) => start = Some(p),
            (false, Some(s)) => {
                runs.push((s, p));
                start = None;
            }
            _ => {}
        }
    }
    runs
}
