#!/usr/bin/env bash
# The VMM's host-KVM tests that depend on what the KVM module does, run
# again inside L1, on upstream's kvm-amd (Debian's kernel): the host's own
# KVM module (kvm_pvm) differs in ways the VMM relies on. Today that is
# vmm/tests/dirty_log_kvm.rs: KVM's dirty ring, which the VMM uses by
# default only on kvm_amd/kvm_intel (vmm/src/dirty_ring.rs), must stop a
# vCPU whose ring is full and lose no page; on the host, kvm_pvm overflows
# the ring instead, which that test only sees detected. The same binary
# has a guest on KVM using the clusters a scattered image's open left
# unmapped (mapped or copied in at its first access, its writes found
# through the ring).
#
# Builds the test binary (cargo test --no-run), boots L1 with it as the
# payload, runs it with CI=1 (a skip is a failure) and fails unless every
# test passed, none printed SKIPPED, and the full-ring test saw no
# overflow. Bounded by SANDBOX_TIMEOUT (default 300 s); an L1 kernel panic
# before the result (QEMU's emulation, see selftest.sh) boots L1 once more.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

tests=(dirty_log_kvm)
payload=$CACHE/kvm-tests/payload
rm -rf "$payload"
mkdir -p "$payload" "$CACHE/logs"

say "== fetch and build L1 (cached)"
"$SANDBOX_SCRIPTS/fetch.sh"
"$SANDBOX_SCRIPTS/build-l1.sh"

say "== build the test binaries"
for t in "${tests[@]}"; do
    bin=$(cd "$REPO_ROOT" && cargo test -p vmm --test "$t" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])' | tail -n1)
    [ -x "$bin" ] || die "no test binary for $t"
    cp "$bin" "$payload/$t"
done
cat >"$payload/run.sh" <<EOF
cd /payload
echo "KVM-TESTS modules: \$(ls /sys/module | grep '^kvm' | tr '\n' ' ')"
rc=0
for t in ${tests[*]}; do
    CI=1 ./\$t --test-threads=1 --nocapture 2>&1 || rc=1
    echo "KVM-TESTS \$t done"
done
exit \$rc
EOF

run() {
    SANDBOX_QUIET=1 SANDBOX_LOG=$1 SANDBOX_TIMEOUT=${SANDBOX_TIMEOUT:-300} \
        "$SANDBOX_SCRIPTS/run-l1.sh" "$payload"
}
log=$CACHE/logs/kvm-tests-$(date +%Y%m%d-%H%M%S).log
t=$(now)
set +e
run "$log"
rc=$?
if [ "$rc" -ne 0 ] && ! grep -q 'SANDBOX-RESULT' "$log" && grep -q 'Kernel panic - not syncing' "$log"; then
    say "L1's kernel panicked (log: $log): booting L1 once more"
    log=${log%.log}-retry.log
    run "$log"
    rc=$?
fi
set -e
say "L1 run: $(elapsed "$t") s, rc=$rc, log: $log"
grep -a -E '^(KVM-TESTS|test |running )|test result|RingStats|SKIPPED|panicked' "$log" | tr -d '\r' || true
fail=
[ "$rc" -eq 0 ] || fail="the payload failed (rc=$rc)"
for t in "${tests[@]}"; do
    grep -a -q "KVM-TESTS $t done" "$log" || fail="${fail:+$fail; }$t did not run to its end"
done
grep -a -q 'KVM-TESTS modules:.*kvm_amd' "$log" || fail="${fail:+$fail; }L1 has no kvm_amd"
! grep -a -q 'SKIPPED' "$log" || fail="${fail:+$fail; }a test was skipped"
! grep -a -E 'test result: ' "$log" | grep -v -q 'test result: ok' || fail="${fail:+$fail; }a test failed"
# Both full-ring tests report their rings' counters: no overflow on kvm-amd.
[ "$(grep -a -c 'rings RingStats' "$log")" -ge 2 ] || fail="${fail:+$fail; }the full-ring tests did not report"
! grep -a 'rings RingStats' "$log" | grep -v -q 'overflows: 0' || fail="${fail:+$fail; }a full-ring test saw an overflow"
if [ -n "$fail" ]; then
    say "FAILED: $fail"
    exit 1
fi
say "passed: ${tests[*]} on L1's kvm_amd"
