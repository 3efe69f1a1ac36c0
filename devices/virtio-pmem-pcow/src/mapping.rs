//! The region's address space: [`Reservation`], one anonymous, 2 MiB-aligned
//! range of the device's size that every cluster is mapped over
//! (`MAP_FIXED`, always checked to stay inside it), and what the process's
//! mappings allow (`vm.max_map_count`, the VMAs of a range).

use std::io;
use std::os::fd::RawFd;

/// The page size the device works in (the only one it supports).
pub const PAGE_SIZE: u64 = 4096;

/// Alignment of the region (a KVM memslot, as Cloud Hypervisor places it).
pub const REGION_ALIGN: usize = 2 << 20;
/// VMAs kept free for the rest of the process (and for later faults and
/// barriers, which map clusters one at a time).
pub const VMA_MARGIN: u64 = 1024;

/// Errors reading what the process's mappings allow.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum MapsError {
    #[error(
        "mapping the image needs about {needed} memory mappings but only {available} of \
         vm.max_map_count={max} are free ({used} in use, {margin} kept spare): raise \
         vm.max_map_count (sysctl) or defragment the image with `pcow-img compact`"
    )]
    TooManyMappings {
        needed: u64,
        available: u64,
        max: u64,
        used: u64,
        margin: u64,
    },
    #[error("reading {what}")]
    Proc {
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

/// An anonymous, private, 2 MiB-aligned reservation of address space;
/// unmapped on drop together with everything mapped over it.
#[derive(Debug)]
pub struct Reservation {
    base: usize,
    len: usize,
    /// The process's `vm.max_map_count` for [`MapBudget`], once the
    /// region is built; `None`: no budget (while it is being built, which
    /// checks its own need first).
    map_limit: Option<u64>,
}

/// Mappings the device may still make at run time, shared by every region
/// of the process (they share its `vm.max_map_count`).
///
/// A guest that writes scattered clusters makes a mapping per cluster
/// (each fault into a hole and each remap splits the mapping it lands
/// in). Unchecked, they used up the process's limit: then any allocation
/// that needs a fresh mapping fails, anywhere in the VMM (Rust's
/// allocator then aborts the process: "memory allocation of 262144 bytes
/// failed", in a run of the startup bench). So the device stops
/// [`VMA_MARGIN`] short of the limit: a mapping past that is refused with
/// `ENOMEM`, the error the kernel gives at the limit, which every caller
/// handles without losing data (a write fault falls back to the zero page
/// and the barrier moves the write into the image; a refused remap leaves
/// the cluster private, its data in the image).
///
/// Only shared mappings are counted and refused: the writable layer's
/// clusters mapped at a write fault or by a barrier's remap, whose number
/// grows with a guest's scattered writes (each splits the mapping it
/// lands in). A private mapping is made over runs already mapped (a
/// snapshot demotes shared runs, a live overlay maps the new base's):
/// it keeps their boundaries, and refusing it at the margin would stop a
/// snapshot halfway; the kernel's own limit still applies to it.
///
/// Counting the process's mappings reads `/proc/self/maps` (10-40 ms at
/// 65,000 lines here), so the count is kept as a bound: the count taken
/// when the last region was built plus two per mapping made since. The
/// bound follows what the device maps; what the rest of the process maps
/// after the open (threads, its allocator) is what the margin is for.
/// Only when the bound reaches the limit is the process counted again
/// (mappings merge and go away, so the bound may be far above the truth),
/// and then at most once per [`RECOUNT_EVERY`] mappings asked for, so that
/// a region held at the limit does not count on every fault: a mapping
/// freed meanwhile is used from the next count on, and a cluster refused
/// meanwhile is mapped later (a write fault's cluster by the barrier's
/// remap, a refused remap at the next barrier after a write there).
#[derive(Debug, Default)]
struct MapBudget {
    /// The process's mappings at the last count (0: never counted).
    counted: u64,
    /// Mappings made since the last count.
    made: u64,
    /// Mappings asked for since the last count (made or refused).
    asked: u64,
    /// Mappings to ask for before the next count once the bound reached
    /// the limit: [`RECOUNT_EVERY`], doubled by each count that still
    /// finds no room (up to [`RECOUNT_MAX`]).
    recount_after: u64,
}

/// Mappings asked for between two counts of the process's mappings once
/// the bound reached the limit (all of them refused): a count costs about
/// as much as 256 to 2,000 faults. Counts that still find no room double
/// it, up to [`RECOUNT_MAX`]: with a count every 256 refusals, 20,000
/// scattered writes of a guest held at the limit took 4.4-5.8 s and the
/// barrier after them 2.5-3.8 s; with the doubling 0.85-3.3 s and
/// 0.22-0.35 s (the startup bench, 2 runs and 4).
const RECOUNT_EVERY: u64 = 256;
/// The longest wait between two counts, in mappings asked for: a count
/// then costs a refused mapping about 8 us on average, and mappings freed
/// meanwhile are found within 4,096 asks.
const RECOUNT_MAX: u64 = 4096;

static MAP_BUDGET: std::sync::Mutex<MapBudget> = std::sync::Mutex::new(MapBudget {
    counted: 0,
    made: 0,
    asked: 0,
    recount_after: RECOUNT_EVERY,
});

impl MapBudget {
    /// Whether one more mapping (at most two more VMAs) stays `VMA_MARGIN`
    /// short of `limit`; `count` counts the process's mappings.
    fn admit(&mut self, limit: u64, count: impl FnOnce() -> Result<u64, MapsError>) -> bool {
        let threshold = limit.saturating_sub(VMA_MARGIN);
        self.asked += 1;
        let bound = self.counted.saturating_add(self.made.saturating_add(1) * 2);
        if self.counted > 0 && bound <= threshold {
            self.made += 1;
            return true;
        }
        if self.counted > 0 && self.asked < self.recount_after {
            return false;
        }
        let counted = count();
        self.asked = 0;
        let room = match counted {
            Ok(n) => {
                self.counted = n.max(1);
                self.made = 0;
                self.counted.saturating_add(2) <= threshold
            }
            // Nothing to go by: refuse, and try again later.
            Err(_) => false,
        };
        if room {
            self.made = 1;
            self.recount_after = RECOUNT_EVERY;
        } else {
            self.recount_after = (self.recount_after.max(1) * 2).min(RECOUNT_MAX);
        }
        room
    }
}

impl Reservation {
    /// Reserves `len` bytes (a multiple of the page size).
    pub fn new(len: usize) -> io::Result<Reservation> {
        let total = len
            .checked_add(REGION_ALIGN)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
        // SAFETY: a fresh anonymous mapping at an address the kernel picks;
        // the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let raw = p as usize;
        let base = raw.next_multiple_of(REGION_ALIGN);
        let head = base - raw;
        let tail = total - head - len;
        // SAFETY: both ranges lie inside the mapping just created and
        // nothing refers to them.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((base + len) as *mut libc::c_void, tail);
            }
            // Page-granular behaviour for the anonymous parts (advisory:
            // the result does not matter).
            libc::madvise(base as *mut libc::c_void, len, libc::MADV_NOHUGEPAGE);
        }
        Ok(Reservation {
            base,
            len,
            map_limit: None,
        })
    }

    /// From now on, every shared mapping over the reservation counts
    /// against the process's `limit` (`vm.max_map_count`, or a test's),
    /// with `in_use` mappings in the process now (a count, or a bound):
    /// see [`MapBudget`].
    pub(crate) fn limit_mappings(&mut self, limit: u64, in_use: u64) {
        self.map_limit = Some(limit);
        let mut budget = MAP_BUDGET
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *budget = MapBudget {
            counted: in_use.max(1),
            made: 0,
            asked: 0,
            recount_after: RECOUNT_EVERY,
        };
    }

    /// Host address of the first byte.
    pub fn base(&self) -> u64 {
        self.base as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        let ok = offset.is_multiple_of(PAGE_SIZE)
            && len.is_multiple_of(PAGE_SIZE)
            && len > 0
            && offset
                .checked_add(len)
                .is_some_and(|e| e <= self.len as u64);
        if ok {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        }
    }

    /// Maps `len` bytes of `fd` at `file_offset` over region offset
    /// `offset`, shared or private, read-write.
    ///
    /// The content seen through the range changes to the file's: callers
    /// only do this over ranges whose current content is that same data,
    /// or that hold no present page (see the monitor and the barrier).
    pub(crate) fn map_file(
        &self,
        offset: u64,
        len: u64,
        fd: RawFd,
        file_offset: u64,
        shared: bool,
    ) -> io::Result<()> {
        self.map_file_unadvised(offset, len, fd, file_offset, shared)?;
        if shared {
            self.advise_random(offset, len);
        }
        Ok(())
    }

    /// [`Reservation::map_file`] without the advice: a caller that maps
    /// many shared runs side by side (the region's open) advises them all
    /// with one [`Reservation::advise_random`] afterwards, a system call
    /// instead of one per run.
    pub(crate) fn map_file_unadvised(
        &self,
        offset: u64,
        len: u64,
        fd: RawFd,
        file_offset: u64,
        shared: bool,
    ) -> io::Result<()> {
        self.check(offset, len)?;
        let off = libc::off_t::try_from(file_offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // Only shared mappings count: they are the ones whose number grows
        // with the guest's scattered writes (see `MapBudget`).
        if shared && !self.admit(1) {
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        }
        let flags = if shared {
            libc::MAP_SHARED
        } else {
            libc::MAP_PRIVATE
        };
        self.map_fixed(offset, len, flags, fd, off)
    }

    /// Whether `n` more mappings fit under the limit set by
    /// [`Reservation::limit_mappings`] (see [`MapBudget`]); always with no
    /// limit set. [`Reservation::map_file`] asks for its shared mappings;
    /// a fault that maps a cluster the open left unmapped asks for its
    /// private ones before it maps anything, so that it is never refused
    /// halfway.
    pub(crate) fn admit(&self, n: u64) -> bool {
        let Some(limit) = self.map_limit else {
            return true;
        };
        // A poisoned lock only means a thread panicked while holding it;
        // the counts stay usable.
        let mut budget = MAP_BUDGET
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (0..n).all(|_| budget.admit(limit, process_map_count))
    }

    /// Maps fresh anonymous memory (not registered with any userfaultfd)
    /// over `[offset, offset + len)`.
    ///
    /// Callers only do this over ranges that hold no present page, so no
    /// content is lost.
    pub(crate) fn map_anon(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        self.map_fixed(offset, len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    }

    /// `mmap` read-write with `flags` over `[offset, offset + len)`,
    /// which the caller checked ([`Reservation::check`]).
    fn map_fixed(
        &self,
        offset: u64,
        len: u64,
        flags: libc::c_int,
        fd: RawFd,
        file_offset: libc::off_t,
    ) -> io::Result<()> {
        let addr = (self.base as u64 + offset) as *mut libc::c_void;
        // `check` proved `[addr, addr + len)` lies inside this reservation,
        // which this value owns; the region is reached through raw
        // pointers only, so no Rust reference into it exists.
        // SAFETY: MAP_FIXED thus replaces only our own, unborrowed pages;
        // a file descriptor is open for the call.
        let p = unsafe {
            libc::mmap(
                addr,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags | libc::MAP_FIXED | libc::MAP_NORESERVE,
                fd,
                file_offset,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// No read-around on the writable layer's mappings in
    /// `[offset, offset + len)`: a fault there would otherwise read ahead
    /// (and zero, for a fresh cluster) up to the file's whole readahead
    /// window, in large folios: 160 us more per first write into a 2 MiB
    /// cluster on ext4 here. The guest's accesses are random. Every
    /// shared mapping gets it, so that neighbours still merge into one
    /// VMA. Advisory: a failure is logged.
    pub(crate) fn advise_random(&self, offset: u64, len: u64) {
        let Ok(addr) = self.ptr(offset, len) else {
            log::debug!("madvise(MADV_RANDOM) outside the region at {offset:#x}");
            return;
        };
        // SAFETY: `ptr` proved the range lies inside this reservation;
        // the advice changes no content.
        if unsafe { libc::madvise(addr.cast(), len as usize, libc::MADV_RANDOM) } != 0 {
            log::debug!(
                "madvise(MADV_RANDOM) at region offset {offset:#x}: {}",
                io::Error::last_os_error()
            );
        }
    }

    /// Drops the pages of `[offset, offset + len)` (anonymous memory): the
    /// range holds no page afterwards, and its next access faults.
    ///
    /// Callers only do this over ranges whose pages all read as zeros with
    /// no writer running (see the barrier), so no content is lost.
    pub(crate) fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        let addr = (self.base as u64 + offset) as *mut libc::c_void;
        // SAFETY: `check` proved the range lies inside this reservation,
        // reached through raw pointers only (no Rust reference into it
        // exists); MADV_DONTNEED only empties its page tables.
        if unsafe { libc::madvise(addr, len as usize, libc::MADV_DONTNEED) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// A raw pointer to region offset `offset` (in bounds, checked).
    pub(crate) fn ptr(&self, offset: u64, len: u64) -> io::Result<*mut u8> {
        self.check(offset, len)?;
        Ok((self.base as u64 + offset) as *mut u8)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: `[base, base + len)` is this reservation (and what was
        // mapped over it); nothing refers to it once its owner is dropped.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
        }
    }
}

/// Checks that `needed` more mappings fit under `max` with `used` in use.
pub fn check_map_count(needed: u64, max: u64, used: u64) -> Result<(), MapsError> {
    let available = max.saturating_sub(used).saturating_sub(VMA_MARGIN);
    if needed > available {
        return Err(MapsError::TooManyMappings {
            needed,
            available,
            max,
            used,
            margin: VMA_MARGIN,
        });
    }
    Ok(())
}

fn read_proc(path: &'static str) -> Result<String, MapsError> {
    std::fs::read_to_string(path).map_err(|source| MapsError::Proc { what: path, source })
}

/// `vm.max_map_count`.
pub fn max_map_count() -> Result<u64, MapsError> {
    read_proc("/proc/sys/vm/max_map_count")?
        .trim()
        .parse()
        .map_err(|_| MapsError::Proc {
            what: "/proc/sys/vm/max_map_count",
            source: io::Error::from(io::ErrorKind::InvalidData),
        })
}

/// `/proc/self/maps`, opened by the first count (a region's open, on the
/// thread that builds it) and read again from its start by every later
/// one: the fault monitor counts when a mapping nears the limit, and its
/// seccomp filter allows no `openat`.
static MAPS_FILE: std::sync::Mutex<Option<std::fs::File>> = std::sync::Mutex::new(None);

/// The process's mappings (lines of `/proc/self/maps`), counted through a
/// buffer on the stack: a process at its mapping limit cannot get the
/// memory for the whole text (megabytes: a fresh mapping).
pub fn process_map_count() -> Result<u64, MapsError> {
    use std::io::{Read, Seek};
    const WHAT: &str = "/proc/self/maps";
    let err = |source| MapsError::Proc { what: WHAT, source };
    let mut held = MAPS_FILE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let f = match &mut *held {
        Some(f) => {
            f.rewind().map_err(err)?;
            f
        }
        none => none.insert(std::fs::File::open(WHAT).map_err(err)?),
    };
    let mut buf = [0u8; 16 << 10];
    let mut lines = 0u64;
    loop {
        match f.read(&mut buf) {
            Ok(0) => return Ok(lines),
            Ok(n) => lines += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(err(e)),
        }
    }
}

/// The mappings (VMAs) inside `[start, end)`.
pub fn vmas_in(start: u64, end: u64) -> Result<u64, MapsError> {
    let maps = read_proc("/proc/self/maps")?;
    let mut n = 0;
    for line in maps.lines() {
        let range = line.split(' ').next().unwrap_or("");
        let mut it = range.split('-');
        let (Some(a), Some(b)) = (it.next(), it.next()) else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        if a < end && b > start {
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_stops_short_of_the_limit_and_counts_again_rarely() {
        let limit = VMA_MARGIN + 100;
        let mut counts = 0;
        let fresh = || MapBudget {
            recount_after: RECOUNT_EVERY,
            ..MapBudget::default()
        };
        let mut b = fresh();
        // Counted at the first mapping: 40 in use, room for 30 more
        // mappings of two VMAs each.
        let mut admitted = 0;
        for _ in 0..40 {
            admitted += u64::from(b.admit(limit, || {
                counts += 1;
                Ok(40)
            }));
        }
        assert_eq!((admitted, counts), (30, 1));
        // Refused without counting until RECOUNT_EVERY were asked since
        // the count.
        let mut refused = 0;
        while b.asked < RECOUNT_EVERY - 1 {
            assert!(!b.admit(limit, || unreachable!("counted too early")));
            refused += 1;
        }
        assert_eq!(refused, RECOUNT_EVERY - 40);
        // The next count finds no room: the wait doubles.
        assert!(!b.admit(limit, || Ok(limit - VMA_MARGIN - 1)));
        assert_eq!(b.recount_after, 2 * RECOUNT_EVERY);
        while b.asked < 2 * RECOUNT_EVERY - 1 {
            assert!(!b.admit(limit, || unreachable!("counted too early")));
        }
        // The next count finds mappings gone (merged, unmapped): admitted,
        // and the wait is back to its start.
        assert!(b.admit(limit, || Ok(80)));
        assert_eq!((b.counted, b.recount_after), (80, RECOUNT_EVERY));
        // A count that fails refuses, and is tried again later.
        let mut b = fresh();
        assert!(!b.admit(limit, || Err(MapsError::Proc {
            what: "test",
            source: io::Error::from_raw_os_error(libc::EIO),
        })));
        assert!(b.admit(limit, || Ok(1)));
        // At or past the limit nothing is admitted.
        let mut b = fresh();
        assert!(!b.admit(limit, || Ok(limit - VMA_MARGIN - 1)));
        assert!(!b.admit(10, || Ok(1)));
    }

    #[test]
    fn the_process_s_mappings_are_counted_as_listed() {
        let listed = std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .count() as u64;
        let counted = process_map_count().unwrap();
        // Other test threads may map or unmap between the two reads.
        assert!(counted.abs_diff(listed) < 64, "{counted} vs {listed}");
        assert!(counted > 5, "{counted}");
    }

    #[test]
    fn map_count_check_names_the_sysctl_and_compact() {
        assert!(check_map_count(100, 65530, 200).is_ok());
        let e = check_map_count(100, 1200, 150).unwrap_err().to_string();
        assert!(e.contains("vm.max_map_count"), "{e}");
        assert!(e.contains("pcow-img compact"), "{e}");
        assert!(e.contains("needs about 100"), "{e}");
    }
}
