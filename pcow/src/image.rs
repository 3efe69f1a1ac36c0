//! An open pcow image: its staged metadata, lookups through layers and
//! bases, reads, writes and cluster allocation.

use std::collections::HashMap;
use std::fs::{File, OpenOptions as FsOpenOptions};
use std::hash::{BuildHasherDefault, Hasher};
use std::path::{Path, PathBuf};

use crate::chain::{Backing, ChainCtx};
use crate::error::{Error, Result};
use crate::format::{
    features, BaseRef, FormatError, Geometry, Header, MAGIC, MAX_VIRTUAL_SIZE, PAGE_SIZE,
};
use crate::io::{FileStorage, Storage};

/// Multiplicative hash for cluster numbers: the keys are integers that
/// SipHash would spend most of the open time on.
#[derive(Default)]
pub(crate) struct VcnHasher(u64);

impl Hasher for VcnHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

pub(crate) type VcnMap = HashMap<u64, u32, BuildHasherDefault<VcnHasher>>;

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
/// Bytes the writer pre-allocates past the last assigned cluster.
const POOL_BYTES: u64 = 4 << 20;

/// An open pcow image and its base chain.
pub struct Image {
    pub(crate) path: PathBuf,
    pub(crate) storage: Box<dyn Storage>,
    pub(crate) writable: bool,
    pub(crate) g: Geometry,
    /// Staged header: counters and fields as the next barrier will write them.
    pub(crate) header: Header,
    /// Slot (0 = A, 1 = B) holding the committed header.
    pub(crate) header_slot: u8,
    pub(crate) committed_gen: u64,
    pub(crate) layers: Vec<Layer>,
    pub(crate) segments: Vec<Segment>,
    pub(crate) entries: Vec<Entry>,
    /// `W` words per entry, staged.
    pub(crate) bitmaps: Vec<u64>,
    /// End of the last structure (staged `cluster_count`).
    pub(crate) next_cluster: u64,
    /// Physical length of the file, pool included.
    pub(crate) file_len: u64,
    pool_clusters: u64,
    /// Clusters an allocation that finds the pool empty adds beyond what it
    /// needs; `None` is the pool's size.
    inline_clusters: Option<u64>,
    /// Data was written since the last sync.
    pub(crate) data_dirty: bool,
    /// Staged metadata differs from the committed image.
    pub(crate) meta_dirty: bool,
    /// File offsets of stale or torn slots found by the scan (L2).
    pub(crate) stale: Vec<u64>,
    /// What the file holds past each slot's content (short slot writes).
    pub(crate) slot_ends: crate::slot_ends::SlotEnds,
    /// Clusters past the committed end at open time (L1).
    pub(crate) uncommitted_at_open: u64,
    /// DIRTY was set when the image was opened (L3).
    pub(crate) dirty_at_open: bool,
    pub(crate) findings: Vec<FormatError>,
    pub(crate) base: Option<Box<Backing>>,
    /// An unlinked overlay made by [`Image::create_temporary`].
    pub(crate) temporary: bool,
    /// Opened for writing and exclusively locked, but the writer has not
    /// started: nothing written yet ([`OpenOptions::defer_writing`]).
    deferred: bool,
    closed: bool,
    /// The commit begun and not yet finished or aborted.
    pub(crate) pending: Option<crate::barrier::Pending>,
    /// Numbers commits, so that a stale [`crate::Commit`] is refused.
    pub(crate) commit_seq: u64,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("path", &self.path)
            .field("writable", &self.writable)
            .field("virtual_size", &self.header.virtual_size)
            .field("cluster_size", &self.g.cluster_size())
            .finish()
    }
}

pub(crate) fn io_err<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        path: path.to_owned(),
        op,
        source,
    }
}

/// Takes an advisory lock on the whole file; a conflict that outlasts
/// [`crate::lock::lock`]'s retries is [`Error::Locked`].
pub(crate) fn lock_file(file: &File, path: &Path, exclusive: bool) -> Result<()> {
    match crate::lock::lock(file, exclusive) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::Locked {
            path: path.to_owned(),
        }),
        Err(e) => Err(io_err(path, "locking")(e)),
    }
}

/// Whether the file starts with the pcow magic.
pub fn is_pcow(file: &File) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut m = [0u8; 8];
    match file.read_exact_at(&mut m, 0) {
        Ok(()) => Ok(m == MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

impl Image {
    /// Opens the image at `path` and its base chain.
    pub fn open(path: impl AsRef<Path>, opts: OpenOptions) -> Result<Image> {
        let path = path.as_ref();
        let file = FsOpenOptions::new()
            .read(true)
            .write(opts.writable)
            .open(path)
            .map_err(io_err(path, "opening"))?;
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
            crate::scan::read_header(storage.as_ref(), file_len).map_err(|e| match e {
                crate::scan::HeaderError::Io(source) => Error::Io {
                    path: path.to_owned(),
                    op: "reading the header",
                    source,
                },
                crate::scan::HeaderError::Format(f) => fmt_err(f),
            })?;
        let g = header.geometry;
        let deferred = opts.writable && opts.defer_writing;
        let mut img = Image {
            path: path.to_owned(),
            storage,
            writable: opts.writable && !deferred,
            g,
            committed_gen: header.generation,
            dirty_at_open: header.dirty(),
            header,
            header_slot,
            layers: Vec::new(),
            segments: Vec::new(),
            entries: Vec::new(),
            bitmaps: Vec::new(),
            next_cluster: 0,
            file_len,
            pool_clusters: (POOL_BYTES >> g.cluster_bits()).max(1),
            inline_clusters: None,
            data_dirty: false,
            meta_dirty: false,
            stale: Vec::new(),
            slot_ends: crate::slot_ends::SlotEnds::default(),
            uncommitted_at_open: 0,
            findings: Vec::new(),
            base: None,
            temporary: false,
            deferred,
            pending: None,
            commit_seq: 0,
            // Nothing may be written back until the open succeeds: a
            // refused image must be left exactly as it was.
            closed: true,
        };
        for (slot, end) in header_slots.into_iter().enumerate() {
            if let Some(end) = end {
                img.slot_ends
                    .synced(slot as u64 * g.slot_size() as u64, end);
            }
        }
        img.scan(opts.lenient)?;
        img.uncommitted_at_open = (file_len >> g.cluster_bits())
            .saturating_sub(img.header.cluster_count)
            + u64::from(!file_len.is_multiple_of(g.cluster_size()));
        if let (Some(base), false) = (img.header.base.clone(), opts.skip_base) {
            let b = crate::chain::open_base(path, &base, ctx)?;
            img.base = Some(Box::new(b));
        }
        // Writing over entries a lenient scan rejected would make the
        // damage permanent; only counters (R10) can be rewritten.
        if let (true, Some(f)) = (
            opts.writable,
            img.findings.iter().find(|f| f.rule() != "R10"),
        ) {
            return Err(Error::Format {
                path: path.to_owned(),
                source: f.clone(),
            });
        }
        img.closed = false;
        if img.writable {
            img.start_writing()?;
        }
        Ok(img)
    }

    /// Starts the writer of an image opened with
    /// [`OpenOptions::defer_writing`]: repairs crash residue and sets DIRTY
    /// (the first write to the file). Nothing to do for a writer already
    /// started; an error for a read-only image.
    pub fn begin_writing(&mut self) -> Result<()> {
        if self.deferred {
            self.deferred = false;
            self.writable = true;
            self.start_writing()?;
        }
        self.require_writable()
    }

    /// Whether the image may be changed: a writer, started or deferred.
    /// The changing calls check this before their own checks, and call
    /// [`Image::begin_writing`] after them.
    pub(crate) fn require_writer(&self) -> Result<()> {
        if self.deferred {
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
        let path = path.as_ref();
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
        let existing = crate::output_file::open_existing_output(path)?;
        if let Some(f) = &existing {
            ctx.visit(f, path)?;
        }
        let base = match &opts.base {
            Some(b) => Some(crate::chain::open_base(path, b, &mut ctx)?),
            None => None,
        };
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
        if !self.stale.is_empty() {
            let zeros = vec![0u8; self.g.slot_size()];
            let stale = std::mem::take(&mut self.stale);
            for &off in &stale {
                self.write_slot(&zeros, off)
                    .map_err(io_err(&path, "zeroing a stale slot"))?;
            }
            self.storage.sync().map_err(io_err(&path, "syncing"))?;
            for off in stale {
                self.slot_ends.synced(off, 0);
            }
        }
        let committed_len = self.g.offset(self.header.cluster_count);
        if self.file_len != committed_len {
            self.storage
                .set_len(committed_len)
                .map_err(io_err(&path, "truncating uncommitted clusters"))?;
            self.file_len = committed_len;
        }
        self.header.incompatible |= features::INCOMPAT_DIRTY;
        self.header.autoclear &= features::SUPPORTED_AUTOCLEAR;
        self.meta_dirty = true;
        self.flush()
    }

    /// Clears DIRTY with a final barrier, drops the pre-allocated pool and
    /// closes. Dropping an image does the same but can only log errors.
    pub fn close(mut self) -> Result<()> {
        self.close_inner()
    }

    fn close_inner(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        if !self.writable {
            return Ok(());
        }
        self.settle_pending();
        self.header.incompatible &= !features::INCOMPAT_DIRTY;
        self.meta_dirty = true;
        self.flush()?;
        let end = self.g.offset(self.next_cluster);
        // The file's own length: a pre-allocation worker's refill that went
        // stale (the file grew meanwhile) extended it beyond what the image
        // counts, and is dropped with the pool.
        let len = self
            .storage
            .len()
            .map_err(io_err(&self.path, "dropping the pool"))?
            .max(self.file_len);
        if len > end {
            self.storage
                .set_len(end)
                .map_err(io_err(&self.path, "dropping the pool"))?;
            self.file_len = end;
        }
        Ok(())
    }

    // ----- accessors -----

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
        self.header.virtual_size
    }
    /// Number of data clusters in the file, all layers.
    pub fn allocated_clusters(&self) -> u64 {
        self.entries.len() as u64
    }
    /// The base reference stored in the header.
    pub fn base_ref(&self) -> Option<&BaseRef> {
        self.header.base.as_ref()
    }
    /// The opened base image, if any.
    pub fn base(&self) -> Option<&Backing> {
        self.base.as_deref()
    }
    /// Whether this handle may write.
    pub fn is_writable(&self) -> bool {
        self.writable
    }
    /// Whether this is a temporary overlay ([`Image::create_temporary`]):
    /// an unlinked file whose content goes when it closes.
    pub fn is_temporary(&self) -> bool {
        self.temporary
    }
    /// The header as the next barrier will write it.
    pub fn header(&self) -> &Header {
        &self.header
    }
    /// Non-fatal rule violations found by a lenient open.
    pub fn findings(&self) -> &[FormatError] {
        &self.findings
    }
    /// The storage's file, if it is one.
    pub fn file(&self) -> Option<&File> {
        self.storage.file()
    }
    /// Committed end of the file in clusters, as staged.
    pub fn cluster_count(&self) -> u64 {
        self.next_cluster
    }
    /// Sets how many clusters the writer pre-allocates ahead.
    pub fn set_pool_clusters(&mut self, n: u64) {
        self.pool_clusters = n.max(1);
    }

    /// Sets how many clusters an allocation that finds the pool empty
    /// reserves beyond what it needs (default, and at most: the pool's
    /// size). A device whose worker refills the pool keeps this small, so
    /// that the write fault that ran the pool dry reserves a little and the
    /// worker the rest.
    pub fn set_inline_growth(&mut self, n: u64) {
        self.inline_clusters = Some(n.max(1));
    }

    // ----- lookups -----

    pub(crate) fn bitmap(&self, e: u32) -> &[u64] {
        let w = self.g.words();
        &self.bitmaps[e as usize * w..(e as usize + 1) * w]
    }

    pub(crate) fn bit(&self, e: u32, page: usize) -> bool {
        self.bitmap(e)[page / 64] & (1 << (page % 64)) != 0
    }

    fn set_bits(&mut self, e: u32, first: usize, last: usize) {
        let w = self.g.words();
        let bm = &mut self.bitmaps[e as usize * w..(e as usize + 1) * w];
        for p in first..=last {
            bm[p / 64] |= 1 << (p % 64);
        }
        let seg = self.entries[e as usize].seg as usize;
        self.segments[seg].dirty = true;
        self.meta_dirty = true;
    }

    /// Layers from `layer` down to layer 0.
    pub(crate) fn path_of(&self, layer: Option<u32>) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(layer, move |l| self.layers[*l as usize].parent)
    }

    /// The source of page `page` of cluster `vcn` in the view of `layer`
    /// (`None`: the view below layer 0, the base).
    pub(crate) fn page_src(&self, layer: Option<u32>, vcn: u64, page: usize) -> PageSrc {
        for l in self.path_of(layer) {
            if let Some(&e) = self.layers[l as usize].map.get(&vcn) {
                if self.bit(e, page) {
                    return PageSrc::Local(self.entries[e as usize].cluster);
                }
            }
        }
        if self.base.is_some() {
            PageSrc::Base
        } else {
            PageSrc::Zero
        }
    }

    /// Whether anything in the view of `layer` (or below it) holds data in
    /// the byte range `[off, off + len)`.
    pub(crate) fn view_has_data(&self, layer: Option<u32>, off: u64, len: u64) -> bool {
        let cs = self.g.cluster_size();
        let (first, last) = (off / cs, (off + len - 1) / cs);
        for vcn in first..=last {
            if self
                .path_of(layer)
                .any(|l| self.layers[l as usize].map.contains_key(&vcn))
            {
                return true;
            }
        }
        self.base.as_ref().is_some_and(|b| b.has_data(off, len))
    }

    /// The active layer.
    pub fn active_layer(&self) -> u32 {
        self.header.active_layer
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<()> {
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|e| e > self.header.virtual_size) {
            return Err(Error::OutOfRange {
                path: self.path.clone(),
                offset,
                len: len as u64,
                size: self.header.virtual_size,
            });
        }
        Ok(())
    }

    // ----- reads -----

    /// Reads the image's content (the active layer's view).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check_range(offset, buf.len())?;
        self.read_view(Some(self.header.active_layer), buf, offset)
    }

    /// Reads the view of `layer` (`None`: the base below layer 0). Bytes past
    /// the virtual size read as zeros (a larger overlay reading its base).
    pub(crate) fn read_view(&self, layer: Option<u32>, buf: &mut [u8], offset: u64) -> Result<()> {
        let vs = self.header.virtual_size;
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

    // ----- writes -----

    /// Writes into the active layer. Durable at the next [`Image::flush`].
    pub fn write_at(&mut self, data: &[u8], offset: u64) -> Result<()> {
        self.require_writer()?;
        self.check_range(offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        self.begin_writing()?;
        self.write_layer(self.header.active_layer, data, offset)
    }

    /// Writes into `layer`; pages not fully covered are first filled from
    /// the view below it (the 4 KiB copy-on-write).
    pub(crate) fn write_layer(&mut self, layer: u32, data: &[u8], offset: u64) -> Result<()> {
        let cs = self.g.cluster_size();
        let parent = self.layers[layer as usize].parent;
        let mut done = 0usize;
        while done < data.len() {
            let off = offset + done as u64;
            let vcn = off / cs;
            let start = off % cs;
            let len = ((cs - start) as usize).min(data.len() - done);
            let chunk = &data[done..done + len];
            let e = match self.layers[layer as usize].map.get(&vcn) {
                Some(&e) => e,
                None => {
                    let mut bm = vec![0u64; self.g.words()];
                    if !self.view_has_data(parent, vcn * cs, cs) {
                        // Nothing below: the fresh (zero) cluster is the
                        // whole truth.
                        self.g.full_bitmap(&mut bm);
                    }
                    self.alloc_entry(layer, vcn, &bm)?
                }
            };
            let base = self.g.offset(self.entries[e as usize].cluster);
            let first = (start / PAGE_SIZE) as usize;
            let last = ((start + len as u64 - 1) / PAGE_SIZE) as usize;
            let mut lo = start; // first byte of the chunk still to write
            let mut hi = start + len as u64; // end of the chunk still to write
            let page_of = |p: usize| p as u64 * PAGE_SIZE;
            let covers = |p: usize, lo: u64, hi: u64| lo <= page_of(p) && hi >= page_of(p + 1);
            if !self.bit(e, first) && !covers(first, lo, hi) {
                let p_end = page_of(first + 1).min(hi);
                self.fill_page(
                    parent,
                    vcn,
                    first,
                    base,
                    &chunk[..(p_end - start) as usize],
                    start,
                )?;
                lo = p_end;
            }
            if lo < hi && last != first && !self.bit(e, last) && !covers(last, lo, hi) {
                let p_start = page_of(last);
                self.fill_page(
                    parent,
                    vcn,
                    last,
                    base,
                    &chunk[(p_start - start) as usize..],
                    p_start,
                )?;
                hi = p_start;
            }
            if lo < hi {
                let part = &chunk[(lo - start) as usize..(hi - start) as usize];
                self.storage
                    .write_at(part, base + lo)
                    .map_err(io_err(&self.path, "writing data"))?;
            }
            self.set_bits(e, first, last);
            self.data_dirty = true;
            done += len;
        }
        Ok(())
    }

    /// Writes page `page` of a cluster at file offset `base`: the view of
    /// `below` with `part` laid over it at in-cluster offset `at`.
    fn fill_page(
        &mut self,
        below: Option<u32>,
        vcn: u64,
        page: usize,
        base: u64,
        part: &[u8],
        at: u64,
    ) -> Result<()> {
        let page_off = page as u64 * PAGE_SIZE;
        let mut buf = vec![0u8; PAGE_SIZE as usize];
        self.read_view(below, &mut buf, vcn * self.g.cluster_size() + page_off)?;
        let o = (at - page_off) as usize;
        buf[o..o + part.len()].copy_from_slice(part);
        self.storage
            .write_at(&buf, base + page_off)
            .map_err(io_err(&self.path, "writing data"))
    }

    // ----- allocation -----

    /// Makes sure clusters up to `end` exist in the file, growing it by the
    /// pool size at a time.
    pub(crate) fn ensure_space(&mut self, end: u64) -> Result<()> {
        self.ensure_space_as(end, Space::Reserved)
    }

    /// [`Image::ensure_space`], growing the file as `space` says.
    fn ensure_space_as(&mut self, end: u64, space: Space) -> Result<()> {
        let need = self.g.offset(end);
        if need <= self.file_len {
            return Ok(());
        }
        if space == Space::Written {
            // A pre-allocation worker may have extended the file beyond
            // what the image counts (its completion is then stale):
            // never shrink.
            let real = self
                .storage
                .len()
                .map_err(io_err(&self.path, "allocating clusters"))?;
            if real < need {
                self.storage
                    .set_len(need)
                    .map_err(io_err(&self.path, "allocating clusters"))?;
            }
            self.file_len = need;
            return Ok(());
        }
        let ahead = self
            .inline_clusters
            .map_or(self.pool_clusters, |n| n.min(self.pool_clusters));
        let new_len = self.g.offset(end + ahead);
        self.storage
            .allocate(self.file_len, new_len - self.file_len)
            .map_err(io_err(&self.path, "allocating clusters"))?;
        self.file_len = new_len;
        Ok(())
    }

    fn check_cluster_limit(&self, extra: u64) -> Result<()> {
        if self.next_cluster + extra >= (1u64 << (62 - self.g.cluster_bits())) {
            return Err(Error::Limit {
                path: self.path.clone(),
                what: "file too large".into(),
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

    /// [`Image::alloc_entry`], the file grown as `space` says.
    fn alloc_entry_as(
        &mut self,
        layer: u32,
        vcn: u64,
        bitmap: &[u64],
        space: Space,
    ) -> Result<u32> {
        let cap = self.g.capacity();
        let extend = self.segments.last().is_some_and(|s| {
            s.layer == layer && s.used < cap && s.meta + 1 + u64::from(s.used) == self.next_cluster
        });
        let need = if extend { 1 } else { 2 };
        self.check_cluster_limit(need)?;
        self.ensure_space_as(self.next_cluster + need, space)?;
        if !extend {
            self.slot_ends
                .forget_cluster(self.g.offset(self.next_cluster), self.g.slot_size());
            self.segments.push(Segment {
                meta: self.next_cluster,
                layer,
                first: self.entries.len() as u32,
                used: 0,
                cur_slot: None,
                dirty: true,
            });
            self.next_cluster += 1;
        }
        let seg_idx = self.segments.len() - 1;
        let idx = self.entries.len() as u32;
        self.entries.push(Entry {
            vcn,
            cluster: self.next_cluster,
            seg: seg_idx as u32,
        });
        self.bitmaps.extend_from_slice(bitmap);
        let seg = &mut self.segments[seg_idx];
        seg.used += 1;
        seg.dirty = true;
        self.next_cluster += 1;
        self.layers[layer as usize].map.insert(vcn, idx);
        self.header.data_cluster_count = self.entries.len() as u64;
        self.meta_dirty = true;
        Ok(idx)
    }

    /// Refuses a new layer past the format's limits (checked before a
    /// snapshot operation writes anything).
    pub(crate) fn check_layer_room(&self) -> Result<()> {
        if self.layers.len() as u64 >= u64::from(crate::format::MAX_LAYERS) {
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
        let n = self.layers.len() as u32;
        self.ensure_space(self.next_cluster + 1)?;
        self.slot_ends
            .forget_cluster(self.g.offset(self.next_cluster), self.g.slot_size());
        self.layers.push(Layer {
            start: self.next_cluster,
            parent: Some(parent),
            snap,
            map: VcnMap::default(),
            cur_slot: None,
            dirty: true,
        });
        self.next_cluster += 1;
        self.header.layer_count = n + 1;
        self.meta_dirty = true;
        Ok(n)
    }

    /// The active layer's data cluster for `vcn`, allocated from the pool if
    /// it has none yet: for a device that writes guest data through a
    /// mapping of the file rather than through [`Image::write_at`].
    pub fn active_cluster(&mut self, vcn: u64) -> Result<ActiveCluster> {
        self.active_cluster_as(vcn, Space::Reserved)
    }

    /// [`Image::active_cluster`] for a caller that writes (`pwrite`) every
    /// page of the cluster before it maps it, if it ever does: a new
    /// cluster still takes the pool's next reserved cluster, but when the
    /// pool is empty the file only grows (sparse) to hold it, and its
    /// space is allocated by the writes that fill it. A device's barrier
    /// copying a few pages into a cluster allocates those pages, not the
    /// whole cluster (on tmpfs, 2 MiB of memory for a 4 KiB page).
    ///
    /// A cluster mapped shared before its pages are written needs
    /// [`Image::active_cluster`]: a write through a mapping into space the
    /// file system cannot allocate is a SIGBUS, not an error.
    pub fn active_cluster_written(&mut self, vcn: u64) -> Result<ActiveCluster> {
        self.active_cluster_as(vcn, Space::Written)
    }

    fn active_cluster_as(&mut self, vcn: u64, space: Space) -> Result<ActiveCluster> {
        if !self.writable {
            return Err(Error::ReadOnly {
                path: self.path.clone(),
            });
        }
        let cs = self.g.cluster_size();
        if vcn >= self.header.virtual_size / cs {
            return Err(Error::OutOfRange {
                path: self.path.clone(),
                offset: vcn.saturating_mul(cs),
                len: cs,
                size: self.header.virtual_size,
            });
        }
        let layer = self.header.active_layer;
        let (e, fresh) = match self.layers[layer as usize].map.get(&vcn) {
            Some(&e) => (e, false),
            None => {
                let mut bm = vec![0u64; self.g.words()];
                if !self.view_has_data(self.layers[layer as usize].parent, vcn * cs, cs) {
                    self.g.full_bitmap(&mut bm);
                }
                (self.alloc_entry_as(layer, vcn, &bm, space)?, true)
            }
        };
        let pages = self.g.pages();
        Ok(ActiveCluster {
            file_offset: self.g.offset(self.entries[e as usize].cluster),
            fresh,
            whole: (0..pages).all(|p| self.bit(e, p)),
        })
    }

    /// Records that pages `[first, first + count)` of the active layer's
    /// cluster `vcn` now hold this layer's data (the 4 KiB copy-on-write).
    /// The data must already be in the cluster; both become durable at the
    /// next barrier, data first.
    pub fn record_pages(&mut self, vcn: u64, first: usize, count: usize) -> Result<()> {
        let layer = self.header.active_layer as usize;
        let e = *self.layers[layer].map.get(&vcn).ok_or_else(|| {
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
        self.data_dirty = true;
        Ok(())
    }

    /// Tells the next barrier that data reached the file through a mapping,
    /// so it must sync before committing metadata.
    pub fn mark_data_written(&mut self) {
        self.data_dirty = true;
    }

    /// The files of the chain, by depth: 0 is this image, 1 its base, ...
    /// (what a device maps; the depth is the one [`ClusterSource`] names).
    pub fn chain_files(&self) -> Vec<&File> {
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

    /// The paths of the chain, by depth (as [`Image::chain_files`]).
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
        let e = *self.layers[self.header.active_layer as usize]
            .map
            .get(&vcn)?;
        Some(self.g.offset(self.entries[e as usize].cluster))
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
        let layer = self.header.active_layer;
        let cs = self.g.cluster_size();
        let parent = self.layers[layer as usize].parent;
        let missing: Vec<u64> = (0..self.header.virtual_size / cs)
            .filter(|&v| {
                !self.layers[layer as usize].map.contains_key(&v)
                    && !self.view_has_data(parent, v * cs, cs)
            })
            .collect();
        if missing.is_empty() {
            return Ok(0);
        }
        // One reservation for all of them and their meta clusters.
        let metas = missing.len() as u64 / u64::from(self.g.capacity()) + 2;
        let saved = (self.pool_clusters, self.inline_clusters.take());
        self.pool_clusters = missing.len() as u64 + metas;
        let zeros = vec![0u8; cs as usize];
        let result = (|| {
            for &vcn in &missing {
                let ac = self.active_cluster_as(vcn, Space::Reserved)?;
                if mode == Preallocation::Full {
                    self.storage
                        .write_at(&zeros, ac.file_offset)
                        .map_err(io_err(&self.path, "writing zeros"))?;
                    self.data_dirty = true;
                }
            }
            Ok(())
        })();
        (self.pool_clusters, self.inline_clusters) = saved;
        result?;
        self.flush()?;
        Ok(missing.len() as u64)
    }

    /// Grows the pre-allocated pool to its full size now, so that later
    /// allocations (a device's write faults) do not have to. Returns the
    /// clusters added to the file.
    pub fn fill_pool(&mut self) -> Result<u64> {
        if !self.writable {
            return Err(Error::ReadOnly {
                path: self.path.clone(),
            });
        }
        let before = self.file_len;
        let want = self.g.offset(self.next_cluster + self.pool_clusters);
        if want > self.file_len {
            self.storage
                .allocate(self.file_len, want - self.file_len)
                .map_err(io_err(&self.path, "allocating clusters"))?;
            self.file_len = want;
        }
        Ok((self.file_len - before) >> self.g.cluster_bits())
    }

    /// For a pre-allocation worker: the byte range `(offset, len)` of the
    /// image file to reserve (fallocate) so that the pool holds its full
    /// size again, or `None` when it does.
    pub fn pool_shortfall(&self) -> Option<(u64, u64)> {
        let want = self.g.offset(self.next_cluster + self.pool_clusters);
        (self.writable && want > self.file_len).then(|| (self.file_len, want - self.file_len))
    }

    /// Records that a worker reserved `[offset, offset + len)` of the image
    /// file. Only a range that continues the file exactly is taken (an
    /// allocation may have grown the file itself meanwhile); returns
    /// whether it was.
    pub fn pool_reserved(&mut self, offset: u64, len: u64) -> bool {
        let whole = len.is_multiple_of(self.g.cluster_size());
        if offset != self.file_len || !whole {
            return false;
        }
        self.file_len += len;
        true
    }

    /// Where each 4 KiB page of virtual cluster `vcn` of the image's view
    /// lives, in the chain's files (see [`Image::chain_files`]).
    pub fn cluster_source(&self, vcn: u64) -> ClusterSource {
        let cs = self.g.cluster_size();
        let active = self.header.active_layer;
        if let Some(&e) = self.layers[active as usize].map.get(&vcn) {
            if (0..self.g.pages()).all(|p| self.bit(e, p)) {
                return ClusterSource::Active {
                    offset: self.g.offset(self.entries[e as usize].cluster),
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
        if off >= self.header.virtual_size {
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

    /// Makes every cluster of the active layer whole: pages it does not
    /// hold are copied from the view below and recorded, so that a device
    /// can map each active cluster shared as one piece. The view does not
    /// change; durable at the next barrier. Returns the clusters completed.
    pub fn complete_active_clusters(&mut self) -> Result<u64> {
        if !self.writable {
            return Err(Error::ReadOnly {
                path: self.path.clone(),
            });
        }
        let active = self.header.active_layer;
        let parent = self.layers[active as usize].parent;
        let pages = self.g.pages();
        let mut partial: Vec<(u64, u32)> = self.layers[active as usize]
            .map
            .iter()
            .filter(|(_, &e)| !(0..pages).all(|p| self.bit(e, p)))
            .map(|(&v, &e)| (v, e))
            .collect();
        partial.sort_unstable();
        let cs = self.g.cluster_size();
        let mut page = vec![0u8; PAGE_SIZE as usize];
        for &(vcn, e) in &partial {
            let base = self.g.offset(self.entries[e as usize].cluster);
            let missing: Vec<usize> = (0..pages).filter(|&p| !self.bit(e, p)).collect();
            for p in missing {
                let off = p as u64 * PAGE_SIZE;
                self.read_view(parent, &mut page, vcn * cs + off)?;
                self.storage
                    .write_at(&page, base + off)
                    .map_err(io_err(&self.path, "writing data"))?;
            }
            self.set_bits(e, 0, pages - 1);
            self.data_dirty = true;
        }
        Ok(partial.len() as u64)
    }

    /// Drops every layer, snapshot and data cluster: the image becomes
    /// empty over its base. Committed at once; the old clusters become
    /// uncommitted space, truncated at close.
    pub(crate) fn reset_empty(&mut self) -> Result<()> {
        self.require_no_commit()?;
        self.layers.truncate(1);
        let root = &mut self.layers[0];
        root.map.clear();
        root.snap = None;
        self.segments.clear();
        self.entries.clear();
        self.bitmaps.clear();
        self.next_cluster = 1;
        self.header.active_layer = 0;
        self.meta_dirty = true;
        self.flush()
    }

    /// Places a whole cluster's bytes for `(layer, vcn)` with exactly
    /// `bitmap` (compact copies layers this way, bit for bit).
    pub(crate) fn put_cluster(
        &mut self,
        layer: u32,
        vcn: u64,
        bitmap: &[u64],
        data: &[u8],
    ) -> Result<()> {
        let e = self.alloc_entry(layer, vcn, bitmap)?;
        let off = self.g.offset(self.entries[e as usize].cluster);
        self.storage
            .write_at(data, off)
            .map_err(io_err(&self.path, "writing data"))?;
        self.data_dirty = true;
        Ok(())
    }

    /// Grows the virtual size.
    pub fn grow(&mut self, new_size: u64) -> Result<()> {
        self.require_writer()?;
        self.require_no_commit()?;
        check_virtual_size(new_size, self.g)?;
        if new_size < self.header.virtual_size {
            return Err(Error::Invalid(format!(
                "shrinking from {} to {new_size} bytes is not supported",
                self.header.virtual_size
            )));
        }
        self.begin_writing()?;
        let old_size = self.header.virtual_size;
        self.header.virtual_size = new_size;
        self.meta_dirty = true;
        // The new range reads as zeros in every view, as qemu does, even
        // where a longer base has data: layer 0 (below every view) gets zero
        // pages there, committed by the same barrier as the new size. Should
        // a write fail, the size stays staged so that the entries written so
        // far stay inside it.
        if self
            .base
            .as_ref()
            .is_some_and(|b| b.has_data(old_size, new_size - old_size))
        {
            let cs = self.g.cluster_size();
            let zeros = vec![0u8; cs as usize];
            for vcn in old_size / cs..new_size / cs {
                let off = vcn * cs;
                if self.base.as_ref().is_some_and(|b| b.has_data(off, cs)) {
                    self.write_layer(0, &zeros, off)?;
                }
            }
        }
        self.flush()
    }

    /// Ranges of the image's view in virtual order, each with where its
    /// bytes live; adjacent ranges with contiguous sources are merged.
    pub fn extents(&self) -> Vec<Extent> {
        let all = [(0, self.header.virtual_size)];
        self.view_extents(Some(self.header.active_layer), &all, 0)
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
            .path_of(layer)
            .flat_map(|l| self.layers[l as usize].map.keys().copied())
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

/// Merges two offset-sorted extent lists into one, coalescing neighbours.
pub(crate) fn merge_extents(a: Vec<Extent>, b: Vec<Extent>) -> Vec<Extent> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut a, mut b) = (a.into_iter().peekable(), b.into_iter().peekable());
    loop {
        let next = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) if x.offset <= y.offset => a.next(),
            (Some(_), Some(_)) => b.next(),
            (Some(_), None) => a.next(),
            (None, Some(_)) => b.next(),
            (None, None) => break,
        };
        if let Some(e) = next {
            push_extent(&mut out, e);
        }
    }
    out
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
        /// Index into [`Image::chain_files`].
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
        /// Index into [`Image::chain_files`].
        depth: usize,
        /// Byte offset in that file.
        offset: u64,
    },
}

/// How much of an image [`Image::preallocate`] allocates up front, named
/// as qemu-img's `preallocation=` option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preallocation {
    /// Nothing: clusters are allocated on first write (thin).
    Off,
    /// Every cluster reserved with `fallocate`.
    Falloc,
    /// Every cluster reserved and its zeros written.
    Full,
}

impl std::str::FromStr for Preallocation {
    type Err = Error;
    fn from_str(s: &str) -> Result<Preallocation> {
        match s {
            "off" => Ok(Preallocation::Off),
            "falloc" => Ok(Preallocation::Falloc),
            "full" => Ok(Preallocation::Full),
            "metadata" => Err(Error::Invalid(
                "preallocation=metadata is not offered: a pcow image's clusters are mapped into \
                 the guest, and a guest write into file space not yet allocated on a full file \
                 system is a SIGBUS, not an error; use falloc"
                    .into(),
            )),
            _ => Err(Error::Invalid(format!(
                "unknown preallocation mode {s:?} (expected off, falloc or full)"
            ))),
        }
    }
}

/// How a new cluster's space is made in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Space {
    /// Reserved (fallocated), with the pool grown ahead: safe to map and
    /// write through the mapping.
    Reserved,
    /// The file only extended, when the pool is empty: every page is
    /// written with `pwrite` (which reports ENOSPC) before it is mapped.
    Written,
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

/// A range of the view and where its bytes live.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Extent {
    /// Virtual offset.
    pub offset: u64,
    /// Length in bytes.
    pub length: u64,
    /// 0: the top image, 1: its base, ...
    pub depth: usize,
    /// The file holding the bytes (for zeros: the deepest image consulted).
    pub file: PathBuf,
    /// Offset in `file`, or `None` for zeros.
    pub file_offset: Option<u64>,
}

pub(crate) fn push_extent(out: &mut Vec<Extent>, e: Extent) {
    if let Some(last) = out.last_mut() {
        let contiguous = match (last.file_offset, e.file_offset) {
            (Some(a), Some(b)) => a + last.length == b && last.file == e.file,
            (None, None) => true,
            _ => false,
        };
        if contiguous && last.depth == e.depth && last.offset + last.length == e.offset {
            last.length += e.length;
            return;
        }
    }
    out.push(e);
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
