#!/usr/bin/env python3
"""Host side of scripts/sandbox/guest-bench.sh: parse the L1 serial log,
print the medians and ratios to raw-DAX, write docs/guest-benchmarks.md and
its plot (gnuplot, SVG).

The log holds, per VM run, a line
    GB-RUN round=R job=J variant=V rc=N guest=ok|FAIL wall=S
followed by fio's JSON (gzip + base64) between GB-FIO-BEGIN and GB-FIO-END,
and, for the profiled runs, GB-PROF lines (the VMM's barrier log, summed in
L1) with their own GB-PROF-FIO-BEGIN..END blocks.

Exit status: 0 when every expected run is there and succeeded, 1 otherwise
(the document is still written, saying what failed), 2 on bad arguments or
an unreadable log.
"""

import argparse
import base64
import datetime
import gzip
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

VARIANT_TEXT = {
    "pcow-snap": "pcow, thin, after `pcow-img snapshot -c` (virtio-pmem, ext4 -o dax)",
    "pcow-ovl": "pcow overlay on a pcow base (`pcow-img create -b`; virtio-pmem, ext4 -o dax)",
    "raw-dax": "raw file (virtio-pmem, ext4 -o dax): **the baseline**",
    "qcow2-snap": "qcow2, thin, after `qemu-img snapshot -c` (virtio-blk, ext4)",
    "qcow2-bak": "qcow2 with a backing file (`qemu-img create -b`; virtio-blk, ext4)",
    "raw-blk": "raw image (virtio-blk, ext4)",
}
JOB_TEXT = {
    "randwrite": "4 KiB random write (first writes into a new file)",
    "randread": "4 KiB random read (a file the image held before the boot)",
    "fsync": "4 KiB random write, fsync after each (`--fsync=1`)",
    "seqwrite": "1 MiB sequential write (a new file)",
}
BOOT_RE = re.compile(r"^GB-BOOT round=(\d+) variant=(\S+) rc=(-?\d+) guest=(\S+) wall=([0-9.]+)")
PBOOT_RE = re.compile(r"^GB-PROF-BOOT variant=(\S+) rc=(-?\d+) guest=(\S+) wall=([0-9.]+)")
PROF_RE = re.compile(r"^GB-PROF variant=(\S+) job=(\S+) (.*)$")
FAULTS_RE = re.compile(r'^GB-PROF-FAULTS variant=(\S+) faults="([^"]*)"')
BEGIN_RE = re.compile(r"^GB-(PROF-)?FIO-BEGIN job=(\S+)")
END_RE = re.compile(r"^GB-(PROF-)?FIO-END rc=(-?\d+)")


def decode_fio(lines):
    """fio's JSON from the base64 lines of one GB-FIO block."""
    raw = base64.b64decode("".join(lines), validate=False)
    return json.loads(gzip.decompress(raw))


def parse_log(path):
    """Runs (one per boot and job), profiled jobs, and the profiled boots
    (status and fault counters) from the serial log."""
    runs, profs, pboots = [], {}, {}
    boot = None  # the current GB-BOOT
    pboot = None  # the current GB-PROF-BOOT
    block = None  # (profiled?, job, base64 lines)
    with open(path, "rb") as f:
        for rawline in f:
            line = rawline.decode("utf-8", "replace").replace("\r", "").rstrip("\n")
            m = BOOT_RE.match(line)
            if m:
                boot = {
                    "round": int(m[1]),
                    "variant": m[2],
                    "rc": int(m[3]),
                    "guest": m[4],
                    "wall": float(m[5]),
                }
                pboot = None
                continue
            m = PBOOT_RE.match(line)
            if m:
                pboot = {"variant": m[1], "rc": int(m[2]), "guest": m[3], "wall": float(m[4]), "faults": None}
                pboots[m[1]] = pboot
                boot = None
                continue
            m = PROF_RE.match(line)
            if m:
                fields = dict(re.findall(r"(\w+)=(\S+)", m[3]))
                profs[(m[1], m[2])] = {"variant": m[1], "job": m[2], "fields": fields, "fio": None, "error": None}
                continue
            m = FAULTS_RE.match(line)
            if m and m[1] in pboots:
                pboots[m[1]]["faults"] = m[2]
                continue
            m = BEGIN_RE.match(line)
            if m:
                block = (bool(m[1]), m[2], [])
                continue
            m = END_RE.match(line)
            if m:
                if block is None:
                    continue
                prof, job, lines = block
                block = None
                fio, err = None, None
                if lines:
                    try:
                        fio = decode_fio(lines)
                    except (ValueError, OSError, EOFError) as e:
                        err = f"fio output unreadable: {e}"
                else:
                    err = "no fio output"
                if prof:
                    if pboot is not None and (pboot["variant"], job) in profs:
                        profs[(pboot["variant"], job)]["fio"] = fio
                        profs[(pboot["variant"], job)]["error"] = err
                elif boot is not None:
                    runs.append(
                        {
                            "round": boot["round"],
                            "variant": boot["variant"],
                            "job": job,
                            "rc": boot["rc"],
                            "guest": boot["guest"],
                            "wall": boot["wall"],
                            "fio_rc": int(m[2]),
                            "fio": fio,
                            "error": err,
                        }
                    )
                continue
            if block is not None:
                if re.fullmatch(r"[A-Za-z0-9+/=]+", line):
                    block[2].append(line)
                # other lines (a kernel message on the console) are skipped
    return runs, list(profs.values()), pboots


def pct(d, p):
    """Percentile p (e.g. 50.0) from a fio percentile dict, in microseconds."""
    if not d:
        return None
    key = f"{p:.6f}"
    v = d.get(key)
    return None if v is None else v / 1000.0


def metrics(job, fio):
    """(primary value, unit, p50 us, p99 us, runtime ms) of one run."""
    j = fio["jobs"][0]
    if job == "randread":
        io = j["read"]
    else:
        io = j["write"]
    runtime_ms = io.get("runtime", 0)
    if job == "seqwrite":
        value, unit = io["bw_bytes"] / 1048576.0, "MiB/s"
    else:
        value, unit = io["iops"], "IOPS"
    if job == "fsync":
        lat = j.get("sync", {}).get("lat_ns", {}).get("percentile", {})
    else:
        lat = io.get("clat_ns", {}).get("percentile", {})
    return value, unit, pct(lat, 50.0), pct(lat, 99.0), runtime_ms


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, nd=1):
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{nd}f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--doc", required=True)
    ap.add_argument("--plot", required=True)
    ap.add_argument("--l1-seconds", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--variants", required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--fs-mib", required=True)
    ap.add_argument("--mem", required=True)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--load", default="")
    ap.add_argument("--images", default="")
    ap.add_argument("--note", default="", help="a paragraph for the Results section (what this document's run was)")
    a = ap.parse_args()
    jobs = a.jobs.split()
    variants = a.variants.split()
    sizes = dict(kv.split("=", 1) for kv in a.sizes.split())

    try:
        runs, profs, pboots = parse_log(a.log)
        with open(a.log, "rb") as f:
            ended = b"GB-L1 done:" in f.read()
    except OSError as e:
        print(f"guest-bench-report: cannot read the log {a.log}: {e}", file=sys.stderr)
        return 2

    # ---- collect -------------------------------------------------------------
    problems = []
    table = {}  # (job, variant) -> list of (round, value, p50, p99, runtime)
    unit = {}
    for r in runs:
        if r["round"] == 0:
            continue  # warm-up
        where = f"round {r['round']} {r['job']} on {r['variant']}"
        if r["rc"] != 0 or r["guest"] != "ok" or r["fio_rc"] != 0:
            problems.append(f"{where}: VM exit {r['rc']}, guest {r['guest']}, fio exit {r['fio_rc']}")
            continue
        if r["fio"] is None:
            problems.append(f"{where}: {r['error'] or 'no fio output'}")
            continue
        try:
            v, u, p50, p99, rt = metrics(r["job"], r["fio"])
        except (KeyError, IndexError, TypeError) as e:
            problems.append(f"{where}: fio's JSON lacks {e}")
            continue
        unit[r["job"]] = u
        table.setdefault((r["job"], r["variant"]), []).append((r["round"], v, p50, p99, rt))
    # Only complete rounds count: the point of a round is that every variant
    # ran every job in it, side by side; a round with a hole would compare
    # variants measured at different times.
    complete = [
        rd
        for rd in range(1, a.rounds + 1)
        if all(any(p[0] == rd for p in table.get((job, v), [])) for job in jobs for v in variants)
    ]
    for rd in range(1, a.rounds + 1):
        if rd not in complete:
            missing = [
                f"{job} on {v}"
                for job in jobs
                for v in variants
                if not any(p[0] == rd for p in table.get((job, v), []))
            ]
            problems.append(
                f"round {rd} is incomplete, not used: no good run of {', '.join(missing[:6])}"
                + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            )
    for key in table:
        table[key] = [p for p in table[key] if p[0] in complete]
    if not ended:
        problems.append(
            "the L1 run did not finish: its log ends without `GB-L1 done` (cut by the timeout, stalled, or crashed)"
        )

    # ---- statistics --------------------------------------------------------------
    rows = {}
    for job in jobs:
        base = {rd: val for rd, val, *_ in table.get((job, "raw-dax"), [])}
        base_med = med(base.values())
        for v in variants:
            pts = table.get((job, v), [])
            vals = [p[1] for p in pts]
            m = med(vals)
            per_round = [val / base[rd] for rd, val, *_ in pts if base.get(rd)]
            rows[(job, v)] = {
                "n": len(pts),
                "median": m,
                "min": min(vals) if vals else None,
                "max": max(vals) if vals else None,
                "p50": med([p[2] for p in pts]),
                "p99": med([p[3] for p in pts]),
                "ratio": (m / base_med) if (m is not None and base_med) else None,
                "rr_min": min(per_round) if per_round else None,
                "rr_max": max(per_round) if per_round else None,
                "runtime": med([p[4] for p in pts]),
            }

    # ---- text table (stdout) -------------------------------------------------
    out = []
    for job in jobs:
        out.append(f"### {JOB_TEXT[job]}")
        out.append("")
        lat = "fsync latency" if job == "fsync" else "completion latency"
        out.append(
            f"| variant | median {unit.get(job, '')} | min-max | {lat} p50 / p99 (us) | ratio to raw-DAX | per-round ratios |"
        )
        out.append("| --- | --- | --- | --- | --- | --- |")
        for v in variants:
            s = rows[(job, v)]
            ratio = "**1.00** (baseline)" if v == "raw-dax" else f"**{fmt(s['ratio'], 2)}**"
            rr = "-" if v == "raw-dax" else f"{fmt(s['rr_min'], 2)}-{fmt(s['rr_max'], 2)}"
            out.append(
                f"| {v} | {fmt(s['median'])} | {fmt(s['min'])}-{fmt(s['max'])} | "
                f"{fmt(s['p50'])} / {fmt(s['p99'])} | {ratio} | {rr} |"
            )
        out.append("")
    result_md = "\n".join(out)
    print(result_md)
    for p in problems:
        print(f"guest-bench-report: FAILED: {p}")

    # ---- profile ------------------------------------------------------------------
    prof_md = []
    for v, b in sorted(pboots.items()):
        if b["rc"] != 0 or b["guest"] != "ok":
            problems.append(f"profiled boot of {v}: VM exit {b['rc']}, guest {b['guest']}")
    if profs:
        prof_md.append(
            "| variant | job | fio runtime | barriers (FLUSH) | vCPU held, sum | held p50 per barrier | scan, sum | pages found / copied |"
        )
        prof_md.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for p in profs:
            f = p["fields"]
            rt = prof_runtime(p)
            share = ""
            try:
                if rt:
                    share = f" ({100.0 * float(f['held_ms']) / rt:.0f}% of the runtime)"
            except (KeyError, ValueError):
                share = ""
            prof_md.append(
                f"| {p['variant']} | {p['job']} | {fmt(rt)} ms | {f.get('barriers', '-')} "
                f"| {f.get('held_ms', '-')} ms{share} | {f.get('held_p50_us', '-')} us | {f.get('scan_ms', '-')} ms "
                f"| {f.get('found', '-')} / {f.get('copied', '-')} |"
            )
        prof_md.append("")
        for v, b in sorted(pboots.items()):
            prof_md.append(
                f"- {v}: the profiled boot took {b['wall']} s; the monitor's counters at exit (the whole boot, all jobs): {b['faults'] or '-'}."
            )
    prof_table = "\n".join(prof_md)

    if a.doc == "-":
        return 1 if problems else 0

    # ---- plot --------------------------------------------------------------------------
    plot_rel = os.path.basename(a.plot)
    plot_ok = False
    with tempfile.TemporaryDirectory() as td:
        dat = os.path.join(td, "ratios.dat")
        with open(dat, "w") as f:
            f.write("job\t" + "\t".join(variants) + "\n")
            for job in jobs:
                vals = []
                for v in variants:
                    r = rows[(job, v)]["ratio"]
                    vals.append("-" if r is None else f"{r:.4f}")
                f.write(job + "\t" + "\t".join(vals) + "\n")
        gp = os.path.join(td, "plot.gp")
        with open(gp, "w") as f:
            f.write(
                f"""set terminal svg size 900,480 font "DejaVu Sans,12" noenhanced
set output {json.dumps(a.plot)}
set datafile separator "\\t"
set datafile missing "-"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border rgb "#333333"
set boxwidth 0.9
set logscale y
set grid ytics lc rgb "#dddddd"
set key outside right top vertical Left reverse samplen 1.5
set ylabel "median / raw-DAX median (log scale; higher is faster)"
set title "fio in the L2 guest, ratio to raw-DAX (nested sandbox: emulated)"
set xtics nomirror
set ytics nomirror
set border 3
plot for [i=2:{len(variants) + 1}] {json.dumps(dat)} using i:xtic(1) title columnheader(i), 1 with lines lc rgb "#000000" dt 2 notitle
"""
            )
        try:
            subprocess.run(["gnuplot", gp], check=True, capture_output=True, timeout=60)
            plot_ok = True
        except (OSError, subprocess.SubprocessError) as e:
            problems.append(f"gnuplot failed: {e}")

    # ---- document ----------------------------------------------------------------
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "vmm", "pcow", "devices", "Cargo.toml", "Cargo.lock")
    ndirty = len([x for x in dirty.splitlines() if x.strip()]) if dirty != "?" else 0
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = []
    try:
        with open(a.manifest) as f:
            versions = [line.split() for line in f if line.strip()]
    except OSError:
        pass
    l1_line = next((ln for ln in open(a.log, "rb").read().decode("utf-8", "replace").splitlines() if ln.startswith("GB-L1 cloud-hypervisor")), "")
    l1_line = l1_line.replace("\r", "").replace("GB-L1 ", "")

    d = []
    w = d.append
    w("# Guest-level benchmark (nested sandbox): fio on pcow-DAX, raw-DAX and qcow2/virtio-blk")
    w("")
    w("<!-- Generated by scripts/sandbox/guest-bench.sh (guest-bench-report.py): edit the scripts, not this file. -->")
    w("")
    w("> **Absolute numbers here mean nothing.** Every guest instruction runs")
    w("> under nested KVM inside an L1 machine that QEMU emulates with TCG (the")
    w("> host has no usable hardware virtualization: `scripts/sandbox/README.md`),")
    w("> on a 2-core machine shared with other jobs. Only the ratios to raw-DAX")
    w("> measured side by side in the same L1 boot say something, and each is bent")
    w("> by the emulation in a direction given below. Real hardware is needed for")
    w("> the paper's absolute figures.")
    w("")
    w("## Command")
    w("")
    w("```sh")
    w(a.command)
    w("```")
    w("")
    w("## What runs")
    w("")
    w("One L1 boot (QEMU TCG, `-cpu EPYC,+svm`, 1 vCPU, real `kvm-amd` inside). In")
    w("it, each round boots every variant once, one after the other, the")
    w("variants' order rotated by one each round, each boot on a fresh image (a")
    w("copy of the pristine one, or a new overlay on a read-only base); the")
    w(f"guest runs the jobs in the order `{' '.join(jobs)}`, each on its own")
    w("file, with a `sync` after each outside fio's timing (so a job's first")
    w("fsync does not flush what the job before it left). One warm-up boot")
    w("(raw-DAX, randread) first, not counted. One boot per job would be purer")
    w("but does not fit: with fio's libraries in the initramfs a boot alone takes")
    w("20-25 s with our VMM and 55-60 s with QEMU here.")
    w("")
    w("| variant | storage |")
    w("| --- | --- |")
    for v in variants:
        w(f"| {v} | {VARIANT_TEXT[v]} |")
    w("")
    w("Both VMMs boot the same L2: Debian's 6.1 cloud kernel, the busybox")
    w("initramfs of `build-l2.sh` with Debian's `fio` and every shared library it")
    w(f"is linked against appended, 1 vCPU, {a.mem} of RAM. Ours: `cloud-hypervisor")
    w("--cpus boot=1 --pmem file=IMAGE` (release build); the guest mounts")
    w("/dev/pmem0 `-t ext4 -o dax`. QEMU (Debian's, in L1, `-accel kvm -cpu host")
    w("-smp 1`, default machine): `-drive file=IMAGE,format=qcow2|raw,cache=writeback")
    w("-device virtio-blk-pci`; the guest mounts /dev/vda `-t ext4`. Every image")
    w("lives in L1's tmpfs (RAM), so neither side waits for a disk.")
    w("")
    w(f"The file system: {a.fs_mib} MiB ext4, 4 KiB blocks, made on the host with")
    w("the read job's file (random bytes) in it; the raw variants use it as is, the")
    w("pcow and qcow2 ones are `convert`ed from it (thin: only what ext4 wrote),")
    w("then the snapshot taken or used as the base." + (f" {a.images}" if a.images else ""))
    w("")
    w("fio (`--ioengine=psync --iodepth=1 --numjobs=1 --direct=1`, JSON output):")
    w("")
    w("| job | fio | bytes |")
    w("| --- | --- | --- |")
    jobopts = {
        "randwrite": "`--rw=randwrite --bs=4k --fallocate=none`, new file",
        "randread": "`--rw=randread --bs=4k`, the file made on the host",
        "fsync": "`--rw=randwrite --bs=4k --fallocate=none --fsync=1`, new file",
        "seqwrite": "`--rw=write --bs=1M --fallocate=none`, new file",
    }
    for job in jobs:
        w(f"| {job} | {jobopts[job]} | {int(sizes[job]) // 1024} KiB |")
    w("")
    w("`--direct=1`: on virtio-blk it bypasses the guest's page cache, so every")
    w("request goes to the device (QEMU's block layer, then the image). On ext4")
    w("`-o dax` there is no page cache to bypass: reads and writes are copies")
    w("between fio's buffer and the pmem mapping with or without O_DIRECT, and a")
    w("write into a hole first allocates blocks, which ext4 zeroes on DAX. On")
    w("virtio-pmem, an fsync ends in the device's FLUSH request: for pcow a")
    w("barrier (vCPUs held while written pages are found and copied into the")
    w("image), for a raw file an `fdatasync` of the file on the L1 side.")
    w("")
    w("## Results")
    w("")
    w(f"Complete rounds used: {len(complete)} of {a.rounds} ({', '.join(map(str, complete)) or 'none'}).")
    w("Medians over those rounds; min-max over them; the ratio is the")
    w("variant's median over raw-DAX's median (higher is faster; for")
    w("latencies compare the columns); per-round ratios: each round's value over")
    w("raw-DAX's value in the same round (the variants ran side by side).")
    w("")
    if a.note:
        w(a.note)
        w("")
    if problems:
        w("**This run had failures** (the tables use the complete rounds only):")
        w("")
        for p in problems:
            w(f"- {p}")
        w("")
    w(result_md)
    if plot_ok:
        w(f"![ratios to raw-DAX]({plot_rel})")
        w("")
    targets = {"randread": 0.95, "fsync": 0.9, "randwrite": 0.8, "seqwrite": 0.8}
    trows = []
    for v in ("pcow-snap", "pcow-ovl"):
        if v not in variants:
            continue
        for job in jobs:
            st = rows[(job, v)]
            if st["ratio"] is None:
                continue
            verdict = "at or above" if st["ratio"] >= targets[job] else "below"
            trows.append(
                f"| {v} | {job} | {fmt(st['ratio'], 2)} | {fmt(st['rr_min'], 2)}-{fmt(st['rr_max'], 2)} "
                f"| {targets[job]:.2f} | {verdict} |"
            )
    if trows:
        w("## Against issue 20's targets (pcow / raw-DAX)")
        w("")
        w("Issue 20 asks for at least 0.95x raw-DAX on reads, 0.9x on write+fsync")
        w("loops and 0.8x on first writes into holes (every write job here writes")
        w("into new blocks). These are the emulated ratios: \"Which way emulation")
        w("bends each ratio\" below explains why they read low for pcow, so \"below\" here is no proof of")
        w("\"below\" on hardware, and \"at or above\" with a wide per-round range is")
        w("no proof either.")
        w("")
        w("| variant | job | ratio of medians | per-round ratios | target | here |")
        w("| --- | --- | --- | --- | --- | --- |")
        for t in trows:
            w(t)
        w("")
    w(EMULATION_TITLE)
    w("")
    w("Every job here touches each page of its file once (fio's random map: no")
    w("block twice; new files for the writes), so every job is about first")
    w("accesses: cold reads, and first writes into blocks the file system had")
    w("never used (holes in the images). Two costs of the emulation pull in")
    w("opposite directions:")
    w("")
    w("- **Per-request CPU cost (bends virtio-blk down).** TCG translates every")
    w("  instruction of L1, and L2 runs in L1's KVM, also translated. A")
    w("  virtio-blk request is a notify exit from L2 into L1's KVM, QEMU's")
    w("  block layer (qcow2 metadata lookups and allocation, a `pwritev`/`preadv`")
    w("  into tmpfs), an interrupt back: a long CPU path, each step many times")
    w("  its hardware cost. A DAX read or write of a page already mapped is a")
    w("  `memcpy` inside L2 with no exit. So for small requests (4 KiB) **the")
    w("  blk/raw-DAX ratios come out lower here than on hardware**.")
    w("- **First touch of a pmem page (bends DAX down).** The first access of")
    w("  L2 to a page of the pmem region is a nested page fault: L1's KVM,")
    w("  emulated, walks and fills its nested page table (and for raw-DAX the")
    w("  page of the tmpfs file is looked up; for pcow, a cluster the guest")
    w("  never wrote goes through the VMM's fault monitor first). On hardware")
    w("  that costs about a microsecond; here it costs hundreds. ext4 on DAX")
    w("  also zeroes each newly allocated block through the same mapping before")
    w("  the data is copied in. virtio-blk moves the data with QEMU's copies in")
    w("  L1 into guest RAM that is already mapped, and pays no such fault per")
    w("  page. So for jobs that touch much new pmem per request (the 1 MiB")
    w("  sequential write: 256 first touches per request) **the blk/raw-DAX")
    w("  ratios come out higher here than on hardware**, and may even be above")
    w("  1 where on hardware DAX would win.")
    w("- **pcow against raw-DAX.** Both pay the nested page faults above; pcow")
    w("  adds its own work, all of it CPU paths that emulation inflates more")
    w("  than copies: the fault monitor's round trip (userfaultfd in L1's")
    w("  kernel, the monitor thread, the cluster's mapping) on the first write")
    w("  into a cluster that is shared with a snapshot or the base or is a hole,")
    w("  and for every guest fsync a barrier (the vCPU thread signalled out of")
    w("  `KVM_RUN` and held, the written pages found and copied, the vCPU")
    w("  resumed). raw-DAX's FLUSH is one `fdatasync` of a tmpfs file, nearly free.")
    w("  So **pcow/raw-DAX comes out lower here than on hardware** for first")
    w("  writes and fsync loops; on reads both map pages and the bias is small.")
    w("- **What the setup leaves out.** The images are in L1's tmpfs: no disk.")
    w("  On hardware with a disk, raw-DAX's FLUSH would write back the file's")
    w("  dirty pages and qcow2/raw-blk's flush would reach the disk; a pcow")
    w("  barrier writes into its image file and then syncs it. Disk flushes")
    w("  would dominate fsync loops for all six variants and pull their ratios")
    w("  towards 1.")
    w("- **Noise.** fio's clock in L2 is kvmclock over L1's emulated TSC, and")
    w("  other jobs on the host's 2 cores slow L1 as a whole. Values taken in")
    w("  the same round share that load, which is why each round runs all")
    w("  variants back to back and why the per-round ratios are shown; with a")
    w("  few rounds, differences under about 20% are not significant here.")
    w("")
    if prof_table:
        w("## Where the pcow time goes (profiled runs)")
        w("")
        w("After the rounds, each pcow variant booted once more and ran every job")
        w("with the VMM's debug log (`-vv`): one line per guest FLUSH with how long")
        w("the barrier held the vCPU (its scan and copy; its commit comes after the")
        w("vCPU is released) and how long the scan took, and at exit the")
        w("monitor's fault counters. These runs are not in the medians (the log")
        w("itself costs a little); fio's runtime is theirs.")
        w("")
        w(prof_table)
        w("")
        w(prof_paragraph(profs, rows))
        w("")
    w("## Runs")
    w("")
    w("```")
    w("round variant job vm-exit guest boot-wall(s) fio-exit value unit p50(us) p99(us) runtime(ms)")
    for r in runs:
        val = ""
        if r["fio"] is not None:
            try:
                v, u, p50, p99, rt = metrics(r["job"], r["fio"])
                val = f"{fmt(v)} {u} {fmt(p50)} {fmt(p99)} {rt}"
            except (KeyError, IndexError, TypeError):
                val = "(fio JSON incomplete)"
        tag = " (warm-up)" if r["round"] == 0 else ""
        w(f"{r['round']} {r['variant']} {r['job']} {r['rc']} {r['guest']} {r['wall']} {r['fio_rc']} {val}{tag}")
    w("```")
    w("")
    w("## Environment")
    w("")
    w("| | |")
    w("| --- | --- |")
    w(f"| date | {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} |")
    w(
        f"| code | commit `{commit}`"
        + (f" with {ndirty} uncommitted change(s) under vmm/ pcow/ devices/ Cargo.*" if ndirty else "")
        + " |"
    )
    if l1_line:
        w(f"| VMMs in L1 | {l1_line} |")
    w(f"| host | `nproc` {os.cpu_count()}, {cpu} |")
    if a.load:
        w(f"| host load average (1 min) during the L1 run | {a.load} |")
    w(f"| L1 | QEMU TCG `-cpu EPYC,+svm`, 1 vCPU, 1536 MiB; run {a.l1_seconds:.0f} s wall |")
    w("")
    if versions:
        w("Packages (`.cache/sandbox/packages.txt` from `fetch.sh`, plus fio):")
        w("")
        w("| role | package | version |")
        w("| --- | --- | --- |")
        for v in versions:
            if len(v) >= 3:
                w(f"| {v[0]} | `{v[1]}` | {v[2]} |")
        w("")
    # The breakdown section (guest-bench-breakdown.py's tables and their
    # reading, measured with a timing probe in a run of its own) is kept
    # across regenerations, before "## Runs": it names its own run.
    kept = kept_breakdown(a.doc)
    if kept:
        i = d.index("## Runs")
        d[i:i] = kept.rstrip("\n").split("\n") + [""]
    # The section of an earlier run with every variant (its own tables,
    # labelled with its run and commit) is kept, before "## Which way
    # emulation bends each ratio", while this run leaves some variants out:
    # a run of the pcow variants alone then does not drop the qcow2 and
    # raw-blk numbers from the document. A run of all of them replaces it.
    earlier = kept_section(a.doc, EARLIER_TITLE)
    if earlier and not set(VARIANT_TEXT) <= set(variants):
        i = d.index(EMULATION_TITLE)
        d[i:i] = earlier.rstrip("\n").split("\n") + [""]
    os.makedirs(os.path.dirname(os.path.abspath(a.doc)), exist_ok=True)
    with open(a.doc, "w") as f:
        f.write("\n".join(d))
    print(f"guest-bench-report: wrote {a.doc}" + (f" and {a.plot}" if plot_ok else ""))
    return 1 if problems else 0


BREAKDOWN_TITLE = "## Where pcow's time goes (timed FLUSHes and faults)"
EARLIER_TITLE = "## Earlier run: all six variants"
EMULATION_TITLE = "## Which way emulation bends each ratio"


def kept_section(path, title):
    """The section of the document at PATH whose heading line starts with
    TITLE (up to the next second-level heading), or None."""
    try:
        with open(path) as f:
            doc = f.read()
    except OSError:
        return None
    i = doc.find("\n" + title)
    if i < 0:
        return None
    j = doc.find("\n## ", i + 1 + len(title))
    return doc[i + 1 : j + 1] if j >= 0 else doc[i + 1 :]


def kept_breakdown(path):
    """The breakdown section of the document at PATH, or None."""
    return kept_section(path, BREAKDOWN_TITLE + "\n")


def prof_runtime(p):
    """fio's runtime (ms) of a profiled job, or None."""
    if p["fio"] is None:
        return None
    try:
        return metrics(p["job"], p["fio"])[4]
    except (KeyError, IndexError, TypeError):
        return None


def prof_paragraph(profs, rows):
    """What the profiled runs show, in numbers (no claim the data lacks)."""
    parts = []
    for p in profs:
        f = p["fields"]
        try:
            n = int(f.get("barriers", "0"))
            held = float(f.get("held_ms", "0"))
            scan = float(f.get("scan_ms", "0"))
            found = int(f.get("found", "0"))
            copied = int(f.get("copied", "0"))
        except ValueError:
            continue
        rt = prof_runtime(p)
        if not rt:
            continue
        base = rows.get((p["job"], "raw-dax"), {}).get("runtime")
        extra = (rt - base) if base else None
        s = f"{p['variant']} {p['job']}: fio ran {rt} ms"
        if base:
            s += f" (raw-DAX's median: {base:.0f} ms)"
        if n:
            s += (
                f"; {n} FLUSH barriers held the vCPU {held:.0f} ms in all, {held / n:.2f} ms each on average"
                f" (scan {scan / n:.2f} ms), finding {found / n:.1f} written private pages and copying {copied / n:.1f} per barrier"
            )
            if extra and extra > 0:
                s += f": {100.0 * min(held, extra) / extra:.0f}% of pcow's extra time over raw-DAX"
        else:
            s += "; no FLUSH during the job"
            if extra and extra > 0:
                s += f", so its {extra:.0f} ms over raw-DAX's median are the monitor's first-write faults and the guest's own work"
        parts.append(s + ".")
    if not parts:
        return "(The profiled runs printed no usable barrier lines.)"
    return (
        "In numbers: "
        + " ".join(parts)
        + " A profiled run is one boot, compared with the medians of the rounds,"
        " so differences of 20% are noise here. Written pages the barriers"
        " did not find were written through shared mappings: the first write"
        " into a hole is an expansion (the vCPU blocks on a userfaultfd fault,"
        " the monitor maps a pre-allocated cluster of the image MAP_SHARED over"
        " it and wakes the vCPU: the `write` fault counter), so the guest's"
        " later stores go to the image file directly and a barrier has nothing"
        " to copy; only a write into a cluster shared with the snapshot or the"
        " base makes a private page (the host kernel's copy-on-write, no exit)"
        " that the next barrier finds and copies. What a barrier with nothing"
        " to copy costs is holding the vCPU for the scan and resuming it. The hold is not all of a FLUSH: the barrier's"
        " commit (the image's metadata and syncs) runs after the vCPU is"
        " released and before the FLUSH is answered, and the per-FLUSH log"
        " line does not time it. The VMM does not time faults one by one"
        " either: the counters above say how many there were."
    )


if __name__ == "__main__":
    sys.exit(main())
