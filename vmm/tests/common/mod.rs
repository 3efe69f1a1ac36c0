//! Fixtures shared by the binary's tests.
#![allow(dead_code)] // each test binary uses a part

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use serde_json::Value;

/// Serializes the tests of one binary. A test that spawns the VMM forks,
/// and a forked child holds the parent's open files, and so their flock
/// locks, until it execs: an image another test thread has open at that
/// moment looks locked to whoever opens it next (the VMM, or the test
/// itself). One test at a time removes that race.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes the library's halting PVH stub kernel
/// ([`vmm::testguest::write_halting_pvh_kernel`]) to `path`.
pub fn halting_kernel(path: &Path) {
    vmm::testguest::write_halting_pvh_kernel(path).expect("write the halting kernel");
}

/// One request on a new connection: (status, head, body).
pub fn exchange(sock: &Path, raw: &[u8]) -> (u16, String, String) {
    let mut s = UnixStream::connect(sock).expect("connect to the API socket");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(raw).expect("send");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    // Read the head, then Content-Length bytes.
    let (head_end, len) = loop {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "connection closed before a response: {out:?}");
        out.extend_from_slice(&buf[..n]);
        if let Some(p) = out.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&out[..p]).to_string();
            let len = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                })
                .unwrap_or(0);
            break (p + 4, len);
        }
    };
    while out.len() < head_end + len {
        let n = s.read(&mut buf).expect("read body");
        assert!(n > 0, "connection closed in the body");
        out.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&out[..head_end]).to_string();
    let status = head[9..12].parse().expect("status code");
    if len > 0 {
        assert!(
            head.contains("Content-Type: application/json"),
            "JSON content type: {head}"
        );
    }
    (
        status,
        head,
        String::from_utf8_lossy(&out[head_end..head_end + len]).to_string(),
    )
}

pub fn call(sock: &Path, method: &str, action: &str, body: Option<&Value>) -> (u16, String) {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let raw = format!(
        "{method} /api/v1/{action} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (status, _, body) = exchange(sock, raw.as_bytes());
    (status, body)
}

/// An error and its causes on one line (the workspace's format).
pub fn chain(e: &dyn std::error::Error) -> String {
    error_report::chain(e)
}

/// A VM with `ram_size` bytes of RAM, or `None` (printed as SKIPPED) when
/// KVM is not usable here. Under CI a `/dev/kvm` that exists must work.
pub fn vm_or_skip(test: &str, ram_size: u64) -> Option<vmm::vm::Vm> {
    vm_with_log_or_skip(test, ram_size, vmm::dirty_log::LogChoice::default())
}

/// [`vm_or_skip`] with the VM's logged slots read as `choice` says.
pub fn vm_with_log_or_skip(
    test: &str,
    ram_size: u64,
    choice: vmm::dirty_log::LogChoice,
) -> Option<vmm::vm::Vm> {
    use vmm::vm::{Vm, VmConfig, VmError};
    match Vm::new_with_log(&VmConfig { ram_size }, choice) {
        Ok(vm) => Some(vm),
        Err(e) => {
            let dev = Path::new("/dev/kvm").exists();
            if dev && std::env::var_os("CI").is_some() {
                panic!(
                    "{test}: /dev/kvm exists but does not work under CI: {}",
                    chain(&e)
                );
            }
            if !matches!(e, VmError::OpenKvm(_)) && dev {
                eprintln!("{test}: note: /dev/kvm opened but the VM failed");
            }
            println!("SKIPPED: no /dev/kvm ({})", chain(&e));
            None
        }
    }
}

/// Whether userfaultfd can be opened here; a test that needs it prints
/// SKIPPED with the reason and returns when it cannot, and fails under CI.
pub fn uffd_or_skip(test: &str) -> bool {
    match virtio_pmem_pcow::Uffd::new() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var_os("CI").is_some() {
                panic!("{test}: userfaultfd unavailable under CI: {}", chain(&e));
            }
            println!("SKIPPED: {test}: userfaultfd unavailable ({})", chain(&e));
            false
        }
    }
}

/// The test guest's report port: every 4-byte write to `TEST_PORT` is a
/// report; reads answer 0 (the guest never halts on its own).
#[derive(Clone, Default)]
pub struct Port(pub std::sync::Arc<Mutex<Vec<vmm::testguest::Report>>>);

impl vmm::vcpu::PortIo for Port {
    fn io_out(&mut self, port: u16, data: &[u8]) {
        if port == vmm::testguest::TEST_PORT && data.len() == 4 {
            let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
            self.0
                .lock()
                .unwrap()
                .push(vmm::testguest::Report::decode(v));
        }
    }

    fn io_in(&mut self, _port: u16, data: &mut [u8]) {
        data.fill(0);
    }
}
