//! A raw file as upstream Cloud Hypervisor serves it: the whole file
//! mapped `MAP_SHARED` (guest writes reach the file), or `MAP_PRIVATE`
//! with `discard_writes` (guest writes stay in memory); FLUSH is fsync.

use std::fs::{File, OpenOptions};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::device::{FlushBackend, FlushError};

/// Errors of [`RawRegion::open`].
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum RawError {
    #[error("{path}: opening")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: locking")]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: file is in use by another process (lock held)")]
    Locked { path: PathBuf },
    #[error("{path}: empty file")]
    Empty { path: PathBuf },
    #[error("{path}: mapping {len} bytes")]
    Map {
        path: PathBuf,
        len: u64,
        #[source]
        source: std::io::Error,
    },
}

/// One `mmap` of a whole file; unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    addr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; nothing in it is
// tied to the creating thread.
unsafe impl Send for Mapping {}

// SAFETY: `&Mapping` only hands out the address and length; every access
// through that address is the caller's (the guest's, through a memslot),
// so sharing the value between threads adds no data race of its own.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Host address of the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the mapping is empty (never: empty files are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` describe exactly the mapping this value
        // created, and no reference into it outlives `self`.
        unsafe {
            libc::munmap(self.addr.cast(), self.len);
        }
    }
}

/// A raw file mapped for a guest.
#[derive(Debug)]
pub struct RawRegion {
    path: PathBuf,
    file: File,
    mapping: Mapping,
    discard_writes: bool,
}

impl RawRegion {
    /// Maps the whole file at `path`. A writer takes an exclusive lock, a
    /// `discard_writes` reader a shared one.
    pub fn open(path: &Path, discard_writes: bool) -> Result<RawRegion, RawError> {
        let file = OpenOptions::new()
            .read(true)
            .write(!discard_writes)
            .open(path)
            .map_err(|source| RawError::Open {
                path: path.to_owned(),
                source,
            })?;
        let locked = pcow::lock::lock(&file, !discard_writes).map_err(|source| RawError::Lock {
            path: path.to_owned(),
            source,
        })?;
        if !locked {
            return Err(RawError::Locked {
                path: path.to_owned(),
            });
        }
        let len = file
            .metadata()
            .map_err(|source| RawError::Open {
                path: path.to_owned(),
                source,
            })?
            .len();
        if len == 0 {
            return Err(RawError::Empty {
                path: path.to_owned(),
            });
        }
        let map_err = |source| RawError::Map {
            path: path.to_owned(),
            len,
            source,
        };
        let size = usize::try_from(len)
            .map_err(|_| map_err(std::io::Error::from_raw_os_error(libc::EFBIG)))?;
        let flags = if discard_writes {
            libc::MAP_PRIVATE
        } else {
            libc::MAP_SHARED
        } | libc::MAP_NORESERVE;
        // SAFETY: a fresh mapping at an address the kernel picks; the fd is
        // open for the call; the result is checked before use.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(map_err(std::io::Error::last_os_error()));
        }
        Ok(RawRegion {
            path: path.to_owned(),
            file,
            mapping: Mapping {
                addr: addr.cast(),
                len: size,
            },
            discard_writes,
        })
    }

    /// The mapping the VMM turns into a memslot.
    pub fn mapping(&self) -> &Mapping {
        &self.mapping
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl RawRegion {
    /// Makes the guest's writes durable (a no-op with `discard_writes`).
    pub fn sync(&self) -> std::io::Result<()> {
        if self.discard_writes {
            // Nothing the guest writes reaches the file.
            return Ok(());
        }
        // fdatasync writes back the page cache, including pages the guest
        // dirtied through the shared mapping.
        self.file.sync_data()
    }
}

impl RawRegion {
    /// The guest's FLUSH: fdatasync.
    pub(crate) fn flush_request(&self) -> Result<(), FlushError> {
        self.sync().map_err(|e| FlushError::from_error(Box::new(e)))
    }
}

impl FlushBackend for RawRegion {
    fn flush(&mut self) -> Result<(), FlushError> {
        self.flush_request()
    }
}
