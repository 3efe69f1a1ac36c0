//! The VMM's outputs and inherited descriptors, as orchestrators use them:
//! `--api-socket fd=N` (a listening socket the parent bound), `--event-monitor
//! path=|fd=` (upstream's event objects, one per lifecycle step) and
//! `--log-file`. The guest is the halting PVH stub on the host's KVM.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::halting_kernel;

const BIN: &str = env!("CARGO_BIN_EXE_cloud-hypervisor");

/// `fd` stays open across the next exec.
fn inheritable(fd: RawFd) {
    // SAFETY: F_SETFD with no flags on an fd this test owns.
    assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }, 0);
}

fn call(sock: &Path, method: &str, action: &str, body: Option<&Value>) -> u16 {
    let mut s = UnixStream::connect(sock).expect("connect");
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} /api/v1/{action} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out[9..12].parse().unwrap()
}

fn wait_exit(child: &mut Child) -> Option<i32> {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st.code();
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "VMM did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The events of a monitor's output: pretty JSON objects, each followed by
/// an empty line.
fn events(text: &str) -> Vec<(String, String)> {
    text.split("\n\n")
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            let v: Value = serde_json::from_str(t).unwrap_or_else(|e| panic!("{e}: {t:?}"));
            for k in ["timestamp", "source", "event", "properties"] {
                assert!(v.get(k).is_some(), "{k} in {v}");
            }
            assert!(v["timestamp"]["secs"].is_u64(), "{v}");
            (
                v["source"].as_str().unwrap().to_owned(),
                v["event"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn inherited_api_socket_event_monitor_and_log_file() {
    let _serial = common::serial();
    if !Path::new("/dev/kvm").exists() {
        assert!(std::env::var_os("CI").is_none(), "no /dev/kvm under CI");
        println!("SKIPPED: no /dev/kvm");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    inheritable(listener.as_raw_fd());
    let kernel = dir.path().join("vmlinux");
    halting_kernel(&kernel);
    let events_path = dir.path().join("events.json");
    let log_path = dir.path().join("vmm.log");
    let mut child = Command::new(BIN)
        .arg("--api-socket")
        .arg(format!("fd={}", listener.as_raw_fd()))
        .arg("--event-monitor")
        .arg(format!("path={}", events_path.display()))
        .arg("--log-file")
        .arg(&log_path)
        .arg("-v")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The VMM serves the socket this process bound; ours is only a copy.
    drop(listener);
    let config = json!({
        "payload": {"kernel": kernel},
        "memory": {"size": 64 << 20},
        "serial": {"mode": "Null"},
        "console": {"mode": "Off"},
    });
    assert_eq!(call(&sock, "PUT", "vm.create", Some(&config)), 204);
    for action in [
        "vm.boot",
        "vm.pause",
        "vm.resume",
        "vm.reboot",
        "vm.shutdown",
        "vm.delete",
    ] {
        assert_eq!(call(&sock, "PUT", action, None), 204, "{action}");
    }
    assert_eq!(call(&sock, "PUT", "vmm.shutdown", None), 200);
    assert_eq!(wait_exit(&mut child), Some(0));
    // The socket file was the parent's: the VMM leaves it where it was.
    assert!(sock.exists());

    let got = events(&std::fs::read_to_string(&events_path).unwrap());
    let names: Vec<String> = got.iter().map(|(s, e)| format!("{s} {e}")).collect();
    let want = [
        "vmm starting",
        "vm booting",
        "vm booted",
        "vm pausing",
        "vm paused",
        "vm resuming",
        "vm resumed",
        "vm rebooting",
        "vm shutdown",
        "vm booting",
        "vm booted",
        "vm rebooted",
        "vm shutdown",
        "vm deleted",
        "vmm shutdown",
    ];
    assert_eq!(names, want);
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(log.contains("inherited fd"), "{log}");
    assert!(
        log.contains("--seccomp true: each thread installs its seccomp filter"),
        "{log}"
    );
}

#[test]
fn event_monitor_on_an_inherited_pipe() {
    let _serial = common::serial();
    let mut fds = [0; 2];
    // SAFETY: pipe writes two fds into the array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both fds were just created and are owned here alone.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    inheritable(w.as_raw_fd());
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let mut child = Command::new(BIN)
        .arg("--api-socket")
        .arg(format!("path={}", sock.display()))
        .arg("--event-monitor")
        .arg(format!("fd={}", w.as_raw_fd()))
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    drop(w);
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(20), "no API socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(call(&sock, "PUT", "vmm.shutdown", None), 200);
    assert_eq!(wait_exit(&mut child), Some(0));
    let mut text = String::new();
    std::fs::File::from(r).read_to_string(&mut text).unwrap();
    let got = events(&text);
    assert_eq!(
        got,
        [
            ("vmm".to_owned(), "starting".to_owned()),
            ("vmm".to_owned(), "shutdown".to_owned())
        ]
    );
}

/// Descriptors that are not what the option needs: one clear line, exit 1.
#[test]
fn bad_descriptors_and_paths_are_refused() {
    let _serial = common::serial();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let plain = std::fs::File::open(&file).unwrap();
    inheritable(plain.as_raw_fd());
    let not_listening = UnixStream::pair().unwrap().0;
    inheritable(not_listening.as_raw_fd());
    let cases = [
        (vec!["--api-socket".to_owned(), "fd=987".into()], "fd 987"),
        (
            vec!["--api-socket".into(), format!("fd={}", plain.as_raw_fd())],
            "not a socket",
        ),
        (
            vec![
                "--api-socket".into(),
                format!("fd={}", not_listening.as_raw_fd()),
            ],
            "not listening",
        ),
        (
            vec![
                "--api-socket".into(),
                format!("path={}", dir.path().join("s").display()),
                "--event-monitor".into(),
                "fd=986".into(),
            ],
            "not an open file descriptor",
        ),
        (
            vec![
                "--api-socket".into(),
                format!("path={}", dir.path().join("s").display()),
                "--event-monitor".into(),
                format!("path={}", dir.path().join("no/such/dir").display()),
            ],
            "--event-monitor path=",
        ),
        (
            vec![
                "--api-socket".into(),
                format!("path={}", dir.path().join("s").display()),
                "--log-file".into(),
                dir.path().join("no/such/log").display().to_string(),
            ],
            "--log-file",
        ),
    ];
    for (args, needle) in cases {
        let out = Command::new(BIN)
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    }
}
