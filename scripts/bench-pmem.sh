#!/usr/bin/env bash
# Benchmarks of the virtio-pmem-pcow region, each measured side by side with
# its baseline in this one run (the machines are shared and noisy: read the
# ratios). Results belong in docs/pmem-benchmarks.md.
#
# On tmpfs (/dev/shm, standing in for persistent memory) and on the disk (a
# directory under /var/tmp), with 64 KiB and 2 MiB clusters
# (devices/virtio-pmem-pcow/benches/pmem.rs):
#   1. expansion: first 1-byte write into a hole vs first touch of a raw
#      sparse file mapping (MAP_SHARED) and a bare userfaultfd handler
#      (pcow without expansion windows); 1c. the same with the default
#      expansion window beside it;
#   2. steady state after mapping: 1 MiB sequential copies and 4 KiB random
#      writes, pcow / raw, and the region's VMA count;
#   3. copy-on-write: first write into a snapshotted page vs a write to an
#      already private page, and the pause of the live snapshot;
#   4. the barrier with 0, 1, 100, 10^3, 10^5 pending private pages vs a
#      bare fdatasync; 4b. barriers after the guest read every page of an
#      image of holes, with and without the zero budget;
#   5. the barrier on a large sparse base (64 GiB) with 100 pages written,
#      beside its I/O floor (the same page writes and syncs without pcow);
#   6. qemu-img bench on qcow2 (allocating, overwrite, overlay) and raw.
# Then a plot of the results (gnuplot).
#
# Usage: scripts/bench-pmem.sh [--docs]
#   --docs   also copy the plot to docs/pmem-benchmarks.png
# Environment: PMEM_BENCH_OUT (result files, default target/pmem-bench),
# PMEM_BENCH_DISK_DIR (default /var/tmp), PMEM_BENCH_TMPFS_DIR (default
# /dev/shm), and the bench's own PMEM_BENCH_* knobs (see benches/pmem.rs):
# PMEM_BENCH_REGION_MIB (1024), PMEM_BENCH_LARGE_GIB (64),
# PMEM_BENCH_LARGE_READ_GIB (4), PMEM_BENCH_CLUSTERS (KiB, "64,2048"),
# PMEM_BENCH_SMALL (0 skips sections 1-4b), PMEM_BENCH_EXPANSION_ONLY (1 runs
# sections 1, 1b and 1c only, and draws no plot), PMEM_BENCH_WINDOW (0 leaves
# out the variant with expansion windows of 1c).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

update_docs=0
case "${1:-}" in
    "") ;;
    --docs) update_docs=1 ;;
    *) echo "usage: $0 [--docs]" >&2; exit 2 ;;
esac

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'bench-pmem.sh: error: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

apt_updated=0
apt_install() {
    if [ "$apt_updated" = 0 ]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
        apt_updated=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

if [ "$update_docs" = 1 ] && [ "${PMEM_BENCH_EXPANSION_ONLY:-0}" != 0 ]; then
    die "--docs needs the plot, which PMEM_BENCH_EXPANSION_ONLY does not draw"
fi

command -v cargo >/dev/null 2>&1 || die "cargo not found; install the Rust toolchain (https://rustup.rs)"
if ! command -v qemu-img >/dev/null 2>&1; then
    step "qemu-img missing: installing qemu-utils"
    apt_install qemu-utils
fi
if ! command -v gnuplot >/dev/null 2>&1; then
    step "gnuplot missing: installing gnuplot-nox"
    apt_install gnuplot-nox
fi

# userfaultfd for an unprivileged user needs the sysctl (root has it).
if [ "$(id -u)" -ne 0 ] && [ "$(cat /proc/sys/vm/unprivileged_userfaultfd 2>/dev/null || echo 0)" = 0 ] \
    && ! [ -w /dev/userfaultfd ]; then
    echo "note: userfaultfd may be refused: set vm.unprivileged_userfaultfd=1 or run as root"
fi

target_dir=$(cargo metadata --format-version 1 --no-deps \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
out=${PMEM_BENCH_OUT:-$target_dir/pmem-bench}
mkdir -p "$out"
out=$(cd "$out" && pwd)
tmpfs_dir=${PMEM_BENCH_TMPFS_DIR:-/dev/shm}
disk_dir=${PMEM_BENCH_DISK_DIR:-/var/tmp}

step "machine"
{
    echo "date:     $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "commit:   $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "nproc:    $(nproc)"
    echo "cpu:      $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
    echo "memory:   $(free -g | awk '/^Mem:/ { print $2 " GiB total, " $7 " GiB available" }')"
    echo "kernel:   $(uname -r)"
    echo "tmpfs:    $tmpfs_dir ($(df -h --output=fstype,avail "$tmpfs_dir" | tail -n1 | xargs)), THP shmem_enabled: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null || echo '?')"
    echo "disk:     $disk_dir ($(df -h --output=source,fstype,avail "$disk_dir" | tail -n1 | xargs))"
    echo "max_map_count: $(cat /proc/sys/vm/max_map_count)"
    echo "qemu-img: $(qemu-img --version | head -n1)"
    echo "rustc:    $(rustc --version)"
    echo "load before: $(uptime | sed 's/.*load average: //')"
} | tee "$out/machine.txt"

step "building the benchmark (release)"
cargo build --release -p virtio-pmem-pcow --bench pmem

step "running (a few minutes)"
start=$(date +%s)
PMEM_BENCH_OUT="$out" PMEM_BENCH_DIRS="tmpfs=$tmpfs_dir,disk=$disk_dir" \
    cargo bench -q -p virtio-pmem-pcow --bench pmem
end=$(date +%s)
{
    echo "load after:  $(uptime | sed 's/.*load average: //')"
    echo "run time:    $((end - start)) s"
} | tee -a "$out/machine.txt"

step "plot"
if [ "${PMEM_BENCH_EXPANSION_ONLY:-0}" != 0 ]; then
    # The plot's barrier and steady-state panels have no data then, and
    # gnuplot stops on an empty data file.
    echo "no plot: PMEM_BENCH_EXPANSION_ONLY ran sections 1, 1b and 1c only"
else
    gnuplot -e "dir='$out'; out='$out/pmem-benchmarks.png'" "$root/scripts/pmem-bench-plot.gp"
    echo "plot:   $out/pmem-benchmarks.png"
fi
echo "tables: $out/tables.md"
echo "raw:    $out/results.tsv"
if [ "$update_docs" = 1 ]; then
    cp "$out/pmem-benchmarks.png" "$root/docs/pmem-benchmarks.png"
    echo "copied the plot to docs/pmem-benchmarks.png"
fi

step "done (reproduce: $root/scripts/bench-pmem.sh)"
