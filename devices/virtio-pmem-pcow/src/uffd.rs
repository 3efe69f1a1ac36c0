//! The userfaultfd ABI (linux/userfaultfd.h) over raw `libc`, shared by the
//! monitor (missing faults of holes) and the write tracker (write-protect,
//! asynchronous). Raw ioctls rather than the `userfaultfd` crate: its
//! bindgen build needs libclang on every machine, for five ioctls. Public
//! for the benchmark's bare fault handler, the baseline of the monitor.

use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

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

const UFFDIO_API: libc::c_ulong = ioc(IOC_READ | IOC_WRITE, 0x3F, size_of::<UffdioApi>());
const UFFDIO_REGISTER: libc::c_ulong = ioc(IOC_READ | IOC_WRITE, 0x00, size_of::<UffdioRegister>());
/// `UFFDIO_WAKE` (a [`UffdioRange`]).
pub const UFFDIO_WAKE: libc::c_ulong = ioc(IOC_READ, 0x02, size_of::<UffdioRange>());
/// `UFFDIO_ZEROPAGE` (a [`UffdioZeropage`]).
pub const UFFDIO_ZEROPAGE: libc::c_ulong =
    ioc(IOC_READ | IOC_WRITE, 0x04, size_of::<UffdioZeropage>());
/// `UFFDIO_COPY` (a [`UffdioCopy`]).
pub const UFFDIO_COPY: libc::c_ulong = ioc(IOC_READ | IOC_WRITE, 0x03, size_of::<UffdioCopy>());
const UFFDIO_WRITEPROTECT: libc::c_ulong =
    ioc(IOC_READ | IOC_WRITE, 0x06, size_of::<UffdioWriteprotect>());
/// `UFFDIO_WRITEPROTECT_MODE_WP`.
const WRITEPROTECT_MODE_WP: u64 = 1;
/// `USERFAULTFD_IOC_NEW` on `/dev/userfaultfd`: `_IO(0xAA, 0x00)`.
const USERFAULTFD_IOC_NEW: libc::c_ulong = UFFDIO << 8;

/// `UFFDIO_COPY_MODE_DONTWAKE`.
pub const COPY_MODE_DONTWAKE: u64 = 1;
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
