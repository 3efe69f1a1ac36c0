#!/usr/bin/env bash
# Faults and FLUSHes under contention, before and after the device-core
# rebuild (issue 18), in one run: devices/virtio-pmem-pcow/benches/
# contention.rs is built against the code at BEFORE (a commit, default
# b5bb414: the last one with one lock across the barrier's syncs) and
# against the working tree, and the two run in turns, ROUNDS times:
#   before = BEFORE's code, its devices served the old way (one thread for
#            every device's faults and every FLUSH, as the VMM's control
#            loop did);
#   after  = this tree, a monitor thread and a FLUSH thread per device.
# Images live in BENCH_DIR (default /var/tmp: the disk). Prints each
# measurement's p50 and p99 (microseconds), before and after, and the
# ratio after/before. Results belong in docs/pmem-benchmarks.md.
#
# Usage: scripts/bench-threads.sh   (env: BEFORE, ROUNDS=3, SECS=3, BENCH_DIR)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
before=${BEFORE:-b5bb414}
rounds=${ROUNDS:-3}
secs=${SECS:-3}
dir=${BENCH_DIR:-/var/tmp}
out=$root/target/bench-threads
mkdir -p "$out"

bench_bin() { # the newest contention bench binary under $1/target
    ls -t "$1"/target/release/deps/contention-* | grep -v '\.d$' | head -1
}

echo "==> building the bench at $before (worktree $out/before)"
if [ ! -d "$out/before" ]; then
    git worktree add -f --detach "$out/before" "$before" >/dev/null
fi
git -C "$out/before" checkout -q --detach "$before"
cp devices/virtio-pmem-pcow/benches/contention.rs "$out/before/devices/virtio-pmem-pcow/benches/"
if ! grep -q 'name = "contention"' "$out/before/devices/virtio-pmem-pcow/Cargo.toml"; then
    printf '\n[[bench]]\nname = "contention"\nharness = false\n' \
        >>"$out/before/devices/virtio-pmem-pcow/Cargo.toml"
fi
(cd "$out/before" && CARGO_TARGET_DIR="$out/before/target" \
    cargo build --release -q -p virtio-pmem-pcow --bench contention)
echo "==> building the bench at the working tree"
cargo build --release -q -p virtio-pmem-pcow --bench contention
old=$(bench_bin "$out/before")
new=$(bench_bin "$root")

: >"$out/raw.txt"
for r in $(seq "$rounds"); do
    echo "==> round $r/$rounds"
    CONTENTION_DIR=$dir CONTENTION_SECS=$secs CONTENTION_MODES=shared "$old" \
        | grep -v '^#' | sed 's/^/before /' | tee -a "$out/raw.txt"
    CONTENTION_DIR=$dir CONTENTION_SECS=$secs CONTENTION_MODES=per-device "$new" \
        | grep -v '^#' | sed 's/^/after /' | tee -a "$out/raw.txt"
done

echo
echo "==> medians over $rounds rounds (us): before = $before, shared thread; after = this tree, per-device threads"
python3 - "$out/raw.txt" <<'PY'
import sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) != 8:
        continue
    which, cell, mode, what, p50, p99 = f[0], f[1], f[2], f[3], float(f[4]), float(f[5])
    rows.setdefault((cell, what), {}).setdefault(which, []).append((p50, p99))
print(f"{'cell':7} {'measurement':30} {'p50 before':>11} {'p50 after':>10} {'ratio':>6} {'p99 before':>11} {'p99 after':>10} {'ratio':>6}")
for (cell, what), d in rows.items():
    if 'before' not in d or 'after' not in d:
        continue
    b50 = st.median(x[0] for x in d['before']); a50 = st.median(x[0] for x in d['after'])
    b99 = st.median(x[1] for x in d['before']); a99 = st.median(x[1] for x in d['after'])
    print(f"{cell:7} {what:30} {b50:11.1f} {a50:10.1f} {a50/b50:6.2f} {b99:11.1f} {a99:10.1f} {a99/b99:6.2f}")
PY
