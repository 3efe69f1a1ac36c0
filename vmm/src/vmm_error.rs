//! Why an action of the VMM failed ([`VmmError`]).
//!
//! The VMM's handlers ([`crate::vmm::Vmm`]) return these; the API layer
//! alone decides what status each answers with and how it is written on
//! the wire ([`crate::api::errors`]). The messages are the ones upstream's
//! clients and our own tests read, word for word.

use std::path::PathBuf;

use crate::chardev::ChardevError;
use crate::config::ValidationError;
use crate::control::StopError;
use crate::health::OutOfSpace;
use crate::machine::MachineError;
use crate::vcpu::VcpuError;

/// Why stopping a machine (shutdown, reboot, delete, a rollback) failed.
#[derive(Debug, thiserror::Error)]
pub enum ShutdownError {
    /// The vCPUs did not stop.
    #[error(transparent)]
    Stop(#[from] StopError),
    /// The machine stopped, but some devices' final barriers failed
    /// (each was logged).
    #[error("{failed} pmem device(s) failed their final barrier")]
    FinalBarriers {
        /// How many failed.
        failed: usize,
    },
}

/// Why an action of the VMM failed.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    // The VM's state does not allow the action.
    #[error("VM is not created")]
    NotCreated,
    #[error("VM is not running")]
    NotRunning,
    /// The VM is in a state that does not allow the action: the reason
    /// names the state and what to do instead.
    #[error("{0}")]
    WrongState(String),
    #[error("the VM stays paused: still out of space: {still} (paused for: {paused_for})")]
    StillOutOfSpace {
        still: Box<OutOfSpace>,
        paused_for: String,
    },

    // The request names something that does not exist or cannot work.
    #[error("invalid VM config")]
    InvalidConfig(#[source] ValidationError),
    #[error("invalid VM config after the resize")]
    InvalidResize(#[source] ValidationError),
    /// A value of the request that cannot work (the message says which).
    #[error("{0}")]
    BadValue(String),
    #[error("{action}: this VMM has no {missing}")]
    Unsupported {
        action: &'static str,
        missing: &'static str,
    },
    #[error("vm.add-pmem")]
    AddPmem(#[source] ValidationError),
    #[error("no device with id {0}")]
    NoSuchDevice(String),
    #[error("no pmem device with id {0}")]
    NoSuchPmem(String),
    #[error("{id} is not a pcow device ({} is a raw file)", file.display())]
    RawFile { id: String, file: PathBuf },
    #[error("{0} is not a pcow device")]
    NotPcow(String),
    #[error("--landlock: confining the VMM")]
    Landlock(#[source] crate::landlock_rules::LandlockError),
    #[error(
        "{what} {}: the path is outside the VMM's Landlock rules (--landlock); add its \
         directory with --landlock-rules path=DIR,access=rw",
        path.display()
    )]
    OutsideLandlock { what: &'static str, path: PathBuf },
    #[error(
        "{what} {}: the path is outside the Landlock rules this VMM process is confined to \
         (--landlock); Landlock only narrows, so the rules of the first confined VM are kept \
         for the process's life: give this path's directory with --landlock-rules when that \
         VM is created, or use a new VMM process",
        path.display()
    )]
    OutsideKeptLandlock { what: &'static str, path: PathBuf },
    #[error(
        "vm.restore: clone {id}: {} is outside the Landlock rules of the snapshot's VM \
         (landlock_enable): a clone must lie beside that VM's pmem files or in one of its \
         landlock_rules directories with write access",
        path.display()
    )]
    CloneOutsideLandlock { id: String, path: PathBuf },
    #[error(
        "pmem {id} has discard_writes: {what} is refused (the image is never \
         written, the guest's writes are discarded); remove the device or use \
         `pcow-img` on the image while no VM runs on it"
    )]
    Discarding { id: String, what: &'static str },
    #[error("{}: no snapshot with id or tag {snapshot:?}", path.display())]
    NoSuchSnapshot { path: PathBuf, snapshot: String },

    // VM snapshots.
    #[error("{0}")]
    BadRestore(#[source] crate::snapshot::restore::RestoreError),
    #[error("taking the snapshot")]
    Snapshot(#[source] Box<crate::snapshot::capture::CaptureFailed>),
    #[error("restoring the snapshot")]
    Restore(#[source] Box<crate::snapshot::restore_machine::RestoreFailed>),

    // Building, starting, stopping the machine.
    #[error("building the VM")]
    Chardevs(#[source] ChardevError),
    #[error("building the VM")]
    Build(#[source] MachineError),
    #[error("starting the vCPUs")]
    Start(#[source] MachineError),
    #[error("pausing the VM")]
    Pause(#[source] VcpuError),
    /// Written as one message (`what: why`), as the VMM always answered.
    #[error("{what}: {}", error_report::chain(error))]
    Shutdown {
        what: &'static str,
        error: ShutdownError,
    },
    #[error("vm.power-button")]
    PowerButton(#[source] MachineError),

    // pcow images and live devices.
    /// A file the config names could not be read.
    #[error("{}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Opening an image for an action on it (the status follows the
    /// image's error).
    #[error("opening {}", path.display())]
    OpenImage {
        path: PathBuf,
        #[source]
        source: Box<pcow::Error>,
    },
    /// Opening an image only to look at it (a failure is the host's).
    #[error("opening {}", path.display())]
    InspectImage {
        path: PathBuf,
        #[source]
        source: Box<pcow::Error>,
    },
    /// An offline action on an image (`what`: "pmem snapshot", ...).
    #[error("{what}")]
    Image {
        what: &'static str,
        #[source]
        source: Box<pcow::Error>,
    },
    /// A live action's barrier (`what`: "pmem flush", ...).
    #[error("{what}")]
    Barrier {
        what: &'static str,
        #[source]
        source: virtio_pmem_pcow::BarrierError,
    },
    #[error("pmem overlay")]
    Overlay(#[source] virtio_pmem_pcow::OverlayError),
    #[error("pmem {id}: status")]
    Status {
        id: String,
        #[source]
        source: virtio_pmem_pcow::BarrierError,
    },
    #[error("pmem {id}: {}", path.display())]
    PmemInfo {
        id: String,
        path: PathBuf,
        #[source]
        source: Box<pcow::Error>,
    },
}
