#!/usr/bin/env bash
# The VM snapshot benchmark (issue 17), one command: builds the release
# `cloud-hypervisor` and vmm/examples/snapshot_bench.rs, runs it (every
# measurement beside its baseline, in this one run), prints its tables and
# writes them, with the commit, the date and the machine's load before and
# after, into docs/snapshots.md, section "Measured" (between the
# `bench-snapshot` markers; the rest of the doc is left as it is).
#
# Usage: scripts/bench-snapshot.sh [--no-docs]
#   --no-docs   print only
# Environment: SNAPBENCH_DIR (where the images and snapshots go, default
# /tmp; e.g. /dev/shm for tmpfs), SNAPBENCH_REPS (default 3). Needs
# /dev/kvm and about 4 GiB free in SNAPBENCH_DIR. Not part of
# scripts/test.sh: benchmarks are not tests.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

docs=1
case "${1:-}" in
    "") ;;
    --no-docs) docs=0 ;;
    *) echo "usage: $0 [--no-docs]" >&2; exit 2 ;;
esac

doc=docs/snapshots.md
begin='<!-- bench-snapshot: begin (written by scripts/bench-snapshot.sh) -->'
end='<!-- bench-snapshot: end -->'
if [ "$docs" -eq 1 ] && { ! grep -qxF "$begin" "$doc" || ! grep -qxF "$end" "$doc"; }; then
    echo "bench-snapshot.sh: $doc lacks the bench-snapshot markers" >&2
    exit 1
fi

cargo build --release -p vmm --bin cloud-hypervisor --example snapshot_bench

commit=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- . ':!docs' || commit="$commit (with uncommitted changes)"
out=target/snapshot-bench.md
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date -u '+%Y-%m-%d %H:%M UTC')
t0=$(date +%s)
SNAPBENCH_BIN=target/release/cloud-hypervisor \
    target/release/examples/snapshot_bench >"$out.body"
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
{
    echo "| | |"
    echo "|---|---|"
    echo "| command | \`scripts/bench-snapshot.sh\` |"
    echo "| code | commit \`$commit\` |"
    echo "| date | $start, $(( $(date +%s) - t0 )) s |"
    echo "| machine | \`nproc\` $(nproc), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), kernel $(uname -r) |"
    echo "| load (1, 5, 15 min) | before $load_before, after $load_after |"
    echo
    cat "$out.body"
} >"$out"
rm -f "$out.body"
cat "$out"

if [ "$docs" -eq 1 ]; then
    tmp=$(mktemp "$doc.XXXXXX")
    awk -v b="$begin" -v e="$end" -v f="$out" '
        $0 == b { print; while ((getline l < f) > 0) print l; skip = 1; next }
        $0 == e { skip = 0 }
        !skip { print }
    ' "$doc" >"$tmp"
    mv "$tmp" "$doc"
    echo "bench-snapshot.sh: wrote the results into $doc"
fi
