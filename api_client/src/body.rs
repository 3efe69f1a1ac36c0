//! The JSON bodies of the actions that take one (besides `vm.create`,
//! whose VmConfig the caller supplies, and `vm.add-pmem`'s
//! [`PmemConfig`](crate::PmemConfig)).

use serde::Serialize;

/// `vm.remove-device` and `vm.pmem-flush`: `{"id"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceId<'a> {
    /// The device id.
    pub id: &'a str,
}

/// `vm.pmem-snapshot`: `{"id", "tag"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PmemSnapshot<'a> {
    /// The pmem device id.
    pub id: &'a str,
    /// The new snapshot's tag.
    pub tag: &'a str,
}

/// `vm.pmem-overlay`: `{"id", "file"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PmemOverlay<'a> {
    /// The pmem device id.
    pub id: &'a str,
    /// The new overlay file, as the VMM will create it.
    pub file: &'a str,
}

/// `vm.pmem-rollback`: `{"id", "snapshot", "reset"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PmemRollback<'a> {
    /// The pmem device id.
    pub id: &'a str,
    /// The snapshot: its tag or its numeric id, as a string.
    pub snapshot: &'a str,
    /// Roll back a Running or Paused VM and restart its guest.
    pub reset: bool,
}

/// `vm.pmem-snapshot-delete`: `{"id", "snapshot"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PmemSnapshotDelete<'a> {
    /// The pmem device id.
    pub id: &'a str,
    /// The snapshot: its tag or its numeric id, as a string.
    pub snapshot: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s<T: Serialize>(v: &T) -> String {
        serde_json::to_string(v).unwrap()
    }

    #[test]
    fn field_names_and_order() {
        assert_eq!(s(&DeviceId { id: "p0" }), r#"{"id":"p0"}"#);
        assert_eq!(
            s(&PmemSnapshot {
                id: "p0",
                tag: "t1"
            }),
            r#"{"id":"p0","tag":"t1"}"#
        );
        assert_eq!(
            s(&PmemOverlay {
                id: "p0",
                file: "/o.pcow"
            }),
            r#"{"id":"p0","file":"/o.pcow"}"#
        );
        assert_eq!(
            s(&PmemRollback {
                id: "p0",
                snapshot: "3",
                reset: true
            }),
            r#"{"id":"p0","snapshot":"3","reset":true}"#
        );
        assert_eq!(
            s(&PmemSnapshotDelete {
                id: "p0",
                snapshot: "t1"
            }),
            r#"{"id":"p0","snapshot":"t1"}"#
        );
    }
}
