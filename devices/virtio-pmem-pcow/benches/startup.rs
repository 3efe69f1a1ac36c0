//! Startup and VMA scale (issue 20, part 4): how long opening and mapping
//! an image takes, and how many VMAs its region needs, for 10^3 .. 10^6
//! allocated clusters, laid out in the file in the order of their virtual
//! clusters (what `pcow-img compact` makes) or scattered (what a guest that
//! writes in random order makes). An image that needs more than half of
//! the mappings `vm.max_map_count` leaves the process gets its shortest
//! runs left unmapped at open (mapped at the first access); after the
//! timed opens, one more open is served by a monitor thread and one byte
//! of every cluster is read, timing those first accesses and counting how
//! they were resolved (mapped, or copied in past the limit).
//!
//! Each image is written once through `pcow::Image::write_at` (one byte per
//! cluster, which allocates the whole cluster) and closed; the open is then
//! timed `ROUNDS` times, each a full `PcowRegion::open` (image and chain
//! opened, the region reserved, every cluster mapped, the monitor made)
//! followed by closing the region. Beside it, the baseline measured in the
//! same run: `mmap` of a raw file of the same virtual size (one VMA).
//!
//! Then past the limit at run time (`STARTUP_BENCH_LIMIT_WRITES` clusters,
//! default 20,000; 0 skips it): a region of holes whose process has used
//! up `vm.max_map_count` but for `STARTUP_BENCH_LIMIT_SPARE` mappings
//! (default 3,072; a filler of single-page mappings made before the open
//! takes the rest),
//! written one byte per cluster in scattered order by a host thread
//! playing the guest. Each write is timed (a write that never
//! returned would hang the bench: that is the check for a hang), the
//! monitor's counters say how each fault was resolved, a barrier runs with
//! the filler still there, another after it is gone and the clusters
//! written again, and the image is read back after the region closed and
//! compared with what was written.
//!
//! Environment: `STARTUP_BENCH_DIR` (default `/dev/shm`),
//! `STARTUP_BENCH_COUNTS` (allocated clusters, default
//! `1000,10000,100000,1000000`), `STARTUP_BENCH_CLUSTER_KIB` (default 4),
//! `STARTUP_BENCH_ROUNDS` (default 5), `STARTUP_BENCH_LAYOUTS` (`order`,
//! `scattered` or both, the default), `STARTUP_BENCH_READS=0` (no read of
//! every cluster after the opens), `STARTUP_BENCH_OUT` (a Markdown
//! table is written there as well as printed; default none).
//! Nothing here asserts a timing.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use pcow::{CreateOptions, Image, OpenOptions};
use virtio_pmem_pcow::{
    max_map_count as map_limit, MonitorReport, MonitorThread, PcowRegion, Quiesce, RegionOptions,
    WriteGate,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn env_list(name: &str, default: &str) -> Res<Vec<u64>> {
    env_or(name, default)
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<u64>()
                .map_err(|e| format!("{name}: {s:?}: {e}").into())
        })
        .collect()
}

/// xorshift: a fixed, reproducible shuffle.
fn shuffled(n: u64, mut seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    for i in (1..v.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    v
}

fn max_map_count() -> String {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Writes an image of `count` virtual clusters, every one allocated, in
/// virtual order (each cluster follows the one before it in the file) or
/// shuffled (each lands at a file offset unrelated to its neighbours).
fn make_image(path: &Path, cs: u64, count: u64, scattered: bool) -> Res<f64> {
    let _ = std::fs::remove_file(path);
    let t = Instant::now();
    let mut img = Image::create(
        path,
        &CreateOptions {
            cluster_size: Some(cs),
            virtual_size: Some(count * cs),
            base: None,
        },
    )?;
    let order: Vec<u64> = if scattered {
        shuffled(count, 0x9e37_79b9_7f4a_7c15)
    } else {
        (0..count).collect()
    };
    for i in order {
        img.write_at(&[1], i * cs)?;
    }
    img.close()?;
    Ok(t.elapsed().as_secs_f64())
}

/// One open of the region: (milliseconds, VMAs), or the error's text.
fn open_once(path: &Path) -> Result<(f64, u64), String> {
    let t = Instant::now();
    let (region, monitor) =
        PcowRegion::open(path, Arc::new(WriteGate::new()), &RegionOptions::default())
            .map_err(|e| error_report::chain(&e))?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let vmas = region.status().map(|s| s.vmas).unwrap_or(0);
    drop(monitor);
    drop(region);
    Ok((ms, vmas))
}

/// One more open, served by a monitor thread, then one byte read from
/// each of the first `count` clusters (the guest's first access to every
/// cluster, deferred ones included), in order.
fn first_reads(path: &Path, cs: u64, count: u64) -> Res<FirstReads> {
    let (region, monitor) =
        PcowRegion::open(path, Arc::new(WriteGate::new()), &RegionOptions::default())?;
    let served = MonitorThread::spawn("startup-reads", Arc::new(monitor), |r| {
        if let MonitorReport::Failed(e) = r {
            eprintln!("monitor: {}", error_report::chain(&e));
        }
    })?;
    let deferred = region.status()?.deferred_at_open;
    let base = region.host_addr();
    let t = Instant::now();
    let mut x = 0u8;
    for vcn in 0..count.min(region.len() / cs) {
        // SAFETY: inside the mapped region; a read of a mapped page or a
        // fault the monitor serves has no other effect.
        x ^= unsafe { std::ptr::read_volatile(base.add((vcn * cs) as usize)) };
    }
    std::hint::black_box(x);
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let st = region.status()?;
    drop(served);
    drop(region);
    Ok(FirstReads {
        deferred,
        ms,
        mapped: st.faults.deferred_mapped,
        copied: st.faults.deferred_copied,
        ahead: st.faults.deferred_ahead,
        vmas: st.vmas,
    })
}

/// What [`first_reads`] measured.
struct FirstReads {
    /// Clusters deferred at open.
    deferred: u64,
    /// The read of every cluster, in ms.
    ms: f64,
    /// Deferred clusters mapped, copied in, and resolved ahead of a fault
    /// (of those mapped or copied).
    mapped: u64,
    copied: u64,
    ahead: u64,
    /// VMAs after the reads.
    vmas: u64,
}

/// The raw baseline: `mmap` of a sparse file of `len` bytes, in ms.
fn raw_map_ms(path: &Path, len: u64) -> Res<f64> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    f.set_len(len)?;
    let t = Instant::now();
    // SAFETY: a fresh shared mapping of a file we own, unmapped below
    // before the file is closed; nothing reads or writes through it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if p == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()).into());
    }
    // SAFETY: `p` is the mapping of `len` bytes made above.
    unsafe { libc::munmap(p, len as usize) };
    Ok(ms)
}

/// Uses up the process's mappings: every other page of a `PROT_NONE`
/// reservation made readable, one mapping each, until the kernel refuses
/// a split; then `spare` mappings are given back. Dropping it unmaps the
/// reservation.
struct VmaFiller {
    addr: *mut libc::c_void,
    len: usize,
    vmas: u64,
}

impl VmaFiller {
    fn fill(spare: u64) -> Res<VmaFiller> {
        const PAGE: usize = 4096;
        let pages = 2 * usize::try_from(map_limit()?)? + 2;
        let len = pages * PAGE;
        // SAFETY: a fresh anonymous reservation at an address the kernel
        // picks; nothing else uses it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(format!("filler: {}", std::io::Error::last_os_error()).into());
        }
        let mut f = VmaFiller { addr, len, vmas: 0 };
        let protect = |page: usize, prot: libc::c_int| {
            // SAFETY: `page` is inside the reservation made above, which
            // holds no data.
            unsafe { libc::mprotect(addr.cast::<u8>().add(page * PAGE).cast(), PAGE, prot) }
        };
        let mut last = None;
        for i in (1..pages).step_by(2) {
            if protect(i, libc::PROT_READ) != 0 {
                break;
            }
            f.vmas += 2;
            last = Some(i);
        }
        // Each page made inaccessible again merges with its neighbours:
        // two mappings back.
        let mut given = 0;
        while let (Some(i), true) = (last, given < spare) {
            if protect(i, libc::PROT_NONE) != 0 {
                break;
            }
            f.vmas -= 2;
            given += 2;
            last = i.checked_sub(2).filter(|&j| j >= 1);
        }
        Ok(f)
    }
}

impl Drop for VmaFiller {
    fn drop(&mut self) {
        // SAFETY: the reservation made in `fill`, unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// The process's mappings, counted through a buffer on the stack (a
/// process at its limit cannot allocate the whole text).
fn count_maps() -> Res<u64> {
    use std::io::Read;
    let mut f = std::fs::File::open("/proc/self/maps")?;
    let mut buf = [0u8; 16 << 10];
    let mut n = 0u64;
    loop {
        match f.read(&mut buf)? {
            0 => return Ok(n),
            k => n += buf[..k].iter().filter(|&&b| b == b'\n').count() as u64,
        }
    }
}

/// Past `vm.max_map_count` at run time; returns the report's lines.
fn at_the_limit(dir: &Path, cs: u64, writes: u64, spare: u64) -> Res<String> {
    let path = dir.join(format!("startup-limit-{}.pcow", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let n = 2 * writes + 2;
    Image::create(
        &path,
        &CreateOptions {
            cluster_size: Some(cs),
            virtual_size: Some(n * cs),
            base: None,
        },
    )?
    .close()?;
    // The rest of the process, there when the region opens.
    let filler = VmaFiller::fill(spare)?;
    let gate = Arc::new(WriteGate::new());
    let quiesce: Arc<dyn Quiesce> = gate.clone();
    let (region, monitor) = PcowRegion::open(&path, quiesce, &RegionOptions::default())?;
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let f = failures.clone();
    let served = MonitorThread::spawn("startup-limit", Arc::new(monitor), move |r| {
        if let MonitorReport::Failed(e) = r {
            if let Ok(mut v) = f.lock() {
                v.push(error_report::chain(&e));
            }
        }
    })?;
    let base = region.host_addr() as usize;
    // Odd clusters only, so that no two written clusters touch.
    let order: Vec<u64> = shuffled(writes, 0x2545_f491_4f6c_dd1d)
        .into_iter()
        .map(|i| 2 * i + 1)
        .collect();
    let write_pass = |value: u8, times: &mut Vec<f64>| {
        for &c in &order {
            let _in = gate.enter();
            let t = Instant::now();
            // SAFETY: cluster `c` lies inside the live region (c < n), which
            // only raw pointers reach; this thread is its only writer.
            unsafe { ((base as u64 + c * cs + 7) as *mut u8).write_volatile(value) };
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
    };
    let mut times = Vec::with_capacity(order.len());
    let before = region.status()?;
    let t = Instant::now();
    write_pass(1, &mut times);
    let writing_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let during = count_maps();
    let count_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let b1 = region.barrier();
    let b1_ms = t.elapsed().as_secs_f64() * 1e3;
    let filled = filler.vmas;
    drop(filler);
    let b1 = b1?;
    let during = during?;
    // Only now: reading /proc/self/maps needs memory that a process
    // without a free mapping cannot get. The barrier faulted nothing.
    let after_writes = region.status()?;
    let mut times2 = Vec::with_capacity(order.len());
    write_pass(2, &mut times2);
    let b2 = region.barrier()?;
    let end = region.status()?;
    drop(served);
    drop(region);
    let img = Image::open(&path, OpenOptions::read_only())?;
    let mut lost = 0u64;
    let mut byte = [0u8; 1];
    for &c in &order {
        img.read_at(&mut byte, c * cs + 7)?;
        lost += u64::from(byte[0] != 2);
    }
    drop(img);
    let _ = std::fs::remove_file(&path);
    let failures = failures.lock().map(|v| v.clone()).unwrap_or_default();
    let p = |v: &[f64], q: f64| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * q) as usize]
    };
    let fa = &after_writes.faults;
    let mut out = String::new();
    writeln!(
        out,
        "past the limit at run time: {writes} scattered 1-byte writes into holes of {} KiB clusters, \
         the process's mappings used up by a filler of {filled} but {spare} (vm.max_map_count {})",
        cs / 1024,
        max_map_count()
    )?;
    writeln!(
        out,
        "- writes: {writing_ms:.0} ms in all, per write p50 {:.1} us, p99 {:.1} us, max {:.1} ms; \
         faults: {} mapped from the image, {} fell back to zeros, {} read; region VMAs {} before, {} after the barrier; \
         process mappings after the writes {during} of {} (counted in {count_ms:.1} ms)",
        p(&times, 0.5),
        p(&times, 0.99),
        p(&times, 1.0) / 1e3,
        fa.write_faults - before.faults.write_faults,
        fa.fallbacks - before.faults.fallbacks,
        fa.read_faults - before.faults.read_faults,
        before.vmas,
        after_writes.vmas,
        max_map_count(),
    )?;
    writeln!(
        out,
        "- barrier with the filler in place: {b1_ms:.0} ms, {} pages copied into {} clusters, \
         {} remapped, {} remaps refused",
        b1.pages_copied, b1.clusters_copied, b1.clusters_remapped, b1.remap_failures
    )?;
    writeln!(
        out,
        "- filler gone, every cluster written again: writes p50 {:.1} us; barrier: {} pages copied, \
         {} clusters remapped, {} refused; region VMAs {}",
        p(&times2, 0.5),
        b2.pages_copied,
        b2.clusters_remapped,
        b2.remap_failures,
        end.vmas
    )?;
    writeln!(
        out,
        "- image read back after the close: {lost} of {writes} written bytes missing; monitor failures: {}",
        if failures.is_empty() {
            "none".to_string()
        } else {
            failures.join("; ")
        }
    )?;
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Res<()> {
    let dir = PathBuf::from(env_or("STARTUP_BENCH_DIR", "/dev/shm"));
    let counts = env_list("STARTUP_BENCH_COUNTS", "1000,10000,100000,1000000")?;
    let cs = env_list("STARTUP_BENCH_CLUSTER_KIB", "4")?
        .first()
        .copied()
        .unwrap_or(4)
        * 1024;
    let rounds = env_list("STARTUP_BENCH_ROUNDS", "5")?
        .first()
        .copied()
        .unwrap_or(5)
        .max(1);
    let layouts = env_or("STARTUP_BENCH_LAYOUTS", "order,scattered");
    let img = dir.join(format!("startup-bench-{}.pcow", std::process::id()));
    let raw = dir.join(format!("startup-bench-{}.raw", std::process::id()));
    let mut md = String::new();
    writeln!(
        md,
        "directory {}, cluster {} KiB, {rounds} opens each, vm.max_map_count {}",
        dir.display(),
        cs / 1024,
        max_map_count()
    )?;
    writeln!(md)?;
    writeln!(
        md,
        "| allocated clusters | layout | image written (s) | file (MiB) | open + map p50 / max (ms) | raw mmap p50 (ms) | open / raw mmap | VMAs | outcome | clusters left unmapped at open | then a read of every cluster in order (ms): deferred ones mapped / copied in (resolved ahead of a fault), VMAs after |"
    )?;
    writeln!(md, "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")?;
    print!("{md}");
    let first_read = env_or("STARTUP_BENCH_READS", "1") != "0";
    for &count in &counts {
        for scattered in [false, true] {
            if !layouts.contains(if scattered { "scattered" } else { "order" }) {
                continue;
            }
            let layout = if scattered { "scattered" } else { "in order" };
            let written = make_image(&img, cs, count, scattered)?;
            let file_mib = std::fs::metadata(&img)?.len() as f64 / (1 << 20) as f64;
            let mut times = Vec::new();
            let mut raw_times = Vec::new();
            let mut vmas = 0;
            let mut outcome = "mapped".to_string();
            for _ in 0..rounds {
                raw_times.push(raw_map_ms(&raw, count * cs)?);
                match open_once(&img) {
                    Ok((ms, v)) => {
                        times.push(ms);
                        vmas = v;
                    }
                    Err(e) => {
                        outcome = format!("refused: {e}");
                        break;
                    }
                }
            }
            let raw_p50 = median(raw_times);
            let row = if times.is_empty() {
                format!(
                    "| {count} | {layout} | {written:.1} | {file_mib:.0} | - | {raw_p50:.3} | - | - | {outcome} | - | - |"
                )
            } else {
                let max = times.iter().copied().fold(0.0, f64::max);
                let p50 = median(times);
                let reads = if first_read {
                    let r = first_reads(&img, cs, count)?;
                    format!(
                        "{} | {:.1}: {} / {} ({}), {}",
                        r.deferred, r.ms, r.mapped, r.copied, r.ahead, r.vmas
                    )
                } else {
                    "- | -".to_string()
                };
                format!(
                    "| {count} | {layout} | {written:.1} | {file_mib:.0} | {p50:.1} / {max:.1} | {raw_p50:.3} | {:.0} | {vmas} | {outcome} | {reads} |",
                    p50 / raw_p50.max(1e-6)
                )
            };
            println!("{row}");
            writeln!(md, "{row}")?;
        }
    }
    let _ = std::fs::remove_file(&img);
    let _ = std::fs::remove_file(&raw);
    let limit_writes = env_list("STARTUP_BENCH_LIMIT_WRITES", "20000")?
        .first()
        .copied()
        .unwrap_or(0);
    let spare = env_list("STARTUP_BENCH_LIMIT_SPARE", "3072")?
        .first()
        .copied()
        .unwrap_or(3072);
    // Filling a larger limit would take minutes and gigabytes of page
    // tables (some distributions set 1,048,576).
    let fillable = map_limit().is_ok_and(|m| m <= 4 << 20);
    if limit_writes > 0 && !fillable {
        let note = format!(
            "\npast the limit at run time: skipped, vm.max_map_count {} is above the 4194304 mappings it fills\n",
            max_map_count()
        );
        print!("{note}");
        md.push_str(&note);
    } else if limit_writes > 0 {
        let report = at_the_limit(&dir, cs, limit_writes, spare)?;
        print!("\n{report}");
        write!(md, "\n{report}")?;
    }
    if let Ok(out) = std::env::var("STARTUP_BENCH_OUT") {
        std::fs::write(&out, md)?;
        println!("written to {out}");
    }
    Ok(())
}
