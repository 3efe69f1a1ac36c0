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
    image.cluster_sources(0..n, |vcn, source| {
        let state = plan_cluster(source, vcn * cs, cs, |r| push_run(&mut runs, r));
        states.push(state);
    });
    Ok(Plan {
        runs,
        clusters: states,
    })
}

/// The state of the cluster at region offset `at` once `source` is mapped
/// there, and its mappings, handed to `push` in ascending order.
pub(crate) fn plan_cluster(
    source: ClusterSource,
    at: u64,
    cs: u64,
    mut push: impl FnMut(Run),
) -> ClusterState {
    let (state, kind) = match source {
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
                push(Run {
                    offset: at + i as u64 * PAGE_SIZE,
                    len: PAGE_SIZE,
                    kind,
                });
            }
            return ClusterState::Private;
        }
    };
    push(Run {
        offset: at,
        len: cs,
        kind,
    });
    state
}

/// When the plan needs more than `room` mappings: leaves the clusters of
/// its shortest runs unmapped (holes, mapped by their first fault, see
/// [`crate::fault`]) so that at most about `room` remain, keeping the
/// longest runs; returns how many clusters it deferred. A mapping that
/// carries only part of a cluster (a mixed cluster's pages) defers that
/// whole cluster. The mappings a scattered image needs grow with its
/// allocated clusters; what the open maps then does not.
pub(crate) fn defer_short_runs(plan: &mut Plan, cs: u64, room: u64) -> u64 {
    if plan.runs.len() as u64 <= room {
        return 0;
    }
    let is_data = |r: &Run| !matches!(r.kind, RunKind::Hole);
    // The shortest run length (in clusters, doubling) whose longer runs,
    // with a hole between each two, fit.
    let mut min_clusters = 1u64;
    loop {
        let kept = plan
            .runs
            .iter()
            .filter(|r| is_data(r) && r.len.is_multiple_of(cs) && r.len / cs >= min_clusters)
            .count() as u64;
        if kept.saturating_mul(2).saturating_add(1) <= room || kept == 0 {
            break;
        }
        min_clusters = min_clusters.saturating_mul(2);
    }
    let deferred_run = |r: &Run| {
        is_data(r)
            && !(r.offset.is_multiple_of(cs)
                && r.len.is_multiple_of(cs)
                && r.len / cs >= min_clusters)
    };
    let mut deferred = vec![false; plan.clusters.len()];
    for r in plan.runs.iter().filter(|r| deferred_run(r)) {
        let (first, end) = (r.offset / cs, (r.offset + r.len).div_ceil(cs));
        for d in &mut deferred[first as usize..end as usize] {
            *d = true;
        }
    }
    let mut runs = Vec::new();
    for r in std::mem::take(&mut plan.runs) {
        // Split at cluster bounds where deferral starts or stops.
        let mut at = r.offset;
        let end = r.offset + r.len;
        while at < end {
            let vcn = at / cs;
            let d = deferred[vcn as usize];
            let mut stop = ((vcn + 1) * cs).min(end);
            while stop < end && deferred[(stop / cs) as usize] == d {
                stop = ((stop / cs + 1) * cs).min(end);
            }
            let kind = match r.kind {
                _ if d => RunKind::Hole,
                RunKind::File {
                    depth,
                    offset,
                    shared,
                } => RunKind::File {
                    depth,
                    offset: offset + (at - r.offset),
                    shared,
                },
                k => k,
            };
            push_run(
                &mut runs,
                Run {
                    offset: at,
                    len: stop - at,
                    kind,
                },
            );
            at = stop;
        }
    }
    plan.runs = runs;
    let mut n = 0;
    for (s, d) in plan.clusters.iter_mut().zip(&deferred) {
        if *d {
            *s = ClusterState::Hole;
            n += 1;
        }
    }
    n
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

    #[test]
    fn deferral_keeps_the_longest_runs_and_defers_whole_clusters() {
        let cs = 4 * PAGE_SIZE;
        let file = |offset, len, fo| Run {
            offset,
            len,
            kind: RunKind::File {
                depth: 0,
                offset: fo,
                shared: true,
            },
        };
        let mut runs = vec![
            file(0, cs, 10 * cs),
            file(cs, cs, 5 * cs),
            file(2 * cs, 4 * cs, 20 * cs),
            Run {
                offset: 6 * cs,
                len: 2 * cs,
                kind: RunKind::Hole,
            },
        ];
        // Cluster 8 mixed: a file page, then anonymous pages.
        runs.push(Run {
            offset: 8 * cs,
            len: PAGE_SIZE,
            kind: RunKind::File {
                depth: 1,
                offset: 0,
                shared: false,
            },
        });
        runs.push(Run {
            offset: 8 * cs + PAGE_SIZE,
            len: 3 * PAGE_SIZE,
            kind: RunKind::Anon,
        });
        runs.push(file(9 * cs, cs, 30 * cs));
        let mut clusters = vec![ClusterState::Shared; 10];
        clusters[6] = ClusterState::Hole;
        clusters[7] = ClusterState::Hole;
        clusters[8] = ClusterState::Private;
        let mut p = Plan {
            runs: runs.clone(),
            clusters: clusters.clone(),
        };
        // Everything fits: nothing changes.
        assert_eq!(defer_short_runs(&mut p, cs, 7), 0);
        assert_eq!(p.runs, runs);

        // Room for about one mapping: the 4-cluster run stays, the rest
        // are holes (merged with the hole between).
        assert_eq!(defer_short_runs(&mut p, cs, 3), 4);
        let hole = |offset, len| Run {
            offset,
            len,
            kind: RunKind::Hole,
        };
        assert_eq!(
            p.runs,
            vec![
                hole(0, 2 * cs),
                file(2 * cs, 4 * cs, 20 * cs),
                hole(6 * cs, 4 * cs)
            ]
        );
        let holes: Vec<usize> = (0..10)
            .filter(|&i| p.clusters[i] == ClusterState::Hole)
            .collect();
        assert_eq!(holes, vec![0, 1, 6, 7, 8, 9]);

        // No room at all: every run with data waits.
        let mut p = Plan { runs, clusters };
        assert_eq!(defer_short_runs(&mut p, cs, 0), 8);
        assert_eq!(p.runs, vec![hole(0, 10 * cs)]);
    }
}
