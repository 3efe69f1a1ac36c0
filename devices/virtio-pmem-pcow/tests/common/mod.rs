//! Fixtures shared by the device's integration tests: the userfaultfd
//! check, the monitor served by the crate's own `MonitorThread`, guest reads and writes through raw pointers, and image
//! helpers. Each test binary uses part of them.
#![allow(dead_code)]

use std::path::Path;
use std::sync::{Arc, Mutex};

use pcow::{BaseFormat, BaseRef, CreateOptions, Image, OpenOptions};
use virtio_pmem_pcow::Uffd;
use virtio_pmem_pcow::{
    Monitor, MonitorReport, MonitorThread, PcowRegion, RegionError, RegionOptions, Status,
    WriteGate,
};

pub const K64: u64 = 64 << 10;
pub const PAGE: u64 = 4096;

/// Whether userfaultfd can be used here; prints why a test is skipped.
pub fn uffd_or_skip(test: &str) -> bool {
    match Uffd::new() {
        Ok(_) => true,
        Err(e) => {
            let mut msg = format!("SKIPPED {test}: userfaultfd unavailable: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg += &format!(": {s}");
                src = s.source();
            }
            // The project's machines have userfaultfd: there a skip would
            // hide a broken environment, so CI fails instead.
            assert!(std::env::var_os("CI").is_none(), "{msg} (under CI)");
            eprintln!("{msg}");
            false
        }
    }
}

/// The monitor served by the crate's own [`MonitorThread`] (the
/// production threading). A failure it reports fails the test when the
/// value is stopped or dropped.
pub struct Served {
    thread: Option<MonitorThread>,
    failures: Arc<Mutex<Vec<String>>>,
}

/// Serves `m` on a [`MonitorThread`].
pub fn serve(m: Monitor) -> Served {
    let failures = Arc::new(Mutex::new(Vec::new()));
    let f = failures.clone();
    let thread = MonitorThread::spawn("pcow-monitor-test", Arc::new(m), move |r| {
        if let MonitorReport::Failed(e) = r {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg += &format!(": {s}");
                src = s.source();
            }
            eprintln!("monitor failed: {msg}");
            f.lock().unwrap().push(msg);
        }
    })
    .expect("monitor thread");
    Served {
        thread: Some(thread),
        failures,
    }
}

impl Served {
    /// Stops and joins the thread; fails if the monitor reported a failure.
    pub fn stop(mut self) {
        self.finish();
    }

    fn finish(&mut self) {
        drop(self.thread.take());
        let failures = std::mem::take(&mut *self.failures.lock().unwrap());
        if !std::thread::panicking() {
            assert!(failures.is_empty(), "the monitor failed: {failures:?}");
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A guest write into the region.
pub fn gwrite(base: usize, len: u64, off: u64, data: &[u8]) {
    assert!(off + data.len() as u64 <= len);
    // SAFETY: in bounds of the live region; the test's writers use
    // disjoint bytes, and the region is only reached through raw pointers.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), (base + off as usize) as *mut u8, data.len())
    };
}

/// A guest read of the region.
pub fn gread(base: usize, len: u64, off: u64, n: usize) -> Vec<u8> {
    assert!(off + n as u64 <= len);
    let mut v = vec![0u8; n];
    // SAFETY: as in `gwrite`; nobody writes these bytes concurrently.
    unsafe { std::ptr::copy_nonoverlapping((base + off as usize) as *const u8, v.as_mut_ptr(), n) };
    // A read whose bytes nobody looks at is still a read of the region (a
    // fault that zero-maps a hole): keep the optimizer from dropping it.
    std::hint::black_box(v)
}

/// Compares two views; on a mismatch names the first differing offset.
#[track_caller]
pub fn same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
        panic!(
            "{what}: {n} bytes differ, first at {i:#x} (cluster {}): got {:?} want {:?}",
            i as u64 / K64,
            &got[i..(i + 8).min(got.len())],
            &want[i..(i + 8).min(want.len())]
        );
    }
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn create(path: &Path, size: u64, cs: u64, base: Option<&str>) -> Image {
    Image::create(
        path,
        &CreateOptions {
            cluster_size: Some(cs),
            virtual_size: Some(size),
            base: base.map(|b| BaseRef {
                name: b.into(),
                format: BaseFormat::Probe,
            }),
        },
    )
    .expect("create")
}

/// Opens the image at `path` read-only beside its writer (ignoring the
/// writer's lock), as `pcow-img -U` would.
pub fn open_forced(path: &Path) -> Image {
    Image::open(
        path,
        OpenOptions {
            force_share: true,
            ..OpenOptions::read_only()
        },
    )
    .expect("open the image beside its writer")
}

/// The whole guest view of the image at `path` as a reader beside its
/// writer sees it now.
pub fn view_forced(path: &Path) -> Vec<u8> {
    let img = open_forced(path);
    let mut v = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut v, 0).expect("read");
    v
}

/// `pcow-img check` finds the closed image at `path` clean.
#[track_caller]
pub fn check_clean(path: &Path) {
    let r = pcow::check::check(path, None, false).expect("check");
    assert!(r.is_clean(), "{}: check: {r:?}", path.display());
}

/// `threads` writers started together: writer `t` writes the byte `t + 1`
/// at `c * K64 + t * PAGE + t` of every cluster `c` below `clusters` of
/// the region at `base` (`len` bytes), in the order `(i * step + t * skew)
/// % clusters`, so every cluster is faulted by every writer, in different
/// orders. Returns when all are done.
pub fn race_writers(base: usize, len: u64, threads: u64, clusters: u64, step: u64, skew: u64) {
    let start = Arc::new(std::sync::Barrier::new(threads as usize));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let start = start.clone();
            std::thread::spawn(move || {
                start.wait();
                for i in 0..clusters {
                    let c = (i * step + t * skew) % clusters;
                    gwrite(base, len, c * K64 + t * PAGE + t, &[t as u8 + 1]);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a racing writer panicked");
    }
}

/// `view` holds every byte [`race_writers`] wrote.
#[track_caller]
pub fn check_raced(view: &[u8], threads: u64, clusters: u64) {
    for c in 0..clusters {
        for t in 0..threads {
            assert_eq!(
                view[(c * K64 + t * PAGE + t) as usize],
                t as u8 + 1,
                "cluster {c}, writer {t}"
            );
        }
    }
}

/// Options under which each write fault in a hole maps its own cluster
/// only (no expansion window): for tests that count faults or mappings
/// per cluster written.
pub fn one_cluster_per_fault() -> RegionOptions {
    RegionOptions {
        expand_window: Some(0),
        ..RegionOptions::default()
    }
}

/// Waits until `region`'s pool is full (the worker's refill was taken),
/// at most 10 s; returns the status that showed it.
pub fn wait_pool_full(region: &PcowRegion) -> Status {
    let t = std::time::Instant::now();
    loop {
        let st = region.status().expect("status");
        if !st.pool.in_flight && st.pool.free_clusters == st.pool.pool_clusters {
            return st;
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "the pool never filled: {:?}",
            st.pool
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// A region, its monitor thread and the gate the "guest" writes through.
pub struct Rig {
    pub region: PcowRegion,
    pub monitor: Served,
    pub gate: Arc<WriteGate>,
}

impl Rig {
    pub fn open(path: &Path, opts: &RegionOptions) -> Result<Rig, RegionError> {
        let gate = Arc::new(WriteGate::new());
        let (region, monitor) = PcowRegion::open(path, gate.clone(), opts)?;
        Ok(Rig {
            region,
            monitor: serve(monitor),
            gate,
        })
    }

    pub fn base(&self) -> usize {
        self.region.host_addr() as usize
    }

    pub fn write(&self, off: u64, data: &[u8]) {
        let _in = self.gate.enter();
        gwrite(self.base(), self.region.len(), off, data);
    }

    pub fn read(&self, off: u64, len: usize) -> Vec<u8> {
        gread(self.base(), self.region.len(), off, len)
    }

    /// Drops the region and the monitor (the image closes).
    pub fn close(self) {
        let Rig {
            region, monitor, ..
        } = self;
        monitor.stop();
        drop(region);
    }
}

/// The image's whole view, read through the pcow library.
pub fn reopen_read(path: &Path) -> Vec<u8> {
    let img = Image::open(path, OpenOptions::read_only()).expect("reopen");
    let mut v = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut v, 0).expect("read");
    v
}

/// A small tmpfs mounted for one test, unmounted on drop.
pub struct SmallFs {
    dir: tempfile::TempDir,
}

impl SmallFs {
    pub fn mount(size: &str) -> Result<SmallFs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("running mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(SmallFs { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Makes the file system bigger (frees space).
    pub fn grow(&self, size: &str) -> Result<(), String> {
        let out = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(self.dir.path())
            .output()
            .map_err(|e| format!("running mount: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
        }
        Ok(())
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let r = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
        if !matches!(r, Ok(s) if s.success()) {
            eprintln!("umount {} failed: {r:?}", self.dir.path().display());
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(self.dir.path())
                .status();
        }
    }
}
