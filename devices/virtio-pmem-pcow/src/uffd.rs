//! userfaultfd: the ABI (linux/userfaultfd.h) over raw `libc`, shared by
//! the monitor (missing faults of holes) and the write tracker
//! (write-protect, asynchronous, [`write_protect`]), and [`Uffd`], the
//! region's userfaultfd (register, zero-fill, wake, read events). Raw ioctls rather than the `userfaultfd` crate: its
//! bindgen build needs libclang on every machine, for five ioctls. Public
//! for the benchmark's bare fault handler, the baseline of the monitor.

use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::mapping::PAGE_SIZE;

const UFFD_API: u64 = 0xAA;
const UFFDIO: libc::c_ulong = 0xAA;
const IOC_WRITE: libc::c_ulong = 1;
const IOC_READ: libc::c_ulong = 2;

const fn ioc(dir: libc::c_ulong, nr: libc::c_ulong, size: usize) -> libc::c_ulong {
    (dir << 30) | ((size as libc::c_ulong) << 16) | (UFFDIO << 8) | nr
}

/// `struct uffdio_api`.
#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
pub struct UffdioRange {
    /// First byte (page aligned).
    pub start: u64,
    /// Length in bytes (page aligned).
    pub len: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
#[derive(Default)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct uffdio_zeropage`.
#[repr(C)]
#[derive(Default)]
pub struct UffdioZeropage {
    /// The pages to fill.
    pub range: UffdioRange,
    /// `UFFDIO_ZEROPAGE_MODE_*` (0: wake the waiters).
    pub mode: u64,
    /// Out: bytes filled, or a negative errno.
    pub zeropage: i64,
}

/// `struct uffdio_copy`.
#[repr(C)]
#[derive(Default)]
pub struct UffdioCopy {
    /// First byte to fill (page aligned, registered).
    pub dst: u64,
    /// Source of the bytes.
    pub src: u64,
    /// Length in bytes (page aligned).
    pub len: u64,
    /// `UFFDIO_COPY_MODE_*` (0: wake the waiters).
    pub mode: u64,
    /// Out: bytes copied, or a negative errno.
    pub copy: i64,
}

/// `UFFDIO_API` (the handshake of a new userfaultfd).
pub const UFFDIO_API: libc::c_ulong = ioc(IOC_READ | IOC_WRITE, 0x3F, size_of::<UffdioApi>());
/// `UFFDIO_REGISTER` (missing or write-protect mode).
pub const UFFDIO_REGISTER: libc::c_ulong =
    ioc(IOC_READ | IOC_WRITE, 0x00, size_of::<UffdioRegister>());
/// `UFFDIO_WAKE` (a [`UffdioRange`]).
pub const UFFDIO_WAKE: libc::c_ulong = ioc(IOC_READ, 0x02, size_of::<UffdioRange>());
/// `UFFDIO_ZEROPAGE` (a [`UffdioZeropage`]).
pub const UFFDIO_ZEROPAGE: libc::c_ulong =
    ioc(IOC_READ | IOC_WRITE, 0x04, size_of::<UffdioZeropage>());
/// `UFFDIO_COPY` (a [`UffdioCopy`]).
pub const UFFDIO_COPY: libc::c_ulong = ioc(IOC_READ | IOC_WRITE, 0x03, size_of::<UffdioCopy>());
/// `UFFDIO_WRITEPROTECT` (write tracking's re-arm).
pub const UFFDIO_WRITEPROTECT: libc::c_ulong =
    ioc(IOC_READ | IOC_WRITE, 0x06, size_of::<UffdioWriteprotect>());
/// `UFFDIO_WRITEPROTECT_MODE_WP`.
const WRITEPROTECT_MODE_WP: u64 = 1;
/// `USERFAULTFD_IOC_NEW` on `/dev/userfaultfd`: `_IO(0xAA, 0x00)`.
pub const USERFAULTFD_IOC_NEW: libc::c_ulong = UFFDIO << 8;

/// `UFFDIO_COPY_MODE_DONTWAKE`.
pub const COPY_MODE_DONTWAKE: u64 = 1;
/// `UFFDIO_COPY_MODE_WP`: the copied pages come write-protected.
pub const COPY_MODE_WP: u64 = 2;
/// `UFFDIO_REGISTER_MODE_MISSING`.
pub const MODE_MISSING: u64 = 1;
/// `UFFDIO_REGISTER_MODE_WP`.
pub const MODE_WP: u64 = 2;
/// `UFFD_FEATURE_WP_UNPOPULATED` (Linux 6.4).
pub const FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// `UFFD_FEATURE_WP_ASYNC` (Linux 6.7).
pub const FEATURE_WP_ASYNC: u64 = 1 << 15;
/// `UFFD_EVENT_PAGEFAULT`.
pub const EVENT_PAGEFAULT: u8 = 0x12;
/// `UFFD_PAGEFAULT_FLAG_WRITE`.
pub const PAGEFAULT_FLAG_WRITE: u64 = 1;
/// Size of `struct uffd_msg`.
pub const MSG_SIZE: usize = 32;

/// Why a userfaultfd could not be had.
#[derive(Debug)]
pub enum OpenError {
    /// Neither the syscall nor `/dev/userfaultfd` gave one (the syscall's error).
    Create(std::io::Error),
    /// The `UFFDIO_API` handshake refused the features.
    Api(std::io::Error),
}

/// Opens a non-blocking, close-on-exec userfaultfd with `features`. It also
/// sees faults taken in kernel mode (KVM reaches guest memory through
/// `get_user_pages`). Falls back to `/dev/userfaultfd` (Linux 6.1+) for
/// users the `vm.unprivileged_userfaultfd` sysctl does not allow.
pub fn open(features: u64) -> Result<OwnedFd, OpenError> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: the syscall takes one integer argument and returns a new fd
    // or -1; no memory is passed.
    let r = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    let raw = if r >= 0 {
        r as RawFd
    } else {
        let e = std::io::Error::last_os_error();
        from_dev(flags).map_err(|_| OpenError::Create(e))?
    };
    // SAFETY: `raw` was just returned by the kernel and is owned by no one
    // else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: `api` is a valid `uffdio_api` the kernel reads and writes back
    // for the duration of the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut api) };
    if r < 0 {
        return Err(OpenError::Api(std::io::Error::last_os_error()));
    }
    Ok(fd)
}

fn from_dev(flags: libc::c_int) -> std::io::Result<RawFd> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")?;
    // SAFETY: USERFAULTFD_IOC_NEW takes the flags as an integer argument and
    // returns a new fd; `dev` is open for the call.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW as _, flags) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

/// Registers `[start, start + len)` with `fd` in `mode`.
pub fn register(fd: &OwnedFd, start: u64, len: u64, mode: u64) -> std::io::Result<()> {
    let mut reg = UffdioRegister {
        range: UffdioRange { start, len },
        mode,
        ioctls: 0,
    };
    // SAFETY: `reg` is a valid `uffdio_register`; registering changes only
    // how faults in the range are served, not its content.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_REGISTER as _, &mut reg) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Write-protects `[start, start + len)`, registered with `fd` in
/// write-protect mode.
pub fn write_protect(fd: &OwnedFd, start: u64, len: u64) -> std::io::Result<()> {
    let mut wp = UffdioWriteprotect {
        range: UffdioRange { start, len },
        mode: WRITEPROTECT_MODE_WP,
    };
    // SAFETY: `wp` is a valid `uffdio_writeprotect`; protecting changes no
    // content, only whether the next write to a page is noted (WP-async:
    // the kernel resolves it without an event).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_WRITEPROTECT as _, &mut wp) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Errors of the userfaultfd.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
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
    /// Opens a userfaultfd for missing-page faults (see [`open`]).
    pub fn new() -> Result<Uffd, UffdError> {
        let fd = open(0).map_err(|e| match e {
            OpenError::Create(e) => UffdError::Create(e),
            OpenError::Api(e) => UffdError::Api(e),
        })?;
        Ok(Uffd {
            fd,
            wp_async: false,
        })
    }

    /// Opens the region's userfaultfd: missing-page faults, and with
    /// `track_zero` also WP-async write tracking of the zero pages it maps
    /// (when the kernel has it, Linux 6.7+; otherwise as [`Uffd::new`]).
    pub(crate) fn for_holes(track_zero: bool) -> Result<Uffd, UffdError> {
        if track_zero {
            // The kernel adds WP_UNPOPULATED to WP_ASYNC in any case:
            // write-protecting an empty entry leaves a marker there.
            match open(FEATURE_WP_ASYNC | FEATURE_WP_UNPOPULATED) {
                Ok(fd) => return Ok(Uffd { fd, wp_async: true }),
                Err(e) => log::info!(
                    "zero-mapped holes not write-tracked (no UFFD_FEATURE_WP_ASYNC: {e:?}); \
                     barriers classify their pages"
                ),
            }
        }
        Uffd::new()
    }

    /// A second handle of this userfaultfd when it was opened WP-async:
    /// write protection of the zero pages it maps goes through it (see
    /// [`crate::pagemap::WriteTracker`]).
    pub(crate) fn wp_async_fd(&self) -> Option<OwnedFd> {
        if !self.wp_async {
            return None;
        }
        match self.fd.try_clone() {
            Ok(fd) => Some(fd),
            Err(e) => {
                log::warn!("zero-mapped holes not write-tracked (dup of the userfaultfd: {e})");
                None
            }
        }
    }

    fn ioctl_err(op: &'static str, start: u64, len: u64) -> UffdError {
        UffdError::Ioctl {
            op,
            start,
            len,
            source: std::io::Error::last_os_error(),
        }
    }

    /// Registers `[start, start + len)` (anonymous memory) for missing-page
    /// faults, and for write protection when opened WP-async.
    pub(crate) fn register_missing(&self, start: u64, len: u64) -> Result<(), UffdError> {
        let mode = if self.wp_async {
            MODE_MISSING | MODE_WP
        } else {
            MODE_MISSING
        };
        register(&self.fd, start, len, mode).map_err(|source| UffdError::Ioctl {
            op: "UFFDIO_REGISTER",
            start,
            len,
            source,
        })
    }

    /// Wakes the threads waiting on faults in the range.
    pub(crate) fn wake(&self, start: u64, len: u64) -> Result<(), UffdError> {
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
    pub(crate) fn zeropage(&self, start: u64, len: u64) -> Result<ZeroOutcome, UffdError> {
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

    fn zeropage_each(&self, start: u64, len: u64) -> Result<(), UffdError> {
        let page = PAGE_SIZE;
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
    fn copy_zeros(&self, at: u64) -> Result<(), UffdError> {
        let page = PAGE_SIZE;
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

    /// Fills the missing pages of `[start, start + data.len())` (page
    /// aligned, registered) with `data` and wakes the waiters. Pages a
    /// write-tracking userfaultfd registered come write-protected, as the
    /// zero pages it maps: the guest's first write to each is recorded.
    pub(crate) fn copy(&self, start: u64, data: &[u8]) -> Result<(), UffdError> {
        let len = data.len() as u64;
        let mut done = 0u64;
        while done < len {
            let mut c = UffdioCopy {
                dst: start + done,
                src: data[done as usize..].as_ptr() as u64,
                len: len - done,
                mode: if self.wp_async { COPY_MODE_WP } else { 0 },
                copy: 0,
            };
            // `c` is a valid `uffdio_copy` whose source is the rest of
            // `data`, borrowed for the call; the kernel fills only missing
            // pages of a registered range (never replaces a present one).
            // SAFETY: so it reads only `data` and writes no live memory.
            let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_COPY as _, &mut c) };
            if r == 0 {
                break;
            }
            match std::io::Error::last_os_error().raw_os_error() {
                // Part done (`copy` says how much), or a page present:
                // go on after it.
                Some(libc::EAGAIN) if c.copy > 0 => done += c.copy as u64,
                Some(libc::EAGAIN) => {}
                Some(libc::EEXIST) => done += c.copy.max(0) as u64 + PAGE_SIZE,
                _ => return Err(Self::ioctl_err("UFFDIO_COPY", start + done, len - done)),
            }
        }
        self.wake(start, len)
    }

    /// [`Uffd::read_msgs`], retried until a message comes or `window` has
    /// passed.
    pub(crate) fn read_msgs_within(
        &self,
        buf: &mut [u8],
        window: Duration,
    ) -> Result<usize, UffdError> {
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
    pub(crate) fn read_msgs(&self, buf: &mut [u8]) -> Result<usize, UffdError> {
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
                _ => return Err(UffdError::Read(e)),
            }
        }
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
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
        let Some(tracker) = u.wp_async_fd().map(crate::pagemap::WriteTracker::from_fd) else {
            eprintln!("SKIPPED a_read_fault_on_a_protected_empty_entry_is_resolved: no WP-async");
            return;
        };
        let len = 16 * PAGE_SIZE;
        let mem = crate::mapping::Reservation::new(len as usize).unwrap();
        let start = mem.base();
        u.register_missing(start, len).unwrap();
        // Page 3 of the empty range gets a marker.
        let page = PAGE_SIZE;
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
