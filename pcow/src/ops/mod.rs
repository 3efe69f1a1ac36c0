//! Whole-image operations built on [`crate::Image`]: commit, rebase,
//! compact, resize, convert, measure and compare.

use std::path::Path;

use crate::error::Result;
use crate::image::{Image, OpenOptions};

mod commit;
mod compact;
mod rebase;

pub use commit::{commit, commit_into, CommitReport};
pub use compact::{compact, CompactReport};
pub use rebase::rebase;

/// Grows the image at `path` to `new_size` bytes (a multiple of its
/// cluster size). Shrinking is refused.
pub fn resize(path: &Path, new_size: u64) -> Result<()> {
    // `grow` checks the size before it writes anything.
    let mut img = Image::open(path, OpenOptions::read_write_deferred())?;
    img.grow(new_size)?;
    img.close()
}
pub mod compare;
pub mod convert;
pub mod map;
pub mod measure;
mod source;
