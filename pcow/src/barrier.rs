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

impl Image {
    /// Writes the slot `buf` at `at`: only the prefix that can differ from
    /// what the file holds (see [`crate::slot_ends`]).
    /// Returns the content's end for [`crate::slot_ends::SlotEnds::synced`].
    pub(crate) fn write_slot(&mut self, buf: &[u8], at: u64) -> std::io::Result<usize> {
        let p = self.slot_ends.prefix_to_write(at, buf);
        if p.len > 0 {
            self.storage.write_at(&buf[..p.len], at)?;
        }
        Ok(p.content_end)
    }
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
        // Each slot written, its offset and content end (recorded in
        // `slot_ends` once a sync has made it durable).
        let mut written = Vec::new();
        let mut entries = Vec::new();
        for i in 0..self.segments.len() {
            let seg = &self.segments[i];
            if !seg.dirty {
                continue;
            }
            entries.clear();
            for e in seg.first..seg.first + seg.used {
                push_entry(&mut entries, self.entries[e as usize].vcn, self.bitmap(e));
            }
            let slot = other(seg.cur_slot);
            let buf = encode_meta(g, gen, seg.meta, seg.layer, seg.used, &entries);
            let at = g.offset(seg.meta) + u64::from(slot) * slot_bytes;
            let end = self
                .write_slot(&buf, at)
                .map_err(io_err(&path, "writing a meta cluster"))?;
            written.push((Written::Segment(i, slot), at, end));
        }
        for i in 0..self.layers.len() {
            let layer = &self.layers[i];
            if !layer.dirty {
                continue;
            }
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
            let at = g.offset(layer.start) + u64::from(slot) * slot_bytes;
            let end = self
                .write_slot(&buf, at)
                .map_err(io_err(&path, "writing a snapshot cluster"))?;
            written.push((Written::Layer(i, slot), at, end));
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
        for &(_, at, end) in &written {
            self.slot_ends.synced(at, end);
        }
        let mut h = self.header.clone();
        h.generation = gen;
        h.cluster_count = self.next_cluster;
        h.data_cluster_count = self.entries.len() as u64;
        h.layer_count = self.layers.len() as u32;
        h.snapshot_count = self.layers.iter().filter(|l| l.snap.is_some()).count() as u32;
        let hslot = other(Some(self.header_slot));
        let hbuf = h.encode();
        let hat = u64::from(hslot) * slot_bytes;
        let hend = self
            .write_slot(&hbuf, hat)
            .map_err(io_err(&path, "writing the header"))?;
        self.storage
            .sync()
            .map_err(io_err(&path, "syncing the header"))?;
        self.slot_ends.synced(hat, hend);
        // Committed: the written slots are now the current ones.
        for (w, _, _) in written {
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
