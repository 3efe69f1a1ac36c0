//! Advisory whole-file locks (`flock`): exclusive for a writer, shared for
//! readers.
//!
//! A conflict is tried again for a short while before it is reported. A
//! process that forks copies its open file descriptions, and so its
//! `flock`s, into the child until the child execs and closes them: in a
//! multi-threaded program where one thread starts another program (`cargo
//! test` running a VMM beside in-process image tests, a management agent
//! starting helpers), a lock another thread has just released can look
//! held for that moment. A real holder keeps its lock past the wait, and
//! the conflict is reported then.

use std::fs::File;
use std::path::Path;
use std::time::Duration;

use crate::error::{io_err, Error, Result};

/// Waits between attempts: about 127 ms in all.
const BACKOFF_MS: [u64; 7] = [1, 2, 4, 8, 16, 32, 64];

/// Locks `file` (exclusive or shared). `Ok(false)`: another open file
/// description holds a conflicting lock, after the retries; `Err`: the
/// lock call itself failed.
pub fn lock(file: &File, exclusive: bool) -> std::io::Result<bool> {
    let attempt = || {
        let r = if exclusive {
            file.try_lock()
        } else {
            file.try_lock_shared()
        };
        match r {
            Ok(()) => Ok(true),
            Err(std::fs::TryLockError::WouldBlock) => Ok(false),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    };
    for ms in BACKOFF_MS {
        if attempt()? {
            return Ok(true);
        }
        std::thread::sleep(Duration::from_millis(ms));
    }
    attempt()
}

/// Takes an advisory lock on the whole file; a conflict that outlasts
/// [`lock`]'s retries is [`Error::Locked`].
pub(crate) fn lock_file(file: &File, path: &Path, exclusive: bool) -> Result<()> {
    match lock(file, exclusive) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::Locked {
            path: path.to_owned(),
        }),
        Err(e) => Err(io_err(path, "locking")(e)),
    }
}
