//! Faults and FLUSHes under contention: what a guest feels while barriers
//! sync, and what a FLUSH costs while other devices are busy. Run through
//! `scripts/bench-threads.sh`, which builds this file against the code
//! before and after a change and runs both in one go (read the ratios: the
//! machines are shared and noisy). Nothing here asserts a timing.
//!
//! Host threads play the guest. Writes that a barrier may harvest enter
//! the [`WriteGate`] (a barrier's hold keeps them out, as a pause keeps
//! vCPUs out of `KVM_RUN`). Accesses that fault (the first write or read
//! of a hole) do not: a vCPU blocked in a fault counts as paused (the
//! pause's signal takes it out of `KVM_RUN`), which a gate cannot model,
//! and they touch no page a barrier moves (a written hole becomes a shared
//! cluster; a read hole is never written here). Two ways to run the
//! devices' work:
//!
//! - `shared`: one thread serves every device's userfaultfd and pool fds
//!   and runs every FLUSH barrier (the VMM's control loop before issue 18);
//! - `per-device`: each device's monitor on its own [`MonitorThread`] and
//!   each device's FLUSHes on a thread of its own (the queue thread).
//!
//! Cells (images in `CONTENTION_DIR`, default `/var/tmp`: the disk):
//!
//! - `faults`: one device; a flusher dirties 256 pages of written clusters
//!   and runs a barrier, back to back, while a prober makes a first write
//!   into a fresh hole cluster, then a first read of another hole, every
//!   200 µs: latency p50/p99/max of each, and the same without barriers;
//! - `flush4`: four devices; on each a writer dirties fresh clusters and
//!   pages without pause; device 0 FLUSHes (dirty 256 pages, barrier) in a
//!   loop: the FLUSH's time p50/p99, and the write-fault latency on
//!   devices 1-3 meanwhile.
//!
//! Output: one line per measurement, `cell mode what p50_us p99_us max_us n`.
//! Environment: `CONTENTION_DIR`, `CONTENTION_SECS` (per cell and mode,
//! default 3), `CONTENTION_MODES` (default `shared,per-device`).

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pcow::{CreateOptions, Image};
use virtio_pmem_pcow::{Monitor, MonitorThread, PcowRegion, PoolOptions, RegionOptions, WriteGate};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

const PAGE: u64 = 4096;
const CLUSTER: u64 = 64 << 10;
/// Large enough that no cell runs out of fresh clusters (a few thousand a
/// second are taken).
const REGION: u64 = 4 << 30;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Shared,
    PerDevice,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Shared => "shared",
            Mode::PerDevice => "per-device",
        }
    }
}

struct Device {
    region: PcowRegion,
    monitor: Option<Arc<Monitor>>,
    base: usize,
    /// Next fresh cluster handed out.
    next: AtomicU64,
}

impl Device {
    fn open(dir: &Path, name: &str, gate: &Arc<WriteGate>) -> Res<Device> {
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        Image::create(
            &path,
            &CreateOptions {
                cluster_size: Some(CLUSTER),
                virtual_size: Some(REGION),
                base: None,
            },
        )?
        .close()?;
        let (region, monitor) = PcowRegion::open_with(
            &path,
            gate.clone(),
            &RegionOptions::default(),
            &PoolOptions::default(),
        )?;
        let base = region.host_addr() as usize;
        Ok(Device {
            region,
            monitor: Some(Arc::new(monitor)),
            base,
            next: AtomicU64::new(0),
        })
    }

    /// A cluster nobody touched yet.
    fn fresh(&self) -> Option<u64> {
        let c = self.next.fetch_add(1, Ordering::Relaxed);
        (c < REGION / CLUSTER).then_some(c)
    }

    fn write(&self, gate: &WriteGate, off: u64, v: u8) {
        let _in = gate.enter();
        self.poke(off, v);
    }

    /// A write outside the gate (see the module docs).
    fn poke(&self, off: u64, v: u8) {
        // SAFETY: `off` lies inside the live region (callers pass offsets
        // below REGION); the region is reached through raw pointers only.
        unsafe { std::ptr::write_volatile((self.base + off as usize) as *mut u8, v) };
    }

    /// A read outside the gate (see the module docs).
    fn peek(&self, off: u64) -> u8 {
        // SAFETY: as in `poke`.
        unsafe { std::ptr::read_volatile((self.base + off as usize) as *const u8) }
    }
}

/// Latencies in microseconds.
#[derive(Default)]
struct Samples(Vec<f64>);

impl Samples {
    fn line(&mut self, cell: &str, mode: Mode, what: &str) {
        let v = &mut self.0;
        v.sort_by(|a, b| a.total_cmp(b));
        let q = |p: f64| {
            if v.is_empty() {
                f64::NAN
            } else {
                v[((v.len() - 1) as f64 * p).round() as usize]
            }
        };
        println!(
            "{cell} {} {what} {:.1} {:.1} {:.1} {}",
            mode.name(),
            q(0.5),
            q(0.99),
            q(1.0),
            v.len()
        );
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// A FLUSH request to the thread that runs barriers.
#[derive(Default)]
struct FlushReq {
    pending: AtomicBool,
    done: Mutex<u64>,
    cv: std::sync::Condvar,
}

impl FlushReq {
    /// Asks for a barrier and waits for it.
    fn flush(&self) {
        let mut g = self.done.lock().unwrap();
        let want = *g + 1;
        self.pending.store(true, Ordering::Release);
        while *g < want {
            g = self.cv.wait(g).unwrap();
        }
    }

    fn serve(&self, region: &PcowRegion) {
        if self.pending.swap(false, Ordering::AcqRel) {
            if let Err(e) = region.barrier() {
                eprintln!("barrier: {e}");
            }
            *self.done.lock().unwrap() += 1;
            self.cv.notify_all();
        }
    }
}

/// How the devices' work is run; dropped at the end of a cell.
enum Runner {
    Shared {
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    },
    PerDevice {
        _monitors: Vec<MonitorThread>,
    },
}

impl Drop for Runner {
    fn drop(&mut self) {
        if let Runner::Shared { stop, thread } = self {
            stop.store(true, Ordering::Relaxed);
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// Starts the devices' monitors (and, in `shared` mode, the one thread
/// that also runs the barriers of `flush`).
fn start(mode: Mode, devs: &Arc<Vec<Device>>, flush: &Arc<FlushReq>) -> Res<Runner> {
    match mode {
        Mode::PerDevice => {
            let mut monitors = Vec::new();
            for (i, d) in devs.iter().enumerate() {
                let m = d.monitor.clone().ok_or("no monitor")?;
                monitors.push(MonitorThread::spawn(&format!("pmem{i}-fault"), m, |r| {
                    eprintln!("monitor: {r:?}")
                })?);
            }
            Ok(Runner::PerDevice {
                _monitors: monitors,
            })
        }
        Mode::Shared => {
            let epoll = Epoll::new()?;
            let mut fds = Vec::new();
            for (i, d) in devs.iter().enumerate() {
                for fd in d.monitor.as_ref().ok_or("no monitor")?.fds() {
                    epoll.ctl(
                        ControlOperation::Add,
                        fd,
                        EpollEvent::new(EventSet::IN, fds.len() as u64),
                    )?;
                    fds.push((i, fd));
                }
            }
            let stop = Arc::new(AtomicBool::new(false));
            let (s, devs, flush) = (stop.clone(), devs.clone(), flush.clone());
            let thread = std::thread::spawn(move || {
                let _keep = epoll.as_raw_fd();
                let mut events = vec![EpollEvent::default(); 16];
                while !s.load(Ordering::Relaxed) {
                    let n = epoll.wait(1, &mut events).unwrap_or(0);
                    for ev in &events[..n] {
                        let (i, fd) = fds[ev.data() as usize];
                        if let Some(m) = &devs[i].monitor {
                            if let Err(e) = m.handle_fd(fd) {
                                eprintln!("monitor: {e}");
                            }
                        }
                    }
                    flush.serve(&devs[0].region);
                }
            });
            Ok(Runner::Shared {
                stop,
                thread: Some(thread),
            })
        }
    }
}

/// Dirties 256 pages of the first `clusters` clusters of `d` (written
/// already), so that a barrier has data to sync.
fn dirty(d: &Device, gate: &WriteGate, clusters: u64, round: u64) {
    for k in 0..256u64 {
        let page = (k * 7919 + round * 104_729) % (clusters * CLUSTER / PAGE);
        d.write(gate, page * PAGE, (round + k) as u8);
    }
}

/// The flusher of device 0: dirty, FLUSH, until `stop`; returns each
/// FLUSH's time.
fn flusher(
    mode: Mode,
    devs: Arc<Vec<Device>>,
    gate: Arc<WriteGate>,
    flush: Arc<FlushReq>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Samples> {
    std::thread::spawn(move || {
        let d = &devs[0];
        let mut s = Samples::default();
        let mut round = 0;
        while !stop.load(Ordering::Relaxed) {
            dirty(d, &gate, 32, round);
            round += 1;
            let t = Instant::now();
            match mode {
                Mode::Shared => flush.flush(),
                Mode::PerDevice => {
                    if let Err(e) = d.region.barrier() {
                        eprintln!("barrier: {e}");
                    }
                }
            }
            s.0.push(us(t.elapsed()));
        }
        s
    })
}

fn open_devices(dir: &Path, n: usize, gate: &Arc<WriteGate>, tag: &str) -> Res<Arc<Vec<Device>>> {
    let mut devs = Vec::new();
    for i in 0..n {
        devs.push(Device::open(
            dir,
            &format!("contention-{tag}-{i}.pcow"),
            gate,
        )?);
    }
    Ok(Arc::new(devs))
}

fn cleanup(dir: &Path, n: usize, tag: &str) {
    for i in 0..n {
        let _ = std::fs::remove_file(dir.join(format!("contention-{tag}-{i}.pcow")));
    }
}

/// Cell `faults`.
fn faults(dir: &Path, mode: Mode, secs: Duration) -> Res<()> {
    let gate = Arc::new(WriteGate::new());
    let devs = open_devices(dir, 1, &gate, "faults")?;
    let flush = Arc::new(FlushReq::default());
    let runner = start(mode, &devs, &flush)?;
    let d = &devs[0];
    // The flusher's clusters: written (shared) before the clock starts.
    for _ in 0..32 {
        let c = d.fresh().ok_or("region full")?;
        d.write(&gate, c * CLUSTER, 1);
    }
    let probe = |with_barriers: bool| -> Res<(Samples, Samples)> {
        let stop = Arc::new(AtomicBool::new(false));
        let f = with_barriers.then(|| {
            flusher(
                mode,
                devs.clone(),
                gate.clone(),
                flush.clone(),
                stop.clone(),
            )
        });
        let (mut w, mut r) = (Samples::default(), Samples::default());
        let end = Instant::now() + secs;
        while Instant::now() < end {
            let (Some(a), Some(b)) = (d.fresh(), d.fresh()) else {
                break;
            };
            let t = Instant::now();
            d.poke(a * CLUSTER + 5, 7);
            w.0.push(us(t.elapsed()));
            let t = Instant::now();
            std::hint::black_box(d.peek(b * CLUSTER + 5));
            r.0.push(us(t.elapsed()));
            std::thread::sleep(Duration::from_micros(200));
        }
        stop.store(true, Ordering::Relaxed);
        if let Some(f) = f {
            let mut fl = f.join().map_err(|_| "flusher panicked")?;
            fl.line("faults", mode, "flush_us");
        }
        Ok((w, r))
    };
    let (mut w0, mut r0) = probe(false)?;
    w0.line("faults", mode, "write_fault_idle");
    r0.line("faults", mode, "read_fault_idle");
    // The idle phase's allocations are committed before the clock starts:
    // each barrier measured carries only what was written during its
    // phase.
    match mode {
        Mode::Shared => flush.flush(),
        Mode::PerDevice => d.region.barrier().map(drop)?,
    }
    let (mut w, mut r) = probe(true)?;
    w.line("faults", mode, "write_fault_during_barriers");
    r.line("faults", mode, "read_fault_during_barriers");
    drop(runner);
    drop(devs);
    cleanup(dir, 1, "faults");
    Ok(())
}

/// Cell `flush4`.
fn flush4(dir: &Path, mode: Mode, secs: Duration) -> Res<()> {
    let gate = Arc::new(WriteGate::new());
    let devs = open_devices(dir, 4, &gate, "flush4")?;
    let flush = Arc::new(FlushReq::default());
    let runner = start(mode, &devs, &flush)?;
    for _ in 0..32 {
        let c = devs[0].fresh().ok_or("region full")?;
        devs[0].write(&gate, c * CLUSTER, 1);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for i in 0..4 {
        let (devs, stop) = (devs.clone(), stop.clone());
        writers.push(std::thread::spawn(move || {
            let d = &devs[i];
            let mut faults = Samples::default();
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let Some(c) = d.fresh() else { break };
                let t = Instant::now();
                d.poke(c * CLUSTER + 9, 3);
                faults.0.push(us(t.elapsed()));
                // Some overwrites of what it wrote (shared now), then a
                // breath.
                for k in 0..16 {
                    d.poke(c * CLUSTER + k * PAGE, round as u8);
                }
                round += 1;
                std::thread::sleep(Duration::from_micros(100));
            }
            faults
        }));
    }
    let f = flusher(
        mode,
        devs.clone(),
        gate.clone(),
        flush.clone(),
        stop.clone(),
    );
    std::thread::sleep(secs);
    stop.store(true, Ordering::Relaxed);
    let mut fl = f.join().map_err(|_| "flusher panicked")?;
    fl.line("flush4", mode, "flush_dev0_us");
    let mut others = Samples::default();
    for (i, w) in writers.into_iter().enumerate() {
        let s = w.join().map_err(|_| "writer panicked")?;
        if i > 0 {
            others.0.extend(s.0);
        }
    }
    others.line("flush4", mode, "write_fault_dev1to3");
    drop(runner);
    drop(devs);
    cleanup(dir, 4, "flush4");
    Ok(())
}

fn main() -> Res<()> {
    // `cargo bench` passes `--bench`; nothing else is taken from argv.
    let dir = PathBuf::from(std::env::var("CONTENTION_DIR").unwrap_or_else(|_| "/var/tmp".into()));
    let secs = Duration::from_secs_f64(
        std::env::var("CONTENTION_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(3.0),
    );
    let modes: Vec<Mode> = std::env::var("CONTENTION_MODES")
        .unwrap_or_else(|_| "shared,per-device".into())
        .split(',')
        .filter_map(|m| match m {
            "shared" => Some(Mode::Shared),
            "per-device" => Some(Mode::PerDevice),
            _ => None,
        })
        .collect();
    println!(
        "# cell mode what p50_us p99_us max_us n   (dir {})",
        dir.display()
    );
    for &mode in &modes {
        faults(&dir, mode, secs)?;
        flush4(&dir, mode, secs)?;
    }
    Ok(())
}
