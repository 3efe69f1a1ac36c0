//! `vm.restore` and `--restore`: a machine built back from a snapshot
//! directory (`docs/snapshots.md`).
//!
//! Everything that can refuse is read and checked before anything
//! changes: the directory ([`SnapshotDir::open`]), every vCPU, VM and
//! device state decoded and validated, the pmem plan checked against the
//! records and the files, guest RAM read or mapped. Only then are the
//! pmem files made (clones created, or the config's own files rolled
//! back), and the machine is built from the snapshot's config with them,
//! its devices restored, its vCPU threads started held, the vCPU and VM
//! states put back, and the queues served once. The VM is left paused
//! (one hold of its [`crate::vcpu::VcpuControl`]).
//!
//! [`OpenedSnapshot`] stops after the directory is read: the VMM confines
//! itself there (`--landlock`, from the snapshot's config) before the rest
//! opens the VM's files, creates clones and starts threads.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::chardev::{ChardevError, Chardevs};
use crate::config::{ValidationError, VmConfig};
use crate::control;
use crate::machine::{Machine, MachineError};
use crate::snapshot::cpu_state::{CpuStateContext, CpuStateError, VcpuState};
use crate::snapshot::device_state::{DeviceStates, DeviceStatesError};
use crate::snapshot::dir::{Snapshot, SnapshotDir, SnapshotError, STATE_FILE};
use crate::snapshot::pmem_state::{self, PlanError};
use crate::snapshot::restore::RestoreRequest;
use crate::snapshot::vm_state::{VmState, VmStateError};
use crate::vcpu::VcpuError;

/// Why a restore failed.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum RestoreFailed {
    #[error("reading the snapshot")]
    Snapshot(#[source] SnapshotError),
    #[error("{}: `{part}` is invalid", file.display())]
    Decode {
        file: PathBuf,
        part: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: vCPU {index}", file.display())]
    VcpuState {
        file: PathBuf,
        index: usize,
        #[source]
        source: CpuStateError,
    },
    #[error("{}: {states} vCPU state(s), the config has {vcpus} vCPU(s)", file.display())]
    VcpuCount {
        file: PathBuf,
        states: usize,
        vcpus: u8,
    },
    #[error("{}: `vm`", file.display())]
    VmStateInvalid {
        file: PathBuf,
        #[source]
        source: VmStateError,
    },
    #[error("pmem content")]
    Pmem(#[source] PlanError),
    #[error("the restored config")]
    Config(#[source] ValidationError),
    #[error("the restored serial port and console")]
    Chardevs(#[source] ChardevError),
    #[error("building the restored machine")]
    Build(#[source] MachineError),
    #[error("restoring the device states")]
    Devices(#[source] DeviceStatesError),
    #[error("pausing the restored vCPUs")]
    Pause(#[source] VcpuError),
    #[error("starting the restored machine")]
    Start(#[source] MachineError),
    #[error("restoring the vCPU states")]
    CpuContext(#[source] CpuStateError),
    #[error("restoring the vCPU states")]
    Vcpus(#[source] VcpuError),
    #[error("restoring the irqchip and clock")]
    VmState(#[source] VmStateError),
}

/// Where a restore's time went.
#[derive(Debug, Clone, Default)]
pub struct RestoreTimes {
    /// Directory opened, states decoded and checked.
    pub read: Duration,
    /// Guest RAM copied or mapped.
    pub memory: Duration,
    /// Clones created, files rolled back.
    pub pmem: Duration,
    /// Machine built, states restored, vCPU threads started (held).
    pub machine: Duration,
}

/// A restored VM, paused.
pub struct Restored {
    /// The snapshot's config, with the pmem files this VM uses.
    pub config: VmConfig,
    /// The machine, started with its vCPUs held.
    pub machine: Machine,
    /// Its serial port's and console's backends.
    pub chardevs: Arc<Chardevs>,
    /// Clone files created for it.
    pub clones: Vec<PathBuf>,
    /// Where the time went.
    pub times: RestoreTimes,
}

fn decode<T: serde::de::DeserializeOwned>(
    file: &std::path::Path,
    part: &'static str,
    v: &serde_json::Value,
) -> Result<T, RestoreFailed> {
    T::deserialize(v).map_err(|source| RestoreFailed::Decode {
        file: file.to_owned(),
        part,
        source,
    })
}

/// Restores the snapshot `req` names into a new machine, paused.
pub fn restore(req: &RestoreRequest) -> Result<Restored, RestoreFailed> {
    OpenedSnapshot::open(req)?.restore(req)
}

/// A snapshot directory read and checked ([`SnapshotDir::open`]), nothing
/// else opened yet: its config says which files the restored VM will
/// use, so the VMM can confine itself (`--landlock`) before
/// [`OpenedSnapshot::restore`] opens them, creates clones and starts
/// threads.
pub struct OpenedSnapshot {
    snap: Snapshot,
    started: Instant,
}

impl OpenedSnapshot {
    /// Reads and checks the directory `req` names.
    pub fn open(req: &RestoreRequest) -> Result<OpenedSnapshot, RestoreFailed> {
        let started = Instant::now();
        let snap = SnapshotDir::open(&req.source).map_err(RestoreFailed::Snapshot)?;
        Ok(OpenedSnapshot { snap, started })
    }

    /// The snapshot's config (its pmem ids assigned), before the clones of
    /// a restore replace its pmem files.
    pub fn config(&self) -> &VmConfig {
        self.snap.config()
    }

    /// Restores it into a new machine, paused (`req` must be the request
    /// it was opened with).
    pub fn restore(self, req: &RestoreRequest) -> Result<Restored, RestoreFailed> {
        restore_opened(self.snap, self.started, req)
    }
}

fn restore_opened(
    snap: Snapshot,
    t: Instant,
    req: &RestoreRequest,
) -> Result<Restored, RestoreFailed> {
    let mut times = RestoreTimes::default();
    let file = req.source.join(STATE_FILE);
    let state = snap.state();
    let vcpus: Vec<VcpuState> = decode(&file, "vcpus", &state.vcpus)?;
    for (index, v) in vcpus.iter().enumerate() {
        v.validate().map_err(|source| RestoreFailed::VcpuState {
            file: file.clone(),
            index,
            source,
        })?;
    }
    let nvcpus = snap.config().cpus.boot_vcpus;
    if vcpus.len() != usize::from(nvcpus) {
        return Err(RestoreFailed::VcpuCount {
            file,
            states: vcpus.len(),
            vcpus: nvcpus,
        });
    }
    let vm_state: VmState = decode(&file, "vm", &state.vm)?;
    vm_state
        .validate()
        .map_err(|source| RestoreFailed::VmStateInvalid {
            file: file.clone(),
            source,
        })?;
    let devices: DeviceStates = decode(&file, "devices", &state.devices)?;
    let plan = pmem_state::plan(&state.pmem, snap.config().pmem(), &req.pmem)
        .map_err(RestoreFailed::Pmem)?;
    times.read = t.elapsed();

    let t = Instant::now();
    let memory = snap
        .restore_memory(req.memory_restore_mode, req.prefault)
        .map_err(RestoreFailed::Snapshot)?;
    times.memory = t.elapsed();

    let t = Instant::now();
    let clones = plan.apply().map_err(RestoreFailed::Pmem)?;
    times.pmem = t.elapsed();
    // From here on a failure removes the clones made for this restore
    // (nothing else can use them yet).
    let remove_clones = |e: RestoreFailed| {
        for c in &clones {
            if let Err(err) = std::fs::remove_file(c) {
                log::warn!("removing the clone {}: {err}", c.display());
            }
        }
        e
    };

    let t = Instant::now();
    let mut config = snap.config().clone();
    if let Some(list) = config.pmem.as_mut() {
        for c in list.iter_mut() {
            if let Some((_, f)) = plan.files.iter().find(|(id, _)| Some(id) == c.id.as_ref()) {
                c.file = f.clone();
            }
        }
    }
    let pmem = config
        .validate_restored()
        .map_err(|e| remove_clones(RestoreFailed::Config(e)))?;
    let chardevs = Arc::new(
        Chardevs::open(&mut config).map_err(|e| remove_clones(RestoreFailed::Chardevs(e)))?,
    );
    let mut machine = Machine::build_restored(&config, &pmem, &chardevs, memory)
        .map_err(|e| remove_clones(RestoreFailed::Build(e)))?;
    machine
        .restore_devices(devices)
        .map_err(|e| remove_clones(RestoreFailed::Devices(e)))?;
    machine
        .ctl
        .pause()
        .map_err(|e| remove_clones(RestoreFailed::Pause(e)))?;
    if let Err(e) = start_and_restore(&mut machine, &vcpus, &vm_state) {
        if let Err(s) = control::stop(&mut machine) {
            log::error!(
                "stopping a machine whose restore failed: {}",
                error_report::chain(&s)
            );
        }
        drop(machine);
        return Err(remove_clones(e));
    }
    times.machine = t.elapsed();
    Ok(Restored {
        config,
        machine,
        chardevs,
        clones,
        times,
    })
}

/// Starts the device and vCPU threads (the vCPUs held before their first
/// run), puts the vCPU and VM states back, and serves every queue once.
fn start_and_restore(
    machine: &mut Machine,
    vcpus: &[VcpuState],
    vm_state: &VmState,
) -> Result<(), RestoreFailed> {
    machine.start().map_err(RestoreFailed::Start)?;
    let ctx = CpuStateContext::new(machine.vm()).map_err(RestoreFailed::CpuContext)?;
    machine
        .ctl
        .restore_states(vcpus, &ctx)
        .map_err(RestoreFailed::Vcpus)?;
    vm_state
        .restore(machine.vm())
        .map_err(RestoreFailed::VmState)?;
    machine.serve_restored_queues();
    Ok(())
}
