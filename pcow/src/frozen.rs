//! Restoring from a frozen image (a VM snapshot's pmem content, see
//! `docs/snapshots.md`): a thin clone over it ([`create_clone`]), or the
//! source image put back to it ([`reset_to_frozen`]). Both check first that
//! the frozen file is still the one the snapshot recorded
//! ([`FileIdentity`]), and change nothing when they refuse.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::format::{BaseFormat, BaseRef};
use crate::header::is_pcow;
use crate::identity::FileIdentity;
use crate::image::{CreateOptions, Image, OpenOptions};
use crate::replace::{remove_stale_temps, sync_dir, temp_name, TempPurpose};

/// Errors of [`create_clone`] and [`reset_to_frozen`].
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum FrozenError {
    #[error("{path}: exists already (a clone is a new file)")]
    Exists { path: PathBuf },
    #[error("{path}: not a pcow image")]
    NotPcow { path: PathBuf },
    #[error("{path}: the frozen image is open for writing by a process, so it is not frozen")]
    FrozenLocked { path: PathBuf },
    #[error(
        "{path}: the image is in use by another process (a VM still runs on it); \
         restore into a clone of the snapshot instead"
    )]
    InUse { path: PathBuf },
    #[error(
        "{path}: not the file the snapshot recorded, or changed since \
         (expected {expected}, found {found})"
    )]
    IdentityChanged {
        path: PathBuf,
        expected: FileIdentity,
        found: FileIdentity,
    },
    #[error("{image}: its base chain does not contain {frozen}")]
    NotInChain { image: PathBuf, frozen: PathBuf },
    #[error("{path}: not valid UTF-8 (base names are stored as UTF-8)")]
    NotUtf8 { path: PathBuf },
    #[error("{path}: {what}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{what}")]
    Image {
        what: &'static str,
        #[source]
        source: Box<Error>,
    },
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> FrozenError + 'a {
    move |source| FrozenError::Io {
        path: path.to_owned(),
        what,
        source,
    }
}

fn img_err(what: &'static str) -> impl FnOnce(Error) -> FrozenError {
    move |source| FrozenError::Image {
        what,
        source: Box::new(source),
    }
}

/// What [`reset_to_frozen`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetInfo {
    /// The image reset (now a new empty overlay over `frozen`).
    pub image: PathBuf,
    /// The base name stored in it.
    pub base: String,
    /// Data clusters the replaced file held (all its layers): what the
    /// image held past the snapshot, now discarded.
    pub discarded_clusters: u64,
    /// The replaced file's size in bytes.
    pub discarded_bytes: u64,
    /// Images that were between the image and `frozen` in its chain, no
    /// longer part of it (left on disk).
    pub dropped_layers: Vec<PathBuf>,
}

/// The name `base` is stored under in an image at `file`: its file name
/// when both share a directory, else its absolute path. Also returns
/// `file` with its directory resolved.
fn base_name_for(file: &Path, base: &Path) -> Result<(PathBuf, String), FrozenError> {
    let name = file.file_name().ok_or_else(|| FrozenError::Io {
        path: file.to_owned(),
        what: "the path names no file",
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })?;
    let parent = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = parent
        .canonicalize()
        .map_err(io_err(parent, "resolving the directory"))?;
    let base_abs = base
        .canonicalize()
        .map_err(io_err(base, "resolving the path"))?;
    let stored: &Path = match (base_abs.parent(), base_abs.file_name()) {
        (Some(d), Some(n)) if d == dir => Path::new(n),
        _ => &base_abs,
    };
    let stored = stored
        .to_str()
        .ok_or_else(|| FrozenError::NotUtf8 {
            path: base_abs.clone(),
        })?
        .to_owned();
    Ok((dir.join(name), stored))
}

/// Opens the frozen image read-only under a shared lock (a writer's lock
/// is [`FrozenError::FrozenLocked`]) and checks it is a pcow image whose
/// identity is `expect`.
fn open_frozen(frozen: &Path, expect: &FileIdentity) -> Result<Image, FrozenError> {
    let f = File::open(frozen).map_err(io_err(frozen, "opening the frozen image"))?;
    if !is_pcow(&f).map_err(io_err(frozen, "reading the frozen image"))? {
        return Err(FrozenError::NotPcow {
            path: frozen.to_owned(),
        });
    }
    drop(f);
    let img = match Image::open(frozen, OpenOptions::read_only()) {
        Ok(img) => img,
        Err(Error::Locked { path }) => return Err(FrozenError::FrozenLocked { path }),
        Err(e) => return Err(img_err("opening the frozen image")(e)),
    };
    let file = img.file().ok_or_else(|| FrozenError::Io {
        path: frozen.to_owned(),
        what: "the frozen image has no file",
        source: io::Error::from_raw_os_error(libc::EBADF),
    })?;
    check_identity(frozen, file, expect)?;
    Ok(img)
}

fn check_identity(path: &Path, file: &File, expect: &FileIdentity) -> Result<(), FrozenError> {
    let found = FileIdentity::of(file).map_err(io_err(path, "reading metadata"))?;
    if found != *expect {
        return Err(FrozenError::IdentityChanged {
            path: path.to_owned(),
            expected: *expect,
            found,
        });
    }
    Ok(())
}

/// Creates a new image at `path` (nothing may be there) over `frozen`,
/// stored as `base`, with `frozen`'s geometry, and closes it.
fn create_over(path: &Path, base: &str, frozen: &Image) -> Result<(), FrozenError> {
    let opts = CreateOptions {
        cluster_size: Some(frozen.cluster_size()),
        virtual_size: Some(frozen.virtual_size()),
        base: Some(BaseRef {
            name: base.to_owned(),
            format: BaseFormat::Pcow,
        }),
    };
    let img = match Image::create_new(path, &opts) {
        Ok(img) => img,
        Err(Error::Io { source, .. }) if source.kind() == io::ErrorKind::AlreadyExists => {
            return Err(FrozenError::Exists {
                path: path.to_owned(),
            })
        }
        Err(e) => return Err(img_err("creating the overlay")(e)),
    };
    // The overlay must stand on the very file that was checked (the name
    // could have been replaced in between).
    let base_file = img.chain_files().get(1).copied();
    let same = match (base_file, frozen.file()) {
        (Some(a), Some(b)) => {
            let a = FileIdentity::of(a).map_err(io_err(path, "reading metadata"))?;
            let b = FileIdentity::of(b).map_err(io_err(path, "reading metadata"))?;
            a == b
        }
        _ => false,
    };
    if !same {
        drop(img);
        let _ = std::fs::remove_file(path);
        return Err(FrozenError::NotInChain {
            image: path.to_owned(),
            frozen: frozen.path().to_owned(),
        });
    }
    if let Err(e) = img.close() {
        let _ = std::fs::remove_file(path);
        return Err(img_err("closing the overlay")(e));
    }
    Ok(())
}

/// A clone for a restored VM: a new thin pcow overlay at `clone` whose
/// base is `frozen` (stored as its file name when both share a directory,
/// else as its absolute path), with `frozen`'s cluster and virtual sizes.
/// Refused, with nothing created: an existing `clone` path (even a
/// dangling link), a `frozen` that is not a pcow image, that a process
/// holds open for writing ([`FrozenError::FrozenLocked`]), or whose
/// identity differs from `expect` ([`FrozenError::IdentityChanged`]:
/// replaced or changed since the snapshot). The clone only reads `frozen`
/// (shared lock, as every base), so any number of clones share it.
pub fn create_clone(frozen: &Path, expect: &FileIdentity, clone: &Path) -> Result<(), FrozenError> {
    match std::fs::symlink_metadata(clone) {
        Ok(_) => {
            return Err(FrozenError::Exists {
                path: clone.to_owned(),
            })
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(clone, "checking the clone's path")(e)),
    }
    let img = open_frozen(frozen, expect)?;
    let (clone, base) = base_name_for(clone, frozen)?;
    create_over(&clone, &base, &img)?;
    sync_dir(&clone).map_err(io_err(&clone, "syncing the clone's directory"))
}

/// Restore without a clone: `image` (the source VM's top) goes back to
/// `frozen`'s content. The file at `image` is replaced atomically by a new
/// empty overlay over `frozen` (made under a temporary name in its
/// directory, see [`crate::replace`], synced, renamed over `image`, the
/// directory synced); what `image` held past the snapshot is discarded,
/// and images between it and `frozen` leave its chain (both reported in
/// [`ResetInfo`]). Refused before any change: `image` locked by another
/// process ([`FrozenError::InUse`]: a VM still runs on it), `image` not a
/// pcow image whose chain contains `frozen` (same device and inode),
/// `frozen` not a pcow image or with an identity other than `expect`.
/// The old file's exclusive lock is held until the rename, so no writer
/// starts on it meanwhile.
pub fn reset_to_frozen(
    image: &Path,
    frozen: &Path,
    expect: &FileIdentity,
) -> Result<ResetInfo, FrozenError> {
    let f = File::open(image).map_err(io_err(image, "opening the image"))?;
    if !is_pcow(&f).map_err(io_err(image, "reading the image"))? {
        return Err(FrozenError::NotPcow {
            path: image.to_owned(),
        });
    }
    let image_id = FileIdentity::of(&f).map_err(io_err(image, "reading metadata"))?;
    drop(f);
    // F first: its chain's shared locks are ours, so an image below F
    // (which we could not lock exclusively now) is told apart from one a
    // VM holds.
    let frozen_img = open_frozen(frozen, expect)?;
    for below in frozen_img.chain_files() {
        let id = FileIdentity::of(below).map_err(io_err(frozen, "reading the chain's metadata"))?;
        if id.same_file(&image_id) {
            return Err(FrozenError::NotInChain {
                image: image.to_owned(),
                frozen: frozen.to_owned(),
            });
        }
    }
    // Locked exclusively, nothing written (deferred writer).
    let old = match Image::open(image, OpenOptions::read_write_deferred()) {
        Ok(img) => img,
        Err(Error::Locked { path }) => return Err(FrozenError::InUse { path }),
        Err(e) => return Err(img_err("opening the image")(e)),
    };
    let frozen_id = frozen_img
        .file()
        .map(FileIdentity::of)
        .transpose()
        .map_err(io_err(frozen, "reading metadata"))?;
    let chain = old.chain_files();
    let mut depth = None;
    for (d, f) in chain.iter().enumerate() {
        let id = FileIdentity::of(f).map_err(io_err(image, "reading the chain's metadata"))?;
        if frozen_id.is_some_and(|z| z.same_file(&id)) {
            depth = Some(d);
            break;
        }
    }
    let Some(depth) = depth else {
        return Err(FrozenError::NotInChain {
            image: image.to_owned(),
            frozen: frozen.to_owned(),
        });
    };
    let dropped_layers = old
        .chain_paths()
        .into_iter()
        .skip(1)
        .take(depth.saturating_sub(1))
        .collect();
    let discarded_bytes = chain
        .first()
        .map(|f| f.metadata().map(|m| m.len()))
        .transpose()
        .map_err(io_err(image, "reading metadata"))?
        .unwrap_or(0);
    let discarded_clusters = old.allocated_clusters();
    // The file itself is replaced, in its own directory: a symbolic link
    // to it stays a link (to the reset image).
    let target = image
        .canonicalize()
        .map_err(io_err(image, "resolving the path"))?;
    let temp = temp_name(&target, TempPurpose::Reset).ok_or_else(|| FrozenError::Io {
        path: image.to_owned(),
        what: "the path names no file",
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })?;
    let (temp, base) = base_name_for(&temp, frozen)?;
    remove_stale_temps(&target).map_err(io_err(&target, "removing stale temporary images"))?;
    create_over(&temp, &base, &frozen_img)?;
    drop(frozen_img);
    if let Err(e) = std::fs::rename(&temp, &target) {
        let _ = std::fs::remove_file(&temp);
        return Err(io_err(&target, "renaming the new overlay over the image")(
            e,
        ));
    }
    // From here the image is reset; the old file goes with its lock.
    drop(old);
    sync_dir(&target).map_err(io_err(&target, "syncing the image's directory"))?;
    Ok(ResetInfo {
        image: target,
        base,
        discarded_clusters,
        discarded_bytes,
        dropped_layers,
    })
}
