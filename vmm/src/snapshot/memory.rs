//! Guest RAM in a snapshot's `memory-ranges` file: its layout, writing it
//! sparsely, and building a VM's guest memory back from it.
//!
//! The file holds every RAM range of the guest, one after the other in
//! guest address order, so range *i* starts at the sum of the sizes of the
//! ranges before it and the file is exactly as long as the RAM. The ranges
//! themselves (guest address and size) are the [`MemoryLayout`] recorded in
//! `state.json`. A 4 KiB page that is all zeros is never written: it stays
//! a hole, so a mostly idle guest costs little disk, and [`restore`] in
//! [`MemoryRestoreMode::Copy`] skips holes with `SEEK_DATA`/`SEEK_HOLE`.
//!
//! [`MemoryRestoreMode::CopyOnWrite`] maps the file `MAP_PRIVATE` as the
//! guest's RAM: pages are read from the page cache when the guest touches
//! them, and a guest write copies the page into the VM's own memory. Every
//! VM restored from one snapshot this way shares the unwritten pages. The
//! file must then stay as it is for as long as such a VM runs (a truncated
//! file raises SIGBUS on access): the snapshot directory is immutable once
//! written. [`MemoryRestoreMode::OnDemand`] (upstream's userfaultfd paging)
//! is not built here and is refused.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_memory::mmap::{MmapRegionBuilder, MmapRegionError};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryError, GuestMemoryMmap,
    GuestMemoryRegion, GuestRegionCollectionError, GuestRegionMmap,
};

pub use crate::config::options::MemoryRestoreMode;

/// The unit of sparseness: a page that is all zeros is a hole in the file.
pub const PAGE: u64 = 4096;

/// How much RAM is copied through one buffer at a time.
const CHUNK: usize = 1 << 20;

/// One guest RAM range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryRange {
    /// Guest physical address of its first byte.
    pub gpa: u64,
    /// Its size in bytes.
    pub size: u64,
}

/// Where guest RAM is and how it is laid out in `memory-ranges` (ranges
/// stored back to back, in this order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryLayout {
    /// The RAM ranges, in increasing guest address order.
    pub ranges: Vec<MemoryRange>,
}

/// Why a [`MemoryLayout`] is not one guest RAM can have.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("no RAM range")]
    Empty,
    #[error(
        "range {index} (guest {gpa:#x}, size {size:#x}): address and size must be multiples \
         of 4 KiB and the size non-zero"
    )]
    Misaligned { index: usize, gpa: u64, size: u64 },
    #[error(
        "range {index} (guest {gpa:#x}) starts below the end {prev_end:#x} of the range before"
    )]
    Unordered {
        index: usize,
        gpa: u64,
        prev_end: u64,
    },
    #[error("range {index} (guest {gpa:#x}, size {size:#x}) wraps around the address space")]
    Wraps { index: usize, gpa: u64, size: u64 },
    #[error("the ranges add up to more than 2^64 bytes")]
    TooLarge,
}

impl MemoryLayout {
    /// The layout of `memory`'s regions.
    pub fn of(memory: &GuestMemoryMmap) -> MemoryLayout {
        MemoryLayout {
            ranges: memory
                .iter()
                .map(|r| MemoryRange {
                    gpa: r.start_addr().0,
                    size: r.len(),
                })
                .collect(),
        }
    }

    /// Checks the layout (at least one range; ranges page aligned,
    /// non-empty, in order, not overlapping, not wrapping) and returns the
    /// RAM's total size, which is the size of `memory-ranges`.
    pub fn check(&self) -> Result<u64, LayoutError> {
        if self.ranges.is_empty() {
            return Err(LayoutError::Empty);
        }
        let mut total: u64 = 0;
        let mut prev_end: Option<u64> = None;
        for (index, r) in self.ranges.iter().enumerate() {
            if r.size == 0 || !r.size.is_multiple_of(PAGE) || !r.gpa.is_multiple_of(PAGE) {
                return Err(LayoutError::Misaligned {
                    index,
                    gpa: r.gpa,
                    size: r.size,
                });
            }
            let end = r.gpa.checked_add(r.size).ok_or(LayoutError::Wraps {
                index,
                gpa: r.gpa,
                size: r.size,
            })?;
            if let Some(prev_end) = prev_end.filter(|&e| r.gpa < e) {
                return Err(LayoutError::Unordered {
                    index,
                    gpa: r.gpa,
                    prev_end,
                });
            }
            prev_end = Some(end);
            total = total.checked_add(r.size).ok_or(LayoutError::TooLarge)?;
        }
        Ok(total)
    }

    /// Each range with its offset in `memory-ranges`. Meaningful on a
    /// layout that passed [`MemoryLayout::check`] (sums cannot overflow).
    pub fn with_file_offsets(&self) -> impl Iterator<Item = (MemoryRange, u64)> + '_ {
        self.ranges.iter().scan(0u64, |offset, r| {
            let at = *offset;
            *offset = offset.saturating_add(r.size);
            Some((*r, at))
        })
    }
}

/// Errors of writing or restoring guest RAM.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("prefaulting the RAM range at guest {gpa:#x} size {size:#x}")]
    Prefault {
        gpa: u64,
        size: u64,
        #[source]
        source: io::Error,
    },
    #[error("invalid RAM layout")]
    Layout(#[source] LayoutError),
    #[error("memory restore mode OnDemand (userfaultfd paging) is not supported by this VMM; use Copy or CopyOnWrite")]
    OnDemandUnsupported,
    #[error("RAM range at guest {gpa:#x} is {size:#x} bytes, more than this host can map")]
    RangeTooLarge { gpa: u64, size: u64 },
    #[error("reading guest RAM at {gpa:#x}")]
    ReadGuest {
        gpa: u64,
        #[source]
        source: GuestMemoryError,
    },
    #[error("writing guest RAM at {gpa:#x}")]
    WriteGuest {
        gpa: u64,
        #[source]
        source: GuestMemoryError,
    },
    #[error("setting the file's size to {size:#x}")]
    SetLen {
        size: u64,
        #[source]
        source: io::Error,
    },
    #[error("writing {len:#x} bytes at file offset {offset:#x}")]
    WriteFile {
        offset: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("reading {len:#x} bytes at file offset {offset:#x}")]
    ReadFile {
        offset: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("finding data at file offset {offset:#x} (SEEK_DATA/SEEK_HOLE)")]
    Seek {
        offset: u64,
        #[source]
        source: io::Error,
    },
    #[error("the file is {actual:#x} bytes, the RAM layout needs {expected:#x}")]
    FileSize { actual: u64, expected: u64 },
    #[error("reading the file's size")]
    Metadata(#[source] io::Error),
    #[error("duplicating the file's descriptor for the mappings")]
    DupFile(#[source] io::Error),
    #[error("mapping RAM range at guest {gpa:#x} size {size:#x}")]
    Map {
        gpa: u64,
        size: u64,
        #[source]
        source: MmapRegionError,
    },
    #[error("assembling guest memory from its ranges")]
    Collection(#[source] GuestRegionCollectionError),
}

/// Writes `memory` into `file` (new and empty, opened for writing) as
/// `memory-ranges`: the file is sized to the RAM, then every run of
/// non-zero pages is written at its offset; all-zero pages stay holes.
/// Does not sync the file (the caller's protocol does). Returns the
/// layout to record.
pub fn save(memory: &GuestMemoryMmap, file: &File) -> Result<MemoryLayout, MemoryError> {
    let layout = MemoryLayout::of(memory);
    let total = layout.check().map_err(MemoryError::Layout)?;
    file.set_len(total).map_err(|source| MemoryError::SetLen {
        size: total,
        source,
    })?;
    let mut buf = vec![0u8; CHUNK];
    for (range, file_offset) in layout.with_file_offsets() {
        let mut done: u64 = 0;
        while done < range.size {
            let len = (range.size - done).min(CHUNK as u64) as usize;
            let chunk = &mut buf[..len];
            let gpa = range.gpa + done;
            memory
                .read_slice(chunk, GuestAddress(gpa))
                .map_err(|source| MemoryError::ReadGuest { gpa, source })?;
            write_nonzero_runs(file, chunk, file_offset + done)?;
            done += len as u64;
        }
    }
    Ok(layout)
}

/// Writes the runs of non-zero pages of `chunk` (a whole number of pages)
/// at `offset` + their place in it.
fn write_nonzero_runs(file: &File, chunk: &[u8], offset: u64) -> Result<(), MemoryError> {
    let page = PAGE as usize;
    let mut run_start: Option<usize> = None;
    let flush = |start: usize, end: usize| {
        let at = offset + start as u64;
        file.write_all_at(&chunk[start..end], at)
            .map_err(|source| MemoryError::WriteFile {
                offset: at,
                len: end - start,
                source,
            })
    };
    for (i, p) in chunk.chunks(page).enumerate() {
        let zero = is_zero(p);
        match (zero, run_start) {
            (false, None) => run_start = Some(i * page),
            (true, Some(start)) => {
                flush(start, i * page)?;
                run_start = None;
            }
            _ => {}
        }
    }
    if let Some(start) = run_start {
        flush(start, chunk.len())?;
    }
    Ok(())
}

/// Whether `bytes` are all zero (word at a time: this runs over all RAM).
fn is_zero(bytes: &[u8]) -> bool {
    let mut words = bytes.chunks_exact(16);
    let whole = words
        .by_ref()
        .all(|w| u128::from_ne_bytes(w.try_into().unwrap_or([1; 16])) == 0);
    whole && words.remainder().iter().all(|&b| b == 0)
}

/// Builds guest memory for `layout` from `file` (a snapshot's
/// `memory-ranges`, opened for reading) in `mode`; `prefault` populates
/// every page before returning (`MAP_POPULATE`). The file's size must be
/// the layout's total.
pub fn restore(
    file: &File,
    layout: &MemoryLayout,
    mode: MemoryRestoreMode,
    prefault: bool,
) -> Result<GuestMemoryMmap, MemoryError> {
    let total = layout.check().map_err(MemoryError::Layout)?;
    let actual = file.metadata().map_err(MemoryError::Metadata)?.len();
    if actual != total {
        return Err(MemoryError::FileSize {
            actual,
            expected: total,
        });
    }
    match mode {
        MemoryRestoreMode::OnDemand => Err(MemoryError::OnDemandUnsupported),
        MemoryRestoreMode::Copy => restore_copy(file, layout, prefault),
        MemoryRestoreMode::CopyOnWrite => restore_cow(file, layout, prefault),
    }
}

fn populate(prefault: bool) -> i32 {
    if prefault {
        libc::MAP_POPULATE
    } else {
        0
    }
}

fn range_len(r: &MemoryRange) -> Result<usize, MemoryError> {
    usize::try_from(r.size).map_err(|_| MemoryError::RangeTooLarge {
        gpa: r.gpa,
        size: r.size,
    })
}

/// Anonymous private RAM (as `Vm::new` allocates it), then the file's data
/// extents read into it; holes stay untouched zero pages.
fn restore_copy(
    file: &File,
    layout: &MemoryLayout,
    prefault: bool,
) -> Result<GuestMemoryMmap, MemoryError> {
    let mut regions = Vec::with_capacity(layout.ranges.len());
    for (index, r) in layout.ranges.iter().enumerate() {
        let mapping = MmapRegionBuilder::new(range_len(r)?)
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | populate(prefault),
            )
            .build()
            .map_err(|source| MemoryError::Map {
                gpa: r.gpa,
                size: r.size,
                source,
            })?;
        regions.push(map_region(mapping, index, r)?);
    }
    let memory = GuestMemoryMmap::from_regions(regions).map_err(MemoryError::Collection)?;
    let mut buf = vec![0u8; CHUNK];
    for (range, file_offset) in layout.with_file_offsets() {
        let end = file_offset + range.size;
        let mut pos = file_offset;
        while let Some((data, data_end)) = next_data(file, pos, end)? {
            let mut at = data;
            while at < data_end {
                let len = (data_end - at).min(CHUNK as u64) as usize;
                let chunk = &mut buf[..len];
                file.read_exact_at(chunk, at)
                    .map_err(|source| MemoryError::ReadFile {
                        offset: at,
                        len,
                        source,
                    })?;
                let gpa = range.gpa + (at - file_offset);
                memory
                    .write_slice(chunk, GuestAddress(gpa))
                    .map_err(|source| MemoryError::WriteGuest { gpa, source })?;
                at += len as u64;
            }
            pos = data_end;
        }
    }
    Ok(memory)
}

/// The next data extent of `file` in `[pos, end)`: `(start, end)`, or
/// `None` when the rest is a hole.
fn next_data(file: &File, pos: u64, end: u64) -> Result<Option<(u64, u64)>, MemoryError> {
    if pos >= end {
        return Ok(None);
    }
    let seek = |whence: i32, from: u64| -> Result<Option<u64>, MemoryError> {
        let off = libc::off_t::try_from(from).map_err(|_| MemoryError::Seek {
            offset: from,
            source: io::Error::from_raw_os_error(libc::EOVERFLOW),
        })?;
        // SAFETY: lseek on a file descriptor this function borrows for the
        // call; it only moves the file's offset (which nothing else here
        // relies on: reads use pread) and touches no memory.
        let r = unsafe { libc::lseek(file.as_raw_fd(), off, whence) };
        if r < 0 {
            let e = io::Error::last_os_error();
            // ENXIO from SEEK_DATA: no data at or after `from`.
            if e.raw_os_error() == Some(libc::ENXIO) {
                return Ok(None);
            }
            return Err(MemoryError::Seek {
                offset: from,
                source: e,
            });
        }
        // A non-negative off_t fits in u64.
        Ok(Some(r as u64))
    };
    let Some(data) = seek(libc::SEEK_DATA, pos)? else {
        return Ok(None);
    };
    if data >= end {
        return Ok(None);
    }
    // Every offset below the file's size has a hole at or after it (the
    // end of the file counts as one), so `None` cannot happen here; treat
    // it as data up to `end`.
    let hole = seek(libc::SEEK_HOLE, data)?.unwrap_or(end);
    Ok(Some((data, hole.min(end))))
}

/// `memory-ranges` mapped `MAP_PRIVATE` range by range: reads come from the
/// page cache (shared by every VM mapping the file), writes copy the page.
fn restore_cow(
    file: &File,
    layout: &MemoryLayout,
    prefault: bool,
) -> Result<GuestMemoryMmap, MemoryError> {
    let shared = Arc::new(file.try_clone().map_err(MemoryError::DupFile)?);
    let mut regions = Vec::with_capacity(layout.ranges.len());
    for (index, (r, file_offset)) in layout.with_file_offsets().enumerate() {
        let mapping = MmapRegionBuilder::new(range_len(&r)?)
            .with_file_offset(FileOffset::from_arc(shared.clone(), file_offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            // Not MAP_POPULATE: on a private writable mapping it copies
            // every page (as a write fault would), and clones would share
            // nothing. Prefaulting maps the page cache for reading.
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(|source| MemoryError::Map {
                gpa: r.gpa,
                size: r.size,
                source,
            })?;
        if prefault {
            populate_read(&mapping).map_err(|source| MemoryError::Prefault {
                gpa: r.gpa,
                size: r.size,
                source,
            })?;
        }
        regions.push(map_region(mapping, index, &r)?);
    }
    GuestMemoryMmap::from_regions(regions).map_err(MemoryError::Collection)
}

/// Maps every page of a private file mapping from the page cache for
/// reading (`MADV_POPULATE_READ`), without copying any: a later guest
/// write still copies its page, and until then every VM mapping the file
/// shares it. Kernels before 5.14 lack the advice: each page is read once
/// instead, which maps it the same way.
fn populate_read(mapping: &vm_memory::MmapRegion) -> io::Result<()> {
    let (ptr, len) = (mapping.as_ptr(), mapping.size());
    // SAFETY: the range is exactly this mapping, which is mapped and
    // readable; the advice only populates page tables (it never changes
    // the contents).
    let rc = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_POPULATE_READ) };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EINVAL) {
        return Err(e);
    }
    for off in (0..len).step_by(PAGE as usize) {
        // SAFETY: `off` is below the mapping's length, so the byte is
        // inside the readable mapping; a volatile read keeps it from being
        // optimized away.
        unsafe { std::ptr::read_volatile(ptr.add(off)) };
    }
    Ok(())
}

/// Range `index` of the layout as a guest region over `mapping`.
fn map_region(
    mapping: vm_memory::MmapRegion,
    index: usize,
    r: &MemoryRange,
) -> Result<GuestRegionMmap, MemoryError> {
    // `check` ruled out wrapping, the only reason `new` refuses.
    GuestRegionMmap::new(mapping, GuestAddress(r.gpa)).ok_or(MemoryError::Layout(
        LayoutError::Wraps {
            index,
            gpa: r.gpa,
            size: r.size,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(ranges: &[(u64, u64)]) -> MemoryLayout {
        MemoryLayout {
            ranges: ranges
                .iter()
                .map(|&(gpa, size)| MemoryRange { gpa, size })
                .collect(),
        }
    }

    #[test]
    fn layout_rules() {
        assert_eq!(layout(&[(0, 8192), (1 << 32, 4096)]).check(), Ok(12288));
        assert_eq!(layout(&[]).check(), Err(LayoutError::Empty));
        for bad in [(0, 0), (0, 100), (12, 4096)] {
            assert!(matches!(
                layout(&[bad]).check(),
                Err(LayoutError::Misaligned { index: 0, .. })
            ));
        }
        assert!(matches!(
            layout(&[(8192, 4096), (4096, 4096)]).check(),
            Err(LayoutError::Unordered { index: 1, .. })
        ));
        assert!(matches!(
            layout(&[(0, 8192), (4096, 4096)]).check(),
            Err(LayoutError::Unordered { index: 1, .. })
        ));
        assert!(matches!(
            layout(&[(u64::MAX - 4095, 8192)]).check(),
            Err(LayoutError::Wraps { index: 0, .. })
        ));
        assert!(matches!(
            layout(&[(0, 4096), (u64::MAX - 4095, 4096), (0, 1 << 63)]).check(),
            Err(LayoutError::Wraps { index: 1, .. })
        ));
        let offsets: Vec<u64> = layout(&[(0, 8192), (1 << 32, 4096), (1 << 40, 4096)])
            .with_file_offsets()
            .map(|(_, o)| o)
            .collect();
        assert_eq!(offsets, [0, 8192, 12288]);
    }

    #[test]
    fn zero_detection() {
        let mut p = vec![0u8; 4096];
        assert!(is_zero(&p));
        p[4095] = 1;
        assert!(!is_zero(&p));
        p[4095] = 0;
        p[0] = 0x80;
        assert!(!is_zero(&p));
        assert!(!is_zero(&[0, 0, 1]));
    }

    /// How many pages of `memory` are resident (`mincore`).
    fn resident_pages(memory: &GuestMemoryMmap) -> usize {
        let mut n = 0;
        for r in memory.iter() {
            let len = r.len() as usize;
            let mut vec = vec![0u8; len.div_ceil(PAGE as usize)];
            // SAFETY: the range is a live page-aligned mapping owned by
            // `memory` (borrowed for the call), and `vec` has one byte per
            // page of it, as mincore writes.
            let rc = unsafe { libc::mincore(r.as_ptr().cast(), len, vec.as_mut_ptr()) };
            assert_eq!(rc, 0, "mincore: {}", io::Error::last_os_error());
            n += vec.iter().filter(|&&b| b & 1 != 0).count();
        }
        n
    }

    #[test]
    fn prefault_populates_every_page() {
        let l = layout(&[(0, 1 << 20), (1 << 32, 1 << 20)]);
        let pages = (2 << 20) / PAGE as usize;
        // An all-hole file: Copy touches nothing without prefault.
        let f = tempfile::tempfile().unwrap();
        f.set_len(2 << 20).unwrap();
        let m = restore(&f, &l, MemoryRestoreMode::Copy, false).unwrap();
        assert_eq!(resident_pages(&m), 0);
        let m = restore(&f, &l, MemoryRestoreMode::Copy, true).unwrap();
        assert_eq!(resident_pages(&m), pages);
        let m = restore(&f, &l, MemoryRestoreMode::CopyOnWrite, true).unwrap();
        assert_eq!(resident_pages(&m), pages);
    }

    /// A prefaulted CopyOnWrite restore maps the file's pages without
    /// copying them: a change to the file shows through the mapping (it
    /// would not through a copied page), and a guest write still copies.
    #[test]
    fn cow_prefault_shares_the_page_cache() {
        let l = layout(&[(0, 1 << 20)]);
        let f = tempfile::tempfile().unwrap();
        f.write_all_at(&vec![1u8; 1 << 20], 0).unwrap();
        let m = restore(&f, &l, MemoryRestoreMode::CopyOnWrite, true).unwrap();
        f.write_all_at(&[2u8; 8], 4096).unwrap();
        let mut b = [0u8; 8];
        m.read_slice(&mut b, GuestAddress(4096)).unwrap();
        assert_eq!(b, [2u8; 8], "the page was copied at the restore");
        m.write_slice(&[3u8; 8], GuestAddress(8192)).unwrap();
        let mut file_bytes = [0u8; 8];
        f.read_exact_at(&mut file_bytes, 8192).unwrap();
        assert_eq!(file_bytes, [1u8; 8], "a guest write reached the file");
    }

    #[test]
    fn on_demand_refused_and_size_checked() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(8192).unwrap();
        let l = layout(&[(0, 8192)]);
        let e = restore(&f, &l, MemoryRestoreMode::OnDemand, false).unwrap_err();
        assert!(matches!(e, MemoryError::OnDemandUnsupported), "{e}");
        assert!(e.to_string().contains("OnDemand"));
        f.set_len(4096).unwrap();
        let e = restore(&f, &l, MemoryRestoreMode::Copy, false).unwrap_err();
        assert!(
            matches!(
                e,
                MemoryError::FileSize {
                    actual: 4096,
                    expected: 8192
                }
            ),
            "{e}"
        );
    }
}
