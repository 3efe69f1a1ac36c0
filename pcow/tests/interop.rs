//! Interop with QEMU's tools (Debian's `qemu-utils`) as the reference:
//! qemu-img reads what `pcow-img convert -O raw` writes, and qemu-img's own
//! raw output round-trips through `pcow-img convert -O pcow`.
//!
//! Without `qemu-img` these tests say so on stderr and return; under CI
//! (`CI` set) a missing `qemu-img` is a failure, since `scripts/test.sh`
//! installs it.

use std::path::Path;
use std::process::Command;

const PCOW_IMG: &str = env!("CARGO_BIN_EXE_pcow-img");

fn have_qemu() -> bool {
    let found = Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "qemu-img is missing on CI (scripts/test.sh installs qemu-utils)"
        );
        eprintln!("SKIPPED: qemu-img not installed (apt-get install qemu-utils)");
    }
    found
}

fn run(dir: &Path, prog: &str, args: &[&str]) -> String {
    let out = Command::new(prog)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{prog} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn pcow(dir: &Path, args: &[&str]) -> String {
    run(dir, PCOW_IMG, args)
}

fn qemu(dir: &Path, args: &[&str]) -> String {
    run(dir, "qemu-img", args)
}

fn same_bytes(dir: &Path, a: &str, b: &str) {
    let (x, y) = (
        std::fs::read(dir.join(a)).unwrap(),
        std::fs::read(dir.join(b)).unwrap(),
    );
    assert_eq!(x.len(), y.len(), "{a} and {b} differ in length");
    if let Some(i) = x.iter().zip(&y).position(|(p, q)| p != q) {
        panic!("{a} and {b} differ at byte {i}");
    }
}

#[test]
fn qemu_img_reads_what_convert_to_raw_writes() {
    if !have_qemu() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    // A chain with a raw base, a snapshot and partial-page writes.
    std::fs::write(
        p.join("base.raw"),
        (0..3u32 << 20).map(|i| (i % 253) as u8).collect::<Vec<_>>(),
    )
    .unwrap();
    pcow(
        p,
        &[
            "create", "-c", "16k", "-b", "base.raw", "-F", "raw", "top.pcow", "4M",
        ],
    );
    pcow(
        p,
        &[
            "io",
            "top.pcow",
            "-c",
            "write -P 0x11 4096 10000",
            "-c",
            "write -P 0x22 3M 100k",
        ],
    );
    pcow(p, &["snapshot", "-c", "s", "top.pcow"]);
    pcow(
        p,
        &[
            "io",
            "top.pcow",
            "-c",
            "write -P 0x33 5000 3",
            "-c",
            "write -P 0 1M 64k",
        ],
    );
    pcow(p, &["convert", "-O", "raw", "top.pcow", "out.raw"]);
    // qemu-img sees a raw image of the virtual size...
    let info: serde_json::Value = serde_json::from_str(&qemu(
        p,
        &["info", "--output", "json", "-f", "raw", "out.raw"],
    ))
    .unwrap();
    assert_eq!(info["virtual-size"], 4 << 20);
    // ...whose bytes, read through QEMU's block layer into qcow2 and back,
    // are what pcow-img's own reader (and the expected pattern) says.
    qemu(
        p,
        &["convert", "-f", "raw", "-O", "qcow2", "out.raw", "q.qcow2"],
    );
    qemu(
        p,
        &["compare", "-f", "raw", "-F", "qcow2", "out.raw", "q.qcow2"],
    );
    qemu(
        p,
        &["convert", "-f", "qcow2", "-O", "raw", "q.qcow2", "back.raw"],
    );
    same_bytes(p, "out.raw", "back.raw");
    let bytes = std::fs::read(p.join("out.raw")).unwrap();
    assert_eq!(&bytes[4096..4096 + 900], &[0x11; 900][..]);
    assert_eq!(&bytes[5000..5003], &[0x33; 3][..]);
    assert_eq!(&bytes[(1 << 20)..(1 << 20) + 65536], &[0u8; 65536][..]);
    assert_eq!(bytes[2 << 20], ((2u32 << 20) % 253) as u8);
    assert_eq!(&bytes[3 << 20..(3 << 20) + 102400], &[0x22; 102400][..]);
    assert!(
        bytes[(3 << 20) + 102400..].iter().all(|&b| b == 0),
        "past the raw base: zeros"
    );
    // The snapshot's content too.
    pcow(p, &["rollback", "top.pcow", "s"]);
    pcow(p, &["convert", "-O", "raw", "top.pcow", "snap.raw"]);
    qemu(
        p,
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            "snap.raw",
            "snap-q.raw",
        ],
    );
    same_bytes(p, "snap.raw", "snap-q.raw");
    let snap = std::fs::read(p.join("snap.raw")).unwrap();
    assert_eq!(&snap[5000..5003], &[0x11; 3][..]);
    assert_eq!(snap[1 << 20], ((1u32 << 20) % 253) as u8);
}

#[test]
fn qemu_raw_output_round_trips_through_pcow() {
    if !have_qemu() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    // A sparse qcow2 written by QEMU's own tools.
    qemu(p, &["create", "-f", "qcow2", "src.qcow2", "6M"]);
    run(
        p,
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 0xab 0 64k",
            "-c",
            "write -P 0xcd 1000000 5000",
            "-c",
            "write -P 0xef 5M 1M",
            "src.qcow2",
        ],
    );
    qemu(
        p,
        &["convert", "-f", "qcow2", "-O", "raw", "src.qcow2", "q.raw"],
    );
    for cluster in ["4k", "64k", "2M"] {
        let img = format!("p-{cluster}.pcow");
        let back = format!("back-{cluster}.raw");
        pcow(
            p,
            &[
                "convert", "-f", "raw", "-O", "pcow", "-c", cluster, "q.raw", &img,
            ],
        );
        pcow(p, &["check", &img]);
        pcow(p, &["convert", "-O", "raw", &img, &back]);
        same_bytes(p, "q.raw", &back);
        // And qemu-img agrees with the original qcow2.
        qemu(
            p,
            &["compare", "-f", "raw", "-F", "qcow2", &back, "src.qcow2"],
        );
    }
    // Thin: the 64 KiB-cluster image holds about what was written.
    let len = std::fs::metadata(p.join("p-64k.pcow")).unwrap().len();
    assert!(
        len < (3 << 20),
        "p-64k.pcow is {len} bytes for 1.1 MiB of data"
    );
}

/// `compare ARGS` by qemu-img and by pcow-img: exit status and stdout.
fn compare_with(dir: &Path, prog: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new(prog)
        .arg("compare")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn compare_answers_as_qemu_img_does() {
    if !have_qemu() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let m = 1usize << 20;
    let mut a = vec![0u8; m];
    a[8192..20480].fill(0x11);
    a[700_000..709_000].fill(0x33);
    let write = |name: &str, v: &[u8]| std::fs::write(p.join(name), v).unwrap();
    write("a.raw", &a);
    write("same.raw", &a);
    let mut c = a.clone();
    c[13_000] ^= 0xff;
    write("c.raw", &c);
    let mut big = a.clone();
    big.resize(2 * m, 0);
    write("big.raw", &big);
    big[1_572_900] = 1;
    write("bigd.raw", &big);
    // Sparse against zeros written: strict mode too (a raw image is
    // allocated everywhere).
    let f = std::fs::File::create(p.join("sparse.raw")).unwrap();
    f.set_len(m as u64).unwrap();
    write("zeros.raw", &vec![0u8; m]);
    // pcow: a base and an overlay with one byte changed, and their raw
    // conversions for qemu-img.
    pcow(p, &["convert", "-O", "pcow", "a.raw", "a.pcow"]);
    pcow(p, &["create", "-b", "a.pcow", "-F", "pcow", "o.pcow"]);
    pcow(p, &["io", "o.pcow", "-c", "write -P 0x22 700100 1"]);
    pcow(p, &["convert", "-O", "raw", "o.pcow", "o.raw"]);

    let cases: &[&[&str]] = &[
        &["a.raw", "same.raw"],
        &["a.raw", "c.raw"],
        &["c.raw", "a.raw"],
        &["a.raw", "big.raw"],
        &["-s", "a.raw", "big.raw"],
        &["a.raw", "bigd.raw"],
        &["bigd.raw", "a.raw"],
        &["sparse.raw", "zeros.raw"],
        &["-s", "sparse.raw", "zeros.raw"],
        &["-q", "a.raw", "c.raw"],
    ];
    for args in cases {
        let mut q = vec!["-f", "raw", "-F", "raw"];
        q.extend_from_slice(args);
        let want = compare_with(p, "qemu-img", &q);
        let got = compare_with(p, PCOW_IMG, &q);
        assert_eq!(got, want, "compare {args:?}: pcow-img vs qemu-img");
    }
    // pcow images against qemu-img on their raw conversions.
    let want = compare_with(p, "qemu-img", &["-f", "raw", "-F", "raw", "a.raw", "o.raw"]);
    assert_eq!(want.0, 1, "{want:?}");
    assert_eq!(compare_with(p, PCOW_IMG, &["a.pcow", "o.pcow"]), want);
    assert_eq!(compare_with(p, PCOW_IMG, &["a.raw", "o.pcow"]), want);
}

/// The data ranges of a file (`SEEK_DATA`/`SEEK_HOLE`), as qemu-img's map
/// of a raw file sees them.
fn data_ranges(path: &Path) -> Vec<(u64, u64)> {
    use std::io::{Seek, SeekFrom};
    let mut f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len();
    let mut out = Vec::new();
    let mut off = 0;
    while off < len {
        // SEEK_DATA = 3, SEEK_HOLE = 4 (std has no names for them).
        let fd = std::os::unix::io::AsRawFd::as_raw_fd(&f);
        // SAFETY: lseek on an fd owned by `f`, which is open.
        let s = unsafe { libc::lseek(fd, off as i64, libc::SEEK_DATA) };
        if s < 0 {
            break;
        }
        // SAFETY: as above.
        let e = unsafe { libc::lseek(fd, s, libc::SEEK_HOLE) };
        out.push((s as u64, e as u64));
        off = e as u64;
    }
    f.seek(SeekFrom::Start(0)).unwrap();
    out
}

/// `ranges` without the first block.
fn holes_at_start(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    if let Some(first) = ranges.first_mut() {
        if first.0 == 0 {
            first.0 = 4096;
            if first.0 >= first.1 {
                ranges.remove(0);
            }
        }
    }
    ranges
}

/// `convert` into raw outputs, new (sparse, `-S 0`) and existing (`-n`,
/// `--target-is-zero`), gives the same bytes and the same holes as
/// qemu-img's.
#[test]
fn convert_to_raw_outputs_as_qemu_img_does() {
    if !have_qemu() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let m = 1usize << 20;
    let mut src = vec![0u8; 2 * m];
    src[8192..20480].fill(0x11);
    src[700_000..709_000].fill(0x33);
    src[m + 5] = 0x44;
    std::fs::write(p.join("src.raw"), &src).unwrap();
    // Targets for -n: 3 MiB of 0x77, and a sparse one.
    let full_target = vec![0x77u8; 3 * m];
    type Case<'a> = (&'a [&'a str], Option<&'a [u8]>);
    let cases: &[Case] = &[
        (&[], None),
        (&["-S", "0"], None),
        (&["-n"], Some(&full_target)),
        (&["-n", "--target-is-zero"], Some(&[])),
    ];
    for (args, target) in cases {
        let mut outs = Vec::new();
        for tool in ["qemu-img", PCOW_IMG] {
            let out = p.join(if tool == PCOW_IMG {
                "pcow.out"
            } else {
                "qemu.out"
            });
            let _ = std::fs::remove_file(&out);
            if let Some(t) = target {
                std::fs::write(&out, t).unwrap();
                if t.is_empty() {
                    std::fs::File::options()
                        .write(true)
                        .open(&out)
                        .unwrap()
                        .set_len(3 * m as u64)
                        .unwrap();
                }
            }
            let mut a = vec!["convert", "-f", "raw", "-O", "raw"];
            a.extend_from_slice(args);
            a.extend(["src.raw", out.to_str().unwrap()]);
            run(p, tool, &a);
            let mut ranges = data_ranges(&out);
            if target.is_none() {
                // qemu-img allocates the first block of every file it
                // creates (file-posix's allocate_first_block, so that
                // alignment probing works), data or not: the first block
                // (zeros in src) is left out of both maps.
                ranges = holes_at_start(ranges);
            }
            outs.push((std::fs::read(&out).unwrap(), ranges));
        }
        assert!(outs[0].0 == outs[1].0, "convert {args:?}: the bytes differ");
        assert_eq!(
            outs[1].1, outs[0].1,
            "convert {args:?}: data ranges (pcow-img, qemu-img)"
        );
    }
}

/// `map` of raw files (any data/hole layout, `--start-offset`,
/// `--max-length`) answers as `qemu-img map` does, in JSON and in the
/// human form.
#[test]
fn map_of_raw_files_as_qemu_img_does() {
    if !have_qemu() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let f = std::fs::File::create(p.join("r.raw")).unwrap();
    f.set_len(4 << 20).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[1; 8192], 0).unwrap();
    f.write_all_at(&[2; 4096], 1 << 20).unwrap();
    f.write_all_at(&[3; 65536], (4 << 20) - 65536).unwrap();
    std::fs::write(p.join("full.raw"), vec![9u8; 1 << 20]).unwrap();
    let strip = |json: &str| -> serde_json::Value {
        let mut v: serde_json::Value = serde_json::from_str(json).unwrap();
        for e in v.as_array_mut().unwrap() {
            e.as_object_mut().unwrap().remove("file");
        }
        v
    };
    let cases: &[&[&str]] = &[
        &["r.raw"],
        &["full.raw"],
        &["--start-offset=4096", "r.raw"],
        &["--start-offset=1M", "--max-length=8192", "r.raw"],
        &["--start-offset=3M", "r.raw"],
        &["--start-offset=8M", "r.raw"],
    ];
    for args in cases {
        // Past the end, qemu-img's JSON holds one entry of length 0 and
        // pcow-img's none: only the human form (a header) is compared.
        let past_end = args.contains(&"--start-offset=8M");
        for json in [true, false].into_iter().filter(|&j| !(j && past_end)) {
            let mut a = vec!["map", "-f", "raw"];
            if json {
                a.push("--output=json");
            }
            a.extend_from_slice(args);
            let (want, got) = (qemu(p, &a), pcow(p, &a));
            if json {
                assert_eq!(
                    strip(&got),
                    strip(&want),
                    "map {args:?}: pcow-img vs qemu-img"
                );
            } else {
                assert_eq!(got, want, "map {args:?}: pcow-img vs qemu-img");
            }
        }
    }
}

/// `info --output json` has qemu-img's shape: a raw file's object is
/// qemu-img's, and a pcow image's has every key qemu-img gives a qcow2
/// image with a snapshot and a base (top level, snapshot entries, and
/// `format-specific` with `type` and `data`). So has `check`'s.
#[test]
fn info_json_has_qemu_imgs_shape() {
    if !have_qemu() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let f = std::fs::File::create(p.join("r.raw")).unwrap();
    f.set_len(1 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[1; 4096], 8192).unwrap();
    let info = |tool: &str, args: &[&str]| -> serde_json::Value {
        let mut a = vec!["info", "--output=json"];
        a.extend_from_slice(args);
        serde_json::from_str(&run(p, tool, &a)).unwrap()
    };
    assert_eq!(
        info(PCOW_IMG, &["-f", "raw", "r.raw"]),
        info("qemu-img", &["-f", "raw", "r.raw"]),
        "info of a raw file"
    );
    qemu(
        p,
        &[
            "create", "-q", "-f", "qcow2", "-b", "r.raw", "-F", "raw", "q.qcow2",
        ],
    );
    qemu(p, &["snapshot", "-c", "s1", "q.qcow2"]);
    pcow(p, &["create", "-b", "r.raw", "-F", "raw", "a.pcow"]);
    pcow(p, &["snapshot", "-c", "s1", "a.pcow"]);
    let (want, got) = (info("qemu-img", &["q.qcow2"]), info(PCOW_IMG, &["a.pcow"]));
    let keys = |v: &serde_json::Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    let missing = |want: &serde_json::Value, got: &serde_json::Value| -> Vec<String> {
        let have = keys(got);
        keys(want)
            .into_iter()
            .filter(|k| !have.contains(k))
            .collect()
    };
    assert!(
        missing(&want, &got).is_empty(),
        "top level lacks {:?}: {got}",
        missing(&want, &got)
    );
    let (ws, gs) = (&want["snapshots"][0], &got["snapshots"][0]);
    assert!(
        missing(ws, gs).is_empty(),
        "a snapshot lacks {:?}: {gs}",
        missing(ws, gs)
    );
    assert_eq!((&gs["id"], &gs["name"]), (&ws["id"], &ws["name"]));
    assert!(missing(&want["format-specific"], &got["format-specific"]).is_empty());
    assert_eq!(got["format-specific"]["type"], "pcow");
    for k in [
        "virtual-size",
        "backing-filename",
        "backing-filename-format",
        "dirty-flag",
    ] {
        assert_eq!(got[k], want[k], "{k}");
    }
}
