//! `--landlock` through the binary: the halting PVH stub on a pcow pmem
//! image, the VMM confined at boot. An overlay beside the image works, one
//! in another directory is refused naming the path and Landlock; a
//! snapshot into a directory given with `--landlock-rules` works, one
//! elsewhere is refused. (The kernel's own refusal is tested in
//! `landlock_rules::tests`.)

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

    // The kernel refuses what the VMM's own check does not cover: a pmem
    // device outside the rules, added while the VM is shut down, cannot
    // be opened (by vm.add-pmem or at the next boot).
    let (st, b) = call(&vmm.sock, "PUT", "vm.shutdown", None);
    assert_eq!(st, 204, "{b}");
    let stray = other.join("stray.pcow");
    Image::create(&stray, &opts).unwrap().close().unwrap();
    let (st, mut b) = vmm.put("vm.add-pmem", json!({"file": stray, "id": "p1"}));
    if st < 400 {
        let (st, boot) = call(&vmm.sock, "PUT", "vm.boot", None);
        assert!(st >= 400, "{st}: {boot}");
        b = boot;
    }
    assert!(b.contains("ermission denied"), "{b}");
}
