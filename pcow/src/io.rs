//! The I/O layer under an image: a small trait so that crash tests can stand
//! in for the file (record writes and syncs, drop what was not synced).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

/// Positioned I/O on the bytes of one image file.
// An empty file is no special case for an image, so no `is_empty`.
#[allow(clippy::len_without_is_empty)]
pub trait Storage: Send {
    /// Fills `buf` from `offset`; reading past the end is an error.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`, extending the file if needed.
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable (fdatasync).
    fn sync(&mut self) -> io::Result<()>;
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// Truncates or extends (with zeros) to `len` bytes.
    fn set_len(&mut self, len: u64) -> io::Result<()>;
    /// Reserves `[offset, offset + len)` so that later writes there do not
    /// fail for lack of space; the range reads as zeros.
    fn allocate(&mut self, offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len;
        if end > self.len()? {
            self.set_len(end)?;
        }
        Ok(())
    }
    /// The file, when the storage is one (for locking and mapping).
    fn file(&self) -> Option<&File> {
        None
    }
    /// A handle on the same bytes for the I/O of a staged commit (the syncs
    /// and the header write of [`crate::Commit::write`]), used while the
    /// image itself is in other hands. Its writes and syncs are this
    /// storage's: a sync through either covers the writes of both.
    fn commit_io(&self) -> io::Result<Box<dyn CommitIo>>;
}

/// The I/O a staged commit does away from its image: positioned writes and
/// syncs on the image's storage.
pub trait CommitIo: Send {
    /// Writes all of `buf` at `offset`.
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write to the storage durable (fdatasync).
    fn sync(&mut self) -> io::Result<()>;
}

/// A real file.
#[derive(Debug)]
pub struct FileStorage {
    file: File,
}

impl FileStorage {
    /// Wraps an open file.
    pub fn new(file: File) -> Self {
        FileStorage { file }
    }
}

impl Storage for FileStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
    fn allocate(&mut self, offset: u64, len: u64) -> io::Result<()> {
        allocate_file(&self.file, offset, len)
    }
    fn file(&self) -> Option<&File> {
        Some(&self.file)
    }
    /// A duplicate of the file descriptor: same open file, same page cache
    /// (and the same lock, held until the handle is dropped too).
    fn commit_io(&self) -> io::Result<Box<dyn CommitIo>> {
        Ok(Box::new(FileCommitIo {
            file: self.file.try_clone()?,
        }))
    }
}

/// A [`FileStorage`]'s commit handle.
#[derive(Debug)]
struct FileCommitIo {
    file: File,
}

impl CommitIo for FileCommitIo {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// Reserves `[offset, offset + len)` of `file` with `fallocate` (extending
/// it), or only extends it where the file system has no `fallocate`.
pub fn allocate_file(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(off), Ok(l)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(io::Error::from_raw_os_error(libc::EFBIG));
    };
    // SAFETY: fallocate only reads its integer arguments; the fd is owned
    // by `file`, which stays open for the call.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, off, l) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // Filesystems without fallocate: extending is the best we can do.
        Some(libc::EOPNOTSUPP) => {
            if offset + len > file.metadata()?.len() {
                file.set_len(offset + len)?;
            }
            Ok(())
        }
        _ => Err(e),
    }
}

/// Allocates all `len` bytes of a raw file (qemu-img's `preallocation=`
/// for raw): reserved, and with `zeros` also written.
pub fn preallocate_file(file: &File, len: u64, zeros: bool) -> io::Result<()> {
    allocate_file(file, 0, len)?;
    if zeros {
        write_zeros(file, 0, len)?;
    }
    Ok(())
}

/// Writes zeros over `[offset, offset + len)` of `file`, 1 MiB at a time.
pub fn write_zeros(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let zeros = vec![0u8; (1u64 << 20).min(len) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(zeros.len() as u64);
        file.write_all_at(&zeros[..n as usize], offset + done)?;
        done += n;
    }
    Ok(())
}
