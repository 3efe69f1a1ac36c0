//! Benchmarks of the pcow library, each measured side by side with its
//! baseline in the same run (these machines are shared and noisy, so only
//! the ratios mean much):
//!
//! - `open_scan`: `Image::open` (read-only: header, scan of every meta and
//!   snapshot cluster) of images with 10^3, 10^5 and 10^6 allocated 4 KiB
//!   clusters, vs reading the same file's bytes with `read(2)`.
//! - `alloc`: `write_at` of one 4 KiB page into each of 4096 fresh 64 KiB
//!   clusters, vs `pwrite(2)` of the same pages into a raw sparse file, and
//!   vs the same `pwrite`s into a raw file that grows by `fallocate(2)` of
//!   4 MiB at a time, as the pcow writer's pre-allocated pool does (this
//!   baseline pays for allocating whole clusters, so the difference to it is
//!   pcow's own bookkeeping).
//! - `barrier`: `flush` after those 4096 allocations (data sync, meta
//!   slots, sync, header, sync) vs `fdatasync(2)` of the raw file.
//!
//! Files live on tmpfs (`/dev/shm`) when it exists (it stands in for
//! persistent memory), otherwise in the temporary directory; set
//! `PCOW_BENCH_DIR` to choose. Run it with `scripts/bench.sh` or
//! `cargo bench -p pcow --bench open_scan`. After criterion's own report it
//! prints a table of medians and ratios. Under `cargo test --benches` every
//! benchmark runs once on the smallest image only.

use std::fs::{File, OpenOptions as FsOpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{black_box, BenchmarkId, Criterion, SamplingMode, Throughput};
use pcow::io::{FileStorage, Storage};
use pcow::{CreateOptions, Image, OpenOptions};

/// Cluster size of the open/scan images.
const SCAN_CLUSTER: u64 = 4096;
/// Cluster size of the allocation benchmark (the library's default).
const ALLOC_CLUSTER: u64 = pcow::DEFAULT_CLUSTER_SIZE;
/// Fresh clusters allocated per measured iteration.
const ALLOC_CLUSTERS: u64 = 4096;
const PAGE: usize = 4096;
/// Growth step of the pre-allocated raw baseline: the pcow writer's pool
/// size (4 MiB, private to the library).
const PREALLOC_STEP: u64 = 4 << 20;

fn bench_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PCOW_BENCH_DIR") {
        return PathBuf::from(d);
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// Creates an image with `clusters` allocated 4 KiB clusters: one byte
/// written into each, then closed (one barrier).
fn build_scan_image(path: &Path, clusters: u64) {
    let opts = CreateOptions {
        cluster_size: Some(SCAN_CLUSTER),
        virtual_size: Some(clusters * SCAN_CLUSTER),
        ..Default::default()
    };
    let mut img = Image::create(path, &opts).expect("creating the scan image");
    for i in 0..clusters {
        img.write_at(&[(i % 251) as u8 + 1], i * SCAN_CLUSTER)
            .expect("writing the scan image");
    }
    img.close().expect("closing the scan image");
    let img = Image::open(path, OpenOptions::read_only()).expect("reopening the scan image");
    assert_eq!(img.allocated_clusters(), clusters, "allocated clusters");
}

/// The baseline: every byte of the file through a 1 MiB buffer.
fn read_whole_file(path: &Path, buf: &mut [u8]) -> u64 {
    let mut f = File::open(path).expect("opening the file");
    let mut total = 0u64;
    loop {
        let n = f.read(buf).expect("reading the file");
        if n == 0 {
            return total;
        }
        total += n as u64;
    }
}

/// Removes the benchmark's files when dropped, also when a benchmark panics.
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for f in &self.0 {
            let _ = std::fs::remove_file(f);
        }
    }
}

fn bench_open_scan(c: &mut Criterion, dir: &Path, sizes: &[u64], made: &mut Cleanup) {
    let mut g = c.benchmark_group("open_scan");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let mut buf = vec![0u8; 1 << 20];
    for &n in sizes {
        let path = dir.join(format!("pcow-bench-scan-{}-{n}.pcow", std::process::id()));
        made.0.push(path.clone());
        let t = Instant::now();
        build_scan_image(&path, n);
        let len = std::fs::metadata(&path).expect("stat").len();
        eprintln!(
            "built {} ({n} clusters, {} MiB) in {:.1} s",
            path.display(),
            len >> 20,
            t.elapsed().as_secs_f64()
        );
        g.throughput(Throughput::Elements(n));
        g.bench_with_input(BenchmarkId::new("pcow_open", n), &path, |b, p| {
            b.iter(|| {
                let img = Image::open(p, OpenOptions::read_only()).expect("open");
                black_box(img.allocated_clusters());
            })
        });
        g.bench_with_input(BenchmarkId::new("read_file", n), &path, |b, p| {
            b.iter(|| black_box(read_whole_file(p, &mut buf)))
        });
    }
    g.finish();
}

/// What one allocation iteration measures.
#[derive(Clone, Copy)]
enum Phase {
    Writes,
    Barrier,
}

/// Allocates `ALLOC_CLUSTERS` fresh clusters in a new image; returns the
/// time spent in `phase`.
fn pcow_alloc_once(path: &Path, phase: Phase) -> Duration {
    let _ = std::fs::remove_file(path);
    let opts = CreateOptions {
        cluster_size: Some(ALLOC_CLUSTER),
        virtual_size: Some(ALLOC_CLUSTERS * ALLOC_CLUSTER),
        ..Default::default()
    };
    let mut img = Image::create(path, &opts).expect("create");
    let page = [0x5au8; PAGE];
    let t = Instant::now();
    for i in 0..ALLOC_CLUSTERS {
        img.write_at(&page, i * ALLOC_CLUSTER).expect("write_at");
    }
    let writes = t.elapsed();
    let t = Instant::now();
    img.flush().expect("flush");
    let barrier = t.elapsed();
    img.close().expect("close");
    match phase {
        Phase::Writes => writes,
        Phase::Barrier => barrier,
    }
}

/// The same pages written into a new raw sparse file of the same size.
fn raw_sparse_once(path: &Path, phase: Phase) -> Duration {
    let _ = std::fs::remove_file(path);
    let f = FsOpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .expect("create raw");
    f.set_len(ALLOC_CLUSTERS * ALLOC_CLUSTER).expect("set_len");
    let page = [0x5au8; PAGE];
    let t = Instant::now();
    for i in 0..ALLOC_CLUSTERS {
        f.write_all_at(&page, i * ALLOC_CLUSTER).expect("pwrite");
    }
    let writes = t.elapsed();
    let t = Instant::now();
    f.sync_data().expect("fdatasync");
    let barrier = t.elapsed();
    match phase {
        Phase::Writes => writes,
        Phase::Barrier => barrier,
    }
}

/// The same pages written into a new raw file that is grown by
/// `fallocate` of `PREALLOC_STEP` whenever a write would pass its end;
/// returns the time of the writes (allocation included).
fn raw_prealloc_once(path: &Path) -> Duration {
    let _ = std::fs::remove_file(path);
    let f = FsOpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .expect("create raw");
    let mut st = FileStorage::new(f);
    let page = [0x5au8; PAGE];
    let mut len = 0u64;
    let t = Instant::now();
    for i in 0..ALLOC_CLUSTERS {
        let off = i * ALLOC_CLUSTER;
        if off + PAGE as u64 > len {
            st.allocate(len, PREALLOC_STEP).expect("fallocate");
            len += PREALLOC_STEP;
        }
        st.write_at(&page, off).expect("pwrite");
    }
    t.elapsed()
}

fn bench_alloc(c: &mut Criterion, dir: &Path, made: &mut Cleanup) {
    let pid = std::process::id();
    let pcow_path = dir.join(format!("pcow-bench-alloc-{pid}.pcow"));
    let raw_path = dir.join(format!("pcow-bench-alloc-{pid}.raw"));
    let pre_path = dir.join(format!("pcow-bench-alloc-{pid}.prealloc.raw"));
    made.0.push(pcow_path.clone());
    made.0.push(raw_path.clone());
    made.0.push(pre_path.clone());
    for (group, phase) in [("alloc", Phase::Writes), ("barrier", Phase::Barrier)] {
        let mut g = c.benchmark_group(group);
        g.sampling_mode(SamplingMode::Flat)
            .sample_size(20)
            .warm_up_time(Duration::from_secs(1))
            // Each iteration also creates and fills the files (untimed
            // when only the barrier is measured): budget the wall time.
            .measurement_time(Duration::from_secs(6));
        if let Phase::Writes = phase {
            g.throughput(Throughput::Elements(ALLOC_CLUSTERS));
        }
        g.bench_function(BenchmarkId::new("pcow", ALLOC_CLUSTERS), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| pcow_alloc_once(&pcow_path, phase)).sum())
        });
        g.bench_function(BenchmarkId::new("raw", ALLOC_CLUSTERS), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| raw_sparse_once(&raw_path, phase)).sum())
        });
        if let Phase::Writes = phase {
            g.bench_function(BenchmarkId::new("raw_prealloc", ALLOC_CLUSTERS), |b| {
                b.iter_custom(|iters| (0..iters).map(|_| raw_prealloc_once(&pre_path)).sum())
            });
        }
        g.finish();
    }
}

/// Criterion's median estimate (ns per iteration) of one benchmark, read
/// from the `estimates.json` it saved.
fn median_ns(out: &Path, group: &str, function: &str, param: u64) -> Option<f64> {
    let p = out
        .join(group)
        .join(function)
        .join(param.to_string())
        .join("new/estimates.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p).ok()?).ok()?;
    v["median"]["point_estimate"].as_f64()
}

fn summary(out: &Path, sizes: &[u64]) {
    println!();
    println!("== pcow benchmark summary (criterion medians, same run) ==");
    println!();
    println!("open + scan (read-only Image::open) vs reading the file's bytes, 4 KiB clusters:");
    println!(
        "{:>10} {:>14} {:>14} {:>12}",
        "clusters", "pcow open ms", "read file ms", "pcow/read"
    );
    for &n in sizes {
        let (Some(p), Some(r)) = (
            median_ns(out, "open_scan", "pcow_open", n),
            median_ns(out, "open_scan", "read_file", n),
        ) else {
            println!("{n:>10} (no estimates: criterion did not measure it)");
            continue;
        };
        println!(
            "{n:>10} {:>14.3} {:>14.3} {:>12.3}",
            p / 1e6,
            r / 1e6,
            p / r
        );
    }
    println!();
    println!(
        "allocation: one 4 KiB write into each of {ALLOC_CLUSTERS} fresh {} KiB clusters:",
        ALLOC_CLUSTER >> 10
    );
    let k = ALLOC_CLUSTERS;
    match (
        median_ns(out, "alloc", "pcow", k),
        median_ns(out, "alloc", "raw", k),
        median_ns(out, "alloc", "raw_prealloc", k),
    ) {
        (Some(p), Some(r), Some(a)) => {
            let per_s = |ns: f64| k as f64 / (ns / 1e9);
            println!(
                "  pcow write_at:                {:>10.0} clusters/s",
                per_s(p)
            );
            println!(
                "  raw sparse pwrite:            {:>10.0} writes/s",
                per_s(r)
            );
            println!(
                "  raw pwrite, fallocate 4 MiB:  {:>10.0} writes/s",
                per_s(a)
            );
            println!("  ratio pcow/raw sparse throughput:     {:.3}", r / p);
            println!("  ratio pcow/raw fallocated throughput: {:.3}", a / p);
        }
        _ => println!("  (no estimates: criterion did not measure it)"),
    }
    match (
        median_ns(out, "barrier", "pcow", k),
        median_ns(out, "barrier", "raw", k),
    ) {
        (Some(p), Some(r)) => {
            println!("barrier after {k} new clusters:");
            println!("  pcow flush:     {:>10.3} ms", p / 1e6);
            println!("  raw fdatasync:  {:>10.3} ms", r / 1e6);
            println!("  ratio pcow/raw time: {:.1}", p / r);
        }
        _ => println!("barrier: (no estimates: criterion did not measure it)"),
    }
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    let dir = bench_dir();
    // Criterion's report goes to a private directory so that the summary
    // reads this run's estimates and nothing older.
    let out = tempfile::Builder::new()
        .prefix("pcow-bench-criterion-")
        .tempdir()
        .expect("creating the criterion output directory");
    let mut c = Criterion::default()
        .output_directory(out.path())
        .configure_from_args();
    let sizes: &[u64] = if bench_mode {
        &[1_000, 100_000, 1_000_000]
    } else {
        &[1_000]
    };
    eprintln!("benchmark files in {}", dir.display());
    let mut files = Cleanup(Vec::new());
    bench_open_scan(&mut c, &dir, sizes, &mut files);
    bench_alloc(&mut c, &dir, &mut files);
    c.final_summary();
    drop(files);
    if bench_mode {
        summary(out.path(), sizes);
    }
}
