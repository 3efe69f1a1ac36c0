//! A raw file as upstream Cloud Hypervisor serves it: the whole file
//! mapped `MAP_SHARED` (guest writes reach the file), or `MAP_PRIVATE`
//! with `discard_writes` (guest writes stay in memory); FLUSH is fsync.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
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
    #[error("{path}: is a {kind}, not a regular file")]
    NotRegular { path: PathBuf, kind: &'static str },
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
        // O_NONBLOCK: a FIFO here must not block the open (and with it the
        // API thread); fstat below refuses anything but a regular file.
        let file = OpenOptions::new()
            .read(true)
            .write(!discard_writes)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|source| RawError::Open {
                path: path.to_owned(),
                source,
            })?;
        let meta = file.metadata().map_err(|source| RawError::Open {
            path: path.to_owned(),
            source,
        })?;
        if !meta.file_type().is_file() {
            return Err(RawError::NotRegular {
                path: path.to_owned(),
                kind: pcow::output_file::kind(meta.file_type()),
            });
        }
        let fd = file.as_raw_fd();
        // SAFETY: F_GETFL/F_SETFL take and return plain integers on `fd`,
        // which `file` owns and keeps open through both calls.
        let r = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 {
                flags
            } else {
                libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK)
            }
        };
        if r < 0 {
            return Err(RawError::Open {
                path: path.to_owned(),
                source: std::io::Error::last_os_error(),
            });
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO, directory, socket or device as a raw pmem file is refused at
    /// once, naming the path and its type (a FIFO used to block the open).
    #[test]
    fn special_files_are_refused_at_once() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path living through the call;
        // mkfifo only reads it.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let sock = dir.path().join("sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let t0 = std::time::Instant::now();
        for discard in [true, false] {
            for (p, want) in [
                (fifo.as_path(), "FIFO"),
                (dir.path(), "directory"),
                (Path::new("/dev/null"), "character device"),
            ] {
                let e = RawRegion::open(p, discard).unwrap_err();
                match &e {
                    RawError::NotRegular { kind, .. } => assert_eq!(*kind, want),
                    // A directory opened for writing fails in open itself.
                    RawError::Open { source, .. } if want == "directory" && !discard => {
                        assert_eq!(source.raw_os_error(), Some(libc::EISDIR))
                    }
                    _ => panic!("{p:?}: {e:?}"),
                }
                assert!(e.to_string().contains(&p.display().to_string()), "{e}");
            }
            // open(2) on a socket fails with ENXIO.
            assert!(RawRegion::open(&sock, discard).is_err());
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
    }
}
