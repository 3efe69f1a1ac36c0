#!/usr/bin/env bash
# Boot-time benchmark of our VMM (`cloud-hypervisor`) in the nested sandbox:
# the same L2 kernel + initramfs (build-l2.sh, vmm-guest.sh `l2.scenario=bench`:
# the guest's init loads the pmem modules, mounts /dev/pmem0 -o dax, does
# nothing else, unmounts and powers off) on a raw pmem file vs a pcow image
# of the same ext4 filesystem, in ONE L1 boot. L1 timestamps every line of
# the VMM's output with its /proc/uptime as the line arrives, and measures
# per VMM run:
#   init     VMM start -> the guest's `L2-BOOTED` (its /init runs)
#   mounted  VMM start -> `L2-PMEM ... mounted=ext4-dax` (modules + mount)
#   total    VMM start -> VMM exit (after the guest's poweroff and the final
#            barrier)
#   and two phases of it: mount = mounted - init, down = total - mounted.
# Runs alternate raw/pcow (the order flips every round), after one discarded
# warm-up run of each; every image starts each run as a fresh copy.
# Prints median, spread and the pcow/raw ratio of the medians, and writes
# docs/vmm-benchmarks.md (VMMBENCH_DOC). All figures are emulated (nested
# KVM inside QEMU TCG): only the ratios mean anything.
#
# Environment: VMMBENCH_RUNS (runs per image kind, default 5), VMMBENCH_DOC
# (default docs/vmm-benchmarks.md; `-` writes none), SANDBOX_TIMEOUT (s, the
# L1 run, default 600), CARGO_TARGET_DIR. L1 gets one vCPU (SANDBOX_SMP=1,
# see vmm-scenarios.sh).
# Exit 0 when every run succeeded; SKIPPED + exit 0 only when QEMU cannot run.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

skip() {
    printf '\nvmm bench: SKIPPED: %s\n' "$*"
    exit 0
}
t_all=$(now)
RUNS=${VMMBENCH_RUNS:-5}
case $RUNS in '' | *[!0-9]* | 0) die "VMMBENCH_RUNS must be a positive integer" ;; esac
SIZE=$((64 * 1048576))
W=$CACHE/vmm-bench
payload=$W/payload
cd "$REPO_ROOT"
DOC=${VMMBENCH_DOC:-docs/vmm-benchmarks.md}
tdir=${CARGO_TARGET_DIR:-target}
case $tdir in /*) ;; *) tdir=$REPO_ROOT/$tdir ;; esac
PCOW_IMG=$tdir/release/pcow-img

if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
        skip "qemu-system-x86_64 is not installed and this user cannot install it (no root, no sudo)"
    fi
fi
say "== fetch (cached in $CACHE)"
"$SANDBOX_SCRIPTS/fetch.sh" >/dev/null
printf 'quit\n' | timeout 60 qemu-system-x86_64 -accel tcg -machine none -nodefaults \
    -display none -monitor stdio >/dev/null 2>&1 \
    || skip "qemu-system-x86_64 is installed but cannot start a TCG machine here"
command -v mkfs.ext4 >/dev/null 2>&1 \
    || as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq e2fsprogs >/dev/null

say "== cargo build --release (cloud-hypervisor + pcow-img)"
cargo build --release -q -p vmm --bin cloud-hypervisor -p pcow --bin pcow-img \
    || die "cargo build of cloud-hypervisor/pcow-img failed"

say "== build (L1, L2, images, payload)"
"$SANDBOX_SCRIPTS/build-l1.sh" >/dev/null
rm -rf "$W"
mkdir -p "$payload" "$W/fs"
"$SANDBOX_SCRIPTS/build-l2.sh" "$SANDBOX_SCRIPTS/vmm-guest.sh" "$payload/l2" >/dev/null
for b in cloud-hypervisor pcow-img; do
    strip --strip-debug -o "$payload/$b" "$tdir/release/$b" 2>/dev/null || cp "$tdir/release/$b" "$payload/$b"
done
# The filesystem: 64 MiB ext4 with some content (about 7 MiB), as raw and
# as pcow (pcow-img convert: the same bytes).
mkdir -p "$W/fs/d"
for i in $(seq 1 200); do head -c $((i * 97 + 4096)) /dev/urandom >"$W/fs/d/f$i"; done
head -c 4194304 /dev/urandom >"$W/fs/big.bin"
truncate -s "$SIZE" "$W/bench.raw"
mkfs.ext4 -q -b 4096 -F -d "$W/fs" "$W/bench.raw"
"$PCOW_IMG" convert -f raw -O pcow "$W/bench.raw" "$W/bench.pcow"
gzip -1 -c "$W/bench.raw" >"$payload/bench.raw.gz"
cp "$W/bench.pcow" "$payload/bench.pcow"
raw_kib=$(($(stat -c %s "$W/bench.raw") / 1024))
pcow_kib=$(($(stat -c %s "$W/bench.pcow") / 1024))
used_kib=$(du -sk "$W/fs" | cut -f1)
echo "RUNS=$RUNS" >"$payload/bench.conf"

cat >"$payload/run.sh" <<'EOF'
# L1 side of scripts/sandbox/vmm-bench.sh (busybox sh, in /payload).
cd /payload || exit 1
. ./bench.conf
gunzip -c bench.raw.gz >/tmp/pristine.raw && rm bench.raw.gz || exit 2
mv bench.pcow /tmp/pristine.pcow || exit 2
echo "VMMBENCH-L1 $(./cloud-hypervisor --version 2>&1 | head -n1)"
# one KIND NAME: one VMM run on a fresh copy of the image; every output line
# is prefixed with L1's uptime when it arrived. Prints a VMMBENCH-RUN line.
one() {
    cp /tmp/pristine.$1 /tmp/work.$1
    sync
    read -r u0 _ </proc/uptime
    { timeout -s KILL 120 ./cloud-hypervisor --kernel l2/vmlinuz --initramfs l2/initramfs.cpio \
        --cmdline "console=ttyS0 panic=-1 quiet l2.scenario=bench" --cpus boot=1 \
        --memory size=256M --pmem file=/tmp/work.$1 --serial tty --console off </dev/null 2>&1
      echo "VMM-EXIT rc=$?"; } | while IFS= read -r line; do
        read -r u _ </proc/uptime
        echo "$u $line"
    done >/tmp/run.log
    tr -d '\r' </tmp/run.log | awk -v u0="$u0" -v kind="$1" -v name="$2" '
        /L2-BOOTED/ && !b { b = $1 - u0 }
        /L2-PMEM .*mounted=ext4-dax/ && !m { m = $1 - u0 }
        /L2-RESULT rc=0/ { ok = 1 }
        /VMM-EXIT rc=/ { e = $1 - u0; rc = $0; sub(/.*rc=/, "", rc) }
        END { printf "VMMBENCH-RUN %s kind=%s init=%.2f mounted=%.2f total=%.2f mount=%.2f down=%.2f rc=%s guest=%s\n",
              name, kind, b, m, e, m - b, e - m, rc, ok ? "ok" : "FAIL" }'
    if ! grep -q 'L2-RESULT rc=0' /tmp/run.log; then
        sed 's/^/  L2| /' /tmp/run.log | tail -n 15
    fi
}
one raw warmup-raw
one pcow warmup-pcow
i=1
while [ $i -le "$RUNS" ]; do
    if [ $((i % 2)) -eq 1 ]; then
        one raw "run$i"
        one pcow "run$i"
    else
        one pcow "run$i"
        one raw "run$i"
    fi
    i=$((i + 1))
done
echo "VMMBENCH-L1 done"
EOF

export SANDBOX_SMP=${SANDBOX_SMP:-1}
mkdir -p "$CACHE/logs"
log=$CACHE/logs/vmm-bench-$(date +%Y%m%d-%H%M%S).log
say "== run L1 ($((RUNS * 2 + 2)) VMM runs, L1 vCPUs $SANDBOX_SMP), serial log: $log"
t=$(now)
set +e
SANDBOX_QUIET=1 SANDBOX_LOG=$log SANDBOX_TIMEOUT=${SANDBOX_TIMEOUT:-600} \
    "$SANDBOX_SCRIPTS/run-l1.sh" "$payload" | grep --line-buffered '^\[run-l1'
rc=${PIPESTATUS[0]}
set -e
t_l1=$(elapsed "$t")
grep -a 'VMMBENCH-RUN' "$log" | tr -d '\r' | sed 's/^/  /'
[ "$rc" -eq 0 ] || die "L1 run failed (run-l1.sh exit $rc; log $log)"

# ---- statistics ----------------------------------------------------------------------
runs=$(grep -a 'VMMBENCH-RUN run' "$log" | tr -d '\r')
nbad=$(grep -c -v 'rc=0 guest=ok' <<<"$runs" || true)
ngood=$(grep -c 'rc=0 guest=ok' <<<"$runs" || true)
[ "$ngood" -eq $((RUNS * 2)) ] || die "$nbad of $((RUNS * 2)) runs failed (log $log)"
# stats KIND METRIC -> "median min p90 max" (nearest rank)
stats() {
    sed -n "s/.* kind=$1 .*$2=\\([0-9.]*\\).*/\\1/p" <<<"$runs" | sort -n | awk '
        { v[NR] = $1 }
        END {
            n = NR
            med = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
            r = int(0.9 * n + 0.999999); if (r < 1) r = 1
            printf "%.2f %.2f %.2f %.2f\n", med, v[1], v[r], v[n]
        }'
}
table=$(
    printf '| metric | raw median | raw min-p90 | pcow median | pcow min-p90 | pcow/raw (medians) |\n'
    printf '| --- | --- | --- | --- | --- | --- |\n'
    for m in init mounted total mount down; do
        read -r rmed rmin rp90 _ <<<"$(stats raw $m)"
        read -r pmed pmin pp90 _ <<<"$(stats pcow $m)"
        ratio=$(awk -v a="$pmed" -v b="$rmed" 'BEGIN { printf (b > 0 ? "%.2f" : "-"), a / b }')
        case $m in
            init) what='VMM start -> guest init (`L2-BOOTED`)' ;;
            mounted) what='VMM start -> pmem0 mounted (`L2-PMEM`)' ;;
            total) what='VMM start -> VMM exit (poweroff)' ;;
            mount) what='of which guest init -> mounted (modules, mount)' ;;
            down) what='of which mounted -> VMM exit (umount, poweroff, teardown)' ;;
        esac
        printf '| %s | %s s | %s-%s s | %s s | %s-%s s | **%s** |\n' "$what" "$rmed" "$rmin" "$rp90" "$pmed" "$pmin" "$pp90" "$ratio"
    done
)
echo
printf '%s\n' "$table"
echo

if [ "$DOC" != - ]; then
    mkdir -p "$(dirname "$DOC")"
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')
    dirty=$(git status --porcelain -- vmm pcow devices Cargo.toml Cargo.lock 2>/dev/null | wc -l)
    {
        echo '# VMM boot benchmark (nested sandbox): raw vs pcow pmem'
        echo
        echo '<!-- Generated by scripts/sandbox/vmm-bench.sh: edit the script, not this file. -->'
        echo
        echo '> **All figures are emulated.** The VMM runs on nested KVM inside an L1'
        echo '> machine that QEMU emulates with TCG (no hardware virtualization on the'
        echo '> host: `scripts/sandbox/README.md`). Absolute times are many times those'
        echo '> of real hardware and depend on the load of a shared 2-core machine;'
        echo '> **only the pcow/raw ratio is meaningful**, and only roughly.'
        echo
        echo '## Command'
        echo
        echo '```sh'
        echo "$([ "$RUNS" = 5 ] || echo "VMMBENCH_RUNS=$RUNS ")scripts/sandbox/vmm-bench.sh"
        echo '```'
        echo
        echo '## What is measured'
        echo
        echo 'One L1 boot (1 vCPU); in it, one warm-up run of each kind (discarded),'
        echo "then $RUNS runs of each, alternating raw and pcow (the order flips every"
        echo 'round). Each run starts `cloud-hypervisor --cpus boot=1 --memory size=256M'
        echo '--pmem file=IMAGE --serial tty` on a fresh copy of the image; the guest'
        echo '(Debian 6.1 cloud kernel, busybox initramfs from `build-l2.sh`) loads the'
        echo 'virtio/pmem modules, mounts /dev/pmem0 `-o dax`, runs nothing'
        echo '(`l2.scenario=bench`), unmounts, syncs and powers off. L1 stamps each line'
        echo 'of the VMM output with its `/proc/uptime` (10 ms resolution) as the line'
        echo 'arrives; times are from just before the VMM starts.'
        echo
        echo "Images: the same 64 MiB ext4 filesystem ($used_kib KiB of files: 200 small"
        echo "random files and a 4 MiB one), as a raw file ($raw_kib KiB) and as a pcow"
        echo "image made from it by \`pcow-img convert -O pcow\` ($pcow_kib KiB)."
        echo
        echo '## Results'
        echo
        echo "min-p90: the fastest run and the 90th percentile (nearest rank; with $RUNS"
        echo 'runs that is the slowest).'
        echo
        printf '%s\n' "$table"
        echo
        echo 'The clock ticks every 10 ms: differences of a few ticks are noise.'
        echo 'The first two rows include the kernel boot, which does not touch the'
        echo 'pmem device; the VMM opens the image before it starts the vCPUs.'
        echo
        echo '## Runs'
        echo
        echo '```'
        grep -a 'VMMBENCH-RUN' "$log" | tr -d '\r' | sed 's/^VMMBENCH-RUN //'
        echo '```'
        echo
        echo '## Environment'
        echo
        echo '| | |'
        echo '| --- | --- |'
        echo "| date | $(date -u '+%Y-%m-%d %H:%M UTC') |"
        echo "| code | commit \`$commit\`$([ "$dirty" -eq 0 ] || echo " with $dirty uncommitted change(s) under vmm/ pcow/ devices/ Cargo.*") |"
        echo "| VMM | $(grep -a 'VMMBENCH-L1 cloud-hypervisor' "$log" | tr -d '\r' | sed 's/.*VMMBENCH-L1 //' | head -n1), release build |"
        echo "| host | \`nproc\` $(nproc), $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1), load average $(cut -d' ' -f1-3 /proc/loadavg) at the end |"
        echo "| L1 | QEMU TCG \`-cpu EPYC,+svm\`, 1 vCPU, ${SANDBOX_MEM:-1536M}; run ${t_l1}s wall |"
        echo
        echo 'Packages (`.cache/sandbox/packages.txt`, from `scripts/sandbox/fetch.sh`):'
        echo
        echo '| role | package | version |'
        echo '| --- | --- | --- |'
        awk '{ printf "| %s | `%s` | %s |\n", $1, $2, $3 }' "$MANIFEST"
    } >"$DOC"
    say "wrote $DOC"
fi
say "L1 run ${t_l1}s, total $(elapsed "$t_all")s; serial log: $log"
echo "vmm bench: $((RUNS * 2)) runs, pcow/raw total-time ratio $(awk -v a="$(stats pcow total | cut -d' ' -f1)" -v b="$(stats raw total | cut -d' ' -f1)" 'BEGIN { printf "%.2f", a / b }')"
