//! The I/O layer under an image: a small trait so that crash tests can stand
//! in for the file (record writes and syncs, drop what was not synced).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::{AsRawFd, RawFd};

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
    /// The storage is a file on tmpfs (see [`store_through_mapping`]).
    fn on_tmpfs(&self) -> bool {
        false
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
    /// Writes all of `buf` at `offset` without waiting for an `fallocate`
    /// of the file in flight where the storage can (a file on tmpfs,
    /// through a mapping: [`store_through_mapping`]), else as
    /// [`CommitIo::write_at`].
    fn write_beside_fallocate(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_at(buf, offset)
    }
    /// Makes every completed write to the storage durable (fdatasync).
    fn sync(&mut self) -> io::Result<()>;
}

/// A real file.
#[derive(Debug)]
pub struct FileStorage {
    file: File,
    /// The file is on tmpfs: a commit can store through a mapping
    /// ([`store_through_mapping`]).
    tmpfs: bool,
}

impl FileStorage {
    /// Wraps an open file.
    pub fn new(file: File) -> Self {
        let tmpfs = on_tmpfs(&file);
        FileStorage { file, tmpfs }
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
    fn on_tmpfs(&self) -> bool {
        self.tmpfs
    }
    /// A duplicate of the file descriptor: same open file, same page cache
    /// (and the same lock, held until the handle is dropped too).
    fn commit_io(&self) -> io::Result<Box<dyn CommitIo>> {
        Ok(Box::new(FileCommitIo {
            file: self.file.try_clone()?,
            tmpfs: self.tmpfs,
        }))
    }
}

/// A [`FileStorage`]'s commit handle.
#[derive(Debug)]
struct FileCommitIo {
    file: File,
    tmpfs: bool,
}

impl CommitIo for FileCommitIo {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }
    fn write_beside_fallocate(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.tmpfs && write_through_mapping(&self.file, buf, offset) {
            return Ok(());
        }
        self.file.write_all_at(buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
}

fn on_tmpfs(file: &File) -> bool {
    fd_on_tmpfs(file.as_raw_fd())
}

/// Whether the open file `fd` is on tmpfs (false when that cannot be told).
fn fd_on_tmpfs(fd: RawFd) -> bool {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: fstatfs fills the `statfs` it is given and only reads `fd`
    // (a bad one is an error).
    let r = unsafe { libc::fstatfs(fd, st.as_mut_ptr()) };
    // SAFETY: fstatfs succeeded, so it initialized `st`.
    r == 0 && unsafe { st.assume_init() }.f_type == libc::TMPFS_MAGIC
}

/// A shared mapping of part of a file, unmapped on drop.
struct FileMapping {
    addr: *mut libc::c_void,
    len: usize,
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are a mapping this value made and owns; no
        // reference into it outlives the value.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// Writes `buf` at `offset` of a tmpfs file through a shared mapping
/// ([`store_through_mapping`]); returns whether it wrote.
fn write_through_mapping(file: &File, buf: &[u8], offset: u64) -> bool {
    // SAFETY: `buf` is valid for reads of its length.
    unsafe { store_through_mapping(file.as_raw_fd(), buf.as_ptr(), buf.len(), offset) }
}

/// Copies `len` bytes from `src` to `offset` of the file `fd` through a
/// shared mapping of the file; returns whether it wrote (false: nothing
/// written, use `pwrite`). Meant for tmpfs files ([`fd_on_tmpfs`]), while
/// an `fallocate` of the file is in flight: making and tearing down the
/// mapping costs 4-6 times a `pwrite` of a page (27 against 6 us here,
/// 230 against 40 us under the nested sandbox's emulation).
///
/// `pwrite` takes the inode lock, which an `fallocate` of the same file
/// holds for the whole call; on tmpfs that call allocates and zeroes every
/// page (a device's pool worker reserving 2 MiB: 0.35-0.75 ms here,
/// hundreds of milliseconds under the nested sandbox's emulation). A store
/// through a mapping takes no such lock. The pages are made present and
/// writable first (`MADV_POPULATE_WRITE`), which allocates a hole's page
/// as `pwrite` would and, where that fails (tmpfs full), reports an error
/// instead of raising SIGBUS at the store: the write is then left to
/// `pwrite`, which fails with the error to report. So is a range beyond the
/// end of the file, or a kernel without `MADV_POPULATE_WRITE` (before
/// 5.14). The pages are tmpfs's: durable as far as tmpfs is, at once.
///
/// # Safety
///
/// `src` must be valid for reads of `len` bytes, and the file must not be
/// shrunk or punched below `offset + len` meanwhile (a store into a page
/// removed after it was made present raises SIGBUS).
pub unsafe fn store_through_mapping(fd: RawFd, src: *const u8, len: usize, offset: u64) -> bool {
    // SAFETY: sysconf only reads its argument.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as u64,
        _ => return false,
    };
    let Some(end) = offset.checked_add(len as u64) else {
        return false;
    };
    if len == 0 || file_len(fd).is_none_or(|l| end > l) {
        return false;
    }
    let start = offset - offset % page;
    let (Ok(map_off), Ok(map_len)) = (
        libc::off_t::try_from(start),
        usize::try_from((end - start).div_ceil(page) * page),
    ) else {
        return false;
    };
    // SAFETY: a new mapping at an address the kernel chooses, of
    // `map_len` bytes of the file from the page-aligned `map_off`;
    // nothing else refers to it.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            map_off,
        )
    };
    if addr == libc::MAP_FAILED {
        return false;
    }
    let map = FileMapping { addr, len: map_len };
    // SAFETY: `map.addr` is page-aligned and maps `map_len` bytes of this
    // function's own mapping; populating changes no content.
    if unsafe { libc::madvise(map.addr, map_len, libc::MADV_POPULATE_WRITE) } != 0 {
        return false;
    }
    // The destination, `len` bytes from `offset - start` into the mapping,
    // lies inside it (`end <= start + map_len`); each of its pages is
    // inside the file (`end` is not past the file's length, which the
    // caller keeps) and was just made present and writable.
    // SAFETY: so the store raises no SIGBUS; the mapping is this
    // function's alone, so nothing aliases it; the caller vouches for `src`.
    unsafe {
        std::ptr::copy_nonoverlapping(
            src,
            map.addr.cast::<u8>().add((offset - start) as usize),
            len,
        );
    }
    true
}

/// The length of the file `fd` (`fstat`, which takes no inode lock).
fn file_len(fd: RawFd) -> Option<u64> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat fills the `stat` it is given and only reads `fd`.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: fstat succeeded, so it initialized `st`.
    u64::try_from(unsafe { st.assume_init() }.st_size).ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shm_file() -> Option<(tempfile::TempDir, File)> {
        let dir = tempfile::tempdir_in("/dev/shm").ok()?;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .ok()?;
        fd_on_tmpfs(f.as_raw_fd()).then_some((dir, f))
    }

    /// Into a hole, across a page boundary, into reserved pages: the bytes
    /// land where `pwrite` would put them; past the end nothing is written.
    #[test]
    fn a_store_through_a_mapping_writes_what_pwrite_would_and_nothing_past_the_end() {
        let Some((_dir, f)) = shm_file() else {
            eprintln!("skipped: /dev/shm is not tmpfs here");
            return;
        };
        f.set_len(64 << 10).unwrap();
        allocate_file(&f, 64 << 10, 64 << 10).unwrap();
        let fd = f.as_raw_fd();
        let data: Vec<u8> = (0..6000u32).map(|i| i as u8).collect();
        for at in [100, 4000, (64 << 10) + 10] {
            // SAFETY: `data` is valid for reads of its length.
            assert!(unsafe { store_through_mapping(fd, data.as_ptr(), data.len(), at) });
            let mut back = vec![0; data.len()];
            f.read_exact_at(&mut back, at).unwrap();
            assert_eq!(back, data, "at {at}");
        }
        let len = f.metadata().unwrap().len();
        // SAFETY: as above.
        assert!(!unsafe { store_through_mapping(fd, data.as_ptr(), data.len(), len - 10) });
        // SAFETY: as above.
        assert!(!unsafe { store_through_mapping(fd, data.as_ptr(), 10, u64::MAX - 5) });
        assert_eq!(f.metadata().unwrap().len(), len, "the file grew");
        let mut tail = [0u8; 10];
        f.read_exact_at(&mut tail, len - 10).unwrap();
        assert_eq!(tail, [0; 10]);
    }

    #[test]
    fn a_disk_file_is_not_tmpfs_and_dev_shm_is() {
        let f = tempfile::tempfile_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        assert!(!fd_on_tmpfs(f.as_raw_fd()));
        assert!(!fd_on_tmpfs(-1));
        if let Some((_dir, f)) = shm_file() {
            assert!(fd_on_tmpfs(f.as_raw_fd()));
        }
    }
}
