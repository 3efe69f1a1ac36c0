//! What a device that maps the image needs, behind a type of its own
//! ([`LiveImage`]): the active layer's clusters allocated and completed for
//! shared mapping, pages recorded after the guest wrote them through the
//! mapping, the chain's files, the pool a worker keeps filled, and the
//! staged commit (so the device syncs without its lock).

use std::fs::File;
use std::path::PathBuf;

use crate::alloc::Space;
use crate::chain::Backing;
use crate::commit::Commit;
use crate::error::{io_err, Error, Result};
use crate::format::PAGE_SIZE;
use crate::image::Image;
use crate::meta::SnapshotInfo;

impl Image {
    /// See [`LiveImage::set_pool_clusters`].
    pub(crate) fn set_pool_clusters(&mut self, n: u64) {
        self.alloc.pool_clusters = n.max(1);
    }

    /// See [`LiveImage::set_inline_growth`].
    pub(crate) fn set_inline_growth(&mut self, n: u64) {
        self.alloc.inline_clusters = Some(n.max(1));
    }

    /// See [`LiveImage::fill_pool`].
    pub(crate) fn fill_pool(&mut self) -> Result<u64> {
        if !self.access.writable {
            return Err(Error::ReadOnly {
                path: self.path.clone(),
            });
        }
        self.alloc
            .fill(self.storage.as_mut(), self.g)
            .map_err(io_err(&self.path, "allocating clusters"))
    }

    /// See [`LiveImage::pool_shortfall`].
    pub(crate) fn pool_shortfall(&self) -> Option<(u64, u64)> {
        self.alloc
            .shortfall(self.g)
            .filter(|_| self.access.writable)
    }

    /// See [`LiveImage::data_clusters_within`].
    pub(crate) fn data_clusters_within(&self, clusters: u64) -> u64 {
        let cap = self.g.capacity();
        let open = self.open_segment_room(self.header.staged.active_layer);
        if clusters <= open {
            return clusters;
        }
        // Every new segment is a meta cluster, then up to `cap` entries.
        let rest = clusters - open;
        open + rest - rest.div_ceil(u64::from(cap) + 1)
    }

    /// See [`LiveImage::pool_reserved`].
    pub(crate) fn pool_reserved(&mut self, offset: u64, len: u64) -> bool {
        self.alloc.reserved(self.g, offset, len)
    }

    /// See [`LiveImage::active_cluster`].
    pub(crate) fn active_cluster(&mut self, vcn: u64) -> Result<ActiveCluster> {
        self.active_cluster_as(vcn, Space::Reserved)
    }

    /// See [`LiveImage::active_cluster_written`].
    pub(crate) fn active_cluster_written(&mut self, vcn: u64) -> Result<ActiveCluster> {
        self.active_cluster_as(vcn, Space::Written)
    }

    pub(crate) fn active_cluster_as(&mut self, vcn: u64, space: Space) -> Result<ActiveCluster> {
        if !self.access.writable {
            return Err(Error::ReadOnly {
                path: self.path.clone(),
            });
        }
        let cs = self.g.cluster_size();
        if vcn >= self.header.staged.virtual_size / cs {
            return Err(Error::OutOfRange {
                path: self.path.clone(),
                offset: vcn.saturating_mul(cs),
                len: cs,
                size: self.header.staged.virtual_size,
            });
        }
        let layer = self.header.staged.active_layer;
        let (e, fresh) = match self.meta.layers[layer as usize].map.get(&vcn) {
            Some(&e) => (e, false),
            None => {
                let mut bm = vec![0u64; self.g.words()];
                if !self.view_has_data(self.meta.layers[layer as usize].parent, vcn * cs, cs) {
                    self.g.full_bitmap(&mut bm);
                }
                (self.alloc_entry_as(layer, vcn, &bm, space)?, true)
            }
        };
        let pages = self.g.pages();
        Ok(ActiveCluster {
            file_offset: self.g.offset(self.meta.entries[e as usize].cluster),
            fresh,
            whole: self.meta.full(e, pages),
        })
    }

    /// See [`LiveImage::record_pages`].
    pub(crate) fn record_pages(&mut self, vcn: u64, first: usize, count: usize) -> Result<()> {
        let layer = self.header.staged.active_layer as usize;
        let e = *self.meta.layers[layer].map.get(&vcn).ok_or_else(|| {
            Error::Invalid(format!("vcn {vcn} has no cluster in the active layer"))
        })?;
        if count == 0
            || first
                .checked_add(count)
                .is_none_or(|end| end > self.g.pages())
        {
            return Err(Error::Invalid(format!(
                "pages {first}+{count} outside a cluster of {} pages",
                self.g.pages()
            )));
        }
        self.set_bits(e, first, first + count - 1);
        self.commit.data_dirty = true;
        Ok(())
    }

    /// See [`LiveImage::mark_data_written`].
    pub(crate) fn mark_data_written(&mut self) {
        self.commit.data_dirty = true;
    }

    /// See [`LiveImage::chain_files`].
    pub(crate) fn chain_files(&self) -> Vec<&File> {
        let mut files: Vec<&File> = self.storage.file().into_iter().collect();
        let mut cur = self.base.as_deref();
        while let Some(b) = cur {
            match b {
                Backing::Pcow(i) => {
                    files.extend(i.storage.file());
                    cur = i.base.as_deref();
                }
                Backing::Raw(r) => {
                    files.push(r.file());
                    cur = None;
                }
            }
        }
        files
    }

    /// The paths of the chain, by depth (as [`crate::LiveImage::chain_files`]).
    pub fn chain_paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.path.clone()];
        let mut cur = self.base.as_deref();
        while let Some(b) = cur {
            paths.push(b.path().to_owned());
            cur = match b {
                Backing::Pcow(i) => i.base.as_deref(),
                Backing::Raw(_) => None,
            };
        }
        paths
    }

    /// Byte offset in the top file of the active layer's cluster for
    /// `vcn`, if the active layer has one.
    pub fn active_offset(&self, vcn: u64) -> Option<u64> {
        let e = *self.meta.layers[self.header.staged.active_layer as usize]
            .map
            .get(&vcn)?;
        Some(self.g.offset(self.meta.entries[e as usize].cluster))
    }

    /// See [`LiveImage::complete_active_clusters`].
    pub(crate) fn complete_active_clusters(&mut self) -> Result<u64> {
        if !self.access.writable {
            return Err(Error::ReadOnly {
                path: self.path.clone(),
            });
        }
        let active = self.header.staged.active_layer;
        let parent = self.meta.layers[active as usize].parent;
        let pages = self.g.pages();
        // In file order, segment by segment: the bitmaps are read in the
        // order they lie in memory, where the layer's map would visit them
        // in the order of their vcns (a cache miss per entry of an image
        // written in scattered order).
        let map = &self.meta.layers[active as usize].map;
        let mut partial: Vec<(u64, u32)> = Vec::new();
        for seg in self.meta.segments.iter().filter(|s| s.layer == active) {
            for e in seg.first..seg.first + seg.used {
                let vcn = self.meta.entries[e as usize].vcn;
                if !self.meta.full(e, pages) && map.get(&vcn) == Some(&e) {
                    partial.push((vcn, e));
                }
            }
        }
        partial.sort_unstable();
        let cs = self.g.cluster_size();
        let mut page = vec![0u8; PAGE_SIZE as usize];
        for &(vcn, e) in &partial {
            let base = self.g.offset(self.meta.entries[e as usize].cluster);
            let missing: Vec<usize> = (0..pages).filter(|&p| !self.meta.bit(e, p)).collect();
            for p in missing {
                let off = p as u64 * PAGE_SIZE;
                self.read_view(parent, &mut page, vcn * cs + off)?;
                self.storage
                    .write_at(&page, base + off)
                    .map_err(io_err(&self.path, "writing data"))?;
            }
            self.set_bits(e, 0, pages - 1);
            self.commit.data_dirty = true;
        }
        Ok(partial.len() as u64)
    }
}

/// An image a device maps and writes through the mapping: the methods
/// only such a device needs (clusters allocated for mapping, pages
/// recorded after the guest wrote them, the pool a worker keeps filled,
/// the chain's files, the staged commit), over an [`Image`] opened
/// read-write. Queries go to the image through `Deref`; the image's own
/// changes that a device makes (barriers, snapshots) are forwarded.
pub struct LiveImage {
    image: Image,
}

impl std::fmt::Debug for LiveImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LiveImage").field(&self.image).finish()
    }
}

impl std::ops::Deref for LiveImage {
    type Target = Image;
    fn deref(&self) -> &Image {
        &self.image
    }
}

impl LiveImage {
    /// Takes an image opened for writing (a deferred writer is started);
    /// [`Error::ReadOnly`] for a read-only one.
    pub fn new(mut image: Image) -> Result<LiveImage> {
        image.begin_writing()?;
        Ok(LiveImage { image })
    }

    /// The image, no longer live (to close it, or to use it otherwise).
    pub fn into_image(self) -> Image {
        self.image
    }

    /// Renames the image's file within its directory
    /// ([`Image::rename_in_dir`]).
    pub fn rename_in_dir(&mut self, to: &std::path::Path) -> Result<()> {
        self.image.rename_in_dir(to)
    }

    /// Closes the image ([`Image::close`]).
    pub fn close(self) -> Result<()> {
        self.image.close()
    }

    /// [`Image::flush`].
    pub fn flush(&mut self) -> Result<()> {
        self.image.flush()
    }

    /// [`Image::snapshot_create`].
    pub fn snapshot_create(&mut self, tag: &str) -> Result<SnapshotInfo> {
        self.image.snapshot_create(tag)
    }

    /// [`Image::snapshot_delete`].
    pub fn snapshot_delete(&mut self, snap: &str) -> Result<SnapshotInfo> {
        self.image.snapshot_delete(snap)
    }

    /// Sets how many clusters the writer pre-allocates ahead.
    pub fn set_pool_clusters(&mut self, n: u64) {
        self.image.set_pool_clusters(n)
    }

    /// Sets how many clusters an allocation that finds the pool empty
    /// reserves beyond what it needs (default, and at most: the pool's
    /// size). A device whose worker refills the pool keeps this small, so
    /// that the write fault that ran the pool dry reserves a little and the
    /// worker the rest.
    pub fn set_inline_growth(&mut self, n: u64) {
        self.image.set_inline_growth(n)
    }

    /// Grows the pre-allocated pool to its full size now, so that later
    /// allocations (a device's write faults) do not have to. Returns the
    /// clusters added to the file.
    pub fn fill_pool(&mut self) -> Result<u64> {
        self.image.fill_pool()
    }

    /// For a pre-allocation worker: the byte range `(offset, len)` of the
    /// image file to reserve (fallocate) so that the pool holds its full
    /// size again, or `None` when it does.
    pub fn pool_shortfall(&self) -> Option<(u64, u64)> {
        self.image.pool_shortfall()
    }

    /// How many data clusters of the active layer can be allocated from
    /// `clusters` clusters of the file, counting the metadata cluster each
    /// new segment takes first.
    pub fn data_clusters_within(&self, clusters: u64) -> u64 {
        self.image.data_clusters_within(clusters)
    }

    /// Records that a worker reserved `[offset, offset + len)` of the image
    /// file. Only a range that continues the file exactly is taken (an
    /// allocation may have grown the file itself meanwhile); returns
    /// whether it was.
    pub fn pool_reserved(&mut self, offset: u64, len: u64) -> bool {
        self.image.pool_reserved(offset, len)
    }

    /// The active layer's data cluster for `vcn`, allocated from the pool if
    /// it has none yet: for a device that writes guest data through a
    /// mapping of the file rather than through [`Image::write_at`].
    pub fn active_cluster(&mut self, vcn: u64) -> Result<ActiveCluster> {
        self.image.active_cluster(vcn)
    }

    /// [`LiveImage::active_cluster`] for a caller that writes (`pwrite`) every
    /// page of the cluster before it maps it, if it ever does: a new
    /// cluster still takes the pool's next reserved cluster, but when the
    /// pool is empty the file only grows (sparse) to hold it, and its
    /// space is allocated by the writes that fill it. A device's barrier
    /// copying a few pages into a cluster allocates those pages, not the
    /// whole cluster (on tmpfs, 2 MiB of memory for a 4 KiB page).
    ///
    /// A cluster mapped shared before its pages are written needs
    /// [`LiveImage::active_cluster`]: a write through a mapping into space the
    /// file system cannot allocate is a SIGBUS, not an error.
    pub fn active_cluster_written(&mut self, vcn: u64) -> Result<ActiveCluster> {
        self.image.active_cluster_written(vcn)
    }

    /// Records that pages `[first, first + count)` of the active layer's
    /// cluster `vcn` now hold this layer's data (the 4 KiB copy-on-write).
    /// The data must already be in the cluster; both become durable at the
    /// next barrier, data first.
    pub fn record_pages(&mut self, vcn: u64, first: usize, count: usize) -> Result<()> {
        self.image.record_pages(vcn, first, count)
    }

    /// Tells the next barrier that data reached the file through a mapping,
    /// so it must sync before committing metadata.
    pub fn mark_data_written(&mut self) {
        self.image.mark_data_written()
    }

    /// The files of the chain, by depth: 0 is this image, 1 its base, ...
    /// (what a device maps; the depth is the one [`crate::ClusterSource`] names).
    pub fn chain_files(&self) -> Vec<&File> {
        self.image.chain_files()
    }

    /// Makes every cluster of the active layer whole: pages it does not
    /// hold are copied from the view below and recorded, so that a device
    /// can map each active cluster shared as one piece. The view does not
    /// change; durable at the next barrier. Returns the clusters completed.
    pub fn complete_active_clusters(&mut self) -> Result<u64> {
        self.image.complete_active_clusters()
    }

    /// Stages a commit of everything written so far, without any I/O:
    /// encodes each dirty segment's and layer's slot for its other slot
    /// and the next generation's header from the state as it is now (the
    /// [`Commit`] writes them), and clears the dirty marks this covers. `None` when there is
    /// nothing to make durable (or the image is not writing). Changes made
    /// before the commit is finished or aborted belong to the next one.
    /// Refused while another commit is pending.
    pub fn begin_commit(&mut self) -> Result<Option<Commit>> {
        self.image.begin_commit()
    }

    /// Publishes a written commit: its slots and header become the current
    /// ones. Marks set again since [`LiveImage::begin_commit`] stay set. A
    /// commit that was not written is aborted instead
    /// ([`Error::CommitUnwritten`]).
    pub fn finish_commit(&mut self, c: Commit) -> Result<()> {
        self.image.finish_commit(c)
    }

    /// Gives up a commit: nothing of it is committed and everything it
    /// covered is dirty again, for a later commit to rewrite. A commit
    /// already written is durable in the file, so it is published instead:
    /// forgetting it would let the next commit overwrite slots its header
    /// names.
    pub fn abort_commit(&mut self, c: Commit) -> Result<()> {
        self.image.abort_commit(c)
    }

    /// Whether a commit is pending: begun, not yet finished or aborted,
    /// and its [`Commit`] still held (a commit whose handle was dropped is
    /// settled by the next metadata change: published if it was written,
    /// else undone).
    pub fn commit_pending(&self) -> bool {
        self.image.commit_pending()
    }
}

/// The active layer's cluster for a virtual cluster, as a device sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActiveCluster {
    /// Byte offset of the cluster in the image file.
    pub file_offset: u64,
    /// The cluster was allocated by this call.
    pub fresh: bool,
    /// Every page belongs to the active layer (nothing below had data, or
    /// every page was recorded): it can be mapped shared as a whole.
    pub whole: bool,
}
