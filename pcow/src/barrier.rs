//! The barrier: the only place metadata reaches the file, in the order the
//! spec's "Updates: the barrier" section defines (data and metadata slots,
//! sync, header slot, sync).

use crate::error::{Error, Result};
use crate::format::{encode_meta, encode_snap, push_entry, SnapSlot, MAX_GENERATION};
use crate::image::{io_err, Image};

/// A metadata cluster written by the barrier in progress.
enum Written {
    Segment(usize, u8),
    Layer(usize, u8),
}

fn other(slot: Option<u8>) -> u8 {
    match slot {
        Some(0) => 1,
        _ => 0,
    }
}

impl Image {
    /// Makes every write so far durable and commits the staged metadata.
    /// On error nothing is committed; the staged state is kept and a later
    /// barrier retries it.
    pub fn flush(&mut self) -> Result<()> {
        if !self.writable {
            return Ok(());
        }
        let path = self.path.clone();
        if !self.meta_dirty {
            if self.data_dirty {
                self.storage.sync().map_err(io_err(&path, "syncing data"))?;
                self.data_dirty = false;
            }
            return Ok(());
        }
        // Readers refuse generations past the limit, so never write one.
        let gen = self.committed_gen + 1;
        if gen > MAX_GENERATION {
            return Err(Error::Limit {
                path: path.clone(),
                what: "generation counter exhausted".into(),
            });
        }
        let g = self.g;
        let slot_bytes = g.slot_size() as u64;
        let mut written = Vec::new();
        let mut entries = Vec::new();
        for (i, seg) in self.segments.iter().enumerate().filter(|(_, s)| s.dirty) {
            entries.clear();
            for e in seg.first..seg.first + seg.used {
                push_entry(&mut entries, self.entries[e as usize].vcn, self.bitmap(e));
            }
            let slot = other(seg.cur_slot);
            let buf = encode_meta(g, gen, seg.meta, seg.layer, seg.used, &entries);
            self.storage
                .write_at(&buf, g.offset(seg.meta) + u64::from(slot) * slot_bytes)
                .map_err(io_err(&path, "writing a meta cluster"))?;
            written.push(Written::Segment(i, slot));
        }
        for (i, layer) in self.layers.iter().enumerate().filter(|(_, l)| l.dirty) {
            let (snapshot_id, tag, time_sec, time_nsec) = match &layer.snap {
                Some(s) => (s.id, s.tag.clone(), s.time_sec, s.time_nsec),
                None => (0, String::new(), 0, 0),
            };
            let s = SnapSlot {
                layer: i as u32,
                parent_layer: layer.parent.unwrap_or(0),
                snapshot_id,
                tag,
                time_sec,
                time_nsec,
            };
            let slot = other(layer.cur_slot);
            let buf = encode_snap(g, gen, layer.start, &s);
            self.storage
                .write_at(&buf, g.offset(layer.start) + u64::from(slot) * slot_bytes)
                .map_err(io_err(&path, "writing a snapshot cluster"))?;
            written.push(Written::Layer(i, slot));
        }
        // One sync covers the data and the new slots: until the header
        // names generation `gen` the slots are stale and readers ignore
        // them, so their order against the data does not matter; only the
        // header must follow both.
        if self.data_dirty || !written.is_empty() {
            self.storage
                .sync()
                .map_err(io_err(&path, "syncing data and metadata"))?;
            self.data_dirty = false;
        }
        let mut h = self.header.clone();
        h.generation = gen;
        h.cluster_count = self.next_cluster;
        h.data_cluster_count = self.entries.len() as u64;
        h.layer_count = self.layers.len() as u32;
        h.snapshot_count = self.layers.iter().filter(|l| l.snap.is_some()).count() as u32;
        let hslot = other(Some(self.header_slot));
        self.storage
            .write_at(&h.encode(), u64::from(hslot) * slot_bytes)
            .map_err(io_err(&path, "writing the header"))?;
        self.storage
            .sync()
            .map_err(io_err(&path, "syncing the header"))?;
        // Committed: the written slots are now the current ones.
        for w in written {
            match w {
                Written::Segment(i, s) => {
                    self.segments[i].cur_slot = Some(s);
                    self.segments[i].dirty = false;
                }
                Written::Layer(i, s) => {
                    self.layers[i].cur_slot = Some(s);
                    self.layers[i].dirty = false;
                }
            }
        }
        self.header = h;
        self.header_slot = hslot;
        self.committed_gen = gen;
        self.meta_dirty = false;
        Ok(())
    }

    /// Generation of the last committed barrier.
    pub fn generation(&self) -> u64 {
        self.committed_gen
    }
}
