//! [`VmmError`] -> HTTP status and error chain: the one place that decides
//! what a failed action answers (upstream's codes: 400 for a request or
//! config that cannot work, 404 for no VM or an unknown device, 409 for a
//! duplicate or a busy image, 500 for the wrong state and the host's own
//! failures).

use virtio_pmem_pcow::{BarrierError, OverlayError, RegionError};

use super::ApiError;
use crate::chardev::ChardevError;
use crate::config::ValidationError;
use crate::machine::MachineError;
use crate::snapshot::capture::CaptureFailed;
use crate::snapshot::restore_machine::RestoreFailed;
use crate::vmm_error::VmmError;

/// The answer to a failed action: its status and its chain (outermost
/// first; [`super::ApiReceiver::serve`] puts upstream's two leading
/// elements in front).
pub fn api_error(e: &VmmError) -> ApiError {
    ApiError {
        status: status(e),
        chain: chain(e),
    }
}

/// The error and its sources, one element each. A variant whose message
/// already holds its cause (a shutdown that failed) is one element.
fn chain(e: &VmmError) -> Vec<String> {
    error_report::messages(e)
}

/// The status `e` answers with.
pub fn status(e: &VmmError) -> u16 {
    match e {
        VmmError::NotCreated | VmmError::NoSuchDevice(_) | VmmError::NoSuchPmem(_) => 404,
        VmmError::NoSuchSnapshot { .. } => 404,
        VmmError::NotRunning
        | VmmError::WrongState(_)
        | VmmError::StillOutOfSpace { .. }
        | VmmError::Start(_)
        | VmmError::Pause(_)
        | VmmError::Shutdown { .. }
        | VmmError::PowerButton(_)
        | VmmError::File { .. }
        | VmmError::InspectImage { .. }
        | VmmError::Status { .. }
        | VmmError::PmemInfo { .. } => 500,
        VmmError::InvalidConfig(_)
        | VmmError::InvalidResize(_)
        | VmmError::BadValue(_)
        | VmmError::Unsupported { .. }
        | VmmError::RawFile { .. }
        | VmmError::NotPcow(_)
        | VmmError::Discarding { .. } => 400,
        // Upstream answers a Landlock refusal as any other failure.
        VmmError::Landlock(_)
        | VmmError::OutsideLandlock { .. }
        | VmmError::OutsideKeptLandlock { .. }
        | VmmError::CloneOutsideLandlock { .. } => 500,
        VmmError::AddPmem(v) => match v {
            ValidationError::DuplicateId(_) | ValidationError::PmemSameFile { .. } => 409,
            _ => 400,
        },
        VmmError::Chardevs(c) => chardev_status(c),
        VmmError::Build(b) => build_status(b),
        VmmError::OpenImage { source, .. } | VmmError::Image { source, .. } => pcow_status(source),
        VmmError::Barrier { source, .. } => barrier_status(source),
        VmmError::BadRestore(_) => 400,
        VmmError::Snapshot(c) => snapshot_status(c),
        VmmError::Restore(r) => restore_status(r),
        VmmError::Overlay(o) => match o {
            OverlayError::Exists { .. } => 409,
            OverlayError::Path { .. } => 400,
            // For one, a chain already at its depth limit.
            OverlayError::Image { source, .. } => pcow_status(source),
            _ => 500,
        },
    }
}

/// The status a pcow library error answers with.
fn pcow_status(e: &pcow::Error) -> u16 {
    match e {
        pcow::Error::NoSuchSnapshot { .. } => 404,
        pcow::Error::DuplicateTag { .. } | pcow::Error::Locked { .. } => 409,
        pcow::Error::BadTag { .. }
        | pcow::Error::Limit { .. }
        | pcow::Error::ChainTooDeep { .. } => 400,
        _ => 500,
    }
}

/// The status a failed machine build answers with: 400 when the config
/// names something that cannot work (not a kernel, a serial file that
/// cannot be opened, ...), 500 for the host's own failures.
fn build_status(e: &MachineError) -> u16 {
    use crate::legacy::serial::SerialError;
    match e {
        MachineError::NoKernel => 400,
        MachineError::Boot(b) if b.is_config_error() => 400,
        MachineError::Serial(SerialError::Interrupt(_)) => 500,
        MachineError::Serial(_) | MachineError::Rng(_) => 400,
        // An image larger than the device maps: the file the config names.
        MachineError::PcowRegion { source, .. } | MachineError::PcowDiscard { source, .. }
            if matches!(
                **source,
                RegionError::TooManyClusters { .. } | RegionError::TooLarge(_)
            ) =>
        {
            400
        }
        _ => 500,
    }
}

/// The status a backend that cannot be opened answers with: 400 for what
/// the config names (a file, a socket path), 500 for the host's own.
fn chardev_status(e: &ChardevError) -> u16 {
    match e {
        ChardevError::Pty { .. } | ChardevError::Stdout { .. } | ChardevError::Thread(_) => 500,
        _ => 400,
    }
}

/// The status a live action's barrier error answers with.
fn barrier_status(e: &BarrierError) -> u16 {
    match e {
        BarrierError::Image(p) => pcow_status(p),
        BarrierError::Discarding => 400,
        _ => 500,
    }
}

/// A snapshot or a restore that failed: 500, as upstream answers every
/// failure of `vm.snapshot` and `vm.restore` (a request this VMM refuses
/// before trying is [`VmmError::BadRestore`], 400).
fn snapshot_status(_: &CaptureFailed) -> u16 {
    500
}

fn restore_status(_: &RestoreFailed) -> u16 {
    500
}
