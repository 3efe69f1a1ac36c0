//! The library's error type: what went wrong, on which file, with the cause
//! chained through `source()`.

use std::path::{Path, PathBuf};

use crate::format::FormatError;

/// Errors of the `pcow` library.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {op}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid image")]
    Format {
        path: PathBuf,
        #[source]
        source: FormatError,
    },
    #[error("{path}: image is in use by another process (lock held)")]
    Locked { path: PathBuf },
    #[error("{path}: is a {kind}, not a regular file")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{path}: base image {name:?} (resolved to {resolved}) does not exist")]
    BaseMissing {
        path: PathBuf,
        name: String,
        resolved: PathBuf,
    },
    #[error("{path}: base image {resolved} is not a {expected} image")]
    BaseFormat {
        path: PathBuf,
        resolved: PathBuf,
        expected: &'static str,
    },
    #[error("{path}: base chain deeper than {limit} images")]
    ChainTooDeep { path: PathBuf, limit: usize },
    #[error("{path}: base chain has a cycle: {resolved} appears twice")]
    ChainCycle { path: PathBuf, resolved: PathBuf },
    #[error("{path}: image is read-only")]
    ReadOnly { path: PathBuf },
    #[error("{path}: access [{offset}, {offset}+{len}) is beyond the virtual size {size}")]
    OutOfRange {
        path: PathBuf,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("{path}: no snapshot with id or tag {snap:?}")]
    NoSuchSnapshot { path: PathBuf, snap: String },
    #[error("{path}: a snapshot tagged {tag:?} already exists")]
    DuplicateTag { path: PathBuf, tag: String },
    #[error("{path}: bad snapshot tag {tag:?}: {why}")]
    BadTag {
        path: PathBuf,
        tag: String,
        why: &'static str,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("{path}: limit reached: {what}")]
    Limit { path: PathBuf, what: String },
    #[error("{path}: image has no base image")]
    NoBase { path: PathBuf },
    #[error("{path}: a commit is in progress")]
    CommitPending { path: PathBuf },
    #[error("{path}: not the image's pending commit")]
    CommitNotPending { path: PathBuf },
    #[error("{path}: commit not written")]
    CommitUnwritten { path: PathBuf },
    #[error("{path}: commit failed earlier, abort it")]
    CommitFailed { path: PathBuf },
    #[error("{path}: commit cancelled by closing the image")]
    CommitCancelled { path: PathBuf },
}

/// Result alias of the library.
pub type Result<T> = std::result::Result<T, Error>;

/// Maps an I/O error of `op` on the file at `path` to [`Error::Io`].
pub(crate) fn io_err<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        path: path.to_owned(),
        op,
        source,
    }
}
