//! The cluster map: layers, segments, entries and their page bitmaps, as
//! the scan found them and writes stage them, and the lookups through the
//! layers of a view.

pub(crate) use crate::vcn_map::VcnMap;

/// A layer: a snapshot cluster (or the file start) and the entries after it.
#[derive(Debug)]
pub(crate) struct Layer {
    /// The snapshot cluster that starts it (0 for layer 0).
    pub start: u64,
    /// The layer it is stacked on (`None` only for layer 0).
    pub parent: Option<u32>,
    /// The snapshot recorded in this layer's snapshot cluster; it names the
    /// view of `parent`.
    pub snap: Option<SnapshotInfo>,
    /// vcn -> entry index.
    pub map: VcnMap,
    /// Slot holding the committed snapshot cluster (layers >= 1).
    pub cur_slot: Option<u8>,
    /// The snapshot cluster must be written at the next barrier.
    pub dirty: bool,
}

/// A meta cluster and its data clusters.
#[derive(Debug)]
pub(crate) struct Segment {
    pub meta: u64,
    pub layer: u32,
    pub first: u32,
    pub used: u32,
    pub cur_slot: Option<u8>,
    pub dirty: bool,
}

/// One data cluster.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    pub vcn: u64,
    pub cluster: u64,
    pub seg: u32,
}

/// A snapshot as the API reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SnapshotInfo {
    /// Numeric id, unique in the file.
    pub id: u32,
    /// UTF-8 tag, unique in the file.
    pub tag: String,
    /// Creation time, seconds since the Unix epoch.
    pub time_sec: u64,
    /// Nanoseconds part of the creation time.
    pub time_nsec: u32,
    /// The layer whose view the snapshot names.
    pub layer: u32,
}

/// Where a 4 KiB page of a view comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PageSrc {
    /// This file, at this data cluster.
    Local(u64),
    /// The base image, at the same virtual offset.
    Base,
    /// Nothing holds it.
    Zero,
}

/// The metadata of one file: which data cluster holds which virtual
/// cluster of which layer, and which of its pages.
#[derive(Debug)]
pub(crate) struct ClusterMap {
    pub(crate) layers: Vec<Layer>,
    pub(crate) segments: Vec<Segment>,
    pub(crate) entries: Vec<Entry>,
    /// `words` words per entry, staged.
    pub(crate) bitmaps: Vec<u64>,
    /// Bitmap words per entry.
    words: usize,
}

impl ClusterMap {
    /// Only layer 0, empty.
    pub(crate) fn new(words: usize) -> Self {
        ClusterMap {
            layers: vec![Layer::root()],
            segments: Vec::new(),
            entries: Vec::new(),
            bitmaps: Vec::new(),
            words,
        }
    }

    pub(crate) fn bitmap(&self, e: u32) -> &[u64] {
        let w = self.words;
        &self.bitmaps[e as usize * w..(e as usize + 1) * w]
    }

    pub(crate) fn bit(&self, e: u32, page: usize) -> bool {
        self.bitmap(e)[page / 64] & (1 << (page % 64)) != 0
    }

    /// Whether entry `e` holds all its cluster's `pages` pages: a word at
    /// a time (a 2 MiB cluster has 512 pages, and opening an image asks
    /// this of every entry).
    pub(crate) fn full(&self, e: u32, pages: usize) -> bool {
        let bm = self.bitmap(e);
        let (whole, rest) = (pages / 64, pages % 64);
        bm.get(..whole)
            .is_some_and(|words| words.iter().all(|w| *w == u64::MAX))
            && (rest == 0
                || bm
                    .get(whole)
                    .is_some_and(|w| w | (u64::MAX << rest) == u64::MAX))
    }

    /// Sets pages `first..=last` of entry `e`; its segment is dirty.
    pub(crate) fn set_bits(&mut self, e: u32, first: usize, last: usize) {
        let w = self.words;
        let bm = &mut self.bitmaps[e as usize * w..(e as usize + 1) * w];
        for p in first..=last {
            bm[p / 64] |= 1 << (p % 64);
        }
        let seg = self.entries[e as usize].seg as usize;
        self.segments[seg].dirty = true;
    }

    /// Layers from `layer` down to layer 0.
    pub(crate) fn path_of(&self, layer: Option<u32>) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(layer, move |l| self.layers[*l as usize].parent)
    }

    /// The source of page `page` of cluster `vcn` in the view of `layer`
    /// (`None`: the view below layer 0); `has_base`: the file has a base.
    pub(crate) fn page_src(
        &self,
        layer: Option<u32>,
        vcn: u64,
        page: usize,
        has_base: bool,
    ) -> PageSrc {
        for l in self.path_of(layer) {
            if let Some(&e) = self.layers[l as usize].map.get(&vcn) {
                if self.bit(e, page) {
                    return PageSrc::Local(self.entries[e as usize].cluster);
                }
            }
        }
        if has_base {
            PageSrc::Base
        } else {
            PageSrc::Zero
        }
    }

    /// Whether a layer of the view of `layer` holds virtual cluster `vcn`.
    pub(crate) fn view_holds(&self, layer: Option<u32>, vcn: u64) -> bool {
        self.path_of(layer)
            .any(|l| self.layers[l as usize].map.contains_key(&vcn))
    }

    /// Snapshots live in the file.
    pub(crate) fn snapshot_count(&self) -> usize {
        self.layers.iter().filter(|l| l.snap.is_some()).count()
    }
}

impl Layer {
    /// Layer 0: the file start, no parent.
    pub(crate) fn root() -> Self {
        Layer {
            start: 0,
            parent: None,
            snap: None,
            map: VcnMap::default(),
            cur_slot: None,
            dirty: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `full` against the page-by-page answer, for clusters of 1 to 512
    /// pages, a page missing anywhere or pages set past the cluster's end.
    #[test]
    fn full_answers_as_every_page_would() {
        for pages in [1usize, 2, 16, 63, 64, 65, 128, 200, 512] {
            let words = pages.div_ceil(64);
            let mut map = ClusterMap::new(words);
            let mut cases: Vec<Vec<u64>> = Vec::new();
            let all: Vec<u64> = (0..words)
                .map(|w| {
                    let n = (pages - w * 64).min(64);
                    if n == 64 {
                        u64::MAX
                    } else {
                        (1u64 << n) - 1
                    }
                })
                .collect();
            cases.push(all.clone());
            cases.push(vec![u64::MAX; words]);
            for missing in [0, pages / 2, pages - 1] {
                let mut bm = all.clone();
                bm[missing / 64] &= !(1 << (missing % 64));
                cases.push(bm);
            }
            cases.push(vec![0; words]);
            for (i, bm) in cases.iter().enumerate() {
                map.bitmaps.extend_from_slice(bm);
                let e = i as u32;
                let want = (0..pages).all(|p| map.bit(e, p));
                assert_eq!(map.full(e, pages), want, "{pages} pages, case {i}");
            }
        }
    }
}
