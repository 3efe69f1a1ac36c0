//! The filters are really installed: each test forks, applies a list in
//! the child (a fresh single-threaded process, so the test harness's
//! threads stay unfiltered) and watches what a call outside it does.

use super::*;
use std::io::Read;
use std::os::fd::FromRawFd;

/// How a forked child ended, and what it wrote to standard error.
struct Ended {
    status: libc::c_int,
    stderr: String,
}

impl Ended {
    fn killed_by(&self) -> Option<libc::c_int> {
        libc::WIFSIGNALED(self.status).then(|| libc::WTERMSIG(self.status))
    }
    fn exit_code(&self) -> Option<libc::c_int> {
        libc::WIFEXITED(self.status).then(|| libc::WEXITSTATUS(self.status))
    }
}

/// Runs `body` in a forked child whose standard error is a pipe; the child
/// exits with `body`'s value. `body` must not allocate (the parent's other
/// threads may hold the allocator's locks at the fork).
fn in_child(body: impl FnOnce() -> libc::c_int) -> Ended {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the child only makes raw system calls and runs `body`, then
    // leaves with _exit, never returning into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: plain descriptor calls in the child; _exit never returns.
        unsafe {
            libc::dup2(fds[1], 2);
            let code = body();
            libc::_exit(code);
        }
    }
    // SAFETY: fds[1] is the parent's copy of the write end, closed once.
    unsafe { libc::close(fds[1]) };
    // SAFETY: fds[0] is the read end, owned from here on by the File.
    let mut reader = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    let mut stderr = String::new();
    reader.read_to_string(&mut stderr).unwrap();
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    Ended { status, stderr }
}

/// A call no list allows: personality(2), here only a query (0xffffffff
/// changes nothing), so it is harmless where it passes.
const FORBIDDEN: i64 = libc::SYS_personality;
const QUERY: libc::c_ulong = 0xffff_ffff;

fn forbidden_call() -> libc::c_long {
    // SAFETY: personality(0xffffffff) only reads the persona.
    unsafe { libc::syscall(FORBIDDEN, QUERY) }
}

#[test]
fn every_list_builds_in_every_mode() {
    for mode in [Seccomp::True, Seccomp::Log, Seccomp::Errno] {
        let action = mismatch_action(mode).unwrap();
        for kind in ThreadKind::ALL {
            let p = program(kind, action.clone()).unwrap();
            assert!(!p.is_empty(), "{kind:?}");
        }
    }
    assert_eq!(mismatch_action(Seccomp::False), None);
}

#[test]
fn lists_hold_what_the_image_and_kvm_work_needs() {
    let vmm = allowed(ThreadKind::Vmm);
    for nr in [
        libc::SYS_userfaultfd,
        libc::SYS_fsync,
        libc::SYS_fdatasync,
        libc::SYS_linkat,
        libc::SYS_renameat2,
        libc::SYS_unlinkat,
        libc::SYS_openat,
        libc::SYS_mremap,
        libc::SYS_fallocate,
        libc::SYS_flock,
        libc::SYS_clone3,
    ] {
        assert!(vmm.contains(&nr), "vmm lacks {nr}");
    }
    let q = allowed(ThreadKind::PmemQueue);
    assert!(q.contains(&libc::SYS_fdatasync) && q.contains(&libc::SYS_ioctl));
    // `ioctl` only where a kind has requests to make.
    for kind in ThreadKind::ALL {
        assert_eq!(
            allowed(kind).contains(&libc::SYS_ioctl),
            !ioctls(kind).is_empty(),
            "{kind:?}"
        );
    }
    // The device crate's threads: no names, no sockets, no spawning; the
    // pool worker only reserves space.
    for kind in [ThreadKind::PmemFault, ThreadKind::PcowPool] {
        let l = allowed(kind);
        for nr in [libc::SYS_unlinkat, libc::SYS_renameat2, libc::SYS_clone3] {
            assert!(!l.contains(&nr), "{kind:?} allows {nr}");
        }
    }
    let pool = allowed(ThreadKind::PcowPool);
    assert!(pool.contains(&libc::SYS_fallocate) && pool.contains(&libc::SYS_ftruncate));
    assert!(!pool.contains(&libc::SYS_openat) && !pool.contains(&libc::SYS_ioctl));
    let fault = allowed(ThreadKind::PmemFault);
    assert!(fault.contains(&libc::SYS_epoll_wait) && fault.contains(&libc::SYS_fallocate));
    // Narrow lists stay narrow: no sockets outside the API, no spawning
    // from a vCPU.
    for kind in ThreadKind::ALL {
        let l = allowed(kind);
        assert_eq!(
            l.contains(&libc::SYS_accept4),
            matches!(kind, ThreadKind::HttpApi | ThreadKind::Vmm),
            "{kind:?}"
        );
        assert_eq!(
            l.contains(&libc::SYS_socket),
            kind == ThreadKind::Vmm,
            "{kind:?}"
        );
        assert!(!l.contains(&libc::SYS_execve), "{kind:?}");
        assert!(!l.contains(&FORBIDDEN), "{kind:?}");
    }
    assert!(!allowed(ThreadKind::Vcpu).contains(&libc::SYS_clone));
    assert!(!allowed(ThreadKind::Vcpu).contains(&libc::SYS_openat));
}

#[test]
fn a_call_outside_the_list_kills_the_process_with_a_report() {
    for kind in ThreadKind::ALL {
        let prog = program(kind, SeccompAction::Trap).unwrap();
        let ended = in_child(|| {
            if install_sigsys_reporter().is_err() || apply_program(kind, &prog).is_err() {
                return 3;
            }
            // An allowed call still works under the filter.
            // SAFETY: getpid has no arguments and cannot fail.
            if unsafe { libc::getpid() } <= 0 {
                return 4;
            }
            forbidden_call();
            5 // not reached: the trap kills the process first
        });
        assert_eq!(
            ended.killed_by(),
            Some(libc::SIGSYS),
            "{kind:?}: {}",
            ended.stderr
        );
        // Its second argument is whatever RSI held: not compared.
        let want = format!(
            "seccomp: a thread of kind {} made system call {} (args 0x{:x}, ",
            kind.name(),
            FORBIDDEN,
            QUERY
        );
        assert!(ended.stderr.contains(&want), "{kind:?}: {:?}", ended.stderr);
    }
}

#[test]
fn without_a_filter_the_same_call_passes() {
    let ended = in_child(|| if forbidden_call() >= 0 { 7 } else { 8 });
    assert_eq!(ended.exit_code(), Some(7), "{}", ended.stderr);
}

#[test]
fn log_mode_lets_the_call_through_and_errno_mode_fails_it() {
    let log = program(ThreadKind::Vcpu, SeccompAction::Log).unwrap();
    let ended = in_child(|| {
        if apply_program(ThreadKind::Vcpu, &log).is_err() {
            return 3;
        }
        if forbidden_call() >= 0 {
            7
        } else {
            8
        }
    });
    assert_eq!(ended.exit_code(), Some(7), "{}", ended.stderr);

    let errno = program(ThreadKind::Vcpu, mismatch_action(Seccomp::Errno).unwrap()).unwrap();
    let ended = in_child(|| {
        if apply_program(ThreadKind::Vcpu, &errno).is_err() {
            return 3;
        }
        let r = forbidden_call();
        // SAFETY: reads this thread's errno after the failed call.
        let e = unsafe { *libc::__errno_location() };
        if r == -1 && e == libc::EPERM {
            7
        } else {
            8
        }
    });
    assert_eq!(ended.exit_code(), Some(7), "{}", ended.stderr);
}

#[test]
fn a_spawned_thread_inherits_its_parents_filter() {
    // The VMM's filter (which allows spawning), then a thread that narrows
    // itself to the vCPU list: openat, allowed to its parent, kills it.
    let vmm = program(ThreadKind::Vmm, SeccompAction::Trap).unwrap();
    let vcpu = program(ThreadKind::Vcpu, SeccompAction::Trap).unwrap();
    // The thread is a bare pthread on a plain function: nothing of the
    // test harness runs in the forked child.
    extern "C" fn narrowed(arg: *mut libc::c_void) -> *mut libc::c_void {
        // SAFETY: `arg` is the vCPU program the parent passes and keeps
        // alive until the join below.
        let prog = unsafe { &*(arg as *const BpfProgram) };
        if apply_program(ThreadKind::Vcpu, prog).is_err() {
            return 3 as *mut libc::c_void;
        }
        // SAFETY: openat with a constant, NUL-terminated path.
        unsafe { libc::openat(libc::AT_FDCWD, c"/".as_ptr(), libc::O_RDONLY) };
        std::ptr::null_mut()
    }
    let ended = in_child(|| {
        if install_sigsys_reporter().is_err() || apply_program(ThreadKind::Vmm, &vmm).is_err() {
            return 3;
        }
        // The parent may still open files.
        // SAFETY: openat with a constant, NUL-terminated path.
        if unsafe { libc::openat(libc::AT_FDCWD, c"/".as_ptr(), libc::O_RDONLY) } < 0 {
            return 4;
        }
        let mut t: libc::pthread_t = 0;
        // SAFETY: `narrowed` is a valid thread function; `vcpu` outlives
        // the thread, which is joined before the child exits.
        let r = unsafe {
            libc::pthread_create(
                &mut t,
                std::ptr::null(),
                narrowed,
                &vcpu as *const BpfProgram as *mut libc::c_void,
            )
        };
        if r != 0 {
            return 5;
        }
        // SAFETY: joins the thread created above.
        unsafe { libc::pthread_join(t, std::ptr::null_mut()) };
        6 // not reached: the thread's openat kills the process
    });
    assert_eq!(ended.killed_by(), Some(libc::SIGSYS), "{}", ended.stderr);
    assert!(
        ended
            .stderr
            .contains(&format!("kind vcpu made system call {}", libc::SYS_openat)),
        "{}",
        ended.stderr
    );
}

#[test]
fn the_report_line_is_formatted_without_allocating_and_truncates() {
    let mut buf = [0u8; 256];
    let n = report_line("vcpu", 41, 2, 0x5413, &mut buf);
    let line = std::str::from_utf8(&buf[..n]).unwrap();
    assert!(line.starts_with(
        "cloud-hypervisor: seccomp: a thread of kind vcpu made system call 41 (args 0x2, 0x5413)"
    ));
    assert!(line.ends_with('\n'));
    let mut small = [0u8; 10];
    assert_eq!(report_line("vcpu", 41, 0, 0, &mut small), 10);
    let mut big = [0u8; 256];
    let n = report_line("x", u64::MAX, u64::MAX, 0, &mut big);
    let line = std::str::from_utf8(&big[..n]).unwrap();
    assert!(line.contains("call 18446744073709551615 (args 0xffffffffffffffff, 0x0)"));
}

/// A request in no table: the terminal's window size (what a console that
/// followed the terminal's size would ask).
const UNLISTED: u32 = libc::TIOCGWINSZ as u32;

/// Whether the last call failed with EBADF.
fn failed_ebadf(r: libc::c_long) -> bool {
    // SAFETY: reads this thread's errno, right after the call.
    r == -1 && unsafe { *libc::__errno_location() } == libc::EBADF
}

/// ioctl(-1, request): a request the filter lets through fails with EBADF
/// (no file), one it does not kills the caller first.
fn ioctl_on_no_fd(request: u64) -> libc::c_long {
    // SAFETY: fd -1 is never open, so the kernel touches no memory and
    // fails with EBADF; the pointer argument is null.
    unsafe { libc::syscall(libc::SYS_ioctl, -1 as libc::c_long, request, 0usize) }
}

#[test]
fn an_ioctl_outside_the_kinds_table_kills_and_a_listed_one_passes() {
    for kind in ThreadKind::ALL {
        let table = ioctls(kind);
        assert!(!table.contains(&UNLISTED), "{kind:?}");
        let prog = program(kind, SeccompAction::Trap).unwrap();
        let ended = in_child(|| {
            if install_sigsys_reporter().is_err() || apply_program(kind, &prog).is_err() {
                return 3;
            }
            for &request in &table {
                // Listed: through the filter, refused by the kernel (EBADF).
                if !failed_ebadf(ioctl_on_no_fd(u64::from(request))) {
                    return 4;
                }
                // The kernel reads `cmd` as 32 bits: so does the filter.
                if !failed_ebadf(ioctl_on_no_fd(0xffff_ffff_0000_0000 | u64::from(request))) {
                    return 5;
                }
            }
            ioctl_on_no_fd(u64::from(UNLISTED));
            6 // not reached: the trap kills the process first
        });
        assert_eq!(
            ended.killed_by(),
            Some(libc::SIGSYS),
            "{kind:?}: {:?} exit {:?}",
            ended.stderr,
            ended.exit_code()
        );
        let want = format!(
            "a thread of kind {} made system call {} (args 0xffffffffffffffff, 0x{UNLISTED:x})",
            kind.name(),
            libc::SYS_ioctl
        );
        assert!(ended.stderr.contains(&want), "{kind:?}: {:?}", ended.stderr);
    }
}

#[test]
fn a_vcpu_may_not_make_the_vmms_requests() {
    // A vCPU thread stacks its list on the VMM's: KVM_CREATE_VM, allowed
    // to its parent, kills it.
    let prog = program(ThreadKind::Vcpu, SeccompAction::Trap).unwrap();
    let ended = in_child(|| {
        if install_sigsys_reporter().is_err() || apply_program(ThreadKind::Vcpu, &prog).is_err() {
            return 3;
        }
        ioctl_on_no_fd(u64::from(KVM_CREATE_VM));
        4
    });
    assert_eq!(ended.killed_by(), Some(libc::SIGSYS), "{}", ended.stderr);
    assert!(
        ended.stderr.contains(&format!("0x{KVM_CREATE_VM:x})")),
        "{}",
        ended.stderr
    );
}

#[test]
fn request_numbers_are_the_kernel_headers() {
    // The values of linux/kvm.h, linux/userfaultfd.h (Debian 12's headers,
    // printed by a C program) and, for PAGEMAP_SCAN (Linux 6.7, newer than
    // those headers), linux/fs.h's _IOWR('f', 16, struct pm_scan_arg) of
    // 96 bytes.
    let known: &[(&str, u32, u32)] = &[
        ("KVM_GET_API_VERSION", KVM_GET_API_VERSION, 0x0000_ae00),
        ("KVM_CREATE_VM", KVM_CREATE_VM, 0x0000_ae01),
        (
            "KVM_GET_MSR_INDEX_LIST",
            KVM_GET_MSR_INDEX_LIST,
            0xc004_ae02,
        ),
        ("KVM_CHECK_EXTENSION", KVM_CHECK_EXTENSION, 0x0000_ae03),
        (
            "KVM_GET_VCPU_MMAP_SIZE",
            KVM_GET_VCPU_MMAP_SIZE,
            0x0000_ae04,
        ),
        (
            "KVM_GET_SUPPORTED_CPUID",
            KVM_GET_SUPPORTED_CPUID,
            0xc008_ae05,
        ),
        ("KVM_CREATE_VCPU", KVM_CREATE_VCPU, 0x0000_ae41),
        ("KVM_GET_DIRTY_LOG", KVM_GET_DIRTY_LOG, 0x4010_ae42),
        ("KVM_CLEAR_DIRTY_LOG", KVM_CLEAR_DIRTY_LOG, 0xc018_aec0),
        ("KVM_ENABLE_CAP", KVM_ENABLE_CAP, 0x4068_aea3),
        ("KVM_RESET_DIRTY_RINGS", KVM_RESET_DIRTY_RINGS, 0x0000_aec7),
        (
            "KVM_SET_USER_MEMORY_REGION",
            KVM_SET_USER_MEMORY_REGION,
            0x4020_ae46,
        ),
        ("KVM_SET_TSS_ADDR", KVM_SET_TSS_ADDR, 0x0000_ae47),
        ("KVM_CREATE_IRQCHIP", KVM_CREATE_IRQCHIP, 0x0000_ae60),
        ("KVM_GET_IRQCHIP", KVM_GET_IRQCHIP, 0xc208_ae62),
        ("KVM_SET_IRQCHIP", KVM_SET_IRQCHIP, 0x8208_ae63),
        ("KVM_SET_GSI_ROUTING", KVM_SET_GSI_ROUTING, 0x4008_ae6a),
        ("KVM_IRQFD", KVM_IRQFD, 0x4020_ae76),
        ("KVM_IOEVENTFD", KVM_IOEVENTFD, 0x4040_ae79),
        ("KVM_SET_CLOCK", KVM_SET_CLOCK, 0x4030_ae7b),
        ("KVM_GET_CLOCK", KVM_GET_CLOCK, 0x8030_ae7c),
        ("KVM_RUN", KVM_RUN, 0x0000_ae80),
        ("KVM_GET_REGS", KVM_GET_REGS, 0x8090_ae81),
        ("KVM_SET_REGS", KVM_SET_REGS, 0x4090_ae82),
        ("KVM_GET_SREGS", KVM_GET_SREGS, 0x8138_ae83),
        ("KVM_SET_SREGS", KVM_SET_SREGS, 0x4138_ae84),
        ("KVM_GET_MSRS", KVM_GET_MSRS, 0xc008_ae88),
        ("KVM_SET_MSRS", KVM_SET_MSRS, 0x4008_ae89),
        ("KVM_GET_FPU", KVM_GET_FPU, 0x81a0_ae8c),
        ("KVM_SET_FPU", KVM_SET_FPU, 0x41a0_ae8d),
        ("KVM_GET_LAPIC", KVM_GET_LAPIC, 0x8400_ae8e),
        ("KVM_SET_LAPIC", KVM_SET_LAPIC, 0x4400_ae8f),
        ("KVM_SET_CPUID2", KVM_SET_CPUID2, 0x4008_ae90),
        ("KVM_GET_CPUID2", KVM_GET_CPUID2, 0xc008_ae91),
        ("KVM_GET_MP_STATE", KVM_GET_MP_STATE, 0x8004_ae98),
        ("KVM_SET_MP_STATE", KVM_SET_MP_STATE, 0x4004_ae99),
        ("KVM_NMI", KVM_NMI, 0x0000_ae9a),
        ("KVM_GET_VCPU_EVENTS", KVM_GET_VCPU_EVENTS, 0x8040_ae9f),
        ("KVM_SET_VCPU_EVENTS", KVM_SET_VCPU_EVENTS, 0x4040_aea0),
        ("KVM_GET_DEBUGREGS", KVM_GET_DEBUGREGS, 0x8080_aea1),
        ("KVM_SET_DEBUGREGS", KVM_SET_DEBUGREGS, 0x4080_aea2),
        ("KVM_SET_TSC_KHZ", KVM_SET_TSC_KHZ, 0x0000_aea2),
        ("KVM_GET_TSC_KHZ", KVM_GET_TSC_KHZ, 0x0000_aea3),
        ("KVM_GET_XSAVE", KVM_GET_XSAVE, 0x9000_aea4),
        ("KVM_SET_XSAVE", KVM_SET_XSAVE, 0x5000_aea5),
        ("KVM_GET_XCRS", KVM_GET_XCRS, 0x8188_aea6),
        ("KVM_SET_XCRS", KVM_SET_XCRS, 0x4188_aea7),
        ("UFFDIO_API", dev(uffd::UFFDIO_API), 0xc018_aa3f),
        ("UFFDIO_REGISTER", dev(uffd::UFFDIO_REGISTER), 0xc020_aa00),
        ("UFFDIO_WAKE", dev(uffd::UFFDIO_WAKE), 0x8010_aa02),
        ("UFFDIO_ZEROPAGE", dev(uffd::UFFDIO_ZEROPAGE), 0xc020_aa04),
        ("UFFDIO_COPY", dev(uffd::UFFDIO_COPY), 0xc028_aa03),
        (
            "UFFDIO_WRITEPROTECT",
            dev(uffd::UFFDIO_WRITEPROTECT),
            0xc018_aa06,
        ),
        (
            "USERFAULTFD_IOC_NEW",
            dev(uffd::USERFAULTFD_IOC_NEW),
            0x0000_aa00,
        ),
        ("PAGEMAP_SCAN", dev(pagemap::PAGEMAP_SCAN), 0xc060_6610),
    ];
    for (name, ours, header) in known {
        assert_eq!(
            ours, header,
            "{name}: {ours:#x} vs the header's {header:#x}"
        );
    }
    // Every request of every table is one of those, or a libc terminal or
    // socket request.
    let libc_ones = [
        libc::TCGETS,
        libc::TCSETS,
        libc::TIOCGPTN,
        libc::TIOCSPTLCK,
        libc::FIONBIO,
    ]
    .map(|r| r as u32);
    for kind in ThreadKind::ALL {
        for r in ioctls(kind) {
            assert!(
                known.iter().any(|k| k.1 == r) || libc_ones.contains(&r),
                "{kind:?}: {r:#x} is checked nowhere"
            );
        }
    }
}

#[test]
fn each_table_holds_what_its_code_paths_make() {
    let has = |kind, names: &[(&str, u32)]| {
        let t = ioctls(kind);
        for (name, r) in names {
            assert!(t.contains(r), "{kind:?} lacks {name}");
        }
    };
    // A vCPU runs, takes NMIs, programs MSI-X routes and moves BARs, and
    // captures and restores its state (snapshot/cpu_state.rs: every ioctl
    // of VcpuState::capture and VcpuState::restore).
    has(
        ThreadKind::Vcpu,
        &[
            ("KVM_RUN", KVM_RUN),
            ("KVM_NMI", KVM_NMI),
            ("KVM_SET_GSI_ROUTING", KVM_SET_GSI_ROUTING),
            ("KVM_IOEVENTFD", KVM_IOEVENTFD),
            ("KVM_GET_MSRS", KVM_GET_MSRS),
            ("KVM_GET_MP_STATE", KVM_GET_MP_STATE),
            ("KVM_GET_CPUID2", KVM_GET_CPUID2),
            ("KVM_GET_TSC_KHZ", KVM_GET_TSC_KHZ),
            ("KVM_GET_REGS", KVM_GET_REGS),
            ("KVM_GET_SREGS", KVM_GET_SREGS),
            ("KVM_GET_FPU", KVM_GET_FPU),
            ("KVM_GET_XSAVE", KVM_GET_XSAVE),
            ("KVM_GET_XCRS", KVM_GET_XCRS),
            ("KVM_GET_LAPIC", KVM_GET_LAPIC),
            ("KVM_GET_DEBUGREGS", KVM_GET_DEBUGREGS),
            ("KVM_GET_VCPU_EVENTS", KVM_GET_VCPU_EVENTS),
            ("KVM_SET_CPUID2", KVM_SET_CPUID2),
            ("KVM_SET_TSC_KHZ", KVM_SET_TSC_KHZ),
            ("KVM_SET_SREGS", KVM_SET_SREGS),
            ("KVM_SET_REGS", KVM_SET_REGS),
            ("KVM_SET_FPU", KVM_SET_FPU),
            ("KVM_SET_XSAVE", KVM_SET_XSAVE),
            ("KVM_SET_XCRS", KVM_SET_XCRS),
            ("KVM_SET_LAPIC", KVM_SET_LAPIC),
            ("KVM_SET_MSRS", KVM_SET_MSRS),
            ("KVM_SET_DEBUGREGS", KVM_SET_DEBUGREGS),
            ("KVM_SET_MP_STATE", KVM_SET_MP_STATE),
            ("KVM_SET_VCPU_EVENTS", KVM_SET_VCPU_EVENTS),
        ],
    );
    // A barrier on the queue thread scans and re-protects written pages.
    has(
        ThreadKind::PmemQueue,
        &[
            ("PAGEMAP_SCAN", dev(pagemap::PAGEMAP_SCAN)),
            ("UFFDIO_WRITEPROTECT", dev(uffd::UFFDIO_WRITEPROTECT)),
            ("UFFDIO_REGISTER", dev(uffd::UFFDIO_REGISTER)),
        ],
    );
    // The monitor fills holes and wakes the faulting threads.
    has(
        ThreadKind::PmemFault,
        &[
            ("UFFDIO_ZEROPAGE", dev(uffd::UFFDIO_ZEROPAGE)),
            ("UFFDIO_COPY", dev(uffd::UFFDIO_COPY)),
            ("UFFDIO_WAKE", dev(uffd::UFFDIO_WAKE)),
            ("UFFDIO_REGISTER", dev(uffd::UFFDIO_REGISTER)),
        ],
    );
    // The VMM thread: every other kind's (inherited filters stack), and its
    // own set-up, VM state, userfaultfd set-up and terminal requests.
    let vmm = ioctls(ThreadKind::Vmm);
    for kind in ThreadKind::ALL {
        for r in ioctls(kind) {
            assert!(vmm.contains(&r), "{kind:?}'s {r:#x} not in the VMM's");
        }
    }
    has(
        ThreadKind::Vmm,
        &[
            ("KVM_CREATE_VM", KVM_CREATE_VM),
            ("KVM_GET_IRQCHIP", KVM_GET_IRQCHIP),
            ("KVM_SET_CLOCK", KVM_SET_CLOCK),
            ("UFFDIO_API", dev(uffd::UFFDIO_API)),
            ("USERFAULTFD_IOC_NEW", dev(uffd::USERFAULTFD_IOC_NEW)),
            ("TCSETS", tty(libc::TCSETS)),
            ("FIONBIO", tty(libc::FIONBIO)),
        ],
    );
    // Narrow stays narrow: only the VMM creates VMs and vCPUs or opens
    // userfaultfds; nothing but the VMM touches a terminal.
    for kind in ThreadKind::ALL {
        let t = ioctls(kind);
        for r in [
            KVM_CREATE_VM,
            KVM_CREATE_VCPU,
            dev(uffd::UFFDIO_API),
            tty(libc::TCSETS),
        ] {
            assert_eq!(t.contains(&r), kind == ThreadKind::Vmm, "{kind:?} {r:#x}");
        }
    }
    for kind in [
        ThreadKind::HttpApi,
        ThreadKind::Chardev,
        ThreadKind::EventMonitor,
        ThreadKind::PcowPool,
    ] {
        assert!(ioctls(kind).is_empty(), "{kind:?}");
    }
}

#[test]
fn the_device_hook_installs_the_fault_and_pool_lists() {
    // Each in a forked child, where init (which allocates: glibc's malloc
    // is usable after a fork, its locks reset in the child) sets the mode
    // for that child alone.
    for (thread, kind) in [
        (DeviceThread::Fault, ThreadKind::PmemFault),
        (DeviceThread::Pool, ThreadKind::PcowPool),
    ] {
        let ended = in_child(|| {
            if init(Seccomp::True).is_err() {
                return 3;
            }
            if device_thread_hook().run(thread).is_err() {
                return 4;
            }
            // Neither list opens files or sockets.
            // SAFETY: openat with a constant, NUL-terminated path.
            unsafe { libc::openat(libc::AT_FDCWD, c"/".as_ptr(), libc::O_RDONLY) };
            6
        });
        assert_eq!(
            ended.killed_by(),
            Some(libc::SIGSYS),
            "{kind:?}: exit {:?} {}",
            ended.exit_code(),
            ended.stderr
        );
        let want = format!(
            "a thread of kind {} made system call {}",
            kind.name(),
            libc::SYS_openat
        );
        assert!(ended.stderr.contains(&want), "{kind:?}: {}", ended.stderr);
    }
    // Without init the hook installs nothing (the device crate's own
    // tests, in-process users).
    let ended = in_child(|| {
        if device_thread_hook().run(DeviceThread::Pool).is_err() {
            return 3;
        }
        // SAFETY: openat with a constant, NUL-terminated path.
        let fd = unsafe { libc::openat(libc::AT_FDCWD, c"/".as_ptr(), libc::O_RDONLY) };
        if fd >= 0 {
            7
        } else {
            8
        }
    });
    assert_eq!(ended.exit_code(), Some(7), "{}", ended.stderr);
}
