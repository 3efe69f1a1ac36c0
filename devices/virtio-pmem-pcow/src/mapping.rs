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
        Ok(Reservation { base, len })
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
        let flags = libc::MAP_FIXED
            | libc::MAP_NORESERVE
            | if shared {
                libc::MAP_SHARED
            } else {
                libc::MAP_PRIVATE
            };
        let addr = (self.base as u64 + offset) as *mut libc::c_void;
        // `check` proved `[addr, addr + len)` lies inside this reservation,
        // which this value owns; the region is reached through raw
        // pointers only, so no Rust reference into it exists.
        // SAFETY: MAP_FIXED thus replaces only our own, unborrowed pages;
        // the fd is open for the call.
        let p = unsafe {
            libc::mmap(
                addr,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                off,
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

/// The process's mappings (lines of `/proc/self/maps`).
pub fn process_map_count() -> Result<u64, MapsError> {
    Ok(read_proc("/proc/self/maps")?.lines().count() as u64)
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
    fn map_count_check_names_the_sysctl_and_compact() {
        assert!(check_map_count(100, 65530, 200).is_ok());
        let e = check_map_count(100, 1200, 150).unwrap_err().to_string();
        assert!(e.contains("vm.max_map_count"), "{e}");
        assert!(e.contains("pcow-img compact"), "{e}");
        assert!(e.contains("needs about 100"), "{e}");
    }
}
