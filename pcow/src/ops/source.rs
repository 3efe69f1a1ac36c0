//! The input side of convert and compare: an image of either format opened
//! read-only, its content (the active view, or a snapshot's), and where
//! that content may be non-zero.
//!
//! A raw input is walked with `SEEK_DATA`/`SEEK_HOLE`, so its holes are
//! never read; a pcow input is walked by its extents, so ranges no image
//! of its chain holds are never read either.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use crate::chain::RawImage;
use crate::error::io_err;
use crate::error::{Error, Result};
use crate::extent::Extent;
use crate::header::is_pcow;
use crate::image::{Image, OpenOptions};
use crate::meta::SnapshotInfo;

/// An image file format as the command line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// Plain bytes.
    Raw,
    /// A pcow image.
    Pcow,
}

impl ImageFormat {
    /// "raw" or "pcow".
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Raw => "raw",
            ImageFormat::Pcow => "pcow",
        }
    }

    /// The format of the file at `path`: pcow if it starts with the pcow
    /// magic, raw otherwise.
    pub fn probe(path: &Path) -> Result<ImageFormat> {
        let file = crate::output_file::open_regular_input(path)?;
        let pcow = is_pcow(&file).map_err(io_err(path, "reading"))?;
        Ok(if pcow {
            ImageFormat::Pcow
        } else {
            ImageFormat::Raw
        })
    }
}

impl std::str::FromStr for ImageFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<ImageFormat> {
        match s {
            "raw" => Ok(ImageFormat::Raw),
            "pcow" => Ok(ImageFormat::Pcow),
            _ => Err(Error::Invalid(format!(
                "unknown image format {s:?} (expected raw or pcow)"
            ))),
        }
    }
}

impl std::fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which snapshot of a pcow input to read instead of its current content,
/// as qemu-img's `-l` and `-s` name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotSel {
    /// An id, tried first, or else a tag (`-l NAME`, `-s NAME`).
    IdOrTag(String),
    /// `-l snapshot.id=ID,snapshot.name=TAG`: every part given must match.
    Exact {
        /// The snapshot's id.
        id: Option<u32>,
        /// The snapshot's tag.
        tag: Option<String>,
    },
}

impl SnapshotSel {
    /// Parses `-l`: `snapshot.id=ID` and/or `snapshot.name=TAG` separated
    /// by a comma, or a bare id or tag.
    pub fn parse_load(arg: &str) -> Result<SnapshotSel> {
        let bad = |why: String| Error::Invalid(format!("invalid snapshot option '{arg}': {why}"));
        if !arg.starts_with("snapshot.") {
            if arg.is_empty() {
                return Err(bad("empty".into()));
            }
            return Ok(SnapshotSel::IdOrTag(arg.to_owned()));
        }
        let (mut id, mut tag) = (None, None);
        for part in arg.split(',') {
            match part.split_once('=') {
                Some(("snapshot.id", v)) if id.is_none() => {
                    id = Some(v.parse::<u32>().map_err(|_| {
                        bad(format!("snapshot.id '{v}' is not a snapshot id (a number)"))
                    })?);
                }
                Some(("snapshot.name", v)) if tag.is_none() && !v.is_empty() => {
                    tag = Some(v.to_owned())
                }
                _ => {
                    return Err(bad(format!(
                        "'{part}': expected snapshot.id=ID and/or snapshot.name=NAME, each once"
                    )))
                }
            }
        }
        Ok(SnapshotSel::Exact { id, tag })
    }

    /// The snapshot of `img` this selects.
    pub fn find(&self, img: &Image) -> Result<SnapshotInfo> {
        if *self
            == (SnapshotSel::Exact {
                id: None,
                tag: None,
            })
        {
            return Err(Error::Invalid("a snapshot needs an id or a name".into()));
        }
        match self {
            SnapshotSel::IdOrTag(s) => img.snapshot(s),
            SnapshotSel::Exact { id, tag } => img
                .snapshots()
                .into_iter()
                .find(|s| {
                    id.is_none_or(|id| s.id == id) && tag.as_ref().is_none_or(|t| &s.tag == t)
                })
                .ok_or_else(|| Error::NoSuchSnapshot {
                    path: img.path().to_owned(),
                    snap: self.to_string(),
                }),
        }
    }
}

impl std::fmt::Display for SnapshotSel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SnapshotSel::IdOrTag(s) => f.write_str(s),
            SnapshotSel::Exact { id, tag } => {
                let mut parts = Vec::new();
                if let Some(id) = id {
                    parts.push(format!("snapshot.id={id}"));
                }
                if let Some(t) = tag {
                    parts.push(format!("snapshot.name={t}"));
                }
                f.write_str(&parts.join(","))
            }
        }
    }
}

/// An opened input image: its content and where that content may be
/// non-zero.
#[derive(Debug)]
pub(crate) enum Source {
    Raw(RawImage),
    /// A pcow image and the layer whose view is read: the active one, or a
    /// snapshot's.
    Pcow {
        image: Box<Image>,
        layer: u32,
    },
}

impl Source {
    /// Opens `path` read-only (shared lock unless `force_share`), probing
    /// the format when `format` is `None`.
    pub(crate) fn open(
        path: &Path,
        format: Option<ImageFormat>,
        force_share: bool,
    ) -> Result<Source> {
        Self::open_snapshot(path, format, force_share, None)
    }

    /// As [`Source::open`], reading snapshot `snapshot` when given (a pcow
    /// image only).
    pub(crate) fn open_snapshot(
        path: &Path,
        format: Option<ImageFormat>,
        force_share: bool,
        snapshot: Option<&SnapshotSel>,
    ) -> Result<Source> {
        let format = match format {
            Some(f) => f,
            None => ImageFormat::probe(path)?,
        };
        Ok(match format {
            ImageFormat::Raw => {
                if let Some(s) = snapshot {
                    return Err(Error::Invalid(format!(
                        "{}: a raw image has no snapshots (asked for {s})",
                        path.display()
                    )));
                }
                Source::Raw(RawImage::open(path, false, force_share)?)
            }
            ImageFormat::Pcow => {
                let opts = OpenOptions {
                    force_share,
                    ..OpenOptions::read_only()
                };
                let image = Box::new(Image::open(path, opts)?);
                let layer = match snapshot {
                    Some(s) => s.find(&image)?.layer,
                    None => image.active_layer(),
                };
                Source::Pcow { image, layer }
            }
        })
    }

    pub(crate) fn format(&self) -> ImageFormat {
        match self {
            Source::Raw(_) => ImageFormat::Raw,
            Source::Pcow { .. } => ImageFormat::Pcow,
        }
    }

    pub(crate) fn size(&self) -> u64 {
        match self {
            Source::Raw(r) => r.len(),
            Source::Pcow { image, .. } => image.virtual_size(),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        match self {
            Source::Raw(r) => r.path(),
            Source::Pcow { image, .. } => image.path(),
        }
    }

    /// Reads the content; the range must lie within the size.
    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match self {
            Source::Raw(r) => r.read_at(buf, offset),
            Source::Pcow { image, layer } => {
                let size = image.virtual_size();
                if offset
                    .checked_add(buf.len() as u64)
                    .is_none_or(|e| e > size)
                {
                    return Err(Error::OutOfRange {
                        path: image.path().to_owned(),
                        offset,
                        len: buf.len() as u64,
                        size,
                    });
                }
                image.read_view(Some(*layer), buf, offset)
            }
        }
    }

    /// The extents of a pcow input's view (by depth of its chain).
    pub(crate) fn extents(&self) -> Option<Vec<Extent>> {
        match self {
            Source::Raw(_) => None,
            Source::Pcow { image, layer } => {
                Some(image.view_extents(Some(*layer), &[(0, image.virtual_size())], 0))
            }
        }
    }

    /// The ranges that may hold non-zero bytes, sorted, disjoint, within
    /// the size. Everything else reads as zeros.
    pub(crate) fn data_ranges(&self) -> Result<Vec<(u64, u64)>> {
        match self {
            Source::Raw(r) => file_data_ranges(r.file(), r.len(), r.path()),
            Source::Pcow { .. } => Ok(extent_data_ranges(&self.extents().unwrap_or_default())),
        }
    }

    /// Calls `f(offset, chunk)` for every `chunk`-sized, `chunk`-aligned
    /// piece of the content that holds a non-zero byte, in order. The buffer
    /// is always `chunk` bytes, zero-padded past the size. Holes are not
    /// read. `progress(done, total)` follows the scan.
    pub(crate) fn scan_nonzero(
        &self,
        chunk: u64,
        progress: &mut dyn FnMut(u64, u64),
        f: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let size = self.size();
        let ranges = self.data_ranges()?;
        let mut buf = vec![0u8; chunk as usize];
        let mut next_chunk = 0u64;
        let mut i = 0;
        progress(0, size);
        while i < ranges.len() {
            let c = (ranges[i].0 / chunk).max(next_chunk);
            let (cs, ce) = (c * chunk, ((c + 1) * chunk).min(size));
            buf.fill(0);
            let mut j = i;
            while j < ranges.len() && ranges[j].0 < ce {
                let (s, e) = (ranges[j].0.max(cs), ranges[j].1.min(ce));
                if s < e {
                    self.read_at(&mut buf[(s - cs) as usize..(e - cs) as usize], s)?;
                }
                if ranges[j].1 <= ce {
                    j += 1;
                } else {
                    break;
                }
            }
            i = j;
            next_chunk = c + 1;
            if !is_zero(&buf) {
                f(cs, &buf)?;
            }
            progress(ce, size);
        }
        progress(size, size);
        Ok(())
    }
}

/// The data ranges of a file up to `len` (`SEEK_DATA`/`SEEK_HOLE`),
/// sorted and disjoint.
pub(crate) fn file_data_ranges(file: &File, len: u64, path: &Path) -> Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut off = 0;
    while let Some((s, e)) = next_data(file, off, len).map_err(io_err(path, "seeking data"))? {
        out.push((s, e));
        off = e;
    }
    Ok(out)
}

/// The ranges of `extents` that hold data, adjacent ones merged.
pub(crate) fn extent_data_ranges(extents: &[Extent]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for e in extents.iter().filter(|e| e.file_offset.is_some()) {
        match out.last_mut() {
            Some(last) if last.1 == e.offset => last.1 += e.length,
            _ => out.push((e.offset, e.offset + e.length)),
        }
    }
    out
}

/// Whether every byte is zero.
pub(crate) fn is_zero(buf: &[u8]) -> bool {
    // OR-folding fixed-size blocks vectorizes; `all` stops at the first
    // non-zero block.
    buf.chunks(256)
        .all(|c| c.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

/// The next data range `[start, end)` of `file` at or after `from`, clipped
/// to `len`, found with `SEEK_DATA`/`SEEK_HOLE`; `None` when only holes
/// remain. A filesystem without them reports everything as data.
pub(crate) fn next_data(file: &File, from: u64, len: u64) -> std::io::Result<Option<(u64, u64)>> {
    if from >= len {
        return Ok(None);
    }
    let fd = file.as_raw_fd();
    let Ok(off) = i64::try_from(from) else {
        return Ok(None);
    };
    // SAFETY: lseek only reads its integer arguments; `fd` is owned by
    // `file`, which stays open for the call. The file position it moves is
    // not used (all I/O is positioned).
    let start = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
    if start < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(Some((from, len))),
            _ => Err(e),
        };
    }
    // SAFETY: as above.
    let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
    if end < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (start, end) = (start as u64, (end as u64).min(len));
    Ok((start < end).then_some((start, end)))
}
