//! Freeze: a VM snapshot's pmem content. [`freeze`] keeps the device's
//! current top image X, as it is at this instant, under a new name F in
//! X's directory, immutable from now on, and puts a new empty overlay over
//! F at X's name, on which the guest continues. No data is copied: the
//! file is the same inode under two names, then one. Writers and the
//! state lock are held throughout (faults wait, as for a live overlay,
//! see [`crate::overlay`]):
//!
//! 1. barrier: every private page is in X, data and metadata durable;
//! 2. the pre-allocation worker stops; X closes (DIRTY cleared, pool
//!    dropped) and the writer's lock is released;
//! 3. `link(X, F)`: F is a second name of X's inode (refused by the file
//!    system if F exists);
//! 4. the overlay is created under a temporary name T
//!    (`.X.freeze-PID.tmp`, see [`pcow::replace`]) with base name F
//!    (relative: same directory), which opens F read-only under a shared
//!    lock; the old top's shared ranges are mapped `MAP_PRIVATE` from F at
//!    the same offsets (same bytes, now history);
//! 5. `rename(T, X)`: atomically, X names the overlay; the directory is
//!    synced;
//! 6. the worker restarts on the overlay.
//!
//! Every moment leaves a file at X with all acknowledged data: before 3,
//! X as it was; after 3, X and F one inode; after 4, also a stale T, which
//! the next freeze of X removes (or [`pcow::reset_to_frozen`]) when no
//! process holds its lock; after 5, X the overlay over F. A failure undoes
//! what was done (T removed, the rename undone by renaming F back over X,
//! else F unlinked if it still names X's old inode), reopens X read-write,
//! maps the remapped ranges shared again and restarts the worker: the
//! device continues on X unchanged. Only if X cannot be reopened as the
//! same file is the device left without a writable image, as for a
//! failed overlay.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pcow::format::MAX_CHAIN_DEPTH;
use pcow::replace::{is_temp_name, remove_stale_temps, sync_dir, temp_name, TempPurpose};
use pcow::{BaseFormat, BaseRef, CreateOptions, FileIdentity, Image, LiveImage, OpenOptions};

use crate::barrier::{barrier_locked, BarrierError, BarrierStats};
use crate::clusters::FileRun;
use crate::health::Failure;
use crate::overlay::{
    release_switch, remap_private, resume_on, shared_runs, top_file, OverlayError,
};
use crate::quiesce::{hold, Quiesce};
use crate::state::{NoImage, RegionState, Shared, Writable};

/// What a freeze did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreezeInfo {
    /// The frozen image F (absolute): the top image as it was, immutable
    /// from now on.
    pub frozen: PathBuf,
    /// The top image X (absolute, the path the device had): now a thin
    /// overlay over F.
    pub top: PathBuf,
    /// F's identity right after the freeze (what a restore checks).
    pub identity: FileIdentity,
    /// The barrier that preceded the freeze.
    pub barrier: BarrierStats,
    /// Time writers were held.
    pub held: Duration,
}

/// Errors of a freeze.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    #[error("barrier before the freeze")]
    Barrier(#[source] Box<BarrierError>),
    #[error("{path}: exists already (a freeze names a new file)")]
    Exists { path: PathBuf },
    #[error(
        "{path}: not in the directory of the image {dir} (the frozen image is a second \
         name of the same file, which needs the same directory)"
    )]
    NotInImageDir { path: PathBuf, dir: PathBuf },
    #[error("{path}: {why}")]
    BadName { path: PathBuf, why: &'static str },
    #[error(
        "the image's chain has {depth} images, the limit is {limit}: a freeze adds one; \
         merge layers first (`pcow-img commit` or `pcow-img rebase`)"
    )]
    ChainTooDeep { depth: usize, limit: usize },
    #[error(
        "the device runs with discard_writes: its image is never written and has \
         no state of its own to freeze"
    )]
    Discarding,
    #[error("{path}: {what}")]
    Path {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {what}")]
    Image {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: Box<pcow::Error>,
    },
    #[error("cluster {vcn}: {what}")]
    Layout { vcn: u64, what: String },
    #[error("remapping clusters {vcn}..{end} private from the frozen image")]
    Remap {
        vcn: u64,
        end: u64,
        #[source]
        source: io::Error,
    },
    #[error(
        "the freeze failed and the image could not be reopened: the device has no writable image"
    )]
    Reopen(#[source] Failure),
    #[error("no writable image")]
    NoImage(#[from] NoImage),
    #[error("region state lock poisoned by a panic")]
    Poisoned,
}

impl From<BarrierError> for FreezeError {
    fn from(e: BarrierError) -> Self {
        FreezeError::Barrier(Box::new(e))
    }
}

impl From<OverlayError> for FreezeError {
    fn from(e: OverlayError) -> Self {
        match e {
            OverlayError::Layout { vcn, what } => FreezeError::Layout { vcn, what },
            OverlayError::Remap { vcn, end, source } => FreezeError::Remap { vcn, end, source },
            OverlayError::NoImage(n) => FreezeError::NoImage(n),
            other => FreezeError::Layout {
                vcn: 0,
                what: error_report::chain(&other),
            },
        }
    }
}

/// The steps after which a test can make a freeze fail
/// ([`fail_next_freeze`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreezeStep {
    /// After `link(X, F)`.
    Linked,
    /// After the overlay was created at T (before it is started).
    Created,
    /// After the shared ranges were remapped from F (before the rename).
    Remapped,
    /// After `rename(T, X)` (before the directory's sync).
    Renamed,
}

thread_local! {
    static FAIL_AT: std::cell::Cell<Option<FreezeStep>> = const { std::cell::Cell::new(None) };
}

/// Makes the next freeze run on this thread fail after `step` with an
/// injected I/O error. The undo paths after the link cannot otherwise be
/// reached on demand (a file system does not fail a rename when asked);
/// tests use this to show each of them leaves the device on its image.
/// Thread-local: a freeze runs on its caller's thread, so parallel tests
/// do not see each other's injections.
#[doc(hidden)]
pub fn fail_next_freeze(step: FreezeStep) {
    FAIL_AT.with(|f| f.set(Some(step)));
}

fn injected(step: FreezeStep) -> Result<(), FreezeError> {
    if FAIL_AT.with(|f| f.get()) != Some(step) {
        return Ok(());
    }
    FAIL_AT.with(|f| f.set(None));
    Err(FreezeError::Path {
        path: PathBuf::from(format!("{step:?}")),
        what: "injected failure (test)",
        source: io::Error::other("injected"),
    })
}

/// The reopened image is not the file the device had.
#[derive(Debug, thiserror::Error)]
#[error("{path}: names another file than the device's image after the failed freeze")]
struct Replaced {
    path: PathBuf,
}

/// The names a freeze uses, decided before anything changes.
#[derive(Debug)]
struct FreezePlan {
    /// X, absolute.
    top: PathBuf,
    /// F, absolute, in X's directory.
    frozen: PathBuf,
    /// F's file name (the overlay's base name).
    base: String,
    /// T, absolute.
    temp: PathBuf,
}

fn path_err(path: &Path, what: &'static str) -> impl FnOnce(io::Error) -> FreezeError {
    let path = path.to_owned();
    move |source| FreezeError::Path { path, what, source }
}

fn img_err(path: &Path, what: &'static str) -> impl FnOnce(pcow::Error) -> FreezeError {
    let path = path.to_owned();
    move |source| FreezeError::Image {
        path,
        what,
        source: Box::new(source),
    }
}

impl FreezePlan {
    fn new(image: &Image, frozen: &Path) -> Result<FreezePlan, FreezeError> {
        let depth = image.chain_paths().len();
        if depth >= MAX_CHAIN_DEPTH {
            return Err(FreezeError::ChainTooDeep {
                depth,
                limit: MAX_CHAIN_DEPTH,
            });
        }
        let top = image
            .path()
            .canonicalize()
            .map_err(path_err(image.path(), "resolving the image's path"))?;
        let dir = top.parent().unwrap_or(Path::new("/")).to_owned();
        // A freeze that a crash cut between its link and its rename left
        // a second name of the image: say so (it is cheap to see, and the
        // name, unlike a temporary, cannot be told from a user's own link).
        if let Ok(md) = std::fs::metadata(&top) {
            if md.nlink() > 1 {
                log::warn!(
                    "{}: the image has {} names; a freeze cut by a crash leaves one \
                     (the frozen name of an incomplete snapshot, safe to remove)",
                    top.display(),
                    md.nlink()
                );
            }
        }
        let bad = |why| FreezeError::BadName {
            path: frozen.to_owned(),
            why,
        };
        let name = frozen.file_name().ok_or_else(|| bad("names no file"))?;
        let parent = match frozen.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let fdir = parent
            .canonicalize()
            .map_err(path_err(parent, "resolving the frozen image's directory"))?;
        if fdir != dir {
            return Err(FreezeError::NotInImageDir {
                path: frozen.to_owned(),
                dir,
            });
        }
        let frozen_abs = dir.join(name);
        match std::fs::symlink_metadata(&frozen_abs) {
            Ok(_) => return Err(FreezeError::Exists { path: frozen_abs }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(path_err(&frozen_abs, "checking the frozen image's path")(e)),
        }
        let base = name
            .to_str()
            .ok_or_else(|| bad("not valid UTF-8 (base names are stored as UTF-8)"))?
            .to_owned();
        let temp = temp_name(&top, TempPurpose::Freeze)
            .ok_or_else(|| bad("the image's path names no file"))?;
        if is_temp_name(&top, &frozen_abs) {
            return Err(bad(
                "named like a temporary file of the image (a later freeze removes those)",
            ));
        }
        Ok(FreezePlan {
            top,
            frozen: frozen_abs,
            base,
            temp,
        })
    }
}

/// Freezes the device's top image under `frozen` (see the module
/// documentation).
pub(crate) fn freeze(
    shared: &Shared,
    quiesce: &dyn Quiesce,
    frozen: &Path,
) -> Result<FreezeInfo, FreezeError> {
    let _serial = shared.serialize();
    let _held = hold(quiesce).map_err(BarrierError::from)?;
    let t = Instant::now();
    let mut st = shared.lock().map_err(|_| FreezeError::Poisoned)?;
    let image = st.image()?;
    if image.is_temporary() {
        return Err(FreezeError::Discarding);
    }
    let plan = FreezePlan::new(image, frozen)?;
    for stale in remove_stale_temps(&plan.top)
        .map_err(path_err(&plan.top, "removing stale temporary images"))?
    {
        log::warn!("removed {}, left by a freeze that crashed", stale.display());
    }
    let barrier = barrier_locked(&mut st)?;
    let runs = shared_runs(&st)?;
    let identity = switch(&mut st, &plan, &runs)?;
    Ok(FreezeInfo {
        frozen: plan.frozen,
        top: plan.top,
        identity,
        barrier,
        held: t.elapsed(),
    })
}

/// How far a freeze got on disk (what an undo must take back).
#[derive(Debug, Default)]
struct Done {
    linked: bool,
    created: bool,
    renamed: bool,
}

/// Steps 2 to 6 (writers held, barrier done); on failure after the close,
/// [`recover`] puts X back. Returns F's identity.
fn switch(
    st: &mut RegionState,
    plan: &FreezePlan,
    runs: &[FileRun],
) -> Result<FileIdentity, FreezeError> {
    let cs = st.view.cs;
    let image = st.image()?;
    let virtual_size = image.virtual_size();
    let lock_handle = top_file(image)
        .and_then(|f| f.try_clone())
        .map_err(path_err(&plan.top, "a handle for the writer's lock"))?;
    let old_id = FileIdentity::of(&lock_handle).map_err(path_err(&plan.top, "reading metadata"))?;
    let mut old = match std::mem::replace(&mut st.image, Writable::Switching) {
        Writable::Open(i) => i,
        other => {
            st.image = other;
            return Err(st.image().err().unwrap_or(NoImage::Switching).into());
        }
    };
    st.pool.stop(&mut old);

    let mut done = Done::default();
    let mut new: Option<LiveImage> = None;
    let mut remapped: Vec<FileRun> = Vec::new();
    let result = (|| {
        old.close()
            .map_err(img_err(&plan.top, "closing the image"))?;
        // The region's mappings keep the old open file description, and
        // its flock, alive: release it, or F could not be opened as a base.
        lock_handle
            .unlock()
            .map_err(path_err(&plan.top, "releasing the writer's lock"))?;
        std::fs::hard_link(&plan.top, &plan.frozen).map_err(|source| {
            if source.kind() == io::ErrorKind::AlreadyExists {
                FreezeError::Exists {
                    path: plan.frozen.clone(),
                }
            } else {
                path_err(&plan.frozen, "linking the frozen image to the image")(source)
            }
        })?;
        done.linked = true;
        injected(FreezeStep::Linked)?;
        let opts = CreateOptions {
            cluster_size: Some(cs),
            virtual_size: Some(virtual_size),
            base: Some(BaseRef {
                name: plan.base.clone(),
                format: BaseFormat::Pcow,
            }),
        };
        // Whatever is at T now is not ours (the stale ones are gone): a
        // failure leaves it alone.
        let theirs = std::fs::symlink_metadata(&plan.temp).is_ok();
        let img = match Image::create_new(&plan.temp, &opts) {
            Ok(img) => img,
            Err(pcow::Error::Io { source, .. })
                if source.kind() == io::ErrorKind::AlreadyExists =>
            {
                return Err(path_err(&plan.temp, "creating the overlay")(source));
            }
            Err(e) => {
                done.created = !theirs;
                return Err(img_err(&plan.temp, "creating the overlay")(e));
            }
        };
        done.created = true;
        injected(FreezeStep::Created)?;
        let img = LiveImage::new(img).map_err(img_err(&plan.temp, "starting the overlay"))?;
        let img = new.insert(img);
        st.pool.configure(img);
        let base_file = img
            .chain_files()
            .get(1)
            .copied()
            .ok_or_else(|| FreezeError::Layout {
                vcn: 0,
                what: "the overlay's chain has no base file".into(),
            })?;
        let base_id =
            FileIdentity::of(base_file).map_err(path_err(&plan.frozen, "reading metadata"))?;
        if !base_id.same_file(&old_id) {
            return Err(FreezeError::Layout {
                vcn: 0,
                what: format!(
                    "the overlay's base {} is not the image's file",
                    plan.frozen.display()
                ),
            });
        }
        let base_fd = base_file.as_raw_fd();
        remap_private(st, img, runs, base_fd, &mut remapped)?;
        injected(FreezeStep::Remapped)?;
        img.rename_in_dir(&plan.top)
            .map_err(img_err(&plan.temp, "renaming the overlay over the image"))?;
        done.renamed = true;
        injected(FreezeStep::Renamed)?;
        sync_dir(&plan.top).map_err(path_err(&plan.top, "syncing the image's directory"))?;
        Ok(base_id)
    })();
    match result {
        Ok(id) => {
            drop(lock_handle);
            let img = new.take().ok_or_else(|| FreezeError::Layout {
                vcn: 0,
                what: "no overlay image".into(),
            })?;
            if let Err(e) = st.pool.start(&img) {
                log::warn!(
                    "no pre-allocation worker after the freeze ({e}), the pool refills inline"
                );
            }
            st.pool.request(&img);
            st.image = Writable::Open(Box::new(img));
            Ok(id)
        }
        Err(cause) => Err(recover(
            st,
            plan,
            cause,
            &lock_handle,
            &old_id,
            new,
            &done,
            &remapped,
        )),
    }
}

/// Undoes the names a failed freeze made; logs what it cannot undo.
fn undo_files(plan: &FreezePlan, old_id: &FileIdentity, done: &Done) {
    let is_old = |p: &Path| FileIdentity::of_path(p).is_ok_and(|id| id.same_file(old_id));
    if done.renamed {
        // X names the overlay, F the old file: F back over X takes both
        // back in one step.
        match std::fs::rename(&plan.frozen, &plan.top) {
            Ok(()) => {
                if let Err(e) = sync_dir(&plan.top) {
                    log::warn!("{}: syncing the directory: {e}", plan.top.display());
                }
            }
            Err(e) => log::error!(
                "{}: renaming the frozen image back over the image: {e}",
                plan.frozen.display()
            ),
        }
        return;
    }
    if done.created {
        if let Err(e) = std::fs::remove_file(&plan.temp) {
            if e.kind() != io::ErrorKind::NotFound {
                log::warn!("{}: removing the overlay: {e}", plan.temp.display());
            }
        }
    }
    if done.linked && is_old(&plan.top) && is_old(&plan.frozen) {
        if let Err(e) = std::fs::remove_file(&plan.frozen) {
            log::warn!("{}: removing the second name: {e}", plan.frozen.display());
        }
    }
}

/// Undoes a failed freeze after X was closed: closes the overlay, takes
/// the new names back, reopens X read-write (and checks it is the same
/// file), maps the ranges already remapped shared again, restarts the
/// worker. Returns the error to report.
#[allow(clippy::too_many_arguments)]
fn recover(
    st: &mut RegionState,
    plan: &FreezePlan,
    cause: FreezeError,
    lock_handle: &std::fs::File,
    old_id: &FileIdentity,
    new: Option<LiveImage>,
    done: &Done,
    remapped: &[FileRun],
) -> FreezeError {
    log::error!(
        "freeze of {} as {}: {}; reopening the image",
        plan.top.display(),
        plan.frozen.display(),
        error_report::chain(&cause)
    );
    // The remapped ranges keep the base's description, and its shared
    // lock, alive: released, or X could not be locked again.
    release_switch(lock_handle, &plan.top, new, &plan.temp);
    undo_files(plan, old_id, done);
    let reopened = Image::open(&plan.top, OpenOptions::read_write())
        .and_then(LiveImage::new)
        .map_err(|source| Failure::new(img_err(&plan.top, "reopening the image")(source)))
        .and_then(|img| {
            let same = top_file(&img)
                .and_then(FileIdentity::of)
                .is_ok_and(|id| id.same_file(old_id));
            if same {
                Ok(img)
            } else {
                Err(Failure::new(Replaced {
                    path: plan.top.clone(),
                }))
            }
        });
    let img = match reopened {
        Ok(img) => img,
        Err(why) => {
            log::error!("{}", error_report::chain(why.error()));
            st.image = Writable::Detached(why.clone());
            return FreezeError::Reopen(why);
        }
    };
    resume_on(st, img, remapped, "freeze");
    cause
}
