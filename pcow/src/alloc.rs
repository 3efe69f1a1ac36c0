//! Where new clusters' space comes from: the pool of clusters reserved
//! past the end of the structures, grown ahead of allocations (and by a
//! device's worker), and how much of an image is allocated up front.

use std::io;

use crate::error::{Error, Result};
use crate::format::{Geometry, MAX_CLUSTER_COUNT};
use crate::io::Storage;

/// Bytes the writer pre-allocates past the last assigned cluster.
const POOL_BYTES: u64 = 4 << 20;

/// The end of the image's structures and the file space reserved past it.
#[derive(Debug)]
pub(crate) struct Pool {
    /// End of the last structure (staged `cluster_count`).
    pub(crate) next_cluster: u64,
    /// Physical length of the file, pool included.
    pub(crate) file_len: u64,
    /// Clusters kept reserved ahead of `next_cluster`.
    pub(crate) pool_clusters: u64,
    /// Clusters an allocation that finds the pool empty adds beyond what it
    /// needs; `None` is the pool's size.
    pub(crate) inline_clusters: Option<u64>,
}

impl Pool {
    /// A pool of the default size over a file of `file_len` bytes; the end
    /// of the structures is set by the scan.
    pub(crate) fn new(g: Geometry, file_len: u64) -> Self {
        Pool {
            next_cluster: 0,
            file_len,
            pool_clusters: (POOL_BYTES >> g.cluster_bits()).max(1),
            inline_clusters: None,
        }
    }

    /// Whether `extra` more clusters keep the file under the format's
    /// size limit (2^62 bytes) and the committed end at most
    /// [`MAX_CLUSTER_COUNT`], which a reader refuses to pass.
    pub(crate) fn has_room(&self, g: Geometry, extra: u64) -> bool {
        let end = self.next_cluster.saturating_add(extra);
        end < (1u64 << (62 - g.cluster_bits())) && end <= MAX_CLUSTER_COUNT
    }

    /// Makes sure clusters up to `end` exist in `storage`, growing it as
    /// `space` says.
    pub(crate) fn ensure(
        &mut self,
        storage: &mut dyn Storage,
        g: Geometry,
        end: u64,
        space: Space,
    ) -> io::Result<()> {
        let need = g.offset(end);
        if need <= self.file_len {
            return Ok(());
        }
        if space == Space::Written {
            // A pre-allocation worker may have extended the file beyond
            // what the image counts (its completion is then stale):
            // never shrink.
            if storage.len()? < need {
                storage.set_len(need)?;
            }
            self.file_len = need;
            return Ok(());
        }
        let ahead = self
            .inline_clusters
            .map_or(self.pool_clusters, |n| n.min(self.pool_clusters));
        let new_len = g.offset(end + ahead);
        storage.allocate(self.file_len, new_len - self.file_len)?;
        self.file_len = new_len;
        Ok(())
    }

    /// Grows the reserved space to the pool's full size; returns the
    /// clusters added.
    pub(crate) fn fill(&mut self, storage: &mut dyn Storage, g: Geometry) -> io::Result<u64> {
        let before = self.file_len;
        let want = g.offset(self.next_cluster + self.pool_clusters);
        if want > self.file_len {
            storage.allocate(self.file_len, want - self.file_len)?;
            self.file_len = want;
        }
        Ok((self.file_len - before) >> g.cluster_bits())
    }

    /// The byte range to reserve so that the pool holds its full size
    /// again, or `None` when it does.
    pub(crate) fn shortfall(&self, g: Geometry) -> Option<(u64, u64)> {
        let want = g.offset(self.next_cluster + self.pool_clusters);
        (want > self.file_len).then(|| (self.file_len, want - self.file_len))
    }

    /// Takes `[offset, offset + len)`, reserved by someone else, into the
    /// pool if it continues the file exactly with whole clusters.
    pub(crate) fn reserved(&mut self, g: Geometry, offset: u64, len: u64) -> bool {
        let whole = len.is_multiple_of(g.cluster_size());
        if offset != self.file_len || !whole {
            return false;
        }
        self.file_len += len;
        true
    }
}

/// How much of an image [`crate::Image::preallocate`] allocates up front, named
/// as qemu-img's `preallocation=` option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preallocation {
    /// Nothing: clusters are allocated on first write (thin).
    Off,
    /// Every cluster reserved with `fallocate`.
    Falloc,
    /// Every cluster reserved and its zeros written.
    Full,
}

impl std::str::FromStr for Preallocation {
    type Err = Error;
    fn from_str(s: &str) -> Result<Preallocation> {
        match s {
            "off" => Ok(Preallocation::Off),
            "falloc" => Ok(Preallocation::Falloc),
            "full" => Ok(Preallocation::Full),
            "metadata" => Err(Error::Invalid(
                "preallocation=metadata is not offered: a pcow image's clusters are mapped into \
                 the guest, and a guest write into file space not yet allocated on a full file \
                 system is a SIGBUS, not an error; use falloc"
                    .into(),
            )),
            _ => Err(Error::Invalid(format!(
                "unknown preallocation mode {s:?} (expected off, falloc or full)"
            ))),
        }
    }
}

/// How a new cluster's space is made in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Space {
    /// Reserved (fallocated), with the pool grown ahead: safe to map and
    /// write through the mapping.
    Reserved,
    /// The file only extended, when the pool is empty: every page is
    /// written with `pwrite` (which reports ENOSPC) before it is mapped.
    Written,
}
