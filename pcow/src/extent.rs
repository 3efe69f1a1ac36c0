//! Extents: ranges of a view and where their bytes live, as `map` and
//! the device report them; merged where they continue each other.

use std::path::PathBuf;

/// A range of the view and where its bytes live.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Extent {
    /// Virtual offset.
    pub offset: u64,
    /// Length in bytes.
    pub length: u64,
    /// 0: the top image, 1: its base, ...
    pub depth: usize,
    /// The file holding the bytes (for zeros: the deepest image consulted).
    pub file: PathBuf,
    /// Offset in `file`, or `None` for zeros.
    pub file_offset: Option<u64>,
}

pub(crate) fn push_extent(out: &mut Vec<Extent>, e: Extent) {
    if let Some(last) = out.last_mut() {
        let contiguous = match (last.file_offset, e.file_offset) {
            (Some(a), Some(b)) => a + last.length == b && last.file == e.file,
            (None, None) => true,
            _ => false,
        };
        if contiguous && last.depth == e.depth && last.offset + last.length == e.offset {
            last.length += e.length;
            return;
        }
    }
    out.push(e);
}

/// Merges two offset-sorted extent lists into one, coalescing neighbours.
pub(crate) fn merge_extents(a: Vec<Extent>, b: Vec<Extent>) -> Vec<Extent> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut a, mut b) = (a.into_iter().peekable(), b.into_iter().peekable());
    loop {
        let next = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) if x.offset <= y.offset => a.next(),
            (Some(_), Some(_)) => b.next(),
            (Some(_), None) => a.next(),
            (None, Some(_)) => b.next(),
            (None, None) => break,
        };
        if let Some(e) = next {
            push_extent(&mut out, e);
        }
    }
    out
}
