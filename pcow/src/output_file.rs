//! Opening the files a command replaces or writes in place (`create`,
//! `convert`'s output, `convert -n`'s target, a raw `resize`).
//!
//! Nothing may be truncated or written before the exclusive lock is held:
//! an image in use by another process (a VMM, an overlay's reader) is
//! refused byte for byte unchanged. Only regular files are written: a
//! directory, FIFO, socket or device is refused at once, without blocking
//! (a FIFO opened for writing would wait for a reader, possibly forever),
//! and a symbolic link at the name of a file being *replaced* is refused
//! rather than followed, so that replacing one name never clobbers a file
//! elsewhere. A target written in place (`-n`) is an existing image chosen
//! by the user, like any image opened for writing: a link to it is
//! followed, and the file it leads to must be regular.

use std::fs::{File, FileType, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use crate::error::io_err;
use crate::error::{Error, Result};
use crate::lock::lock_file;

/// What a file type is called in an error (the one list every crate of
/// the workspace uses when it refuses a file by its type).
pub fn kind(t: FileType) -> &'static str {
    if t.is_file() {
        "regular file"
    } else if t.is_dir() {
        "directory"
    } else if t.is_symlink() {
        "symbolic link"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_char_device() {
        "character device"
    } else {
        "special file"
    }
}

fn not_regular(path: &Path, t: FileType) -> Error {
    Error::NotRegular {
        path: path.to_owned(),
        kind: kind(t),
    }
}

/// Refuses anything but a regular file, by the type `fstat` reports for
/// the open file (a name checked before opening may have changed since).
fn check_regular(file: &File, path: &Path) -> Result<()> {
    let t = file
        .metadata()
        .map_err(io_err(path, "reading metadata"))?
        .file_type();
    if t.is_file() {
        Ok(())
    } else {
        Err(not_regular(path, t))
    }
}

/// Clears `O_NONBLOCK`, which only served the open: later I/O on the
/// (regular) file must not see `EAGAIN`, e.g. from a lease.
fn clear_nonblock(file: &File, path: &Path) -> Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL and F_SETFL take and return plain integers; `fd` is
    // owned by `file`, open for both calls.
    let r = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            flags
        } else {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK)
        }
    };
    if r < 0 {
        return Err(io_err(path, "clearing O_NONBLOCK")(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Finishes opening an input (an image, a base, a raw file) that was
/// opened with `O_NONBLOCK`, so that a FIFO there did not block the open:
/// refuses anything but a regular file, by `fstat`, then clears
/// `O_NONBLOCK` for the blocking I/O that follows.
pub(crate) fn regular_input(file: &File, path: &Path) -> Result<()> {
    check_regular(file, path)?;
    clear_nonblock(file, path)
}

/// The error for a failed open of input `path`: a directory opened for
/// writing (`EISDIR`) or a socket (`ENXIO`) is named by its type as
/// [`Error::NotRegular`], like those `fstat` catches after an open.
pub(crate) fn input_open_error(path: &Path, op: &'static str, e: std::io::Error) -> Error {
    match std::fs::metadata(path) {
        Ok(m) if !m.file_type().is_file() => not_regular(path, m.file_type()),
        _ => io_err(path, op)(e),
    }
}

/// Opens `path` read-only as an input: without blocking on a FIFO, and
/// refusing anything but a regular file ([`regular_input`]).
pub fn open_regular_input(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| input_open_error(path, "opening", e))?;
    regular_input(&file, path)?;
    Ok(file)
}

/// Opens an existing file named `path` that is about to be replaced, with
/// no truncation, and locks it exclusively; `Ok(None)` when nothing is
/// there. A symbolic link (even dangling), directory, FIFO, socket or
/// device at `path` is refused; so is a file another process holds
/// ([`Error::Locked`]). Nothing is written.
pub fn open_existing_output(path: &Path) -> Result<Option<File>> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => return Err(not_regular(path, m.file_type())),
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(path, "opening")(e)),
    }
    let file = match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        // Replaced by something else since the check above.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(Error::NotRegular {
                path: path.to_owned(),
                kind: "symbolic link",
            })
        }
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(path, "opening")(e)),
    };
    check_regular(&file, path)?;
    clear_nonblock(&file, path)?;
    lock_file(&file, path, true)?;
    Ok(Some(file))
}

/// Creates a new, empty file at `path` (nothing may be there, not even a
/// dangling link: `O_EXCL` never follows one), locked exclusively.
pub fn create_new_output(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io_err(path, "creating"))?;
    lock_file(&file, path, true)?;
    Ok(file)
}

/// The file at `path` to be replaced, locked exclusively and not yet
/// truncated: the existing regular file, or a new one. See
/// [`open_existing_output`] for what is refused.
pub fn open_output(path: &Path) -> Result<File> {
    open_output_noting(path).map(|(f, _)| f)
}

/// [`open_output`], and whether the file is new (made by this call): a
/// caller that fails before writing it removes it again, so that a
/// refusal leaves no file where there was none.
pub fn open_output_noting(path: &Path) -> Result<(File, bool)> {
    if let Some(f) = open_existing_output(path)? {
        return Ok((f, false));
    }
    match create_new_output(path) {
        // Another process made the file in between: judge that one.
        Err(Error::Io { source, .. }) if source.kind() == ErrorKind::AlreadyExists => {
            let f = open_existing_output(path)?.ok_or_else(|| {
                io_err(path, "creating")(std::io::Error::from(ErrorKind::AlreadyExists))
            })?;
            Ok((f, false))
        }
        r => r.map(|f| (f, true)),
    }
}

/// Opens the existing file at `path` to be written in place (`convert
/// -n`, a raw `resize`), locked exclusively. A link is followed; the file
/// must be regular, checked before opening (opening some devices acts on
/// them) and again on the open file; the open does not block on a FIFO.
pub fn open_in_place(path: &Path) -> Result<File> {
    let m = std::fs::metadata(path).map_err(io_err(path, "opening"))?;
    if !m.file_type().is_file() {
        return Err(not_regular(path, m.file_type()));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err(path, "opening"))?;
    check_regular(&file, path)?;
    clear_nonblock(&file, path)?;
    lock_file(&file, path, true)?;
    Ok(file)
}

/// Empties `file` (from [`open_output`]) and sets its length to `size`, a
/// hole. The new length is set once before emptying: a size the file
/// system cannot hold (`EFBIG`) is refused with the file as it was.
pub fn reset_len(file: &File, path: &Path, size: u64) -> Result<()> {
    file.set_len(size).map_err(io_err(path, "sizing"))?;
    file.set_len(0).map_err(io_err(path, "truncating"))?;
    file.set_len(size).map_err(io_err(path, "sizing"))
}
