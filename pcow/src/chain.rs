//! Base images: resolving a stored name, opening raw or pcow bases
//! read-only with shared locks, and refusing cycles and over-deep chains.

use std::fs::{File, OpenOptions as FsOpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{io_err, Error, Result};
use crate::extent::{merge_extents, Extent};
use crate::format::{BaseFormat, BaseRef, MAX_BASE_NAME, MAX_CHAIN_DEPTH};
use crate::header::is_pcow;
use crate::image::{Image, OpenOptions};
use crate::io::FileStorage;
use crate::lock::lock_file;

/// Files already in the chain being opened (device, inode).
#[derive(Debug, Default)]
pub(crate) struct ChainCtx {
    pub seen: Vec<(u64, u64)>,
    /// Take no locks anywhere in the chain (`-U`).
    pub force_share: bool,
}

impl ChainCtx {
    /// Records `file`; a file seen before is a cycle.
    pub(crate) fn visit(&mut self, file: &File, path: &Path) -> Result<()> {
        let md = file.metadata().map_err(io_err(path, "reading metadata"))?;
        let id = (md.dev(), md.ino());
        if self.seen.contains(&id) {
            return Err(Error::ChainCycle {
                path: path.to_owned(),
                resolved: path.to_owned(),
            });
        }
        self.seen.push(id);
        Ok(())
    }
}

/// Checks a base name as the header will store it (R4).
pub(crate) fn check_base_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_BASE_NAME || name.contains('\0') {
        return Err(Error::Invalid(format!(
            "base image name must be 1 to {MAX_BASE_NAME} bytes without NUL (got {} bytes)",
            name.len()
        )));
    }
    Ok(())
}

/// Where a stored base name points: relative to the naming image's
/// directory, never the working directory.
pub fn resolve_base(image_path: &Path, name: &str) -> PathBuf {
    let p = Path::new(name);
    if p.is_absolute() {
        return p.to_owned();
    }
    match image_path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join(p),
        _ => p.to_owned(),
    }
}

/// A base image, opened read-only (or read-write by `commit`).
#[derive(Debug)]
pub enum Backing {
    /// A pcow image (its active view).
    Pcow(Box<Image>),
    /// A raw file.
    Raw(RawImage),
}

/// A raw image file: its bytes, zeros past its end.
#[derive(Debug)]
pub struct RawImage {
    path: PathBuf,
    file: File,
    len: u64,
    writable: bool,
}

impl RawImage {
    /// Opens a raw file (locks it shared, or exclusive when writable).
    pub fn open(path: &Path, writable: bool, force_share: bool) -> Result<RawImage> {
        let file = FsOpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| crate::output_file::input_open_error(path, "opening", e))?;
        crate::output_file::regular_input(&file, path)?;
        if !force_share {
            lock_file(&file, path, writable)?;
        }
        Self::from_file(file, path, writable)
    }

    fn from_file(file: File, path: &Path, writable: bool) -> Result<RawImage> {
        let len = file
            .metadata()
            .map_err(io_err(path, "reading metadata"))?
            .len();
        Ok(RawImage {
            path: path.to_owned(),
            file,
            len,
            writable,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The file.
    pub fn file(&self) -> &File {
        &self.file
    }
    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads at `offset`; zeros past the end.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let avail = self.len.saturating_sub(offset).min(buf.len() as u64) as usize;
        if avail > 0 {
            self.file
                .read_exact_at(&mut buf[..avail], offset)
                .map_err(io_err(&self.path, "reading"))?;
        }
        buf[avail..].fill(0);
        Ok(())
    }

    /// Writes at `offset`, extending the file.
    pub fn write_at(&mut self, data: &[u8], offset: u64) -> Result<()> {
        if !self.writable {
            return Err(Error::ReadOnly {
                path: self.path.clone(),
            });
        }
        self.file
            .write_all_at(data, offset)
            .map_err(io_err(&self.path, "writing"))?;
        self.len = self.len.max(offset + data.len() as u64);
        Ok(())
    }

    /// fsync.
    pub fn flush(&mut self) -> Result<()> {
        if self.writable {
            self.file
                .sync_all()
                .map_err(io_err(&self.path, "syncing"))?;
        }
        Ok(())
    }

    /// Sets the length (zeros when growing).
    pub fn set_len(&mut self, len: u64) -> Result<()> {
        self.file
            .set_len(len)
            .map_err(io_err(&self.path, "resizing"))?;
        self.len = len;
        Ok(())
    }
}

impl Backing {
    /// Size of the base's content in bytes.
    pub fn size(&self) -> u64 {
        match self {
            Backing::Pcow(i) => i.virtual_size(),
            Backing::Raw(r) => r.len,
        }
    }

    /// The base's path.
    pub fn path(&self) -> &Path {
        match self {
            Backing::Pcow(i) => i.path(),
            Backing::Raw(r) => &r.path,
        }
    }

    /// Format name ("pcow" or "raw").
    pub fn format(&self) -> &'static str {
        match self {
            Backing::Pcow(_) => "pcow",
            Backing::Raw(_) => "raw",
        }
    }

    /// Reads the base's content at a virtual offset; zeros past its size.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match self {
            Backing::Pcow(i) => i.read_view(Some(i.active_layer()), buf, offset),
            Backing::Raw(r) => r.read_at(buf, offset),
        }
    }

    /// Writes at a virtual offset (commit into a base opened writable).
    pub fn write_at(&mut self, data: &[u8], offset: u64) -> Result<()> {
        match self {
            Backing::Pcow(i) => i.write_at(data, offset),
            Backing::Raw(r) => r.write_at(data, offset),
        }
    }

    /// Makes writes durable (a barrier for pcow, fsync for raw).
    pub fn flush(&mut self) -> Result<()> {
        match self {
            Backing::Pcow(i) => i.flush(),
            Backing::Raw(r) => r.flush(),
        }
    }

    /// Whether any byte of `[off, off + len)` can be non-zero.
    pub fn has_data(&self, off: u64, len: u64) -> bool {
        match self {
            Backing::Pcow(i) => {
                off < i.virtual_size()
                    && i.view_has_data(Some(i.active_layer()), off, len.min(i.virtual_size() - off))
            }
            Backing::Raw(r) => off < r.len,
        }
    }

    /// Extents of the base's content over sorted, disjoint `ranges`.
    pub(crate) fn view_extents(&self, ranges: &[(u64, u64)], depth: usize) -> Vec<Extent> {
        let (size, path) = (self.size(), self.path().to_owned());
        let mut inside = Vec::new();
        let mut outside = Vec::new();
        for &(s, e) in ranges {
            if s < size {
                inside.push((s, e.min(size)));
            }
            if e > size {
                outside.push((s.max(size), e));
            }
        }
        let zeros = |list: &[(u64, u64)]| -> Vec<Extent> {
            list.iter()
                .map(|&(s, e)| Extent {
                    offset: s,
                    length: e - s,
                    depth,
                    file: path.clone(),
                    file_offset: None,
                })
                .collect()
        };
        let data = match self {
            Backing::Pcow(i) => i.view_extents(Some(i.active_layer()), &inside, depth),
            Backing::Raw(_) => inside
                .iter()
                .map(|&(s, e)| Extent {
                    offset: s,
                    length: e - s,
                    depth,
                    file: path.clone(),
                    file_offset: Some(s),
                })
                .collect(),
        };
        merge_extents(data, zeros(&outside))
    }

    /// Number of images in this chain (1 for a raw base).
    pub fn depth(&self) -> usize {
        match self {
            Backing::Pcow(i) => 1 + i.base().map_or(0, Backing::depth),
            Backing::Raw(_) => 1,
        }
    }
}

/// Opens the base named by the image at `image_path`, and its own chain.
pub(crate) fn open_base(image_path: &Path, base: &BaseRef, ctx: &mut ChainCtx) -> Result<Backing> {
    open_base_mode(image_path, base, ctx, false)
}

/// Opens a base for writing (commit): exclusive lock on it, shared below.
/// A pcow base is opened with [`OpenOptions::defer_writing`]: nothing is
/// written to it before the first change, so that a commit refused after
/// this open leaves it as it was.
pub fn open_base_writable(image_path: &Path, base: &BaseRef) -> Result<Backing> {
    let mut ctx = ChainCtx::default();
    open_base_mode(image_path, base, &mut ctx, true)
}

fn open_base_mode(
    image_path: &Path,
    base: &BaseRef,
    ctx: &mut ChainCtx,
    writable: bool,
) -> Result<Backing> {
    let resolved = resolve_base(image_path, &base.name);
    if ctx.seen.len() >= MAX_CHAIN_DEPTH {
        return Err(Error::ChainTooDeep {
            path: image_path.to_owned(),
            limit: MAX_CHAIN_DEPTH,
        });
    }
    let file = match FsOpenOptions::new()
        .read(true)
        .write(writable)
        .custom_flags(libc::O_NONBLOCK)
        .open(&resolved)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::BaseMissing {
                path: image_path.to_owned(),
                name: base.name.clone(),
                resolved,
            })
        }
        Err(e) => {
            return Err(crate::output_file::input_open_error(
                &resolved,
                "opening the base image",
                e,
            ))
        }
    };
    crate::output_file::regular_input(&file, &resolved)?;
    if let Err(Error::ChainCycle { .. }) = ctx.visit(&file, &resolved) {
        return Err(Error::ChainCycle {
            path: image_path.to_owned(),
            resolved,
        });
    }
    if !ctx.force_share {
        lock_file(&file, &resolved, writable)?;
    }
    let pcow = is_pcow(&file).map_err(io_err(&resolved, "reading"))?;
    let format = match base.format {
        BaseFormat::Probe if pcow => BaseFormat::Pcow,
        BaseFormat::Probe => BaseFormat::Raw,
        f => f,
    };
    match format {
        BaseFormat::Pcow if !pcow => Err(Error::BaseFormat {
            path: image_path.to_owned(),
            resolved,
            expected: "pcow",
        }),
        BaseFormat::Pcow => {
            let opts = OpenOptions {
                writable,
                defer_writing: true,
                ..OpenOptions::default()
            };
            let img = Image::open_inner(Box::new(FileStorage::new(file)), &resolved, opts, ctx)?;
            Ok(Backing::Pcow(Box::new(img)))
        }
        _ => Ok(Backing::Raw(RawImage::from_file(
            file, &resolved, writable,
        )?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_names_resolve_against_the_image_directory() {
        assert_eq!(
            resolve_base(Path::new("/a/b/top.pcow"), "base.pcow"),
            Path::new("/a/b/base.pcow")
        );
        assert_eq!(
            resolve_base(Path::new("/a/b/top.pcow"), "../c/base"),
            Path::new("/a/b/../c/base")
        );
        assert_eq!(
            resolve_base(Path::new("top.pcow"), "base.pcow"),
            Path::new("base.pcow")
        );
        assert_eq!(
            resolve_base(Path::new("/a/top.pcow"), "/abs/base"),
            Path::new("/abs/base")
        );
    }
}
