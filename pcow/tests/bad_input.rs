//! Bad images: every kind of malformed input is a clear error that names
//! the rule, the field and its file offset, never a panic
//! (`docs/pcow-format.md`, rules R1..R11).
//!
//! Header-only images are laid out by hand, field by field ([`Hdr`]), so
//! the test depends on the spec's table and not on the library's encoder.
//! Images with content are made with the library and then patched; every
//! patched metadata slot is re-sealed with the CRC32C implemented here
//! (bitwise Castagnoli), so that the field check, not the CRC, is what
//! fails. Each case also runs `pcow::check::check` and asserts its exit
//! code (2 for R-rule corruption).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use error_report::chain as error_chain;
use pcow::check::{check, CheckReport, Repair};
use pcow::{BaseFormat, BaseRef, CreateOptions, Error, FormatError, Image, OpenOptions};

// ----- field offsets (spec: "Super cluster (header slot)") -----

const MAGIC: &[u8; 8] = b"PCOW\r\n\x1a\n";
const H_VERSION: usize = 8;
const H_HEADER_LENGTH: usize = 12;
const H_CLUSTER_BITS: usize = 16;
const H_CRC: usize = 20;
const H_INCOMPAT: usize = 24;
const H_COMPAT: usize = 32;
const H_AUTOCLEAR: usize = 40;
const H_GENERATION: usize = 48;
const H_VIRTUAL_SIZE: usize = 56;
const H_CLUSTER_COUNT: usize = 64;
const H_DATA_CLUSTER_COUNT: usize = 72;
const H_ACTIVE_LAYER: usize = 80;
const H_LAYER_COUNT: usize = 84;
const H_SNAPSHOT_COUNT: usize = 88;
const H_NEXT_SNAPSHOT_ID: usize = 92;
const H_BASE_NAME_LENGTH: usize = 96;
const H_BASE_FORMAT: usize = 98;
/// Where the base name starts in a header written by version 1.
const H_BASE_NAME: usize = 112;

// ----- meta and snapshot slots (spec: "Meta cluster slot", "Snapshot cluster slot") -----

const META_MAGIC: &[u8; 4] = b"PMET";
const SNAP_MAGIC: &[u8; 4] = b"PSNP";
const S_CRC: usize = 4;
const S_GENERATION: usize = 8;
const S_SELF_CLUSTER: usize = 16;
const M_LAYER: usize = 24;
const M_USED: usize = 28;
const M_ENTRIES: usize = 32;
const P_LAYER: usize = 24;
const P_PARENT_LAYER: usize = 28;
const P_SNAPSHOT_ID: usize = 32;
const P_TAG_LENGTH: usize = 36;
const P_TIME_NSEC: usize = 48;
const P_VM_STATE_OFFSET: usize = 56;
const P_VM_STATE_SIZE: usize = 64;
const P_TAG: usize = 128;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

// ----- CRC32C and little-endian helpers -----

/// CRC32C (Castagnoli), bitwise: reflected polynomial 0x82F63B78.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Sets the slot's CRC the way the spec says: over the whole slot with the
/// `crc32c` field zeroed.
fn seal(slot: &mut [u8], crc_at: usize) {
    slot[crc_at..crc_at + 4].fill(0);
    let c = crc32c(slot);
    slot[crc_at..crc_at + 4].copy_from_slice(&c.to_le_bytes());
}

fn crc_ok(slot: &[u8], crc_at: usize) -> bool {
    let mut copy = slot.to_vec();
    seal(&mut copy, crc_at);
    copy[crc_at..crc_at + 4] == slot[crc_at..crc_at + 4]
}

fn get16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}
fn get32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn get64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

// ----- a header slot laid out by hand -----

/// The fields of a header slot, in the order of the spec's table.
#[derive(Clone, Debug)]
struct Hdr {
    version: u32,
    header_length: u32,
    cluster_bits: u32,
    incompatible: u64,
    compatible: u64,
    autoclear: u64,
    generation: u64,
    virtual_size: u64,
    cluster_count: u64,
    data_cluster_count: u64,
    active_layer: u32,
    layer_count: u32,
    snapshot_count: u32,
    next_snapshot_id: u32,
    base_name_length: u16,
    base_format: u8,
    base_name: Vec<u8>,
}

impl Hdr {
    /// A valid, empty image: 64 KiB clusters, 1 MiB, only the super cluster.
    fn valid() -> Hdr {
        Hdr {
            version: 1,
            header_length: 112,
            cluster_bits: 16,
            incompatible: 0,
            compatible: 0,
            autoclear: 0,
            generation: 1,
            virtual_size: MIB,
            cluster_count: 1,
            data_cluster_count: 0,
            active_layer: 0,
            layer_count: 1,
            snapshot_count: 0,
            next_snapshot_id: 1,
            base_name_length: 0,
            base_format: 0,
            base_name: Vec::new(),
        }
    }

    fn with_base(mut self, name: &[u8], format: u8) -> Hdr {
        self.base_name_length = name.len() as u16;
        self.base_name = name.to_vec();
        self.base_format = format;
        self
    }

    /// One header slot of `slot_len` bytes, field by field, sealed.
    fn slot(&self, slot_len: usize) -> Vec<u8> {
        let mut s = vec![0u8; slot_len];
        s[0..8].copy_from_slice(MAGIC); // magic
        put32(&mut s, H_VERSION, self.version); // version
        put32(&mut s, H_HEADER_LENGTH, self.header_length); // header_length
        put32(&mut s, H_CLUSTER_BITS, self.cluster_bits); // cluster_bits
        put32(&mut s, H_CRC, 0); // crc32c: sealed below
        put64(&mut s, H_INCOMPAT, self.incompatible); // incompatible_features
        put64(&mut s, H_COMPAT, self.compatible); // compatible_features
        put64(&mut s, H_AUTOCLEAR, self.autoclear); // autoclear_features
        put64(&mut s, H_GENERATION, self.generation); // generation
        put64(&mut s, H_VIRTUAL_SIZE, self.virtual_size); // virtual_size
        put64(&mut s, H_CLUSTER_COUNT, self.cluster_count); // cluster_count
        put64(&mut s, H_DATA_CLUSTER_COUNT, self.data_cluster_count); // data_cluster_count
        put32(&mut s, H_ACTIVE_LAYER, self.active_layer); // active_layer
        put32(&mut s, H_LAYER_COUNT, self.layer_count); // layer_count
        put32(&mut s, H_SNAPSHOT_COUNT, self.snapshot_count); // snapshot_count
        put32(&mut s, H_NEXT_SNAPSHOT_ID, self.next_snapshot_id); // next_snapshot_id
        put16(&mut s, H_BASE_NAME_LENGTH, self.base_name_length); // base_name_length
        s[H_BASE_FORMAT] = self.base_format; // base_format
        s[99..112].fill(0); // reserved
        let at = (self.header_length as usize).min(slot_len); // base_name
        let n = self.base_name.len().min(slot_len - at);
        s[at..at + n].copy_from_slice(&self.base_name[..n]);
        seal(&mut s, H_CRC);
        s
    }

    /// The super cluster: slot A holds this header, slot B is zero (never
    /// written). The layout uses the cluster size of `cluster_bits`, or
    /// 64 KiB when the field is out of range.
    fn image(&self) -> Vec<u8> {
        let c = if (12..=21).contains(&self.cluster_bits) {
            1usize << self.cluster_bits
        } else {
            64 << 10
        };
        let mut file = vec![0u8; c];
        file[..c / 2].copy_from_slice(&self.slot(c / 2));
        file
    }
}

// ----- an image file's bytes, with the slot logic of the spec -----

struct Raw {
    b: Vec<u8>,
    /// Cluster size `C`.
    c: usize,
}

impl Raw {
    fn load(p: &Path) -> Raw {
        Raw::from_bytes(std::fs::read(p).unwrap())
    }
    fn from_bytes(b: Vec<u8>) -> Raw {
        let c = 1usize << get32(&b, H_CLUSTER_BITS);
        Raw { b, c }
    }
    fn save(&self, p: &Path) {
        std::fs::write(p, &self.b).unwrap();
    }
    /// Slot size `S`.
    fn s(&self) -> usize {
        self.c / 2
    }
    fn header_valid(&self, at: usize) -> bool {
        self.b.len() >= at + self.s()
            && &self.b[at..at + 8] == MAGIC
            && crc_ok(&self.b[at..at + self.s()], H_CRC)
    }
    /// Byte offset of the current header slot (0 or `S`).
    fn hdr(&self) -> usize {
        [0, self.s()]
            .into_iter()
            .filter(|&at| self.header_valid(at))
            .max_by_key(|&at| get64(&self.b, at + H_GENERATION))
            .expect("a valid header slot")
    }
    fn committed_gen(&self) -> u64 {
        get64(&self.b, self.hdr() + H_GENERATION)
    }
    fn hdr_u64(&self, field: usize) -> u64 {
        get64(&self.b, self.hdr() + field)
    }
    fn hdr_u32(&self, field: usize) -> u32 {
        get32(&self.b, self.hdr() + field)
    }
    fn hdr_u16(&self, field: usize) -> u16 {
        get16(&self.b, self.hdr() + field)
    }
    /// Byte offset of the current slot of metadata cluster `cluster`.
    fn cur(&self, cluster: usize) -> usize {
        let g = self.committed_gen();
        [0, self.s()]
            .into_iter()
            .map(|half| cluster * self.c + half)
            .filter(|&at| {
                let slot = &self.b[at..at + self.s()];
                (&slot[..4] == META_MAGIC || &slot[..4] == SNAP_MAGIC)
                    && crc_ok(slot, S_CRC)
                    && get64(slot, S_SELF_CLUSTER) == cluster as u64
                    && get64(slot, S_GENERATION) <= g
            })
            .max_by_key(|&at| get64(&self.b, at + S_GENERATION))
            .unwrap_or_else(|| panic!("no current slot in cluster {cluster}"))
    }
    /// The structures from cluster 1 to the committed end: (cluster, magic).
    fn structures(&self) -> Vec<(usize, [u8; 4])> {
        let cc = self.hdr_u64(H_CLUSTER_COUNT) as usize;
        let mut out = Vec::new();
        let mut pos = 1;
        while pos < cc {
            let at = self.cur(pos);
            let magic: [u8; 4] = self.b[at..at + 4].try_into().unwrap();
            out.push((pos, magic));
            pos += if &magic == META_MAGIC {
                1 + get32(&self.b, at + M_USED) as usize
            } else {
                1
            };
        }
        out
    }
    fn metas(&self) -> Vec<usize> {
        self.structures()
            .into_iter()
            .filter(|(_, m)| m == META_MAGIC)
            .map(|(c, _)| c)
            .collect()
    }
    fn snaps(&self) -> Vec<usize> {
        self.structures()
            .into_iter()
            .filter(|(_, m)| m == SNAP_MAGIC)
            .map(|(c, _)| c)
            .collect()
    }
    /// Applies `f` to every header slot that is valid, and re-seals it.
    fn patch_header(&mut self, f: impl Fn(&mut [u8])) {
        let s = self.s();
        for at in [0, s] {
            if self.header_valid(at) {
                f(&mut self.b[at..at + s]);
                seal(&mut self.b[at..at + s], H_CRC);
            }
        }
    }
    /// Applies `f` to both slots of a metadata cluster (those that hold a
    /// slot at all), and re-seals them.
    fn patch_slots(&mut self, cluster: usize, f: impl Fn(&mut [u8])) {
        let s = self.s();
        for half in [0, s] {
            let at = cluster * self.c + half;
            let slot = &mut self.b[at..at + s];
            if &slot[..4] == META_MAGIC || &slot[..4] == SNAP_MAGIC {
                f(slot);
                seal(slot, S_CRC);
            }
        }
    }
}

// ----- images, errors, checks -----

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Bytes that are never zero and differ with `seed`.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            ((i as u32)
                .wrapping_mul(7)
                .wrapping_add(u32::from(seed) * 13) as u8)
                | 1
        })
        .collect()
}

fn create(path: &Path, cluster_size: u64, virtual_size: u64) -> Image {
    let opts = CreateOptions {
        cluster_size: Some(cluster_size),
        virtual_size: Some(virtual_size),
        ..Default::default()
    };
    Image::create(path, &opts).unwrap()
}

fn create_with_base(path: &Path, name: &str, format: BaseFormat, cluster_size: u64) -> Image {
    let opts = CreateOptions {
        cluster_size: Some(cluster_size),
        virtual_size: None,
        base: Some(BaseRef {
            name: name.to_owned(),
            format,
        }),
    };
    Image::create(path, &opts).unwrap()
}

/// 16 KiB clusters (4 pages), 128 KiB: vcn 0 and 1 written in full, one
/// segment (meta at cluster 1, data at 2 and 3).
fn two_cluster_image(dir: &Path) -> PathBuf {
    let p = dir.join("two.pcow");
    let mut img = create(&p, 16 * KIB, 128 * KIB);
    img.write_at(&pattern(1, 32 << 10), 0).unwrap();
    img.close().unwrap();
    p
}

/// 16 KiB clusters, 128 KiB, three layers: vcn 0 in layer 0, snapshot s1
/// (layer 1), one page of vcn 0 and all of vcn 1 in layer 1, snapshot s2
/// (layer 2), one page of vcn 2 in layer 2.
fn layered_image(dir: &Path) -> PathBuf {
    let p = dir.join("layered.pcow");
    let mut img = create(&p, 16 * KIB, 128 * KIB);
    img.write_at(&pattern(1, 16 << 10), 0).unwrap();
    img.snapshot_create("s1").unwrap();
    img.write_at(&pattern(2, 4096), 8192).unwrap();
    img.write_at(&pattern(3, 16 << 10), 16 << 10).unwrap();
    img.snapshot_create("s2").unwrap();
    img.write_at(&pattern(4, 100), (32 << 10) + 5000).unwrap();
    img.close().unwrap();
    p
}

fn read_all(img: &Image) -> Vec<u8> {
    let mut buf = vec![0u8; img.virtual_size() as usize];
    img.read_at(&mut buf, 0).unwrap();
    buf
}

fn open_ro(path: &Path) -> pcow::Result<Image> {
    Image::open(path, OpenOptions::read_only())
}

/// The format error of a strict read-only open (the open must fail with one).
fn format_err(path: &Path) -> FormatError {
    match open_ro(path) {
        Err(Error::Format { source, .. }) => source,
        Err(e) => panic!("expected a format error, got {e:?}"),
        Ok(_) => panic!("{} opened, expected a format error", path.display()),
    }
}

/// Asserts the open fails with a format error of `rule` whose message names
/// file offset `offset`; returns the error for variant checks.
fn expect_rule(path: &Path, rule: &str, offset: u64) -> FormatError {
    let e = format_err(path);
    let msg = e.to_string();
    assert_eq!(e.rule(), rule, "{msg}");
    assert!(msg.starts_with(&format!("{rule}:")), "{msg}");
    assert!(
        msg.contains(&format!("offset {offset}")),
        "{msg}: does not name offset {offset}"
    );
    // The library error shows the rule through its source chain, with the path.
    let full = error_chain(&open_ro(path).unwrap_err());
    assert!(full.contains(&path.display().to_string()) && full.contains(rule));
    // A read-write open refuses the same image the same way. It runs on a
    // copy: a failed read-write open currently rewrites the file (see
    // `failed_read_write_open_leaves_the_file_unchanged`).
    let copy = path.with_extension("rw-copy");
    std::fs::copy(path, &copy).unwrap();
    match Image::open(&copy, OpenOptions::read_write()) {
        Err(Error::Format { source, .. }) => {
            assert_eq!(source.rule(), e.rule(), "read-write open: {source}")
        }
        other => panic!("read-write open: expected {e:?}, got {other:?}"),
    }
    std::fs::remove_file(&copy).unwrap();
    e
}

fn run_check(path: &Path) -> CheckReport {
    check(path, None, false).unwrap_or_else(|e| panic!("check failed: {}", error_chain(&e)))
}

/// `check` reports corruption of `rule` (exit code 2).
fn expect_check(path: &Path, rule: &str) -> CheckReport {
    let r = run_check(path);
    assert_eq!(r.exit_code(), 2, "{:#?}", r);
    assert!(
        r.corruptions.iter().any(|f| f.rule == rule),
        "no {rule} finding in {:#?}",
        r.corruptions
    );
    r
}

fn expect_clean(path: &Path) {
    let r = run_check(path);
    assert_eq!(r.exit_code(), 0, "{r:#?}");
}

// ----- the CRC and the hand-built layout -----

#[test]
fn crc32c_matches_the_castagnoli_check_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(b""), 0);
}

#[test]
fn hand_built_header_matches_the_library_encoder_and_opens() {
    for bits in [12u32, 16, 21] {
        let g = pcow::Geometry::new(bits).unwrap();
        let mut h = Hdr::valid();
        h.cluster_bits = bits;
        h.virtual_size = 4 << bits;
        let mut lib = pcow::Header::new(g, h.virtual_size, None);
        lib.generation = 1;
        assert_eq!(h.slot(g.slot_size()), lib.encode(), "cluster_bits {bits}");

        let h = h.with_base(b"dir/base.raw", 1);
        let lib = pcow::Header {
            base: Some(BaseRef {
                name: "dir/base.raw".into(),
                format: BaseFormat::Raw,
            }),
            ..lib
        };
        assert_eq!(h.slot(g.slot_size()), lib.encode(), "with a base name");
    }
    let dir = tmp();
    let p = write_file(dir.path(), "hand.pcow", &Hdr::valid().image());
    let img = open_ro(&p).unwrap();
    assert_eq!(img.virtual_size(), MIB);
    assert_eq!(read_all(&img), vec![0u8; MIB as usize]);
    drop(img);
    expect_clean(&p);
}

// ----- truncated files -----

#[test]
fn truncated_files_are_errors() {
    let dir = tmp();
    let full = std::fs::read(layered_image(dir.path())).unwrap();
    let raw = Raw::from_bytes(full.clone());
    let (c, s) = (raw.c, raw.s());
    let hdr = raw.hdr() as u64;
    let cc = raw.hdr_u64(H_CLUSTER_COUNT);
    // The last structure is a segment: cut it in the middle of its last
    // data cluster.
    let mid_segment = full.len() - c / 2;
    let cases: [(usize, &str); 8] = [
        (0, "not pcow"),
        (7, "not pcow"),
        (8, "R1"),
        (100, "R1"),
        (s / 2, "R1"),
        (s + s / 2, "R5"),
        (c, "R5"),
        (mid_segment, "R5"),
    ];
    for (len, want) in cases {
        let p = write_file(dir.path(), &format!("cut-{len}.pcow"), &full[..len]);
        let e = format_err(&p);
        let msg = e.to_string();
        if want == "not pcow" {
            assert_eq!(e, FormatError::NotPcow, "{len} bytes");
            // check cannot start on a file that is not pcow: an error, not a report.
            let ce = check(&p, None, false).unwrap_err();
            assert!(error_chain(&ce).contains("not a pcow image"), "{ce}");
            continue;
        }
        assert_eq!(e.rule(), want, "{len} bytes: {msg}");
        match e {
            FormatError::ClusterCount {
                value,
                file_clusters,
                offset,
            } => {
                assert_eq!(file_clusters, len as u64 / c as u64, "{len} bytes");
                assert!(value > file_clusters, "{len} bytes");
                assert!(msg.contains(&format!("offset {offset}")), "{msg}");
                if len >= c {
                    // Both header slots are in the file: the current one counts.
                    assert_eq!((value, offset), (cc, hdr + H_CLUSTER_COUNT as u64));
                }
            }
            // Shorter than the smallest header slot: said as such.
            FormatError::Truncated { len: l } => assert_eq!(l, len as u64),
            FormatError::NoValidHeader { .. } | FormatError::ClusterBits { .. } => {}
            other => panic!("{len} bytes: unexpected {other:?}"),
        }
        expect_check(&p, want);
    }
    // Cut right after slot A of the header: slot A is complete and valid
    // (when slot B is current, slot A holds the previous version), but not
    // even the super cluster is in the file.
    let p = write_file(dir.path(), "cut-slot.pcow", &full[..s]);
    let e = format_err(&p);
    assert!(
        matches!(
            e,
            FormatError::ClusterCount {
                file_clusters: 0,
                ..
            }
        ),
        "{e:?}"
    );
    expect_check(&p, "R5");
}

// ----- header fields out of range -----

/// Writes `h` as a header-only image and expects `rule` at `offset`.
fn header_case(dir: &Path, name: &str, h: &Hdr, rule: &str, offset: u64) -> FormatError {
    let p = write_file(dir, name, &h.image());
    let e = expect_rule(&p, rule, offset);
    expect_check(&p, rule);
    e
}

#[test]
fn header_version_other_than_1() {
    let dir = tmp();
    for v in [0u32, 2, u32::MAX] {
        let h = Hdr {
            version: v,
            ..Hdr::valid()
        };
        let e = header_case(dir.path(), &format!("v{v}.pcow"), &h, "R1", 8);
        assert_eq!(
            e,
            FormatError::Version {
                value: v,
                offset: 8
            }
        );
        assert!(e.to_string().contains(&format!("version {v}")));
    }
}

#[test]
fn header_length_out_of_range() {
    let dir = tmp();
    // Too small, too big, not a multiple of 8.
    for v in [0u32, 104, 111, 1032, 4096, 116, 1020] {
        let h = Hdr {
            header_length: v,
            ..Hdr::valid()
        };
        let e = header_case(dir.path(), &format!("hl{v}.pcow"), &h, "R1", 12);
        assert_eq!(
            e,
            FormatError::HeaderLength {
                value: v,
                offset: 12
            }
        );
    }
    // A later version's longer header is accepted; the name follows it.
    for v in [120u32, 1024] {
        let mut h = Hdr {
            header_length: v,
            ..Hdr::valid()
        }
        .with_base(b"base.raw", 1);
        h.virtual_size = 64 << 10;
        let mut slot = h.slot(32 << 10);
        slot[112..120].fill(0xee); // an unknown later field, ignored
        seal(&mut slot, H_CRC);
        let mut file = vec![0u8; 64 << 10];
        file[..32 << 10].copy_from_slice(&slot);
        let p = write_file(dir.path(), &format!("hl{v}.pcow"), &file);
        write_file(dir.path(), "base.raw", &[7u8; 100]);
        let img = open_ro(&p).unwrap();
        assert_eq!(img.base_ref().unwrap().name, "base.raw");
        let mut b = [0u8; 2];
        img.read_at(&mut b, 99).unwrap();
        assert_eq!(b, [7, 0]);
        drop(img);
        expect_clean(&p);
        // A version 1 writer rewrites the header with its own length (112),
        // dropping the unknown field and keeping the name.
        rw_open_close(&p);
        let raw = Raw::load(&p);
        for at in [0, raw.s()] {
            assert_eq!(get32(&raw.b, at + H_HEADER_LENGTH), 112, "slot at {at}");
            assert_eq!(&raw.b[at + H_BASE_NAME..at + H_BASE_NAME + 8], b"base.raw");
            assert_eq!(raw.b[at + H_BASE_NAME + 8], 0);
        }
        assert_eq!(open_ro(&p).unwrap().base_ref().unwrap().name, "base.raw");
        expect_clean(&p);
    }
}

fn rw_open_close(p: &Path) {
    Image::open(p, OpenOptions::read_write())
        .unwrap()
        .close()
        .unwrap();
}

#[test]
fn cluster_bits_out_of_range() {
    let dir = tmp();
    for v in [0u32, 11, 22, 63] {
        let h = Hdr {
            cluster_bits: v,
            ..Hdr::valid()
        };
        let e = header_case(dir.path(), &format!("cb{v}.pcow"), &h, "R1", 16);
        assert_eq!(
            e,
            FormatError::ClusterBits {
                value: v,
                offset: 16
            }
        );
    }
}

#[test]
fn virtual_size_out_of_range() {
    let dir = tmp();
    let c = 64 * KIB;
    for v in [0u64, c - 1, 3 * c + 4096, (1 << 56) + c, u64::MAX - c + 1] {
        let h = Hdr {
            virtual_size: v,
            ..Hdr::valid()
        };
        let e = header_case(dir.path(), &format!("vs{v}.pcow"), &h, "R3", 56);
        assert_eq!(
            e,
            FormatError::VirtualSize {
                value: v,
                cluster_size: c,
                offset: 56
            }
        );
    }
    // The bound itself is valid.
    let h = Hdr {
        virtual_size: 1 << 56,
        ..Hdr::valid()
    };
    let p = write_file(dir.path(), "vsmax.pcow", &h.image());
    let img = open_ro(&p).unwrap();
    let mut b = [1u8; 8];
    img.read_at(&mut b, (1 << 56) - 8).unwrap();
    assert_eq!(b, [0; 8]);
    drop(img);
    expect_clean(&p);
}

#[test]
fn base_name_length_out_of_range() {
    let dir = tmp();
    for v in [1024u16, 2000, u16::MAX] {
        let mut h = Hdr::valid().with_base(&vec![b'a'; 1024], 0);
        h.base_name_length = v;
        let e = header_case(dir.path(), &format!("bnl{v}.pcow"), &h, "R4", 96);
        assert_eq!(
            e,
            FormatError::BaseNameLength {
                value: u64::from(v),
                offset: 96
            }
        );
    }
    // "Ends within the slot": the largest header_length (1024) plus the
    // longest name (1023) ends at byte 2047, inside the smallest slot (4 KiB
    // clusters: 2048 bytes), so with valid fields a name cannot pass the
    // slot's end. The boundary is accepted and read back exactly.
    let name: Vec<u8> = std::iter::repeat_n(b"./".as_slice(), 507)
        .flatten()
        .chain(b"base.raw1")
        .copied()
        .collect();
    assert_eq!(name.len(), 1023);
    let h = Hdr {
        cluster_bits: 12,
        virtual_size: 8192,
        header_length: 1024,
        ..Hdr::valid()
    }
    .with_base(&name, 1);
    let slot = h.slot(2048);
    assert_eq!(&slot[1024..2047], name.as_slice());
    let p = write_file(dir.path(), "edge.pcow", &h.image());
    write_file(dir.path(), "base.raw1", b"xyz");
    let img = open_ro(&p).unwrap();
    assert_eq!(img.base_ref().unwrap().name.as_bytes(), name.as_slice());
    let mut b = [0u8; 4];
    img.read_at(&mut b, 0).unwrap();
    assert_eq!(&b, b"xyz\0");
}

#[test]
fn base_format_out_of_range() {
    let dir = tmp();
    write_file(dir.path(), "base.raw", &[1u8; 10]);
    for v in [3u8, 4, 255] {
        let h = Hdr::valid().with_base(b"base.raw", v);
        let e = header_case(dir.path(), &format!("bf{v}.pcow"), &h, "R4", 98);
        assert_eq!(
            e,
            FormatError::BaseFormat {
                value: v,
                offset: 98
            }
        );
    }
    // A format without a name.
    for v in [1u8, 2] {
        let h = Hdr {
            base_format: v,
            ..Hdr::valid()
        };
        let e = header_case(dir.path(), &format!("bf{v}-noname.pcow"), &h, "R4", 98);
        assert_eq!(
            e,
            FormatError::BaseFormat {
                value: v,
                offset: 98
            }
        );
    }
}

#[test]
fn cluster_count_out_of_range() {
    let dir = tmp();
    for v in [0u64, 2, 1 << 32] {
        let h = Hdr {
            cluster_count: v,
            ..Hdr::valid()
        };
        let e = header_case(dir.path(), &format!("cc{v}.pcow"), &h, "R5", 64);
        assert_eq!(
            e,
            FormatError::ClusterCount {
                value: v,
                file_clusters: 1,
                offset: 64
            }
        );
    }
    // Past the limit of 2^32 clusters: refused as such before the file's
    // length is looked at (a sparse file can be as long as it claims).
    for v in [(1u64 << 32) + 1, u64::MAX] {
        let h = Hdr {
            cluster_count: v,
            ..Hdr::valid()
        };
        let e = header_case(dir.path(), &format!("cc{v}.pcow"), &h, "R5", 64);
        assert_eq!(
            e,
            FormatError::ClusterCountLimit {
                value: v,
                offset: 64
            }
        );
    }
    // Beyond the file in an image with content, through the current slot.
    let p = layered_image(dir.path());
    let mut raw = Raw::load(&p);
    let file_clusters = (raw.b.len() / raw.c) as u64;
    raw.patch_header(|s| put64(s, H_CLUSTER_COUNT, file_clusters + 1));
    raw.save(&p);
    let e = expect_rule(&p, "R5", (raw.hdr() + H_CLUSTER_COUNT) as u64);
    assert!(matches!(e, FormatError::ClusterCount { value, .. } if value == file_clusters + 1));
    expect_check(&p, "R5");
}

#[test]
fn active_layer_out_of_range() {
    let dir = tmp();
    let h = Hdr {
        active_layer: 1,
        ..Hdr::valid()
    };
    let e = header_case(dir.path(), "al.pcow", &h, "R5", 80);
    assert_eq!(
        e,
        FormatError::ActiveLayer {
            value: 1,
            layer_count: 1,
            offset: 80
        }
    );
    // Three layers: 3 is one too many.
    let p = layered_image(dir.path());
    let mut raw = Raw::load(&p);
    assert_eq!(raw.hdr_u32(H_LAYER_COUNT), 3);
    raw.patch_header(|s| put32(s, H_ACTIVE_LAYER, 3));
    raw.save(&p);
    let e = expect_rule(&p, "R5", (raw.hdr() + H_ACTIVE_LAYER) as u64);
    assert!(matches!(
        e,
        FormatError::ActiveLayer {
            value: 3,
            layer_count: 3,
            ..
        }
    ));
    expect_check(&p, "R5");
}

// ----- CRC and the two header slots -----

/// 16 KiB clusters: vcn 0 committed by a flush, then vcn 1 committed by
/// close. The current header has both; the other slot only vcn 0.
fn two_barrier_image(dir: &Path) -> PathBuf {
    let p = dir.join("crc.pcow");
    let mut img = create(&p, 16 * KIB, 128 * KIB);
    img.write_at(&pattern(1, 16 << 10), 0).unwrap();
    img.flush().unwrap();
    img.write_at(&pattern(2, 16 << 10), 16 << 10).unwrap();
    img.close().unwrap();
    p
}

#[test]
fn crc_mismatch_in_one_header_slot_uses_the_other() {
    let dir = tmp();
    let p = two_barrier_image(dir.path());
    let mut raw = Raw::load(&p);
    let cur = raw.hdr();
    let other = raw.s() - cur;
    assert!(raw.header_valid(other));
    assert!(get64(&raw.b, other + H_GENERATION) < raw.committed_gen());
    {
        let img = open_ro(&p).unwrap();
        assert_eq!(
            &read_all(&img)[16 << 10..32 << 10],
            &pattern(2, 16 << 10)[..]
        );
    }
    raw.b[cur + 1000] ^= 0x40; // inside the slot, not a field: only the CRC fails
    raw.save(&p);
    let img = open_ro(&p).unwrap();
    assert_eq!(img.generation(), get64(&raw.b, other + H_GENERATION));
    let all = read_all(&img);
    assert_eq!(&all[..16 << 10], &pattern(1, 16 << 10)[..], "older content");
    assert!(
        all[16 << 10..].iter().all(|&b| b == 0),
        "newer write is gone"
    );
    drop(img);
    // The older version was written by a writer that had not closed yet:
    // it has DIRTY, uncommitted clusters and a stale meta slot: leaks only.
    let r = run_check(&p);
    assert_eq!(r.exit_code(), 3, "{r:#?}");
    assert!(r.corruptions.is_empty());
    let r = check(&p, Some(Repair::Leaks), false).unwrap();
    assert_eq!(r.exit_code(), 0, "{r:#?}");
    expect_clean(&p);
    let img = open_ro(&p).unwrap();
    assert_eq!(&read_all(&img)[..16 << 10], &pattern(1, 16 << 10)[..]);
}

#[test]
fn crc_mismatch_in_both_header_slots() {
    let dir = tmp();
    let p = two_barrier_image(dir.path());
    let mut raw = Raw::load(&p);
    let s = raw.s();
    raw.b[H_CRC] ^= 1;
    raw.b[s + 2000] ^= 1;
    raw.save(&p);
    let e = format_err(&p);
    assert!(matches!(e, FormatError::NoValidHeader { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.starts_with("R1:"), "{msg}");
    assert!(
        msg.contains("crc32c mismatch in the slot at offset 0"),
        "{msg}"
    );
    expect_check(&p, "R1");
}

#[test]
fn crc_mismatch_in_both_header_slots_names_both_slots() {
    let dir = tmp();
    let p = two_barrier_image(dir.path());
    let mut raw = Raw::load(&p);
    let s = raw.s();
    raw.b[H_CRC] ^= 1;
    raw.b[s + 2000] ^= 1;
    raw.save(&p);
    let msg = format_err(&p).to_string();
    // Slot B is in the file with a bad CRC: "absent" would send whoever
    // reads the message looking for a truncated file.
    assert!(
        msg.contains(&format!("crc32c mismatch in the slot at offset {s}")),
        "slot B's CRC error is not named: {msg}"
    );
}

#[test]
fn damaged_magic_in_slot_b_falls_back_to_slot_a_and_in_slot_a_is_not_pcow() {
    let dir = tmp();
    let p = two_barrier_image(dir.path());
    let mut raw = Raw::load(&p);
    let s = raw.s();
    // Slot B's magic damaged: slot A decides.
    raw.b[s] = b'X';
    raw.save(&p);
    let img = open_ro(&p).unwrap();
    assert_eq!(img.generation(), get64(&raw.b, H_GENERATION));
    drop(img);
    // File magic damaged: not a pcow image at all.
    raw.b[0] = b'X';
    raw.save(&p);
    assert_eq!(format_err(&p), FormatError::NotPcow);
    assert!(check(&p, None, false).is_err());
}

// ----- feature bits -----

#[test]
fn unknown_incompatible_bit_is_refused_and_named() {
    let dir = tmp();
    for bit in [1u32, 7, 63] {
        let h = Hdr {
            incompatible: 1 << bit,
            ..Hdr::valid()
        };
        let e = header_case(dir.path(), &format!("ic{bit}.pcow"), &h, "R2", 24);
        assert_eq!(
            e,
            FormatError::UnknownIncompatible {
                bits: 1 << bit,
                offset: 24
            }
        );
        assert!(e.to_string().contains(&format!("{:#x}", 1u64 << bit)));
    }
    // In an image with content, DIRTY alongside: only the unknown bit is named.
    let p = layered_image(dir.path());
    let mut raw = Raw::load(&p);
    raw.patch_header(|s| put64(s, H_INCOMPAT, 1 | (1 << 9)));
    raw.save(&p);
    let e = expect_rule(&p, "R2", 24);
    assert!(matches!(
        e,
        FormatError::UnknownIncompatible { bits: 0x200, .. }
    ));
    expect_check(&p, "R2");
}

#[test]
fn unknown_compatible_bit_is_ignored() {
    let dir = tmp();
    let p = layered_image(dir.path());
    let before = read_all(&open_ro(&p).unwrap());
    let mut raw = Raw::load(&p);
    raw.patch_header(|s| put64(s, H_COMPAT, (1 << 5) | (1 << 63)));
    raw.save(&p);
    let img = open_ro(&p).unwrap();
    assert_eq!(img.header().compatible, (1 << 5) | (1 << 63));
    assert_eq!(read_all(&img), before);
    drop(img);
    expect_clean(&p);
    let mut img = Image::open(&p, OpenOptions::read_write()).unwrap();
    img.write_at(b"more", 70000).unwrap();
    img.close().unwrap();
    expect_clean(&p);
}

#[test]
fn unknown_autoclear_bit_is_cleared_by_a_writer() {
    let dir = tmp();
    let p = layered_image(dir.path());
    let before = read_all(&open_ro(&p).unwrap());
    let mut raw = Raw::load(&p);
    raw.patch_header(|s| put64(s, H_AUTOCLEAR, 1 << 3));
    raw.save(&p);
    let img = open_ro(&p).unwrap();
    assert_eq!(img.header().autoclear, 1 << 3);
    assert_eq!(read_all(&img), before);
    drop(img);
    expect_clean(&p);
    // A reader leaves it on disk.
    assert_eq!(Raw::load(&p).hdr_u64(H_AUTOCLEAR), 1 << 3);
    let img = Image::open(&p, OpenOptions::read_write()).unwrap();
    img.close().unwrap();
    let raw = Raw::load(&p);
    assert_eq!(raw.hdr_u64(H_AUTOCLEAR), 0, "cleared in the current slot");
    assert_eq!(
        get64(&raw.b, raw.s() - raw.hdr() + H_AUTOCLEAR),
        0,
        "and in the other"
    );
    assert_eq!(read_all(&open_ro(&p).unwrap()), before);
    expect_clean(&p);
}

// ----- meta clusters -----

#[test]
fn meta_used_zero() {
    let dir = tmp();
    let p = two_cluster_image(dir.path());
    let mut raw = Raw::load(&p);
    raw.patch_slots(1, |s| put32(s, M_USED, 0));
    raw.save(&p);
    let e = expect_rule(&p, "R7", (raw.cur(1) + M_USED) as u64);
    assert!(
        matches!(
            e,
            FormatError::MetaUsed {
                used: 0,
                capacity: 510,
                ..
            }
        ),
        "{e:?}"
    );
    expect_check(&p, "R7");
}

#[test]
fn meta_used_above_capacity() {
    let dir = tmp();
    let p = two_cluster_image(dir.path());
    let mut raw = Raw::load(&p);
    // N = floor((8192 - 32) / 16) = 510 at 16 KiB.
    for used in [511u32, u32::MAX] {
        raw.patch_slots(1, |s| put32(s, M_USED, used));
        raw.save(&p);
        let e = expect_rule(&p, "R7", (raw.cur(1) + M_USED) as u64);
        assert_eq!(
            e,
            FormatError::MetaUsed {
                used,
                capacity: 510,
                offset: (raw.cur(1) + M_USED) as u64
            }
        );
        expect_check(&p, "R7");
    }
}

#[test]
fn meta_used_past_the_committed_end() {
    let dir = tmp();
    let p = two_cluster_image(dir.path());
    let mut raw = Raw::load(&p);
    raw.patch_slots(1, |s| put32(s, M_USED, 3));
    raw.save(&p);
    let e = format_err(&p);
    assert_eq!(
        e,
        FormatError::StructurePastEnd {
            cluster: 1,
            end: 5,
            cluster_count: 4
        }
    );
    assert!(e.to_string().starts_with("R6:"));
    expect_check(&p, "R6");
}

#[test]
fn meta_layer_not_yet_started() {
    let dir = tmp();
    let p = layered_image(dir.path());
    let mut raw = Raw::load(&p);
    let metas = raw.metas();
    assert_eq!(metas.len(), 3);
    // The layer-0 segment claims layer 1, which starts after it.
    raw.patch_slots(metas[0], |s| put32(s, M_LAYER, 1));
    raw.save(&p);
    let e = expect_rule(&p, "R7", (raw.cur(metas[0]) + M_LAYER) as u64);
    assert!(
        matches!(
            e,
            FormatError::MetaLayer {
                layer: 1,
                layers: 1,
                ..
            }
        ),
        "{e:?}"
    );
    expect_check(&p, "R7");
    // The last segment (after two snapshot clusters) claims layer 3.
    let p = layered_image(dir.path());
    let mut raw = Raw::load(&p);
    raw.patch_slots(metas[2], |s| put32(s, M_LAYER, 3));
    raw.save(&p);
    let e = expect_rule(&p, "R7", (raw.cur(metas[2]) + M_LAYER) as u64);
    assert!(
        matches!(
            e,
            FormatError::MetaLayer {
                layer: 3,
                layers: 3,
                ..
            }
        ),
        "{e:?}"
    );
    expect_check(&p, "R7");
}

/// Entry `i` of the meta cluster at `cluster`, at 16 KiB (E = 16).
fn entry_at(raw: &Raw, cluster: usize, i: usize) -> usize {
    raw.cur(cluster) + M_ENTRIES + i * 16
}

#[test]
fn entry_vcn_beyond_the_virtual_size() {
    let dir = tmp();
    for vcn in [8u64, 9, u64::MAX - 1] {
        let p = two_cluster_image(dir.path());
        let mut raw = Raw::load(&p);
        raw.patch_slots(1, |s| put64(s, M_ENTRIES + 16, vcn));
        raw.save(&p);
        let at = entry_at(&raw, 1, 1) as u64;
        let e = expect_rule(&p, "R8", at);
        assert_eq!(
            e,
            FormatError::VcnOutOfRange {
                vcn,
                limit: 8,
                offset: at
            }
        );
        expect_check(&p, "R8");
    }
}

#[test]
fn entry_empty_bitmap() {
    let dir = tmp();
    let p = two_cluster_image(dir.path());
    let mut raw = Raw::load(&p);
    raw.patch_slots(1, |s| put64(s, M_ENTRIES + 8, 0));
    raw.save(&p);
    let at = entry_at(&raw, 1, 0) as u64 + 8;
    let e = expect_rule(&p, "R8", at);
    assert_eq!(e, FormatError::EmptyBitmap { offset: at });
    expect_check(&p, "R8");
}

#[test]
fn entry_bitmap_bits_beyond_the_cluster_pages() {
    let dir = tmp();
    // 16 KiB clusters: 4 pages, bits 0..4.
    for bm in [0b1_0000u64, 0b1_1111, 1 << 63] {
        let p = two_cluster_image(dir.path());
        let mut raw = Raw::load(&p);
        assert_eq!(get64(&raw.b, entry_at(&raw, 1, 1) + 8), 0b1111);
        raw.patch_slots(1, |s| put64(s, M_ENTRIES + 16 + 8, bm));
        raw.save(&p);
        let at = entry_at(&raw, 1, 1) as u64 + 8;
        let e = expect_rule(&p, "R8", at);
        assert_eq!(
            e,
            FormatError::BitmapBeyondCluster {
                pages: 4,
                offset: at
            }
        );
        expect_check(&p, "R8");
    }
}

#[test]
fn duplicate_vcn_in_one_layer() {
    let dir = tmp();
    let p = two_cluster_image(dir.path());
    let mut raw = Raw::load(&p);
    raw.patch_slots(1, |s| put64(s, M_ENTRIES + 16, 0));
    raw.save(&p);
    let at = entry_at(&raw, 1, 1) as u64;
    let e = expect_rule(&p, "R8", at);
    assert_eq!(
        e,
        FormatError::DuplicateVcn {
            vcn: 0,
            layer: 0,
            offset: at
        }
    );
    expect_check(&p, "R8");
    // The same vcn in two layers is the normal case (layered_image has vcn 0
    // in layers 0 and 1).
    expect_clean(&layered_image(dir.path()));
}

// ----- snapshot clusters -----

/// Patches snapshot cluster `which` (0: s1, 1: s2) of a fresh layered image
/// and expects `rule` at slot offset `field`.
fn snap_case(
    which: usize,
    field: usize,
    f: impl Fn(&mut [u8]),
) -> (FormatError, tempfile::TempDir) {
    let dir = tmp();
    let p = layered_image(dir.path());
    let mut raw = Raw::load(&p);
    let snaps = raw.snaps();
    assert_eq!(snaps.len(), 2);
    raw.patch_slots(snaps[which], f);
    raw.save(&p);
    let at = (raw.cur(snaps[which]) + field) as u64;
    let e = expect_rule(&p, "R9", at);
    expect_check(&p, "R9");
    (e, dir)
}

#[test]
fn snapshot_parent_layer_not_below_its_layer() {
    let (e, _d) = snap_case(0, P_PARENT_LAYER, |s| put32(s, P_PARENT_LAYER, 1));
    assert!(
        matches!(
            e,
            FormatError::ParentLayer {
                value: 1,
                layer: 1,
                ..
            }
        ),
        "{e:?}"
    );
    let (e, _d) = snap_case(1, P_PARENT_LAYER, |s| put32(s, P_PARENT_LAYER, 7));
    assert!(
        matches!(
            e,
            FormatError::ParentLayer {
                value: 7,
                layer: 2,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn snapshot_duplicate_id() {
    let (e, _d) = snap_case(1, P_SNAPSHOT_ID, |s| put32(s, P_SNAPSHOT_ID, 1));
    assert!(
        matches!(
            e,
            FormatError::SnapshotId {
                value: 1,
                next: 3,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn snapshot_id_not_below_next_snapshot_id() {
    for id in [3u32, 1000, u32::MAX] {
        let (e, _d) = snap_case(1, P_SNAPSHOT_ID, |s| put32(s, P_SNAPSHOT_ID, id));
        assert!(
            matches!(e, FormatError::SnapshotId { value, next: 3, .. } if value == id),
            "{e:?}"
        );
    }
}

#[test]
fn snapshot_tag_not_utf8() {
    let (e, _d) = snap_case(0, P_TAG, |s| s[P_TAG] = 0xff);
    assert!(matches!(e, FormatError::SnapshotTag { .. }), "{e:?}");
    // A NUL byte inside the tag is refused the same way.
    let (e, _d) = snap_case(1, P_TAG, |s| s[P_TAG + 1] = 0);
    assert!(matches!(e, FormatError::SnapshotTag { .. }), "{e:?}");
    // tag_length 0 for a named snapshot, or over 255.
    for len in [0u16, 256] {
        let (e, _d) = snap_case(0, P_TAG_LENGTH, |s| put16(s, P_TAG_LENGTH, len));
        assert!(matches!(e, FormatError::SnapshotTag { .. }), "{e:?}");
    }
}

#[test]
fn snapshot_time_nsec_not_below_one_second() {
    for v in [1_000_000_000u32, u32::MAX] {
        let (e, _d) = snap_case(0, P_TIME_NSEC, |s| put32(s, P_TIME_NSEC, v));
        assert!(
            matches!(e, FormatError::TimeNsec { value, .. } if value == v),
            "{e:?}"
        );
    }
}

#[test]
fn snapshot_vm_state_fields_set() {
    let (e, _d) = snap_case(0, P_VM_STATE_OFFSET, |s| put64(s, P_VM_STATE_OFFSET, 4096));
    assert!(matches!(e, FormatError::VmState { .. }), "{e:?}");
    // vm_state_size: the error names the pair, at the offset of its first
    // field (56); the size itself is at 64.
    let dir = tmp();
    let p = layered_image(dir.path());
    let mut raw = Raw::load(&p);
    let s1 = raw.snaps()[0];
    raw.patch_slots(s1, |s| put64(s, P_VM_STATE_SIZE, 1));
    raw.save(&p);
    let e = format_err(&p);
    assert_eq!(e.rule(), "R9");
    let start = (raw.cur(s1) + P_VM_STATE_OFFSET) as u64;
    assert!(matches!(e, FormatError::VmState { offset } if offset == start || offset == start + 8));
    expect_check(&p, "R9");
}

#[test]
fn snapshot_layer_misnumbered() {
    let (e, _d) = snap_case(1, P_LAYER, |s| put32(s, P_LAYER, 5));
    assert!(
        matches!(
            e,
            FormatError::SnapshotLayer {
                value: 5,
                expected: 2,
                ..
            }
        ),
        "{e:?}"
    );
}

// ----- counters (R10) -----

#[test]
fn wrong_counters_are_reported_and_repaired() {
    let cases: [(&str, usize, i64); 6] = [
        ("data_cluster_count", H_DATA_CLUSTER_COUNT, 1),
        ("data_cluster_count", H_DATA_CLUSTER_COUNT, -1),
        ("layer_count", H_LAYER_COUNT, 1),
        ("layer_count", H_LAYER_COUNT, 100),
        ("snapshot_count", H_SNAPSHOT_COUNT, -1),
        ("snapshot_count", H_SNAPSHOT_COUNT, 1),
    ];
    for (name, field, delta) in cases {
        let dir = tmp();
        let p = layered_image(dir.path());
        let before = read_all(&open_ro(&p).unwrap());
        let mut raw = Raw::load(&p);
        let good = if field == H_DATA_CLUSTER_COUNT {
            raw.hdr_u64(field)
        } else {
            u64::from(raw.hdr_u32(field))
        };
        let bad = good.wrapping_add_signed(delta);
        raw.patch_header(|s| {
            if field == H_DATA_CLUSTER_COUNT {
                put64(s, field, bad)
            } else {
                put32(s, field, bad as u32)
            }
        });
        raw.save(&p);
        let at = (raw.hdr() + field) as u64;
        let e = expect_rule(&p, "R10", at);
        assert_eq!(
            e,
            FormatError::Counter {
                name,
                stored: bad,
                found: good,
                offset: at
            }
        );
        expect_check(&p, "R10");
        // Repairing leaks only leaves the counters alone.
        let r = check(&p, Some(Repair::Leaks), false).unwrap();
        assert_eq!(r.exit_code(), 2, "{name} {delta}: {r:#?}");
        assert!(r.corruptions.iter().all(|f| !f.repaired));
        // -r all rewrites them.
        let r = check(&p, Some(Repair::All), false).unwrap();
        assert!(r.corruptions.iter().all(|f| f.repaired), "{r:#?}");
        assert_eq!(r.exit_code(), 0, "{name} {delta}: {r:#?}");
        expect_clean(&p);
        let img = open_ro(&p).unwrap();
        assert_eq!(read_all(&img), before, "{name} {delta}: content kept");
        assert_eq!(img.snapshots().len(), 2);
        drop(img);
        let raw = Raw::load(&p);
        let now = if field == H_DATA_CLUSTER_COUNT {
            raw.hdr_u64(field)
        } else {
            u64::from(raw.hdr_u32(field))
        };
        assert_eq!(now, good, "{name} {delta}: on disk");
    }
}

#[test]
fn wrong_counter_in_a_header_only_image_is_repaired() {
    let dir = tmp();
    let h = Hdr {
        data_cluster_count: 3,
        ..Hdr::valid()
    };
    let p = write_file(dir.path(), "dcc.pcow", &h.image());
    expect_rule(&p, "R10", 72);
    expect_check(&p, "R10");
    assert_eq!(check(&p, Some(Repair::All), false).unwrap().exit_code(), 0);
    expect_clean(&p);
}

// ----- base chains (R11) -----

#[test]
fn missing_base_is_an_error_naming_the_resolved_path_and_is_not_created() {
    let dir = tmp();
    let base = dir.path().join("base.pcow");
    let mut b = create(&base, 64 * KIB, MIB);
    b.write_at(b"base", 0).unwrap();
    b.close().unwrap();
    let top = dir.path().join("top.pcow");
    create_with_base(&top, "base.pcow", BaseFormat::Pcow, 64 * KIB)
        .close()
        .unwrap();
    std::fs::remove_file(&base).unwrap();

    for opts in [OpenOptions::read_only(), OpenOptions::read_write()] {
        match Image::open(&top, opts) {
            Err(
                ref e @ Error::BaseMissing {
                    ref path,
                    ref name,
                    ref resolved,
                },
            ) => {
                assert_eq!(path, &top);
                assert_eq!(name, "base.pcow");
                assert_eq!(resolved, &base);
                assert!(e.to_string().contains(&base.display().to_string()), "{e}");
            }
            other => panic!("expected BaseMissing, got {other:?}"),
        }
        assert!(!base.exists(), "the missing base was created");
    }
    let r = expect_check(&top, "R11");
    assert!(r
        .corruptions
        .iter()
        .any(|f| f.message.contains(&base.display().to_string())));
    assert!(!base.exists(), "check created the missing base");

    // Creating an overlay on a missing base fails and creates no base.
    let nothere = dir.path().join("nothere.pcow");
    let opts = CreateOptions {
        base: Some(BaseRef {
            name: "nothere.pcow".into(),
            format: BaseFormat::Probe,
        }),
        virtual_size: Some(MIB),
        ..Default::default()
    };
    let e = Image::create(dir.path().join("top2.pcow"), &opts).unwrap_err();
    assert!(
        matches!(e, Error::BaseMissing { ref resolved, .. } if resolved == &nothere),
        "{e:?}"
    );
    assert!(!nothere.exists());
}

/// Replaces the base name of the image at `p` with `name` (same length).
fn rename_base(p: &Path, name: &str) {
    let mut raw = Raw::load(p);
    let len = raw.hdr_u16(H_BASE_NAME_LENGTH);
    assert_eq!(usize::from(len), name.len());
    raw.patch_header(|s| {
        assert_eq!(get16(s, H_BASE_NAME_LENGTH), len);
        s[H_BASE_NAME..H_BASE_NAME + name.len()].copy_from_slice(name.as_bytes())
    });
    raw.save(p);
}

#[test]
fn base_chain_cycle_is_an_error() {
    let dir = tmp();
    let d = dir.path();
    create(&d.join("c.pcow"), 64 * KIB, MIB).close().unwrap();
    create_with_base(&d.join("b.pcow"), "c.pcow", BaseFormat::Pcow, 64 * KIB)
        .close()
        .unwrap();
    create_with_base(&d.join("a.pcow"), "b.pcow", BaseFormat::Pcow, 64 * KIB)
        .close()
        .unwrap();
    // B's base becomes A: A -> B -> A.
    rename_base(&d.join("b.pcow"), "a.pcow");
    for (img, again) in [("a.pcow", "a.pcow"), ("b.pcow", "b.pcow")] {
        let p = d.join(img);
        for opts in [OpenOptions::read_only(), OpenOptions::read_write()] {
            match Image::open(&p, opts) {
                Err(ref e @ Error::ChainCycle { ref resolved, .. }) => {
                    assert_eq!(resolved, &d.join(again), "{e}");
                    assert!(e.to_string().contains("cycle"), "{e}");
                }
                other => panic!("{img}: expected ChainCycle, got {other:?}"),
            }
        }
        expect_check(&p, "R11");
    }
    // An image that names itself.
    create_with_base(&d.join("s.pcow"), "c.pcow", BaseFormat::Probe, 64 * KIB)
        .close()
        .unwrap();
    rename_base(&d.join("s.pcow"), "s.pcow");
    assert!(matches!(
        open_ro(&d.join("s.pcow")),
        Err(Error::ChainCycle { .. })
    ));
    expect_check(&d.join("s.pcow"), "R11");
}

#[test]
fn base_chain_deeper_than_32_is_an_error() {
    let dir = tmp();
    let d = dir.path();
    let name = |i: usize| format!("i{i:02}.pcow");
    // i00 <- i01 <- ... <- i31: 32 images, the limit; image k holds byte
    // k + 1 in page k.
    let mut img = create(&d.join(name(0)), 4096, 33 * 4096);
    img.write_at(&[1], 0).unwrap();
    img.close().unwrap();
    for k in 1..32 {
        let mut img = create_with_base(&d.join(name(k)), &name(k - 1), BaseFormat::Pcow, 4096);
        img.write_at(&[k as u8 + 1], k as u64 * 4096).unwrap();
        img.close().unwrap();
    }
    let top = open_ro(&d.join(name(31))).unwrap();
    assert_eq!(top.base().unwrap().depth(), 31);
    for k in 0..32u64 {
        let mut b = [0u8; 2];
        top.read_at(&mut b, k * 4096).unwrap();
        assert_eq!(b, [k as u8 + 1, 0], "page {k}");
    }
    drop(top);
    expect_clean(&d.join(name(31)));
    // A 33rd image cannot be created on top ...
    let e = Image::create(
        d.join("j32.pcow"),
        &CreateOptions {
            base: Some(BaseRef {
                name: name(31),
                format: BaseFormat::Pcow,
            }),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::ChainTooDeep { limit: 32, .. }), "{e:?}");
    // ... nor opened when its name is patched in.
    let p = d.join(name(32));
    create_with_base(&p, &name(30), BaseFormat::Pcow, 4096)
        .close()
        .unwrap();
    rename_base(&p, &name(31));
    for opts in [OpenOptions::read_only(), OpenOptions::read_write()] {
        match Image::open(&p, opts) {
            Err(e @ Error::ChainTooDeep { limit: 32, .. }) => {
                assert!(e.to_string().contains("32"), "{e}")
            }
            other => panic!("expected ChainTooDeep, got {other:?}"),
        }
    }
    expect_check(&p, "R11");
}

#[test]
fn base_with_the_wrong_format() {
    let dir = tmp();
    let d = dir.path();
    let raw_base = d.join("disk.img");
    std::fs::write(&raw_base, pattern(9, 100_000)).unwrap();
    // Creating a pcow-format overlay on a raw file fails.
    let e = Image::create(
        d.join("x.pcow"),
        &CreateOptions {
            base: Some(BaseRef {
                name: "disk.img".into(),
                format: BaseFormat::Pcow,
            }),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::BaseFormat {
                expected: "pcow",
                ..
            }
        ),
        "{e:?}"
    );
    // An overlay made as raw, then patched to say pcow.
    let top = d.join("top.pcow");
    create_with_base(&top, "disk.img", BaseFormat::Raw, 64 * KIB)
        .close()
        .unwrap();
    {
        let img = open_ro(&top).unwrap();
        let mut b = vec![0u8; 100_000];
        img.read_at(&mut b, 0).unwrap();
        assert_eq!(b, pattern(9, 100_000));
    }
    let mut raw = Raw::load(&top);
    assert_eq!(raw.b[raw.hdr() + H_BASE_FORMAT], 1);
    raw.patch_header(|s| s[H_BASE_FORMAT] = 2);
    raw.save(&top);
    let e = open_ro(&top).unwrap_err();
    let Error::BaseFormat {
        resolved, expected, ..
    } = &e
    else {
        panic!("expected BaseFormat, got {e:?}")
    };
    assert_eq!(resolved, &raw_base);
    assert_eq!(*expected, "pcow");
    assert!(e.to_string().contains(&raw_base.display().to_string()));
    expect_check(&top, "R11");
}

#[test]
fn base_name_with_a_nul_byte_or_bad_utf8() {
    let dir = tmp();
    let d = dir.path();
    create(&d.join("base.pcow"), 64 * KIB, MIB).close().unwrap();
    for (i, bad) in [0u8, 0xff, 0xc3].into_iter().enumerate() {
        let top = d.join(format!("top{i}.pcow"));
        create_with_base(&top, "base.pcow", BaseFormat::Pcow, 64 * KIB)
            .close()
            .unwrap();
        let mut raw = Raw::load(&top);
        raw.patch_header(|s| s[H_BASE_NAME + 4] = bad);
        raw.save(&top);
        let e = expect_rule(&top, "R4", 112);
        assert_eq!(e, FormatError::BaseNameEncoding { offset: 112 });
        expect_check(&top, "R4");
    }
    // The library refuses to write such a name in the first place.
    let e = Image::create(
        d.join("n.pcow"),
        &CreateOptions {
            base: Some(BaseRef {
                name: "base\0.pcow".into(),
                format: BaseFormat::Pcow,
            }),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::Invalid(_)), "{e:?}");
}

#[test]
fn base_name_of_48_bytes_without_terminator_reads_back_exactly() {
    let dir = tmp();
    let d = dir.path();
    let name = format!("{}.pcow", "b".repeat(43));
    assert_eq!(name.len(), 48);
    let mut b = create(&d.join(&name), 64 * KIB, MIB);
    b.write_at(b"from the base", 0).unwrap();
    b.close().unwrap();
    let top = d.join("top.pcow");
    create_with_base(&top, &name, BaseFormat::Pcow, 64 * KIB)
        .close()
        .unwrap();
    let mut raw = Raw::load(&top);
    let at = raw.hdr() + H_BASE_NAME;
    assert_eq!(&raw.b[at..at + 48], name.as_bytes());
    assert_eq!(raw.hdr_u16(H_BASE_NAME_LENGTH), 48);
    // No terminator is needed: whatever follows the name, its length says
    // where it ends.
    raw.patch_header(|s| s[H_BASE_NAME + 48..H_BASE_NAME + 64].fill(b'X'));
    raw.save(&top);
    let img = open_ro(&top).unwrap();
    assert_eq!(img.base_ref().unwrap().name, name);
    assert_eq!(img.base().unwrap().path(), d.join(&name));
    let mut buf = [0u8; 13];
    img.read_at(&mut buf, 0).unwrap();
    assert_eq!(&buf, b"from the base");
}

// ----- a refused read-write open must not write -----

#[test]
fn failed_read_write_open_leaves_the_file_unchanged() {
    let dir = tmp();
    let d = dir.path();
    let mut damaged: Vec<(&str, PathBuf)> = Vec::new();
    // R8 found by the scan: an entry with an empty bitmap.
    let p = two_cluster_image(d);
    let mut raw = Raw::load(&p);
    raw.patch_slots(1, |s| put64(s, M_ENTRIES + 8, 0));
    raw.save(&p);
    damaged.push(("R8 empty bitmap", p));
    // R7 found by the scan: used 0.
    let p = d.join("used0.pcow");
    std::fs::copy(layered_image(d), &p).unwrap();
    let mut raw = Raw::load(&p);
    let m = raw.metas()[1];
    raw.patch_slots(m, |s| put32(s, M_USED, 0));
    raw.save(&p);
    damaged.push(("R7 used 0", p));
    // R10 found at the end of the scan.
    let p = d.join("counter.pcow");
    std::fs::copy(layered_image(d), &p).unwrap();
    let mut raw = Raw::load(&p);
    raw.patch_header(|s| put32(s, H_LAYER_COUNT, 9));
    raw.save(&p);
    damaged.push(("R10 layer_count", p));
    // R11: the base is missing (found after the scan).
    create(&d.join("gone.pcow"), 64 * KIB, MIB).close().unwrap();
    let p = d.join("orphan.pcow");
    create_with_base(&p, "gone.pcow", BaseFormat::Pcow, 64 * KIB)
        .close()
        .unwrap();
    std::fs::remove_file(d.join("gone.pcow")).unwrap();
    damaged.push(("R11 missing base", p));
    // R1 found in the header (before anything is built).
    let p = write_file(
        d,
        "version.pcow",
        &Hdr {
            version: 2,
            ..Hdr::valid()
        }
        .image(),
    );
    damaged.push(("R1 version", p));

    let mut changed = Vec::new();
    for (what, p) in &damaged {
        let before = std::fs::read(p).unwrap();
        assert!(Image::open(p, OpenOptions::read_write()).is_err(), "{what}");
        let after = std::fs::read(p).unwrap();
        if after != before {
            changed.push(format!(
                "{what}: {} bytes before, {} after{}",
                before.len(),
                after.len(),
                match open_ro(p) {
                    Ok(_) => ", now opens".to_string(),
                    Err(e) => format!(", now: {}", error_chain(&e)),
                }
            ));
        }
    }
    assert!(
        changed.is_empty(),
        "a refused read-write open wrote to the image:\n{}",
        changed.join("\n")
    );
}

// ----- random damage -----

/// xorshift64*: deterministic, so a failing iteration can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// A metadata slot of the seed image: (offset, crc offset, bytes in use).
type SlotSpan = (usize, usize, usize);

/// Applies one random mutation; returns what it did.
fn mutate(rng: &mut Rng, b: &mut Vec<u8>, slots: &[SlotSpan], s: usize, c: usize) -> String {
    const INTERESTING: [u64; 16] = [
        0,
        1,
        2,
        3,
        0x7f,
        0x80,
        0xff,
        0x100,
        0xffff,
        0x1_0000,
        0x7fff_ffff,
        0x8000_0000,
        0xffff_ffff,
        1 << 56,
        (1 << 56) + 1,
        u64::MAX,
    ];
    if b.is_empty() {
        return "nothing left".into();
    }
    match rng.below(7) {
        0 => {
            let n = 1 + rng.below(4);
            let mut what = String::from("flip");
            for _ in 0..n {
                let at = rng.below(b.len());
                let bit = rng.below(8);
                b[at] ^= 1 << bit;
                what += &format!(" {at}.{bit}");
            }
            what
        }
        1 | 2 => {
            let (at, crc_at, used) = slots[rng.below(slots.len())];
            if at + s > b.len() {
                return "slot cut off".into();
            }
            let n = 1 + rng.below(3);
            let mut what = format!("flip+seal slot {at}:");
            for _ in 0..n {
                let o = rng.below(used);
                let bit = rng.below(8);
                b[at + o] ^= 1 << bit;
                what += &format!(" {o}.{bit}");
            }
            seal(&mut b[at..at + s], crc_at);
            what
        }
        3 | 4 => {
            let (at, crc_at, used) = slots[rng.below(slots.len())];
            if at + s > b.len() {
                return "slot cut off".into();
            }
            let width = [1usize, 2, 4, 8][rng.below(4)];
            let o = rng.below(used.saturating_sub(width) + 1) / width * width;
            let mut v = INTERESTING[rng.below(INTERESTING.len())];
            if rng.below(4) == 0 {
                // Near the current value.
                let mut cur = [0u8; 8];
                cur[..width].copy_from_slice(&b[at + o..at + o + width]);
                v = u64::from_le_bytes(cur)
                    .wrapping_add(rng.below(5) as u64)
                    .wrapping_sub(2);
            }
            b[at + o..at + o + width].copy_from_slice(&v.to_le_bytes()[..width]);
            seal(&mut b[at..at + s], crc_at);
            format!("set+seal slot {at}: {width} bytes at {o} = {v:#x}")
        }
        5 => {
            let len = match rng.below(3) {
                0 => rng.below(b.len()),
                1 => (rng.below(b.len() / c + 1) * c).saturating_sub(rng.below(2)),
                _ => rng.below(b.len() / s + 1) * s + rng.below(3),
            };
            b.truncate(len);
            format!("truncate to {len}")
        }
        _ => {
            let extra = rng.below(2 * c);
            let fill = (rng.next() & 0xff) as u8;
            b.extend(std::iter::repeat_n(fill, extra));
            format!("append {extra} bytes of {fill:#x}")
        }
    }
}

/// Opens, reads and checks a damaged image; must not panic, whatever it holds.
fn exercise(p: &Path, write: bool) {
    if let Ok(img) = open_ro(p) {
        let vs = img.virtual_size();
        let head = vs.min(256 << 10) as usize;
        let mut buf = vec![0u8; head];
        let _ = img.read_at(&mut buf, 0);
        let mut small = [0u8; 5000];
        let _ = img.read_at(&mut small, vs.saturating_sub(5000).min(3000));
        let _ = img.read_at(&mut small, vs.saturating_sub(5000));
        let _ = img.snapshots();
        let _ = img.allocated_clusters();
    }
    if let Ok(r) = check(p, None, false) {
        let _ = r.exit_code();
    }
    if write {
        if let Ok(mut img) = Image::open(p, OpenOptions::read_write()) {
            let _ = img.write_at(&[0xab; 5000], 3000);
            let _ = img.flush();
            let _ = img.close();
        }
        let _ = check(p, Some(Repair::All), false);
        if let Ok(img) = open_ro(p) {
            let mut small = [0u8; 5000];
            let _ = img.read_at(&mut small, 0);
        }
    }
}

#[test]
fn random_flips_and_truncations_never_panic() {
    const ITERATIONS: usize = 3000;
    // Thousands of rewritten files: on tmpfs when there is one (seconds
    // less than a disk).
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tmp()
    };
    let seed_image = layered_image(dir.path());
    let valid = std::fs::read(&seed_image).unwrap();
    let raw = Raw::from_bytes(valid.clone());
    let (s, c) = (raw.s(), raw.c);
    // Mutations that re-seal a slot aim at its fields.
    let mut slots: Vec<SlotSpan> = vec![(0, H_CRC, 128), (s, H_CRC, 128)];
    for (cluster, magic) in raw.structures() {
        for half in [0, s] {
            let at = cluster * c + half;
            if raw.b[at..at + 4] == magic {
                let used = if &magic == META_MAGIC {
                    M_ENTRIES + get32(&raw.b, at + M_USED) as usize * 16
                } else {
                    P_TAG + usize::from(get16(&raw.b, at + P_TAG_LENGTH))
                };
                slots.push((at, S_CRC, used));
            }
        }
    }
    let target = dir.path().join("fuzz.pcow");
    let mut rng = Rng(0x5eed_0bad_1dea_0001);
    let mut failures = Vec::new();
    let mut opened = 0;
    for iter in 0..ITERATIONS {
        let mut b = valid.clone();
        let mut what = mutate(&mut rng, &mut b, &slots, s, c);
        if rng.below(3) == 0 {
            what += "; ";
            what += &mutate(&mut rng, &mut b, &slots, s, c);
        }
        let write = rng.below(8) == 0;
        std::fs::write(&target, &b).unwrap();
        opened += usize::from(open_ro(&target).is_ok());
        if catch_unwind(AssertUnwindSafe(|| exercise(&target, write))).is_err() {
            failures.push(format!("iteration {iter} (write {write}): {what}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} panics, seed 0x5eed_0bad_1dea_0001:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The mutations are neither all fatal nor all harmless.
    assert!(
        opened > ITERATIONS / 20 && opened < ITERATIONS,
        "{opened} opened"
    );
}
