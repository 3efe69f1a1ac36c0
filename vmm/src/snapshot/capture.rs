//! `vm.snapshot`: a paused machine written into a snapshot directory
//! (`docs/snapshots.md`).
//!
//! Order, chosen for the crash contract of `docs/snapshot-format.md`:
//! every check that can refuse comes before the first write; the vCPU
//! and VM states are read; then, with every pmem queue held so that no
//! device changes its rings in guest RAM, the device states are read,
//! guest RAM is written to `memory-ranges` and each pmem device's content
//! is captured (pcow: frozen under a new overlay; raw: synced and
//! identified); `config.json`; and `state.json` last, which alone makes
//! the directory a snapshot. A failure or a crash before it leaves a
//! directory that restore refuses as incomplete; the running VM's images
//! stay consistent whatever happens (a pcow device frozen before the
//! failure goes on as the frozen file's overlay, which is the same
//! content).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::config::VmConfig;
use crate::machine::Machine;
use crate::snapshot::cpu_state::{CpuStateContext, CpuStateError};
use crate::snapshot::dir::{CapturedState, SnapshotDir, SnapshotError};
use crate::snapshot::pmem_state::{self, CaptureError};
use crate::snapshot::vm_state::{VmState, VmStateError};
use crate::vcpu::VcpuError;

/// Why a snapshot failed.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum CaptureFailed {
    #[error("`destination_url` {0:?}: only file:// URLs are supported (file:///path/to/dir)")]
    NotFileUrl(String),
    #[error("`destination_url` {0:?}: the path must be absolute (file:///path/to/dir)")]
    RelativePath(String),
    #[error("the snapshot directory")]
    Dir(#[source] SnapshotError),
    #[error("reading the vCPU state")]
    CpuContext(#[source] CpuStateError),
    #[error("reading the vCPU state")]
    Vcpus(#[source] VcpuError),
    #[error("reading the irqchip and clock state")]
    VmState(#[source] VmStateError),
    #[error("capturing pmem content")]
    Pmem(#[source] CaptureError),
    #[error("encoding the state")]
    Encode(#[source] serde_json::Error),
}

/// Where each part of a snapshot's time went.
#[derive(Debug, Clone, Default)]
pub struct CaptureTimes {
    /// vCPU, irqchip and clock state.
    pub cpu_state: Duration,
    /// Device states (pmem queues held).
    pub devices: Duration,
    /// `memory-ranges` written and synced.
    pub memory: Duration,
    /// Every pmem device's content captured.
    pub pmem: Duration,
    /// `config.json` and `state.json`.
    pub files: Duration,
}

/// A snapshot taken.
#[derive(Debug, Clone)]
pub struct Captured {
    /// Each pcow device's frozen image, by device id.
    pub frozen: Vec<(String, PathBuf)>,
    /// Where the time went.
    pub times: CaptureTimes,
}

/// The directory of a `destination_url` (`file:///DIR`).
pub fn destination_path(url: &str) -> Result<PathBuf, CaptureFailed> {
    let path = url
        .strip_prefix("file://")
        .ok_or_else(|| CaptureFailed::NotFileUrl(url.to_owned()))?;
    if !path.starts_with('/') {
        return Err(CaptureFailed::RelativePath(url.to_owned()));
    }
    Ok(PathBuf::from(path))
}

/// Writes a snapshot of `machine` (paused, built from `config`) into
/// `dir`, which must exist and be empty. `discarding` lists the pmem
/// devices with `discard_writes` (refused).
pub fn capture(
    machine: &Machine,
    config: &VmConfig,
    discarding: &[String],
    dir: &Path,
) -> Result<Captured, CaptureFailed> {
    pmem_state::check_capturable(&machine.pmem, discarding).map_err(CaptureFailed::Pmem)?;
    let mut writer = SnapshotDir::create(dir).map_err(CaptureFailed::Dir)?;
    let mut times = CaptureTimes::default();

    let t = Instant::now();
    let ctx = CpuStateContext::new(machine.vm()).map_err(CaptureFailed::CpuContext)?;
    let vcpus = machine
        .ctl
        .save_states(&ctx)
        .map_err(CaptureFailed::Vcpus)?;
    let vm = VmState::capture(machine.vm()).map_err(CaptureFailed::VmState)?;
    times.cpu_state = t.elapsed();

    let now_sec = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (devices, pmem) = {
        let held = machine.hold_pmem_queues();
        let t = Instant::now();
        let devices = machine.device_states_held(&held);
        times.devices = t.elapsed();
        let t = Instant::now();
        writer
            .write_memory(machine.vm().memory())
            .map_err(CaptureFailed::Dir)?;
        times.memory = t.elapsed();
        let t = Instant::now();
        let pmem = machine
            .pmem
            .iter()
            .map(|p| pmem_state::capture(p, now_sec))
            .collect::<Result<Vec<_>, _>>()
            .map_err(CaptureFailed::Pmem)?;
        times.pmem = t.elapsed();
        (devices, pmem)
    };

    let t = Instant::now();
    writer.write_config(config).map_err(CaptureFailed::Dir)?;
    let frozen = pmem
        .iter()
        .filter_map(|r| r.frozen.clone().map(|f| (r.id.clone(), f)))
        .collect();
    let captured = CapturedState {
        vcpus: serde_json::to_value(&vcpus).map_err(CaptureFailed::Encode)?,
        vm: serde_json::to_value(&vm).map_err(CaptureFailed::Encode)?,
        devices: serde_json::to_value(&devices).map_err(CaptureFailed::Encode)?,
        pmem: pmem
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<_, _>>()
            .map_err(CaptureFailed::Encode)?,
    };
    writer.finish(captured).map_err(CaptureFailed::Dir)?;
    times.files = t.elapsed();
    Ok(Captured { frozen, times })
}
