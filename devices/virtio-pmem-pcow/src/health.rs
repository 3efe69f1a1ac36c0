//! Typed health: the failures a running device keeps for its VMM (a write
//! fault that found the file system full, the pool's last failure, the
//! loss of the writable image) as the errors themselves, shared between
//! the device and every [`crate::Status`] that reports them.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// A failure kept for the status: the error, shared by every copy. Two
/// copies are equal when they are the same failure (not two failures
/// with the same message).
#[derive(Clone)]
pub struct Failure(Arc<dyn Error + Send + Sync>);

impl Failure {
    /// Keeps `e`.
    pub fn new(e: impl Error + Send + Sync + 'static) -> Failure {
        Failure(Arc::new(e))
    }

    /// The error kept.
    pub fn error(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.0
    }

    /// Whether the failure is the file system being full
    /// ([`is_out_of_space`]).
    pub fn is_out_of_space(&self) -> bool {
        is_out_of_space(self.error())
    }
}

impl fmt::Debug for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// The error's own message; its causes follow as [`Error::source`].
impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl Error for Failure {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for Failure {
    fn eq(&self, other: &Failure) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Failure {}

/// Whether an error (or one of its sources) is the file system being out
/// of space (ENOSPC) or quota (EDQUOT): the condition a VMM answers by
/// pausing the guest until space is freed, like QEMU's `werror=enospc`.
pub fn is_out_of_space(e: &(dyn Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
                return true;
            }
        }
        if let Some(f) = err.downcast_ref::<Failure>() {
            // A kept failure hides its error's own type from a downcast.
            if is_out_of_space(f.error()) {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_failure_keeps_its_error_and_equals_only_itself() {
        let f = Failure::new(Outer(std::io::Error::from_raw_os_error(libc::ENOSPC)));
        assert!(f.is_out_of_space());
        assert!(is_out_of_space(&f));
        assert_eq!(f.to_string(), "outer");
        assert!(f.source().is_some());
        assert_eq!(f.clone(), f);
        let g = Failure::new(Outer(std::io::Error::from_raw_os_error(libc::ENOSPC)));
        assert_ne!(f, g);
        let h = Failure::new(Outer(std::io::Error::from_raw_os_error(libc::EIO)));
        assert!(!h.is_out_of_space());
    }
}
