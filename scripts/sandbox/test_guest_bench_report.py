#!/usr/bin/env python3
"""Tests of guest-bench-report.py on serial logs made here (no sandbox):
medians and ratios to raw-DAX, per-round ratios, and that every kind of
broken run makes the report fail instead of being counted.

Run: python3 scripts/sandbox/test_guest_bench_report.py
"""

import base64
import gzip
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPORT = os.path.join(HERE, "guest-bench-report.py")
JOBS = ["randread", "fsync"]


def fio_block(job, iops, p50_ns=1000, p99_ns=9000, dev="pmem", rc=0, garble=False):
    """The lines the guest prints for one fio job."""
    io = {
        "iops": iops,
        "bw_bytes": iops * 4096,
        "runtime": 1000,
        "clat_ns": {"percentile": {"50.000000": p50_ns, "99.000000": p99_ns}},
    }
    j = {"jobname": job, "read": io if job == "randread" else {}, "write": io if job != "randread" else {}}
    if job == "fsync":
        j["sync"] = {"lat_ns": {"percentile": {"50.000000": p50_ns * 2, "99.000000": p99_ns * 2}}}
    text = base64.b64encode(gzip.compress(json.dumps({"jobs": [j]}).encode())).decode()
    if garble:
        text = text[: len(text) // 2]
    lines = [f"GB-FIO-BEGIN job={job} dev={dev}"]
    lines += [text[i : i + 76] for i in range(0, len(text), 76)]
    lines.append(f"GB-FIO-END rc={rc}")
    return lines


def boot(rnd, variant, values, rc=0, guest="ok", **kw):
    """A GB-BOOT line and one fio block per job (values: job -> IOPS)."""
    lines = [f"GB-BOOT round={rnd} variant={variant} rc={rc} guest={guest} wall=12.5"]
    for job in JOBS:
        if job in values:
            lines += fio_block(job, values[job], **kw)
    return lines


def run_report(lines, variants=("pcow-snap", "raw-dax"), rounds=2, ended=True, doc=None):
    """Runs the report on LINES; with DOC (a file's text), the document is
    that file rewritten, and the output ends with what was written."""
    with tempfile.TemporaryDirectory() as td:
        log = os.path.join(td, "serial.log")
        with open(log, "w") as f:
            # The serial console adds carriage returns; keep them.
            end = ["GB-L1 done: 0 failed run(s), 1.0s"] if ended else []
            f.write("\r\n".join(lines + end) + "\r\n")
        doc_path = os.path.join(td, "doc.md")
        if doc is not None:
            with open(doc_path, "w") as f:
                f.write(doc)
        manifest = os.path.join(td, "packages.txt")
        with open(manifest, "w") as f:
            f.write("l2-kernel linux-image-x 1\n")
        p = subprocess.run(
            [
                sys.executable,
                REPORT,
                "--log", log,
                "--doc", doc_path if doc is not None else "-",
                "--plot", os.path.join(td, "p.svg"),
                "--rounds", str(rounds),
                "--jobs", " ".join(JOBS),
                "--variants", " ".join(variants),
                "--sizes", "randread=4096 randwrite=4096 fsync=4096 seqwrite=4096",
                "--fs-mib", "64",
                "--mem", "512M",
                "--manifest", manifest,
                "--command", "test",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out = p.stdout + p.stderr
        if doc is not None and os.path.exists(doc_path):
            with open(doc_path) as f:
                out += "\n=== DOC ===\n" + f.read()
        return p.returncode, out


def row(out, job_title_word, variant):
    """The table row of VARIANT under the table whose title has the word."""
    section = out.split(job_title_word, 1)[1]
    for line in section.splitlines():
        if line.startswith(f"| {variant} |"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no row for {variant} after {job_title_word!r} in:\n{out}")


class Report(unittest.TestCase):
    def test_medians_and_ratios(self):
        lines = ["noise before the runs"]
        # warm-up (round 0) must not count: a huge value would move the median
        lines += boot(0, "raw-dax", {"randread": 999999})
        lines += boot(1, "raw-dax", {"randread": 1000, "fsync": 50})
        lines += boot(1, "pcow-snap", {"randread": 900, "fsync": 40})
        lines += boot(2, "pcow-snap", {"randread": 1100, "fsync": 20})
        lines += boot(2, "raw-dax", {"randread": 1000, "fsync": 40})
        rc, out = run_report(lines)
        self.assertEqual(rc, 0, out)
        r = row(out, "random read", "pcow-snap")
        self.assertEqual(r[1], "1000")  # median of 900, 1100
        self.assertEqual(r[2], "900-1100")
        self.assertEqual(r[4], "**1.00**")  # 1000 / 1000
        self.assertEqual(r[5], "0.90-1.10")  # per round: 900/1000, 1100/1000
        r = row(out, "fsync after each", "pcow-snap")
        self.assertEqual(r[1], "30.0")  # median of 40, 20
        self.assertEqual(r[4], "**0.67**")  # 30 / median(50, 40) = 45
        self.assertEqual(r[5], "0.50-0.80")  # 20/40, 40/50
        # fsync's latency column is fio's sync latency (2 us / 18 us here)
        self.assertEqual(r[3], "2.0 / 18.0")
        r = row(out, "random read", "raw-dax")
        self.assertIn("baseline", r[4])

    def test_missing_run_fails(self):
        lines = boot(1, "raw-dax", {"randread": 1000, "fsync": 50})
        lines += boot(1, "pcow-snap", {"randread": 900, "fsync": 40})
        lines += boot(2, "raw-dax", {"randread": 3000, "fsync": 50})
        rc, out = run_report(lines)
        self.assertEqual(rc, 1, out)
        self.assertIn("round 2 is incomplete, not used: no good run of randread on pcow-snap, fsync on pcow-snap", out)
        # only round 1 counts: raw-dax's median is round 1's value
        self.assertEqual(row(out, "random read", "raw-dax")[1], "1000")

    def test_failed_boot_fio_error_and_garbled_output_fail(self):
        for bad, expect in [
            (boot(2, "pcow-snap", {"randread": 900, "fsync": 40}, rc=137), "VM exit 137"),
            (boot(2, "pcow-snap", {"randread": 900, "fsync": 40}, guest="FAIL"), "guest FAIL"),
            (boot(2, "pcow-snap", {"randread": 900, "fsync": 40}, rc=0, garble=True), "unreadable"),
            (boot(2, "pcow-snap", {"randread": 900, "fsync": 40}, rc=0, **{"p50_ns": 1}) [:1]
             + fio_block("randread", 900, rc=1) + fio_block("fsync", 40), "fio exit 1"),
        ]:
            lines = boot(1, "raw-dax", {"randread": 1000, "fsync": 50})
            lines += boot(1, "pcow-snap", {"randread": 900, "fsync": 40})
            lines += boot(2, "raw-dax", {"randread": 1000, "fsync": 50})
            lines += bad
            rc, out = run_report(lines)
            self.assertEqual(rc, 1, out)
            self.assertIn(expect, out)

    def test_breakdown_section_is_kept_across_regenerations(self):
        lines = boot(1, "raw-dax", {"randread": 1000, "fsync": 50})
        lines += boot(1, "pcow-snap", {"randread": 900, "fsync": 40})
        section = "## Where pcow's time goes (timed FLUSHes and faults)\n\nmeasured by hand: 42 us\n"
        old = "# old\n\n## Results\n\nold numbers\n\n" + section + "\n## Runs\n\nold runs\n"
        rc, out = run_report(lines, rounds=1, doc=old)
        self.assertEqual(rc, 0, out)
        doc = out.split("=== DOC ===\n", 1)[1]
        self.assertNotIn("old numbers", doc)
        self.assertEqual(doc.count("measured by hand: 42 us"), 1)
        self.assertLess(doc.index("measured by hand"), doc.index("## Runs"))
        # without the section in the old document there is none
        rc, out = run_report(lines, rounds=1, doc="# old\n\n## Runs\n")
        self.assertNotIn("timed FLUSHes", out.split("=== DOC ===\n", 1)[1])

    def test_earlier_full_run_is_kept_while_variants_are_left_out(self):
        lines = boot(1, "raw-dax", {"randread": 1000, "fsync": 50})
        lines += boot(1, "pcow-snap", {"randread": 900, "fsync": 40})
        earlier = "## Earlier run: all six variants (run of 13:31, commit `45884e3`)\n\n| qcow2-snap | 421 |\n"
        old = "# old\n\n## Results\n\nold numbers\n\n" + earlier + "\n## Which way emulation bends each ratio\n\nx\n\n## Runs\n"
        rc, out = run_report(lines, rounds=1, doc=old)
        self.assertEqual(rc, 0, out)
        doc = out.split("=== DOC ===\n", 1)[1]
        self.assertEqual(doc.count("| qcow2-snap | 421 |"), 1)
        self.assertLess(doc.index("## Against issue 20"), doc.index("## Earlier run: all six variants (run of 13:31"))
        self.assertLess(doc.index("## Earlier run"), doc.index("## Which way emulation"))
        # a run of every variant supersedes it
        six = ["pcow-snap", "pcow-ovl", "raw-dax", "qcow2-snap", "qcow2-bak", "raw-blk"]
        lines = []
        for v in six:
            lines += boot(1, v, {"randread": 1000, "fsync": 50})
        rc, out = run_report(lines, variants=six, rounds=1, doc=old)
        self.assertEqual(rc, 0, out)
        self.assertNotIn("## Earlier run", out.split("=== DOC ===\n", 1)[1])

    def test_l1_restart_lines_and_a_hung_boot(self):
        # guest-bench.sh after L1 froze: the frozen boot retried in a new
        # L1 (its GB-START lines twice, a GB-HOST line) counts once ...
        lines = ["GB-START i=0 round=1 variant=raw-dax at=1.0s"] + boot(1, "raw-dax", {"randread": 1000, "fsync": 50})
        lines += ["GB-DONE i=0", "GB-START i=1 round=1 variant=pcow-snap at=9.0s", "GB-ALIVE",
                  "GB-HOST l1-hung attempt=1 stalled_s=180 boot=1 next=1",
                  "GB-START i=1 round=1 variant=pcow-snap at=5.0s"]
        lines += boot(1, "pcow-snap", {"randread": 900, "fsync": 40}) + ["GB-DONE i=1"]
        rc, out = run_report(lines, rounds=1)
        self.assertEqual(rc, 0, out)
        self.assertEqual(row(out, "random read", "pcow-snap")[1], "900")
        # ... and one that froze twice is a failed boot
        lines = boot(1, "raw-dax", {"randread": 1000, "fsync": 50})
        lines += ["GB-BOOT round=1 variant=pcow-snap rc=-2 guest=HUNG wall=0"]
        rc, out = run_report(lines, rounds=1)
        self.assertEqual(rc, 1, out)
        self.assertIn("no good run of randread on pcow-snap", out)

    def test_unfinished_l1_run_fails(self):
        lines = boot(1, "raw-dax", {"randread": 1000, "fsync": 50})
        lines += boot(1, "pcow-snap", {"randread": 900, "fsync": 40})
        rc, out = run_report(lines, rounds=1, ended=False)
        self.assertEqual(rc, 1, out)
        self.assertIn("the L1 run did not finish", out)
        rc, out = run_report(lines, rounds=1, ended=True)
        self.assertEqual(rc, 0, out)

    def test_unreadable_log_is_an_error(self):
        p = subprocess.run(
            [sys.executable, REPORT, "--log", "/nonexistent/guest-bench.log", "--doc", "-", "--plot", "x",
             "--rounds", "1", "--jobs", "fsync", "--variants", "raw-dax", "--sizes", "fsync=4096",
             "--fs-mib", "64", "--mem", "512M", "--manifest", "/nonexistent", "--command", "t"],
            capture_output=True, text=True, timeout=60,
        )
        self.assertEqual(p.returncode, 2)
        self.assertIn("cannot read the log", p.stderr)


if __name__ == "__main__":
    unittest.main()
