//! What is mapped over each cluster of the region ([`ClusterState`]), and
//! runs: the one place where adjacent pieces (clusters, pages, mappings,
//! address ranges) are merged into maximal runs ([`Adjoin`], [`push_run`]).

/// What is mapped over one cluster of the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterState {
    /// Nothing: anonymous, registered with userfaultfd, no page present.
    Hole,
    /// A former hole the monitor filled with the zero page on a read;
    /// writes land in private anonymous pages.
    Zero,
    /// Private mapping(s) of read-only data (and anonymous zero pages for
    /// a mixed cluster): writes land in private pages.
    Private,
    /// The active layer's cluster, mapped shared.
    Shared,
}

/// A piece that may continue the one before it.
pub(crate) trait Adjoin {
    /// Grows `self` by `next` when `next` continues it; returns whether it
    /// did.
    fn adjoin(&mut self, next: &Self) -> bool;
}

/// An address or index range `[start, end)`: adjoins a range starting at
/// its end.
impl Adjoin for (u64, u64) {
    fn adjoin(&mut self, next: &Self) -> bool {
        if self.1 == next.0 {
            self.1 = next.1;
            true
        } else {
            false
        }
    }
}

/// Appends `piece`, merged into the last run when it continues it.
pub(crate) fn push_run<T: Adjoin>(runs: &mut Vec<T>, piece: T) {
    if let Some(last) = runs.last_mut() {
        if last.adjoin(&piece) {
            return;
        }
    }
    runs.push(piece);
}

/// Clusters `[vcn, end)` stored contiguously in one file from byte
/// `offset` (clusters of `cs` bytes): adjoins the clusters that follow in
/// the region and in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileRun {
    pub(crate) vcn: u64,
    pub(crate) end: u64,
    pub(crate) offset: u64,
    pub(crate) cs: u64,
}

impl FileRun {
    /// Cluster `vcn` alone, stored at `offset`.
    pub(crate) fn one(vcn: u64, offset: u64, cs: u64) -> FileRun {
        FileRun {
            vcn,
            end: vcn + 1,
            offset,
            cs,
        }
    }
}

impl Adjoin for FileRun {
    fn adjoin(&mut self, next: &FileRun) -> bool {
        let follows = self.end == next.vcn
            && self.cs == next.cs
            && self.offset + (self.end - self.vcn) * self.cs == next.offset;
        if follows {
            self.end = next.end;
        }
        follows
    }
}

/// Maximal runs `[first, end)` of consecutive values in `sorted` (sorted,
/// unique).
pub(crate) fn index_runs(sorted: impl IntoIterator<Item = u64>) -> Vec<(u64, u64)> {
    let mut runs = Vec::new();
    for i in sorted {
        push_run(&mut runs, (i, i + 1));
    }
    runs
}

/// The state of every cluster of the region, by vcn, and how many are in
/// each state (kept as they change: a barrier that follows a write log
/// asks for the zero-mapped count without a pass over a million
/// clusters).
#[derive(Debug)]
pub(crate) struct Clusters(Vec<ClusterState>, [u64; 4]);

/// Index of `s` in the per-state counts.
fn slot(s: ClusterState) -> usize {
    match s {
        ClusterState::Hole => 0,
        ClusterState::Zero => 1,
        ClusterState::Private => 2,
        ClusterState::Shared => 3,
    }
}

impl Clusters {
    pub(crate) fn new(states: Vec<ClusterState>) -> Clusters {
        let mut counts = [0u64; 4];
        for &s in &states {
            counts[slot(s)] += 1;
        }
        Clusters(states, counts)
    }

    /// The state of cluster `vcn` (in the region: callers check).
    pub(crate) fn get(&self, vcn: u64) -> ClusterState {
        self.0[vcn as usize]
    }

    /// Sets clusters `[vcn, end)` to `state`.
    pub(crate) fn set(&mut self, vcn: u64, end: u64, state: ClusterState) {
        for c in &mut self.0[vcn as usize..end as usize] {
            self.1[slot(*c)] -= 1;
            self.1[slot(state)] += 1;
            *c = state;
        }
    }

    /// Clusters in the region.
    pub(crate) fn len(&self) -> u64 {
        self.0.len() as u64
    }

    /// Clusters in `state`.
    pub(crate) fn count(&self, state: ClusterState) -> u64 {
        self.1[slot(state)]
    }

    /// Maximal runs `[first, end)` of clusters in `state`.
    pub(crate) fn runs(&self, state: ClusterState) -> Vec<(u64, u64)> {
        let ([runs], _) = self.runs_of([state]);
        runs
    }

    /// Maximal runs of clusters in each of `states`, in one pass over the
    /// clusters (a million at 64 GiB of 64 KiB clusters: a pass is about a
    /// millisecond, which a barrier pays), and the clusters in each.
    pub(crate) fn runs_of<const N: usize>(
        &self,
        states: [ClusterState; N],
    ) -> ([Vec<(u64, u64)>; N], [u64; N]) {
        let mut runs: [Vec<(u64, u64)>; N] = std::array::from_fn(|_| Vec::new());
        let mut counts = [0u64; N];
        let mut i = 0u64;
        for same in self.0.chunk_by(|a, b| a == b) {
            let n = same.len() as u64;
            if let Some(k) = states.iter().position(|s| *s == same[0]) {
                runs[k].push((i, i + n));
                counts[k] += n;
            }
            i += n;
        }
        (runs, counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_only_when_they_touch() {
        let mut runs = Vec::new();
        for r in [(0, 2), (2, 5), (6, 7), (7, 8), (10, 11)] {
            push_run(&mut runs, r);
        }
        assert_eq!(runs, vec![(0, 5), (6, 8), (10, 11)]);
        assert_eq!(
            index_runs([1, 2, 3, 7, 9, 10]),
            vec![(1, 4), (7, 8), (9, 11)]
        );
        let f = |vcn, offset| FileRun {
            vcn,
            end: vcn + 1,
            offset,
            cs: 16,
        };
        let mut runs = Vec::new();
        for r in [f(0, 32), f(1, 48), f(2, 0), f(4, 16)] {
            push_run(&mut runs, r);
        }
        let ends: Vec<_> = runs.iter().map(|r| (r.vcn, r.end, r.offset)).collect();
        assert_eq!(ends, vec![(0, 2, 32), (2, 3, 0), (4, 5, 16)]);
    }

    #[test]
    fn runs_of_states_are_maximal_and_counted() {
        use ClusterState::*;
        let c = Clusters::new(vec![Hole, Hole, Zero, Private, Private, Hole, Zero]);
        let ([holes, zero], counts) = c.runs_of([Hole, Zero]);
        assert_eq!(holes, vec![(0, 2), (5, 6)]);
        assert_eq!(zero, vec![(2, 3), (6, 7)]);
        assert_eq!(counts, [3, 2]);
        assert_eq!(c.runs(Private), vec![(3, 5)]);
        assert_eq!(c.count(Shared), 0);
    }

    #[test]
    fn counts_follow_every_change() {
        use ClusterState::*;
        let mut c = Clusters::new(vec![Hole, Hole, Zero, Private, Private, Hole, Zero]);
        c.set(0, 3, Shared);
        c.set(5, 7, Zero);
        c.set(4, 5, Private);
        for s in [Hole, Zero, Private, Shared] {
            let passes = c.0.iter().filter(|&&x| x == s).count() as u64;
            assert_eq!(c.count(s), passes, "{s:?}");
        }
        assert_eq!(
            [
                c.count(Hole),
                c.count(Zero),
                c.count(Private),
                c.count(Shared)
            ],
            [0, 2, 2, 3]
        );
    }
}
