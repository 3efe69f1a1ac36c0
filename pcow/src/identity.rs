//! What identifies a file's state: which file it is (device and inode)
//! and whether it changed since (size and modification time). A VM
//! snapshot records it for each image it refers to, so that a restore
//! can tell the image it finds from the one the snapshot captured.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A file's device, inode, size and modification time, from `fstat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    /// The device of the file system holding the file.
    pub dev: u64,
    /// The inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
}

impl FileIdentity {
    fn from_metadata(md: &std::fs::Metadata) -> FileIdentity {
        FileIdentity {
            dev: md.dev(),
            ino: md.ino(),
            size: md.size(),
            mtime_ns: md
                .mtime()
                .saturating_mul(1_000_000_000)
                .saturating_add(md.mtime_nsec()),
        }
    }

    /// The identity of an open file.
    pub fn of(file: &File) -> std::io::Result<FileIdentity> {
        Ok(Self::from_metadata(&file.metadata()?))
    }

    /// The identity of the file at `path` (a link is followed).
    pub fn of_path(path: &Path) -> std::io::Result<FileIdentity> {
        Ok(Self::from_metadata(&std::fs::metadata(path)?))
    }

    /// Whether both name the same file (device and inode), whatever its
    /// content.
    pub fn same_file(&self, other: &FileIdentity) -> bool {
        (self.dev, self.ino) == (other.dev, other.ino)
    }
}

impl std::fmt::Display for FileIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dev {} inode {} size {} mtime {} ns",
            self.dev, self.ino, self.size, self.mtime_ns
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_changes_the_identity_and_a_rename_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::fs::write(&a, b"one").unwrap();
        let before = FileIdentity::of_path(&a).unwrap();
        let f = File::open(&a).unwrap();
        assert_eq!(FileIdentity::of(&f).unwrap(), before);
        let b = dir.path().join("b");
        std::fs::rename(&a, &b).unwrap();
        assert_eq!(FileIdentity::of_path(&b).unwrap(), before);
        std::fs::write(&b, b"three").unwrap();
        let after = FileIdentity::of_path(&b).unwrap();
        assert!(after.same_file(&before));
        assert_ne!(after, before, "size differs");
    }
}
