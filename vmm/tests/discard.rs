//! `discard_writes=on` on pcow images, through the `cloud-hypervisor`
//! binary and its API (the guest is a halting PVH stub: the guest-side
//! writes are in `discard_kvm.rs`): two VMMs boot on one image at once, a
//! writer is refused while they run, the image operations are refused,
//! flush and reboot work, and after a shutdown and a SIGKILL the image is
//! byte-identical, checks clean, and no file is left in its directory.
//! `PCOW_DISCARD_DIR` moves the temporary overlays; a bad one fails the
//! boot with a message that names it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pcow::{CreateOptions, Image, OpenOptions};
use serde_json::{json, Value};

mod common;
use common::{call, halting_kernel};

const BIN: &str = env!("CARGO_BIN_EXE_cloud-hypervisor");
const MIB: u64 = 1 << 20;

fn expect(sock: &Path, method: &str, action: &str, body: Option<Value>, status: u16) -> Value {
    let (st, b) = call(sock, method, action, body.as_ref());
    assert_eq!(st, status, "{method} {action} {body:?}: {b}");
    if b.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&b).unwrap_or_else(|e| panic!("{action}: {e}: {b}"))
    }
}

/// An error answer with `status` whose text mentions `needle`.
fn refused(sock: &Path, action: &str, body: Value, status: u16, needle: &str) {
    let (st, b) = call(sock, "PUT", action, Some(&body));
    assert_eq!(st, status, "{action} {body}: {b}");
    assert!(
        b.contains(needle),
        "{action}: should mention {needle:?}: {b}"
    );
}

struct Vmm {
    child: Child,
    sock: PathBuf,
}

impl Vmm {
    fn start(dir: &Path, name: &str, discard_dir: Option<&str>) -> Vmm {
        let sock = dir.join(format!("{name}.sock"));
        let mut cmd = Command::new(BIN);
        cmd.args(["--api-socket", &format!("path={}", sock.display())])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .env_remove("PCOW_DISCARD_DIR");
        if let Some(d) = discard_dir {
            cmd.env("PCOW_DISCARD_DIR", d);
        }
        let child = cmd.spawn().expect("spawn");
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(t0.elapsed() < Duration::from_secs(20), "no API socket");
            std::thread::sleep(Duration::from_millis(10));
        }
        Vmm { child, sock }
    }

    fn boot(&self, kernel: &Path, image: &Path) {
        let c = json!({
            "payload": {"kernel": kernel},
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
            "memory": {"size": 64 * MIB},
            "pmem": [{"file": image, "id": "root", "discard_writes": true}],
            "serial": {"mode": "Null"},
            "console": {"mode": "Off"},
        });
        expect(&self.sock, "PUT", "vm.create", Some(c), 204);
        expect(&self.sock, "PUT", "vm.boot", None, 204);
    }

    /// The chain vm.pmem-info reports for the device.
    fn chain(&self) -> Vec<String> {
        let info = expect(&self.sock, "GET", "vm.pmem-info", None, 200);
        info[0]["chain"]
            .as_array()
            .unwrap_or_else(|| panic!("chain: {info}"))
            .iter()
            .map(|p| p.as_str().unwrap().to_owned())
            .collect()
    }

    fn wait_exit(&mut self) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "VMM did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn kvm_or_skip() -> bool {
    if Path::new("/dev/kvm").exists() {
        return true;
    }
    assert!(std::env::var_os("CI").is_none(), "no /dev/kvm under CI");
    println!("SKIPPED: no /dev/kvm");
    false
}

/// An 8 MiB pcow image with data, in its own directory.
fn image(dir: &Path) -> PathBuf {
    let path = dir.join("root.pcow");
    let opts = CreateOptions {
        virtual_size: Some(8 * MIB),
        ..CreateOptions::default()
    };
    let mut img = Image::create(&path, &opts).unwrap();
    img.write_at(b"root file system", 4096).unwrap();
    img.close().unwrap();
    path
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The unlinked files in `dir` the process has open (distinct files: the
/// pool worker holds a second descriptor of its overlay).
fn open_unlinked(pid: u32, dir: &Path) -> usize {
    let dir = dir.canonicalize().unwrap();
    let mut targets: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.starts_with(&dir) && t.to_string_lossy().ends_with(" (deleted)"))
        .map(|t| t.to_string_lossy().into_owned())
        .collect();
    targets.sort();
    targets.dedup();
    targets.len()
}

fn writer_refused(path: &Path) -> bool {
    matches!(
        Image::open(path, OpenOptions::read_write()),
        Err(pcow::Error::Locked { .. })
    )
}

/// No process holds a lock on the file (checked without opening it as an
/// image, which would write it).
fn free(path: &Path) -> bool {
    std::fs::File::open(path).unwrap().try_lock().is_ok()
}

#[test]
fn two_vmms_share_an_image_with_discard_writes_and_leave_it_untouched() {
    let _serial = common::serial();
    if !kvm_or_skip() {
        return;
    }
    let images = tempfile::tempdir().unwrap();
    let run = tempfile::tempdir().unwrap();
    let kernel = run.path().join("vmlinux");
    halting_kernel(&kernel);
    let img = image(images.path());
    let bytes = std::fs::read(&img).unwrap();
    let files = listing(images.path());

    let mut a = Vmm::start(run.path(), "a", None);
    let mut b = Vmm::start(run.path(), "b", None);
    // Refused before the boot too: the image is never written.
    let c = json!({
        "payload": {"kernel": kernel},
        "memory": {"size": 64 * MIB},
        "pmem": [{"file": img, "id": "root", "discard_writes": true}],
        "serial": {"mode": "Null"},
        "console": {"mode": "Off"},
    });
    expect(&a.sock, "PUT", "vm.create", Some(c), 204);
    refused(
        &a.sock,
        "vm.pmem-snapshot",
        json!({"id": "root", "tag": "t"}),
        400,
        "discard_writes",
    );
    expect(&a.sock, "PUT", "vm.delete", None, 204);
    a.boot(&kernel, &img);
    b.boot(&kernel, &img);

    let canon = img.canonicalize().unwrap();
    for v in [&a, &b] {
        let chain = v.chain();
        assert_eq!(chain.len(), 2, "{chain:?}");
        assert!(chain[0].ends_with(" (deleted)"), "{chain:?}");
        assert!(
            Path::new(&chain[0]).starts_with(canon.parent().unwrap()),
            "{chain:?}"
        );
        assert_eq!(Path::new(&chain[1]), canon);
    }
    assert_ne!(a.chain()[0], b.chain()[0], "one overlay each");
    assert_eq!(listing(images.path()), files, "no named file while running");
    assert!(writer_refused(&img), "a writer while two VMs run on it");
    drop(Image::open(&img, OpenOptions::read_only()).expect("a reader"));

    // Flush works (a barrier into the overlay); image operations do not.
    let f = expect(
        &a.sock,
        "PUT",
        "vm.pmem-flush",
        Some(json!({"id": "root"})),
        200,
    );
    assert_eq!(f["id"], "root");
    for (action, body) in [
        ("vm.pmem-snapshot", json!({"id": "root", "tag": "t"})),
        (
            "vm.pmem-overlay",
            json!({"id": "root", "file": images.path().join("o.pcow")}),
        ),
        (
            "vm.pmem-rollback",
            json!({"id": "root", "snapshot": "t", "reset": true}),
        ),
        (
            "vm.pmem-snapshot-delete",
            json!({"id": "root", "snapshot": "t"}),
        ),
    ] {
        refused(&a.sock, action, body, 400, "discard_writes");
    }
    assert_eq!(
        expect(&a.sock, "GET", "vm.info", None, 200)["state"],
        "Running"
    );

    // A reboot builds a new machine: a new overlay, the old one gone.
    let before = a.chain()[0].clone();
    assert_eq!(open_unlinked(a.child.id(), images.path()), 1);
    expect(&a.sock, "PUT", "vm.reboot", None, 204);
    let after = a.chain()[0].clone();
    assert_ne!(before, after, "a new overlay after the reboot");
    assert_eq!(
        open_unlinked(a.child.id(), images.path()),
        1,
        "the old overlay is closed"
    );
    assert_eq!(listing(images.path()), files);

    // a shuts its VM down (its overlay goes): b still holds the image.
    expect(&a.sock, "PUT", "vm.shutdown", None, 204);
    assert_eq!(open_unlinked(a.child.id(), images.path()), 0);
    assert_eq!(open_unlinked(b.child.id(), images.path()), 1);
    assert!(writer_refused(&img), "b still runs on it");
    // b is killed: nothing is left, the lock goes with the process.
    b.child.kill().unwrap();
    b.child.wait().unwrap();
    assert!(free(&img), "the lock went with the killed VMM");
    expect(&a.sock, "PUT", "vmm.shutdown", None, 200);
    assert_eq!(a.wait_exit(), Some(0));

    assert_eq!(listing(images.path()), files, "left behind");
    assert!(std::fs::read(&img).unwrap() == bytes, "the image changed");
    let report = pcow::check::check(&img, None, false).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

#[test]
fn the_overlay_directory_comes_from_pcow_discard_dir() {
    let _serial = common::serial();
    if !kvm_or_skip() {
        return;
    }
    let images = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let run = tempfile::tempdir().unwrap();
    let kernel = run.path().join("vmlinux");
    halting_kernel(&kernel);
    let img = image(images.path());
    let bytes = std::fs::read(&img).unwrap();

    let mut v = Vmm::start(run.path(), "a", Some(&elsewhere.path().to_string_lossy()));
    v.boot(&kernel, &img);
    let chain = v.chain();
    assert!(
        Path::new(&chain[0]).starts_with(elsewhere.path().canonicalize().unwrap()),
        "{chain:?}"
    );
    assert!(listing(elsewhere.path()).is_empty());
    expect(&v.sock, "PUT", "vmm.shutdown", None, 200);
    assert_eq!(v.wait_exit(), Some(0));

    // A directory that does not exist: the boot fails and says where the
    // directory came from.
    let missing = elsewhere.path().join("missing");
    let mut v = Vmm::start(run.path(), "b", Some(&missing.to_string_lossy()));
    let c = json!({
        "payload": {"kernel": kernel},
        "memory": {"size": 64 * MIB},
        "pmem": [{"file": img, "id": "root", "discard_writes": true}],
        "serial": {"mode": "Null"},
        "console": {"mode": "Off"},
    });
    expect(&v.sock, "PUT", "vm.create", Some(c), 204);
    let (st, body) = call(&v.sock, "PUT", "vm.boot", None);
    assert!(st >= 400, "{st} {body}");
    assert!(body.contains("PCOW_DISCARD_DIR"), "{body}");
    assert!(body.contains("missing"), "{body}");
    expect(&v.sock, "PUT", "vmm.shutdown", None, 200);
    assert_eq!(v.wait_exit(), Some(0));
    assert!(std::fs::read(&img).unwrap() == bytes, "the image changed");
    assert!(free(&img));
}
