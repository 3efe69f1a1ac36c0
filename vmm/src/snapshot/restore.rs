//! What a restore asks for, from `vm.restore`'s JSON body (upstream's
//! `RestoreConfig`) or from `--restore` ([`options::RestoreConfig`]),
//! checked into one [`RestoreRequest`].
//!
//! Upstream's `net_fds`, `vfio_fds`, `iommufd_fd` and `zone_updates` are
//! accepted at their empty values only (this VMM has no net, VFIO or NUMA
//! devices). `source_url` must be `file://` and an absolute path. The clone
//! extension `pmem` names, per pmem device id, the file a clone writes to.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::config::options::{self, MemoryRestoreMode};

/// One clone override: pmem device `id` writes to its own `file`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemClone {
    /// The pmem device's id in the snapshot's config (`_pmem0`, ...).
    pub id: String,
    /// The clone's own file (absolute path).
    pub file: PathBuf,
}

/// `vm.restore`'s body: upstream's `RestoreConfig` field names and
/// defaults, plus `pmem`. Unknown fields are ignored (and logged), as
/// upstream ignores them.
#[derive(Debug, Deserialize)]
struct RestoreBody {
    source_url: String,
    #[serde(default)]
    prefault: bool,
    #[serde(default)]
    memory_restore_mode: MemoryRestoreMode,
    #[serde(default)]
    net_fds: Option<Vec<Value>>,
    #[serde(default)]
    vfio_fds: Option<Vec<Value>>,
    #[serde(default)]
    iommufd_fd: Option<i32>,
    #[serde(default)]
    resume: bool,
    #[serde(default)]
    zone_updates: Vec<Value>,
    #[serde(default)]
    pmem: Vec<PmemClone>,
}

/// Why a restore request is refused.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("not a restore config")]
    Json(#[source] serde_json::Error),
    #[error("`source_url` {0:?}: only file:// URLs are supported (file:///path/to/snapshot)")]
    NotFileUrl(String),
    #[error("`source_url` {0:?}: the path must be absolute (file:///path/to/snapshot)")]
    RelativePath(String),
    #[error(
        "`memory_restore_mode` OnDemand (userfaultfd paging) is not supported by this VMM; \
         use Copy or CopyOnWrite"
    )]
    OnDemand,
    #[error("`{0}` is not supported by this VMM (accepted only empty)")]
    NotEmpty(&'static str),
    #[error("`pmem`: an entry has an empty id")]
    CloneEmptyId,
    #[error("`pmem`: `{id}` is given twice")]
    CloneDuplicateId { id: String },
    #[error("`pmem`: `{id}`: the file {file:?} must be an absolute path")]
    CloneRelativeFile { id: String, file: PathBuf },
    #[error("`pmem`: `{id}` and `{other}` name the same file {file:?}")]
    CloneSameFile {
        id: String,
        other: String,
        file: PathBuf,
    },
}

/// A restore, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreRequest {
    /// The snapshot directory (from `source_url`).
    pub source: PathBuf,
    /// Populate guest RAM before the VM runs.
    pub prefault: bool,
    /// How guest RAM comes back (never `OnDemand`).
    pub memory_restore_mode: MemoryRestoreMode,
    /// Run the VM once restored (otherwise it is Paused).
    pub resume: bool,
    /// Clone overrides, in the order given.
    pub pmem: Vec<PmemClone>,
}

impl RestoreRequest {
    /// Parses and checks `vm.restore`'s body.
    pub fn from_json(body: &[u8]) -> Result<RestoreRequest, RestoreError> {
        let b: RestoreBody = crate::config::from_json(body).map_err(RestoreError::Json)?;
        if b.net_fds.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(RestoreError::NotEmpty("net_fds"));
        }
        if b.vfio_fds.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(RestoreError::NotEmpty("vfio_fds"));
        }
        if b.iommufd_fd.is_some() {
            return Err(RestoreError::NotEmpty("iommufd_fd"));
        }
        if !b.zone_updates.is_empty() {
            return Err(RestoreError::NotEmpty("zone_updates"));
        }
        Self::checked(
            &b.source_url,
            b.prefault,
            b.memory_restore_mode,
            b.resume,
            b.pmem,
        )
    }

    /// [`RestoreRequest::from_json`] of a body the API already parsed.
    pub fn from_value(body: &Value) -> Result<RestoreRequest, RestoreError> {
        let bytes = serde_json::to_vec(body).map_err(RestoreError::Json)?;
        Self::from_json(&bytes)
    }

    /// Checks what `--restore` parsed.
    pub fn from_cli(c: &options::RestoreConfig) -> Result<RestoreRequest, RestoreError> {
        if c.net_fds.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(RestoreError::NotEmpty("net_fds"));
        }
        if c.vfio_fds.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(RestoreError::NotEmpty("vfio_fds"));
        }
        if c.iommufd_fd.is_some() {
            return Err(RestoreError::NotEmpty("iommufd_fd"));
        }
        if !c.zone_updates.is_empty() {
            return Err(RestoreError::NotEmpty("zone_updates"));
        }
        let pmem = c
            .pmem
            .iter()
            .map(|(id, file)| PmemClone {
                id: id.clone(),
                file: file.clone(),
            })
            .collect();
        Self::checked(
            &c.source_url.to_string_lossy(),
            c.prefault,
            c.memory_restore_mode,
            c.resume,
            pmem,
        )
    }

    fn checked(
        url: &str,
        prefault: bool,
        mode: MemoryRestoreMode,
        resume: bool,
        pmem: Vec<PmemClone>,
    ) -> Result<RestoreRequest, RestoreError> {
        let source = source_path(url)?;
        if mode == MemoryRestoreMode::OnDemand {
            return Err(RestoreError::OnDemand);
        }
        let mut ids = BTreeSet::new();
        for (i, c) in pmem.iter().enumerate() {
            if c.id.is_empty() {
                return Err(RestoreError::CloneEmptyId);
            }
            if !ids.insert(c.id.as_str()) {
                return Err(RestoreError::CloneDuplicateId { id: c.id.clone() });
            }
            if !c.file.is_absolute() {
                return Err(RestoreError::CloneRelativeFile {
                    id: c.id.clone(),
                    file: c.file.clone(),
                });
            }
            if let Some(other) = pmem[..i].iter().find(|o| o.file == c.file) {
                return Err(RestoreError::CloneSameFile {
                    id: c.id.clone(),
                    other: other.id.clone(),
                    file: c.file.clone(),
                });
            }
        }
        Ok(RestoreRequest {
            source,
            prefault,
            memory_restore_mode: mode,
            resume,
            pmem,
        })
    }
}

/// The directory of a `file://` URL with an absolute path.
pub fn source_path(url: &str) -> Result<PathBuf, RestoreError> {
    let path = url
        .strip_prefix("file://")
        .ok_or_else(|| RestoreError::NotFileUrl(url.to_owned()))?;
    if !Path::new(path).is_absolute() {
        return Err(RestoreError::RelativePath(url.to_owned()));
    }
    Ok(PathBuf::from(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::options::RestoreConfig;

    fn json(s: &str) -> Result<RestoreRequest, RestoreError> {
        RestoreRequest::from_json(s.as_bytes())
    }

    fn cli(s: &str) -> Result<RestoreRequest, RestoreError> {
        RestoreRequest::from_cli(&RestoreConfig::parse(s).unwrap())
    }

    #[test]
    fn upstream_body_as_ch_remote_sends_it() {
        let r = json(
            r#"{"source_url": "file:///snap", "prefault": false,
                "memory_restore_mode": "Copy", "net_fds": null, "vfio_fds": null,
                "iommufd_fd": null, "resume": false, "zone_updates": []}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            RestoreRequest {
                source: "/snap".into(),
                prefault: false,
                memory_restore_mode: MemoryRestoreMode::Copy,
                resume: false,
                pmem: vec![],
            }
        );
        // Defaults, as upstream's serde gives them.
        assert_eq!(
            json(r#"{"source_url": "file:///s"}"#).unwrap().source,
            Path::new("/s")
        );
        let r = json(
            r#"{"source_url": "file:///s", "prefault": true, "resume": true,
                "memory_restore_mode": "CopyOnWrite", "net_fds": [], "vfio_fds": [],
                "pmem": [{"id": "_pmem0", "file": "/c/clone1.pcow"},
                         {"id": "data", "file": "/c/clone2.pcow"}]}"#,
        )
        .unwrap();
        assert!(r.prefault && r.resume);
        assert_eq!(r.memory_restore_mode, MemoryRestoreMode::CopyOnWrite);
        assert_eq!(
            r.pmem,
            [
                PmemClone {
                    id: "_pmem0".into(),
                    file: "/c/clone1.pcow".into()
                },
                PmemClone {
                    id: "data".into(),
                    file: "/c/clone2.pcow".into()
                }
            ]
        );
    }

    #[test]
    fn body_refusals() {
        let cases: &[(&str, &str)] = &[
            (r#"{}"#, "not a restore config"),
            (r#"{"source_url": 1}"#, "not a restore config"),
            (
                r#"{"source_url": "file:///s", "memory_restore_mode": "copy"}"#,
                "not a restore config",
            ),
            (
                r#"{"source_url": "file:///s", "pmem": [{"id": "a"}]}"#,
                "not a restore config",
            ),
            (
                r#"{"source_url": "file:///s", "pmem": [{"id": "a", "file": "/f", "x": 1}]}"#,
                "not a restore config",
            ),
            (r#"{"source_url": "/snap"}"#, "only file:// URLs"),
            (r#"{"source_url": "tcp://h/s"}"#, "only file:// URLs"),
            (r#"{"source_url": "file://snap"}"#, "must be absolute"),
            (r#"{"source_url": "file://"}"#, "must be absolute"),
            (
                r#"{"source_url": "file:///s", "memory_restore_mode": "OnDemand"}"#,
                "OnDemand",
            ),
            (
                r#"{"source_url": "file:///s", "net_fds": [{"id": "n", "num_fds": 1, "fds": [3]}]}"#,
                "`net_fds`",
            ),
            (
                r#"{"source_url": "file:///s", "vfio_fds": [{"id": "v", "fd": 3}]}"#,
                "`vfio_fds`",
            ),
            (
                r#"{"source_url": "file:///s", "iommufd_fd": 3}"#,
                "`iommufd_fd`",
            ),
            (
                r#"{"source_url": "file:///s", "zone_updates": [{"id": "z", "host_numa_node": 0}]}"#,
                "`zone_updates`",
            ),
            (
                r#"{"source_url": "file:///s", "pmem": [{"id": "", "file": "/f"}]}"#,
                "empty id",
            ),
            (
                r#"{"source_url": "file:///s", "pmem": [{"id": "a", "file": "/f"}, {"id": "a", "file": "/g"}]}"#,
                "`a` is given twice",
            ),
            (
                r#"{"source_url": "file:///s", "pmem": [{"id": "a", "file": "rel.pcow"}]}"#,
                "absolute path",
            ),
            (
                r#"{"source_url": "file:///s", "pmem": [{"id": "a", "file": "/f"}, {"id": "b", "file": "/f"}]}"#,
                "`b` and `a` name the same file",
            ),
        ];
        for (body, needle) in cases {
            let m = json(body).unwrap_err().to_string();
            assert!(m.contains(needle), "{body}: {m}");
        }
    }

    #[test]
    fn command_line_forms() {
        let r = cli("source_url=file:///snap").unwrap();
        assert_eq!(r.source, Path::new("/snap"));
        assert_eq!(r.memory_restore_mode, MemoryRestoreMode::Copy);
        assert!(!r.prefault && !r.resume && r.pmem.is_empty());
        for (v, mode) in [
            ("copy", MemoryRestoreMode::Copy),
            ("CopyOnWrite", MemoryRestoreMode::CopyOnWrite),
            ("copyonwrite", MemoryRestoreMode::CopyOnWrite),
        ] {
            let r = cli(&format!("source_url=file:///s,memory_restore_mode={v}")).unwrap();
            assert_eq!(r.memory_restore_mode, mode, "{v}");
        }
        let r = cli("source_url=file:///s,prefault=on,resume=on,\
             pmem=[_pmem0@/path/clone1.pcow,data@/path/clone2.pcow]")
        .unwrap();
        assert!(r.prefault && r.resume);
        assert_eq!(
            r.pmem,
            [
                PmemClone {
                    id: "_pmem0".into(),
                    file: "/path/clone1.pcow".into()
                },
                PmemClone {
                    id: "data".into(),
                    file: "/path/clone2.pcow".into()
                }
            ]
        );
        assert!(cli("source_url=file:///s,net_fds=[],vfio_fds=[],zone_updates=[]").is_ok());
        assert!(cli("source_url=file:///s,pmem=[]").is_ok());
    }

    #[test]
    fn command_line_refusals() {
        for (s, needle) in [
            ("source_url=/snap", "only file:// URLs"),
            ("source_url=file://rel", "must be absolute"),
            (
                "source_url=file:///s,memory_restore_mode=ondemand",
                "OnDemand",
            ),
            ("source_url=file:///s,net_fds=[n@[3]]", "`net_fds`"),
            ("source_url=file:///s,vfio_fds=[v@3]", "`vfio_fds`"),
            ("source_url=file:///s,iommufd_fd=3", "`iommufd_fd`"),
            ("source_url=file:///s,zone_updates=[z@0]", "`zone_updates`"),
            ("source_url=file:///s,pmem=[a@/f,a@/g]", "given twice"),
            ("source_url=file:///s,pmem=[a@rel]", "absolute path"),
            ("source_url=file:///s,pmem=[a@/f,b@/f]", "same file"),
        ] {
            let m = cli(s).unwrap_err().to_string();
            assert!(m.contains(needle), "{s}: {m}");
        }
        // Syntax errors are the option parser's.
        for (s, needle) in [
            ("source_url=file:///s,pmem=a@/f", "for `pmem`"),
            ("source_url=file:///s,pmem=[a]", "for `pmem`"),
            ("source_url=file:///s,pmem=[a@]", "for `pmem`"),
            ("source_url=file:///s,pmem=[@/f]", "for `pmem`"),
            (
                "source_url=file:///s,memory_restore_mode=cow",
                "copy, ondemand or copyonwrite",
            ),
        ] {
            let m = RestoreConfig::parse(s).unwrap_err().to_string();
            assert!(m.contains(needle), "{s}: {m}");
        }
    }
}
