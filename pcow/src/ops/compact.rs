//! `compact`: rewrite an image with only what its views reach, each
//! layer's clusters in virtual order, and replace the file atomically.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use crate::error::{io_err, Error, Result};
use crate::format::PAGE_SIZE;
use crate::image::{CreateOptions, Image, OpenOptions};
use crate::lock::lock_file;
use crate::meta::SnapshotInfo;
use crate::replace::{temp_name, TempPurpose};

/// What a compaction did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CompactReport {
    /// File length before, in bytes.
    pub old_size: u64,
    /// File length after, in bytes.
    pub new_size: u64,
    /// Layers before and after.
    pub layers_before: u32,
    /// See `layers_before`.
    pub layers_after: u32,
    /// Data clusters before and after.
    pub clusters_before: u64,
    /// See `clusters_before`.
    pub clusters_after: u64,
}

/// The new file's layers: which old layers each one merges (top first)
/// and its new parent.
struct Plan {
    kept: Vec<u32>,
    groups: HashMap<u32, Vec<u32>>,
    new_index: HashMap<u32, u32>,
    parent: HashMap<u32, Option<u32>>,
}

fn plan(img: &Image) -> Plan {
    let n = img.meta.layers.len();
    let snapshots = img.snapshots();
    let mut head = vec![false; n];
    head[img.active_layer() as usize] = true;
    for s in &snapshots {
        head[s.layer as usize] = true;
    }
    let mut live = vec![false; n];
    for h in (0..n).filter(|&h| head[h]) {
        for l in img.meta.path_of(Some(h as u32)) {
            live[l as usize] = true;
        }
    }
    let mut live_children = vec![0usize; n];
    for (i, l) in img.meta.layers.iter().enumerate().filter(|(i, _)| live[*i]) {
        if let Some(p) = l.parent {
            live_children[p as usize] += 1;
        }
        let _ = i;
    }
    // An unnamed layer with one live child adds nothing a view can see on
    // its own: fold it into that child.
    let merged = |l: usize| live[l] && !head[l] && live_children[l] == 1;
    let kept: Vec<u32> = (0..n)
        .filter(|&l| live[l] && !merged(l))
        .map(|l| l as u32)
        .collect();
    let mut groups = HashMap::new();
    let mut parent = HashMap::new();
    for &k in &kept {
        let mut group = vec![k];
        let mut cur = img.meta.layers[k as usize].parent;
        while let Some(p) = cur.filter(|p| merged(*p as usize)) {
            group.push(p);
            cur = img.meta.layers[p as usize].parent;
        }
        groups.insert(k, group);
        parent.insert(k, cur);
    }
    let new_index = kept
        .iter()
        .enumerate()
        .map(|(i, &k)| (k, i as u32))
        .collect();
    Plan {
        kept,
        groups,
        new_index,
        parent,
    }
}

/// Compacts the image at `path` in place (through a temporary file in the
/// same directory and a rename).
pub fn compact(path: &Path) -> Result<CompactReport> {
    let opts = OpenOptions {
        force_share: true,
        ..OpenOptions::default()
    };
    let src = Image::open(path, opts)?;
    if let Some(f) = src.file() {
        // Exclusive on the image (no writer, no overlay reading it); the
        // base chain is only read.
        lock_file(f, path, true)?;
    }
    let old_size = src.alloc.file_len;
    // A compact, freeze or reset of this image that was killed left its
    // temporary file: nothing holds its lock any more.
    crate::replace::remove_stale_temps(path).map_err(io_err(
        path,
        "removing stale temporary files beside the image",
    ))?;
    let tmp = temp_name(path, TempPurpose::Compact).ok_or_else(|| Error::Io {
        path: path.to_owned(),
        op: "naming the temporary file",
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    let result = write_compacted(&src, &tmp);
    let (layers_after, clusters_after) = match result {
        Ok(x) => x,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, path).map_err(io_err(path, "replacing the image"))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(dir, "syncing the directory"))?;
    }
    let new_size = std::fs::metadata(path)
        .map_err(io_err(path, "reading metadata"))?
        .len();
    Ok(CompactReport {
        old_size,
        new_size,
        layers_before: src.meta.layers.len() as u32,
        layers_after,
        clusters_before: src.meta.entries.len() as u64,
        clusters_after,
    })
}

fn write_compacted(src: &Image, tmp: &Path) -> Result<(u32, u64)> {
    let p = plan(src);
    let g = src.geometry();
    let opts = CreateOptions {
        cluster_size: Some(g.cluster_size()),
        virtual_size: Some(src.virtual_size()),
        base: src.base_ref().cloned(),
    };
    let mut dst = Image::create(tmp, &opts)?;
    let mut unplaced: Vec<SnapshotInfo> = src.snapshots();
    let cs = g.cluster_size() as usize;
    let mut buf = vec![0u8; cs];
    let mut bm = vec![0u64; g.words()];
    for &k in &p.kept {
        let new_k = p.new_index[&k];
        if new_k > 0 {
            let parent = p.parent[&k].map(|old| p.new_index[&old]).unwrap_or(0);
            // A snapshot cluster stacked on `parent` may carry one record
            // of a snapshot of `parent`'s view.
            let old_parent = p.parent[&k];
            let rec = unplaced
                .iter()
                .position(|s| Some(s.layer) == old_parent)
                .map(|i| unplaced.remove(i))
                .map(|s| SnapshotInfo { layer: parent, ..s });
            let l = dst.append_layer(parent, rec)?;
            debug_assert_eq!(l, new_k);
        }
        let group = &p.groups[&k];
        let mut vcns: Vec<u64> = group
            .iter()
            .flat_map(|&l| src.meta.layers[l as usize].map.keys())
            .collect();
        vcns.sort_unstable();
        vcns.dedup();
        for vcn in vcns {
            bm.fill(0);
            buf.fill(0);
            // Pages from the topmost layer of the group that holds them.
            for page in 0..g.pages() {
                let holder = group.iter().find_map(|&l| {
                    src.meta.layers[l as usize]
                        .map
                        .get(&vcn)
                        .filter(|&&e| src.meta.bit(e, page))
                        .map(|&e| src.meta.entries[e as usize].cluster)
                });
                if let Some(cluster) = holder {
                    let at = page * PAGE_SIZE as usize;
                    src.storage
                        .read_at(
                            &mut buf[at..at + PAGE_SIZE as usize],
                            g.offset(cluster) + at as u64,
                        )
                        .map_err(io_err(src.path(), "reading data"))?;
                    bm[page / 64] |= 1 << (page % 64);
                }
            }
            dst.put_cluster(new_k, vcn, &bm, &buf)?;
        }
    }
    // Snapshots whose view has no kept child layer get an empty layer to
    // carry their record.
    for s in unplaced {
        let parent = p.new_index[&s.layer];
        dst.append_layer(parent, Some(SnapshotInfo { layer: parent, ..s }))?;
    }
    dst.header.staged.active_layer = p.new_index[&src.active_layer()];
    dst.header.staged.next_snapshot_id = src.header.staged.next_snapshot_id;
    dst.commit.meta_dirty = true;
    let layers = dst.meta.layers.len() as u32;
    let clusters = dst.meta.entries.len() as u64;
    dst.close()?;
    Ok((layers, clusters))
}
