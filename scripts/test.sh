#!/usr/bin/env bash
# Every test of the project: formatting, lints, `cargo test --workspace`
# (unit, property, crash-injection, integration and doc tests), and the
# nested-sandbox tests that boot real Linux guests (scripts/sandbox/).
# On a fresh Debian 12 machine it first installs what the tests need
# (qemu-img, the reference tool the tests compare against; libclang-dev;
# python3-venv for the API's property-based test; acpica-tools for the
# DSDT check).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

current="start"
t_start=$SECONDS
t_step=$SECONDS
# Each step prints how long the previous one took, so CI's log shows where
# the time goes.
step() {
    [ "$current" = start ] || printf '(%s: %d s)\n' "$current" $((SECONDS - t_step))
    current=$*
    t_step=$SECONDS
    printf '\n==> %s\n' "$*"
}
die() { printf 'test.sh: error: %s\n' "$*" >&2; exit 1; }
on_exit() {
    local rc=$?
    # A background step still running when another failed.
    [ -z "${api_pid:-}" ] || kill "$api_pid" 2>/dev/null || true
    [ "$rc" -eq 0 ] || printf '\ntest.sh: FAILED (exit %d) at: %s\n' "$rc" "$current" >&2
}
trap on_exit EXIT

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

step "checking prerequisites"
command -v cargo >/dev/null 2>&1 \
    || die "cargo not found; install the Rust toolchain (https://rustup.rs), rust-version 1.89 or newer"
if ! command -v qemu-img >/dev/null 2>&1; then
    step "qemu-img missing: installing qemu-utils"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y qemu-utils
fi
if [ -x /usr/bin/dpkg ] && ! dpkg -s libclang-dev >/dev/null 2>&1; then
    # The userfaultfd crate generates its bindings with libclang at build time.
    step "libclang-dev missing: installing it"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y libclang-dev
fi
if [ "${API_FUZZ:-1}" != 0 ] && [ -x /usr/bin/dpkg ] \
    && ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    # scripts/api-fuzz.sh installs schemathesis from PyPI into a venv.
    step "python3-venv missing: installing it"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y python3 python3-venv
fi
if [ -x /usr/bin/dpkg ] && ! command -v iasl >/dev/null 2>&1; then
    # ACPICA's iasl disassembles and recompiles the VMM's DSDT (acpi.rs test).
    step "iasl missing: installing acpica-tools"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y acpica-tools
fi
if [ -x /usr/bin/dpkg ] && ! command -v gnuplot >/dev/null 2>&1; then
    # The guest benchmark's report draws its plot with gnuplot (its tests
    # run the report: scripts/sandbox/test_guest_bench_report.py).
    step "gnuplot missing: installing gnuplot-nox"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y gnuplot-nox
fi
echo "cargo:    $(cargo --version)"
echo "qemu-img: $(qemu-img --version | head -n1)"

step "cargo fmt --all -- --check"
cargo fmt --all -- --check

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test --workspace --no-fail-fast (every test binary runs; any failure fails)"
cargo test --workspace --no-fail-fast

# The parsers of the guest benchmark's logs (scripts/sandbox/guest-bench*):
# the benchmark itself is not a test, its report and breakdown are.
step "python3 unittest: scripts/sandbox/test_*.py"
python3 -m unittest discover -s scripts/sandbox -p 'test_*.py'

# The REST API against its description, docs/openapi.yaml: schemathesis
# (from PyPI, into .cache/api-fuzz/) generates requests from it for a VMM
# with no VM, a created VM and a running one (scripts/api-fuzz.sh): any 5xx
# but a documented wrong-state answer (upstream's 500), failed conformance
# check or VMM death fails. API_FUZZ=0 skips this step
# (and says so).
# It runs in the background beside the fuzzing below (it keeps about one
# core busy; the fuzz build and the fuzzers take the rest), its output in
# .cache/api-fuzz.log, printed when both are done; either failing fails.
api_pid=""
if [ "${API_FUZZ:-1}" != 0 ]; then
    step "API property-based test: schemathesis on docs/openapi.yaml (scripts/api-fuzz.sh), in the background"
    mkdir -p .cache
    scripts/api-fuzz.sh >.cache/api-fuzz.log 2>&1 &
    api_pid=$!
else
    step "API property-based test: SKIPPED (API_FUZZ=0)"
fi

# Every fuzz target for a bounded time (cargo-fuzz on the stable toolchain,
# docs/fuzzing.md): any crash, leak, timeout or OOM fails. FUZZ_SECONDS=0
# skips this step (and says so).
fuzz_secs=${FUZZ_SECONDS:-12}
if [ "$fuzz_secs" -gt 0 ]; then
    step "fuzzing: every target for ${fuzz_secs} s (scripts/fuzz.sh)"
    scripts/fuzz.sh "$fuzz_secs"
else
    step "fuzzing: SKIPPED (FUZZ_SECONDS=0)"
fi

if [ -n "$api_pid" ]; then
    step "API property-based test: waiting for it; its output (.cache/api-fuzz.log)"
    api_rc=0
    wait "$api_pid" || api_rc=$?
    api_pid=""
    cat .cache/api-fuzz.log
    [ "$api_rc" -eq 0 ] || die "scripts/api-fuzz.sh failed (exit $api_rc)"
fi

# Tier 4: real Linux guests in the nested sandbox (QEMU TCG playing an AMD
# host, its stock kvm-amd, our cloud-hypervisor inside). Each script fetches
# and builds what it needs from Debian's packages (cached in .cache/sandbox)
# and prints SKIPPED only where QEMU cannot run at all; under CI a skip fails.
step "nested sandbox: selftest (L1 has a real /dev/kvm; QEMU in L1 boots a guest)"
scripts/sandbox/selftest.sh

step "nested sandbox: KVM tests on L1's kvm-amd (the dirty ring; scripts/sandbox/kvm-tests-l1.sh)"
scripts/sandbox/kvm-tests-l1.sh

step "nested sandbox: cloud-hypervisor scenarios with real Linux guests"
scripts/sandbox/vmm-scenarios.sh

step "all tests passed in $((SECONDS - t_start)) s"
