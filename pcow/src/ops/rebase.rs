//! `rebase`: point an image at another base (or none), keeping every
//! layer's view unchanged (safe) or just renaming (unsafe).

use std::path::Path;

use crate::chain::{check_base_name, open_base, Backing, ChainCtx};
use crate::error::{Error, Result};
use crate::format::{BaseRef, PAGE_SIZE};
use crate::image::{Image, OpenOptions};
use crate::ops::source::{extent_data_ranges, file_data_ranges};

/// Changes the base of the image at `path` to `new_base` (`None`:
/// flatten). Safe mode first copies into layer 0 every page that layer 0
/// does not hold and where the old and new bases differ; since every view
/// falls through layer 0 to the base, no view changes. A crash in between
/// leaves the old base name with extra (equal) pages in layer 0.
pub fn rebase(path: &Path, new_base: Option<BaseRef>, unsafe_: bool) -> Result<()> {
    if let Some(b) = &new_base {
        check_base_name(&b.name)?;
    }
    // Nothing is written before the image and the new base chain are
    // open, locked and checked.
    let opts = OpenOptions {
        skip_base: unsafe_,
        ..OpenOptions::read_write_deferred()
    };
    let mut img = Image::open(path, opts)?;
    if unsafe_ {
        // Unsafe mode skips reading the new base's data, not the checks of
        // its identity: if it exists, it is opened (unlocked) with its whole
        // chain, so the image itself (by any name: device and inode are
        // compared), a cycle, a non-regular file, a file that is not of the
        // declared format and a chain past the limit are refused. A new
        // base that does not exist yet is allowed, as qemu-img allows it.
        if let Some(b) = &new_base {
            let mut ctx = ChainCtx {
                force_share: true,
                ..ChainCtx::default()
            };
            if let Some(f) = img.file() {
                ctx.visit(f, path)?;
            }
            match open_base(path, b, &mut ctx) {
                Ok(_) | Err(Error::BaseMissing { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        img.begin_writing()?;
    } else {
        let mut ctx = ChainCtx::default();
        if let Some(f) = img.file() {
            ctx.visit(f, path)?;
        }
        let new = match &new_base {
            Some(b) => Some(open_base(path, b, &mut ctx)?),
            None => None,
        };
        img.begin_writing()?;
        copy_differences(&mut img, new.as_ref())?;
        img.flush()?;
        img.base = new.map(Box::new);
    }
    img.header.staged.base = new_base;
    img.commit.meta_dirty = true;
    img.close()
}

fn copy_differences(img: &mut Image, new: Option<&Backing>) -> Result<()> {
    let cs = img.cluster_size();
    let ps = PAGE_SIZE as usize;
    let mut old_buf = vec![0u8; cs as usize];
    let mut new_buf = vec![0u8; cs as usize];
    // Only clusters where the old or the new base stores data can differ
    // (everywhere else both read as zeros): the walk costs what the bases
    // store, not the virtual size.
    let mut candidates = Vec::new();
    for b in img.base.as_deref().into_iter().chain(new) {
        candidates.extend(data_clusters(b, img.virtual_size(), cs)?);
    }
    candidates.sort_unstable();
    for vcn in merge_runs(candidates).into_iter().flat_map(|(s, e)| s..e) {
        let off = vcn * cs;
        let held: Vec<bool> = match img.meta.layers[0].map.get(&vcn) {
            Some(&e) => (0..img.geometry().pages())
                .map(|p| img.meta.bit(e, p))
                .collect(),
            None => vec![false; img.geometry().pages()],
        };
        if held.iter().all(|h| *h) {
            continue;
        }
        img.read_view(None, &mut old_buf, off)?;
        match new {
            Some(b) => b.read_at(&mut new_buf, off)?,
            None => new_buf.fill(0),
        }
        for (p, _) in held.iter().enumerate().filter(|(_, h)| !**h) {
            let r = p * ps..(p + 1) * ps;
            if old_buf[r.clone()] != new_buf[r.clone()] {
                img.write_layer(0, &old_buf[r], off + (p * ps) as u64)?;
            }
        }
    }
    Ok(())
}

/// Runs `[first, end)` of the virtual clusters below `size` where `b`
/// stores data: a pcow chain's data extents, a raw file's data ranges
/// (`SEEK_DATA`, so a sparse raw base costs what it stores).
fn data_clusters(b: &Backing, size: u64, cs: u64) -> Result<Vec<(u64, u64)>> {
    let ranges = match b {
        Backing::Raw(r) => file_data_ranges(r.file(), r.len().min(size), b.path())?,
        Backing::Pcow(_) => extent_data_ranges(&b.view_extents(&[(0, size.min(b.size()))], 1)),
    };
    Ok(ranges
        .into_iter()
        .map(|(s, e)| (s / cs, e.div_ceil(cs)))
        .collect())
}

/// Sorted runs, overlapping or adjacent ones merged.
fn merge_runs(sorted: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for (s, e) in sorted {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}
