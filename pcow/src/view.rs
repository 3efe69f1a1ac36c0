//! Reading an image's views: the source of each page through the layers
//! and the base chain, reads, extents, and where a cluster's pages live
//! for a device that maps them.

use crate::chain::Backing;
use crate::error::{io_err, Result};
use crate::extent::{merge_extents, push_extent, Extent};
use crate::format::PAGE_SIZE;
use crate::image::Image;
use crate::meta::PageSrc;

impl Image {
    /// The source of page `page` of cluster `vcn` in the view of `layer`
    /// (`None`: the view below layer 0, the base).
    pub(crate) fn page_src(&self, layer: Option<u32>, vcn: u64, page: usize) -> PageSrc {
        self.meta.page_src(layer, vcn, page, self.base.is_some())
    }

    /// Whether anything in the view of `layer` (or below it) holds data in
    /// the byte range `[off, off + len)`.
    pub(crate) fn view_has_data(&self, layer: Option<u32>, off: u64, len: u64) -> bool {
        let cs = self.g.cluster_size();
        let (first, last) = (off / cs, (off + len - 1) / cs);
        // Whichever is shorter: the clusters of the range, or the entries
        // of the layers (a range of the whole 2^56-byte view has 2^44
        // clusters, an image a few entries).
        let held: usize = self
            .meta
            .path_of(layer)
            .map(|l| self.meta.layers[l as usize].map.len())
            .sum();
        let holds = if last - first < held as u64 {
            (first..=last).any(|vcn| self.meta.view_holds(layer, vcn))
        } else {
            self.meta.path_of(layer).any(|l| {
                self.meta.layers[l as usize]
                    .map
                    .keys()
                    .any(|v| (first..=last).contains(&v))
            })
        };
        if holds {
            return true;
        }
        self.base.as_ref().is_some_and(|b| b.has_data(off, len))
    }

    /// Reads the image's content (the active layer's view).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check_range(offset, buf.len())?;
        self.read_view(Some(self.header.staged.active_layer), buf, offset)
    }

    /// Reads the view of `layer` (`None`: the base below layer 0). Bytes past
    /// the virtual size read as zeros (a larger overlay reading its base).
    pub(crate) fn read_view(&self, layer: Option<u32>, buf: &mut [u8], offset: u64) -> Result<()> {
        let vs = self.header.staged.virtual_size;
        let cs = self.g.cluster_size();
        let mut done = 0usize;
        // A run of pages with the same kind of source and contiguous file
        // offsets is read with one call.
        let mut run: Option<(PageSrc, usize, u64)> = None; // (src, buf start, file offset)
        while done < buf.len() {
            let off = offset + done as u64;
            if off >= vs {
                self.flush_run(&mut run, buf, done, offset)?;
                buf[done..].fill(0);
                return Ok(());
            }
            let vcn = off / cs;
            let in_cluster = off % cs;
            let page = (in_cluster / PAGE_SIZE) as usize;
            let n = ((PAGE_SIZE - in_cluster % PAGE_SIZE) as usize).min(buf.len() - done);
            let src = self.page_src(layer, vcn, page);
            let file_off = match src {
                PageSrc::Local(c) => self.g.offset(c) + in_cluster,
                _ => 0,
            };
            let extends = match (&run, src) {
                (Some((PageSrc::Local(_), s, fo)), PageSrc::Local(_)) => {
                    fo + (done - s) as u64 == file_off
                }
                (Some((PageSrc::Base, _, _)), PageSrc::Base)
                | (Some((PageSrc::Zero, _, _)), PageSrc::Zero) => true,
                _ => false,
            };
            if !extends {
                self.flush_run(&mut run, buf, done, offset)?;
                run = Some((src, done, file_off));
            }
            done += n;
        }
        self.flush_run(&mut run, buf, done, offset)
    }

    fn flush_run(
        &self,
        run: &mut Option<(PageSrc, usize, u64)>,
        buf: &mut [u8],
        end: usize,
        offset: u64,
    ) -> Result<()> {
        let Some((src, start, file_off)) = run.take() else {
            return Ok(());
        };
        let dst = &mut buf[start..end];
        match src {
            PageSrc::Local(_) => self
                .storage
                .read_at(dst, file_off)
                .map_err(io_err(&self.path, "reading data"))?,
            PageSrc::Base => match &self.base {
                Some(b) => b.read_at(dst, offset + start as u64)?,
                None => dst.fill(0),
            },
            PageSrc::Zero => dst.fill(0),
        }
        Ok(())
    }

    /// Where each 4 KiB page of virtual cluster `vcn` of the image's view
    /// lives, in the chain's files (see [`crate::LiveImage::chain_files`]).
    pub fn cluster_source(&self, vcn: u64) -> ClusterSource {
        let active = self.header.staged.active_layer;
        if let Some(&e) = self.meta.layers[active as usize].map.get(&vcn) {
            if self.meta.full(e, self.g.pages()) {
                return ClusterSource::Active {
                    offset: self.g.offset(self.meta.entries[e as usize].cluster),
                };
            }
        }
        // No layer of this file holds a page of it: the cluster as the
        // base has it, whole, without a walk (and a vector) per page. A
        // device's open asks for every cluster, most of them holes in a
        // thin image: 16 page lookups each at 64 KiB clusters.
        if !self.meta.view_holds(Some(active), vcn) {
            if let Some(whole) = self.below_whole(vcn, self.g.cluster_size(), 1) {
                return whole;
            }
        }
        self.cluster_source_by_pages(vcn)
    }

    /// [`Image::cluster_source`] of every cluster in `vcns`, in order,
    /// handed to `f`. On an image whose clusters lie scattered over its
    /// file, asking each cluster's entry and bitmap costs a cache miss or
    /// two per cluster (they lie in the order of the file, not of the
    /// vcns: at 10^6 clusters, most of a device's open). So the data
    /// cluster of every whole entry is first gathered into a table in
    /// entry order, one pass over the entries and bitmaps as they lie, a
    /// sixth of the entries' size; a cluster of the active layer is then
    /// answered from the layer's map and that table, both small enough to
    /// stay in the cache. Anything else takes [`Image::cluster_source`].
    pub fn cluster_sources(
        &self,
        vcns: std::ops::Range<u64>,
        mut f: impl FnMut(u64, ClusterSource),
    ) {
        let map = &self.meta.layers[self.header.staged.active_layer as usize].map;
        let pages = self.g.pages();
        // The data cluster of each whole entry; NOT_WHOLE for a partial
        // one (and for a cluster number the table cannot hold).
        const NOT_WHOLE: u32 = u32::MAX;
        let whole: Vec<u32> = (0..self.meta.entries.len())
            .map(|e| {
                let cluster = self.meta.entries[e].cluster;
                match u32::try_from(cluster) {
                    Ok(c) if c != NOT_WHOLE && self.meta.full(e as u32, pages) => c,
                    _ => NOT_WHOLE,
                }
            })
            .collect();
        // In batches: the table's slots for a batch are looked up in a
        // loop of their own, so that their misses (the table is larger
        // than a core's cache at 10^6 entries) overlap instead of each
        // waiting behind `f`'s work for the cluster before.
        const BATCH: usize = 64;
        let mut found = [NOT_WHOLE; BATCH];
        let mut at = vcns.start;
        while at < vcns.end {
            let end = at.saturating_add(BATCH as u64).min(vcns.end);
            for (slot, vcn) in found.iter_mut().zip(at..end) {
                *slot = map
                    .get(&vcn)
                    .and_then(|&e| whole.get(e as usize))
                    .copied()
                    .unwrap_or(NOT_WHOLE);
            }
            for (&c, vcn) in found.iter().zip(at..end) {
                let source = if c == NOT_WHOLE {
                    self.cluster_source(vcn)
                } else {
                    ClusterSource::Active {
                        offset: self.g.offset(u64::from(c)),
                    }
                };
                f(vcn, source);
            }
            at = end;
        }
    }

    /// Cluster `vcn` (of `cs` bytes) of the view below this file's layers,
    /// as one piece: a hole, or read-only data contiguous in one file (of
    /// the chain's file `depth` or deeper); `None` when it takes a walk
    /// page by page (a raw base that ends inside it, a base of another
    /// cluster size, a base whose layers hold only part of it).
    fn below_whole(&self, vcn: u64, cs: u64, depth: usize) -> Option<ClusterSource> {
        let off = vcn.checked_mul(cs)?;
        match self.base.as_deref() {
            None => Some(ClusterSource::Hole),
            Some(Backing::Raw(r)) if off >= r.len() => Some(ClusterSource::Hole),
            Some(Backing::Raw(r)) if r.len() - off >= cs => {
                Some(ClusterSource::ReadOnly { depth, offset: off })
            }
            Some(Backing::Raw(_)) => None,
            Some(Backing::Pcow(b)) => {
                if b.g.cluster_size() != cs {
                    return None;
                }
                if off >= b.header.staged.virtual_size {
                    return Some(ClusterSource::Hole);
                }
                let active = b.header.staged.active_layer;
                if let Some(&e) = b.meta.layers[active as usize].map.get(&vcn) {
                    if b.meta.full(e, b.g.pages()) {
                        return Some(ClusterSource::ReadOnly {
                            depth,
                            offset: b.g.offset(b.meta.entries[e as usize].cluster),
                        });
                    }
                }
                if b.meta.view_holds(Some(active), vcn) {
                    return None;
                }
                b.below_whole(vcn, cs, depth + 1)
            }
        }
    }

    /// [`Image::cluster_source`] found page by page through the chain.
    fn cluster_source_by_pages(&self, vcn: u64) -> ClusterSource {
        let cs = self.g.cluster_size();
        let active = self.header.staged.active_layer;
        let mut pages = Vec::with_capacity(self.g.pages());
        for page in 0..self.g.pages() {
            pages.push(self.page_location(Some(active), vcn * cs + page as u64 * PAGE_SIZE, 0));
        }
        if pages.iter().all(|p| *p == PageLocation::Zero) {
            return ClusterSource::Hole;
        }
        if let PageLocation::File { depth, offset } = pages[0] {
            let run = pages.iter().enumerate().all(|(i, p)| {
                *p == PageLocation::File {
                    depth,
                    offset: offset + i as u64 * PAGE_SIZE,
                }
            });
            if run {
                return ClusterSource::ReadOnly { depth, offset };
            }
        }
        ClusterSource::Mixed(pages)
    }

    /// Where the page at virtual offset `off` of `layer`'s view lives;
    /// `depth` is this image's depth in the chain.
    fn page_location(&self, layer: Option<u32>, off: u64, depth: usize) -> PageLocation {
        let cs = self.g.cluster_size();
        if off >= self.header.staged.virtual_size {
            return PageLocation::Zero;
        }
        let (vcn, in_cluster) = (off / cs, off % cs);
        match self.page_src(layer, vcn, (in_cluster / PAGE_SIZE) as usize) {
            PageSrc::Local(c) => PageLocation::File {
                depth,
                offset: self.g.offset(c) + in_cluster,
            },
            PageSrc::Zero => PageLocation::Zero,
            PageSrc::Base => match self.base.as_deref() {
                Some(Backing::Pcow(i)) => i.page_location(Some(i.active_layer()), off, depth + 1),
                // A page a raw base only partly covers maps too: the kernel
                // zero-fills a mapping past the end of its file, which is
                // what reads return there.
                Some(Backing::Raw(r)) if off < r.len() => PageLocation::File {
                    depth: depth + 1,
                    offset: off,
                },
                _ => PageLocation::Zero,
            },
        }
    }

    /// Ranges of the image's view in virtual order, each with where its
    /// bytes live; adjacent ranges with contiguous sources are merged.
    pub fn extents(&self) -> Vec<Extent> {
        let all = [(0, self.header.staged.virtual_size)];
        self.view_extents(Some(self.header.staged.active_layer), &all, 0)
    }

    /// Extents of `layer`'s view over sorted, disjoint `ranges`. Costs what
    /// the layers hold, not the virtual size: only held clusters are walked
    /// page by page, and everything else goes to the base in one call.
    pub(crate) fn view_extents(
        &self,
        layer: Option<u32>,
        ranges: &[(u64, u64)],
        depth: usize,
    ) -> Vec<Extent> {
        let cs = self.g.cluster_size();
        let mut held: Vec<u64> = self
            .meta
            .path_of(layer)
            .flat_map(|l| self.meta.layers[l as usize].map.keys())
            .collect();
        held.sort_unstable();
        held.dedup();
        let mut own = Vec::new();
        let mut gaps: Vec<(u64, u64)> = Vec::new();
        let push_gap = |gaps: &mut Vec<(u64, u64)>, s: u64, e: u64| match gaps.last_mut() {
            Some(last) if last.1 == s => last.1 = e,
            _ => gaps.push((s, e)),
        };
        for &(start, end) in ranges {
            let mut off = start;
            let mut i = held.partition_point(|&v| v < start / cs);
            while off < end {
                let Some(v) = held.get(i).copied().filter(|v| v * cs < end) else {
                    push_gap(&mut gaps, off, end);
                    break;
                };
                i += 1;
                if v * cs > off {
                    push_gap(&mut gaps, off, v * cs);
                    off = v * cs;
                }
                let cluster_end = ((v + 1) * cs).min(end);
                while off < cluster_end {
                    let in_cluster = off % cs;
                    let page = (in_cluster / PAGE_SIZE) as usize;
                    let n = (PAGE_SIZE - in_cluster % PAGE_SIZE).min(cluster_end - off);
                    match self.page_src(layer, v, page) {
                        PageSrc::Local(c) => push_extent(
                            &mut own,
                            Extent {
                                offset: off,
                                length: n,
                                depth,
                                file: self.path.clone(),
                                file_offset: Some(self.g.offset(c) + in_cluster),
                            },
                        ),
                        _ => push_gap(&mut gaps, off, off + n),
                    }
                    off += n;
                }
            }
        }
        let below = match &self.base {
            Some(b) => b.view_extents(&gaps, depth + 1),
            None => gaps
                .iter()
                .map(|&(s, e)| Extent {
                    offset: s,
                    length: e - s,
                    depth,
                    file: self.path.clone(),
                    file_offset: None,
                })
                .collect(),
        };
        merge_extents(own, below)
    }
}

/// Where a virtual cluster's bytes live, for a device that maps them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterSource {
    /// A whole cluster of the active layer at this offset of the top file:
    /// map it shared, guest writes go straight to the image.
    Active {
        /// Byte offset in the top file.
        offset: u64,
    },
    /// A whole cluster of read-only data, contiguous in one file of the
    /// chain: map it private (the host kernel copies a page on write).
    ReadOnly {
        /// Index into [`crate::LiveImage::chain_files`].
        depth: usize,
        /// Byte offset in that file.
        offset: u64,
    },
    /// Nothing in the chain holds any of it: reads are zeros.
    Hole,
    /// Pages from several places (partial copies, a short raw base).
    Mixed(Vec<PageLocation>),
}

/// Where one 4 KiB page lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageLocation {
    /// Reads as zeros.
    Zero,
    /// In a file of the chain.
    File {
        /// Index into [`crate::LiveImage::chain_files`].
        depth: usize,
        /// Byte offset in that file.
        offset: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{BaseFormat, BaseRef};
    use crate::image::{CreateOptions, OpenOptions};

    const CS: u64 = 64 << 10;
    const N: u64 = 24;

    fn create(path: &std::path::Path, cs: u64, base: Option<&str>) -> Image {
        Image::create(
            path,
            &CreateOptions {
                cluster_size: Some(cs),
                virtual_size: Some(N * CS),
                base: base.map(|b| BaseRef {
                    name: b.into(),
                    format: BaseFormat::Probe,
                }),
            },
        )
        .unwrap()
    }

    /// Every cluster's source with the shortcut through the base equals
    /// the walk page by page, over a chain that has every case: a raw base
    /// ending inside a cluster, a pcow base holding whole and partial
    /// clusters in two layers, a top layer above, holes everywhere below.
    #[test]
    fn whole_clusters_from_the_base_match_the_page_walk() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("raw"), vec![5u8; (6 * CS + 6000) as usize]).unwrap();
        let mut mid = create(&d.path().join("mid.pcow"), CS, Some("raw"));
        mid.write_at(&[1; CS as usize], 2 * CS).unwrap(); // whole, over the raw base
        mid.write_at(&[1; 10], 8 * CS + 5).unwrap(); // partial, over holes
        mid.write_at(&[1; CS as usize], 10 * CS).unwrap(); // whole, over holes
        mid.snapshot_create("s").unwrap();
        mid.write_at(&[2; 10], 10 * CS + 4096).unwrap(); // partial above a whole
        mid.write_at(&[2; CS as usize], 12 * CS).unwrap();
        mid.close().unwrap();
        let mut top = create(&d.path().join("top.pcow"), CS, Some("mid.pcow"));
        top.write_at(&[3; CS as usize], 4 * CS).unwrap();
        top.write_at(&[3; 10], 12 * CS + 8192).unwrap();
        top.close().unwrap();
        // A base of another cluster size: always the page walk.
        let mut other = create(&d.path().join("other.pcow"), CS / 4, Some("raw"));
        other.write_at(&[4; 10], 3 * CS).unwrap();
        other.close().unwrap();
        let odd = create(&d.path().join("odd.pcow"), CS, Some("other.pcow"));
        odd.close().unwrap();

        let mut kinds = std::collections::BTreeSet::new();
        for name in ["mid.pcow", "top.pcow", "odd.pcow"] {
            let img = Image::open(d.path().join(name), OpenOptions::read_only()).unwrap();
            for vcn in 0..N {
                let fast = img.cluster_source(vcn);
                let active = img.header.staged.active_layer as usize;
                let whole_active = img.meta.layers[active]
                    .map
                    .get(&vcn)
                    .is_some_and(|&e| img.meta.full(e, img.g.pages()));
                if !whole_active {
                    assert_eq!(
                        fast,
                        img.cluster_source_by_pages(vcn),
                        "{name} cluster {vcn}"
                    );
                }
                kinds.insert(match fast {
                    ClusterSource::Active { .. } => "active".to_string(),
                    ClusterSource::ReadOnly { depth, .. } => format!("read-only {depth}"),
                    ClusterSource::Hole => "hole".into(),
                    ClusterSource::Mixed(_) => "mixed".into(),
                });
            }
        }
        let want = [
            "active",
            "hole",
            "mixed",
            "read-only 0",
            "read-only 1",
            "read-only 2",
        ];
        assert_eq!(kinds.into_iter().collect::<Vec<_>>(), want);
    }
}
