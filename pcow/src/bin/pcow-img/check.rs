//! `check`: the consistency rules of the spec, in qemu-img's output and
//! exit-code conventions (0 clean, 2 corrupt, 3 leaks only, 1 the check
//! itself failed).

use std::fmt::Write as _;

use anyhow::bail;
use pcow::check::{CheckReport, Finding, Repair};
use serde_json::{json, Value};

use crate::output::print_json;
use crate::{CheckArgs, OutputFormat, RepairArg};

/// `R6: both slots ...` is printed as `R6` and the rest.
fn describe(f: &Finding) -> &str {
    f.message
        .strip_prefix(f.rule.as_str())
        .and_then(|m| m.strip_prefix(": "))
        .unwrap_or(&f.message)
}

fn human(r: &CheckReport) -> String {
    let mut s = String::new();
    let repaired: Vec<&Finding> = r
        .corruptions
        .iter()
        .chain(&r.leaks)
        .filter(|f| f.repaired)
        .collect();
    if !repaired.is_empty() {
        let _ = writeln!(
            s,
            "The following inconsistencies were found and repaired:\n"
        );
        for f in &repaired {
            let _ = writeln!(s, "    {}: {}", f.rule, describe(f));
        }
        let _ = writeln!(s);
    }
    let errors: Vec<&Finding> = r.corruptions.iter().filter(|f| !f.repaired).collect();
    let leaks: Vec<&Finding> = r.leaks.iter().filter(|f| !f.repaired).collect();
    for f in &errors {
        let _ = writeln!(s, "ERROR {}: {}", f.rule, describe(f));
    }
    for f in &leaks {
        let _ = writeln!(s, "Leaked {}: {}", f.rule, describe(f));
    }
    if errors.is_empty() && leaks.is_empty() {
        let _ = writeln!(s, "No errors were found on the image.");
    }
    if !errors.is_empty() {
        let _ = writeln!(
            s,
            "\n{} errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.",
            errors.len()
        );
    }
    if !leaks.is_empty() {
        // L1 names its cluster count; stale slots and the DIRTY flag leak
        // no cluster.
        let clusters = leak_count(r, leaks.iter().copied().filter(|f| f.rule == "L1"));
        let other = leaks.iter().filter(|f| f.rule != "L1").count();
        let _ = writeln!(s);
        if clusters > 0 {
            let _ = writeln!(s, "{clusters} leaked clusters were found on the image.");
        }
        if other > 0 {
            let _ = writeln!(
                s,
                "{other} other leaks (stale metadata slots, DIRTY flag) were found on the image."
            );
        }
        let _ = writeln!(s, "This means waste of disk space, but no harm to data.");
    }
    if r.total_clusters > 0 {
        let pct = r.allocated_clusters as f64 * 100.0 / r.total_clusters as f64;
        let _ = writeln!(
            s,
            "{}/{} = {pct:.2}% allocated, {} unreachable clusters",
            r.allocated_clusters, r.total_clusters, r.unreachable_clusters
        );
        let _ = writeln!(s, "Image end offset: {}", r.image_end_offset);
    }
    s
}

/// Leaks counted as qemu-img counts them: the clusters of L1, and one for
/// each other leak (a stale slot, the DIRTY flag).
fn leak_count<'a>(r: &CheckReport, leaks: impl Iterator<Item = &'a Finding>) -> u64 {
    leaks
        .map(|f| if f.rule == "L1" { r.leaked_clusters } else { 1 })
        .sum()
}

/// qemu-img's `ImageCheck` object (counts present only when non-zero, and
/// `check-errors` for failures of the check itself, which are an exit 1
/// here instead), with pcow's unreachable clusters and every finding.
fn json_report(r: &CheckReport) -> Value {
    let count = |found: &[Finding], repaired: bool| {
        found.iter().filter(|f| f.repaired == repaired).count() as u64
    };
    let mut m = serde_json::Map::new();
    m.insert("filename".into(), json!(r.filename));
    m.insert("format".into(), json!("pcow"));
    m.insert("check-errors".into(), json!(0));
    let counts = [
        ("corruptions", count(&r.corruptions, false)),
        ("corruptions-fixed", count(&r.corruptions, true)),
        (
            "leaks",
            leak_count(r, r.leaks.iter().filter(|f| !f.repaired)),
        ),
        (
            "leaks-fixed",
            leak_count(r, r.leaks.iter().filter(|f| f.repaired)),
        ),
    ];
    for (k, n) in counts.into_iter().filter(|&(_, n)| n > 0) {
        m.insert(k.into(), json!(n));
    }
    m.insert("image-end-offset".into(), json!(r.image_end_offset));
    m.insert("total-clusters".into(), json!(r.total_clusters));
    m.insert("allocated-clusters".into(), json!(r.allocated_clusters));
    m.insert("unreachable-clusters".into(), json!(r.unreachable_clusters));
    let findings: Vec<Value> = r
        .corruptions
        .iter()
        .map(|f| (f, "corruption"))
        .chain(r.leaks.iter().map(|f| (f, "leak")))
        .map(|(f, kind)| {
            json!({"rule": f.rule, "kind": kind, "message": f.message, "repaired": f.repaired})
        })
        .collect();
    m.insert("findings".into(), Value::Array(findings));
    Value::Object(m)
}

pub fn check(a: CheckArgs) -> anyhow::Result<u8> {
    if a.format == Some(crate::Fmt::Raw) {
        bail!("a raw image has no metadata to check (check is for pcow images)");
    }
    let repair = a.repair.map(|r| match r {
        RepairArg::Leaks => Repair::Leaks,
        RepairArg::All => Repair::All,
    });
    let report = pcow::check::check(&a.file, repair, a.force_share)?;
    let mut code = report.exit_code();
    // With -U the image may have a writer (a running VM): its DIRTY flag
    // and the clusters it allocated since its last barrier read as leaks
    // that its next barrier or close commits. They say nothing about the
    // image, so leaks alone do not fail the check; corruption still does.
    let in_use = a.force_share && writer_holds(&a.file);
    if in_use && code == 3 {
        code = 0;
    }
    match a.output {
        _ if a.quiet => {}
        OutputFormat::Json => {
            let mut v = json_report(&report);
            if in_use {
                v["in-use"] = json!(true);
            }
            print_json(&v)?
        }
        OutputFormat::Human => {
            print!("{}", human(&report));
            if in_use {
                println!("{IN_USE_NOTE}");
            }
        }
    }
    Ok(u8::try_from(code).unwrap_or(1))
}

/// What `check -U` says of an image another process writes.
const IN_USE_NOTE: &str = "The image is in use by another process (a writer holds it): the \
    leaks above can be stale (clusters allocated and the DIRTY flag set since its last \
    commit, which its next barrier or close commits), so they do not fail the check.";

/// Whether another process holds `path` for writing (its exclusive lock
/// stops a shared one). Anything that keeps the probe from answering is
/// "no": the check's own result stands.
fn writer_holds(path: &std::path::Path) -> bool {
    let Ok(f) = pcow::output_file::open_regular_input(path) else {
        return false;
    };
    matches!(f.try_lock_shared(), Err(std::fs::TryLockError::WouldBlock))
}
