//! Benchmarks of the pcow virtio-pmem region, each measured side by side
//! with its baseline in one run (the machines are shared and noisy: read
//! the ratios). Run through `scripts/bench-pmem.sh`; results are described
//! in `docs/pmem-benchmarks.md`.
//!
//! Host threads play the guest: they write the region through raw
//! pointers while the userfaultfd monitor runs on its own thread, polling
//! its fd as a VMM's epoll loop does. For every file system directory and
//! every cluster size:
//!
//! 1. expansion: the first 1-byte write into each hole cluster (shuffled
//!    order), with the device's default pool (refilled by its worker
//!    thread), with the pool refilled inside the fault that runs it dry,
//!    and with a pool pre-filled for the whole region (no worker),
//!    interleaved with the first touch of
//!    the same cluster of a raw sparse file mapped `MAP_SHARED` and with a
//!    bare userfaultfd handler (the mechanism's floor: map a reserved
//!    file cluster and wake, nothing else). These pcow variants run
//!    without expansion windows (`RegionOptions::expand_window` =
//!    `Some(0)`): like the bare handler, each hole costs its own write
//!    fault, so they measure the per-fault mechanism against its floor;
//!    1b. the same first writes into an image preallocated up front
//!    (`preallocation=falloc`: mapped shared whole, no fault to resolve);
//!    1c. the same first writes, in the same rotation, into a region with
//!    the device's defaults: the pool worker and the default expansion
//!    window (`DEFAULT_EXPAND_WINDOW`), where the second write fault in a
//!    window maps all its holes. Its samples are every cluster's first
//!    write like the others', most of them without a fault of the
//!    monitor's, and the fills in its p99; beside them the write faults
//!    it took, the clusters mapped ahead, and its samples split by what
//!    its monitor did for each write (its counters, read after each write
//!    outside the timing: a fault for one cluster, a fault that filled
//!    the window, no fault). Not run where a window is
//!    one cluster (2 MiB clusters: the defaults are the pool-worker
//!    variant there);
//! 2. steady state once every cluster is mapped: a first full write pass,
//!    1 MiB sequential copies over the whole region and 4 KiB random
//!    writes, pcow vs the raw mapping, and the region's VMA count;
//! 3. a live snapshot (its pause) and then copy-on-write: the first write
//!    into a snapshotted page as the writer sees it (never read / read
//!    first) vs a second write to the same, already private, page;
//! 4. the barrier with 0, 1, 100, 10^3 and 10^5 pending private pages
//!    (a top image over a raw base whose pages the "guest" has all read)
//!    vs `fdatasync` of the raw file after writing the same pages;
//!    4b. barriers after the guest read every page of an image of holes,
//!    with the default zero budget and with none;
//! 5. the barrier on a large sparse raw base (64 GiB by default) with 100
//!    pages written since the last barrier, before and after the guest
//!    read part of the base, beside its I/O floor (the same 100 page
//!    writes into fresh clusters and the two syncs, without pcow);
//! 6. `qemu-img bench` on qcow2 with the same 4 KiB write workloads
//!    (allocating, overwrite, overlay copy-on-write) and on raw.
//!
//! Environment: `PMEM_BENCH_DIRS` (`name=dir,...`, default
//! `tmpfs=/dev/shm,disk=/var/tmp`), `PMEM_BENCH_CLUSTERS` (KiB, default
//! `64,2048`), `PMEM_BENCH_REGION_MIB` (default 1024),
//! `PMEM_BENCH_LARGE_GIB` (default 64, 0 skips), `PMEM_BENCH_LARGE_READ_GIB`
//! (default 4), `PMEM_BENCH_OUT` (result files, default `pmem-bench` in the
//! current directory), `PMEM_BENCH_QEMU` (0 skips `qemu-img`),
//! `PMEM_BENCH_SMALL` (0 skips sections 1-4b, the ones on the small region),
//! `PMEM_BENCH_EXPANSION_ONLY` (1 runs sections 1, 1b and 1c only),
//! `PMEM_BENCH_WINDOW` (0 leaves out the variant of 1c: the others then
//! run without its pool worker beside them).
//! Nothing here asserts a timing.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use pcow::{BaseFormat, BaseRef, CreateOptions, Image};
use virtio_pmem_pcow::uffd;
use virtio_pmem_pcow::Uffd;
use virtio_pmem_pcow::{
    Monitor, PcowRegion, PoolOptions, RegionOptions, WriteGate, DEFAULT_EXPAND_WINDOW,
};

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

// ---------------------------------------------------------------- config

struct Config {
    dirs: Vec<(String, PathBuf)>,
    clusters: Vec<u64>,
    region: u64,
    large: u64,
    large_read: u64,
    out: PathBuf,
    qemu: bool,
    small: bool,
    expansion_only: bool,
    window: bool,
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v}: not a number")),
        Err(_) => default,
    }
}

impl Config {
    fn from_env() -> Config {
        let dirs = std::env::var("PMEM_BENCH_DIRS")
            .unwrap_or_else(|_| "tmpfs=/dev/shm,disk=/var/tmp".into())
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| match s.split_once('=') {
                Some((n, d)) => (n.to_string(), PathBuf::from(d)),
                None => (s.to_string(), PathBuf::from(s)),
            })
            .collect();
        let clusters = std::env::var("PMEM_BENCH_CLUSTERS")
            .unwrap_or_else(|_| "64,2048".into())
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.trim().parse::<u64>().expect("PMEM_BENCH_CLUSTERS: KiB") << 10)
            .collect();
        Config {
            dirs,
            clusters,
            region: env_u64("PMEM_BENCH_REGION_MIB", 1024) * MIB,
            large: env_u64("PMEM_BENCH_LARGE_GIB", 64) * GIB,
            large_read: env_u64("PMEM_BENCH_LARGE_READ_GIB", 4) * GIB,
            out: std::env::var_os("PMEM_BENCH_OUT")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("pmem-bench")),
            qemu: env_u64("PMEM_BENCH_QEMU", 1) != 0,
            small: env_u64("PMEM_BENCH_SMALL", 1) != 0,
            expansion_only: env_u64("PMEM_BENCH_EXPANSION_ONLY", 0) != 0,
            window: env_u64("PMEM_BENCH_WINDOW", 1) != 0,
        }
    }
}

// ---------------------------------------------------------------- stats

#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    n: usize,
    p50: f64,
    p99: f64,
    max: f64,
    mean: f64,
}

/// Nearest-rank percentiles of `v`.
fn stats(mut v: Vec<f64>) -> Stats {
    if v.is_empty() {
        return Stats::default();
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Stats {
        n: v.len(),
        p50: rank(0.50),
        p99: rank(0.99),
        max: v[v.len() - 1],
        mean: v.iter().sum::<f64>() / v.len() as f64,
    }
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn shuffled(&mut self, n: u64) -> Vec<u64> {
        let mut v: Vec<u64> = (0..n).collect();
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
        v
    }
}

fn size_name(b: u64) -> String {
    if b >= GIB && b.is_multiple_of(GIB) {
        format!("{} GiB", b / GIB)
    } else if b >= MIB && b.is_multiple_of(MIB) {
        format!("{} MiB", b / MIB)
    } else {
        format!("{} KiB", b >> 10)
    }
}

fn short_cs(cs: u64) -> String {
    if cs >= GIB {
        format!("{}G", cs / GIB)
    } else if cs >= MIB {
        format!("{}M", cs / MIB)
    } else {
        format!("{}K", cs >> 10)
    }
}

// ---------------------------------------------------------------- memory

/// A range of mapped memory the benchmark reaches through raw pointers
/// only (never through Rust references), bounds-checked on every access.
#[derive(Debug, Clone, Copy)]
struct Mem {
    base: usize,
    len: u64,
}

impl Mem {
    /// # Safety
    ///
    /// `[base, base + len)` must stay mapped readable and writable while
    /// the value (or a copy) is used, and no Rust reference may point into
    /// it meanwhile.
    unsafe fn new(base: *mut u8, len: u64) -> Mem {
        Mem {
            base: base as usize,
            len,
        }
    }

    fn write_byte(&self, off: u64, v: u8) {
        assert!(off < self.len);
        // SAFETY: in bounds of a range `new`'s contract keeps mapped and
        // writable; a volatile store so that the write really happens.
        unsafe { std::ptr::write_volatile((self.base + off as usize) as *mut u8, v) };
    }

    fn read_byte(&self, off: u64) -> u8 {
        assert!(off < self.len);
        // SAFETY: as in `write_byte`, reading.
        unsafe { std::ptr::read_volatile((self.base + off as usize) as *const u8) }
    }

    fn write(&self, off: u64, src: &[u8]) {
        assert!(off + src.len() as u64 <= self.len);
        // SAFETY: as in `write_byte`; `src` is a Rust buffer outside the
        // range (the range is never borrowed), so they do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                (self.base + off as usize) as *mut u8,
                src.len(),
            )
        };
    }
}

/// A raw file mapped `MAP_SHARED` (the upstream raw pmem baseline).
struct RawMap {
    file: File,
    addr: *mut libc::c_void,
    len: u64,
}

/// Creates (or empties) a file for reading and writing.
fn new_file(path: &Path) -> Res<File> {
    Ok(std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?)
}

impl RawMap {
    /// Creates a sparse file of `len` bytes and maps it.
    fn create(path: &Path, len: u64) -> Res<RawMap> {
        let file = new_file(path)?;
        file.set_len(len)?;
        // SAFETY: a new shared mapping of a file we own, at an address the
        // kernel picks; checked below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(RawMap { file, addr, len })
    }

    fn mem(&self) -> Mem {
        // SAFETY: the mapping lives as long as `self`, and every `Mem` made
        // here is used only while `self` lives (within this benchmark).
        unsafe { Mem::new(self.addr.cast(), self.len) }
    }

    fn fdatasync(&self) -> Res<()> {
        self.file.sync_data()?;
        Ok(())
    }
}

impl Drop for RawMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `create`; nothing uses it any more.
        unsafe { libc::munmap(self.addr, self.len as usize) };
    }
}

/// The floor of userfaultfd expansion on this machine: a handler thread
/// that does only what any expansion must (read the fault, map a file
/// cluster reserved beforehand over the faulting cluster, wake the writer)
/// and, like the monitor, keeps reading for 50 µs after each fault before
/// it sleeps in `poll`. No image, no pool, no lock: what pcow's expansion
/// costs beyond it is pcow's own.
struct BareHandler {
    addr: *mut libc::c_void,
    len: u64,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<u64, String>>>,
}

/// The bare handler's polling window (the monitor's default maximum).
const BARE_POLL: std::time::Duration = std::time::Duration::from_micros(50);

impl BareHandler {
    fn create(path: &Path, len: u64, cs: u64) -> Res<BareHandler> {
        let file = new_file(path)?;
        // Every cluster reserved up front, as a pre-filled pool is.
        // SAFETY: fallocate on an fd we own; no memory is passed.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a new anonymous reservation at an address the kernel
        // picks; checked below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        let mut bare = BareHandler {
            addr,
            len,
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
        };
        let fd = uffd::open(0).map_err(|e| format!("userfaultfd: {e:?}"))?;
        uffd::register(&fd, addr as u64, len, uffd::MODE_MISSING)?;
        let (base, stop) = (addr as u64, bare.stop.clone());
        bare.thread = Some(std::thread::spawn(move || {
            bare_loop(&fd, &file, base, cs, &stop)
        }));
        Ok(bare)
    }

    fn mem(&self) -> Mem {
        // SAFETY: the reservation lives as long as `self`, and every `Mem`
        // made here is used only while `self` lives (within this benchmark).
        unsafe { Mem::new(self.addr.cast(), self.len) }
    }

    /// Stops the handler; returns the faults it resolved.
    fn finish(mut self) -> Res<u64> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => Ok(r?),
            Some(Err(_)) => Err("the bare handler panicked".into()),
            None => Ok(0),
        }
    }
}

impl Drop for BareHandler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // SAFETY: the reservation made in `create`; its handler is gone
        // and nothing uses it any more.
        unsafe { libc::munmap(self.addr, self.len as usize) };
    }
}

fn bare_loop(
    fd: &std::os::fd::OwnedFd,
    file: &File,
    base: u64,
    cs: u64,
    stop: &AtomicBool,
) -> Result<u64, String> {
    let mut buf = [0u8; uffd::MSG_SIZE * 32];
    let mut faults = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the call.
        unsafe { libc::poll(&mut pfd, 1, 20) };
        let mut until = None;
        loop {
            // SAFETY: `buf` is writable for its whole length.
            let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                if until.is_none_or(|u| Instant::now() >= u) {
                    break;
                }
                std::hint::spin_loop();
                continue;
            }
            for m in buf[..n as usize].chunks_exact(uffd::MSG_SIZE) {
                if m[0] != uffd::EVENT_PAGEFAULT {
                    continue;
                }
                let mut w = [0u8; 8];
                w.copy_from_slice(&m[16..24]);
                let off = (u64::from_ne_bytes(w) - base) / cs * cs;
                // SAFETY: replaces one cluster of the reservation (owned by
                // the benchmark, which only writes it through raw pointers)
                // with the same range of the file, reserved and zero.
                let p = unsafe {
                    libc::mmap(
                        (base + off) as *mut libc::c_void,
                        cs as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED | libc::MAP_FIXED,
                        file.as_raw_fd(),
                        off as libc::off_t,
                    )
                };
                if p == libc::MAP_FAILED {
                    return Err(format!("mmap: {}", std::io::Error::last_os_error()));
                }
                let mut range = uffd::UffdioRange {
                    start: base + off,
                    len: cs,
                };
                // SAFETY: a valid `uffdio_range`; waking touches no memory.
                if unsafe { libc::ioctl(fd.as_raw_fd(), uffd::UFFDIO_WAKE as _, &mut range) } < 0 {
                    return Err(format!("UFFDIO_WAKE: {}", std::io::Error::last_os_error()));
                }
                faults += 1;
            }
            until = Some(Instant::now() + BARE_POLL);
        }
    }
    Ok(faults)
}

// ---------------------------------------------------------------- region

/// The monitor on its own thread, polling its fd like an epoll loop.
struct MonitorThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    /// Shared with the thread so that the benchmark can read its counters
    /// between two writes.
    monitor: Arc<Monitor>,
}

impl MonitorThread {
    fn spawn(monitor: Monitor) -> MonitorThread {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let monitor = Arc::new(monitor);
        let m = monitor.clone();
        let handle = std::thread::spawn(move || {
            let mut pfds: Vec<libc::pollfd> = m
                .fds()
                .into_iter()
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            while !s.load(Ordering::Relaxed) {
                // SAFETY: `pfds` is a valid array of pollfds for the call.
                let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 20) };
                if r <= 0 {
                    continue;
                }
                for p in pfds.iter_mut() {
                    if p.revents != 0 {
                        p.revents = 0;
                        if let Err(e) = m.handle_fd(p.fd) {
                            eprintln!("monitor: {e}");
                        }
                    }
                }
            }
        });
        MonitorThread {
            stop,
            handle: Some(handle),
            monitor,
        }
    }
}

/// A pcow region with its monitor thread. Nothing else writes while the
/// benchmark's own thread runs a barrier, so the gate is never entered.
struct Rig {
    region: PcowRegion,
    monitor: MonitorThread,
}

impl Rig {
    fn from_image(image: Image, opts: &RegionOptions, pool: &PoolOptions) -> Res<Rig> {
        let gate = Arc::new(WriteGate::new());
        let (region, monitor) = PcowRegion::from_image_with(image, gate, opts, pool)?;
        Ok(Rig {
            region,
            monitor: MonitorThread::spawn(monitor),
        })
    }

    fn mem(&self) -> Mem {
        // SAFETY: the region stays mapped while `self` lives (the rig is
        // closed only after its last use here) and is only reached through
        // raw pointers.
        unsafe { Mem::new(self.region.host_addr(), self.region.len()) }
    }

    fn vmas(&self) -> u64 {
        self.region.status().map(|s| s.vmas).unwrap_or(0)
    }

    /// Stops the monitor, then unmaps the region and closes the image.
    fn close(mut self) {
        self.monitor.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.monitor.handle.take() {
            let _ = h.join();
        }
        // The monitor (its last reference, the thread's is gone) after the
        // region: it keeps the address space reserved until then.
        drop(self.region);
        drop(self.monitor);
    }
}

fn create_image(path: &Path, cs: u64, size: Option<u64>, base: Option<&str>) -> Res<Image> {
    let _ = std::fs::remove_file(path);
    Ok(Image::create(
        path,
        &CreateOptions {
            cluster_size: Some(cs),
            virtual_size: size,
            base: base.map(|b| BaseRef {
                name: b.into(),
                format: BaseFormat::Raw,
            }),
        },
    )?)
}

/// How an expansion region gets its clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pool {
    /// The device's default (`default_pool_clusters`: a sixteenth of the
    /// device, at least 64 clusters), refilled by the worker thread.
    Worker,
    /// The same pool refilled inside the write fault that runs it dry.
    Inline,
    /// A pool holding a cluster for every hole before the first fault,
    /// without a worker.
    Prefilled,
    /// No holes: every cluster allocated up front
    /// (`Image::preallocate`, `preallocation=falloc`).
    Preallocated,
}

/// [`RegionOptions::expand_window`] of the variants that measure the
/// per-fault mechanism: off, so that every hole costs its own write fault
/// as it does in the bare handler they are compared with.
const NO_WINDOW: Option<u64> = Some(0);

/// An empty image of `size` mapped as a region, with expansion windows of
/// `window` bytes (`None`: the default).
fn fresh_region(path: &Path, cs: u64, size: u64, pool: Pool, window: Option<u64>) -> Res<Rig> {
    let mut img = create_image(path, cs, Some(size), None)?;
    let mut opts = RegionOptions {
        expand_window: window,
        ..RegionOptions::default()
    };
    if pool == Pool::Preallocated {
        img.preallocate(pcow::Preallocation::Falloc)?;
    }
    if pool == Pool::Prefilled {
        // Every data cluster and the meta clusters they need (one per
        // 2,046 data clusters at 64 KiB, fewer at larger sizes), so that
        // no fault has to grow the file.
        let n = size / cs + size / cs / 64 + 2;
        let mut live = pcow::LiveImage::new(img)?;
        live.set_pool_clusters(n);
        live.fill_pool()?;
        img = live.into_image();
        opts.pool_clusters = Some(n);
    }
    // A pre-filled pool already holds a cluster for every hole: a worker
    // would only refill what the faults take, a gigabyte of `fallocate`
    // running beside the other variants' turns, which is not what the
    // variant measures (and slows the others).
    let po = match pool {
        Pool::Inline | Pool::Prefilled => PoolOptions::inline(),
        _ => PoolOptions::default(),
    };
    Rig::from_image(img, &opts, &po)
}

// ---------------------------------------------------------------- report

/// The tables, the raw results and the plot data of one run.
#[derive(Default)]
struct Report {
    /// Section title -> (header, rows).
    tables: Vec<(String, String, Vec<String>)>,
    tsv: String,
    notes: Vec<String>,
    /// Plot data: case -> series -> value.
    latency: BTreeMap<String, BTreeMap<&'static str, f64>>,
    steady: BTreeMap<String, BTreeMap<&'static str, f64>>,
    barrier: BTreeMap<String, BTreeMap<String, f64>>,
    cases: Vec<String>,
    large: u64,
    large_read: u64,
}

impl Report {
    fn table(&mut self, title: &str, header: &str) {
        if !self.tables.iter().any(|(t, _, _)| t == title) {
            self.tables
                .push((title.to_string(), header.to_string(), Vec::new()));
        }
    }

    fn row(&mut self, title: &str, cells: &[String]) {
        let line = format!("| {} |", cells.join(" | "));
        println!("  {line}");
        let t = self
            .tables
            .iter_mut()
            .find(|(t, _, _)| t == title)
            .expect("table declared");
        t.2.push(line);
    }

    fn tsv(&mut self, section: &str, case: &str, what: &str, s: &Stats, unit: &str) {
        let _ = writeln!(
            self.tsv,
            "{section}\t{case}\t{what}\t{unit}\t{}\t{:.3}\t{:.3}\t{:.3}\t{:.3}",
            s.n, s.p50, s.p99, s.max, s.mean
        );
    }

    fn note(&mut self, n: String) {
        println!("  note: {n}");
        self.notes.push(n);
    }

    fn markdown(&self) -> String {
        let mut s = String::new();
        for (title, header, rows) in &self.tables {
            let cols = header.matches('|').count().saturating_sub(1);
            let _ = writeln!(s, "### {title}\n\n{header}");
            let _ = writeln!(s, "|{}", "---:|".repeat(cols));
            for r in rows {
                let _ = writeln!(s, "{r}");
            }
            s.push('\n');
        }
        if !self.notes.is_empty() {
            s.push_str("### Notes from the run\n\n");
            for n in &self.notes {
                let _ = writeln!(s, "- {n}");
            }
        }
        s
    }

    fn write_plot_data(&self, out: &Path) -> Res<()> {
        let f = |v: Option<&f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
        let mut lat = String::from("case");
        for s in LATENCY_SERIES {
            let _ = write!(lat, "\t{s}");
        }
        lat.push('\n');
        for c in &self.cases {
            let m = self.latency.get(c);
            let _ = write!(lat, "{c}");
            for s in LATENCY_SERIES {
                let _ = write!(lat, "\t{}", f(m.and_then(|m| m.get(s))));
            }
            lat.push('\n');
        }
        std::fs::write(out.join("plot-latency.dat"), lat)?;

        let mut st = String::from("case");
        for s in STEADY_SERIES {
            let _ = write!(st, "\t{s}");
        }
        st.push('\n');
        for c in &self.cases {
            let m = self.steady.get(c);
            let _ = write!(st, "{c}");
            for s in STEADY_SERIES {
                let _ = write!(st, "\t{}", f(m.and_then(|m| m.get(s))));
            }
            st.push('\n');
        }
        std::fs::write(out.join("plot-steady.dat"), st)?;

        // Rows: pending pages; columns: each case's barrier, then each
        // case's fdatasync.
        let mut b = String::from("pending");
        for c in &self.cases {
            let _ = write!(b, "\tbarrier_{c}");
        }
        for c in &self.cases {
            let _ = write!(b, "\tfdatasync_{c}");
        }
        b.push('\n');
        for (key, label) in BARRIER_ROWS {
            let label = label
                .replace("{large}", &short_cs(self.large))
                .replace("{read}", &short_cs(self.large_read));
            let _ = write!(b, "\"{label}\"");
            for c in &self.cases {
                let v = self
                    .barrier
                    .get(c)
                    .and_then(|m| m.get(&format!("barrier:{key}")));
                let _ = write!(b, "\t{}", f(v));
            }
            for c in &self.cases {
                let v = self
                    .barrier
                    .get(c)
                    .and_then(|m| m.get(&format!("sync:{key}")));
                let _ = write!(b, "\t{}", f(v));
            }
            b.push('\n');
        }
        std::fs::write(out.join("plot-barrier.dat"), b)?;
        Ok(())
    }
}

const LATENCY_SERIES: [&str; 12] = [
    "raw_first_touch",
    "pcow_expansion_worker",
    "pcow_expansion_inline",
    "pcow_expansion_prefilled",
    "pcow_cow_first_write",
    "pcow_cow_after_read",
    "pcow_private_write",
    "qcow2_allocating",
    "qcow2_overwrite",
    "qcow2_overlay_cow",
    "bare_uffd_expansion",
    "pcow_preallocated_first_write",
];

const STEADY_SERIES: [&str; 3] = ["seq_1MiB", "random_4KiB", "first_pass"];

const BARRIER_ROWS: [(&str, &str); 7] = [
    ("0", "0"),
    ("1", "1"),
    ("100", "100"),
    ("1000", "10^3"),
    ("100000", "10^5"),
    ("large-cold", "100 @{large}"),
    ("large-read", "100 @{large}, {read} read"),
];

/// Three significant digits (whole numbers from 100 up).
fn f1(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    if v >= 100.0 || v == 0.0 {
        return format!("{v:.0}");
    }
    let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.decimals$}")
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}", a / b)
    } else {
        "-".into()
    }
}

// ---------------------------------------------------------------- benches

struct Case {
    name: String,
    fs: String,
    dir: PathBuf,
    cs: u64,
    size: u64,
}

/// Clusters one variant expands in a row in the expansion benchmark.
const EXPANSION_RUN: usize = 64;

/// Expansion (1, 1b, 1c), steady state (2), snapshot and copy-on-write
/// (3); leaves the raw mapping (fully written) for the barrier's baseline.
fn expansion_steady_cow(c: &Case, rep: &mut Report, cfg: &Config) -> Res<RawMap> {
    let (cs, size) = (c.cs, c.size);
    let n = size / cs;
    println!(
        "\n[{}] expansion: {n} clusters of {} (1 byte each, shuffled order)",
        c.name,
        size_name(cs)
    );
    let raw = RawMap::create(&c.dir.join("raw.img"), size)?;
    // The variants compared with the bare handler run without expansion
    // windows: the bare handler maps the faulting cluster only, and so do
    // they (one write fault per cluster). A preallocated image has no hole
    // for a window to fill; it runs without, like the others.
    let rig_w = fresh_region(
        &c.dir.join("worker.pcow"),
        cs,
        size,
        Pool::Worker,
        NO_WINDOW,
    )?;
    let rig_i = fresh_region(
        &c.dir.join("inline.pcow"),
        cs,
        size,
        Pool::Inline,
        NO_WINDOW,
    )?;
    let rig_b = fresh_region(
        &c.dir.join("prefilled.pcow"),
        cs,
        size,
        Pool::Prefilled,
        NO_WINDOW,
    )?;
    let rig_p = fresh_region(
        &c.dir.join("prealloc.pcow"),
        cs,
        size,
        Pool::Preallocated,
        NO_WINDOW,
    )?;
    // The device's defaults as a VMM opens it: the pool worker and the
    // default expansion window. Where a window is one cluster (2 MiB
    // clusters) it is the pool-worker variant again: not run.
    let window_clusters = DEFAULT_EXPAND_WINDOW / cs;
    let rig_d = if !cfg.window {
        rep.note(format!(
            "{}: no expansion-window variant: PMEM_BENCH_WINDOW=0",
            c.name
        ));
        None
    } else if window_clusters > 1 {
        Some(fresh_region(
            &c.dir.join("window.pcow"),
            cs,
            size,
            Pool::Worker,
            None,
        )?)
    } else {
        rep.note(format!(
            "{}: no expansion-window variant: the default window ({}) is {} cluster here, \
             so the defaults are the pool-worker variant",
            c.name,
            size_name(DEFAULT_EXPAND_WINDOW),
            window_clusters.max(1)
        ));
        None
    };
    let bare = BareHandler::create(&c.dir.join("bare.img"), size, cs)?;
    // Let the worker fill its first pool, as it would before a guest runs.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let order = Rng(0x5eed ^ cs).shuffled(n);
    let (mr, mw, mi, mb, mx) = (raw.mem(), rig_w.mem(), rig_i.mem(), rig_b.mem(), bare.mem());
    let mp = rig_p.mem();
    let md = rig_d.as_ref().map(|r| (r.mem(), &*r.monitor.monitor));
    let (mut tr, mut tw, mut ti, mut tb, mut tx) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut tp, mut td) = (vec![], vec![]);
    // The window variant's samples by what its monitor did for the write:
    // 0 nothing (the cluster was mapped ahead), 1 a fault for the cluster
    // alone, 2 a fault that filled the window. Its counters are read after
    // each write (outside the timing): nothing else faults in its region.
    let mut kinds: Vec<usize> = Vec::new();
    let mut last = match md {
        Some((_, mon)) => mon.counters()?,
        None => Default::default(),
    };
    // Each variant writes a run of clusters in turn: the first writes of a
    // guest come in bursts (and the monitor's polling is made for them),
    // while the turns keep the variants side by side in time. The order
    // of the turns is shuffled for every run: a variant's work that
    // outlasts its turn (a pool worker's refill) lands on whichever turns
    // follow it, and a rotation would always give it the same successors.
    let mut turn_order = Rng(0x7e57 ^ cs);
    for run in order.chunks(EXPANSION_RUN) {
        let mut sides = vec![
            (mr, &mut tr, None),
            (mw, &mut tw, None),
            (mi, &mut ti, None),
            (mb, &mut tb, None),
            (mx, &mut tx, None),
            (mp, &mut tp, None),
        ];
        if let Some((m, mon)) = md {
            sides.push((m, &mut td, Some(mon)));
        }
        let perm = turn_order.shuffled(sides.len() as u64);
        let mut turns: Vec<_> = perm.into_iter().zip(sides).collect();
        turns.sort_by_key(|(place, _)| *place);
        for (_, (m, v, mon)) in turns {
            for &cl in run {
                let t = Instant::now();
                m.write_byte(cl * cs + 100, 7);
                v.push(us(t));
                if let Some(mon) = mon {
                    let now = mon.counters()?;
                    let faults = |f: &virtio_pmem_pcow::FaultCounters| {
                        f.write_faults + f.read_faults + f.fallbacks + f.wake_only
                    };
                    kinds.push(if now.clusters_ahead > last.clusters_ahead {
                        2
                    } else if faults(&now) > faults(&last) {
                        1
                    } else {
                        0
                    });
                    last = now;
                }
            }
        }
    }
    let bare_faults = bare.finish()?;
    let _ = std::fs::remove_file(c.dir.join("bare.img"));
    let (sr, sw, si, sb, sx) = (stats(tr), stats(tw), stats(ti), stats(tb), stats(tx));
    let mut by_kind: [Vec<f64>; 3] = Default::default();
    for (&t, &kind) in td.iter().zip(&kinds) {
        by_kind[kind].push(t);
    }
    let [k_ahead, k_one, k_fill] = by_kind.map(stats);
    let (sp, sd) = (stats(tp), stats(td));
    let stp = rig_p.region.status()?;
    let (vw, vi, vb) = (rig_w.vmas(), rig_i.vmas(), rig_b.vmas());
    let stw = rig_w.region.status()?;
    let title = "1. Expansion: first 1-byte write into a hole (µs per cluster)";
    rep.table(
        title,
        "| fs | cluster | samples | raw first touch p50 / p99 | bare userfaultfd handler p50 / p99 | pcow, pool worker (default pool), no window p50 / p99 | pcow, inline refill, no window p50 / p99 | pcow, pool pre-filled, no window p50 / p99 | pcow / bare handler (p50: default pool, pre-filled) | pcow / raw (p50, default pool) | VMAs after (default pool / inline / pre-filled) |",
    );
    rep.row(
        title,
        &[
            c.fs.clone(),
            short_cs(cs),
            n.to_string(),
            format!("{} / {}", f1(sr.p50), f1(sr.p99)),
            format!("{} / {}", f1(sx.p50), f1(sx.p99)),
            format!("**{}** / {}", f1(sw.p50), f1(sw.p99)),
            format!("{} / {}", f1(si.p50), f1(si.p99)),
            format!("{} / {}", f1(sb.p50), f1(sb.p99)),
            format!("{}, {}", ratio(sw.p50, sx.p50), ratio(sb.p50, sx.p50)),
            ratio(sw.p50, sr.p50),
            format!("{vw} / {vi} / {vb}"),
        ],
    );
    rep.tsv("expansion", &c.name, "raw_first_touch", &sr, "us");
    rep.tsv("expansion", &c.name, "pcow_worker", &sw, "us");
    rep.tsv("expansion", &c.name, "pcow_inline", &si, "us");
    rep.tsv("expansion", &c.name, "pcow_prefilled", &sb, "us");
    rep.tsv("expansion", &c.name, "bare_uffd_handler", &sx, "us");
    rep.tsv("expansion", &c.name, "pcow_preallocated", &sp, "us");
    // Every variant without a window took one write fault per cluster.
    for (what, rig) in [
        ("pool worker", &rig_w),
        ("inline refill", &rig_i),
        ("pre-filled pool", &rig_b),
    ] {
        let f = rig.region.status()?.faults;
        if f.write_faults + f.fallbacks != n || f.clusters_ahead != 0 {
            rep.note(format!(
                "{}: {what} without a window: {} write faults, {} fallbacks and {} clusters \
                 mapped ahead for {n} clusters (expected one fault per cluster)",
                c.name, f.write_faults, f.fallbacks, f.clusters_ahead
            ));
        }
    }
    let title_p = "1b. First write into a preallocated image (µs per cluster)";
    rep.table(
        title_p,
        "| fs | cluster | samples | raw first touch p50 / p99 | pcow, preallocated (falloc) p50 / p99 | pcow expansion (pool worker, no window) p50 | preallocated / raw (p50) | preallocated / expansion (p50) | faults taken (preallocated) |",
    );
    rep.row(
        title_p,
        &[
            c.fs.clone(),
            short_cs(cs),
            n.to_string(),
            format!("{} / {}", f1(sr.p50), f1(sr.p99)),
            format!("**{}** / {}", f1(sp.p50), f1(sp.p99)),
            f1(sw.p50),
            ratio(sp.p50, sr.p50),
            ratio(sp.p50, sw.p50),
            (stp.faults.write_faults + stp.faults.read_faults).to_string(),
        ],
    );
    let title_w = "1c. Expansion with the default expansion window beside the same pool without it (µs per cluster)";
    rep.table(
        title_w,
        "| fs | cluster | samples | bare userfaultfd handler p50 / p99 | pcow, pool worker, no window p50 / p99 | pcow, default (pool worker, expansion windows) p50 / p99 | windows / no window (p50, p99) | windows / bare handler (p50, p99) | mean: no window / windows | write faults: no window / windows | clusters mapped ahead (windows) | windows, samples: p50 / p99 by what the monitor did: a fault for one cluster; a fault that filled its window; no fault (mapped ahead) | VMAs after (no window / windows) |",
    );
    match &rig_d {
        Some(rig_d) => {
            let std = rig_d.region.status()?;
            let fd = std.faults;
            rep.row(
                title_w,
                &[
                    c.fs.clone(),
                    short_cs(cs),
                    n.to_string(),
                    format!("{} / {}", f1(sx.p50), f1(sx.p99)),
                    format!("{} / {}", f1(sw.p50), f1(sw.p99)),
                    format!("**{}** / {}", f1(sd.p50), f1(sd.p99)),
                    format!("{}, {}", ratio(sd.p50, sw.p50), ratio(sd.p99, sw.p99)),
                    format!("{}, {}", ratio(sd.p50, sx.p50), ratio(sd.p99, sx.p99)),
                    format!("{} / {}", f1(sw.mean), f1(sd.mean)),
                    format!("{} / {}", stw.faults.write_faults, fd.write_faults),
                    fd.clusters_ahead.to_string(),
                    [k_one, k_fill, k_ahead]
                        .iter()
                        .map(|k| format!("{}: {} / {}", k.n, f1(k.p50), f1(k.p99)))
                        .collect::<Vec<_>>()
                        .join("; "),
                    format!("{vw} / {}", std.vmas),
                ],
            );
            rep.tsv("expansion", &c.name, "pcow_worker_window", &sd, "us");
            rep.tsv("expansion", &c.name, "pcow_window_one", &k_one, "us");
            rep.tsv("expansion", &c.name, "pcow_window_fill", &k_fill, "us");
            rep.tsv("expansion", &c.name, "pcow_window_ahead", &k_ahead, "us");
            // Every cluster was mapped by its own fault, ahead of a
            // neighbour's, or got zeros (a fallback).
            if fd.write_faults + fd.clusters_ahead + fd.fallbacks != n {
                rep.note(format!(
                    "{}: with windows: {} write faults + {} clusters mapped ahead + {} fallbacks \
                     for {n} clusters",
                    c.name, fd.write_faults, fd.clusters_ahead, fd.fallbacks
                ));
            }
            rep.note(format!(
                "{}: expansion with windows ({window_clusters} clusters each) and the worker: \
                 {} write faults for {n} clusters, {} clusters mapped ahead ({} faults read by \
                 the monitor while it polled, {} fallbacks); pool: {} refills by the worker ({} \
                 stale pieces), {} faults that had to allocate inline, {} that waited for the \
                 worker's next piece, {} clusters at the end",
                c.name,
                fd.write_faults,
                fd.clusters_ahead,
                fd.polled,
                fd.fallbacks,
                std.pool.refills,
                std.pool.stale_refills,
                std.pool.inline_allocations,
                std.pool.piece_waits,
                std.pool.pool_clusters
            ));
        }
        None => rep.row(
            title_w,
            &[
                c.fs.clone(),
                short_cs(cs),
                n.to_string(),
                format!("{} / {}", f1(sx.p50), f1(sx.p99)),
                format!("{} / {}", f1(sw.p50), f1(sw.p99)),
                if cfg.window {
                    "- (a window is 1 cluster: the same as no window)".into()
                } else {
                    "- (not run: PMEM_BENCH_WINDOW=0)".into()
                },
                "-".into(),
                "-".into(),
                format!("{} / -", f1(sw.mean)),
                format!("{} / -", stw.faults.write_faults),
                "-".into(),
                "-".into(),
                format!("{vw} / -"),
            ],
        ),
    }
    if bare_faults != n {
        rep.note(format!(
            "{}: the bare handler resolved {bare_faults} faults for {n} clusters",
            c.name
        ));
    }
    rep.note(format!(
        "{}: expansion with the worker, no window: {} write faults ({} read by the monitor while \
         it polled), {} fallbacks; pool: {} refills by the worker ({} stale pieces), {} faults \
         that had to allocate inline, {} that waited for the worker's next piece, {} clusters at \
         the end",
        c.name,
        stw.faults.write_faults,
        stw.faults.polled,
        stw.faults.fallbacks,
        stw.pool.refills,
        stw.pool.stale_refills,
        stw.pool.inline_allocations,
        stw.pool.piece_waits,
        stw.pool.pool_clusters
    ));
    if let Some(rig_d) = rig_d {
        rig_d.close();
        let _ = std::fs::remove_file(c.dir.join("window.pcow"));
    }
    let lat = rep.latency.entry(c.name.clone()).or_default();
    lat.insert("raw_first_touch", sr.p50);
    lat.insert("pcow_expansion_worker", sw.p50);
    lat.insert("pcow_expansion_inline", si.p50);
    lat.insert("pcow_expansion_prefilled", sb.p50);
    lat.insert("bare_uffd_expansion", sx.p50);
    lat.insert("pcow_preallocated_first_write", sp.p50);
    rig_p.close();
    let _ = std::fs::remove_file(c.dir.join("prealloc.pcow"));
    rig_w.close();
    rig_i.close();
    let _ = std::fs::remove_file(c.dir.join("worker.pcow"));
    let _ = std::fs::remove_file(c.dir.join("inline.pcow"));
    if cfg.expansion_only {
        rig_b.close();
        let _ = std::fs::remove_file(c.dir.join("prefilled.pcow"));
        return Ok(raw);
    }

    // 2. Steady state over the mapped region.
    println!("[{}] steady state over {}", c.name, size_name(size));
    let chunk = vec![0x5au8; MIB as usize];
    let page = vec![0xa5u8; PAGE as usize];
    let pass = |m: Mem, times: &mut Vec<f64>| {
        let t0 = Instant::now();
        let mut off = 0;
        while off < size {
            let t = Instant::now();
            m.write(off, &chunk[..(size - off).min(MIB) as usize]);
            times.push(us(t));
            off += MIB;
        }
        t0.elapsed().as_secs_f64()
    };
    let mut scratch = Vec::new();
    let first_b = pass(mb, &mut scratch);
    let first_r = pass(mr, &mut scratch);
    // Rounds alternate which side goes first (caches, TLB and the page
    // allocator's state favour neither), and the ratio is the median of
    // the per-round ratios: the machines are shared and a round of one
    // side alone can be hit by a neighbour's burst.
    let rounds = 7;
    let writes = (size / PAGE).min(65536);
    let (mut seq_b, mut seq_r, mut rnd_b, mut rnd_r) = (vec![], vec![], vec![], vec![]);
    let (mut seq_tb, mut seq_tr, mut rnd_tb, mut rnd_tr) = (vec![], vec![], vec![], vec![]);
    for round in 0..rounds {
        let pcow_first = round % 2 == 0;
        if pcow_first {
            seq_tb.push(pass(mb, &mut seq_b));
            seq_tr.push(pass(mr, &mut seq_r));
        } else {
            seq_tr.push(pass(mr, &mut seq_r));
            seq_tb.push(pass(mb, &mut seq_b));
        }
        let offs: Vec<u64> = {
            let mut g = Rng(0xabc + round);
            (0..writes).map(|_| g.below(size / PAGE) * PAGE).collect()
        };
        let mut sides = [(mb, &mut rnd_b, &mut rnd_tb), (mr, &mut rnd_r, &mut rnd_tr)];
        if !pcow_first {
            sides.reverse();
        }
        for (m, lat, tot) in sides {
            let t0 = Instant::now();
            for &o in &offs {
                let t = Instant::now();
                m.write(o, &page);
                lat.push(us(t));
            }
            tot.push(t0.elapsed().as_secs_f64());
        }
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    // pcow/raw throughput per round (raw time / pcow time): median, min, max.
    let round_ratios = |b: &[f64], r: &[f64]| {
        let mut v: Vec<f64> = b.iter().zip(r).map(|(tb, tr)| tr / tb).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let q_seq = round_ratios(&seq_tb, &seq_tr);
    let q_rnd = round_ratios(&rnd_tb, &rnd_tr);
    let mibs = |secs: f64, bytes: u64| bytes as f64 / MIB as f64 / secs;
    let (sb_seq, sr_seq) = (mibs(med(seq_tb), size), mibs(med(seq_tr), size));
    let (sb_rnd, sr_rnd) = (
        mibs(med(rnd_tb), writes * PAGE),
        mibs(med(rnd_tr), writes * PAGE),
    );
    let (fb, fr) = (mibs(first_b, size), mibs(first_r, size));
    let (lb_seq, lr_seq, lb_rnd, lr_rnd) = (stats(seq_b), stats(seq_r), stats(rnd_b), stats(rnd_r));
    let vmas = rig_b.vmas();
    let title = "2. Steady state after mapping (MiB/s, median of 7 rounds; per-copy µs)";
    rep.table(
        title,
        "| fs | cluster | region VMAs | workload | pcow MiB/s | raw MiB/s | pcow / raw (median of the rounds' ratios) | rounds' ratios min - max | pcow p50 / p99 µs | raw p50 / p99 µs |",
    );
    for (what, b, r, q, lb, lr) in [
        (
            "1 MiB sequential copies",
            sb_seq,
            sr_seq,
            q_seq,
            lb_seq,
            lr_seq,
        ),
        (
            "4 KiB random writes",
            sb_rnd,
            sr_rnd,
            q_rnd,
            lb_rnd.to_owned(),
            lr_rnd.to_owned(),
        ),
    ] {
        rep.row(
            title,
            &[
                c.fs.clone(),
                short_cs(cs),
                vmas.to_string(),
                what.into(),
                format!("{b:.0}"),
                format!("{r:.0}"),
                format!("**{:.2}**", q.0),
                format!("{:.2} - {:.2}", q.1, q.2),
                format!("{} / {}", f1(lb.p50), f1(lb.p99)),
                format!("{} / {}", f1(lr.p50), f1(lr.p99)),
            ],
        );
    }
    rep.row(
        title,
        &[
            c.fs.clone(),
            short_cs(cs),
            vmas.to_string(),
            "first full write pass (page faults)".into(),
            format!("{fb:.0}"),
            format!("{fr:.0}"),
            ratio(fb, fr),
            "-".into(),
            "-".into(),
            "-".into(),
        ],
    );
    rep.tsv("steady", &c.name, "pcow_seq_1MiB", &lb_seq, "us");
    rep.tsv("steady", &c.name, "raw_seq_1MiB", &lr_seq, "us");
    rep.tsv("steady", &c.name, "pcow_random_4KiB", &lb_rnd, "us");
    rep.tsv("steady", &c.name, "raw_random_4KiB", &lr_rnd, "us");
    let st = rep.steady.entry(c.name.clone()).or_default();
    st.insert("seq_1MiB", q_seq.0);
    st.insert("random_4KiB", q_rnd.0);
    st.insert("first_pass", fb / fr);
    rep.latency
        .entry(c.name.clone())
        .or_default()
        .insert("pcow_private_write", lb_rnd.p50);

    // 3. Live snapshot, then copy-on-write.
    let t = Instant::now();
    rig_b.region.barrier()?;
    let settle = ms(t);
    let t = Instant::now();
    rig_b.region.snapshot_create("bench")?;
    let pause = ms(t);
    let vmas_after = rig_b.vmas();
    let pages = size / PAGE;
    let m = (pages / 4).min(8192);
    let pick = Rng(0xc0ffee ^ cs).shuffled(pages);
    let (cold, warm) = (&pick[..m as usize], &pick[m as usize..2 * m as usize]);
    let (mut t_cold, mut t_priv, mut t_warm) = (vec![], vec![], vec![]);
    for &p in cold {
        let off = p * PAGE + 17;
        let t = Instant::now();
        mb.write_byte(off, 1);
        t_cold.push(us(t));
        let t = Instant::now();
        mb.write_byte(off + 1, 2);
        t_priv.push(us(t));
    }
    for &p in warm {
        let off = p * PAGE + 17;
        std::hint::black_box(mb.read_byte(off));
        let t = Instant::now();
        mb.write_byte(off, 3);
        t_warm.push(us(t));
    }
    let (sc, sp, sw) = (stats(t_cold), stats(t_priv), stats(t_warm));
    let pending = rig_b.region.status()?.pending_private_pages;
    let title = "3. Copy-on-write: first write into a snapshotted page, as the writer sees it (µs)";
    rep.table(
        title,
        "| fs | cluster | samples | first write p50 / p99 | first write after a read p50 / p99 | already-private write p50 / p99 | first / private (p50) | live snapshot pause (ms) |",
    );
    rep.row(
        title,
        &[
            c.fs.clone(),
            short_cs(cs),
            m.to_string(),
            format!("**{}** / {}", f1(sc.p50), f1(sc.p99)),
            format!("{} / {}", f1(sw.p50), f1(sw.p99)),
            format!("{} / {}", f1(sp.p50), f1(sp.p99)),
            ratio(sc.p50, sp.p50),
            format!("{pause:.1}"),
        ],
    );
    rep.tsv("cow", &c.name, "first_write", &sc, "us");
    rep.tsv("cow", &c.name, "first_write_after_read", &sw, "us");
    rep.tsv("cow", &c.name, "private_write", &sp, "us");
    rep.note(format!(
        "{}: live snapshot demoted {n} clusters in {pause:.1} ms (VMAs {vmas} -> {vmas_after}), \
         after a barrier of the steady-state writes that took {settle:.1} ms; \
         {pending} private pages pending after the copy-on-write test",
        c.name
    ));
    let lat = rep.latency.entry(c.name.clone()).or_default();
    lat.insert("pcow_cow_first_write", sc.p50);
    lat.insert("pcow_cow_after_read", sw.p50);
    rig_b.close();
    let _ = std::fs::remove_file(c.dir.join("prefilled.pcow"));
    Ok(raw)
}

/// The barrier's own timing of its phases, p50 over rounds (ms).
#[derive(Default)]
struct Phases {
    scan: Vec<f64>,
    copy: Vec<f64>,
    commit: Vec<f64>,
    pages_copied: u64,
    tracked: bool,
}

impl Phases {
    fn add(&mut self, s: &virtio_pmem_pcow::BarrierStats) {
        self.scan.push(s.scan.as_secs_f64() * 1e3);
        self.copy.push(s.copy.as_secs_f64() * 1e3);
        self.commit.push(s.commit.as_secs_f64() * 1e3);
        self.pages_copied = s.pages_copied;
        self.tracked = s.tracked;
    }

    fn cell(&self) -> String {
        let p = |v: &Vec<f64>| f1(stats(v.clone()).p50);
        format!(
            "{} / {} / {}",
            p(&self.scan),
            p(&self.copy),
            p(&self.commit)
        )
    }
}

/// Writes one byte into each of `n` consecutive pages from `off`.
fn dirty_pages(m: Mem, off: u64, n: u64, v: u8) {
    for i in 0..n {
        m.write_byte(off + i * PAGE + 9, v);
    }
}

/// 4. The barrier with N pending private pages vs fdatasync.
fn barrier_pending(c: &Case, raw: &RawMap, rep: &mut Report) -> Res<()> {
    let (cs, size) = (c.cs, c.size);
    println!(
        "[{}] barrier over a {} top image on a raw base",
        c.name,
        size_name(size)
    );
    let base = c.dir.join("base.raw");
    let f = File::create(&base)?;
    f.set_len(size)?;
    drop(f);
    let top = c.dir.join("top.pcow");
    let img = create_image(&top, cs, None, Some("base.raw"))?;
    let rig = Rig::from_image(img, &RegionOptions::default(), &PoolOptions::default())?;
    let m = rig.mem();
    // The guest has read its whole disk: every page is mapped.
    let t = Instant::now();
    let mut x = 0u8;
    let mut off = 0;
    while off < size {
        x ^= m.read_byte(off);
        off += PAGE;
    }
    std::hint::black_box(x);
    let populate = ms(t);
    raw.fdatasync()?;
    let mr = raw.mem();
    let mut next = 0u64; // next unused cluster of the region
    let mut tracked = false;
    let title = "4. Barrier with N pending private pages vs fdatasync (ms)";
    rep.table(
        title,
        "| fs | cluster | pending pages | rounds | pcow barrier p50 / max | its scan / copy / commit (p50) | pages copied | fdatasync p50 / max | barrier / fdatasync (p50) |",
    );
    for (np, rounds) in [(0u64, 10u64), (1, 10), (100, 5), (1000, 5), (100_000, 2)] {
        let span = (np * PAGE).div_ceil(cs).max(1);
        let (mut tb, mut ts, mut ph) = (vec![], vec![], Phases::default());
        for r in 0..rounds {
            if np > 0 && (next + span) * cs > size {
                rep.note(format!(
                    "{}: {np} pending pages: region used up after {r} rounds",
                    c.name
                ));
                break;
            }
            dirty_pages(m, next * cs, np, r as u8 + 1);
            let t = Instant::now();
            let s = rig.region.barrier()?;
            tb.push(ms(t));
            ph.add(&s);
            if s.private_pages != np {
                rep.note(format!(
                    "{}: barrier found {} private pages, {np} written",
                    c.name, s.private_pages
                ));
            }
            if np > 0 {
                next += span;
            }
            dirty_pages(mr, ((r * 7919) % (size / PAGE / 2)) * PAGE, np, r as u8 + 1);
            let t = Instant::now();
            raw.fdatasync()?;
            ts.push(ms(t));
        }
        if tb.is_empty() {
            continue;
        }
        let (sb, ss) = (stats(tb), stats(ts));
        rep.row(
            title,
            &[
                c.fs.clone(),
                short_cs(cs),
                np.to_string(),
                sb.n.to_string(),
                format!("**{}** / {}", f1(sb.p50), f1(sb.max)),
                ph.cell(),
                ph.pages_copied.to_string(),
                format!("{} / {}", f1(ss.p50), f1(ss.max)),
                ratio(sb.p50, ss.p50),
            ],
        );
        rep.tsv("barrier", &c.name, &format!("pcow_{np}"), &sb, "ms");
        rep.tsv("barrier", &c.name, &format!("fdatasync_{np}"), &ss, "ms");
        tracked = ph.tracked;
        let e = rep.barrier.entry(c.name.clone()).or_default();
        e.insert(format!("barrier:{np}"), sb.p50);
        e.insert(format!("sync:{np}"), ss.p50);
        if np == 100 {
            e.insert("sync:large-cold".into(), ss.p50);
            e.insert("sync:large-read".into(), ss.p50);
        }
    }
    rep.note(format!(
        "{}: barrier region: {} over a sparse raw base, every page read first ({populate:.0} ms); \
         the pending pages are consecutive, fresh in every round; write tracking: {}",
        c.name,
        size_name(size),
        tracked
    ));
    rig.close();
    let _ = std::fs::remove_file(&top);
    let _ = std::fs::remove_file(&base);
    Ok(())
}

/// 5. The barrier on a large sparse base with 100 pages written.
fn barrier_large(c: &Case, large: u64, read: u64, rep: &mut Report) -> Res<()> {
    let cs = c.cs;
    println!(
        "[{}] barrier on a {} sparse raw base, 100 pages written",
        c.name,
        size_name(large)
    );
    let base = c.dir.join("large.raw");
    let f = File::create(&base)?;
    f.set_len(large)?;
    drop(f);
    let top = c.dir.join("large.pcow");
    let img = create_image(&top, cs, None, Some("large.raw"))?;
    let t = Instant::now();
    let rig = Rig::from_image(img, &RegionOptions::default(), &PoolOptions::default())?;
    let open = ms(t);
    let m = rig.mem();
    let clusters = large / cs;
    let mut g = Rng(0x1a46e ^ cs);
    let mut used = std::collections::HashSet::new();
    let mut round = |label: &str, rep: &mut Report| -> Res<(Stats, Phases)> {
        let mut times = Vec::new();
        let mut ph = Phases::default();
        for r in 0..3u8 {
            let mut k = 0;
            while k < 100 {
                let cl = g.below(clusters);
                if used.insert(cl) {
                    m.write_byte(cl * cs + g.below(cs / PAGE) * PAGE + 5, r + 1);
                    k += 1;
                }
            }
            let t = Instant::now();
            let s = rig.region.barrier()?;
            times.push(ms(t));
            ph.add(&s);
        }
        let s = stats(times);
        rep.tsv("barrier_large", &c.name, label, &s, "ms");
        Ok((s, ph))
    };
    let t = Instant::now();
    rig.region.barrier()?;
    let empty = ms(t);
    let (cold, ph_cold) = round("cold", rep)?;
    let read = read.min(large);
    let t = Instant::now();
    let mut x = 0u8;
    let mut off = 0;
    while off < read {
        x ^= m.read_byte(off);
        off += PAGE;
    }
    std::hint::black_box(x);
    let populate = ms(t);
    let (warm, ph_warm) = round("read", rep)?;
    let vmas = rig.vmas();
    let floor = fresh_write_floor(&c.dir.join("floor.img"), cs)?;
    rep.tsv("barrier_large", &c.name, "floor", &floor, "ms");
    let title =
        "5. Barrier on a large sparse base, 100 random pages written since the last barrier (ms)";
    rep.table(
        title,
        "| fs | cluster | base | region open (ms) | barrier, nothing pending | base not read: barrier p50 / max | its scan / copy / commit | I/O floor p50 / max | barrier / floor (p50) | after reading part of the base: barrier p50 / max | its scan / copy / commit | VMAs |",
    );
    rep.row(
        title,
        &[
            c.fs.clone(),
            short_cs(cs),
            size_name(large),
            format!("{open:.0}"),
            f1(empty),
            format!("**{}** / {}", f1(cold.p50), f1(cold.max)),
            ph_cold.cell(),
            format!("{} / {}", f1(floor.p50), f1(floor.max)),
            ratio(cold.p50, floor.p50),
            format!(
                "{} / {} ({} read in {populate:.0} ms)",
                f1(warm.p50),
                f1(warm.max),
                size_name(read)
            ),
            ph_warm.cell(),
            vmas.to_string(),
        ],
    );
    let e = rep.barrier.entry(c.name.clone()).or_default();
    e.insert("barrier:large-cold".into(), cold.p50);
    e.insert("barrier:large-read".into(), warm.p50);
    rig.close();
    let _ = std::fs::remove_file(&top);
    let _ = std::fs::remove_file(&base);
    Ok(())
}

/// The I/O any barrier of 100 copied pages needs, without pcow: the file
/// grows by 100 clusters, one page is written into each, `fdatasync`; then
/// one 4 KiB page is overwritten (the commit record), `fdatasync`. 3 rounds,
/// ms each. On a journaling file system the first sync carries the
/// allocation of 100 new blocks.
fn fresh_write_floor(path: &Path, cs: u64) -> Res<Stats> {
    use std::os::unix::fs::FileExt;
    let f = new_file(path)?;
    f.write_all_at(&[1u8; PAGE as usize], 0)?;
    f.sync_data()?;
    let mut g = Rng(0xf1007 ^ cs);
    let mut end = cs;
    let mut times = Vec::new();
    for r in 0..3u8 {
        let page = [r + 1; PAGE as usize];
        let t = Instant::now();
        for _ in 0..100 {
            f.set_len(end + cs)?;
            f.write_all_at(&page, end + g.below(cs / PAGE) * PAGE)?;
            end += cs;
        }
        f.sync_data()?;
        f.write_all_at(&page, 0)?;
        f.sync_data()?;
        times.push(ms(t));
    }
    drop(f);
    let _ = std::fs::remove_file(path);
    Ok(stats(times))
}

/// Runs `qemu-img bench` and returns µs per request.
fn qemu_bench(fmt: &str, path: &Path, cs: u64, count: u64) -> Res<f64> {
    let out = Command::new("qemu-img")
        .args(["bench", "-f", fmt, "-t", "writeback", "-w", "-s", "4096"])
        .args(["-S", &cs.to_string(), "-d", "1", "-c", &count.to_string()])
        .arg(path)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "qemu-img bench {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    // "Run completed in 1.234 seconds."
    let secs: f64 = text
        .split("Run completed in ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("unexpected qemu-img bench output: {text}"))?;
    Ok(secs * 1e6 / count as f64)
}

fn qemu_img(args: &[&str]) -> Res<()> {
    let out = Command::new("qemu-img").args(args).output()?;
    if !out.status.success() {
        return Err(format!(
            "qemu-img {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(())
}

/// 6. `qemu-img bench`: the I/O-path baseline.
fn qemu(c: &Case, rep: &mut Report) -> Res<()> {
    let (cs, size) = (c.cs, c.size);
    let count = size / cs;
    println!(
        "[{}] qemu-img bench, {count} x 4 KiB writes, one per {}",
        c.name,
        size_name(cs)
    );
    let q = c.dir.join("q.qcow2");
    let o = c.dir.join("o.qcow2");
    let r = c.dir.join("q.raw");
    let (qs, os, rs) = (
        q.to_string_lossy().to_string(),
        o.to_string_lossy().to_string(),
        r.to_string_lossy().to_string(),
    );
    let csz = cs.to_string();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &format!("cluster_size={csz}"),
        &qs,
        &size.to_string(),
    ])?;
    let alloc = qemu_bench("qcow2", &q, cs, count)?;
    let over = qemu_bench("qcow2", &q, cs, count)?;
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &format!("cluster_size={csz}"),
        "-b",
        &qs,
        "-F",
        "qcow2",
        &os,
    ])?;
    let overlay = qemu_bench("qcow2", &o, cs, count)?;
    let f = File::create(&r)?;
    f.set_len(size)?;
    drop(f);
    let raw_first = qemu_bench("raw", &r, cs, count)?;
    let raw_over = qemu_bench("raw", &r, cs, count)?;
    let _ = rs;
    let lat = rep.latency.entry(c.name.clone()).or_default();
    lat.insert("qcow2_allocating", alloc);
    lat.insert("qcow2_overwrite", over);
    lat.insert("qcow2_overlay_cow", overlay);
    let get = |k: &str| lat.get(k).copied().unwrap_or(f64::NAN);
    let (p_exp, p_cow, p_priv) = (
        get("pcow_expansion_worker"),
        get("pcow_cow_first_write"),
        get("pcow_private_write"),
    );
    let title = "6. The I/O-path baseline: `qemu-img bench` 4 KiB writes (µs per request, mean) vs the pcow region (p50)";
    rep.table(
        title,
        "| fs | cluster | requests | workload | qcow2 (qemu-img bench) | pcow region | qcow2 / pcow |",
    );
    for (what, qv, pv, pwhat) in [
        (
            "allocating (first write into a cluster)",
            alloc,
            p_exp,
            "expansion, 1 byte",
        ),
        (
            "overwrite (allocated cluster)",
            over,
            p_priv,
            "4 KiB write, mapped page",
        ),
        (
            "overlay copy-on-write (backing data)",
            overlay,
            p_cow,
            "first write into a snapshotted page",
        ),
    ] {
        rep.row(
            title,
            &[
                c.fs.clone(),
                short_cs(cs),
                count.to_string(),
                what.into(),
                f1(qv),
                format!("{} ({pwhat})", f1(pv)),
                ratio(qv, pv),
            ],
        );
    }
    rep.row(
        title,
        &[
            c.fs.clone(),
            short_cs(cs),
            count.to_string(),
            "raw file through the same block layer (first / second pass)".into(),
            format!("{} / {}", f1(raw_first), f1(raw_over)),
            "-".into(),
            "-".into(),
        ],
    );
    for (k, v) in [
        ("qcow2_allocating", alloc),
        ("qcow2_overwrite", over),
        ("qcow2_overlay_cow", overlay),
        ("raw_first", raw_first),
        ("raw_second", raw_over),
    ] {
        let s = Stats {
            n: count as usize,
            p50: f64::NAN,
            p99: f64::NAN,
            max: f64::NAN,
            mean: v,
        };
        rep.tsv("qemu_img_bench", &c.name, k, &s, "us");
    }
    for p in [&q, &o, &r] {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

/// Barriers after the "guest" read every page of an image of holes: with
/// the default zero budget (the first barrier returns the clusters to
/// holes) and with none (every barrier classifies every zero page).
fn barrier_after_hole_reads(c: &Case, rep: &mut Report) -> Res<()> {
    let cs = c.cs;
    println!(
        "[{}] barriers after reading {} of holes",
        c.name,
        size_name(c.size)
    );
    let mut cells = Vec::new();
    let mut read_ms = Vec::new();
    for budget in [None, Some(u64::MAX)] {
        let path = c.dir.join("holes.pcow");
        let img = create_image(&path, cs, Some(c.size), None)?;
        let opts = RegionOptions {
            zero_budget: budget,
            ..RegionOptions::default()
        };
        let rig = Rig::from_image(img, &opts, &PoolOptions::default())?;
        let m = rig.mem();
        rig.region.barrier()?;
        let t = Instant::now();
        let mut x = 0u8;
        let mut off = 0;
        while off < c.size {
            x ^= m.read_byte(off);
            off += PAGE;
        }
        std::hint::black_box(x);
        read_ms.push(ms(t));
        let t = Instant::now();
        let first = rig.region.barrier()?;
        let first_ms = ms(t);
        let mut later = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            rig.region.barrier()?;
            later.push(ms(t));
        }
        let later = stats(later);
        let label = if budget.is_none() {
            "budget"
        } else {
            "no_budget"
        };
        rep.tsv("barrier_holes", &c.name, label, &later, "ms");
        cells.push((first_ms, first.reholed, later));
        rig.close();
        let _ = std::fs::remove_file(&path);
    }
    let title = "4b. Barriers after the guest read every page of an image of holes (ms)";
    rep.table(
        title,
        "| fs | cluster | holes read | zero budget 256 MiB: first barrier (clusters returned to holes) | its later barriers p50 / max | no budget: first barrier | its later barriers p50 / max | later barriers, no budget / budget (p50) |",
    );
    let (b, nb) = (&cells[0], &cells[1]);
    rep.row(
        title,
        &[
            c.fs.clone(),
            short_cs(cs),
            format!("{} in {:.0} ms", size_name(c.size), read_ms[0]),
            format!("{} ({})", f1(b.0), b.1),
            format!("**{}** / {}", f1(b.2.p50), f1(b.2.max)),
            f1(nb.0),
            format!("{} / {}", f1(nb.2.p50), f1(nb.2.max)),
            ratio(nb.2.p50, b.2.p50),
        ],
    );
    Ok(())
}

fn run_case(cfg: &Config, c: &Case, rep: &mut Report) -> Res<()> {
    if cfg.small {
        let raw = expansion_steady_cow(c, rep, cfg)?;
        if !cfg.expansion_only {
            barrier_pending(c, &raw, rep)?;
            barrier_after_hole_reads(c, rep)?;
        }
        drop(raw);
        let _ = std::fs::remove_file(c.dir.join("raw.img"));
    }
    if cfg.expansion_only {
        return Ok(());
    }
    if cfg.large > 0 {
        barrier_large(c, cfg.large, cfg.large_read, rep)?;
    }
    if cfg.qemu {
        if let Err(e) = qemu(c, rep) {
            rep.note(format!("{}: qemu-img bench failed: {e}", c.name));
        }
    }
    Ok(())
}

/// The platform's cost of waking a sleeping thread: median round trip
/// (µs) of an eventfd ping-pong between two threads, either where the
/// scheduler puts them or both pinned to CPU 0. A userfaultfd fault is such
/// a round trip (the faulting thread wakes the monitor, the monitor wakes
/// it back), so it bounds expansion from below.
fn wake_round_trip(pinned: bool) -> Res<f64> {
    fn pin0() {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and
        // sched_setaffinity only touch that local set (0 = this thread).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(0, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
    fn efd() -> Res<i32> {
        // SAFETY: eventfd takes two integers and returns a new fd or -1.
        let fd = unsafe { libc::eventfd(0, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(fd)
    }
    fn post(fd: i32) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to our own fd.
        unsafe { libc::write(fd, one.as_ptr().cast(), 8) };
    }
    fn take(fd: i32) {
        let mut b = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local buffer.
        unsafe { libc::read(fd, b.as_mut_ptr().cast(), 8) };
    }
    const N: usize = 5000;
    let (ping, pong) = (efd()?, efd()?);
    let peer = std::thread::spawn(move || {
        if pinned {
            pin0();
        }
        for _ in 0..N {
            take(ping);
            post(pong);
        }
    });
    let mut v = Vec::with_capacity(N);
    std::thread::scope(|s| {
        s.spawn(|| {
            if pinned {
                pin0();
            }
            for _ in 0..N {
                let t = Instant::now();
                post(ping);
                take(pong);
                v.push(us(t));
            }
        });
    });
    let _ = peer.join();
    // SAFETY: both fds are ours and no longer used.
    unsafe {
        libc::close(ping);
        libc::close(pong);
    }
    Ok(stats(v).p50)
}

fn main() -> Res<()> {
    let cfg = Config::from_env();
    if let Err(e) = Uffd::new() {
        println!("SKIPPED: userfaultfd unavailable: {e}");
        return Ok(());
    }
    std::fs::create_dir_all(&cfg.out)?;
    let mut rep = Report {
        tsv: "section\tcase\tmetric\tunit\tn\tp50\tp99\tmax\tmean\n".into(),
        large: cfg.large,
        large_read: cfg.large_read.min(cfg.large),
        ..Report::default()
    };
    let (free, pinned) = (wake_round_trip(false)?, wake_round_trip(true)?);
    rep.note(format!(
        "platform: waking a sleeping thread and being woken back (eventfd ping-pong, \
         p50 round trip): {free:.1} µs between two threads the scheduler places, \
         {pinned:.1} µs with both on one CPU; every userfaultfd fault is such a round trip"
    ));
    let t0 = Instant::now();
    for (fs, dir) in &cfg.dirs {
        let work = dir.join(format!("pcow-pmem-bench.{}", std::process::id()));
        std::fs::create_dir_all(&work)?;
        for &cs in &cfg.clusters {
            let c = Case {
                name: format!("{fs}-{}", short_cs(cs)),
                fs: fs.clone(),
                dir: work.clone(),
                cs,
                size: cfg.region,
            };
            rep.cases.push(c.name.clone());
            let t = Instant::now();
            let r = run_case(&cfg, &c, &mut rep);
            println!("[{}] done in {:.1} s", c.name, t.elapsed().as_secs_f64());
            if let Err(e) = r {
                rep.note(format!("{}: failed: {e}", c.name));
                let _ = std::fs::remove_dir_all(&work);
                std::fs::create_dir_all(&work)?;
            }
        }
        let _ = std::fs::remove_dir_all(&work);
    }
    let md = rep.markdown();
    println!("\n{md}");
    println!("total {:.0} s", t0.elapsed().as_secs_f64());
    std::fs::write(cfg.out.join("tables.md"), &md)?;
    std::fs::write(cfg.out.join("results.tsv"), &rep.tsv)?;
    rep.write_plot_data(&cfg.out)?;
    Ok(())
}
