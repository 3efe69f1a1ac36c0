//! The guest's view as the host maps it: the reservation, the userfaultfd
//! its holes are registered with, and the state of every cluster. What the
//! monitor, the barrier and an overlay change together, under the region
//! state lock.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use crate::clusters::{ClusterState, Clusters};
use crate::mapping::Reservation;
use crate::uffd::Uffd;

/// The region's address space and what is mapped over each cluster.
#[derive(Debug)]
pub(crate) struct View {
    pub(crate) mapping: Reservation,
    /// Shared with the monitor, which reads its events without the lock.
    pub(crate) uffd: Arc<Uffd>,
    pub(crate) clusters: Clusters,
    /// The cluster size.
    pub(crate) cs: u64,
}

impl View {
    /// Host address of the region.
    pub(crate) fn base(&self) -> u64 {
        self.mapping.base()
    }

    /// Length of the region.
    pub(crate) fn len(&self) -> u64 {
        self.mapping.len() as u64
    }

    /// The cluster holding host address `addr`, if it is in the region.
    pub(crate) fn vcn_at(&self, addr: u64) -> Option<u64> {
        let off = addr.checked_sub(self.base())?;
        (off < self.len()).then_some(off / self.cs)
    }

    /// Host address of clusters `[vcn, end)` and their length.
    pub(crate) fn span(&self, vcn: u64, end: u64) -> (u64, u64) {
        (self.base() + vcn * self.cs, (end - vcn) * self.cs)
    }

    /// Maps clusters `[vcn, end)` from `fd` at `file_offset`, shared or
    /// private, and records their new state. The content seen there must
    /// stay the same (see [`Reservation::map_file`]).
    pub(crate) fn map_clusters(
        &mut self,
        vcn: u64,
        end: u64,
        fd: RawFd,
        file_offset: u64,
        shared: bool,
    ) -> io::Result<()> {
        let cs = self.cs;
        self.mapping
            .map_file(vcn * cs, (end - vcn) * cs, fd, file_offset, shared)?;
        let state = if shared {
            ClusterState::Shared
        } else {
            ClusterState::Private
        };
        self.clusters.set(vcn, end, state);
        Ok(())
    }
}
