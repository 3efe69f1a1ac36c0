//! Compare: whether two images (raw or pcow, in any mix) show the same
//! content, with qemu-img compare's rules.
//!
//! - A range one image has no data for (a pcow hole through its whole
//!   chain, a hole of a sparse raw file) reads as zeros, so it equals zeros
//!   the other image stores.
//! - Images of different sizes are identical when the longer one holds
//!   only zeros past the shorter one's end (the caller warns of the size).
//! - Strict mode also fails on different sizes, and where one image has
//!   data and the other a hole: a hole of a raw file (`SEEK_HOLE`), or a
//!   range no image of a pcow chain holds. qemu-img calls that a block
//!   status mismatch, and so do two raw files, one sparse where the other
//!   stores zeros.
//!
//! Only ranges where at least one image has data are read: comparing two
//! sparse images costs what they hold, not their virtual size. A mismatch
//! is reported as the start of the first 512-byte sector that differs, as
//! qemu-img does.

use std::path::Path;

use crate::error::Error;
use crate::ops::convert::{ImageFormat, Source};

/// How to compare.
#[derive(Debug, Clone, Copy, Default)]
pub struct CompareOptions {
    /// Formats of the first and the second image; `None` probes the magic.
    pub formats: [Option<ImageFormat>; 2],
    /// Fail on different sizes and on allocation differences too.
    pub strict: bool,
    /// Open the images without locks (`-U`).
    pub force_share: bool,
}

/// The outcome of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The same content. `size_mismatch`: the sizes differ, and the longer
    /// image holds only zeros past the end of the shorter.
    Identical {
        /// Whether the sizes differ.
        size_mismatch: bool,
    },
    /// The bytes differ in the 512-byte sector starting at `offset`.
    ContentMismatch {
        /// Byte offset of the sector.
        offset: u64,
        /// The sizes differ and everything up to the shorter image's end
        /// matched (qemu-img warns of the size then).
        size_mismatch: bool,
    },
    /// Strict mode: the virtual sizes differ.
    SizeMismatch,
    /// Strict mode: at `offset` one image has data allocated and the other
    /// has none.
    AllocationMismatch {
        /// Byte offset where the allocation status first differs.
        offset: u64,
    },
}

impl Verdict {
    /// Whether the images count as the same.
    pub fn identical(&self) -> bool {
        matches!(self, Verdict::Identical { .. })
    }
}

/// Why a comparison could not finish. Each kind has its own exit status
/// in `pcow-img compare` ([`CompareError::exit_code`]).
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// An image could not be opened.
    #[error("opening the image")]
    Open(#[source] Error),
    /// Where an image holds data could not be found.
    #[error("finding where the image holds data")]
    Allocation(#[source] Error),
    /// Reading an image failed.
    #[error("reading")]
    Read(#[source] Error),
}

impl CompareError {
    /// qemu-img compare's exit status: 2 opening, 3 allocation, 4 reading.
    pub fn exit_code(&self) -> u8 {
        match self {
            CompareError::Open(_) => 2,
            CompareError::Allocation(_) => 3,
            CompareError::Read(_) => 4,
        }
    }
}

/// Bytes compared at a time.
const CHUNK: u64 = 2 << 20;
/// The unit a mismatch is reported in.
const SECTOR: u64 = 512;

/// One image's sorted, disjoint data ranges, walked in offset order.
struct Allocation {
    ranges: Vec<(u64, u64)>,
    next: usize,
}

impl Allocation {
    /// Whether `pos` is in a data range, and where that state ends
    /// (`u64::MAX` past the last range). Positions must not decrease
    /// between calls.
    fn at(&mut self, pos: u64) -> (bool, u64) {
        while self.next < self.ranges.len() && self.ranges[self.next].1 <= pos {
            self.next += 1;
        }
        match self.ranges.get(self.next) {
            Some(&(s, e)) if s <= pos => (true, e),
            Some(&(s, _)) => (false, s),
            None => (false, u64::MAX),
        }
    }
}

/// Compares the images at `first` and `second`. `progress(done, total)`
/// follows the walk over the larger virtual size.
pub fn compare(
    first: &Path,
    second: &Path,
    opts: &CompareOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Verdict, CompareError> {
    let open =
        |path, format| Source::open(path, format, opts.force_share).map_err(CompareError::Open);
    let images = [
        open(first, opts.formats[0])?,
        open(second, opts.formats[1])?,
    ];
    let sizes = [images[0].size(), images[1].size()];
    if opts.strict && sizes[0] != sizes[1] {
        return Ok(Verdict::SizeMismatch);
    }
    let mut alloc = Vec::with_capacity(2);
    for img in &images {
        alloc.push(Allocation {
            ranges: img.data_ranges().map_err(CompareError::Allocation)?,
            next: 0,
        });
    }
    let total = sizes[0].max(sizes[1]);
    let mut bufs = [vec![0u8; CHUNK as usize], vec![0u8; CHUNK as usize]];
    let mut pos = 0u64;
    progress(0, total);
    while pos < total {
        let (a0, e0) = alloc[0].at(pos);
        let (a1, e1) = alloc[1].at(pos);
        if opts.strict && a0 != a1 {
            return Ok(Verdict::AllocationMismatch { offset: pos });
        }
        // A range where neither image has data is skipped in one step:
        // the walk costs what the images hold, not their virtual size.
        let end = if a0 || a1 {
            e0.min(e1).min(pos + CHUNK)
        } else {
            e0.min(e1)
        }
        .min(total);
        if a0 || a1 {
            let n = (end - pos) as usize;
            for (i, held) in [a0, a1].into_iter().enumerate() {
                let buf = &mut bufs[i][..n];
                if held {
                    // A data range lies within its image's size.
                    images[i].read_at(buf, pos).map_err(CompareError::Read)?;
                } else {
                    buf.fill(0);
                }
            }
            if let Some(i) = bufs[0][..n]
                .iter()
                .zip(&bufs[1][..n])
                .position(|(x, y)| x != y)
            {
                let at = pos + i as u64;
                return Ok(Verdict::ContentMismatch {
                    offset: at - at % SECTOR,
                    size_mismatch: sizes[0] != sizes[1] && at >= sizes[0].min(sizes[1]),
                });
            }
        }
        pos = end;
        progress(pos, total);
    }
    Ok(Verdict::Identical {
        size_mismatch: sizes[0] != sizes[1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::{CreateOptions, Image};

    fn pcow(path: &Path, size: u64, writes: &[(u64, &[u8])]) {
        let mut img = Image::create(
            path,
            &CreateOptions {
                cluster_size: Some(4096),
                virtual_size: Some(size),
                base: None,
            },
        )
        .unwrap();
        for (off, data) in writes {
            img.write_at(data, *off).unwrap();
        }
        img.close().unwrap();
    }

    fn raw(path: &Path, size: u64, writes: &[(u64, &[u8])]) {
        let f = std::fs::File::create(path).unwrap();
        f.set_len(size).unwrap();
        for (off, data) in writes {
            std::os::unix::fs::FileExt::write_all_at(&f, data, *off).unwrap();
        }
    }

    fn cmp(a: &Path, b: &Path, strict: bool) -> Verdict {
        let opts = CompareOptions {
            strict,
            ..CompareOptions::default()
        };
        compare(a, b, &opts, &mut |_, _| {}).unwrap()
    }

    #[test]
    fn allocation_walk_reports_state_ends() {
        let mut a = Allocation {
            ranges: vec![(10, 20), (30, 40)],
            next: 0,
        };
        assert_eq!(a.at(0), (false, 10));
        assert_eq!(a.at(10), (true, 20));
        assert_eq!(a.at(19), (true, 20));
        assert_eq!(a.at(20), (false, 30));
        assert_eq!(a.at(35), (true, 40));
        assert_eq!(a.at(40), (false, u64::MAX));
    }

    #[test]
    fn content_sizes_and_allocation() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n);
        let m = 1 << 20;
        pcow(&p("a.pcow"), m, &[(5000, b"hello"), (700_000, &[7; 9000])]);
        raw(&p("a.raw"), m, &[(5000, b"hello"), (700_000, &[7; 9000])]);
        assert_eq!(
            cmp(&p("a.pcow"), &p("a.raw"), false),
            Verdict::Identical {
                size_mismatch: false
            }
        );
        // One byte differs, at 701_100: in the sector at 700_928.
        raw(
            &p("b.raw"),
            m,
            &[(5000, b"hello"), (700_000, &[7; 9000]), (701_100, &[8])],
        );
        assert_eq!(
            cmp(&p("a.pcow"), &p("b.raw"), false),
            Verdict::ContentMismatch {
                offset: 700_928,
                size_mismatch: false
            }
        );
        assert_eq!(
            cmp(&p("b.raw"), &p("a.pcow"), false),
            Verdict::ContentMismatch {
                offset: 700_928,
                size_mismatch: false
            }
        );
        // Zeros stored in one image equal a hole in the other; strict mode
        // calls that an allocation mismatch.
        pcow(&p("z.pcow"), m, &[(65536, &[0; 4096])]);
        pcow(&p("e.pcow"), m, &[]);
        assert!(cmp(&p("z.pcow"), &p("e.pcow"), false).identical());
        assert_eq!(
            cmp(&p("z.pcow"), &p("e.pcow"), true),
            Verdict::AllocationMismatch { offset: 65536 }
        );
        // Sizes: zeros past the shorter end are equal, data is not.
        pcow(
            &p("long.pcow"),
            2 * m,
            &[(5000, b"hello"), (700_000, &[7; 9000])],
        );
        assert_eq!(
            cmp(&p("a.pcow"), &p("long.pcow"), false),
            Verdict::Identical {
                size_mismatch: true
            }
        );
        assert_eq!(
            cmp(&p("a.pcow"), &p("long.pcow"), true),
            Verdict::SizeMismatch
        );
        pcow(
            &p("tail.pcow"),
            2 * m,
            &[(5000, b"hello"), (700_000, &[7; 9000]), (m + 1, &[1])],
        );
        assert_eq!(
            cmp(&p("tail.pcow"), &p("a.pcow"), false),
            Verdict::ContentMismatch {
                offset: m,
                size_mismatch: true
            }
        );
    }

    #[test]
    fn strict_mode_tells_holes_from_stored_zeros_in_raw_files() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n);
        raw(&p("sparse"), 1 << 20, &[(8192, b"x")]);
        raw(&p("full"), 1 << 20, &[(0, &vec![0; 1 << 20]), (8192, b"x")]);
        assert!(cmp(&p("sparse"), &p("full"), false).identical());
        assert_eq!(
            cmp(&p("sparse"), &p("full"), true),
            Verdict::AllocationMismatch { offset: 0 }
        );
        pcow(&p("a.pcow"), 1 << 20, &[(8192, b"x")]);
        assert!(cmp(&p("a.pcow"), &p("sparse"), true).identical());
    }

    #[test]
    fn open_errors_are_their_own_kind() {
        let d = tempfile::tempdir().unwrap();
        raw(&d.path().join("r"), 4096, &[]);
        let e = compare(
            &d.path().join("missing"),
            &d.path().join("r"),
            &CompareOptions::default(),
            &mut |_, _| {},
        )
        .unwrap_err();
        assert_eq!(e.exit_code(), 2, "{e:?}");
    }
}
