//! KVM's dirty log of a pmem memslot as the device crate's
//! [`WriteLog`]: a barrier then reads which pages the guest wrote
//! (`KVM_GET_DIRTY_LOG`) instead of scanning the page tables of the
//! whole region (see `virtio_pmem_pcow::write_log`).
//!
//! What it relies on of KVM: a slot registered with
//! `KVM_MEM_LOG_DIRTY_PAGES` sets a page's bit whenever KVM gives the guest
//! a writable mapping of it (a write fault, or a read of a page whose host
//! mapping is already writable), so a page is either marked or mapped
//! read-only for the guest.
//!
//! Three ways to read it, chosen per VM ([`LogChoice`]): KVM's dirty ring
//! ([`crate::dirty_ring`]: per-vCPU rings of the pages written, so a read
//! costs what was written) where the host's KVM module is trusted to stop
//! a vCPU at a full ring, else the slot's bitmap, in one of two ways
//! ([`enable_manual_protect`]):
//!
//! - with `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` enabled (every host KVM of
//!   this project has it), `KVM_GET_DIRTY_LOG` only copies the slot's
//!   bitmap out, and `KVM_CLEAR_DIRTY_LOG` then clears the bits that copy
//!   held and write-protects just those pages. A page written after the
//!   copy keeps its bit for the next read (the clear takes only the bits
//!   it is given); a named page written before its clear is in what the
//!   caller copies afterwards, and written after it faults and is marked
//!   again. The read costs a copy and a walk of one bit per page of the
//!   slot (about 4 µs per GiB, measured in `barrier_log_bench`) and the
//!   clear work per page written;
//! - without it, `KVM_GET_DIRTY_LOG` takes and clears each word of the
//!   bitmap and write-protects its pages under the MMU lock, then flushes
//!   the TLBs before it returns: a write racing it is in the bitmap it
//!   returns (its page was writable, so marked) or faults again and is
//!   marked for the next call. It visits every word of the slot with an
//!   atomic exchange: about 20-30 µs per GiB.
//!
//! The device holds the vCPUs paused while a barrier reads the log and
//! copies the pages, so nothing races there at all; that also covers hosts
//! whose KVM logs through a per-vCPU buffer (Intel's PML), flushed into
//! the bitmap at every exit. A status read while the guest runs may miss a
//! write still in such a buffer; the next read, a barrier's with the vCPUs
//! out, names it. Host remaps of the region (barriers, overlays, holes
//! returned with `MADV_DONTNEED`) only drop KVM's mappings; the bitmap is
//! per guest page of the slot and keeps its bits.
//!
//! The cost on the guest: KVM maps a logged slot with 4 KiB pages only,
//! and the first write to each page after a read of the log takes a fault
//! into KVM (no exit to the VMM).

use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_dirty_log, kvm_enable_cap, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE,
};
use kvm_ioctls::VmFd;
use std::os::fd::AsRawFd;
use virtio_pmem_pcow::{WriteLog, WriteLogError};

use crate::dirty_ring::{page_bitmap, DirtyRingError, DirtyRings};

/// `KVM_GET_DIRTY_LOG`: `_IOW(KVMIO, 0x42, struct kvm_dirty_log)`.
const KVM_GET_DIRTY_LOG: libc::c_ulong = (1 << 30)
    | ((std::mem::size_of::<kvm_dirty_log>() as libc::c_ulong) << 16)
    | (0xAE << 8)
    | 0x42;

/// `KVM_CLEAR_DIRTY_LOG`: `_IOWR(KVMIO, 0xc0, struct kvm_clear_dirty_log)`.
const KVM_CLEAR_DIRTY_LOG: libc::c_ulong = (3 << 30)
    | ((std::mem::size_of::<kvm_clear_dirty_log>() as libc::c_ulong) << 16)
    | (0xAE << 8)
    | 0xc0;

/// Host page size the log counts in.
const PAGE: u64 = 4096;

/// Errors of the dirty log.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    #[error("KVM_GET_DIRTY_LOG of memslot {slot}")]
    Get {
        slot: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("KVM_CLEAR_DIRTY_LOG of memslot {slot}, pages {first}..+{count}")]
    Clear {
        slot: u32,
        first: u64,
        count: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("memslot {slot} was deleted")]
    Deleted { slot: u32 },
    #[error("KVM's dirty ring")]
    Ring(#[source] DirtyRingError),
    #[error("no memory for the dirty bitmap of {pages} pages")]
    Memory {
        pages: u64,
        #[source]
        source: std::collections::TryReserveError,
    },
}

/// How a VM's logged memslots report what the guest wrote, chosen when
/// the VM is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogChoice {
    /// KVM's dirty ring ([`crate::dirty_ring`], rings of
    /// [`crate::dirty_ring::DEFAULT_RING_BYTES`]) when KVM offers it and
    /// the host's KVM module is one known to stop a vCPU before its ring
    /// overflows ([`crate::dirty_ring::host_stops_full_rings`]); else the
    /// bitmap.
    #[default]
    Auto,
    /// The dirty ring with rings of at most this many bytes whenever KVM
    /// offers it (tests and benchmarks; a ring KVM overflows is detected
    /// and its slots' readers scan instead).
    Ring(u32),
    /// The dirty bitmap (`KVM_GET_DIRTY_LOG`), also where a ring is
    /// offered (benchmarks compare the two).
    Bitmap,
}

/// What a VM's logged slots are read with.
#[derive(Debug, Clone)]
pub(crate) enum VmLog {
    Ring(Arc<DirtyRings>),
    /// The bitmap; `manual`: [`enable_manual_protect`] succeeded.
    Bitmap {
        manual: bool,
    },
}

/// The slot's log state, shared by the [`crate::vm::Memslot`] (which marks
/// it deleted, under the lock, before it deletes the slot: a read never
/// reaches a slot number that may have been given to another region) and
/// the [`KvmDirtyLog`].
#[derive(Debug)]
pub(crate) struct SlotLog {
    slot: u32,
    live: bool,
    /// [`host_logs_unbuffered`].
    unbuffered: bool,
    source: Source,
}

/// Where a slot's written pages come from.
#[derive(Debug)]
enum Source {
    /// The VM's dirty rings, which keep the slot's pages collected.
    Ring(Arc<DirtyRings>),
    /// The slot's dirty bitmap.
    Bitmap(Bitmap),
}

/// A slot's dirty bitmap and how to read it.
#[derive(Debug)]
struct Bitmap {
    vm: Arc<VmFd>,
    slot: u32,
    /// The VM has manual protection enabled ([`enable_manual_protect`]):
    /// a read copies the bitmap and clears what it copied.
    manual: bool,
    /// Pages in the slot.
    pages: u64,
    /// One bit per page of the slot, reused by every read.
    words: Vec<u64>,
}

/// Whether this host's KVM sets a page's bit in the dirty bitmap when it
/// makes the page writable for the guest, with no per-vCPU buffer in
/// between: then a read made while vCPUs run names every write that
/// completed before it ([`WriteLog::complete_unheld`]). Intel's PML logs
/// writes into a per-vCPU buffer that reaches the bitmap only at that
/// vCPU's next exit; without PML, KVM write-protects logged pages and marks
/// them in the fault, as AMD's SVM does (`kvm_amd` has no `pml` parameter
/// in the kernels this project runs on; one that has it is judged by its
/// value). Any other KVM module (or a `/sys` that cannot be read) counts
/// as buffered. Read once, on the first call: call it before the process
/// confines itself (`/sys/module` is outside the Landlock rules).
pub fn host_logs_unbuffered() -> bool {
    static UNBUFFERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNBUFFERED.get_or_init(|| {
        unbuffered_by(|module, file| {
            std::fs::read_to_string(format!("/sys/module/{module}/{file}"))
                .ok()
                .or_else(|| {
                    std::path::Path::new(&format!("/sys/module/{module}/{file}"))
                        .is_dir()
                        .then(String::new)
                })
        })
    })
}

/// [`host_logs_unbuffered`] over `read(module, path)`: a file's content,
/// `Some("")` for a directory, `None` when absent.
fn unbuffered_by(read: impl Fn(&str, &str) -> Option<String>) -> bool {
    let off = |v: Option<String>| v.is_some_and(|v| matches!(v.trim(), "N" | "n" | "0"));
    if read("kvm_intel", "").is_some() {
        return off(read("kvm_intel", "parameters/pml"));
    }
    if read("kvm_amd", "").is_some() {
        return match read("kvm_amd", "parameters/pml") {
            None => true,
            pml => off(pml),
        };
    }
    false
}

/// Enables `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` on `vm` (before any logged
/// slot exists); whether it is on. A KVM without it keeps the
/// read-and-clear `KVM_GET_DIRTY_LOG`, which is correct, only slower for
/// large slots; the reason is logged at info level.
pub(crate) fn enable_manual_protect(vm: &VmFd) -> bool {
    let offered = vm.check_extension_raw(libc::c_ulong::from(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2));
    if offered & KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE as i32 == 0 {
        log::info!(
            "KVM offers no manual dirty-log protection (KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 = \
             {offered}): pmem barriers read the dirty log with KVM_GET_DIRTY_LOG's own clearing"
        );
        return false;
    }
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
        ..Default::default()
    };
    // Only this flag: with KVM_DIRTY_LOG_INITIALLY_SET every page of a new
    // slot would read as written once.
    cap.args[0] = u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE);
    match vm.enable_cap(&cap) {
        Ok(()) => true,
        Err(e) => {
            log::info!(
                "enabling manual dirty-log protection failed ({e}): pmem barriers read the \
                 dirty log with KVM_GET_DIRTY_LOG's own clearing"
            );
            false
        }
    }
}

/// The slot's log, shared.
pub(crate) type SharedSlotLog = Arc<Mutex<SlotLog>>;

impl SlotLog {
    /// The log of `slot` (`len` bytes, registered with
    /// `KVM_MEM_LOG_DIRTY_PAGES`) of a VM whose slots `vm_log` reads.
    pub(crate) fn new(
        vm: Arc<VmFd>,
        slot: u32,
        len: u64,
        vm_log: &VmLog,
    ) -> Result<SharedSlotLog, DirtyLogError> {
        let pages = len.div_ceil(PAGE);
        let source = match vm_log {
            VmLog::Ring(rings) => {
                rings.register(slot, pages).map_err(DirtyLogError::Ring)?;
                Source::Ring(rings.clone())
            }
            VmLog::Bitmap { manual } => {
                let words =
                    page_bitmap(pages).map_err(|source| DirtyLogError::Memory { pages, source })?;
                Source::Bitmap(Bitmap {
                    vm,
                    slot,
                    manual: *manual,
                    pages,
                    words,
                })
            }
        };
        Ok(Arc::new(Mutex::new(SlotLog {
            slot,
            live: true,
            unbuffered: host_logs_unbuffered(),
            source,
        })))
    }

    /// Marks the slot deleted (before it is).
    pub(crate) fn retire(log: &SharedSlotLog) {
        let mut l = lock(log);
        l.live = false;
        if let Source::Ring(rings) = &l.source {
            rings.unregister(l.slot);
        }
    }

    /// Reads and clears the log: calls `into` with each page marked.
    fn take(&mut self, into: &mut dyn FnMut(u64)) -> Result<(), DirtyLogError> {
        if !self.live {
            return Err(DirtyLogError::Deleted { slot: self.slot });
        }
        match &mut self.source {
            Source::Ring(rings) => match rings.take(self.slot, into) {
                Ok(true) => Ok(()),
                Ok(false) => Err(DirtyLogError::Deleted { slot: self.slot }),
                Err(e) => Err(DirtyLogError::Ring(e)),
            },
            Source::Bitmap(b) => b.take(into),
        }
    }
}

impl Bitmap {
    /// Reads and clears the bitmap: calls `into` with each page marked.
    fn take(&mut self, into: &mut dyn FnMut(u64)) -> Result<(), DirtyLogError> {
        let arg = kvm_dirty_log {
            slot: self.slot,
            padding1: 0,
            __bindgen_anon_1: kvm_bindings::kvm_dirty_log__bindgen_ty_1 {
                dirty_bitmap: self.words.as_mut_ptr().cast(),
            },
        };
        // `arg` names a slot of this VM (live: its Memslot has not deleted
        // it, checked by the caller under the lock the deletion takes) and
        // a bitmap of one bit per page of that slot (sized from its
        // length), which outlives the call; KVM writes only the bitmap.
        // SAFETY: so the ioctl writes only memory this function owns.
        let r = unsafe { libc::ioctl(self.vm.as_raw_fd(), KVM_GET_DIRTY_LOG as _, &arg) };
        if r < 0 {
            return Err(DirtyLogError::Get {
                slot: self.slot,
                source: std::io::Error::last_os_error(),
            });
        }
        let mut span: Option<(usize, usize)> = None;
        for (i, word) in self.words.iter().enumerate() {
            let mut w = *word;
            if w == 0 {
                continue;
            }
            span = Some((span.map_or(i, |s| s.0), i));
            while w != 0 {
                let bit = u64::from(w.trailing_zeros());
                into(i as u64 * 64 + bit);
                w &= w - 1;
            }
        }
        match span {
            Some((first, last)) if self.manual => self.clear(first, last),
            _ => Ok(()),
        }
    }

    /// Clears (and write-protects) the pages of words `first..=last` of
    /// the bitmap the last read copied: one call per 2^31 pages of the
    /// span (KVM skips its zero words).
    fn clear(&mut self, first: usize, last: usize) -> Result<(), DirtyLogError> {
        /// `num_pages` is 32 bits; a multiple of 64.
        const MAX_CALL: u64 = 1 << 31;
        let mut page = first as u64 * 64;
        // KVM wants a multiple of 64 pages, or the rest of the slot.
        let end = ((last as u64 + 1) * 64).min(self.pages);
        while page < end {
            let count = (end - page).min(MAX_CALL);
            let mut arg = kvm_clear_dirty_log {
                slot: self.slot,
                num_pages: count as u32,
                first_page: page,
                ..Default::default()
            };
            let word = (page / 64) as usize;
            arg.__bindgen_anon_1.dirty_bitmap = self.words[word..].as_mut_ptr().cast();
            // `arg` names a live slot of this VM (checked by the caller
            // under the lock the deletion takes), pages inside it (`end` is
            // capped at its page count), and a bitmap holding at least
            // `count` bits from `page` on, which outlives the call; KVM
            // only reads it.
            // SAFETY: so the ioctl reads only memory this function owns.
            let r = unsafe { libc::ioctl(self.vm.as_raw_fd(), KVM_CLEAR_DIRTY_LOG as _, &arg) };
            if r < 0 {
                return Err(DirtyLogError::Clear {
                    slot: self.slot,
                    first: page,
                    count,
                    source: std::io::Error::last_os_error(),
                });
            }
            page += count;
        }
        Ok(())
    }
}

fn lock(log: &SharedSlotLog) -> MutexGuard<'_, SlotLog> {
    // The state is a flag and a scratch bitmap: valid after any panic.
    log.lock().unwrap_or_else(|e| e.into_inner())
}

/// KVM's dirty log of one memslot, for a pcow region
/// ([`virtio_pmem_pcow::PcowRegion::attach_write_log`]).
#[derive(Debug, Clone)]
pub struct KvmDirtyLog(pub(crate) SharedSlotLog);

impl KvmDirtyLog {
    /// Reads and clears the log: the pages (from the slot's start) written
    /// since the previous read.
    pub fn take(&self, into: &mut dyn FnMut(u64)) -> Result<(), DirtyLogError> {
        lock(&self.0).take(into)
    }
}

impl WriteLog for KvmDirtyLog {
    fn take_written(&self, into: &mut dyn FnMut(u64)) -> Result<(), WriteLogError> {
        self.take(into).map_err(|e| WriteLogError {
            what: "KVM dirty log".into(),
            source: Box::new(e),
        })
    }

    fn complete_unheld(&self) -> bool {
        lock(&self.0).unbuffered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_kvm_known_to_log_without_buffers_is_unbuffered() {
        let host = |files: &'static [(&'static str, &'static str, &'static str)]| {
            unbuffered_by(move |m, f| {
                files
                    .iter()
                    .find(|(fm, ff, _)| *fm == m && *ff == f)
                    .map(|(_, _, v)| v.to_string())
            })
        };
        // AMD without a pml parameter, or with it off.
        assert!(host(&[("kvm_amd", "", "")]));
        assert!(host(&[
            ("kvm_amd", "", ""),
            ("kvm_amd", "parameters/pml", "N\n")
        ]));
        assert!(!host(&[
            ("kvm_amd", "", ""),
            ("kvm_amd", "parameters/pml", "Y\n")
        ]));
        // Intel: PML on (the default), unknown, or off.
        assert!(!host(&[
            ("kvm_intel", "", ""),
            ("kvm_intel", "parameters/pml", "Y\n")
        ]));
        assert!(!host(&[("kvm_intel", "", "")]));
        assert!(host(&[
            ("kvm_intel", "", ""),
            ("kvm_intel", "parameters/pml", "N\n")
        ]));
        // Another KVM (this project's hosts run `kvm_pvm`), or none known.
        assert!(!host(&[("kvm_pvm", "", "")]));
        assert!(!host(&[]));
    }

    #[test]
    fn the_ioctl_number_is_the_kernels() {
        // include/uapi/linux/kvm.h: _IOW(KVMIO, 0x42, struct kvm_dirty_log)
        // with a 16-byte struct.
        assert_eq!(std::mem::size_of::<kvm_dirty_log>(), 16);
        assert_eq!(KVM_GET_DIRTY_LOG, 0x4010_ae42);
        // _IOWR(KVMIO, 0xc0, struct kvm_clear_dirty_log), 24 bytes.
        assert_eq!(std::mem::size_of::<kvm_clear_dirty_log>(), 24);
        assert_eq!(KVM_CLEAR_DIRTY_LOG, 0xc018_aec0);
    }
}
