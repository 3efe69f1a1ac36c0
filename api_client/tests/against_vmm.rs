//! `ch-remote` against the real `cloud-hypervisor` (both built by
//! `cargo test --workspace` into the same directory): every command once,
//! on a VM whose guest is a halting PVH stub (the host's emulating KVM runs
//! it), and the images checked with `pcow-img` afterwards.
//!
//! Skipped, and saying so, when the VMM binaries were not built (`cargo
//! test -p api_client` alone) or there is no /dev/kvm; under CI a skip
//! fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn skip(why: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "this test must run under CI: {why}"
    );
    println!("SKIPPED: {why}");
}

fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_ch-remote"))
        .parent()
        .expect("binary directory")
        .to_owned()
}

/// The halting PVH stub: an ELF with an XEN_ELFNOTE_PHYS32_ENTRY note
/// whose code is `hlt; jmp hlt`.
fn halting_kernel(path: &Path) {
    const LOAD: u64 = 0x10_0000;
    let code = [0xf4u8, 0xeb, 0xfd];
    let mut e = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    e.extend_from_slice(&1u32.to_le_bytes());
    for v in [LOAD, 64, 0] {
        e.extend_from_slice(&v.to_le_bytes()); // entry, phoff, shoff
    }
    e.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 2, 64, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    for (ty, fl, off, addr, len, al) in [
        (1u32, 5u32, 0x1000u64, LOAD, code.len() as u64, 0x1000u64), // PT_LOAD
        (4, 4, 176, 0, 20, 4),                                       // PT_NOTE
    ] {
        e.extend_from_slice(&ty.to_le_bytes());
        e.extend_from_slice(&fl.to_le_bytes());
        for v in [off, addr, addr, len, len, al] {
            e.extend_from_slice(&v.to_le_bytes());
        }
    }
    for v in [4u32, 4, 18] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(b"Xen\0");
    e.extend_from_slice(&(LOAD as u32).to_le_bytes());
    e.resize(0x1000, 0);
    e.extend_from_slice(&code);
    std::fs::write(path, e).expect("write the stub kernel");
}

struct Vmm(Child);

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn ch(sock: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ch-remote"))
        .arg("--api-socket")
        .arg(sock)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ch-remote")
}

/// `create` with the config on standard input, as upstream's default.
fn create_from_stdin(sock: &Path, config: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_ch-remote"))
        .arg("--api-socket")
        .arg(sock)
        .arg("create")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ch-remote");
    let mut pipe = child.stdin.take().expect("stdin");
    pipe.write_all(config.as_bytes()).expect("write the config");
    drop(pipe);
    child.wait_with_output().expect("wait for ch-remote")
}

/// Runs a command that must succeed; returns its stdout.
fn ok(sock: &Path, args: &[&str]) -> String {
    let o = ch(sock, args);
    assert!(
        o.status.success(),
        "ch-remote {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs a command that must fail; returns its stderr.
fn fails(sock: &Path, args: &[&str], needle: &str) {
    let o = ch(sock, args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "ch-remote {args:?}: {err}");
    assert!(err.contains(needle), "ch-remote {args:?}: {err}");
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

#[test]
fn every_command_against_the_vmm() {
    let dir_bin = bin_dir();
    let (vmm_bin, img_bin) = (dir_bin.join("cloud-hypervisor"), dir_bin.join("pcow-img"));
    if !vmm_bin.exists() || !img_bin.exists() {
        return skip("cloud-hypervisor or pcow-img not built (run cargo test --workspace)");
    }
    if !Path::new("/dev/kvm").exists() {
        return skip("no /dev/kvm");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let p = |n: &str| dir.path().join(n);
    let s = |n: &str| p(n).to_string_lossy().into_owned();
    halting_kernel(&p("vmlinux"));
    for img in ["a.pcow", "b.pcow"] {
        let st = Command::new(&img_bin)
            .args(["create", &s(img), "4M"])
            .output()
            .expect("pcow-img create");
        assert!(st.status.success());
    }
    let sock = p("api.sock");
    let _vmm = Vmm(Command::new(&vmm_bin)
        .arg("--api-socket")
        .arg(format!("path={}", sock.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn cloud-hypervisor"));
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(20), "no API socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    let sock = sock.as_path();

    let ping = json(&ok(sock, &["ping"]));
    assert!(ping["pid"].as_u64().is_some(), "{ping}");
    fails(sock, &["info"], "VM is not created");
    let config = serde_json::json!({
        "payload": {"kernel": s("vmlinux")},
        "memory": {"size": 64 << 20},
        "pmem": [{"file": s("a.pcow"), "id": "p0"}],
        "serial": {"mode": "Null"},
        "console": {"mode": "Off"},
    });
    std::fs::write(p("vm.json"), config.to_string()).unwrap();
    let created = create_from_stdin(sock, &config.to_string());
    assert!(
        created.status.success() && created.stdout.is_empty(),
        "create from stdin: {}",
        String::from_utf8_lossy(&created.stderr)
    );
    fails(sock, &["create", &s("vm.json")], "already created");
    ok(sock, &["add-pmem", &format!("file={},id=p1", s("b.pcow"))]);
    ok(sock, &["remove-device", "p1"]);
    ok(sock, &["add-pmem", &format!("file={},id=p1", s("b.pcow"))]);
    assert_eq!(json(&ok(sock, &["info"]))["state"], "Created");
    ok(sock, &["boot"]);
    fails(sock, &["remove-device", "p1"], "hot-unplug");
    ok(sock, &["pause"]);
    assert_eq!(json(&ok(sock, &["info"]))["state"], "Paused");
    ok(sock, &["resume"]);
    let snap = json(&ok(sock, &["pmem-snapshot", "id=p0,tag=first"]));
    assert_eq!(snap["snapshot"]["tag"], "first");
    fails(sock, &["pmem-snapshot", "id=p0,tag=first"], "first");
    let flush = json(&ok(sock, &["pmem-flush", "p0"]));
    assert_eq!(flush["id"], "p0");
    let info = json(&ok(sock, &["pmem-info"]));
    assert_eq!(info[0]["snapshots"][0]["tag"], "first");
    assert_eq!(info[1]["id"], "p1");
    fails(sock, &["pmem-rollback", "id=p0,snapshot=first"], "reset");
    let rb = json(&ok(
        sock,
        &["pmem-rollback", "id=p0,snapshot=first,reset=on"],
    ));
    assert_eq!(rb["snapshot"]["tag"], "first");
    let ov = json(&ok(
        sock,
        &["pmem-overlay", &format!("id=p0,file={}", s("ov.pcow"))],
    ));
    assert_eq!(ov["base"], "a.pcow");
    ok(sock, &["pmem-snapshot", "id=p0,tag=on-overlay"]);
    ok(sock, &["pmem-snapshot-delete", "id=p0,snapshot=on-overlay"]);
    fails(
        sock,
        &["pmem-snapshot-delete", "id=p0,snapshot=on-overlay"],
        "on-overlay",
    );
    fails(sock, &["pmem-flush", "nope"], "nope");
    ok(sock, &["reboot"]);
    ok(sock, &["shutdown"]);
    assert_eq!(json(&ok(sock, &["info"]))["state"], "Created");
    ok(sock, &["pmem-snapshot", "id=p1,tag=offline"]);
    ok(sock, &["delete"]);
    fails(sock, &["info"], "VM is not created");
    ok(sock, &["shutdown-vmm"]);

    // The images: clean, with what the commands made of them.
    for img in ["a.pcow", "b.pcow", "ov.pcow"] {
        let o = Command::new(&img_bin)
            .args(["check", &s(img)])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "pcow-img check {img}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    let o = Command::new(&img_bin)
        .args(["info", "--output", "json", &s("b.pcow")])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("offline"));
    let o = Command::new(&img_bin)
        .args(["info", "--output", "json", "--backing-chain", &s("ov.pcow")])
        .output()
        .unwrap();
    let chain = String::from_utf8_lossy(&o.stdout);
    assert!(
        chain.contains("a.pcow") && chain.contains("first"),
        "{chain}"
    );
}
