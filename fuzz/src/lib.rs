//! Helpers shared by the pcow fuzz targets: an in-memory [`Storage`], a
//! bounded whole-image read that checks reads against `extents()`, and a
//! scratch directory for the targets that need real files.
//!
//! The targets panic only on real findings: a library panic, a model
//! mismatch, or an image that a writer turned corrupt.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use pcow::io::Storage;
use pcow::Image;

/// Largest file a [`MemStorage`] grows to; past it writes fail like a full
/// disk (`ENOSPC`), so a hostile header cannot make the fuzzer allocate
/// without bound through the storage.
pub const MAX_STORAGE: u64 = 64 << 20;

/// How much of the virtual size the targets read (the first part only).
pub const READ_CAP: u64 = 16 << 20;

/// An image file in memory. Clones share the bytes, so a target can look
/// at what the library wrote after the image is closed.
#[derive(Clone, Default)]
pub struct MemStorage {
    bytes: Arc<Mutex<Vec<u8>>>,
}

impl MemStorage {
    /// A storage holding `bytes`.
    pub fn new(bytes: Vec<u8>) -> Self {
        MemStorage {
            bytes: Arc::new(Mutex::new(bytes)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the current bytes.
    pub fn contents(&self) -> Vec<u8> {
        self.lock().clone()
    }
}

fn no_space() -> io::Error {
    io::Error::from_raw_os_error(28) // ENOSPC
}

impl Storage for MemStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let b = self.lock();
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= b.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        buf.copy_from_slice(&b[offset as usize..end as usize]);
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= MAX_STORAGE)
            .ok_or_else(no_space)?;
        let mut b = self.lock();
        if end > b.len() as u64 {
            b.resize(end as usize, 0);
        }
        b[offset as usize..end as usize].copy_from_slice(buf);
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.lock().len() as u64)
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        if len > MAX_STORAGE {
            return Err(no_space());
        }
        self.lock().resize(len as usize, 0);
        Ok(())
    }

    /// The same bytes (a clone shares them).
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

/// Reads the first `min(virtual size, READ_CAP)` bytes of `img` in chunks
/// and returns them; errors end the read early (a corrupt image may fail a
/// read, but must not panic).
pub fn read_prefix(img: &Image) -> Option<Vec<u8>> {
    let n = img.virtual_size().min(READ_CAP);
    let mut out = vec![0u8; n as usize];
    for (i, chunk) in out.chunks_mut(1 << 20).enumerate() {
        img.read_at(chunk, (i as u64) << 20).ok()?;
    }
    Some(out)
}

/// Checks `extents()` against the bytes read: the extents cover
/// `[0, virtual size)` in order without gaps, zero extents read as zeros,
/// and extents of the top image (depth 0) read as the file's bytes there.
/// `file` is the top image's content, when the caller has it.
pub fn check_extents(img: &Image, read: &[u8], file: Option<&[u8]>) {
    let vs = img.virtual_size();
    let mut pos = 0u64;
    for e in img.extents() {
        assert_eq!(e.offset, pos, "extents leave a gap or overlap: {e:?}");
        assert!(e.length > 0, "empty extent {e:?}");
        pos = e
            .offset
            .checked_add(e.length)
            .expect("extent end overflows");
        let lo = e.offset.min(read.len() as u64) as usize;
        let hi = pos.min(read.len() as u64) as usize;
        let got = &read[lo..hi];
        match (e.file_offset, e.depth, file) {
            (None, _, _) => assert!(
                got.iter().all(|&b| b == 0),
                "zero extent {e:?} does not read as zeros"
            ),
            (Some(fo), 0, Some(file)) => {
                let want = usize::try_from(fo)
                    .ok()
                    .and_then(|fo| file.get(fo..fo + got.len()));
                assert_eq!(
                    Some(got),
                    want,
                    "extent {e:?} does not read as the file's bytes"
                );
            }
            _ => {}
        }
    }
    assert_eq!(pos, vs, "extents end at {pos}, not at the virtual size");
}

/// A scratch directory for this process, on tmpfs when there is one
/// (`/dev/shm`), removed at exit by nobody: libFuzzer exits with
/// `_exit`, so the directory name carries the pid and `scripts/fuzz.sh`
/// cleans the parent up.
pub fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let parent = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm/pcow-fuzz")
        } else {
            std::env::temp_dir().join("pcow-fuzz")
        };
        let dir = parent.join(format!("{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("cannot create the scratch directory");
        dir
    })
}

/// Splits `data` into `n` parts: `n - 1` little-endian u32 lengths first
/// (each clamped to what is left), then the parts; the last part takes the
/// rest. The seed script writes chain inputs in this layout.
pub fn split_parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    let head = 4 * (n - 1);
    if data.len() < head {
        return vec![&[][..]; n];
    }
    let (lens, mut rest) = data.split_at(head);
    let mut parts = Vec::with_capacity(n);
    for l in lens.chunks_exact(4) {
        let len = u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize;
        let (p, r) = rest.split_at(len.min(rest.len()));
        parts.push(p);
        rest = r;
    }
    parts.push(rest);
    parts
}

/// A small deterministic hash of the input, to derive parameters from it.
pub fn hash(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Whether `PCOW_FUZZ_DEBUG` is set: the targets then print what each
/// open returned (for looking at one input: `target/.../image_chain FILE`).
pub fn debug() -> bool {
    static DEBUG: OnceLock<bool> = OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var_os("PCOW_FUZZ_DEBUG").is_some())
}

/// Recomputes the CRC of every slot that has a magic (header slots; meta
/// and snapshot slots at cluster boundaries), with the geometry of slot A.
/// A mutated image almost never has right CRCs, and a slot with a wrong
/// CRC is rejected before any other rule is looked at: fixing them lets
/// the fuzzer reach the rules behind the checksum.
pub fn fix_crcs(file: &mut [u8]) {
    const HEADER_CRC: usize = 20;
    const CLUSTER_CRC: usize = 4;
    if file.len() < 20 || file[..8] != pcow::format::MAGIC {
        return;
    }
    let bits = u32::from_le_bytes([file[16], file[17], file[18], file[19]]);
    let Some(g) = pcow::Geometry::new(bits) else {
        return;
    };
    let (cs, slot) = (g.cluster_size() as usize, g.slot_size());
    let seal = |s: &mut [u8], at: usize| {
        s[at..at + 4].fill(0);
        let c = crc32c::crc32c(s);
        s[at..at + 4].copy_from_slice(&c.to_le_bytes());
    };
    for start in (0..file.len()).step_by(slot) {
        let Some(s) = file.get_mut(start..start + slot) else {
            break;
        };
        if start < cs {
            if s[..8] == pcow::format::MAGIC {
                seal(s, HEADER_CRC);
            }
        } else if s[..4] == *b"PMET" || s[..4] == *b"PSNP" {
            seal(s, CLUSTER_CRC);
        }
    }
}
