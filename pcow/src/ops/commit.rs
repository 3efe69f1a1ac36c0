//! `commit`: copy what an overlay holds into its base.

use std::path::{Path, PathBuf};

use crate::chain::{open_base_writable, Backing};
use crate::error::{Error, Result};
use crate::format::PAGE_SIZE;
use crate::image::{Image, OpenOptions};

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
    let opts = OpenOptions {
        writable: true,
        skip_base: true,
        ..OpenOptions::default()
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

/// Virtual clusters that any layer on `layer`'s path holds, in order.
pub(crate) fn held_vcns(img: &Image, layer: u32) -> Vec<u64> {
    let mut v: Vec<u64> = img
        .path_of(Some(layer))
        .flat_map(|l| img.layers[l as usize].map.keys().copied())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// For each page of `vcn`: whether a layer on `layer`'s path holds it.
pub(crate) fn held_pages(img: &Image, layer: u32, vcn: u64) -> Vec<bool> {
    let pages = img.geometry().pages();
    let mut held = vec![false; pages];
    for l in img.path_of(Some(layer)) {
        if let Some(&e) = img.layers[l as usize].map.get(&vcn) {
            for (p, h) in held.iter_mut().enumerate() {
                *h |= img.bit(e, p);
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
