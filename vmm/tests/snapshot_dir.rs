//! The snapshot directory (`vmm::snapshot::dir`) and guest RAM in it
//! (`vmm::snapshot::memory`), without KVM: a real `GuestMemoryMmap` with
//! known content written and read back in both restore modes, sparseness,
//! every hostile directory the reader must refuse, and a writer killed at
//! random points.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm::config::{PayloadConfig, VmConfig};
use vmm::snapshot::dir::{
    CapturedState, ConfigError, SnapshotDir, SnapshotError, StateError, CONFIG_FILE, MEMORY_FILE,
    STATE_FILE, STATE_TEMP_FILE,
};
use vmm::snapshot::memory::{LayoutError, MemoryRestoreMode};

mod common;
use common::chain;

const PAGE: u64 = 4096;
/// Two RAM ranges, below and above the 32-bit hole.
const RANGES: [(u64, u64); 2] = [(0, 2 << 20), (4 << 30, 1 << 20)];

/// A xorshift generator: content that is reproducible from a seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Guest RAM over `ranges` where about one page in `one_in` holds data:
/// random bytes, a single non-zero byte at the page's start or end, or a
/// run of several data pages; the rest stays zero.
fn ram(ranges: &[(u64, u64)], seed: u64, one_in: u64) -> GuestMemoryMmap {
    let mem = GuestMemoryMmap::from_ranges(
        &ranges
            .iter()
            .map(|&(g, s)| (GuestAddress(g), s as usize))
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let mut rng = Rng(seed | 1);
    for &(gpa, size) in ranges {
        let mut page = 0;
        while page < size / PAGE {
            let at = GuestAddress(gpa + page * PAGE);
            match rng.next() % one_in {
                0 => {
                    let run = 1 + rng.next() % 4;
                    for p in 0..run.min(size / PAGE - page) {
                        let bytes: Vec<u8> = (0..PAGE).map(|_| rng.next() as u8 | 1).collect();
                        mem.write_slice(&bytes, GuestAddress(at.0 + p * PAGE))
                            .unwrap();
                    }
                    page += run;
                    continue;
                }
                1 => mem.write_obj(0x5au8, at).unwrap(),
                2 => mem
                    .write_obj(0xa5u8, GuestAddress(at.0 + PAGE - 1))
                    .unwrap(),
                _ => {}
            }
            page += 1;
        }
    }
    mem
}

fn total(ranges: &[(u64, u64)]) -> u64 {
    ranges.iter().map(|r| r.1).sum()
}

fn config(kernel: &Path, ram_size: u64) -> VmConfig {
    let mut c = VmConfig::default();
    c.memory.size = ram_size;
    c.payload = Some(PayloadConfig {
        kernel: Some(kernel.to_owned()),
        cmdline: Some("console=ttyS0".into()),
        ..Default::default()
    });
    c
}

fn captured() -> CapturedState {
    CapturedState {
        vcpus: json!([{"regs": {"rip": 4096}}, {"regs": {"rip": 8192}}]),
        vm: json!({"clock": 12345}),
        devices: json!({"serial": {"lcr": 3}}),
        pmem: vec![json!({"id": "_pmem0", "tag": "snap-1"})],
    }
}

fn write_snapshot(dir: &Path, mem: &GuestMemoryMmap, cfg: &VmConfig) {
    let mut w = SnapshotDir::create(dir).unwrap();
    w.write_memory(mem).unwrap();
    w.write_config(cfg).unwrap();
    w.finish(captured()).unwrap();
}

/// Every byte of `a` equals `b`'s, range by range.
fn assert_same_ram(a: &GuestMemoryMmap, b: &GuestMemoryMmap) {
    let ra: Vec<_> = a.iter().map(|r| (r.start_addr(), r.len())).collect();
    let rb: Vec<_> = b.iter().map(|r| (r.start_addr(), r.len())).collect();
    assert_eq!(ra, rb, "layouts differ");
    for (gpa, len) in ra {
        let mut x = vec![0u8; len as usize];
        let mut y = vec![0u8; len as usize];
        a.read_slice(&mut x, gpa).unwrap();
        b.read_slice(&mut y, gpa).unwrap();
        if x != y {
            let i = x.iter().zip(&y).position(|(p, q)| p != q).unwrap();
            panic!("RAM differs at guest {:#x}", gpa.0 + i as u64);
        }
    }
}

struct Fixture {
    tmp: tempfile::TempDir,
    kernel: PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let kernel = tmp.path().join("vmlinux");
    fs::write(&kernel, b"not a kernel: only its presence is checked").unwrap();
    Fixture { tmp, kernel }
}

#[test]
fn round_trip_both_modes_every_byte() {
    let f = fixture();
    let mem = ram(&RANGES, 7, 5);
    let cfg = config(&f.kernel, total(&RANGES));
    let dir = f.tmp.path().join("snap");
    fs::create_dir(&dir).unwrap();
    write_snapshot(&dir, &mem, &cfg);
    let names: Vec<String> = {
        let mut v: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names, [CONFIG_FILE, MEMORY_FILE, STATE_FILE]);

    let snap = SnapshotDir::open(&dir).unwrap();
    assert_eq!(snap.config().memory.size, cfg.memory.size);
    assert_eq!(snap.config().payload, cfg.payload);
    let state = snap.state();
    assert_eq!(state.version, 1);
    assert_eq!(state.vcpus, captured().vcpus);
    assert_eq!(state.vm, captured().vm);
    assert_eq!(state.devices, captured().devices);
    assert_eq!(state.pmem, captured().pmem);
    let layout: Vec<(u64, u64)> = snap
        .memory_layout()
        .ranges
        .iter()
        .map(|r| (r.gpa, r.size))
        .collect();
    assert_eq!(layout, RANGES);
    // config.json is upstream's shape: what vm.info shows.
    let on_disk: Value = serde_json::from_slice(&fs::read(dir.join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!(on_disk, serde_json::to_value(&cfg).unwrap());

    for mode in [MemoryRestoreMode::Copy, MemoryRestoreMode::CopyOnWrite] {
        for prefault in [false, true] {
            let back = snap.restore_memory(mode, prefault).unwrap();
            assert_same_ram(&mem, &back);
        }
    }

    // CopyOnWrite: a guest write stays in its VM; the file and another VM
    // restored from it are unchanged.
    let before = fs::read(dir.join(MEMORY_FILE)).unwrap();
    let a = snap
        .restore_memory(MemoryRestoreMode::CopyOnWrite, false)
        .unwrap();
    let b = snap
        .restore_memory(MemoryRestoreMode::CopyOnWrite, false)
        .unwrap();
    a.write_slice(&[0xee; 64], GuestAddress(4 << 30)).unwrap();
    a.write_slice(&[0xdd; 64], GuestAddress(8192)).unwrap();
    assert_eq!(fs::read(dir.join(MEMORY_FILE)).unwrap(), before);
    assert_same_ram(&mem, &b);
    let mut x = [0u8; 64];
    a.read_slice(&mut x, GuestAddress(4 << 30)).unwrap();
    assert_eq!(x, [0xee; 64]);

    // OnDemand is refused with a clear message.
    let e = snap
        .restore_memory(MemoryRestoreMode::OnDemand, false)
        .unwrap_err();
    let m = chain(&e);
    assert!(m.contains(MEMORY_FILE) && m.contains("OnDemand"), "{m}");
}

#[test]
fn memory_ranges_is_sparse() {
    let f = fixture();
    // 64 MiB of RAM with about one data page in 4096.
    let ranges = [(0, 48 << 20), (4 << 30, 16 << 20)];
    let mem = ram(&ranges, 3, 4096);
    let dir = f.tmp.path().join("snap");
    fs::create_dir(&dir).unwrap();
    write_snapshot(&dir, &mem, &config(&f.kernel, total(&ranges)));
    let meta = fs::metadata(dir.join(MEMORY_FILE)).unwrap();
    assert_eq!(meta.len(), total(&ranges));
    let allocated = meta.blocks() * 512;
    println!(
        "memory-ranges: {} bytes, {} allocated",
        meta.len(),
        allocated
    );
    assert!(
        allocated < total(&ranges) / 16,
        "memory-ranges not sparse: {allocated} bytes allocated"
    );
    let snap = SnapshotDir::open(&dir).unwrap();
    assert_same_ram(
        &mem,
        &snap.restore_memory(MemoryRestoreMode::Copy, false).unwrap(),
    );
}

#[test]
fn writer_refuses_a_destination_it_must_not_touch() {
    let f = fixture();
    let mem = ram(&RANGES, 1, 9);
    // Not empty: refused, its content untouched.
    let full = f.tmp.path().join("full");
    fs::create_dir(&full).unwrap();
    fs::write(full.join("keep"), b"mine").unwrap();
    let e = SnapshotDir::create(&full).unwrap_err();
    assert!(
        matches!(e, SnapshotError::NotEmpty { ref entry, .. } if entry == "keep"),
        "{e}"
    );
    assert!(e.to_string().contains("not empty"), "{e}");
    assert_eq!(fs::read(full.join("keep")).unwrap(), b"mine");
    assert_eq!(fs::read_dir(&full).unwrap().count(), 1);
    // Missing, or a file.
    let e = SnapshotDir::create(&f.tmp.path().join("nope")).unwrap_err();
    assert!(matches!(e, SnapshotError::Dir { .. }), "{e}");
    let e = SnapshotDir::create(&f.kernel).unwrap_err();
    assert!(matches!(e, SnapshotError::NotADirectory { .. }), "{e}");
    // The state comes last.
    let d = f.tmp.path().join("order");
    fs::create_dir(&d).unwrap();
    let mut w = SnapshotDir::create(&d).unwrap();
    w.write_config(&config(&f.kernel, total(&RANGES))).unwrap();
    let e = SnapshotDir::create(&d).unwrap_err();
    assert!(matches!(e, SnapshotError::NotEmpty { .. }), "{e}");
    let e = w.finish(captured()).unwrap_err();
    assert!(
        matches!(e, SnapshotError::OutOfOrder { missing, .. } if missing == MEMORY_FILE),
        "{e}"
    );
    assert!(!d.join(STATE_FILE).exists());
    let d2 = f.tmp.path().join("order3");
    fs::create_dir(&d2).unwrap();
    let mut w = SnapshotDir::create(&d2).unwrap();
    w.write_memory(&mem).unwrap();
    let e = w.finish(captured()).unwrap_err();
    assert!(
        matches!(e, SnapshotError::OutOfOrder { missing, .. } if missing == CONFIG_FILE),
        "{e}"
    );
    assert!(matches!(
        SnapshotDir::open(&d2).unwrap_err(),
        SnapshotError::Incomplete { temp: false, .. }
    ));
}

/// Every file's name and content, to show that the reader changes nothing.
fn contents(dir: &Path) -> Vec<(String, Option<Vec<u8>>)> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            let meta = e.metadata().unwrap();
            // Large sparse files: compare their length only.
            let bytes =
                (meta.is_file() && meta.len() < (8 << 20)).then(|| fs::read(e.path()).unwrap());
            (name, bytes)
        })
        .collect();
    v.sort();
    v
}

fn edit_json(file: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_slice(&fs::read(file).unwrap()).unwrap();
    f(&mut v);
    fs::write(file, serde_json::to_vec(&v).unwrap()).unwrap();
}

fn truncate(file: &Path, by: u64) {
    let len = fs::metadata(file).unwrap().len();
    let f = fs::OpenOptions::new().write(true).open(file).unwrap();
    f.set_len(len - by).unwrap();
}

type Check = fn(&SnapshotError) -> bool;

#[test]
fn hostile_directories_are_refused_naming_file_and_fault() {
    let f = fixture();
    let mem = ram(&RANGES, 11, 6);
    let cfg = config(&f.kernel, total(&RANGES));
    let template = f.tmp.path().join("template");
    fs::create_dir(&template).unwrap();
    write_snapshot(&template, &mem, &cfg);
    let half = |p: &Path| truncate(p, fs::metadata(p).unwrap().len() / 2);

    #[allow(clippy::type_complexity)]
    let cases: Vec<(&str, Box<dyn Fn(&Path)>, Option<&str>, &str, Check)> = vec![
        (
            "no state.json",
            Box::new(|d| fs::remove_file(d.join(STATE_FILE)).unwrap()),
            None,
            "incomplete snapshot",
            |e| matches!(e, SnapshotError::Incomplete { temp: false, .. }),
        ),
        (
            "only state.json.tmp",
            Box::new(|d| fs::rename(d.join(STATE_FILE), d.join(STATE_TEMP_FILE)).unwrap()),
            None,
            "only its temporary file",
            |e| matches!(e, SnapshotError::Incomplete { temp: true, .. }),
        ),
        (
            "no config.json",
            Box::new(|d| fs::remove_file(d.join(CONFIG_FILE)).unwrap()),
            Some(CONFIG_FILE),
            "missing",
            |e| matches!(e, SnapshotError::Missing { .. }),
        ),
        (
            "no memory-ranges",
            Box::new(|d| fs::remove_file(d.join(MEMORY_FILE)).unwrap()),
            Some(MEMORY_FILE),
            "missing",
            |e| matches!(e, SnapshotError::Missing { .. }),
        ),
        (
            "state.json truncated",
            Box::new(move |d| half(&d.join(STATE_FILE))),
            Some(STATE_FILE),
            "not JSON",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::NotJson(_),
                        ..
                    }
                )
            },
        ),
        (
            "state.json empty",
            Box::new(|d| fs::write(d.join(STATE_FILE), b"").unwrap()),
            Some(STATE_FILE),
            "not JSON",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::NotJson(_),
                        ..
                    }
                )
            },
        ),
        (
            "state.json garbage",
            Box::new(|d| fs::write(d.join(STATE_FILE), [0xff, 0, 0x7b, 0x22]).unwrap()),
            Some(STATE_FILE),
            "not JSON",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::NotJson(_),
                        ..
                    }
                )
            },
        ),
        (
            "state.json an array",
            Box::new(|d| fs::write(d.join(STATE_FILE), b"[]").unwrap()),
            Some(STATE_FILE),
            "not a JSON object",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::NotAnObject,
                        ..
                    }
                )
            },
        ),
        (
            "state.json version 2",
            Box::new(|d| edit_json(&d.join(STATE_FILE), |v| v["version"] = json!(2))),
            Some(STATE_FILE),
            "format version 2 is not supported",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::UnsupportedVersion { found: 2, .. },
                        ..
                    }
                )
            },
        ),
        (
            "state.json version 0",
            Box::new(|d| edit_json(&d.join(STATE_FILE), |v| v["version"] = json!(0))),
            Some(STATE_FILE),
            "format version 0",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::UnsupportedVersion { .. },
                        ..
                    }
                )
            },
        ),
        (
            "state.json version a string",
            Box::new(|d| edit_json(&d.join(STATE_FILE), |v| v["version"] = json!("1"))),
            Some(STATE_FILE),
            "not a format version number",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::BadVersion(_),
                        ..
                    }
                )
            },
        ),
        (
            "state.json without version",
            Box::new(|d| {
                edit_json(&d.join(STATE_FILE), |v| {
                    v.as_object_mut().unwrap().remove("version");
                })
            }),
            Some(STATE_FILE),
            "no `version`",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::NoVersion,
                        ..
                    }
                )
            },
        ),
        (
            "state.json unknown field",
            Box::new(|d| edit_json(&d.join(STATE_FILE), |v| v["extra"] = json!(1))),
            Some(STATE_FILE),
            "unknown field `extra`",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::Fields(_),
                        ..
                    }
                )
            },
        ),
        (
            "state.json without devices",
            Box::new(|d| {
                edit_json(&d.join(STATE_FILE), |v| {
                    v.as_object_mut().unwrap().remove("devices");
                })
            }),
            Some(STATE_FILE),
            "missing field `devices`",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::Fields(_),
                        ..
                    }
                )
            },
        ),
        (
            "state.json pmem not a list",
            Box::new(|d| edit_json(&d.join(STATE_FILE), |v| v["pmem"] = json!({}))),
            Some(STATE_FILE),
            "invalid type",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::Fields(_),
                        ..
                    }
                )
            },
        ),
        (
            "state.json range size negative",
            Box::new(|d| {
                edit_json(&d.join(STATE_FILE), |v| {
                    v["memory"]["ranges"][0]["size"] = json!(-4096)
                })
            }),
            Some(STATE_FILE),
            "invalid value",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::Fields(_),
                        ..
                    }
                )
            },
        ),
        (
            "state.json range misaligned",
            Box::new(|d| {
                edit_json(&d.join(STATE_FILE), |v| {
                    v["memory"]["ranges"][1]["gpa"] = json!((4u64 << 30) + 100)
                })
            }),
            Some(STATE_FILE),
            "multiples of 4 KiB",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::Layout(LayoutError::Misaligned { index: 1, .. }),
                        ..
                    }
                )
            },
        ),
        (
            "state.json ranges overlap",
            Box::new(|d| {
                edit_json(&d.join(STATE_FILE), |v| {
                    v["memory"]["ranges"][1]["gpa"] = json!(1 << 20)
                })
            }),
            Some(STATE_FILE),
            "starts below the end",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::Layout(LayoutError::Unordered { .. }),
                        ..
                    }
                )
            },
        ),
        (
            "state.json no ranges",
            Box::new(|d| edit_json(&d.join(STATE_FILE), |v| v["memory"]["ranges"] = json!([]))),
            Some(STATE_FILE),
            "no RAM range",
            |e| {
                matches!(
                    e,
                    SnapshotError::State {
                        source: StateError::Layout(LayoutError::Empty),
                        ..
                    }
                )
            },
        ),
        (
            "state.json huge",
            Box::new(|d| {
                let f = fs::OpenOptions::new()
                    .write(true)
                    .open(d.join(STATE_FILE))
                    .unwrap();
                f.set_len(65 << 20).unwrap();
            }),
            Some(STATE_FILE),
            "more than the",
            |e| matches!(e, SnapshotError::TooLarge { .. }),
        ),
        (
            "state.json a directory",
            Box::new(|d| {
                fs::remove_file(d.join(STATE_FILE)).unwrap();
                fs::create_dir(d.join(STATE_FILE)).unwrap();
            }),
            Some(STATE_FILE),
            "not a regular file",
            |e| matches!(e, SnapshotError::NotAFile { .. }),
        ),
        (
            "config.json truncated",
            Box::new(move |d| half(&d.join(CONFIG_FILE))),
            Some(CONFIG_FILE),
            "not a VM config",
            |e| {
                matches!(
                    e,
                    SnapshotError::Config {
                        source: ConfigError::Json(_),
                        ..
                    }
                )
            },
        ),
        (
            "config.json wrong type",
            Box::new(|d| edit_json(&d.join(CONFIG_FILE), |v| v["memory"] = json!("big"))),
            Some(CONFIG_FILE),
            "not a VM config",
            |e| {
                matches!(
                    e,
                    SnapshotError::Config {
                        source: ConfigError::Json(_),
                        ..
                    }
                )
            },
        ),
        (
            "config.json invalid: no vCPU",
            Box::new(|d| edit_json(&d.join(CONFIG_FILE), |v| v["cpus"]["boot_vcpus"] = json!(0))),
            Some(CONFIG_FILE),
            "invalid VM config",
            |e| {
                matches!(
                    e,
                    SnapshotError::Config {
                        source: ConfigError::Invalid(_),
                        ..
                    }
                )
            },
        ),
        (
            // A kernel file that is gone is fine (the RAM holds it); a
            // config without one is not a VM's.
            "config.json invalid: no kernel",
            Box::new(|d| {
                edit_json(&d.join(CONFIG_FILE), |v| {
                    v["payload"]["kernel"] = json!(null)
                })
            }),
            Some(CONFIG_FILE),
            "invalid VM config",
            |e| {
                matches!(
                    e,
                    SnapshotError::Config {
                        source: ConfigError::Invalid(_),
                        ..
                    }
                )
            },
        ),
        (
            "config.json RAM differs from the layout",
            Box::new(|d| {
                edit_json(&d.join(CONFIG_FILE), |v| {
                    v["memory"]["size"] = json!(total(&RANGES) + PAGE)
                })
            }),
            Some(CONFIG_FILE),
            "adds up to",
            |e| matches!(e, SnapshotError::RamMismatch { .. }),
        ),
        (
            "memory-ranges truncated",
            Box::new(|d| truncate(&d.join(MEMORY_FILE), PAGE)),
            Some(MEMORY_FILE),
            "needs exactly",
            |e| matches!(e, SnapshotError::MemorySize { .. }),
        ),
        (
            "memory-ranges empty",
            Box::new(|d| fs::write(d.join(MEMORY_FILE), b"").unwrap()),
            Some(MEMORY_FILE),
            "needs exactly",
            |e| matches!(e, SnapshotError::MemorySize { actual: 0, .. }),
        ),
        (
            "memory-ranges longer",
            Box::new(|d| {
                let f = fs::OpenOptions::new()
                    .write(true)
                    .open(d.join(MEMORY_FILE))
                    .unwrap();
                f.set_len(total(&RANGES) + PAGE).unwrap();
            }),
            Some(MEMORY_FILE),
            "needs exactly",
            |e| matches!(e, SnapshotError::MemorySize { .. }),
        ),
        (
            "memory-ranges for another layout",
            Box::new(|d| {
                // Both the config and the layout say more RAM than the file.
                edit_json(&d.join(STATE_FILE), |v| {
                    v["memory"]["ranges"][1]["size"] = json!(2 << 20)
                });
                edit_json(&d.join(CONFIG_FILE), |v| {
                    v["memory"]["size"] = json!(4 << 20)
                });
            }),
            Some(MEMORY_FILE),
            "needs exactly",
            |e| matches!(e, SnapshotError::MemorySize { .. }),
        ),
        (
            "memory-ranges a directory",
            Box::new(|d| {
                fs::remove_file(d.join(MEMORY_FILE)).unwrap();
                fs::create_dir(d.join(MEMORY_FILE)).unwrap();
            }),
            Some(MEMORY_FILE),
            "not a regular file",
            |e| matches!(e, SnapshotError::NotAFile { .. }),
        ),
    ];
    assert!(cases.len() >= 30);
    for (i, (name, mutate, file, needle, check)) in cases.iter().enumerate() {
        let d = f.tmp.path().join(format!("case{i}"));
        fs::create_dir(&d).unwrap();
        for n in [CONFIG_FILE, STATE_FILE, MEMORY_FILE] {
            fs::copy(template.join(n), d.join(n)).unwrap();
        }
        mutate(&d);
        let before = contents(&d);
        let e = SnapshotDir::open(&d).expect_err(name);
        let m = chain(&e);
        assert!(check(&e), "{name}: wrong error: {m}");
        assert!(m.contains(needle), "{name}: `{needle}` not in: {m}");
        let names = match file {
            Some(file) => d.join(file),
            None => d.clone(),
        };
        assert!(
            e.to_string().starts_with(&names.display().to_string()),
            "{name}: the error does not name {}: {m}",
            names.display()
        );
        assert!(!m.contains('\n'), "{name}: {m}");
        assert_eq!(
            contents(&d),
            before,
            "{name}: the reader changed the directory"
        );
    }
    // The directory itself.
    let e = SnapshotDir::open(&f.tmp.path().join("nope")).unwrap_err();
    assert!(matches!(e, SnapshotError::Dir { .. }), "{e}");
    let e = SnapshotDir::open(&f.kernel).unwrap_err();
    assert!(matches!(e, SnapshotError::NotADirectory { .. }), "{e}");
    // And the template is still good.
    let snap = SnapshotDir::open(&template).unwrap();
    assert_same_ram(
        &mem,
        &snap.restore_memory(MemoryRestoreMode::Copy, false).unwrap(),
    );
}

const CHILD_DIR: &str = "SNAPDIR_TEST_CHILD_DIR";
const CHILD_KERNEL: &str = "SNAPDIR_TEST_CHILD_KERNEL";
/// RAM of the killed writers: large enough that writing it takes a while.
const CHILD_RANGES: [(u64, u64); 2] = [(0, 24 << 20), (4 << 30, 8 << 20)];
const CHILD_SEED: u64 = 99;

/// The child process of [`kill_mid_write_leaves_complete_or_incomplete`]:
/// writes one snapshot into `$SNAPDIR_TEST_CHILD_DIR`. Ignored, so that only
/// that test runs it (with `--ignored`); without the variable it does
/// nothing.
#[test]
#[ignore = "the child process of kill_mid_write_leaves_complete_or_incomplete"]
fn child_writer() {
    let (Some(dir), Some(kernel)) = (std::env::var_os(CHILD_DIR), std::env::var_os(CHILD_KERNEL))
    else {
        println!("child_writer: run by kill_mid_write_leaves_complete_or_incomplete only");
        return;
    };
    let mem = ram(&CHILD_RANGES, CHILD_SEED, 2);
    let cfg = config(Path::new(&kernel), total(&CHILD_RANGES));
    // Mark the start so the parent times the write, not the process start.
    println!("writing");
    write_snapshot(Path::new(&dir), &mem, &cfg);
}

fn spawn_child(dir: &Path, kernel: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "child_writer",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, dir)
        .env(CHILD_KERNEL, kernel)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn kill_mid_write_leaves_complete_or_incomplete() {
    let f = fixture();
    let expected = ram(&CHILD_RANGES, CHILD_SEED, 2);
    // One full run, to know how long a write takes.
    let d = f.tmp.path().join("full");
    fs::create_dir(&d).unwrap();
    let t = Instant::now();
    let status = spawn_child(&d, &f.kernel).wait().unwrap();
    let full = t.elapsed();
    assert!(status.success(), "the child writer failed: {status}");
    assert_same_ram(
        &expected,
        &SnapshotDir::open(&d)
            .unwrap()
            .restore_memory(MemoryRestoreMode::Copy, false)
            .unwrap(),
    );
    fs::remove_dir_all(&d).unwrap();

    let iterations = 40;
    let (mut complete, mut incomplete) = (0, 0);
    let mut rng = Rng(0x5eed);
    let span = full.as_micros() as u64 * 3 / 2;
    for i in 0..iterations {
        let d = f.tmp.path().join(format!("kill{i}"));
        fs::create_dir(&d).unwrap();
        let mut child = spawn_child(&d, &f.kernel);
        std::thread::sleep(Duration::from_micros(rng.next() % span.max(1)));
        // SIGKILL (a no-op error if it already exited).
        let _ = child.kill();
        child.wait().unwrap();
        match SnapshotDir::open(&d) {
            Ok(snap) => {
                let back = snap.restore_memory(MemoryRestoreMode::Copy, false).unwrap();
                assert_same_ram(&expected, &back);
                assert_eq!(snap.state().vcpus, captured().vcpus);
                complete += 1;
            }
            Err(SnapshotError::Incomplete { .. }) => incomplete += 1,
            Err(e) => panic!(
                "iteration {i}: neither complete nor incomplete: {}",
                chain(&e)
            ),
        }
        fs::remove_dir_all(&d).unwrap();
    }
    println!(
        "a full write took {full:?}; {iterations} kills: {complete} complete, {incomplete} \
         incomplete"
    );
    assert_eq!(complete + incomplete, iterations);
    assert!(
        incomplete > 0,
        "no kill landed mid-write: the test did not test anything"
    );
}
