//! The threads that were running before the VMM confined itself: the API
//! server's acceptor and connection threads and the `--event-monitor`
//! writer. They are spawned at start, before any VM's config is known, and
//! a Landlock domain covers only the thread that asks for it and the
//! threads it spawns later (this kernel has Landlock ABI 7; restricting
//! every thread of a process at once, `LANDLOCK_RESTRICT_SELF_TSYNC`,
//! needs ABI 8). So each of them restricts *itself*: the VMM publishes
//! that it is confined ([`LateConfinement::publish`]), and each such
//! thread looks before its next piece of work ([`LateConfinement::follow`]):
//! the acceptor before it spawns a connection thread (which then inherits
//! the domain), a connection thread before it reads its next request, the
//! event monitor before each write.
//!
//! What they get is no filesystem access at all: they read and write
//! descriptors that are already open (the listening socket, the
//! connections, the monitor's file) and open nothing. The type checks of
//! the paths a request names (a FIFO given as a pmem file is refused
//! without blocking) run on the VMM thread, within the VM's rules.

use std::sync::atomic::{AtomicBool, Ordering};

use landlock::{Access, AccessFs, Ruleset, RulesetAttr, RulesetStatus};

use super::{LandlockError, LANDLOCK_ABI};

/// Whether the VMM confined itself, for the threads that must follow.
#[derive(Debug, Default)]
pub struct LateConfinement {
    published: AtomicBool,
}

/// The process's own: the VMM publishes into it, the API server and the
/// event monitor follow it.
static PROCESS: LateConfinement = LateConfinement::new();

/// The confinement state of this process.
pub fn process() -> &'static LateConfinement {
    &PROCESS
}

impl LateConfinement {
    /// Not published yet.
    pub const fn new() -> LateConfinement {
        LateConfinement {
            published: AtomicBool::new(false),
        }
    }

    /// Says that the VMM is confined: from now on the following threads
    /// restrict themselves before their next piece of work.
    pub fn publish(&self) {
        self.published.store(true, Ordering::Release);
    }

    /// Whether [`LateConfinement::publish`] was called.
    pub fn is_published(&self) -> bool {
        self.published.load(Ordering::Acquire)
    }

    /// Called by a thread before each piece of work, with its own flag
    /// (`confined`, false at first): once the VMM is confined, restricts
    /// the calling thread to no filesystem access at all, once. Returns
    /// whether this call confined it. An error means the thread could not
    /// follow: it must stop working rather than go on unconfined.
    pub fn follow(&self, confined: &mut bool) -> Result<bool, LandlockError> {
        if *confined || !self.is_published() {
            return Ok(false);
        }
        restrict_thread_to_nothing()?;
        *confined = true;
        Ok(true)
    }
}

/// Restricts the calling thread (and the threads it spawns from now on)
/// to no filesystem access: every right Landlock handles, no rule.
pub fn restrict_thread_to_nothing() -> Result<(), LandlockError> {
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(LANDLOCK_ABI))
        .map_err(LandlockError::Ruleset)?
        .create()
        .map_err(LandlockError::Ruleset)?
        .restrict_self()
        .map_err(LandlockError::Restrict)?;
    if status.ruleset == RulesetStatus::NotEnforced {
        return Err(LandlockError::NotEnforced);
    }
    Ok(())
}
