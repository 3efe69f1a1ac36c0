//! A hook the device's user gives ([`crate::RegionOptions::thread_hook`])
//! to confine the threads this crate spawns (a seccomp filter, an
//! affinity, ...) without this crate knowing how: it runs first thing on
//! each new thread, before the thread does any of its work, and the spawn
//! waits for its answer. A hook that fails ends the thread before its work
//! and the spawn fails with the hook's error, so a thread never runs
//! unconfined when its user asked otherwise.

use std::io;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

/// The kinds of threads this crate spawns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceThread {
    /// The userfaultfd monitor of a region ([`crate::MonitorThread`]).
    Fault,
    /// The pool's pre-allocation worker (`pcow-pool`).
    Pool,
}

impl std::fmt::Display for DeviceThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceThread::Fault => "fault monitor",
            DeviceThread::Pool => "pool worker",
        })
    }
}

/// What a hook's failure carries.
pub type HookError = Box<dyn std::error::Error + Send + Sync>;

/// The function a new thread runs first (see the module's docs).
#[derive(Clone)]
pub struct ThreadHook(Arc<dyn Fn(DeviceThread) -> Result<(), HookError> + Send + Sync>);

impl ThreadHook {
    /// A hook running `f` on each new thread with the thread's kind.
    pub fn new(f: impl Fn(DeviceThread) -> Result<(), HookError> + Send + Sync + 'static) -> Self {
        ThreadHook(Arc::new(f))
    }

    /// Runs the hook on the calling thread (what a new thread of `thread`'s
    /// kind does first).
    pub fn run(&self, thread: DeviceThread) -> Result<(), HookError> {
        (self.0)(thread)
    }
}

impl std::fmt::Debug for ThreadHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ThreadHook")
    }
}

/// A hook refused to confine a new thread; the thread ended unstarted.
#[derive(Debug, thiserror::Error)]
#[error("confining the new {thread} thread")]
pub struct ConfineError {
    /// Which thread.
    pub thread: DeviceThread,
    /// The hook's error.
    #[source]
    pub source: HookError,
}

/// Spawns a thread named `name` that runs `hook` (if any) and then `body`;
/// returns once the hook answered. A failed hook is the spawn's error
/// (`io::ErrorKind::Other` wrapping a [`ConfineError`]) and `body` never
/// runs.
pub(crate) fn spawn(
    name: String,
    kind: DeviceThread,
    hook: Option<ThreadHook>,
    body: impl FnOnce() + Send + 'static,
) -> io::Result<JoinHandle<()>> {
    let (tx, rx) = mpsc::sync_channel::<Result<(), HookError>>(1);
    let handle = std::thread::Builder::new().name(name).spawn(move || {
        let confined = match &hook {
            Some(h) => h.run(kind),
            None => Ok(()),
        };
        let go = confined.is_ok();
        // The spawner waits for this answer; it only goes if the spawner
        // is gone, and then nobody is left to serve either.
        if tx.send(confined).is_err() || !go {
            return;
        }
        body();
    })?;
    let answer = rx
        .recv()
        .unwrap_or_else(|_| Err("the new thread ended before its hook answered".into()));
    match answer {
        Ok(()) => Ok(handle),
        Err(source) => {
            // The thread returns right after its answer.
            let _ = handle.join();
            Err(io::Error::other(ConfineError {
                thread: kind,
                source,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn the_hook_runs_first_on_the_new_thread_and_its_failure_is_the_spawns() {
        let main = std::thread::current().id();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = seen.clone();
        let hook = ThreadHook::new(move |kind| {
            assert_ne!(std::thread::current().id(), main);
            s.lock()
                .unwrap()
                .push((kind, std::thread::current().name().map(str::to_owned)));
            match kind {
                DeviceThread::Fault => Ok(()),
                DeviceThread::Pool => Err("no filter for you".into()),
            }
        });
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        let h = spawn(
            "t-fault".into(),
            DeviceThread::Fault,
            Some(hook.clone()),
            move || {
                r.fetch_add(1, Ordering::SeqCst);
            },
        )
        .unwrap();
        h.join().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1);

        let r = ran.clone();
        let e = spawn("t-pool".into(), DeviceThread::Pool, Some(hook), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap_err();
        // The body never ran, and the error names the thread and the cause.
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        let inner = e.get_ref().unwrap().downcast_ref::<ConfineError>().unwrap();
        assert_eq!(inner.thread, DeviceThread::Pool);
        assert_eq!(
            error_chain(&e),
            "confining the new pool worker thread: no filter for you"
        );
        assert_eq!(
            *seen.lock().unwrap(),
            [
                (DeviceThread::Fault, Some("t-fault".to_owned())),
                (DeviceThread::Pool, Some("t-pool".to_owned()))
            ]
        );
    }

    #[test]
    fn without_a_hook_the_body_runs() {
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        spawn("t".into(), DeviceThread::Pool, None, move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap()
        .join()
        .unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }

    fn error_chain(e: &io::Error) -> String {
        let mut out = e.to_string();
        let mut cur: Option<&(dyn std::error::Error + 'static)> =
            e.get_ref().and_then(|i| i.source());
        while let Some(c) = cur {
            out.push_str(": ");
            out.push_str(&c.to_string());
            cur = c.source();
        }
        out
    }
}
