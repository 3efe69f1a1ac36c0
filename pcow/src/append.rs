//! Appending to the file: data clusters (a new segment when the last one
//! is full or of another layer), snapshot clusters starting layers, and
//! preallocation of a whole image; the space comes from [`crate::alloc`].

use crate::alloc::{Preallocation, Space};
use crate::error::{io_err, Error, Result};
use crate::image::Image;
use crate::meta::{Entry, Layer, Segment, SnapshotInfo, VcnMap};

impl Image {
    /// Makes sure clusters up to `end` exist in the file, growing it by the
    /// pool size at a time.
    pub(crate) fn ensure_space(&mut self, end: u64) -> Result<()> {
        self.ensure_space_as(end, Space::Reserved)
    }

    /// [`Image::ensure_space`], growing the file as `space` says.
    pub(crate) fn ensure_space_as(&mut self, end: u64, space: Space) -> Result<()> {
        self.alloc
            .ensure(self.storage.as_mut(), self.g, end, space)
            .map_err(io_err(&self.path, "allocating clusters"))
    }

    fn check_cluster_limit(&self, extra: u64) -> Result<()> {
        if !self.alloc.has_room(self.g, extra) {
            return Err(Error::Limit {
                path: self.path.clone(),
                what: "file too large (at most 2^62 bytes and 2^32 clusters)".into(),
            });
        }
        Ok(())
    }

    /// Appends a data cluster for `(layer, vcn)` with `bitmap`; a new
    /// segment starts unless the last structure is a segment of `layer`
    /// with room.
    pub(crate) fn alloc_entry(&mut self, layer: u32, vcn: u64, bitmap: &[u64]) -> Result<u32> {
        self.alloc_entry_as(layer, vcn, bitmap, Space::Reserved)
    }

    /// Entries the last segment still takes for `layer` without a new
    /// segment: it must be `layer`'s, have room, and end where the next
    /// cluster goes (its entries' clusters follow its meta cluster).
    pub(crate) fn open_segment_room(&self, layer: u32) -> u64 {
        let cap = self.g.capacity();
        self.meta
            .segments
            .last()
            .filter(|s| {
                s.layer == layer
                    && s.used < cap
                    && s.meta + 1 + u64::from(s.used) == self.alloc.next_cluster
            })
            .map_or(0, |s| u64::from(cap - s.used))
    }

    /// [`Image::alloc_entry`], the file grown as `space` says.
    pub(crate) fn alloc_entry_as(
        &mut self,
        layer: u32,
        vcn: u64,
        bitmap: &[u64],
        space: Space,
    ) -> Result<u32> {
        let extend = self.open_segment_room(layer) > 0;
        let need = if extend { 1 } else { 2 };
        self.check_cluster_limit(need)?;
        self.ensure_space_as(self.alloc.next_cluster + need, space)?;
        if !extend {
            self.commit
                .slot_ends
                .forget_cluster(self.g.offset(self.alloc.next_cluster), self.g.slot_size());
            self.meta.segments.push(Segment {
                meta: self.alloc.next_cluster,
                layer,
                first: self.meta.entries.len() as u32,
                used: 0,
                cur_slot: None,
                dirty: true,
            });
            self.alloc.next_cluster += 1;
        }
        let seg_idx = self.meta.segments.len() - 1;
        let idx = self.meta.entries.len() as u32;
        self.meta.entries.push(Entry {
            vcn,
            cluster: self.alloc.next_cluster,
            seg: seg_idx as u32,
        });
        self.meta.bitmaps.extend_from_slice(bitmap);
        let seg = &mut self.meta.segments[seg_idx];
        seg.used += 1;
        seg.dirty = true;
        self.alloc.next_cluster += 1;
        self.meta.layers[layer as usize].map.insert(vcn, idx);
        self.header.staged.data_cluster_count = self.meta.entries.len() as u64;
        self.commit.meta_dirty = true;
        Ok(idx)
    }

    /// Refuses a new layer past the format's limits (checked before a
    /// snapshot operation writes anything).
    pub(crate) fn check_layer_room(&self) -> Result<()> {
        if self.meta.layers.len() as u64 >= u64::from(crate::format::MAX_LAYERS) {
            return Err(Error::Limit {
                path: self.path.clone(),
                what: format!(
                    "at most {} layers per image (run compact)",
                    crate::format::MAX_LAYERS
                ),
            });
        }
        self.check_cluster_limit(1)
    }

    /// Appends a snapshot cluster starting a layer on `parent`.
    pub(crate) fn append_layer(&mut self, parent: u32, snap: Option<SnapshotInfo>) -> Result<u32> {
        self.check_layer_room()?;
        let n = self.meta.layers.len() as u32;
        self.ensure_space(self.alloc.next_cluster + 1)?;
        self.commit
            .slot_ends
            .forget_cluster(self.g.offset(self.alloc.next_cluster), self.g.slot_size());
        self.meta.layers.push(Layer {
            start: self.alloc.next_cluster,
            parent: Some(parent),
            snap,
            map: VcnMap::default(),
            cur_slot: None,
            dirty: true,
        });
        self.alloc.next_cluster += 1;
        self.header.staged.layer_count = n + 1;
        self.commit.meta_dirty = true;
        Ok(n)
    }

    /// Allocates a cluster of the active layer for every virtual cluster
    /// that reads as zeros through the whole chain (qemu-img's
    /// `preallocation=`): a device then maps the whole image shared, and the
    /// guest's first writes take no fault. Clusters with data below (a
    /// base, an older snapshot) are left to copy-on-write. `Falloc`
    /// reserves the space in one `fallocate`; `Full` also writes the zeros.
    /// Durable on return; returns the clusters allocated.
    pub fn preallocate(&mut self, mode: Preallocation) -> Result<u64> {
        if mode == Preallocation::Off {
            return Ok(0);
        }
        self.require_no_commit()?;
        self.begin_writing()?;
        let layer = self.header.staged.active_layer;
        let cs = self.g.cluster_size();
        let parent = self.meta.layers[layer as usize].parent;
        let missing: Vec<u64> = (0..self.header.staged.virtual_size / cs)
            .filter(|&v| {
                !self.meta.layers[layer as usize].map.contains_key(&v)
                    && !self.view_has_data(parent, v * cs, cs)
            })
            .collect();
        if missing.is_empty() {
            return Ok(0);
        }
        // One reservation for all of them and their meta clusters.
        let metas = missing.len() as u64 / u64::from(self.g.capacity()) + 2;
        let saved = (self.alloc.pool_clusters, self.alloc.inline_clusters.take());
        self.alloc.pool_clusters = missing.len() as u64 + metas;
        let zeros = vec![0u8; cs as usize];
        let result = (|| {
            for &vcn in &missing {
                let ac = self.active_cluster_as(vcn, Space::Reserved)?;
                if mode == Preallocation::Full {
                    self.storage
                        .write_at(&zeros, ac.file_offset)
                        .map_err(io_err(&self.path, "writing zeros"))?;
                    self.commit.data_dirty = true;
                }
            }
            Ok(())
        })();
        (self.alloc.pool_clusters, self.alloc.inline_clusters) = saved;
        result?;
        self.flush()?;
        Ok(missing.len() as u64)
    }
}
