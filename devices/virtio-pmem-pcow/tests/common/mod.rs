//! Fixtures shared by the device's integration tests: the userfaultfd
//! check, the monitor on its own thread (polling its fds as a VMM's epoll
//! loop would), guest reads and writes through raw pointers, and image
//! helpers. Each test binary uses part of them.
#![allow(dead_code)]

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use pcow::{BaseFormat, BaseRef, CreateOptions, Image, OpenOptions};
use virtio_pmem_pcow::monitor::Uffd;
use virtio_pmem_pcow::{Monitor, PcowRegion, RegionError, RegionOptions, WriteGate};

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

/// The monitor on its own thread, polling both fds like an epoll loop.
pub struct MonitorThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Monitor>>,
}

impl MonitorThread {
    pub fn spawn(m: Monitor) -> MonitorThread {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let fds = m.fds();
            while !s.load(Ordering::Relaxed) {
                let mut pfds: Vec<libc::pollfd> = fds
                    .iter()
                    .map(|&fd| libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    })
                    .collect();
                // SAFETY: `pfds` is a valid array of pollfds for the call.
                let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 20) };
                if r > 0 {
                    for p in &pfds {
                        if p.revents != 0 {
                            m.handle_fd(p.fd).expect("monitor");
                        }
                    }
                }
            }
            m
        });
        MonitorThread {
            stop,
            handle: Some(handle),
        }
    }

    pub fn stop(mut self) -> Monitor {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.take().unwrap().join().expect("monitor thread")
    }
}

impl Drop for MonitorThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
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

/// A region, its monitor thread and the gate the "guest" writes through.
pub struct Rig {
    pub region: PcowRegion,
    pub monitor: MonitorThread,
    pub gate: Arc<WriteGate>,
}

impl Rig {
    pub fn open(path: &Path, opts: &RegionOptions) -> Result<Rig, RegionError> {
        let gate = Arc::new(WriteGate::new());
        let (region, monitor) = PcowRegion::open(path, gate.clone(), opts)?;
        Ok(Rig {
            region,
            monitor: MonitorThread::spawn(monitor),
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
        let m = monitor.stop();
        drop(region);
        drop(m);
    }
}

/// The image's whole view, read through the pcow library.
pub fn reopen_read(path: &Path) -> Vec<u8> {
    let img = Image::open(path, OpenOptions::read_only()).expect("reopen");
    let mut v = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut v, 0).expect("read");
    v
}
