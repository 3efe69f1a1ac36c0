//! KVM's dirty ring (`KVM_CAP_DIRTY_LOG_RING`): the pages the guest
//! writes in logged memslots, as per-vCPU rings of entries, so that
//! finding what was written costs what was written, not one bit per page
//! of the slot as `KVM_GET_DIRTY_LOG` does (`dirty_log`).
//!
//! How KVM fills it: when a vCPU is given a writable mapping of a page of
//! a slot registered with `KVM_MEM_LOG_DIRTY_PAGES`, KVM pushes one entry
//! (slot, page offset) onto that vCPU's ring, which this process maps from
//! the vCPU's fd. The page stays writable until it is collected:
//! [`DirtyRings`] reads each ring from its fetch index, marks the entries
//! it read as collected, and `KVM_RESET_DIRTY_RINGS` then write-protects
//! their pages again, so the next write to one of them is pushed again. A
//! write made between the read and the reset is covered by the caller's
//! copy, which comes after the reset (the same argument as the bitmap's
//! clear in `dirty_log`).
//!
//! A ring that fills up stops its vCPU: `KVM_RUN` returns
//! `KVM_EXIT_DIRTY_RING_FULL` until the ring is collected and reset. The
//! vCPU's thread does that itself ([`DirtyRings::collect_full`]), so the pages
//! must be kept until a barrier asks for them: each logged slot has a
//! `Pending` set (a bitmap with the list of its non-zero words), whose
//! size is fixed by the slot and whose reading costs what was written.
//!
//! The ring is chosen for a VM at its creation, before any vCPU exists
//! (KVM refuses it later); with it, KVM refuses `KVM_GET_DIRTY_LOG` for
//! that VM. A KVM without it keeps the bitmap.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{
    kvm_dirty_gfn, kvm_enable_cap, KVM_CAP_DIRTY_LOG_RING, KVM_DIRTY_LOG_PAGE_OFFSET,
};
use kvm_ioctls::{VcpuFd, VmFd};

/// `KVM_RESET_DIRTY_RINGS`: `_IO(KVMIO, 0xc7)`.
pub(crate) const KVM_RESET_DIRTY_RINGS: libc::c_ulong = (0xAE << 8) | 0xc7;
/// `KVM_EXIT_DIRTY_RING_FULL`: the exit reason of a vCPU whose ring is
/// full (`kvm-ioctls` reports it as `VcpuExit::Unsupported`).
pub const KVM_EXIT_DIRTY_RING_FULL: u32 = 31;
/// An entry KVM pushed and nobody collected yet.
const GFN_DIRTY: u32 = 1 << 0;
/// An entry collected: `KVM_RESET_DIRTY_RINGS` re-protects its page.
const GFN_RESET: u32 = 1 << 1;
/// Host page size (the ring's mmap offset is counted in it).
const PAGE: u64 = 4096;
/// Bytes of each vCPU's ring asked for by default: 16,384 entries (KVM
/// allocates it per vCPU). A vCPU stops to empty its ring after writing
/// about 64 MiB of distinct pages between two collections.
pub const DEFAULT_RING_BYTES: u32 = 256 << 10;
/// Full-ring exits in a row with nothing to collect after which the vCPU
/// stops with an error instead of spinning (KVM's ring and ours no longer
/// agree, and resetting did not help).
const STUCK_FULL_EXITS: u64 = 10_000;

/// Errors of the dirty ring.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum DirtyRingError {
    #[error("mapping the dirty ring of vCPU {vcpu} ({bytes} bytes)")]
    Map {
        vcpu: u8,
        bytes: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("KVM_RESET_DIRTY_RINGS")]
    Reset(#[source] std::io::Error),
    #[error(
        "memslot {slot}: a dirty ring overflowed (KVM wrote past a full ring), written pages \
         may be missing"
    )]
    Overflowed { slot: u32 },
    #[error("KVM reported a vCPU's dirty ring full {0} times in a row with nothing in it")]
    Stuck(u64),
    #[error("no memory for the pending pages of memslot {slot} ({pages} pages)")]
    Memory {
        slot: u32,
        pages: u64,
        #[source]
        source: std::collections::TryReserveError,
    },
}

/// Enables the dirty ring on `vm` (before any vCPU exists) with rings of
/// at most `bytes` each (a power of two; KVM's own maximum caps it); the
/// ring's size in entries, or `None` when this KVM has no ring or refuses
/// it (the reason is logged at info level: the bitmap is used instead).
pub(crate) fn enable(vm: &VmFd, bytes: u32) -> Option<u32> {
    let max = vm.check_extension_raw(libc::c_ulong::from(KVM_CAP_DIRTY_LOG_RING));
    if max <= 0 {
        log::info!(
            "KVM has no dirty ring (KVM_CAP_DIRTY_LOG_RING = {max}): the dirty bitmap is read"
        );
        return None;
    }
    let bytes = bytes.min(max as u32);
    if !bytes.is_power_of_two() || u64::from(bytes) < PAGE {
        log::info!("dirty ring of {bytes} bytes: not a power of two of at least a page; the dirty bitmap is read");
        return None;
    }
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_DIRTY_LOG_RING,
        ..Default::default()
    };
    cap.args[0] = u64::from(bytes);
    match vm.enable_cap(&cap) {
        Ok(()) => Some(bytes / std::mem::size_of::<kvm_dirty_gfn>() as u32),
        Err(e) => {
            log::info!(
                "enabling a dirty ring of {bytes} bytes failed ({e}): the dirty bitmap is read"
            );
            None
        }
    }
}

/// Whether the host's KVM module is one that stops a vCPU when its ring
/// is nearly full (`KVM_EXIT_DIRTY_RING_FULL` at the soft limit), so that
/// no entry is overwritten: upstream's `kvm_amd` and `kvm_intel` (QEMU
/// relies on it). This project's `kvm_pvm` does not (measured: a guest
/// writing four rings' worth of pages drove a ring past full, with a
/// warning from `kvm_dirty_ring_push` in the host's log and entries
/// overwritten; `tests/dirty_log_kvm.rs`), nor is any other module
/// assumed to. `PCOW_DIRTY_RING=off` in the environment says no anyway
/// (a measurement knob: the bitmap where the ring would be used, to
/// compare the two on the same KVM). Read once; call it before the
/// process confines itself (`/sys/module` is outside the Landlock rules).
pub fn host_stops_full_rings() -> bool {
    static STOPS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *STOPS.get_or_init(|| {
        let off = std::env::var_os("PCOW_DIRTY_RING").is_some_and(|v| v == "off");
        !off && stops_full_rings_by(|module| {
            std::path::Path::new(&format!("/sys/module/{module}")).is_dir()
        })
    })
}

/// [`host_stops_full_rings`] over `loaded(module)`.
fn stops_full_rings_by(loaded: impl Fn(&str) -> bool) -> bool {
    if loaded("kvm_pvm") {
        return false;
    }
    loaded("kvm_amd") || loaded("kvm_intel")
}

/// What the rings have done, for benchmarks and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingStats {
    /// Entries read from the rings.
    pub entries: u64,
    /// `KVM_RESET_DIRTY_RINGS` calls.
    pub resets: u64,
    /// Collections made by a vCPU whose ring was full.
    pub full_exits: u64,
    /// Entries naming no registered slot, or a page outside it (a slot
    /// deleted since, or registered after the write): dropped.
    pub strays: u64,
    /// Collections that found a ring KVM may have written past (see
    /// [`DirtyRings::collect_full`]): every slot's next take failed.
    pub overflows: u64,
}

/// One vCPU's ring, mapped from its fd.
#[derive(Debug)]
struct Ring {
    vcpu: u8,
    base: NonNull<kvm_dirty_gfn>,
    entries: u32,
    /// The next entry to read (free-running; the index is taken modulo
    /// `entries`).
    fetch: u32,
    /// KVM overflowed this ring once, so `fetch` may no longer be where
    /// KVM pushes: every collection reads the whole ring.
    whole: bool,
    /// Entries the last collection read from this ring.
    last_read: u32,
    /// Full-ring exits of this ring's vCPU in a row that found nothing in
    /// it to collect.
    empty_full: u64,
}

// SAFETY: the mapping is shared memory owned by this struct; it is only
// read and written under the `DirtyRings` lock, from any thread.
unsafe impl Send for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        let bytes = self.entries as usize * std::mem::size_of::<kvm_dirty_gfn>();
        // SAFETY: `base` is the start of a mapping of `bytes` this struct
        // made and nothing else refers to once it is dropped.
        unsafe { libc::munmap(self.base.as_ptr().cast(), bytes) };
    }
}

impl Ring {
    /// The flags word of the entry at `index`, which KVM writes
    /// concurrently (it pushes while the vCPU runs).
    fn flags(&self, index: u32) -> &AtomicU32 {
        let e = self.entry(index);
        // SAFETY: `e` points into the live mapping, 8-byte aligned (the
        // mapping is page aligned and entries are 16 bytes), and the flags
        // field is only ever accessed atomically by this process.
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*e).flags)) }
    }

    fn entry(&self, index: u32) -> *mut kvm_dirty_gfn {
        // SAFETY: the index is reduced below `entries`, the mapping's
        // length in entries.
        unsafe { self.base.as_ptr().add((index % self.entries) as usize) }
    }
}

/// A zeroed bitmap of one bit per page of a slot of `pages` pages, or the
/// allocation's failure (a slot's size comes from outside).
pub(crate) fn page_bitmap(pages: u64) -> Result<Vec<u64>, std::collections::TryReserveError> {
    let words = pages.div_ceil(64) as usize;
    let mut bits = Vec::new();
    bits.try_reserve_exact(words)?;
    bits.resize(words, 0);
    Ok(bits)
}

/// The pages of one slot collected from the rings and not yet taken.
#[derive(Debug)]
pub(crate) struct Pending {
    pages: u64,
    /// One bit per page of the slot.
    bits: Vec<u64>,
    /// The indexes of the non-zero words of `bits`, each once: what a take
    /// walks, so that it costs what was written.
    touched: Vec<u32>,
    /// A ring overflowed since the last take: pages may be missing.
    lost: bool,
}

impl Pending {
    pub(crate) fn new(slot: u32, pages: u64) -> Result<Pending, DirtyRingError> {
        let bits = page_bitmap(pages).map_err(|source| DirtyRingError::Memory {
            slot,
            pages,
            source,
        })?;
        Ok(Pending {
            pages,
            bits,
            touched: Vec::new(),
            lost: false,
        })
    }

    /// Marks `page`; false when it lies outside the slot.
    pub(crate) fn mark(&mut self, page: u64) -> bool {
        if page >= self.pages {
            return false;
        }
        let w = (page / 64) as usize;
        if self.bits[w] == 0 {
            // At most one push per word between takes: bounded by the
            // slot's words.
            self.touched.push(w as u32);
        }
        self.bits[w] |= 1 << (page % 64);
        true
    }

    /// Calls `into` with each marked page, once, and forgets them.
    pub(crate) fn take(&mut self, into: &mut dyn FnMut(u64)) {
        for &w in &self.touched {
            let mut bits = std::mem::take(&mut self.bits[w as usize]);
            while bits != 0 {
                into(u64::from(w) * 64 + u64::from(bits.trailing_zeros()));
                bits &= bits - 1;
            }
        }
        self.touched.clear();
    }
}

#[derive(Debug)]
struct RingSet {
    rings: Vec<Ring>,
    slots: HashMap<u32, Pending>,
    stats: RingStats,
}

/// The dirty rings of one VM's vCPUs and the pages collected from them,
/// by slot. Shared by the VM (which adds each vCPU's ring), its vCPU
/// threads (a full ring) and the logged slots' readers (barriers).
#[derive(Debug)]
pub struct DirtyRings {
    vm: Arc<VmFd>,
    entries: u32,
    set: Mutex<RingSet>,
}

impl DirtyRings {
    /// The rings of `vm`, on which [`enable`] gave rings of `entries`.
    pub(crate) fn new(vm: Arc<VmFd>, entries: u32) -> Arc<DirtyRings> {
        Arc::new(DirtyRings {
            vm,
            entries,
            set: Mutex::new(RingSet {
                rings: Vec::new(),
                slots: HashMap::new(),
                stats: RingStats::default(),
            }),
        })
    }

    /// Entries per vCPU ring.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    fn lock(&self) -> MutexGuard<'_, RingSet> {
        // Rings, pending bits and counters stay consistent between any two
        // statements: valid after a panic.
        self.set.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Maps the ring of a new vCPU.
    pub(crate) fn add_vcpu(&self, vcpu: u8, fd: &VcpuFd) -> Result<(), DirtyRingError> {
        let bytes = self.entries as usize * std::mem::size_of::<kvm_dirty_gfn>();
        // A shared mapping of the vCPU fd at KVM's ring offset, of the
        // size the VM's ring was enabled with: KVM's own pages, which it
        // keeps until the VM is destroyed (the mapping holds the fd's file).
        // SAFETY: a new mapping at no fixed address; it replaces nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                (u64::from(KVM_DIRTY_LOG_PAGE_OFFSET) * PAGE) as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(DirtyRingError::Map {
                vcpu,
                bytes,
                source: std::io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(p.cast()).ok_or(DirtyRingError::Map {
            vcpu,
            bytes,
            source: std::io::Error::from_raw_os_error(libc::EFAULT),
        })?;
        self.lock().rings.push(Ring {
            vcpu,
            base,
            entries: self.entries,
            fetch: 0,
            whole: false,
            last_read: 0,
            empty_full: 0,
        });
        Ok(())
    }

    /// Starts keeping the pages of `slot` (`pages` long). What the rings
    /// hold before is collected first and dropped for slots not
    /// registered: entries of a deleted slot with the same number (KVM
    /// pushes none once the deletion returned) never reach this one.
    pub(crate) fn register(&self, slot: u32, pages: u64) -> Result<(), DirtyRingError> {
        let pending = Pending::new(slot, pages)?;
        let mut set = self.lock();
        self.collect_locked(&mut set)?;
        set.slots.insert(slot, pending);
        Ok(())
    }

    /// Stops keeping the pages of `slot` (it is about to be deleted).
    pub(crate) fn unregister(&self, slot: u32) {
        self.lock().slots.remove(&slot);
    }

    /// Empties every ring into the slots' pending pages: what vCPU `vcpu`
    /// does when its ring is full, before it runs again.
    ///
    /// Finding nothing in that ring happens once when another thread
    /// collected it between the exit and this call; the vCPU then runs
    /// (KVM sees the ring free) and cannot fill it again before its next
    /// exit. A second such exit in a row means KVM wrote past the ring and
    /// its index moved away from ours: every slot's next read fails, and
    /// the rings are read whole from then on.
    pub fn collect_full(&self, vcpu: u8) -> Result<(), DirtyRingError> {
        let mut set = self.lock();
        set.stats.full_exits += 1;
        self.collect_locked(&mut set)?;
        let Some(i) = set.rings.iter().position(|r| r.vcpu == vcpu) else {
            return Ok(());
        };
        if set.rings[i].last_read > 0 {
            set.rings[i].empty_full = 0;
            return Ok(());
        }
        set.rings[i].empty_full += 1;
        let streak = set.rings[i].empty_full;
        if streak == 2 && !set.rings[i].whole {
            set.stats.overflows += 1;
            log::warn!(
                "KVM reported vCPU {vcpu}'s dirty ring full twice with no entry where it \
                 should be: it wrote past the ring; pmem barriers scan their regions once"
            );
            for ring in &mut set.rings {
                ring.whole = true;
            }
            set.slots.values_mut().for_each(|p| p.lost = true);
            self.collect_locked(&mut set)?;
        }
        if streak > STUCK_FULL_EXITS {
            return Err(DirtyRingError::Stuck(streak));
        }
        // Let KVM reset what it still counts as taken.
        self.reset()
    }

    /// Empties every ring, then calls `into` with each page of `slot`
    /// written since the last take (each once) and forgets them. False
    /// when the slot is not registered.
    pub(crate) fn take(
        &self,
        slot: u32,
        into: &mut dyn FnMut(u64),
    ) -> Result<bool, DirtyRingError> {
        let mut set = self.lock();
        self.collect_locked(&mut set)?;
        match set.slots.get_mut(&slot) {
            Some(p) if p.lost => {
                // The caller scans instead; what is pending is a part.
                p.lost = false;
                p.take(&mut |_| {});
                Err(DirtyRingError::Overflowed { slot })
            }
            Some(p) => {
                p.take(into);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// What the rings have done so far.
    pub fn stats(&self) -> RingStats {
        self.lock().stats
    }

    /// Empties every ring into the slots' pending pages and resets what
    /// it read; how many entries that was. A ring found full in one pass
    /// (or, read whole, full everywhere) may have been overflowed: KVM
    /// should stop a vCPU before its ring is full, but a KVM that does not
    /// (this project's `kvm_pvm`, measured: a warning in
    /// `kvm_dirty_ring_push`, entries overwritten) loses entries, so every
    /// slot's next take reports the loss and its reader scans instead.
    fn collect_locked(&self, set: &mut RingSet) -> Result<u64, DirtyRingError> {
        let RingSet {
            rings,
            slots,
            stats,
        } = set;
        let mut read = 0u64;
        let mut overflowed = false;
        for ring in rings.iter_mut() {
            let mut record = |ring: &Ring, index: u32| {
                let e = ring.entry(index);
                // SAFETY: `e` is in the live mapping; KVM wrote both fields
                // before the flag read (acquire) and keeps them until reset.
                let (slot, offset) = unsafe {
                    (
                        std::ptr::read_volatile(std::ptr::addr_of!((*e).slot)),
                        std::ptr::read_volatile(std::ptr::addr_of!((*e).offset)),
                    )
                };
                // The address space is in the high 16 bits: only 0 (the
                // one an x86 VM's memory slots are in) is logged.
                let kept = slot >> 16 == 0
                    && slots
                        .get_mut(&(slot & 0xffff))
                        .is_some_and(|p| p.mark(offset));
                if !kept {
                    stats.strays += 1;
                }
                ring.flags(index).store(GFN_RESET, Ordering::Release);
            };
            let mut n = 0u32;
            if !ring.whole {
                // KVM pushes in order and stops pushing at a full ring, so
                // one lap at most.
                while n < ring.entries {
                    if ring.flags(ring.fetch).load(Ordering::Acquire) & GFN_DIRTY == 0 {
                        break;
                    }
                    record(ring, ring.fetch);
                    ring.fetch = ring.fetch.wrapping_add(1);
                    n += 1;
                }
                if n == ring.entries {
                    ring.whole = true;
                    overflowed = true;
                }
            }
            if ring.whole {
                // Every dirty entry, wherever KVM put it; KVM's reset then
                // goes on through all of them in its own order.
                let mut found = 0u32;
                for index in 0..ring.entries {
                    if ring.flags(index).load(Ordering::Acquire) & GFN_DIRTY != 0 {
                        record(ring, index);
                        found += 1;
                    }
                }
                overflowed |= found == ring.entries;
                n += found;
            }
            ring.last_read = n;
            read += u64::from(n);
        }
        stats.entries += read;
        if overflowed {
            stats.overflows += 1;
            log::warn!(
                "a dirty ring was full when read: KVM may have written past it; pmem barriers \
                 scan their regions once"
            );
            slots.values_mut().for_each(|p| p.lost = true);
        }
        if read == 0 {
            return Ok(0);
        }
        self.reset()?;
        set.stats.resets += 1;
        Ok(read)
    }

    /// `KVM_RESET_DIRTY_RINGS`: KVM re-protects the pages of the entries
    /// marked collected and frees them.
    fn reset(&self) -> Result<(), DirtyRingError> {
        // SAFETY: the ioctl takes no argument; it reads the rings this VM's
        // vCPUs share with KVM and re-protects the pages of collected
        // entries.
        let r = unsafe { libc::ioctl(self.vm.as_raw_fd(), KVM_RESET_DIRTY_RINGS as _, 0) };
        if r < 0 {
            return Err(DirtyRingError::Reset(std::io::Error::last_os_error()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_pages_are_named_once_and_forgotten() {
        let mut p = Pending::new(3, 200).unwrap();
        for page in [5, 70, 5, 199, 64, 70] {
            assert!(p.mark(page));
        }
        assert!(!p.mark(200), "past the slot");
        assert!(!p.mark(u64::MAX));
        let mut got = Vec::new();
        p.take(&mut |x| got.push(x));
        got.sort_unstable();
        assert_eq!(got, [5, 64, 70, 199]);
        let mut again = Vec::new();
        p.take(&mut |x| again.push(x));
        assert!(again.is_empty(), "{again:?}");
        assert!(p.mark(70));
        p.take(&mut |x| again.push(x));
        assert_eq!(again, [70]);
        assert!(p.touched.is_empty() && p.bits.iter().all(|&w| w == 0));
    }

    #[test]
    fn a_pending_set_touches_each_word_once() {
        let mut p = Pending::new(0, 64 * 1000).unwrap();
        for page in 0..64 * 1000 {
            p.mark(page);
            p.mark(page);
        }
        assert_eq!(p.touched.len(), 1000);
        let mut n = 0;
        p.take(&mut |_| n += 1);
        assert_eq!(n, 64 * 1000);
    }

    #[test]
    fn only_upstream_kvm_modules_are_trusted_to_stop_at_a_full_ring() {
        let host = |m: &'static [&'static str]| stops_full_rings_by(|x| m.contains(&x));
        assert!(host(&["kvm_amd"]));
        assert!(host(&["kvm_intel"]));
        assert!(!host(&["kvm_pvm"]));
        assert!(!host(&["kvm_pvm", "kvm_amd"]));
        assert!(!host(&[]));
    }

    #[test]
    fn the_ioctl_number_is_the_kernels() {
        // include/uapi/linux/kvm.h: #define KVM_RESET_DIRTY_RINGS _IO(KVMIO, 0xc7)
        assert_eq!(KVM_RESET_DIRTY_RINGS, 0xaec7);
        assert_eq!(std::mem::size_of::<kvm_dirty_gfn>(), 16);
    }
}
