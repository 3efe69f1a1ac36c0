//! Benchmark: VM snapshots, restores and the host memory of clones, each
//! beside a baseline measured in the same run (`docs/pmem-benchmarks.md`,
//! "VM snapshots"). Run it through `scripts/bench-snapshot.sh`, which
//! builds it (release) and puts its output into the docs.
//!
//! The guest is the halting PVH stub, so this example puts data where a
//! guest would: pseudo-random bytes into guest RAM from the host, and
//! pmem writes through the region's host mapping after `Machine::start`
//! (the device's fault thread serves them as it does a guest's).
//!
//! 1. Snapshot time split (pause, vCPU/VM state, devices, RAM, pmem,
//!    files) of a VM with a 1 GiB and a 16 GiB pcow image holding the same
//!    data (a base written before boot, then the same written set through
//!    the mapping); baselines: a plain barrier of the same written set on a
//!    twin VM, and a sequential write + fsync of the guest's RAM bytes.
//! 2. Restore to running vCPUs, Copy vs CopyOnWrite (with and without
//!    prefault), at two RAM sizes, `memory-ranges` cold and warm in the
//!    page cache; baseline: reading `memory-ranges` sequentially.
//! 3. PSS of 4 `cloud-hypervisor` processes restored from one snapshot
//!    (CopyOnWrite, CopyOnWrite + prefault, Copy) and of 4 booted fresh.
//!
//! `cargo run --release -p vmm --example snapshot_bench` (needs /dev/kvm
//! and the release `cloud-hypervisor` binary beside `examples/`).
//! Environment: `SNAPBENCH_DIR` (where the images and snapshots go,
//! default /tmp), `SNAPBENCH_REPS` (repetitions, default 3),
//! `SNAPBENCH_BIN` (the `cloud-hypervisor` binary).

use std::error::Error;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pcow::{BaseFormat, BaseRef, CreateOptions, Image};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm::chardev::Chardevs;
use vmm::config::options::MemoryRestoreMode;
use vmm::config::VmConfig;
use vmm::machine::Machine;
use vmm::snapshot::capture::{self, CaptureTimes};
use vmm::snapshot::restore::{PmemClone, RestoreRequest};
use vmm::snapshot::restore_machine;

type Res<T> = Result<T, Box<dyn Error>>;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Data in the pcow image before boot.
const PMEM_BASE: u64 = 256 * MIB;
/// Written through the mapping after boot (inside the base): the written
/// set of the snapshot's barrier.
const PMEM_WRITTEN: u64 = 64 * MIB;
const PMEM_WRITTEN_AT: u64 = 64 * MIB;
/// Guest RAM below this is left alone: the stub kernel (at 1 MiB), its
/// boot data and the ACPI tables live there.
const RAM_KEEP: u64 = 16 * MIB;
const CHUNK: usize = 1 << 20;

fn main() -> Res<()> {
    if !Path::new("/dev/kvm").exists() {
        return Err("needs /dev/kvm".into());
    }
    let root = PathBuf::from(std::env::var_os("SNAPBENCH_DIR").unwrap_or_else(|| "/tmp".into()));
    let reps: usize = match std::env::var("SNAPBENCH_REPS") {
        Ok(v) => v
            .parse()
            .map_err(|e| format!("SNAPBENCH_REPS={v:?}: {e}"))?,
        Err(_) => 3,
    };
    if reps == 0 {
        return Err("SNAPBENCH_REPS must be at least 1".into());
    }
    let bin = match std::env::var_os("SNAPBENCH_BIN") {
        Some(b) => PathBuf::from(b),
        None => std::env::current_exe()?
            .parent()
            .and_then(Path::parent)
            .ok_or("no directory above the example")?
            .join("cloud-hypervisor"),
    };
    if !bin.is_file() {
        return Err(format!(
            "{}: no cloud-hypervisor binary (SNAPBENCH_BIN)",
            bin.display()
        )
        .into());
    }
    let tmp = tempfile::Builder::new()
        .prefix("snapbench")
        .tempdir_in(&root)?;
    let dir = tmp.path();
    let kernel = dir.join("halt.elf");
    vmm::testguest::write_halting_pvh_kernel(&kernel)?;
    println!(
        "Files in {} ({}), {reps} repetitions, medians.\n",
        root.display(),
        fs_type(&root)
    );

    let snap256 = snapshot_section(dir, &kernel, reps)?;
    let snap1g = dir.join("snap-ram1g");
    let ram1g = Prepared::new(dir, &kernel, "ram1g", GIB, GIB)?;
    ram1g.snapshot(&snap1g)?;
    ram1g.stop()?;
    restore_section(dir, &[(256 * MIB, &snap256), (GIB, &snap1g)], reps)?;
    memory_section(dir, &bin, &kernel, &snap1g)?;
    Ok(())
}

/// The file system `path` is on, from /proc/self/mounts (longest prefix).
fn fs_type(path: &Path) -> String {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && path.starts_with(f[1])).then(|| (f[1].len(), f[2].to_owned()))
        })
        .max()
        .map_or_else(|| "unknown file system".into(), |(_, t)| t)
}

/// Fills `buf` with xorshift64 output from `seed` (never all zeros, so no
/// page of it is a hole in `memory-ranges`).
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for w in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn mib_s(bytes: u64, d: Duration) -> String {
    format!("{:.0}", bytes as f64 / MIB as f64 / d.as_secs_f64())
}

/// A started VM on the halting kernel with one pcow device, RAM filled
/// and the written set in the pmem mapping, as a guest would leave them.
struct Prepared {
    machine: Machine,
    config: VmConfig,
}

impl Prepared {
    fn new(dir: &Path, kernel: &Path, name: &str, image_size: u64, ram: u64) -> Res<Prepared> {
        // The data a guest wrote before: a base image under the device's
        // image, as after an earlier snapshot. Writes into it are
        // copy-on-write in the region, and the barrier copies them up.
        let base = dir.join(format!("{name}-base.pcow"));
        let mut img = Image::create(
            &base,
            &CreateOptions {
                virtual_size: Some(image_size),
                ..Default::default()
            },
        )?;
        let mut buf = vec![0u8; CHUNK];
        for off in (0..PMEM_BASE).step_by(CHUNK) {
            fill(&mut buf, off ^ 0xba5e);
            img.write_at(&buf, off)?;
        }
        img.close()?;
        let image = dir.join(format!("{name}.pcow"));
        Image::create(
            &image,
            &CreateOptions {
                base: Some(BaseRef {
                    name: format!("{name}-base.pcow"),
                    format: BaseFormat::Pcow,
                }),
                ..Default::default()
            },
        )?
        .close()?;
        let json = serde_json::json!({
            "payload": {"kernel": kernel},
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
            "memory": {"size": ram},
            "pmem": [{"file": image}],
            "serial": {"mode": "Null"},
            "console": {"mode": "Off"},
        });
        let mut config: VmConfig = vmm::config::from_json(json.to_string().as_bytes())?;
        let pmem = config.validate()?;
        let chardevs = Arc::new(Chardevs::open(&mut config)?);
        let mut machine = Machine::build(&config, &pmem, &chardevs)?;
        machine.start()?;

        let mem = machine.vm().memory();
        for region in mem.iter() {
            let start = region.start_addr().0;
            let end = start + region.len();
            for gpa in (start.max(RAM_KEEP)..end).step_by(CHUNK) {
                let n = CHUNK.min((end - gpa) as usize);
                fill(&mut buf[..n], gpa ^ 0x5a5a);
                mem.write_slice(&buf[..n], GuestAddress(gpa))?;
            }
        }
        let region = machine.pmem[0]
            .pcow()
            .ok_or("the pmem device is not pcow")?;
        if region.len() < PMEM_WRITTEN_AT + PMEM_WRITTEN {
            return Err("the pmem region is smaller than the written set".into());
        }
        for off in (PMEM_WRITTEN_AT..PMEM_WRITTEN_AT + PMEM_WRITTEN).step_by(CHUNK) {
            fill(&mut buf, off ^ 0xd1e7);
            // Host writes race nothing: the halting guest never touches the
            // region, and a fault on it is served by the device's fault thread.
            // SAFETY: the region maps `region.len()` bytes at `host_addr()` while
            // the machine lives, and `off + CHUNK` is within it (checked above).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    buf.as_ptr(),
                    region.host_addr().add(off as usize),
                    CHUNK,
                );
            }
        }
        Ok(Prepared { machine, config })
    }

    /// Pauses and snapshots into `dir` (created): (pause, capture times).
    fn snapshot(&self, dir: &Path) -> Res<(Duration, CaptureTimes)> {
        std::fs::create_dir(dir)?;
        let t = Instant::now();
        self.machine.ctl.pause()?;
        let pause = t.elapsed();
        let c = capture::capture(&self.machine, &self.config, &[], dir)?;
        Ok((pause, c.times))
    }

    /// Writes guest RAM's bytes into `file` sequentially, as `dd bs=1M
    /// conv=fsync` would (every byte, no holes): (bytes, time).
    fn write_ram_plainly(&self, file: &Path) -> Res<(u64, Duration)> {
        let mem = self.machine.vm().memory();
        let mut buf = vec![0u8; CHUNK];
        let t = Instant::now();
        let mut f = File::create(file)?;
        let mut bytes = 0;
        for region in mem.iter() {
            let start = region.start_addr().0;
            let end = start + region.len();
            for gpa in (start..end).step_by(CHUNK) {
                let n = CHUNK.min((end - gpa) as usize);
                mem.read_slice(&mut buf[..n], GuestAddress(gpa))?;
                f.write_all(&buf[..n])?;
                bytes += n as u64;
            }
        }
        f.sync_all()?;
        Ok((bytes, t.elapsed()))
    }

    fn stop(mut self) -> Res<()> {
        vmm::control::stop(&mut self.machine)?;
        Ok(())
    }
}

/// Section 1. Returns a snapshot of a 256 MiB-RAM VM for section 2.
fn snapshot_section(dir: &Path, kernel: &Path, reps: usize) -> Res<PathBuf> {
    println!("### 1. Snapshot of a paused VM: 256 MiB RAM, one pcow device");
    println!();
    println!(
        "pcow image: {} MiB written before boot, {} MiB of it rewritten through the \
         mapping after boot (the written set); milliseconds.\n",
        PMEM_BASE >> 20,
        PMEM_WRITTEN >> 20
    );
    println!("| image | pause | vCPU/VM state | devices | RAM write | pmem capture | files | total | plain barrier, same writes | RAM write MiB/s | sequential write + fsync MiB/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let ram = 256 * MIB;
    let mut kept = None;
    let mut pmem_medians = Vec::new();
    let mut twin_stats = String::new();
    for size in [GIB, 16 * GIB] {
        let g = size >> 30;
        let (mut pause, mut cpu, mut dev, mut memw, mut pm, mut files, mut total) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        let (mut barrier, mut plain) = (vec![], vec![]);
        let (mut mem_bytes, mut plain_bytes) = (0, 0);
        for r in 0..reps {
            // The baseline first, on a twin VM: the same written set's
            // plain barrier, no freeze.
            let twin = Prepared::new(dir, kernel, &format!("twin{g}g-{r}"), size, ram)?;
            let region = twin.machine.pmem[0].pcow().ok_or("not pcow")?;
            let t = Instant::now();
            let stats = region.barrier()?;
            barrier.push(t.elapsed());
            if stats.private_pages * 4096 < PMEM_WRITTEN {
                return Err(format!("the barrier found only {stats:?}").into());
            }
            twin_stats = format!(
                "{} private pages found, {} pages in {} clusters copied",
                stats.private_pages, stats.pages_copied, stats.clusters_copied
            );
            twin.stop()?;
            remove_images(dir, &format!("twin{g}g-{r}"))?;

            let name = format!("img{g}g-{r}");
            let vm = Prepared::new(dir, kernel, &name, size, ram)?;
            let snap = dir.join(format!("snap-{name}"));
            let (p, t) = vm.snapshot(&snap)?;
            let plain_file = dir.join("plain-write");
            let (bytes, d) = vm.write_ram_plainly(&plain_file)?;
            std::fs::remove_file(&plain_file)?;
            plain.push(d);
            plain_bytes = bytes;
            vm.stop()?;
            mem_bytes = std::fs::metadata(snap.join("memory-ranges"))?.blocks() * 512;
            pause.push(p);
            cpu.push(t.cpu_state);
            dev.push(t.devices);
            memw.push(t.memory);
            pm.push(t.pmem);
            files.push(t.files);
            total.push(p + t.cpu_state + t.devices + t.memory + t.pmem + t.files);
            if size == GIB && kept.is_none() {
                kept = Some(snap);
            } else {
                remove_snapshot(&snap)?;
                remove_images(dir, &name)?;
            }
        }
        let pmem_m = median(pm);
        pmem_medians.push(pmem_m);
        let memw_m = median(memw);
        println!(
            "| {g} GiB | {} | {} | {} | {} | {} | {} | {} | {} | {} ({} MiB on disk) | {} |",
            ms(median(pause)),
            ms(median(cpu)),
            ms(median(dev)),
            ms(memw_m),
            ms(pmem_m),
            ms(median(files)),
            ms(median(total)),
            ms(median(barrier)),
            mib_s(mem_bytes, memw_m),
            mem_bytes >> 20,
            mib_s(plain_bytes, median(plain)),
        );
    }
    println!();
    println!("The plain barrier's work (last run): {twin_stats}.\n");
    println!(
        "pmem capture, 16 GiB / 1 GiB image: **{:.2}**\n",
        pmem_medians[1].as_secs_f64() / pmem_medians[0].as_secs_f64()
    );
    kept.ok_or_else(|| "no snapshot kept".into())
}

/// Removes the device image `name` and its base.
fn remove_images(dir: &Path, name: &str) -> Res<()> {
    std::fs::remove_file(dir.join(format!("{name}.pcow")))?;
    std::fs::remove_file(dir.join(format!("{name}-base.pcow")))?;
    Ok(())
}

/// Removes a snapshot directory and the frozen images its state names.
fn remove_snapshot(snap: &Path) -> Res<()> {
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snap.join("state.json"))?)?;
    for p in state["pmem"].as_array().into_iter().flatten() {
        if let Some(f) = p["frozen"].as_str() {
            std::fs::remove_file(f)?;
        }
    }
    std::fs::remove_dir_all(snap)?;
    Ok(())
}

/// Drops `file`'s pages from the page cache (this file only: the machine
/// is shared). Pages mapped by a process stay; none is mapped here.
fn evict(file: &Path) -> Res<()> {
    let f = File::open(file)?;
    // SAFETY: posix_fadvise only reads its integer arguments; `f` is an
    // open descriptor for the duration of the call.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(format!(
            "posix_fadvise({}): {}",
            file.display(),
            std::io::Error::from_raw_os_error(rc)
        )
        .into());
    }
    Ok(())
}

fn read_sequentially(file: &Path) -> Res<Duration> {
    let t = Instant::now();
    let mut f = File::open(file)?;
    let mut buf = vec![0u8; CHUNK];
    while f.read(&mut buf)? > 0 {}
    Ok(t.elapsed())
}

/// Section 2: restore to running vCPUs.
fn restore_section(dir: &Path, snaps: &[(u64, &PathBuf)], reps: usize) -> Res<()> {
    println!("### 2. Restore to running vCPUs (`restore()` start to vCPUs resumed)");
    println!();
    println!(
        "Milliseconds. Cold: `memory-ranges` dropped from the page cache first \
         (`POSIX_FADV_DONTNEED` on that file); warm: read by the previous run. \
         The pmem device is a clone (a new thin overlay) each time.\n"
    );
    println!("| RAM | cache | Copy | CopyOnWrite | CopyOnWrite + prefault | CoW / Copy | read `memory-ranges` sequentially | of which RAM (Copy; CoW + prefault) |");
    println!("|---|---|---|---|---|---|---|---|");
    let modes = [
        (MemoryRestoreMode::Copy, false),
        (MemoryRestoreMode::CopyOnWrite, false),
        (MemoryRestoreMode::CopyOnWrite, true),
    ];
    for (ram, snap) in snaps {
        let ranges = snap.join("memory-ranges");
        for cold in [true, false] {
            let mut cols = Vec::new();
            let mut ram_part = Vec::new();
            for (mode, prefault) in modes {
                let (mut all, mut memory) = (vec![], vec![]);
                for r in 0..reps {
                    if cold {
                        evict(&ranges)?;
                    } else {
                        read_sequentially(&ranges)?;
                    }
                    let clone = dir.join(format!("restore-clone-{r}.pcow"));
                    let req = RestoreRequest {
                        source: snap.to_path_buf(),
                        prefault,
                        memory_restore_mode: mode,
                        resume: false,
                        pmem: vec![PmemClone {
                            id: "_pmem0".into(),
                            file: clone.clone(),
                        }],
                    };
                    let t = Instant::now();
                    let mut restored = restore_machine::restore(&req)?;
                    restored.machine.ctl.resume();
                    all.push(t.elapsed());
                    memory.push(restored.times.memory);
                    vmm::control::stop(&mut restored.machine)?;
                    drop(restored);
                    std::fs::remove_file(&clone)?;
                }
                cols.push(median(all));
                ram_part.push(median(memory));
            }
            if cold {
                evict(&ranges)?;
            }
            let read = read_sequentially(&ranges)?;
            println!(
                "| {} MiB | {} | {} | {} | {} | {:.3} | {} | {}; {} |",
                ram >> 20,
                if cold { "cold" } else { "warm" },
                ms(cols[0]),
                ms(cols[1]),
                ms(cols[2]),
                cols[1].as_secs_f64() / cols[0].as_secs_f64(),
                ms(read),
                ms(ram_part[0]),
                ms(ram_part[2]),
            );
        }
    }
    println!();
    Ok(())
}

/// A `cloud-hypervisor` process with its API socket.
struct Vmm {
    child: Child,
    sock: PathBuf,
}

impl Vmm {
    fn spawn(bin: &Path, dir: &Path, name: &str, args: &[String]) -> Res<Vmm> {
        let sock = dir.join(format!("{name}.sock"));
        let log = File::create(dir.join(format!("{name}.log")))?;
        let child = Command::new(bin)
            .arg("--api-socket")
            .arg(format!("path={}", sock.display()))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        Ok(Vmm { child, sock })
    }

    /// Waits until `vm.info` says Running.
    fn wait_running(&mut self, name: &str) -> Res<()> {
        let t = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Err(format!("{name} exited ({status}); see its .log").into());
            }
            if let Ok(body) = get(&self.sock, "vm.info") {
                let v: serde_json::Value = serde_json::from_str(&body)?;
                if v["state"] == "Running" {
                    return Ok(());
                }
            }
            if t.elapsed() > Duration::from_secs(60) {
                return Err(format!("{name}: not Running after 60 s").into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// (PSS, RSS) in KiB, from /proc/PID/smaps_rollup.
    fn memory(&self) -> Res<(u64, u64)> {
        let s = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", self.child.id()))?;
        let field = |name: &str| -> Res<u64> {
            let line = s
                .lines()
                .find(|l| l.starts_with(name))
                .ok_or_else(|| format!("smaps_rollup: no {name}"))?;
            let v = line[name.len()..].trim().trim_end_matches("kB").trim();
            Ok(v.parse()?)
        };
        Ok((field("Pss:")?, field("Rss:")?))
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        // Ours: killed by its own pid.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET /api/v1/<action>`: the body of a 200 answer.
fn get(sock: &Path, action: &str) -> Res<String> {
    let mut s = UnixStream::connect(sock)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /api/v1/{action} HTTP/1.1\r\nHost: localhost\r\n\r\n"
    )?;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err("connection closed before the answer".into());
        }
        out.extend_from_slice(&buf[..n]);
        let Some(p) = out.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&out[..p]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(Ok(0), |v| v.trim().parse())?;
        if out.len() >= p + 4 + len {
            if !head.starts_with("http/1.1 200") {
                return Err(format!("{action}: {}", head.lines().next().unwrap_or("")).into());
            }
            return Ok(String::from_utf8_lossy(&out[p + 4..p + 4 + len]).into_owned());
        }
    }
}

/// Section 3: the host memory of 4 VMMs at once.
fn memory_section(dir: &Path, bin: &Path, kernel: &Path, snap: &Path) -> Res<()> {
    println!("### 3. Host memory of 4 VMMs at once (1 GiB RAM snapshot, filled)");
    println!();
    println!("PSS and RSS from `/proc/PID/smaps_rollup`, MiB, read once all 4 are Running.\n");
    println!("| 4 VMMs | PSS per VM | PSS sum | RSS sum | vs 4 × Copy |");
    println!("|---|---|---|---|---|");
    let url = format!("file://{}", snap.display());
    let variants: [(&str, Option<&str>); 4] = [
        ("restored, Copy", Some("memory_restore_mode=copy")),
        (
            "restored, CopyOnWrite",
            Some("memory_restore_mode=copyonwrite"),
        ),
        (
            "restored, CopyOnWrite + prefault (RAM populated)",
            Some("memory_restore_mode=copyonwrite,prefault=on"),
        ),
        ("booted fresh (RAM untouched: the floor)", None),
    ];
    let mut copy_sum = 0;
    for (label, restore) in variants {
        let mut vms = Vec::new();
        let mut files = Vec::new();
        for k in 0..4 {
            let name = format!("vmm{k}");
            let image = dir.join(format!("vmm{k}.pcow"));
            files.push(image.clone());
            let args: Vec<String> = match restore {
                Some(opts) => vec![
                    "--restore".into(),
                    format!(
                        "source_url={url},{opts},pmem=[_pmem0@{}],resume=on",
                        image.display()
                    ),
                ],
                None => {
                    Image::create(
                        &image,
                        &CreateOptions {
                            virtual_size: Some(GIB),
                            ..Default::default()
                        },
                    )?
                    .close()?;
                    vec![
                        "--kernel".into(),
                        kernel.display().to_string(),
                        "--memory".into(),
                        "size=1024M".into(),
                        "--pmem".into(),
                        format!("file={}", image.display()),
                        "--serial".into(),
                        "null".into(),
                        "--console".into(),
                        "off".into(),
                    ]
                }
            };
            vms.push((name.clone(), Vmm::spawn(bin, dir, &name, &args)?));
        }
        for (name, vm) in &mut vms {
            vm.wait_running(name)?;
        }
        let mut pss = Vec::new();
        let mut rss = 0;
        for (_, vm) in &vms {
            let (p, r) = vm.memory()?;
            pss.push(p);
            rss += r;
        }
        drop(vms);
        for f in files {
            std::fs::remove_file(f)?;
        }
        let sum: u64 = pss.iter().sum();
        if restore == Some("memory_restore_mode=copy") {
            copy_sum = sum;
        }
        let per: Vec<String> = pss.iter().map(|p| format!("{}", p >> 10)).collect();
        println!(
            "| {label} | {} | {} | {} | {:.3} |",
            per.join(", "),
            sum >> 10,
            rss >> 10,
            sum as f64 / copy_sum as f64
        );
    }
    println!();
    Ok(())
}
