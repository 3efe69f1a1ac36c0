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
        let cs = self.g.cluster_size();
        let active = self.header.staged.active_layer;
        if let Some(&e) = self.meta.layers[active as usize].map.get(&vcn) {
            if (0..self.g.pages()).all(|p| self.meta.bit(e, p)) {
                return ClusterSource::Active {
                    offset: self.g.offset(self.meta.entries[e as usize].cluster),
                };
            }
        }
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
