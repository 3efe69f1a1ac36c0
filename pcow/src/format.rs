//! On-disk layout of pcow version 1 (see `docs/pcow-format.md`): constants,
//! the three slot kinds (header, meta, snapshot), and their validation.
//!
//! Everything here is pure: bytes in, checked values (or a [`FormatError`]
//! naming the rule, the field and its file offset) out. No `unsafe`.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Bytes 0..8 of every pcow file (and of both header slots).
pub const MAGIC: [u8; 8] = *b"PCOW\r\n\x1a\n";
/// The format version this crate reads and writes.
pub const VERSION: u32 = 1;
/// `header_length` written by this version.
pub const HEADER_LENGTH_V1: u32 = 112;
/// Largest `header_length` a reader accepts.
pub const MAX_HEADER_LENGTH: u32 = 1024;
/// Smallest and largest `cluster_bits` (4 KiB .. 2 MiB).
pub const MIN_CLUSTER_BITS: u32 = 12;
/// See [`MIN_CLUSTER_BITS`].
pub const MAX_CLUSTER_BITS: u32 = 21;
/// Granularity of copy-on-write, independent of the host page size.
pub const PAGE_SIZE: u64 = 4096;
/// Longest base image name, in bytes.
pub const MAX_BASE_NAME: usize = 1023;
/// Longest snapshot tag, in bytes.
pub const MAX_TAG: usize = 255;
/// Largest virtual size.
pub const MAX_VIRTUAL_SIZE: u64 = 1 << 56;
/// Largest valid generation: far beyond any real use (2^62 barriers at one
/// per microsecond take 146,000 years), so that a writer never wraps.
pub const MAX_GENERATION: u64 = 1 << 62;
/// Implementation limit on layers per file.
pub const MAX_LAYERS: u32 = 65536;
/// Implementation limit on images in a chain, the top included.
pub const MAX_CHAIN_DEPTH: usize = 32;
/// Implementation limit on `cluster_count`: clusters are indexed with 32
/// bits in memory (an entry's index, a segment's first entry), and the
/// limit is checked before anything is allocated for the walk.
pub const MAX_CLUSTER_COUNT: u64 = 1 << 32;

pub(crate) const META_MAGIC: [u8; 4] = *b"PMET";
pub(crate) const SNAP_MAGIC: [u8; 4] = *b"PSNP";
/// Offset of the `crc32c` field in a header slot.
const HEADER_CRC_OFFSET: usize = 20;
/// Offset of the `crc32c` field in meta and snapshot slots.
const CLUSTER_CRC_OFFSET: usize = 4;
/// Size of the fixed part of a meta slot; entries follow.
pub(crate) const META_FIXED: usize = 32;
/// Offset of the tag in a snapshot slot.
pub(crate) const SNAP_TAG_OFFSET: usize = 128;

/// Feature bits, in qcow2's three classes.
pub mod features {
    /// Incompatible bit 0: the image is (or was, at a crash) open for writing.
    pub const INCOMPAT_DIRTY: u64 = 1;
    /// Incompatible bits this version understands.
    pub const SUPPORTED_INCOMPAT: u64 = INCOMPAT_DIRTY;
    /// Compatible bits this version understands.
    pub const SUPPORTED_COMPAT: u64 = 0;
    /// Autoclear bits this version understands (others are cleared on write).
    pub const SUPPORTED_AUTOCLEAR: u64 = 0;
}

/// A violated format rule, with the field, its value and its file offset.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("not a pcow image (no magic at offset 0)")]
    NotPcow,
    #[error("R1: file is {len} bytes, shorter than a header slot (2048 bytes at least)")]
    Truncated { len: u64 },
    #[error("R1: no valid header slot (slot A: {a}; slot B: {b})")]
    NoValidHeader { a: String, b: String },
    #[error("R1: bad magic at offset {offset}")]
    HeaderMagic { offset: u64 },
    #[error("R1: unsupported version {value} at offset {offset} (this reader knows 1)")]
    Version { value: u32, offset: u64 },
    #[error(
        "R1: header_length {value} at offset {offset} (must be 112..=1024 and a multiple of 8)"
    )]
    HeaderLength { value: u32, offset: u64 },
    #[error("R1: cluster_bits {value} at offset {offset} (must be 12..=21)")]
    ClusterBits { value: u32, offset: u64 },
    #[error("R1: crc32c mismatch in the slot at offset {offset} (stored {stored:#010x}, computed {computed:#010x})")]
    Crc {
        offset: u64,
        stored: u32,
        computed: u32,
    },
    #[error("R1: generation {value} at offset {offset} (must be 1..=2^62)")]
    Generation { value: u64, offset: u64 },
    #[error("R2: unknown incompatible feature bits {bits:#x} at offset {offset}")]
    UnknownIncompatible { bits: u64, offset: u64 },
    #[error("R3: virtual_size {value} at offset {offset} (must be a non-zero multiple of the cluster size {cluster_size}, at most 2^56)")]
    VirtualSize {
        value: u64,
        cluster_size: u64,
        offset: u64,
    },
    #[error("R4: base_name_length {value} at offset {offset} (at most 1023 and within the slot)")]
    BaseNameLength { value: u64, offset: u64 },
    #[error("R4: base_name at offset {offset} is not UTF-8 without NUL bytes")]
    BaseNameEncoding { offset: u64 },
    #[error(
        "R4: base_format {value} at offset {offset} (0 probe, 1 raw, 2 pcow; 0 without a base)"
    )]
    BaseFormat { value: u8, offset: u64 },
    #[error("R5: cluster_count {value} at offset {offset} (must be >= 1 and within the file's {file_clusters} clusters)")]
    ClusterCount {
        value: u64,
        file_clusters: u64,
        offset: u64,
    },
    #[error("R5: cluster_count {value} at offset {offset} is past the limit of 2^32 clusters")]
    ClusterCountLimit { value: u64, offset: u64 },
    #[error(
        "R5: active_layer {value} at offset {offset} (must be below layer_count {layer_count})"
    )]
    ActiveLayer {
        value: u32,
        layer_count: u32,
        offset: u64,
    },
    #[error("R6: no valid slot in the {kind} cluster {cluster} (offset {offset}): {why}")]
    NoValidSlot {
        kind: &'static str,
        cluster: u64,
        offset: u64,
        why: String,
    },
    #[error("R6: cluster {cluster} (offset {offset}) should start a structure but holds neither a meta nor a snapshot cluster")]
    UnknownStructure { cluster: u64, offset: u64 },
    #[error("R6: the structure at cluster {cluster} ends at cluster {end}, past the committed end {cluster_count}")]
    StructurePastEnd {
        cluster: u64,
        end: u64,
        cluster_count: u64,
    },
    #[error("R6: both slots of cluster {cluster} (offset {offset}) have generation {generation}")]
    SameGeneration {
        cluster: u64,
        offset: u64,
        generation: u64,
    },
    #[error("R7: meta cluster at offset {offset} names layer {layer}, but only {layers} layers start before it")]
    MetaLayer {
        layer: u32,
        layers: u32,
        offset: u64,
    },
    #[error("R7: meta cluster at offset {offset} has used {used} (must be 1..={capacity})")]
    MetaUsed {
        used: u32,
        capacity: u32,
        offset: u64,
    },
    #[error(
        "R8: entry at offset {offset} has vcn {vcn}, beyond the virtual size ({limit} clusters)"
    )]
    VcnOutOfRange { vcn: u64, limit: u64, offset: u64 },
    #[error("R8: entry at offset {offset} has an empty bitmap")]
    EmptyBitmap { offset: u64 },
    #[error("R8: entry at offset {offset} has bitmap bits set beyond the cluster's {pages} pages")]
    BitmapBeyondCluster { pages: u64, offset: u64 },
    #[error("R8: entry at offset {offset} repeats vcn {vcn} in layer {layer}")]
    DuplicateVcn { vcn: u64, layer: u32, offset: u64 },
    #[error("R9: snapshot cluster at offset {offset} says layer {value}, but it starts layer {expected}")]
    SnapshotLayer {
        value: u32,
        expected: u32,
        offset: u64,
    },
    #[error(
        "R9: snapshot cluster at offset {offset} has parent_layer {value} (must be below {layer})"
    )]
    ParentLayer { value: u32, layer: u32, offset: u64 },
    #[error("R9: snapshot cluster at offset {offset} has snapshot_id {value} (must be unique and below next_snapshot_id {next})")]
    SnapshotId { value: u32, next: u32, offset: u64 },
    #[error("R9: snapshot cluster at offset {offset} has a bad tag ({why})")]
    SnapshotTag { why: &'static str, offset: u64 },
    #[error("R9: snapshot cluster at offset {offset} has time_nsec {value} (must be below 10^9)")]
    TimeNsec { value: u32, offset: u64 },
    #[error("R9: snapshot cluster at offset {offset} has VM state fields set (must be zero in version 1)")]
    VmState { offset: u64 },
    #[error("R10: counter {name} at offset {offset} is {stored}, the image has {found}")]
    Counter {
        name: &'static str,
        stored: u64,
        found: u64,
        offset: u64,
    },
}

impl FormatError {
    /// The rule number this error reports ("R1".."R10"), or "" for a non-pcow file.
    pub fn rule(&self) -> &'static str {
        use FormatError::*;
        match self {
            NotPcow => "",
            NoValidHeader { .. } | HeaderMagic { .. } | Version { .. } | HeaderLength { .. } => {
                "R1"
            }
            ClusterBits { .. } | Crc { .. } | Truncated { .. } | Generation { .. } => "R1",
            UnknownIncompatible { .. } => "R2",
            VirtualSize { .. } => "R3",
            BaseNameLength { .. } | BaseNameEncoding { .. } | BaseFormat { .. } => "R4",
            ClusterCount { .. } | ClusterCountLimit { .. } | ActiveLayer { .. } => "R5",
            NoValidSlot { .. } | UnknownStructure { .. } | StructurePastEnd { .. } => "R6",
            SameGeneration { .. } => "R6",
            MetaLayer { .. } | MetaUsed { .. } => "R7",
            VcnOutOfRange { .. } | EmptyBitmap { .. } | BitmapBeyondCluster { .. } => "R8",
            DuplicateVcn { .. } => "R8",
            SnapshotLayer { .. } | ParentLayer { .. } | SnapshotId { .. } | SnapshotTag { .. } => {
                "R9"
            }
            TimeNsec { .. } | VmState { .. } => "R9",
            Counter { .. } => "R10",
        }
    }
}

/// Sizes derived from `cluster_bits` (the `C`, `S`, `P`, `W`, `E`, `N` of the spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    cluster_bits: u32,
}

impl Geometry {
    /// `None` unless `cluster_bits` is within 12..=21.
    pub fn new(cluster_bits: u32) -> Option<Self> {
        (MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS)
            .contains(&cluster_bits)
            .then_some(Geometry { cluster_bits })
    }

    /// The geometry of a cluster size, if it is a power of two from 4 KiB to 2 MiB.
    pub fn from_cluster_size(size: u64) -> Option<Self> {
        if !size.is_power_of_two() {
            return None;
        }
        Self::new(size.trailing_zeros())
    }

    /// `cluster_bits`.
    pub fn cluster_bits(self) -> u32 {
        self.cluster_bits
    }
    /// `C`.
    pub fn cluster_size(self) -> u64 {
        1 << self.cluster_bits
    }
    /// `S`: half a cluster.
    pub fn slot_size(self) -> usize {
        1 << (self.cluster_bits - 1)
    }
    /// `P`: 4 KiB pages per cluster.
    pub fn pages(self) -> usize {
        (self.cluster_size() / PAGE_SIZE) as usize
    }
    /// `W`: bitmap words per entry.
    pub fn words(self) -> usize {
        self.pages().div_ceil(64)
    }
    /// `E`: entry size in bytes.
    pub fn entry_size(self) -> usize {
        8 + 8 * self.words()
    }
    /// `N`: entries per meta cluster.
    pub fn capacity(self) -> u32 {
        ((self.slot_size() - META_FIXED) / self.entry_size()) as u32
    }
    /// Byte offset of a cluster index.
    pub fn offset(self, cluster: u64) -> u64 {
        cluster << self.cluster_bits
    }
    /// The bitmap of a cluster whose every page is present.
    pub fn full_bitmap(self, out: &mut [u64]) {
        let pages = self.pages();
        for (i, w) in out.iter_mut().enumerate() {
            let bits = pages.saturating_sub(i * 64).min(64);
            *w = if bits == 64 {
                u64::MAX
            } else {
                (1u64 << bits) - 1
            };
        }
    }
}

/// How to read a base image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BaseFormat {
    /// Look at the file's first bytes.
    Probe,
    /// Plain bytes.
    Raw,
    /// A pcow image.
    Pcow,
}

impl BaseFormat {
    fn code(self) -> u8 {
        match self {
            BaseFormat::Probe => 0,
            BaseFormat::Raw => 1,
            BaseFormat::Pcow => 2,
        }
    }
    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            BaseFormat::Probe => "probe",
            BaseFormat::Raw => "raw",
            BaseFormat::Pcow => "pcow",
        }
    }
}

/// A base image reference as stored in the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseRef {
    /// Path, relative to the naming image's directory unless absolute.
    pub name: String,
    /// Format, or probe.
    pub format: BaseFormat,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RawHeader {
    magic: [u8; 8],
    version: U32,
    header_length: U32,
    cluster_bits: U32,
    crc32c: U32,
    incompatible_features: U64,
    compatible_features: U64,
    autoclear_features: U64,
    generation: U64,
    virtual_size: U64,
    cluster_count: U64,
    data_cluster_count: U64,
    active_layer: U32,
    layer_count: U32,
    snapshot_count: U32,
    next_snapshot_id: U32,
    base_name_length: U16,
    base_format: u8,
    reserved: [u8; 13],
}
const _: () = assert!(core::mem::size_of::<RawHeader>() == HEADER_LENGTH_V1 as usize);

/// The decoded header (one slot's content).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Geometry from `cluster_bits`.
    pub geometry: Geometry,
    /// Header length as read (written back as [`HEADER_LENGTH_V1`]).
    pub header_length: u32,
    /// Incompatible feature bits.
    pub incompatible: u64,
    /// Compatible feature bits.
    pub compatible: u64,
    /// Autoclear feature bits.
    pub autoclear: u64,
    /// Committed generation.
    pub generation: u64,
    /// Guest-visible size in bytes.
    pub virtual_size: u64,
    /// Committed end of the file, in clusters.
    pub cluster_count: u64,
    /// Number of data entries in the file.
    pub data_cluster_count: u64,
    /// Layer whose view is the image's content.
    pub active_layer: u32,
    /// Number of layers.
    pub layer_count: u32,
    /// Number of live snapshots.
    pub snapshot_count: u32,
    /// Id for the next snapshot.
    pub next_snapshot_id: u32,
    /// Base image, if any.
    pub base: Option<BaseRef>,
}

impl Header {
    /// A fresh header for a new empty image.
    pub fn new(geometry: Geometry, virtual_size: u64, base: Option<BaseRef>) -> Self {
        Header {
            geometry,
            header_length: HEADER_LENGTH_V1,
            incompatible: 0,
            compatible: 0,
            autoclear: 0,
            generation: 0,
            virtual_size,
            cluster_count: 1,
            data_cluster_count: 0,
            active_layer: 0,
            layer_count: 1,
            snapshot_count: 0,
            next_snapshot_id: 1,
            base,
        }
    }

    /// Whether the DIRTY bit is set.
    pub fn dirty(&self) -> bool {
        self.incompatible & features::INCOMPAT_DIRTY != 0
    }

    /// Encodes one header slot (`S` bytes, CRC filled in).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_slot().to_bytes()
    }

    /// [`Header::encode`] as its non-zero head ([`Slot`]).
    pub(crate) fn encode_slot(&self) -> Slot {
        let g = self.geometry;
        let (name, format) = match &self.base {
            Some(b) => (b.name.as_bytes(), b.format.code()),
            None => (&[][..], 0),
        };
        let raw = RawHeader {
            magic: MAGIC,
            version: VERSION.into(),
            header_length: HEADER_LENGTH_V1.into(),
            cluster_bits: g.cluster_bits.into(),
            crc32c: 0.into(),
            incompatible_features: self.incompatible.into(),
            compatible_features: self.compatible.into(),
            autoclear_features: self.autoclear.into(),
            generation: self.generation.into(),
            virtual_size: self.virtual_size.into(),
            cluster_count: self.cluster_count.into(),
            data_cluster_count: self.data_cluster_count.into(),
            active_layer: self.active_layer.into(),
            layer_count: self.layer_count.into(),
            snapshot_count: self.snapshot_count.into(),
            next_snapshot_id: self.next_snapshot_id.into(),
            base_name_length: (name.len() as u16).into(),
            base_format: format,
            reserved: [0; 13],
        };
        let mut head = Vec::with_capacity(HEADER_LENGTH_V1 as usize + name.len());
        head.extend_from_slice(raw.as_bytes());
        head.extend_from_slice(name);
        Slot::sealed(head, g.slot_size(), HEADER_CRC_OFFSET)
    }

    /// Decodes and validates (R1..R4) the header slot in `buf`, which was
    /// read from file offset `at`. `buf` may be longer than the slot.
    pub fn decode(buf: &[u8], at: u64) -> Result<Header, FormatError> {
        let (raw, _) = RawHeader::read_from_prefix(buf)
            .map_err(|_| FormatError::HeaderMagic { offset: at })?;
        if raw.magic != MAGIC {
            return Err(FormatError::HeaderMagic { offset: at });
        }
        if raw.version.get() != VERSION {
            return Err(FormatError::Version {
                value: raw.version.get(),
                offset: at + 8,
            });
        }
        let hl = raw.header_length.get();
        if !(HEADER_LENGTH_V1..=MAX_HEADER_LENGTH).contains(&hl) || hl % 8 != 0 {
            return Err(FormatError::HeaderLength {
                value: hl,
                offset: at + 12,
            });
        }
        let geometry = Geometry::new(raw.cluster_bits.get()).ok_or(FormatError::ClusterBits {
            value: raw.cluster_bits.get(),
            offset: at + 16,
        })?;
        let slot = geometry.slot_size();
        if buf.len() < slot {
            return Err(FormatError::HeaderMagic { offset: at });
        }
        check_crc(&buf[..slot], HEADER_CRC_OFFSET, at)?;
        let generation = raw.generation.get();
        if generation == 0 || generation > MAX_GENERATION {
            return Err(FormatError::Generation {
                value: generation,
                offset: at + 48,
            });
        }
        let unknown = raw.incompatible_features.get() & !features::SUPPORTED_INCOMPAT;
        if unknown != 0 {
            return Err(FormatError::UnknownIncompatible {
                bits: unknown,
                offset: at + 24,
            });
        }
        let vs = raw.virtual_size.get();
        let cs = geometry.cluster_size();
        if vs == 0 || !vs.is_multiple_of(cs) || vs > MAX_VIRTUAL_SIZE {
            return Err(FormatError::VirtualSize {
                value: vs,
                cluster_size: cs,
                offset: at + 56,
            });
        }
        let name_len = raw.base_name_length.get() as usize;
        let name_start = hl as usize;
        if name_len > MAX_BASE_NAME || name_start + name_len > slot {
            return Err(FormatError::BaseNameLength {
                value: name_len as u64,
                offset: at + 96,
            });
        }
        let name_bytes = &buf[name_start..name_start + name_len];
        let format = match raw.base_format {
            0 => BaseFormat::Probe,
            1 => BaseFormat::Raw,
            2 => BaseFormat::Pcow,
            v => {
                return Err(FormatError::BaseFormat {
                    value: v,
                    offset: at + 98,
                })
            }
        };
        let base = if name_len == 0 {
            if format != BaseFormat::Probe {
                return Err(FormatError::BaseFormat {
                    value: raw.base_format,
                    offset: at + 98,
                });
            }
            None
        } else {
            let name = std::str::from_utf8(name_bytes)
                .ok()
                .filter(|s| !s.contains('\0'))
                .ok_or(FormatError::BaseNameEncoding {
                    offset: at + name_start as u64,
                })?;
            Some(BaseRef {
                name: name.to_owned(),
                format,
            })
        };
        Ok(Header {
            geometry,
            header_length: hl,
            incompatible: raw.incompatible_features.get(),
            compatible: raw.compatible_features.get(),
            autoclear: raw.autoclear_features.get(),
            generation: raw.generation.get(),
            virtual_size: vs,
            cluster_count: raw.cluster_count.get(),
            data_cluster_count: raw.data_cluster_count.get(),
            active_layer: raw.active_layer.get(),
            layer_count: raw.layer_count.get(),
            snapshot_count: raw.snapshot_count.get(),
            next_snapshot_id: raw.next_snapshot_id.get(),
            base,
        })
    }
}

/// Common prefix of meta and snapshot slots.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RawSlotPrefix {
    magic: [u8; 4],
    crc32c: U32,
    generation: U64,
    self_cluster: U64,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RawMeta {
    prefix: RawSlotPrefix,
    layer: U32,
    used: U32,
}
const _: () = assert!(core::mem::size_of::<RawMeta>() == META_FIXED);

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RawSnap {
    prefix: RawSlotPrefix,
    layer: U32,
    parent_layer: U32,
    snapshot_id: U32,
    tag_length: U16,
    reserved0: U16,
    time_sec: U64,
    time_nsec: U32,
    reserved1: U32,
    vm_state_offset: U64,
    vm_state_size: U64,
    reserved2: [u8; 56],
}
const _: () = assert!(core::mem::size_of::<RawSnap>() == SNAP_TAG_OFFSET);

/// What a meta or snapshot cluster slot holds, before rule checks that need
/// the rest of the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SlotBody {
    Meta { layer: u32, used: u32 },
    Snap(SnapSlot),
}

/// A decoded snapshot cluster slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SnapSlot {
    pub layer: u32,
    pub parent_layer: u32,
    pub snapshot_id: u32,
    pub tag: String,
    pub time_sec: u64,
    pub time_nsec: u32,
}

/// A slot that passed its magic and CRC checks.
#[derive(Debug, Clone)]
pub(crate) struct DecodedSlot {
    pub generation: u64,
    pub body: SlotBody,
}

/// Why a slot is not usable (kept for error messages).
#[derive(Debug, Clone)]
pub(crate) enum SlotFault {
    /// Neither magic: zeroed, never written, or not metadata at all.
    NoMagic,
    /// The CRC does not match (torn or damaged).
    Crc(FormatError),
    /// Written for another cluster.
    Misplaced { self_cluster: u64 },
}

impl std::fmt::Display for SlotFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotFault::NoMagic => write!(f, "no slot magic"),
            SlotFault::Crc(e) => write!(f, "{e}"),
            SlotFault::Misplaced { self_cluster } => {
                write!(f, "self_cluster says {self_cluster}")
            }
        }
    }
}

/// Decodes a meta or snapshot slot of `cluster`, read from file offset `at`.
/// Checks magic, CRC and position only; the caller checks the rest.
pub(crate) fn decode_slot(buf: &[u8], cluster: u64, at: u64) -> Result<DecodedSlot, SlotFault> {
    let Ok((p, _)) = RawSlotPrefix::read_from_prefix(buf) else {
        return Err(SlotFault::NoMagic);
    };
    if p.magic != META_MAGIC && p.magic != SNAP_MAGIC {
        return Err(SlotFault::NoMagic);
    }
    check_crc(buf, CLUSTER_CRC_OFFSET, at).map_err(SlotFault::Crc)?;
    if p.self_cluster.get() != cluster {
        return Err(SlotFault::Misplaced {
            self_cluster: p.self_cluster.get(),
        });
    }
    let generation = p.generation.get();
    if p.magic == META_MAGIC {
        let (m, _) = RawMeta::read_from_prefix(buf).map_err(|_| SlotFault::NoMagic)?;
        return Ok(DecodedSlot {
            generation,
            body: SlotBody::Meta {
                layer: m.layer.get(),
                used: m.used.get(),
            },
        });
    }
    let (s, _) = RawSnap::read_from_prefix(buf).map_err(|_| SlotFault::NoMagic)?;
    // Field checks that need no context are done here so every caller gets
    // them; a slot that fails them is reported by the scanner as R9.
    let tag_len = s.tag_length.get() as usize;
    let tag_bytes = buf
        .get(SNAP_TAG_OFFSET..SNAP_TAG_OFFSET + tag_len)
        .unwrap_or(&[]);
    let tag = String::from_utf8_lossy(tag_bytes).into_owned();
    Ok(DecodedSlot {
        generation,
        body: SlotBody::Snap(SnapSlot {
            layer: s.layer.get(),
            parent_layer: s.parent_layer.get(),
            snapshot_id: s.snapshot_id.get(),
            tag,
            time_sec: s.time_sec.get(),
            time_nsec: s.time_nsec.get(),
        }),
    })
}

/// Context-free R9 checks of a snapshot slot (tag, time, VM state fields).
pub(crate) fn check_snap_fields(buf: &[u8], at: u64) -> Result<(), FormatError> {
    let Ok((s, _)) = RawSnap::read_from_prefix(buf) else {
        return Err(FormatError::SnapshotTag {
            why: "slot too short",
            offset: at,
        });
    };
    let tag_len = s.tag_length.get() as usize;
    let tag_at = at + SNAP_TAG_OFFSET as u64;
    if s.snapshot_id.get() == 0 {
        if tag_len != 0 {
            return Err(FormatError::SnapshotTag {
                why: "a layer without a snapshot has a tag",
                offset: tag_at,
            });
        }
    } else {
        if tag_len == 0 || tag_len > MAX_TAG {
            return Err(FormatError::SnapshotTag {
                why: "tag_length must be 1..=255",
                offset: at + 36,
            });
        }
        let bytes = buf
            .get(SNAP_TAG_OFFSET..SNAP_TAG_OFFSET + tag_len)
            .unwrap_or(&[]);
        if std::str::from_utf8(bytes)
            .map(|t| t.contains('\0'))
            .unwrap_or(true)
        {
            return Err(FormatError::SnapshotTag {
                why: "not UTF-8 without NUL bytes",
                offset: tag_at,
            });
        }
    }
    if s.time_nsec.get() >= 1_000_000_000 {
        return Err(FormatError::TimeNsec {
            value: s.time_nsec.get(),
            offset: at + 48,
        });
    }
    if s.vm_state_offset.get() != 0 {
        return Err(FormatError::VmState { offset: at + 56 });
    }
    if s.vm_state_size.get() != 0 {
        return Err(FormatError::VmState { offset: at + 64 });
    }
    Ok(())
}

/// Encodes a meta slot: `entries` is `used * E` bytes already laid out.
pub(crate) fn encode_meta(
    g: Geometry,
    generation: u64,
    cluster: u64,
    layer: u32,
    used: u32,
    entries: &[u8],
) -> Slot {
    let raw = RawMeta {
        prefix: RawSlotPrefix {
            magic: META_MAGIC,
            crc32c: 0.into(),
            generation: generation.into(),
            self_cluster: cluster.into(),
        },
        layer: layer.into(),
        used: used.into(),
    };
    let mut head = Vec::with_capacity(META_FIXED + entries.len());
    head.extend_from_slice(raw.as_bytes());
    head.extend_from_slice(entries);
    Slot::sealed(head, g.slot_size(), CLUSTER_CRC_OFFSET)
}

/// Encodes a snapshot slot.
pub(crate) fn encode_snap(g: Geometry, generation: u64, cluster: u64, s: &SnapSlot) -> Slot {
    let raw = RawSnap {
        prefix: RawSlotPrefix {
            magic: SNAP_MAGIC,
            crc32c: 0.into(),
            generation: generation.into(),
            self_cluster: cluster.into(),
        },
        layer: s.layer.into(),
        parent_layer: s.parent_layer.into(),
        snapshot_id: s.snapshot_id.into(),
        tag_length: (s.tag.len() as u16).into(),
        reserved0: 0.into(),
        time_sec: s.time_sec.into(),
        time_nsec: s.time_nsec.into(),
        reserved1: 0.into(),
        vm_state_offset: 0.into(),
        vm_state_size: 0.into(),
        reserved2: [0; 56],
    };
    let mut head = Vec::with_capacity(SNAP_TAG_OFFSET + s.tag.len());
    head.extend_from_slice(raw.as_bytes());
    head.resize(SNAP_TAG_OFFSET, 0);
    head.extend_from_slice(s.tag.as_bytes());
    Slot::sealed(head, g.slot_size(), CLUSTER_CRC_OFFSET)
}

/// A slot's encoding as its head: the slot is `head` followed by zeros up
/// to `len` bytes. A slot is half a cluster (1 MiB at 2 MiB clusters) and
/// its CRC covers all of it, but its content is short; every barrier
/// encodes one per changed structure, so the zeros are never built, nor
/// read for the CRC (the CRC of zeros is extended arithmetically).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Slot {
    pub(crate) head: Vec<u8>,
    pub(crate) len: usize,
}

impl Slot {
    /// `head` (CRC field zero) sealed as a slot of `len` bytes: the CRC is
    /// the one [`seal`] computes over the whole slot.
    fn sealed(mut head: Vec<u8>, len: usize, crc_at: usize) -> Slot {
        // The fixed part is always there; a head longer than the slot is
        // a caller's bug the decoders' limits prevent (names, tags and
        // entries are bounded by the slot).
        debug_assert!(head.len() >= crc_at + 4 && head.len() <= len);
        let c = crc32c::crc32c(&head[..crc_at]);
        let c = crc32c::crc32c_append(c, &[0; 4]);
        let c = crc32c::crc32c_append(c, &head[crc_at + 4..]);
        let c = crc_append_zeros(c, len.saturating_sub(head.len()));
        head[crc_at..crc_at + 4].copy_from_slice(&c.to_le_bytes());
        Slot { head, len }
    }

    /// The whole slot.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        self.prefix(self.len)
    }

    /// The slot's first `n` bytes (at most its length).
    pub(crate) fn prefix(&self, n: usize) -> Vec<u8> {
        let n = n.min(self.len);
        let mut v = Vec::with_capacity(n);
        v.extend_from_slice(&self.head[..n.min(self.head.len())]);
        v.resize(n, 0);
        v
    }
}

/// `crc32c_append(crc, &[0; n])` without the zeros. CRC-32C's register
/// moves linearly over zero bytes: appending `2^k` of them is a fixed
/// 32x32 matrix over GF(2), so `n` zeros are the matrices of `n`'s bits
/// applied in turn (a few hundred operations, where reading 1 MiB of zeros
/// costs tens of microseconds, and far more under emulation).
fn crc_append_zeros(crc: u32, n: usize) -> u32 {
    static ZEROS: std::sync::OnceLock<[[u32; 32]; 48]> = std::sync::OnceLock::new();
    let ops = ZEROS.get_or_init(|| {
        // One zero bit in the reflected register: shift right, and feed
        // the polynomial back for the bit shifted out.
        let mut bit = [0u32; 32];
        bit[0] = 0x82F6_3B78;
        for (n, row) in bit.iter_mut().enumerate().skip(1) {
            *row = 1 << (n - 1);
        }
        let byte = gf2_square(&gf2_square(&gf2_square(&bit)));
        let mut ops = [[0u32; 32]; 48];
        ops[0] = byte;
        for k in 1..48 {
            ops[k] = gf2_square(&ops[k - 1]);
        }
        ops
    });
    // The register is the CRC inverted (CRC-32C's pre- and post-inversion).
    let mut reg = !crc;
    for (k, op) in ops.iter().enumerate() {
        if (n >> k) & 1 == 1 {
            reg = gf2_times(op, reg);
        }
    }
    !reg
}

/// `mat * vec` over GF(2): the rows of `mat` picked by `vec`'s bits.
fn gf2_times(mat: &[u32; 32], mut vec: u32) -> u32 {
    let mut sum = 0;
    let mut i = 0;
    while vec != 0 {
        if vec & 1 == 1 {
            sum ^= mat[i];
        }
        vec >>= 1;
        i += 1;
    }
    sum
}

/// `mat * mat` over GF(2): the operator applied twice.
fn gf2_square(mat: &[u32; 32]) -> [u32; 32] {
    let mut sq = [0u32; 32];
    for (row, m) in sq.iter_mut().zip(mat) {
        *row = gf2_times(mat, *m);
    }
    sq
}

fn slot_crc(buf: &[u8], crc_at: usize) -> u32 {
    let c = crc32c::crc32c(&buf[..crc_at]);
    let c = crc32c::crc32c_append(c, &[0; 4]);
    crc32c::crc32c_append(c, &buf[crc_at + 4..])
}

fn check_crc(buf: &[u8], crc_at: usize, at: u64) -> Result<(), FormatError> {
    let stored = u32::from_le_bytes([
        buf[crc_at],
        buf[crc_at + 1],
        buf[crc_at + 2],
        buf[crc_at + 3],
    ]);
    let computed = slot_crc(buf, crc_at);
    if stored != computed {
        return Err(FormatError::Crc {
            offset: at,
            stored,
            computed,
        });
    }
    Ok(())
}

/// Reads entry `i` of a meta slot: `(vcn, bitmap words)` into `bitmap`.
pub(crate) fn read_entry(slot: &[u8], g: Geometry, i: usize, bitmap: &mut [u64]) -> u64 {
    let e = META_FIXED + i * g.entry_size();
    let word = |o: usize| u64::from_le_bytes(slot[o..o + 8].try_into().unwrap_or([0; 8]));
    for (w, b) in bitmap.iter_mut().enumerate() {
        *b = word(e + 8 + 8 * w);
    }
    word(e)
}

/// Appends entry `(vcn, bitmap)` in its on-disk form.
pub(crate) fn push_entry(out: &mut Vec<u8>, vcn: u64, bitmap: &[u64]) {
    out.extend_from_slice(&vcn.to_le_bytes());
    for w in bitmap {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The CRC as the format defines it, over every byte of the slot.
    fn whole_slot_crc(bytes: &[u8], crc_at: usize) -> u32 {
        slot_crc(bytes, crc_at)
    }

    proptest! {
        #[test]
        fn appending_zeros_is_the_crc_of_zeros(crc in any::<u32>(), n in 0usize..200_000) {
            prop_assert_eq!(crc_append_zeros(crc, n), crc32c::crc32c_append(crc, &vec![0; n]));
        }

        /// A slot sealed from its head holds the CRC of the whole slot, and
        /// its bytes are the head then zeros.
        #[test]
        fn a_sealed_slot_is_the_whole_slot(
            head in proptest::collection::vec(any::<u8>(), 24..3000),
            extra in 0usize..(1 << 21),
            crc_at in 0usize..16,
        ) {
            let len = head.len() + extra;
            let mut h = head.clone();
            h[crc_at..crc_at + 4].fill(0);
            let slot = Slot::sealed(h.clone(), len, crc_at);
            let bytes = slot.to_bytes();
            prop_assert_eq!(bytes.len(), len);
            prop_assert_eq!(&bytes[..crc_at], &h[..crc_at]);
            prop_assert_eq!(&bytes[crc_at + 4..h.len()], &h[crc_at + 4..]);
            prop_assert!(bytes[h.len()..].iter().all(|b| *b == 0));
            let stored = u32::from_le_bytes(bytes[crc_at..crc_at + 4].try_into().unwrap());
            prop_assert_eq!(stored, whole_slot_crc(&bytes, crc_at));
            let n = extra.min(len);
            prop_assert_eq!(slot.prefix(n), bytes[..n].to_vec());
        }
    }

    #[test]
    fn encoded_slots_decode_at_every_cluster_size() {
        for bits in [12, 16, 21] {
            let g = Geometry::new(bits).unwrap();
            let mut h = Header::new(g, 1 << 30, None);
            h.generation = 7;
            let bytes = h.encode();
            assert_eq!(bytes.len(), g.slot_size());
            check_crc(&bytes, HEADER_CRC_OFFSET, 0).unwrap();
            let m = encode_meta(g, 3, 1, 0, 0, &[]).to_bytes();
            check_crc(&m, CLUSTER_CRC_OFFSET, 0).unwrap();
            let s = encode_snap(
                g,
                3,
                1,
                &SnapSlot {
                    layer: 1,
                    parent_layer: 0,
                    snapshot_id: 1,
                    tag: "t".into(),
                    time_sec: 1,
                    time_nsec: 2,
                },
            )
            .to_bytes();
            check_crc(&s, CLUSTER_CRC_OFFSET, 0).unwrap();
        }
    }

    #[test]
    fn geometry_table() {
        // (cluster_bits, P, W, E, N) as the spec's Conventions define them.
        let cases = [
            (12, 1, 1, 16, 126),
            (16, 16, 1, 16, 2046),
            (21, 512, 8, 72, 14563),
        ];
        for (bits, p, w, e, n) in cases {
            let g = Geometry::new(bits).unwrap();
            assert_eq!(
                (g.pages(), g.words(), g.entry_size(), g.capacity()),
                (p, w, e, n),
                "bits {bits}"
            );
        }
        assert!(Geometry::new(11).is_none() && Geometry::new(22).is_none());
        assert!(Geometry::from_cluster_size(3 << 12).is_none());
        let mut bm = [0u64; 8];
        Geometry::new(21).unwrap().full_bitmap(&mut bm);
        assert_eq!(bm, [u64::MAX; 8]);
        let mut bm = [0u64; 1];
        Geometry::new(15).unwrap().full_bitmap(&mut bm);
        assert_eq!(bm, [0xff]);
    }

    #[test]
    fn header_round_trip_and_crc() {
        let g = Geometry::new(16).unwrap();
        let mut h = Header::new(
            g,
            1 << 30,
            Some(BaseRef {
                name: "base.pcow".into(),
                format: BaseFormat::Pcow,
            }),
        );
        h.generation = 7;
        let buf = h.encode();
        assert_eq!(buf.len(), g.slot_size());
        assert_eq!(Header::decode(&buf, 0).unwrap(), h);
        let mut bad = buf.clone();
        bad[60] ^= 1;
        assert!(matches!(
            Header::decode(&bad, 0),
            Err(FormatError::Crc { .. })
        ));
    }
}
