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
        libc::SYS_ioctl,
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
