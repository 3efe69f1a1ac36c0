//! Changing an image's content: writes with the 4 KiB copy-on-write fill,
//! whole clusters placed by compact, growing the virtual size, emptying
//! it.

use crate::error::{io_err, Error, Result};
use crate::format::PAGE_SIZE;
use crate::image::{check_virtual_size, Image};

impl Image {
    /// Sets pages `first..=last` of entry `e`: its segment and the
    /// metadata are dirty.
    pub(crate) fn set_bits(&mut self, e: u32, first: usize, last: usize) {
        self.meta.set_bits(e, first, last);
        self.commit.meta_dirty = true;
    }

    /// Writes into the active layer. Durable at the next [`Image::flush`].
    pub fn write_at(&mut self, data: &[u8], offset: u64) -> Result<()> {
        self.require_writer()?;
        self.check_range(offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        self.begin_writing()?;
        self.write_layer(self.header.staged.active_layer, data, offset)
    }

    /// Writes into `layer`; pages not fully covered are first filled from
    /// the view below it (the 4 KiB copy-on-write).
    pub(crate) fn write_layer(&mut self, layer: u32, data: &[u8], offset: u64) -> Result<()> {
        let cs = self.g.cluster_size();
        let parent = self.meta.layers[layer as usize].parent;
        let mut done = 0usize;
        while done < data.len() {
            let off = offset + done as u64;
            let vcn = off / cs;
            let start = off % cs;
            let len = ((cs - start) as usize).min(data.len() - done);
            let chunk = &data[done..done + len];
            let e = match self.meta.layers[layer as usize].map.get(&vcn) {
                Some(&e) => e,
                None => {
                    let mut bm = vec![0u64; self.g.words()];
                    if !self.view_has_data(parent, vcn * cs, cs) {
                        // Nothing below: the fresh (zero) cluster is the
                        // whole truth.
                        self.g.full_bitmap(&mut bm);
                    }
                    self.alloc_entry(layer, vcn, &bm)?
                }
            };
            let base = self.g.offset(self.meta.entries[e as usize].cluster);
            let first = (start / PAGE_SIZE) as usize;
            let last = ((start + len as u64 - 1) / PAGE_SIZE) as usize;
            let mut lo = start; // first byte of the chunk still to write
            let mut hi = start + len as u64; // end of the chunk still to write
            let page_of = |p: usize| p as u64 * PAGE_SIZE;
            let covers = |p: usize, lo: u64, hi: u64| lo <= page_of(p) && hi >= page_of(p + 1);
            if !self.meta.bit(e, first) && !covers(first, lo, hi) {
                let p_end = page_of(first + 1).min(hi);
                self.fill_page(
                    parent,
                    vcn,
                    first,
                    base,
                    &chunk[..(p_end - start) as usize],
                    start,
                )?;
                lo = p_end;
            }
            if lo < hi && last != first && !self.meta.bit(e, last) && !covers(last, lo, hi) {
                let p_start = page_of(last);
                self.fill_page(
                    parent,
                    vcn,
                    last,
                    base,
                    &chunk[(p_start - start) as usize..],
                    p_start,
                )?;
                hi = p_start;
            }
            if lo < hi {
                let part = &chunk[(lo - start) as usize..(hi - start) as usize];
                self.storage
                    .write_at(part, base + lo)
                    .map_err(io_err(&self.path, "writing data"))?;
            }
            self.set_bits(e, first, last);
            self.commit.data_dirty = true;
            done += len;
        }
        Ok(())
    }

    /// Writes page `page` of a cluster at file offset `base`: the view of
    /// `below` with `part` laid over it at in-cluster offset `at`.
    fn fill_page(
        &mut self,
        below: Option<u32>,
        vcn: u64,
        page: usize,
        base: u64,
        part: &[u8],
        at: u64,
    ) -> Result<()> {
        let page_off = page as u64 * PAGE_SIZE;
        let mut buf = vec![0u8; PAGE_SIZE as usize];
        self.read_view(below, &mut buf, vcn * self.g.cluster_size() + page_off)?;
        let o = (at - page_off) as usize;
        buf[o..o + part.len()].copy_from_slice(part);
        self.storage
            .write_at(&buf, base + page_off)
            .map_err(io_err(&self.path, "writing data"))
    }

    /// Drops every layer, snapshot and data cluster: the image becomes
    /// empty over its base. Committed at once; the old clusters become
    /// uncommitted space, truncated at close.
    pub(crate) fn reset_empty(&mut self) -> Result<()> {
        self.require_no_commit()?;
        self.meta.layers.truncate(1);
        let root = &mut self.meta.layers[0];
        root.map.clear();
        root.snap = None;
        self.meta.segments.clear();
        self.meta.entries.clear();
        self.meta.bitmaps.clear();
        self.alloc.next_cluster = 1;
        self.header.staged.active_layer = 0;
        self.commit.meta_dirty = true;
        self.flush()
    }

    /// Places a whole cluster's bytes for `(layer, vcn)` with exactly
    /// `bitmap` (compact copies layers this way, bit for bit).
    pub(crate) fn put_cluster(
        &mut self,
        layer: u32,
        vcn: u64,
        bitmap: &[u64],
        data: &[u8],
    ) -> Result<()> {
        let e = self.alloc_entry(layer, vcn, bitmap)?;
        let off = self.g.offset(self.meta.entries[e as usize].cluster);
        self.storage
            .write_at(data, off)
            .map_err(io_err(&self.path, "writing data"))?;
        self.commit.data_dirty = true;
        Ok(())
    }

    /// Grows the virtual size.
    pub fn grow(&mut self, new_size: u64) -> Result<()> {
        self.require_writer()?;
        self.require_no_commit()?;
        check_virtual_size(new_size, self.g)?;
        if new_size < self.header.staged.virtual_size {
            return Err(Error::Invalid(format!(
                "shrinking from {} to {new_size} bytes is not supported",
                self.header.staged.virtual_size
            )));
        }
        self.begin_writing()?;
        let old_size = self.header.staged.virtual_size;
        self.header.staged.virtual_size = new_size;
        self.commit.meta_dirty = true;
        // The new range reads as zeros in every view, as qemu does, even
        // where a longer base has data: layer 0 (below every view) gets zero
        // pages there, committed by the same barrier as the new size. Should
        // a write fail, the size stays staged so that the entries written so
        // far stay inside it.
        // Only the clusters where the base stores data are visited, not the
        // whole new range (which may be most of 2^56 bytes).
        let cs = self.g.cluster_size();
        let held: Vec<(u64, u64)> = match self.base.as_deref() {
            Some(b) => b
                .view_extents(&[(old_size, new_size)], 1)
                .into_iter()
                .filter(|e| e.file_offset.is_some())
                .map(|e| (e.offset, e.offset + e.length))
                .collect(),
            None => Vec::new(),
        };
        if !held.is_empty() {
            let zeros = vec![0u8; cs as usize];
            let mut next = old_size / cs;
            for (s, e) in held {
                for vcn in (s / cs).max(next)..e.div_ceil(cs) {
                    self.write_layer(0, &zeros, vcn * cs)?;
                    next = vcn + 1;
                }
            }
        }
        self.flush()
    }
}
