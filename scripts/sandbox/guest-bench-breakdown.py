#!/usr/bin/env python3
"""Where pcow's time goes in the guest benchmark: one guest fsync and one
first write, taken apart from a profiled run of scripts/sandbox/guest-bench.sh
with GB_PROFILE_LOG=1 (each profiled boot's whole output, the guest's serial
and the VMM's debug log in the order written, between GB-PROF-LOG-BEGIN and
GB-PROF-LOG-END, gzipped and base64-encoded).

The VMM's lines it reads:
- `pmem FLUSH barrier: ... held_us= scan_us= [copy_us= commit_us=]` (the
  device's debug line, one per FLUSH of a pcow device);
- `pmem probe flush: wake= flush0= pause0= paused= vcpu_paused= released=
  vcpu_resumed= commit0= commit1= barrier1= flush1= done= kicks=` (the
  current patch adds `serial= locked= decided= unheld= relocked= csync1=
  cheader= csync2=`: the barrier lock, the state lock and the write log
  read on both paths, unheld or held, and the commit's syncs) and
  `pmem probe faults: n= at= resolve_us= with_refill_us= polled=` (with
  `lock_us= map_us= wake_us=`, and now `mmap_us= mmaps= writes= ahead=`:
  the expansion windows): the instants (microseconds on one clock) and the
  fault monitor's service time that scripts/sandbox/guest-bench-timing.patch
  adds to the VMM. Lines of the older patch (no `decided=`) are read as
  before. Without the patch only the barrier lines are there, and the
  tables say so.
- `a vCPU ended: ... pauses: N ...` and `pmem ...: faults: ...` at exit.

Usage: guest-bench-breakdown.py LOG [--into DOC]
Prints the section (markdown); with --into, puts it into DOC in place of
its "## Where pcow's time goes (timed FLUSHes and faults)" section, or
before "## Runs" when it has none. Exit 1 when the log has no profiled
boot's output, 2 on bad arguments.
"""

import argparse
import base64
import gzip
import json
import re
import statistics
import sys

TITLE = "## Where pcow's time goes (timed FLUSHes and faults)"
LOG_BEGIN = re.compile(r"^GB-PROF-LOG-BEGIN variant=(\S+) rc=(-?\d+) guest=(\S+) wall=([0-9.]+)")
KV = re.compile(r"(\w+)=(-?[0-9.]+|true|false)")


KVM_KEYS = ["exits", "halt_exits", "halt_wakeup", "signal_exits", "io_exits", "mmio_exits", "irq_exits",
            "request_irq_exits", "irq_injections", "pf_taken", "pf_fixed", "pf_fast", "pf_spurious", "pf_guest",
            "pf_emulate", "remote_tlb_flush", "tlb_flush", "nested_run", "host_state_reload", "insn_emulation",
            "pages_4k", "pages_2m", "mmu_shadow_zapped", "mmu_pte_write"]
KVM_LINE = re.compile(r"^GB-PROF-KVM variant=(\S+)(.*)$")


def blocks(path, kvm=None):
    """(variant, boot status, decoded text) for each GB-PROF-LOG block;
    L1's KVM counters per variant (GB-PROF-KVM lines) into KVM."""
    out = []
    cur = None
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", "replace").replace("\r", "").rstrip("\n")
            m = KVM_LINE.match(line)
            if m and kvm is not None:
                kvm[m[1]] = {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", m[2])}
                continue
            m = LOG_BEGIN.match(line)
            if m:
                cur = (m[1], {"rc": int(m[2]), "guest": m[3], "wall": float(m[4])}, [])
                continue
            if line.startswith("GB-PROF-LOG-END") and cur is not None:
                try:
                    text = gzip.decompress(base64.b64decode("".join(cur[2]))).decode("utf-8", "replace")
                except (ValueError, OSError, EOFError) as e:
                    print(f"guest-bench-breakdown: {cur[0]}: the boot's log is unreadable: {e}", file=sys.stderr)
                    text = None
                if text is not None:
                    out.append((cur[0], cur[1], text))
                cur = None
                continue
            if cur is not None and re.fullmatch(r"[A-Za-z0-9+/=]+", line):
                cur[2].append(line)
    return out


def fio_of(lines):
    try:
        return json.loads(gzip.decompress(base64.b64decode("".join(lines))))
    except (ValueError, OSError, EOFError):
        return None


FAULT_KEYS = ("n", "resolve_us", "lock_us", "map_us", "mmap_us", "mmaps", "wake_us", "writes", "ahead")


def parse_boot(text):
    """Per job: the FLUSH probe lines, the barrier lines, the fault batches
    and fio's JSON; and the boot's exit counters."""
    jobs = {}
    job = None
    fio_block = None
    exit_lines = []
    snaps = {}
    for line in text.splitlines():
        if line.startswith("GB-KVM-SNAP GB-JOB-"):
            m = re.match(r"GB-KVM-SNAP GB-JOB-(BEGIN|END) job=(\S+) at=\S+ (.*)", line)
            if m:
                snaps[(m[2], m[1])] = {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", m[3])}
            continue
        if line.startswith("GB-JOB-BEGIN job="):
            job = line.split("=", 1)[1].strip()
            jobs[job] = {"flush": [], "barrier": [], "faults": [], "fio": None}
            continue
        if line.startswith("GB-JOB-END"):
            job = None
            continue
        if line.startswith("GB-FIO-BEGIN job="):
            fio_block = (line.split()[1].split("=", 1)[1], [])
            continue
        if line.startswith("GB-FIO-END") and fio_block is not None:
            name, b64 = fio_block
            if name in jobs:
                jobs[name]["fio"] = fio_of(b64)
            fio_block = None
            continue
        if fio_block is not None:
            if re.fullmatch(r"[A-Za-z0-9+/=]+", line):
                fio_block[1].append(line)
            continue
        if "a vCPU ended:" in line or re.search(r"pmem \S+: faults:", line):
            exit_lines.append(line[line.index("] ") + 2 :] if "] " in line else line)
        if job is None:
            continue
        if "pmem probe flush:" in line:
            jobs[job]["flush"].append({k: int(float(v)) for k, v in KV.findall(line.split("pmem probe flush:", 1)[1])})
        elif "pmem FLUSH barrier:" in line:
            jobs[job]["barrier"].append(dict(KV.findall(line.split("pmem FLUSH barrier:", 1)[1])))
        elif "pmem probe faults:" in line:
            f = dict(KV.findall(line.split("pmem probe faults:", 1)[1]))
            jobs[job]["faults"].append({k: int(f[k]) for k in FAULT_KEYS if k in f})
    for j, d in jobs.items():
        b, e = snaps.get((j, "BEGIN")), snaps.get((j, "END"))
        d["kvm"] = {k: e[k] - b.get(k, 0) for k in e} if b and e else None
    return jobs, exit_lines


def stats(xs):
    """mean, p50, p90 of a list (microseconds)."""
    if not xs:
        return None
    s = sorted(xs)
    return (statistics.fmean(s), s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.9))])


def fmt_us(st):
    if st is None:
        return "-"
    return f"{st[0]:.0f} / {st[1]:.0f} / {st[2]:.0f}"


def flush_steps(fl):
    """Each FLUSH's steps in microseconds (the probe's instants)."""
    steps = []
    for f in fl:
        s = {"total": f["done"] - f["wake"], "to_handler": f["flush0"] - f["wake"], "handler": f["flush1"] - f["flush0"],
             "answer": f["done"] - f["flush1"]}
        if f.get("decided", 0) >= f["flush0"]:
            steps.append(barrier_steps(s, f))
            continue
        if f.get("pause0", 0) >= f["flush0"]:
            s["before_hold"] = f["pause0"] - f["flush0"]
            s["pause"] = f["paused"] - f["pause0"]
            s["kicked"] = None
            s["held"] = f["released"] - f["paused"]
            if f.get("staged", 0) >= f["paused"]:
                s["h_prepare"] = f["prepared"] - f["paused"]
                s["h_quiet"] = f["quiet"] - f["prepared"]
                s["h_move"] = f["moved"] - f["quiet"]
                s["h_stage"] = f["staged"] - f["moved"]
                s["h_release"] = f["released"] - f["staged"]
            committed = f["commit0"] >= f["released"]
            s["commit"] = f["commit1"] - f["commit0"] if committed else 0
            s["after"] = f["barrier1"] - (f["commit1"] if committed else f["released"])
            s["to_return"] = f["flush1"] - f["barrier1"]
            s["vcpu_paused_in_hold"] = f["pause0"] <= f["vcpu_paused"] <= f["paused"]
        steps.append(s)
    # Kicks during each FLUSH: the counter's growth.
    prev = None
    for s, f in zip(steps, fl):
        if prev is not None:
            s["kicked"] = f["kicks"] - prev
        prev = f["kicks"]
    return steps


def barrier_steps(s, f):
    """A FLUSH's barrier steps from the current probe's instants (both
    paths: `unheld=1` staged its commit with the vCPU running, `unheld=0`
    held it). A step the FLUSH did not take is left out."""
    fl = f["flush0"]
    s["before_lock"] = f["serial"] - fl
    s["lock"] = f["locked"] - f["serial"]
    s["log_read"] = f["decided"] - f["locked"]
    staged = f["staged"] if f.get("staged", 0) >= f["decided"] else None
    if f.get("unheld") == 1:
        s["unheld"] = True
        s["total_unheld"] = s["total"]
        if staged is not None:
            s["u_stage"] = staged - f["decided"]
        end_of_hold = staged
    else:
        s["unheld"] = False
        s["total_held"] = s["total"]
        s["before_hold"] = f["pause0"] - f["decided"]
        s["pause"] = f["paused"] - f["pause0"]
        s["kicked"] = None
        s["held"] = f["released"] - f["paused"]
        if staged is not None and f.get("moved", 0) >= f["paused"]:
            s["h_prepare"] = f["prepared"] - f["paused"]
            s["h_quiet"] = f["quiet"] - f["prepared"]
            s["h_move"] = f["moved"] - f["quiet"]
            s["h_stage"] = staged - f["moved"]
            s["h_release"] = f["released"] - staged
        s["vcpu_paused_in_hold"] = f["pause0"] <= f["vcpu_paused"] <= f["paused"]
        end_of_hold = f["released"]
    c0 = f["commit0"]
    if end_of_hold is not None and c0 >= end_of_hold:
        s["commit"] = f["commit1"] - c0
        # The commit's own steps: a sync before the header (when there was
        # data or slots to sync), then the header and its sync (when the
        # metadata changed); a stamp older than the commit is a step it
        # did not take.
        sync1 = f["csync1"] if f.get("csync1", 0) >= c0 else None
        if sync1 is not None:
            s["c_sync1"] = sync1 - c0
        if f.get("cheader", 0) >= c0 and f.get("csync2", 0) >= c0:
            s["c_header"] = f["cheader"] - (sync1 if sync1 is not None else c0)
            s["c_sync2"] = f["csync2"] - f["cheader"]
            s["c_two_syncs"] = sync1 is not None
        else:
            s["c_two_syncs"] = False
        s["relock"] = f["relocked"] - f["commit1"]
        s["after"] = f["barrier1"] - f["relocked"]
    elif end_of_hold is not None:
        s["commit"] = 0
        s["after"] = f["barrier1"] - end_of_hold
    s["to_return"] = f["flush1"] - f["barrier1"]
    return s


def fio_numbers(fio, job):
    if not fio or not fio.get("jobs"):
        return {}
    j = fio["jobs"][0]
    w = j.get("read" if job == "randread" else "write", {})
    out = {"runtime_ms": w.get("runtime", 0), "ops": w.get("total_ios", 0), "iops": w.get("iops", 0.0),
           "write_clat_mean_us": w.get("clat_ns", {}).get("mean", 0) / 1000}
    if job == "fsync":
        lat = j.get("sync", {}).get("lat_ns", {})
        out["sync_mean_us"] = lat.get("mean", 0) / 1000
        out["syncs"] = j.get("sync", {}).get("total_ios", 0)
    return out


def kvm_table(kvm, parsed):
    """L1's KVM counters over each profiled boot, and per fio operation."""
    L = []
    vs = [v for v, _, _ in parsed if v in kvm]
    if not vs:
        return L
    ops = {}
    for v, _, (js, _) in parsed:
        ops[v] = sum((fio_numbers(d["fio"], j).get("ops", 0) or 0) for j, d in js.items())
    keys = sorted({k for v in vs for k, x in kvm[v].items() if x})
    L.append("L1's KVM counters (debugfs, global: one VM runs at a time) over each whole profiled boot "
             "(boot, fio's start, the jobs, the syncs, poweroff), and their difference per fio operation:")
    L.append("")
    L.append("| counter | " + " | ".join(vs) + (" | difference per op |" if len(vs) == 2 else " |"))
    L.append("| --- | " + " | ".join("---" for _ in vs) + (" | --- |" if len(vs) == 2 else " |"))
    for k in keys:
        cells = [str(kvm[v].get(k, 0)) for v in vs]
        extra = ""
        if len(vs) == 2 and ops.get(vs[0]):
            extra = f" {(kvm[vs[0]].get(k, 0) - kvm[vs[1]].get(k, 0)) / ops[vs[0]]:.1f} |"
        L.append(f"| {k} | " + " | ".join(cells) + " |" + extra)
    L.append("")
    return L


def section(parsed, log, kvm=None):
    L = []
    w = L.append
    w(TITLE)
    w("")
    w("<!-- Generated by scripts/sandbox/guest-bench-breakdown.py from a run's serial log. -->")
    w("")
    variants = [v for v, _, _ in parsed]
    probed = any(f for _, (jobs, _), in [(v, p) for v, _, p in parsed] for f in [j["flush"] for j in jobs.values()])
    w(f"From `{log.split('/')[-1]}`: the profiled boots of {', '.join(variants)} (one boot each, the VMM at `-vv`).")
    if not probed:
        w("This log has no probe lines (the VMM was built without "
          "`scripts/sandbox/guest-bench-timing.patch`): only the barrier's own times are below.")
    w("")
    # Per job, per variant: fio, FLUSHes, faults.
    jobs = sorted({j for _, (js, _) in [(v, p) for v, _, p in parsed] for j in js})
    for job in jobs:
        w(f"### {job}")
        w("")
        w("| variant | fio ops | fio runtime | completion latency, mean | fsync latency, mean | FLUSHes (per op) | faults (per op) | monitor's service per fault, mean |")
        w("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for v, _, (js, _) in parsed:
            if job not in js:
                continue
            d = js[job]
            fn = fio_numbers(d["fio"], job)
            ops = fn.get("ops", 0) or 0
            nfl = max(len(d["flush"]), len(d["barrier"]))
            nfa = sum(b["n"] for b in d["faults"])
            res = sum(b["resolve_us"] for b in d["faults"])
            # Without the probe a raw FLUSH leaves no line, and faults none.
            flushes = f"{nfl} ({nfl / ops if ops else 0:.2f})" if probed or d["barrier"] else "-"
            faults = f"{nfa} ({nfa / ops if ops else 0:.3f})" if probed else "-"
            w(f"| {v} | {ops} | {fn.get('runtime_ms', 0)} ms | {fn.get('write_clat_mean_us', 0):.0f} us "
              f"| {('%.0f us' % fn['sync_mean_us']) if 'sync_mean_us' in fn else '-'} "
              f"| {flushes} | {faults} | {('%.0f us' % (res / nfa)) if nfa else '-'} |")
        w("")
        kv = [(v, js[job]["kvm"], fio_numbers(js[job]["fio"], job).get("ops", 0) or 0)
              for v, _, (js, _) in parsed if job in js and js[job].get("kvm")]
        if kv:
            keys = [k for k in KVM_KEYS if any(x.get(k) for _, x, _ in kv)]
            w("L1's KVM counters during the job (read when the guest printed GB-JOB-BEGIN and GB-JOB-END, "
              "polled every 0.3 s: the serial output around the markers is in them too), per fio operation:")
            w("")
            w("| counter | " + " | ".join(v for v, _, _ in kv) + " |")
            w("| --- | " + " | ".join("---" for _ in kv) + " |")
            for k in keys:
                w(f"| {k} | " + " | ".join(f"{x.get(k, 0) / ops:.1f}" if ops else "-" for _, x, ops in kv) + " |")
            w("")
        rows = []
        for v, _, (js, _) in parsed:
            if job not in js or not js[job]["flush"]:
                continue
            st = flush_steps(js[job]["flush"])
            def col(k, st=st):
                return fmt_us(stats([s[k] for s in st if s.get(k) is not None]))

            rows.append((v, st, col))
        if rows:
            for v, st, _ in rows:
                nu = sum(1 for x in st if x.get("unheld") is True)
                nh = sum(1 for x in st if x.get("unheld") is False)
                if nu or nh:
                    w(f"{v}: {nu} of {len(st)} FLUSHes ran unheld (the vCPU not held), {nh} held.")
                    w("")
            w("Per FLUSH, microseconds, mean / p50 / p90 (the probe's instants; a step a raw FLUSH does not have is `-`):")
            w("")
            w("| step | " + " | ".join(v for v, _, _ in rows) + " |")
            w("| --- | " + " | ".join("---" for _ in rows) + " |")
            for key, text in [
                ("total", "the queue thread woken -> the FLUSH answered (used ring + interrupt)"),
                ("total_unheld", "  the same, unheld FLUSHes only"),
                ("total_held", "  the same, held FLUSHes only"),
                ("to_handler", "woken -> the FLUSH handler (device lock, the chain parsed)"),
                ("handler", "the handler: the barrier (pcow) or fdatasync (raw)"),
                ("before_lock", "  handler -> the barrier lock taken"),
                ("lock", "  the state lock taken, the pool's refills applied"),
                ("log_read", "  the write log read under the state lock (hold or not decided)"),
                ("u_stage", "  unheld: the commit staged under the state lock, the vCPU running"),
                ("before_hold", "  held: -> the hold asked"),
                ("pause", "  the hold: vCPU out of KVM_RUN and parked (kick, wait)"),
                ("held", "  vCPU held (the device's held_us):"),
                ("h_prepare", "    the state lock, the pool's refills applied"),
                ("h_quiet", "    the pool worker quiet (its piece in flight)"),
                ("h_move", "    the written pages found and moved (the device's scan + copy)"),
                ("h_stage", "    the commit staged (metadata written, no sync)"),
                ("h_release", "    the vCPU released"),
                ("commit", "  commit: sync, header write, sync (0: nothing to commit)"),
                ("c_sync1", "    the first sync (data and metadata slots)"),
                ("c_header", "    the header written (only when the metadata changed)"),
                ("c_sync2", "    the second sync (the header)"),
                ("relock", "  the state lock again (waiting for the monitor or the pool)"),
                ("after", "  after: finish (publish), pool refill request"),
                ("to_return", "  the barrier returned -> the handler returned (its log line)"),
                ("answer", "the handler returned -> the FLUSH answered"),
            ]:
                w(f"| {text} | " + " | ".join(col(key) for _, _, col in rows) + " |")
            for v, st, _ in rows:
                c2 = [s["c_two_syncs"] for s in st if "c_two_syncs" in s]
                if c2:
                    w("")
                    w(f"{v}: {sum(c2)} of {len(c2)} commits wrote a header (two syncs), "
                      f"{len(c2) - sum(c2)} synced once (no metadata change); "
                      f"{sum(1 for s in st if s.get('commit') == 0)} FLUSHes had nothing to commit.")
                k = [s["kicked"] for s in st if s.get("kicked") is not None]
                inhold = [s["vcpu_paused_in_hold"] for s in st if "vcpu_paused_in_hold" in s]
                if inhold:
                    w("")
                    w(f"{v}: the vCPU was kicked out of KVM_RUN in {sum(1 for x in k if x)} of {len(k)} FLUSHes "
                      f"and parked during the hold in {sum(inhold)} of {len(inhold)}.")
            w("")
        for v, _, (js, _) in parsed:
            fb = js.get(job, {}).get("faults", [])
            nf = sum(b["n"] for b in fb)
            if nf and any("map_us" in b for b in fb):
                tot = lambda k: sum(b.get(k, 0) for b in fb)
                windows = any("ahead" in b for b in fb)
                w(f"{v}: the fault monitor served {nf} faults in {len(fb)} batches; per fault, mean: "
                  f"{tot('resolve_us') / nf:.0f} us from reading the fault to its wake done, of which the state lock "
                  f"{tot('lock_us') / nf:.0f} us, "
                  + (f"`map_fresh` (the window's holes chosen, clusters taken from the pool and mapped) "
                     f"{tot('map_us') / nf:.0f} us (of it the mmaps MAP_FIXED {tot('mmap_us') / nf:.0f} us)"
                     if windows else f"taking and mapping the cluster (`map_fresh`: mmap MAP_FIXED) {tot('map_us') / nf:.0f} us")
                  + f", `UFFDIO_WAKE` {tot('wake_us') / nf:.0f} us.")
                if windows:
                    nw = tot("writes")
                    w(f"Of them {nw} write faults into holes, which mapped {tot('ahead')} clusters ahead "
                      f"(expansion windows) in {tot('mmaps')} mmaps: "
                      f"{(nw + tot('ahead')) / nw if nw else 0:.1f} clusters per write fault.")
                w("")
        bars = [(v, js[job]["barrier"]) for v, _, (js, _) in parsed if job in js and js[job]["barrier"]]
        for v, b in bars:
            def tot(k):
                return sum(float(x.get(k, 0)) for x in b)
            w(f"{v}: the device's own line for these {len(b)} FLUSHes: held {tot('held_us') / 1000:.1f} ms in all "
              f"(scan {tot('scan_us') / 1000:.1f} ms" + (f", copy {tot('copy_us') / 1000:.1f} ms" if any('copy_us' in x for x in b) else "")
              + ")" + (f", commit {tot('commit_us') / 1000:.1f} ms" if any('commit_us' in x for x in b) else "")
              + f"; pages found {tot('found'):.0f}, copied {tot('copied'):.0f}"
              + (f"; {sum(1 for x in b if x.get('unheld') == 'true')} of them without holding the vCPU (`unheld=true`)"
                 if any('unheld' in x for x in b) else "")
              + ".")
        if bars:
            w("")
    if kvm:
        L.extend(kvm_table(kvm, parsed))
    for v, st, (js, ex) in parsed:
        if ex:
            w(f"- {v} at exit (whole boot: {st['wall']} s): " + "; ".join(f"`{e}`" for e in ex))
    w("")
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--into")
    a = ap.parse_args()
    kvm = {}
    try:
        bs = blocks(a.log, kvm)
    except OSError as e:
        print(f"guest-bench-breakdown: {a.log}: {e}", file=sys.stderr)
        return 2
    if not bs:
        print(f"guest-bench-breakdown: {a.log}: no GB-PROF-LOG block (run guest-bench.sh with GB_PROFILE_LOG=1)", file=sys.stderr)
        return 1
    parsed = [(v, st, parse_boot(text)) for v, st, text in bs]
    text = section(parsed, a.log, kvm)
    if not a.into:
        print(text)
        return 0
    try:
        doc = open(a.into).read()
    except OSError as e:
        print(f"guest-bench-breakdown: {a.into}: {e}", file=sys.stderr)
        return 2
    if TITLE in doc:
        i = doc.index(TITLE)
        j = doc.find("\n## ", i + len(TITLE))
        doc = doc[:i] + text + ("\n" + doc[j + 1 :] if j >= 0 else "")
    elif "\n## Runs" in doc:
        i = doc.index("\n## Runs")
        doc = doc[: i + 1] + text + "\n" + doc[i + 1 :]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    with open(a.into, "w") as f:
        f.write(doc)
    print(f"guest-bench-breakdown: wrote its section into {a.into}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
