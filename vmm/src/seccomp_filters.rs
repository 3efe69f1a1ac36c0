//! Per-thread seccomp filters (`--seccomp`): one allow-list per kind of
//! thread, all in this file, built with `seccompiler` and installed by each
//! thread on itself when it starts.
//!
//! How it fits together:
//! - `main` calls [`init`] once with the `--seccomp` mode; that builds every
//!   list (so a list that does not compile is an error before any guest
//!   runs) and, for `true`, installs the SIGSYS reporter. Without [`init`]
//!   (in-process tests, library users) [`apply`] installs nothing.
//! - The VMM thread (`main`) applies [`ThreadKind::Vmm`] before it creates,
//!   boots or restores a VM, so every thread spawned after that inherits the
//!   VMM's filter (seccomp filters are inherited across `clone`) and then
//!   narrows itself with its own list: a thread can only ever make the calls
//!   that every filter on its stack allows. The device crate's
//!   `pmemN-fault` monitor and `pcow-pool` worker install theirs through
//!   the device crate's thread hook ([`device_thread_hook`], given in the
//!   region's options); the API's per-connection threads run under the
//!   acceptor's (`http-api`) list.
//! - `ioctl` is allowed only with the request numbers of the kind's table
//!   ([`ioctls`]), compared on the low 32 bits of the second argument,
//!   which is all the kernel reads (`ioctl`'s `cmd` is an `unsigned int`).
//!   A kind with an empty table may not call `ioctl` at all. Filters stack,
//!   so the VMM thread's table holds every other kind's requests too.
//! - `--seccomp true` traps a call outside the list: the SIGSYS handler
//!   writes one line naming the thread kind, the call's number and its first
//!   two arguments (an `ioctl`'s request) to standard error, and the process
//!   dies of SIGSYS (as upstream, which also traps and aborts). `log` lets
//!   the call through and the kernel logs it (`SECCOMP_RET_LOG`: the audit
//!   log or `dmesg`); `errno` fails it with `EPERM`; `false` installs none.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use virtio_pmem_pcow::{pagemap, uffd, DeviceThread, ThreadHook};

use crate::config::options::Seccomp;

mod requests;
use requests::*;

/// The kinds of threads that install a filter of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ThreadKind {
    /// The VMM thread: the control loop, VM creation, boot, snapshots,
    /// restores, overlays (and, by inheritance, every later thread).
    Vmm,
    /// A vCPU thread (`vcpuN`).
    Vcpu,
    /// A pmem device's queue thread (`pmemN-queue`): flushes and barriers.
    PmemQueue,
    /// The API server's acceptor (`http-api`) and its connection threads.
    HttpApi,
    /// A serial/console output writer (`serial-out`, `console-out`).
    Chardev,
    /// The `--event-monitor` writer.
    EventMonitor,
    /// A pcow device's userfaultfd monitor (`pmemN-fault`, the device
    /// crate's thread): resolves faults, tracks writes of new mappings.
    PmemFault,
    /// A pcow image's pre-allocation worker (`pcow-pool`, the device
    /// crate's thread): fallocate on its own handle of the image.
    PcowPool,
}

impl ThreadKind {
    /// Every kind (for building and testing all lists).
    pub const ALL: [ThreadKind; 8] = [
        ThreadKind::Vmm,
        ThreadKind::Vcpu,
        ThreadKind::PmemQueue,
        ThreadKind::HttpApi,
        ThreadKind::Chardev,
        ThreadKind::EventMonitor,
        ThreadKind::PmemFault,
        ThreadKind::PcowPool,
    ];

    /// The name the SIGSYS report gives.
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vmm => "vmm",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::PmemQueue => "pmem-queue",
            ThreadKind::HttpApi => "http-api",
            ThreadKind::Chardev => "chardev",
            ThreadKind::EventMonitor => "event-monitor",
            ThreadKind::PmemFault => "pmem-fault",
            ThreadKind::PcowPool => "pcow-pool",
        }
    }
}

/// Why a filter could not be built or installed.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the seccomp filter of the {kind} threads")]
    Build {
        kind: &'static str,
        #[source]
        source: seccompiler::BackendError,
    },
    #[error("compiling the seccomp filter of the {kind} threads")]
    Compile {
        kind: &'static str,
        #[source]
        source: seccompiler::BackendError,
    },
    #[error("installing the seccomp filter of a {kind} thread")]
    Apply {
        kind: &'static str,
        #[source]
        source: seccompiler::Error,
    },
    #[error("installing the SIGSYS handler that reports a call outside a seccomp filter")]
    Handler(#[source] std::io::Error),
    #[error("the seccomp filters were already set up")]
    AlreadySet,
}

/// What every thread needs: thread start and exit (Rust's and glibc's),
/// memory, locks, time, the vCPU kick and the SIGSYS reporter's own calls
/// (write, rt_sigaction, getpid, gettid, tgkill).
const COMMON: &[i64] = &[
    libc::SYS_brk,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_close,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_futex,
    libc::SYS_getpid,
    libc::SYS_getrandom,
    libc::SYS_gettid,
    libc::SYS_madvise,
    libc::SYS_mmap,
    libc::SYS_mprotect,
    libc::SYS_munmap,
    libc::SYS_nanosleep,
    libc::SYS_read,
    libc::SYS_restart_syscall,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_yield,
    libc::SYS_sigaltstack,
    libc::SYS_tgkill,
    libc::SYS_write,
    libc::SYS_writev,
];

/// Waiting on eventfds and epoll sets.
const EVENTS: &[i64] = &[
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_wait,
    libc::SYS_eventfd2,
    libc::SYS_poll,
    libc::SYS_ppoll,
];

/// Starting threads (the new thread runs its first calls under its
/// parent's filter) and installing a child's own filter.
const SPAWN: &[i64] = &[
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_prctl,
    libc::SYS_rseq,
    libc::SYS_seccomp,
    libc::SYS_set_robust_list,
];

/// pcow image I/O: reads and writes, durability (fsync of files and of
/// directories), space, locks, the live overlay's and the barrier's
/// mappings (mremap; PAGEMAP_SCAN on /proc/self/pagemap and KVM's dirty log
/// of a pmem memslot, KVM_GET_DIRTY_LOG, KVM_CLEAR_DIRTY_LOG and KVM_RESET_DIRTY_RINGS, are `ioctl`s, in the request tables).
const IMAGE_IO: &[i64] = &[
    libc::SYS_fadvise64,
    libc::SYS_fallocate,
    libc::SYS_fcntl,
    libc::SYS_fdatasync,
    libc::SYS_flock,
    libc::SYS_fstat,
    libc::SYS_fstatfs,
    libc::SYS_fsync,
    libc::SYS_ftruncate,
    libc::SYS_lseek,
    libc::SYS_mincore,
    libc::SYS_mremap,
    libc::SYS_msync,
    libc::SYS_newfstatat,
    libc::SYS_openat,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_readv,
    libc::SYS_statx,
    libc::SYS_sync_file_range,
];

/// Creating, linking, renaming and removing files and directories (the
/// overlays, frozen snapshot files, `vm.snapshot` directories, `vm.restore`
/// clones), and the lookups around them.
const NAMES: &[i64] = &[
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_fchmod,
    libc::SYS_getcwd,
    libc::SYS_getdents64,
    libc::SYS_linkat,
    libc::SYS_mkdirat,
    libc::SYS_readlinkat,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_statfs,
    libc::SYS_unlinkat,
    libc::SYS_umask,
    // The same through glibc's older entry points (std's remove_file,
    // rename, create_dir and metadata use these on x86_64).
    libc::SYS_access,
    libc::SYS_link,
    libc::SYS_lstat,
    libc::SYS_mkdir,
    libc::SYS_readlink,
    libc::SYS_rename,
    libc::SYS_rmdir,
    libc::SYS_stat,
    libc::SYS_unlink,
];

/// The VMM thread's own extras: KVM and userfaultfd set-up, signals,
/// timers, descriptors, Landlock (`--landlock` confines it at vm.create).
const VMM_EXTRA: &[i64] = &[
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_landlock_add_rule,
    libc::SYS_landlock_create_ruleset,
    libc::SYS_landlock_restrict_self,
    libc::SYS_memfd_create,
    libc::SYS_pipe2,
    libc::SYS_prlimit64,
    libc::SYS_signalfd4,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_userfaultfd,
];

/// Opening and looking at a file without changing anything.
const LOOKUPS: &[i64] = &[
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_openat,
    libc::SYS_readlinkat,
    libc::SYS_statx,
];

/// The API server: the listening socket and its connections.
const SOCKETS: &[i64] = &[
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_fcntl,
    libc::SYS_getsockopt,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_sendto,
    libc::SYS_setsockopt,
    libc::SYS_shutdown,
];

/// Creating a listening socket (the VMM thread's chardev sockets).
const CHARDEV_SOCKET: &[i64] = &[libc::SYS_bind, libc::SYS_listen, libc::SYS_socket];

/// A thread started before the VMM confined itself restricts itself
/// (`--landlock`, see `landlock_rules::threads`): an empty ruleset, the
/// no-new-privileges bit, the restriction; `fcntl(F_GETFD)` is std's check
/// of the ruleset's descriptor.
const LANDLOCK_SELF: &[i64] = &[
    libc::SYS_fcntl,
    libc::SYS_landlock_create_ruleset,
    libc::SYS_landlock_restrict_self,
    libc::SYS_prctl,
];

/// A userfaultfd or pagemap request number, as the filters compare it.
const fn dev(request: libc::c_ulong) -> u32 {
    request as u32
}

/// A `libc` terminal or socket request number, as the filters compare it.
const fn tty(request: libc::Ioctl) -> u32 {
    request as u32
}

// The `ioctl` requests of each kind: one table per kind. KVM's numbers are
// in `seccomp_filters/requests.rs`, userfaultfd's and PAGEMAP_SCAN are the
// device crate's own (the numbers its calls use), the rest `libc`'s.

/// The VMM thread's own requests (it also holds every other table, see
/// [`ioctls`]): KVM set-up of the system, the VM and each vCPU before its
/// thread starts (CPUID, MSRs, FPU, LAPIC, boot registers), the VM-wide
/// state of `vm.snapshot`/`vm.restore` (irqchip, clock); the regions'
/// userfaultfds (opened, registered) and barriers run from the API
/// (`vm.pmem-flush`, snapshots, overlays: PAGEMAP_SCAN, write-protect); the
/// terminal (`isatty` of standard input, raw mode for `tty`, a new `pty`:
/// `grantpt`, `unlockpt`, `ptsname_r`) and the non-blocking chardev
/// sockets (`--serial socket=`: std's `set_nonblocking` is FIONBIO).
const VMM_IOCTLS: &[u32] = &[
    KVM_GET_API_VERSION,
    KVM_CREATE_VM,
    KVM_GET_VCPU_MMAP_SIZE,
    KVM_CHECK_EXTENSION,
    KVM_GET_SUPPORTED_CPUID,
    KVM_GET_MSR_INDEX_LIST,
    KVM_CREATE_VCPU,
    KVM_SET_USER_MEMORY_REGION,
    KVM_ENABLE_CAP,
    KVM_GET_DIRTY_LOG,
    KVM_CLEAR_DIRTY_LOG,
    KVM_RESET_DIRTY_RINGS,
    KVM_SET_TSS_ADDR,
    KVM_CREATE_IRQCHIP,
    KVM_IRQFD,
    KVM_IOEVENTFD,
    KVM_SET_GSI_ROUTING,
    KVM_GET_IRQCHIP,
    KVM_SET_IRQCHIP,
    KVM_GET_CLOCK,
    KVM_SET_CLOCK,
    KVM_SET_CPUID2,
    KVM_SET_MSRS,
    KVM_SET_FPU,
    KVM_GET_LAPIC,
    KVM_SET_LAPIC,
    KVM_SET_REGS,
    KVM_GET_SREGS,
    KVM_SET_SREGS,
    dev(uffd::UFFDIO_API),
    dev(uffd::USERFAULTFD_IOC_NEW),
    dev(uffd::UFFDIO_REGISTER),
    dev(uffd::UFFDIO_WRITEPROTECT),
    dev(pagemap::PAGEMAP_SCAN),
    tty(libc::TCGETS),
    tty(libc::TCSETS),
    tty(libc::TIOCGPTN),
    tty(libc::TIOCSPTLCK),
    tty(libc::FIONBIO),
];

/// A vCPU thread: `KVM_RUN` and `KVM_NMI`; a full dirty ring collected
/// (`KVM_RESET_DIRTY_RINGS`); what the guest's MMIO and port
/// writes make it do (MSI-X vectors programmed: the GSI routes; a BAR
/// moved: its queue notifications' ioeventfds); and the vCPU state that
/// `vm.snapshot` reads and a restore writes on the vCPU's own thread
/// (`snapshot/cpu_state.rs`).
const VCPU_IOCTLS: &[u32] = &[
    KVM_RUN,
    KVM_NMI,
    KVM_RESET_DIRTY_RINGS,
    KVM_SET_GSI_ROUTING,
    KVM_IOEVENTFD,
    KVM_GET_REGS,
    KVM_SET_REGS,
    KVM_GET_SREGS,
    KVM_SET_SREGS,
    KVM_GET_FPU,
    KVM_SET_FPU,
    KVM_GET_XSAVE,
    KVM_SET_XSAVE,
    KVM_GET_XCRS,
    KVM_SET_XCRS,
    KVM_GET_LAPIC,
    KVM_SET_LAPIC,
    KVM_GET_MSRS,
    KVM_SET_MSRS,
    KVM_GET_VCPU_EVENTS,
    KVM_SET_VCPU_EVENTS,
    KVM_GET_MP_STATE,
    KVM_SET_MP_STATE,
    KVM_GET_DEBUGREGS,
    KVM_SET_DEBUGREGS,
    KVM_GET_TSC_KHZ,
    KVM_SET_TSC_KHZ,
    KVM_GET_CPUID2,
    KVM_SET_CPUID2,
];

/// A pmem queue thread: the FLUSH barrier finds written pages (KVM's dirty
/// ring or log of the pmem memslot, or PAGEMAP_SCAN where KVM has none),
/// write-protects them again and tracks clusters it maps private
/// (UFFDIO_REGISTER in write-protect mode).
const PMEM_QUEUE_IOCTLS: &[u32] = &[
    KVM_GET_DIRTY_LOG,
    KVM_CLEAR_DIRTY_LOG,
    KVM_RESET_DIRTY_RINGS,
    dev(pagemap::PAGEMAP_SCAN),
    dev(uffd::UFFDIO_WRITEPROTECT),
    dev(uffd::UFFDIO_REGISTER),
];

/// A pcow device's fault monitor: fills holes with zeros (ZEROPAGE, COPY
/// of a zero page where ZEROPAGE cannot), copies in a cluster it cannot
/// map (COPY; REGISTER when a mapping failed halfway and the hole is made
/// anew) and wakes the faulting threads.
const PMEM_FAULT_IOCTLS: &[u32] = &[
    dev(uffd::UFFDIO_ZEROPAGE),
    dev(uffd::UFFDIO_COPY),
    dev(uffd::UFFDIO_WAKE),
    dev(uffd::UFFDIO_REGISTER),
];

/// The `ioctl` requests `kind` may make (empty: no `ioctl` at all). The
/// pool worker, the API, the chardev writers and the event monitor make
/// none. The VMM thread's filter is inherited by every thread it spawns
/// and stacks under theirs, so it allows each of their requests too.
pub fn ioctls(kind: ThreadKind) -> Vec<u32> {
    let parts: &[&[u32]] = match kind {
        ThreadKind::Vmm => &[
            VMM_IOCTLS,
            VCPU_IOCTLS,
            PMEM_QUEUE_IOCTLS,
            PMEM_FAULT_IOCTLS,
        ],
        ThreadKind::Vcpu => &[VCPU_IOCTLS],
        ThreadKind::PmemQueue => &[PMEM_QUEUE_IOCTLS],
        ThreadKind::PmemFault => &[PMEM_FAULT_IOCTLS],
        ThreadKind::HttpApi
        | ThreadKind::Chardev
        | ThreadKind::EventMonitor
        | ThreadKind::PcowPool => &[],
    };
    let mut requests: Vec<u32> = parts.iter().flat_map(|p| p.iter().copied()).collect();
    requests.sort_unstable();
    requests.dedup();
    requests
}

/// The fault monitor's image I/O: a cluster allocated in the image (the
/// pool's reserve refilled inline when there is no worker: `fallocate`, or
/// a look at the file and `ftruncate` where the file system cannot), the
/// image's own reads and writes; never opening a file.
const FAULT_IO: &[i64] = &[
    libc::SYS_fallocate,
    libc::SYS_fcntl,
    libc::SYS_fdatasync,
    libc::SYS_fstat,
    libc::SYS_fsync,
    libc::SYS_ftruncate,
    libc::SYS_lseek,
    libc::SYS_mincore,
    libc::SYS_mremap,
    libc::SYS_newfstatat,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_statx,
];

/// What the pool worker does: `fallocate` on its own handle of the image
/// (where the file system cannot, its size grows with `ftruncate` after a
/// look at it), and its eventfd's write (in COMMON); fcntl(F_GETFD): std
/// checks a descriptor it is handed.
const POOL: &[i64] = &[
    libc::SYS_fallocate,
    libc::SYS_fcntl,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_ftruncate,
];

/// The system calls a kind of thread may make (`ioctl` when its table of
/// requests is not empty, and then only those, see [`ioctls`]).
pub fn allowed(kind: ThreadKind) -> Vec<i64> {
    let parts: &[&[i64]] = match kind {
        // The VMM thread's filter is inherited by every thread it spawns,
        // so it holds theirs too. Its sockets are `--serial socket=` and
        // `--console socket=`: the control loop binds and accepts them.
        ThreadKind::Vmm => &[
            COMMON,
            EVENTS,
            SPAWN,
            IMAGE_IO,
            NAMES,
            VMM_EXTRA,
            SOCKETS,
            CHARDEV_SOCKET,
        ],
        // fcntl: the serial port's output toggles O_NONBLOCK.
        ThreadKind::Vcpu => &[COMMON, EVENTS, &[libc::SYS_fcntl]],
        ThreadKind::PmemQueue => &[COMMON, EVENTS, IMAGE_IO, NAMES],
        // The acceptor spawns one thread per connection.
        // A request's paths are checked there (a FIFO given as a pmem file
        // is refused without blocking), hence the lookups.
        ThreadKind::HttpApi => &[COMMON, EVENTS, SPAWN, SOCKETS, LOOKUPS, LANDLOCK_SELF],
        ThreadKind::Chardev => &[COMMON, &[libc::SYS_fsync, libc::SYS_fdatasync]],
        ThreadKind::EventMonitor => &[COMMON, LANDLOCK_SELF],
        // Its epoll loop over the userfaultfd and the pool's eventfd, the
        // mappings of the clusters it hands out (mmap, in COMMON) and the
        // image I/O of a pool it refills inline (no worker) or of a
        // cluster it allocates; never a name.
        ThreadKind::PmemFault => &[COMMON, EVENTS, FAULT_IO],
        ThreadKind::PcowPool => &[COMMON, POOL],
    };
    let mut calls: Vec<i64> = parts.iter().flat_map(|p| p.iter().copied()).collect();
    if !ioctls(kind).is_empty() {
        calls.push(libc::SYS_ioctl);
    }
    calls.sort_unstable();
    calls.dedup();
    calls
}

/// What a call outside the list does under `mode` (`None` for no filter).
pub fn mismatch_action(mode: Seccomp) -> Option<SeccompAction> {
    match mode {
        Seccomp::True => Some(SeccompAction::Trap),
        Seccomp::False => None,
        Seccomp::Log => Some(SeccompAction::Log),
        Seccomp::Errno => Some(SeccompAction::Errno(libc::EPERM as u32)),
    }
}

/// Builds the BPF program of `kind`'s list, with `on_mismatch` for the rest.
pub fn program(kind: ThreadKind, on_mismatch: SeccompAction) -> Result<BpfProgram, SeccompError> {
    let build = |source| SeccompError::Build {
        kind: kind.name(),
        source,
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        allowed(kind).into_iter().map(|nr| (nr, vec![])).collect();
    if let Some(slot) = rules.get_mut(&libc::SYS_ioctl) {
        // One rule per request: the call matches if any of them does.
        // Dword compares the low 32 bits, all the kernel reads of `cmd`.
        let by_request = ioctls(kind)
            .into_iter()
            .map(|request| {
                let cond = SeccompCondition::new(
                    1,
                    SeccompCmpArgLen::Dword,
                    SeccompCmpOp::Eq,
                    u64::from(request),
                )?;
                SeccompRule::new(vec![cond])
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(build)?;
        *slot = by_request;
    }
    let filter = SeccompFilter::new(rules, on_mismatch, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(build)?;
    filter.try_into().map_err(|source| SeccompError::Compile {
        kind: kind.name(),
        source,
    })
}

/// The programs [`init`] built, by kind.
static PROGRAMS: OnceLock<BTreeMap<ThreadKind, BpfProgram>> = OnceLock::new();

thread_local! {
    /// The kind whose filter this thread installed last (for the SIGSYS
    /// report; a const-initialised `Cell` is safe to read in a handler).
    static KIND: Cell<&'static str> = const { Cell::new("spawned (its parent's filter)") };
}

/// Sets the `--seccomp` mode for the process: builds every list and, for
/// `true`, installs the SIGSYS reporter. `false` makes [`apply`] a no-op.
pub fn init(mode: Seccomp) -> Result<(), SeccompError> {
    let mut programs = BTreeMap::new();
    if let Some(action) = mismatch_action(mode) {
        if action == SeccompAction::Trap {
            install_sigsys_reporter()?;
        }
        for kind in ThreadKind::ALL {
            programs.insert(kind, program(kind, action.clone())?);
        }
    }
    PROGRAMS
        .set(programs)
        .map_err(|_| SeccompError::AlreadySet)?;
    match mode {
        Seccomp::False => log::info!("--seccomp false: no thread installs a seccomp filter"),
        Seccomp::True | Seccomp::Log | Seccomp::Errno => {
            let word = match mode {
                Seccomp::Log => "log",
                Seccomp::Errno => "errno",
                _ => "true",
            };
            log::info!("--seccomp {word}: each thread installs its seccomp filter as it starts")
        }
    }
    Ok(())
}

/// Installs `kind`'s filter on the calling thread (nothing before [`init`]
/// or under `--seccomp false`).
pub fn apply(kind: ThreadKind) -> Result<(), SeccompError> {
    let Some(program) = PROGRAMS.get().and_then(|p| p.get(&kind)) else {
        return Ok(());
    };
    apply_program(kind, program)
}

/// The hook the VMM gives the device crate ([`virtio_pmem_pcow::RegionOptions::thread_hook`]):
/// its fault monitor applies [`ThreadKind::PmemFault`], its pool worker
/// [`ThreadKind::PcowPool`] (nothing before [`init`] or under `--seccomp
/// false`, as [`apply`]).
pub fn device_thread_hook() -> ThreadHook {
    ThreadHook::new(|thread| {
        let kind = match thread {
            DeviceThread::Fault => ThreadKind::PmemFault,
            DeviceThread::Pool => ThreadKind::PcowPool,
        };
        apply(kind).map_err(Into::into)
    })
}

/// Installs `program` (built for `kind`) on the calling thread.
pub fn apply_program(kind: ThreadKind, program: &BpfProgram) -> Result<(), SeccompError> {
    seccompiler::apply_filter(program).map_err(|source| SeccompError::Apply {
        kind: kind.name(),
        source,
    })?;
    KIND.with(|k| k.set(kind.name()));
    Ok(())
}

/// Installs [`on_sigsys`] for SIGSYS.
pub fn install_sigsys_reporter() -> Result<(), SeccompError> {
    // SAFETY: sigaction is plain data; zeroed is a valid empty value and
    // every field used is set below.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = on_sigsys as *const () as libc::sighandler_t;
    act.sa_flags = libc::SA_SIGINFO;
    // SAFETY: `act.sa_mask` is a valid sigset_t to empty.
    unsafe { libc::sigemptyset(&mut act.sa_mask) };
    // SAFETY: `act` is initialised and outlives the call; the handler only
    // makes async-signal-safe calls.
    if unsafe { libc::sigaction(libc::SIGSYS, &act, std::ptr::null_mut()) } != 0 {
        return Err(SeccompError::Handler(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Appends `s` to `buf` at `*len` (truncating at the end of `buf`).
fn put(buf: &mut [u8], len: &mut usize, s: &[u8]) {
    for &b in s {
        if *len < buf.len() {
            buf[*len] = b;
            *len += 1;
        }
    }
}

/// Appends `v` in decimal (`hex`: in hexadecimal with `0x`).
fn put_num(buf: &mut [u8], len: &mut usize, mut v: u64, hex: bool) {
    let base = if hex { 16 } else { 10 };
    if hex {
        put(buf, len, b"0x");
    }
    let mut digits = [0u8; 20];
    let mut n = 0;
    loop {
        digits[n] = b"0123456789abcdef"[(v % base) as usize];
        n += 1;
        v /= base;
        if v == 0 {
            break;
        }
    }
    while n > 0 {
        n -= 1;
        put(buf, len, &digits[n..=n]);
    }
}

/// The one-line report of a trapped call (formatted without allocating).
pub fn report_line(kind: &str, nr: u64, arg0: u64, arg1: u64, buf: &mut [u8]) -> usize {
    let mut len = 0;
    put(
        buf,
        &mut len,
        b"cloud-hypervisor: seccomp: a thread of kind ",
    );
    put(buf, &mut len, kind.as_bytes());
    put(buf, &mut len, b" made system call ");
    put_num(buf, &mut len, nr, false);
    put(buf, &mut len, b" (args ");
    put_num(buf, &mut len, arg0, true);
    put(buf, &mut len, b", ");
    put_num(buf, &mut len, arg1, true);
    put(
        buf,
        &mut len,
        b"), which its filter does not allow: killing the process (see docs/vmm.md)\n",
    );
    len
}

/// The SIGSYS handler of `--seccomp true`: writes [`report_line`] to
/// standard error, then kills the process with SIGSYS (default action, so
/// the parent sees the signal). Only async-signal-safe calls, all of them in
/// every list: write, rt_sigaction, getpid, gettid, tgkill.
extern "C" fn on_sigsys(_sig: libc::c_int, _info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let (mut nr, mut a0, mut a1) = (u64::MAX, 0, 0);
    if !ctx.is_null() {
        // SAFETY: with SA_SIGINFO the kernel passes a valid ucontext_t as
        // the third argument; for a seccomp trap its RAX holds the call's
        // number and RDI/RSI its first two arguments (x86_64 ABI).
        let gregs = unsafe { &(*(ctx as *const libc::ucontext_t)).uc_mcontext.gregs };
        nr = gregs[libc::REG_RAX as usize] as u64;
        a0 = gregs[libc::REG_RDI as usize] as u64;
        a1 = gregs[libc::REG_RSI as usize] as u64;
    }
    let kind = KIND.with(|k| k.get());
    let mut buf = [0u8; 256];
    let len = report_line(kind, nr, a0, a1, &mut buf);
    // Then SIGSYS, reset to its default action, is sent to this thread: it
    // stays pending (blocked in its own handler) and kills the process as
    // the handler returns.
    // SAFETY: `len` initialised bytes of `buf` to fd 2, then raw,
    // async-signal-safe system calls with valid arguments.
    unsafe {
        libc::write(2, buf.as_ptr().cast(), len);
        libc::signal(libc::SIGSYS, libc::SIG_DFL);
        libc::syscall(
            libc::SYS_tgkill,
            libc::getpid(),
            libc::syscall(libc::SYS_gettid),
            libc::SIGSYS,
        );
    }
}

#[cfg(test)]
mod tests;
