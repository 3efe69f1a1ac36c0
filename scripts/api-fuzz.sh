#!/usr/bin/env bash
# Property-based test of the REST API against its description,
# docs/openapi.yaml, with schemathesis (docs/api.md, "Property-based
# testing").
#
#   scripts/api-fuzz.sh [MAX_EXAMPLES_PER_OPERATION]
#
# Default: 150 examples per operation and generation phase (examples,
# coverage, fuzzing). Installs schemathesis (pinned) into a venv in
# .cache/api-fuzz/ when missing, builds cloud-hypervisor and pcow-img, and
# runs three rounds, each on its own VMM (`--api-socket` only, its cwd a
# fresh directory holding the files the spec's examples name). schemathesis
# speaks TCP: scripts/api-fuzz-helper.py bridges 127.0.0.1:PORT to the Unix
# socket.
#   fresh    no VM at the start: every operation but vmm.shutdown (the
#            configs vm.create accepts are booted and deleted by a check);
#   created  a VM created (a halting PVH stub kernel, pcow devices pmem0
#            and pmem1, raw raw0), not booted: every operation but
#            vmm.shutdown, vm.boot and vm.delete;
#   running  that VM booted: every operation but vmm.shutdown, vm.shutdown
#            and vm.delete (so that the live pmem paths stay reachable);
#            vm.power-button and vm.nmi only when this build delivers them
#            (probed first: an answer "not wired yet" leaves them out,
#            SKIPPED in the summary).
# Checks on every response: status code, content type, headers and body as
# documented, invalid input refused (negative_data_rejection); and ours
# (scripts/api-fuzz-hooks.py, which also steers generated bodies towards
# files and devices that exist): upstream's wire format (no reason phrase,
# Server and Connection headers, a 204 without Content-Length), the
# documented error chains, 400 ["Bad Request"] for a method the path does
# not have, a 5xx only as a documented wrong-state answer (500 ["Error from
# API", what, why] with a state reason of that action: upstream answers an
# action in the wrong state so; any other 5xx fails), an accepted config
# boots or is refused with a 4xx, a snapshot just taken can be rolled back
# to and deleted. The 5xx in the requests sent are counted again from the
# cassette (api-fuzz-hooks.py server-errors): any that is not a wrong-state
# answer fails the round. After each round the VMM must still be alive;
# then the operations left out are sent on purpose (vm.shutdown and
# vm.delete where there is a VM: 204 each; vmm.shutdown last: 200), and the
# VMM must exit with status 0. Exits non-zero on any schemathesis failure,
# any 5xx that is not a wrong-state answer, a VMM that died or did not exit
# cleanly. Needs /dev/kvm (without it: SKIPPED, a failure under CI).
#
# Environment: API_FUZZ_SEED (default 1: runs are reproducible),
# API_FUZZ_ROUNDS (default "fresh created running"), API_FUZZ_WORKERS
# (default 1), API_FUZZ_ARGS (more `schemathesis run` options). Reports
# (JUnit, the requests as a VCR cassette), the VMM's log and schemathesis'
# output go to .cache/api-fuzz/report/ROUND/.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
die() { printf 'api-fuzz.sh: error: %s\n' "$*" >&2; exit 1; }

examples=${1:-150}
case "$examples" in '' | *[!0-9]* | 0) die "MAX_EXAMPLES_PER_OPERATION must be a positive number, got '$examples'" ;; esac
seed=${API_FUZZ_SEED:-1}
rounds=${API_FUZZ_ROUNDS:-fresh created running}
workers=${API_FUZZ_WORKERS:-1}
schemathesis_version=4.32.5
cache="$root/.cache/api-fuzz"
venv="$cache/venv"
reports="$cache/report"
helper="$root/scripts/api-fuzz-helper.py"

if [ ! -e /dev/kvm ]; then
    [ -z "${CI:-}" ] || die "no /dev/kvm under CI"
    echo "api-fuzz.sh: SKIPPED: no /dev/kvm (the VMs of the created and running rounds need it)"
    exit 0
fi

# --- schemathesis ------------------------------------------------------------
st="$venv/bin/schemathesis"
if ! "$st" --version 2>/dev/null | grep -qx "schemathesis, version $schemathesis_version"; then
    echo "==> installing schemathesis $schemathesis_version into $venv"
    command -v python3 >/dev/null 2>&1 || die "python3 not found (Python 3.9 or newer)"
    rm -rf "$venv"
    python3 -m venv "$venv" \
        || die "python3 -m venv failed: install python3-venv (Debian) and retry"
    "$venv/bin/pip" install --quiet "schemathesis==$schemathesis_version"
fi
echo "schemathesis: $("$st" --version)"
# Our checks must tell right answers from wrong ones before they judge
# the server's.
"$venv/bin/python" "$root/scripts/api-fuzz-hooks.py" selftest
# No state carried from one run to the next (schemathesis would replay the
# failures of earlier runs first): the seed alone decides what is sent.
config="$cache/schemathesis.toml"
printf '[cache]\nenabled = false\n' >"$config"

# --- binaries ----------------------------------------------------------------
echo "==> building cloud-hypervisor and pcow-img"
# The test profile: the binaries `cargo test` built (the dev profile would
# build the whole workspace a second time).
cargo build --quiet --profile test -p vmm --bin cloud-hypervisor -p pcow --bin pcow-img
tdir=${CARGO_TARGET_DIR:-target}
case $tdir in /*) ;; *) tdir=$root/$tdir ;; esac
vmm_bin="$tdir/debug/cloud-hypervisor"
pcow_img="$tdir/debug/pcow-img"

# --- processes ---------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/api-fuzz.XXXXXX")
vmm_pid=""
bridge_pid=""
stop_pid() {
    local pid=$1
    [ -n "$pid" ] || return 0
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}
cleanup() {
    stop_pid "$bridge_pid"
    stop_pid "$vmm_pid"
    rm -rf "$work"
}
trap cleanup EXIT

call() { python3 "$helper" call "$sock" "$@"; }

# start_vmm ROUND: a VMM on a fresh socket in a fresh directory (its cwd, so
# that relative paths the tester sends land there), and the bridge to it.
start_vmm() {
    local round=$1
    dir="$work/$round"
    mkdir -p "$dir" "$reports/$round"
    sock="$dir/api.sock"
    (cd "$dir" && exec "$vmm_bin" --api-socket "path=$sock" -v) \
        </dev/null >"$reports/$round/vmm.log" 2>&1 &
    vmm_pid=$!
    local _
    for _ in $(seq 200); do
        [ -S "$sock" ] && break
        kill -0 "$vmm_pid" 2>/dev/null || die "$round: the VMM exited at start (see $reports/$round/vmm.log)"
        sleep 0.05
    done
    [ -S "$sock" ] || die "$round: no API socket after 10 s"
    rm -f "$dir/port"
    python3 "$helper" bridge "$sock" "$dir/port" &
    bridge_pid=$!
    for _ in $(seq 200); do
        [ -s "$dir/port" ] && break
        sleep 0.05
    done
    [ -s "$dir/port" ] || die "$round: the bridge did not start"
    port=$(cat "$dir/port")
    # The files the spec's examples name (relative paths: the VMM's cwd),
    # so that the examples reach past "cannot open": vm.create's VmConfig
    # (vmlinux, disk0.pcow), vm.add-pmem's PmemConfig (disk1.pcow).
    python3 "$helper" kernel "$dir/vmlinux"
    "$pcow_img" create "$dir/disk0.pcow" 4M >/dev/null
    "$pcow_img" create "$dir/disk1.pcow" 4M >/dev/null
    truncate -s 2M "$dir/raw0.img"
}

# make_vm: a VM in state Created with the devices the spec's examples name:
# pcow pmem0 (the pmem-* actions) and pmem1 (vm.remove-device), and a raw
# raw0.
make_vm() {
    call PUT vm.create '{"payload":{"kernel":"vmlinux"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":67108864},"pmem":[{"file":"disk0.pcow","id":"pmem0"},{"file":"disk1.pcow","id":"pmem1"},{"file":"raw0.img","id":"raw0"}],"serial":{"mode":"Null"},"console":{"mode":"Off"}}' \
        204 >/dev/null
}

total_ops=0
total_requests=0
total_failures=0
summary=()
checks=status_code_conformance,content_type_conformance
checks+=,response_headers_conformance,response_schema_conformance
checks+=,negative_data_rejection
# Ours (scripts/api-fuzz-hooks.py); the first and the last replace
# schemathesis' not_a_server_error and unsupported_method (405), which
# upstream's wire behaviour does not follow.
checks+=,server_error_is_wrong_state,error_body_shape,wire_format,wrong_method_is_bad_request
checks+=,accepted_vm_config_boots,snapshot_can_be_restored
export SCHEMATHESIS_HOOKS="$root/scripts/api-fuzz-hooks.py"

# fuzz ROUND EXCLUDED_OPERATION_ID...: schemathesis on the running VMM.
fuzz() {
    local round=$1
    shift
    local excl=()
    local id
    for id in "$@"; do excl+=(--exclude-operation-id "$id"); done
    echo "==> $round: schemathesis on port $port (seed $seed, $examples examples per operation)"
    local rc=0 t0=$SECONDS
    local log="$reports/$round/schemathesis.log"
    # The requests our checks send, one line each (the hooks write it).
    export API_FUZZ_EXTRA_LOG="$reports/$round/check-requests.log"
    : >"$API_FUZZ_EXTRA_LOG"
    # The wrong-state 500s the check accepted, one line each (action, why).
    export API_FUZZ_WRONG_STATE_LOG="$reports/$round/wrong-state.log"
    : >"$API_FUZZ_WRONG_STATE_LOG"
    # The failures the hooks drop (an array body serde reads as a struct).
    export API_FUZZ_DROPPED_LOG="$reports/$round/dropped.log"
    : >"$API_FUZZ_DROPPED_LOG"
    # shellcheck disable=SC2086
    "$st" --config-file "$config" run "$root/docs/openapi.yaml" \
        --url "http://127.0.0.1:$port/api/v1" \
        --checks "$checks" \
        --phases examples,coverage,fuzzing \
        --max-examples "$examples" \
        --seed "$seed" \
        --generation-database none \
        --workers "$workers" \
        --request-timeout 30 \
        --no-color \
        --report junit,vcr \
        --report-junit-path "$reports/$round/junit.xml" \
        --report-vcr-path "$reports/$round/requests.yaml" \
        "${excl[@]}" ${API_FUZZ_ARGS:-} \
        2>&1 | tee "$log" || rc=$?
    local secs=$((SECONDS - t0))
    # The numbers: operations and failing ones from the JUnit report, the
    # requests and their status codes from the cassette.
    local junit="$reports/$round/junit.xml" vcr="$reports/$round/requests.yaml"
    local ops=0 failures=0 requests=0 wrong_state=0 other_5xx=0 extra classified dropped
    extra=$(wc -l <"$API_FUZZ_EXTRA_LOG")
    dropped=$(wc -l <"$API_FUZZ_DROPPED_LOG")
    if [ -f "$junit" ]; then
        ops=$(sed -nE 's/^<testsuites .* tests="([0-9]+)".*/\1/p' "$junit")
        failures=$(sed -nE 's/^<testsuites errors="([0-9]+)" failures="([0-9]+)".*/\1 + \2/p' "$junit")
        failures=$((failures))
    fi
    if [ -f "$vcr" ]; then
        requests=$(grep -c '^- id:' "$vcr" || true)
        # Every 5xx in the cassette, classified again: wrong state or not.
        classified=$("$venv/bin/python" "$root/scripts/api-fuzz-hooks.py" server-errors "$vcr") \
            || die "$round: reading $vcr failed"
        read -r wrong_state other_5xx <<<"$(head -n1 <<<"$classified")"
        if [ "$other_5xx" -gt 0 ]; then
            echo "$round: 5xx answers that are not a documented wrong-state answer:"
            tail -n +2 <<<"$classified"
        fi
    fi
    total_ops=$((total_ops + ops))
    total_requests=$((total_requests + requests + extra))
    total_failures=$((total_failures + failures))
    summary+=("$(printf '%-8s operations %3d  requests %6d (+%4d by our checks)  500 wrong state %4d  other 5xx %3d  failures %3d (+%d array bodies dropped)  %4d s%s' \
        "$round" "$ops" "$requests" "$extra" "$wrong_state" "$other_5xx" "$failures" "$dropped" "$secs" "$skipped_note")")
    kill -0 "$vmm_pid" 2>/dev/null \
        || die "$round: the VMM died during the run (see $reports/$round/vmm.log)"
    [ "$rc" -eq 0 ] || die "$round: schemathesis failed (exit $rc; log and reports in $reports/$round/)"
    [ "$other_5xx" -eq 0 ] || die "$round: $other_5xx answers with a 5xx that is not a wrong-state answer (see $vcr)"
    echo "$round: the VMM is alive"
}

# finish ROUND ACTION...: the actions left out of the run, on purpose (each
# a PUT that must answer 204); vmm.shutdown last (200, as upstream), and the
# VMM must exit 0.
finish() {
    local round=$1
    shift
    local action
    for action in "$@"; do
        call PUT "$action" "" 204 >/dev/null || die "$round: $action"
    done
    call PUT vmm.shutdown "" 200 >/dev/null || die "$round: vmm.shutdown"
    local rc=0
    wait "$vmm_pid" || rc=$?
    vmm_pid=""
    [ "$rc" -eq 0 ] || die "$round: the VMM exited with status $rc after vmm.shutdown"
    stop_pid "$bridge_pid"
    bridge_pid=""
    echo "$round: vmm.shutdown answered 200, the VMM exited 0"
}

# probe_delivered ACTION OPERATION_ID: on the running VM, ACTION answers
# 204, or 500 "not wired yet" (the route exists, the delivery is another
# change): then the operation is left out of the running round, SKIPPED.
probe_delivered() {
    local action=$1 id=$2 out
    if out=$(call PUT "$action" "" 204); then
        return 0
    fi
    case "$out" in
        *": 500 "*'"not wired yet"'*)
            echo "running: SKIPPED $action: the route exists but this build does not deliver it ($out)"
            undelivered+=("$id")
            ;;
        *) die "running: $action on the running VM: $out" ;;
    esac
}

t_start=$SECONDS
rm -rf "$reports"

for round in $rounds; do
    case "$round" in
        fresh)
            start_vmm fresh
            skipped_note=""
            fuzz fresh shutdownVMM
            finish fresh vm.delete
            ;;
        created)
            start_vmm created
            make_vm
            skipped_note=""
            fuzz created shutdownVMM bootVM deleteVM
            finish created vm.delete
            ;;
        running)
            start_vmm running
            make_vm
            call PUT vm.boot "" 204 >/dev/null
            undelivered=()
            probe_delivered vm.power-button power-buttonVM
            probe_delivered vm.nmi nmiVM
            skipped_note=""
            [ "${#undelivered[@]}" -eq 0 ] || skipped_note="  (SKIPPED: ${undelivered[*]}, not wired in this build)"
            fuzz running shutdownVMM shutdownVM deleteVM "${undelivered[@]}"
            finish running vm.shutdown vm.delete
            ;;
        *) die "unknown round '$round' (fresh, created, running)" ;;
    esac
done

echo
echo "==> summary (schemathesis $schemathesis_version, seed $seed, $examples examples per operation; reports in .cache/api-fuzz/report/)"
printf '%s\n' "${summary[@]}"
echo "total: $total_ops operations tested over the rounds (and vmm.shutdown on purpose after each)," \
    "$total_requests requests, $total_failures failures, $((SECONDS - t_start)) s"
[ "$total_failures" = 0 ] || die "failures found"
echo "api-fuzz.sh: no 5xx but documented wrong-state answers, no failed check, the VMM never died and exited 0 on vmm.shutdown"
