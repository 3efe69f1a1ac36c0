//! A write log the device's user may give a region ([`WriteLog`]): the
//! pages the guest wrote, as the hypervisor saw them (KVM's dirty log of
//! the region's memslot, in a VMM). With one, a barrier classifies only
//! the pages the log names instead of scanning the page tables of every
//! private and zero-mapped cluster (`PAGEMAP_SCAN`), so its cost follows
//! what was written, not what the guest has read.
//!
//! What the region relies on (see `harvest`):
//!
//! - the log's contract below: a write is named by a call that returns
//!   after it began, at the latest by the next barrier's, never by none;
//! - writes before the log was attached are not in it: the first barrier
//!   after [`crate::PcowRegion::attach_write_log`] also runs the full scan,
//!   and so does the first after a call that failed (a failed call may
//!   have lost what it took);
//! - pages a call named are kept by the region until a barrier that
//!   succeeds has moved them (a status that reads the log keeps them for
//!   the next barrier; a failed barrier keeps its harvest);
//! - writers are held from the log's read to the end of the copy, so what
//!   a barrier copies of a page holds every write the log named it for;
//! - except where nothing is copied: a log that vouches for reads made
//!   while writers run ([`WriteLog::complete_unheld`]) lets a barrier
//!   whose log names only pages that need no move (pages of clusters
//!   mapped shared from the image, which the commit's sync covers) skip
//!   holding the writers.

/// Errors of a [`WriteLog`].
#[derive(Debug, thiserror::Error)]
#[error("reading the write log ({what})")]
pub struct WriteLogError {
    /// What the log was doing.
    pub what: String,
    /// Why it failed.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// The pages of a region the guest wrote, as its hypervisor logs them.
///
/// Pages are numbered in 4 KiB units from the start of the region (the
/// memslot's guest page index).
pub trait WriteLog: Send + Sync {
    /// Calls `into` with every page written since the previous call (since
    /// the log started, for the first), each at least once, then starts a
    /// new interval.
    ///
    /// Contract: every write to a page is named by a call that returns
    /// after the write began, at the latest by the first call made while
    /// the writers are held after it (a barrier's: KVM's dirty log with the
    /// vCPUs out of `KVM_RUN`). Pages nobody wrote may be named too (they
    /// cost a copy). A call that fails may have lost pages it took: the
    /// region then finds the written pages by scanning until a call
    /// succeeds again.
    fn take_written(&self, into: &mut dyn FnMut(u64)) -> Result<(), WriteLogError>;

    /// Whether a call made while writers run names every write that
    /// completed before the call began (no per-writer buffer that only
    /// holding the writers would flush: Intel's PML is one). `false`
    /// unless the log knows.
    fn complete_unheld(&self) -> bool {
        false
    }
}
