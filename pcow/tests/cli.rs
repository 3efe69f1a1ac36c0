//! End-to-end tests of `pcow-img`: the real binary on files in a tempdir.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use common::{fails, ok, run_in, tmp, BIN};
use serde_json::{json, Value};

fn json(dir: &Path, args: &[&str]) -> Value {
    let s = ok(dir, args);
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{args:?}: bad JSON {e}: {s}"))
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

/// Flips one byte of a file.
fn flip(p: &Path, off: u64) {
    let f = OpenOptions::new().read(true).write(true).open(p).unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, off).unwrap();
    b[0] ^= 0xff;
    f.write_all_at(&b, off).unwrap();
}

fn pattern_file(p: &Path, len: usize, pieces: &[(usize, usize, u8)]) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for &(off, n, b) in pieces {
        v[off..off + n].fill(b);
    }
    std::fs::write(p, &v).unwrap();
    v
}

// ----- create / info -----

#[test]
fn create_and_info_json() {
    let d = tmp();
    let out = ok(d.path(), &["create", "-c", "4k", "a.pcow", "1M"]);
    assert!(out.starts_with("Formatting 'a.pcow', fmt=pcow cluster_size=4096 size=1048576"));
    let v = json(d.path(), &["info", "--output", "json", "a.pcow"]);
    assert_eq!(v["filename"], "a.pcow");
    assert_eq!(v["format"], "pcow");
    assert_eq!(v["format-specific"]["type"], "pcow");
    assert_eq!(v["format-specific"]["data"]["format-version"], 1);
    assert_eq!(v["virtual-size"], 1 << 20);
    assert_eq!(v["cluster-size"], 4096);
    assert_eq!(v["format-specific"]["data"]["allocated-clusters"], 0);
    assert_eq!(v["format-specific"]["data"]["file-length"], 4096);
    assert!(v["actual-size"].is_u64());
    assert_eq!(v["dirty-flag"], false);
    assert!(v["format-specific"]["data"]["generation"].as_u64().unwrap() >= 1);
    assert_eq!(v["snapshots"], serde_json::json!([]));
    assert_eq!(v["format-specific"]["data"]["backing-chain-depth"], 0);
    assert!(v.get("backing-filename").is_none());

    ok(d.path(), &["create", "b.pcow", "64K"]);
    let v = json(d.path(), &["info", "--output=json", "b.pcow"]);
    assert_eq!(v["cluster-size"], 65536);
    assert_eq!(v["virtual-size"], 65536);
}

#[test]
fn info_human() {
    let d = tmp();
    ok(d.path(), &["create", "a.pcow", "1G"]);
    let out = ok(d.path(), &["info", "a.pcow"]);
    assert!(out.contains("image: a.pcow\n"), "{out}");
    assert!(out.contains("file format: pcow\n"), "{out}");
    assert!(
        out.contains("virtual size: 1 GiB (1073741824 bytes)\n"),
        "{out}"
    );
    assert!(out.contains("disk size: "), "{out}");
    assert!(out.contains("cluster_size: 65536\n"), "{out}");
    assert!(!out.contains("Snapshot list"), "{out}");
    ok(d.path(), &["snapshot", "-c", "first", "a.pcow"]);
    let out = ok(d.path(), &["info", "a.pcow"]);
    assert!(out.contains("Snapshot list:\nID        TAG"), "{out}");
    assert!(out.contains("1         first"), "{out}");
    // The format-specific block, as the JSON has it.
    ok(d.path(), &["io", "-c", "write 0 4k", "a.pcow"]);
    let out = ok(d.path(), &["info", "a.pcow"]);
    let v = json(d.path(), &["info", "--output", "json", "a.pcow"]);
    let data = &v["format-specific"]["data"];
    for line in [
        "    format version: 1\n".to_string(),
        format!("    generation: {}\n", data["generation"]),
        "    allocated clusters: 1\n".to_string(),
        "    layers: 2 (active: 1)\n".to_string(),
        format!("    file length: {}\n", data["file-length"]),
    ] {
        assert!(out.contains(&line), "{line:?} in {out}");
    }
    assert!(data["generation"].as_u64().unwrap() > 1, "{v}");
}

#[test]
fn info_of_a_raw_file() {
    let d = tmp();
    std::fs::write(d.path().join("r.raw"), vec![1u8; 8192]).unwrap();
    let v = json(d.path(), &["info", "--output", "json", "r.raw"]);
    assert_eq!(v["format"], "raw");
    assert_eq!(v["virtual-size"], 8192);
    let out = ok(d.path(), &["info", "r.raw"]);
    assert!(out.contains("file format: raw"), "{out}");
}

#[test]
fn create_with_base_and_backing_chain() {
    let d = tmp();
    let sub = d.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    // A raw base of 100000 bytes; the pcow base over it, the top over that.
    std::fs::write(sub.join("r.raw"), vec![3u8; 100_000]).unwrap();
    // Relative names resolve against the new image's directory, not the cwd.
    ok(
        d.path(),
        &["create", "-b", "r.raw", "-F", "raw", "sub/mid.pcow"],
    );
    let v = json(d.path(), &["info", "--output", "json", "sub/mid.pcow"]);
    assert_eq!(
        v["virtual-size"], 131072,
        "base size rounded to the cluster"
    );
    assert_eq!(v["backing-filename"], "r.raw");
    assert_eq!(v["backing-filename-format"], "raw");
    let full = PathBuf::from(v["full-backing-filename"].as_str().unwrap());
    assert_eq!(
        std::fs::canonicalize(full).unwrap(),
        std::fs::canonicalize(sub.join("r.raw")).unwrap()
    );
    assert_eq!(v["format-specific"]["data"]["backing-chain-depth"], 1);

    // Without -F the base's format is probed and recorded.
    ok(d.path(), &["create", "-b", "mid.pcow", "sub/top.pcow"]);
    let v = json(d.path(), &["info", "--output", "json", "sub/top.pcow"]);
    assert_eq!(v["backing-filename-format"], "pcow");
    assert_eq!(v["format-specific"]["data"]["backing-chain-depth"], 2);

    let chain = json(
        d.path(),
        &[
            "info",
            "--output",
            "json",
            "--backing-chain",
            "sub/top.pcow",
        ],
    );
    let chain = chain.as_array().unwrap();
    assert_eq!(chain.len(), 3);
    assert_eq!(chain[0]["filename"], "sub/top.pcow");
    assert_eq!(chain[1]["format"], "pcow");
    assert_eq!(chain[2]["format"], "raw");
    assert_eq!(chain[2]["virtual-size"], 100_000);
    let human = ok(d.path(), &["info", "--backing-chain", "sub/top.pcow"]);
    assert_eq!(human.matches("image: ").count(), 3, "{human}");
    assert!(
        human.contains("backing file: mid.pcow (actual path: "),
        "{human}"
    );

    // The top's view reads the raw bytes through the chain.
    ok(
        d.path(),
        &["io", "-r", "sub/top.pcow", "-c", "read -P 3 0 100000"],
    );
    ok(
        d.path(),
        &["io", "-r", "sub/top.pcow", "-c", "read -P 0 100000 31072"],
    );
}

#[test]
fn create_errors() {
    let d = tmp();
    let p = d.path();
    fails(p, &["create", "a.pcow", "12x"], "'12x'");
    fails(p, &["create", "a.pcow", ""], "''");
    fails(
        p,
        &["create", "a.pcow", "99999999999999999999"],
        "too large",
    );
    fails(p, &["create", "a.pcow", "99999999T"], "too large");
    fails(
        p,
        &["create", "a.pcow", "1000"],
        "not a multiple of the cluster size 65536",
    );
    fails(p, &["create", "-c", "4k", "a.pcow", "6k"], "'6k'");
    fails(p, &["create", "a.pcow", "0"], "'0'");
    fails(p, &["create", "a.pcow"], "size is needed");
    fails(
        p,
        &["create", "-c", "3k", "a.pcow", "1M"],
        "cluster size '3k'",
    );
    fails(
        p,
        &["create", "-c", "4M", "a.pcow", "4M"],
        "cluster size '4M'",
    );
    fails(
        p,
        &["create", "-b", "missing.raw", "a.pcow"],
        "does not exist",
    );
    std::fs::write(p.join("r.raw"), [0u8; 4096]).unwrap();
    fails(
        p,
        &["create", "-b", "r.raw", "-F", "pcow", "a.pcow"],
        "is not a pcow image",
    );
    fails(p, &["create", "-F", "raw", "a.pcow", "1M"], "");
    fails(
        p,
        &["create", "-b", "r.raw", "-F", "qcow2", "a.pcow"],
        "qcow2",
    );
    fails(p, &["create", "nodir/a.pcow", "1M"], "nodir/a.pcow");
}

#[test]
fn create_with_qemu_img_style_format_and_options() {
    let d = tmp();
    let p = d.path();
    // -f raw: a sparse file of the size.
    let out = ok(p, &["create", "-f", "raw", "r.img", "1M"]);
    assert_eq!(out, "Formatting 'r.img', fmt=raw size=1048576\n");
    let meta = std::fs::metadata(p.join("r.img")).unwrap();
    assert_eq!((meta.len(), meta.blocks()), (1 << 20, 0));
    // -f pcow and -o: the same image as the flags make.
    let out = ok(
        p,
        &[
            "create",
            "-f",
            "pcow",
            "-o",
            "cluster_size=4k,size=1M",
            "a.pcow",
        ],
    );
    assert_eq!(
        out,
        "Formatting 'a.pcow', fmt=pcow cluster_size=4096 size=1048576\n"
    );
    // Several -o, a base with a comma in its name (',,').
    std::fs::copy(p.join("a.pcow"), p.join("b,1.pcow")).unwrap();
    let out = ok(
        p,
        &[
            "create",
            "-o",
            "backing_file=b,,1.pcow",
            "-o",
            "backing_fmt=pcow",
            "o.pcow",
        ],
    );
    assert!(
        out.ends_with("size=1048576 backing_file=b,1.pcow backing_fmt=pcow\n"),
        "{out}"
    );
    let v = json(p, &["info", "--output", "json", "o.pcow"]);
    assert_eq!(v["backing-filename"], "b,1.pcow");
    // -o help lists the options; no file needed.
    let out = ok(p, &["create", "-o", "help"]);
    assert!(
        out.contains("cluster_size=SIZE") && out.contains("backing_fmt"),
        "{out}"
    );

    fails(
        p,
        &["create", "-o", "compat=1.1", "x.pcow", "1M"],
        "unknown option 'compat'",
    );
    fails(p, &["create", "-o", "size", "x.pcow"], "expected KEY=VALUE");
    fails(
        p,
        &["create", "-o", "size=1M,size=2M", "x.pcow"],
        "given twice",
    );
    fails(
        p,
        &[
            "create",
            "-c",
            "4k",
            "-o",
            "cluster_size=4k",
            "x.pcow",
            "1M",
        ],
        "-c and -o cluster_size",
    );
    fails(
        p,
        &["create", "-o", "size=1M", "x.pcow", "1M"],
        "SIZE and -o size",
    );
    fails(
        p,
        &[
            "create",
            "-o",
            "backing_fmt=qcow2,backing_file=a.pcow",
            "x.pcow",
        ],
        "invalid backing_fmt 'qcow2'",
    );
    fails(
        p,
        &["create", "-F", "raw", "x.pcow", "1M"],
        "needs a base image",
    );
    fails(
        p,
        &["create", "-f", "raw", "-b", "a.pcow", "x.img"],
        "no base image",
    );
    fails(
        p,
        &["create", "-f", "raw", "-c", "4k", "x.img", "1M"],
        "no cluster size",
    );
    fails(p, &["create", "-f", "raw", "x.img"], "size is needed");
    fails(p, &["create", "-f", "qcow2", "x.img", "1M"], "qcow2");
    fails(p, &["create"], "image to create is missing");
    assert!(!p.join("x.pcow").exists() && !p.join("x.img").exists());
}

#[test]
fn usage_errors_and_help() {
    let d = tmp();
    fails(d.path(), &["frobnicate"], "frobnicate");
    fails(d.path(), &["info"], "");
    fails(d.path(), &["info", "missing.pcow"], "missing.pcow");
    let r = run_in(d.path(), &["--help"]);
    assert_eq!(r.code, 0);
    assert!(r.stdout.contains("convert"));
    let r = run_in(d.path(), &["create", "--help"]);
    assert_eq!(r.code, 0);
}

// ----- check -----

#[test]
fn check_exit_codes() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-c", "4k", "a.pcow", "1M"]);
    ok(p, &["io", "a.pcow", "-c", "write 0 16k"]);
    let out = ok(p, &["check", "a.pcow"]);
    assert!(out.contains("No errors were found on the image."), "{out}");
    // qemu-img's ImageCheck: counts only when non-zero.
    let v = json(p, &["check", "--output", "json", "a.pcow"]);
    assert_eq!(v["format"], "pcow");
    assert!(
        v.get("corruptions").is_none() && v.get("leaks").is_none(),
        "{v}"
    );
    assert_eq!(v["findings"], serde_json::json!([]));
    assert_eq!(v["check-errors"], 0);
    assert_eq!(v["allocated-clusters"], 4);
    assert_eq!(v["total-clusters"], 256);

    // Leak: a cluster of zeros past the committed end (L1).
    let img = p.join("a.pcow");
    let len = file_len(&img);
    let f = OpenOptions::new().append(true).open(&img).unwrap();
    f.set_len(len + 4096).unwrap();
    drop(f);
    let r = run_in(p, &["check", "a.pcow"]);
    assert_eq!(r.code, 3, "{r:?}", r = (r.stdout.clone(), r.stderr.clone()));
    assert!(r.stdout.contains("L1"), "{}", r.stdout);
    assert!(
        r.stdout.contains("leaked clusters were found"),
        "{}",
        r.stdout
    );
    let r = run_in(p, &["check", "--output", "json", "a.pcow"]);
    assert_eq!(r.code, 3);
    let v: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["leaks"], 1, "{v}");
    assert_eq!(v["findings"][0]["rule"], "L1");
    assert_eq!(v["findings"][0]["kind"], "leak");
    assert_eq!(v["findings"][0]["repaired"], false);

    // Repair the leak: exit 0, and clean afterwards.
    let out = ok(p, &["check", "-r", "leaks", "a.pcow"]);
    assert!(out.contains("repaired"), "{out}");
    assert_eq!(file_len(&img), len);
    ok(p, &["check", "a.pcow"]);

    // Corruption: flip a byte in both slots of the meta cluster (cluster 1).
    flip(&img, 4096 + 40);
    flip(&img, 4096 + 2048 + 40);
    let r = run_in(p, &["check", "a.pcow"]);
    assert_eq!(r.code, 2, "{} {}", r.stdout, r.stderr);
    assert!(r.stdout.contains("ERROR R6"), "{}", r.stdout);
    assert!(
        r.stdout.contains("errors were found on the image"),
        "{}",
        r.stdout
    );
    let r = run_in(p, &["check", "--output", "json", "a.pcow"]);
    assert_eq!(r.code, 2);
    let v: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["findings"][0]["rule"], "R6");
    assert_eq!(v["findings"][0]["kind"], "corruption");
    assert_eq!(
        (&v["corruptions"], &v["check-errors"]),
        (&json!(1), &json!(0)),
        "{v}"
    );
    // Repairs do not touch a corrupt image.
    assert_eq!(run_in(p, &["check", "-r", "all", "a.pcow"]).code, 2);
}

#[test]
fn check_errors_that_stop_it() {
    let d = tmp();
    let p = d.path();
    fails(p, &["check", "missing.pcow"], "missing.pcow");
    std::fs::write(p.join("r.raw"), [0u8; 4096]).unwrap();
    fails(p, &["check", "r.raw"], "not a pcow image");
    ok(p, &["create", "a.pcow", "1M"]);
    fails(p, &["check", "-r", "bogus", "a.pcow"], "bogus");
}

#[test]
fn check_reports_a_missing_base() {
    let d = tmp();
    let p = d.path();
    std::fs::write(p.join("r.raw"), [0u8; 65536]).unwrap();
    ok(p, &["create", "-b", "r.raw", "a.pcow"]);
    std::fs::remove_file(p.join("r.raw")).unwrap();
    let r = run_in(p, &["check", "a.pcow"]);
    assert_eq!(r.code, 2, "{} {}", r.stdout, r.stderr);
    assert!(r.stdout.contains("R11"), "{}", r.stdout);
}

// ----- snapshots -----

#[test]
fn snapshots_create_list_apply_delete() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "a.pcow", "1M"]);
    ok(p, &["io", "a.pcow", "-c", "write -P 1 0 4k"]);
    ok(p, &["snapshot", "-c", "one", "a.pcow"]);
    ok(p, &["io", "a.pcow", "-c", "write -P 2 0 4k"]);
    ok(p, &["snapshot", "-c", "two", "a.pcow"]);
    ok(p, &["io", "a.pcow", "-c", "write -P 3 0 4k"]);

    let out = ok(p, &["snapshot", "-l", "a.pcow"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "Snapshot list:");
    assert!(
        lines[1].starts_with("ID        TAG               VM SIZE"),
        "{out}"
    );
    assert!(lines[2].starts_with("1         one "), "{out}");
    assert!(lines[3].starts_with("2         two "), "{out}");
    // -U lists without locks.
    ok(p, &["snapshot", "-U", "-l", "a.pcow"]);

    // Apply by tag, by id, and with rollback.
    ok(p, &["snapshot", "-a", "one", "a.pcow"]);
    ok(p, &["io", "-r", "a.pcow", "-c", "read -P 1 0 4k"]);
    ok(p, &["snapshot", "-a", "2", "a.pcow"]);
    ok(p, &["io", "-r", "a.pcow", "-c", "read -P 2 0 4k"]);
    ok(p, &["rollback", "a.pcow", "one"]);
    ok(p, &["io", "-r", "a.pcow", "-c", "read -P 1 0 4k"]);

    let v = json(p, &["info", "--output", "json", "a.pcow"]);
    let snaps = v["snapshots"].as_array().unwrap();
    assert_eq!(snaps.len(), 2);
    assert_eq!(snaps[0]["id"], "1");
    assert_eq!(snaps[0]["name"], "one");
    assert!(snaps[0]["date-sec"].as_u64().unwrap() > 0);
    assert!(snaps[0]["date-nsec"].as_u64().unwrap() < 1_000_000_000);

    ok(p, &["snapshot", "-d", "one", "a.pcow"]);
    let out = ok(p, &["snapshot", "-l", "a.pcow"]);
    assert!(!out.contains(" one "), "{out}");
    assert!(out.contains(" two "), "{out}");
    ok(p, &["check", "a.pcow"]);
}

#[test]
fn snapshot_errors() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "a.pcow", "1M"]);
    ok(p, &["snapshot", "-c", "s", "a.pcow"]);
    fails(p, &["snapshot", "-c", "s", "a.pcow"], "already exists");
    fails(p, &["snapshot", "-a", "nope", "a.pcow"], "no snapshot");
    fails(p, &["snapshot", "-d", "9", "a.pcow"], "no snapshot");
    fails(p, &["rollback", "a.pcow", "nope"], "no snapshot");
    fails(p, &["snapshot", "a.pcow"], "");
    fails(p, &["snapshot", "-l", "-c", "x", "a.pcow"], "");
    fails(p, &["snapshot", "-U", "-c", "x", "a.pcow"], "-U");
    fails(p, &["snapshot", "-l", "missing.pcow"], "missing.pcow");
}

// ----- io -----

#[test]
fn io_commands() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-c", "4k", "a.pcow", "1M"]);
    let out = ok(
        p,
        &[
            "io",
            "a.pcow",
            "-c",
            "write 0 4096",
            "-c",
            "write -P 0x5a 8k 6k",
            "-c",
            "flush",
            "-c",
            "read -P 0xcd 0 4k",
        ],
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "wrote 4096/4096 bytes at offset 0",
            "wrote 6144/6144 bytes at offset 8192",
            "flushed",
            "read 4096/4096 bytes at offset 0",
        ]
    );
    ok(p, &["io", "-r", "a.pcow", "-c", "read -P 90 8k 6k"]);
    ok(p, &["io", "-r", "a.pcow", "-c", "read -P 0 4k 4k"]);
    ok(p, &["io", "-r", "-U", "a.pcow", "-c", "read 0 1M"]);

    // Mismatch: exit 1 naming the first differing offset.
    let r = run_in(p, &["io", "-r", "a.pcow", "-c", "read -P 0x5a 7k 2k"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("offset 7168"), "{}", r.stderr);

    fails(p, &["io", "-r", "a.pcow", "-c", "write 0 4k"], "read-only");
    fails(
        p,
        &["io", "a.pcow", "-c", "write 1M 1"],
        "beyond the virtual size",
    );
    fails(
        p,
        &["io", "a.pcow", "-c", "read 0 2M"],
        "beyond the virtual size",
    );
    fails(p, &["io", "a.pcow", "-c", "write 0 12x"], "'12x'");
    fails(p, &["io", "a.pcow", "-c", "write -P 300 0 1"], "'300'");
    fails(p, &["io", "a.pcow", "-c", "erase 0 1"], "erase");
    fails(p, &["io", "a.pcow", "-c", "read 0"], "OFFSET LENGTH");
    fails(p, &["io", "-U", "a.pcow", "-c", "read 0 1"], "-r");
    fails(p, &["io", "a.pcow"], "");
    ok(p, &["check", "a.pcow"]);
}

// ----- map -----

#[test]
fn map_human_and_json() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-c", "4k", "base.pcow", "1M"]);
    ok(p, &["io", "base.pcow", "-c", "write 0 8k"]);
    ok(p, &["create", "-c", "4k", "-b", "base.pcow", "top.pcow"]);
    ok(p, &["io", "top.pcow", "-c", "write 64k 4k"]);

    let out = ok(p, &["map", "top.pcow"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "Offset          Length          Mapped to       File"
    );
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[1].starts_with("0               0x2000          0x2000          base.pcow"),
        "{out}"
    );
    assert!(
        lines[2].starts_with("0x10000         0x1000          0x2000          top.pcow"),
        "{out}"
    );

    let v = json(p, &["map", "--output", "json", "top.pcow"]);
    let list = v.as_array().unwrap();
    let data: Vec<&Value> = list.iter().filter(|e| e["data"] == true).collect();
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["start"], 0);
    assert_eq!(data[0]["length"], 8192);
    assert_eq!(data[0]["depth"], 1);
    assert_eq!(data[0]["present"], true);
    assert_eq!(data[0]["offset"], 8192);
    assert_eq!(data[0]["file"], "base.pcow");
    assert_eq!(data[1]["depth"], 0);
    let zeros: Vec<&Value> = list.iter().filter(|e| e["data"] == false).collect();
    assert!(!zeros.is_empty());
    assert!(zeros
        .iter()
        .all(|e| e["zero"] == true && e.get("offset").is_none()));
    let total: u64 = list.iter().map(|e| e["length"].as_u64().unwrap()).sum();
    assert_eq!(total, 1 << 20);
    fails(p, &["map", "missing.pcow"], "missing.pcow");
}

// ----- convert / measure -----

#[test]
fn convert_round_trip_and_sparse_output() {
    let d = tmp();
    let p = d.path();
    let size = 64 << 20;
    let raw = p.join("in.raw");
    let mut want = vec![0u8; 300_000];
    for (i, b) in want.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    std::fs::write(&raw, &want).unwrap();
    // A hole, then data in the middle, then a hole up to 64 MiB.
    let f = OpenOptions::new().write(true).open(&raw).unwrap();
    f.write_all_at(b"middle", 40 << 20).unwrap();
    f.set_len(size).unwrap();
    drop(f);

    let r = run_in(p, &["convert", "-O", "pcow", "-p", "in.raw", "a.pcow"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = json(p, &["info", "--output", "json", "a.pcow"]);
    assert_eq!(v["virtual-size"], size);
    // 300000 bytes -> 5 clusters of 64 KiB, plus one for "middle".
    assert_eq!(v["format-specific"]["data"]["allocated-clusters"], 6);
    ok(p, &["check", "a.pcow"]);

    // measure IN predicts exactly the converted file's size.
    let out = ok(p, &["measure", "-O", "pcow", "in.raw"]);
    let required = format!("required size: {}\n", file_len(&p.join("a.pcow")));
    assert!(out.starts_with(&required), "{out} vs {required}");
    assert!(out.contains("fully allocated size: "), "{out}");

    ok(p, &["convert", "-O", "raw", "a.pcow", "back.raw"]);
    let back = p.join("back.raw");
    assert_eq!(file_len(&back), size);
    assert_eq!(
        std::fs::read(&raw).unwrap(),
        std::fs::read(&back).unwrap(),
        "round trip differs"
    );
    // Sparse: far fewer blocks than the length.
    let blocks = std::fs::metadata(&back).unwrap().blocks() * 512;
    assert!(
        blocks < size / 16,
        "raw output not sparse: {blocks} bytes allocated"
    );

    // raw -> raw keeps it sparse too; -f given explicitly.
    ok(
        p,
        &["convert", "-f", "raw", "-O", "raw", "in.raw", "copy.raw"],
    );
    assert_eq!(
        std::fs::read(&raw).unwrap(),
        std::fs::read(p.join("copy.raw")).unwrap()
    );
    assert!(std::fs::metadata(p.join("copy.raw")).unwrap().blocks() * 512 < size / 16);

    // pcow -> pcow with another cluster size.
    ok(
        p,
        &["convert", "-O", "pcow", "-c", "4k", "a.pcow", "b.pcow"],
    );
    let v = json(p, &["info", "--output", "json", "b.pcow"]);
    assert_eq!(v["cluster-size"], 4096);
    assert_eq!(v["format-specific"]["data"]["allocated-clusters"], 75); // ceil(300000 / 4096) + 1
    ok(p, &["convert", "-O", "raw", "b.pcow", "back2.raw"]);
    assert_eq!(
        std::fs::read(&raw).unwrap(),
        std::fs::read(p.join("back2.raw")).unwrap()
    );
}

#[test]
fn convert_zero_clusters_are_not_allocated() {
    let d = tmp();
    let p = d.path();
    // Written zeros (not holes) are still not copied.
    pattern_file(&p.join("z.raw"), 1 << 20, &[(200_000, 10, 9)]);
    ok(p, &["convert", "-O", "pcow", "z.raw", "z.pcow"]);
    let v = json(p, &["info", "--output", "json", "z.pcow"]);
    assert_eq!(v["format-specific"]["data"]["allocated-clusters"], 1);
    ok(p, &["convert", "-O", "raw", "z.raw", "z2.raw"]);
    assert!(std::fs::metadata(p.join("z2.raw")).unwrap().blocks() * 512 < 64 << 10);
    assert_eq!(
        std::fs::read(p.join("z.raw")).unwrap(),
        std::fs::read(p.join("z2.raw")).unwrap()
    );
}

#[test]
fn convert_reads_through_the_chain_and_rounds() {
    let d = tmp();
    let p = d.path();
    let want = pattern_file(&p.join("base.raw"), 70_000, &[(0, 70_000, 4)]);
    ok(p, &["create", "-c", "4k", "-b", "base.raw", "top.pcow"]);
    ok(p, &["io", "top.pcow", "-c", "write -P 5 4k 4k"]);
    ok(p, &["snapshot", "-c", "s", "top.pcow"]);
    ok(p, &["io", "top.pcow", "-c", "write -P 6 8k 4k"]);
    ok(p, &["convert", "-O", "raw", "top.pcow", "flat.raw"]);
    let got = std::fs::read(p.join("flat.raw")).unwrap();
    assert_eq!(got.len(), 73_728);
    let mut exp = want.clone();
    exp.resize(73_728, 0);
    exp[4096..8192].fill(5);
    exp[8192..12288].fill(6);
    assert_eq!(got, exp);

    // Rounding: a note on stderr; the image is the input rounded up.
    let r = run_in(p, &["convert", "-O", "pcow", "base.raw", "r.pcow"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.contains("rounded up from 70000 to 131072"),
        "{}",
        r.stderr
    );
    let v = json(p, &["info", "--output", "json", "r.pcow"]);
    assert_eq!(v["virtual-size"], 131072);
    ok(
        p,
        &[
            "io",
            "-r",
            "r.pcow",
            "-c",
            "read -P 4 0 70000",
            "-c",
            "read -P 0 70000 61072",
        ],
    );
}

#[test]
fn convert_errors() {
    let d = tmp();
    let p = d.path();
    std::fs::write(p.join("r.raw"), [1u8; 4096]).unwrap();
    fails(
        p,
        &["convert", "-O", "pcow", "missing.raw", "o.pcow"],
        "missing.raw",
    );
    fails(
        p,
        &["convert", "-f", "pcow", "-O", "raw", "r.raw", "o.raw"],
        "not a pcow image",
    );
    fails(
        p,
        &["convert", "-O", "raw", "-c", "4k", "r.raw", "o.raw"],
        "-c",
    );
    fails(
        p,
        &["convert", "-O", "pcow", "-c", "5k", "r.raw", "o.pcow"],
        "'5k'",
    );
    fails(p, &["convert", "-O", "qcow2", "r.raw", "o"], "qcow2");
    fails(
        p,
        &["convert", "-O", "raw", "r.raw", "r.raw"],
        "is the input image",
    );
    assert_eq!(std::fs::read(p.join("r.raw")).unwrap(), vec![1u8; 4096]);
    // Nor any image of the input's chain, even without locks.
    ok(p, &["create", "-b", "r.raw", "top.pcow"]);
    fails(
        p,
        &["convert", "-U", "-O", "raw", "top.pcow", "r.raw"],
        "base chain",
    );
    assert_eq!(std::fs::read(p.join("r.raw")).unwrap(), vec![1u8; 4096]);
    std::fs::write(p.join("empty.raw"), []).unwrap();
    fails(
        p,
        &["convert", "-O", "pcow", "empty.raw", "o.pcow"],
        "empty",
    );
    fails(p, &["convert", "-O", "pcow", "r.raw"], "");
}

/// The view of image `name` in `dir`, through `convert -O raw`.
fn raw_view(dir: &Path, name: &str) -> Vec<u8> {
    ok(dir, &["convert", "-O", "raw", name, "view.tmp"]);
    let v = std::fs::read(dir.join("view.tmp")).unwrap();
    std::fs::remove_file(dir.join("view.tmp")).unwrap();
    v
}

#[test]
fn convert_snapshots_bases_existing_targets_and_sparse_sizes() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-c", "4k", "base.pcow", "1M"]);
    ok(p, &["io", "-c", "write -P 1 0 512k", "base.pcow"]);
    ok(p, &["create", "-c", "4k", "-b", "base.pcow", "top.pcow"]);
    ok(p, &["io", "-c", "write -P 2 64k 4k", "top.pcow"]);
    ok(p, &["snapshot", "-c", "before", "top.pcow"]);
    ok(p, &["io", "-c", "write -P 3 128k 4k", "top.pcow"]);

    // -l and -s read a snapshot; without them, the current content.
    let now = raw_view(p, "top.pcow");
    assert_eq!((now[64 << 10], now[128 << 10]), (2, 3));
    for args in [
        &["-l", "snapshot.name=before"][..],
        &["-l", "snapshot.id=1"],
        &["-l", "before"],
        &["-s", "1"],
    ] {
        let mut a = vec!["convert", "-O", "raw"];
        a.extend_from_slice(args);
        a.extend(["top.pcow", "snap.raw"]);
        ok(p, &a);
        let snap = std::fs::read(p.join("snap.raw")).unwrap();
        assert_eq!((snap[64 << 10], snap[128 << 10]), (2, 1), "{args:?}");
    }
    fails(
        p,
        &[
            "convert",
            "-O",
            "raw",
            "-l",
            "snapshot.name=nope",
            "top.pcow",
            "x.raw",
        ],
        "snapshot.name=nope",
    );
    fails(
        p,
        &[
            "convert", "-O", "raw", "-l", "1", "-s", "1", "top.pcow", "x.raw",
        ],
        "-l and -s",
    );
    fails(
        p,
        &[
            "convert",
            "-O",
            "raw",
            "-l",
            "snapshot.id=one",
            "top.pcow",
            "x.raw",
        ],
        "snapshot.id 'one'",
    );
    fails(
        p,
        &["convert", "-O", "raw", "-s", "1", "snap.raw", "x.raw"],
        "a raw image has no snapshots",
    );

    // -B: an overlay of base.pcow holding only what differs from it.
    ok(
        p,
        &[
            "convert",
            "-O",
            "pcow",
            "-B",
            "base.pcow",
            "top.pcow",
            "flat.pcow",
        ],
    );
    let v = json(p, &["info", "--output", "json", "flat.pcow"]);
    assert_eq!(v["backing-filename"], "base.pcow", "{v}");
    assert_eq!(raw_view(p, "flat.pcow"), now);
    let own: Vec<Value> =
        serde_json::from_str::<Value>(&ok(p, &["map", "--output", "json", "flat.pcow"]))
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["depth"] == 0 && e["data"] == true)
            .cloned()
            .collect();
    assert_eq!(own.len(), 2, "{own:?}");
    // The same through -o, from the raw view.
    ok(p, &["convert", "-O", "raw", "top.pcow", "now.raw"]);
    ok(
        p,
        &[
            "convert",
            "-O",
            "pcow",
            "-o",
            "backing_file=base.pcow,backing_fmt=pcow,cluster_size=4k",
            "now.raw",
            "flat2.pcow",
        ],
    );
    assert_eq!(raw_view(p, "flat2.pcow"), now);
    fails(
        p,
        &[
            "convert",
            "-O",
            "raw",
            "-B",
            "base.pcow",
            "top.pcow",
            "x.raw",
        ],
        "a raw output has no base",
    );
    fails(
        p,
        &[
            "convert", "-O", "pcow", "-o", "size=1M", "top.pcow", "x.pcow",
        ],
        "unknown option 'size'",
    );
    fails(
        p,
        &[
            "convert",
            "-O",
            "pcow",
            "-B",
            "a",
            "-o",
            "backing_file=b",
            "top.pcow",
            "x.pcow",
        ],
        "-B and -o backing_file",
    );
    let help = ok(p, &["convert", "-O", "pcow", "-o", "help"]);
    assert!(
        help.contains("backing_file=FILE") && !help.contains("\n  size="),
        "{help}"
    );

    // -n: into an existing, larger target; its tail is kept.
    pattern_file(&p.join("t.raw"), 2 << 20, &[(0, 2 << 20, 0x77)]);
    ok(p, &["convert", "-n", "-O", "raw", "top.pcow", "t.raw"]);
    let t = std::fs::read(p.join("t.raw")).unwrap();
    assert_eq!(&t[..1 << 20], &now[..]);
    assert!(t[1 << 20..].iter().all(|&b| b == 0x77));
    fails(
        p,
        &["convert", "-n", "-O", "raw", "t.raw", "now.raw"],
        "smaller than the input",
    );
    fails(
        p,
        &["convert", "-n", "-O", "raw", "now.raw", "flat.pcow"],
        "would overwrite its metadata",
    );
    fails(
        p,
        &[
            "convert",
            "-n",
            "-O",
            "pcow",
            "-B",
            "base.pcow",
            "now.raw",
            "flat.pcow",
        ],
        "keeps its own base",
    );
    fails(
        p,
        &[
            "convert",
            "--target-is-zero",
            "-O",
            "raw",
            "now.raw",
            "x.raw",
        ],
        "--target-is-zero",
    );
    // Into an existing pcow image: a snapshot's content back into it.
    ok(
        p,
        &[
            "convert",
            "-n",
            "-O",
            "pcow",
            "-U",
            "-s",
            "before",
            "top.pcow",
            "flat.pcow",
        ],
    );
    let snap = raw_view(p, "flat.pcow");
    assert_eq!((snap[64 << 10], snap[128 << 10]), (2, 1));

    // -S 0 allocates every cluster; a bad size names the rule.
    ok(
        p,
        &[
            "convert",
            "-O",
            "pcow",
            "-c",
            "4k",
            "-S",
            "0",
            "now.raw",
            "full.pcow",
        ],
    );
    let v = json(p, &["info", "--output", "json", "full.pcow"]);
    assert_eq!(
        v["format-specific"]["data"]["allocated-clusters"], 256,
        "{v}"
    );
    fails(
        p,
        &["convert", "-O", "raw", "-S", "1000", "now.raw", "x.raw"],
        "multiples of 4096",
    );
    assert!(!p.join("x.raw").exists() && !p.join("x.pcow").exists());
}

#[test]
fn preallocation_on_create_and_convert() {
    use std::os::unix::fs::MetadataExt;
    let d = tmp();
    let p = d.path();
    let on_disk = |name: &str| std::fs::metadata(p.join(name)).unwrap().blocks() * 512;
    let out = ok(p, &["create", "-o", "preallocation=full", "a.pcow", "4M"]);
    assert!(out.contains("preallocation=full size=4194304"), "{out}");
    let v = json(p, &["info", "--output", "json", "a.pcow"]);
    assert_eq!(
        v["format-specific"]["data"]["allocated-clusters"], 64,
        "{v}"
    );
    assert!(on_disk("a.pcow") >= 4 << 20);
    ok(p, &["check", "a.pcow"]);
    assert_eq!(raw_view(p, "a.pcow"), vec![0u8; 4 << 20]);
    let out = ok(
        p,
        &[
            "create",
            "-f",
            "raw",
            "-o",
            "preallocation=falloc",
            "r.raw",
            "2M",
        ],
    );
    assert!(
        out.ends_with("size=2097152 preallocation=falloc\n"),
        "{out}"
    );
    assert!(on_disk("r.raw") >= 2 << 20);
    // An overlay: only the clusters its base leaves empty.
    ok(p, &["create", "-c", "4k", "b.pcow", "1M"]);
    ok(p, &["io", "-c", "write -P 5 0 512k", "b.pcow"]);
    ok(
        p,
        &[
            "create",
            "-b",
            "b.pcow",
            "-o",
            "preallocation=falloc",
            "o.pcow",
        ],
    );
    let v = json(p, &["info", "--output", "json", "o.pcow"]);
    assert_eq!(v["format-specific"]["data"]["allocated-clusters"], 8, "{v}");
    assert_eq!(raw_view(p, "o.pcow"), raw_view(p, "b.pcow"));
    // convert: a preallocated output holding the input.
    ok(
        p,
        &[
            "convert",
            "-O",
            "pcow",
            "-o",
            "preallocation=falloc",
            "o.pcow",
            "c.pcow",
        ],
    );
    let v = json(p, &["info", "--output", "json", "c.pcow"]);
    assert_eq!(
        v["format-specific"]["data"]["allocated-clusters"], 16,
        "{v}"
    );
    assert_eq!(raw_view(p, "c.pcow"), raw_view(p, "b.pcow"));
    fails(
        p,
        &["create", "-o", "preallocation=metadata", "x.pcow", "1M"],
        "SIGBUS",
    );
    fails(
        p,
        &["create", "-o", "preallocation=sparse", "x.pcow", "1M"],
        "off, falloc or full",
    );
    fails(
        p,
        &[
            "convert",
            "-n",
            "-O",
            "pcow",
            "-o",
            "preallocation=full",
            "o.pcow",
            "c.pcow",
        ],
        "preallocation applies to a new output",
    );
}

#[test]
fn quiet_and_format_flags_as_qemu_img_takes_them() {
    let d = tmp();
    let p = d.path();
    // -q: nothing on stdout for success.
    for args in [
        &["create", "-q", "-c", "4k", "a.pcow", "1M"][..],
        &["create", "-q", "-f", "raw", "r.raw", "1M"],
        &["io", "-c", "write -P 1 0 4k", "a.pcow"],
        &["snapshot", "-q", "-f", "pcow", "-c", "s1", "a.pcow"],
        &["check", "-q", "a.pcow"],
        &["create", "-q", "-b", "a.pcow", "o.pcow"],
        &["commit", "-q", "-f", "pcow", "-d", "o.pcow"],
        &["rebase", "-q", "-f", "pcow", "-u", "-b", "a.pcow", "o.pcow"],
        &["resize", "-q", "-f", "pcow", "a.pcow", "2M"],
        &["compact", "-q", "-f", "pcow", "a.pcow"],
        &["rollback", "-q", "a.pcow", "s1"],
        &["resize", "-q", "r.raw", "+1M"],
    ] {
        let out = ok(p, args);
        if args.contains(&"-q") {
            assert_eq!(out, "", "{args:?}");
        }
    }
    // -l still lists under -q, as qemu-img's does.
    assert!(ok(p, &["snapshot", "-q", "-l", "a.pcow"]).contains("s1"));
    // check -q: the verdict is the exit code alone.
    std::fs::OpenOptions::new()
        .append(true)
        .open(p.join("a.pcow"))
        .unwrap()
        .set_len(file_len(&p.join("a.pcow")) + 4096)
        .unwrap();
    let r = run_in(p, &["check", "-q", "a.pcow"]);
    assert_eq!((r.code, r.stdout.as_str()), (3, ""), "{}", r.stderr);
    // A raw file grows (a hole), as qemu-img resize does; it never shrinks.
    assert_eq!(file_len(&p.join("r.raw")), 2 << 20);
    ok(p, &["resize", "-f", "raw", "r.raw", "3M"]);
    assert_eq!(file_len(&p.join("r.raw")), 3 << 20);
    fails(p, &["resize", "r.raw", "1M"], "shrinking");
    assert_eq!(file_len(&p.join("r.raw")), 3 << 20);
    // -f raw where only a pcow image makes sense.
    fails(p, &["snapshot", "-f", "raw", "-l", "r.raw"], "no snapshots");
    fails(p, &["commit", "-f", "raw", "r.raw"], "no base");
    fails(p, &["rebase", "-f", "raw", "-b", "", "r.raw"], "no base");
    fails(p, &["compact", "-f", "raw", "r.raw"], "compact is for pcow");
}

#[test]
fn commit_into_a_base_further_down_the_chain() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-q", "-c", "4k", "base.pcow", "1M"]);
    ok(p, &["io", "-c", "write -P 1 0 64k", "base.pcow"]);
    ok(
        p,
        &["create", "-q", "-c", "4k", "-b", "base.pcow", "mid.pcow"],
    );
    ok(p, &["io", "-c", "write -P 2 8k 4k", "mid.pcow"]);
    ok(
        p,
        &["create", "-q", "-c", "4k", "-b", "mid.pcow", "top.pcow"],
    );
    ok(p, &["io", "-c", "write -P 3 100k 4k", "top.pcow"]);
    let top = raw_view(p, "top.pcow");
    let out = ok(p, &["commit", "-b", "base.pcow", "top.pcow"]);
    assert!(
        out.starts_with("Image committed: 8192 bytes copied into "),
        "{out}"
    );
    assert_eq!(raw_view(p, "base.pcow"), top);
    assert_eq!(raw_view(p, "top.pcow"), top);
    let v = json(p, &["info", "--output", "json", "top.pcow"]);
    assert_eq!(
        v["format-specific"]["data"]["allocated-clusters"], 1,
        "kept: {v}"
    );
    ok(p, &["check", "base.pcow"]);
    ok(p, &["create", "-q", "other.pcow", "1M"]);
    fails(
        p,
        &["commit", "-b", "other.pcow", "top.pcow"],
        "is not a base image of",
    );
    fails(p, &["commit", "-b", "nope.pcow", "top.pcow"], "nope.pcow");
}

#[test]
fn a_closed_stdout_ends_pcow_img_without_a_panic() {
    let d = tmp();
    let p = d.path();
    // 2000 extents: far more map output than a pipe holds.
    ok(p, &["create", "-c", "4k", "a.pcow", "16M"]);
    let writes: Vec<String> = (0..1000)
        .map(|i| format!("write -P 1 {}k 4k", i * 8))
        .collect();
    let mut args = vec!["io"];
    for w in &writes {
        args.extend(["-c", w.as_str()]);
    }
    args.push("a.pcow");
    ok(p, &args);
    let mut child = std::process::Command::new(BIN)
        // JSON: some 300 KB, which the pipe (64 KiB) cannot take without a
        // reader.
        .args(["map", "--output", "json", "a.pcow"])
        .current_dir(p)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read one byte, then hang up.
    let mut out = child.stdout.take().unwrap();
    let mut b = [0u8; 1];
    std::io::Read::read_exact(&mut out, &mut b).unwrap();
    drop(out);
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(o.status.signal(), Some(libc::SIGPIPE), "{:?}", o.status);
}

#[test]
fn measure_sizes() {
    let d = tmp();
    let p = d.path();
    let out = ok(p, &["measure", "-O", "pcow", "--size", "1G"]);
    assert!(
        out.starts_with("required size: 65536\nfully allocated size: "),
        "{out}"
    );
    let v = json(
        p,
        &[
            "measure", "-O", "pcow", "-c", "4k", "--size", "1M", "--output", "json",
        ],
    );
    assert_eq!(v["required"], 4096);
    // 256 data clusters, N = (2048 - 32) / 16 = 126 entries per meta cluster.
    assert_eq!(v["fully-allocated"], (1 + 3 + 256) * 4096);

    // A fully written image measures as its fully allocated size.
    pattern_file(&p.join("full.raw"), 1 << 20, &[(0, 1 << 20, 0xee)]);
    let v = json(
        p,
        &[
            "measure", "-O", "pcow", "-c", "4k", "--output", "json", "full.raw",
        ],
    );
    assert_eq!(v["required"], v["fully-allocated"]);
    ok(
        p,
        &["convert", "-O", "pcow", "-c", "4k", "full.raw", "full.pcow"],
    );
    assert_eq!(v["required"], file_len(&p.join("full.pcow")));

    fails(p, &["measure", "-O", "pcow", "--size", "12x"], "'12x'");
    fails(p, &["measure", "-O", "raw", "--size", "1M"], "pcow");
    fails(p, &["measure", "-O", "pcow"], "");
    fails(
        p,
        &["measure", "-O", "pcow", "--size", "1M", "full.raw"],
        "",
    );
    fails(p, &["measure", "-O", "pcow", "missing.raw"], "missing.raw");
}

// ----- resize / commit / rebase / compact -----

#[test]
fn resize_grows() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "a.pcow", "1M"]);
    ok(p, &["io", "a.pcow", "-c", "write -P 8 0 64k"]);
    let out = ok(p, &["resize", "a.pcow", "+1M"]);
    assert_eq!(out, "Image resized.\n");
    let v = json(p, &["info", "--output", "json", "a.pcow"]);
    assert_eq!(v["virtual-size"], 2 << 20);
    ok(p, &["resize", "a.pcow", "4m"]);
    let v = json(p, &["info", "--output", "json", "a.pcow"]);
    assert_eq!(v["virtual-size"], 4 << 20);
    ok(
        p,
        &[
            "io",
            "-r",
            "a.pcow",
            "-c",
            "read -P 8 0 64k",
            "-c",
            "read -P 0 64k 4032k",
        ],
    );
    fails(p, &["resize", "a.pcow", "1M"], "shrinking");
    fails(p, &["resize", "a.pcow", "-1M"], "shrinking");
    fails(
        p,
        &["resize", "a.pcow", "+1000"],
        "not a multiple of the cluster size",
    );
    fails(p, &["resize", "a.pcow", "5000000"], "'5000000'");
    fails(p, &["resize", "a.pcow", "12x"], "'12x'");
    fails(p, &["resize", "missing.pcow", "1G"], "missing.pcow");
    ok(p, &["check", "a.pcow"]);
}

#[test]
fn commit_into_base() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-c", "4k", "base.pcow", "1M"]);
    ok(p, &["io", "base.pcow", "-c", "write -P 1 0 16k"]);
    ok(p, &["create", "-b", "base.pcow", "top.pcow"]);
    ok(p, &["io", "top.pcow", "-c", "write -P 2 4k 4k"]);

    // -d keeps the overlay's data.
    let out = ok(p, &["commit", "-d", "top.pcow"]);
    assert!(out.starts_with("Image committed"), "{out}");
    ok(
        p,
        &[
            "io",
            "-r",
            "base.pcow",
            "-c",
            "read -P 2 4k 4k",
            "-c",
            "read -P 1 0 4k",
        ],
    );
    let v = json(p, &["info", "--output", "json", "top.pcow"]);
    assert_eq!(v["format-specific"]["data"]["allocated-clusters"], 1);

    ok(p, &["io", "top.pcow", "-c", "write -P 3 8k 4k"]);
    ok(p, &["commit", "top.pcow"]);
    let v = json(p, &["info", "--output", "json", "top.pcow"]);
    assert_eq!(v["format-specific"]["data"]["allocated-clusters"], 0);
    ok(
        p,
        &[
            "io",
            "-r",
            "top.pcow",
            "-c",
            "read -P 3 8k 4k",
            "-c",
            "read -P 2 4k 4k",
        ],
    );
    ok(p, &["check", "top.pcow"]);
    ok(p, &["check", "base.pcow"]);
    fails(p, &["commit", "base.pcow"], "no base image");
}

#[test]
fn rebase_safe_unsafe_and_flatten() {
    let d = tmp();
    let p = d.path();
    pattern_file(&p.join("a.raw"), 1 << 20, &[(0, 1 << 20, 0xa)]);
    pattern_file(&p.join("b.raw"), 1 << 20, &[(0, 1 << 20, 0xb)]);
    ok(p, &["create", "-b", "a.raw", "top.pcow"]);
    ok(p, &["io", "top.pcow", "-c", "write -P 1 0 4k"]);

    // Safe rebase keeps the view.
    ok(p, &["rebase", "-F", "raw", "-b", "b.raw", "top.pcow"]);
    let v = json(p, &["info", "--output", "json", "top.pcow"]);
    assert_eq!(v["backing-filename"], "b.raw");
    ok(
        p,
        &[
            "io",
            "-r",
            "top.pcow",
            "-c",
            "read -P 1 0 4k",
            "-c",
            "read -P 0xa 4k 1020k",
        ],
    );

    // Unsafe only renames: the view now shows b.
    ok(p, &["rebase", "-u", "-b", "a.raw", "top.pcow"]);
    ok(p, &["rebase", "-u", "-b", "b.raw", "top.pcow"]);
    ok(p, &["io", "-r", "top.pcow", "-c", "read -P 0xa 4k 60k"]);

    // Flatten.
    ok(p, &["rebase", "-b", "", "top.pcow"]);
    let v = json(p, &["info", "--output", "json", "top.pcow"]);
    assert!(v.get("backing-filename").is_none());
    std::fs::remove_file(p.join("b.raw")).unwrap();
    ok(
        p,
        &[
            "io",
            "-r",
            "top.pcow",
            "-c",
            "read -P 1 0 4k",
            "-c",
            "read -P 0xa 4k 60k",
        ],
    );
    ok(p, &["check", "top.pcow"]);

    fails(
        p,
        &["rebase", "-b", "missing.raw", "top.pcow"],
        "does not exist",
    );
    fails(p, &["rebase", "-b", "", "-F", "raw", "top.pcow"], "-F");
    fails(p, &["rebase", "top.pcow"], "");
}

#[test]
fn compact_reclaims() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-c", "4k", "a.pcow", "1M"]);
    ok(p, &["io", "a.pcow", "-c", "write -P 1 0 64k"]);
    ok(p, &["snapshot", "-c", "s", "a.pcow"]);
    ok(p, &["io", "a.pcow", "-c", "write -P 2 0 64k"]);
    ok(p, &["snapshot", "-d", "s", "a.pcow"]);
    let before = file_len(&p.join("a.pcow"));
    let out = ok(p, &["compact", "a.pcow"]);
    assert!(out.starts_with("Image compacted"), "{out}");
    assert!(file_len(&p.join("a.pcow")) < before);
    ok(p, &["io", "-r", "a.pcow", "-c", "read -P 2 0 64k"]);
    ok(p, &["check", "a.pcow"]);
    fails(p, &["compact", "missing.pcow"], "missing.pcow");
}

/// A compact that was killed leaves its temporary file beside the image;
/// the next compact of that image removes it (nothing holds its lock),
/// and leaves other names alone.
#[test]
fn a_killed_compact_leaves_a_temporary_file_the_next_one_removes() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-c", "4k", "a.pcow", "32M"]);
    ok(p, &["io", "a.pcow", "-c", "write -P 3 0 24M"]);
    ok(p, &["snapshot", "-c", "s", "a.pcow"]);
    ok(p, &["io", "a.pcow", "-c", "write -P 4 0 24M"]);
    ok(p, &["snapshot", "-d", "s", "a.pcow"]);
    let leftovers = |p: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".a.pcow.compact-"))
            .collect();
        v.sort();
        v
    };
    // Kill compacts part-way until one leaves its file (or a few tries).
    for delay_ms in [5u64, 15, 30, 60, 120] {
        let mut child = std::process::Command::new(BIN)
            .args(["compact", "a.pcow"])
            .current_dir(p)
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill();
        let _ = child.wait();
        if !leftovers(p).is_empty() {
            break;
        }
    }
    // And one left by a process that no longer exists, for certain.
    std::fs::write(p.join(".a.pcow.compact-4000000.tmp"), b"half a compact").unwrap();
    // Names that are not a temporary file of a.pcow stay.
    for keep in [
        ".b.pcow.compact-1.tmp",
        ".a.pcow.compact-x.tmp",
        "a.pcow.compact-1.tmp",
    ] {
        std::fs::write(p.join(keep), b"keep").unwrap();
    }
    ok(p, &["compact", "a.pcow"]);
    assert_eq!(leftovers(p), [".a.pcow.compact-x.tmp"]);
    for keep in [".b.pcow.compact-1.tmp", "a.pcow.compact-1.tmp"] {
        assert!(p.join(keep).exists(), "{keep} was removed");
    }
    ok(p, &["io", "-r", "a.pcow", "-c", "read -P 4 0 24M"]);
    ok(p, &["check", "a.pcow"]);
}

// ----- locking -----
// In tests/cli_lock.rs: a test that holds an image open in this process
// would lend its lock to every child the other tests fork (between fork and
// exec the child holds copies of all descriptors).

// ----- compare -----

/// `pcow-img compare A B`: (exit code, stdout, stderr).
fn compare(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["compare"];
    all.extend_from_slice(args);
    let r = run_in(dir, &all);
    (r.code, r.stdout, r.stderr)
}

#[test]
fn compare_verdicts_and_exit_codes() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-c", "4k", "a.pcow", "1M"]);
    ok(p, &["io", "a.pcow", "-c", "write -P 0x11 8k 12k"]);
    ok(p, &["convert", "-O", "raw", "a.pcow", "a.raw"]);
    let same = (0, "Images are identical.\n".to_string(), String::new());
    assert_eq!(compare(p, &["a.pcow", "a.raw"]), same);
    assert_eq!(
        compare(p, &["-f", "pcow", "-F", "raw", "a.pcow", "a.raw"]),
        same
    );
    // Read as raw, the pcow file is its metadata: different.
    assert_eq!(compare(p, &["-f", "raw", "a.pcow", "a.raw"]).0, 1);

    // An overlay shows its base: identical, strict too (the chain's data
    // counts as allocated). One byte written: the sector holding it.
    ok(p, &["create", "-b", "a.pcow", "-F", "pcow", "o.pcow"]);
    assert_eq!(compare(p, &["-s", "a.pcow", "o.pcow"]), same);
    ok(p, &["io", "o.pcow", "-c", "write -P 0x22 13000 1"]);
    let mismatch = (
        1,
        "Content mismatch at offset 12800!\n".to_string(),
        String::new(),
    );
    assert_eq!(compare(p, &["a.pcow", "o.pcow"]), mismatch);
    assert_eq!(compare(p, &["o.pcow", "a.raw"]), mismatch);
    assert_eq!(
        compare(p, &["-q", "a.pcow", "o.pcow"]),
        (1, String::new(), String::new())
    );
    assert_eq!(
        compare(p, &["-q", "a.pcow", "a.raw"]),
        (0, String::new(), String::new())
    );

    // Sizes: zeros past the shorter end are the same content; strict
    // mode says the sizes differ.
    ok(p, &["convert", "-O", "pcow", "a.raw", "big.pcow"]);
    ok(p, &["resize", "big.pcow", "+1M"]);
    assert_eq!(
        compare(p, &["a.pcow", "big.pcow"]),
        (
            0,
            "Warning: Image size mismatch!\nImages are identical.\n".into(),
            String::new()
        )
    );
    assert_eq!(
        compare(p, &["-s", "a.pcow", "big.pcow"]),
        (
            1,
            "Strict mode: Image size mismatch!\n".into(),
            String::new()
        )
    );
    ok(p, &["io", "big.pcow", "-c", "write -P 1 1536k 1"]);
    assert_eq!(
        compare(p, &["big.pcow", "a.raw"]),
        (
            1,
            "Warning: Image size mismatch!\nContent mismatch at offset 1572864!\n".into(),
            String::new()
        )
    );

    // Zeros written where the other image has a hole: the same content,
    // an allocation difference in strict mode.
    ok(p, &["create", "-c", "4k", "z.pcow", "1M"]);
    ok(p, &["create", "-c", "4k", "e.pcow", "1M"]);
    ok(p, &["io", "z.pcow", "-c", "write -P 0 64k 4k"]);
    assert_eq!(compare(p, &["z.pcow", "e.pcow"]), same);
    assert_eq!(
        compare(p, &["-s", "z.pcow", "e.pcow"]),
        (
            1,
            "Strict mode: Offset 65536 block status mismatch!\n".into(),
            String::new()
        )
    );
}

#[test]
fn compare_errors_exit_2_and_name_the_file() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "a.pcow", "1M"]);
    let (code, out, err) = compare(p, &["a.pcow", "missing.pcow"]);
    assert_eq!((code, out.as_str()), (2, ""), "{err}");
    assert!(
        err.starts_with("pcow-img: opening the image: ") && err.contains("missing.pcow"),
        "{err}"
    );
    // Errors are printed with -q too.
    let (code, _, err) = compare(p, &["-q", "missing.pcow", "a.pcow"]);
    assert_eq!(code, 2);
    assert!(err.contains("missing.pcow"), "{err}");
    // A corrupt header: the open fails.
    std::fs::write(p.join("bad.pcow"), b"PCOW\0\0\0\0garbage").unwrap();
    let (code, _, err) = compare(p, &["-f", "pcow", "bad.pcow", "a.pcow"]);
    assert_eq!(code, 2, "{err}");
    // An image in use by a writer: refused unless -U.
    let held = pcow::Image::open(p.join("a.pcow"), pcow::OpenOptions::read_write()).unwrap();
    let (code, _, err) = compare(p, &["a.pcow", "a.pcow"]);
    assert_eq!(code, 2);
    assert!(err.contains("in use"), "{err}");
    assert_eq!(compare(p, &["-U", "a.pcow", "a.pcow"]).0, 0);
    drop(held);
    // Usage errors are 1, as for every command.
    fails(p, &["compare", "a.pcow"], "required arguments");
}

#[test]
fn format_flag_on_info_check_and_map() {
    let d = tmp();
    let p = d.path();
    ok(p, &["create", "-c", "4k", "a.pcow", "1M"]);
    ok(p, &["create", "-f", "raw", "r.img", "1M"]);
    // -f raw shows the pcow file as the bytes it is.
    let v = json(p, &["info", "-f", "raw", "--output", "json", "a.pcow"]);
    assert_eq!(v["format"], "raw");
    assert_eq!(v["virtual-size"], 4096);
    let v = json(p, &["info", "-f", "pcow", "--output", "json", "a.pcow"]);
    assert_eq!(v["format"], "pcow");
    fails(p, &["info", "-f", "pcow", "r.img"], "not a pcow image");
    ok(p, &["check", "-f", "pcow", "a.pcow"]);
    fails(p, &["check", "-f", "raw", "a.pcow"], "no metadata to check");
    ok(p, &["map", "-f", "pcow", "a.pcow"]);
    // -f raw maps the file's bytes: all data, at their own offsets.
    let out = ok(p, &["map", "-f", "raw", "a.pcow"]);
    assert!(
        out.ends_with("\n0               0x1000          0               a.pcow\n"),
        "{out}"
    );
    let v = json(
        p,
        &["map", "--output", "json", "--start-offset", "64k", "r.img"],
    );
    assert_eq!(v[0]["start"], 65536, "{v}");
    assert_eq!(v[0]["data"], false, "{v}");
    fails(p, &["map", "-f", "pcow", "r.img"], "not a pcow image");
    fails(p, &["map", "--max-length", "x", "r.img"], "--max-length");
    fails(p, &["info", "-f", "qcow2", "a.pcow"], "qcow2");
}
