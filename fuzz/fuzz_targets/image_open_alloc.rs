//! Opening costs what the file stores: arbitrary bytes as an image file,
//! opened read-only (lenient, as `check` does, and strict) under a global
//! allocator that counts bytes; the open fails the target when the peak
//! of live heap bytes it added passes `ALLOC_FACTOR` times the input's
//! length plus `ALLOC_SLACK`.
//!
//! Each input is opened twice: as it is, and as a sparse file, its bytes
//! followed by a 1 TiB hole that reads as zeros ([`Sparse`]). The hole
//! stores nothing, so it must cost nothing: a header that claims billions
//! of clusters (which the hole makes "fit in the file") must not make the
//! open reserve memory for them (issue 19 found 51 GB reserved for an
//! 8 TiB sparse file). Both opens also run after `fix_crcs`, so the
//! fuzzer reaches the fields behind the checksums.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::fuzz_target;
use pcow::io::Storage;
use pcow::{Image, OpenOptions};
use pcow_fuzz::{fix_crcs, MemStorage};

/// Live heap bytes may grow by this many times the input's length...
const ALLOC_FACTOR: usize = 16;
/// ...plus this much, whatever the input: the scan's one-cluster buffer
/// (2 MiB at the largest clusters) and the walk's up-front reservation
/// (at most 65,536 entries with their bitmaps and map: about 4 MiB at
/// 4 KiB clusters, 8 MiB at 2 MiB).
const ALLOC_SLACK: usize = 16 << 20;
/// The hole after the bytes of a sparse input.
const HOLE: u64 = 1 << 40;

/// The image's name in errors; its directory does not exist.
const PATH: &str = "/nonexistent/pcow-fuzz/alloc.pcow";

/// Live heap bytes, and the highest they reached since the last reset.
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting.
struct Counting;

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` with the caller's own
// arguments, so `System`'s guarantees are this allocator's; the counters
// are only bookkeeping beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract, passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a block this allocator (that is,
        // `System`) returned, with its layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as in `dealloc`, and `new_size` is the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The input's bytes followed by a hole of [`HOLE`] bytes: a sparse file.
/// Read-only (the target opens nothing for writing).
struct Sparse(MemStorage, u64);

impl Storage for Sparse {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let stored = self.1;
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= stored + HOLE)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        // The stored part, then zeros.
        let split = (stored.clamp(offset, end) - offset) as usize;
        let (data, hole) = buf.split_at_mut(split);
        if !data.is_empty() {
            self.0.read_at(data, offset)?;
        }
        hole.fill(0);
        Ok(())
    }
    fn write_at(&mut self, _: &[u8], _: u64) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::PermissionDenied))
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.1 + HOLE)
    }
    fn set_len(&mut self, _: u64) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::PermissionDenied))
    }
    fn commit_io(&self) -> io::Result<Box<dyn pcow::io::CommitIo>> {
        Err(io::Error::from(io::ErrorKind::PermissionDenied))
    }
}

/// Opens `storage` and asserts what the open added to the heap, while the
/// image is still open, against the input's length.
fn open_bounded(storage: Box<dyn Storage>, input_len: usize, lenient: bool, what: &str) {
    let opts = OpenOptions {
        force_share: true,
        skip_base: true,
        lenient,
        ..OpenOptions::default()
    };
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let img = Image::open_storage(storage, PATH, opts);
    let added = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    let limit = ALLOC_FACTOR * input_len + ALLOC_SLACK;
    assert!(
        added <= limit,
        "opening {what} ({input_len} bytes, lenient {lenient}, {}) allocated {added} bytes at its peak, past {limit}",
        if img.is_ok() { "opened" } else { "refused" }
    );
    drop(img);
}

fn run(data: &[u8]) {
    for lenient in [true, false] {
        let s = MemStorage::new(data.to_vec());
        open_bounded(Box::new(s), data.len(), lenient, "the file");
        let s = Sparse(MemStorage::new(data.to_vec()), data.len() as u64);
        open_bounded(Box::new(s), data.len(), lenient, "the sparse file");
    }
}

fuzz_target!(|data: &[u8]| {
    run(data);
    let mut fixed = data.to_vec();
    fix_crcs(&mut fixed);
    if fixed != data {
        run(&fixed);
    }
});
