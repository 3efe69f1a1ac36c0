#!/usr/bin/env bash
# Runs every fuzz target of fuzz/ for a bounded time (docs/fuzzing.md).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Default: 30 s per target, all targets, FUZZ_JOBS of them at a time
# (default one per core). Installs
# cargo-fuzz when it is missing, makes the seed corpora
# (scripts/fuzz-seeds.sh), builds the targets with AddressSanitizer on the
# stable toolchain (RUSTC_BOOTSTRAP=1, see the doc), and runs each with a
# per-input timeout of 10 s and an RSS limit of 2 GiB. Exits non-zero when
# any target crashed, leaked, timed out or ran out of memory; the input is
# in fuzz/artifacts/<target>/. Prints executions/s and coverage (libFuzzer's
# cov: edges and ft: features) per target.
#
# Environment: FUZZ_SANITIZER (address; none is faster and finds panics,
# hangs and OOMs only), FUZZ_ARGS (more libFuzzer flags), FUZZ_LOG_SUFFIX
# (logs go to fuzz/logs/SUFFIX/, for runs side by side).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
die() { printf 'fuzz.sh: error: %s\n' "$*" >&2; exit 1; }

secs=${1:-30}
shift || true
case "$secs" in '' | *[!0-9]*) die "SECONDS_PER_TARGET must be a number, got '$secs'" ;; esac
all_targets=(image_open image_open_alloc image_chain image_ops api_http options pmem_queue snapshot_state snapshot_config)
if [ "$#" -eq 0 ]; then targets=("${all_targets[@]}"); else targets=("$@"); fi
sanitizer=${FUZZ_SANITIZER:-address}

# cargo-fuzz passes nightly flags (-Zsanitizer, -Cpasses=sancov-module,
# -Zbuild-std when asked): RUSTC_BOOTSTRAP=1 lets the stable compiler take
# them.
export RUSTC_BOOTSTRAP=1

max_len() {
    case "$1" in
        image_ops | options) echo 4096 ;;
        api_http | pmem_queue | snapshot_state | snapshot_config) echo 65536 ;;
        *) echo 262144 ;;
    esac
}

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> installing cargo-fuzz"
    cargo install cargo-fuzz --version 0.13.2 --locked
fi
echo "cargo-fuzz: $(cargo fuzz --version)"

echo "==> seeds"
bash scripts/fuzz-seeds.sh

echo "==> building the targets (sanitizer: $sanitizer)"
(cd fuzz && cargo fuzz build -O -a -s "$sanitizer")
# Where cargo put them: fuzz/target, or CARGO_TARGET_DIR (relative to fuzz/,
# where cargo ran).
case ${CARGO_TARGET_DIR:-} in
    '') bin_dir=$root/fuzz/target ;;
    /*) bin_dir=$CARGO_TARGET_DIR ;;
    *) bin_dir=$root/fuzz/$CARGO_TARGET_DIR ;;
esac
bin_dir=$bin_dir/x86_64-unknown-linux-gnu/release
for t in "${targets[@]}"; do
    [ -x "$bin_dir/$t" ] || die "no fuzz target binary $bin_dir/$t after the build (unknown target '$t'?)"
done

logs="$root/fuzz/logs${FUZZ_LOG_SUFFIX:+/$FUZZ_LOG_SUFFIX}"
mkdir -p "$logs"
# Targets run side by side, FUZZ_JOBS at a time (default: one per core);
# each writes its exit status next to its log.
jobs=${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}
case "$jobs" in '' | *[!0-9]* | 0) die "FUZZ_JOBS must be a positive number, got '$jobs'" ;; esac
run_target() {
    local t=$1 rc=0
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
    # The binary built above, not `cargo fuzz run`: that would rebuild when
    # the sources changed since, inside a long campaign.
    # shellcheck disable=SC2086
    (cd fuzz && "$bin_dir/$t" "corpus/$t" -artifact_prefix="artifacts/$t/" \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -max_len="$(max_len "$t")" -print_final_stats=1 ${FUZZ_ARGS:-}) \
        >"$logs/$t.log" 2>&1 || rc=$?
    echo "$rc" >"$logs/$t.rc"
}
for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    echo "==> $t: ${secs} s"
    rm -f "$logs/$t.rc"
    run_target "$t" &
done
wait

failed=()
summary=()
for t in "${targets[@]}"; do
    log="$logs/$t.log"
    # No status file: the runner itself died (counted as a failure).
    rc=$(cat "$logs/$t.rc" 2>/dev/null || echo 255)
    # The last status line has cov: and ft:; the final stats have exec/s.
    status=$(grep -E '^#[0-9]+' "$log" | grep 'cov:' | tail -n1 || true)
    cov=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$status")
    ft=$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$status")
    corp=$(sed -nE 's/.* corp: ([0-9]+\/[0-9a-zA-Z]+).*/\1/p' <<<"$status")
    execs=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+)/\1/p' "$log" | tail -n1)
    eps=$(sed -nE 's/^stat::average_exec_per_sec: *([0-9]+)/\1/p' "$log" | tail -n1)
    rss=$(sed -nE 's/^stat::peak_rss_mb: *([0-9]+)/\1/p' "$log" | tail -n1)
    line=$(printf '%-12s exec/s %6s  cov %5s  ft %6s  corpus %-12s runs %9s  rss %5s MB' \
        "$t" "${eps:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "${execs:-?}" "${rss:-?}")
    if [ "$rc" -ne 0 ]; then
        line+="  FAILED (exit $rc)"
        failed+=("$t")
        grep -E 'ERROR: libFuzzer|ERROR: AddressSanitizer|ERROR: LeakSanitizer|panicked at|Test unit written|SUMMARY' "$log" | head -n 20 || true
    fi
    echo "$line"
    summary+=("$line")
done

# Scratch files of the chain and ops targets (tmpfs), one directory per
# fuzzer pid: only those of finished fuzzers go, as several runs of this
# script may share the machine.
for d in /dev/shm/pcow-fuzz/* "${TMPDIR:-/tmp}"/pcow-fuzz/*; do
    [ -d "$d" ] || continue
    kill -0 "${d##*/}" 2>/dev/null || rm -rf "$d"
done

echo
echo "==> summary (${secs} s per target, sanitizer $sanitizer; logs in fuzz/logs/)"
printf '%s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzz.sh: FAILED: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz.sh: no crash, leak, timeout or OOM"
