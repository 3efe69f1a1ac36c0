//! The VMM: at most one VM, its lifecycle, and the API actions on it.
//!
//! States of the VM (as `vm.info` reports them):
//!
//! | state | machine | reached by |
//! |---|---|---|
//! | (none) | - | start without `--kernel`, `vm.delete` |
//! | `Created` | - | `--kernel` (before the boot), `vm.create`, `vm.shutdown` |
//! | `Running` | built, vCPUs run | `vm.boot`, `vm.resume`, `vm.reboot`, guest reset |
//! | `Paused` | built, vCPUs held | `vm.pause` |
//!
//! As upstream, a VM that was shut down is `Created` again (it may boot
//! again), and the answers are upstream's (status codes chosen in
//! [`crate::api::errors`]): an action in the wrong state is
//! 500 (`["Error from API", what failed, why]`), `vm.info`, `vm.boot`,
//! `vm.reboot` and the `add-*` actions without a VM are 404, `vm.pause`,
//! `vm.resume`, `vm.shutdown`, `vm.counters`, `vm.power-button` and
//! `vm.nmi` without a running VM are 500, `vm.delete` without a VM is 204.
//!
//! The VMM thread runs [`Vmm::run`]: while a machine exists it is the
//! control loop ([`crate::control::EventLoop`], registered once per boot
//! and kept across requests), which also returns when the API has
//! requests; otherwise it waits for the API or a signal. Every action
//! fails with a [`VmmError`]; the API layer ([`crate::api::errors`])
//! alone turns it into upstream's status and error chain. Guest power-off
//! and SIGTERM/SIGINT end the VMM (exit code 0) after the final barriers,
//! as upstream ends on them; `vmm.shutdown` too.

use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Value};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::api::{
    ApiReceiver, ApiRequest, HandlerResult, PmemOverlay, PmemRollback, PmemSnapshot,
    PmemSnapshotDelete, RequestHandler, Unsupported, VmResize,
};
use crate::chardev::Chardevs;
use crate::config::{PmemConfig, VmConfig, MAX_VCPUS};
use crate::control::{self, Inputs, Outcome};
use crate::event_monitor::event;
use crate::health::OutOfSpace;
use crate::landlock_rules::{threads, vm_needs, vm_rules, Confinement, LandlockRule, RuleAccess};
use crate::machine::{Machine, Pmem};
use crate::snapshot::capture;
use crate::snapshot::restore::{PmemClone, RestoreRequest};
use crate::snapshot::restore_machine::OpenedSnapshot;
use crate::vmm_error::{ShutdownError, VmmError};

/// The VM's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    /// Configured, not booted.
    Created,
    /// vCPUs running.
    Running,
    /// vCPUs held.
    Paused,
}

impl VmState {
    fn name(self) -> &'static str {
        match self {
            VmState::Created => "Created",
            VmState::Running => "Running",
            VmState::Paused => "Paused",
        }
    }
}

struct Vm {
    config: VmConfig,
    state: VmState,
    machine: Option<Machine>,
    /// The control loop of the machine, registered once per boot.
    events: Option<control::EventLoop>,
    boots: u64,
    /// The serial port's and console's backends, opened at the first boot
    /// and kept across reboots (a pty keeps its path).
    chardevs: Option<Arc<Chardevs>>,
}

/// Why the VMM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmmExit {
    /// Guest power-off, a signal, or `vmm.shutdown`: exit code 0.
    Done(String),
    /// A failure (exit code 1).
    Failed(String),
}

/// The VMM state.
pub struct Vmm {
    vm: Option<Vm>,
    inputs: Inputs,
    api: Option<ApiReceiver>,
    exit: Option<VmmExit>,
    /// The Landlock rules this VMM restricted itself to (`--landlock`):
    /// for good once set.
    confinement: Option<Confinement>,
}

fn snapshot_json(s: &pcow::SnapshotInfo) -> Value {
    json!({
        "id": s.id,
        "tag": s.tag,
        "time": pcow::civil::rfc3339(s.time_sec),
    })
}

/// An action in a state that does not allow it (upstream: 500).
fn wrong_state(msg: impl Into<String>) -> VmmError {
    VmmError::WrongState(msg.into())
}

impl Vmm {
    /// A VMM with no VM yet.
    pub fn new(inputs: Inputs, api: Option<ApiReceiver>) -> Vmm {
        Vmm {
            vm: None,
            inputs,
            api,
            exit: None,
            confinement: None,
        }
    }

    /// With `landlock_enable`, restricts the VMM thread (and the threads it
    /// spawns from now on) to what `config` needs plus `extra` (a
    /// restore's snapshot directory), once per process, and tells the
    /// threads that were running before to follow
    /// ([`threads::LateConfinement`]). `clones`, files a restore will
    /// create, must lie within those rules: checked before anything is
    /// restricted or created.
    fn confine(
        &mut self,
        config: &VmConfig,
        extra: &[LandlockRule],
        clones: &[PmemClone],
    ) -> Result<(), VmmError> {
        if !config.landlock_enable || self.confinement.is_some() {
            return Ok(());
        }
        let mut rules = vm_rules(config).map_err(VmmError::Landlock)?;
        rules.extend_from_slice(extra);
        let planned = Confinement::resolve(rules);
        if let Some(c) = clones
            .iter()
            .find(|c| !planned.allows(&c.file, RuleAccess::RW))
        {
            return Err(VmmError::CloneOutsideLandlock {
                id: c.id.clone(),
                path: c.file.clone(),
            });
        }
        let c = planned.restrict().map_err(VmmError::Landlock)?;
        log::info!("--landlock: the VMM is confined to its VM's files and the rules given");
        self.confinement = Some(c);
        threads::process().publish();
        Ok(())
    }

    /// In a process already confined (an earlier VM had `--landlock`),
    /// refuses a VM whose files lie outside the rules it keeps, naming the
    /// first, before any of them is opened (the kernel would only say
    /// "Permission denied", from deep within the action). The tops of
    /// pcow chains are checked before their bases are looked up.
    fn check_kept_rules(
        &self,
        what: &'static str,
        config: &VmConfig,
        clones: &[PmemClone],
    ) -> Result<(), VmmError> {
        let Some(c) = &self.confinement else {
            return Ok(());
        };
        let outside = |path: &Path| VmmError::OutsideKeptLandlock {
            what,
            path: path.to_owned(),
        };
        if let Some(n) = c.first_outside(&vm_needs(config, clones)) {
            return Err(outside(&n.path));
        }
        for p in config.pmem() {
            if let Some(base) = c.first_base_outside(&p.file) {
                return Err(outside(&base));
            }
        }
        Ok(())
    }

    /// Refuses a new path outside the Landlock rules, naming it (the
    /// kernel would only say "Permission denied").
    fn check_landlock(&self, what: &'static str, path: &Path) -> Result<(), VmmError> {
        match &self.confinement {
            Some(c) if !c.allows(path, RuleAccess::RW) => Err(VmmError::OutsideLandlock {
                what,
                path: path.to_owned(),
            }),
            _ => Ok(()),
        }
    }

    fn vm(&self) -> Result<&Vm, VmmError> {
        self.vm.as_ref().ok_or(VmmError::NotCreated)
    }

    fn vm_mut(&mut self) -> Result<&mut Vm, VmmError> {
        self.vm.as_mut().ok_or(VmmError::NotCreated)
    }

    /// The machine of the running (or paused) VM.
    fn machine(&self) -> Result<&Machine, VmmError> {
        self.vm
            .as_ref()
            .and_then(|vm| vm.machine.as_ref())
            .ok_or(VmmError::NotRunning)
    }

    /// The running (or paused) VM and its machine.
    fn machine_mut(&mut self) -> Result<(&mut VmState, &mut Machine), VmmError> {
        match self.vm.as_mut() {
            Some(Vm {
                machine: Some(m),
                state,
                ..
            }) => Ok((state, m)),
            _ => Err(VmmError::NotRunning),
        }
    }

    /// Creates the VM from `config` (validated here).
    pub fn create(&mut self, mut config: VmConfig) -> HandlerResult {
        if let Some(vm) = &self.vm {
            return Err(wrong_state(format!(
                "VM is already created (it is {}): vm.delete it first",
                vm.state.name()
            )));
        }
        self.check_kept_rules("vm.create:", &config, &[])?;
        config.validate().map_err(VmmError::InvalidConfig)?;
        self.confine(&config, &[], &[])?;
        self.vm = Some(Vm {
            config,
            state: VmState::Created,
            machine: None,
            events: None,
            boots: 0,
            chardevs: None,
        });
        Ok(None)
    }

    /// Builds and starts the machine of a created or shut-down VM.
    pub fn boot(&mut self) -> HandlerResult {
        let vm = self.vm_mut()?;
        if vm.machine.is_some() {
            return Err(wrong_state(format!(
                "VM is already booted (it is {})",
                vm.state.name()
            )));
        }
        // Again: the files may have changed since the VM was created.
        let pmem = vm.config.validate().map_err(VmmError::InvalidConfig)?;
        event("vm", "booting", &[]);
        let chardevs = match &vm.chardevs {
            Some(c) => c.clone(),
            None => {
                let c = Chardevs::open(&mut vm.config).map_err(VmmError::Chardevs)?;
                vm.chardevs.insert(Arc::new(c)).clone()
            }
        };
        let mut m = Machine::build(&vm.config, &pmem, &chardevs).map_err(VmmError::Build)?;
        if let Err(e) = m.start() {
            // What started (device threads, vCPUs) stops before the
            // machine goes.
            if let Err(s) = control::stop(&mut m) {
                log::error!(
                    "stopping a machine that did not start: {}",
                    error_report::chain(&s)
                );
            }
            return Err(VmmError::Start(e));
        }
        vm.boots += 1;
        log::info!("guest started (boot {})", vm.boots);
        vm.machine = Some(m);
        vm.state = VmState::Running;
        event("vm", "booted", &[]);
        Ok(None)
    }

    /// Stops the machine (final barriers) if there is one; the state
    /// becomes `Created` again.
    fn stop_machine(&mut self) -> Result<(), ShutdownError> {
        let Some(vm) = self.vm.as_mut() else {
            return Ok(());
        };
        let Some(mut m) = vm.machine.take() else {
            return Ok(());
        };
        vm.state = VmState::Created;
        vm.events = None;
        let failed = control::stop(&mut m)?;
        drop(m);
        event("vm", "shutdown", &[]);
        if failed > 0 {
            return Err(ShutdownError::FinalBarriers { failed });
        }
        Ok(())
    }

    /// Runs until the VMM should end.
    pub fn run(&mut self) -> VmmExit {
        loop {
            if let Some(exit) = self.exit.take() {
                if let Err(e) = self.stop_machine() {
                    return VmmExit::Failed(error_report::chain(&e));
                }
                return exit;
            }
            let api_fd = self.api.as_ref().map(|a| a.evt.as_raw_fd());
            let outcome = match self.vm.as_mut() {
                Some(Vm {
                    machine: Some(m),
                    events,
                    ..
                }) => {
                    let events = match events {
                        Some(l) => Ok(l),
                        None => control::EventLoop::new(m, &self.inputs, api_fd)
                            .map(|l| events.insert(l)),
                    };
                    match events.and_then(|l| l.run(m, &self.inputs)) {
                        Ok(o) => o,
                        Err(e) => Outcome::Failed(e.into()),
                    }
                }
                _ => match self.wait_idle(api_fd) {
                    Ok(o) => o,
                    Err(e) => {
                        self.exit = Some(VmmExit::Failed(e));
                        continue;
                    }
                },
            };
            match outcome {
                Outcome::Api => self.serve_api(),
                Outcome::PowerOff => {
                    self.exit = Some(VmmExit::Done("guest powered off".into()));
                }
                Outcome::Signal(sig) => {
                    self.exit = Some(VmmExit::Done(format!("stopped by signal {sig}")));
                }
                Outcome::Reset => {
                    log::info!("guest reset: booting again");
                    if let Err(e) = self.restart() {
                        self.exit = Some(VmmExit::Failed(error_report::chain(&e)));
                    }
                }
                Outcome::OutOfSpace(why) => self.pause_for_space(why),
                Outcome::Failed(e) => self.exit = Some(VmmExit::Failed(error_report::chain(&e))),
            }
        }
    }

    /// A pmem device found its file system full: the guest pauses (its
    /// writes wait in memory, a FLUSH waits in the queue) until `vm.resume`
    /// finds space again. Nothing is answered with an error and nothing
    /// is lost.
    fn pause_for_space(&mut self, why: OutOfSpace) {
        let Some(vm) = self.vm.as_mut() else { return };
        let Some(m) = vm.machine.as_mut() else { return };
        if vm.state == VmState::Running {
            if let Err(e) = m.ctl.pause() {
                log::error!("pausing the VM for space: {}", error_report::chain(&e));
                return;
            }
            vm.state = VmState::Paused;
            event("vm", "paused", &[("reason", &why.to_string())]);
        }
        log::warn!("VM paused: {why}; free space, then vm.resume");
        m.pause_reason = Some(why);
    }

    /// `vm.resume`: after a pause for space, the devices first move what
    /// waited into their images; the guest stays paused if they cannot.
    fn resume(&mut self) -> HandlerResult {
        let (state, m) = self.machine_mut()?;
        if *state != VmState::Paused {
            return Err(wrong_state(format!("VM is {}, not Paused", state.name())));
        }
        if let Some(why) = &m.pause_reason {
            for p in &m.pmem {
                p.retry_out_of_space()
                    .map_err(|still| VmmError::StillOutOfSpace {
                        still: Box::new(still),
                        paused_for: why.to_string(),
                    })?;
            }
            log::info!("space found again: the VM resumes");
            m.pause_reason = None;
        }
        event("vm", "resuming", &[]);
        m.ctl.resume();
        *state = VmState::Running;
        event("vm", "resumed", &[]);
        Ok(None)
    }

    /// `vm.snapshot` of the paused VM into `destination_url`'s directory.
    fn snapshot(&mut self, destination_url: &str) -> HandlerResult {
        let vm = self.vm.as_ref().ok_or(VmmError::NotRunning)?;
        let Some(m) = vm.machine.as_ref() else {
            return Err(VmmError::NotRunning);
        };
        if vm.state != VmState::Paused {
            return Err(wrong_state("Trying to snapshot while VM is running"));
        }
        let dir = capture::destination_path(destination_url)
            .map_err(|e| VmmError::Snapshot(Box::new(e)))?;
        self.check_landlock("vm.snapshot: destination", &dir)?;
        let discarding: Vec<String> = vm
            .config
            .pmem()
            .iter()
            .filter(|p| p.discard_writes)
            .filter_map(|p| p.id.clone())
            .collect();
        event("vm", "snapshotting", &[]);
        let c = capture::capture(m, &vm.config, &discarding, &dir)
            .map_err(|e| VmmError::Snapshot(Box::new(e)))?;
        let t = &c.times;
        log::info!(
            "snapshot {}: vCPU/VM state {:?}, devices {:?}, RAM {:?}, pmem {:?}, files {:?}",
            dir.display(),
            t.cpu_state,
            t.devices,
            t.memory,
            t.pmem,
            t.files
        );
        event("vm", "snapshotted", &[]);
        Ok(None)
    }

    /// `vm.restore` (and `--restore`): a new VM from a snapshot, paused
    /// unless the request asks to resume it.
    pub fn restore(&mut self, req: &RestoreRequest) -> HandlerResult {
        if let Some(vm) = &self.vm {
            return Err(wrong_state(format!(
                "VM is already created (it is {}): vm.delete it first",
                vm.state.name()
            )));
        }
        // The snapshot's files are the VM's: its directory is read before
        // anything else (a process confined by an earlier VM must allow
        // it) and joins the rules of a VM confined now.
        let source = LandlockRule {
            path: req.source.clone(),
            access: RuleAccess::R,
        };
        if let Some(c) = &self.confinement {
            if let Some(n) = c.first_outside(std::slice::from_ref(&source)) {
                return Err(VmmError::OutsideKeptLandlock {
                    what: "vm.restore: snapshot directory",
                    path: n.path.clone(),
                });
            }
        }
        event("vm", "restoring", &[]);
        let restore_failed = |e| VmmError::Restore(Box::new(e));
        let opened = OpenedSnapshot::open(req).map_err(restore_failed)?;
        // Confined before the restore opens the VM's files, creates its
        // clones and starts its threads (which inherit the domain).
        self.check_kept_rules("vm.restore:", opened.config(), &req.pmem)?;
        self.confine(opened.config(), &[source], &req.pmem)?;
        let r = opened.restore(req).map_err(restore_failed)?;
        let t = &r.times;
        log::info!(
            "restored {}: read {:?}, RAM {:?} ({:?}), pmem {:?}, machine {:?}",
            req.source.display(),
            t.read,
            t.memory,
            req.memory_restore_mode,
            t.pmem,
            t.machine
        );
        self.vm = Some(Vm {
            config: r.config,
            state: VmState::Paused,
            machine: Some(r.machine),
            events: None,
            boots: 1,
            chardevs: Some(r.chardevs),
        });
        event("vm", "restored", &[]);
        if req.resume {
            self.resume()?;
        }
        Ok(None)
    }

    /// Stops and boots again.
    fn restart(&mut self) -> HandlerResult {
        event("vm", "rebooting", &[]);
        self.stop_machine().map_err(|error| VmmError::Shutdown {
            what: "stopping the VM",
            error,
        })?;
        self.boot()?;
        event("vm", "rebooted", &[]);
        Ok(None)
    }

    fn serve_api(&mut self) {
        if let Some(api) = self.api.take() {
            api.serve(self);
            self.api = Some(api);
        }
    }

    /// No machine: waits for an API request or a signal.
    fn wait_idle(&mut self, api_fd: Option<RawFd>) -> Result<Outcome, String> {
        let Some(api_fd) = api_fd else {
            return Err("no VM and no API socket: nothing to do".into());
        };
        let epoll = Epoll::new().map_err(|e| format!("epoll_create: {e}"))?;
        for (fd, data) in [(api_fd, 0u64), (self.inputs.signal_fd, 1)] {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, data),
                )
                .map_err(|e| format!("epoll_ctl: {e}"))?;
        }
        let mut events = [EpollEvent::default(); 2];
        loop {
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("epoll_wait: {e}")),
            };
            for ev in &events[..n] {
                if ev.data() == 1 {
                    if let Some(sig) = control::read_signal(self.inputs.signal_fd) {
                        return Ok(Outcome::Signal(sig));
                    }
                } else {
                    return Ok(Outcome::Api);
                }
            }
        }
    }

    /// `vm.info` in upstream's shape: no `device_tree` before the boot,
    /// no `pause_reason` (ours) unless the VMM paused the guest itself.
    fn info(&self) -> HandlerResult {
        let vm = self.vm()?;
        let mut info = json!({
            "config": vm.config,
            "state": vm.state.name(),
            "memory_actual_size": vm.config.memory.size,
        });
        if let Some(m) = &vm.machine {
            info["device_tree"] = json!(m.device_tree());
            if let Some(why) = &m.pause_reason {
                info["pause_reason"] = json!(why.to_string());
            }
        }
        Ok(Some(info))
    }

    /// `vm.counters`: per device, its counters (upstream's
    /// `{id: {name: value}}`).
    fn counters(&mut self) -> HandlerResult {
        let (_, m) = self.machine_mut()?;
        let object = |c: Vec<(&str, u64)>| {
            Value::Object(
                c.into_iter()
                    .map(|(k, v)| (k.to_owned(), json!(v)))
                    .collect(),
            )
        };
        let mut out = serde_json::Map::new();
        if let Some(c) = &m.console {
            out.insert(c.function.id.to_owned(), object(c.function.counters()));
        }
        out.insert(m.rng.id.to_owned(), object(m.rng.counters()));
        for p in &m.pmem {
            out.insert(p.id.clone(), object(p.counters()));
        }
        Ok(Some(Value::Object(out)))
    }

    /// `vm.resize`: on a VM that is not booted, edits its config as
    /// upstream does (checked here rather than at the next boot); a running
    /// VM keeps its vCPUs and RAM, since this VMM has no vCPU or memory
    /// hot-plug, unless nothing would change.
    fn resize(&mut self, r: VmResize) -> HandlerResult {
        let vm = self.vm_mut()?;
        let cfg = &vm.config;
        let vcpus = match r.desired_vcpus {
            None => None,
            Some(n) => Some(
                u8::try_from(n)
                    .ok()
                    .filter(|n| (1..=MAX_VCPUS).contains(n))
                    .ok_or_else(|| {
                        VmmError::BadValue(format!("desired_vcpus {n}: must be 1 to {MAX_VCPUS}"))
                    })?,
            ),
        };
        if let Some(ram) = r.desired_ram {
            if ram == 0 || ram % (2 << 20) != 0 {
                return Err(VmmError::BadValue(format!(
                    "desired_ram {ram}: must be a non-zero multiple of 2 MiB"
                )));
            }
        }
        if r.desired_balloon.is_some_and(|b| b != 0) {
            return Err(VmmError::BadValue(
                "desired_balloon: this VMM has no virtio-balloon device".into(),
            ));
        }
        let changes_vcpus = vcpus.is_some_and(|n| n != cfg.cpus.boot_vcpus);
        let changes_ram = r.desired_ram.is_some_and(|m| m != cfg.memory.size);
        if vm.machine.is_some() {
            if changes_vcpus || changes_ram {
                return Err(wrong_state(format!(
                    "VM is {}: resizing it needs {} hot-plug, which this VMM does not have; \
                     vm.shutdown, vm.resize, then vm.boot",
                    vm.state.name(),
                    if changes_vcpus { "vCPU" } else { "memory" }
                )));
            }
            return Ok(None);
        }
        let mut next = cfg.clone();
        if let Some(n) = vcpus {
            next.cpus.boot_vcpus = n;
            next.cpus.max_vcpus = next.cpus.max_vcpus.max(n);
        }
        if let Some(ram) = r.desired_ram {
            next.memory.size = ram;
        }
        next.validate().map_err(VmmError::InvalidResize)?;
        event("vm", "resizing", &[]);
        vm.config = next;
        event("vm", "resized", &[]);
        Ok(None)
    }

    /// An upstream endpoint of something this VMM does not have: refused
    /// once the state upstream checks first allows it (a VM for devices,
    /// a booted VM for snapshots, dumps and sending a migration).
    fn unsupported(&self, u: Unsupported) -> HandlerResult {
        match u.action {
            "vm.restore" | "vm.receive-migration" => {}
            "vm.snapshot" | "vm.coredump" | "vm.send-migration" => {
                if self.vm.as_ref().is_none_or(|vm| vm.machine.is_none()) {
                    return Err(VmmError::NotRunning);
                }
            }
            _ => {
                self.vm()?;
            }
        }
        Err(VmmError::Unsupported {
            action: u.action,
            missing: u.missing,
        })
    }

    fn add_pmem(&mut self, cfg: PmemConfig) -> HandlerResult {
        self.vm()?;
        if let Some(c) = &self.confinement {
            let outside = c
                .first_outside(&[LandlockRule {
                    path: cfg.file.clone(),
                    access: RuleAccess::RW,
                }])
                .map(|n| n.path.clone())
                .or_else(|| c.first_base_outside(&cfg.file));
            if let Some(path) = outside {
                return Err(VmmError::OutsideKeptLandlock {
                    what: "vm.add-pmem: file",
                    path,
                });
            }
        }
        let vm = self.vm_mut()?;
        if vm.machine.is_some() {
            return Err(wrong_state(
                "hot-plug of pmem devices into a running VM is not supported: \
                 add the device before vm.boot or after vm.shutdown",
            ));
        }
        vm.config.add_pmem(cfg).map_err(VmmError::AddPmem)?;
        Ok(None)
    }

    fn remove_device(&mut self, id: &str) -> HandlerResult {
        let vm = self.vm_mut()?;
        if vm.machine.is_some() {
            return Err(wrong_state(
                "hot-unplug from a running VM is not supported: \
                 remove the device before vm.boot or after vm.shutdown",
            ));
        }
        let list = vm.config.pmem.get_or_insert_with(Vec::new);
        let before = list.len();
        list.retain(|p| p.id.as_deref() != Some(id));
        if list.len() == before {
            return Err(VmmError::NoSuchDevice(id.to_owned()));
        }
        Ok(None)
    }

    /// The configured pmem device `id` (404 if unknown, 400 if raw).
    fn pcow_config(&self, id: &str) -> Result<PathBuf, VmmError> {
        let vm = self.vm()?;
        let p = vm
            .config
            .pmem()
            .iter()
            .find(|p| p.id.as_deref() == Some(id))
            .ok_or_else(|| VmmError::NoSuchPmem(id.to_owned()))?;
        let unreadable = |source| VmmError::File {
            path: p.file.clone(),
            source,
        };
        let file = std::fs::File::open(&p.file).map_err(unreadable)?;
        let is_pcow = pcow::is_pcow(&file).map_err(unreadable)?;
        if !is_pcow {
            return Err(VmmError::RawFile {
                id: id.to_owned(),
                file: p.file.clone(),
            });
        }
        Ok(p.file.clone())
    }

    /// Refuses `what` (an operation that writes the image) on a device
    /// with `discard_writes`, running or not: such a device never writes
    /// its image, and its own writes are discarded.
    fn refuse_discard(&self, id: &str, what: &'static str) -> Result<(), VmmError> {
        let discards = self
            .vm()?
            .config
            .pmem()
            .iter()
            .any(|p| p.id.as_deref() == Some(id) && p.discard_writes);
        if discards {
            return Err(VmmError::Discarding {
                id: id.to_owned(),
                what,
            });
        }
        Ok(())
    }

    /// The live pcow device `id`, when the machine runs.
    fn live(&self, id: &str) -> Result<Option<&Pmem>, VmmError> {
        self.pcow_config(id)?;
        Ok(self
            .vm()?
            .machine
            .as_ref()
            .and_then(|m| m.pmem.iter().find(|p| p.id == id)))
    }

    fn offline_image(path: &Path) -> Result<pcow::Image, VmmError> {
        pcow::Image::open(path, pcow::OpenOptions::read_write()).map_err(|source| {
            VmmError::OpenImage {
                path: path.to_owned(),
                source: Box::new(source),
            }
        })
    }

    fn pmem_snapshot(&mut self, r: PmemSnapshot) -> HandlerResult {
        self.refuse_discard(&r.id, "a snapshot")?;
        let info = match self.live(&r.id)? {
            Some(p) => p
                .pcow()
                .ok_or_else(|| VmmError::NotPcow(r.id.clone()))?
                .snapshot_create(&r.tag)
                .map_err(|source| VmmError::Barrier {
                    what: "pmem snapshot",
                    source,
                })?,
            None => {
                let path = self.pcow_config(&r.id)?;
                let mut img = Self::offline_image(&path)?;
                img.snapshot_create(&r.tag)
                    .map_err(|source| VmmError::Image {
                        what: "pmem snapshot",
                        source: Box::new(source),
                    })?
            }
        };
        log::info!("pmem {}: snapshot {} ({})", r.id, info.id, info.tag);
        Ok(Some(json!({"id": r.id, "snapshot": snapshot_json(&info)})))
    }

    fn pmem_overlay(&mut self, r: PmemOverlay) -> HandlerResult {
        self.refuse_discard(&r.id, "an overlay")?;
        let Some(p) = self.live(&r.id)? else {
            return Err(wrong_state(
                "the VM is not running: create an overlay offline with \
                 `pcow-img create -b BASE -F pcow FILE` and point the device at it",
            ));
        };
        let region = p.pcow().ok_or_else(|| VmmError::NotPcow(r.id.clone()))?;
        self.check_landlock("vm.pmem-overlay: file", Path::new(&r.file))?;
        let info = region
            .overlay(Path::new(&r.file))
            .map_err(VmmError::Overlay)?;
        // From now on (reboot, reset) the device is the overlay.
        if let Some(vm) = self.vm.as_mut() {
            if let Some(c) = vm
                .config
                .pmem
                .get_or_insert_with(Vec::new)
                .iter_mut()
                .find(|c| c.id.as_deref() == Some(r.id.as_str()))
            {
                c.file = info.file.clone();
            }
            if let Some(m) = vm.machine.as_mut() {
                if let Some(d) = m.pmem.iter_mut().find(|d| d.id == r.id) {
                    d.file = info.file.clone();
                }
            }
        }
        log::info!(
            "pmem {}: overlay {} on {} ({} clusters remapped, held {:?})",
            r.id,
            info.file.display(),
            info.base,
            info.remapped_clusters,
            info.held
        );
        Ok(Some(json!({
            "id": r.id,
            "file": info.file,
            "base": info.base,
        })))
    }

    fn pmem_rollback(&mut self, r: PmemRollback) -> HandlerResult {
        self.refuse_discard(&r.id, "a rollback")?;
        let path = self.pcow_config(&r.id)?;
        let running = self.vm()?.machine.is_some();
        if running && !r.reset {
            return Err(wrong_state(format!(
                "the VM is {}: a rollback replaces what the guest sees under it; \
                 pass \"reset\": true to restart the guest on the snapshot, \
                 or shut the VM down first",
                self.vm()?.state.name()
            )));
        }
        if running {
            // Refuse an unknown snapshot before the guest is stopped for it.
            let opts = pcow::OpenOptions {
                force_share: true,
                ..pcow::OpenOptions::default()
            };
            let img = pcow::Image::open(&path, opts).map_err(|source| VmmError::InspectImage {
                path: path.clone(),
                source: Box::new(source),
            })?;
            let known = img
                .snapshots()
                .iter()
                .any(|s| s.tag == r.snapshot || s.id.to_string() == r.snapshot);
            if !known {
                return Err(VmmError::NoSuchSnapshot {
                    path,
                    snapshot: r.snapshot,
                });
            }
            drop(img);
            self.stop_machine().map_err(|error| VmmError::Shutdown {
                what: "stopping the VM",
                error,
            })?;
        }
        let applied = Self::offline_image(&path).and_then(|mut img| {
            img.snapshot_apply(&r.snapshot)
                .map_err(|source| VmmError::Image {
                    what: "pmem rollback",
                    source: Box::new(source),
                })
        });
        if let Ok(info) = &applied {
            log::info!(
                "pmem {}: rolled back to snapshot {} ({})",
                r.id,
                info.id,
                info.tag
            );
        }
        if running {
            // Back up in any case: on the snapshot, or on the unchanged
            // image if the rollback failed.
            self.boot()?;
        }
        let info = applied?;
        Ok(Some(json!({"id": r.id, "snapshot": snapshot_json(&info)})))
    }

    fn pmem_snapshot_delete(&mut self, r: PmemSnapshotDelete) -> HandlerResult {
        self.refuse_discard(&r.id, "deleting a snapshot")?;
        let info = match self.live(&r.id)? {
            Some(p) => p
                .pcow()
                .ok_or_else(|| VmmError::NotPcow(r.id.clone()))?
                .snapshot_delete(&r.snapshot)
                .map_err(|source| VmmError::Barrier {
                    what: "pmem snapshot delete",
                    source,
                })?,
            None => {
                let path = self.pcow_config(&r.id)?;
                let mut img = Self::offline_image(&path)?;
                img.snapshot_delete(&r.snapshot)
                    .map_err(|source| VmmError::Image {
                        what: "pmem snapshot delete",
                        source: Box::new(source),
                    })?
            }
        };
        Ok(Some(json!({"id": r.id, "snapshot": snapshot_json(&info)})))
    }

    fn pmem_flush(&mut self, id: &str) -> HandlerResult {
        let Some(p) = self.live(id)? else {
            return Err(wrong_state(format!(
                "the VM is {}: nothing to flush (the image is closed)",
                self.vm()?.state.name()
            )));
        };
        let stats = p
            .barrier()
            .ok_or_else(|| VmmError::NotPcow(id.to_owned()))?
            .map_err(|source| VmmError::Barrier {
                what: "pmem flush",
                source,
            })?;
        Ok(Some(json!({
            "id": id,
            "private_pages": stats.private_pages,
            "pages_copied": stats.pages_copied,
            "held_us": stats.held.as_micros() as u64,
        })))
    }

    /// `vm.power-button`: on a Running or Paused VM (as upstream: there the
    /// event waits for the resume). The guest decides what to do; a
    /// power-off then ends the VMM as any other.
    fn power_button(&self) -> HandlerResult {
        let m = self.machine()?;
        m.power_button().map_err(VmmError::PowerButton)?;
        log::info!("ACPI power button pressed");
        Ok(None)
    }

    /// `vm.nmi`: on a Running or Paused VM (as upstream; a paused vCPU
    /// takes it at the resume).
    fn nmi(&self) -> HandlerResult {
        let n = self.machine()?.nmi();
        log::info!("NMI injected into {n} vCPU(s)");
        Ok(None)
    }

    fn pmem_info(&self) -> HandlerResult {
        let vm = self.vm()?;
        let mut out = Vec::new();
        for c in vm.config.pmem() {
            let id = c.id.clone().unwrap_or_default();
            let file_size = std::fs::metadata(&c.file).map(|m| m.len()).ok();
            let live = vm
                .machine
                .as_ref()
                .and_then(|m| m.pmem.iter().find(|p| p.id == id));
            let mut entry = json!({
                "id": id,
                "file": c.file,
                "file_size": file_size,
                "format": "raw",
                "virtual_size": c.size.or(file_size),
                "allocated_clusters": null,
                "cluster_size": null,
                "snapshots": null,
                "chain": null,
                "pending_private_pages": null,
                "barriers": live.map(|p| p.barriers()),
                "out_of_space": live.and_then(Pmem::out_of_space).map(|o| o.to_string()),
                "expansions": null,
            });
            let is_pcow = std::fs::File::open(&c.file)
                .ok()
                .and_then(|f| pcow::is_pcow(&f).ok())
                .unwrap_or(false);
            if let Some(region) = live.and_then(Pmem::pcow) {
                let st = region.status().map_err(|source| VmmError::Status {
                    id: id.clone(),
                    source,
                })?;
                entry["format"] = json!("pcow");
                entry["virtual_size"] = json!(region.len());
                entry["cluster_size"] = json!(region.cluster_size());
                entry["allocated_clusters"] = json!(st.allocated_clusters);
                entry["snapshots"] = st.snapshots.iter().map(snapshot_json).collect();
                entry["chain"] = json!(st.chain);
                entry["pending_private_pages"] = json!(st.pending_private_pages);
                entry["expansions"] = json!(st.faults.write_faults);
            } else if is_pcow {
                let opts = pcow::OpenOptions {
                    force_share: true,
                    ..pcow::OpenOptions::default()
                };
                let img =
                    pcow::Image::open(&c.file, opts).map_err(|source| VmmError::PmemInfo {
                        id: id.clone(),
                        path: c.file.clone(),
                        source: Box::new(source),
                    })?;
                entry["format"] = json!("pcow");
                entry["virtual_size"] = json!(img.virtual_size());
                entry["cluster_size"] = json!(img.cluster_size());
                entry["allocated_clusters"] = json!(img.allocated_clusters());
                entry["snapshots"] = img.snapshots().iter().map(snapshot_json).collect();
                entry["chain"] = json!(img.chain_paths());
                entry["pending_private_pages"] = json!(0);
            }
            out.push(entry);
        }
        Ok(Some(Value::Array(out)))
    }
}

impl RequestHandler for Vmm {
    fn handle(&mut self, request: ApiRequest) -> HandlerResult {
        log::debug!("API request: {request:?}");
        match request {
            ApiRequest::VmmPing => Ok(Some(json!({
                "build_version": env!("CARGO_PKG_VERSION"),
                "version": env!("CARGO_PKG_VERSION"),
                "pid": std::process::id(),
                "features": ["kvm", "pcow"],
            }))),
            ApiRequest::VmmShutdown => {
                event("vmm", "shutdown", &[]);
                self.exit = Some(VmmExit::Done("vmm.shutdown".into()));
                Ok(None)
            }
            ApiRequest::VmCreate(cfg) => self.create(*cfg),
            ApiRequest::VmBoot => self.boot(),
            ApiRequest::VmInfo => self.info(),
            ApiRequest::VmPause => {
                let (state, m) = self.machine_mut()?;
                if *state != VmState::Running {
                    return Err(wrong_state(format!("VM is {}, not Running", state.name())));
                }
                event("vm", "pausing", &[]);
                m.ctl.pause().map_err(VmmError::Pause)?;
                *state = VmState::Paused;
                event("vm", "paused", &[]);
                Ok(None)
            }
            ApiRequest::VmResume => self.resume(),
            ApiRequest::VmShutdown => {
                self.machine_mut()?;
                self.stop_machine().map_err(|error| VmmError::Shutdown {
                    what: "shutting the VM down",
                    error,
                })?;
                Ok(None)
            }
            ApiRequest::VmReboot => {
                if self.vm()?.machine.is_none() {
                    return Err(VmmError::NotCreated);
                }
                self.restart()
            }
            ApiRequest::VmDelete => {
                self.stop_machine().map_err(|error| VmmError::Shutdown {
                    what: "shutting the VM down",
                    error,
                })?;
                if self.vm.take().is_some() {
                    event("vm", "deleted", &[]);
                }
                Ok(None)
            }
            ApiRequest::VmCounters => self.counters(),
            ApiRequest::VmPowerButton => self.power_button(),
            ApiRequest::VmNmi => self.nmi(),
            ApiRequest::VmResize(r) => self.resize(r),
            ApiRequest::VmSnapshot(c) => self.snapshot(&c.destination_url),
            ApiRequest::VmRestore(body) => {
                let req = RestoreRequest::from_value(&body).map_err(VmmError::BadRestore)?;
                self.restore(&req)
            }
            ApiRequest::Unsupported(u) => self.unsupported(u),
            ApiRequest::VmAddPmem(cfg) => self.add_pmem(*cfg),
            ApiRequest::VmRemoveDevice(d) => self.remove_device(&d.id),
            ApiRequest::PmemSnapshot(r) => self.pmem_snapshot(r),
            ApiRequest::PmemOverlay(r) => self.pmem_overlay(r),
            ApiRequest::PmemRollback(r) => self.pmem_rollback(r),
            ApiRequest::PmemSnapshotDelete(r) => self.pmem_snapshot_delete(r),
            ApiRequest::PmemFlush(d) => self.pmem_flush(&d.id),
            ApiRequest::PmemInfo => self.pmem_info(),
        }
    }
}
