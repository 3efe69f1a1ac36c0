#!/usr/bin/env bash
# Benchmarks, each measured side by side with its baseline in this one run
# (the machines are shared and noisy: read the ratios, not the absolute
# numbers). Results belong in docs/benchmarks.md.
#
#   1. library (criterion, pcow/benches/open_scan.rs): open + scan of images
#      with 10^3, 10^5, 10^6 allocated 4 KiB clusters vs reading the file's
#      bytes; cluster allocation through write_at vs pwrite into a raw sparse
#      file; the barrier after the allocations vs fdatasync.
#   2. convert: `pcow-img convert -O pcow` vs `qemu-img convert -O qcow2` of
#      the same 1 GiB raw input (half data, half holes), alternating, the
#      median of ROUNDS rounds each.
#
# Usage: scripts/bench.sh [--convert-only | --library-only]
# Environment: ROUNDS (default 5), PCOW_BENCH_DIR (default /dev/shm if it has
# 4 GiB free, otherwise the temporary directory).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

run_library=1
run_convert=1
case "${1:-}" in
    "") ;;
    --convert-only) run_library=0 ;;
    --library-only) run_convert=0 ;;
    *) echo "usage: $0 [--convert-only | --library-only]" >&2; exit 2 ;;
esac
rounds=${ROUNDS:-5}

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'bench.sh: error: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

command -v cargo >/dev/null 2>&1 || die "cargo not found; install the Rust toolchain (https://rustup.rs)"
if ! command -v qemu-img >/dev/null 2>&1; then
    step "qemu-img missing: installing qemu-utils"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y qemu-utils
fi

step "machine"
echo "date:     $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "commit:   $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "nproc:    $(nproc)"
echo "cpu:      $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
free -g | sed 's/^/          /'
echo "kernel:   $(uname -r)"
echo "qemu-img: $(qemu-img --version | head -n1)"
echo "rustc:    $(rustc --version)"

if [ "$run_library" = 1 ]; then
    step "library: cargo bench -p pcow --bench open_scan"
    cargo bench -p pcow --bench open_scan
fi

if [ "$run_convert" = 1 ]; then
    step "building pcow-img (release)"
    cargo build --release -p pcow --bin pcow-img
    target_dir=$(cargo metadata --format-version 1 --no-deps \
        | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    pcow_img="$target_dir/release/pcow-img"
    [ -x "$pcow_img" ] || die "pcow-img not found at $pcow_img"

    bench_dir=${PCOW_BENCH_DIR:-}
    if [ -z "$bench_dir" ]; then
        shm_free_kib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $4 }')
        if [ -n "$shm_free_kib" ] && [ "$shm_free_kib" -ge $((4 * 1024 * 1024)) ]; then
            bench_dir=/dev/shm
        else
            bench_dir=${TMPDIR:-/tmp}
        fi
    fi
    work=$(mktemp -d "$bench_dir/pcow-bench.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    step "convert: 1 GiB raw input (1 MiB of data, 1 MiB hole, x512) in $work"
    raw="$work/input.raw"
    truncate -s 1G "$raw"
    for ((i = 0; i < 512; i++)); do
        dd if=/dev/urandom of="$raw" bs=1M count=1 seek=$((2 * i)) conv=notrunc status=none
    done
    echo "input: $(du -k --apparent-size "$raw" | cut -f1) KiB apparent, $(du -k "$raw" | cut -f1) KiB allocated"

    now_ns() { date +%s%N; }
    pcow_ns=()
    qcow_ns=()
    for ((r = 1; r <= rounds; r++)); do
        rm -f "$work/out.pcow" "$work/out.qcow2"
        t0=$(now_ns)
        "$pcow_img" convert -O pcow "$raw" "$work/out.pcow"
        t1=$(now_ns)
        # -t writeback: flush at the end, as pcow-img's closing barrier does
        # (qemu-img's default for convert's target is cache=unsafe).
        qemu-img convert -f raw -O qcow2 -t writeback "$raw" "$work/out.qcow2"
        t2=$(now_ns)
        pcow_ns+=($((t1 - t0)))
        qcow_ns+=($((t2 - t1)))
        printf 'round %d: pcow-img %8.1f ms   qemu-img %8.1f ms\n' "$r" \
            "$(awk -v n=$((t1 - t0)) 'BEGIN { print n / 1e6 }')" \
            "$(awk -v n=$((t2 - t1)) 'BEGIN { print n / 1e6 }')"
    done

    step "convert: checking the outputs against the input"
    qemu-img compare -f raw -F qcow2 "$raw" "$work/out.qcow2"
    "$pcow_img" convert -O raw "$work/out.pcow" "$work/back.raw"
    cmp "$raw" "$work/back.raw"
    echo "pcow: output converted back to raw is identical to the input"
    echo "sizes: pcow $(du -k "$work/out.pcow" | cut -f1) KiB, qcow2 $(du -k "$work/out.qcow2" | cut -f1) KiB allocated"

    median() { printf '%s\n' "$@" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
    p=$(median "${pcow_ns[@]}")
    q=$(median "${qcow_ns[@]}")
    step "convert summary (median of $rounds rounds, 1024 MiB virtual each)"
    awk -v p="$p" -v q="$q" 'BEGIN {
        mp = 1024 / (p / 1e9); mq = 1024 / (q / 1e9)
        printf "pcow-img convert -O pcow:  %8.1f ms  %8.1f MiB/s\n", p / 1e6, mp
        printf "qemu-img convert -O qcow2: %8.1f ms  %8.1f MiB/s\n", q / 1e6, mq
        printf "ratio pcow-img/qemu-img throughput: %.2f\n", mp / mq
    }'
fi

step "done (reproduce: $root/scripts/bench.sh)"
