//! I/O errors injected under a live region (a `Storage` wrapper that fails
//! the k-th write, sync or allocation): a guest FLUSH through a real
//! virtqueue is answered EIO, the image on disk stays consistent and holds
//! exactly the last committed barrier, and the next barrier that succeeds
//! saves everything written before it, also the pages the failed barrier
//! had already harvested (write tracking re-protects them, so no later
//! scan would report them again).

mod common;

use std::fs::OpenOptions as FsOpenOptions;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};

use common::*;
use pcow::io::{CommitIo, FileStorage, Storage};
use pcow::{Image, OpenOptions};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_pmem_pcow::{
    FlushBackend, FlushError, PcowRegion, PmemDevice, PoolOptions, RegionOptions, WriteGate,
};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueOwnedT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Which storage operation fails next: the `n`-th write, sync or
/// allocation after arming fails with EIO, once.
#[derive(Debug, Default)]
struct Faults {
    armed: Mutex<Option<(&'static str, u32)>>,
    injected: Mutex<Vec<&'static str>>,
}

impl Faults {
    fn arm(&self, kind: &'static str, n: u32) {
        *self.armed.lock().unwrap() = Some((kind, n));
    }

    fn disarm(&self) {
        *self.armed.lock().unwrap() = None;
    }

    fn injected(&self) -> usize {
        self.injected.lock().unwrap().len()
    }

    fn hit(&self, op: &'static str) -> io::Result<()> {
        let mut armed = self.armed.lock().unwrap();
        match *armed {
            Some((kind, 0)) if kind == op => {
                *armed = None;
                self.injected.lock().unwrap().push(op);
                Err(io::Error::from_raw_os_error(libc::EIO))
            }
            Some((kind, n)) if kind == op => {
                *armed = Some((kind, n - 1));
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// A file whose writes, syncs and allocations fail on demand.
struct FaultyStorage {
    inner: FileStorage,
    faults: Arc<Faults>,
}

impl Storage for FaultyStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.faults.hit("write")?;
        self.inner.write_at(buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.faults.hit("sync")?;
        self.inner.sync()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    /// Growing the file is how a barrier's copy-on-write clusters get
    /// their space once the pool is empty: an allocation too.
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.faults.hit("allocation")?;
        self.inner.set_len(len)
    }
    fn allocate(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.faults.hit("allocation")?;
        self.inner.allocate(offset, len)
    }
    fn file(&self) -> Option<&std::fs::File> {
        self.inner.file()
    }
    /// The barrier's syncs and header write go through this handle: they
    /// fail on demand as the storage's own do.
    fn commit_io(&self) -> io::Result<Box<dyn CommitIo>> {
        Ok(Box::new(FaultyCommitIo {
            inner: self.inner.commit_io()?,
            faults: self.faults.clone(),
        }))
    }
}

/// A [`FaultyStorage`]'s commit handle.
struct FaultyCommitIo {
    inner: Box<dyn CommitIo>,
    faults: Arc<Faults>,
}

impl CommitIo for FaultyCommitIo {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.faults.hit("write")?;
        self.inner.write_at(buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.faults.hit("sync")?;
        self.inner.sync()
    }
}

/// The region as the virtio device's backend.
struct Backend(Arc<PcowRegion>);

impl FlushBackend for Backend {
    fn flush(&mut self) -> Result<(), FlushError> {
        self.0
            .barrier()
            .map(|_| ())
            .map_err(|e| FlushError::from_error(Box::new(e)))
    }
}

const REQ: u64 = 0x1000;
const RESP: u64 = 0x2000;

/// A guest's FLUSH through a split virtqueue in guest memory: returns the
/// `ret` the device wrote (0 OK, 1 EIO).
fn guest_flush(dev: &mut PmemDevice<Backend>) -> u32 {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
    let vq = MockSplitQueue::new(&mem, 16);
    let w = VRING_DESC_F_WRITE as u16;
    let chain = [
        RawDescriptor::from(SplitDescriptor::new(REQ, 4, VRING_DESC_F_NEXT as u16, 1)),
        RawDescriptor::from(SplitDescriptor::new(RESP, 4, w, 0)),
    ];
    vq.add_desc_chains(&chain, 0).unwrap();
    mem.write_obj(0u32, GuestAddress(REQ)).unwrap(); // type 0: FLUSH
    mem.write_obj(0xdead_beefu32, GuestAddress(RESP)).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    dev.process_queue(&mem, &mut q).unwrap();
    assert_eq!(vq.used().idx().load(), 1, "the FLUSH was answered");
    assert!(q.iter(&mem).unwrap().next().is_none());
    u32::from_le(mem.read_obj::<u32>(GuestAddress(RESP)).unwrap())
}

/// `pcow-img check`'s verdict: no corruption (leaked pool clusters past a
/// failed barrier are allowed).
fn assert_consistent(path: &Path, what: &str) {
    let r = pcow::check::check(path, None, true).expect("check");
    assert!(r.corruptions.is_empty(), "{what}: {:?}", r.corruptions);
}

/// Every byte of `got` is the last good barrier's or the guest's newest.
fn old_or_new(got: &[u8], old: &[u8], new: &[u8], at: &str) {
    let bad = (0..got.len()).find(|&i| got[i] != old[i] && got[i] != new[i]);
    if let Some(i) = bad {
        panic!(
            "{at}: the image after EIO has {:#04x} at {i:#x}, neither the last barrier's \
             {:#04x} nor the newest {:#04x}",
            got[i], old[i], new[i]
        );
    }
}

struct Guest {
    region: Arc<PcowRegion>,
    gate: Arc<WriteGate>,
    model: Vec<u8>,
}

impl Guest {
    fn write(&mut self, off: u64, data: &[u8]) {
        let _in = self.gate.enter();
        gwrite(
            self.region.host_addr() as usize,
            self.region.len(),
            off,
            data,
        );
        self.model[off as usize..][..data.len()].copy_from_slice(data);
    }

    fn read(&self, off: u64, n: usize) -> Vec<u8> {
        gread(self.region.host_addr() as usize, self.region.len(), off, n)
    }

    /// Writes that reach every kind of cluster: holes (mapped shared on
    /// the fault), snapshotted clusters (copy-on-write, tracked), and
    /// zero-mapped holes (read first, then written: private).
    /// Clusters from `SCRIBBLED` on stay holes until round `r` writes
    /// cluster `SCRIBBLED + r`: every round has metadata to commit.
    fn scribble(&mut self, round: u64) {
        for c in (0..SCRIBBLED).filter(|c| (c + round).is_multiple_of(3)) {
            let off = c * K64 + (round * 4 * PAGE + 13) % K64;
            let d = pattern(round * 1000 + c, 700);
            if (c + round).is_multiple_of(2) {
                let _ = self.read(off, 1);
            }
            self.write(off, &d);
        }
        let fresh = (SCRIBBLED + round) * K64 + 99;
        self.write(fresh, &pattern(round, 300));
    }
}

const SCRIBBLED: u64 = 32;

#[test]
fn an_io_error_on_a_barrier_is_eio_and_the_next_barrier_saves_everything() {
    if !uffd_or_skip("an_io_error_on_a_barrier_is_eio_and_the_next_barrier_saves_everything") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("eio.pcow");
    const N: u64 = 64;
    create(&path, N * K64, K64, None).close().unwrap();

    let faults = Arc::new(Faults::default());
    faults.disarm();
    let file = FsOpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let storage = FaultyStorage {
        inner: FileStorage::new(file),
        faults: faults.clone(),
    };
    let image = Image::open_storage(Box::new(storage), &path, OpenOptions::read_write()).unwrap();
    let gate = Arc::new(WriteGate::new());
    // No worker and a pool of one cluster: the barrier's copy-on-write
    // clusters are allocated through the storage too (the file grown), so
    // the injected errors also hit an allocation between the harvest and
    // the copy.
    let opts = RegionOptions {
        pool_clusters: Some(1),
        ..RegionOptions::default()
    };
    let (region, monitor) =
        PcowRegion::from_image_with(image, gate.clone(), &opts, &PoolOptions::inline()).unwrap();
    let monitor = serve(monitor);
    let region = Arc::new(region);
    let mut dev = PmemDevice::new(1 << 32, region.len(), Backend(region.clone()));
    let mut g = Guest {
        region: region.clone(),
        gate,
        model: vec![0u8; (N * K64) as usize],
    };

    // Data in the image, then a snapshot: its clusters are history now,
    // and writes to them are copy-on-write into tracked private pages.
    g.scribble(0);
    assert_eq!(guest_flush(&mut dev), 0);
    region.snapshot_create("before-faults").unwrap();

    // Fail the n-th write, sync or allocation of a barrier (data and
    // metadata writes, their sync, the header, its sync, the clusters
    // that copy-on-write needs): a barrier with fewer such I/Os just
    // succeeds.
    let mut last_good = view_forced(&path);
    let mut failures = 0;
    let mut round = 0;
    for kind in ["allocation", "write", "sync"] {
        for n in 0..4 {
            round += 1;
            let at = format!("{kind} #{n}");
            g.scribble(round);
            let before = faults.injected();
            faults.arm(kind, n);
            let ret = guest_flush(&mut dev);
            faults.disarm();
            if faults.injected() == before {
                assert_eq!(ret, 0, "{at}: no error injected, yet the FLUSH failed");
                last_good = view_forced(&path);
                same(&last_good, &g.model, &format!("{at}: the image"));
                continue;
            }
            failures += 1;
            assert_eq!(
                ret, 1,
                "{at}: the FLUSH after an injected EIO answered {ret}"
            );
            // Nothing of the failed barrier is committed: the file holds the
            // last good barrier, consistently (clusters mapped shared from
            // the file show the guest's newest bytes, as a raw file would).
            assert_consistent(&path, &format!("after EIO in {at}"));
            old_or_new(&view_forced(&path), &last_good, &g.model, &at);
            // The guest still sees everything it wrote.
            same(
                &g.read(0, g.model.len()),
                &g.model,
                &format!("{at}: guest view"),
            );
            // The next barrier saves everything, including what the failed
            // barrier had harvested.
            assert_eq!(guest_flush(&mut dev), 0, "{at}: the barrier after EIO");
            assert_consistent(&path, &format!("{at}: after the good barrier"));
            last_good = view_forced(&path);
            same(
                &last_good,
                &g.model,
                &format!("{at}: the image after the good barrier"),
            );
        }
    }
    let kinds = faults.injected.lock().unwrap().clone();
    // A barrier has two syncs (data and metadata slots, then the header),
    // so of the four sync faults armed two are reached.
    assert!(failures >= 7, "only {failures} I/Os failed: {kinds:?}");
    assert_eq!(
        kinds.iter().filter(|k| **k == "sync").count(),
        2,
        "syncs failed: {kinds:?}"
    );
    for kind in ["allocation", "write", "sync"] {
        assert!(
            kinds.contains(&kind),
            "no EIO injected into a {kind}: {kinds:?}"
        );
    }
    let m = dev.metrics();
    assert_eq!(m.flush_errors, failures);
    eprintln!("{failures} injected EIOs ({kinds:?}), each answered EIO; {m:?}");

    let model = std::mem::take(&mut g.model);
    drop(dev);
    drop(g);
    drop(monitor);
    let region = Arc::try_unwrap(region).expect("last user of the region");
    drop(region);
    check_clean(&path);
    same(&view_forced(&path), &model, "the closed image");
}
