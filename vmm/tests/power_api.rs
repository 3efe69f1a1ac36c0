//! `vm.power-button` and `vm.nmi` through the `cloud-hypervisor` binary's
//! API socket, in every VM state, with the halting PVH stub as the guest
//! (the host's emulating KVM runs it).
//!
//! The stub has no interrupt handlers (its IDT has one empty entry), so an
//! NMI it takes is a triple fault, which the VMM treats as a guest reset:
//! the VMM's log line `guest started (boot N)` is how the test sees that
//! the NMI reached the guest, and that a paused guest takes it only at the
//! resume. The stub ignores the power button (it has no ACPI); the button's
//! effect on a real Linux guest is the nested sandbox's scenario 14.
//!
//! Without a booted VM both answer upstream's 500 "VM is not running".

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::{call, halting_kernel};

const BIN: &str = env!("CARGO_BIN_EXE_cloud-hypervisor");
const MIB: u64 = 1 << 20;
/// How long the VMM gets for a guest reset to show in its log.
const RESET_DEADLINE: Duration = Duration::from_secs(20);

fn ok(sock: &Path, action: &str) {
    let (st, body) = call(sock, "PUT", action, None);
    assert_eq!(st, 204, "{action}: {body}");
}

/// An error answer whose chain mentions one of `needles`.
fn refused(sock: &Path, action: &str, statuses: &[u16], needles: &[&str]) {
    let (st, body) = call(sock, "PUT", action, None);
    assert!(statuses.contains(&st), "{action}: status {st}: {body}");
    assert!(
        needles.iter().any(|n| body.contains(n)),
        "{action}: should mention one of {needles:?}: {body}"
    );
}

fn state(sock: &Path) -> String {
    let (st, body) = call(sock, "GET", "vm.info", None);
    assert_eq!(st, 200, "vm.info: {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["state"].as_str().unwrap_or_default().to_owned()
}

struct Vmm {
    child: Child,
    dir: tempfile::TempDir,
    sock: PathBuf,
    log: PathBuf,
}

impl Vmm {
    fn start() -> Option<Vmm> {
        if !Path::new("/dev/kvm").exists() {
            assert!(std::env::var_os("CI").is_none(), "no /dev/kvm under CI");
            println!("SKIPPED: no /dev/kvm");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let log = dir.path().join("vmm.log");
        let child = Command::new(BIN)
            .args(["--api-socket", &format!("path={}", sock.display()), "-v"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn");
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(t0.elapsed() < Duration::from_secs(20), "no API socket");
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(Vmm {
            child,
            dir,
            sock,
            log,
        })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log has `line`.
    fn wait_log(&self, line: &str) {
        let t0 = Instant::now();
        while !self.log().contains(line) {
            assert!(
                t0.elapsed() < RESET_DEADLINE,
                "no {line:?} in the VMM log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn power_button_and_nmi_in_every_state() {
    let _serial = common::serial();
    let Some(mut v) = Vmm::start() else { return };
    let sock = v.sock.clone();
    let sock = sock.as_path();
    let kernel = v.dir.path().join("vmlinux");
    halting_kernel(&kernel);

    // No VM, then Created: nothing to press, nothing to interrupt.
    for action in ["vm.power-button", "vm.nmi"] {
        refused(sock, action, &[500], &["VM is not running"]);
        let (st, body) = call(sock, "GET", action, None);
        assert!((400..500).contains(&st), "GET {action}: {st} {body}");
        let (st, body) = call(sock, "PUT", action, Some(&json!({"x": 1})));
        assert_eq!(st, 400, "{action} with a body: {body}");
    }
    let config = json!({
        "payload": {"kernel": kernel},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
        "memory": {"size": 64 * MIB},
        "serial": {"mode": "Null"},
        "console": {"mode": "Off"},
    });
    let (st, body) = call(sock, "PUT", "vm.create", Some(&config));
    assert_eq!(st, 204, "vm.create: {body}");
    for action in ["vm.power-button", "vm.nmi"] {
        refused(sock, action, &[500], &["VM is not running"]);
    }

    ok(sock, "vm.boot");
    v.wait_log("guest started (boot 1)");
    // Running: the stub ignores the button and keeps running.
    ok(sock, "vm.power-button");
    v.wait_log("ACPI power button pressed");
    assert_eq!(state(sock), "Running");
    // The NMI reaches the guest: the stub has no handler, triple-faults,
    // and the VMM boots it again.
    ok(sock, "vm.nmi");
    v.wait_log("NMI injected into 2 vCPU(s)");
    v.wait_log("guest started (boot 2)");
    assert_eq!(state(sock), "Running");

    // Paused: both answer; the NMI waits for the resume.
    ok(sock, "vm.pause");
    ok(sock, "vm.power-button");
    ok(sock, "vm.nmi");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !v.log().contains("(boot 3)"),
        "a paused guest took the NMI:\n{}",
        v.log()
    );
    assert_eq!(state(sock), "Paused");
    ok(sock, "vm.resume");
    v.wait_log("guest started (boot 3)");

    // Shut down (Created again, as upstream): refused again.
    ok(sock, "vm.shutdown");
    assert_eq!(state(sock), "Created");
    for action in ["vm.power-button", "vm.nmi"] {
        refused(sock, action, &[500], &["VM is not running"]);
    }
    let (st, _) = call(sock, "PUT", "vmm.shutdown", None);
    assert_eq!(st, 200, "vmm.shutdown");
    let t0 = Instant::now();
    let code = loop {
        if let Some(s) = v.child.try_wait().unwrap() {
            break s.code();
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "VMM did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code, Some(0), "VMM log:\n{}", v.log());
}
