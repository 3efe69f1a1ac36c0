//! [`VcnMap`]: a layer's map from virtual cluster number to entry index.
//!
//! Opening an image with 10^6 allocated clusters spent about half its time
//! in a hash map (a cache miss per lookup and per insert, and rehashing
//! as it grew: its size cannot be taken from the header's untrusted
//! counters). Real images are mostly dense: a layer holds a good share of
//! the clusters below its highest one. So the map switches to a plain
//! table indexed by vcn once its keys are dense enough ([`DENSITY`]), and
//! back to hashing if a far key would make the table too sparse. Either
//! way its memory follows the entries really inserted (the table is at
//! most [`DENSITY`] slots per entry), never a size an image declares.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Multiplicative hash for cluster numbers: the keys are integers that
/// SipHash would spend most of the open time on.
#[derive(Default)]
pub(crate) struct VcnHasher(u64);

impl Hasher for VcnHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type Sparse = HashMap<u64, u32, BuildHasherDefault<VcnHasher>>;

/// A table slot with no entry. Entry indices stay below it: an image has
/// fewer than 2^32 clusters ([`crate::format::MAX_CLUSTER_COUNT`]), and
/// an index that is not is kept in the hash map.
const ABSENT: u32 = u32::MAX;

/// The table is used while it has at most this many slots per entry (4
/// bytes each: at most 64 bytes per entry, about three times what the
/// hash map takes, still bounded by the entries really inserted). Entries
/// inserted in scattered order stay hashed until the table would reach
/// this density: at 4 slots per entry a quarter of the entries of an
/// image written in random order went through the hash map (about a tenth
/// of its open time at 10^6 clusters, in a profile), at 16 a sixteenth.
const DENSITY: u64 = 16;

/// Below this many entries the hash map is small anyway.
const DENSE_MIN_LEN: usize = 1024;

/// vcn -> entry index of one layer.
#[derive(Debug, Clone, Default)]
pub(crate) struct VcnMap {
    repr: Repr,
    len: usize,
}

#[derive(Debug, Clone)]
enum Repr {
    /// Keys hashed; `max` is the largest key (when not empty); `pinned`:
    /// an index equal to [`ABSENT`] was inserted, which no table can hold.
    Sparse { map: Sparse, max: u64, pinned: bool },
    /// `table[vcn]` is the entry index, or [`ABSENT`].
    Dense(Vec<u32>),
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Sparse {
            map: Sparse::default(),
            max: 0,
            pinned: false,
        }
    }
}

impl VcnMap {
    /// Entries in the map.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The entry index of `vcn`.
    pub(crate) fn get(&self, vcn: &u64) -> Option<&u32> {
        match &self.repr {
            Repr::Sparse { map, .. } => map.get(vcn),
            Repr::Dense(t) => usize::try_from(*vcn)
                .ok()
                .and_then(|i| t.get(i))
                .filter(|e| **e != ABSENT),
        }
    }

    /// Whether `vcn` has an entry.
    pub(crate) fn contains_key(&self, vcn: &u64) -> bool {
        self.get(vcn).is_some()
    }

    /// Maps `vcn` to `idx`; returns the index it had.
    pub(crate) fn insert(&mut self, vcn: u64, idx: u32) -> Option<u32> {
        if let Repr::Dense(t) = &mut self.repr {
            let fits = idx != ABSENT && vcn < DENSITY * (self.len as u64 + 1);
            match usize::try_from(vcn) {
                Ok(i) if i < t.len() && idx != ABSENT => {
                    let old = std::mem::replace(&mut t[i], idx);
                    if old == ABSENT {
                        self.len += 1;
                        return None;
                    }
                    return Some(old);
                }
                Ok(i) if fits => {
                    t.resize(i + 1, ABSENT);
                    t[i] = idx;
                    self.len += 1;
                    return None;
                }
                _ => self.make_sparse(),
            }
        }
        let mut old = None;
        let mut densify = false;
        if let Repr::Sparse { map, max, pinned } = &mut self.repr {
            old = map.insert(vcn, idx);
            if old.is_none() {
                *max = if self.len == 0 { vcn } else { (*max).max(vcn) };
                self.len += 1;
            }
            *pinned |= idx == ABSENT;
            densify = !*pinned && self.len >= DENSE_MIN_LEN && *max < DENSITY * self.len as u64;
        }
        if densify {
            self.make_dense();
        }
        old
    }

    /// Maps `vcn` to `idx` unless it has an entry already (one lookup);
    /// returns whether it did.
    pub(crate) fn insert_new(&mut self, vcn: u64, idx: u32) -> bool {
        if let Repr::Dense(t) = &mut self.repr {
            if let Some(slot) = usize::try_from(vcn).ok().and_then(|i| t.get_mut(i)) {
                if *slot != ABSENT {
                    return false;
                }
                if idx != ABSENT {
                    *slot = idx;
                    self.len += 1;
                    return true;
                }
            }
        } else if let Repr::Sparse { map, .. } = &self.repr {
            if map.contains_key(&vcn) {
                return false;
            }
        }
        self.insert(vcn, idx).is_none()
    }

    /// Loads the table slots of `vcns`, a batch about to be inserted,
    /// without changing anything: on an image written in scattered order
    /// each insert's slot is a cache miss, and loaded together their
    /// misses overlap instead of each stalling its insert (the scan's
    /// inserts sit between longer work, so the processor does not reach
    /// the next one's load while one waits).
    pub(crate) fn preload(&self, vcns: impl Iterator<Item = u64>) {
        if let Repr::Dense(t) = &self.repr {
            let mut seen = 0u32;
            for v in vcns {
                if let Some(e) = usize::try_from(v).ok().and_then(|i| t.get(i)) {
                    seen ^= *e;
                }
            }
            std::hint::black_box(seen);
        }
    }

    /// Empties the map.
    pub(crate) fn clear(&mut self) {
        *self = VcnMap::default();
    }

    /// Room for `n` more entries, while the map hashes.
    pub(crate) fn reserve(&mut self, n: usize) {
        if let Repr::Sparse { map, .. } = &mut self.repr {
            map.reserve(n);
        }
    }

    /// `(vcn, entry index)` of every entry, in no particular order.
    pub(crate) fn iter(&self) -> Box<dyn Iterator<Item = (u64, u32)> + '_> {
        match &self.repr {
            Repr::Sparse { map, .. } => Box::new(map.iter().map(|(&v, &e)| (v, e))),
            Repr::Dense(t) => Box::new(
                t.iter()
                    .enumerate()
                    .filter(|(_, e)| **e != ABSENT)
                    .map(|(v, &e)| (v as u64, e)),
            ),
        }
    }

    /// The vcns with an entry, in no particular order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.iter().map(|(v, _)| v)
    }

    fn make_dense(&mut self) {
        let Repr::Sparse { map, max, .. } = &self.repr else {
            return;
        };
        // Only called while `max` is below DENSITY times the entries.
        let Some(n) = usize::try_from(*max).ok().and_then(|m| m.checked_add(1)) else {
            return;
        };
        let mut t = vec![ABSENT; n];
        for (&v, &e) in map {
            // Every key is at most `max`.
            t[v as usize] = e;
        }
        self.repr = Repr::Dense(t);
    }

    fn make_sparse(&mut self) {
        let Repr::Dense(t) = &self.repr else {
            return;
        };
        let mut map = Sparse::default();
        map.reserve(self.len);
        let mut max = 0;
        for (v, &e) in t.iter().enumerate().filter(|(_, e)| **e != ABSENT) {
            map.insert(v as u64, e);
            max = v as u64;
        }
        self.repr = Repr::Sparse {
            map,
            max,
            pinned: false,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn is_dense(m: &VcnMap) -> bool {
        matches!(m.repr, Repr::Dense(_))
    }

    /// Every operation against a plain ordered map, through both forms
    /// and the switches between them.
    fn check_against_model(keys: impl IntoIterator<Item = u64>) -> VcnMap {
        let mut m = VcnMap::default();
        let mut model = BTreeMap::new();
        for (i, k) in keys.into_iter().enumerate() {
            let idx = i as u32;
            let fresh = !model.contains_key(&k);
            assert_eq!(m.insert_new(k, idx), fresh, "insert_new {k}");
            if fresh {
                model.insert(k, idx);
            } else {
                assert_eq!(m.insert(k, idx), model.insert(k, idx), "insert {k}");
            }
            assert_eq!(m.len(), model.len());
            assert_eq!(m.get(&k), model.get(&k));
        }
        let mut got: Vec<(u64, u32)> = m.iter().collect();
        got.sort_unstable();
        let want: Vec<(u64, u32)> = model.iter().map(|(&k, &v)| (k, v)).collect();
        assert_eq!(got, want);
        let mut keys: Vec<u64> = m.keys().collect();
        keys.sort_unstable();
        assert_eq!(keys, model.keys().copied().collect::<Vec<_>>());
        for probe in [0, 1, 4095, 4096, u64::MAX, u64::MAX - 1] {
            assert_eq!(m.contains_key(&probe), model.contains_key(&probe));
        }
        m
    }

    #[test]
    fn dense_keys_switch_to_the_table_and_answer_the_same() {
        // In order, with duplicates.
        let m = check_against_model((0..5000).chain(0..10));
        assert!(is_dense(&m));
        // Shuffled: dense once enough of them are in.
        let mut keys: Vec<u64> = (0..20_000).collect();
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for i in (1..keys.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            keys.swap(i, (s % (i as u64 + 1)) as usize);
        }
        assert!(is_dense(&check_against_model(keys)));
    }

    #[test]
    fn far_keys_keep_or_bring_back_the_hash_map() {
        // Sparse from the start: never a table of 2^40 slots.
        let m = check_against_model((0..3000).map(|i| i << 28));
        assert!(!is_dense(&m));
        // Dense, then one key far past the table: back to hashing, with
        // everything kept.
        let m = check_against_model((0..3000).chain([u64::MAX, 1 << 50, 7]));
        assert!(!is_dense(&m));
        // A key just past the table grows it.
        let m = check_against_model((0..3000).chain([3000 + 5000]));
        assert!(is_dense(&m));
    }

    #[test]
    fn an_index_that_is_the_table_marker_stays_findable() {
        let mut m = check_against_model(0..2000);
        assert!(is_dense(&m));
        assert!(m.insert_new(2000, ABSENT));
        assert!(!is_dense(&m));
        assert_eq!(m.get(&2000), Some(&ABSENT));
        assert_eq!(m.len(), 2001);
        m.clear();
        assert_eq!((m.len(), m.get(&1)), (0, None));
    }
}
