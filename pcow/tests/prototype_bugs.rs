//! The gaps of the MSST 2019 prototype (`docs/pcow-format.md`, "What the
//! MSST 2019 prototype got wrong"), each turned into a test that the
//! prototype would fail and this implementation must pass.

use std::path::Path;
use std::time::{Duration, Instant};

mod common;

use common::{overlay, read, ro, tmp};
use pcow::{BaseFormat, BaseRef, CreateOptions, Error, Image, OpenOptions};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const PAGE: usize = 4096;

// ----- helpers -----

fn create(path: &Path, cluster_size: u64, virtual_size: u64) -> Image {
    Image::create(
        path,
        &CreateOptions {
            cluster_size: Some(cluster_size),
            virtual_size: Some(virtual_size),
            ..Default::default()
        },
    )
    .unwrap()
}

fn rw(path: &Path) -> Image {
    Image::open(path, OpenOptions::read_write()).unwrap()
}

/// Bytes that are never zero and differ with `seed`.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(7).wrapping_add(seed.wrapping_mul(131)) % 251) as u8 + 1)
        .collect()
}

/// Runs `f` on its own thread and fails if it has not returned after
/// `secs` seconds (the prototype's failure mode was a loop, not an error).
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let h = std::thread::spawn(f);
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !h.is_finished() {
        assert!(
            Instant::now() < deadline,
            "{what}: still running after {secs} s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// The bytes of an image file, read the way the spec lays them out.
struct FileView {
    b: Vec<u8>,
    c: usize,
}

impl FileView {
    fn load(p: &Path) -> FileView {
        let b = std::fs::read(p).unwrap();
        let c = 1usize << u32::from_le_bytes(b[16..20].try_into().unwrap());
        FileView { b, c }
    }
    fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes(self.b[at..at + 2].try_into().unwrap())
    }
    fn u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.b[at..at + 4].try_into().unwrap())
    }
    fn u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.b[at..at + 8].try_into().unwrap())
    }
    /// Offset of the current header slot (higher generation; the images
    /// here were closed cleanly, so both slots are valid).
    fn hdr(&self) -> usize {
        let s = self.c / 2;
        if self.u64(s + 48) > self.u64(48) && self.b[s..s + 8] == self.b[..8] {
            s
        } else {
            0
        }
    }
    /// Offset of the current slot of metadata cluster `cluster`.
    fn cur(&self, cluster: usize) -> usize {
        let g = self.u64(self.hdr() + 48);
        [0, self.c / 2]
            .into_iter()
            .map(|h| cluster * self.c + h)
            .filter(|&at| {
                (&self.b[at..at + 4] == b"PMET" || &self.b[at..at + 4] == b"PSNP")
                    && self.u64(at + 16) == cluster as u64
                    && self.u64(at + 8) <= g
            })
            .max_by_key(|&at| self.u64(at + 8))
            .unwrap()
    }
    /// The segments from cluster 1 to the committed end: (meta cluster,
    /// layer, used).
    fn segments(&self) -> Vec<(usize, u32, u32)> {
        let cc = self.u64(self.hdr() + 64) as usize;
        let mut out = Vec::new();
        let mut pos = 1;
        while pos < cc {
            let at = self.cur(pos);
            if &self.b[at..at + 4] == b"PMET" {
                let used = self.u32(at + 28);
                out.push((pos, self.u32(at + 24), used));
                pos += 1 + used as usize;
            } else {
                pos += 1;
            }
        }
        out
    }
    /// Entry `i` of the meta cluster at `meta`: (vcn, bitmap words), with
    /// entry size `e`.
    fn entry(&self, meta: usize, i: usize, e: usize) -> (u64, Vec<u64>) {
        let at = self.cur(meta) + 32 + i * e;
        let words = (8..e).step_by(8).map(|o| self.u64(at + o)).collect();
        (self.u64(at), words)
    }
    /// The bytes of cluster `cluster`.
    fn cluster(&self, cluster: usize) -> &[u8] {
        &self.b[cluster * self.c..(cluster + 1) * self.c]
    }
}

/// Entry size by the spec: `8 + 8 * ceil(P / 64)`.
fn spec_entry_size(cluster_size: u64) -> usize {
    let pages = (cluster_size / 4096) as usize;
    8 + 8 * pages.div_ceil(64)
}

// ----- 4 KiB CoW bitmap written but never read at reopen -----

#[test]
fn partial_copy_bitmap_is_read_at_reopen() {
    let dir = tmp();
    let d = dir.path();
    let cs = 64 * KIB; // 16 pages
    let old = pattern(1, cs as usize);
    let new_page = pattern(2, PAGE);
    let sub = pattern(3, 100);

    // Below the partial copy: an older layer of the same file, or a base image.
    let snap = d.join("snap.pcow");
    let mut img = create(&snap, cs, MIB);
    img.write_at(&old, cs).unwrap();
    img.snapshot_create("before").unwrap();
    let base = d.join("base.pcow");
    let mut b = create(&base, cs, MIB);
    b.write_at(&old, cs).unwrap();
    b.close().unwrap();
    let top = d.join("top.pcow");
    let mut o = overlay(&top, "base.pcow", BaseFormat::Pcow, cs);
    for img in [&mut img, &mut o] {
        // One whole page, and 100 bytes inside another page.
        img.write_at(&new_page, cs + 5 * PAGE as u64).unwrap();
        img.write_at(&sub, cs + 9 * PAGE as u64 + 1000).unwrap();
        img.flush().unwrap();
    }
    img.close().unwrap();
    o.close().unwrap();

    let mut expect = old.clone();
    expect[5 * PAGE..6 * PAGE].copy_from_slice(&new_page);
    expect[9 * PAGE + 1000..9 * PAGE + 1100].copy_from_slice(&sub);
    for p in [&snap, &top] {
        let img = ro(p);
        let got = read(&img, cs, cs as usize);
        for page in 0..16 {
            let r = page * PAGE..(page + 1) * PAGE;
            assert!(
                got[r.clone()] == expect[r],
                "{}: page {page} after reopen",
                p.display()
            );
        }
        // The rest of the image is untouched.
        assert!(read(&img, 0, cs as usize).iter().all(|&x| x == 0));
        drop(img);
        // On disk: the newest segment's entry marks exactly pages 5 and 9.
        let f = FileView::load(p);
        let (meta, _, used) = *f.segments().last().unwrap();
        assert_eq!(used, 1);
        assert_eq!(f.entry(meta, 0, 16), (1, vec![(1 << 5) | (1 << 9)]));
    }
    // The snapshot still has the old cluster.
    let mut img = rw(&snap);
    img.snapshot_apply("before").unwrap();
    assert_eq!(read(&img, cs, cs as usize), old);
}

// ----- bitmap written to the wrong entry past the first segment -----

#[test]
fn second_segment_entries_at_4k_clusters() {
    let dir = tmp();
    let p = dir.path().join("seg.pcow");
    let cs = 4 * KIB;
    let n = 200u64; // N = 126 at 4 KiB: two segments per layer
    let mut img = create(&p, cs, 256 * cs);
    for i in 0..n {
        img.write_at(&pattern(i as u32, cs as usize), i * cs)
            .unwrap();
    }
    img.snapshot_create("base").unwrap();
    // Copy-on-write of 100 bytes in every cluster, at a different place each.
    let at = |i: u64| i * cs + (i * 37) % (cs - 100);
    for i in 0..n {
        img.write_at(&pattern(1000 + i as u32, 100), at(i)).unwrap();
    }
    img.close().unwrap();

    let expect = |i: u64| {
        let mut c = pattern(i as u32, cs as usize);
        let o = (at(i) - i * cs) as usize;
        c[o..o + 100].copy_from_slice(&pattern(1000 + i as u32, 100));
        c
    };
    let img = ro(&p);
    for i in 0..n {
        assert!(read(&img, i * cs, cs as usize) == expect(i), "cluster {i}");
    }
    drop(img);
    // Layout: each layer has segments of 126 and 74 entries; entry i of a
    // segment at M describes cluster M + 1 + i.
    let f = FileView::load(&p);
    let segs = f.segments();
    let shape: Vec<(u32, u32)> = segs.iter().map(|&(_, l, u)| (l, u)).collect();
    assert_eq!(shape, [(0, 126), (0, 74), (1, 126), (1, 74)]);
    for &(meta, layer, used) in &segs[2..] {
        assert_eq!(layer, 1);
        for i in 0..used as usize {
            let (vcn, bitmap) = f.entry(meta, i, 16);
            assert_eq!(bitmap, [1], "vcn {vcn}");
            assert!(
                f.cluster(meta + 1 + i) == expect(vcn).as_slice(),
                "data of vcn {vcn} is not at cluster M + 1 + {i}"
            );
        }
    }
}

#[test]
fn second_segment_partial_bitmaps_at_16k_clusters() {
    let dir = tmp();
    let p = dir.path().join("seg16.pcow");
    let cs = 16 * KIB; // 4 pages, N = 510
    let n = 520u64;
    let mut img = create(&p, cs, n * cs);
    let mut layer0 = Vec::with_capacity((n * cs) as usize);
    for i in 0..n {
        layer0.extend(pattern(i as u32, cs as usize));
    }
    img.write_at(&layer0, 0).unwrap();
    img.snapshot_create("base").unwrap();
    // Layer 1: one page of each of the first 515 clusters, page i % 4.
    let m = 515u64;
    let mut expect = layer0.clone();
    for i in 0..m {
        let off = (i * cs) as usize + (i as usize % 4) * PAGE;
        let page = pattern(5000 + i as u32, PAGE);
        img.write_at(&page, off as u64).unwrap();
        expect[off..off + PAGE].copy_from_slice(&page);
    }
    img.close().unwrap();

    let img = ro(&p);
    for i in 0..n {
        let r = (i * cs) as usize..((i + 1) * cs) as usize;
        assert!(read(&img, i * cs, cs as usize) == expect[r], "cluster {i}");
    }
    drop(img);
    let f = FileView::load(&p);
    let segs = f.segments();
    let shape: Vec<(u32, u32)> = segs.iter().map(|&(_, l, u)| (l, u)).collect();
    assert_eq!(shape, [(0, 510), (0, 10), (1, 510), (1, 5)]);
    let (meta, _, used) = segs[3];
    for i in 0..used as usize {
        let (vcn, bitmap) = f.entry(meta, i, 16);
        assert_eq!(vcn, 510 + i as u64);
        assert_eq!(bitmap, [1 << (vcn % 4)], "vcn {vcn}");
        let page = (vcn % 4) as usize;
        assert!(
            f.cluster(meta + 1 + i)[page * PAGE..(page + 1) * PAGE]
                == pattern(5000 + vcn as u32, PAGE),
            "vcn {vcn}"
        );
    }
}

// ----- bitmap fixed at 32 bits; clusters over 128 KiB overflow it -----

#[test]
fn two_mib_clusters_cow_of_page_300() {
    let dir = tmp();
    let p = dir.path().join("big.pcow");
    let cs = 2 * MIB; // 512 pages, 8 bitmap words
    let old = pattern(7, cs as usize);
    let mut img = create(&p, cs, 2 * cs);
    img.write_at(&old, 0).unwrap();
    img.snapshot_create("s").unwrap();
    let written = [300usize, 511, 32, 128];
    for &pg in &written {
        img.write_at(&pattern(pg as u32, PAGE), (pg * PAGE) as u64)
            .unwrap();
    }
    img.close().unwrap();

    let img = ro(&p);
    let got = read(&img, 0, cs as usize);
    for pg in 0..512 {
        let want = if written.contains(&pg) {
            pattern(pg as u32, PAGE)
        } else {
            old[pg * PAGE..(pg + 1) * PAGE].to_vec()
        };
        assert!(got[pg * PAGE..(pg + 1) * PAGE] == want, "page {pg}");
    }
    drop(img);
    let f = FileView::load(&p);
    let (meta, layer, _) = *f.segments().last().unwrap();
    assert_eq!(layer, 1);
    let (vcn, bitmap) = f.entry(meta, 0, 72);
    assert_eq!(vcn, 0);
    let mut want = vec![0u64; 8];
    for pg in written {
        want[pg / 64] |= 1 << (pg % 64);
    }
    assert_eq!(bitmap, want);
    assert_eq!(bitmap[4], 1 << 44, "page 300 is word 4, bit 44");
}

#[test]
fn last_page_cow_for_every_cluster_size_over_128k() {
    let dir = tmp();
    for bits in 17..=21u32 {
        let cs = 1u64 << bits;
        let pages = (cs / 4096) as usize;
        // The last page, one past the middle, and bit 32 (bit 30 at 128 KiB).
        let cow = [pages - 1, pages / 2 + 1, 32.min(pages - 2)];
        let p = dir.path().join(format!("c{bits}.pcow"));
        let old = pattern(bits, cs as usize);
        let mut img = create(&p, cs, 2 * cs);
        img.write_at(&old, cs).unwrap();
        img.snapshot_create("s").unwrap();
        for pg in cow {
            img.write_at(&pattern(pg as u32, PAGE), cs + (pg * PAGE) as u64)
                .unwrap();
        }
        img.close().unwrap();
        let img = ro(&p);
        let got = read(&img, cs, cs as usize);
        for pg in 0..pages {
            let want = if cow.contains(&pg) {
                pattern(pg as u32, PAGE)
            } else {
                old[pg * PAGE..(pg + 1) * PAGE].to_vec()
            };
            assert!(got[pg * PAGE..(pg + 1) * PAGE] == want, "{cs}: page {pg}");
        }
    }
}

// ----- entry width depends on a build flag -----

#[test]
fn entry_width_is_a_function_of_cluster_bits_only() {
    let dir = tmp();
    for bits in 12..=21u32 {
        let cs = 1u64 << bits;
        let e = spec_entry_size(cs);
        let g = pcow::Geometry::new(bits).unwrap();
        assert_eq!(g.entry_size(), e, "cluster_bits {bits}");
        assert_eq!(g.capacity() as usize, (cs as usize / 2 - 32) / e);

        let p = dir.path().join(format!("w{bits}.pcow"));
        let mut img = create(&p, cs, 8 * cs);
        img.write_at(&[1], 0).unwrap();
        img.write_at(&[2], 5 * cs).unwrap();
        img.close().unwrap();
        let f = FileView::load(&p);
        let at = f.cur(1);
        assert_eq!(f.u32(at + 28), 2, "used");
        // Find entry 1 in the file: the first 8-aligned word after entry 0's
        // vcn that holds vcn 5 (entry 0's bitmap words are all-ones masks).
        let width = (16..f.c / 2 - 32)
            .step_by(8)
            .find(|&o| f.u64(at + 32 + o) == 5)
            .unwrap();
        assert_eq!(width, e, "cluster_bits {bits}: entry size in the file");
        // Entry 0: vcn 0 and a full bitmap of P bits.
        let (vcn, bitmap) = f.entry(1, 0, e);
        assert_eq!(vcn, 0);
        let pages = (cs / 4096) as usize;
        let ones: u32 = bitmap.iter().map(|w| w.count_ones()).sum();
        assert_eq!(ones as usize, pages, "cluster_bits {bits}");
        // Nothing past entry 1.
        assert!(f.b[at + 32 + 2 * e..at + f.c / 2].iter().all(|&x| x == 0));
        // And the library reads back what it wrote.
        let img = ro(&p);
        assert_eq!(read(&img, 5 * cs, 2), [2, 0]);
    }
}

// ----- base name memcpy(..., 48) from argv, no NUL -----

#[test]
fn base_name_longer_than_48_bytes_round_trips() {
    let dir = tmp();
    let d = dir.path();
    // 200 bytes of relative path: three 49-byte directories and a 50-byte file.
    let comp = |c: char| std::iter::repeat_n(c, 49).collect::<String>();
    let rel_dir = format!("{}/{}/{}", comp('a'), comp('b'), comp('c'));
    let name = format!("{rel_dir}/{}.pcow", "d".repeat(45));
    assert_eq!(name.len(), 200);
    std::fs::create_dir_all(d.join(&rel_dir)).unwrap();
    let mut b = create(&d.join(&name), 64 * KIB, MIB);
    b.write_at(b"long name base", 12345).unwrap();
    b.close().unwrap();
    let top = d.join("top.pcow");
    overlay(&top, &name, BaseFormat::Pcow, 64 * KIB)
        .close()
        .unwrap();

    let img = ro(&top);
    assert_eq!(img.base_ref().unwrap().name, name);
    assert_eq!(img.base().unwrap().path(), d.join(&name));
    assert_eq!(read(&img, 12345, 14), b"long name base");
    drop(img);
    let f = FileView::load(&top);
    let h = f.hdr();
    assert_eq!(f.u16(h + 96), 200);
    assert_eq!(&f.b[h + 112..h + 312], name.as_bytes());
    assert_eq!(f.b[h + 312], 0);

    // UTF-8 and the longest name (1023 bytes) round trip; 1024 is refused.
    std::fs::write(d.join("bäse-ü.raw"), b"utf8").unwrap();
    let t = d.join("utf8.pcow");
    overlay(&t, "bäse-ü.raw", BaseFormat::Raw, 64 * KIB)
        .close()
        .unwrap();
    assert_eq!(ro(&t).base_ref().unwrap().name, "bäse-ü.raw");
    let longest = format!("{}base.raw1", "./".repeat(507));
    assert_eq!(longest.len(), 1023);
    std::fs::write(d.join("base.raw1"), b"max").unwrap();
    let t = d.join("max.pcow");
    overlay(&t, &longest, BaseFormat::Raw, 64 * KIB)
        .close()
        .unwrap();
    let img = ro(&t);
    assert_eq!(img.base_ref().unwrap().name, longest);
    assert_eq!(read(&img, 0, 4), b"max\0");
    let e = Image::create(
        d.join("toolong.pcow"),
        &CreateOptions {
            base: Some(BaseRef {
                name: format!(".{longest}"),
                format: BaseFormat::Raw,
            }),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::Invalid(_)), "{e:?}");
}

// ----- relative base resolved against the working directory -----
// In tests/relative_base.rs: it runs a child process, and a fork of this
// multi-threaded test binary would briefly hold every other test's image
// locks (flock locks follow the file description into the child).

// ----- missing base silently created empty -----

#[test]
fn missing_base_is_an_error_and_is_not_created() {
    let dir = tmp();
    let d = dir.path();
    for format in [BaseFormat::Probe, BaseFormat::Raw, BaseFormat::Pcow] {
        let e = Image::create(
            d.join("top.pcow"),
            &CreateOptions {
                virtual_size: Some(MIB),
                base: Some(BaseRef {
                    name: "missing.img".into(),
                    format,
                }),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(matches!(e, Error::BaseMissing { .. }), "{e:?}");
        assert!(!d.join("missing.img").exists(), "{format:?}: base created");
    }
    // An existing overlay whose base went away.
    create(&d.join("gone.pcow"), 64 * KIB, MIB).close().unwrap();
    overlay(&d.join("o.pcow"), "gone.pcow", BaseFormat::Pcow, 64 * KIB)
        .close()
        .unwrap();
    std::fs::remove_file(d.join("gone.pcow")).unwrap();
    for opts in [OpenOptions::read_only(), OpenOptions::read_write()] {
        let e = Image::open(d.join("o.pcow"), opts).unwrap_err();
        assert!(
            matches!(e, Error::BaseMissing { ref resolved, .. } if resolved == &d.join("gone.pcow")),
            "{e:?}"
        );
        assert!(!d.join("gone.pcow").exists(), "base created by the open");
    }
    let r = pcow::check::check(&d.join("o.pcow"), None, false).unwrap();
    assert_eq!(r.exit_code(), 2);
    assert!(!d.join("gone.pcow").exists(), "base created by check");
}

// ----- two-level chain recurses forever -----

#[test]
fn two_level_chain_reads_correctly_and_terminates() {
    for bottom_raw in [false, true] {
        let dir = tmp();
        let d = dir.path().to_owned();
        let size = MIB as usize;
        let mut model = vec![0u8; size];
        // Bottom: 4 KiB clusters (or raw); mid: 64 KiB; top: 16 KiB.
        let base_data = pattern(1, 3 * 64 * KIB as usize);
        if bottom_raw {
            // 1 MiB like the pcow bottom (an overlay takes its base's size).
            let mut bytes = base_data.clone();
            bytes.resize(size, 0);
            std::fs::write(d.join("base"), &bytes).unwrap();
        } else {
            let mut b = create(&d.join("base"), 4 * KIB, MIB);
            b.write_at(&base_data, 0).unwrap();
            b.close().unwrap();
        }
        model[..base_data.len()].copy_from_slice(&base_data);
        let fmt = if bottom_raw {
            BaseFormat::Raw
        } else {
            BaseFormat::Pcow
        };
        // (offset, seed, length)
        let mid_writes: [(u64, u32, usize); 3] = [
            (2 * 4096, 2, 4096),       // one page of vcn 0
            (64 * 1024 + 10, 3, 5000), // inside vcn 1
            (512 * 1024, 4, 70000),    // past the base's data
        ];
        let top_writes: [(u64, u32, usize); 3] = [
            (3 * 4096, 5, 4096),   // next to mid's page
            (2 * 4096 + 7, 6, 11), // inside mid's page
            (MIB - 3000, 7, 3000), // the end
        ];
        let mut mid = overlay(&d.join("mid.pcow"), "base", fmt, 64 * KIB);
        for (off, seed, len) in mid_writes {
            let data = pattern(seed, len);
            mid.write_at(&data, off).unwrap();
            model[off as usize..off as usize + len].copy_from_slice(&data);
        }
        mid.close().unwrap();
        let mut top = overlay(&d.join("top.pcow"), "mid.pcow", BaseFormat::Pcow, 16 * KIB);
        for (off, seed, len) in top_writes {
            let data = pattern(seed, len);
            top.write_at(&data, off).unwrap();
            model[off as usize..off as usize + len].copy_from_slice(&data);
        }
        top.close().unwrap();
        let got = within(60, "reading a two-level chain", move || {
            let img = ro(&d.join("top.pcow"));
            assert_eq!(img.base().unwrap().depth(), 2);
            read(&img, 0, size)
        });
        assert!(got == model, "raw bottom {bottom_raw}: content differs");
    }
}

#[test]
fn closing_a_cycle_is_refused_and_terminates() {
    let dir = tmp();
    let d = dir.path().to_owned();
    create(&d.join("b.pcow"), 64 * KIB, MIB).close().unwrap();
    overlay(&d.join("a.pcow"), "b.pcow", BaseFormat::Pcow, 64 * KIB)
        .close()
        .unwrap();
    let before = std::fs::read(d.join("b.pcow")).unwrap();
    // Recreating b as an overlay of a would make a -> b -> a.
    let r = within(60, "creating a cycle", move || {
        let r = Image::create(
            d.join("b.pcow"),
            &CreateOptions {
                base: Some(BaseRef {
                    name: "a.pcow".into(),
                    format: BaseFormat::Pcow,
                }),
                ..Default::default()
            },
        )
        .map(|_| ());
        (r, d)
    });
    let (r, d) = r;
    assert!(matches!(r, Err(Error::ChainCycle { .. })), "{r:?}");
    assert_eq!(std::fs::read(d.join("b.pcow")).unwrap(), before);
    let img = within(60, "opening a", move || {
        Image::open(d.join("a.pcow"), OpenOptions::read_only()).map(|i| i.base().unwrap().depth())
    });
    assert_eq!(img.unwrap(), 1);
}

// ----- reads allocate clusters -----

#[test]
fn reads_do_not_allocate_or_write() {
    let dir = tmp();
    let d = dir.path();
    let mut b = create(&d.join("base.pcow"), 64 * KIB, 2 * MIB);
    b.write_at(&pattern(1, 300_000), 50_000).unwrap();
    b.close().unwrap();
    let top = d.join("top.pcow");
    let mut img = overlay(&top, "base.pcow", BaseFormat::Pcow, 64 * KIB);
    img.write_at(&pattern(2, 5000), 70_000).unwrap();
    img.snapshot_create("s").unwrap();
    img.write_at(&pattern(3, 100), 200_000).unwrap();
    img.close().unwrap();
    let base_bytes = std::fs::read(d.join("base.pcow")).unwrap();

    // A writer's handle and a reader's: reads must not change the file.
    for writable in [true, false] {
        let img = Image::open(
            &top,
            OpenOptions {
                writable,
                ..Default::default()
            },
        )
        .unwrap();
        let bytes = std::fs::read(&top).unwrap();
        let (alloc, end, gen) = (
            img.allocated_clusters(),
            img.cluster_count(),
            img.generation(),
        );
        let vs = img.virtual_size();
        let whole = read(&img, 0, vs as usize);
        for (chunk, step) in [(4096usize, 4096u64), (1000, 777), (70_001, 65_537)] {
            let mut off = 0;
            while off + chunk as u64 <= vs {
                assert!(read(&img, off, chunk) == whole[off as usize..off as usize + chunk]);
                off += step;
            }
        }
        let _ = img.extents();
        assert_eq!(img.allocated_clusters(), alloc, "writable {writable}");
        assert_eq!(img.cluster_count(), end, "writable {writable}");
        assert_eq!(img.generation(), gen, "writable {writable}");
        assert!(
            std::fs::read(&top).unwrap() == bytes,
            "writable {writable}: the file changed"
        );
        assert!(
            std::fs::read(d.join("base.pcow")).unwrap() == base_bytes,
            "the base changed"
        );
        if writable {
            let mut img = img;
            img.flush().unwrap();
            assert_eq!(img.allocated_clusters(), alloc);
            assert!(
                std::fs::read(&top).unwrap() == bytes,
                "flush after reads wrote"
            );
        }
    }
}

// ----- no global state -----

#[test]
fn two_images_open_at_once_with_interleaved_writes() {
    let dir = tmp();
    let (pa, pb) = (dir.path().join("a.pcow"), dir.path().join("b.pcow"));
    let (sa, sb) = (MIB as usize, 3 * MIB as usize);
    let mut a = create(&pa, 4 * KIB, sa as u64);
    let mut b = create(&pb, 64 * KIB, sb as u64);
    let (mut ma, mut mb) = (vec![0u8; sa], vec![0u8; sb]);
    for i in 0..60u32 {
        let len = 1 + (i as usize * 997) % 9000;
        let oa = (i as usize * 15_013) % (sa - len);
        let ob = (i as usize * 48_611) % (sb - len);
        let (da, db) = (pattern(i, len), pattern(i + 500, len));
        a.write_at(&da, oa as u64).unwrap();
        b.write_at(&db, ob as u64).unwrap();
        ma[oa..oa + len].copy_from_slice(&da);
        mb[ob..ob + len].copy_from_slice(&db);
        if i == 20 {
            a.snapshot_create("a20").unwrap();
        }
        if i % 10 == 0 {
            b.flush().unwrap();
        }
    }
    assert!(read(&a, 0, sa) == ma && read(&b, 0, sb) == mb);
    assert_eq!(a.snapshots().len(), 1);
    assert!(b.snapshots().is_empty());
    a.close().unwrap();
    b.close().unwrap();
    // Two readers of different images, and two of the same, at once.
    let (ra, rb, ra2) = (ro(&pa), ro(&pb), ro(&pa));
    assert!(read(&ra, 0, sa) == ma);
    assert!(read(&rb, 0, sb) == mb);
    assert!(read(&ra2, 0, sa) == ma);
    drop((ra, rb, ra2));

    // And from two threads at once.
    let handles: Vec<_> = [(pa, sa, 1u32), (pb, sb, 2)]
        .into_iter()
        .map(|(p, size, seed)| {
            std::thread::spawn(move || {
                let mut img = rw(&p);
                let mut model = read(&img, 0, size);
                for i in 0..50u32 {
                    let off = (i as usize * 20_011 * seed as usize) % (size - 4096);
                    let data = pattern(i * seed, 4096);
                    img.write_at(&data, off as u64).unwrap();
                    model[off..off + 4096].copy_from_slice(&data);
                }
                img.close().unwrap();
                assert!(read(&ro(&p), 0, size) == model);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

// ----- no fsync, no locking, no checksums -----

fn expect_locked(r: pcow::Result<Image>, what: &str) {
    match r {
        Err(Error::Locked { .. }) => {}
        Err(e) => panic!("{what}: expected Locked, got {e:?}"),
        Ok(_) => panic!("{what}: opened, expected Locked"),
    }
}

#[test]
fn locking_one_writer_or_many_readers() {
    let dir = tmp();
    let d = dir.path();
    let p = d.join("l.pcow");
    let mut w = create(&p, 64 * KIB, MIB);
    w.write_at(b"w", 0).unwrap();
    expect_locked(Image::open(&p, OpenOptions::read_write()), "second writer");
    expect_locked(
        Image::open(&p, OpenOptions::read_only()),
        "reader during a writer",
    );
    assert!(matches!(
        pcow::check::check(&p, None, false),
        Err(Error::Locked { .. })
    ));
    // `-U`: a reader that takes no lock.
    let shared = Image::open(
        &p,
        OpenOptions {
            force_share: true,
            ..Default::default()
        },
    )
    .unwrap();
    drop(shared);
    w.close().unwrap();

    let r1 = ro(&p);
    let r2 = ro(&p);
    assert_eq!(read(&r1, 0, 1), b"w");
    assert_eq!(read(&r2, 0, 1), b"w");
    expect_locked(
        Image::open(&p, OpenOptions::read_write()),
        "writer during readers",
    );
    drop(r1);
    expect_locked(
        Image::open(&p, OpenOptions::read_write()),
        "writer during a reader",
    );
    drop(r2);
    rw(&p).close().unwrap();

    // A writer of an overlay holds its base shared: no writer on the base.
    let mut o = overlay(&d.join("o.pcow"), "l.pcow", BaseFormat::Pcow, 64 * KIB);
    o.write_at(b"o", 1).unwrap();
    expect_locked(
        Image::open(&p, OpenOptions::read_write()),
        "writer of a base in use",
    );
    assert_eq!(read(&ro(&p), 0, 2), b"w\0", "readers of the base are fine");
    o.close().unwrap();
    rw(&p).close().unwrap();
}

#[test]
fn damaged_meta_slot_is_detected_not_read() {
    let dir = tmp();
    let p = dir.path().join("m.pcow");
    let mut img = create(&p, 16 * KIB, MIB);
    img.write_at(&pattern(1, 16 << 10), 0).unwrap();
    img.close().unwrap();
    let f = FileView::load(&p);
    let at = f.cur(1);
    let mut bytes = f.b.clone();
    bytes[at + 32 + 8] ^= 0x02; // entry 0's bitmap: a page that is not there
    std::fs::write(&p, &bytes).unwrap();
    match Image::open(&p, OpenOptions::read_only()) {
        Err(Error::Format { source, .. }) => {
            assert_eq!(source.rule(), "R6", "{source}");
            assert!(source.to_string().contains("crc32c mismatch"), "{source}");
        }
        other => panic!("expected a CRC error, got {other:?}"),
    }
}

// ----- virtual size in GB -----

#[test]
fn virtual_size_is_in_bytes() {
    let dir = tmp();
    let p = dir.path().join("v.pcow");
    let size = 3 * MIB;
    let mut img = create(&p, 64 * KIB, size);
    assert_eq!(img.virtual_size(), size);
    img.write_at(b"Z", size - 1).unwrap();
    img.write_at(b"ab", size - 3).unwrap();
    assert!(matches!(
        img.write_at(b"xy", size - 1),
        Err(Error::OutOfRange { .. })
    ));
    let mut one = [0u8; 1];
    assert!(matches!(
        img.read_at(&mut one, size),
        Err(Error::OutOfRange { .. })
    ));
    img.close().unwrap();
    let img = ro(&p);
    assert_eq!(img.virtual_size(), size);
    assert_eq!(read(&img, size - 4, 4), b"\0abZ");
    let f = FileView::load(&p);
    assert_eq!(f.u64(f.hdr() + 56), size, "stored in bytes");

    // Any multiple of the cluster size: 5 clusters of 4 KiB.
    let p = dir.path().join("v4.pcow");
    let mut img = create(&p, 4 * KIB, 5 * 4096);
    img.write_at(b"e", 5 * 4096 - 1).unwrap();
    img.close().unwrap();
    assert_eq!(ro(&p).virtual_size(), 20480);
    assert_eq!(read(&ro(&p), 20479, 1), b"e");
    // Not a multiple of the cluster size: refused, not rounded.
    let e = Image::create(
        dir.path().join("odd.pcow"),
        &CreateOptions {
            cluster_size: Some(64 * KIB),
            virtual_size: Some(size + 4096),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::Invalid(_)), "{e:?}");
}

#[test]
fn write_to_the_last_virtual_cluster_terminates_and_reads_back() {
    let dir = tmp();
    let d = dir.path().to_owned();
    within(60, "writing the last cluster", move || {
        for (cs, size) in [(64 * KIB, MIB), (4 * KIB, 1u64 << 56), (2 * MIB, 1 << 56)] {
            let p = d.join(format!("last-{cs}.pcow"));
            let mut img = create(&p, cs, size);
            let last = pattern(9, cs as usize);
            img.write_at(&last, size - cs).unwrap();
            // A write across the last two clusters, and the very last byte.
            let across = pattern(10, 2 * PAGE);
            img.write_at(&across, size - cs - PAGE as u64).unwrap();
            img.write_at(b"!", size - 1).unwrap();
            img.close().unwrap();
            let img = ro(&p);
            let mut want = last.clone();
            want[..PAGE].copy_from_slice(&across[PAGE..]);
            *want.last_mut().unwrap() = b'!';
            assert!(
                read(&img, size - cs, cs as usize) == want,
                "cluster size {cs}"
            );
            assert!(read(&img, size - cs - PAGE as u64, PAGE) == across[..PAGE]);
            assert_eq!(img.allocated_clusters(), 2);
            // The file holds two data clusters, not one per virtual cluster.
            let len = std::fs::metadata(&p).unwrap().len();
            assert!(len <= 5 * cs, "cluster size {cs}: file is {len} bytes");
        }
    });
}
