//! Live overlay: [`overlay`] switches the running device to a new top file
//! whose base is the current image, with writers held and the state lock
//! held throughout (faults wait for the switch; it holds the lock across
//! its barrier's syncs, the close and the open):
//!
//! 1. barrier: every private page is in the image, data and metadata are
//!    durable;
//! 2. the pre-allocation worker stops (its handle shares the writer's
//!    open file description and so its `flock`);
//! 3. the image closes (DIRTY cleared, pool dropped) and the writer's
//!    exclusive lock is released explicitly: the region's mappings keep the
//!    old open file description, and with it the lock, alive after the fd
//!    closes;
//! 4. the overlay is created with the old top as its base (the name stored
//!    relative when both files share a directory, else absolute), which
//!    opens the whole chain again, the old top read-only at depth 1 under a
//!    shared lock;
//! 5. every shared range of the region (the old top's active clusters) is
//!    mapped `MAP_PRIVATE` from the new chain's depth-1 file at the same
//!    offsets: the same bytes, now read-only history; writes to them are
//!    copy-on-write, holes fault into the overlay;
//! 6. the worker restarts on the overlay's file.
//!
//! If a step after the close fails, the overlay file (new, so ours) is
//! closed and removed, the old image is reopened read-write, ranges already
//! remapped are mapped shared again from it, and the worker restarts: the
//! device continues on the old image with the region's content unchanged
//! (writers were held, every remap maps the same file bytes). A range
//! that cannot be mapped shared again stays private over the same bytes,
//! which the next barrier copies back (correct, a little slower). Only if
//! the old image cannot be reopened (another process took its lock in the
//! moment it was free, or the disk failed) is the device left without a
//! writable image ([`crate::state::Writable::Detached`]): faults map zeros,
//! barriers fail with an error naming the cause, and the status reports it.
//! While the old image is closed the state holds no image at all
//! ([`crate::state::Writable::Switching`]), never a stand-in.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pcow::{BaseFormat, BaseRef, ClusterSource, CreateOptions, Image, LiveImage, OpenOptions};

use crate::barrier::{barrier_locked, BarrierError, BarrierStats};
use crate::clusters::{push_run, ClusterState, FileRun};
use crate::health::Failure;
use crate::quiesce::{hold, Quiesce};
use crate::state::{NoImage, RegionState, Shared, Writable};

/// The old image could not be reopened after a failed overlay.
#[derive(Debug, thiserror::Error)]
#[error("{}: reopening the image after a failed overlay ({cause})", path.display())]
pub(crate) struct ReopenError {
    path: PathBuf,
    cause: Failure,
    #[source]
    source: pcow::Error,
}

/// What a live overlay did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayInfo {
    /// The new top image (absolute path).
    pub file: PathBuf,
    /// The base name stored in the overlay (relative to the overlay's
    /// directory, or absolute).
    pub base: String,
    /// The base (the former top image), absolute.
    pub base_path: PathBuf,
    /// Clusters remapped from shared to private (read-only history).
    pub remapped_clusters: u64,
    /// The barrier that preceded the switch.
    pub barrier: BarrierStats,
    /// Time writers were held.
    pub held: Duration,
}

/// Errors of a live overlay.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error("barrier before the overlay")]
    Barrier(#[source] Box<BarrierError>),
    #[error("{path}: the overlay file exists already (a live overlay creates a new file)")]
    Exists { path: PathBuf },
    #[error("{path}: {what}")]
    Path {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not valid UTF-8 (base names are stored as UTF-8)")]
    NotUtf8 { path: PathBuf },
    #[error("{path}: {what}")]
    Image {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: Box<pcow::Error>,
    },
    #[error("cluster {vcn}: {what}")]
    Layout { vcn: u64, what: String },
    #[error("remapping clusters {vcn}..{end} private from the base")]
    Remap {
        vcn: u64,
        end: u64,
        #[source]
        source: io::Error,
    },
    #[error("the overlay failed and the old image could not be reopened: the device has no writable image")]
    Reopen(#[source] Failure),
    #[error("no writable image")]
    NoImage(#[from] NoImage),
    #[error(
        "the device runs with discard_writes: its writes go to a temporary overlay that \
         is discarded, and the image is never written; shut the VM down and overlay \
         the image offline (`pcow-img create -b IMAGE -F pcow FILE`)"
    )]
    Discarding,
    #[error("region state lock poisoned by a panic")]
    Poisoned,
}

impl From<BarrierError> for OverlayError {
    fn from(e: BarrierError) -> Self {
        OverlayError::Barrier(Box::new(e))
    }
}

/// Where the overlay goes and what it names as its base, decided before
/// anything changes.
#[derive(Debug)]
struct OverlayPlan {
    file: PathBuf,
    base: String,
    base_path: PathBuf,
}

impl OverlayPlan {
    fn new(image: &Image, new_file: &Path) -> Result<OverlayPlan, OverlayError> {
        let perr = |path: &Path, what| {
            let path = path.to_owned();
            move |source| OverlayError::Path { path, what, source }
        };
        match std::fs::symlink_metadata(new_file) {
            Ok(_) => {
                return Err(OverlayError::Exists {
                    path: new_file.to_owned(),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(perr(new_file, "checking the overlay file")(e)),
        }
        let name = new_file.file_name().ok_or_else(|| OverlayError::Path {
            path: new_file.to_owned(),
            what: "the overlay path names no file",
            source: io::Error::from(io::ErrorKind::InvalidInput),
        })?;
        let parent = match new_file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = parent
            .canonicalize()
            .map_err(perr(parent, "the overlay's directory"))?;
        let base_path = image
            .path()
            .canonicalize()
            .map_err(perr(image.path(), "resolving the image's path"))?;
        let stored: &Path = match (base_path.parent(), base_path.file_name()) {
            (Some(d), Some(n)) if d == dir => Path::new(n),
            _ => &base_path,
        };
        let base = stored
            .to_str()
            .ok_or_else(|| OverlayError::NotUtf8 {
                path: base_path.clone(),
            })?
            .to_owned();
        Ok(OverlayPlan {
            file: dir.join(name),
            base,
            base_path,
        })
    }
}

/// Live overlay: the current image becomes the read-only base of a new top
/// image at `new_file` (which must not exist), and the guest continues on
/// it. See the module documentation for the steps and what a failure
/// leaves.
pub(crate) fn overlay(
    shared: &Shared,
    quiesce: &dyn Quiesce,
    new_file: &Path,
) -> Result<OverlayInfo, OverlayError> {
    let _serial = shared.serialize();
    let _held = hold(quiesce).map_err(BarrierError::from)?;
    let t = Instant::now();
    let mut st = shared.lock().map_err(|_| OverlayError::Poisoned)?;
    let image = st.image()?;
    if image.is_temporary() {
        return Err(OverlayError::Discarding);
    }
    let plan = OverlayPlan::new(image, new_file)?;
    let barrier = barrier_locked(&mut st)?;
    let runs = shared_runs(&st)?;
    let remapped = switch(&mut st, &plan, &runs)?;
    st.counters.overlays += 1;
    Ok(OverlayInfo {
        file: plan.file,
        base: plan.base,
        base_path: plan.base_path,
        remapped_clusters: remapped,
        barrier,
        held: t.elapsed(),
    })
}

/// The top file of `image`.
pub(crate) fn top_file(image: &Image) -> io::Result<&File> {
    image
        .file()
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))
}

/// The shared clusters of the region, in runs contiguous in the top file.
pub(crate) fn shared_runs(st: &RegionState) -> Result<Vec<FileRun>, OverlayError> {
    let image = st.image()?;
    let cs = st.view.cs;
    let mut runs = Vec::new();
    for (a, b) in st.view.clusters.runs(ClusterState::Shared) {
        for vcn in a..b {
            let offset = image.active_offset(vcn).ok_or(OverlayError::Layout {
                vcn,
                what: "mapped shared but the active layer has no cluster there".into(),
            })?;
            push_run(
                &mut runs,
                FileRun {
                    vcn,
                    end: vcn + 1,
                    offset,
                    cs,
                },
            );
        }
    }
    Ok(runs)
}

/// Steps 2 to 6 of an overlay (writers held, barrier done); on failure
/// after the close, [`recover`] puts the old image back.
fn switch(st: &mut RegionState, plan: &OverlayPlan, runs: &[FileRun]) -> Result<u64, OverlayError> {
    let old_path = plan.base_path.clone();
    let img_err = |path: &Path, what| {
        let path = path.to_owned();
        move |source| OverlayError::Image {
            path,
            what,
            source: Box::new(source),
        }
    };
    let cs = st.view.cs;
    let image = st.image()?;
    let virtual_size = image.virtual_size();
    // Failures up to the close leave everything as it was.
    let lock_handle = top_file(image)
        .and_then(|f| f.try_clone())
        .map_err(|source| OverlayError::Path {
            path: old_path.clone(),
            what: "a handle for the writer's lock",
            source,
        })?;
    let mut old = match std::mem::replace(&mut st.image, Writable::Switching) {
        Writable::Open(i) => i,
        other => {
            st.image = other;
            return Err(st.image().err().unwrap_or(NoImage::Switching).into());
        }
    };
    st.pool.stop(&mut old);

    // From here on, a failure reopens the old image.
    let mut created = false;
    let mut new: Option<LiveImage> = None;
    let mut remapped: Vec<FileRun> = Vec::new();
    let result = (|| {
        old.close()
            .map_err(img_err(&old_path, "closing the image"))?;
        // The region's mappings keep the old open file description alive,
        // and a flock lives as long as its description: release it, or the
        // overlay could not open its base.
        lock_handle.unlock().map_err(|source| OverlayError::Path {
            path: old_path.clone(),
            what: "releasing the writer's lock",
            source,
        })?;
        // The file did not exist: whatever is there from now on is ours.
        created = true;
        let img = Image::create(
            &plan.file,
            &CreateOptions {
                cluster_size: Some(cs),
                virtual_size: Some(virtual_size),
                base: Some(BaseRef {
                    name: plan.base.clone(),
                    format: BaseFormat::Pcow,
                }),
            },
        )
        .and_then(LiveImage::new)
        .map_err(img_err(&plan.file, "creating the overlay"))?;
        let img = new.insert(img);
        st.pool.configure(img);
        let base_fd = img
            .chain_files()
            .get(1)
            .map(|f| f.as_raw_fd())
            .ok_or_else(|| OverlayError::Layout {
                vcn: 0,
                what: "the overlay's chain has no base file".into(),
            })?;
        remap_private(st, img, runs, base_fd, &mut remapped)?;
        Ok(())
    })();
    match result {
        Ok(()) => {
            drop(lock_handle);
            let img = new.take().ok_or_else(|| OverlayError::Layout {
                vcn: 0,
                what: "no overlay image".into(),
            })?;
            if let Err(e) = st.pool.start(&img) {
                log::warn!(
                    "no pre-allocation worker after the overlay ({e}), the pool refills inline"
                );
            }
            st.pool.request(&img);
            st.image = Writable::Open(Box::new(img));
            Ok(remapped.iter().map(|r| r.end - r.vcn).sum())
        }
        Err(cause) => Err(recover(
            st,
            plan,
            cause,
            &lock_handle,
            new,
            created,
            &remapped,
        )),
    }
}

/// Undoes a failed overlay after the old image was closed: closes and
/// removes the new file, reopens the old image read-write, maps the ranges
/// already remapped shared again, restarts the worker. Returns the error
/// to report.
fn recover(
    st: &mut RegionState,
    plan: &OverlayPlan,
    cause: OverlayError,
    lock_handle: &File,
    new: Option<LiveImage>,
    created: bool,
    remapped: &[FileRun],
) -> OverlayError {
    log::error!(
        "overlay onto {}: {}; reopening the old image",
        plan.file.display(),
        error_report::chain(&cause)
    );
    // Our own locks would stop the reopen (the old description's, if the
    // failure came before its release).
    release_switch(lock_handle, &plan.base_path, new, &plan.file);
    if created {
        match std::fs::remove_file(&plan.file) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                log::warn!("{}: removing the overlay: {e}", plan.file.display())
            }
            _ => {}
        }
    }
    let img = match Image::open(&plan.base_path, OpenOptions::read_write()).and_then(LiveImage::new)
    {
        Ok(img) => img,
        Err(source) => {
            let why = Failure::new(ReopenError {
                path: plan.base_path.clone(),
                cause: Failure::new(cause),
                source,
            });
            log::error!("{}", error_report::chain(&why));
            st.image = Writable::Detached(why.clone());
            return OverlayError::Reopen(why);
        }
    };
    resume_on(st, img, remapped, "overlay");
    cause
}

/// Hands the old top's shared `runs` over to the overlay `img`: once the
/// overlay shows each run's first cluster where the old top had it (the
/// rest of a run follows from the same file layout), each run is mapped
/// `MAP_PRIVATE` from `base_fd` (the overlay's depth-1 file: the same
/// bytes, now read-only history) and tracked for the barriers. What was
/// remapped is pushed to `remapped`, for a failure to map back.
pub(crate) fn remap_private(
    st: &mut RegionState,
    img: &LiveImage,
    runs: &[FileRun],
    base_fd: std::os::fd::RawFd,
    remapped: &mut Vec<FileRun>,
) -> Result<(), OverlayError> {
    for r in runs {
        let want = ClusterSource::ReadOnly {
            depth: 1,
            offset: r.offset,
        };
        let got = img.cluster_source(r.vcn);
        if got != want {
            return Err(OverlayError::Layout {
                vcn: r.vcn,
                what: format!("the overlay shows {got:?}, expected {want:?}"),
            });
        }
    }
    for r in runs {
        st.view
            .map_clusters(r.vcn, r.end, base_fd, r.offset, false)
            .map_err(|source| OverlayError::Remap {
                vcn: r.vcn,
                end: r.end,
                source,
            })?;
        remapped.push(*r);
        st.tracking.track(&st.view, r.vcn, r.end);
    }
    Ok(())
}

/// After a failed switch (a live overlay, a freeze): releases the
/// device's own locks that would stop the old image's reopen (the old
/// description's `lock_handle`, and the new overlay's shared lock on its
/// base, whose description the remapped ranges keep alive) and closes the
/// new overlay, if it was opened.
pub(crate) fn release_switch(
    lock_handle: &std::fs::File,
    old: &Path,
    new: Option<LiveImage>,
    new_file: &Path,
) {
    if let Err(e) = lock_handle.unlock() {
        log::warn!("{}: releasing the lock: {e}", old.display());
    }
    if let Some(img) = new {
        if let Some(f) = img.chain_files().get(1) {
            if let Err(e) = f.unlock() {
                log::warn!("{}: releasing the base's lock: {e}", old.display());
            }
        }
        if let Err(e) = img.close() {
            log::warn!("{}: closing the overlay: {e}", new_file.display());
        }
    }
}

/// The device goes on with `img`, its old image reopened after a failed
/// `what` (overlay, freeze): same file, same offsets, so what was
/// remapped is mapped shared again (a range that fails stays private over
/// the same bytes, and the barrier copies its written pages back into the
/// same cluster); the pre-allocation worker restarts.
pub(crate) fn resume_on(
    st: &mut RegionState,
    mut img: LiveImage,
    remapped: &[FileRun],
    what: &str,
) {
    st.pool.configure(&mut img);
    match top_file(&img).map(|f| f.as_raw_fd()) {
        Ok(fd) => {
            for r in remapped {
                if let Err(e) = st.view.map_clusters(r.vcn, r.end, fd, r.offset, true) {
                    log::warn!(
                        "clusters {}..{}: left private after the failed {what}: {e}",
                        r.vcn,
                        r.end
                    );
                }
            }
        }
        Err(e) => log::warn!("no top file after reopening: {e}"),
    }
    if let Err(e) = st.pool.start(&img) {
        log::warn!("no pre-allocation worker ({e}), the pool refills inline");
    }
    st.pool.request(&img);
    st.image = Writable::Open(Box::new(img));
}
