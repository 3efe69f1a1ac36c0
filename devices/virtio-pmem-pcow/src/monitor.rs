//! The userfaultfd monitor: an fd-driven state machine for the VMM's epoll
//! loop. [`Monitor::fd`] is registered for reading; [`Monitor::handle_ready`]
//! drains the pending faults and resolves each:
//!
//! - a write fault in a hole cluster gets the active layer's cluster
//!   (allocated from the image's pool), mapped `MAP_FIXED|MAP_SHARED` over
//!   the cluster, then `UFFDIO_WAKE`: the waiter retries on the file page.
//!   Nothing is lost by the remap: a hole cluster has no present page (any
//!   access to it faults and waits for us), so the mapping replaced is empty.
//! - a read fault in a hole gets `UFFDIO_ZEROPAGE` over the whole cluster:
//!   nothing is allocated. Later writes there land in private anonymous
//!   pages without a fault; the barrier moves them into the image (and,
//!   past the zero budget, returns the clusters nobody wrote to holes).
//! - a fault in a cluster already resolved (several threads faulted it, or
//!   a queued event raced a resolution) only wakes: one allocation per
//!   cluster however many threads fault it.
//!
//! userfaultfd is driven with raw ioctls ([`crate::uffd`]).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::fault_poll::FaultPoll;
use crate::pagemap::WriteTracker;
use crate::pcow_device::DeviceState;
use crate::pool::EventFd;
use crate::region::{ClusterState, RegionState};
use crate::uffd::{
    self, UffdioCopy, UffdioRange, UffdioZeropage, COPY_MODE_DONTWAKE, EVENT_PAGEFAULT,
    FEATURE_WP_ASYNC, FEATURE_WP_UNPOPULATED, MODE_MISSING, MODE_WP, MSG_SIZE,
    PAGEFAULT_FLAG_WRITE, UFFDIO_COPY, UFFDIO_WAKE, UFFDIO_ZEROPAGE,
};
use pcow::check::error_chain;

/// Errors of the userfaultfd and of fault resolution.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error(
        "creating a userfaultfd (as non-root, set vm.unprivileged_userfaultfd=1 \
         or grant access to /dev/userfaultfd)"
    )]
    Create(#[source] std::io::Error),
    #[error("UFFDIO_API handshake")]
    Api(#[source] std::io::Error),
    #[error("{op} on {start:#x}+{len:#x}")]
    Ioctl {
        op: &'static str,
        start: u64,
        len: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("reading userfaultfd events")]
    Read(#[source] std::io::Error),
    #[error("fault at {addr:#x} outside the region")]
    OutsideRegion { addr: u64 },
    #[error("region state lock poisoned by a panic")]
    Poisoned,
    #[error("fault at {addr:#x} left unresolved")]
    Unresolved {
        addr: u64,
        #[source]
        source: Box<MonitorError>,
    },
}

/// An open userfaultfd (non-blocking, close-on-exec); closed on drop,
/// which also drops every registration made through it.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
    /// Opened with `UFFD_FEATURE_WP_ASYNC`: holes are registered in
    /// write-protect mode too, so the barrier tracks writes into the zero
    /// pages it maps like those of private clusters.
    wp_async: bool,
}

/// What `UFFDIO_ZEROPAGE` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ZeroOutcome {
    /// Every page of the range now maps the zero page.
    Mapped,
    /// Some page was already present (`EEXIST`): the range is resolved.
    Exists,
}

/// A page of zeros to copy from: `UFFDIO_COPY` fills an entry that
/// `UFFDIO_ZEROPAGE` refuses.
#[repr(C, align(4096))]
struct ZeroPage([u8; 4096]);

static ZERO_PAGE: ZeroPage = ZeroPage([0; 4096]);

impl Uffd {
    /// Opens a userfaultfd for missing-page faults (see [`uffd::open`]).
    pub fn new() -> Result<Uffd, MonitorError> {
        let fd = uffd::open(0).map_err(|e| match e {
            uffd::OpenError::Create(e) => MonitorError::Create(e),
            uffd::OpenError::Api(e) => MonitorError::Api(e),
        })?;
        Ok(Uffd {
            fd,
            wp_async: false,
        })
    }

    /// Opens the region's userfaultfd: missing-page faults, and with
    /// `track_zero` also WP-async write tracking of the zero pages it maps
    /// (when the kernel has it, Linux 6.7+; otherwise as [`Uffd::new`]).
    pub(crate) fn for_holes(track_zero: bool) -> Result<Uffd, MonitorError> {
        if track_zero {
            // The kernel adds WP_UNPOPULATED to WP_ASYNC in any case:
            // write-protecting an empty entry leaves a marker there.
            match uffd::open(FEATURE_WP_ASYNC | FEATURE_WP_UNPOPULATED) {
                Ok(fd) => return Ok(Uffd { fd, wp_async: true }),
                Err(e) => log::info!(
                    "zero-mapped holes not write-tracked (no UFFD_FEATURE_WP_ASYNC: {e:?}); \
                     barriers classify their pages"
                ),
            }
        }
        Uffd::new()
    }

    /// A handle write-protecting through this userfaultfd (for the
    /// barrier's scan of zero-mapped holes), when it was opened WP-async.
    pub(crate) fn write_tracker(&self) -> Option<WriteTracker> {
        if !self.wp_async {
            return None;
        }
        match self.fd.try_clone() {
            Ok(fd) => Some(WriteTracker::from_fd(fd)),
            Err(e) => {
                log::warn!("zero-mapped holes not write-tracked (dup of the userfaultfd: {e})");
                None
            }
        }
    }

    fn ioctl_err(op: &'static str, start: u64, len: u64) -> MonitorError {
        MonitorError::Ioctl {
            op,
            start,
            len,
            source: std::io::Error::last_os_error(),
        }
    }

    /// Registers `[start, start + len)` (anonymous memory) for missing-page
    /// faults, and for write protection when opened WP-async.
    pub(crate) fn register_missing(&self, start: u64, len: u64) -> Result<(), MonitorError> {
        let mode = if self.wp_async {
            MODE_MISSING | MODE_WP
        } else {
            MODE_MISSING
        };
        uffd::register(&self.fd, start, len, mode).map_err(|source| MonitorError::Ioctl {
            op: "UFFDIO_REGISTER",
            start,
            len,
            source,
        })
    }

    /// Wakes the threads waiting on faults in the range.
    pub(crate) fn wake(&self, start: u64, len: u64) -> Result<(), MonitorError> {
        let mut range = UffdioRange { start, len };
        // SAFETY: `range` is a valid `uffdio_range`; waking touches no memory.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE as _, &mut range) };
        if r < 0 {
            return Err(Self::ioctl_err("UFFDIO_WAKE", start, len));
        }
        Ok(())
    }

    /// Maps the zero page over every missing page of the range and wakes
    /// the waiters.
    pub(crate) fn zeropage(&self, start: u64, len: u64) -> Result<ZeroOutcome, MonitorError> {
        for _ in 0..16 {
            let mut z = UffdioZeropage {
                range: UffdioRange { start, len },
                ..UffdioZeropage::default()
            };
            // SAFETY: `z` is a valid `uffdio_zeropage`; the kernel only
            // fills missing pages of a registered range with the zero page
            // (it never replaces a present page).
            let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_ZEROPAGE as _, &mut z) };
            if r == 0 {
                return Ok(ZeroOutcome::Mapped);
            }
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EEXIST) => {
                    // Part of the range was present: the rest may still be
                    // missing with waiters; fill it page by page.
                    self.zeropage_each(start, len)?;
                    return Ok(ZeroOutcome::Exists);
                }
                Some(libc::EAGAIN) => continue,
                _ => return Err(Self::ioctl_err("UFFDIO_ZEROPAGE", start, len)),
            }
        }
        Err(Self::ioctl_err("UFFDIO_ZEROPAGE", start, len))
    }

    fn zeropage_each(&self, start: u64, len: u64) -> Result<(), MonitorError> {
        let page = crate::pagemap::PAGE_SIZE;
        let mut a = start;
        while a < start + len {
            let mut z = UffdioZeropage {
                range: UffdioRange {
                    start: a,
                    len: page,
                },
                ..UffdioZeropage::default()
            };
            // SAFETY: as in `zeropage`, for one page.
            let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_ZEROPAGE as _, &mut z) };
            if r < 0 {
                if std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
                    return Err(Self::ioctl_err("UFFDIO_ZEROPAGE", a, page));
                }
                // Present, or an empty entry carrying a uffd-wp marker
                // (left by write-protecting it), which UFFDIO_ZEROPAGE
                // refuses but the waiter still faults on: fill that one
                // by copying zeros, which the kernel allows.
                self.copy_zeros(a)?;
            }
            a += page;
        }
        self.wake(start, len)
    }

    /// Fills the page at `at` with zeros if it is missing (`EEXIST`, a
    /// present page, is fine), without waking.
    fn copy_zeros(&self, at: u64) -> Result<(), MonitorError> {
        let page = crate::pagemap::PAGE_SIZE;
        loop {
            let mut c = UffdioCopy {
                dst: at,
                src: ZERO_PAGE.0.as_ptr() as u64,
                len: page,
                mode: COPY_MODE_DONTWAKE,
                copy: 0,
            };
            // SAFETY: `c` is a valid `uffdio_copy` whose source is a static
            // page of zeros; the kernel fills only a missing page of a
            // registered range (never replaces a present one).
            let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_COPY as _, &mut c) };
            if r == 0 {
                return Ok(());
            }
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EEXIST) => return Ok(()),
                Some(libc::EAGAIN) => continue,
                _ => return Err(Self::ioctl_err("UFFDIO_COPY", at, page)),
            }
        }
    }

    /// [`Uffd::read_msgs`], retried until a message comes or `window` has
    /// passed.
    fn read_msgs_within(&self, buf: &mut [u8], window: Duration) -> Result<usize, MonitorError> {
        if window.is_zero() {
            return Ok(0);
        }
        let deadline = Instant::now() + window;
        loop {
            let n = self.read_msgs(buf)?;
            if n > 0 || Instant::now() >= deadline {
                return Ok(n);
            }
            std::hint::spin_loop();
        }
    }

    /// Reads pending messages into `buf` (a multiple of 32 bytes); returns
    /// the number of messages, 0 when none is pending.
    fn read_msgs(&self, buf: &mut [u8]) -> Result<usize, MonitorError> {
        loop {
            // SAFETY: `buf` is writable for its whole length for the call.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 {
                return Ok(n as usize / MSG_SIZE);
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) => return Ok(0),
                Some(libc::EINTR) => continue,
                _ => return Err(MonitorError::Read(e)),
            }
        }
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Counters of the monitor (cumulative).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FaultCounters {
    /// Write faults that mapped a cluster of the image.
    pub write_faults: u64,
    /// Read faults that mapped zeros.
    pub read_faults: u64,
    /// Faults in clusters already resolved (woken only).
    pub wake_only: u64,
    /// Write faults resolved with zeros because mapping the cluster failed
    /// (the write is then harvested by the next barrier).
    pub fallbacks: u64,
    /// Faults the monitor read while it polled after an earlier one, so
    /// without being woken (see [`crate::fault_poll`]).
    pub polled: u64,
}

/// The fd-driven half of a pcow region, owned by the VMM's event loop.
///
/// Two fds to poll for reading ([`Monitor::fds`]): the userfaultfd
/// ([`Monitor::fd`], handled by [`Monitor::handle_ready`]) and, when the
/// pool has a worker, its eventfd ([`Monitor::pool_fd`], handled by
/// [`Monitor::handle_pool_ready`]); [`Monitor::handle_fd`] dispatches.
///
/// Holds the region's shared state: the region's address space stays
/// reserved while the monitor lives, so a late fault can never map
/// into memory that was given back.
pub struct Monitor {
    pub(crate) dev: Arc<Mutex<DeviceState>>,
    pub(crate) uffd: Arc<Uffd>,
    pub(crate) pool_efd: Option<Arc<EventFd>>,
    /// Only the thread handling the userfaultfd takes it.
    pub(crate) poll: Mutex<FaultPoll>,
    /// Set when a write fault found the file system full and the region
    /// had no such failure recorded yet; taken by the monitor thread.
    pub(crate) space_alert: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("fd", &self.uffd.as_raw_fd())
            .field("pool_fd", &self.pool_fd())
            .finish()
    }
}

impl Monitor {
    /// The userfaultfd to poll for reading (non-blocking).
    pub fn fd(&self) -> RawFd {
        self.uffd.as_raw_fd()
    }

    /// The pre-allocation worker's eventfd to poll for reading
    /// (non-blocking; the same fd for the monitor's whole life, also across
    /// live overlays), or `None` when the pool has no worker.
    pub fn pool_fd(&self) -> Option<RawFd> {
        self.pool_efd.as_ref().map(|e| e.as_raw_fd())
    }

    /// Every fd to register for reading: the userfaultfd, then the pool's
    /// eventfd if any.
    pub fn fds(&self) -> Vec<RawFd> {
        std::iter::once(self.fd()).chain(self.pool_fd()).collect()
    }

    /// Handles readiness of `fd` (one of [`Monitor::fds`]); an unknown fd
    /// does nothing. Returns the events handled.
    pub fn handle_fd(&self, fd: RawFd) -> Result<usize, MonitorError> {
        if fd == self.fd() {
            self.handle_ready()
        } else if Some(fd) == self.pool_fd() {
            self.handle_pool_ready()
        } else {
            Ok(0)
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, DeviceState>, MonitorError> {
        self.dev.lock().map_err(|_| MonitorError::Poisoned)
    }

    /// Drains and resolves every pending fault; returns how many were
    /// handled. Call when [`Monitor::fd`] is readable. The first error is
    /// returned after every event read was tried (an event is never left
    /// half-done: a fault that cannot be mapped gets zeros). After each
    /// batch, takes finished refills and asks the worker for one if the
    /// pool is low. When nothing is pending any more, keeps reading for the
    /// adaptive poll window ([`crate::fault_poll`], at most 50 µs by
    /// default) before it returns, without holding the device's lock.
    pub fn handle_ready(&self) -> Result<usize, MonitorError> {
        let mut buf = [0u8; MSG_SIZE * 32];
        let mut handled = 0;
        let mut first_err = None;
        let mut poll = self.poll.lock().map_err(|_| MonitorError::Poisoned)?;
        let mut n = self.uffd.read_msgs(&mut buf)?;
        if n == 0 {
            return Ok(0);
        }
        poll.fault_at(Instant::now());
        let mut polled = false;
        loop {
            let mut g = self.lock()?;
            let dev = &mut *g;
            if polled {
                dev.region.faults.polled += n as u64;
            }
            for m in buf[..n * MSG_SIZE].chunks_exact(MSG_SIZE) {
                if m[0] != EVENT_PAGEFAULT {
                    continue;
                }
                let word = |at: usize| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&m[at..at + 8]);
                    u64::from_ne_bytes(w)
                };
                let (flags, addr) = (word(8), word(16));
                handled += 1;
                let before = dev.region.image.pool_shortfall();
                match dev
                    .region
                    .resolve_fault(addr, flags & PAGEFAULT_FLAG_WRITE != 0)
                {
                    // The pool had a shortfall and has none now: the fault's
                    // allocation grew the file by a whole pool itself (a
                    // worker's refill is only taken in `apply`, below).
                    Ok(Resolved::Allocated) => {
                        if before.is_some() && dev.region.image.pool_shortfall().is_none() {
                            dev.pool.note_inline();
                        }
                    }
                    Ok(Resolved::Fallback(msg)) => {
                        if dev.region.out_of_space.is_some() {
                            self.space_alert
                                .store(true, std::sync::atomic::Ordering::Release);
                        }
                        dev.pool.note_failure(msg)
                    }
                    Ok(Resolved::Zeroed | Resolved::Woken) => {}
                    Err(e) => {
                        log::error!("userfaultfd: {e}");
                        first_err.get_or_insert(e);
                    }
                }
            }
            dev.pool.apply(&mut dev.region.image);
            dev.pool.request(&dev.region.image);
            drop(g);
            n = self.uffd.read_msgs(&mut buf)?;
            if n > 0 {
                continue;
            }
            // Everything pending is handled: keep reading for the window
            // (without the device lock), the next fault of a burst is
            // likely on its way.
            poll.idle_at(Instant::now());
            n = self.uffd.read_msgs_within(&mut buf, poll.window())?;
            if n == 0 {
                break;
            }
            poll.fault_at(Instant::now());
            polled = true;
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(handled),
        }
    }

    /// Takes the worker's finished refills (the image's pool grows by what
    /// was reserved) and asks for the next one if the pool is still low.
    /// Call when [`Monitor::pool_fd`] is readable; returns the refills
    /// taken.
    pub fn handle_pool_ready(&self) -> Result<usize, MonitorError> {
        if let Some(e) = &self.pool_efd {
            e.drain();
        }
        let mut g = self.lock()?;
        let dev = &mut *g;
        let n = dev.pool.apply(&mut dev.region.image);
        // A range that just failed is not asked for again (see
        // `PoolCtl::request`): a full disk does not make the worker spin.
        dev.pool.request(&dev.region.image);
        Ok(n)
    }

    /// Whether a write fault found the file system full since the last
    /// call (then [`crate::PcowRegion::out_of_space`] says why).
    pub fn take_space_alert(&self) -> bool {
        self.space_alert
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    /// Counters so far.
    pub fn counters(&self) -> Result<FaultCounters, MonitorError> {
        Ok(self.lock()?.region.faults)
    }
}

/// How a fault was resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// A hole got the active layer's cluster, mapped shared.
    Allocated,
    /// A read in a hole got zeros.
    Zeroed,
    /// The cluster was resolved already: woken only.
    Woken,
    /// A write in a hole got zeros because no cluster could be mapped
    /// (the message says why).
    Fallback(String),
}

impl RegionState {
    /// Resolves one fault at `addr`.
    pub(crate) fn resolve_fault(
        &mut self,
        addr: u64,
        write: bool,
    ) -> Result<Resolved, MonitorError> {
        let base = self.mapping.base();
        let cs = self.cs;
        if addr < base || addr >= base + self.mapping.len() as u64 {
            return Err(MonitorError::OutsideRegion { addr });
        }
        let vcn = (addr - base) / cs;
        let start = base + vcn * cs;
        match self.clusters[vcn as usize] {
            ClusterState::Hole if write => {
                match self.map_fresh(vcn) {
                    Ok(()) => {
                        self.clusters[vcn as usize] = ClusterState::Shared;
                        self.faults.write_faults += 1;
                        self.uffd.wake(start, cs)?;
                        Ok(Resolved::Allocated)
                    }
                    Err(e) => {
                        // Zeros keep the guest running; its write lands in
                        // a private page that the next barrier moves into
                        // the image (or reports the same error).
                        if self.faults.fallbacks.is_power_of_two() {
                            log::warn!("cluster {vcn}: mapping failed, zeros instead: {e}");
                        }
                        self.faults.fallbacks += 1;
                        self.uffd
                            .zeropage(start, cs)
                            .map_err(|z| MonitorError::Unresolved {
                                addr,
                                source: Box::new(z),
                            })?;
                        self.clusters[vcn as usize] = ClusterState::Zero;
                        let msg = format!(
                            "cluster {vcn}: no cluster for a write fault, zeros mapped: {}",
                            error_chain(&*e)
                        );
                        if crate::barrier::is_out_of_space(&*e) && self.out_of_space.is_none() {
                            self.out_of_space = Some(msg.clone());
                        }
                        Ok(Resolved::Fallback(msg))
                    }
                }
            }
            ClusterState::Hole => {
                self.uffd.zeropage(start, cs)?;
                self.clusters[vcn as usize] = ClusterState::Zero;
                self.faults.read_faults += 1;
                Ok(Resolved::Zeroed)
            }
            _ => {
                self.faults.wake_only += 1;
                self.uffd.wake(start, cs)?;
                Ok(Resolved::Woken)
            }
        }
    }

    /// Allocates the active cluster for hole `vcn` and maps it shared.
    fn map_fresh(&mut self, vcn: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let ac = self.image.active_cluster(vcn)?;
        if !ac.whole {
            return Err(
                format!("cluster {vcn} is a hole but the image's cluster is partial").into(),
            );
        }
        let fd = self.top_fd()?;
        self.mapping
            .map_file(vcn * self.cs, self.cs, fd, ac.file_offset, true)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// An empty entry write-protected through the monitor's userfaultfd
    /// carries a uffd-wp marker, which `UFFDIO_ZEROPAGE` refuses (`EEXIST`)
    /// although a reader still faults on it: the monitor must fill it some
    /// other way, or the reader faults forever.
    #[test]
    fn a_read_fault_on_a_protected_empty_entry_is_resolved() {
        let Ok(u) = Uffd::for_holes(true) else {
            eprintln!(
                "SKIPPED a_read_fault_on_a_protected_empty_entry_is_resolved: no userfaultfd"
            );
            return;
        };
        let Some(tracker) = u.write_tracker() else {
            eprintln!("SKIPPED a_read_fault_on_a_protected_empty_entry_is_resolved: no WP-async");
            return;
        };
        let len = 16 * crate::pagemap::PAGE_SIZE;
        let mem = crate::region::Reservation::new(len as usize).unwrap();
        let start = mem.base();
        u.register_missing(start, len).unwrap();
        // Page 3 of the empty range gets a marker.
        let page = crate::pagemap::PAGE_SIZE;
        tracker.protect(start + 3 * page, page).unwrap();
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            // SAFETY: reads one byte of the test's mapping; the fault is
            // resolved by the loop below.
            let v = unsafe { std::ptr::read_volatile((start + 3 * page + 5) as *const u8) };
            let _ = tx.send(v);
        });
        let mut buf = [0u8; MSG_SIZE * 8];
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut faults = 0;
        let got = loop {
            if let Ok(v) = rx.try_recv() {
                break Some(v);
            }
            if Instant::now() > deadline {
                break None;
            }
            if u.read_msgs(&mut buf).unwrap() > 0 {
                faults += 1;
                u.zeropage(start, len).unwrap();
            }
        };
        let Some(v) = got else {
            // The reader is stuck in its fault: resolve it for good so the
            // thread can end, then fail.
            let _ = u.copy_zeros(start + 3 * page);
            let _ = u.wake(start, len);
            let _ = reader.join();
            panic!("the reader was not released after {faults} faults");
        };
        reader.join().unwrap();
        assert_eq!(v, 0);
        assert_eq!(faults, 1, "one fault, resolved at once");
    }
}
