//! An open pcow image: opening (the header, the scan, the base chain),
//! creating, the writer's start (crash residue repaired, DIRTY set) and
//! close, and the accessors. The image's state is grouped by job: the
//! header ([`crate::header`]), the cluster map ([`crate::meta`]), the pool
//! ([`crate::alloc`]), the commit ([`crate::commit`]) and what the open
//! found; the operations on it are `impl Image` blocks in the modules
//! above this one (see the crate's module map).

use std::fs::{File, OpenOptions as FsOpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::alloc::Pool;
use crate::chain::{Backing, ChainCtx};
use crate::commit::CommitState;
use crate::error::{io_err, Error, Result};
use crate::format::{features, BaseRef, FormatError, Geometry, Header, MAX_VIRTUAL_SIZE};
use crate::header::HeaderState;
use crate::io::{FileStorage, Storage};
use crate::lock::lock_file;
use crate::meta::ClusterMap;

/// How to open an image.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// Open the top image for writing (exclusive lock).
    pub writable: bool,
    /// Take no locks (like `qemu-img -U`): for inspecting an image in use.
    pub force_share: bool,
    /// Do not open the base chain (commit uses this to open the base for writing).
    pub skip_base: bool,
    /// Collect non-fatal rule violations in [`Image::findings`] instead of
    /// failing (used by `check`).
    pub lenient: bool,
    /// With `writable`: lock exclusively but write nothing (no DIRTY flag,
    /// no repair of crash residue) until the first change, so that checks
    /// made after opening (other locks, arguments, a base) can still refuse
    /// and leave the file byte for byte as it was. `write_at`, `grow`,
    /// `preallocate` and the snapshot operations start the writer after
    /// their own checks; [`Image::begin_writing`] starts it explicitly.
    /// Until then [`Image::is_writable`] is false and closing writes
    /// nothing.
    pub defer_writing: bool,
}

impl OpenOptions {
    /// Read-only, locked.
    pub fn read_only() -> Self {
        Self::default()
    }
    /// Read-write, locked.
    pub fn read_write() -> Self {
        OpenOptions {
            writable: true,
            ..Self::default()
        }
    }
    /// Read-write, locked, nothing written before the first change (see
    /// [`OpenOptions::defer_writing`]).
    pub fn read_write_deferred() -> Self {
        OpenOptions {
            writable: true,
            defer_writing: true,
            ..Self::default()
        }
    }
}

/// How to create an image.
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    /// Cluster size in bytes (default 64 KiB).
    pub cluster_size: Option<u64>,
    /// Virtual size in bytes (default: the base's size).
    pub virtual_size: Option<u64>,
    /// Base image, as it will be stored (relative to the new image's directory).
    pub base: Option<BaseRef>,
}

/// Default cluster size.
pub const DEFAULT_CLUSTER_SIZE: u64 = 64 << 10;

/// An open pcow image and its base chain.
pub struct Image {
    /// Names the image in errors and anchors relative base names.
    pub(crate) path: PathBuf,
    pub(crate) storage: Box<dyn Storage>,
    pub(crate) g: Geometry,
    pub(crate) access: Access,
    pub(crate) header: HeaderState,
    pub(crate) meta: ClusterMap,
    pub(crate) alloc: Pool,
    pub(crate) commit: CommitState,
    pub(crate) found: OpenFindings,
    pub(crate) base: Option<Box<Backing>>,
}

/// What opening the file found besides the metadata: crash residue to
/// repair or report, and rule violations a lenient open let through.
#[derive(Debug, Default)]
pub(crate) struct OpenFindings {
    /// File offsets of stale or torn slots found by the scan (L2).
    pub(crate) stale: Vec<u64>,
    /// Clusters past the committed end at open time (L1).
    pub(crate) uncommitted_at_open: u64,
    /// DIRTY was set when the image was opened (L3).
    pub(crate) dirty_at_open: bool,
    /// Non-fatal rule violations (lenient open).
    pub(crate) findings: Vec<FormatError>,
}

/// What a handle may do, and where it is in its life.
#[derive(Debug, Default)]
pub(crate) struct Access {
    pub(crate) writable: bool,
    /// Opened for writing and exclusively locked, but the writer has not
    /// started: nothing written yet ([`OpenOptions::defer_writing`]).
    pub(crate) deferred: bool,
    pub(crate) closed: bool,
    /// An unlinked overlay made by [`Image::create_temporary`].
    pub(crate) temporary: bool,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("path", &self.path)
            .field("writable", &self.access.writable)
            .field("virtual_size", &self.header.staged.virtual_size)
            .field("cluster_size", &self.g.cluster_size())
            .finish()
    }
}

impl Image {
    /// Opens the image at `path` and its base chain.
    pub fn open(path: impl AsRef<Path>, opts: OpenOptions) -> Result<Image> {
        let path = path.as_ref();
        let file = FsOpenOptions::new()
            .read(true)
            .write(opts.writable)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| crate::output_file::input_open_error(path, "opening", e))?;
        crate::output_file::regular_input(&file, path)?;
        if !opts.force_share {
            lock_file(&file, path, opts.writable)?;
        }
        Self::open_locked(file, path, opts)
    }

    /// Opens the image in `file`, already locked as `opts` asks.
    pub(crate) fn open_locked(file: File, path: &Path, opts: OpenOptions) -> Result<Image> {
        let mut ctx = ChainCtx {
            force_share: opts.force_share,
            ..ChainCtx::default()
        };
        ctx.visit(&file, path)?;
        Self::open_inner(Box::new(FileStorage::new(file)), path, opts, &mut ctx)
    }

    /// Opens an image on any storage; `path` names it in errors and anchors
    /// relative base names. Used by crash tests.
    pub fn open_storage(
        storage: Box<dyn Storage>,
        path: impl AsRef<Path>,
        opts: OpenOptions,
    ) -> Result<Image> {
        Self::open_inner(storage, path.as_ref(), opts, &mut ChainCtx::default())
    }

    pub(crate) fn open_inner(
        storage: Box<dyn Storage>,
        path: &Path,
        opts: OpenOptions,
        ctx: &mut ChainCtx,
    ) -> Result<Image> {
        let fmt_err = |source| Error::Format {
            path: path.to_owned(),
            source,
        };
        let file_len = storage.len().map_err(io_err(path, "reading the size"))?;
        let (header, header_slot, header_slots) =
            crate::header::read_header(storage.as_ref(), file_len).map_err(|e| match e {
                crate::header::HeaderError::Io(source) => Error::Io {
                    path: path.to_owned(),
                    op: "reading the header",
                    source,
                },
                crate::header::HeaderError::Format(f) => fmt_err(f),
            })?;
        let g = header.geometry;
        let deferred = opts.writable && opts.defer_writing;
        let mut img = Image {
            path: path.to_owned(),
            storage,
            g,
            access: Access {
                writable: opts.writable && !deferred,
                deferred,
                // Nothing may be written back until the open succeeds: a
                // refused image must be left exactly as it was.
                closed: true,
                temporary: false,
            },
            found: OpenFindings {
                dirty_at_open: header.dirty(),
                ..OpenFindings::default()
            },
            header: HeaderState::new(header, header_slot),
            meta: ClusterMap::new(g.words()),
            alloc: Pool::new(g, file_len),
            commit: CommitState::default(),
            base: None,
        };
        for (slot, end) in header_slots.into_iter().enumerate() {
            if let Some(end) = end {
                img.commit
                    .slot_ends
                    .synced(slot as u64 * g.slot_size() as u64, end);
            }
        }
        img.scan(opts.lenient)?;
        img.found.uncommitted_at_open = (file_len >> g.cluster_bits())
            .saturating_sub(img.header.staged.cluster_count)
            + u64::from(!file_len.is_multiple_of(g.cluster_size()));
        if let (Some(base), false) = (img.header.staged.base.clone(), opts.skip_base) {
            let b = crate::chain::open_base(path, &base, ctx)?;
            img.base = Some(Box::new(b));
        }
        // Writing over entries a lenient scan rejected would make the
        // damage permanent; only counters (R10) can be rewritten.
        if let (true, Some(f)) = (
            opts.writable,
            img.found.findings.iter().find(|f| f.rule() != "R10"),
        ) {
            return Err(Error::Format {
                path: path.to_owned(),
                source: f.clone(),
            });
        }
        img.access.closed = false;
        if img.access.writable {
            img.start_writing()?;
        }
        Ok(img)
    }

    /// Starts the writer of an image opened with
    /// [`OpenOptions::defer_writing`]: repairs crash residue and sets DIRTY
    /// (the first write to the file). Nothing to do for a writer already
    /// started; an error for a read-only image.
    pub fn begin_writing(&mut self) -> Result<()> {
        if self.access.deferred {
            self.access.deferred = false;
            self.access.writable = true;
            self.start_writing()?;
        }
        self.require_writable()
    }

    /// Whether the image may be changed: a writer, started or deferred.
    /// The changing calls check this before their own checks, and call
    /// [`Image::begin_writing`] after them.
    pub(crate) fn require_writer(&self) -> Result<()> {
        if self.access.deferred {
            Ok(())
        } else {
            self.require_writable()
        }
    }

    /// Creates a new empty image at `path` and opens it for writing. A
    /// regular file there is replaced, unless another process holds it
    /// ([`Error::Locked`], the file unchanged); anything else there, a
    /// symbolic link included, is refused (see [`crate::output_file`]).
    pub fn create(path: impl AsRef<Path>, opts: &CreateOptions) -> Result<Image> {
        Self::create_mode(path.as_ref(), opts, true)
    }

    /// [`Image::create`] that never replaces: anything at `path` (a file,
    /// a dangling link) is refused with [`Error::Io`] of kind
    /// `AlreadyExists`, after the base chain was opened and checked, and
    /// nothing is written to it.
    pub fn create_new(path: impl AsRef<Path>, opts: &CreateOptions) -> Result<Image> {
        Self::create_mode(path.as_ref(), opts, false)
    }

    fn create_mode(path: &Path, opts: &CreateOptions, replace: bool) -> Result<Image> {
        let cluster_size = opts.cluster_size.unwrap_or(DEFAULT_CLUSTER_SIZE);
        let g = Geometry::from_cluster_size(cluster_size).ok_or_else(|| {
            Error::Invalid(format!(
                "cluster size {cluster_size} must be a power of two from 4096 to 2097152"
            ))
        })?;
        if let Some(b) = &opts.base {
            crate::chain::check_base_name(&b.name)?;
        }
        // An existing file is locked (and visited, so a base chain that
        // leads back to it is a cycle) before anything is decided, and only
        // truncated once everything has been; a new file is only made once
        // the base chain has opened. See `output_file` for what is refused.
        let mut ctx = ChainCtx::default();
        let existing = if replace {
            crate::output_file::open_existing_output(path)?
        } else {
            None
        };
        if let Some(f) = &existing {
            ctx.visit(f, path)?;
        }
        let base = match &opts.base {
            Some(b) => Some(crate::chain::open_base(path, b, &mut ctx)?),
            None => None,
        };
        // The new image is one more in the chain: refused here, before a
        // new file exists, not when it is opened after being made.
        if base
            .as_ref()
            .is_some_and(|b| b.depth() + 1 > crate::format::MAX_CHAIN_DEPTH)
        {
            return Err(Error::ChainTooDeep {
                path: path.to_owned(),
                limit: crate::format::MAX_CHAIN_DEPTH,
            });
        }
        let virtual_size = match (opts.virtual_size, &base) {
            (Some(s), _) => s,
            (None, Some(b)) => b.size().next_multiple_of(g.cluster_size()),
            (None, None) => {
                return Err(Error::Invalid(
                    "a size is needed when there is no base image".into(),
                ))
            }
        };
        check_virtual_size(virtual_size, g)?;
        drop(base);
        let file = match existing {
            Some(f) => f,
            None => crate::output_file::create_new_output(path)?,
        };
        let mut storage = FileStorage::new(file);
        storage.set_len(0).map_err(io_err(path, "truncating"))?;
        let mut header = Header::new(g, virtual_size, opts.base.clone());
        header.generation = 1;
        storage
            .write_at(&header.encode(), 0)
            .map_err(io_err(path, "writing the header"))?;
        storage
            .set_len(g.cluster_size())
            .map_err(io_err(path, "sizing"))?;
        storage.sync().map_err(io_err(path, "syncing"))?;
        let mut ctx = ChainCtx::default();
        if let Some(f) = storage.file() {
            ctx.visit(f, path)?;
        }
        Self::open_inner(Box::new(storage), path, OpenOptions::read_write(), &mut ctx)
    }

    /// Creates an empty image on any storage (crash tests).
    pub fn create_storage(
        mut storage: Box<dyn Storage>,
        path: impl AsRef<Path>,
        cluster_size: u64,
        virtual_size: u64,
    ) -> Result<Image> {
        let path = path.as_ref();
        let g = Geometry::from_cluster_size(cluster_size)
            .ok_or_else(|| Error::Invalid(format!("bad cluster size {cluster_size}")))?;
        check_virtual_size(virtual_size, g)?;
        let mut header = Header::new(g, virtual_size, None);
        header.generation = 1;
        storage.set_len(0).map_err(io_err(path, "truncating"))?;
        storage
            .write_at(&header.encode(), 0)
            .map_err(io_err(path, "writing the header"))?;
        storage
            .set_len(g.cluster_size())
            .map_err(io_err(path, "sizing"))?;
        storage.sync().map_err(io_err(path, "syncing"))?;
        Self::open_storage(storage, path, OpenOptions::read_write())
    }

    /// Repairs crash residue and marks the image DIRTY: the first header
    /// write of a writer. Stale slots go first, or the new header would make
    /// them valid.
    fn start_writing(&mut self) -> Result<()> {
        let path = self.path.clone();
        if !self.found.stale.is_empty() {
            let zeros = crate::format::Slot {
                head: Vec::new(),
                len: self.g.slot_size(),
            };
            let stale = std::mem::take(&mut self.found.stale);
            for &off in &stale {
                self.write_slot(&zeros, off)
                    .map_err(io_err(&path, "zeroing a stale slot"))?;
            }
            self.storage.sync().map_err(io_err(&path, "syncing"))?;
            for off in stale {
                self.commit.slot_ends.synced(off, 0);
            }
        }
        let committed_len = self.g.offset(self.header.staged.cluster_count);
        if self.alloc.file_len != committed_len {
            self.storage
                .set_len(committed_len)
                .map_err(io_err(&path, "truncating uncommitted clusters"))?;
            self.alloc.file_len = committed_len;
        }
        self.header.staged.incompatible |= features::INCOMPAT_DIRTY;
        self.header.staged.autoclear &= features::SUPPORTED_AUTOCLEAR;
        self.commit.meta_dirty = true;
        self.flush()
    }

    /// Clears DIRTY with a final barrier, drops the pre-allocated pool and
    /// closes. Dropping an image does the same but can only log errors.
    pub fn close(mut self) -> Result<()> {
        self.close_inner()
    }

    fn close_inner(&mut self) -> Result<()> {
        if self.access.closed {
            return Ok(());
        }
        self.access.closed = true;
        if !self.access.writable {
            return Ok(());
        }
        self.settle_pending();
        self.header.staged.incompatible &= !features::INCOMPAT_DIRTY;
        self.commit.meta_dirty = true;
        self.flush()?;
        let end = self.g.offset(self.alloc.next_cluster);
        // The file's own length: a pre-allocation worker's refill that went
        // stale (the file grew meanwhile) extended it beyond what the image
        // counts, and is dropped with the pool.
        let len = self
            .storage
            .len()
            .map_err(io_err(&self.path, "dropping the pool"))?
            .max(self.alloc.file_len);
        if len > end {
            self.storage
                .set_len(end)
                .map_err(io_err(&self.path, "dropping the pool"))?;
            self.alloc.file_len = end;
        }
        Ok(())
    }

    /// Renames the image's file to `to`, in the same directory (so that a
    /// relative base name resolves as before), replacing atomically
    /// whatever file is there (`rename(2)`); the image keeps its open file
    /// and its lock, and names itself `to` from now on. The caller syncs
    /// the directory ([`crate::replace::sync_dir`]) when the new name must
    /// survive a crash.
    pub fn rename_in_dir(&mut self, to: &Path) -> Result<()> {
        let dir = |p: &Path| match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
            _ => PathBuf::from("."),
        };
        if dir(&self.path) != dir(to) || to.file_name().is_none() {
            return Err(Error::Invalid(format!(
                "renaming {} to {}: not a file name in the same directory",
                self.path.display(),
                to.display()
            )));
        }
        std::fs::rename(&self.path, to).map_err(io_err(&self.path, "renaming"))?;
        self.path = to.to_owned();
        Ok(())
    }

    /// The image's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Geometry (cluster size and derived sizes).
    pub fn geometry(&self) -> Geometry {
        self.g
    }
    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        self.g.cluster_size()
    }
    /// Virtual size in bytes.
    pub fn virtual_size(&self) -> u64 {
        self.header.staged.virtual_size
    }
    /// Number of data clusters in the file, all layers.
    pub fn allocated_clusters(&self) -> u64 {
        self.meta.entries.len() as u64
    }
    /// The base reference stored in the header.
    pub fn base_ref(&self) -> Option<&BaseRef> {
        self.header.staged.base.as_ref()
    }
    /// The opened base image, if any.
    pub fn base(&self) -> Option<&Backing> {
        self.base.as_deref()
    }
    /// Whether this handle may write.
    pub fn is_writable(&self) -> bool {
        self.access.writable
    }
    /// Whether this handle is a writer, started or deferred
    /// ([`OpenOptions::defer_writing`]): what checks made before the first
    /// write (a device's size limits) ask.
    pub fn is_writer(&self) -> bool {
        self.access.writable || self.access.deferred
    }
    /// Whether this is a temporary overlay ([`Image::create_temporary`]):
    /// an unlinked file whose content goes when it closes.
    pub fn is_temporary(&self) -> bool {
        self.access.temporary
    }
    /// The header as the next barrier will write it.
    pub fn header(&self) -> &Header {
        &self.header.staged
    }
    /// Non-fatal rule violations found by a lenient open.
    pub fn findings(&self) -> &[FormatError] {
        &self.found.findings
    }
    /// The storage's file, if it is one.
    pub fn file(&self) -> Option<&File> {
        self.storage.file()
    }
    /// The storage is a file on tmpfs (looked at when it was opened).
    pub fn on_tmpfs(&self) -> bool {
        self.storage.on_tmpfs()
    }
    /// Committed end of the file in clusters, as staged.
    pub fn cluster_count(&self) -> u64 {
        self.alloc.next_cluster
    }
    /// The active layer.
    pub fn active_layer(&self) -> u32 {
        self.header.staged.active_layer
    }

    pub(crate) fn check_range(&self, offset: u64, len: usize) -> Result<()> {
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|e| e > self.header.staged.virtual_size) {
            return Err(Error::OutOfRange {
                path: self.path.clone(),
                offset,
                len: len as u64,
                size: self.header.staged.virtual_size,
            });
        }
        Ok(())
    }
}

pub(crate) fn check_virtual_size(size: u64, g: Geometry) -> Result<()> {
    if size == 0 || !size.is_multiple_of(g.cluster_size()) || size > MAX_VIRTUAL_SIZE {
        return Err(Error::Invalid(format!(
            "virtual size {size} must be a non-zero multiple of the cluster size {} and at most 2^56",
            g.cluster_size()
        )));
    }
    Ok(())
}

impl Drop for Image {
    fn drop(&mut self) {
        if let Err(e) = self.close_inner() {
            log::error!("{}: closing failed: {e}", self.path.display());
        }
    }
}
