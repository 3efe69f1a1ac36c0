//! What a snapshot records of each pmem device's content, and what a
//! restore does with it (`docs/snapshots.md`, "pmem content").
//!
//! - A **pcow** device's current top image is frozen under a new overlay
//!   ([`PcowRegion::freeze`]): the top keeps its name for the running VM
//!   (now a thin overlay) and the content at the snapshot instant gets a
//!   new name beside it, which the snapshot owns ([`PmemRecord::frozen`]).
//!   No data is copied. A restore gives the VM a thin overlay over the
//!   frozen file: a clone's own file when the restore names one for the
//!   device, else the config's own path, whose content since the snapshot
//!   is discarded (refused while another process holds it).
//! - A **raw** file is referenced, as upstream does: the record holds what
//!   identifies its state (device, inode, size, mtime), and a restore
//!   refuses a file that changed unless the restore names a file for the
//!   device (then that file is used as it is).
//! - Devices with `discard_writes` are refused: their writes live only in
//!   the VMM's memory (raw) or in an unnamed temporary file (pcow).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::PmemConfig;
use crate::machine::Pmem;
use crate::snapshot::restore::PmemClone;

/// What identifies a file's state: a file that was replaced has another
/// inode, one that was written another mtime (and maybe size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileIdentity {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
    /// `st_size`.
    pub size: u64,
    /// `st_mtime` in nanoseconds since the epoch.
    pub mtime_ns: i64,
}

impl From<pcow::FileIdentity> for FileIdentity {
    fn from(i: pcow::FileIdentity) -> Self {
        FileIdentity {
            dev: i.dev,
            ino: i.ino,
            size: i.size,
            mtime_ns: i.mtime_ns,
        }
    }
}

impl From<FileIdentity> for pcow::FileIdentity {
    fn from(i: FileIdentity) -> Self {
        pcow::FileIdentity {
            dev: i.dev,
            ino: i.ino,
            size: i.size,
            mtime_ns: i.mtime_ns,
        }
    }
}

/// How a device's content is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PmemKind {
    /// Frozen pcow image.
    Pcow,
    /// Referenced raw file.
    Raw,
}

/// One pmem device in `state.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemRecord {
    /// The device id.
    pub id: String,
    /// pcow or raw.
    pub kind: PmemKind,
    /// The device's file in the source VM (the config's `file`).
    pub file: PathBuf,
    /// pcow: the frozen image holding the content at the snapshot instant
    /// (absolute); raw: absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen: Option<PathBuf>,
    /// The identity of `frozen` (pcow) or `file` (raw) at the snapshot.
    pub identity: FileIdentity,
}

/// Why a device's content cannot be captured.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error(
        "pmem {id}: a device with discard_writes cannot be snapshotted (its writes live only \
         in this VMM)"
    )]
    Discarding { id: String },
    #[error("pmem {id}: {} has no file name", file.display())]
    NoFileName { id: String, file: PathBuf },
    #[error("pmem {id}: freezing {}", file.display())]
    Freeze {
        id: String,
        file: PathBuf,
        #[source]
        source: virtio_pmem_pcow::FreezeError,
    },
    #[error("pmem {id}: syncing {}", file.display())]
    Sync {
        id: String,
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("pmem {id}: reading the identity of {}", file.display())]
    Identity {
        id: String,
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Checks, before anything is written, that every device can be captured.
pub fn check_capturable(pmem: &[Pmem], discarding: &[String]) -> Result<(), CaptureError> {
    for p in pmem {
        if discarding.iter().any(|d| d == &p.id) {
            return Err(CaptureError::Discarding { id: p.id.clone() });
        }
        if p.file.file_name().is_none() {
            return Err(CaptureError::NoFileName {
                id: p.id.clone(),
                file: p.file.clone(),
            });
        }
    }
    Ok(())
}

/// The name the frozen content of `file` gets: beside it, marked with the
/// snapshot's time (and a counter when that name is taken).
pub fn frozen_name(file: &Path, now_sec: u64) -> Option<PathBuf> {
    let name = file.file_name()?.to_string_lossy().into_owned();
    let (y, mo, d, h, mi, s) = pcow::civil::utc(now_sec);
    let stamp = format!("{y:04}{mo:02}{d:02}T{h:02}{mi:02}{s:02}Z");
    let dir = file.parent().unwrap_or(Path::new("."));
    (0..1000u32)
        .map(|n| {
            if n == 0 {
                dir.join(format!("{name}.snap-{stamp}"))
            } else {
                dir.join(format!("{name}.snap-{stamp}-{n}"))
            }
        })
        .find(|c| std::fs::symlink_metadata(c).is_err())
}

/// Captures one device's content: a pcow image is frozen (its barrier
/// first), a raw file synced and identified. The VM is paused.
pub fn capture(p: &Pmem, now_sec: u64) -> Result<PmemRecord, CaptureError> {
    match p.pcow() {
        Some(region) => {
            let frozen = frozen_name(&p.file, now_sec).ok_or_else(|| CaptureError::NoFileName {
                id: p.id.clone(),
                file: p.file.clone(),
            })?;
            let info = region
                .freeze(&frozen)
                .map_err(|source| CaptureError::Freeze {
                    id: p.id.clone(),
                    file: p.file.clone(),
                    source,
                })?;
            log::info!(
                "pmem {}: frozen as {} ({} pages moved, writers held {:?}); {} goes on as its overlay",
                p.id,
                info.frozen.display(),
                info.barrier.pages_copied,
                info.held,
                info.top.display()
            );
            Ok(PmemRecord {
                id: p.id.clone(),
                kind: PmemKind::Pcow,
                file: p.file.clone(),
                frozen: Some(info.frozen),
                identity: info.identity.into(),
            })
        }
        None => {
            if let Some(Err(source)) = p.sync_raw() {
                return Err(CaptureError::Sync {
                    id: p.id.clone(),
                    file: p.file.clone(),
                    source,
                });
            }
            let identity =
                pcow::FileIdentity::of_path(&p.file).map_err(|source| CaptureError::Identity {
                    id: p.id.clone(),
                    file: p.file.clone(),
                    source,
                })?;
            Ok(PmemRecord {
                id: p.id.clone(),
                kind: PmemKind::Raw,
                file: p.file.clone(),
                frozen: None,
                identity: identity.into(),
            })
        }
    }
}

/// Why a restore cannot give a device its content.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("`state.json`: `pmem` is not a list of pmem records")]
    Records(#[source] serde_json::Error),
    #[error("pmem {id}: the snapshot has no record of its content")]
    NoRecord { id: String },
    #[error("`state.json`: `pmem` records device {id}, which the config does not have")]
    UnknownRecord { id: String },
    #[error("`pmem`: {id} is not a pmem device of the snapshot")]
    UnknownClone { id: String },
    #[error("pmem {id}: the pcow record names no frozen image")]
    NoFrozen { id: String },
    #[error(
        "pmem {id}: {} changed since the snapshot (recorded {recorded:?}, now {now:?}); name a \
         file for it in the restore's `pmem` (pmem=[{id}@FILE]) to use a file as it is",
        file.display()
    )]
    RawChanged {
        id: String,
        file: PathBuf,
        recorded: FileIdentity,
        now: FileIdentity,
    },
    #[error("pmem {id}: {}", file.display())]
    RawMissing {
        id: String,
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "pmem {id}: the frozen image {} changed since the snapshot (recorded {recorded:?}, \
         now {now:?}): it is not the snapshot's content any more",
        frozen.display()
    )]
    FrozenChanged {
        id: String,
        frozen: PathBuf,
        recorded: FileIdentity,
        now: FileIdentity,
    },
    #[error("pmem {id}: the frozen image {}", frozen.display())]
    FrozenMissing {
        id: String,
        frozen: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("pmem {id}: creating the clone {} over {}", clone.display(), frozen.display())]
    Clone {
        id: String,
        clone: PathBuf,
        frozen: PathBuf,
        #[source]
        source: Box<pcow::FrozenError>,
    },
    #[error(
        "pmem {id}: {} is in use by another process (does the source VM still run on it?): \
         give this VM its own file with the restore's `pmem` (pmem=[{id}@/path/clone.pcow])",
        file.display()
    )]
    InUse { id: String, file: PathBuf },
    #[error("pmem {id}: rolling {} back to {}", file.display(), frozen.display())]
    Reset {
        id: String,
        file: PathBuf,
        frozen: PathBuf,
        #[source]
        source: Box<pcow::FrozenError>,
    },
}

/// What the restore does for one pcow device, once every check passed.
#[derive(Debug, Clone)]
enum Action {
    /// Create a clone overlay at `file` over `frozen`.
    Clone {
        id: String,
        file: PathBuf,
        frozen: PathBuf,
        identity: FileIdentity,
    },
    /// Roll `file` back to a fresh overlay over `frozen`.
    Reset {
        id: String,
        file: PathBuf,
        frozen: PathBuf,
        identity: FileIdentity,
    },
}

/// The checked plan of a restore's pmem devices: which file each device
/// gets and what must be created for it.
#[derive(Debug)]
pub struct PmemPlan {
    actions: Vec<Action>,
    /// Per device id, the file the restored VM uses.
    pub files: Vec<(String, PathBuf)>,
}

/// Checks the records against the snapshot's devices and the restore's
/// clones; reads every file it needs but changes none.
pub fn plan(
    records: &[serde_json::Value],
    devices: &[PmemConfig],
    clones: &[PmemClone],
) -> Result<PmemPlan, PlanError> {
    // The snapshot's config has its ids assigned.
    let ids: Vec<&str> = devices.iter().filter_map(|d| d.id.as_deref()).collect();
    let records: Vec<PmemRecord> = records
        .iter()
        .map(|r| serde_json::from_value(r.clone()))
        .collect::<Result<_, _>>()
        .map_err(PlanError::Records)?;
    for r in &records {
        if !ids.contains(&r.id.as_str()) {
            return Err(PlanError::UnknownRecord { id: r.id.clone() });
        }
    }
    for c in clones {
        if !ids.contains(&c.id.as_str()) {
            return Err(PlanError::UnknownClone { id: c.id.clone() });
        }
    }
    let mut actions = Vec::new();
    let mut files = Vec::new();
    for id in ids {
        let r = records
            .iter()
            .find(|r| r.id == id)
            .ok_or_else(|| PlanError::NoRecord { id: id.to_owned() })?;
        let clone = clones.iter().find(|c| c.id == id).map(|c| c.file.clone());
        match r.kind {
            PmemKind::Raw => {
                let file = match clone {
                    Some(f) => f,
                    None => {
                        let now = pcow::FileIdentity::of_path(&r.file)
                            .map_err(|source| PlanError::RawMissing {
                                id: id.to_owned(),
                                file: r.file.clone(),
                                source,
                            })?
                            .into();
                        if now != r.identity {
                            return Err(PlanError::RawChanged {
                                id: id.to_owned(),
                                file: r.file.clone(),
                                recorded: r.identity,
                                now,
                            });
                        }
                        r.file.clone()
                    }
                };
                files.push((id.to_owned(), file));
            }
            PmemKind::Pcow => {
                let frozen = r
                    .frozen
                    .clone()
                    .ok_or_else(|| PlanError::NoFrozen { id: id.to_owned() })?;
                let now: FileIdentity = pcow::FileIdentity::of_path(&frozen)
                    .map_err(|source| PlanError::FrozenMissing {
                        id: id.to_owned(),
                        frozen: frozen.clone(),
                        source,
                    })?
                    .into();
                if now != r.identity {
                    return Err(PlanError::FrozenChanged {
                        id: id.to_owned(),
                        frozen,
                        recorded: r.identity,
                        now,
                    });
                }
                let (file, action) = match clone {
                    Some(file) => (
                        file.clone(),
                        Action::Clone {
                            id: id.to_owned(),
                            file,
                            frozen,
                            identity: r.identity,
                        },
                    ),
                    None => (
                        r.file.clone(),
                        Action::Reset {
                            id: id.to_owned(),
                            file: r.file.clone(),
                            frozen,
                            identity: r.identity,
                        },
                    ),
                };
                files.push((id.to_owned(), file));
                actions.push(action);
            }
        }
    }
    Ok(PmemPlan { actions, files })
}

impl PmemPlan {
    /// Checks every action that can be checked without a change (the
    /// frozen images' identities, that a clone's file is free, that a
    /// rolled-back file is not held), then carries them out: clones
    /// first (each removed again if a later action fails), rollbacks last.
    pub fn apply(&self) -> Result<Vec<PathBuf>, PlanError> {
        let mut created: Vec<PathBuf> = Vec::new();
        let undo = |created: &[PathBuf]| {
            for f in created {
                if let Err(e) = std::fs::remove_file(f) {
                    log::warn!("removing the clone {}: {e}", f.display());
                }
            }
        };
        let mut ordered: Vec<&Action> = self
            .actions
            .iter()
            .filter(|a| matches!(a, Action::Clone { .. }))
            .collect();
        ordered.extend(
            self.actions
                .iter()
                .filter(|a| matches!(a, Action::Reset { .. })),
        );
        for a in ordered {
            let r = match a {
                Action::Clone {
                    id,
                    file,
                    frozen,
                    identity,
                } => pcow::create_clone(frozen, &(*identity).into(), file)
                    .map(|()| {
                        log::info!(
                            "pmem {id}: clone {} over {}",
                            file.display(),
                            frozen.display()
                        );
                        created.push(file.clone());
                    })
                    .map_err(|source| PlanError::Clone {
                        id: id.clone(),
                        clone: file.clone(),
                        frozen: frozen.clone(),
                        source: Box::new(source),
                    }),
                Action::Reset {
                    id,
                    file,
                    frozen,
                    identity,
                } => match pcow::reset_to_frozen(file, frozen, &(*identity).into()) {
                    Ok(info) => {
                        log::info!(
                            "pmem {id}: {} rolled back to {} ({info:?} discarded)",
                            file.display(),
                            frozen.display()
                        );
                        Ok(())
                    }
                    Err(pcow::FrozenError::InUse { .. }) => Err(PlanError::InUse {
                        id: id.clone(),
                        file: file.clone(),
                    }),
                    Err(source) => Err(PlanError::Reset {
                        id: id.clone(),
                        file: file.clone(),
                        frozen: frozen.clone(),
                        source: Box::new(source),
                    }),
                },
            };
            if let Err(e) = r {
                undo(&created);
                return Err(e);
            }
        }
        Ok(created)
    }
}
