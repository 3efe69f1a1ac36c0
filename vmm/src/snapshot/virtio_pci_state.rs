//! Capture and restore of a [`VirtioPciDevice`]: its config space, MSI-X,
//! common configuration registers, queues with their positions, ISR, and
//! whether it was activated (a child module of `pci::virtio_pci`, kept
//! under `snapshot/`).
//!
//! A restored active device is activated again with its queues, their
//! `next_avail`/`next_used` as saved, without the reset the guest did not
//! ask for: the driver's next notification is served from where the
//! device stopped. The device's own state beyond its queues (console
//! input) is saved by its owner (see [`crate::snapshot::device_state`]).

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK,
};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use super::{QueueRegs, VirtioPciDevice, BAR_INDEX, BAR_SIZE, NO_VECTOR};
use crate::pci::bus::Mmio64Window;
use crate::pci::config::{ConfigSpace, ConfigSpaceState};
use crate::pci::msix::MsixState;
use crate::snapshot::device_state::StateError;

/// One queue's saved registers and positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtioQueueState {
    /// `queue_size` as the driver set it.
    pub size: u16,
    /// `queue_enable`.
    pub ready: bool,
    /// `queue_msix_vector` (0xffff: none).
    pub msix_vector: u16,
    /// Descriptor table address.
    pub desc_table: u64,
    /// Driver (available) ring address.
    pub avail_ring: u64,
    /// Device (used) ring address.
    pub used_ring: u64,
    /// The next available-ring entry the device reads (0 while inactive).
    pub next_avail: u16,
    /// The next used-ring entry the device writes (0 while inactive).
    pub next_used: u16,
}

/// The saved state of a virtio-pci function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtioPciState {
    /// The virtio device type (checked on restore).
    pub device_type: u32,
    /// PCI config space.
    pub config: ConfigSpaceState,
    /// MSI-X table, PBA and control.
    pub msix: MsixState,
    /// `device_feature_select`.
    pub device_feature_select: u32,
    /// `driver_feature_select`.
    pub driver_feature_select: u32,
    /// The features the driver wrote.
    pub driver_features: u64,
    /// `device_status`.
    pub status: u8,
    /// `config_generation`.
    pub config_generation: u8,
    /// `config_msix_vector` (0xffff: none).
    pub config_msix_vector: u16,
    /// `queue_select`.
    pub queue_select: u16,
    /// ISR status bits not yet read.
    pub isr: u8,
    /// Whether the device was activated (DRIVER_OK accepted).
    pub activated: bool,
    /// Every queue of the device, in order.
    pub queues: Vec<VirtioQueueState>,
}

impl VirtioPciDevice {
    /// The function's state. The device must not be serving a queue
    /// concurrently (the VM is paused and the device threads idle).
    pub fn state(&self) -> VirtioPciState {
        let positions = if self.active {
            self.device.queue_states()
        } else {
            Vec::new()
        };
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let pos = positions
                    .iter()
                    .find(|(index, _)| usize::from(*index) == i)
                    .map(|(_, q)| (q.next_avail, q.next_used))
                    .unwrap_or((0, 0));
                VirtioQueueState {
                    size: r.size,
                    ready: r.enabled,
                    msix_vector: r.vector,
                    desc_table: r.desc,
                    avail_ring: r.driver,
                    used_ring: r.device,
                    next_avail: pos.0,
                    next_used: pos.1,
                }
            })
            .collect();
        VirtioPciState {
            device_type: self.device.device_type(),
            config: self.config.state(),
            msix: self.msix.state(),
            device_feature_select: self.device_feature_select,
            driver_feature_select: self.driver_feature_select,
            driver_features: self.driver_features,
            status: self.status,
            config_generation: self.config_generation,
            config_msix_vector: self.config_vector,
            queue_select: self.queue_select,
            isr: self.isr,
            activated: self.active,
            queues,
        }
    }

    fn check_vector(&self, field: String, v: u16) -> Result<(), StateError> {
        if v == NO_VECTOR || v < self.msix.len() {
            Ok(())
        } else {
            Err(StateError::Vector {
                field,
                vector: v,
                table: self.msix.len(),
            })
        }
    }

    /// Checks BAR 0 of `config` against the BAR `window`: unassigned (0),
    /// being sized (all ones above its size), or inside the window.
    fn check_bar(&self, config: &ConfigSpaceState, window: Mmio64Window) -> Result<(), StateError> {
        let Some(addr) = self.config.state_bar_address(config, BAR_INDEX) else {
            return Ok(());
        };
        let sizing = !(BAR_SIZE - 1);
        let inside = addr >= window.base
            && addr
                .checked_add(BAR_SIZE)
                .is_some_and(|e| e <= window.end());
        if addr == 0 || (addr == sizing && !ConfigSpace::state_memory_enabled(config)) || inside {
            return Ok(());
        }
        Err(StateError::Bar {
            index: BAR_INDEX,
            addr,
            size: BAR_SIZE,
            base: window.base,
            end: window.end(),
        })
    }

    /// Checks the queue registers of `s` and, for an activated device,
    /// builds its queues as they were. Changes nothing.
    fn check_queues(&self, s: &VirtioPciState) -> Result<Vec<(u16, Queue)>, StateError> {
        if s.queues.len() != self.queues.len() {
            return Err(StateError::Count {
                field: "queues".into(),
                got: s.queues.len(),
                expected: self.queues.len(),
            });
        }
        let event_idx = s.driver_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut built = Vec::new();
        for (i, (q, regs)) in s.queues.iter().zip(&self.queues).enumerate() {
            if !q.size.is_power_of_two() || q.size > regs.max {
                return Err(StateError::QueueSize {
                    queue: i,
                    size: q.size,
                    max: regs.max,
                });
            }
            self.check_vector(format!("queue {i}: msix_vector"), q.msix_vector)?;
            for (ring, addr, align) in [
                ("descriptor", q.desc_table, 16),
                ("driver", q.avail_ring, 2),
                ("device", q.used_ring, 4),
            ] {
                if !addr.is_multiple_of(align) {
                    return Err(StateError::QueueAlign {
                        queue: i,
                        ring,
                        addr,
                        align,
                    });
                }
            }
            if !s.activated || !q.ready {
                continue;
            }
            let mem_err = || StateError::QueueMemory {
                queue: i,
                desc: q.desc_table,
                driver: q.avail_ring,
                device: q.used_ring,
            };
            // Size and alignment were checked: these only fail on what is
            // reported as QueueMemory below anyway.
            let mut queue = Queue::new(regs.max).map_err(|_| mem_err())?;
            queue.try_set_size(q.size).map_err(|_| mem_err())?;
            queue
                .try_set_desc_table_address(GuestAddress(q.desc_table))
                .map_err(|_| mem_err())?;
            queue
                .try_set_avail_ring_address(GuestAddress(q.avail_ring))
                .map_err(|_| mem_err())?;
            queue
                .try_set_used_ring_address(GuestAddress(q.used_ring))
                .map_err(|_| mem_err())?;
            queue.set_event_idx(event_idx);
            queue.set_ready(true);
            queue.set_next_avail(q.next_avail);
            queue.set_next_used(q.next_used);
            if !queue.is_valid(&self.mem) {
                return Err(mem_err());
            }
            built.push((i as u16, queue));
        }
        Ok(built)
    }

    /// Restores `s` into this function, built from the same config and
    /// not yet used by a guest; its BAR must lie in `window` (the bus's).
    /// Everything is checked before anything changes; an activated device
    /// is activated again with its saved queues.
    pub fn restore(&mut self, s: VirtioPciState, window: Mmio64Window) -> Result<(), StateError> {
        let device_type = self.device.device_type();
        if s.device_type != device_type {
            return Err(StateError::DeviceType {
                saved: s.device_type,
                device: device_type,
            });
        }
        self.config.check_state(&s.config)?;
        self.check_bar(&s.config, window)?;
        self.msix.check_state(&s.msix)?;
        // The capability's control bits and the table's must agree.
        let cap_control = {
            let mut c = self.config.clone();
            c.restore(&s.config)?;
            c.read_u16(self.msix_cap + 2) & 0xc000
        };
        if cap_control != s.msix.control {
            return Err(StateError::field(
                "msix.control",
                u64::from(s.msix.control),
                "differs from the MSI-X capability's message control in config space",
            ));
        }
        self.check_vector("config_msix_vector".into(), s.config_msix_vector)?;
        let features_ok = VIRTIO_CONFIG_S_FEATURES_OK as u8;
        let driver_ok = VIRTIO_CONFIG_S_DRIVER_OK as u8;
        if s.status & features_ok != 0 && s.driver_features & !self.device_features != 0 {
            return Err(StateError::field(
                "driver_features",
                s.driver_features,
                "features the device does not offer, accepted (FEATURES_OK)",
            ));
        }
        if s.activated
            && (s.status & (features_ok | driver_ok) != features_ok | driver_ok
                || s.status & VIRTIO_CONFIG_S_FAILED as u8 != 0)
        {
            return Err(StateError::field(
                "status",
                u64::from(s.status),
                "an activated device has FEATURES_OK and DRIVER_OK, not FAILED",
            ));
        }
        if s.isr & !0b11 != 0 {
            return Err(StateError::field(
                "isr",
                u64::from(s.isr),
                "only bits 0 (queue) and 1 (config) exist",
            ));
        }
        let queues = self.check_queues(&s)?;

        // Everything checked: apply.
        if self.active {
            self.device.reset();
            self.active = false;
        }
        self.config.restore(&s.config)?;
        self.msix.restore(&s.msix, &*self.sink)?;
        self.device_feature_select = s.device_feature_select;
        self.driver_feature_select = s.driver_feature_select;
        self.driver_features = s.driver_features;
        self.status = s.status;
        self.config_generation = s.config_generation;
        self.config_vector = s.config_msix_vector;
        self.queue_select = s.queue_select;
        self.isr = s.isr;
        for (regs, q) in self.queues.iter_mut().zip(&s.queues) {
            *regs = QueueRegs {
                max: regs.max,
                size: q.size,
                vector: q.msix_vector,
                enabled: q.ready,
                desc: q.desc_table,
                driver: q.avail_ring,
                device: q.used_ring,
            };
        }
        if s.activated {
            self.device
                .activate(self.mem.clone(), self.driver_features, queues)
                .map_err(StateError::Activate)?;
            self.active = true;
        }
        Ok(())
    }

    /// Serves every queue of an activated function once. For a restored
    /// function, once the guest RAM, vCPUs and irqchip are restored and
    /// just before the vCPUs run: a request the driver made available and
    /// notified before the snapshot but the device had not served yet (a
    /// notification in flight, a pmem FLUSH put back while it waited for
    /// space) would otherwise wait for a notification already sent.
    pub fn serve_restored_queues(&mut self) {
        if !self.active {
            return;
        }
        for q in 0..self.queues.len() as u16 {
            self.notify_queue(q);
        }
    }
}
