//! pcow: a copy-on-write image format for persistent memory.
//!
//! A pcow file is a super cluster followed by appended segments (a meta
//! cluster and the data clusters it describes, positions implied by entry
//! index) and snapshot clusters that start new layers. `docs/pcow-format.md`
//! is the specification; this crate reads and writes exactly that.
//!
//! ```
//! # fn main() -> pcow::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("disk.pcow");
//! let opts = pcow::CreateOptions { virtual_size: Some(1 << 20), ..Default::default() };
//! let mut img = pcow::Image::create(&path, &opts)?;
//! img.write_at(b"hello", 4096)?;
//! img.snapshot_create("before")?;
//! img.write_at(b"world", 4096)?;
//! img.snapshot_apply("before")?;
//! let mut buf = [0u8; 5];
//! img.read_at(&mut buf, 4096)?;
//! assert_eq!(&buf, b"hello");
//! img.close()?;
//! # Ok(()) }
//! ```
//!
//! Modules, bottom up (imports point down; the one loop is inherent: a
//! base image is an [`Image`], opened by `chain`):
//! - `format` (on-disk encodings), `io` (the storage traits), `error`,
//!   `lock`, `slot_ends`, `extent`;
//! - `header` (reading the header slots, the staged header), `meta` (the
//!   cluster map: layers, segments, entries, bitmaps), `alloc` (the pool
//!   of reserved clusters), `commit` (a commit in flight and its handle);
//! - `image` (the `Image` struct: open, create, close, accessors), `chain`
//!   (opening the base chain);
//! - `impl Image` by job: `scan` (reading the metadata), `view` (reads,
//!   page sources, extents), `write`, `append` (new clusters, segments,
//!   layers), `barrier` (the staged commit), `snapshot`, `live` (what a
//!   device that maps the image uses), `temp` (temporary overlays);
//! - `check`, `ops` (the `pcow-img` operations), `identity` (which file,
//!   changed or not), `replace` (replacing an image under its name),
//!   `frozen` (clones of and resets to a VM snapshot's frozen image).
#![warn(missing_docs)]

mod alloc;
mod append;
mod barrier;
mod chain;
pub mod check;
pub mod civil;
mod commit;
mod error;
mod extent;
pub mod format;
mod frozen;
mod header;
mod identity;
mod image;
pub mod io;
mod live;
pub mod lock;
mod meta;
pub mod ops;
pub mod output_file;
pub mod replace;
mod scan;
mod slot_ends;
mod snapshot;
mod temp;
mod vcn_map;
mod view;
mod write;

pub use alloc::Preallocation;
pub use chain::{open_base_writable, resolve_base, Backing, RawImage};
pub use commit::Commit;
pub use error::{Error, Result};
pub use extent::Extent;
pub use format::{BaseFormat, BaseRef, FormatError, Geometry, Header};
pub use frozen::{create_clone, reset_to_frozen, FrozenError, ResetInfo};
pub use header::is_pcow;
pub use identity::FileIdentity;
pub use image::{CreateOptions, Image, OpenOptions, DEFAULT_CLUSTER_SIZE};
pub use live::{ActiveCluster, LiveImage};
pub use meta::SnapshotInfo;
pub use temp::TempOptions;
pub use view::{ClusterSource, PageLocation};
