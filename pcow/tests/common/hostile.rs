//! A generator of hostile images: files laid out from the tables of
//! `docs/pcow-format.md` (not with the library's encoder), every slot
//! sealed with a correct CRC32C, so that what a reader meets is the
//! declared sizes, the counts at and past every limit, the cycles and the
//! names, not a checksum failure. Data clusters are never written: they
//! are holes of a sparse file, and a file can be made far longer than
//! what it stores ([`Layout::file_len`]).
//!
//! [`cases`] lists the images the bounded-cost tests run every command on,
//! each with what opening it must do.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A structure after the super cluster, in file order.
pub enum Structure {
    /// A meta cluster whose entries name `vcns` (each with a full bitmap),
    /// followed by its data clusters (holes). `used` overrides the entry
    /// count written in the slot (and the clusters the segment spans).
    Segment {
        layer: u32,
        vcns: Vec<u64>,
        used: Option<u32>,
    },
    /// A snapshot cluster starting the next layer, stacked on `parent`;
    /// `id` 0 is a layer without a snapshot.
    Snapshot { parent: u32, id: u32, tag: Vec<u8> },
}

/// The header's fields, as the table "Super cluster (header slot)" lists
/// them. [`Layout::write`] computes them from the structures; a case may
/// change them before they are written.
#[derive(Debug, Clone)]
pub struct HeaderFields {
    pub cluster_bits: u32,
    pub generation: u64,
    pub virtual_size: u64,
    pub cluster_count: u64,
    pub data_cluster_count: u64,
    pub active_layer: u32,
    pub layer_count: u32,
    pub snapshot_count: u32,
    pub next_snapshot_id: u32,
    pub base_name: Vec<u8>,
    pub base_format: u8,
}

/// An image to write.
pub struct Layout {
    pub cluster_bits: u32,
    pub virtual_size: u64,
    /// Base name (bytes as stored) and `base_format`.
    pub base: Option<(Vec<u8>, u8)>,
    pub structures: Vec<Structure>,
    /// The file's length; `None`: the committed end. Longer is a hole.
    pub file_len: Option<u64>,
}

/// What [`Layout::write`] wrote.
pub struct Written {
    pub header: HeaderFields,
    /// Bytes of metadata written (the super cluster and every meta and
    /// snapshot cluster): what an open may need memory for.
    pub metadata_bytes: u64,
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

/// CRC32C of the slot with its CRC field (at `crc_at`) zero, stored there.
fn seal(slot: &mut [u8], crc_at: usize) {
    slot[crc_at..crc_at + 4].fill(0);
    let crc = crc32c::crc32c(slot);
    put32(slot, crc_at, crc);
}

impl Layout {
    /// An image of `virtual_size` bytes with clusters of `2^cluster_bits`.
    pub fn new(cluster_bits: u32, virtual_size: u64) -> Layout {
        Layout {
            cluster_bits,
            virtual_size,
            base: None,
            structures: Vec::new(),
            file_len: None,
        }
    }

    /// Adds a segment of layer `layer` naming `vcns`.
    pub fn segment(mut self, layer: u32, vcns: Vec<u64>) -> Layout {
        self.structures.push(Structure::Segment {
            layer,
            vcns,
            used: None,
        });
        self
    }

    /// Adds a snapshot cluster.
    pub fn snapshot(mut self, parent: u32, id: u32, tag: &[u8]) -> Layout {
        self.structures.push(Structure::Snapshot {
            parent,
            id,
            tag: tag.to_vec(),
        });
        self
    }

    /// Names a base.
    pub fn base(mut self, name: &[u8], format: u8) -> Layout {
        self.base = Some((name.to_vec(), format));
        self
    }

    /// Writes the image at `path` with the computed header.
    pub fn write(&self, path: &Path) -> Written {
        self.write_with(path, |_| {})
    }

    /// Writes the image at `path`; `tweak` may change the header first.
    pub fn write_with(&self, path: &Path, tweak: impl FnOnce(&mut HeaderFields)) -> Written {
        let c = 1u64 << self.cluster_bits;
        let s = (c / 2) as usize;
        let pages = (c / 4096) as usize;
        let words = pages.div_ceil(64);
        let entry = 8 + 8 * words;
        let capacity = (s - 32) / entry;
        let file = File::create(path).unwrap();
        let mut pos = 1u64;
        let (mut data, mut layers, mut snaps, mut max_id) = (0u64, 1u32, 0u32, 0u32);
        let mut metadata_bytes = c;
        for st in &self.structures {
            let mut slot = vec![0u8; s];
            match st {
                Structure::Segment { layer, vcns, used } => {
                    let used = used.unwrap_or(vcns.len() as u32);
                    slot[0..4].copy_from_slice(b"PMET"); // magic
                    put64(&mut slot, 8, 1); // generation
                    put64(&mut slot, 16, pos); // self_cluster
                    put32(&mut slot, 24, *layer); // layer
                    put32(&mut slot, 28, used); // used
                    for (i, vcn) in vcns.iter().take(capacity).enumerate() {
                        let at = 32 + i * entry;
                        put64(&mut slot, at, *vcn); // vcn
                        for p in 0..pages {
                            // bitmap: every page of the cluster
                            slot[at + 8 + p / 8] |= 1 << (p % 8);
                        }
                    }
                    seal(&mut slot, 4);
                    file.write_all_at(&slot, pos * c).unwrap();
                    pos += 1 + u64::from(used);
                    data += u64::from(used);
                }
                Structure::Snapshot { parent, id, tag } => {
                    slot[0..4].copy_from_slice(b"PSNP"); // magic
                    put64(&mut slot, 8, 1); // generation
                    put64(&mut slot, 16, pos); // self_cluster
                    put32(&mut slot, 24, layers); // layer
                    put32(&mut slot, 28, *parent); // parent_layer
                    put32(&mut slot, 32, *id); // snapshot_id
                    put16(&mut slot, 36, tag.len() as u16); // tag_length
                    put64(&mut slot, 40, 1_700_000_000); // time_sec
                    let n = tag.len().min(s - 128);
                    slot[128..128 + n].copy_from_slice(&tag[..n]); // tag
                    seal(&mut slot, 4);
                    file.write_all_at(&slot, pos * c).unwrap();
                    pos += 1;
                    layers += 1;
                    if *id != 0 {
                        snaps += 1;
                        max_id = max_id.max(*id);
                    }
                }
            }
            metadata_bytes += c;
        }
        let (base_name, base_format) = self.base.clone().unwrap_or_default();
        let mut h = HeaderFields {
            cluster_bits: self.cluster_bits,
            generation: 1,
            virtual_size: self.virtual_size,
            cluster_count: pos,
            data_cluster_count: data,
            active_layer: layers - 1,
            layer_count: layers,
            snapshot_count: snaps,
            next_snapshot_id: max_id + 1,
            base_name,
            base_format,
        };
        tweak(&mut h);
        let mut slot = vec![0u8; s];
        slot[0..8].copy_from_slice(b"PCOW\r\n\x1a\n"); // magic
        put32(&mut slot, 8, 1); // version
        put32(&mut slot, 12, 112); // header_length
        put32(&mut slot, 16, h.cluster_bits); // cluster_bits
        put64(&mut slot, 48, h.generation); // generation
        put64(&mut slot, 56, h.virtual_size); // virtual_size
        put64(&mut slot, 64, h.cluster_count); // cluster_count
        put64(&mut slot, 72, h.data_cluster_count); // data_cluster_count
        put32(&mut slot, 80, h.active_layer); // active_layer
        put32(&mut slot, 84, h.layer_count); // layer_count
        put32(&mut slot, 88, h.snapshot_count); // snapshot_count
        put32(&mut slot, 92, h.next_snapshot_id); // next_snapshot_id
        put16(&mut slot, 96, h.base_name.len() as u16); // base_name_length
        slot[98] = h.base_format; // base_format
        let n = h.base_name.len().min(s - 112);
        slot[112..112 + n].copy_from_slice(&h.base_name[..n]); // base_name
        seal(&mut slot, 20);
        file.write_all_at(&slot, 0).unwrap();
        let committed = pos * c;
        file.set_len(self.file_len.unwrap_or(committed).max(committed))
            .unwrap();
        Written {
            header: h,
            metadata_bytes,
        }
    }
}

/// What opening a hostile image must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// It opens: `info` succeeds.
    Opens,
    /// It is refused: `info` fails with an error containing this text.
    Refused(&'static str),
}

/// One hostile image.
pub struct Case {
    pub name: &'static str,
    pub expect: Expect,
    /// Writes the image (and any files it names) into the directory.
    pub make: fn(&Path) -> Made,
}

/// A hostile image written by [`Case::make`].
pub struct Made {
    pub path: PathBuf,
    /// Metadata bytes of every image of the chain.
    pub metadata_bytes: u64,
    /// Data clusters the metadata of the chain declares (holes: stored
    /// as nothing, read as zeros).
    pub data_clusters: u64,
}

const TIB: u64 = 1 << 40;

fn made(path: PathBuf, w: &[Written]) -> Made {
    Made {
        path,
        metadata_bytes: w.iter().map(|w| w.metadata_bytes).sum(),
        data_clusters: w.iter().map(|w| w.header.data_cluster_count).sum(),
    }
}

fn one(dir: &Path, name: &str, l: Layout) -> Made {
    let p = dir.join(name);
    let w = l.write(&p);
    made(p, &[w])
}

/// A chain of `depth` images, top first named `top.pcow`, each the base of
/// the one above it.
fn chain(dir: &Path, depth: usize) -> Made {
    let mut all = Vec::new();
    for i in (0..depth).rev() {
        let mut l = Layout::new(16, 1 << 20).segment(0, vec![i as u64 % 16]);
        if i + 1 < depth {
            l = l.base(format!("c{}.pcow", i + 1).as_bytes(), 2);
        }
        let name = if i == 0 {
            "top.pcow".to_owned()
        } else {
            format!("c{i}.pcow")
        };
        all.push(l.write(&dir.join(name)));
    }
    made(dir.join("top.pcow"), &all)
}

/// `layers` snapshot clusters, each stacked on the layer before it, every
/// 1024th a named snapshot, with a segment in the last layer.
fn layered(dir: &Path, layers: u32) -> Made {
    let mut l = Layout::new(12, TIB);
    for k in 1..=layers {
        let id = if k % 1024 == 0 { k / 1024 } else { 0 };
        let tag = if id != 0 {
            format!("s{id}").into_bytes()
        } else {
            Vec::new()
        };
        l.structures.push(Structure::Snapshot {
            parent: k - 1,
            id,
            tag,
        });
    }
    l = l.segment(layers, vec![0, 1 << 20]);
    one(dir, "layers.pcow", l)
}

/// Every hostile image of the bounded-cost tests.
pub fn cases() -> Vec<Case> {
    vec![
        Case {
            // 2^56 bytes at 4 KiB clusters: 2^44 virtual clusters, two held.
            name: "max-virtual-size",
            expect: Expect::Opens,
            make: |d| {
                one(
                    d,
                    "max.pcow",
                    Layout::new(12, 1 << 56).segment(0, vec![0, (1 << 44) - 1]),
                )
            },
        },
        Case {
            name: "max-virtual-size-2m-clusters",
            expect: Expect::Opens,
            make: |d| {
                one(
                    d,
                    "max2m.pcow",
                    Layout::new(21, 1 << 56).segment(0, vec![7, (1 << 35) - 1]),
                )
            },
        },
        Case {
            // A small overlay of a 2^56-byte base with data at its end:
            // growing the overlay must visit the base's data, not 2^44
            // clusters.
            name: "small-overlay-of-max-base",
            expect: Expect::Opens,
            make: |d| {
                let b = Layout::new(12, 1 << 56)
                    .segment(0, vec![3, (1 << 44) - 1])
                    .write(&d.join("maxbase.pcow"));
                let t = Layout::new(12, 1 << 20)
                    .base(b"maxbase.pcow", 2)
                    .segment(0, vec![1])
                    .write(&d.join("small.pcow"));
                made(d.join("small.pcow"), &[b, t])
            },
        },
        Case {
            name: "virtual-size-past-limit",
            expect: Expect::Refused("R3: virtual_size"),
            make: |d| one(d, "past.pcow", Layout::new(12, (1 << 56) + 4096)),
        },
        Case {
            // The 51 GB abort: a sparse 8 TiB file whose header
            // claims 2^31 committed and data clusters; two are stored.
            name: "sparse-8tib-counters",
            expect: Expect::Refused("R6"),
            make: |d| {
                let p = d.join("sparse.pcow");
                let mut l = Layout::new(12, 8 * TIB).segment(0, vec![0, 1]);
                l.file_len = Some(8 * TIB);
                let w = l.write_with(&p, |h| {
                    h.cluster_count = 1 << 31;
                    h.data_cluster_count = 1 << 31;
                });
                made(p, &[w])
            },
        },
        Case {
            name: "cluster-count-past-limit",
            expect: Expect::Refused("past the limit of 2^32 clusters"),
            make: |d| {
                let p = d.join("cc.pcow");
                let w = Layout::new(12, TIB).write_with(&p, |h| {
                    h.cluster_count = (1 << 32) + 1;
                });
                made(p, &[w])
            },
        },
        Case {
            // 129,024 entries in 1,024 meta clusters (4 MiB of metadata),
            // spread over a 2^56-byte view.
            name: "many-entries",
            expect: Expect::Opens,
            make: |d| {
                let mut l = Layout::new(12, 1 << 56);
                for s in 0..1024u64 {
                    l = l.segment(0, (0..126).map(|i| (s * 126 + i) * 65_521).collect());
                }
                one(d, "many.pcow", l)
            },
        },
        Case {
            name: "layers-at-limit",
            expect: Expect::Opens,
            make: |d| layered(d, 65535),
        },
        Case {
            name: "layers-past-limit",
            expect: Expect::Refused("R9"),
            make: |d| layered(d, 65536),
        },
        Case {
            name: "counters-at-maximum",
            expect: Expect::Refused("R10"),
            make: |d| {
                let p = d.join("counters.pcow");
                let w = Layout::new(16, 1 << 30)
                    .segment(0, vec![3])
                    .write_with(&p, |h| {
                        h.data_cluster_count = u64::MAX;
                        h.layer_count = u32::MAX;
                        h.snapshot_count = u32::MAX;
                    });
                made(p, &[w])
            },
        },
        Case {
            name: "structure-past-end",
            expect: Expect::Refused("past the committed end"),
            make: |d| {
                let p = d.join("pastend.pcow");
                let mut l = Layout::new(12, TIB);
                l.structures.push(Structure::Segment {
                    layer: 0,
                    vcns: vec![5],
                    used: Some(100),
                });
                let w = l.write_with(&p, |h| h.cluster_count = 3);
                made(p, &[w])
            },
        },
        Case {
            name: "meta-used-past-capacity",
            expect: Expect::Refused("R7"),
            make: |d| {
                let mut l = Layout::new(12, TIB);
                l.structures.push(Structure::Segment {
                    layer: 0,
                    vcns: vec![5],
                    used: Some(127),
                });
                one(d, "used.pcow", l)
            },
        },
        Case {
            name: "vcn-past-virtual-size",
            expect: Expect::Refused("R8"),
            make: |d| {
                one(
                    d,
                    "vcn.pcow",
                    Layout::new(12, 1 << 20).segment(0, vec![256]),
                )
            },
        },
        Case {
            name: "tag-at-limit",
            expect: Expect::Opens,
            make: |d| {
                one(
                    d,
                    "tag.pcow",
                    Layout::new(12, TIB).snapshot(0, 1, &[b't'; 255]),
                )
            },
        },
        Case {
            name: "tag-past-limit",
            expect: Expect::Refused("R9"),
            make: |d| {
                one(
                    d,
                    "tag256.pcow",
                    Layout::new(12, TIB).snapshot(0, 1, &[b't'; 256]),
                )
            },
        },
        Case {
            name: "chain-at-depth-limit",
            expect: Expect::Opens,
            make: |d| chain(d, 32),
        },
        Case {
            name: "chain-past-depth-limit",
            expect: Expect::Refused("32"),
            make: |d| chain(d, 33),
        },
        Case {
            name: "chain-cycle",
            expect: Expect::Refused("cycle"),
            make: |d| {
                let a = Layout::new(16, 1 << 20)
                    .base(b"b.pcow", 2)
                    .write(&d.join("a.pcow"));
                let b = Layout::new(16, 1 << 20)
                    .base(b"a.pcow", 2)
                    .write(&d.join("b.pcow"));
                made(d.join("a.pcow"), &[a, b])
            },
        },
        Case {
            name: "self-base",
            expect: Expect::Refused("cycle"),
            make: |d| {
                one(
                    d,
                    "self.pcow",
                    Layout::new(16, 1 << 20).base(b"./self.pcow", 0),
                )
            },
        },
        Case {
            name: "base-is-etc-passwd",
            expect: Expect::Refused("/etc/passwd"),
            make: |d| {
                one(
                    d,
                    "passwd.pcow",
                    Layout::new(16, 1 << 20).base(b"/etc/passwd", 2),
                )
            },
        },
        Case {
            name: "base-is-dev-zero",
            expect: Expect::Refused("not a regular file"),
            make: |d| {
                one(
                    d,
                    "zero.pcow",
                    Layout::new(16, 1 << 20).base(b"/dev/zero", 1),
                )
            },
        },
        Case {
            name: "base-name-at-limit-to-elsewhere",
            expect: Expect::Refused("base"),
            make: |d| {
                let mut name = b"../../../../../../../..".to_vec();
                while name.len() < 1023 {
                    name.extend_from_slice(b"/x");
                }
                name.truncate(1023);
                one(d, "longname.pcow", Layout::new(16, 1 << 20).base(&name, 1))
            },
        },
    ]
}
