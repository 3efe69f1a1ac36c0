//! `--landlock` through the binary: the halting PVH stub on a pcow pmem
//! image, the VMM confined at boot. An overlay beside the image works, one
//! in another directory is refused naming the path and Landlock; a
//! snapshot into a directory given with `--landlock-rules` works, one
//! elsewhere is refused. A second VM in a confined process (after
//! `vm.delete`) whose files lie outside the rules kept is refused up front,
//! naming the path; the API and event-monitor threads keep working once
//! they confined themselves. A snapshot of a confined VM restores confined
//! (`vm.restore` and `--restore`): a clone outside the rules is refused
//! with nothing created, one inside works, and what the restored VMM is
//! later asked to create outside is refused. (The kernel's own refusal,
//! and a following thread's, are tested in `landlock_rules::tests`.)

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pcow::{CreateOptions, Image};
use serde_json::{json, Value};

mod common;
use common::{call, halting_kernel};

const BIN: &str = env!("CARGO_BIN_EXE_cloud-hypervisor");
const MIB: u64 = 1 << 20;

/// Whether KVM and Landlock are both here; otherwise says SKIPPED (and
/// fails under CI where the kernel lists Landlock among its LSMs).
fn kvm_and_landlock_or_skip(test: &str) -> bool {
    if !Path::new("/dev/kvm").exists() {
        assert!(std::env::var_os("CI").is_none(), "no /dev/kvm under CI");
        println!("SKIPPED {test}: no /dev/kvm");
        return false;
    }
    landlock_or_skip(test)
}

/// Whether Landlock is here; otherwise says SKIPPED (and fails under CI
/// where the kernel lists Landlock among its LSMs).
fn landlock_or_skip(test: &str) -> bool {
    if !vmm::landlock_rules::kernel_supports_landlock() {
        let listed = std::fs::read_to_string("/sys/kernel/security/lsm")
            .is_ok_and(|l| l.split(',').any(|m| m.trim() == "landlock"));
        assert!(
            !(listed && std::env::var_os("CI").is_some()),
            "Landlock is listed in /sys/kernel/security/lsm but not usable"
        );
        println!("SKIPPED {test}: this kernel has no Landlock (landlock_create_ruleset failed)");
        return false;
    }
    true
}

struct Vmm {
    child: Child,
    sock: PathBuf,
    log: PathBuf,
}

impl Vmm {
    fn start(dir: &Path, args: &[String]) -> Vmm {
        let sock = dir.join("api.sock");
        let log = dir.join("vmm.log");
        let child = Command::new(BIN)
            .args(["--api-socket", &format!("path={}", sock.display()), "-v"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn");
        let vmm = Vmm { child, sock, log };
        let t0 = Instant::now();
        while !vmm.sock.exists() {
            assert!(t0.elapsed() < Duration::from_secs(20), "{}", vmm.log());
            std::thread::sleep(Duration::from_millis(10));
        }
        vmm
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn put(&self, action: &str, body: Value) -> (u16, String) {
        call(&self.sock, "PUT", action, Some(&body))
    }

    fn state(&self) -> String {
        let (st, b) = call(&self.sock, "GET", "vm.info", None);
        assert_eq!(st, 200, "{b}\n{}", self.log());
        let v: Value = serde_json::from_str(&b).unwrap();
        v["state"].as_str().unwrap_or_default().to_owned()
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn landlock_confines_overlays_and_snapshots_to_the_rules() {
    let test = "landlock_confines_overlays_and_snapshots_to_the_rules";
    if !kvm_and_landlock_or_skip(test) {
        return;
    }
    let _serial = common::serial();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (img_dir, snap_dir, other) = (t.join("img"), t.join("snap"), t.join("other"));
    for d in [&img_dir, &snap_dir, &other] {
        std::fs::create_dir(d).unwrap();
    }
    let kernel = t.join("halt.elf");
    halting_kernel(&kernel);
    let image = img_dir.join("disk.pcow");
    let opts = CreateOptions {
        virtual_size: Some(16 * MIB),
        ..Default::default()
    };
    Image::create(&image, &opts).unwrap().close().unwrap();

    let vmm = Vmm::start(
        t,
        &[
            "--kernel".into(),
            kernel.display().to_string(),
            "--memory".into(),
            "size=64M".into(),
            "--pmem".into(),
            format!("file={},id=p0", image.display()),
            "--serial".into(),
            "null".into(),
            "--console".into(),
            "off".into(),
            "--landlock".into(),
            "--landlock-rules".into(),
            format!("path={},access=rw", snap_dir.display()),
        ],
    );
    let t0 = Instant::now();
    while vmm.state() != "Running" {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", vmm.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        vmm.log().contains("--landlock: the VMM is confined"),
        "{}",
        vmm.log()
    );

    // Beside the image: allowed.
    let ov = img_dir.join("ov.pcow");
    let (st, b) = vmm.put("vm.pmem-overlay", json!({"id": "p0", "file": ov}));
    assert_eq!(st, 200, "{b}\n{}", vmm.log());
    assert!(ov.is_file());

    // Another directory: refused, naming the path and Landlock; nothing
    // is created there.
    let out = other.join("ov2.pcow");
    let (st, b) = vmm.put("vm.pmem-overlay", json!({"id": "p0", "file": out}));
    assert_eq!(st, 500, "{b}");
    assert!(b.contains(&out.display().to_string()), "{b}");
    assert!(b.contains("Landlock"), "{b}");
    assert_eq!(std::fs::read_dir(&other).unwrap().count(), 0);

    // A snapshot into the --landlock-rules directory works (its frozen
    // pcow file goes beside the image); elsewhere it is refused.
    let (st, b) = call(&vmm.sock, "PUT", "vm.pause", None);
    assert_eq!(st, 204, "{b}");
    let (st, b) = vmm.put(
        "vm.snapshot",
        json!({"destination_url": format!("file://{}", other.display())}),
    );
    assert_eq!(st, 500, "{b}");
    assert!(
        b.contains("Landlock") && b.contains(&other.display().to_string()),
        "{b}"
    );
    let (st, b) = vmm.put(
        "vm.snapshot",
        json!({"destination_url": format!("file://{}", snap_dir.display())}),
    );
    assert_eq!(st, 204, "{b}\n{}", vmm.log());
    for f in ["config.json", "state.json", "memory-ranges"] {
        assert!(snap_dir.join(f).is_file(), "{f} missing");
    }
    let (st, b) = call(&vmm.sock, "PUT", "vm.resume", None);
    assert_eq!(st, 204, "{b}");
    assert_eq!(vmm.state(), "Running");

    // A pmem device outside the rules, added while the VM is shut down, is
    // refused naming the path and Landlock (the kernel would refuse to
    // open it at the next boot with a bare "Permission denied").
    let (st, b) = call(&vmm.sock, "PUT", "vm.shutdown", None);
    assert_eq!(st, 204, "{b}");
    let stray = other.join("stray.pcow");
    Image::create(&stray, &opts).unwrap().close().unwrap();
    let (st, b) = vmm.put("vm.add-pmem", json!({"file": stray, "id": "p1"}));
    assert_eq!(st, 500, "{b}");
    assert!(
        b.contains(&stray.display().to_string()) && b.contains("Landlock"),
        "{b}"
    );
}

/// One connection kept open across requests (HTTP/1.1 keep-alive).
struct KeepAlive {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl KeepAlive {
    fn connect(sock: &Path) -> KeepAlive {
        let stream = UnixStream::connect(sock).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        KeepAlive {
            stream,
            buf: Vec::new(),
        }
    }

    /// Sends one request and reads its answer: (status, body).
    fn request(&mut self, method: &str, action: &str, body: &str) -> (u16, String) {
        let raw = format!(
            "{method} /api/v1/{action} HTTP/1.1\r\nHost: localhost\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.stream.write_all(raw.as_bytes()).expect("send");
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(p) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..p]).to_string();
                let len: usize = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap())
                    })
                    .unwrap_or(0);
                if self.buf.len() >= p + 4 + len {
                    let body = String::from_utf8_lossy(&self.buf[p + 4..p + 4 + len]).to_string();
                    self.buf.drain(..p + 4 + len);
                    return (head[9..12].parse().unwrap(), body);
                }
            }
            let n = self.stream.read(&mut chunk).expect("read");
            assert!(n > 0, "the connection closed: {:?}", self.buf);
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// Waits for `vmm`'s VM to reach `want`.
fn wait_state(vmm: &Vmm, want: &str) {
    let t0 = Instant::now();
    while vmm.state() != want {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", vmm.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A 16 MiB pcow image at `path`, on `base` if given.
fn image(path: &Path, base: Option<&Path>) {
    let opts = CreateOptions {
        virtual_size: Some(16 * MIB),
        base: base.map(|b| pcow::BaseRef {
            name: b.to_str().unwrap().to_owned(),
            format: pcow::BaseFormat::Pcow,
        }),
        ..Default::default()
    };
    Image::create(path, &opts).unwrap().close().unwrap();
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

#[test]
fn a_second_vm_outside_the_kept_rules_is_refused_up_front() {
    let test = "a_second_vm_outside_the_kept_rules_is_refused_up_front";
    if !landlock_or_skip(test) {
        return;
    }
    let _serial = common::serial();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (a, b) = (t.join("a"), t.join("b"));
    for d in [&a, &b] {
        std::fs::create_dir(d).unwrap();
    }
    let kernel = a.join("halt.elf");
    halting_kernel(&kernel);
    let disk = a.join("disk.pcow");
    image(&disk, None);
    let events = t.join("events.json");
    let vmm = Vmm::start(
        t,
        &[
            "--event-monitor".into(),
            format!("path={}", events.display()),
        ],
    );
    let config = |pmem: &Path| {
        json!({
            "payload": {"kernel": kernel},
            "memory": {"size": 64 * MIB},
            "pmem": [{"file": pmem, "id": "p0"}],
            "serial": {"mode": "Null"},
            "console": {"mode": "Off"},
            "landlock_enable": true,
        })
    };
    // Through a keep-alive connection that was open before the VMM was
    // confined: its thread follows before its next request.
    let mut conn = KeepAlive::connect(&vmm.sock);
    let (st, body) = conn.request("PUT", "vm.create", &config(&disk).to_string());
    assert_eq!(st, 204, "{body}\n{}", vmm.log());
    assert!(vmm.log().contains("the VMM is confined"), "{}", vmm.log());
    let (st, body) = conn.request("GET", "vmm.ping", "");
    assert_eq!(st, 200, "{body}\n{}", vmm.log());
    assert!(
        vmm.log()
            .contains("API: the connection thread follows the VMM's Landlock confinement"),
        "{}",
        vmm.log()
    );
    drop(conn);

    // Files in b: a pmem device added, and after vm.delete a second VM,
    // each refused naming the path and saying why, before anything is
    // opened (a FIFO there answers at once as well).
    let in_b = b.join("disk.pcow");
    image(&in_b, None);
    let nix_fifo = b.join("fifo");
    let c = std::ffi::CString::new(nix_fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads the NUL-terminated path, which outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let (st, body) = vmm.put("vm.add-pmem", json!({"file": in_b, "id": "p1"}));
    assert_eq!(st, 500, "{body}");
    assert!(
        body.contains(&in_b.display().to_string()) && body.contains("Landlock"),
        "{body}"
    );
    let (st, body) = call(&vmm.sock, "PUT", "vm.delete", None);
    assert_eq!(st, 204, "{body}");
    for pmem in [&in_b, &nix_fifo] {
        let (st, body) = vmm.put("vm.create", config(pmem));
        assert_eq!(st, 500, "{body}");
        for needle in [
            "vm.create:",
            &pmem.display().to_string(),
            "Landlock",
            "kept for the process's life",
            "--landlock-rules",
            "new VMM process",
        ] {
            assert!(body.contains(needle), "{needle:?} in {body}");
        }
    }
    // A top inside, its base outside: the base is named.
    let top = a.join("top.pcow");
    image(&top, Some(&in_b));
    let (st, body) = vmm.put("vm.create", config(&top));
    assert_eq!(st, 500, "{body}");
    assert!(body.contains(&in_b.display().to_string()), "{body}");
    let (st, body) = call(&vmm.sock, "GET", "vm.info", None);
    assert_eq!(st, 404, "a refused create left a VM: {body}");
    // A FIFO inside the rules: the type check answers at once.
    let in_fifo = a.join("fifo");
    let c = std::ffi::CString::new(in_fifo.to_str().unwrap()).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let (st, body) = vmm.put("vm.create", config(&in_fifo));
    assert_eq!(st, 400, "{body}");
    assert!(body.contains("not a regular file"), "{body}");

    // The same files again: fine.
    let (st, body) = vmm.put("vm.create", config(&disk));
    assert_eq!(st, 204, "{body}\n{}", vmm.log());
    // The API's threads (new connections, this one's acceptor) and the
    // event monitor confined themselves and still work: the deletion
    // above was written after the VMM was confined.
    let (st, body) = call(&vmm.sock, "GET", "vmm.ping", None);
    assert_eq!(st, 200, "{body}");
    let (st, body) = call(&vmm.sock, "PUT", "vm.delete", None);
    assert_eq!(st, 204, "{body}");
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(&events).unwrap_or_default();
        if text.matches("\"deleted\"").count() == 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "events: {text}\n{}",
            vmm.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = vmm.log();
    assert!(!log.contains("cannot confine itself"), "{log}");
    for who in ["API: the acceptor", "event monitor:"] {
        assert!(
            log.contains(&format!("{who} follows the VMM's Landlock confinement")),
            "{who}: {log}"
        );
    }
}

#[test]
fn a_confined_vm_restores_confined_and_its_clones_stay_within_the_rules() {
    let test = "a_confined_vm_restores_confined_and_its_clones_stay_within_the_rules";
    if !kvm_and_landlock_or_skip(test) {
        return;
    }
    let _serial = common::serial();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (img, snap, clones, other) = (
        t.join("img"),
        t.join("snap"),
        t.join("clones"),
        t.join("other"),
    );
    for d in [&img, &snap, &clones, &other] {
        std::fs::create_dir(d).unwrap();
    }
    let kernel = img.join("halt.elf");
    halting_kernel(&kernel);
    let disk = img.join("disk.pcow");
    image(&disk, None);
    let source = Vmm::start(
        &t.join("img"),
        &[
            "--kernel".into(),
            kernel.display().to_string(),
            "--memory".into(),
            "size=64M".into(),
            "--pmem".into(),
            format!("file={},id=p0", disk.display()),
            "--serial".into(),
            "null".into(),
            "--console".into(),
            "off".into(),
            "--landlock".into(),
            "--landlock-rules".into(),
            format!("path={},access=rw", snap.display()),
            format!("path={},access=rw", clones.display()),
        ],
    );
    wait_state(&source, "Running");
    let (st, b) = call(&source.sock, "PUT", "vm.pause", None);
    assert_eq!(st, 204, "{b}");
    let (st, b) = source.put("vm.snapshot", json!({"destination_url": url(&snap)}));
    assert_eq!(st, 204, "{b}\n{}", source.log());
    drop(source);

    // Through the API, in a new process: a clone outside the rules is
    // refused naming it and Landlock, nothing created, no VM left.
    let dir_b = t.join("b");
    std::fs::create_dir(&dir_b).unwrap();
    let vmm = Vmm::start(&dir_b, &[]);
    let outside = other.join("clone.pcow");
    let (st, body) = vmm.put(
        "vm.restore",
        json!({"source_url": url(&snap), "pmem": [{"id": "p0", "file": outside}]}),
    );
    assert_eq!(st, 500, "{body}");
    assert!(
        body.contains(&outside.display().to_string()) && body.contains("Landlock"),
        "{body}"
    );
    assert!(names(&other).is_empty(), "{:?}", names(&other));
    let (st, body) = call(&vmm.sock, "GET", "vm.info", None);
    assert_eq!(st, 404, "{body}");
    // Inside: restored, paused, confined.
    let inside = clones.join("clone1.pcow");
    let (st, body) = vmm.put(
        "vm.restore",
        json!({"source_url": url(&snap), "pmem": [{"id": "p0", "file": inside}]}),
    );
    assert_eq!(st, 204, "{body}\n{}", vmm.log());
    assert_eq!(vmm.state(), "Paused");
    assert!(vmm.log().contains("the VMM is confined"), "{}", vmm.log());
    let ov = other.join("ov.pcow");
    let (st, body) = vmm.put("vm.pmem-overlay", json!({"id": "p0", "file": ov}));
    assert_eq!(st, 500, "{body}");
    assert!(
        body.contains(&ov.display().to_string()) && body.contains("Landlock"),
        "{body}"
    );
    let (st, body) = vmm.put("vm.snapshot", json!({"destination_url": url(&other)}));
    assert_eq!(st, 500, "{body}");
    assert!(body.contains("Landlock"), "{body}");
    assert!(names(&other).is_empty(), "{:?}", names(&other));
    // Within the rules the restored VM works on.
    let snap2 = clones.join("snap2");
    std::fs::create_dir(&snap2).unwrap();
    let (st, body) = vmm.put("vm.snapshot", json!({"destination_url": url(&snap2)}));
    assert_eq!(st, 204, "{body}\n{}", vmm.log());
    let (st, body) = call(&vmm.sock, "PUT", "vm.resume", None);
    assert_eq!(st, 204, "{body}");
    assert_eq!(vmm.state(), "Running");
    drop(vmm);

    // `--restore`: outside, the VMM ends at once with the error; inside,
    // it runs confined.
    let dir_c = t.join("c");
    std::fs::create_dir(&dir_c).unwrap();
    let log = dir_c.join("vmm.log");
    let mut child = Command::new(BIN)
        .args([
            "--restore".to_owned(),
            format!("source_url={},pmem=[p0@{}]", url(&snap), outside.display()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("--restore of a clone outside the rules did not end");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "{text}");
    assert!(
        text.contains(&outside.display().to_string()) && text.contains("Landlock"),
        "{text}"
    );
    assert!(names(&other).is_empty(), "{:?}", names(&other));
    let inside = clones.join("clone2.pcow");
    let vmm = Vmm::start(
        &dir_c,
        &[
            "--restore".into(),
            format!("source_url={},pmem=[p0@{}]", url(&snap), inside.display()),
        ],
    );
    wait_state(&vmm, "Paused");
    assert!(vmm.log().contains("the VMM is confined"), "{}", vmm.log());
    let (st, body) = vmm.put("vm.pmem-overlay", json!({"id": "p0", "file": ov}));
    assert_eq!(st, 500, "{body}");
    assert!(body.contains("Landlock"), "{body}");
    let (st, body) = call(&vmm.sock, "PUT", "vm.resume", None);
    assert_eq!(st, 204, "{body}");
    assert_eq!(vmm.state(), "Running");
}
