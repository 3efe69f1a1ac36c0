//! `rebase`: point an image at another base (or none), keeping every
//! layer's view unchanged (safe) or just renaming (unsafe).

use std::path::Path;

use crate::chain::{check_base_name, open_base, Backing, ChainCtx};
use crate::error::{Error, Result};
use crate::format::{BaseRef, PAGE_SIZE};
use crate::image::{Image, OpenOptions};

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
    for vcn in 0..img.virtual_size() / cs {
        let off = vcn * cs;
        let old_has = img.base.as_ref().is_some_and(|b| b.has_data(off, cs));
        let new_has = new.is_some_and(|b| b.has_data(off, cs));
        if !old_has && !new_has {
            continue;
        }
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
