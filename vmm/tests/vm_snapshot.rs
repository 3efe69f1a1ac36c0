//! `vm.snapshot`, `vm.restore` and `--restore` through the binary's API
//! socket, with the halting PVH stub as the guest and a pcow and a raw
//! pmem device: the snapshot directory and the frozen pcow image, clones,
//! the rollback of the source's image, the refusals (wrong state, a busy
//! image, hostile snapshot directories), and that a refusal changes no
//! file. A real Linux guest's continuity across a restore is the nested
//! sandbox's (scenarios 16-19); the device and vCPU state round trips are
//! `device_state_kvm.rs` and `snapshot_kvm.rs`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pcow::{CreateOptions, Image, OpenOptions};
use serde_json::{json, Value};

mod common;
use common::{call, halting_kernel};

const BIN: &str = env!("CARGO_BIN_EXE_cloud-hypervisor");
const MIB: u64 = 1 << 20;

fn kvm_or_skip(test: &str) -> bool {
    if Path::new("/dev/kvm").exists() {
        return true;
    }
    assert!(std::env::var_os("CI").is_none(), "no /dev/kvm under CI");
    println!("SKIPPED {test}: no /dev/kvm");
    false
}

struct Vmm {
    child: Child,
    sock: PathBuf,
    log: PathBuf,
}

impl Vmm {
    fn start(dir: &Path, name: &str, extra: &[String]) -> Vmm {
        let sock = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("{name}.log"));
        let mut args = vec![
            "--api-socket".to_owned(),
            format!("path={}", sock.display()),
            "-v".to_owned(),
        ];
        args.extend(extra.iter().cloned());
        let child = Command::new(BIN)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn");
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "no API socket; log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Vmm { child, sock, log }
    }

    fn put(&self, action: &str, body: Option<Value>) -> (u16, String) {
        call(&self.sock, "PUT", action, body.as_ref())
    }

    fn ok(&self, action: &str, body: Option<Value>) {
        let (st, b) = self.put(action, body);
        assert_eq!(st, 204, "{action}: {b}\nlog:\n{}", self.log());
    }

    fn refused(&self, action: &str, body: Value, status: u16, needle: &str) -> String {
        let (st, b) = self.put(action, Some(body));
        assert_eq!(st, status, "{action}: {b}");
        assert!(
            b.contains(needle),
            "{action}: should mention {needle:?}: {b}"
        );
        b
    }

    fn info(&self) -> Value {
        let (st, body) = call(&self.sock, "GET", "vm.info", None);
        assert_eq!(st, 200, "vm.info: {body}");
        serde_json::from_str(&body).unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Every thread of the VMM runs under a seccomp filter (the default
    /// `--seccomp true`): mode 2 in its /proc status. vCPU and pmem queue
    /// threads, and the device crate's fault monitors and pool workers
    /// (through the VMM's thread hook), stack their own list on the VMM
    /// thread's (2 filters). Returns the thread names seen and what is
    /// wrong with them (empty when all is well).
    fn filter_report(&self) -> (Vec<String>, Vec<String>) {
        let task = PathBuf::from(format!("/proc/{}/task", self.child.id()));
        let (mut names, mut wrong) = (Vec::new(), Vec::new());
        for t in std::fs::read_dir(&task).unwrap() {
            let t = t.unwrap().path();
            let (Ok(comm), Ok(status)) = (
                std::fs::read_to_string(t.join("comm")),
                std::fs::read_to_string(t.join("status")),
            ) else {
                continue; // the thread ended meanwhile
            };
            let comm = comm.trim().to_owned();
            let field = |key: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(key))
                    .map(|v| v.trim().to_owned())
                    .unwrap_or_default()
            };
            if field("Seccomp:") != "2" {
                wrong.push(format!("{comm}: unfiltered"));
            }
            let filters: u32 = field("Seccomp_filters:").parse().unwrap();
            let own = comm.starts_with("vcpu")
                || comm.ends_with("-queue")
                || comm.ends_with("-fault")
                || comm == "pcow-pool";
            if filters < if own { 2 } else { 1 } {
                wrong.push(format!("{comm}: {filters} filters"));
            }
            names.push(comm);
        }
        (names, wrong)
    }

    /// Waits until threads named `want` are all there and every thread is
    /// filtered as it must be: a new thread has its name from its first
    /// moment but installs its own filter a moment later.
    fn wait_filtered(&self, want: &[&str]) {
        let t0 = Instant::now();
        loop {
            let (names, wrong) = self.filter_report();
            if wrong.is_empty() && want.iter().all(|w| names.iter().any(|n| n == w)) {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{names:?}, wrong: {wrong:?}"
            );
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

fn url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

/// A 16 MiB pcow image holding `pattern` at offset 0.
fn pcow_image(path: &Path, pattern: &[u8]) {
    let opts = CreateOptions {
        virtual_size: Some(16 * MIB),
        ..Default::default()
    };
    let mut img = Image::create(path, &opts).unwrap();
    img.write_at(pattern, 0).unwrap();
    img.close().unwrap();
}

fn read_image(path: &Path, len: usize) -> Vec<u8> {
    let img = Image::open(
        path,
        OpenOptions {
            force_share: true,
            ..Default::default()
        },
    )
    .unwrap();
    let mut buf = vec![0u8; len];
    img.read_at(&mut buf, 0).unwrap();
    buf
}

/// Every file under `dir` (not the API sockets and logs) with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if name.ends_with(".sock") || name.ends_with(".log") || name.ends_with(".lock") {
                continue;
            }
            if p.is_dir() {
                todo.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn state_json(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("state.json")).unwrap()).unwrap()
}

#[test]
fn snapshot_restore_clones_rollback_and_refusals() {
    let test = "snapshot_restore_clones_rollback_and_refusals";
    if !kvm_or_skip(test) {
        return;
    }
    let _serial = common::serial();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let kernel = t.join("halt.elf");
    halting_kernel(&kernel);
    let image = t.join("disk.pcow");
    pcow_image(&image, b"before the snapshot");
    let raw = t.join("raw.img");
    std::fs::write(&raw, vec![7u8; 2 * MIB as usize]).unwrap();

    let a = Vmm::start(t, "a", &[]);
    let config = json!({
        "payload": {"kernel": kernel},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
        "memory": {"size": 64 * MIB},
        "pmem": [{"file": image}, {"file": raw, "id": "r"}],
        "serial": {"mode": "Null"},
        "console": {"mode": "Off"},
    });
    a.ok("vm.create", Some(config));
    let snap = t.join("snap");
    std::fs::create_dir(&snap).unwrap();
    // No machine yet: upstream's 500.
    a.refused(
        "vm.snapshot",
        json!({"destination_url": url(&snap)}),
        500,
        "not running",
    );
    a.ok("vm.boot", None);
    a.wait_filtered(&[
        "vcpu0",
        "vcpu1",
        "pmem0-queue",
        "pmem0-fault",
        "pcow-pool",
        "http-api",
    ]);
    a.refused(
        "vm.snapshot",
        json!({"destination_url": url(&snap)}),
        500,
        "Trying to snapshot while VM is running",
    );
    a.ok("vm.pause", None);
    a.refused(
        "vm.snapshot",
        json!({"destination_url": "http://x/y"}),
        500,
        "file://",
    );
    let busy = t.join("busy");
    std::fs::create_dir(&busy).unwrap();
    std::fs::write(busy.join("x"), b"x").unwrap();
    a.refused(
        "vm.snapshot",
        json!({"destination_url": url(&busy)}),
        500,
        "empty",
    );
    a.ok("vm.snapshot", Some(json!({"destination_url": url(&snap)})));

    // The directory: config, state (last), RAM as big as the config's.
    for f in ["config.json", "state.json", "memory-ranges"] {
        assert!(snap.join(f).is_file(), "{f} missing");
    }
    assert_eq!(
        std::fs::metadata(snap.join("memory-ranges")).unwrap().len(),
        64 * MIB
    );
    let state = state_json(&snap);
    assert_eq!(state["vcpus"].as_array().map(Vec::len), Some(2), "{state}");
    let pmem = state["pmem"].as_array().unwrap();
    assert_eq!(pmem.len(), 2, "{state}");
    assert_eq!(pmem[0]["id"], "_pmem0");
    assert_eq!(pmem[0]["kind"], "pcow");
    assert_eq!(pmem[1]["kind"], "raw");
    let frozen = PathBuf::from(pmem[0]["frozen"].as_str().unwrap());
    assert_eq!(frozen.parent(), image.parent(), "frozen beside the image");
    // The source keeps its file name, now a thin overlay over the frozen
    // image; both read what the image held.
    assert_eq!(a.info()["config"]["pmem"][0]["file"], json!(image));
    assert_eq!(read_image(&frozen, 19), b"before the snapshot");
    assert_eq!(read_image(&image, 19), b"before the snapshot");
    a.ok("vm.resume", None);

    // Restoring onto the image the source still runs on is refused and
    // names the clone override; nothing changes.
    let before = files(t);
    let b = Vmm::start(t, "b", &[]);
    let body = b.refused(
        "vm.restore",
        json!({"source_url": url(&snap)}),
        500,
        "pmem=[_pmem0@",
    );
    assert!(body.contains("in use"), "{body}");
    assert_eq!(files(t), before, "a refused restore changed files");

    // A clone: its own thin overlay over the frozen image. The raw file
    // is the source's (locked while it runs): the clone gets a copy,
    // which a restore uses as it is.
    let clone1 = t.join("clone1.pcow");
    let raw1 = t.join("raw1.img");
    std::fs::copy(&raw, &raw1).unwrap();
    b.ok(
        "vm.restore",
        Some(json!({"source_url": url(&snap), "pmem": [
            {"id": "_pmem0", "file": clone1}, {"id": "r", "file": raw1}
        ]})),
    );
    let info = b.info();
    assert_eq!(info["state"], "Paused", "{info}");
    assert_eq!(info["config"]["pmem"][0]["file"], json!(clone1));
    b.refused(
        "vm.restore",
        json!({"source_url": url(&snap)}),
        500,
        "already created",
    );
    b.ok("vm.resume", None);
    assert_eq!(b.info()["state"], "Running");
    // Restored through the API: its threads are filtered as well.
    b.wait_filtered(&["vcpu0", "vcpu1", "pmem0-queue", "pmem0-fault", "pcow-pool"]);
    let (st, pinfo) = call(&b.sock, "GET", "vm.pmem-info", None);
    assert_eq!(st, 200, "{pinfo}");
    assert!(pinfo.contains("clone1.pcow"), "{pinfo}");
    assert!(
        pinfo.contains(frozen.file_name().unwrap().to_str().unwrap()),
        "{pinfo}"
    );

    // `--restore` with a second clone, resumed at once.
    let clone2 = t.join("clone2.pcow");
    let raw2 = t.join("raw2.img");
    std::fs::copy(&raw, &raw2).unwrap();
    let c = Vmm::start(
        t,
        "c",
        &[
            "--restore".to_owned(),
            format!(
                "source_url={},resume=on,memory_restore_mode=copyonwrite,pmem=[_pmem0@{},r@{}]",
                url(&snap),
                clone2.display(),
                raw2.display()
            ),
        ],
    );
    let t0 = Instant::now();
    while c.info()["state"] != "Running" {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", c.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    c.wait_filtered(&["vcpu0", "pmem0-queue"]);
    drop(c);
    drop(b);

    // The source gone, a restore without override rolls its image back
    // to the frozen content.
    drop(a);
    let frozen_bytes = std::fs::read(&frozen).unwrap();
    let d = Vmm::start(t, "d", &[]);
    d.ok(
        "vm.restore",
        Some(json!({"source_url": url(&snap), "resume": true})),
    );
    assert_eq!(d.info()["state"], "Running");
    assert_eq!(d.info()["config"]["pmem"][0]["file"], json!(image));
    d.ok("vm.shutdown", None);
    drop(d);
    assert_eq!(
        std::fs::read(&frozen).unwrap(),
        frozen_bytes,
        "frozen image changed"
    );
    assert_eq!(read_image(&image, 19), b"before the snapshot");
    // A clone needs neither the source's image nor the kernel file: the
    // frozen image and the RAM hold everything.
    std::fs::rename(&image, t.join("moved.pcow")).unwrap();
    std::fs::remove_file(&kernel).unwrap();
    let clone3 = t.join("clone3.pcow");
    let e = Vmm::start(t, "e", &[]);
    e.ok(
        "vm.restore",
        Some(json!({"source_url": url(&snap), "resume": true, "pmem": [
            {"id": "_pmem0", "file": clone3}, {"id": "r", "file": raw1}
        ]})),
    );
    assert_eq!(e.info()["state"], "Running");
    e.ok("vm.shutdown", None);
    drop(e);
    std::fs::rename(t.join("moved.pcow"), &image).unwrap();

    // The rolled-back image (shut down) and the frozen one are clean; the
    // clones' VMMs were killed: leaks at most.
    for f in [&image, &frozen, &clone3] {
        let report = pcow::check::check(f, None, false).unwrap();
        assert!(report.is_clean(), "{}: {report:?}", f.display());
    }
    for f in [&clone1, &clone2] {
        let report = pcow::check::check(f, None, false).unwrap();
        assert!(report.corruptions.is_empty(), "{}: {report:?}", f.display());
    }
}

#[test]
fn hostile_snapshot_directories_are_refused_and_change_nothing() {
    let test = "hostile_snapshot_directories_are_refused_and_change_nothing";
    if !kvm_or_skip(test) {
        return;
    }
    let _serial = common::serial();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let kernel = t.join("halt.elf");
    halting_kernel(&kernel);
    let image = t.join("disk.pcow");
    pcow_image(&image, b"content");
    let raw = t.join("raw.img");
    std::fs::write(&raw, vec![1u8; 2 * MIB as usize]).unwrap();
    let snap = t.join("snap");
    std::fs::create_dir(&snap).unwrap();
    {
        let a = Vmm::start(t, "a", &[]);
        a.ok(
            "vm.create",
            Some(json!({
                "payload": {"kernel": kernel},
                "memory": {"size": 32 * MIB},
                "pmem": [{"file": image}, {"file": raw}],
                "serial": {"mode": "Null"},
                "console": {"mode": "Off"},
            })),
        );
        a.ok("vm.boot", None);
        a.ok("vm.pause", None);
        a.ok("vm.snapshot", Some(json!({"destination_url": url(&snap)})));
    }
    let v = Vmm::start(t, "v", &[]);
    // Every restore names a clone for the pcow device, so that a refusal
    // after the clone was made must remove it again (a restore without
    // one rolls the source's image back first: see docs/snapshots.md).
    let clone = t.join("clone.pcow");
    let restore =
        |dir: &Path| json!({"source_url": url(dir), "pmem": [{"id": "_pmem0", "file": clone}]});
    // Each case: a copy of the snapshot directory damaged one way.
    type Damage = fn(&Path);
    let cases: Vec<(&str, Damage, u16, &str)> = vec![
        (
            "no-state",
            |d| std::fs::remove_file(d.join("state.json")).unwrap(),
            500,
            "incomplete",
        ),
        (
            "truncated-state",
            |d| {
                let s = std::fs::read(d.join("state.json")).unwrap();
                std::fs::write(d.join("state.json"), &s[..s.len() / 2]).unwrap();
            },
            500,
            "state.json",
        ),
        (
            "version",
            |d| {
                let mut s = state_json(d);
                s["version"] = json!(99);
                std::fs::write(d.join("state.json"), s.to_string()).unwrap();
            },
            500,
            "version 99",
        ),
        (
            "short-ram",
            |d| {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(d.join("memory-ranges"))
                    .unwrap();
                f.set_len(MIB).unwrap();
            },
            500,
            "memory-ranges",
        ),
        (
            "no-config",
            |d| std::fs::remove_file(d.join("config.json")).unwrap(),
            500,
            "config.json",
        ),
        (
            "vcpu-count",
            |d| {
                let mut s = state_json(d);
                let one = s["vcpus"][0].clone();
                s["vcpus"] = json!([one.clone(), one]);
                std::fs::write(d.join("state.json"), s.to_string()).unwrap();
            },
            500,
            "vCPU",
        ),
        (
            "unknown-device-state",
            |d| {
                let mut s = state_json(d);
                s["devices"]["ghost"] = json!({"power": {"reset_control": 0}});
                std::fs::write(d.join("state.json"), s.to_string()).unwrap();
            },
            500,
            "ghost",
        ),
    ];
    for (name, damage, status, needle) in cases {
        let copy = t.join(format!("copy-{name}"));
        std::fs::create_dir(&copy).unwrap();
        for f in std::fs::read_dir(&snap).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
        }
        damage(&copy);
        let before = files(t);
        let body = v.refused("vm.restore", restore(&copy), status, needle);
        assert_eq!(
            files(t),
            before,
            "{name}: a refused restore changed files: {body}"
        );
        let (st, _) = call(&v.sock, "GET", "vm.info", None);
        assert_eq!(st, 404, "{name}: a refused restore left a VM");
    }

    // The raw file changed since the snapshot: refused, naming the
    // override; with it, the file is used as it is.
    std::fs::write(&raw, vec![2u8; 2 * MIB as usize]).unwrap();
    let before = files(t);
    v.refused(
        "vm.restore",
        restore(&snap),
        500,
        "changed since the snapshot",
    );
    assert_eq!(files(t), before);
    // The frozen image missing, then replaced: refused too.
    let state = state_json(&snap);
    let frozen = PathBuf::from(state["pmem"][0]["frozen"].as_str().unwrap());
    let aside = t.join("aside");
    std::fs::rename(&frozen, &aside).unwrap();
    let before = files(t);
    v.refused(
        "vm.restore",
        json!({"source_url": url(&snap), "pmem": [
            {"id": "_pmem0", "file": clone}, {"id": "_pmem1", "file": raw}
        ]}),
        500,
        "the frozen image",
    );
    assert_eq!(files(t), before);
    std::fs::rename(&aside, &frozen).unwrap();
    let saved = std::fs::read(&frozen).unwrap();
    std::fs::remove_file(&frozen).unwrap();
    std::fs::write(&frozen, &saved).unwrap();
    let before = files(t);
    v.refused(
        "vm.restore",
        json!({"source_url": url(&snap), "pmem": [
            {"id": "_pmem0", "file": clone}, {"id": "_pmem1", "file": raw}
        ]}),
        500,
        "the frozen image",
    );
    assert_eq!(files(t), before);
    // OnDemand is refused by name.
    v.refused(
        "vm.restore",
        json!({"source_url": url(&snap), "memory_restore_mode": "OnDemand"}),
        400,
        "OnDemand",
    );
}
