//! Our `ch-remote` against upstream Cloud Hypervisor's own VMM, through a
//! VM's life on a halting PVH stub: every step must exit as upstream's
//! `ch-remote` does, and when `UPSTREAM_CH_REMOTE` names upstream's client
//! too, print the same stdout and stderr (upstream's timestamped log line
//! aside).
//!
//! Runs only when `UPSTREAM_CH` names upstream's `cloud-hypervisor`
//! binary (CI has none: it says SKIPPED), and needs /dev/kvm.
//! `UPSTREAM_CH=/tmp/upstream-ch/src/target/release/cloud-hypervisor
//! UPSTREAM_CH_REMOTE=/tmp/upstream-ch/src/target/release/ch-remote cargo
//! test -p api_client --test against_upstream -- --nocapture`

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The halting PVH stub: an ELF with an XEN_ELFNOTE_PHYS32_ENTRY note
/// whose code is `hlt; jmp hlt` (the same as against_vmm.rs).
fn halting_kernel(path: &Path) {
    const LOAD: u64 = 0x10_0000;
    let code = [0xf4u8, 0xeb, 0xfd];
    let mut e = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    e.extend_from_slice(&2u16.to_le_bytes());
    e.extend_from_slice(&0x3eu16.to_le_bytes());
    e.extend_from_slice(&1u32.to_le_bytes());
    for v in [LOAD, 64, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 2, 64, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    for (ty, fl, off, addr, len, al) in [
        (1u32, 5u32, 0x1000u64, LOAD, code.len() as u64, 0x1000u64),
        (4, 4, 176, 0, 20, 4),
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

/// One run of a client: exit code, stdout, stderr without env_logger's
/// `[<time> ERROR <module>] ...` lines, pids masked.
fn run(client: &Path, sock: &Path, args: &[&str], stdin: &str) -> (Option<i32>, String, String) {
    let mut child = Command::new(client)
        .arg("--api-socket")
        .arg(sock)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run a ch-remote");
    let mut pipe = child.stdin.take().expect("stdin");
    pipe.write_all(stdin.as_bytes()).expect("write stdin");
    drop(pipe);
    let out = child.wait_with_output().expect("wait");
    let mask = |s: &[u8]| {
        let s = String::from_utf8_lossy(s);
        let s: Vec<&str> = s
            .lines()
            .filter(|l| !(l.starts_with('[') && l.contains(" ERROR ")))
            .collect();
        let s = s.join("\n");
        match s.find("\"pid\":") {
            Some(i) => {
                let end = s[i + 6..]
                    .find(|c: char| !c.is_ascii_digit())
                    .map_or(s.len(), |e| i + 6 + e);
                format!("{}\"pid\":N{}", &s[..i], &s[end..])
            }
            None => s,
        }
    };
    (out.status.code(), mask(&out.stdout), mask(&out.stderr))
}

/// A VM's life; the exit code upstream's ch-remote gives each step.
fn steps(dir: &Path) -> Vec<(Vec<String>, &'static str, i32)> {
    let s = |p: &str| dir.join(p).to_string_lossy().into_owned();
    let config = format!(
        r#"{{"cpus":{{"boot_vcpus":1,"max_vcpus":1}},"memory":{{"size":67108864}},"payload":{{"kernel":"{}"}},"serial":{{"mode":"Null"}},"console":{{"mode":"Off"}}}}"#,
        s("vmlinux")
    );
    let config: &'static str = Box::leak(config.into_boxed_str());
    let pmem = |id: &str| format!("file={},size=4M,id={id}", s("p.raw"));
    let v =
        |args: &[&str], stdin, code| (args.iter().map(|a| a.to_string()).collect(), stdin, code);
    vec![
        v(&["ping"], "", 0),
        v(&["info"], "", 1),
        v(&["create"], config, 0),
        v(&["create", "-"], config, 1),
        v(&["info"], "", 0),
        v(&["add-pmem", &pmem("p1")], "", 0),
        v(&["add-pmem", &pmem("p1")], "", 1),
        v(&["remove-device", "p1"], "", 0),
        v(&["counters"], "", 1),
        v(&["boot"], "", 0),
        v(&["counters"], "", 0),
        v(&["pause"], "", 0),
        v(&["pause"], "", 1),
        v(&["resume"], "", 0),
        v(&["add-pmem", &pmem("p2")], "", 0),
        v(&["resize", "--cpus", "1"], "", 0),
        v(&["nmi"], "", 0),
        v(&["power-button"], "", 0),
        v(&["reboot"], "", 0),
        v(&["shutdown"], "", 0),
        v(&["info"], "", 0),
        v(&["delete"], "", 0),
        v(&["info"], "", 1),
        v(&["shutdown-vmm"], "", 0),
    ]
}

fn life(client: &Path, vmm: &Path, dir: &Path) -> Vec<(Option<i32>, String, String)> {
    let sock = dir.join(format!(
        "api-{}.sock",
        client.file_name().unwrap_or_default().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&sock);
    let mut vmm = Vmm(Command::new(vmm)
        .arg("--api-socket")
        .arg(format!("path={}", sock.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn upstream cloud-hypervisor"));
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(20), "no API socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut out = Vec::new();
    for (args, stdin, code) in steps(dir) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let r = run(client, &sock, &args, stdin);
        println!("{} {args:?} -> {:?}", client.display(), r.0);
        assert_eq!(r.0, Some(code), "{args:?}: {}", r.2);
        out.push(r);
    }
    // shutdown-vmm: upstream's VMM exits 0.
    let t0 = Instant::now();
    loop {
        if let Some(st) = vmm.0.try_wait().expect("wait") {
            assert!(st.success(), "upstream VMM exit: {st}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "VMM did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    out
}

#[test]
fn our_ch_remote_drives_upstreams_vmm() {
    let Some(vmm) = std::env::var_os("UPSTREAM_CH").map(PathBuf::from) else {
        println!("SKIPPED: UPSTREAM_CH (upstream's cloud-hypervisor binary) is not set");
        return;
    };
    if !Path::new("/dev/kvm").exists() {
        println!("SKIPPED: no /dev/kvm");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    halting_kernel(&dir.path().join("vmlinux"));
    std::fs::write(dir.path().join("p.raw"), vec![0u8; 4 << 20]).expect("pmem file");
    let ours = life(Path::new(env!("CARGO_BIN_EXE_ch-remote")), &vmm, dir.path());
    // The hot-plugged pmem's answer: a 200 with its PCI address.
    assert!(
        ours[14].1.starts_with(r#"{"id":"p2","bdf":"#),
        "{:?}",
        ours[14]
    );
    assert_eq!(ours[0].1.lines().count(), 1);
    assert!(ours[1].2.starts_with(
        "Error: ch-remote exited with the following chain of errors:\n  0: http client error\n  \
         1: Server responded with NotFound\n  2: Error from API\n"
    ));
    match std::env::var_os("UPSTREAM_CH_REMOTE").map(PathBuf::from) {
        None => println!("upstream's ch-remote not compared: UPSTREAM_CH_REMOTE is not set"),
        Some(theirs) => {
            let theirs = life(&theirs, &vmm, dir.path());
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert_eq!(a, b, "step {i}: ours vs upstream's ch-remote");
            }
        }
    }
}
