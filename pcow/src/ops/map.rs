//! Map: where each range of an image's content lives, as `qemu-img map`
//! reports it. A pcow image is mapped through its chain (a range no image
//! holds is not present); a raw file by `SEEK_DATA`/`SEEK_HOLE` (a hole is
//! present and reads as zeros, at the same offset of the file).

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::ops::source::{file_data_ranges, ImageFormat, Source};

/// One range of the map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapRange {
    /// Virtual offset.
    pub start: u64,
    /// Length in bytes.
    pub length: u64,
    /// 0: the image itself, 1: its base, ...
    pub depth: usize,
    /// The file the range was found in (for a range no image holds, the
    /// deepest image consulted).
    pub file: PathBuf,
    /// Whether some image of the chain (or the raw file) has the range.
    pub present: bool,
    /// Whether data is stored there (otherwise it reads as zeros).
    pub data: bool,
    /// Offset in `file`, where the range is present.
    pub offset: Option<u64>,
}

/// Maps the image at `path` from `start`, over `max_length` bytes at most
/// (to the end when `None`). A start at or past the end maps nothing.
pub fn map(
    path: &Path,
    format: Option<ImageFormat>,
    force_share: bool,
    start: u64,
    max_length: Option<u64>,
) -> Result<Vec<MapRange>> {
    let src = Source::open(path, format, force_share)?;
    let size = src.size();
    let end = match max_length {
        Some(len) => start.saturating_add(len).min(size),
        None => size,
    };
    if start >= end {
        return Ok(Vec::new());
    }
    let all = match &src {
        Source::Raw(r) => {
            // Data ranges, and the holes between them.
            let mut v = Vec::new();
            let mut at = 0;
            for (s, e) in file_data_ranges(r.file(), size, r.path())? {
                if at < s {
                    v.push(raw_range(r.path(), at, s, false));
                }
                v.push(raw_range(r.path(), s, e, true));
                at = e;
            }
            if at < size {
                v.push(raw_range(r.path(), at, size, false));
            }
            v
        }
        Source::Pcow { .. } => src
            .extents()
            .unwrap_or_default()
            .into_iter()
            .map(|e| MapRange {
                start: e.offset,
                length: e.length,
                depth: e.depth,
                file: e.file,
                present: e.file_offset.is_some(),
                data: e.file_offset.is_some(),
                offset: e.file_offset,
            })
            .collect(),
    };
    Ok(clip(all, start, end))
}

fn raw_range(path: &Path, s: u64, e: u64, data: bool) -> MapRange {
    MapRange {
        start: s,
        length: e - s,
        depth: 0,
        file: path.to_owned(),
        present: true,
        data,
        offset: Some(s),
    }
}

/// The parts of `ranges` (sorted, disjoint) inside `[start, end)`.
fn clip(ranges: Vec<MapRange>, start: u64, end: u64) -> Vec<MapRange> {
    ranges
        .into_iter()
        .filter(|r| r.start < end && r.start + r.length > start)
        .map(|mut r| {
            let s = r.start.max(start);
            let e = (r.start + r.length).min(end);
            r.offset = r.offset.map(|o| o + (s - r.start));
            r.start = s;
            r.length = e - s;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::{CreateOptions, Image};

    #[test]
    fn raw_files_map_data_and_holes_and_ranges_clip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.raw");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(1 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[1; 8192], 65536).unwrap();
        let m = map(&p, None, false, 0, None).unwrap();
        let spans: Vec<(u64, u64, bool)> = m.iter().map(|r| (r.start, r.length, r.data)).collect();
        assert_eq!(
            spans,
            [
                (0, 65536, false),
                (65536, 8192, true),
                (73728, (1 << 20) - 73728, false)
            ]
        );
        assert!(m.iter().all(|r| r.present && r.offset == Some(r.start)));
        // From inside the data, 4 KiB of it and 4 KiB of hole.
        let m = map(&p, None, false, 69632, Some(8192)).unwrap();
        let spans: Vec<(u64, u64, bool, Option<u64>)> = m
            .iter()
            .map(|r| (r.start, r.length, r.data, r.offset))
            .collect();
        assert_eq!(
            spans,
            [
                (69632, 4096, true, Some(69632)),
                (73728, 4096, false, Some(73728))
            ]
        );
        assert!(map(&p, None, false, 1 << 20, None).unwrap().is_empty());
        assert!(map(&p, None, false, 0, Some(0)).unwrap().is_empty());
    }

    #[test]
    fn pcow_ranges_clip_with_their_file_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.pcow");
        let mut img = Image::create(
            &p,
            &CreateOptions {
                cluster_size: Some(4096),
                virtual_size: Some(65536),
                base: None,
            },
        )
        .unwrap();
        img.write_at(&[1; 8192], 16384).unwrap();
        img.close().unwrap();
        let all = map(&p, None, false, 0, None).unwrap();
        let data: Vec<&MapRange> = all.iter().filter(|r| r.data).collect();
        assert_eq!(data.len(), 1);
        let o = data[0].offset.unwrap();
        let m = map(&p, None, false, 20480, Some(8192)).unwrap();
        let spans: Vec<(u64, u64, bool, Option<u64>)> = m
            .iter()
            .map(|r| (r.start, r.length, r.present, r.offset))
            .collect();
        assert_eq!(
            spans,
            [
                (20480, 4096, true, Some(o + 4096)),
                (24576, 4096, false, None)
            ]
        );
    }
}
