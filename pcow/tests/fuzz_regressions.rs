//! Regression tests for what the fuzz targets of `fuzz/` found
//! (docs/fuzzing.md). Each test names the target and the finding, and
//! rebuilds the minimized input with the library's own types (a header
//! through `Header::encode`, an `image_ops` input as the operation
//! sequence it decodes to), so that it stays readable; a byte-level input
//! that cannot be built so goes inline as hex, or as a small file under
//! `tests/fuzz-regressions/`.

use std::io;
use std::sync::{Arc, Mutex};

use pcow::io::Storage;
use pcow::{CreateOptions, Image, OpenOptions};

/// An image file in memory, as the fuzz targets use (fuzz/src/lib.rs).
#[derive(Clone, Default)]
struct MemStorage(Arc<Mutex<Vec<u8>>>);

impl MemStorage {
    fn new(bytes: Vec<u8>) -> Self {
        MemStorage(Arc::new(Mutex::new(bytes)))
    }
    fn contents(&self) -> Vec<u8> {
        self.0.lock().unwrap().clone()
    }
}

impl Storage for MemStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let b = self.0.lock().unwrap();
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= b.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        buf.copy_from_slice(&b[offset as usize..end as usize]);
        Ok(())
    }
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut b = self.0.lock().unwrap();
        let end = offset as usize + buf.len();
        if end > b.len() {
            b.resize(end, 0);
        }
        b[offset as usize..end].copy_from_slice(buf);
        Ok(())
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.lock().unwrap().len() as u64)
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.0.lock().unwrap().resize(len as usize, 0);
        Ok(())
    }
    fn commit_io(&self) -> io::Result<Box<dyn pcow::io::CommitIo>> {
        Ok(Box::new(self.clone()))
    }
}

impl pcow::io::CommitIo for MemStorage {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        Storage::write_at(self, buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn ids(img: &Image) -> Vec<(u32, String)> {
    img.snapshots().into_iter().map(|s| (s.id, s.tag)).collect()
}

/// image_ops, finding 1 (artifact crash-f3fa3f15…): after `compact`,
/// `snapshots()` no longer lists the snapshots oldest first (its doc): a
/// snapshot on a branch that is not the active one moves to the end.
/// Minimized: create s0, s1; apply s0; create s2; compact.
#[test]
fn image_ops_compact_keeps_snapshot_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img.pcow");
    let opts = CreateOptions {
        cluster_size: Some(4096),
        virtual_size: Some(256 << 10),
        base: None,
    };
    let mut img = Image::create(&path, &opts).unwrap();
    img.snapshot_create("s0").unwrap();
    img.snapshot_create("s1").unwrap();
    img.snapshot_apply("s0").unwrap();
    img.snapshot_create("s2").unwrap();
    let before = ids(&img);
    img.close().unwrap();
    assert_eq!(
        before,
        [(1, "s0".into()), (2, "s1".into()), (3, "s2".into())],
        "before compact"
    );
    pcow::ops::compact(&path).unwrap();
    let img = Image::open(&path, OpenOptions::read_only()).unwrap();
    assert_eq!(ids(&img), before, "compact changed the snapshot order");
}

/// The write cycle of the `image_open` target on `bytes`: when a writer
/// accepts the image, write, flush, snapshot create, overwrite, snapshot
/// apply and close must leave an image that reopens strictly and that
/// `check::report` finds no corruption in.
fn write_cycle_stays_valid(bytes: Vec<u8>) {
    let path = "/nonexistent/pcow-fuzz/image.pcow";
    let opts = |writable, lenient| OpenOptions {
        writable,
        force_share: true,
        skip_base: true,
        lenient,
        ..OpenOptions::default()
    };
    let store = MemStorage::new(bytes);
    let Ok(mut img) = Image::open_storage(Box::new(store.clone()), path, opts(true, false)) else {
        return; // refusing the image is fine
    };
    img.write_at(&[0xa5; 4096], 0).unwrap();
    img.flush().unwrap();
    let info = img.snapshot_create("fuzz-0").unwrap();
    img.write_at(&[0x5a; 4096], 0).unwrap();
    img.snapshot_apply(&info.id.to_string()).unwrap();
    img.close().unwrap();
    let bytes = store.contents();
    let img = Image::open_storage(
        Box::new(MemStorage::new(bytes.clone())),
        path,
        opts(false, false),
    )
    .unwrap_or_else(|e| {
        panic!(
            "the writer's result does not reopen strictly: {}",
            error_report::chain(&e)
        )
    });
    let mut b = [0u8; 4096];
    img.read_at(&mut b, 0).unwrap();
    assert_eq!(b, [0xa5; 4096], "content after reopen");
    drop(img);
    let img =
        Image::open_storage(Box::new(MemStorage::new(bytes)), path, opts(false, true)).unwrap();
    let rep = pcow::check::report(&img);
    assert!(rep.corruptions.is_empty(), "corrupt: {:?}", rep.corruptions);
}

/// image_open, finding 2 (artifact crash-6114ca1b…, minimized to the
/// header): an empty image whose header has `next_snapshot_id = 0` (and no
/// snapshot, so "greater than every snapshot id" holds) is accepted by a
/// writer; `snapshot_create` then gives the new snapshot id 0, which is
/// the "no snapshot" id, and the closed image no longer opens ("invalid
/// image"). The writer must either refuse the header or not hand out id 0.
#[test]
fn image_open_next_snapshot_id_zero() {
    let g = pcow::Geometry::from_cluster_size(4096).unwrap();
    let mut h = pcow::Header::new(g, 1 << 20, None);
    h.generation = 3;
    h.next_snapshot_id = 0;
    let mut file = h.encode();
    file.resize(4096, 0);
    write_cycle_stays_valid(file);
}

/// image_open, finding 3 (artifact crash-0d1b7204…, minimized to the
/// header): a header with `generation = u64::MAX` is valid for a reader,
/// and opening it read-write panics with "attempt to add with overflow"
/// (barrier.rs, `committed_gen + 1` in `flush` from `start_writing`); a
/// build without overflow checks writes generation 0 instead, which no
/// reader accepts. A writer must refuse the image (or stop) with an error.
#[test]
fn image_open_generation_overflow() {
    let g = pcow::Geometry::from_cluster_size(4096).unwrap();
    for generation in [u64::MAX, u64::MAX - 1, u64::MAX - 3] {
        let mut h = pcow::Header::new(g, 1 << 20, None);
        h.generation = generation;
        let mut file = h.encode();
        file.resize(4096, 0);
        write_cycle_stays_valid(file);
    }
}
