//! Internal snapshots: create, list, apply (rollback) and delete, as layers
//! of one file (see the spec's "Operations").

use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::format::MAX_TAG;
use crate::image::Image;
use crate::meta::SnapshotInfo;

impl Image {
    /// Live snapshots, oldest first (ids are handed out in creation order;
    /// the layers that carry them need not be, after a rollback or a
    /// compaction).
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let mut v: Vec<SnapshotInfo> = self
            .meta
            .layers
            .iter()
            .filter_map(|l| l.snap.clone())
            .collect();
        v.sort_unstable_by_key(|s| s.id);
        v
    }

    /// Finds a snapshot by id (tried first, as qemu-img does) or by tag;
    /// returns the index of the layer whose snapshot cluster records it.
    fn find_snapshot(&self, snap: &str) -> Result<(usize, SnapshotInfo)> {
        let id = snap.parse::<u32>().ok();
        let found = |pred: &dyn Fn(&SnapshotInfo) -> bool| {
            self.meta
                .layers
                .iter()
                .enumerate()
                .find_map(|(i, l)| l.snap.as_ref().filter(|s| pred(s)).map(|s| (i, s.clone())))
        };
        id.and_then(|id| found(&|s| s.id == id))
            .or_else(|| found(&|s| s.tag == snap))
            .ok_or_else(|| Error::NoSuchSnapshot {
                path: self.path.clone(),
                snap: snap.to_owned(),
            })
    }

    /// Looks a snapshot up by id or tag.
    pub fn snapshot(&self, snap: &str) -> Result<SnapshotInfo> {
        Ok(self.find_snapshot(snap)?.1)
    }

    fn check_tag(&self, tag: &str) -> Result<()> {
        let bad = |why| Error::BadTag {
            path: self.path.clone(),
            tag: tag.to_owned(),
            why,
        };
        if tag.is_empty() || tag.len() > MAX_TAG {
            return Err(bad("must be 1 to 255 bytes"));
        }
        if tag.contains('\0') {
            return Err(bad("must not contain NUL"));
        }
        if self
            .meta
            .layers
            .iter()
            .any(|l| l.snap.as_ref().is_some_and(|s| s.tag == tag))
        {
            return Err(Error::DuplicateTag {
                path: self.path.clone(),
                tag: tag.to_owned(),
            });
        }
        Ok(())
    }

    pub(crate) fn require_writable(&self) -> Result<()> {
        if self.access.writable {
            Ok(())
        } else {
            Err(Error::ReadOnly {
                path: self.path.clone(),
            })
        }
    }

    /// Freezes the current content as snapshot `tag`: one barrier, one
    /// snapshot cluster, no data copied.
    pub fn snapshot_create(&mut self, tag: &str) -> Result<SnapshotInfo> {
        self.require_writer()?;
        self.require_no_commit()?;
        self.check_tag(tag)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        // Id 0 means "no snapshot": never hand it out, even if a lenient
        // open let a zero counter through.
        let id = self.header.staged.next_snapshot_id.max(1);
        let id_next = id.checked_add(1).ok_or_else(|| Error::Limit {
            path: self.path.clone(),
            what: "snapshot ids exhausted".into(),
        })?;
        self.check_layer_room()?;
        self.begin_writing()?;
        let info = SnapshotInfo {
            id,
            tag: tag.to_owned(),
            time_sec: now.as_secs(),
            time_nsec: now.subsec_nanos(),
            layer: self.header.staged.active_layer,
        };
        self.create_snapshot_with(info.clone())?;
        self.header.staged.next_snapshot_id = id_next;
        self.flush()?;
        Ok(info)
    }

    /// Stages a snapshot of the active layer with the given record (compact
    /// uses it to keep ids and times).
    pub(crate) fn create_snapshot_with(&mut self, info: SnapshotInfo) -> Result<()> {
        let layer = self.append_layer(self.header.staged.active_layer, Some(info))?;
        self.header.staged.active_layer = layer;
        Ok(())
    }

    /// Makes snapshot `snap` the image's content (rollback). Later snapshots
    /// are kept; what was written since the last snapshot is dropped.
    pub fn snapshot_apply(&mut self, snap: &str) -> Result<SnapshotInfo> {
        self.require_writer()?;
        self.require_no_commit()?;
        let (_, info) = self.find_snapshot(snap)?;
        self.check_layer_room()?;
        self.begin_writing()?;
        let layer = self.append_layer(info.layer, None)?;
        self.header.staged.active_layer = layer;
        self.flush()?;
        Ok(info)
    }

    /// Deletes snapshot `snap` (any of them). Its data stays while other
    /// views need it; `compact` reclaims what nothing reaches.
    pub fn snapshot_delete(&mut self, snap: &str) -> Result<SnapshotInfo> {
        self.require_writer()?;
        self.require_no_commit()?;
        let (i, info) = self.find_snapshot(snap)?;
        self.begin_writing()?;
        self.meta.layers[i].snap = None;
        self.meta.layers[i].dirty = true;
        self.commit.meta_dirty = true;
        self.flush()?;
        Ok(info)
    }
}
