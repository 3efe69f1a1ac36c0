//! The mappings of a whole image view, planned from the image's layout:
//!
//! - a whole cluster of the writable layer: `MAP_SHARED` read-write from the
//!   top file (guest writes go straight to the image);
//! - a cluster of a read-only layer (snapshot, base image):
//!   `MAP_PRIVATE` from its file (the host kernel copies a page on write,
//!   without an exit; the barrier moves the copies into the image);
//! - a hole: the reservation's anonymous memory, registered with
//!   userfaultfd for missing pages (the monitor serves it);
//! - a mixed cluster: per page run, file pages `MAP_PRIVATE`, zero pages
//!   anonymous (not registered: a write there is harvested like a
//!   copy-on-write page).
//!
//! Adjacent clusters contiguous in the same file with the same mode share
//! one mapping.

use std::collections::TryReserveError;

use pcow::{ClusterSource, Image, PageLocation};

use crate::clusters::{push_run, Adjoin, ClusterState};
use crate::mapping::PAGE_SIZE;

/// One planned mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub offset: u64,
    pub len: u64,
    pub kind: RunKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunKind {
    /// Registered anonymous memory.
    Hole,
    /// Plain anonymous memory (zero pages of a mixed cluster).
    Anon,
    File {
        depth: usize,
        offset: u64,
        shared: bool,
    },
}

impl Adjoin for Run {
    /// Contiguous in the region, and the same kind: holes with holes,
    /// anonymous with anonymous, file pieces contiguous in the same file
    /// with the same mode.
    fn adjoin(&mut self, next: &Run) -> bool {
        if self.offset + self.len != next.offset {
            return false;
        }
        let merge = match (self.kind, next.kind) {
            (RunKind::Hole, RunKind::Hole) | (RunKind::Anon, RunKind::Anon) => true,
            (
                RunKind::File {
                    depth: d1,
                    offset: o1,
                    shared: s1,
                },
                RunKind::File {
                    depth: d2,
                    offset: o2,
                    shared: s2,
                },
            ) => d1 == d2 && s1 == s2 && o1 + self.len == o2,
            _ => false,
        };
        if merge {
            self.len += next.len;
        }
        merge
    }
}

/// The plan of a region.
pub(crate) struct Plan {
    pub runs: Vec<Run>,
    pub clusters: Vec<ClusterState>,
}

/// The mappings of a whole image view and the state of every cluster; an
/// error when there is no memory for the states (the caller bounds their
/// number, see [`crate::build::MAX_REGION_CLUSTERS`]).
pub(crate) fn plan(image: &Image) -> Result<Plan, TryReserveError> {
    let cs = image.cluster_size();
    let n = image.virtual_size() / cs;
    let mut runs = Vec::new();
    let mut states = Vec::new();
    states.try_reserve_exact(usize::try_from(n).unwrap_or(usize::MAX))?;
    for vcn in 0..n {
        let at = vcn * cs;
        let (state, kind) = match image.cluster_source(vcn) {
            ClusterSource::Active { offset } => (
                ClusterState::Shared,
                RunKind::File {
                    depth: 0,
                    offset,
                    shared: true,
                },
            ),
            ClusterSource::ReadOnly { depth, offset } => (
                ClusterState::Private,
                RunKind::File {
                    depth,
                    offset,
                    shared: false,
                },
            ),
            ClusterSource::Hole => (ClusterState::Hole, RunKind::Hole),
            ClusterSource::Mixed(pages) => {
                for (i, p) in pages.iter().enumerate() {
                    let kind = match *p {
                        PageLocation::Zero => RunKind::Anon,
                        PageLocation::File { depth, offset } => RunKind::File {
                            depth,
                            offset,
                            shared: false,
                        },
                    };
                    push_run(
                        &mut runs,
                        Run {
                            offset: at + i as u64 * PAGE_SIZE,
                            len: PAGE_SIZE,
                            kind,
                        },
                    );
                }
                states.push(ClusterState::Private);
                continue;
            }
        };
        states.push(state);
        push_run(
            &mut runs,
            Run {
                offset: at,
                len: cs,
                kind,
            },
        );
    }
    Ok(Plan {
        runs,
        clusters: states,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_only_when_contiguous_in_the_same_file_and_mode() {
        let f = |offset, len, depth, fo, shared| Run {
            offset,
            len,
            kind: RunKind::File {
                depth,
                offset: fo,
                shared,
            },
        };
        let mut runs = Vec::new();
        push_run(&mut runs, f(0, 4096, 0, 8192, true));
        push_run(&mut runs, f(4096, 4096, 0, 12288, true)); // merges
        push_run(&mut runs, f(8192, 4096, 0, 16384, false)); // other mode
        push_run(&mut runs, f(12288, 4096, 1, 20480, false)); // other file
        push_run(&mut runs, f(16384, 4096, 1, 0, false)); // not contiguous
        let hole = |offset| Run {
            offset,
            len: 4096,
            kind: RunKind::Hole,
        };
        push_run(&mut runs, hole(20480));
        push_run(&mut runs, hole(24576)); // merges
        assert_eq!(runs.len(), 5);
        assert_eq!(runs[0].len, 8192);
        assert_eq!(runs[4].len, 8192);
    }
}
