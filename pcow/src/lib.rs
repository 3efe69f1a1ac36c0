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
#![warn(missing_docs)]

mod barrier;
mod chain;
pub mod check;
pub mod civil;
mod error;
pub mod format;
mod image;
pub mod io;
pub mod lock;
pub mod ops;
pub mod output_file;
mod scan;
mod slot_ends;
mod snapshot;
mod temp;

pub use barrier::Commit;
pub use chain::{open_base_writable, resolve_base, Backing, RawImage};
pub use error::{Error, Result};
pub use format::{BaseFormat, BaseRef, FormatError, Geometry, Header};
pub use image::{
    is_pcow, ActiveCluster, ClusterSource, CreateOptions, Extent, Image, OpenOptions, PageLocation,
    Preallocation, SnapshotInfo, DEFAULT_CLUSTER_SIZE,
};
pub use temp::TempOptions;
