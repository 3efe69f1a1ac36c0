//! A modern (virtio 1.x, non-transitional) virtio-pci function driving a
//! [`VirtioDevice`].
//!
//! One 64-bit memory BAR (BAR 0, [`BAR_SIZE`]) holds every structure the
//! vendor capabilities point at, each in its own 4 KiB page:
//!
//! | BAR offset | Structure | Length |
//! |---|---|---|
//! | [`COMMON_OFFSET`] 0x0000 | common configuration (virtio 1.2, 4.1.4.3) | [`COMMON_LEN`] 0x38 |
//! | [`ISR_OFFSET`] 0x1000 | ISR status (read clears) | 1 |
//! | [`DEVICE_CFG_OFFSET`] 0x2000 | device-specific configuration | the device's |
//! | [`NOTIFY_OFFSET`] 0x3000 | queue notify, queue *n* at `4 * n` | `4 * num_queues` |
//! | [`MSIX_TABLE_OFFSET`] 0x4000 | MSI-X table, one vector per queue plus config | `16 * vectors` |
//! | [`MSIX_PBA_OFFSET`] 0x5000 | MSI-X PBA | whole qwords |
//!
//! Config space: vendor 0x1af4, device 0x1040 + type, revision 1,
//! subsystem 0x1af4:0x0040; capabilities common, ISR, device, notify,
//! PCI-cfg access, then MSI-X. No INTx (pin 0): interrupts are MSI-X only,
//! delivered to an [`InterruptSink`]. Notifications arrive through
//! [`VirtioPciDevice::notify`] (the ioeventfd path, with the addresses from
//! [`VirtioPciDevice::notify_addresses`]) or a BAR write (the MMIO exit
//! path).

use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK,
    VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};

use super::bus::PciDevice;
use super::config::{BarSpec, ConfigError, ConfigSpace, PciIds};
use super::msix::{InterruptSink, Msix, MSIX_CAP_ID};

/// Virtio PCI vendor id.
pub const VIRTIO_PCI_VENDOR: u16 = 0x1af4;
/// Modern device ids are this plus the device type.
pub const VIRTIO_PCI_DEVICE_BASE: u16 = 0x1040;
/// Subsystem id of non-transitional devices (0x40 or higher).
pub const VIRTIO_PCI_SUBSYSTEM: u16 = 0x0040;
/// "No MSI-X vector".
pub const NO_VECTOR: u16 = 0xffff;

/// Vendor-specific capability id.
const CAP_VENDOR: u8 = 0x09;
/// `cfg_type` of `struct virtio_pci_cap`.
const CAP_COMMON_CFG: u8 = 1;
const CAP_NOTIFY_CFG: u8 = 2;
const CAP_ISR_CFG: u8 = 3;
const CAP_DEVICE_CFG: u8 = 4;
const CAP_PCI_CFG: u8 = 5;

/// The BAR everything lives in.
pub const BAR_INDEX: usize = 0;
/// Its size.
pub const BAR_SIZE: u64 = 0x8000;
/// Common configuration.
pub const COMMON_OFFSET: u64 = 0x0000;
/// Common configuration length (up to `queue_device`).
pub const COMMON_LEN: u64 = 0x38;
/// ISR status.
pub const ISR_OFFSET: u64 = 0x1000;
/// Device-specific configuration.
pub const DEVICE_CFG_OFFSET: u64 = 0x2000;
/// Device-specific configuration window size (at most).
pub const DEVICE_CFG_MAX: u64 = 0x1000;
/// Queue notify region.
pub const NOTIFY_OFFSET: u64 = 0x3000;
/// `notify_off_multiplier`: queue *n* notifies at `NOTIFY_OFFSET + 4 * n`.
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;
/// MSI-X table.
pub const MSIX_TABLE_OFFSET: u64 = 0x4000;
/// MSI-X pending bit array.
pub const MSIX_PBA_OFFSET: u64 = 0x5000;
/// Queues a device may have (the MSI-X table stays inside its page).
pub const MAX_QUEUES: usize = 64;

/// ISR bit: a queue was used.
const ISR_QUEUE: u8 = 1;
/// ISR bit: the configuration changed.
const ISR_CONFIG: u8 = 2;

// Common configuration register offsets (virtio 1.2, 4.1.4.3).
const DEVICE_FEATURE_SELECT: u64 = 0x00;
const DEVICE_FEATURE: u64 = 0x04;
const DRIVER_FEATURE_SELECT: u64 = 0x08;
const DRIVER_FEATURE: u64 = 0x0c;
const CONFIG_MSIX_VECTOR: u64 = 0x10;
const NUM_QUEUES: u64 = 0x12;
const DEVICE_STATUS: u64 = 0x14;
const CONFIG_GENERATION: u64 = 0x15;
const QUEUE_SELECT: u64 = 0x16;
const QUEUE_SIZE: u64 = 0x18;
const QUEUE_MSIX_VECTOR: u64 = 0x1a;
const QUEUE_ENABLE: u64 = 0x1c;
const QUEUE_NOTIFY_OFF: u64 = 0x1e;
const QUEUE_DESC: u64 = 0x20;
const QUEUE_DRIVER: u64 = 0x28;
const QUEUE_DEVICE: u64 = 0x30;

/// Errors a [`VirtioDevice`] reports.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    #[error("queue {0} is not active")]
    QueueNotActive(u16),
    #[error("activation needs {expected} queue(s), the driver enabled {got}")]
    QueueCount { expected: usize, got: usize },
    #[error("queue {index}: invalid configuration (size or ring addresses)")]
    InvalidQueue { index: u16 },
    #[error("processing queue {index}")]
    Process {
        index: u16,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Errors of building a virtio-pci function.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum VirtioPciError {
    #[error("device has {0} queues: must be 1..={MAX_QUEUES}")]
    QueueCount(usize),
    #[error("device type {0} does not fit a virtio-pci device id")]
    DeviceType(u32),
    #[error("device config of {0} bytes is larger than its window")]
    ConfigSize(usize),
    #[error("building the config space")]
    Config(#[source] ConfigError),
}

/// A virtio device as the transport sees it (the pmem adapter implements
/// it in [`super::pmem`]).
pub trait VirtioDevice: Send {
    /// Virtio device type (27 for pmem).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits offered (the transport adds `VIRTIO_F_VERSION_1`).
    fn features(&self) -> u64;
    /// Size of the device-specific configuration.
    fn config_size(&self) -> usize;
    /// Reads the device-specific configuration at `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// A driver write to the device-specific configuration; dropped by
    /// default (read-only configurations).
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        log::debug!(
            "dropped device config write at {offset:#x} ({} bytes)",
            data.len()
        );
    }
    /// PCI class code (base, sub, interface); "other" by default.
    fn pci_class(&self) -> (u8, u8, u8) {
        (0xff, 0x00, 0x00)
    }
    /// DRIVER_OK: the device takes its enabled queues (index, queue) and
    /// the guest memory; `features` is what the driver accepted.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        features: u64,
        queues: Vec<(u16, Queue)>,
    ) -> Result<(), VirtioError>;
    /// The driver notified queue `index`: serve it. Returns whether the
    /// driver needs an interrupt.
    fn process_queue(&mut self, index: u16) -> Result<bool, VirtioError>;
    /// Device reset: drop the queues (the device may be activated again).
    fn reset(&mut self);
    /// The queues the device holds while active, by index, with their
    /// positions (`next_avail`, `next_used`): what a snapshot saves so a
    /// restored device continues where it was. Empty while inactive.
    fn queue_states(&self) -> Vec<(u16, QueueState)>;
    /// Why the device stopped serving its queues until [`unstall`] (a
    /// request waits for a host condition, such as free space); `None`
    /// by default.
    ///
    /// [`unstall`]: VirtioDevice::unstall
    fn stalled(&self) -> Option<String> {
        None
    }
    /// Lets a stalled device serve its queues again.
    fn unstall(&mut self) {}
    /// The device's own counters for `vm.counters` (name, value); none by
    /// default.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

/// Per-queue registers as the driver programs them.
#[derive(Debug, Clone, Copy)]
struct QueueRegs {
    max: u16,
    size: u16,
    vector: u16,
    enabled: bool,
    desc: u64,
    driver: u64,
    device: u64,
}

impl QueueRegs {
    fn new(max: u16) -> QueueRegs {
        QueueRegs {
            max,
            size: max,
            vector: NO_VECTOR,
            enabled: false,
            desc: 0,
            driver: 0,
            device: 0,
        }
    }
}

/// Replaces the 32-bit half of `v` at byte `shift` (0 or 4) or all of it
/// from a 4- or 8-byte write; other widths leave it.
fn write_u64_part(v: &mut u64, rel: u64, data: &[u8]) {
    match (rel, data.len()) {
        (0, 8) => *v = le(data),
        (0, 4) => *v = (*v & !0xffff_ffff) | le(data),
        (4, 4) => *v = (*v & 0xffff_ffff) | (le(data) << 32),
        _ => log::debug!(
            "virtio-pci: dropped {}-byte queue address write",
            data.len()
        ),
    }
}

/// Little-endian value of up to 8 bytes.
fn le(data: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = data.len().min(8);
    b[..n].copy_from_slice(&data[..n]);
    u64::from_le_bytes(b)
}

/// A virtio-pci function.
pub struct VirtioPciDevice {
    config: ConfigSpace,
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    sink: Arc<dyn InterruptSink + Sync>,
    msix: Msix,
    msix_cap: usize,
    pci_cfg_cap: usize,
    device_features: u64,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    status: u8,
    config_generation: u8,
    config_vector: u16,
    queue_select: u16,
    queues: Vec<QueueRegs>,
    isr: u8,
    active: bool,
    ignored: u64,
    /// The eventfds the queues' own threads wait on (those KVM's
    /// ioeventfds signal), by queue; empty when the queues are served
    /// where they are notified.
    kicks: Vec<EventFd>,
}

impl std::fmt::Debug for VirtioPciDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioPciDevice")
            .field("type", &self.device.device_type())
            .field("status", &self.status)
            .field("active", &self.active)
            .finish()
    }
}

fn vendor_cap(cfg_type: u8, offset: u64, length: u64, extra: &[u8]) -> Vec<u8> {
    let len = 16 + extra.len();
    let mut c = vec![CAP_VENDOR, 0, len as u8, cfg_type, BAR_INDEX as u8, 0, 0, 0];
    c.extend_from_slice(&(offset as u32).to_le_bytes());
    c.extend_from_slice(&(length as u32).to_le_bytes());
    c.extend_from_slice(extra);
    c
}

impl VirtioPciDevice {
    /// A function for `device`, its queues reading and writing `mem`,
    /// interrupts going to `sink`. One MSI-X vector per queue plus one for
    /// configuration changes.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        sink: Arc<dyn InterruptSink + Sync>,
    ) -> Result<VirtioPciDevice, VirtioPciError> {
        let nq = device.queue_max_sizes().len();
        if nq == 0 || nq > MAX_QUEUES {
            return Err(VirtioPciError::QueueCount(nq));
        }
        let ty = device.device_type();
        let dev_id = u16::try_from(ty)
            .ok()
            .and_then(|t| VIRTIO_PCI_DEVICE_BASE.checked_add(t))
            .ok_or(VirtioPciError::DeviceType(ty))?;
        let cfg_len = device.config_size();
        if cfg_len as u64 > DEVICE_CFG_MAX {
            return Err(VirtioPciError::ConfigSize(cfg_len));
        }
        let mut config = ConfigSpace::new(PciIds {
            vendor: VIRTIO_PCI_VENDOR,
            device: dev_id,
            revision: 1,
            class: device.pci_class(),
            subsystem_vendor: VIRTIO_PCI_VENDOR,
            subsystem: VIRTIO_PCI_SUBSYSTEM,
        });
        let e = VirtioPciError::Config;
        config
            .add_bar64(BarSpec {
                index: BAR_INDEX,
                size: BAR_SIZE,
                prefetchable: false,
            })
            .map_err(e)?;
        let msix = Msix::new(nq as u16 + 1);
        let ro: &[u8] = &[];
        config
            .add_capability(
                &vendor_cap(CAP_COMMON_CFG, COMMON_OFFSET, COMMON_LEN, ro),
                ro,
            )
            .map_err(e)?;
        config
            .add_capability(&vendor_cap(CAP_ISR_CFG, ISR_OFFSET, 1, ro), ro)
            .map_err(e)?;
        // Linux refuses a device capability of length 0: a device without
        // configuration (virtio-rng) has none.
        if cfg_len > 0 {
            config
                .add_capability(
                    &vendor_cap(CAP_DEVICE_CFG, DEVICE_CFG_OFFSET, cfg_len as u64, ro),
                    ro,
                )
                .map_err(e)?;
        }
        let notify_len = nq as u64 * u64::from(NOTIFY_OFF_MULTIPLIER);
        config
            .add_capability(
                &vendor_cap(
                    CAP_NOTIFY_CFG,
                    NOTIFY_OFFSET,
                    notify_len,
                    &NOTIFY_OFF_MULTIPLIER.to_le_bytes(),
                ),
                ro,
            )
            .map_err(e)?;
        // virtio_pci_cfg_cap: bar, offset and length writable; the data
        // window is intercepted.
        let mut pci_cfg_mask = [0u8; 20];
        pci_cfg_mask[4] = 0xff;
        pci_cfg_mask[8..16].fill(0xff);
        let pci_cfg_cap = config
            .add_capability(&vendor_cap(CAP_PCI_CFG, 0, 0, &[0; 4]), &pci_cfg_mask)
            .map_err(e)?;
        let mut msix_body = vec![MSIX_CAP_ID, 0];
        msix_body.extend_from_slice(&msix.table_size_field().to_le_bytes());
        msix_body.extend_from_slice(&(MSIX_TABLE_OFFSET as u32 | BAR_INDEX as u32).to_le_bytes());
        msix_body.extend_from_slice(&(MSIX_PBA_OFFSET as u32 | BAR_INDEX as u32).to_le_bytes());
        // enable and function mask (bits 15, 14 of message control)
        let msix_cap = config
            .add_capability(&msix_body, &[0, 0, 0, 0xc0])
            .map_err(e)?;
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&m| QueueRegs::new(m))
            .collect();
        let device_features = device.features() | (1 << VIRTIO_F_VERSION_1);
        Ok(VirtioPciDevice {
            config,
            device,
            mem,
            sink,
            msix,
            msix_cap,
            pci_cfg_cap,
            device_features,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            config_generation: 0,
            config_vector: NO_VECTOR,
            queue_select: 0,
            queues,
            isr: 0,
            active: false,
            ignored: 0,
            kicks: Vec::new(),
        })
    }

    /// The device status byte.
    pub fn status(&self) -> u8 {
        self.status
    }

    /// Whether the device was activated (DRIVER_OK accepted).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// The features the driver accepted.
    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }

    /// The notify addresses for ioeventfds, `(guest address, queue)`, at
    /// the BAR's current address; empty while the BAR does not decode.
    pub fn notify_addresses(&self) -> Vec<(u64, u16)> {
        let Some(base) = self.config.bar_address(BAR_INDEX) else {
            return Vec::new();
        };
        if !self.config.memory_enabled() || base == 0 {
            return Vec::new();
        }
        (0..self.queues.len() as u16)
            .map(|q| {
                let off = NOTIFY_OFFSET + u64::from(q) * u64::from(NOTIFY_OFF_MULTIPLIER);
                (base + off, q)
            })
            .collect()
    }

    fn count_ignored(&mut self, what: &str, offset: u64, len: usize) {
        self.ignored += 1;
        if self.ignored.is_power_of_two() {
            log::debug!(
                "virtio-pci: ignored {what} at BAR offset {offset:#x} ({len} bytes), {} so far",
                self.ignored
            );
        }
    }

    /// Hands the queues to the threads that wait on `kicks` (one eventfd
    /// per queue, those KVM's ioeventfds signal): a notification that
    /// reaches the BAR as an MMIO exit instead (its ioeventfd could not be
    /// registered) signals the queue's eventfd rather than serving the
    /// queue on the vCPU thread. A pmem FLUSH served there would pause
    /// the vCPUs from one of them, and the vCPU's seccomp list has none
    /// of the image I/O a barrier makes.
    pub fn set_queue_kicks(&mut self, kicks: Vec<EventFd>) {
        self.kicks = kicks;
    }

    /// A notification written to the BAR (the MMIO exit path): the queue's
    /// own thread is kicked when it has one, else the queue is served here.
    fn notify_written(&mut self, offset: u64) {
        let m = u64::from(NOTIFY_OFF_MULTIPLIER);
        let kick = usize::try_from(offset / m)
            .ok()
            .filter(|_| offset.is_multiple_of(m))
            .and_then(|q| self.kicks.get(q));
        match kick {
            Some(k) => {
                if let Err(e) = k.write(1) {
                    log::error!("virtio-pci: kicking queue {}: {e}", offset / m);
                }
            }
            None => self.notify(offset),
        }
    }

    /// A notification of the queue at `offset` inside the notify region
    /// (the ioeventfd path calls this with `4 * queue`). Notifications
    /// before DRIVER_OK, for unknown queues or at unaligned offsets are
    /// ignored.
    pub fn notify(&mut self, offset: u64) {
        let m = u64::from(NOTIFY_OFF_MULTIPLIER);
        let q = offset / m;
        if !offset.is_multiple_of(m) || q >= self.queues.len() as u64 {
            self.count_ignored("notify", NOTIFY_OFFSET.saturating_add(offset), 0);
            return;
        }
        self.notify_queue(q as u16);
    }

    /// Serves queue `index` and interrupts the driver if it needs it.
    pub fn notify_queue(&mut self, index: u16) {
        if !self.active || self.status & VIRTIO_CONFIG_S_NEEDS_RESET as u8 != 0 {
            self.count_ignored("notify before DRIVER_OK", NOTIFY_OFFSET, 0);
            return;
        }
        let Some(regs) = self.queues.get(usize::from(index)).copied() else {
            return;
        };
        if !regs.enabled {
            return;
        }
        match self.device.process_queue(index) {
            Ok(true) => {
                self.isr |= ISR_QUEUE;
                if regs.vector != NO_VECTOR {
                    self.msix.raise(regs.vector, &*self.sink);
                }
            }
            Ok(false) => {}
            Err(e) => {
                log::error!("virtio-pci: device type {}: {e}", self.device.device_type());
                self.set_needs_reset();
            }
        }
    }

    /// Why the device stopped serving its queues, if it did.
    pub fn stalled(&self) -> Option<String> {
        self.device.stalled()
    }

    /// Lets a stalled device go on, and serves every queue (the request
    /// that stalled it first).
    pub fn unstall(&mut self) {
        self.device.unstall();
        for q in 0..self.queues.len() as u16 {
            self.notify_queue(q);
        }
    }

    /// The device's counters (`vm.counters`).
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        self.device.counters()
    }

    /// BAR 0 as the guest programmed it: its address (`None` before the
    /// guest assigns one) and its size.
    pub fn bar(&self) -> (Option<u64>, u64) {
        (self.config.bar_address(BAR_INDEX), BAR_SIZE)
    }

    /// Signals a configuration change (config vector, ISR bit 1).
    pub fn config_changed(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        self.isr |= ISR_CONFIG;
        if self.config_vector != NO_VECTOR {
            self.msix.raise(self.config_vector, &*self.sink);
        }
    }

    fn set_needs_reset(&mut self) {
        self.status |= VIRTIO_CONFIG_S_NEEDS_RESET as u8;
        self.config_changed();
    }

    fn reset(&mut self) {
        if self.active {
            self.device.reset();
        }
        self.active = false;
        self.status = 0;
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.config_vector = NO_VECTOR;
        self.queue_select = 0;
        for q in &mut self.queues {
            *q = QueueRegs::new(q.max);
        }
        self.isr = 0;
    }

    fn write_status(&mut self, v: u8) {
        if v == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        if v & old != old {
            // Only a reset clears bits (3.1.1: the driver never clears).
            self.count_ignored("status write clearing bits", DEVICE_STATUS, 1);
            return;
        }
        let mut new = v;
        let features_ok = VIRTIO_CONFIG_S_FEATURES_OK as u8;
        let driver_ok = VIRTIO_CONFIG_S_DRIVER_OK as u8;
        if new & features_ok != 0 && old & features_ok == 0 {
            let unsupported = self.driver_features & !self.device_features;
            let modern = self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0;
            if unsupported != 0 || !modern {
                log::debug!(
                    "virtio-pci: FEATURES_OK refused (driver features {:#x}, offered {:#x})",
                    self.driver_features,
                    self.device_features
                );
                new &= !features_ok;
            }
        }
        if new & driver_ok != 0 && old & driver_ok == 0 {
            if new & features_ok == 0 {
                self.count_ignored("DRIVER_OK without FEATURES_OK", DEVICE_STATUS, 1);
                new &= !driver_ok;
            } else if new & VIRTIO_CONFIG_S_FAILED as u8 == 0 {
                self.status = new;
                if let Err(e) = self.activate() {
                    log::error!("virtio-pci: activation failed: {e}");
                    self.set_needs_reset();
                }
                return;
            }
        }
        self.status = new;
    }

    fn activate(&mut self) -> Result<(), VirtioError> {
        let mut queues = Vec::new();
        let event_idx = self.driver_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        for (i, r) in self.queues.iter().enumerate() {
            if !r.enabled {
                continue;
            }
            let index = i as u16;
            let invalid = |_| VirtioError::InvalidQueue { index };
            let mut q = Queue::new(r.max).map_err(invalid)?;
            q.try_set_size(r.size).map_err(invalid)?;
            q.try_set_desc_table_address(GuestAddress(r.desc))
                .map_err(invalid)?;
            q.try_set_avail_ring_address(GuestAddress(r.driver))
                .map_err(invalid)?;
            q.try_set_used_ring_address(GuestAddress(r.device))
                .map_err(invalid)?;
            q.set_event_idx(event_idx);
            q.set_ready(true);
            if !q.is_valid(&self.mem) {
                return Err(VirtioError::InvalidQueue { index });
            }
            queues.push((index, q));
        }
        self.device
            .activate(self.mem.clone(), self.driver_features, queues)?;
        self.active = true;
        Ok(())
    }

    fn selected(&self) -> Option<&QueueRegs> {
        self.queues.get(usize::from(self.queue_select))
    }

    /// The common configuration as bytes (reads slice it).
    fn common_image(&self) -> [u8; COMMON_LEN as usize] {
        let mut c = [0u8; COMMON_LEN as usize];
        let put = |c: &mut [u8; COMMON_LEN as usize], off: u64, v: &[u8]| {
            c[off as usize..off as usize + v.len()].copy_from_slice(v);
        };
        put(
            &mut c,
            DEVICE_FEATURE_SELECT,
            &self.device_feature_select.to_le_bytes(),
        );
        let window = match self.device_feature_select {
            0 => self.device_features as u32,
            1 => (self.device_features >> 32) as u32,
            _ => 0,
        };
        put(&mut c, DEVICE_FEATURE, &window.to_le_bytes());
        put(
            &mut c,
            DRIVER_FEATURE_SELECT,
            &self.driver_feature_select.to_le_bytes(),
        );
        let window = match self.driver_feature_select {
            0 => self.driver_features as u32,
            1 => (self.driver_features >> 32) as u32,
            _ => 0,
        };
        put(&mut c, DRIVER_FEATURE, &window.to_le_bytes());
        put(
            &mut c,
            CONFIG_MSIX_VECTOR,
            &self.config_vector.to_le_bytes(),
        );
        put(
            &mut c,
            NUM_QUEUES,
            &(self.queues.len() as u16).to_le_bytes(),
        );
        put(&mut c, DEVICE_STATUS, &[self.status]);
        put(&mut c, CONFIG_GENERATION, &[self.config_generation]);
        put(&mut c, QUEUE_SELECT, &self.queue_select.to_le_bytes());
        // An unavailable queue reads size 0 and everything else 0 too.
        if let Some(q) = self.selected() {
            put(&mut c, QUEUE_SIZE, &q.size.to_le_bytes());
            put(&mut c, QUEUE_MSIX_VECTOR, &q.vector.to_le_bytes());
            put(&mut c, QUEUE_ENABLE, &u16::from(q.enabled).to_le_bytes());
            put(&mut c, QUEUE_NOTIFY_OFF, &self.queue_select.to_le_bytes());
            put(&mut c, QUEUE_DESC, &q.desc.to_le_bytes());
            put(&mut c, QUEUE_DRIVER, &q.driver.to_le_bytes());
            put(&mut c, QUEUE_DEVICE, &q.device.to_le_bytes());
        } else {
            put(&mut c, QUEUE_MSIX_VECTOR, &NO_VECTOR.to_le_bytes());
        }
        c
    }

    fn read_common(&self, offset: u64, data: &mut [u8]) {
        let img = self.common_image();
        for (i, b) in data.iter_mut().enumerate() {
            *b = img.get(offset as usize + i).copied().unwrap_or(0);
        }
    }

    fn valid_vector(&self, v: u16) -> u16 {
        if v < self.msix.len() {
            v
        } else {
            NO_VECTOR
        }
    }

    fn write_common(&mut self, offset: u64, data: &[u8]) {
        let v = le(data);
        let len = data.len();
        let driver_ok = self.status & VIRTIO_CONFIG_S_DRIVER_OK as u8 != 0;
        let features_ok = self.status & VIRTIO_CONFIG_S_FEATURES_OK as u8 != 0;
        match (offset, len) {
            (DEVICE_FEATURE_SELECT, 4) => self.device_feature_select = v as u32,
            (DRIVER_FEATURE_SELECT, 4) => self.driver_feature_select = v as u32,
            (DRIVER_FEATURE, 4) if !features_ok => match self.driver_feature_select {
                0 => self.driver_features = (self.driver_features & !0xffff_ffff) | v,
                1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (v << 32),
                _ => self.count_ignored("driver_feature window > 1", offset, len),
            },
            (CONFIG_MSIX_VECTOR, 2) => self.config_vector = self.valid_vector(v as u16),
            (DEVICE_STATUS, 1) => self.write_status(v as u8),
            (QUEUE_SELECT, 2) => self.queue_select = v as u16,
            (QUEUE_MSIX_VECTOR, 2) => {
                let vector = self.valid_vector(v as u16);
                if let Some(q) = self.queues.get_mut(usize::from(self.queue_select)) {
                    q.vector = vector;
                }
            }
            (QUEUE_SIZE | QUEUE_ENABLE | QUEUE_DESC..=0x37, _) if !driver_ok => {
                let Some(q) = self.queues.get_mut(usize::from(self.queue_select)) else {
                    self.count_ignored("queue write, no such queue", offset, len);
                    return;
                };
                match (offset, len) {
                    (QUEUE_SIZE, 2) => {
                        let s = v as u16;
                        if s.is_power_of_two() && s <= q.max {
                            q.size = s;
                        } else {
                            self.count_ignored("invalid queue_size", offset, len);
                        }
                    }
                    // 1.2: the driver never writes 0 here
                    (QUEUE_ENABLE, 2) => q.enabled |= v == 1,
                    (QUEUE_DESC..=0x27, _) => {
                        write_u64_part(&mut q.desc, offset - QUEUE_DESC, data)
                    }
                    (QUEUE_DRIVER..=0x2f, _) => {
                        write_u64_part(&mut q.driver, offset - QUEUE_DRIVER, data)
                    }
                    (QUEUE_DEVICE..=0x37, _) => {
                        write_u64_part(&mut q.device, offset - QUEUE_DEVICE, data)
                    }
                    _ => self.count_ignored("bad-width queue write", offset, len),
                }
            }
            _ => self.count_ignored("common config write", offset, len),
        }
    }

    fn bar_read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let len = data.len() as u64;
        if offset.saturating_add(len) > BAR_SIZE {
            self.count_ignored("read past the BAR", offset, data.len());
            return;
        }
        match offset {
            o if o + len <= COMMON_OFFSET + COMMON_LEN => self.read_common(o, data),
            ISR_OFFSET if len == 1 => {
                data[0] = self.isr;
                self.isr = 0;
            }
            o if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_MAX).contains(&o) => {
                self.device.read_config(o - DEVICE_CFG_OFFSET, data)
            }
            o if (MSIX_TABLE_OFFSET..MSIX_TABLE_OFFSET + self.msix.table_bytes()).contains(&o) => {
                self.msix.read_table(o - MSIX_TABLE_OFFSET, data)
            }
            o if (MSIX_PBA_OFFSET..MSIX_PBA_OFFSET + self.msix.pba_bytes()).contains(&o) => {
                self.msix.read_pba(o - MSIX_PBA_OFFSET, data)
            }
            o => self.count_ignored("read", o, data.len()),
        }
    }

    fn bar_write(&mut self, offset: u64, data: &[u8]) {
        let len = data.len() as u64;
        if offset.saturating_add(len) > BAR_SIZE {
            self.count_ignored("write past the BAR", offset, data.len());
            return;
        }
        let notify_end =
            NOTIFY_OFFSET + self.queues.len() as u64 * u64::from(NOTIFY_OFF_MULTIPLIER);
        match offset {
            o if o + len <= COMMON_OFFSET + COMMON_LEN => self.write_common(o, data),
            o if (NOTIFY_OFFSET..notify_end).contains(&o) => self.notify_written(o - NOTIFY_OFFSET),
            o if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_MAX).contains(&o) => {
                self.device.write_config(o - DEVICE_CFG_OFFSET, data)
            }
            o if (MSIX_TABLE_OFFSET..MSIX_TABLE_OFFSET + self.msix.table_bytes()).contains(&o) => {
                self.msix
                    .write_table(o - MSIX_TABLE_OFFSET, data, &*self.sink)
            }
            o => self.count_ignored("write", o, data.len()),
        }
    }

    /// The BAR access the PCI-cfg capability's window selects, if its
    /// fields describe one (BAR 0, length 1, 2 or 4, aligned, inside).
    fn pci_cfg_target(&self, access_len: usize) -> Option<(u64, usize)> {
        let cap = self.pci_cfg_cap;
        let bar = self.config.read_u32(cap + 4) & 0xff;
        let off = u64::from(self.config.read_u32(cap + 8));
        let len = self.config.read_u32(cap + 12) as usize;
        (bar as usize == BAR_INDEX
            && matches!(len, 1 | 2 | 4)
            && len <= access_len
            && off.is_multiple_of(len as u64)
            && off + len as u64 <= BAR_SIZE)
            .then_some((off, len))
    }
}

impl PciDevice for VirtioPciDevice {
    fn config(&self) -> &ConfigSpace {
        &self.config
    }

    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.config
    }

    fn read_config(&mut self, offset: usize, data: &mut [u8]) {
        if offset == self.pci_cfg_cap + 16 {
            data.fill(0);
            if let Some((off, len)) = self.pci_cfg_target(data.len()) {
                self.bar_read(off, &mut data[..len]);
            }
            return;
        }
        self.config.read(offset, data)
    }

    fn write_config(&mut self, offset: usize, data: &[u8]) {
        if offset == self.pci_cfg_cap + 16 {
            if let Some((off, len)) = self.pci_cfg_target(data.len()) {
                self.bar_write(off, &data[..len]);
            }
            return;
        }
        self.config.write(offset, data);
        let ctrl = self.msix_cap + 2;
        if offset < ctrl + 2 && offset.saturating_add(data.len()) > ctrl {
            let control = self.config.read_u16(ctrl);
            self.msix.set_control(control, &*self.sink);
        }
    }

    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        if bar == BAR_INDEX {
            self.bar_read(offset, data);
        } else {
            data.fill(0);
        }
    }

    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar == BAR_INDEX {
            self.bar_write(offset, data);
        }
    }
}

// Snapshot state (issue 17): capture and restore, kept under snapshot/.
#[path = "../snapshot/virtio_pci_state.rs"]
mod state;
pub use state::{VirtioPciState, VirtioQueueState};
