//! Temporary overlays: an image in an unlinked file over a base chain that
//! is only read, for a writer whose writes are to be thrown away
//! (`discard_writes`: many VMs on one image, each with its own writes).
//!
//! - The file has no name from the start (`O_TMPFILE`) where the file
//!   system supports it; elsewhere it is created under a unique name and
//!   unlinked at once (a crash in between leaves that one file, named
//!   `.NAME.discard-PID-N`). Closing it, or the death of the process,
//!   frees it: nothing is left behind.
//! - The base chain is opened read-only under shared locks, as any base:
//!   other readers and other temporary overlays may share it, writers are
//!   refused while it is held. The overlay file itself is locked
//!   exclusively.
//! - Syncs are skipped: durability is pointless for a file that cannot
//!   outlive the process. Barriers still commit metadata, so the image
//!   stays consistent for every reader in the process.

use std::fs::{File, OpenOptions as FsOpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::chain::{open_base, Backing, ChainCtx};
use crate::error::io_err;
use crate::error::{Error, Result};
use crate::format::{BaseFormat, BaseRef, Geometry, Header};
use crate::image::{check_virtual_size, Image, OpenOptions};
use crate::io::{CommitIo, FileStorage, Storage};
use crate::lock::lock_file;
use crate::DEFAULT_CLUSTER_SIZE;

/// Where and how a temporary overlay is made.
#[derive(Debug, Clone, Default)]
pub struct TempOptions {
    /// The directory of the overlay's file; `None` is the base image's
    /// directory.
    pub dir: Option<PathBuf>,
    /// Do not try `O_TMPFILE`: create a named file and unlink it (what is
    /// done where the file system has no `O_TMPFILE`; tests use it).
    pub named: bool,
}

/// Numbers the overlays of this process (unique names).
static SEQ: AtomicU64 = AtomicU64::new(0);

/// A file's storage without syncs: its content never needs to outlive
/// the process.
#[derive(Debug)]
struct VolatileStorage(FileStorage);

impl Storage for VolatileStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.0.write_at(buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.0.len()
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn allocate(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.0.allocate(offset, len)
    }
    fn file(&self) -> Option<&File> {
        self.0.file()
    }
    fn on_tmpfs(&self) -> bool {
        self.0.on_tmpfs()
    }
    fn commit_io(&self) -> io::Result<Box<dyn CommitIo>> {
        Ok(Box::new(VolatileCommitIo(self.0.commit_io()?)))
    }
}

/// A volatile storage's commit handle: writes, no syncs.
struct VolatileCommitIo(Box<dyn CommitIo>);

impl CommitIo for VolatileCommitIo {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.0.write_at(buf, offset)
    }
    fn write_beside_fallocate(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.0.write_beside_fallocate(buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A name no file of this process has used: `.NAME.discard-PID-N`.
fn unique_name(file_name: &str) -> String {
    format!(
        ".{file_name}.discard-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Names tried before giving up on a directory full of leftovers (files
/// of a crashed process whose id this one now has).
const NAME_TRIES: usize = 16;

/// Opens a new file in `dir` that has no name: `O_TMPFILE`, or a unique
/// name unlinked at once. Returns it and the name it is called by in
/// messages.
fn create_unlinked(dir: &Path, file_name: &str, named: bool) -> Result<(File, String)> {
    if !named {
        match FsOpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(dir)
        {
            Ok(f) => return Ok((f, unique_name(file_name))),
            // No O_TMPFILE in this kernel (EISDIR) or file system.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
                ) =>
            {
                log::debug!(
                    "{}: no O_TMPFILE ({e}), creating a named file and unlinking it",
                    dir.display()
                );
            }
            Err(e) => return Err(io_err(dir, "creating a temporary overlay in")(e)),
        }
    }
    let mut tries = 0;
    loop {
        let unique = unique_name(file_name);
        let path = dir.join(&unique);
        match FsOpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .create_new(true)
            .open(&path)
        {
            Ok(file) => {
                std::fs::remove_file(&path)
                    .map_err(io_err(&path, "unlinking the temporary overlay"))?;
                return Ok((file, unique));
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries + 1 < NAME_TRIES => {
                tries += 1;
            }
            Err(e) => return Err(io_err(&path, "creating")(e)),
        }
    }
}

impl Image {
    /// Creates a temporary overlay over the image (pcow or raw) at `base`
    /// and opens it for writing; see the module documentation. The
    /// overlay has the base's virtual size (a raw file's length rounded up
    /// to whole clusters) and, over a pcow base, its cluster size.
    ///
    /// Its [`Image::path`] names the file it would have had, with
    /// ` (deleted)` appended: it cannot be opened again by path, and
    /// operations that reopen an image by path are not for it.
    pub fn create_temporary(base: &Path, opts: &TempOptions) -> Result<Image> {
        let base_abs = base
            .canonicalize()
            .map_err(io_err(base, "resolving the base image's path"))?;
        let dir = match &opts.dir {
            Some(d) => d
                .canonicalize()
                .map_err(io_err(d, "resolving the directory"))?,
            None => base_abs.parent().map(Path::to_owned).ok_or_else(|| {
                Error::Invalid(format!("{}: no parent directory", base_abs.display()))
            })?,
        };
        let file_name = base_abs
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (file, unique) = create_unlinked(&dir, &file_name, opts.named)?;
        let shown = dir.join(format!("{unique} (deleted)"));
        lock_file(&file, &shown, true)?;

        // The stored name is never used to open the base (the chain opened
        // here is handed over), but it says what the overlay is over.
        let stored = match base_abs.parent() {
            Some(p) if p == dir => PathBuf::from(&file_name),
            _ => base_abs.clone(),
        };
        let utf8 = |p: &Path| {
            p.to_str().map(str::to_owned).ok_or_else(|| {
                Error::Invalid(format!(
                    "{}: base image path is not valid UTF-8",
                    p.display()
                ))
            })
        };
        let name = utf8(&stored)?;
        crate::chain::check_base_name(&name)?;
        let mut ctx = ChainCtx::default();
        ctx.visit(&file, &shown)?;
        let backing = open_base(
            &shown,
            &BaseRef {
                name: utf8(&base_abs)?,
                format: BaseFormat::Probe,
            },
            &mut ctx,
        )?;
        let (format, cluster_size) = match &backing {
            Backing::Pcow(i) => (BaseFormat::Pcow, i.cluster_size()),
            Backing::Raw(_) => (BaseFormat::Raw, DEFAULT_CLUSTER_SIZE),
        };
        let g = Geometry::from_cluster_size(cluster_size)
            .ok_or_else(|| Error::Invalid(format!("bad cluster size {cluster_size}")))?;
        let virtual_size = backing.size().next_multiple_of(g.cluster_size());
        check_virtual_size(virtual_size, g)?;

        let mut storage = VolatileStorage(FileStorage::new(file));
        let mut header = Header::new(g, virtual_size, Some(BaseRef { name, format }));
        header.generation = 1;
        storage
            .write_at(&header.encode(), 0)
            .map_err(io_err(&shown, "writing the header"))?;
        storage
            .set_len(g.cluster_size())
            .map_err(io_err(&shown, "sizing"))?;
        let open = OpenOptions {
            writable: true,
            skip_base: true,
            ..OpenOptions::default()
        };
        let mut img = Image::open_inner(Box::new(storage), &shown, open, &mut ctx)?;
        img.base = Some(Box::new(backing));
        img.access.temporary = true;
        Ok(img)
    }
}
