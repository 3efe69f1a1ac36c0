//! The barrier: the only place metadata reaches the file, in the order the
//! spec's "Updates: the barrier" section defines (data and metadata slots,
//! sync, header slot, sync).
//!
//! A barrier is a commit in three steps, so that a caller that shares the
//! image under a lock holds it only for the fast ones:
//! - [`crate::LiveImage::begin_commit`] (no sync) writes every dirty metadata slot
//!   into its other slot, builds the header of the next generation from
//!   the state as staged now, and clears the dirty marks it covers;
//! - [`Commit::write`] (no `Image`) syncs, writes the header slot and syncs
//!   again, through the storage's [`crate::io::CommitIo`] handle;
//! - [`crate::LiveImage::finish_commit`] publishes the written slots and header;
//!   [`crate::LiveImage::abort_commit`] marks what the commit covered dirty again.
//!
//! Changes made between begin and finish (clusters allocated, pages
//! recorded) mark things dirty again and belong to the next commit: the
//! header the commit writes only counts what was staged at begin, and the
//! slots it wrote describe that state. While a commit is pending, every
//! other metadata write is refused ([`Error::CommitPending`]).
//! [`Image::flush`] is the three steps in a row.

use std::sync::{Arc, Mutex};

use crate::commit::{progress, Commit, Pending, Progress, SlotOf, SlotWrite, Written};
use crate::error::{io_err, Error, Result};
use crate::format::{encode_meta, encode_snap, push_entry, Header, Slot, SnapSlot, MAX_GENERATION};
use crate::image::Image;

impl Image {
    /// Writes the slot `buf` at `at`: only the prefix that can differ from
    /// what the file holds (see [`crate::slot_ends`]).
    /// Returns the content's end for [`crate::slot_ends::SlotEnds::synced`].
    pub(crate) fn write_slot(&mut self, slot: &Slot, at: u64) -> std::io::Result<usize> {
        let (w, end) = self.stage_slot(slot, at, "writing a slot");
        if let Some(w) = w {
            self.storage.write_at(&w.bytes, w.at)?;
        }
        Ok(end)
    }

    /// [`Image::write_slot`] staged for a commit: the record raised now,
    /// the write (if anything can differ) returned for the commit to
    /// issue. Returns it and the content's end.
    fn stage_slot(
        &mut self,
        slot: &Slot,
        at: u64,
        what: &'static str,
    ) -> (Option<SlotWrite>, usize) {
        let p = self.commit.slot_ends.prefix_to_write(at, slot);
        let w = (p.len > 0).then(|| SlotWrite {
            bytes: slot.prefix(p.len),
            at,
            what,
        });
        (w, p.content_end)
    }
}

fn other(slot: Option<u8>) -> u8 {
    match slot {
        Some(0) => 1,
        _ => 0,
    }
}

impl Image {
    /// Makes every write so far durable and commits the staged metadata:
    /// the staged commit's three steps in a row (see
    /// [`crate::LiveImage::begin_commit`]).
    /// On error nothing is committed; the staged state is kept and a later
    /// barrier retries it.
    pub fn flush(&mut self) -> Result<()> {
        let Some(mut c) = self.begin_commit()? else {
            return Ok(());
        };
        match c.write() {
            Ok(()) => self.finish_commit(c),
            Err(e) => {
                self.abort_commit(c)?;
                Err(e)
            }
        }
    }

    /// Refuses a metadata write while a commit is pending.
    /// A commit whose [`Commit`] was dropped without being handed back can
    /// no longer write: it is settled here (published if it was written,
    /// else undone), so that a lost handle does not block the image.
    pub(crate) fn require_no_commit(&mut self) -> Result<()> {
        match &self.commit.pending {
            None => Ok(()),
            Some(p) if p.handle_dropped() => {
                self.settle_pending();
                Ok(())
            }
            Some(_) => Err(Error::CommitPending {
                path: self.path.clone(),
            }),
        }
    }

    /// See [`crate::LiveImage::begin_commit`].
    pub(crate) fn begin_commit(&mut self) -> Result<Option<Commit>> {
        if !self.access.writable {
            return Ok(None);
        }
        self.require_no_commit()?;
        if !self.commit.meta_dirty && !self.commit.data_dirty {
            return Ok(None);
        }
        let path = self.path.clone();
        let io = self
            .storage
            .commit_io()
            .map_err(io_err(&path, "opening the commit handle"))?;
        let (written, slots, header, header_write) = if self.commit.meta_dirty {
            let (written, slots, h, hslot, hwrite, hend) = self.stage_metadata()?;
            (
                written,
                slots,
                Some((h, hslot, hwrite.at, hend)),
                Some(hwrite),
            )
        } else {
            (Vec::new(), Vec::new(), None, None)
        };
        // Staged: what the commit covers is no longer dirty; anything
        // changed from here on marks it again for the next commit.
        for w in &written {
            match w.of {
                SlotOf::Segment(i) => self.meta.segments[i].dirty = false,
                SlotOf::Layer(i) => self.meta.layers[i].dirty = false,
            }
        }
        let sync_first = self.commit.data_dirty || !written.is_empty();
        let pending = Pending {
            id: self.commit.seq,
            gate: Arc::new(Mutex::new(Progress::Open)),
            written,
            header,
            had_data: self.commit.data_dirty,
            had_meta: self.commit.meta_dirty,
        };
        self.commit.seq += 1;
        self.commit.data_dirty = false;
        self.commit.meta_dirty = false;
        let commit = Commit {
            id: pending.id,
            gate: pending.gate.clone(),
            io,
            path,
            slots,
            sync_first,
            header: header_write,
            beside_fallocate: false,
        };
        self.commit.pending = Some(pending);
        Ok(Some(commit))
    }

    /// Encodes the dirty slots and the next header, for the commit to
    /// write (see [`crate::LiveImage::begin_commit`]); marks nothing clean.
    #[allow(clippy::type_complexity)]
    fn stage_metadata(
        &mut self,
    ) -> Result<(Vec<Written>, Vec<SlotWrite>, Header, u8, SlotWrite, usize)> {
        let path = self.path.clone();
        // Readers refuse generations past the limit, so never write one.
        let gen = self.header.committed_gen + 1;
        if gen > MAX_GENERATION {
            return Err(Error::Limit {
                path: path.clone(),
                what: "generation counter exhausted".into(),
            });
        }
        let g = self.g;
        let slot_bytes = g.slot_size() as u64;
        let mut written = Vec::new();
        let mut slots = Vec::new();
        let mut entries = Vec::new();
        for i in 0..self.meta.segments.len() {
            let seg = &self.meta.segments[i];
            if !seg.dirty {
                continue;
            }
            entries.clear();
            for e in seg.first..seg.first + seg.used {
                push_entry(
                    &mut entries,
                    self.meta.entries[e as usize].vcn,
                    self.meta.bitmap(e),
                );
            }
            let slot = other(seg.cur_slot);
            let buf = encode_meta(g, gen, seg.meta, seg.layer, seg.used, &entries);
            let at = g.offset(seg.meta) + u64::from(slot) * slot_bytes;
            let (w, end) = self.stage_slot(&buf, at, "writing a meta cluster");
            slots.extend(w);
            written.push(Written {
                of: SlotOf::Segment(i),
                slot,
                at,
                end,
            });
        }
        for i in 0..self.meta.layers.len() {
            let layer = &self.meta.layers[i];
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
            let (w, end) = self.stage_slot(&buf, at, "writing a snapshot cluster");
            slots.extend(w);
            written.push(Written {
                of: SlotOf::Layer(i),
                slot,
                at,
                end,
            });
        }
        let mut h = self.header.staged.clone();
        h.generation = gen;
        h.cluster_count = self.alloc.next_cluster;
        h.data_cluster_count = self.meta.entries.len() as u64;
        h.layer_count = self.meta.layers.len() as u32;
        h.snapshot_count = self.meta.snapshot_count() as u32;
        let hslot = other(Some(self.header.slot));
        let hslot_bytes = h.encode_slot();
        let hat = u64::from(hslot) * slot_bytes;
        // The record is raised before the write is issued (by the commit),
        // as `write_slot` does.
        let p = self.commit.slot_ends.prefix_to_write(hat, &hslot_bytes);
        let hwrite = SlotWrite {
            bytes: hslot_bytes.prefix(p.len),
            at: hat,
            what: "writing the header",
        };
        Ok((written, slots, h, hslot, hwrite, p.content_end))
    }

    /// Takes the pending record of `c`, or refuses a commit that is not
    /// this image's pending one.
    fn take_pending(&mut self, c: &Commit) -> Result<Pending> {
        match self.commit.pending.take() {
            Some(p) if p.id == c.id && Arc::ptr_eq(&p.gate, &c.gate) => Ok(p),
            other => {
                self.commit.pending = other;
                Err(Error::CommitNotPending {
                    path: self.path.clone(),
                })
            }
        }
    }

    /// See [`crate::LiveImage::finish_commit`].
    pub(crate) fn finish_commit(&mut self, c: Commit) -> Result<()> {
        let p = self.take_pending(&c)?;
        let progress = *progress(&p.gate);
        if progress == Progress::Written {
            self.publish(p);
            Ok(())
        } else {
            self.restore(p);
            Err(Error::CommitUnwritten {
                path: self.path.clone(),
            })
        }
    }

    /// See [`crate::LiveImage::abort_commit`].
    pub(crate) fn abort_commit(&mut self, c: Commit) -> Result<()> {
        let p = self.take_pending(&c)?;
        let progress = *progress(&p.gate);
        if progress == Progress::Written {
            self.publish(p);
        } else {
            self.restore(p);
        }
        Ok(())
    }

    /// Settles a commit whose [`Commit`] was not handed back (the image is
    /// closing): published if it was written, else cancelled, so that the
    /// handle can no longer write a header, and undone.
    pub(crate) fn settle_pending(&mut self) {
        let Some(p) = self.commit.pending.take() else {
            return;
        };
        let written = {
            let mut progress = progress(&p.gate);
            if *progress != Progress::Written {
                *progress = Progress::Cancelled;
            }
            *progress == Progress::Written
        };
        if written {
            self.publish(p);
        } else {
            self.restore(p);
        }
    }

    fn publish(&mut self, p: Pending) {
        for w in &p.written {
            match w.of {
                SlotOf::Segment(i) => self.meta.segments[i].cur_slot = Some(w.slot),
                SlotOf::Layer(i) => self.meta.layers[i].cur_slot = Some(w.slot),
            }
            self.commit.slot_ends.synced(w.at, w.end);
        }
        if let Some((h, hslot, hat, hend)) = p.header {
            self.commit.slot_ends.synced(hat, hend);
            self.header.slot = hslot;
            self.header.committed_gen = h.generation;
            // The staged header keeps what changed since begin; the
            // counters are the staged state's (as the next commit will
            // write them), the end of the file the committed one.
            self.header.staged.generation = h.generation;
            self.header.staged.cluster_count = h.cluster_count;
            self.header.staged.data_cluster_count = self.meta.entries.len() as u64;
            self.header.staged.layer_count = self.meta.layers.len() as u32;
            self.header.staged.snapshot_count = self.meta.snapshot_count() as u32;
        }
    }

    fn restore(&mut self, p: Pending) {
        for w in &p.written {
            match w.of {
                SlotOf::Segment(i) => self.meta.segments[i].dirty = true,
                SlotOf::Layer(i) => self.meta.layers[i].dirty = true,
            }
        }
        self.commit.data_dirty |= p.had_data;
        self.commit.meta_dirty |= p.had_meta;
    }

    /// See [`crate::LiveImage::commit_pending`].
    pub(crate) fn commit_pending(&self) -> bool {
        self.commit
            .pending
            .as_ref()
            .is_some_and(|p| !p.handle_dropped())
    }

    /// Generation of the last committed barrier.
    pub fn generation(&self) -> u64 {
        self.header.committed_gen
    }
}
