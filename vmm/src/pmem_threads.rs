//! The threads of a pmem device, and what they tell the VMM thread.
//!
//! Each pmem device of a running machine has:
//!
//! - `pmemN-queue` ([`QueueThread`], pcow and raw devices): an epoll loop
//!   over the device's queue notification eventfds (the KVM ioeventfds)
//!   and a stop eventfd, registered once for the thread's life. It serves
//!   the queue: a FLUSH runs the device's barrier right there, which holds
//!   the vCPUs through the [`crate::vcpu::VcpuControl`] (kicked out of
//!   `KVM_RUN`) for the harvest, then syncs. A FLUSH of one device
//!   therefore never waits behind another device's, nor behind the VMM
//!   thread's work.
//! - `pmemN-fault` (pcow devices only): the device crate's
//!   [`MonitorThread`], which serves the image's userfaultfd and its pool
//!   eventfd. A vCPU blocked in a fault is released there whatever the
//!   VMM thread, the API or another device is doing, and while a barrier
//!   of its own device waits for the vCPUs to stop (a fault that needs
//!   the image may wait for that device's own region lock: the device
//!   crate's lock order).
//!
//! Both report to the VMM thread through one eventfd per machine
//! ([`DeviceAlerts`]): a monitor that failed (the VM fails), and a device
//! that waits for free space (a FLUSH stalled in its queue, or a write
//! fault that got no cluster: the VMM pauses the guest).
//!
//! Drop order: a [`PmemThreads`] stops its queue thread first (a FLUSH in
//! progress completes: its hold finds the vCPUs stopped), then the fault
//! thread. Stop the vCPUs before either, so that no vCPU is left blocked
//! in a fault nobody serves.

use crate::seccomp_filters::{self, ThreadKind};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use virtio_pmem_pcow::{Monitor, MonitorError, MonitorReport, MonitorThread};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::pci::VirtioPciDevice;

/// A pcow device's monitor failed: a vCPU may be stuck in a fault, so the
/// VM fails (the message names the device).
#[derive(Debug, thiserror::Error)]
#[error("pmem {id}: image monitor")]
pub struct MonitorFailed {
    /// The device id.
    pub id: String,
    /// What the monitor reported.
    #[source]
    pub source: MonitorError,
}

/// The device threads' reports to the VMM thread: an eventfd its control
/// loop polls, and the first failure not taken yet (the VM fails on it;
/// later ones are logged only, so a monitor failing at every fault cannot
/// grow memory or flood the log).
#[derive(Debug)]
pub struct DeviceAlerts {
    evt: EventFd,
    failure: Mutex<Option<MonitorFailed>>,
}

impl DeviceAlerts {
    /// No alert yet.
    pub fn new() -> io::Result<DeviceAlerts> {
        Ok(DeviceAlerts {
            evt: EventFd::new(EFD_NONBLOCK)?,
            failure: Mutex::new(None),
        })
    }

    /// The eventfd to poll for reading.
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.evt.as_raw_fd()
    }

    /// Wakes the VMM thread: a device may wait for space (it checks).
    pub fn space(&self) {
        self.wake();
    }

    /// Records a monitor failure (unless one waits already) and wakes the
    /// VMM thread.
    pub fn failed(&self, failure: MonitorFailed) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            log::error!("{}", error_report::chain(&failure));
            *f = Some(failure);
        } else {
            log::debug!("{}", error_report::chain(&failure));
        }
        drop(f);
        self.wake();
    }

    fn wake(&self) {
        if let Err(e) = self.evt.write(1) {
            log::error!("waking the VMM thread: {e}");
        }
    }

    /// Clears the eventfd (after it was readable) and takes the failure
    /// recorded, if any.
    pub fn take(&self) -> Option<MonitorFailed> {
        let _ = self.evt.read();
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

/// The data of the stop eventfd's registration (queues use their index).
const STOP: u64 = u64::MAX;

/// A pmem device's queue served on a thread of its own; stopped and
/// joined on drop.
pub struct QueueThread {
    stop: EventFd,
    handle: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for QueueThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueThread")
            .field("running", &self.handle.is_some())
            .finish()
    }
}

impl QueueThread {
    /// Starts a thread named `name` serving the queues of `virtio`, one
    /// per eventfd of `notify` (in queue order). After each notification
    /// it served, a device whose queue stalled (a FLUSH waits for space)
    /// wakes the VMM thread through `alerts`.
    pub fn spawn(
        name: &str,
        virtio: Arc<Mutex<VirtioPciDevice>>,
        notify: Vec<EventFd>,
        alerts: Arc<DeviceAlerts>,
    ) -> io::Result<QueueThread> {
        let stop = EventFd::new(EFD_NONBLOCK)?;
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, STOP),
        )?;
        for (q, fd) in notify.iter().enumerate() {
            epoll.ctl(
                ControlOperation::Add,
                fd.as_raw_fd(),
                EpollEvent::new(EventSet::IN, q as u64),
            )?;
        }
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || serve_queues(&epoll, &virtio, &notify, &alerts))?;
        Ok(QueueThread {
            stop,
            handle: Some(handle),
        })
    }
}

fn serve_queues(
    epoll: &Epoll,
    virtio: &Mutex<VirtioPciDevice>,
    notify: &[EventFd],
    alerts: &DeviceAlerts,
) {
    if let Err(e) = seccomp_filters::apply(ThreadKind::PmemQueue) {
        log::error!(
            "{}: {}; the queue is not served",
            name(),
            error_report::chain(&e)
        );
        return;
    }
    let mut events = vec![EpollEvent::default(); notify.len() + 1];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::error!("{}: epoll_wait: {e}; the queue is no longer served", name());
                return;
            }
        };
        for ev in &events[..n] {
            if ev.data() == STOP {
                return;
            }
            let Ok(queue) = u16::try_from(ev.data()) else {
                continue;
            };
            if let Some(fd) = notify.get(usize::from(queue)) {
                let _ = fd.read();
            }
            let mut v = virtio.lock().unwrap_or_else(|e| e.into_inner());
            v.notify_queue(queue);
            let stalled = v.stalled().is_some();
            drop(v);
            if stalled {
                alerts.space();
            }
        }
    }
}

/// This thread's name, for messages.
fn name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("pmem-queue")
        .to_owned()
}

impl Drop for QueueThread {
    fn drop(&mut self) {
        if let Err(e) = self.stop.write(1) {
            log::error!("queue thread: signalling the stop: {e}");
        }
        if let Some(h) = self.handle.take() {
            if h.join().is_err() {
                log::error!("queue thread panicked");
            }
        }
    }
}

/// The threads of one pmem device. Field order is drop order: the queue
/// thread stops before the fault thread.
#[derive(Debug)]
pub struct PmemThreads {
    _queue: QueueThread,
    _fault: Option<MonitorThread>,
}

impl PmemThreads {
    /// Starts `pmem{index}-fault` for `monitor` (pcow), then
    /// `pmem{index}-queue` for `virtio`'s queues. `id` names the device in
    /// failures.
    pub fn spawn(
        index: usize,
        id: &str,
        virtio: Arc<Mutex<VirtioPciDevice>>,
        notify: Vec<EventFd>,
        monitor: Option<Arc<Monitor>>,
        alerts: &Arc<DeviceAlerts>,
    ) -> io::Result<PmemThreads> {
        let fault = match monitor {
            Some(m) => {
                let a = alerts.clone();
                let id = id.to_owned();
                Some(MonitorThread::spawn(
                    &format!("pmem{index}-fault"),
                    m,
                    move |r| match r {
                        MonitorReport::Failed(source) => a.failed(MonitorFailed {
                            id: id.clone(),
                            source,
                        }),
                        MonitorReport::OutOfSpace => a.space(),
                    },
                )?)
            }
            None => None,
        };
        let queue = QueueThread::spawn(
            &format!("pmem{index}-queue"),
            virtio,
            notify,
            alerts.clone(),
        )?;
        Ok(PmemThreads {
            _queue: queue,
            _fault: fault,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: std::os::fd::RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `p` is a valid pollfd for the call.
        unsafe { libc::poll(&mut p, 1, 0) > 0 }
    }

    fn failure(id: &str) -> MonitorFailed {
        MonitorFailed {
            id: id.into(),
            source: MonitorError::Poisoned,
        }
    }

    #[test]
    fn alerts_wake_the_vmm_thread_and_keep_the_first_failure_only() {
        let a = DeviceAlerts::new().unwrap();
        assert!(!readable(a.fd()));
        a.space();
        assert!(readable(a.fd()));
        assert!(a.take().is_none(), "space is not a failure");
        assert!(!readable(a.fd()), "take clears the eventfd");
        a.failed(failure("pmem0"));
        a.failed(failure("pmem1"));
        assert!(readable(a.fd()));
        let f = a.take().expect("a failure");
        assert_eq!(f.id, "pmem0");
        assert!(
            error_report::chain(&f).starts_with("pmem pmem0: image monitor: "),
            "{}",
            error_report::chain(&f)
        );
        assert!(a.take().is_none(), "later failures are logged only");
    }
}
