//! The `cloud-hypervisor` binary as a user runs it.
//!
//! Bad input is refused before any guest starts: one clear error line, a
//! non-zero exit, and every image file byte-identical afterwards. None of
//! these cases reaches `KVM_RUN`, so they need no usable KVM.
//!
//! With KVM (the host's emulating KVM is enough: the guest only halts), a
//! running VM ends with exit code 0 on SIGTERM after its final barrier.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pcow::{BaseFormat, BaseRef, CreateOptions, Image, OpenOptions};

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_cloud-hypervisor");
const MIB: u64 = 1 << 20;

struct Run {
    code: Option<i32>,
    stderr: String,
    stdout: String,
}

fn run(args: &[&str]) -> Run {
    let out = Command::new(BIN)
        .args(args)
        .output()
        .expect("running cloud-hypervisor");
    Run {
        code: out.status.code(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
    }
}

/// Runs with `args`, expects exit 1 and one stderr line containing every
/// needle.
fn refused(args: &[&str], needles: &[&str]) -> String {
    refused_with(1, args, needles)
}

/// Runs with `args`, expects exit `code` and one stderr line containing
/// every needle.
fn refused_with(code: i32, args: &[&str], needles: &[&str]) -> String {
    let r = run(args);
    assert_eq!(r.code, Some(code), "exit code for {args:?}: {}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "one error line for {args:?}, got:\n{}",
        r.stderr
    );
    for n in needles {
        assert!(
            lines[0].contains(n),
            "error for {args:?} should name {n:?}: {}",
            lines[0]
        );
    }
    assert!(r.stdout.is_empty(), "no guest output: {}", r.stdout);
    lines[0].to_owned()
}

struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn s(&self, name: &str) -> String {
        self.path(name).to_string_lossy().into_owned()
    }

    /// A file that is not a kernel.
    fn not_a_kernel(&self) -> String {
        std::fs::write(self.path("kernel"), vec![0x5a; 64 * 1024]).unwrap();
        self.s("kernel")
    }

    /// The halting PVH stub kernel ([`common::halting_kernel`]).
    fn halting_kernel(&self) -> String {
        common::halting_kernel(&self.path("vmlinux"));
        self.s("vmlinux")
    }

    /// A pcow image of `size` with some data written.
    fn pcow(&self, name: &str, size: u64) -> String {
        let opts = CreateOptions {
            virtual_size: Some(size),
            ..CreateOptions::default()
        };
        let mut img = Image::create(self.path(name), &opts).expect("create image");
        img.write_at(b"pcow data", 4096).expect("write");
        img.flush().expect("barrier");
        drop(img);
        self.s(name)
    }
}

fn bytes(p: &str) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

#[test]
fn a_kernel_that_is_not_a_kernel_is_refused_before_any_image_is_opened() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.not_a_kernel();
    let img = f.pcow("a.pcow", 4 * MIB);
    let before = bytes(&img);
    refused(
        &[
            "--kernel",
            &kernel,
            "--pmem",
            &format!("file={img}"),
            "--console",
            "off",
        ],
        &["not a Linux kernel", &kernel],
    );
    assert!(bytes(&img) == before, "{} changed", img);
}

#[test]
fn a_raw_file_that_is_not_a_2mib_multiple_is_refused() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.not_a_kernel();
    let raw = f.s("raw.img");
    std::fs::write(&raw, vec![7u8; 3 * 1024 * 1024 + 4096]).unwrap();
    let before = bytes(&raw);
    refused(
        &["--kernel", &kernel, "--pmem", &format!("file={raw}")],
        &[&raw, "2 MiB"],
    );
    assert!(bytes(&raw) == before, "{} changed", raw);
}

#[test]
fn a_pcow_image_whose_size_is_not_a_2mib_multiple_names_pcow_img_resize() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.not_a_kernel();
    let img = f.pcow("odd.pcow", 3 * MIB);
    let before = bytes(&img);
    refused(
        &["--kernel", &kernel, "--pmem", &format!("file={img}")],
        &[&img, "pcow-img resize"],
    );
    assert!(bytes(&img) == before, "{} changed", img);
}

#[test]
fn a_corrupt_pcow_image_is_refused_and_left_as_it_was() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.not_a_kernel();
    let img = f.pcow("bad.pcow", 4 * MIB);
    let mut b = bytes(&img);
    // A header length the format does not have.
    b[12] ^= 0x40;
    std::fs::write(&img, &b).unwrap();
    refused(
        &["--kernel", &kernel, "--pmem", &format!("file={img}")],
        &[&img],
    );
    assert!(bytes(&img) == b, "{} changed", img);
}

#[test]
fn a_missing_base_image_is_refused() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.not_a_kernel();
    let base = f.pcow("base.pcow", 4 * MIB);
    let top = f.path("top.pcow");
    let opts = CreateOptions {
        virtual_size: Some(4 * MIB),
        base: Some(BaseRef {
            name: "base.pcow".into(),
            format: BaseFormat::Pcow,
        }),
        ..CreateOptions::default()
    };
    Image::create(&top, &opts).expect("overlay");
    std::fs::remove_file(&base).unwrap();
    let top = top.to_string_lossy().into_owned();
    let before = bytes(&top);
    refused(
        &["--kernel", &kernel, "--pmem", &format!("file={top}")],
        &["base.pcow"],
    );
    assert!(bytes(&top) == before, "{} changed", top);
}

#[test]
fn two_devices_on_the_same_file_are_refused() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.not_a_kernel();
    let img = f.pcow("a.pcow", 4 * MIB);
    // The same file under a second name.
    let link = f.path("link.pcow");
    std::os::unix::fs::symlink(Path::new(&img), &link).unwrap();
    let link = link.to_string_lossy().into_owned();
    let before = bytes(&img);
    refused(
        &[
            "--kernel",
            &kernel,
            "--pmem",
            &format!("file={img}"),
            "--pmem",
            &format!("file={link}"),
        ],
        &["same file"],
    );
    assert!(bytes(&img) == before, "{} changed", img);
}

#[test]
fn a_pcow_image_locked_by_another_writer_is_refused() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.halting_kernel();
    let img = f.pcow("a.pcow", 4 * MIB);
    let holder = Image::open(Path::new(&img), OpenOptions::read_write()).expect("hold the image");
    let before = bytes(&img);
    refused(
        &["--kernel", &kernel, "--pmem", &format!("file={img}")],
        &[&img],
    );
    assert!(bytes(&img) == before, "{} changed", img);
    drop(holder);
}

#[test]
fn bad_option_values_are_one_line_and_exit_1() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.not_a_kernel();
    refused(&["--kernel", &kernel, "--cpus", "boot=0"], &["boot"]);
    refused(
        &["--kernel", &kernel, "--memory", "size=lots"],
        &["--memory"],
    );
    refused(
        &["--kernel", &kernel, "--pmem", "size=2M"],
        &["--pmem", "file"],
    );
    refused(&["--kernel", &kernel, "--serial", "socket="], &["socket"]);
    refused(
        &["--kernel", &kernel, "--console", "socket=/tmp/x"],
        &["--console", "socket"],
    );
    refused(&["--kernel", &kernel, "--rng", "src="], &["--rng", "src"]);
    refused(
        &["--kernel", &kernel, "--rng", "bogus=1"],
        &["--rng", "bogus"],
    );
    refused(&["--kernel", &kernel, "--rng", "iommu=maybe"], &["iommu"]);
    refused(&["--kernel", &f.s("missing-kernel")], &["missing-kernel"]);
    // Values upstream parses after its argument parser: exit 1 there too.
    refused(
        &["--kernel", &kernel, "--disk", "path=/x,bogus=1"],
        &["--disk", "unknown key `bogus`"],
    );
    refused(
        &["--api-socket", "/tmp/x.sock", "--event-monitor", "/tmp/ev"],
        &["--event-monitor"],
    );
    refused(
        &["--api-socket", "/tmp/x.sock", "--log-format", "{nope}"],
        &["--log-format", "{nope}"],
    );
}

/// What upstream's argument parser (clap) refuses exits 2, as there.
#[test]
fn command_line_parse_errors_exit_2() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.not_a_kernel();
    refused_with(2, &["--frobnicate"], &["--frobnicate"]);
    refused_with(2, &["stray"], &["stray"]);
    refused_with(2, &["--kernel"], &["--kernel needs a value"]);
    refused_with(2, &["--kernel", &kernel, "--kernel", &kernel], &["twice"]);
    refused_with(2, &["--memory", "size=1G"], &["--memory needs --kernel"]);
    refused_with(2, &["--disk", "path=/x"], &["--disk needs --kernel"]);
    refused_with(2, &["--kernel", &kernel, "--pvpanic=on"], &["--pvpanic"]);
    refused_with(2, &["--seccomp", "maybe"], &["--seccomp", "maybe"]);
    refused_with(2, &["--seccomp", "x\ny"], &["--seccomp"]);
    refused_with(2, &["--event-monitor"], &["--event-monitor needs a value"]);
}

/// Options of devices this VMM does not have parse with upstream's syntax
/// and are refused before any guest starts, naming the field and option;
/// options not supported yet are refused with the reason.
#[test]
fn options_we_cannot_honour_are_refused_by_name() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.halting_kernel();
    let k = |extra: &[&str]| {
        let mut a = vec!["--kernel", kernel.as_str(), "--console", "off"];
        a.extend_from_slice(extra);
        a.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    for (extra, needles) in [
        (
            vec!["--disk", "path=/x"],
            vec!["`disks` (--disk)", "no virtio-block"],
        ),
        (vec!["--net", "tap=t0"], vec!["`net` (--net)"]),
        (
            vec!["--vsock", "cid=3,socket=/s"],
            vec!["`vsock` (--vsock)"],
        ),
        (vec!["--balloon", "size=1G"], vec!["`balloon` (--balloon)"]),
        (vec!["--rtc"], vec!["`rtc` (--rtc)"]),
        (vec!["--watchdog"], vec!["`watchdog`"]),
        (
            vec![
                "--landlock",
                "--landlock-rules",
                "path=/no/such/dir,access=r",
            ],
            vec![
                "`landlock_rules` (--landlock-rules)",
                "/no/such/dir",
                "does not exist",
            ],
        ),
        (vec!["--cpus", "boot=1,nested=off"], vec!["`cpus.nested`"]),
        (
            vec!["--platform", "uuid=abc"],
            vec!["`platform.system_uuid`"],
        ),
        (
            vec!["--no-shutdown"],
            vec!["--no-shutdown", "not supported"],
        ),
        (
            vec!["--restore", "source_url=file:///nonexistent"],
            vec!["--restore", "cannot be combined with --kernel"],
        ),
    ] {
        let args = k(&extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&args, &needles);
    }
}

#[test]
fn help_and_version_exit_0() {
    let _serial = common::serial();
    let r = run(&["--help"]);
    assert_eq!(r.code, Some(0));
    for o in [
        "--api-socket",
        "--balloon",
        "--cmdline",
        "--console",
        "--cpus",
        "--debug-console",
        "--device",
        "--disk",
        "--event-monitor",
        "--firmware",
        "--fs",
        "--generic-vhost-user",
        "--initramfs",
        "--kernel",
        "--landlock",
        "--landlock-rules",
        "--log-file",
        "--log-format",
        "--memory",
        "--memory-zone",
        "--net",
        "--no-shutdown",
        "--numa",
        "--pci-segment",
        "--platform",
        "--pmem",
        "--pvpanic",
        "--rate-limit-group",
        "--restore",
        "--rng",
        "--rtc",
        "--seccomp",
        "--serial",
        "--tpm",
        "--user-device",
        "-v",
        "--vdpa",
        "--version",
        "--vsock",
        "--watchdog",
        "--help",
    ] {
        assert!(
            r.stdout
                .lines()
                .any(|l| l.split_whitespace().any(|w| w.trim_end_matches(',') == o)),
            "{o} not in --help:\n{}",
            r.stdout
        );
    }
    let r = run(&["--version"]);
    assert_eq!(r.code, Some(0));
    assert!(r.stdout.starts_with("cloud-hypervisor v"), "{}", r.stdout);
}

/// Waits up to `limit` for `child` to exit.
fn wait_for(child: &mut std::process::Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn sigterm_ends_a_running_guest_with_exit_0_after_the_final_barrier() {
    let _serial = common::serial();
    if !Path::new("/dev/kvm").exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no /dev/kvm under CI: this test must run"
        );
        println!("SKIPPED: no /dev/kvm");
        return;
    }
    let f = Fixture::new();
    let kernel = f.halting_kernel();
    let img = f.pcow("a.pcow", 4 * MIB);
    let mut child = Command::new(BIN)
        .args([
            "--kernel",
            &kernel,
            "--cpus",
            "boot=2",
            "--memory",
            "size=64M",
            "--pmem",
            &format!("file={img}"),
            "--serial",
            "null",
            "--console",
            "off",
            "-v",
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn cloud-hypervisor");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("guest started") {
                let _ = tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let started = rx.recv_timeout(Duration::from_secs(30)).is_ok();
    // Let the vCPUs enter KVM_RUN and halt.
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = wait_for(&mut child, Duration::from_secs(30));
    if status.is_none() {
        let _ = child.kill();
    }
    let log = reader.join().expect("stderr reader");
    assert!(started, "the guest never started:\n{log}");
    let status = status.unwrap_or_else(|| panic!("no exit within 30 s of SIGTERM:\n{log}"));
    assert_eq!(status.code(), Some(0), "exit status:\n{log}");
    assert!(log.contains("signal 15"), "{log}");
    assert!(log.contains("final barrier"), "{log}");
    let report = pcow::check::check(Path::new(&img), None, false).expect("check");
    assert!(report.is_clean(), "image after SIGTERM: {report:?}");
    let ro = Image::open(Path::new(&img), OpenOptions::read_only()).expect("reopen");
    let mut buf = [0u8; 9];
    ro.read_at(&mut buf, 4096).expect("read");
    assert_eq!(&buf, b"pcow data");
}

#[test]
fn an_rng_source_that_cannot_serve_is_refused_at_start() {
    let _serial = common::serial();
    let f = Fixture::new();
    let kernel = f.halting_kernel();
    std::fs::create_dir(f.path("dir")).unwrap();
    refused(
        &[
            "--kernel",
            &kernel,
            "--console",
            "off",
            "--rng",
            &format!("src={}", f.s("dir")),
        ],
        &["rng source", "is a directory"],
    );
    refused(
        &[
            "--kernel",
            &kernel,
            "--console",
            "off",
            "--rng",
            &format!("src={}", f.s("missing")),
        ],
        &["rng source", "missing", "cannot open"],
    );
}

/// `--serial socket=` and `--console pty` on a running VM: the socket
/// takes a client, the pty exists with the logged path, and both are gone
/// after the exit.
#[test]
fn serial_socket_and_console_pty_while_the_guest_runs() {
    let _serial = common::serial();
    if !Path::new("/dev/kvm").exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no /dev/kvm under CI: this test must run"
        );
        println!("SKIPPED: no /dev/kvm");
        return;
    }
    let f = Fixture::new();
    let kernel = f.halting_kernel();
    let sock = f.path("serial.sock");
    let mut child = Command::new(BIN)
        .args([
            "--kernel",
            &kernel,
            "--memory",
            "size=64M",
            "--serial",
            &format!("socket={}", sock.display()),
            "--console",
            "pty",
            "-v",
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn cloud-hypervisor");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(i) = line.find("console: pseudo-terminal ") {
                let _ = tx.send(line[i + 25..].trim().to_owned());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let pty = rx.recv_timeout(Duration::from_secs(30));
    // Let the machine finish building and the guest start.
    std::thread::sleep(Duration::from_millis(500));
    let connected = std::os::unix::net::UnixStream::connect(&sock).is_ok();
    let pty_exists = pty.as_ref().is_ok_and(|p| Path::new(p).exists());
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = wait_for(&mut child, Duration::from_secs(30));
    if status.is_none() {
        let _ = child.kill();
    }
    let log = reader.join().expect("stderr reader");
    let pty = pty.unwrap_or_else(|_| panic!("no pty path logged:\n{log}"));
    assert!(pty.starts_with("/dev/pts/"), "{pty}");
    assert!(pty_exists, "{pty} missing while the VM ran:\n{log}");
    assert!(connected, "the serial socket took no client:\n{log}");
    assert!(
        log.contains("virtio-rng: /dev/urandom, PCI 0000:00:02.0"),
        "{log}"
    );
    assert!(
        log.contains("virtio-console: Pty, PCI 0000:00:01.0"),
        "{log}"
    );
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(!sock.exists(), "the socket file is left behind");
}

/// `--serial tty --console tty` on a real terminal (a pty this test
/// opens), with the default `--seccomp true`: the VMM thread checks the
/// terminal and puts it in raw mode under its filter (TCGETS, TCSETS in
/// its table), and puts it back as it exits.
#[test]
fn serial_and_console_on_a_terminal_under_the_filters() {
    let _serial = common::serial();
    if !Path::new("/dev/kvm").exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no /dev/kvm under CI: this test must run"
        );
        println!("SKIPPED: no /dev/kvm");
        return;
    }
    // SAFETY: posix_openpt takes flags only; the result is checked.
    let main = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    assert!(
        main >= 0,
        "posix_openpt: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `main` is the pty's main side, owned here from now on.
    let main = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(main) };
    use std::os::fd::AsRawFd;
    let mut name = [0 as libc::c_char; 128];
    // SAFETY: grantpt/unlockpt on a pty main side; ptsname_r writes at
    // most `name.len()` bytes into `name`.
    let ok = unsafe {
        libc::grantpt(main.as_raw_fd()) == 0
            && libc::unlockpt(main.as_raw_fd()) == 0
            && libc::ptsname_r(main.as_raw_fd(), name.as_mut_ptr(), name.len()) == 0
    };
    assert!(ok, "pty: {}", std::io::Error::last_os_error());
    // SAFETY: ptsname_r succeeded: `name` is NUL-terminated.
    let path = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let term = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let canonical = |f: &std::fs::File| {
        // SAFETY: termios is plain data, filled by tcgetattr.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `f` is an open terminal; `t` is valid for the call.
        assert_eq!(unsafe { libc::tcgetattr(f.as_raw_fd(), &mut t) }, 0);
        t.c_lflag & libc::ICANON != 0
    };
    assert!(canonical(&term), "a new terminal is canonical");
    let f = Fixture::new();
    let kernel = f.halting_kernel();
    let mut child = Command::new(BIN)
        .args([
            "--kernel",
            &kernel,
            "--memory",
            "size=64M",
            "--serial",
            "tty",
            "--console",
            "tty",
        ])
        .stdin(term.try_clone().unwrap())
        .stdout(term.try_clone().unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn cloud-hypervisor");
    let t0 = Instant::now();
    while canonical(&term) {
        assert!(
            t0.elapsed() < Duration::from_secs(20) && child.try_wait().unwrap().is_none(),
            "the terminal never went raw"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Let the machine finish building and the guest start.
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = wait_for(&mut child, Duration::from_secs(30));
    if status.is_none() {
        let _ = child.kill();
    }
    let mut log = String::new();
    use std::io::Read;
    let _ = child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut log);
    assert!(!log.contains("seccomp:"), "{log}");
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(canonical(&term), "the terminal was not put back:\n{log}");
    drop(main);
}

/// A `--pmem file=` name holding byte 0xff is refused with an error that
/// shows the byte; the file whose name holds U+FFFD instead (what a lossy
/// conversion would open) is not touched.
#[test]
fn a_non_utf8_file_name_is_refused_not_altered() {
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;
    let dir = tempfile::tempdir().unwrap();
    let lossy = dir.path().join("p\u{fffd}.raw");
    std::fs::write(&lossy, vec![0u8; 2 << 20]).unwrap();
    let mut arg = b"file=".to_vec();
    arg.extend_from_slice(dir.path().as_os_str().as_encoded_bytes());
    arg.extend_from_slice(b"/p\xff.raw");
    let out = Command::new(BIN)
        .arg("--kernel")
        .arg(dir.path().join("vmlinux"))
        .arg("--pmem")
        .arg(OsString::from_vec(arg))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("not valid UTF-8") && err.contains("p\\xff.raw"),
        "{err}"
    );
    assert_eq!(std::fs::read(&lossy).unwrap(), vec![0u8; 2 << 20]);
}

#[test]
fn restore_of_a_missing_or_relative_snapshot_fails_naming_it() {
    let _serial = common::serial();
    refused(
        &["--restore", "source_url=file:///nonexistent-snapshot-dir"],
        &["restoring the snapshot", "/nonexistent-snapshot-dir"],
    );
    refused(
        &["--restore", "source_url=file://relative/dir"],
        &["must be absolute"],
    );
    refused(
        &[
            "--restore",
            "source_url=file:///s,memory_restore_mode=ondemand",
        ],
        &["OnDemand", "not supported"],
    );
}
