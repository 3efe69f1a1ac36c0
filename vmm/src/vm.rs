//! The KVM VM: guest RAM (vm-memory) registered as memslots, and memslots
//! for external host regions (a pmem device's region) above RAM.
//!
//! Every memslot is an RAII [`Memslot`]: dropping it deletes the slot from
//! the VM before anything else may reuse the host range it pointed at.

use crate::boot::layout;
use crate::dirty_log::{
    enable_manual_protect, KvmDirtyLog, LogChoice, SharedSlotLog, SlotLog, VmLog,
};
use crate::dirty_ring::{self, DirtyRingError, DirtyRings};
use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::vcpu::Vcpu;

/// External regions (pmem) are placed at 2 MiB-aligned guest addresses, as
/// Cloud Hypervisor does.
pub const REGION_ALIGN: u64 = 2 << 20;
/// Host page size the memslot ranges must be aligned to.
const PAGE: u64 = 4096;
/// Guest RAM stays below the 32-bit MMIO hole (no split RAM yet).
pub const MAX_RAM: u64 = 3 << 30;
/// Where KVM's TSS goes on Intel hosts (three pages below 4 GiB, as
/// Firecracker and Cloud Hypervisor place it).
const TSS_ADDRESS: usize = layout::KVM_TSS_START as usize;

/// Errors of the VM and its memslots.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("opening /dev/kvm")]
    OpenKvm(#[source] kvm_ioctls::Error),
    #[error("KVM API version {0}, expected 12")]
    ApiVersion(i32),
    #[error("KVM_CREATE_VM")]
    CreateVm(#[source] kvm_ioctls::Error),
    #[error("KVM_SET_TSS_ADDR")]
    TssAddress(#[source] kvm_ioctls::Error),
    #[error("guest RAM size {size:#x}: must be a non-zero multiple of 4 KiB up to {max:#x}")]
    RamSize { size: u64, max: u64 },
    #[error("allocating guest RAM")]
    GuestMemory(#[source] vm_memory::mmap::FromRangesError),
    #[error(
        "region at guest {gpa:#x}, host {host:#x}, size {len:#x}: the guest address must be \
         2 MiB aligned, the host address and size non-zero multiples of 4 KiB"
    )]
    Misaligned { gpa: u64, host: u64, len: u64 },
    #[error("region at guest {gpa:#x} size {len:#x} overlaps guest RAM or memslot {slot}")]
    Overlap { gpa: u64, len: u64, slot: u32 },
    #[error("region at guest {gpa:#x} size {len:#x} wraps around the address space")]
    Wraps { gpa: u64, len: u64 },
    #[error("all {0} memslots are in use")]
    NoFreeSlot(usize),
    #[error("KVM_SET_USER_MEMORY_REGION slot {slot} at guest {gpa:#x} size {len:#x}")]
    SetMemslot {
        slot: u32,
        gpa: u64,
        len: u64,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("KVM_CREATE_VCPU {0}")]
    CreateVcpu(u8, #[source] kvm_ioctls::Error),
    #[error("vCPU {0}'s dirty ring")]
    VcpuRing(u8, #[source] DirtyRingError),
    #[error("memslot table lock poisoned by a panic")]
    Poisoned,
}

/// The guest-physical ranges in use, by memslot number.
#[derive(Debug)]
struct SlotTable {
    max: usize,
    /// (slot, gpa, len), unordered.
    used: Vec<(u32, u64, u64)>,
}

impl SlotTable {
    fn free_slot(&self) -> Option<u32> {
        (0..self.max as u32).find(|s| self.used.iter().all(|u| u.0 != *s))
    }

    fn overlap(&self, gpa: u64, len: u64) -> Option<u32> {
        self.used
            .iter()
            .find(|&&(_, g, l)| gpa < g + l && g < gpa + len)
            .map(|u| u.0)
    }

    fn end(&self) -> u64 {
        self.used.iter().map(|&(_, g, l)| g + l).max().unwrap_or(0)
    }
}

/// A memslot of the VM; deleted from the VM on drop.
#[derive(Debug)]
pub struct Memslot {
    vm: Arc<VmFd>,
    table: Arc<Mutex<SlotTable>>,
    slot: u32,
    gpa: u64,
    len: u64,
    /// The slot's dirty log, when it was registered with one.
    log: Option<SharedSlotLog>,
}

impl Memslot {
    /// The KVM slot number.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Guest-physical start.
    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the slot is empty (never: sizes are checked non-zero).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slot's dirty log, if it has one ([`Vm::add_logged_region`]).
    pub fn write_log(&self) -> Option<KvmDirtyLog> {
        self.log.clone().map(KvmDirtyLog)
    }
}

impl Drop for Memslot {
    fn drop(&mut self) {
        // First: no read of the log may reach the slot number once it can
        // be given to another slot.
        if let Some(log) = &self.log {
            SlotLog::retire(log);
        }
        let region = kvm_userspace_memory_region {
            slot: self.slot,
            guest_phys_addr: self.gpa,
            memory_size: 0,
            userspace_addr: 0,
            flags: 0,
        };
        // SAFETY: a zero size deletes the slot: KVM stops using the host
        // range it pointed at and no new host memory is handed to the guest.
        if let Err(e) = unsafe { self.vm.set_user_memory_region(region) } {
            log::error!("deleting memslot {} at {:#x}: {e}", self.slot, self.gpa);
            // The slot stays taken in the table: it is still in the VM.
            return;
        }
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.used.retain(|u| u.0 != self.slot);
    }
}

/// Configuration of a [`Vm`].
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Guest RAM in bytes, mapped at guest address 0.
    pub ram_size: u64,
}

/// A KVM VM with its guest RAM.
#[derive(Debug)]
pub struct Vm {
    // Drop order matters: the RAM memslots are deleted (fields drop in
    // declaration order) before the RAM they point at is unmapped.
    ram_slots: Vec<Memslot>,
    memory: GuestMemoryMmap,
    table: Arc<Mutex<SlotTable>>,
    fd: Arc<VmFd>,
    /// How logged slots are read (`dirty_log`, `dirty_ring`).
    log: VmLog,
    _kvm: Kvm,
}

impl Vm {
    /// Opens `/dev/kvm`, creates the VM, allocates RAM at guest address 0
    /// and registers it.
    pub fn new(config: &VmConfig) -> Result<Vm, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        Self::with_kvm(kvm, config)
    }

    /// [`Vm::new`] with an already open `/dev/kvm`.
    pub fn with_kvm(kvm: Kvm, config: &VmConfig) -> Result<Vm, VmError> {
        Self::with_kvm_log(kvm, config, LogChoice::default())
    }

    /// [`Vm::new`] with logged slots read as `choice` says.
    pub fn new_with_log(config: &VmConfig, choice: LogChoice) -> Result<Vm, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        Self::with_kvm_log(kvm, config, choice)
    }

    /// [`Vm::with_kvm`] with logged slots read as `choice` says.
    pub fn with_kvm_log(kvm: Kvm, config: &VmConfig, choice: LogChoice) -> Result<Vm, VmError> {
        let size = config.ram_size;
        if size == 0 || !size.is_multiple_of(PAGE) || size > MAX_RAM {
            return Err(VmError::RamSize { size, max: MAX_RAM });
        }
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size as usize)])
            .map_err(VmError::GuestMemory)?;
        Self::with_memory_log(kvm, memory, choice)
    }

    /// A VM whose guest RAM is `memory` (a restored snapshot's: copied or
    /// mapped from `memory-ranges`), which must start at guest address 0
    /// and fit under [`MAX_RAM`].
    pub fn with_memory(kvm: Kvm, memory: GuestMemoryMmap) -> Result<Vm, VmError> {
        Self::with_memory_log(kvm, memory, LogChoice::default())
    }

    /// [`Vm::with_memory`] with logged slots read as `choice` says.
    pub fn with_memory_log(
        kvm: Kvm,
        memory: GuestMemoryMmap,
        choice: LogChoice,
    ) -> Result<Vm, VmError> {
        let v = kvm.get_api_version();
        if v != kvm_bindings::KVM_API_VERSION as i32 {
            return Err(VmError::ApiVersion(v));
        }
        let end = memory.last_addr().0.saturating_add(1);
        let starts_at_zero = memory.iter().any(|r| r.start_addr().0 == 0);
        if !starts_at_zero || !end.is_multiple_of(PAGE) || end > MAX_RAM {
            return Err(VmError::RamSize {
                size: end,
                max: MAX_RAM,
            });
        }
        let fd = Arc::new(kvm.create_vm().map_err(VmError::CreateVm)?);
        fd.set_tss_address(TSS_ADDRESS)
            .map_err(VmError::TssAddress)?;
        // Before any vCPU exists: KVM takes a ring only then.
        let ring = match choice {
            LogChoice::Auto if dirty_ring::host_stops_full_rings() => {
                dirty_ring::enable(&fd, dirty_ring::DEFAULT_RING_BYTES)
            }
            LogChoice::Auto | LogChoice::Bitmap => None,
            LogChoice::Ring(bytes) => dirty_ring::enable(&fd, bytes),
        };
        let log = match ring {
            Some(entries) => VmLog::Ring(DirtyRings::new(fd.clone(), entries)),
            None => VmLog::Bitmap {
                manual: enable_manual_protect(&fd),
            },
        };
        let table = Arc::new(Mutex::new(SlotTable {
            max: kvm.get_nr_memslots(),
            used: Vec::new(),
        }));
        let mut vm = Vm {
            ram_slots: Vec::new(),
            memory,
            table,
            fd,
            log,
            _kvm: kvm,
        };
        let ranges: Vec<(u64, u64, u64)> = vm
            .memory
            .iter()
            .map(|r| (r.start_addr().0, r.as_ptr() as u64, r.len()))
            .collect();
        for (gpa, host, len) in ranges {
            // SAFETY: the range is guest RAM owned by `vm.memory`, which
            // outlives the memslot (`ram_slots` drops first, see `Vm`).
            let slot = unsafe { vm.add_slot(gpa, host, len, 0)? };
            vm.ram_slots.push(slot);
        }
        Ok(vm)
    }

    /// The VM's fd (for ioctls this crate does not wrap yet).
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// The VM's fd, shared (interrupt routing, ioeventfds).
    pub fn fd_arc(&self) -> Arc<VmFd> {
        self.fd.clone()
    }

    /// The `/dev/kvm` handle the VM was created from.
    pub fn kvm(&self) -> &Kvm {
        &self._kvm
    }

    /// Guest RAM.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// End of guest RAM (first guest address past it).
    pub fn ram_end(&self) -> u64 {
        self.memory.last_addr().0 + 1
    }

    fn table(&self) -> Result<MutexGuard<'_, SlotTable>, VmError> {
        self.table.lock().map_err(|_| VmError::Poisoned)
    }

    /// The first 2 MiB-aligned guest address above RAM and every memslot:
    /// where the next external region of any size can go.
    pub fn next_region_gpa(&self) -> Result<u64, VmError> {
        // Never below 4 GiB: the 32-bit hole holds ECAM, BARs and the APICs.
        let end = self
            .table()?
            .end()
            .max(layout::pmem_area_start(self.ram_end()));
        Ok(end.next_multiple_of(REGION_ALIGN))
    }

    /// Gives the guest the host range `host_addr..host_addr+len` at guest
    /// address `gpa` (2 MiB aligned, not overlapping RAM or another slot).
    /// The slot is deleted when the returned handle drops.
    ///
    /// # Safety
    ///
    /// The host range must stay mapped, and must not be reused for anything
    /// the guest may not see or change, until the returned [`Memslot`] is
    /// dropped: the guest reads and writes it at any time (KVM accesses it
    /// through the process's page tables, so an unmapped range only faults
    /// the vCPU, but a range mapped again for something else would expose
    /// that to the guest).
    pub unsafe fn add_region(
        &self,
        gpa: u64,
        host_addr: *mut u8,
        len: u64,
    ) -> Result<Memslot, VmError> {
        let host = region_host(gpa, host_addr, len)?;
        // SAFETY: the caller keeps the range mapped for the slot's life.
        unsafe { self.add_slot(gpa, host, len, 0) }
    }

    /// [`Vm::add_region`] with KVM's dirty log of the slot
    /// (`KVM_MEM_LOG_DIRTY_PAGES`, [`Memslot::write_log`]) when this KVM
    /// gives one: the slot is registered with the flag and the log read
    /// once (a KVM that cannot log fails one or the other). Otherwise, or
    /// when the bitmap cannot be allocated, the slot is registered without
    /// it and the reason is logged at info level.
    ///
    /// # Safety
    ///
    /// As [`Vm::add_region`].
    pub unsafe fn add_logged_region(
        &self,
        gpa: u64,
        host_addr: *mut u8,
        len: u64,
    ) -> Result<Memslot, VmError> {
        let host = region_host(gpa, host_addr, len)?;
        // SAFETY: the caller keeps the range mapped for the slot's life.
        let why = match unsafe { self.add_slot(gpa, host, len, KVM_MEM_LOG_DIRTY_PAGES) } {
            Ok(mut slot) => match SlotLog::new(self.fd.clone(), slot.slot, len, &self.log) {
                Ok(log) => match KvmDirtyLog(log.clone()).take(&mut |_| {}) {
                    Ok(()) => {
                        slot.log = Some(log);
                        return Ok(slot);
                    }
                    Err(e) => error_report::chain(&e),
                },
                Err(e) => error_report::chain(&e),
            },
            Err(e @ VmError::SetMemslot { .. }) => error_report::chain(&e),
            Err(e) => return Err(e),
        };
        log::info!(
            "memslot at guest {gpa:#x}: no KVM dirty log ({why}); pmem barriers scan the page tables"
        );
        // SAFETY: as above (a slot registered with the flag was dropped
        // on the way here, which deleted it).
        unsafe { self.add_slot(gpa, host, len, 0) }
    }

    /// Whether this VM's dirty logs are read with manual protection
    /// (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`: a read copies the bitmap, a
    /// clear re-protects only what it named).
    pub fn dirty_log_manual(&self) -> bool {
        matches!(self.log, VmLog::Bitmap { manual: true })
    }

    /// The VM's dirty rings, when its logged slots are read from KVM's
    /// dirty ring instead of the bitmap.
    pub fn dirty_rings(&self) -> Option<Arc<DirtyRings>> {
        match &self.log {
            VmLog::Ring(r) => Some(r.clone()),
            VmLog::Bitmap { .. } => None,
        }
    }

    /// Registers a memslot.
    ///
    /// # Safety
    ///
    /// As [`Vm::add_region`].
    unsafe fn add_slot(
        &self,
        gpa: u64,
        host: u64,
        len: u64,
        flags: u32,
    ) -> Result<Memslot, VmError> {
        if gpa.checked_add(len).is_none() || host.checked_add(len).is_none() {
            return Err(VmError::Wraps { gpa, len });
        }
        let mut t = self.table()?;
        if let Some(slot) = t.overlap(gpa, len) {
            return Err(VmError::Overlap { gpa, len, slot });
        }
        let slot = t.free_slot().ok_or(VmError::NoFreeSlot(t.max))?;
        let region = kvm_userspace_memory_region {
            slot,
            guest_phys_addr: gpa,
            memory_size: len,
            userspace_addr: host,
            flags,
        };
        // SAFETY: the slot number is free and the guest range overlaps no
        // other slot (checked above under the table lock); the host range
        // stays valid for the slot's life by this function's contract.
        unsafe { self.fd.set_user_memory_region(region) }.map_err(|source| {
            VmError::SetMemslot {
                slot,
                gpa,
                len,
                source,
            }
        })?;
        t.used.push((slot, gpa, len));
        Ok(Memslot {
            vm: self.fd.clone(),
            table: self.table.clone(),
            slot,
            gpa,
            len,
            log: None,
        })
    }

    /// Creates vCPU `id`.
    pub fn create_vcpu(&self, id: u8) -> Result<Vcpu, VmError> {
        let fd = self
            .fd
            .create_vcpu(u64::from(id))
            .map_err(|e| VmError::CreateVcpu(id, e))?;
        let rings = self.dirty_rings();
        if let Some(r) = &rings {
            r.add_vcpu(id, &fd).map_err(|e| VmError::VcpuRing(id, e))?;
        }
        Ok(Vcpu::new(id, fd, rings))
    }
}

/// The host address of a region for [`Vm::add_region`]: `gpa` 2 MiB
/// aligned, the host range page aligned and not empty.
fn region_host(gpa: u64, host_addr: *mut u8, len: u64) -> Result<u64, VmError> {
    let host = host_addr as u64;
    if !gpa.is_multiple_of(REGION_ALIGN)
        || !host.is_multiple_of(PAGE)
        || len == 0
        || !len.is_multiple_of(PAGE)
    {
        return Err(VmError::Misaligned { gpa, host, len });
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_table_overlap_and_end() {
        let t = SlotTable {
            max: 3,
            used: vec![(0, 0, 0x1000), (2, 0x20_0000, 0x20_0000)],
        };
        assert_eq!(t.free_slot(), Some(1));
        assert_eq!(t.overlap(0x1000, 0x1000), None);
        assert_eq!(t.overlap(0xfff, 2), Some(0));
        assert_eq!(t.overlap(0x3f_ffff, 1), Some(2));
        assert_eq!(t.overlap(0x40_0000, 1), None);
        assert_eq!(t.end(), 0x40_0000);
    }
}
