//! Startup and VMA scale (issue 20, part 4): how long opening and mapping
//! an image takes, and how many VMAs its region needs, for 10^3 .. 10^6
//! allocated clusters, laid out in the file in the order of their virtual
//! clusters (what `pcow-img compact` makes) or scattered (what a guest that
//! writes in random order makes). What happens at and past
//! `vm.max_map_count` is reported as the error the open returns.
//!
//! Each image is written once through `pcow::Image::write_at` (one byte per
//! cluster, which allocates the whole cluster) and closed; the open is then
//! timed `ROUNDS` times, each a full `PcowRegion::open` (image and chain
//! opened, the region reserved, every cluster mapped, the monitor made)
//! followed by closing the region. Beside it, the baseline measured in the
//! same run: `mmap` of a raw file of the same virtual size (one VMA).
//!
//! Environment: `STARTUP_BENCH_DIR` (default `/dev/shm`),
//! `STARTUP_BENCH_COUNTS` (allocated clusters, default
//! `1000,10000,100000,1000000`), `STARTUP_BENCH_CLUSTER_KIB` (default 4),
//! `STARTUP_BENCH_ROUNDS` (default 5), `STARTUP_BENCH_LAYOUTS` (`order`,
//! `scattered` or both, the default), `STARTUP_BENCH_OUT` (a Markdown
//! table is written there as well as printed; default none).
//! Nothing here asserts a timing.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use pcow::{CreateOptions, Image};
use virtio_pmem_pcow::{PcowRegion, RegionOptions, WriteGate};

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
        "| allocated clusters | layout | image written (s) | file (MiB) | open + map p50 / max (ms) | raw mmap p50 (ms) | open / raw mmap | VMAs | outcome |"
    )?;
    writeln!(md, "|---:|---|---:|---:|---:|---:|---:|---:|---|")?;
    print!("{md}");
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
                    "| {count} | {layout} | {written:.1} | {file_mib:.0} | - | {raw_p50:.3} | - | - | {outcome} |"
                )
            } else {
                let max = times.iter().copied().fold(0.0, f64::max);
                let p50 = median(times);
                format!(
                    "| {count} | {layout} | {written:.1} | {file_mib:.0} | {p50:.1} / {max:.1} | {raw_p50:.3} | {:.0} | {vmas} | {outcome} |",
                    p50 / raw_p50.max(1e-6)
                )
            };
            println!("{row}");
            writeln!(md, "{row}")?;
        }
    }
    let _ = std::fs::remove_file(&img);
    let _ = std::fs::remove_file(&raw);
    if let Ok(out) = std::env::var("STARTUP_BENCH_OUT") {
        std::fs::write(&out, md)?;
        println!("written to {out}");
    }
    Ok(())
}
