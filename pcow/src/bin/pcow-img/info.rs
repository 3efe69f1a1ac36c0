//! `info` and `map`: what an image is and where its data lives.

use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use anyhow::Context;
use pcow::ops::convert::ImageFormat;
use pcow::{Backing, BaseFormat, Image, OpenOptions};
use serde_json::{json, Map, Value};

use crate::output::{date, hex16, human_size, print_json};
use crate::size::parse_size;
use crate::{InfoArgs, MapArgs, OutputFormat};

/// `(actual-size, file-length)` of an open file: blocks on disk times 512,
/// and the length.
fn disk_usage(file: Option<&File>, path: &Path) -> anyhow::Result<(u64, u64)> {
    let md = match file {
        Some(f) => f.metadata(),
        None => std::fs::metadata(path),
    }
    .with_context(|| format!("{}: reading metadata", path.display()))?;
    Ok((md.blocks() * 512, md.len()))
}

/// The `info` object of a pcow image, in qemu-img's shape: the common
/// fields at the top, pcow's own under `format-specific`.
fn pcow_json(img: &Image, filename: &str) -> anyhow::Result<Value> {
    let h = img.header();
    let (actual, len) = disk_usage(img.file(), img.path())?;
    let snaps: Vec<Value> = img
        .snapshots()
        .iter()
        .map(|s| {
            // qemu-img's fields (ids as strings; no VM state, clock or
            // instruction count in a pcow snapshot), and pcow's layer.
            json!({
                "id": s.id.to_string(),
                "name": s.tag,
                "date-sec": s.time_sec,
                "date-nsec": s.time_nsec,
                "vm-clock-sec": 0,
                "vm-clock-nsec": 0,
                "vm-state-size": 0,
                "icount": 0,
                "layer": s.layer,
            })
        })
        .collect();
    let mut m = Map::new();
    m.insert("filename".into(), json!(filename));
    m.insert("format".into(), json!("pcow"));
    m.insert("virtual-size".into(), json!(img.virtual_size()));
    m.insert("cluster-size".into(), json!(img.cluster_size()));
    m.insert("actual-size".into(), json!(actual));
    m.insert("dirty-flag".into(), json!(h.dirty()));
    m.insert("snapshots".into(), Value::Array(snaps));
    if let Some(b) = img.base_ref() {
        let resolved = pcow::resolve_base(img.path(), &b.name);
        let full = std::fs::canonicalize(&resolved).unwrap_or(resolved);
        let fmt = match (b.format, img.base()) {
            (BaseFormat::Probe, Some(opened)) => opened.format(),
            (f, _) => f.name(),
        };
        m.insert("backing-filename".into(), json!(b.name));
        m.insert(
            "full-backing-filename".into(),
            json!(full.display().to_string()),
        );
        m.insert("backing-filename-format".into(), json!(fmt));
    }
    m.insert(
        "format-specific".into(),
        json!({
            "type": "pcow",
            "data": {
                "format-version": pcow::format::VERSION,
                "generation": h.generation,
                "allocated-clusters": img.allocated_clusters(),
                "cluster-count": h.cluster_count,
                "layer-count": h.layer_count,
                "active-layer": h.active_layer,
                "file-length": len,
                "backing-chain-depth": img.base().map_or(0, Backing::depth),
            },
        }),
    );
    Ok(Value::Object(m))
}

/// The `info` object of a raw file, as qemu-img gives it.
fn raw_json(path: &Path, file: Option<&File>) -> anyhow::Result<Value> {
    let (actual, len) = disk_usage(file, path)?;
    Ok(json!({
        "filename": path.display().to_string(),
        "format": "raw",
        "virtual-size": len,
        "actual-size": actual,
        "dirty-flag": false,
    }))
}

/// Every image of the chain, top first.
fn chain_json(img: &Image, filename: &str) -> anyhow::Result<Vec<Value>> {
    let mut out = vec![pcow_json(img, filename)?];
    let mut cur = img.base();
    while let Some(b) = cur {
        match b {
            Backing::Pcow(i) => {
                out.push(pcow_json(i, &i.path().display().to_string())?);
                cur = i.base();
            }
            Backing::Raw(r) => {
                out.push(raw_json(r.path(), Some(r.file()))?);
                cur = None;
            }
        }
    }
    Ok(out)
}

fn get_u64(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn get_str<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

/// qemu-img's snapshot table.
pub fn snapshot_table(snaps: &[pcow::SnapshotInfo]) -> String {
    let mut s = format!(
        "{:<10}{:<17}{:>8}{:>20}{:>13}{:>11}",
        "ID", "TAG", "VM SIZE", "DATE", "VM CLOCK", "ICOUNT"
    );
    s = s.trim_end().to_owned();
    for sn in snaps {
        // No VM state, clock or instruction count: zeros, as qemu-img
        // shows a snapshot it took of an image offline.
        let row = format!(
            "{:<9} {:<16} {:>8}{:>20}{:>13} {:>10}",
            sn.id,
            sn.tag,
            human_size(0),
            date(sn.time_sec),
            "00:00:00.000",
            0
        );
        s.push('\n');
        s.push_str(row.trim_end());
    }
    s
}

/// qemu-img's human `info` layout for one image object.
fn human(v: &Value, snaps: &[pcow::SnapshotInfo]) -> String {
    let mut s = String::new();
    let vs = get_u64(v, "virtual-size");
    let _ = writeln!(s, "image: {}", get_str(v, "filename"));
    let _ = writeln!(s, "file format: {}", get_str(v, "format"));
    let _ = writeln!(s, "virtual size: {} ({vs} bytes)", human_size(vs));
    let _ = writeln!(s, "disk size: {}", human_size(get_u64(v, "actual-size")));
    if get_str(v, "format") != "pcow" {
        return s;
    }
    let _ = writeln!(s, "cluster_size: {}", get_u64(v, "cluster-size"));
    if let Some(name) = v.get("backing-filename").and_then(Value::as_str) {
        let full = get_str(v, "full-backing-filename");
        if full != name {
            let _ = writeln!(s, "backing file: {name} (actual path: {full})");
        } else {
            let _ = writeln!(s, "backing file: {name}");
        }
        let _ = writeln!(
            s,
            "backing file format: {}",
            get_str(v, "backing-filename-format")
        );
    }
    if !snaps.is_empty() {
        let _ = writeln!(s, "Snapshot list:");
        let _ = writeln!(s, "{}", snapshot_table(snaps));
    }
    let _ = writeln!(s, "Format specific information:");
    let d = &v["format-specific"]["data"];
    let _ = writeln!(s, "    format version: {}", get_u64(d, "format-version"));
    let _ = writeln!(s, "    generation: {}", get_u64(d, "generation"));
    let dirty = v
        .get("dirty-flag")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let _ = writeln!(s, "    dirty flag: {dirty}");
    let _ = writeln!(
        s,
        "    allocated clusters: {}",
        get_u64(d, "allocated-clusters")
    );
    let _ = writeln!(
        s,
        "    layers: {} (active: {})",
        get_u64(d, "layer-count"),
        get_u64(d, "active-layer")
    );
    let _ = writeln!(s, "    file length: {}", get_u64(d, "file-length"));
    s
}

fn open(path: &Path, force_share: bool) -> pcow::Result<Image> {
    Image::open(
        path,
        OpenOptions {
            force_share,
            ..OpenOptions::read_only()
        },
    )
}

pub fn info(a: InfoArgs) -> anyhow::Result<u8> {
    let filename = a.file.display().to_string();
    let format = match a.format {
        Some(f) => f.into(),
        None => ImageFormat::probe(&a.file)?,
    };
    if format == ImageFormat::Raw {
        // Opened (without blocking, unlocked as before) so that a FIFO,
        // directory, socket or device is refused, not described.
        let raw = pcow::RawImage::open(&a.file, false, true)?;
        let v = raw_json(&a.file, Some(raw.file()))?;
        match (a.output, a.backing_chain) {
            (OutputFormat::Json, true) => print_json(&Value::Array(vec![v]))?,
            (OutputFormat::Json, false) => print_json(&v)?,
            (OutputFormat::Human, _) => print!("{}", human(&v, &[])),
        }
        return Ok(0);
    }
    let img = open(&a.file, a.force_share)?;
    if !a.backing_chain {
        let v = pcow_json(&img, &filename)?;
        match a.output {
            OutputFormat::Json => print_json(&v)?,
            OutputFormat::Human => print!("{}", human(&v, &img.snapshots())),
        }
        return Ok(0);
    }
    let chain = chain_json(&img, &filename)?;
    match a.output {
        OutputFormat::Json => print_json(&Value::Array(chain))?,
        OutputFormat::Human => {
            // Snapshots of every pcow image of the chain, in chain order.
            let mut snaps = vec![img.snapshots()];
            let mut cur = img.base();
            while let Some(Backing::Pcow(i)) = cur {
                snaps.push(i.snapshots());
                cur = i.base();
            }
            snaps.push(Vec::new());
            let texts: Vec<String> = chain
                .iter()
                .zip(snaps.iter())
                .map(|(v, s)| human(v, s))
                .collect();
            print!("{}", texts.join("\n"));
        }
    }
    Ok(0)
}

pub fn map(a: MapArgs) -> anyhow::Result<u8> {
    let start = match &a.start_offset {
        Some(s) => parse_size(s).context("--start-offset")?,
        None => 0,
    };
    let max_length = match &a.max_length {
        Some(s) => Some(parse_size(s).context("--max-length")?),
        None => None,
    };
    let ranges = pcow::ops::map::map(
        &a.file,
        a.format.map(Into::into),
        a.force_share,
        start,
        max_length,
    )?;
    match a.output {
        OutputFormat::Json => {
            let list: Vec<Value> = ranges
                .iter()
                .map(|r| {
                    let mut m = Map::new();
                    m.insert("start".into(), json!(r.start));
                    m.insert("length".into(), json!(r.length));
                    m.insert("depth".into(), json!(r.depth));
                    m.insert("present".into(), json!(r.present));
                    m.insert("zero".into(), json!(!r.data));
                    m.insert("data".into(), json!(r.data));
                    if let Some(o) = r.offset {
                        m.insert("offset".into(), json!(o));
                    }
                    m.insert("file".into(), json!(r.file.display().to_string()));
                    Value::Object(m)
                })
                .collect();
            print_json(&Value::Array(list))?;
        }
        OutputFormat::Human => {
            println!("{:<16}{:<16}{:<16}File", "Offset", "Length", "Mapped to");
            for r in ranges.iter().filter(|r| r.data) {
                if let Some(o) = r.offset {
                    println!(
                        "{}{}{}{}",
                        hex16(r.start),
                        hex16(r.length),
                        hex16(o),
                        r.file.display()
                    );
                }
            }
        }
    }
    Ok(0)
}
