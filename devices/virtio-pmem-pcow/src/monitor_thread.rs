//! The monitor's own thread: an epoll loop over the device's userfaultfd
//! and its pool eventfd, registered once for the device's life.
//!
//! A VMM spawns one per pcow device. Faults are then served whatever the
//! VMM thread or the device's queue is doing: a FLUSH barrier that waits
//! for its syncs, a barrier that pauses the vCPUs (a vCPU blocked in a
//! fault inside `KVM_RUN` is released here, not by the pause), or another
//! device's work. What the VMM must react to (the monitor failed, a write
//! fault found the file system full) is handed to a callback, which
//! typically writes an eventfd the VMM thread polls.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::fault::{Monitor, MonitorError};
use crate::thread_hook::{self, DeviceThread};
use crate::uffd::UffdError;

/// What the thread tells its VMM.
#[derive(Debug)]
pub enum MonitorReport {
    /// Handling a fault failed: the guest may be stuck on it.
    Failed(MonitorError),
    /// A write fault found the file system full since the last barrier
    /// that succeeded ([`crate::PcowRegion::out_of_space`] says why).
    OutOfSpace,
}

/// The data of the stop eventfd's registration (the monitor's fds use
/// their own numbers).
const STOP: u64 = u64::MAX;

/// A monitor served by a thread of its own; stopped and joined on drop.
pub struct MonitorThread {
    monitor: Arc<Monitor>,
    stop: EventFd,
    handle: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MonitorThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MonitorThread")
            .field("monitor", &self.monitor)
            .field("running", &self.handle.is_some())
            .finish()
    }
}

impl MonitorThread {
    /// Starts a thread named `name` serving `monitor` until the value is
    /// dropped. `report` runs on that thread. The thread first runs the
    /// region's [`crate::RegionOptions::thread_hook`]; its failure is this
    /// call's (a [`crate::ConfineError`] inside the `io::Error`) and
    /// nothing is served.
    pub fn spawn(
        name: &str,
        monitor: Arc<Monitor>,
        report: impl Fn(MonitorReport) + Send + 'static,
    ) -> io::Result<MonitorThread> {
        let stop = EventFd::new(EFD_NONBLOCK)?;
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, STOP),
        )?;
        for fd in monitor.fds() {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, fd as u64),
            )?;
        }
        let m = monitor.clone();
        let handle = thread_hook::spawn(
            name.to_owned(),
            DeviceThread::Fault,
            monitor.thread_hook(),
            move || serve(&epoll, &m, &report),
        )?;
        Ok(MonitorThread {
            monitor,
            stop,
            handle: Some(handle),
        })
    }

    /// The monitor served.
    pub fn monitor(&self) -> &Arc<Monitor> {
        &self.monitor
    }
}

fn serve(epoll: &Epoll, m: &Monitor, report: &dyn Fn(MonitorReport)) {
    let mut events = vec![EpollEvent::default(); 4];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::error!("monitor thread: epoll_wait: {e}");
                report(MonitorReport::Failed(MonitorError::Uffd(UffdError::Read(
                    e,
                ))));
                return;
            }
        };
        for ev in &events[..n] {
            if ev.data() == STOP {
                return;
            }
            if let Err(e) = m.handle_fd(ev.data() as i32) {
                report(MonitorReport::Failed(e));
            }
        }
        if m.take_space_alert() {
            report(MonitorReport::OutOfSpace);
        }
    }
}

impl Drop for MonitorThread {
    fn drop(&mut self) {
        if let Err(e) = self.stop.write(1) {
            log::error!("monitor thread: signalling the stop: {e}");
        }
        if let Some(h) = self.handle.take() {
            if h.join().is_err() {
                log::error!("monitor thread panicked");
            }
        }
    }
}
