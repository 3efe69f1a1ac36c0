//! `commit`, `rebase`, `resize` and `compact`: thin wrappers over
//! `pcow::ops`.

use anyhow::{bail, Context};
use pcow::ops::convert::ImageFormat;
use pcow::{BaseRef, Image, OpenOptions};

use crate::create::base_format;
use crate::output::human_size;
use crate::size::{parse_aligned, parse_size};
use crate::{CommitArgs, CompactArgs, Fmt, RebaseArgs, ResizeArgs};

/// `-f` on a command only a pcow image has: `-f raw` is an error naming
/// what a raw image lacks.
pub fn pcow_only(format: Option<Fmt>, command: &str, lacks: &str) -> anyhow::Result<()> {
    if format == Some(Fmt::Raw) {
        bail!("a raw image has no {lacks} ({command} is for pcow images)");
    }
    Ok(())
}

pub fn commit(a: CommitArgs) -> anyhow::Result<u8> {
    pcow_only(a.format, "commit", "base")?;
    let r = match &a.base {
        Some(base) => pcow::ops::commit_into(&a.file, base)?,
        None => pcow::ops::commit(&a.file, a.keep)?,
    };
    if a.quiet {
        return Ok(0);
    }
    println!(
        "Image committed: {} bytes copied into {}{}",
        r.bytes_copied,
        r.base.display(),
        if r.emptied { "; overlay emptied" } else { "" }
    );
    Ok(0)
}

pub fn rebase(a: RebaseArgs) -> anyhow::Result<u8> {
    pcow_only(a.image_format, "rebase", "base")?;
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
    // Nothing to say on success, quiet or not (as qemu-img).
    let _ = a.quiet;
    Ok(0)
}

pub fn resize(a: ResizeArgs) -> anyhow::Result<u8> {
    let format = match a.format {
        Some(f) => f.into(),
        None => ImageFormat::probe(&a.file)?,
    };
    if format == ImageFormat::Raw {
        return resize_raw(&a);
    }
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
    if !a.quiet {
        println!("Image resized.");
    }
    Ok(0)
}

/// `resize` of a raw file: grown to the new size (a hole), as qemu-img
/// does; shrinking is refused here too.
fn resize_raw(a: &ResizeArgs) -> anyhow::Result<u8> {
    let f = pcow::output_file::open_in_place(&a.file)?;
    let current = f
        .metadata()
        .with_context(|| format!("{}: reading metadata", a.file.display()))?
        .len();
    let new_size = match a.size.strip_prefix('+') {
        Some(delta) => current
            .checked_add(parse_size(delta)?)
            .with_context(|| format!("invalid size '{}': the new size overflows", a.size))?,
        None if a.size.starts_with('-') => bail!(
            "invalid size '{}': shrinking is not supported (current size {current})",
            a.size
        ),
        None => parse_size(&a.size)?,
    };
    if new_size < current {
        bail!(
            "invalid size '{}': shrinking from {current} to {new_size} bytes is not supported",
            a.size
        );
    }
    f.set_len(new_size)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("{}: growing to {new_size} bytes", a.file.display()))?;
    if !a.quiet {
        println!("Image resized.");
    }
    Ok(0)
}

pub fn compact(a: CompactArgs) -> anyhow::Result<u8> {
    pcow_only(a.format, "compact", "layers or clusters to compact")?;
    let r = pcow::ops::compact(&a.file)?;
    if a.quiet {
        return Ok(0);
    }
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
