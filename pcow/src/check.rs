//! Consistency check and repair: every rule of the spec's "Consistency
//! rules" section, reported by number, in qemu-img's exit-code convention.

use std::path::Path;

use crate::error::{Error, Result};
use crate::image::{Image, OpenOptions};

/// How much `check` may repair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair {
    /// L1..L3: uncommitted clusters, stale slots, the DIRTY flag.
    Leaks,
    /// Leaks and R10 (counters).
    All,
}

/// One violated rule.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Finding {
    /// "R1".."R11", "L1".."L3".
    pub rule: String,
    /// What is wrong, with the field and file offset.
    pub message: String,
    /// Whether this run repaired it.
    pub repaired: bool,
}

/// The outcome of a check.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CheckReport {
    /// The image checked.
    pub filename: String,
    /// Rule violations R1..R11.
    pub corruptions: Vec<Finding>,
    /// L1..L3.
    pub leaks: Vec<Finding>,
    /// Data clusters in the file (all layers).
    pub allocated_clusters: u64,
    /// Clusters past the committed end (L1).
    pub leaked_clusters: u64,
    /// Data clusters no view reaches (reclaimed by `compact`).
    pub unreachable_clusters: u64,
    /// Virtual size in clusters.
    pub total_clusters: u64,
    /// Committed end of the image, in bytes.
    pub image_end_offset: u64,
}

impl CheckReport {
    /// qemu-img's convention: 0 clean, 2 corrupt, 3 leaks only.
    pub fn exit_code(&self) -> i32 {
        if self.corruptions.iter().any(|f| !f.repaired) {
            2
        } else if self.leaks.iter().any(|f| !f.repaired) {
            3
        } else {
            0
        }
    }

    /// Whether nothing unrepaired was found.
    pub fn is_clean(&self) -> bool {
        self.exit_code() == 0
    }
}

fn finding(rule: &str, message: String) -> Finding {
    Finding {
        rule: rule.to_owned(),
        message,
        repaired: false,
    }
}

/// The findings of an image opened with [`OpenOptions::lenient`].
pub fn report(img: &Image) -> CheckReport {
    let g = img.geometry();
    let mut r = CheckReport {
        filename: img.path().display().to_string(),
        allocated_clusters: img
            .meta
            .entries
            .iter()
            .filter(|e| e.vcn != u64::MAX)
            .count() as u64,
        total_clusters: img.virtual_size() / g.cluster_size(),
        image_end_offset: g.offset(img.header.staged.cluster_count),
        ..CheckReport::default()
    };
    for f in img.findings() {
        r.corruptions.push(finding(f.rule(), f.to_string()));
    }
    r.leaked_clusters = img.found.uncommitted_at_open;
    if img.found.uncommitted_at_open > 0 {
        r.leaks.push(finding(
            "L1",
            format!(
                "{} uncommitted cluster(s) past the committed end (offset {})",
                img.found.uncommitted_at_open, r.image_end_offset
            ),
        ));
    }
    for off in &img.found.stale {
        r.leaks.push(finding(
            "L2",
            format!("stale or torn metadata slot at offset {off} (interrupted barrier)"),
        ));
    }
    if img.found.dirty_at_open {
        r.leaks.push(finding(
            "L3",
            "DIRTY flag set: the image was not closed cleanly".into(),
        ));
    }
    r.unreachable_clusters = unreachable_clusters(img);
    r
}

/// Data clusters in layers that no snapshot and not the active layer reach.
fn unreachable_clusters(img: &Image) -> u64 {
    let mut live = vec![false; img.meta.layers.len()];
    let heads = img
        .meta
        .layers
        .iter()
        .filter_map(|l| l.snap.as_ref().map(|s| s.layer))
        .chain(std::iter::once(img.active_layer()));
    for h in heads {
        for l in img.meta.path_of(Some(h)) {
            live[l as usize] = true;
        }
    }
    img.meta
        .layers
        .iter()
        .zip(live)
        .filter(|(_, live)| !live)
        .map(|(l, _)| l.map.len() as u64)
        .sum()
}

/// Checks the image at `path` and its base chain; repairs what `repair`
/// allows. Errors are only for what stops the check itself (I/O, a file
/// that is not pcow, a lock held by a writer).
pub fn check(path: &Path, repair: Option<Repair>, force_share: bool) -> Result<CheckReport> {
    let lenient = OpenOptions {
        lenient: true,
        skip_base: true,
        force_share,
        ..OpenOptions::default()
    };
    let img = match Image::open(path, lenient) {
        Ok(img) => img,
        Err(Error::Format { source, .. }) if source != crate::format::FormatError::NotPcow => {
            // The walk cannot go on: the one fatal violation is the report.
            return Ok(CheckReport {
                filename: path.display().to_string(),
                corruptions: vec![finding(source.rule(), source.to_string())],
                ..CheckReport::default()
            });
        }
        Err(e) => return Err(e),
    };
    let mut r = report(&img);
    if img.base_ref().is_some() {
        let chain = OpenOptions {
            force_share,
            ..OpenOptions::default()
        };
        match Image::open(
            path,
            OpenOptions {
                skip_base: false,
                ..chain
            },
        ) {
            Ok(_) => {}
            Err(e @ (Error::Io { .. } | Error::Locked { .. })) => return Err(e),
            // Our own image's fatal errors were handled above, so a format
            // error here comes from a base: the chain is broken.
            Err(e) => r.corruptions.push(finding("R11", error_report::chain(&e))),
        }
    }
    drop(img);
    let Some(repair) = repair else {
        return Ok(r);
    };
    let only_counters = r.corruptions.iter().all(|f| f.rule == "R10");
    let wanted = |f: &Finding| repair == Repair::All || f.rule.starts_with('L');
    let fixable = r
        .corruptions
        .iter()
        .all(|f| f.rule == "R10" && repair == Repair::All);
    if !only_counters || !fixable && !r.corruptions.is_empty() {
        // Writing metadata over a corrupt image could make it worse.
        return Ok(r);
    }
    if r.leaks.is_empty() && r.corruptions.is_empty() {
        return Ok(r);
    }
    let rw = OpenOptions {
        writable: true,
        lenient: true,
        skip_base: true,
        ..OpenOptions::default()
    };
    // Opening for writing zeroes stale slots (L2), truncates uncommitted
    // clusters (L1) and writes a header whose counters are recomputed from
    // the walk (R10); closing clears DIRTY (L3).
    let mut img = Image::open(path, rw)?;
    let max_id = img.snapshots().iter().map(|s| s.id).max().unwrap_or(0);
    if img.header.staged.next_snapshot_id <= max_id {
        // Also covers a zero counter with no snapshot: the next id is 1.
        img.header.staged.next_snapshot_id = max_id + 1;
        img.commit.meta_dirty = true;
    }
    img.close()?;
    for f in r.corruptions.iter_mut().chain(r.leaks.iter_mut()) {
        f.repaired = wanted(f);
    }
    Ok(r)
}
