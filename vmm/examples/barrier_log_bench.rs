//! Section 5b of `docs/pmem-benchmarks.md`: the barrier on a large sparse
//! base with 100 pages written by a guest on the host's KVM, found through
//! KVM's dirty log of the memslot against the page-table scan (no log),
//! next to the I/O floor of such a barrier, all in one run.
//!
//! For each file system (tmpfs `/dev/shm`, the disk `/var/tmp`) and
//! cluster size (64 KiB, 2 MiB): the I/O floor (as section 5: the file
//! grows by 100 clusters, a page written into each, `fdatasync`, a 4 KiB
//! commit record, `fdatasync`), then three VMs in turn (their order
//! rotates from cell to cell), each with a fresh pcow top image over a
//! sparse raw base of `PMEM_BENCH_LARGE_GIB` GiB (default 64) as its pmem
//! memslot: two registered with KVM's dirty log (barriers follow it), one
//! reading it from KVM's dirty ring (forced where KVM offers one), one
//! from the dirty bitmap, and one without (barriers scan). In 3 rounds the
//! test guest writes one byte into each
//! of 100 random pages in 100 distinct clusters and spins; then the
//! barrier is timed, pausing the running vCPU as a guest's FLUSH does
//! ("wait": until the vCPU is out of `KVM_RUN` and the state lock taken),
//! and the guest halts. Then host threads read the first
//! `PMEM_BENCH_LARGE_READ_GIB` GiB (default 4) of the region (what makes a
//! scan slow: present page-table entries), one barrier protects them (timed
//! apart), and 3 more rounds. The guest reaches only the first 4 GiB of
//! the region (its identity map ends at 8 GiB guest-physical), so the
//! random pages lie there; what a barrier costs does not depend on where.
//!
//! Run: `cargo run -p vmm --example barrier_log_bench` (the workspace's dev
//! profile is optimized). `PMEM_BENCH_CELLS=tmpfs-64K,disk-2M` runs only
//! those cells, `PMEM_BENCH_ONLY_LOG=1` only the two dirty-log variants. Without a usable `/dev/kvm` it prints SKIPPED.
//! Never asserts timings.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pcow::{BaseFormat, BaseRef, CreateOptions, Image};
use virtio_pmem_pcow::{BarrierStats, MonitorReport, MonitorThread, PcowRegion, RegionOptions};
use vmm::dirty_log::LogChoice;
use vmm::dirty_ring::DEFAULT_RING_BYTES;
use vmm::testguest::{Report, Step, TestGuest, TEST_PORT};
use vmm::vcpu::{self, PortIo, VcpuControl};
use vmm::vm::{Vm, VmConfig};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const PAGE: u64 = 4096;
const GIB: u64 = 1 << 30;
/// What the guest can reach of the region.
const REACH: u64 = 4 * GIB;

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The guest's reports, and the answer to its polls (non-zero: halt).
#[derive(Clone, Default)]
struct Port(Arc<Mutex<Vec<Report>>>, Arc<std::sync::atomic::AtomicU8>);

impl PortIo for Port {
    fn io_out(&mut self, port: u16, data: &[u8]) {
        if port == TEST_PORT && data.len() == 4 {
            let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Report::decode(v));
        }
    }

    fn io_in(&mut self, _port: u16, data: &mut [u8]) {
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = self.1.load(std::sync::atomic::Ordering::Relaxed);
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn p50_max(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() - 1])
}

/// A barrier's times, p50 over rounds: the total and its pieces
/// (`BarrierStats`).
#[derive(Default)]
struct Rounds {
    total: Vec<f64>,
    scan: Vec<f64>,
    copy: Vec<f64>,
    commit: Vec<f64>,
    held: Vec<f64>,
    stage: Vec<f64>,
    wait: Vec<f64>,
    publish: Vec<f64>,
    logged: usize,
    copied: u64,
}

impl Rounds {
    fn add(&mut self, t: Duration, s: &BarrierStats) {
        self.total.push(ms(t));
        self.scan.push(ms(s.scan));
        self.copy.push(ms(s.copy));
        self.commit.push(ms(s.commit));
        self.held.push(ms(s.held));
        self.stage.push(ms(s.stage));
        self.wait.push(ms(s.wait));
        self.publish.push(ms(s.publish));
        self.logged += usize::from(s.write_log);
        self.copied += s.pages_copied;
    }

    fn cell(&self) -> String {
        let (p, m) = p50_max(self.total.clone());
        format!("**{p:.2}** / {m:.2}")
    }

    fn split(&self) -> String {
        let p = |v: &Vec<f64>| p50_max(v.clone()).0;
        format!(
            "{:.3} / {:.3} / {:.3} / {:.3} / {:.3} / {:.3} / {:.3}",
            p(&self.wait),
            p(&self.scan),
            p(&self.copy),
            p(&self.stage),
            p(&self.held),
            p(&self.commit),
            p(&self.publish)
        )
    }
}

/// How a VM's barriers find the written pages.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// KVM's dirty ring (forced where KVM offers it: the guest writes 100
    /// pages a round, far below a ring's size, so even a KVM that
    /// overflows full rings keeps them).
    Ring,
    /// KVM's dirty bitmap.
    Bitmap,
    /// No log: the page-table scan.
    Scan,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Ring => "KVM dirty ring",
            Kind::Bitmap => "KVM dirty bitmap",
            Kind::Scan => "page-table scan",
        }
    }

    fn choice(self) -> LogChoice {
        match self {
            Kind::Ring => LogChoice::Ring(DEFAULT_RING_BYTES),
            Kind::Bitmap | Kind::Scan => LogChoice::Bitmap,
        }
    }
}

/// What one VM measured.
struct Variant {
    cold: Rounds,
    warm: Rounds,
    after_read: f64,
    read_ms: f64,
}

/// The I/O floor of a barrier of 100 pages in new clusters (section 5).
fn floor(path: &Path, cs: u64) -> Res<Vec<f64>> {
    let f = File::create(path)?;
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
        times.push(ms(t.elapsed()));
    }
    drop(f);
    std::fs::remove_file(path)?;
    Ok(times)
}

/// One VM on a fresh top image over `base`, its memslot logged or not.
fn variant(dir: &Path, cs: u64, large: u64, read: u64, kind: Kind) -> Res<Option<Variant>> {
    let logged = kind != Kind::Scan;
    let top = dir.join(if logged { "log.pcow" } else { "scan.pcow" });
    let _ = std::fs::remove_file(&top);
    Image::create(
        &top,
        &CreateOptions {
            cluster_size: Some(cs),
            virtual_size: Some(large),
            base: Some(BaseRef {
                name: "large.raw".into(),
                format: BaseFormat::Raw,
            }),
        },
    )?
    .close()?;
    let vm = Vm::new_with_log(&VmConfig { ram_size: 2 << 20 }, kind.choice())?;
    if kind == Kind::Ring && vm.dirty_rings().is_none() {
        println!("SKIPPED the dirty-ring variant: this KVM gives no dirty ring");
        return Ok(None);
    }
    let ctl = VcpuControl::new()?;
    let (region, monitor) = PcowRegion::open(&top, ctl.clone(), &RegionOptions::default())?;
    let monitor = MonitorThread::spawn("bench-fault", Arc::new(monitor), |r| {
        if let MonitorReport::Failed(e) = r {
            eprintln!("monitor: {}", error_report::chain(&e));
        }
    })?;
    let gpa = vm.next_region_gpa()?;
    let (host, len) = (region.host_addr(), region.len());
    let slot = if logged {
        // SAFETY: `slot` is dropped below before `monitor` and `region`,
        // which keep the range mapped.
        let slot = unsafe { vm.add_logged_region(gpa, host, len) }?;
        let Some(log) = slot.write_log() else {
            println!("SKIPPED the dirty-log variant: this KVM gives no dirty log");
            return Ok(None);
        };
        region.attach_write_log(Arc::new(log))?;
        slot
    } else {
        // SAFETY: as above.
        unsafe { vm.add_region(gpa, host, len) }?
    };
    // The first barrier after attaching the log scans once.
    region.barrier()?;
    let reach = len.min(REACH);
    let mut g = Rng(0x1a46e ^ cs ^ kind as u64);
    let mut used = std::collections::HashSet::new();
    let mut id = 0u8;
    let mut rounds = |rounds: &mut Rounds| -> Res<()> {
        for r in 0..3u8 {
            let mut steps = Vec::new();
            while steps.len() < 100 {
                let cl = g.below(reach / cs);
                if used.insert(cl) {
                    let off = cl * cs + g.below(cs / PAGE) * PAGE + 5;
                    steps.push(Step::write(gpa + off, 1, u64::from(r) + 1));
                }
            }
            // The guest keeps running after its writes (spinning, polling
            // the port), as a guest does when its FLUSH arrives: the
            // barrier pauses its vCPU ("wait").
            let guest = TestGuest {
                checks: steps,
                idle: Some(1000),
            };
            let loaded = guest.load(vm.memory(), gpa + reach)?;
            let cpu = vm.create_vcpu(id)?;
            id += 1;
            loaded.configure(&cpu)?;
            let port = Port::default();
            let t = vcpu::spawn(cpu, ctl.clone(), Box::new(port.clone()))?;
            let start = Instant::now();
            let done = || {
                let r = port.0.lock().unwrap_or_else(|e| e.into_inner());
                r.len() == 101 && matches!(r.last(), Some(Report::Done(100)))
            };
            while !done() && !t.is_finished() && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_micros(200));
            }
            if !done() {
                let reports = port.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
                return Err(format!("the guest did not finish its writes: {reports:?}").into());
            }
            let tb = Instant::now();
            let s = region.barrier();
            let took = tb.elapsed();
            port.1.store(1, std::sync::atomic::Ordering::Relaxed);
            t.join()?;
            rounds.add(took, &s?);
        }
        Ok(())
    };
    let mut cold = Rounds::default();
    rounds(&mut cold)?;
    let t = Instant::now();
    let mut x = 0u8;
    let mut off = 0;
    while off < read.min(len) {
        // SAFETY: `off` is inside the mapped region; a read of a private
        // file page (or a fault the monitor serves) has no other effect.
        x ^= unsafe { std::ptr::read_volatile(host.add(off as usize)) };
        off += PAGE;
    }
    std::hint::black_box(x);
    let read_ms = ms(t.elapsed());
    let t = Instant::now();
    region.barrier()?;
    let after_read = ms(t.elapsed());
    let mut warm = Rounds::default();
    rounds(&mut warm)?;
    drop(slot);
    drop(monitor);
    drop(region);
    std::fs::remove_file(&top)?;
    Ok(Some(Variant {
        cold,
        warm,
        after_read,
        read_ms,
    }))
}

/// What reading the dirty log of an empty slot costs (`KVM_GET_DIRTY_LOG`
/// and the walk of its bitmap, or the collection of the rings): for the
/// bitmap the part of a logged barrier that grows with the slot, not with
/// what was written. p50 and min of 20 reads, ms.
fn log_read_cost(gib: u64, kind: Kind) -> Res<(f64, f64)> {
    let vm = Vm::new_with_log(&VmConfig { ram_size: 2 << 20 }, kind.choice())?;
    if kind == Kind::Ring && vm.dirty_rings().is_none() {
        return Err("no dirty ring".into());
    }
    // A vCPU, so that there is a ring to read.
    let _cpu = vm.create_vcpu(0)?;
    let len = gib * GIB;
    // An anonymous reservation the guest never touches: only the slot's
    // size matters here.
    // SAFETY: a new private anonymous mapping, no fixed address: it
    // replaces nothing; unmapped below after the slot is gone.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().into());
    }
    let gpa = vm.next_region_gpa()?;
    // SAFETY: the mapping outlives the slot (dropped before the munmap).
    let slot = unsafe { vm.add_logged_region(gpa, p.cast(), len) };
    let r = (|| -> Res<(f64, f64)> {
        let slot = slot?;
        let log = slot.write_log().ok_or("no dirty log")?;
        let mut v = Vec::new();
        for _ in 0..20 {
            let t = Instant::now();
            log.take(&mut |_| {})?;
            v.push(ms(t.elapsed()));
        }
        v.sort_by(f64::total_cmp);
        Ok((v[v.len() / 2], v[0]))
    })();
    // SAFETY: the slot that pointed at it is deleted (dropped in the
    // closure); nothing else uses the mapping.
    unsafe { libc::munmap(p, len as usize) };
    r
}

fn env_gib(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
        * GIB
}

fn main() -> Res<()> {
    if let Err(e) = Vm::new(&VmConfig { ram_size: 2 << 20 }) {
        println!("SKIPPED: no usable /dev/kvm ({})", error_report::chain(&e));
        return Ok(());
    }
    let large = env_gib("PMEM_BENCH_LARGE_GIB", 64);
    let read = env_gib("PMEM_BENCH_LARGE_READ_GIB", 4);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load before: {}", load.trim());
    println!("| slot | reading the log, nothing written, p50 / min (ms): KVM dirty bitmap | KVM dirty ring (one vCPU) |");
    println!("|---:|---:|---:|");
    for gib in [1, 4, 16, 64] {
        if gib * GIB > large {
            break;
        }
        let cell = |kind| match log_read_cost(gib, kind) {
            Ok((p50, min)) => format!("{p50:.3} / {min:.3}"),
            Err(e) => e.to_string(),
        };
        println!(
            "| {gib} GiB | {} | {} |",
            cell(Kind::Bitmap),
            cell(Kind::Ring)
        );
    }
    println!();
    println!(
        "| fs | cluster | variant | base not read: barrier p50 / max | wait / scan / copy / stage / held / commit / publish | barriers on the log | after reading {} GiB: first barrier | then barrier p50 / max | wait / scan / copy / stage / held / commit / publish | I/O floor p50 / max | barrier / floor, not read / read (p50) |",
        read / GIB
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut cell = 0;
    // `PMEM_BENCH_CELLS=tmpfs-64K,disk-2M`: only those cells (iterating).
    let cells = std::env::var("PMEM_BENCH_CELLS").ok();
    let only_log = std::env::var_os("PMEM_BENCH_ONLY_LOG").is_some();
    for (fs, root) in [("tmpfs", "/dev/shm"), ("disk", "/var/tmp")] {
        for cs in [64u64 << 10, 2 << 20] {
            let name = format!("{fs}-{}", if cs == 64 << 10 { "64K" } else { "2M" });
            if cells
                .as_deref()
                .is_some_and(|c| !c.split(',').any(|c| c == name))
            {
                continue;
            }
            let dir = tempfile::Builder::new()
                .prefix("barrier-log-bench")
                .tempdir_in(root)?;
            let base = File::create(dir.path().join("large.raw"))?;
            base.set_len(large)?;
            drop(base);
            let fl = floor(&dir.path().join("floor.img"), cs)?;
            let (fp50, fmax) = p50_max(fl);
            // The variants' order rotates from cell to cell.
            let mut order = vec![Kind::Ring, Kind::Bitmap, Kind::Scan];
            order.rotate_left(cell % 3);
            cell += 1;
            let mut rows = Vec::new();
            for kind in order {
                if only_log && kind == Kind::Scan {
                    continue;
                }
                if let Some(v) = variant(dir.path(), cs, large, read, kind)? {
                    rows.push((kind, v));
                }
            }
            rows.sort_by_key(|r| r.0);
            for (kind, v) in rows {
                let cold = p50_max(v.cold.total.clone()).0;
                let warm = p50_max(v.warm.total.clone()).0;
                println!(
                    "| {fs} | {} | {} | {} | {} | {} of 6 | {:.1} ({:.0} ms to read) | {} | {} | {fp50:.2} / {fmax:.2} | {:.2} / {:.2} |",
                    if cs == 64 << 10 { "64K" } else { "2M" },
                    kind.name(),
                    v.cold.cell(),
                    v.cold.split(),
                    v.cold.logged + v.warm.logged,
                    v.after_read,
                    v.read_ms,
                    v.warm.cell(),
                    v.warm.split(),
                    cold / fp50,
                    warm / fp50,
                );
                if v.cold.copied + v.warm.copied != 600 {
                    println!(
                        "note: {} pages copied, not 600",
                        v.cold.copied + v.warm.copied
                    );
                }
            }
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load after: {}", load.trim());
    Ok(())
}
