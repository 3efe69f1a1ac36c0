//! The snapshot directory: writing it so that a crash never leaves a
//! snapshot that reads as complete but is not, and reading it back with
//! every field validated.
//!
//! # Files
//!
//! | file | content |
//! |---|---|
//! | `config.json` | the [`VmConfig`] as `vm.info` shows it (upstream's shape) |
//! | `memory-ranges` | guest RAM, sparse (see [`super::memory`]) |
//! | `state.json` | the [`StateEnvelope`]: format version, RAM layout, vCPU, VM, device and pmem state |
//!
//! # Crash protocol
//!
//! `state.json` is the completion record: it exists only once everything
//! else is durable.
//!
//! 1. The destination must exist, be a directory and be empty; otherwise
//!    it is refused before anything is created in it.
//! 2. `memory-ranges` is created (`O_EXCL`), sized, written and fsynced.
//! 3. `config.json` is created (`O_EXCL`), written and fsynced.
//! 4. The directory is fsynced (the two names are durable).
//! 5. `state.json.tmp` is created (`O_EXCL`), written and fsynced, then
//!    renamed to `state.json` and the directory fsynced again.
//!
//! A crash before the rename of step 5 leaves no `state.json`: the reader
//! refuses the directory as incomplete ([`SnapshotError::Incomplete`]). A
//! crash after it leaves a complete snapshot, since the rename is atomic
//! and every file it vouches for was synced before. A directory left
//! incomplete is not empty, so it cannot be reused as a destination by
//! accident; delete it and take the snapshot again.
//!
//! # Reading
//!
//! [`SnapshotDir::open`] checks, in order: the directory, `state.json`
//! (present, size limit, JSON, an object, its version, its fields, the RAM
//! layout), `config.json` (size limit, JSON in upstream's shape,
//! [`VmConfig::validate`], RAM size equal to the layout's), and
//! `memory-ranges` (a regular file exactly as long as the layout).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use vm_memory::GuestMemoryMmap;

use super::memory::{self, LayoutError, MemoryError, MemoryLayout, MemoryRestoreMode};
use crate::config::{ValidationError, VmConfig};

/// The VM's config, upstream's shape.
pub const CONFIG_FILE: &str = "config.json";
/// The state envelope; its presence marks the snapshot complete.
pub const STATE_FILE: &str = "state.json";
/// Where `state.json` is written before its atomic rename.
pub const STATE_TEMP_FILE: &str = "state.json.tmp";
/// Guest RAM.
pub const MEMORY_FILE: &str = "memory-ranges";

/// The `state.json` format version this VMM writes and reads.
pub const STATE_VERSION: u32 = 1;
/// Largest `state.json` read (device state is small; this bounds what a
/// hostile file can make the reader allocate).
pub const MAX_STATE_LEN: u64 = 64 << 20;
/// Largest `config.json` read.
pub const MAX_CONFIG_LEN: u64 = 4 << 20;

/// `state.json`: ours, versioned. The vCPU, VM, device and pmem parts are
/// produced by their own modules and held here as JSON until those land.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateEnvelope {
    /// Format version: [`STATE_VERSION`].
    pub version: u32,
    /// Guest RAM ranges and their place in `memory-ranges`.
    pub memory: MemoryLayout,
    /// Every vCPU's state.
    pub vcpus: Value,
    /// VM-wide state (irqchip, PIT, clock).
    pub vm: Value,
    /// Every device's state.
    pub devices: Value,
    /// Each pmem device's captured content reference.
    pub pmem: Vec<Value>,
}

/// What the other snapshot modules captured, for [`SnapshotWriter::finish`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CapturedState {
    /// Every vCPU's state.
    pub vcpus: Value,
    /// VM-wide state.
    pub vm: Value,
    /// Every device's state.
    pub devices: Value,
    /// Each pmem device's captured content reference.
    pub pmem: Vec<Value>,
}

/// Why a `state.json` is refused.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("not JSON")]
    NotJson(#[source] serde_json::Error),
    #[error("not a JSON object")]
    NotAnObject,
    #[error("no `version` field")]
    NoVersion,
    #[error("`version` is {0}, not a format version number")]
    BadVersion(String),
    #[error("format version {found} is not supported (this VMM reads version {supported})")]
    UnsupportedVersion { found: u64, supported: u32 },
    #[error("invalid fields")]
    Fields(#[source] serde_json::Error),
    #[error("`memory`: invalid RAM layout")]
    Layout(#[source] LayoutError),
}

/// Parses and validates a `state.json`: the version first (so a newer
/// format gets a version error, not a field error), then the fields, then
/// the RAM layout.
pub fn parse_state(bytes: &[u8]) -> Result<StateEnvelope, StateError> {
    let value: Value = serde_json::from_slice(bytes).map_err(StateError::NotJson)?;
    let object = value.as_object().ok_or(StateError::NotAnObject)?;
    let version = object.get("version").ok_or(StateError::NoVersion)?;
    let found = version
        .as_u64()
        .ok_or_else(|| StateError::BadVersion(truncated(version)))?;
    if found != u64::from(STATE_VERSION) {
        return Err(StateError::UnsupportedVersion {
            found,
            supported: STATE_VERSION,
        });
    }
    let state: StateEnvelope = serde_json::from_value(value).map_err(StateError::Fields)?;
    state.memory.check().map_err(StateError::Layout)?;
    Ok(state)
}

/// A JSON value for an error message, cut to a readable length.
fn truncated(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// Why `config.json` is refused before validation.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("not a VM config")]
    Json(#[source] serde_json::Error),
    #[error("invalid VM config")]
    Invalid(#[source] ValidationError),
}

/// Parses a `config.json` as `vm.create` parses its body (upstream's
/// shape; unknown fields are logged and ignored, as upstream does) and
/// validates every rule that is not about files (the kernel is in the
/// snapshot's RAM; which pmem files a restored VM gets is the restore's
/// choice). Returns the config with its pmem ids assigned.
pub fn parse_config(bytes: &[u8]) -> Result<VmConfig, ConfigError> {
    let mut config: VmConfig = crate::config::from_json(bytes).map_err(ConfigError::Json)?;
    config
        .validate_snapshot_config()
        .map_err(ConfigError::Invalid)?;
    Ok(config)
}

/// Errors of writing or reading a snapshot directory; each names the file.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: cannot use as a snapshot directory")]
    Dir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not a directory")]
    NotADirectory { path: PathBuf },
    #[error(
        "{path}: destination is not empty (it holds `{entry}`); snapshots go to an empty directory"
    )]
    NotEmpty { path: PathBuf, entry: String },
    #[error("{path}: incomplete snapshot (no {STATE_FILE}{}): the writer did not finish; delete it", if *.temp { ", only its temporary file" } else { "" })]
    Incomplete { path: PathBuf, temp: bool },
    #[error("{file}: missing")]
    Missing { file: PathBuf },
    #[error("{file}: not a regular file")]
    NotAFile { file: PathBuf },
    #[error("{file}: {len} bytes, more than the {max} bytes allowed")]
    TooLarge { file: PathBuf, len: u64, max: u64 },
    #[error("{file}: cannot read")]
    Read {
        file: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{file}: cannot create")]
    Create {
        file: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{file}: cannot write")]
    Write {
        file: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{file}: cannot write guest RAM")]
    WriteMemory {
        file: PathBuf,
        #[source]
        source: MemoryError,
    },
    #[error("{file}: cannot sync")]
    Sync {
        file: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{from}: cannot rename to {STATE_FILE}")]
    Rename {
        from: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{file}: cannot serialize")]
    Serialize {
        file: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{file}: {missing} must be written before the state")]
    OutOfOrder {
        file: PathBuf,
        missing: &'static str,
    },
    #[error("{file}: invalid snapshot state")]
    State {
        file: PathBuf,
        #[source]
        source: StateError,
    },
    #[error("{file}: invalid")]
    Config {
        file: PathBuf,
        #[source]
        source: ConfigError,
    },
    #[error(
        "{file}: `memory.size` is {config_size:#x} bytes but the RAM layout in {STATE_FILE} \
         adds up to {layout_size:#x}"
    )]
    RamMismatch {
        file: PathBuf,
        config_size: u64,
        layout_size: u64,
    },
    #[error(
        "{file}: {actual:#x} bytes, the RAM layout in {STATE_FILE} needs exactly {expected:#x} \
         (truncated or not this snapshot's)"
    )]
    MemorySize {
        file: PathBuf,
        actual: u64,
        expected: u64,
    },
    #[error("{file}: cannot restore guest RAM")]
    RestoreMemory {
        file: PathBuf,
        #[source]
        source: MemoryError,
    },
}

/// Entry points to snapshot directories.
pub struct SnapshotDir;

impl SnapshotDir {
    /// Starts writing a snapshot into `path`, which must exist, be a
    /// directory and be empty (refused otherwise, without touching it).
    pub fn create(path: &Path) -> Result<SnapshotWriter, SnapshotError> {
        let dir_err = |source| SnapshotError::Dir {
            path: path.to_owned(),
            source,
        };
        let meta = fs::metadata(path).map_err(dir_err)?;
        if !meta.is_dir() {
            return Err(SnapshotError::NotADirectory {
                path: path.to_owned(),
            });
        }
        if let Some(entry) = fs::read_dir(path).map_err(dir_err)?.next() {
            let entry = entry.map_err(dir_err)?;
            return Err(SnapshotError::NotEmpty {
                path: path.to_owned(),
                entry: entry.file_name().to_string_lossy().into_owned(),
            });
        }
        let dir = File::open(path).map_err(dir_err)?;
        Ok(SnapshotWriter {
            path: path.to_owned(),
            dir,
            memory: None,
            config_written: false,
        })
    }

    /// Opens the snapshot in `path`, validating every file (see the module
    /// docs for the order of the checks).
    pub fn open(path: &Path) -> Result<Snapshot, SnapshotError> {
        let meta = fs::metadata(path).map_err(|source| SnapshotError::Dir {
            path: path.to_owned(),
            source,
        })?;
        if !meta.is_dir() {
            return Err(SnapshotError::NotADirectory {
                path: path.to_owned(),
            });
        }
        let state_path = path.join(STATE_FILE);
        let state_bytes = match read_limited(&state_path, MAX_STATE_LEN) {
            Err(SnapshotError::Missing { .. }) => {
                return Err(SnapshotError::Incomplete {
                    path: path.to_owned(),
                    temp: path.join(STATE_TEMP_FILE).exists(),
                })
            }
            r => r?,
        };
        let state = parse_state(&state_bytes).map_err(|source| SnapshotError::State {
            file: state_path.clone(),
            source,
        })?;
        let layout_size = state.memory.check().map_err(|e| SnapshotError::State {
            file: state_path.clone(),
            source: StateError::Layout(e),
        })?;

        let config_path = path.join(CONFIG_FILE);
        let config_bytes = read_limited(&config_path, MAX_CONFIG_LEN)?;
        let config = parse_config(&config_bytes).map_err(|source| SnapshotError::Config {
            file: config_path.clone(),
            source,
        })?;
        if config.memory.size != layout_size {
            return Err(SnapshotError::RamMismatch {
                file: config_path,
                config_size: config.memory.size,
                layout_size,
            });
        }

        let memory_path = path.join(MEMORY_FILE);
        let memory = open_regular(&memory_path)?;
        let actual = memory
            .metadata()
            .map_err(|source| SnapshotError::Read {
                file: memory_path.clone(),
                source,
            })?
            .len();
        if actual != layout_size {
            return Err(SnapshotError::MemorySize {
                file: memory_path,
                actual,
                expected: layout_size,
            });
        }
        Ok(Snapshot {
            path: path.to_owned(),
            config,
            state,
            memory,
        })
    }
}

/// Opens `file` for reading; it must be a regular file.
fn open_regular(file: &Path) -> Result<File, SnapshotError> {
    let f = File::open(file).map_err(|source| {
        if source.kind() == io::ErrorKind::NotFound {
            SnapshotError::Missing {
                file: file.to_owned(),
            }
        } else {
            SnapshotError::Read {
                file: file.to_owned(),
                source,
            }
        }
    })?;
    let meta = f.metadata().map_err(|source| SnapshotError::Read {
        file: file.to_owned(),
        source,
    })?;
    if !meta.is_file() {
        return Err(SnapshotError::NotAFile {
            file: file.to_owned(),
        });
    }
    Ok(f)
}

/// Reads a whole regular file of at most `max` bytes.
fn read_limited(file: &Path, max: u64) -> Result<Vec<u8>, SnapshotError> {
    let f = open_regular(file)?;
    let read_err = |source| SnapshotError::Read {
        file: file.to_owned(),
        source,
    };
    let len = f.metadata().map_err(read_err)?.len();
    if len > max {
        return Err(SnapshotError::TooLarge {
            file: file.to_owned(),
            len,
            max,
        });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // `take` bounds the read even if the file grows meanwhile.
    f.take(max + 1).read_to_end(&mut bytes).map_err(read_err)?;
    if bytes.len() as u64 > max {
        return Err(SnapshotError::TooLarge {
            file: file.to_owned(),
            len: bytes.len() as u64,
            max,
        });
    }
    Ok(bytes)
}

/// A snapshot read and validated by [`SnapshotDir::open`].
#[derive(Debug)]
pub struct Snapshot {
    path: PathBuf,
    config: VmConfig,
    state: StateEnvelope,
    memory: File,
}

impl Snapshot {
    /// The snapshot's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The VM's config (validated, pmem ids assigned).
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The state envelope.
    pub fn state(&self) -> &StateEnvelope {
        &self.state
    }

    /// The RAM layout (validated; `memory-ranges` has its size).
    pub fn memory_layout(&self) -> &MemoryLayout {
        &self.state.memory
    }

    /// `memory-ranges`, open for reading.
    pub fn memory_file(&self) -> &File {
        &self.memory
    }

    /// Builds the guest memory of a VM restored from this snapshot.
    pub fn restore_memory(
        &self,
        mode: MemoryRestoreMode,
        prefault: bool,
    ) -> Result<GuestMemoryMmap, SnapshotError> {
        memory::restore(&self.memory, &self.state.memory, mode, prefault).map_err(|source| {
            SnapshotError::RestoreMemory {
                file: self.path.join(MEMORY_FILE),
                source,
            }
        })
    }
}

/// Writes one snapshot directory, in the order of the crash protocol (see
/// the module docs): [`write_memory`](Self::write_memory) and
/// [`write_config`](Self::write_config) in either order, then
/// [`finish`](Self::finish).
#[derive(Debug)]
pub struct SnapshotWriter {
    path: PathBuf,
    dir: File,
    memory: Option<MemoryLayout>,
    config_written: bool,
}

impl SnapshotWriter {
    /// Creates `name` exclusively: nothing that appeared since the
    /// emptiness check is overwritten.
    fn create_file(&self, name: &str) -> Result<(File, PathBuf), SnapshotError> {
        let file = self.path.join(name);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&file)
            .map_err(|source| SnapshotError::Create {
                file: file.clone(),
                source,
            })?;
        Ok((f, file))
    }

    fn sync(f: &File, file: &Path) -> Result<(), SnapshotError> {
        f.sync_all().map_err(|source| SnapshotError::Sync {
            file: file.to_owned(),
            source,
        })
    }

    fn sync_dir(&self) -> Result<(), SnapshotError> {
        Self::sync(&self.dir, &self.path)
    }

    /// Writes and syncs `memory-ranges` from `memory` (the VM paused).
    /// Returns the layout that `state.json` will record.
    pub fn write_memory(
        &mut self,
        memory: &GuestMemoryMmap,
    ) -> Result<&MemoryLayout, SnapshotError> {
        let (f, file) = self.create_file(MEMORY_FILE)?;
        let layout = memory::save(memory, &f).map_err(|source| SnapshotError::WriteMemory {
            file: file.clone(),
            source,
        })?;
        Self::sync(&f, &file)?;
        Ok(self.memory.insert(layout))
    }

    /// Writes and syncs `config.json` (the config as `vm.info` shows it).
    pub fn write_config(&mut self, config: &VmConfig) -> Result<(), SnapshotError> {
        let (mut f, file) = self.create_file(CONFIG_FILE)?;
        let bytes = serde_json::to_vec(config).map_err(|source| SnapshotError::Serialize {
            file: file.clone(),
            source,
        })?;
        f.write_all(&bytes).map_err(|source| SnapshotError::Write {
            file: file.clone(),
            source,
        })?;
        Self::sync(&f, &file)?;
        self.config_written = true;
        Ok(())
    }

    /// Completes the snapshot: `state.json` written under a temporary
    /// name, synced, renamed, and the directory synced. Until this returns
    /// the directory reads as incomplete.
    pub fn finish(self, captured: CapturedState) -> Result<(), SnapshotError> {
        let state_path = self.path.join(STATE_FILE);
        let Some(memory) = self.memory.clone() else {
            return Err(SnapshotError::OutOfOrder {
                file: state_path,
                missing: MEMORY_FILE,
            });
        };
        if !self.config_written {
            return Err(SnapshotError::OutOfOrder {
                file: state_path,
                missing: CONFIG_FILE,
            });
        }
        // The names of memory-ranges and config.json are durable before the
        // record that vouches for them can be.
        self.sync_dir()?;
        let envelope = StateEnvelope {
            version: STATE_VERSION,
            memory,
            vcpus: captured.vcpus,
            vm: captured.vm,
            devices: captured.devices,
            pmem: captured.pmem,
        };
        let (mut f, temp) = self.create_file(STATE_TEMP_FILE)?;
        let bytes = serde_json::to_vec(&envelope).map_err(|source| SnapshotError::Serialize {
            file: temp.clone(),
            source,
        })?;
        f.write_all(&bytes).map_err(|source| SnapshotError::Write {
            file: temp.clone(),
            source,
        })?;
        Self::sync(&f, &temp)?;
        drop(f);
        fs::rename(&temp, &state_path).map_err(|source| SnapshotError::Rename {
            from: temp.clone(),
            source,
        })?;
        self.sync_dir()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state_json(version: &str, extra: &str) -> String {
        format!(
            r#"{{"version": {version}, "memory": {{"ranges": [{{"gpa": 0, "size": 8192}}]}},
                "vcpus": [], "vm": {{}}, "devices": {{}}, "pmem": []{extra}}}"#
        )
    }

    #[test]
    fn state_envelope_versions_and_fields() {
        let s = parse_state(state_json("1", "").as_bytes()).unwrap();
        assert_eq!(s.version, 1);
        assert_eq!(s.memory.check(), Ok(8192));
        let err = |bytes: &[u8]| parse_state(bytes).unwrap_err();
        assert!(matches!(err(b"{"), StateError::NotJson(_)));
        assert!(matches!(err(b"[1]"), StateError::NotAnObject));
        assert!(matches!(err(b"{}"), StateError::NoVersion));
        assert!(matches!(
            err(state_json("\"1\"", "").as_bytes()),
            StateError::BadVersion(_)
        ));
        assert!(matches!(
            err(state_json("-1", "").as_bytes()),
            StateError::BadVersion(_)
        ));
        let e = err(state_json("2", "").as_bytes());
        assert!(matches!(
            e,
            StateError::UnsupportedVersion {
                found: 2,
                supported: 1
            }
        ));
        assert_eq!(
            e.to_string(),
            "format version 2 is not supported (this VMM reads version 1)"
        );
        // A future version with other fields is a version error still.
        assert!(matches!(
            err(br#"{"version": 7, "other": 1}"#),
            StateError::UnsupportedVersion { found: 7, .. }
        ));
        assert!(matches!(
            err(state_json("1", r#", "bogus": 1"#).as_bytes()),
            StateError::Fields(_)
        ));
        assert!(matches!(
            err(br#"{"version": 1, "memory": {"ranges": []}}"#),
            StateError::Fields(_)
        ));
        assert!(matches!(
            err(
                br#"{"version": 1, "memory": {"ranges": []}, "vcpus": 0, "vm": 0,
                     "devices": 0, "pmem": []}"#
            ),
            StateError::Layout(LayoutError::Empty)
        ));
        let long = format!("\"{}\"", "x".repeat(100));
        let m = err(state_json(&long, "").as_bytes()).to_string();
        assert!(m.len() < 100, "{m}");
    }
}
