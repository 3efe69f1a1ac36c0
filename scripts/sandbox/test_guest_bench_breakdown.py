#!/usr/bin/env python3
"""Tests of guest-bench-breakdown.py on serial logs made here (no sandbox):
the steps of a FLUSH from the probe's instants, faults per operation, L1's
KVM counters per operation, the document's section replaced in place, and
a log without any profiled boot refused.

Run: python3 scripts/sandbox/test_guest_bench_breakdown.py
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
TOOL = os.path.join(HERE, "guest-bench-breakdown.py")
TITLE = "## Where pcow's time goes (timed FLUSHes and faults)"


def b64(data):
    text = base64.b64encode(gzip.compress(data)).decode()
    return [text[i : i + 76] for i in range(0, len(text), 76)]


def fio(job, ops, clat_us, sync_us):
    j = {"write": {"total_ios": ops, "iops": 100.0, "runtime": 2000, "clat_ns": {"mean": clat_us * 1000}},
         "sync": {"total_ios": ops, "lat_ns": {"mean": sync_us * 1000}}}
    return [f"GB-FIO-BEGIN job={job} dev=pmem"] + b64(json.dumps({"jobs": [j]}).encode()) + ["GB-FIO-END rc=0"]


def flush_line(base, pcow):
    """A probe line: woken at BASE, answered 1000 us later; for pcow the
    hold takes 300 us, the vCPU is held 400 us, the commit 50 us."""
    if pcow:
        t = dict(wake=base, flush0=base + 100, pause0=base + 110, paused=base + 410, vcpu_paused=base + 200,
                 prepared=base + 420, quiet=base + 430, moved=base + 530, staged=base + 560, released=base + 810,
                 vcpu_resumed=base + 900, commit0=base + 820, commit1=base + 870, barrier1=base + 880,
                 flush1=base + 900, done=base + 1000, kicks=base // 1000)
    else:
        t = dict(wake=base, flush0=base + 100, pause0=0, paused=0, vcpu_paused=0, prepared=0, quiet=0, moved=0,
                 staged=0, released=0, vcpu_resumed=0, commit0=0, commit1=0, barrier1=0, flush1=base + 150,
                 done=base + 200, kicks=0)
    return "[2026-11-26T10:00:00.000Z DEBUG vmm::pmem_threads] pmem probe flush: " + " ".join(
        f"{k}={v}" for k, v in t.items())


def flush_line_v2(base, unheld, header):
    """A line of the current probe: woken at BASE, handler at +100, the
    barrier lock at +110, the state lock at +130, the log read at +150;
    unheld: staged at +250, the commit from +300; held: the hold asked at
    +160, held at +400, pages moved at +430, staged at +460, released at
    +500, the commit from +510. The commit: its first sync 40 us, with
    HEADER the header 10 us and its sync 30 us; then the state lock again
    20 us, publish 10 us; answered at +1000."""
    t = dict(wake=base, flush0=base + 100, serial=base + 110, locked=base + 130, decided=base + 150,
             unheld=1 if unheld else 0, kicks=0, vcpu_resumed=0)
    if unheld:
        t.update(pause0=0, paused=0, vcpu_paused=0, prepared=0, quiet=0, moved=0, released=0, staged=base + 250)
        c0 = base + 300
    else:
        t.update(pause0=base + 160, paused=base + 400, vcpu_paused=base + 300, prepared=base + 410,
                 quiet=base + 420, moved=base + 430, staged=base + 460, released=base + 500)
        c0 = base + 510
    t.update(commit0=c0, csync1=c0 + 40, cheader=(c0 + 50) if header else 0, csync2=(c0 + 80) if header else 0)
    t["commit1"] = c0 + (80 if header else 40)
    t["relocked"] = t["commit1"] + 20
    t["barrier1"] = t["relocked"] + 10
    t["flush1"] = t["barrier1"] + 5
    t["done"] = base + 1000
    return "[2026-11-26T10:00:00.000Z DEBUG vmm::pmem_threads] pmem probe flush: " + " ".join(
        f"{k}={v}" for k, v in t.items())


def boot_text(pcow):
    lines = ["GB-MOUNT /dev/pmem0 /mnt/pmem ext4 rw,dax=always 0 0", "GB-JOB-BEGIN job=fsync",
             "GB-KVM-SNAP GB-JOB-BEGIN job=fsync at=1.0 exits=100 pf_fixed=50 signal_exits=0"]
    for i in range(4):  # two fsyncs, two FLUSHes each
        lines.append(flush_line(10000 * (i + 1), pcow))
        if pcow:
            lines.append("[... DEBUG virtio_pmem_pcow::region] pmem FLUSH barrier: found=1 copied=1 tracked=false "
                         "logged=true held_us=400 scan_us=80 unheld=false")
    if pcow:
        for _ in range(2):
            lines.append("[... DEBUG virtio_pmem_pcow::fault] pmem probe faults: n=1 at=5 resolve_us=3000 "
                         "with_refill_us=3100 polled=false lock_us=10 map_us=1000 wake_us=1900")
    end = 140 if pcow else 120
    lines += ["GB-JOB-END job=fsync",
              f"GB-KVM-SNAP GB-JOB-END job=fsync at=9.0 exits={end} pf_fixed=64 signal_exits={4 if pcow else 0}"]
    lines += fio("fsync", 2, 5000 if pcow else 4000, 30000 if pcow else 10000)
    lines.append("[... INFO vmm::control] a vCPU ended: Halted (VcpuStats { pauses: 4 })")
    return "\n".join(lines) + "\n"


def serial_log(variants):
    out = ["GB-L1 something", "GB-ALIVE"]
    for v in variants:
        out.append(f"GB-PROF-LOG-BEGIN variant={v} rc=0 guest=ok wall=30.5")
        out += b64(boot_text(v != "raw-dax").encode())
        out.append("GB-PROF-LOG-END")
    return "\r\n".join(out) + "\r\n"


def run(log_text, into=None):
    with tempfile.TemporaryDirectory() as td:
        log = os.path.join(td, "serial.log")
        with open(log, "w") as f:
            f.write(log_text)
        args = [sys.executable, TOOL, log]
        doc = os.path.join(td, "doc.md")
        if into is not None:
            with open(doc, "w") as f:
                f.write(into)
            args += ["--into", doc]
        p = subprocess.run(args, capture_output=True, text=True, timeout=60)
        out = p.stdout + p.stderr
        if into is not None:
            with open(doc) as f:
                out += "\n=== DOC ===\n" + f.read()
        return p.returncode, out


def row(out, start):
    for line in out.splitlines():
        if line.startswith(start):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no row starting {start!r} in:\n{out}")


class Breakdown(unittest.TestCase):
    def test_steps_faults_and_counters(self):
        rc, out = run(serial_log(["pcow-snap", "raw-dax"]))
        self.assertEqual(rc, 0, out)
        # fio: 2 ops; 4 FLUSHes (2 per op); 2 faults (1 per op), 3000 us each
        r = row(out, "| pcow-snap | 2 |")
        self.assertEqual(r[3], "5000 us")
        self.assertEqual(r[4], "30000 us")
        self.assertEqual(r[5], "4 (2.00)")
        self.assertEqual(r[6], "2 (1.000)")
        self.assertEqual(r[7], "3000 us")
        self.assertEqual(row(out, "| raw-dax | 2 |")[6], "0 (0.000)")
        # the steps, mean / p50 / p90, pcow then raw
        self.assertEqual(row(out, "| the queue thread woken")[1:], ["1000 / 1000 / 1000", "200 / 200 / 200"])
        self.assertEqual(row(out, "|   the hold: vCPU")[1:], ["300 / 300 / 300", "-"])
        self.assertEqual(row(out, "|   vCPU held")[1:], ["400 / 400 / 400", "-"])
        self.assertEqual(row(out, "|     the written pages found")[1], "100 / 100 / 100")
        self.assertEqual(row(out, "|     the vCPU released")[1], "250 / 250 / 250")
        self.assertEqual(row(out, "|   commit:")[1], "50 / 50 / 50")
        self.assertEqual(row(out, "| the handler: the barrier")[1:], ["800 / 800 / 800", "50 / 50 / 50"])
        # kicked in 3 of 3 (the first FLUSH has no previous count), parked in 4 of 4
        self.assertIn("kicked out of KVM_RUN in 3 of 3 FLUSHes and parked during the hold in 4 of 4", out)
        self.assertIn("of which the state lock 10 us, taking and mapping the cluster (`map_fresh`: mmap MAP_FIXED) "
                      "1000 us, `UFFDIO_WAKE` 1900 us", out)
        self.assertIn("held 1.6 ms in all (scan 0.3 ms); pages found 4, copied 4; 0 of them without holding", out)
        # KVM counters per op: exits (140-100)/2 and (120-100)/2
        self.assertEqual(row(out, "| exits |")[1:], ["20.0", "10.0"])
        self.assertEqual(row(out, "| signal_exits |")[1:], ["2.0", "0.0"])
        self.assertEqual(row(out, "| pf_fixed |")[1:], ["7.0", "7.0"])

    def test_current_probe_unheld_and_held_flushes_and_windows(self):
        lines = ["GB-JOB-BEGIN job=fsync"]
        # three unheld FLUSHes (two with a header), one held (with a header)
        lines += [flush_line_v2(10000, True, True), flush_line_v2(20000, True, False),
                  flush_line_v2(30000, True, True), flush_line_v2(40000, False, True)]
        lines += ["[... DEBUG virtio_pmem_pcow::fault] pmem probe faults: n=1 at=5 resolve_us=3000 with_refill_us=3100 "
                  "polled=false lock_us=10 map_us=2000 mmap_us=1500 mmaps=1 wake_us=900 writes=1 ahead=31",
                  "[... DEBUG virtio_pmem_pcow::fault] pmem probe faults: n=1 at=9 resolve_us=1000 with_refill_us=1000 "
                  "polled=false lock_us=0 map_us=600 mmap_us=500 mmaps=1 wake_us=300 writes=1 ahead=0"]
        lines += ["GB-JOB-END job=fsync"] + fio("fsync", 2, 5000, 30000)
        text = "\n".join(lines) + "\n"
        log = "\r\n".join(["GB-PROF-LOG-BEGIN variant=pcow-snap rc=0 guest=ok wall=30.5"] + b64(text.encode())
                           + ["GB-PROF-LOG-END"]) + "\r\n"
        rc, out = run(log)
        self.assertEqual(rc, 0, out)
        self.assertIn("pcow-snap: 3 of 4 FLUSHes ran unheld (the vCPU not held), 1 held.\n\nPer FLUSH", out)
        # the table's rows follow its header with nothing between them
        self.assertIn("| --- | --- |\n| the queue thread woken", out)
        self.assertEqual(row(out, "|   the same, unheld FLUSHes only")[1], "1000 / 1000 / 1000")
        self.assertEqual(row(out, "|   handler -> the barrier lock taken")[1], "10 / 10 / 10")
        self.assertEqual(row(out, "|   the state lock taken")[1], "20 / 20 / 20")
        self.assertEqual(row(out, "|   the write log read")[1], "20 / 20 / 20")
        self.assertEqual(row(out, "|   unheld: the commit staged")[1], "100 / 100 / 100")
        self.assertEqual(row(out, "|   held: -> the hold asked")[1], "10 / 10 / 10")
        self.assertEqual(row(out, "|   the hold: vCPU")[1], "240 / 240 / 240")
        self.assertEqual(row(out, "|     the written pages found")[1], "10 / 10 / 10")
        self.assertEqual(row(out, "|     the first sync")[1], "40 / 40 / 40")
        self.assertEqual(row(out, "|     the header written")[1], "10 / 10 / 10")
        self.assertEqual(row(out, "|     the second sync")[1], "30 / 30 / 30")
        # commits: 80, 40, 80, 80 us
        self.assertEqual(row(out, "|   commit:")[1], "70 / 80 / 80")
        self.assertEqual(row(out, "|   the state lock again")[1], "20 / 20 / 20")
        self.assertEqual(row(out, "|   after: finish")[1], "10 / 10 / 10")
        self.assertIn("3 of 4 commits wrote a header (two syncs), 1 synced once", out)
        self.assertIn("per fault, mean: 2000 us from reading the fault to its wake done, of which the state lock 5 us, "
                      "`map_fresh` (the window's holes chosen, clusters taken from the pool and mapped) 1300 us "
                      "(of it the mmaps MAP_FIXED 1000 us), `UFFDIO_WAKE` 600 us.", out)
        self.assertIn("Of them 2 write faults into holes, which mapped 31 clusters ahead (expansion windows) in 2 mmaps: "
                      "16.5 clusters per write fault.", out)

    def test_into_replaces_the_section_in_place(self):
        doc = "# d\n\n## Results\n\nr\n\n" + TITLE + "\n\nold breakdown\n\n## Runs\n\nruns\n"
        rc, out = run(serial_log(["pcow-snap", "raw-dax"]), into=doc)
        self.assertEqual(rc, 0, out)
        d = out.split("=== DOC ===\n", 1)[1]
        self.assertNotIn("old breakdown", d)
        self.assertEqual(d.count(TITLE), 1)
        self.assertLess(d.index(TITLE), d.index("## Runs"))
        self.assertIn("## Results\n\nr\n", d)
        # a document without the section gets it before "## Runs"
        rc, out = run(serial_log(["pcow-snap"]), into="# d\n\n## Runs\n\nruns\n")
        d = out.split("=== DOC ===\n", 1)[1]
        self.assertLess(d.index(TITLE), d.index("## Runs"))

    def test_a_log_without_profiled_boots_is_refused(self):
        rc, out = run("GB-L1 done: 0 failed run(s)\r\n")
        self.assertEqual(rc, 1, out)
        self.assertIn("no GB-PROF-LOG block", out)
        rc, out = run(serial_log(["pcow-snap"]).replace("GB-PROF-LOG-END", "GB-PROF-LOG-END\r\nGB-PROF-LOG-BEGIN variant=x rc=0 guest=ok wall=1\r\n!!!\r\nGB-PROF-LOG-END"))
        self.assertEqual(rc, 0, out)  # the good block is read, the broken one skipped


if __name__ == "__main__":
    unittest.main()
