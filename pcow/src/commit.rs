//! A commit in flight: what the image records of it ([`Pending`], in
//! [`CommitState`]) and the handle that makes it durable away from the
//! image ([`Commit`], whose progress both share). The steps themselves are
//! in [`crate::barrier`].

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{io_err, Error, Result};
use crate::format::Header;
use crate::io::CommitIo;
use crate::slot_ends::SlotEnds;

/// A metadata slot written by a commit: whose, which slot, where, and the
/// end of its content (recorded in `slot_ends` once a sync made it durable).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Written {
    pub(crate) of: SlotOf,
    pub(crate) slot: u8,
    pub(crate) at: u64,
    pub(crate) end: usize,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum SlotOf {
    Segment(usize),
    Layer(usize),
}

/// How far the [`Commit`] handed out for a pending commit got. Shared with
/// the image, so that closing an image whose commit was never finished
/// knows whether the header may already be on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    /// Nothing written yet, or a write may still be tried.
    Open,
    /// A write failed: the commit can only be aborted.
    Failed,
    /// Synced and the header written and synced: the commit is durable.
    Written,
    /// The image gave up on the commit (closed): writing it is refused.
    Cancelled,
}

pub(crate) type Gate = Arc<Mutex<Progress>>;

pub(crate) fn progress(gate: &Gate) -> MutexGuard<'_, Progress> {
    // The state is a plain enum: a panic while holding it leaves it whole.
    gate.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where the image's metadata stands against the file: what the next
/// commit must write, the commit in flight, and what the file holds past
/// each slot's content.
#[derive(Debug, Default)]
pub(crate) struct CommitState {
    /// Data was written since the last sync.
    pub(crate) data_dirty: bool,
    /// Staged metadata differs from the committed image.
    pub(crate) meta_dirty: bool,
    /// The commit begun and not yet finished or aborted.
    pub(crate) pending: Option<Pending>,
    /// Numbers commits, so that a stale [`Commit`] is refused.
    pub(crate) seq: u64,
    /// What the file holds past each slot's content (short slot writes).
    pub(crate) slot_ends: SlotEnds,
}

/// The image's record of the commit in flight: what to publish when it is
/// written, what to mark dirty again when it is not.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) id: u64,
    pub(crate) gate: Gate,
    pub(crate) written: Vec<Written>,
    /// The new header, its slot and content end (`None`: a data sync only).
    pub(crate) header: Option<(Header, u8, u64, usize)>,
    pub(crate) had_data: bool,
    pub(crate) had_meta: bool,
}

impl Pending {
    /// Whether the [`Commit`] handed out for it is gone (dropped without
    /// being handed back): nothing can write it any more.
    pub(crate) fn handle_dropped(&self) -> bool {
        Arc::strong_count(&self.gate) == 1
    }
}

/// A slot a commit writes (a metadata slot, the header), as the bytes to
/// write there and what they are (for the error).
#[derive(Debug)]
pub(crate) struct SlotWrite {
    pub(crate) bytes: Vec<u8>,
    pub(crate) at: u64,
    pub(crate) what: &'static str,
}

/// A commit staged by [`crate::LiveImage::begin_commit`]: the I/O that makes it
/// durable, done without the image by [`Commit::write`], then handed back
/// to [`crate::LiveImage::finish_commit`] (or [`crate::LiveImage::abort_commit`]).
#[must_use = "a commit must be written and finished, or aborted"]
pub struct Commit {
    pub(crate) id: u64,
    pub(crate) gate: Gate,
    pub(crate) io: Box<dyn CommitIo>,
    pub(crate) path: PathBuf,
    /// The metadata slots, written first: staged under the image's lock,
    /// written without it, so that nothing waiting for the image (a fault)
    /// waits for the file system (a `pwrite` waits for any `fallocate` of
    /// the same file in flight, the pool worker's).
    pub(crate) slots: Vec<SlotWrite>,
    /// Sync data and slots before the header (or alone, for a data sync).
    pub(crate) sync_first: bool,
    pub(crate) header: Option<SlotWrite>,
    /// Write the slots and the header with
    /// [`CommitIo::write_beside_fallocate`] ([`Commit::beside_fallocate`]).
    pub(crate) beside_fallocate: bool,
}

impl std::fmt::Debug for Commit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Commit")
            .field("id", &self.id)
            .field("path", &self.path)
            .field("progress", &*progress(&self.gate))
            .finish()
    }
}

impl Commit {
    /// Has [`Commit::write`] write its slots and header without waiting for
    /// an `fallocate` of the image file in flight, where the storage can (on
    /// tmpfs, through a mapping of the file, at several times the cost of a
    /// `pwrite`): for a caller that knows one is in flight (a device's pool
    /// worker reserving clusters holds the file's inode lock, which every
    /// `pwrite` waits for, for the whole call).
    pub fn beside_fallocate(&mut self) {
        self.beside_fallocate = true;
    }

    /// Makes the commit durable: writes the slots staged at begin, syncs
    /// them and the data, writes the header slot, syncs again. Needs no lock on the
    /// image. After an error the commit can only be aborted (a failed sync
    /// is not retried: the kernel may have dropped the pages it failed on).
    pub fn write(&mut self) -> Result<()> {
        let gate = self.gate.clone();
        let mut progress = progress(&gate);
        match *progress {
            Progress::Open => {}
            Progress::Written => return Ok(()),
            Progress::Failed => {
                return Err(Error::CommitFailed {
                    path: self.path.clone(),
                })
            }
            Progress::Cancelled => {
                return Err(Error::CommitCancelled {
                    path: self.path.clone(),
                })
            }
        }
        match self.write_inner() {
            Ok(()) => {
                *progress = Progress::Written;
                Ok(())
            }
            Err(e) => {
                *progress = Progress::Failed;
                Err(e)
            }
        }
    }

    fn write_inner(&mut self) -> Result<()> {
        let path = &self.path;
        let beside = self.beside_fallocate;
        let write = |io: &mut Box<dyn CommitIo>, w: &SlotWrite| {
            if beside {
                io.write_beside_fallocate(&w.bytes, w.at)
            } else {
                io.write_at(&w.bytes, w.at)
            }
            .map_err(io_err(path, w.what))
        };
        for w in &self.slots {
            write(&mut self.io, w)?;
        }
        // One sync covers the data and the new slots: until the header
        // names the new generation the slots are stale and readers ignore
        // them, so their order against the data does not matter; only the
        // header must follow both.
        if self.sync_first {
            let op = if self.header.is_some() {
                "syncing data and metadata"
            } else {
                "syncing data"
            };
            self.io.sync().map_err(io_err(path, op))?;
        }
        if let Some(h) = &self.header {
            write(&mut self.io, h)?;
            self.io.sync().map_err(io_err(path, "syncing the header"))?;
        }
        Ok(())
    }
}
