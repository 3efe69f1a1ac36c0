//! The fault path never waits for a barrier's syncs: on the production
//! threading (each region's monitor on the crate's own `MonitorThread`),
//! with a storage whose commit syncs are held for 500 ms, a write fault
//! into another cluster and a read of a hole complete within milliseconds
//! while a FLUSH barrier is inside its sync; and with two devices, a FLUSH
//! stalled on one does not delay the other's faults.

mod common;

use std::fs::OpenOptions as FsOpenOptions;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::*;
use pcow::io::{CommitIo, FileStorage, Storage};
use pcow::{Image, OpenOptions};
use virtio_pmem_pcow::{PcowRegion, WriteGate};

/// How long a slowed sync takes.
const SLOW_SYNC: Duration = Duration::from_millis(500);

/// The longest a fault may take while another barrier syncs. A fault here
/// takes tens of microseconds; the margin is for a loaded two-core machine,
/// an order of magnitude below the sync it must not wait for.
const FAULT_BOUND: Duration = Duration::from_millis(50);

/// Whether the next commit sync is slowed, and whether one is in progress.
#[derive(Debug, Default)]
struct SyncGate {
    state: Mutex<SyncState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct SyncState {
    armed: bool,
    in_sync: bool,
}

impl SyncGate {
    fn arm(&self) {
        self.state.lock().unwrap().armed = true;
    }

    /// Waits until a slowed sync has started.
    fn wait_in_sync(&self) {
        let s = self.state.lock().unwrap();
        let (s, timeout) = self
            .cv
            .wait_timeout_while(s, Duration::from_secs(10), |s| !s.in_sync)
            .unwrap();
        assert!(!timeout.timed_out(), "no slowed sync started: {s:?}");
    }

    fn in_sync(&self) -> bool {
        self.state.lock().unwrap().in_sync
    }

    /// A commit's sync: the first one after arming sleeps [`SLOW_SYNC`].
    fn sync(&self) {
        {
            let mut s = self.state.lock().unwrap();
            if !s.armed {
                return;
            }
            s.armed = false;
            s.in_sync = true;
        }
        self.cv.notify_all();
        std::thread::sleep(SLOW_SYNC);
        self.state.lock().unwrap().in_sync = false;
    }
}

/// A file whose commit handle's syncs can be slowed.
struct SlowStorage {
    inner: FileStorage,
    gate: Arc<SyncGate>,
}

impl Storage for SlowStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.gate.sync();
        self.inner.sync()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn allocate(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.allocate(offset, len)
    }
    fn file(&self) -> Option<&std::fs::File> {
        self.inner.file()
    }
    fn commit_io(&self) -> io::Result<Box<dyn CommitIo>> {
        Ok(Box::new(SlowCommitIo {
            inner: self.inner.commit_io()?,
            gate: self.gate.clone(),
        }))
    }
}

/// A [`SlowStorage`]'s commit handle: the barrier's syncs.
struct SlowCommitIo {
    inner: Box<dyn CommitIo>,
    gate: Arc<SyncGate>,
}

impl CommitIo for SlowCommitIo {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.gate.sync();
        self.inner.sync()
    }
}

const N: u64 = 64;

/// Something the guest does, timed.
type GuestOp = Box<dyn Fn(&Rig)>;

/// A region on the image at `path` (created), its storage's commit syncs
/// slowed on demand, served by the crate's monitor thread.
fn slow_rig(path: &Path) -> (Rig, Arc<SyncGate>) {
    create(path, N * K64, K64, None).close().unwrap();
    let sync = Arc::new(SyncGate::default());
    let file = FsOpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let storage = SlowStorage {
        inner: FileStorage::new(file),
        gate: sync.clone(),
    };
    let image = Image::open_storage(Box::new(storage), path, OpenOptions::read_write()).unwrap();
    let gate = Arc::new(WriteGate::new());
    let (region, monitor) =
        PcowRegion::from_image(image, gate.clone(), &one_cluster_per_fault()).unwrap();
    let rig = Rig {
        region,
        monitor: serve(monitor),
        gate,
    };
    (rig, sync)
}

/// Runs `f` and returns how long it took.
fn timed(f: impl FnOnce()) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

#[test]
fn faults_complete_while_a_barrier_syncs() {
    if !uffd_or_skip("faults_complete_while_a_barrier_syncs") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("slow.pcow");
    let (rig, sync) = slow_rig(&path);
    let rig = Arc::new(rig);
    // Something to commit: a fresh cluster (metadata) with data.
    rig.write(3 * K64 + 7, b"before");
    rig.read(9 * K64, 1); // cluster 9 zero-mapped: later faults there only wake
                          // A write fault into another cluster (a hole: a cluster allocated and
                          // mapped), a read of a hole (zeros mapped), a write into a zero-mapped
                          // cluster (no fault), each timed first thing inside a barrier's slowed
                          // sync (one barrier each, so that none waits behind another).
    let cases: [(&str, GuestOp); 3] = [
        (
            "write fault",
            Box::new(|r| r.write(20 * K64 + 5, b"during")),
        ),
        (
            "hole read",
            Box::new(|r| assert_eq!(r.read(30 * K64 + 100, 4), [0; 4])),
        ),
        ("write", Box::new(|r| r.write(9 * K64, b"zero-mapped"))),
    ];
    for (what, op) in cases {
        rig.write(40 * K64, what.as_bytes()); // something to commit
        sync.arm();
        let r = rig.clone();
        let barrier = std::thread::spawn(move || {
            let t = Instant::now();
            let s = r.region.barrier();
            (s, t.elapsed())
        });
        sync.wait_in_sync();
        let d = timed(|| op(&rig));
        let still = sync.in_sync();
        let (stats, took) = barrier.join().unwrap();
        let stats = stats.expect("barrier");
        eprintln!(
            "{what} during a {SLOW_SYNC:?} sync: {d:?}; barrier {took:?}, held {:?}, commit {:?}",
            stats.held, stats.commit
        );
        assert!(
            d < FAULT_BOUND,
            "{what} took {d:?} during the barrier's sync"
        );
        assert!(still, "{what} was timed while the sync slept");
        assert!(took >= SLOW_SYNC, "the barrier's sync was slowed: {took:?}");
        assert!(stats.held < SLOW_SYNC, "writers were held through the sync");
    }
    let st = rig.region.status().unwrap();
    assert_eq!(st.faults.write_faults, 3, "{:?}", st.faults);
    assert!(st.faults.read_faults >= 2, "{:?}", st.faults);
    // The writes made during the commit belong to the next barrier.
    rig.region.barrier().expect("second barrier");
    let rig = Arc::try_unwrap(rig).ok().expect("last user of the rig");
    rig.close();
    let v = reopen_read(&path);
    assert_eq!(&v[(3 * K64 + 7) as usize..][..6], b"before");
    assert_eq!(&v[(20 * K64 + 5) as usize..][..6], b"during");
    assert_eq!(&v[(9 * K64) as usize..][..11], b"zero-mapped");
    check_clean(&path);
}

#[test]
fn a_stalled_flush_on_one_device_does_not_delay_another() {
    if !uffd_or_skip("a_stalled_flush_on_one_device_does_not_delay_another") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (slow, sync) = slow_rig(&dir.path().join("slow.pcow"));
    let fast_path = dir.path().join("fast.pcow");
    create(&fast_path, N * K64, K64, None).close().unwrap();
    let fast = Rig::open(&fast_path, &one_cluster_per_fault()).unwrap();
    let slow = Arc::new(slow);
    slow.write(K64, b"slow");
    sync.arm();
    let s = slow.clone();
    let barrier = std::thread::spawn(move || s.region.barrier());
    sync.wait_in_sync();
    let mut worst = Duration::ZERO;
    let done = AtomicBool::new(false);
    for c in 0..8 {
        worst = worst.max(timed(|| fast.write(c * 2 * K64, &[c as u8 + 1; 16])));
        worst = worst.max(timed(|| {
            fast.read((c * 2 + 1) * K64, 1);
        }));
    }
    // The fast device's own barrier completes meanwhile too.
    let fast_barrier = timed(|| {
        fast.region.barrier().expect("barrier of the other device");
        done.store(true, Ordering::Relaxed);
    });
    let still = sync.in_sync();
    barrier.join().unwrap().expect("slow barrier");
    eprintln!(
        "while one device synced for {SLOW_SYNC:?}: worst fault on the other {worst:?}, \
         its barrier {fast_barrier:?}"
    );
    assert!(worst < FAULT_BOUND, "a fault took {worst:?}");
    assert!(
        still,
        "the faults were timed while the other device's sync slept"
    );
    assert!(
        fast_barrier < SLOW_SYNC,
        "the other device's barrier took {fast_barrier:?}"
    );
    let st = fast.region.status().unwrap();
    assert_eq!(st.faults.write_faults, 8, "{:?}", st.faults);
    fast.close();
    let v = reopen_read(&fast_path);
    for c in 0..8u64 {
        assert_eq!(v[(c * 2 * K64) as usize], c as u8 + 1);
    }
    check_clean(&fast_path);
    let slow = Arc::try_unwrap(slow).ok().expect("last user of the rig");
    slow.close();
}
