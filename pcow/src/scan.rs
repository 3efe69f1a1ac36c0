//! Reading an image's metadata: walking the structures from cluster 1 to
//! the committed end (the header is read by [`crate::header`]), choosing
//! each structure's slot and checking every rule that can be checked on
//! the way (R5..R10), into the cluster map.

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::format::{
    check_snap_fields, decode_slot, read_entry, DecodedSlot, FormatError, Geometry, SlotBody,
    SlotFault, MAX_CLUSTER_COUNT, MAX_LAYERS,
};
use crate::image::Image;
use crate::meta::{ClusterMap, Entry, Layer, Segment, SnapshotInfo, VcnMap};

/// Most entries reserved before the walk, whatever the header claims:
/// 64 Ki entries, with their map and bitmaps about 4 MiB at 4 KiB
/// clusters and 8 MiB at 2 MiB (the bitmaps grow with the cluster).
const RESERVE_CAP: u64 = 1 << 16;

/// The current slot of a metadata cluster and what to remember about the other.
struct Chosen {
    slot: u8,
    decoded: DecodedSlot,
}

impl Image {
    /// Walks the structures and builds layers, segments and entries. With
    /// `lenient`, violations that do not stop the walk go to `findings`.
    pub(crate) fn scan(&mut self, lenient: bool) -> Result<()> {
        let path = self.path.clone();
        let fail = |source: FormatError| Error::Format {
            path: path.clone(),
            source,
        };
        let g = self.g;
        let h = &self.header.staged;
        let file_clusters = self.alloc.file_len >> g.cluster_bits();
        // The limit comes first, before anything is allocated for the walk:
        // a sparse file can be as long as it likes.
        if h.cluster_count > MAX_CLUSTER_COUNT {
            return Err(fail(FormatError::ClusterCountLimit {
                value: h.cluster_count,
                offset: self.header.offset() + 64,
            }));
        }
        if h.cluster_count == 0 || h.cluster_count > file_clusters {
            return Err(fail(FormatError::ClusterCount {
                value: h.cluster_count,
                file_clusters,
                offset: self.header.offset() + 64,
            }));
        }
        let cc = h.cluster_count;
        let gen = h.generation;
        let vclusters = h.virtual_size >> g.cluster_bits();
        let next_id = h.next_snapshot_id;
        let mut findings = Vec::new();
        let mut report = |e: FormatError| -> Result<()> {
            if lenient {
                findings.push(e);
                Ok(())
            } else {
                Err(fail(e))
            }
        };
        self.meta = ClusterMap::new(g.words());
        self.found.stale.clear();
        let words = g.words();
        // The counter is untrusted, and the committed clusters only bound
        // it by the file's length, which a sparse file makes as large as it
        // likes: reserve at most RESERVE_CAP entries up front (what a real
        // image saves in rehashing), and let the walk grow the rest as it
        // finds entries that are really stored.
        let expect = self
            .header
            .staged
            .data_cluster_count
            .min(cc)
            .min(RESERVE_CAP) as usize;
        self.meta.entries.reserve(expect);
        self.meta.bitmaps.reserve(expect * words);
        if self.header.staged.layer_count <= 1 {
            self.meta.layers[0].map.reserve(expect);
        }
        let slot_len = g.slot_size();
        let mut ids = HashSet::new();
        let mut tags = HashSet::new();
        let mut buf = vec![0u8; g.cluster_size() as usize];
        let mut bm = vec![0u64; words];
        let mut pos = 1u64;
        while pos < cc {
            let at = g.offset(pos);
            self.storage
                .read_at(&mut buf, at)
                .map_err(crate::error::io_err(&self.path, "reading metadata"))?;
            for (i, bytes) in buf.chunks_exact(slot_len).enumerate() {
                self.commit
                    .slot_ends
                    .observed(at + (i * slot_len) as u64, bytes);
            }
            let chosen = self.choose_slot(&buf, pos, at, gen).map_err(fail)?;
            let slot_at = at + u64::from(chosen.slot) * slot_len as u64;
            let slot = &buf[chosen.slot as usize * slot_len..(chosen.slot as usize + 1) * slot_len];
            match chosen.decoded.body {
                SlotBody::Meta { layer, used } => {
                    let layers = self.meta.layers.len() as u32;
                    if layer >= layers {
                        return Err(fail(FormatError::MetaLayer {
                            layer,
                            layers,
                            offset: slot_at + 24,
                        }));
                    }
                    if used == 0 || used > g.capacity() {
                        return Err(fail(FormatError::MetaUsed {
                            used,
                            capacity: g.capacity(),
                            offset: slot_at + 28,
                        }));
                    }
                    let end = pos + 1 + u64::from(used);
                    if end > cc {
                        return Err(fail(FormatError::StructurePastEnd {
                            cluster: pos,
                            end,
                            cluster_count: cc,
                        }));
                    }
                    let seg_idx = self.meta.segments.len() as u32;
                    let first = self.meta.entries.len() as u32;
                    self.meta.layers[layer as usize]
                        .map
                        .preload((0..used as usize).map(|i| read_entry(slot, g, i, &mut [])));
                    for i in 0..used as usize {
                        let entry_at =
                            slot_at + (crate::format::META_FIXED + i * g.entry_size()) as u64;
                        let vcn = read_entry(slot, g, i, &mut bm);
                        let cluster = pos + 1 + i as u64;
                        if vcn >= vclusters {
                            report(FormatError::VcnOutOfRange {
                                vcn,
                                limit: vclusters,
                                offset: entry_at,
                            })?;
                        } else if bm.iter().all(|w| *w == 0) {
                            report(FormatError::EmptyBitmap {
                                offset: entry_at + 8,
                            })?;
                        } else if !bitmap_fits(&bm, g) {
                            report(FormatError::BitmapBeyondCluster {
                                pages: g.pages() as u64,
                                offset: entry_at + 8,
                            })?;
                        } else if !self.meta.layers[layer as usize]
                            .map
                            .insert_new(vcn, self.meta.entries.len() as u32)
                        {
                            report(FormatError::DuplicateVcn {
                                vcn,
                                layer,
                                offset: entry_at,
                            })?;
                        } else {
                            self.meta.entries.push(Entry {
                                vcn,
                                cluster,
                                seg: seg_idx,
                            });
                            self.meta.bitmaps.extend_from_slice(&bm);
                            continue;
                        }
                        // A rejected entry keeps its place so positions stay
                        // implied by index; it maps nothing.
                        self.meta.entries.push(Entry {
                            vcn: u64::MAX,
                            cluster,
                            seg: seg_idx,
                        });
                        self.meta.bitmaps.extend(std::iter::repeat_n(0, words));
                    }
                    self.meta.segments.push(Segment {
                        meta: pos,
                        layer,
                        first,
                        used,
                        cur_slot: Some(chosen.slot),
                        dirty: false,
                    });
                    pos = end;
                }
                SlotBody::Snap(s) => {
                    if let Err(e) = check_snap_fields(slot, slot_at) {
                        report(e)?;
                    }
                    let expected = self.meta.layers.len() as u32;
                    if expected >= MAX_LAYERS {
                        return Err(fail(FormatError::SnapshotLayer {
                            value: s.layer,
                            expected,
                            offset: slot_at + 24,
                        }));
                    }
                    if s.layer != expected {
                        report(FormatError::SnapshotLayer {
                            value: s.layer,
                            expected,
                            offset: slot_at + 24,
                        })?;
                    }
                    if s.parent_layer >= expected {
                        // Without a parent the layer tree cannot be built.
                        return Err(fail(FormatError::ParentLayer {
                            value: s.parent_layer,
                            layer: expected,
                            offset: slot_at + 28,
                        }));
                    }
                    let mut snap = None;
                    if s.snapshot_id != 0 {
                        if s.snapshot_id >= next_id || !ids.insert(s.snapshot_id) {
                            report(FormatError::SnapshotId {
                                value: s.snapshot_id,
                                next: next_id,
                                offset: slot_at + 32,
                            })?;
                        } else if !tags.insert(s.tag.clone()) {
                            report(FormatError::SnapshotTag {
                                why: "duplicate tag",
                                offset: slot_at + crate::format::SNAP_TAG_OFFSET as u64,
                            })?;
                        } else {
                            snap = Some(SnapshotInfo {
                                id: s.snapshot_id,
                                tag: s.tag.clone(),
                                time_sec: s.time_sec,
                                time_nsec: s.time_nsec,
                                layer: s.parent_layer,
                            });
                        }
                    }
                    self.meta.layers.push(Layer {
                        start: pos,
                        parent: Some(s.parent_layer),
                        snap,
                        map: VcnMap::default(),
                        cur_slot: Some(chosen.slot),
                        dirty: false,
                    });
                    pos += 1;
                }
            }
        }
        self.alloc.next_cluster = cc;
        // R10: counters against what the walk found.
        let hdr = self.header.offset();
        let found_layers = self.meta.layers.len() as u64;
        let found_snaps = self.meta.layers.iter().filter(|l| l.snap.is_some()).count() as u64;
        let found_data = self.meta.entries.len() as u64;
        let counters = [
            (
                "layer_count",
                u64::from(self.header.staged.layer_count),
                found_layers,
                hdr + 84,
            ),
            (
                "snapshot_count",
                u64::from(self.header.staged.snapshot_count),
                found_snaps,
                hdr + 88,
            ),
            (
                "data_cluster_count",
                self.header.staged.data_cluster_count,
                found_data,
                hdr + 72,
            ),
        ];
        for (name, stored, found, offset) in counters {
            if stored != found {
                report(FormatError::Counter {
                    name,
                    stored,
                    found,
                    offset,
                })?;
            }
        }
        if self.header.staged.active_layer as usize >= self.meta.layers.len() {
            return Err(fail(FormatError::ActiveLayer {
                value: self.header.staged.active_layer,
                layer_count: self.meta.layers.len() as u32,
                offset: hdr + 80,
            }));
        }
        // Id 0 means "no snapshot", so the counter is at least 1 even
        // without snapshots.
        let max = self
            .meta
            .layers
            .iter()
            .filter_map(|l| l.snap.as_ref())
            .map(|s| s.id)
            .max();
        let min_next = max.unwrap_or(0) + 1;
        if self.header.staged.next_snapshot_id < min_next {
            report(FormatError::Counter {
                name: "next_snapshot_id",
                stored: u64::from(self.header.staged.next_snapshot_id),
                found: u64::from(min_next),
                offset: hdr + 92,
            })?;
        }
        self.found.findings = findings;
        Ok(())
    }

    /// Picks the current slot of the metadata cluster at `pos`; records
    /// stale and torn partners for repair.
    fn choose_slot(
        &mut self,
        buf: &[u8],
        pos: u64,
        at: u64,
        gen: u64,
    ) -> std::result::Result<Chosen, FormatError> {
        let s = self.g.slot_size();
        let mut valid: Vec<Chosen> = Vec::new();
        let mut faults: Vec<String> = Vec::new();
        let mut junk = Vec::new();
        for slot in 0..2u8 {
            let slot_at = at + u64::from(slot) * s as u64;
            match decode_slot(
                &buf[slot as usize * s..(slot as usize + 1) * s],
                pos,
                slot_at,
            ) {
                Ok(d) if d.generation <= gen => valid.push(Chosen { slot, decoded: d }),
                Ok(d) => {
                    faults.push(format!(
                        "slot {} is stale (generation {} > {gen})",
                        slot_name(slot),
                        d.generation
                    ));
                    junk.push(slot_at);
                }
                Err(SlotFault::NoMagic) => {
                    faults.push(format!("slot {}: no magic", slot_name(slot)))
                }
                Err(f) => {
                    faults.push(format!("slot {}: {f}", slot_name(slot)));
                    junk.push(slot_at);
                }
            }
        }
        if valid.len() == 2 && valid[0].decoded.generation == valid[1].decoded.generation {
            return Err(FormatError::SameGeneration {
                cluster: pos,
                offset: at,
                generation: valid[0].decoded.generation,
            });
        }
        let Some(best) = valid.into_iter().max_by_key(|c| c.decoded.generation) else {
            if junk.is_empty() {
                return Err(FormatError::UnknownStructure {
                    cluster: pos,
                    offset: at,
                });
            }
            return Err(FormatError::NoValidSlot {
                kind: "metadata",
                cluster: pos,
                offset: at,
                why: faults.join("; "),
            });
        };
        self.found.stale.extend(junk);
        Ok(best)
    }
}

fn slot_name(slot: u8) -> char {
    if slot == 0 {
        'A'
    } else {
        'B'
    }
}

fn bitmap_fits(bm: &[u64], g: Geometry) -> bool {
    let pages = g.pages();
    bm.iter().enumerate().all(|(i, w)| {
        let bits = pages.saturating_sub(i * 64).min(64);
        bits == 64 || w >> bits == 0
    })
}
