//! The whole virtual machine, built from a validated [`VmConfig`]: the KVM
//! VM with its in-kernel irqchip, guest RAM with the kernel and boot data,
//! ACPI tables, the virtio-pci functions in upstream's order (the console
//! unless `--console off`, the entropy device, then the pmem devices, each
//! a region from the device crate with its memslot above RAM), the PCI
//! bus, the legacy ports, and the vCPUs configured and ready to start.
//! With `--console off` the entropy device is 00:01.0 and the first pmem
//! 00:02.0, as upstream.
//!
//! [`Machine::build`] does everything that can fail before any guest code
//! runs, so a bad kernel, a bad image or a busy lock is an error before
//! the guest starts. [`Machine::start`] spawns each pmem device's threads
//! (its fault thread for a pcow image, its queue thread:
//! [`crate::pmem_threads`]), then the vCPU threads; the VMM thread's
//! control loop ([`crate::control`]) then serves the machine, and
//! [`crate::control::stop`] ends it: the vCPUs
//! ([`Machine::stop_vcpus`]), the device threads
//! ([`Machine::stop_device_threads`]), then the final barrier of every
//! device ([`Machine::final_barriers`]).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvm_ioctls::{IoEventAddress, NoDatamatch, VmFd};
use pcow::TempOptions;
use virtio_pmem_pcow::{
    BarrierError, BarrierStats, Monitor, PcowRegion, PmemBackend, PmemDevice, RawRegion,
    RegionOptions,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::acpi::{self, AcpiConfig};
use crate::boot::linux::{self, BootSource};
use crate::chardev::{Backend, Chardevs};
use crate::config::{PmemFormat, ValidatedPmem, VmConfig};
use crate::cpu;
use crate::device_tree::{self, DeviceTree, Resource};
use crate::health::OutOfSpace;
use crate::irq::{self, GsiRouter, MsixIrqs};
use crate::legacy::ports::PortBusBuilder;
use crate::legacy::power::{power_channel, PowerDevice, PowerEventReceiver};
use crate::legacy::serial::{SerialDevice, SharedSerial, COM1_IRQ};
use crate::pci::virtio_pci::{BAR_INDEX, NOTIFY_OFFSET, NOTIFY_OFF_MULTIPLIER};
use crate::pci::{
    BarMove, ConsoleDevice, ConsoleInput, Mmio64Window, PciBus, PciConfigIo, PmemVirtio, RngDevice,
    VirtioDevice, VirtioPciDevice,
};
use crate::pmem_threads::{DeviceAlerts, PmemThreads};
use crate::seccomp_filters;
use crate::vcpu::{self, MmioBus, Vcpu, VcpuControl, VcpuThread};
use crate::vm::{Memslot, Vm};

/// The environment variable naming the directory of the temporary
/// overlays of pcow devices with `discard_writes` (default: each image's
/// own directory).
pub const DISCARD_DIR_ENV: &str = "PCOW_DISCARD_DIR";

/// The directory [`DISCARD_DIR_ENV`] names; unset or empty: `None`.
fn discard_dir() -> Option<PathBuf> {
    std::env::var_os(DISCARD_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// How the VMM opens a pcow region: the device crate's threads (fault
/// monitor, pool worker) install their seccomp filters as they start.
fn region_options() -> RegionOptions {
    RegionOptions {
        thread_hook: Some(seccomp_filters::device_thread_hook()),
        ..RegionOptions::default()
    }
}

/// Opens a pcow device with `discard_writes`: the guest writes into a
/// temporary overlay (an unlinked file) over the image, which is only
/// read and is locked shared, so other VMs may run on it at once. The
/// overlay goes with the machine: at shutdown, reboot, or the VMM's exit
/// (upstream's `discard_writes` maps a raw file `MAP_PRIVATE`, whose
/// writes go with the mapping in the same way).
fn open_discarding(
    p: &ValidatedPmem,
    ctl: Arc<VcpuControl>,
) -> Result<(PcowRegion, Monitor), MachineError> {
    let dir = discard_dir();
    let shown = dir
        .clone()
        .or_else(|| p.file.parent().map(PathBuf::from))
        .unwrap_or_default();
    PcowRegion::open_discarding(
        &p.file,
        &TempOptions { dir, named: false },
        ctl,
        &region_options(),
    )
    .map_err(|source| MachineError::PcowDiscard {
        id: p.id.clone(),
        path: p.file.clone(),
        dir: shown.clone(),
        source: Box::new(source),
    })
    .inspect(|(region, _)| {
        let chain = region.status().map(|s| s.chain).unwrap_or_default();
        log::info!(
            "pmem {}: discard_writes: the guest writes into {}, discarded with the machine",
            p.id,
            chain
                .first()
                .map_or_else(|| shown.display().to_string(), |c| c.display().to_string())
        );
    })
}

/// Errors of building and starting a machine.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    #[error("the config has no kernel (--kernel)")]
    NoKernel,
    #[error("creating the VM")]
    Vm(#[source] crate::vm::VmError),
    #[error("KVM_CREATE_IRQCHIP")]
    Irqchip(#[source] kvm_ioctls::Error),
    #[error("interrupt setup")]
    Irq(#[source] irq::IrqError),
    #[error("vCPU setup")]
    Cpu(#[source] cpu::CpuError),
    #[error("vCPU")]
    Vcpu(#[source] vcpu::VcpuError),
    #[error("loading the kernel")]
    Boot(#[source] crate::boot::BootError),
    #[error("writing the ACPI tables")]
    Acpi(#[source] acpi::AcpiError),
    #[error(
        "pmem device {id} ({}): discard_writes: a temporary overlay in {} \
         (set {DISCARD_DIR_ENV} to use another directory)",
        path.display(),
        dir.display()
    )]
    PcowDiscard {
        id: String,
        path: PathBuf,
        dir: PathBuf,
        #[source]
        source: Box<virtio_pmem_pcow::RegionError>,
    },
    #[error("pmem device {id} ({})", path.display())]
    PcowRegion {
        id: String,
        path: PathBuf,
        #[source]
        source: Box<virtio_pmem_pcow::RegionError>,
    },
    #[error("pmem device {id} ({})", path.display())]
    RawRegion {
        id: String,
        path: PathBuf,
        #[source]
        source: virtio_pmem_pcow::RawError,
    },
    #[error("pmem device {id}: the region is {len:#x} bytes, the config says {size:#x}")]
    RegionSize { id: String, len: u64, size: u64 },
    #[error("pmem device {id}: attaching KVM's dirty log")]
    WriteLog {
        id: String,
        #[source]
        source: Box<BarrierError>,
    },
    #[error("pmem device {id}: memslot")]
    Memslot {
        id: String,
        #[source]
        source: crate::vm::VmError,
    },
    #[error("virtio-rng")]
    Rng(#[source] crate::pci::rng::RngError),
    #[error("{id}: virtio-pci function")]
    VirtioPci {
        id: String,
        #[source]
        source: crate::pci::VirtioPciError,
    },
    #[error("PCI bus")]
    Pci(#[source] crate::pci::PciError),
    #[error("legacy ports")]
    Ports(#[source] crate::legacy::ports::PortsError),
    #[error("serial port")]
    Serial(#[source] crate::legacy::serial::SerialError),
    #[error("power events")]
    Power(#[source] crate::legacy::power::PowerError),
    #[error("creating an eventfd")]
    EventFd(#[source] std::io::Error),
    #[error("pmem device {id}: starting its threads")]
    DeviceThreads {
        id: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the snapshot's RAM is {ram:#x} bytes, its config says {config:#x}")]
    RestoredRam { ram: u64, config: u64 },
    #[error("raising the power button interrupt (GSI {})", acpi::GED_GSI)]
    PowerButton(#[source] std::io::Error),
}

/// The copy-on-write granularity: a barrier moves whole 4 KiB pages.
const COW_PAGE: u64 = 4096;

/// One pmem device of a machine.
pub struct Pmem {
    // Field order is drop order: the device's threads stop first, then
    // the memslot goes before the region it points at can be unmapped.
    threads: Option<PmemThreads>,
    slot: Memslot,
    /// The device id.
    pub id: String,
    /// The backing file.
    pub file: PathBuf,
    /// Its format.
    pub format: PmemFormat,
    /// The virtio-pci function.
    pub virtio: Arc<Mutex<VirtioPciDevice>>,
    /// The userfaultfd monitor (pcow only), served by the device's
    /// `pmemN-fault` thread once the machine started.
    pub monitor: Option<Arc<Monitor>>,
    /// The region.
    pub backend: PmemBackend,
    /// Queue notification eventfds (one per queue), until
    /// [`Machine::start`] hands them to the device's `pmemN-queue` thread.
    pub notify: Vec<EventFd>,
    /// The PCI address, `0000:00:DD.F`.
    pub bdf: String,
}

impl Pmem {
    /// Guest-physical address of the region.
    pub fn gpa(&self) -> u64 {
        self.slot.gpa()
    }

    /// Size of the region.
    pub fn size(&self) -> u64 {
        self.slot.len()
    }

    /// The pcow region (`None` for a raw file).
    pub fn pcow(&self) -> Option<&PcowRegion> {
        match &self.backend {
            PmemBackend::Pcow(r) => Some(r),
            PmemBackend::Raw(_) => None,
        }
    }

    /// Barriers that succeeded so far (FLUSH requests, the API's, the
    /// final one).
    pub fn barriers(&self) -> u64 {
        self.pcow().map_or(0, |r| r.barrier_totals().barriers)
    }

    /// Why the guest must wait for free space on this device, if it must:
    /// a FLUSH stalled in the queue, or a write fault that got no cluster.
    pub fn out_of_space(&self) -> Option<OutOfSpace> {
        let stalled = self
            .virtio
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stalled();
        if let Some(why) = stalled {
            return Some(OutOfSpace::Flush {
                id: self.id.clone(),
                why,
            });
        }
        let region = self.pcow()?;
        match region.out_of_space() {
            Ok(why) => why.map(|why| OutOfSpace::Fault {
                id: self.id.clone(),
                why,
            }),
            Err(error) => Some(OutOfSpace::Unknown {
                id: self.id.clone(),
                error,
            }),
        }
    }

    /// After space was freed: a barrier moves what the guest wrote while
    /// the file system was full into the image, then a stalled FLUSH is
    /// retried and answered. Fails (and changes nothing the guest sees)
    /// while there is still no space. Call with the vCPUs held.
    pub fn retry_out_of_space(&self) -> Result<(), OutOfSpace> {
        let mut v = self.virtio.lock().unwrap_or_else(|e| e.into_inner());
        if v.stalled().is_some() {
            // The waiting FLUSH's own barrier moves everything; it stalls
            // again while there is still no space.
            v.unstall();
            return match v.stalled() {
                Some(why) => Err(OutOfSpace::Flush {
                    id: self.id.clone(),
                    why,
                }),
                None => Ok(()),
            };
        }
        drop(v);
        let waiting = self
            .pcow()
            .is_some_and(|r| !matches!(r.out_of_space(), Ok(None)));
        if waiting {
            // Space first: the write that fell back to zeros may not have
            // reached its page, and a barrier with nothing to move would
            // then let the guest run on a full file system.
            if let Some(Err(error)) = self.pcow().map(PcowRegion::reserve_space) {
                return Err(OutOfSpace::Barrier {
                    id: self.id.clone(),
                    error,
                });
            }
            if let Some(Err(error)) = self.barrier() {
                return Err(OutOfSpace::Barrier {
                    id: self.id.clone(),
                    error,
                });
            }
        }
        Ok(())
    }

    /// The device's counters for `vm.counters`: the virtio device's own
    /// (FLUSH requests), then for pcow what the barriers and the monitor
    /// did. `bytes_written` counts what the device itself wrote into the
    /// image (pages moved by copy-on-write); the guest's stores through
    /// shared mappings never pass through the VMM.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let mut c = self
            .virtio
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .counters();
        if let Some(r) = self.pcow() {
            let totals = r.barrier_totals();
            let copied = totals.pages_copied;
            c.push(("barriers", totals.barriers));
            c.push(("pages_copied", copied));
            c.push(("bytes_written", copied * COW_PAGE));
            if let Some(f) = self.monitor.as_ref().and_then(|m| m.counters().ok()) {
                c.push(("expansions", f.write_faults));
                c.push(("clusters_ahead", f.clusters_ahead));
                c.push(("zero_maps", f.read_faults));
                c.push(("deferred_maps", f.deferred_mapped));
                c.push(("deferred_copies", f.deferred_copied));
                c.push(("deferred_ahead", f.deferred_ahead));
            }
        }
        c
    }

    /// A host-initiated barrier on a pcow device (an API flush); `None`
    /// for a raw file.
    pub fn barrier(&self) -> Option<Result<BarrierStats, BarrierError>> {
        self.pcow().map(PcowRegion::barrier)
    }

    /// A raw file's fsync (`None` for pcow).
    pub fn sync_raw(&self) -> Option<std::io::Result<()>> {
        match &self.backend {
            PmemBackend::Pcow(_) => None,
            PmemBackend::Raw(r) => Some(r.sync()),
        }
    }

    /// The barrier at the end of a run: pcow's, or fsync for a raw file.
    fn final_barrier(&self) -> Result<Option<BarrierStats>, Box<dyn std::error::Error>> {
        match &self.backend {
            PmemBackend::Pcow(r) => Ok(Some(r.barrier()?)),
            PmemBackend::Raw(r) => {
                r.sync()?;
                Ok(None)
            }
        }
    }
}

/// A virtio-pci function of the VMM's own (the entropy device, the
/// console).
pub struct VirtioFn {
    /// The device id (`__rng`, `__console`, as upstream names them).
    pub id: &'static str,
    /// The function.
    pub virtio: Arc<Mutex<VirtioPciDevice>>,
    /// Queue notification eventfds (one per queue).
    pub notify: Vec<EventFd>,
    /// The PCI address, `0000:00:DD.F`.
    pub bdf: String,
}

impl VirtioFn {
    /// The device's counters (`vm.counters`).
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        self.virtio
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .counters()
    }

    /// Serves queue `queue` (a notification, or new input).
    pub fn serve(&self, queue: u16) {
        self.virtio
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .notify_queue(queue);
    }
}

/// The virtio console of a machine.
pub struct Console {
    /// Its function.
    pub function: VirtioFn,
    /// Input waiting for the guest (the control loop fills it).
    pub input: Arc<Mutex<ConsoleInput>>,
}

/// The queue notify ioeventfds of every virtio-pci function, moved with
/// its BAR (the bus's hook reports every change of what a BAR decodes).
struct IoEvents {
    vm: Arc<VmFd>,
    /// Per PCI slot: the queues' eventfds.
    devices: HashMap<u8, Vec<EventFd>>,
}

impl IoEvents {
    fn addr(base: u64, queue: usize) -> IoEventAddress {
        IoEventAddress::Mmio(base + NOTIFY_OFFSET + queue as u64 * u64::from(NOTIFY_OFF_MULTIPLIER))
    }

    fn bar_moved(&self, m: BarMove) {
        if m.bar != BAR_INDEX {
            return;
        }
        let Some(fds) = self.devices.get(&m.address.device) else {
            return;
        };
        for (q, fd) in fds.iter().enumerate() {
            if let Some(old) = m.old {
                if let Err(e) = self
                    .vm
                    .unregister_ioevent(fd, &Self::addr(old, q), NoDatamatch)
                {
                    log::warn!(
                        "{}: queue {q}: removing the ioeventfd at {old:#x}: {e}",
                        m.address
                    );
                }
            }
            if let Some(new) = m.new {
                // Without the ioeventfd the notification still arrives, as
                // an MMIO exit: the vCPU signals the same eventfd
                // (`VirtioPciDevice::set_queue_kicks`).
                if let Err(e) = self
                    .vm
                    .register_ioevent(fd, &Self::addr(new, q), NoDatamatch)
                {
                    log::warn!("{}: queue {q}: ioeventfd at {new:#x}: {e}", m.address);
                }
            }
        }
        log::debug!("{}: BAR {} {:x?} -> {:x?}", m.address, m.bar, m.old, m.new);
    }
}

/// The PCI bus as a vCPU's MMIO handler.
struct PciMmio(Arc<Mutex<PciBus>>);

impl MmioBus for PciMmio {
    fn mmio_read(&mut self, addr: u64, data: &mut [u8]) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .mmio_read(addr, data)
    }

    fn mmio_write(&mut self, addr: u64, data: &[u8]) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .mmio_write(addr, data)
    }
}

/// A built machine.
pub struct Machine {
    // Field order is drop order: vCPU threads are joined (by `shutdown`)
    // before anything here drops; the pmem memslots go before the VM.
    threads: Vec<VcpuThread>,
    vcpus: Vec<Vcpu>,
    /// The pmem devices, in config order.
    pub pmem: Vec<Pmem>,
    /// The virtio console (absent with `--console off`).
    pub console: Option<Console>,
    /// The virtio-rng device.
    pub rng: VirtioFn,
    /// The serial port's and the console's backends (kept across reboots
    /// by the VMM).
    pub chardevs: Arc<Chardevs>,
    /// The serial port (absent with `--serial off`).
    pub serial: Option<SharedSerial>,
    /// Guest power-off and reset requests.
    pub power: PowerEventReceiver,
    /// Written by each vCPU thread when its run ends.
    pub vcpu_exit: Arc<EventFd>,
    /// The pmem device threads' reports (a monitor failed, a device waits
    /// for space), polled by the control loop.
    pub alerts: Arc<DeviceAlerts>,
    /// Pause/resume of the vCPUs (the pmem barriers hold them through it).
    pub ctl: Arc<VcpuControl>,
    /// Why the VMM paused the guest by itself (a pmem device found its
    /// file system full: the only reason it does), until `vm.resume`
    /// finds space again.
    pub pause_reason: Option<OutOfSpace>,
    /// The ACPI Generic Event Device's interrupt (an irqfd on
    /// [`acpi::GED_GSI`]): the power button.
    ged: EventFd,
    /// The power ports (kept for their snapshot state).
    power_device: Arc<Mutex<PowerDevice>>,
    bus: Arc<Mutex<PciBus>>,
    ports: crate::legacy::ports::PortBus,
    _router: Arc<GsiRouter>,
    vm: Vm,
}

fn cap<T>(id: &str, r: Result<T, crate::vm::VmError>) -> Result<T, MachineError> {
    r.map_err(|source| MachineError::Memslot {
        id: id.to_owned(),
        source,
    })
}

/// A new function, the eventfds of its queues and its address.
type NewFunction = (
    Arc<Mutex<VirtioPciDevice>>,
    Vec<EventFd>,
    crate::pci::PciAddress,
);

/// Puts `dev` behind a new virtio-pci function on `bus`, with MSI-X
/// through irqfds and one ioeventfd per queue (registered when its BAR
/// decodes). Returns the function, the eventfds the control loop polls,
/// and the PCI address.
fn add_function(
    bus: &mut PciBus,
    io_events: &mut IoEvents,
    router: &Arc<GsiRouter>,
    vm: &Vm,
    id: &str,
    dev: Box<dyn VirtioDevice>,
) -> Result<NewFunction, MachineError> {
    let nqueues = dev.queue_max_sizes().len() as u16;
    let irqs = MsixIrqs::new(router.clone(), nqueues + 1).map_err(MachineError::Irq)?;
    let mut dev =
        VirtioPciDevice::new(dev, vm.memory().clone(), Arc::new(irqs)).map_err(|source| {
            MachineError::VirtioPci {
                id: id.to_owned(),
                source,
            }
        })?;
    let mut kvm_fds = Vec::new();
    let mut loop_fds = Vec::new();
    let mut kicks = Vec::new();
    for _ in 0..nqueues {
        let fd = EventFd::new(EFD_NONBLOCK).map_err(MachineError::EventFd)?;
        loop_fds.push(fd.try_clone().map_err(MachineError::EventFd)?);
        kicks.push(fd.try_clone().map_err(MachineError::EventFd)?);
        kvm_fds.push(fd);
    }
    // Whether KVM's ioeventfd or an MMIO exit carries a notification, the
    // thread waiting on `loop_fds` serves the queue.
    dev.set_queue_kicks(kicks);
    let dev = Arc::new(Mutex::new(dev));
    let addr = bus.add_device(dev.clone()).map_err(MachineError::Pci)?;
    io_events.devices.insert(addr.device, kvm_fds);
    Ok((dev, loop_fds, addr))
}

impl Machine {
    /// Builds the machine for `config`, whose validation returned `pmem`,
    /// its serial port and console on `chardevs` (opened for this VM with
    /// [`Chardevs::open`]).
    pub fn build(
        config: &VmConfig,
        pmem: &[ValidatedPmem],
        chardevs: &Arc<Chardevs>,
    ) -> Result<Machine, MachineError> {
        let payload = config.payload.as_ref();
        let kernel = payload
            .and_then(|p| p.kernel.as_deref())
            .ok_or(MachineError::NoKernel)?;
        let ram_size = config.memory.size;
        let vm = Vm::new(&crate::vm::VmConfig { ram_size }).map_err(MachineError::Vm)?;
        // The kernel first: a file that is not a kernel fails before any
        // image is opened.
        let boot = linux::load(
            vm.memory(),
            &BootSource {
                kernel,
                initramfs: payload.and_then(|p| p.initramfs.as_deref()),
                cmdline: payload.and_then(|p| p.cmdline.as_deref()).unwrap_or(""),
                ram_size,
            },
        )
        .map_err(MachineError::Boot)?;
        crate::boot::write_reset_stub(vm.memory()).map_err(MachineError::Boot)?;
        let m = Self::assemble(config, pmem, chardevs, vm)?;
        // ACPI tables, now that the PCI window is known.
        let window = lock_state(&m.bus).window();
        acpi::create_acpi_tables(
            m.vm.memory(),
            &AcpiConfig {
                vcpus: usize::from(config.cpus.boot_vcpus),
                pci_mmio64_start: window.base,
                pci_mmio64_size: window.size,
            },
        )
        .map_err(MachineError::Acpi)?;
        if let Some(v) = m.vcpus.first() {
            v.set_regs(&boot.vcpu.regs()).map_err(MachineError::Vcpu)?;
            v.update_sregs(|s| boot.vcpu.apply_sregs(s))
                .map_err(MachineError::Vcpu)?;
        }
        log::info!(
            "machine: {} vCPU(s), {} MiB RAM, kernel {} ({:?}), {} pmem device(s)",
            config.cpus.boot_vcpus,
            ram_size >> 20,
            kernel.display(),
            boot.protocol,
            m.pmem.len()
        );
        Ok(m)
    }

    /// Builds the machine of a restored snapshot: `config` and `pmem` as
    /// the snapshot's config gives them (pmem files already swapped for
    /// the restore's own), guest RAM `memory` from `memory-ranges` (the
    /// kernel, boot data and ACPI tables are in it). Devices, vCPUs and
    /// irqchip are fresh, in the same order and places as the source
    /// machine's, for [`Machine::restore_devices`] and the vCPU and VM
    /// states to be put back into.
    pub fn build_restored(
        config: &VmConfig,
        pmem: &[ValidatedPmem],
        chardevs: &Arc<Chardevs>,
        memory: vm_memory::GuestMemoryMmap,
    ) -> Result<Machine, MachineError> {
        let kvm =
            kvm_ioctls::Kvm::new().map_err(|e| MachineError::Vm(crate::vm::VmError::OpenKvm(e)))?;
        let vm = Vm::with_memory(kvm, memory).map_err(MachineError::Vm)?;
        if vm.ram_end() != config.memory.size {
            return Err(MachineError::RestoredRam {
                ram: vm.ram_end(),
                config: config.memory.size,
            });
        }
        let m = Self::assemble(config, pmem, chardevs, vm)?;
        log::info!(
            "machine restored: {} vCPU(s), {} MiB RAM, {} pmem device(s)",
            config.cpus.boot_vcpus,
            config.memory.size >> 20,
            m.pmem.len()
        );
        Ok(m)
    }

    /// What a booted and a restored machine share: the irqchip, the
    /// devices in upstream's order with their pmem regions above RAM, the
    /// legacy ports, and the vCPUs (configured, without registers yet).
    fn assemble(
        config: &VmConfig,
        pmem: &[ValidatedPmem],
        chardevs: &Arc<Chardevs>,
        vm: Vm,
    ) -> Result<Machine, MachineError> {
        let nvcpus = config.cpus.boot_vcpus;
        vm.fd().create_irq_chip().map_err(MachineError::Irqchip)?;
        let router = GsiRouter::new(vm.fd_arc());
        router.install_defaults().map_err(MachineError::Irq)?;
        let ctl = VcpuControl::new().map_err(MachineError::Vcpu)?;
        // The entropy source next: a bad `--rng src=` fails before any
        // image is opened.
        let rng_dev = RngDevice::open(&config.rng.src).map_err(MachineError::Rng)?;
        // pmem regions and their memslots, 2 MiB aligned above RAM.
        let mut regions = Vec::new();
        for p in pmem {
            let cfg = config
                .pmem()
                .iter()
                .find(|c| c.id.as_deref() == Some(p.id.as_str()));
            let discard = cfg.is_some_and(|c| c.discard_writes);
            let (backend, monitor, host, len) = match p.format {
                PmemFormat::Pcow => {
                    let (region, monitor) = if discard {
                        open_discarding(p, ctl.clone())?
                    } else {
                        PcowRegion::open(&p.file, ctl.clone(), &region_options()).map_err(
                            |source| MachineError::PcowRegion {
                                id: p.id.clone(),
                                path: p.file.clone(),
                                source: Box::new(source),
                            },
                        )?
                    };
                    let (host, len) = (region.host_addr(), region.len());
                    (
                        PmemBackend::Pcow(Arc::new(region)),
                        Some(Arc::new(monitor)),
                        host,
                        len,
                    )
                }
                PmemFormat::Raw => {
                    let region = RawRegion::open(&p.file, discard).map_err(|source| {
                        MachineError::RawRegion {
                            id: p.id.clone(),
                            path: p.file.clone(),
                            source,
                        }
                    })?;
                    let m = region.mapping();
                    let (host, len) = (m.as_ptr(), m.len() as u64);
                    (PmemBackend::Raw(Arc::new(region)), None, host, len)
                }
            };
            // A raw file may be longer than the device (size=): the guest
            // sees the first `size` bytes.
            if len < p.size || (p.format == PmemFormat::Pcow && len != p.size) {
                return Err(MachineError::RegionSize {
                    id: p.id.clone(),
                    len,
                    size: p.size,
                });
            }
            let gpa = cap(&p.id, vm.next_region_gpa())?;
            let slot = match &backend {
                PmemBackend::Pcow(region) => {
                    // SAFETY: `Pmem` declares `slot` before `backend` and
                    // `monitor`, which keep the region mapped: the memslot
                    // is deleted first.
                    let slot = cap(&p.id, unsafe { vm.add_logged_region(gpa, host, p.size) })?;
                    // Barriers follow the guest's writes through KVM's
                    // dirty log (the first one scans once: the region is
                    // fresh, but that is the log's rule, not ours to skip).
                    if let Some(log) = slot.write_log() {
                        region.attach_write_log(Arc::new(log)).map_err(|e| {
                            MachineError::WriteLog {
                                id: p.id.clone(),
                                source: Box::new(e),
                            }
                        })?;
                        let how = match vm.dirty_rings() {
                            Some(r) => format!("dirty ring ({} entries per vCPU)", r.entries()),
                            None => "dirty bitmap".into(),
                        };
                        log::info!("pmem {}: barriers follow KVM's dirty log: its {how}", p.id);
                    }
                    slot
                }
                // SAFETY: `Pmem` declares `slot` before `backend`, which
                // keeps the file mapped: the memslot is deleted first.
                PmemBackend::Raw(_) => cap(&p.id, unsafe { vm.add_region(gpa, host, p.size) })?,
            };
            regions.push((p, slot, backend, monitor));
        }
        let regions_end = regions
            .iter()
            .map(|r| r.1.gpa() + r.1.len())
            .max()
            .unwrap_or(0);
        let window = Mmio64Window::above(regions_end.max(vm.ram_end()));
        let mut bus = PciBus::new(window);

        let mut io_events = IoEvents {
            vm: vm.fd_arc(),
            devices: HashMap::new(),
        };
        let mut add = |id: &str, dev: Box<dyn VirtioDevice>| {
            add_function(&mut bus, &mut io_events, &router, &vm, id, dev)
        };
        // Upstream's order: console, rng, then the pmem devices.
        let console = match &chardevs.console {
            Backend::Off => None,
            b => {
                let input = ConsoleInput::shared();
                let sink = b
                    .output()
                    .map(|o| Box::new(o.writer()) as Box<dyn std::io::Write + Send>);
                let dev = ConsoleDevice::new(sink, input.clone());
                let (virtio, notify, addr) = add("__console", Box::new(dev))?;
                log::info!("virtio-console: {:?}, PCI {addr}", config.console.mode);
                Some(Console {
                    function: VirtioFn {
                        id: "__console",
                        virtio,
                        notify,
                        bdf: addr.to_string(),
                    },
                    input,
                })
            }
        };
        let rng_src = rng_dev.path().display().to_string();
        let (virtio, notify, addr) = add("__rng", Box::new(rng_dev))?;
        log::info!("virtio-rng: {rng_src}, PCI {addr}");
        let rng = VirtioFn {
            id: "__rng",
            virtio,
            notify,
            bdf: addr.to_string(),
        };
        let mut devices = Vec::new();
        for (p, slot, backend, monitor) in regions {
            let virtio = PmemVirtio::new(PmemDevice::new(slot.gpa(), slot.len(), backend.clone()));
            let (dev, loop_fds, addr) = add(&p.id, Box::new(virtio))?;
            log::info!(
                "pmem {}: {} ({:?}) at guest {:#x}, {} MiB, PCI {addr}",
                p.id,
                p.file.display(),
                p.format,
                slot.gpa(),
                slot.len() >> 20
            );
            devices.push(Pmem {
                threads: None,
                slot,
                id: p.id.clone(),
                file: p.file.clone(),
                format: p.format,
                virtio: dev,
                monitor,
                backend,
                notify: loop_fds,
                bdf: addr.to_string(),
            });
        }
        // Nothing decodes yet (memory space is off until the guest's
        // driver enables it): the hook registers each notify address when
        // its BAR starts decoding.
        let io_events = Arc::new(io_events);
        let ev = io_events.clone();
        bus.set_bar_hook(move |m| ev.bar_moved(m));
        let bus = Arc::new(Mutex::new(bus));

        // Legacy devices.
        let (power_tx, power) = power_channel().map_err(MachineError::Power)?;
        let serial_irq = irq::irqfd(vm.fd(), COM1_IRQ).map_err(MachineError::Irq)?;
        let serial =
            SerialDevice::from_config(&config.serial, &chardevs.serial, Box::new(serial_irq))
                .map_err(MachineError::Serial)?
                .map(SerialDevice::shared);
        let mut ports = PortBusBuilder::new();
        if let Some(s) = &serial {
            ports.add_serial(s.clone()).map_err(MachineError::Ports)?;
        }
        let power_device = PowerDevice::new(power_tx).shared();
        ports
            .add_power(power_device.clone())
            .map_err(MachineError::Ports)?;
        ports
            .add_pci_config(PciConfigIo::new(bus.clone()))
            .map_err(MachineError::Ports)?;
        // Where Linux looks for the source of an NMI (vm.nmi).
        ports.add_system_control_b().map_err(MachineError::Ports)?;
        let ports = ports.build();
        let ged = irq::irqfd(vm.fd(), acpi::GED_GSI).map_err(MachineError::Irq)?;

        // vCPUs: CPUID, MSRs, FPU, LAPIC.
        let base_cpuid = cpu::supported_cpuid(vm.kvm()).map_err(MachineError::Cpu)?;
        let tsc_deadline = cpu::tsc_deadline(vm.kvm());
        let mut vcpus = Vec::new();
        for id in 0..nvcpus {
            let v = vm.create_vcpu(id).map_err(MachineError::Vm)?;
            let cpuid = cpu::patch_cpuid(&base_cpuid, id, nvcpus, tsc_deadline);
            cpu::configure(&v, &cpuid).map_err(MachineError::Cpu)?;
            vcpus.push(v);
        }
        Ok(Machine {
            threads: Vec::new(),
            vcpus,
            pmem: devices,
            console,
            rng,
            chardevs: chardevs.clone(),
            serial,
            power,
            vcpu_exit: Arc::new(EventFd::new(EFD_NONBLOCK).map_err(MachineError::EventFd)?),
            alerts: Arc::new(DeviceAlerts::new().map_err(MachineError::EventFd)?),
            ctl,
            pause_reason: None,
            ged,
            power_device,
            bus,
            ports,
            _router: router,
            vm,
        })
    }
    /// `vm.info`'s device tree: the serial port, the IO-APIC, and each
    /// virtio device (console, rng, pmem) under its PCI function.
    pub fn device_tree(&self) -> DeviceTree {
        use crate::legacy::serial::{COM1_BASE, COM1_SIZE};
        let mut tree = DeviceTree::new();
        if self.serial.is_some() {
            device_tree::add_platform(
                &mut tree,
                "__serial",
                vec![
                    Resource::PioAddressRange {
                        base: COM1_BASE,
                        size: COM1_SIZE,
                    },
                    Resource::LegacyIrq(COM1_IRQ),
                ],
            );
        }
        device_tree::add_platform(
            &mut tree,
            "__ioapic",
            vec![Resource::MmioAddressRange {
                base: crate::boot::layout::IOAPIC_START,
                size: crate::boot::layout::IOAPIC_SIZE,
            }],
        );
        let functions = self
            .console
            .iter()
            .map(|c| &c.function)
            .chain(std::iter::once(&self.rng));
        for f in functions {
            let bar = f.virtio.lock().unwrap_or_else(|e| e.into_inner()).bar();
            device_tree::add_virtio(&mut tree, f.id, &f.bdf, bar, Vec::new());
        }
        for p in &self.pmem {
            let bar = p.virtio.lock().unwrap_or_else(|e| e.into_inner()).bar();
            let region = Resource::MmioAddressRange {
                base: p.gpa(),
                size: p.size(),
            };
            device_tree::add_virtio(&mut tree, &p.id, &p.bdf, bar, vec![region]);
        }
        tree
    }

    /// Starts the threads of every pmem device (`pmemN-fault` for a pcow
    /// image's monitor, `pmemN-queue` for its queue), then every vCPU on
    /// its own thread.
    pub fn start(&mut self) -> Result<(), MachineError> {
        for (index, p) in self.pmem.iter_mut().enumerate() {
            let threads = PmemThreads::spawn(
                index,
                &p.id,
                p.virtio.clone(),
                std::mem::take(&mut p.notify),
                p.monitor.clone(),
                &self.alerts,
            )
            .map_err(|source| MachineError::DeviceThreads {
                id: p.id.clone(),
                source,
            })?;
            p.threads = Some(threads);
        }
        for v in self.vcpus.drain(..) {
            let t = vcpu::spawn_notifying(
                v,
                self.ctl.clone(),
                Box::new(self.ports.clone()),
                Box::new(PciMmio(self.bus.clone())),
                Some(self.vcpu_exit.clone()),
            )
            .map_err(MachineError::Vcpu)?;
            self.threads.push(t);
        }
        Ok(())
    }

    /// The KVM VM.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// The eventfd of the vCPU exits.
    pub fn vcpu_exit_fd(&self) -> RawFd {
        self.vcpu_exit.as_raw_fd()
    }

    /// Takes the vCPU threads that have ended, with their results.
    pub fn reap_vcpus(&mut self) -> Vec<vcpu::VcpuResult> {
        // The eventfd counts the threads that signalled; each signals just
        // before it returns, so give those a moment to finish.
        let signalled = self.vcpu_exit.read().unwrap_or(0) as usize;
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.threads.iter().filter(|t| t.is_finished()).count() < signalled
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        let (done, running): (Vec<_>, Vec<_>) =
            self.threads.drain(..).partition(|t| t.is_finished());
        self.threads = running;
        done.into_iter().map(VcpuThread::join).collect()
    }

    /// Whether any vCPU thread is still running.
    pub fn vcpus_running(&self) -> bool {
        self.threads.iter().any(|t| !t.is_finished())
    }

    /// Asks every vCPU to stop (they leave `KVM_RUN` at the kick).
    pub fn stop_vcpus(&self) {
        self.ctl.stop();
    }

    /// Stops and joins the threads of every pmem device: each queue
    /// thread, then its fault thread. Call once the vCPUs have stopped (a
    /// vCPU in a fault needs the fault thread to leave it).
    pub fn stop_device_threads(&mut self) {
        for p in &mut self.pmem {
            p.threads = None;
        }
    }

    /// Presses the ACPI power button: raises the Generic Event Device's
    /// interrupt, whose `_EVT` notifies `\_SB_.PWRB` (see [`crate::acpi`]).
    /// What happens next is the guest's choice (a Linux guest with an ACPI
    /// event handler powers off, and the VMM then ends as on any guest
    /// power-off). On a paused VM the interrupt waits for the resume.
    pub fn power_button(&self) -> Result<(), MachineError> {
        self.ged.write(1).map_err(MachineError::PowerButton)
    }

    /// Injects an NMI into every vCPU (each vCPU's thread queues it before
    /// its next run; a paused vCPU takes it at the resume). Returns how many
    /// vCPUs got one.
    pub fn nmi(&self) -> usize {
        self.ctl.nmi()
    }

    /// The first device that waits for free space, and why.
    pub fn out_of_space(&self) -> Option<OutOfSpace> {
        self.pmem.iter().find_map(Pmem::out_of_space)
    }

    /// Runs the barrier of every device (raw: fsync). Errors are logged and
    /// counted; returns how many failed.
    pub fn final_barriers(&self) -> usize {
        let mut failed = 0;
        for p in &self.pmem {
            match p.final_barrier() {
                Ok(Some(s)) => {
                    log::info!("pmem {}: final barrier: {s:?}", p.id);
                    // What the guest's accesses cost over the whole run:
                    // faults the monitor resolved, and how the clusters are
                    // mapped at the end.
                    if let Some(Ok(st)) = p.pcow().map(PcowRegion::status) {
                        log::info!(
                            "pmem {}: faults: {} write, {} read, {} woken only, {} clusters mapped ahead, {} left unmapped at open mapped ({} copied in, {} read ahead); clusters: {} shared, {} private, {} zero-mapped, {} holes",
                            p.id,
                            st.faults.write_faults,
                            st.faults.read_faults,
                            st.faults.wake_only,
                            st.faults.clusters_ahead,
                            st.faults.deferred_mapped,
                            st.faults.deferred_copied,
                            st.faults.deferred_ahead,
                            st.shared,
                            st.private,
                            st.zero_mapped,
                            st.holes
                        );
                    }
                }
                Ok(None) => log::info!("pmem {}: final fsync", p.id),
                Err(e) => {
                    log::error!("pmem {}: final barrier failed: {e}", p.id);
                    failed += 1;
                }
            }
        }
        failed
    }
}

// ---- Snapshot device state (issue 17, the "devstate" piece) ----

use crate::snapshot::device_state::{
    virtio_pci_id, DeviceState, DeviceStates, DeviceStatesError, PCI_BUS_ID, POWER_ID, SERIAL_ID,
};

/// Locks `m`, through a poisoned lock (the state is still read whole).
fn lock_state<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Machine {
    /// The virtio-pci functions: (device id, function), console, rng,
    /// then pmem as built.
    fn virtio_functions(&self) -> Vec<(&str, &Arc<Mutex<VirtioPciDevice>>)> {
        let mut v: Vec<(&str, &Arc<Mutex<VirtioPciDevice>>)> = Vec::new();
        if let Some(c) = &self.console {
            v.push((c.function.id, &c.function.virtio));
        }
        v.push((self.rng.id, &self.rng.virtio));
        for p in &self.pmem {
            v.push((p.id.as_str(), &p.virtio));
        }
        v
    }

    /// The state of every device (serial, power ports, PCI bus, each
    /// virtio-pci function, the console's input), by device id. Call with
    /// the vCPUs paused.
    pub fn device_states(&self) -> DeviceStates {
        let held = self.hold_pmem_queues();
        self.device_states_held(&held)
    }

    /// Holds every pmem function, in device order, until the guards drop:
    /// a request its queue thread serves finishes first, and the thread
    /// serves nothing more meanwhile. With the vCPUs paused too, nothing
    /// changes the devices' state or their rings in guest RAM: a snapshot
    /// captures both at one instant.
    pub fn hold_pmem_queues(&self) -> Vec<std::sync::MutexGuard<'_, VirtioPciDevice>> {
        self.pmem.iter().map(|p| lock_state(&p.virtio)).collect()
    }

    /// [`Machine::device_states`] with the pmem functions already held
    /// ([`Machine::hold_pmem_queues`]).
    pub fn device_states_held(
        &self,
        held: &[std::sync::MutexGuard<'_, VirtioPciDevice>],
    ) -> DeviceStates {
        let mut s = DeviceStates::new();
        if let Some(serial) = &self.serial {
            let st = lock_state(serial).state();
            s.insert(SERIAL_ID, DeviceState::Serial(st));
        }
        let power = lock_state(&self.power_device).state();
        s.insert(POWER_ID, DeviceState::Power(power));
        let bus = lock_state(&self.bus).state();
        s.insert(PCI_BUS_ID, DeviceState::PciBus(bus));
        let own = self.console.iter().map(|c| &c.function).chain([&self.rng]);
        for f in own {
            let st = lock_state(&f.virtio).state();
            s.insert(virtio_pci_id(f.id), DeviceState::VirtioPci(Box::new(st)));
        }
        for (p, guard) in self.pmem.iter().zip(held) {
            s.insert(
                virtio_pci_id(&p.id),
                DeviceState::VirtioPci(Box::new(guard.state())),
            );
        }
        if let Some(c) = &self.console {
            let st = lock_state(&c.input).state();
            s.insert(c.function.id, DeviceState::ConsoleInput(st));
        }
        s
    }

    /// Restores `states` into this machine, built from the same config
    /// and not started: every device of the machine must have its state,
    /// and every state its device. Each device checks its state before
    /// changing; a machine whose restore failed half-way must be dropped.
    /// Ends by registering the notify ioeventfds where the restored BARs
    /// decode.
    pub fn restore_devices(&mut self, mut states: DeviceStates) -> Result<(), DeviceStatesError> {
        let at = |id: &str| {
            let id = id.to_owned();
            move |source| DeviceStatesError::Device { id, source }
        };
        if let Some(serial) = &self.serial {
            let st = states.take_serial(SERIAL_ID)?;
            lock_state(serial).restore(&st).map_err(at(SERIAL_ID))?;
        }
        let st = states.take_power(POWER_ID)?;
        lock_state(&self.power_device)
            .restore(&st)
            .map_err(at(POWER_ID))?;
        let st = states.take_pci_bus(PCI_BUS_ID)?;
        let window = {
            let mut bus = lock_state(&self.bus);
            bus.restore(&st).map_err(at(PCI_BUS_ID))?;
            bus.window()
        };
        for (id, f) in self.virtio_functions() {
            let fid = virtio_pci_id(id);
            let st = states.take_virtio_pci(&fid)?;
            lock_state(f).restore(*st, window).map_err(at(&fid))?;
        }
        if let Some(c) = &self.console {
            let st = states.take_console_input(c.function.id)?;
            lock_state(&c.input)
                .restore(&st)
                .map_err(at(c.function.id))?;
        }
        states.finish()?;
        lock_state(&self.bus).announce_bars();
        Ok(())
    }

    /// Serves every queue of each activated virtio-pci function once (see
    /// [`VirtioPciDevice::serve_restored_queues`]): call after
    /// [`Machine::restore_devices`], once the guest RAM, vCPU and irqchip
    /// states are restored too, just before the vCPUs run.
    pub fn serve_restored_queues(&self) {
        for (_, f) in self.virtio_functions() {
            lock_state(f).serve_restored_queues();
        }
    }
}
