//! Convert: copy an image's content (raw, or a pcow image through its whole
//! chain) into a new raw or pcow file, skipping holes and all-zero clusters.
//!
//! A raw input is walked with `SEEK_DATA`/`SEEK_HOLE`, so holes are never
//! read; a pcow input is walked by its extents, so unallocated ranges are
//! never read either. What is read is examined one output chunk at a time
//! and only chunks with a non-zero byte are written: a pcow output
//! allocates no cluster for zeros, a raw output (sized with `set_len`) stays
//! sparse.

use std::fs::{File, OpenOptions as FsOpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::chain::RawImage;
use crate::error::{Error, Result};
use crate::format::{Geometry, PAGE_SIZE};
use crate::image::{io_err, is_pcow, CreateOptions, Image, OpenOptions, DEFAULT_CLUSTER_SIZE};

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
        let file = File::open(path).map_err(io_err(path, "opening"))?;
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

/// How to convert.
#[derive(Debug, Clone, Copy)]
pub struct ConvertOptions {
    /// Input format; `None` probes the file's magic.
    pub input_format: Option<ImageFormat>,
    /// Output format.
    pub output_format: ImageFormat,
    /// Cluster size of a pcow output (default 64 KiB). Must be `None` for a
    /// raw output.
    pub cluster_size: Option<u64>,
    /// Open the input without locks (`-U`).
    pub force_share: bool,
}

/// What a conversion did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvertReport {
    /// Input format (probed or given).
    pub input_format: ImageFormat,
    /// Size of the input's content in bytes.
    pub input_size: u64,
    /// Size of the output's content: the input size, rounded up to the
    /// cluster size for a pcow output.
    pub output_size: u64,
    /// Bytes of data written to the output (zeros are not written).
    pub bytes_written: u64,
}

impl ConvertReport {
    /// Whether the output's size was rounded up from the input's.
    pub fn rounded(&self) -> bool {
        self.output_size != self.input_size
    }
}

/// Size of a raw output's write unit: the scan reads this much at a time
/// and writes only its non-zero 4 KiB pages.
const RAW_CHUNK: u64 = 1 << 20;

/// The virtual size of a pcow image holding `input_size` bytes: rounded up
/// to the cluster size.
pub fn pcow_size(input_size: u64, cluster_size: u64) -> u64 {
    input_size.next_multiple_of(cluster_size)
}

/// The geometry of an optional cluster size (default 64 KiB), with a clear
/// error for a bad one.
pub fn geometry(cluster_size: Option<u64>) -> Result<Geometry> {
    let cs = cluster_size.unwrap_or(DEFAULT_CLUSTER_SIZE);
    Geometry::from_cluster_size(cs).ok_or_else(|| {
        Error::Invalid(format!(
            "cluster size {cs} must be a power of two from 4096 to 2097152"
        ))
    })
}

/// An opened input image: its content and where that content may be
/// non-zero.
#[derive(Debug)]
pub(crate) enum Source {
    Raw(RawImage),
    Pcow(Box<Image>),
}

impl Source {
    /// Opens `path` read-only (shared lock unless `force_share`), probing
    /// the format when `format` is `None`.
    pub(crate) fn open(
        path: &Path,
        format: Option<ImageFormat>,
        force_share: bool,
    ) -> Result<Source> {
        let format = match format {
            Some(f) => f,
            None => ImageFormat::probe(path)?,
        };
        Ok(match format {
            ImageFormat::Raw => Source::Raw(RawImage::open(path, false, force_share)?),
            ImageFormat::Pcow => {
                let opts = OpenOptions {
                    force_share,
                    ..OpenOptions::read_only()
                };
                Source::Pcow(Box::new(Image::open(path, opts)?))
            }
        })
    }

    pub(crate) fn format(&self) -> ImageFormat {
        match self {
            Source::Raw(_) => ImageFormat::Raw,
            Source::Pcow(_) => ImageFormat::Pcow,
        }
    }

    pub(crate) fn size(&self) -> u64 {
        match self {
            Source::Raw(r) => r.len(),
            Source::Pcow(i) => i.virtual_size(),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        match self {
            Source::Raw(r) => r.path(),
            Source::Pcow(i) => i.path(),
        }
    }

    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match self {
            Source::Raw(r) => r.read_at(buf, offset),
            Source::Pcow(i) => i.read_at(buf, offset),
        }
    }

    /// The ranges that may hold non-zero bytes, sorted, disjoint, within
    /// the size. Everything else reads as zeros.
    pub(crate) fn data_ranges(&self) -> Result<Vec<(u64, u64)>> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut push = |s: u64, e: u64| match out.last_mut() {
            Some(last) if last.1 == s => last.1 = e,
            _ => out.push((s, e)),
        };
        match self {
            Source::Raw(r) => {
                let mut off = 0;
                while let Some((s, e)) =
                    next_data(r.file(), off, r.len()).map_err(io_err(r.path(), "seeking data"))?
                {
                    push(s, e);
                    off = e;
                }
            }
            Source::Pcow(i) => {
                for e in i.extents().iter().filter(|e| e.file_offset.is_some()) {
                    push(e.offset, e.offset + e.length);
                }
            }
        }
        Ok(out)
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
fn next_data(file: &File, from: u64, len: u64) -> std::io::Result<Option<(u64, u64)>> {
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

/// Refuses an output that is the input file or any image of its chain
/// (creating the output truncates it).
fn check_distinct(src: &Source, output: &Path) -> Result<()> {
    let Ok(out) = std::fs::metadata(output) else {
        return Ok(());
    };
    let mut paths = vec![src.path().to_owned()];
    if let Source::Pcow(img) = src {
        let mut cur = img.base();
        while let Some(b) = cur {
            paths.push(b.path().to_owned());
            cur = match b {
                crate::chain::Backing::Pcow(i) => i.base(),
                crate::chain::Backing::Raw(_) => None,
            };
        }
    }
    for p in paths {
        let Ok(md) = std::fs::metadata(&p) else {
            continue;
        };
        if md.dev() == out.dev() && md.ino() == out.ino() {
            return Err(Error::Invalid(format!(
                "output {} is the input image {} (or in its base chain)",
                output.display(),
                p.display()
            )));
        }
    }
    Ok(())
}

/// Converts the image at `input` into a new image at `output` (replacing
/// any file there). `progress(done, total)` is called as the input is
/// scanned, in bytes of the input's content.
pub fn convert(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ConvertReport> {
    if opts.output_format == ImageFormat::Raw && opts.cluster_size.is_some() {
        return Err(Error::Invalid(
            "a cluster size only applies to a pcow output".into(),
        ));
    }
    let g = geometry(opts.cluster_size)?;
    let src = Source::open(input, opts.input_format, opts.force_share)?;
    check_distinct(&src, output)?;
    let input_size = src.size();
    let mut report = ConvertReport {
        input_format: src.format(),
        input_size,
        output_size: input_size,
        bytes_written: 0,
    };
    match opts.output_format {
        ImageFormat::Pcow => {
            if input_size == 0 {
                return Err(Error::Invalid(format!(
                    "{}: the input is empty; a pcow image needs a non-zero size",
                    src.path().display()
                )));
            }
            report.output_size = pcow_size(input_size, g.cluster_size());
            let create = CreateOptions {
                cluster_size: Some(g.cluster_size()),
                virtual_size: Some(report.output_size),
                base: None,
            };
            let mut img = Image::create(output, &create)?;
            src.scan_nonzero(g.cluster_size(), progress, &mut |off, buf| {
                img.write_at(buf, off)?;
                report.bytes_written += buf.len() as u64;
                Ok(())
            })?;
            img.close()?;
        }
        ImageFormat::Raw => {
            let mut out = RawOutput::create(output, input_size)?;
            src.scan_nonzero(RAW_CHUNK, progress, &mut |off, buf| {
                let len = ((input_size - off) as usize).min(buf.len());
                report.bytes_written += out.write_nonzero(&buf[..len], off)?;
                Ok(())
            })?;
            out.finish()?;
        }
    }
    Ok(report)
}

/// A raw output file: exclusively locked, sized up front, written only
/// where the data is not zero.
struct RawOutput {
    path: PathBuf,
    file: File,
}

impl RawOutput {
    fn create(path: &Path, size: u64) -> Result<RawOutput> {
        let file = FsOpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err(path, "creating"))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::Locked {
                    path: path.to_owned(),
                })
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io_err(path, "locking")(e)),
        }
        file.set_len(0).map_err(io_err(path, "truncating"))?;
        file.set_len(size).map_err(io_err(path, "sizing"))?;
        Ok(RawOutput {
            path: path.to_owned(),
            file,
        })
    }

    /// Writes the runs of non-zero 4 KiB pages of `buf` (at `off`); returns
    /// the bytes written.
    fn write_nonzero(&mut self, buf: &[u8], off: u64) -> Result<u64> {
        let page = PAGE_SIZE as usize;
        let mut written = 0u64;
        let mut run: Option<usize> = None;
        let mut p = 0usize;
        while p <= buf.len() {
            let end = (p + page).min(buf.len());
            let data = p < buf.len() && !is_zero(&buf[p..end]);
            match (data, run) {
                (true, None) => run = Some(p),
                (false, Some(s)) => {
                    self.file
                        .write_all_at(&buf[s..p], off + s as u64)
                        .map_err(io_err(&self.path, "writing"))?;
                    written += (p - s) as u64;
                    run = None;
                }
                _ => {}
            }
            if p == buf.len() {
                break;
            }
            p = end;
        }
        Ok(written)
    }

    fn finish(self) -> Result<()> {
        self.file.sync_all().map_err(io_err(&self.path, "syncing"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection() {
        let mut v = vec![0u8; 100];
        assert!(is_zero(&v));
        v[99] = 1;
        assert!(!is_zero(&v));
        assert!(is_zero(&[]));
    }

    #[test]
    fn raw_round_trip_through_pcow() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("in.raw");
        let mut data = vec![0u8; 300_000];
        data[5000..9000].fill(7);
        data[299_999] = 1;
        std::fs::write(&raw, &data).unwrap();
        let pc = dir.path().join("out.pcow");
        let opts = ConvertOptions {
            input_format: None,
            output_format: ImageFormat::Pcow,
            cluster_size: Some(4096),
            force_share: false,
        };
        let r = convert(&raw, &pc, &opts, &mut |_, _| {}).unwrap();
        assert_eq!(r.input_format, ImageFormat::Raw);
        assert_eq!(r.output_size, 303_104);
        assert!(r.rounded());
        assert_eq!(r.bytes_written, 3 * 4096);
        let back = dir.path().join("back.raw");
        let opts = ConvertOptions {
            output_format: ImageFormat::Raw,
            cluster_size: None,
            ..opts
        };
        let r = convert(&pc, &back, &opts, &mut |_, _| {}).unwrap();
        assert_eq!(r.input_format, ImageFormat::Pcow);
        let got = std::fs::read(&back).unwrap();
        assert_eq!(got.len(), 303_104);
        assert_eq!(&got[..data.len()], &data[..]);
        assert!(got[data.len()..].iter().all(|&b| b == 0));
    }

    #[test]
    fn same_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("in.raw");
        std::fs::write(&raw, [1u8; 4096]).unwrap();
        let opts = ConvertOptions {
            input_format: None,
            output_format: ImageFormat::Raw,
            cluster_size: None,
            force_share: false,
        };
        assert!(matches!(
            convert(&raw, &raw, &opts, &mut |_, _| {}),
            Err(Error::Invalid(_))
        ));
        assert_eq!(std::fs::read(&raw).unwrap(), vec![1u8; 4096]);
    }
}
