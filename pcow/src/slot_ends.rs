//! How far each metadata slot's bytes may be non-zero in the file.
//!
//! A slot is `S` bytes (half a cluster: 1 MiB at 2 MiB clusters) and its
//! CRC covers all of them, but its content is short: a header is a few
//! hundred bytes, a meta slot grows with its entries. A barrier that
//! rewrites a slot only needs to write the prefix that can differ from what
//! the file holds: the new content, and whatever the slot held before, so
//! that the old bytes are overwritten with zeros. Past that prefix the file
//! already holds zeros, so after the sync the slot is byte for byte the new
//! encoding, exactly as if all `S` bytes had been written.
//!
//! The record is an upper bound of the non-zero bytes on disk, never less:
//! - it starts from the bytes the scan read (the page cache, which the
//!   next sync makes durable whatever a crashed writer left unsynced);
//! - a write raises it to the larger of the old and the new content before
//!   it is issued, so a torn or failed write or sync leaves a true bound;
//! - only a sync that succeeded after the write lowers it to the new
//!   content's end;
//! - a slot the record does not know (one of a new structure, whose
//!   cluster may hold anything, or one that could not be read) is written
//!   whole.

use std::collections::HashMap;

use crate::format::Slot;

/// Writes are rounded up to this (the page cache's unit): a shorter write
/// would cost a read-modify-write of the page in the kernel.
const WRITE_UNIT: usize = 4096;

/// What to write of a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Prefix {
    /// Leading bytes to write.
    pub(crate) len: usize,
    /// One past the new content's last non-zero byte.
    pub(crate) content_end: usize,
}

/// Upper bounds of the non-zero bytes of slots, by the slot's file offset.
#[derive(Debug, Default)]
pub(crate) struct SlotEnds {
    ends: HashMap<u64, usize>,
}

/// One past the last non-zero byte of `bytes` (0 when all are zero).
pub(crate) fn content_end(bytes: &[u8]) -> usize {
    // Whole blocks first, with a fold the compiler vectorizes: a slot is
    // up to 1 MiB and mostly zeros.
    const BLOCK: usize = 256;
    let mut end = bytes.len();
    while end > 0 {
        let start = end.saturating_sub(BLOCK);
        let block = &bytes[start..end];
        if block.iter().fold(0u8, |a, b| a | b) != 0 {
            return start + block.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
        }
        end = start;
    }
    0
}

impl SlotEnds {
    /// Records the bytes the file holds for the slot at `at`.
    pub(crate) fn observed(&mut self, at: u64, bytes: &[u8]) {
        self.ends.insert(at, content_end(bytes));
    }

    /// Forgets both slots of the cluster at `at`, which becomes a new
    /// structure and may hold anything: their next writes are whole.
    pub(crate) fn forget_cluster(&mut self, at: u64, slot: usize) {
        self.ends.remove(&at);
        self.ends.remove(&(at + slot as u64));
    }

    /// How many leading bytes of `new` (a whole slot) must be written at
    /// `at` to make the slot hold exactly `new`; raises the record to cover
    /// both the old and the new content until [`SlotEnds::synced`] is told
    /// the returned content end.
    pub(crate) fn prefix_to_write(&mut self, at: u64, new: &Slot) -> Prefix {
        let slot = new.len;
        let new_end = content_end(&new.head);
        let old_end = self.ends.get(&at).copied().unwrap_or(slot);
        let end = new_end.max(old_end);
        self.ends.insert(at, end);
        Prefix {
            len: end
                .div_ceil(WRITE_UNIT)
                .saturating_mul(WRITE_UNIT)
                .min(slot)
                .max(new_end),
            content_end: new_end,
        }
    }

    /// A sync succeeded after a slot was written at `at` (by the prefix
    /// from [`SlotEnds::prefix_to_write`]): the file holds exactly that
    /// slot there, non-zero up to `content_end` at most.
    pub(crate) fn synced(&mut self, at: u64, content_end: usize) {
        self.ends.insert(at, content_end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_end_finds_the_last_non_zero_byte() {
        let mut v = vec![0u8; 4096];
        assert_eq!(content_end(&v), 0);
        for at in [0, 1, 255, 256, 257, 1000, 4095] {
            v.fill(0);
            v[at] = 1;
            assert_eq!(content_end(&v), at + 1, "{at}");
            v[0] = 7;
            assert_eq!(content_end(&v), at + 1, "{at}");
        }
        assert_eq!(content_end(&[1, 0, 2, 0]), 3);
    }

    fn bytes(content: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        v[..content].fill(0xa5);
        v
    }

    fn slot(content: usize, len: usize) -> Slot {
        Slot {
            head: vec![0xa5; content],
            len,
        }
    }

    #[test]
    fn an_unknown_slot_is_written_whole() {
        let mut e = SlotEnds::default();
        assert_eq!(e.prefix_to_write(0, &slot(100, 1 << 20)).len, 1 << 20);
    }

    #[test]
    fn a_known_slot_is_written_up_to_the_larger_content_in_pages() {
        let mut e = SlotEnds::default();
        e.observed(4096, &bytes(5000, 1 << 20));
        // Shorter new content: the old bytes up to 5000 must become zero.
        let p = e.prefix_to_write(4096, &slot(100, 1 << 20));
        assert_eq!((p.len, p.content_end), (8192, 100));
        e.synced(4096, p.content_end);
        assert_eq!(e.prefix_to_write(4096, &slot(100, 1 << 20)).len, 4096);
        e.synced(4096, 100);
        assert_eq!(e.prefix_to_write(4096, &slot(9000, 1 << 20)).len, 12288);
    }

    #[test]
    fn an_unsynced_write_keeps_the_larger_bound() {
        let mut e = SlotEnds::default();
        e.observed(0, &bytes(9000, 1 << 16));
        assert_eq!(e.prefix_to_write(0, &slot(10, 1 << 16)).len, 12288);
        // The sync failed: the file may hold either content.
        assert_eq!(e.prefix_to_write(0, &slot(10, 1 << 16)).len, 12288);
    }

    #[test]
    fn small_slots_are_never_overrun() {
        let mut e = SlotEnds::default();
        e.observed(2048, &bytes(10, 2048));
        assert_eq!(e.prefix_to_write(2048, &slot(20, 2048)).len, 2048);
        e.forget_cluster(0, 2048);
        assert_eq!(e.prefix_to_write(2048, &slot(20, 2048)).len, 2048);
    }
}
