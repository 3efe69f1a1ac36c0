//! `snapshot` and `rollback`.

use anyhow::bail;
use pcow::{Image, OpenOptions};

use crate::info::snapshot_table;
use crate::{RollbackArgs, SnapshotArgs};

pub fn snapshot(a: SnapshotArgs) -> anyhow::Result<u8> {
    crate::maint::pcow_only(a.format, "snapshot", "snapshots")?;
    // -q: the operations print nothing anyway, and -l lists all the same
    // (as qemu-img's does).
    let _ = a.quiet;
    if a.list {
        let img = Image::open(
            &a.file,
            OpenOptions {
                force_share: a.force_share,
                ..OpenOptions::read_only()
            },
        )?;
        let snaps = img.snapshots();
        if !snaps.is_empty() {
            println!("Snapshot list:");
            println!("{}", snapshot_table(&snaps));
        }
        return Ok(0);
    }
    if a.force_share {
        bail!("-U (force share) is only allowed with -l: the other operations write the image");
    }
    // The operation checks its argument (a tag, a snapshot) before it
    // writes anything: a refusal leaves the image as it was.
    let mut img = Image::open(&a.file, OpenOptions::read_write_deferred())?;
    if let Some(tag) = &a.create {
        img.snapshot_create(tag)?;
    } else if let Some(snap) = &a.apply {
        img.snapshot_apply(snap)?;
    } else if let Some(snap) = &a.delete {
        img.snapshot_delete(snap)?;
    }
    img.close()?;
    Ok(0)
}

pub fn rollback(a: RollbackArgs) -> anyhow::Result<u8> {
    let _ = a.quiet;
    let mut img = Image::open(&a.file, OpenOptions::read_write_deferred())?;
    img.snapshot_apply(&a.snap)?;
    img.close()?;
    Ok(0)
}
