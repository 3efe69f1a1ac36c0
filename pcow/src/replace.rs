//! Replacing an image under its name without a moment when the name is
//! missing: the new file is made under a temporary name in the same
//! directory, synced, renamed over the old name, and the directory is
//! synced. A crash leaves either name's old or new file, plus at most the
//! temporary file, which is recognisable by its name
//! (`.NAME.<purpose>-<pid>.tmp`, beside `NAME`) and removed by the next
//! replacement of `NAME` ([`remove_stale_temps`]) once no process holds its
//! lock. Used by a device's freeze (VM snapshots), by
//! [`crate::reset_to_frozen`] and by [`crate::ops::compact`].

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Why a temporary file is made (part of its name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TempPurpose {
    /// A device freezing its top image (`.NAME.freeze-PID.tmp`).
    Freeze,
    /// [`crate::reset_to_frozen`] (`.NAME.reset-PID.tmp`).
    Reset,
    /// `pcow-img compact` (`.NAME.compact-PID.tmp`).
    Compact,
}

impl TempPurpose {
    const ALL: [TempPurpose; 3] = [
        TempPurpose::Freeze,
        TempPurpose::Reset,
        TempPurpose::Compact,
    ];

    fn word(self) -> &'static str {
        match self {
            TempPurpose::Freeze => "freeze",
            TempPurpose::Reset => "reset",
            TempPurpose::Compact => "compact",
        }
    }
}

fn dir_of(image: &Path) -> &Path {
    match image.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The temporary name this process uses to replace `image` (in its
/// directory). `None` when `image` names no file.
pub fn temp_name(image: &Path, purpose: TempPurpose) -> Option<PathBuf> {
    let name = image.file_name()?;
    let mut t = OsString::from(".");
    t.push(name);
    t.push(format!(".{}-{}.tmp", purpose.word(), std::process::id()));
    Some(dir_of(image).join(t))
}

/// Whether `entry` is a temporary name of `name` (any purpose, any pid).
fn is_temp_of(entry: &[u8], name: &[u8]) -> bool {
    let Some(rest) = entry
        .strip_prefix(b".")
        .and_then(|r| r.strip_prefix(name))
        .and_then(|r| r.strip_prefix(b"."))
        .and_then(|r| r.strip_suffix(b".tmp"))
    else {
        return false;
    };
    TempPurpose::ALL.iter().any(|p| {
        rest.strip_prefix(p.word().as_bytes())
            .and_then(|r| r.strip_prefix(b"-"))
            .is_some_and(|pid| !pid.is_empty() && pid.iter().all(u8::is_ascii_digit))
    })
}

/// Whether `path` is named like a temporary file of `image` (in its
/// directory, any purpose, any pid): a name [`remove_stale_temps`] may
/// remove, which nothing else should use.
pub fn is_temp_name(image: &Path, path: &Path) -> bool {
    match (image.file_name(), path.file_name()) {
        (Some(i), Some(p)) => {
            dir_of(image) == dir_of(path) && is_temp_of(p.as_bytes(), i.as_bytes())
        }
        _ => false,
    }
}

/// Removes the temporary files a crash left beside `image` (one readdir
/// of its directory): regular files named as [`temp_name`] makes them, for
/// any purpose and process, whose lock no process holds (a replacement in
/// progress holds its file's lock). Returns the files removed.
pub fn remove_stale_temps(image: &Path) -> io::Result<Vec<PathBuf>> {
    let Some(name) = image.file_name() else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(dir_of(image))? {
        let entry = entry?;
        if !is_temp_of(entry.file_name().as_bytes(), name.as_bytes()) {
            continue;
        }
        let path = entry.path();
        if !entry.file_type()?.is_file() {
            log::warn!(
                "{}: named like a temporary image but not a regular file, left alone",
                path.display()
            );
            continue;
        }
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => continue,
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
        // Unlinked while we hold its lock: no process was using it.
        match std::fs::remove_file(&path) {
            Ok(()) => {
                log::warn!("{}: removed a stale temporary image", path.display());
                removed.push(path);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// Syncs the directory holding `image`, making a rename or link in it
/// durable.
pub fn sync_dir(image: &Path) -> io::Result<()> {
    File::open(dir_of(image))?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporary_names_are_recognised_exactly() {
        let t = temp_name(Path::new("/d/disk.pcow"), TempPurpose::Freeze).unwrap();
        assert_eq!(t.parent(), Some(Path::new("/d")));
        let n = t.file_name().unwrap().as_bytes();
        assert!(is_temp_of(n, b"disk.pcow"));
        assert!(!is_temp_of(n, b"disk"));
        assert!(is_temp_of(b".disk.pcow.reset-1.tmp", b"disk.pcow"));
        for other in [
            &b"disk.pcow"[..],
            b".disk.pcow.freeze-.tmp",
            b".disk.pcow.freeze-12x.tmp",
            b".disk.pcow.other-12.tmp",
            b".disk.pcow.freeze-12.tmp~",
            b".disk.pcow.snap.freeze-12.tmp",
        ] {
            assert!(!is_temp_of(other, b"disk.pcow"), "{other:?}");
        }
        assert_eq!(temp_name(Path::new("/"), TempPurpose::Reset), None);
        assert!(is_temp_name(Path::new("/d/disk.pcow"), &t));
        assert!(!is_temp_name(Path::new("/e/disk.pcow"), &t));
        assert!(!is_temp_name(
            Path::new("/d/disk.pcow"),
            Path::new("/d/disk.pcow.snap-1")
        ));
    }

    #[test]
    fn only_unlocked_temporaries_of_the_image_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.pcow");
        std::fs::write(&image, b"image").unwrap();
        let stale = dir.path().join(".disk.pcow.freeze-1.tmp");
        let held = dir.path().join(".disk.pcow.reset-2.tmp");
        let other = dir.path().join(".other.pcow.freeze-1.tmp");
        let a_dir = dir.path().join(".disk.pcow.freeze-3.tmp");
        for p in [&stale, &held, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        std::fs::create_dir(&a_dir).unwrap();
        let lock = File::open(&held).unwrap();
        lock.lock().unwrap();
        assert_eq!(remove_stale_temps(&image).unwrap(), vec![stale.clone()]);
        assert!(!stale.exists());
        assert!(held.exists() && other.exists() && a_dir.exists() && image.exists());
        drop(lock);
        assert_eq!(remove_stale_temps(&image).unwrap(), vec![held.clone()]);
        sync_dir(&image).unwrap();
    }
}
