//! Holding the guest's writers for a barrier: the [`Quiesce`] a VMM
//! implements (pausing its vCPUs), and [`WriteGate`], which stands in for
//! it in tests and tools.

use std::sync::{Condvar, Mutex};

/// Holds the guest's writers for a barrier. A VMM pauses its vCPUs; tests
/// use [`WriteGate`].
///
/// The monitor serves faults on a thread of its own and a barrier takes
/// the region state lock only once writers are held, so a writer blocked
/// in a fault is released while `hold` waits for it.
pub trait Quiesce: Send + Sync {
    /// Returns once no writer runs and none will start until `release`;
    /// or fails (a writer did not stop in time) with nothing held.
    fn hold(&self) -> Result<(), QuiesceError>;
    /// Lets writers run again (after a `hold` that succeeded).
    fn release(&self);
}

/// Why the guest's writers could not be held (e.g. a vCPU that did not
/// leave `KVM_RUN` within the VMM's deadline); nothing is held.
#[derive(Debug, thiserror::Error)]
#[error("holding the guest's writers")]
pub struct QuiesceError(#[source] pub Box<dyn std::error::Error + Send + Sync>);

/// Releases the hold when dropped (also on an early error return).
struct Held<'a>(&'a dyn Quiesce);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Holds writers for the lifetime of the returned guard.
pub(crate) fn hold(q: &dyn Quiesce) -> Result<impl Drop + '_, QuiesceError> {
    q.hold()?;
    Ok(Held(q))
}

/// A writer-preferring gate: writers [`enter`](WriteGate::enter) around each
/// write; [`Quiesce::hold`] waits for writers inside to leave and keeps new
/// ones out. Stands in for pausing vCPUs in tests and tools.
#[derive(Debug, Default)]
pub struct WriteGate {
    state: Mutex<GateState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    writers: usize,
    held: bool,
    waiting: usize,
}

/// A writer inside a [`WriteGate`]; leaves on drop.
#[derive(Debug)]
pub struct GateEntry<'a>(&'a WriteGate);

impl WriteGate {
    /// A gate with nobody inside.
    pub fn new() -> WriteGate {
        WriteGate::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // The state is two counters and a flag, valid after any panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enters as a writer (waits while a barrier holds or waits to hold).
    pub fn enter(&self) -> GateEntry<'_> {
        let mut s = self.lock();
        while s.held || s.waiting > 0 {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.writers += 1;
        GateEntry(self)
    }
}

impl Drop for GateEntry<'_> {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.writers -= 1;
        drop(s);
        self.0.cv.notify_all();
    }
}

impl Quiesce for WriteGate {
    fn hold(&self) -> Result<(), QuiesceError> {
        let mut s = self.lock();
        s.waiting += 1;
        while s.held || s.writers > 0 {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.waiting -= 1;
        s.held = true;
        Ok(())
    }

    fn release(&self) {
        let mut s = self.lock();
        s.held = false;
        drop(s);
        self.cv.notify_all();
    }
}
