//! The health the VMM tracks for its guest, as values holding what went
//! wrong (the wire and the events print them; nothing is kept as a
//! string of our own making).
//!
//! A pmem device that waits for free space ([`OutOfSpace`]) makes the VMM
//! pause the guest ([`crate::machine::Machine::pause_reason`]) until
//! `vm.resume` finds space again. Where the device crate reports only a
//! message (a FLUSH stalled in its queue, a write fault that got no
//! cluster), the variant holds that message; where an operation failed,
//! it holds the error.

use virtio_pmem_pcow::BarrierError;

/// Why a pmem device waits for free space. Displayed as the VMM has
/// always reported it (`vm.info`'s `pause_reason`, `vm.pmem-info`'s
/// `out_of_space`, the `paused` event).
#[derive(Debug, thiserror::Error)]
pub enum OutOfSpace {
    /// A FLUSH found the file system full and waits, unanswered, in the
    /// device's queue.
    #[error("pmem {id}: flush: {why}")]
    Flush {
        /// The device id.
        id: String,
        /// The device's account of the failed barrier.
        why: String,
    },
    /// A write fault got no cluster since the last barrier that
    /// succeeded (the guest's write waits in memory).
    #[error("pmem {id}: {}", error_report::chain(.why))]
    Fault {
        /// The device id.
        id: String,
        /// Why the region could not allocate (its whole chain is shown:
        /// "No space left on device" is what operators look for).
        why: virtio_pmem_pcow::Failure,
    },
    /// The region's state could not be read (counted as waiting: the VMM
    /// cannot tell that it does not).
    #[error("pmem {id}: {error}")]
    Unknown {
        /// The device id.
        id: String,
        /// Why the state could not be read.
        error: BarrierError,
    },
    /// The barrier that should move what waited into the image failed.
    #[error("pmem {id}: {}", error_report::chain(error))]
    Barrier {
        /// The device id.
        id: String,
        /// The barrier's error.
        error: BarrierError,
    },
}
