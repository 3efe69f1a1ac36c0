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
    /// Clusters with data left unmapped (see [`Deferral`]).
    pub deferred: u64,
}

/// The mappings of a whole image view and the state of every cluster,
/// at most about `room` mappings of them (past that, the shortest runs
/// are deferred: see [`Deferral`]); an error when there is no memory for
/// the states (the caller bounds their number, see
/// [`crate::build::MAX_REGION_CLUSTERS`]).
pub(crate) fn plan(image: &Image, room: u64) -> Result<Plan, TryReserveError> {
    let cs = image.cluster_size();
    let n = image.virtual_size() / cs;
    let mut runs = Vec::new();
    let mut states = Vec::new();
    states.try_reserve_exact(usize::try_from(n).unwrap_or(usize::MAX))?;
    let mut deferral = Deferral::new(cs, room);
    image.cluster_sources(0..n, |vcn, source| {
        let state = plan_cluster(source, vcn * cs, cs, |r| push_run(&mut runs, r));
        states.push(state);
        deferral.bound(&mut runs, &mut states);
    });
    let deferred = deferral.finish(&mut runs, &mut states);
    Ok(Plan {
        runs,
        clusters: states,
        deferred,
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

/// Leaves the clusters of a plan's shortest runs unmapped when it needs
/// more than `room` mappings (holes, mapped by their first fault, see
/// [`crate::fault`]), so that at most about `room` remain: it keeps the
/// runs of at least a length (in clusters, doubling from one) whose count,
/// with a hole between each two, fits. A mapping that carries only part of
/// a cluster (a mixed cluster's pages) defers that whole cluster. The
/// mappings a scattered image needs grow with its allocated clusters;
/// what the open maps then does not.
///
/// It runs while the plan is built ([`Deferral::bound`]), so that the
/// plan's runs never grow past about twice `room`: a scattered image of
/// 10^6 clusters would otherwise plan 10^6 runs (40 MB) only to drop
/// almost all of them. That gives what one pass over the whole plan gives,
/// because the length kept only grows as runs are added: a run shorter
/// than the length kept for part of the plan is shorter than the length
/// kept for all of it.
pub(crate) struct Deferral {
    cs: u64,
    room: u64,
    /// Runs shorter than this many clusters are deferred.
    min_clusters: u64,
    /// Whether runs were deferred already.
    started: bool,
    deferred: u64,
}

impl Deferral {
    pub(crate) fn new(cs: u64, room: u64) -> Deferral {
        Deferral {
            cs,
            room,
            min_clusters: 1,
            started: false,
            deferred: 0,
        }
    }

    /// Defers the short runs of a plan built so far (every cluster of
    /// `states` planned, the last run of `runs` possibly still growing)
    /// once it holds more than twice `room` runs.
    pub(crate) fn bound(&mut self, runs: &mut Vec<Run>, states: &mut [ClusterState]) {
        if runs.len() as u64 > self.room.saturating_mul(2).saturating_add(2) {
            self.started = true;
            self.defer(runs, states, 1);
        }
    }

    /// Defers the short runs of the finished plan if it needs more than
    /// `room` mappings; returns how many clusters were deferred in all.
    pub(crate) fn finish(mut self, runs: &mut Vec<Run>, states: &mut [ClusterState]) -> u64 {
        if self.started || runs.len() as u64 > self.room {
            self.defer(runs, states, 0);
        }
        self.deferred
    }

    /// Defers the short runs among all but the last `open` runs.
    fn defer(&mut self, runs: &mut Vec<Run>, states: &mut [ClusterState], open: usize) {
        let cs = self.cs;
        let closed = runs.len().saturating_sub(open);
        let is_data = |r: &Run| !matches!(r.kind, RunKind::Hole);
        let whole = |r: &Run| r.offset.is_multiple_of(cs) && r.len.is_multiple_of(cs);
        loop {
            let min = self.min_clusters;
            let kept = runs[..closed]
                .iter()
                .filter(|r| is_data(r) && whole(r) && r.len / cs >= min)
                .count() as u64;
            if kept.saturating_mul(2).saturating_add(1) <= self.room || kept == 0 {
                break;
            }
            self.min_clusters = min.saturating_mul(2);
        }
        // A deferred cluster's state becomes a hole; a mapping over a
        // cluster in that state becomes a hole below.
        for r in runs[..closed]
            .iter()
            .filter(|r| is_data(r) && !(whole(r) && r.len / cs >= self.min_clusters))
        {
            let (first, end) = (r.offset / cs, (r.offset + r.len).div_ceil(cs));
            for s in &mut states[first as usize..end as usize] {
                if *s != ClusterState::Hole {
                    *s = ClusterState::Hole;
                    self.deferred += 1;
                }
            }
        }
        let deferred = |at: u64| states[(at / cs) as usize] == ClusterState::Hole;
        let mut out = Vec::with_capacity(closed.min(self.room as usize) + open + 1);
        for r in runs.drain(..) {
            // A run is deferred whole or not at all, but for the one still
            // growing: its first cluster may be a mixed one deferred with
            // the runs before it. Only such a run is split, at cluster
            // bounds, so that a compaction costs its runs, not the
            // clusters they cover.
            let (first, last) = (deferred(r.offset), deferred(r.offset + r.len - 1));
            if first == last {
                let kind = if first { RunKind::Hole } else { r.kind };
                push_run(&mut out, Run { kind, ..r });
                continue;
            }
            let mut at = r.offset;
            let end = r.offset + r.len;
            while at < end {
                let d = deferred(at);
                let mut stop = ((at / cs + 1) * cs).min(end);
                while stop < end && deferred(stop) == d {
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
                    &mut out,
                    Run {
                        offset: at,
                        len: stop - at,
                        kind,
                    },
                );
                at = stop;
            }
        }
        *runs = out;
    }
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
        let (mut r, mut c) = (runs.clone(), clusters.clone());
        // Everything fits: nothing changes.
        assert_eq!(Deferral::new(cs, 7).finish(&mut r, &mut c), 0);
        assert_eq!(r, runs);

        // Room for about one mapping: the 4-cluster run stays, the rest
        // are holes (merged with the hole between).
        assert_eq!(Deferral::new(cs, 3).finish(&mut r, &mut c), 4);
        let hole = |offset, len| Run {
            offset,
            len,
            kind: RunKind::Hole,
        };
        assert_eq!(
            r,
            vec![
                hole(0, 2 * cs),
                file(2 * cs, 4 * cs, 20 * cs),
                hole(6 * cs, 4 * cs)
            ]
        );
        let holes: Vec<usize> = (0..10).filter(|&i| c[i] == ClusterState::Hole).collect();
        assert_eq!(holes, vec![0, 1, 6, 7, 8, 9]);

        // No room at all: every run with data waits.
        let (mut r, mut c) = (runs, clusters);
        assert_eq!(Deferral::new(cs, 0).finish(&mut r, &mut c), 8);
        assert_eq!(r, vec![hole(0, 10 * cs)]);
    }

    /// A cluster's source drawn from `seed`, in runs of random length (1
    /// to 150 clusters) of one kind each: clusters of the top file or of a
    /// base contiguous in it (a run starts at a jump in the file), holes,
    /// and single mixed clusters.
    fn source(seed: &mut u64, run: &mut (u64, u64, u64), cs: u64) -> ClusterSource {
        let mut next = || {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            *seed
        };
        let (at, left, kind) = run;
        if *left == 0 {
            *at += (next() % 64 + 2) * cs;
            *left = [1, 1, 1, 2, 3, 5, 8, 40, 150][(next() % 9) as usize];
            *kind = next() % 10;
        }
        *left -= 1;
        let here = *at;
        *at += cs;
        match *kind {
            0..=5 => ClusterSource::Active { offset: here },
            6 => ClusterSource::Hole,
            7 | 8 => ClusterSource::ReadOnly {
                depth: 1,
                offset: here,
            },
            _ => {
                *left = 0;
                let r = next();
                ClusterSource::Mixed(
                    (0..cs / PAGE_SIZE)
                        .map(|p| {
                            if (r >> p) & 1 == 0 {
                                PageLocation::Zero
                            } else {
                                PageLocation::File {
                                    depth: 1,
                                    offset: here + p * PAGE_SIZE,
                                }
                            }
                        })
                        .collect(),
                )
            }
        }
    }

    #[test]
    fn deferring_while_planning_equals_deferring_the_whole_plan() {
        let cs = 4 * PAGE_SIZE;
        let rooms = [0u64, 1, 2, 5, 10, 20, 40, 100, 5000];
        for (seed, room) in (1..=30u64).flat_map(|s| rooms.iter().map(move |&r| (s, r))) {
            let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut file = (0, 0, 0);
            let sources: Vec<ClusterSource> =
                (0..3000).map(|_| source(&mut s, &mut file, cs)).collect();
            // The whole plan, then one pass.
            let (mut all, mut all_states) = (Vec::new(), Vec::new());
            for (vcn, src) in sources.iter().enumerate() {
                let st = plan_cluster(src.clone(), vcn as u64 * cs, cs, |r| push_run(&mut all, r));
                all_states.push(st);
            }
            let planned = all.len();
            let once = Deferral::new(cs, room).finish(&mut all, &mut all_states);
            // Deferred while planning, as `plan` does.
            let (mut runs, mut states) = (Vec::new(), Vec::new());
            let mut d = Deferral::new(cs, room);
            let mut most = 0;
            for (vcn, src) in sources.iter().enumerate() {
                let st = plan_cluster(src.clone(), vcn as u64 * cs, cs, |r| push_run(&mut runs, r));
                states.push(st);
                d.bound(&mut runs, &mut states);
                most = most.max(runs.len());
            }
            let progressive = d.finish(&mut runs, &mut states);
            assert_eq!(
                (progressive, &runs, &states),
                (once, &all, &all_states),
                "seed {seed}, room {room}"
            );
            assert!(most as u64 <= 2 * room + 3, "room {room}: {most} runs held");
            if room < 100 {
                assert!(
                    planned as u64 > 2 * room + 3 && once > 0,
                    "room {room}: nothing to defer"
                );
            }
            if once > 0 {
                assert!(
                    runs.len() as u64 <= room + 1,
                    "room {room}: {} runs",
                    runs.len()
                );
            }
        }
    }
}
