//! `commit`, `rebase`, `resize` and `compact`: thin wrappers over
//! `pcow::ops`.

use anyhow::bail;
use pcow::{BaseRef, Image, OpenOptions};

use crate::create::base_format;
use crate::output::human_size;
use crate::size::parse_aligned;
use crate::{CommitArgs, CompactArgs, RebaseArgs, ResizeArgs};

pub fn commit(a: CommitArgs) -> anyhow::Result<u8> {
    let r = pcow::ops::commit(&a.file, a.keep)?;
    println!(
        "Image committed: {} bytes copied into {}{}",
        r.bytes_copied,
        r.base.display(),
        if r.emptied { "; overlay emptied" } else { "" }
    );
    Ok(0)
}

pub fn rebase(a: RebaseArgs) -> anyhow::Result<u8> {
    let new_base = if a.base.is_empty() {
        if a.format.is_some() {
            bail!("-F makes no sense with -b \"\" (removing the base)");
        }
        None
    } else {
        Some(BaseRef {
            format: base_format(&a.file, &a.base, a.format),
            name: a.base,
        })
    };
    pcow::ops::rebase(&a.file, new_base, a.unsafe_)?;
    Ok(0)
}

pub fn resize(a: ResizeArgs) -> anyhow::Result<u8> {
    let (current, cs) = {
        let img = Image::open(&a.file, OpenOptions::read_only())?;
        (img.virtual_size(), img.cluster_size())
    };
    let new_size = if let Some(delta) = a.size.strip_prefix('+') {
        let d = parse_aligned(delta, cs)?;
        match current.checked_add(d) {
            Some(n) => n,
            None => bail!("invalid size '{}': the new size overflows", a.size),
        }
    } else if a.size.starts_with('-') {
        bail!(
            "invalid size '{}': shrinking is not supported (current size {current})",
            a.size
        );
    } else {
        parse_aligned(&a.size, cs)?
    };
    if new_size < current {
        bail!(
            "invalid size '{}': shrinking from {current} to {new_size} bytes is not supported",
            a.size
        );
    }
    pcow::ops::resize(&a.file, new_size)?;
    println!("Image resized.");
    Ok(0)
}

pub fn compact(a: CompactArgs) -> anyhow::Result<u8> {
    let r = pcow::ops::compact(&a.file)?;
    println!(
        "Image compacted: {} -> {} ({} -> {} layers, {} -> {} data clusters)",
        human_size(r.old_size),
        human_size(r.new_size),
        r.layers_before,
        r.layers_after,
        r.clusters_before,
        r.clusters_after
    );
    Ok(0)
}
