# shellcheck shell=sh
# L1 side of scripts/sandbox/guest-bench.sh (busybox sh; the payload's
# run.sh, in /payload).
#
# gb.conf (written by guest-bench.sh): ROUNDS, JOBS, VARIANTS, SIZES
# (job:bytes,...), MEM, RUN_TIMEOUT, WARMUP, PROFILE (1: the profiled runs
# at the end).
# The payload: cloud-hypervisor, pcow-img, qemu/ (Debian's
# qemu-system-x86_64, qemu-img, firmware), l2/ (kernel + initramfs with fio),
# images: pristine.raw.gz (the ext4), pcow-snap.pcow (pcow, snapshot taken),
# pcow-base.pcow (overlays' base), qcow2-snap.qcow2 (internal snapshot
# taken), qcow2-base.qcow2 (overlays' backing file).
#
# For every round, every variant (their order rotated by one each round, so
# that none always runs first or last): a fresh image (a copy of the
# pristine one, or a new overlay on the read-only base), one VM boot that
# runs the jobs one after the other (a boot with fio's libraries in the
# initramfs costs 20-60 s here, so one boot per job would not fit), and
#   GB-BOOT round=R variant=V rc=N guest=ok|FAIL wall=S
# followed by the guest's GB-FIO-BEGIN..GB-FIO-END blocks, one per job. A
# failed boot also prints the last lines of its output. PROFILE=1 then
# boots each pcow variant once more with the VMM's debug log and prints
# what its barriers did during each job (GB-PROF lines): not counted in the
# medians.
cd /payload || exit 1
. ./gb.conf
# GB_DIRTY_RING=off: our VMM follows KVM's dirty bitmap, not its ring.
[ -z "${DIRTY_RING:-}" ] || export PCOW_DIRTY_RING="$DIRTY_RING"
up() { cut -d' ' -f1 /proc/uptime; }
T0=$(up)
gunzip -c pristine.raw.gz >/tmp/pristine.raw && rm pristine.raw.gz || exit 2
for f in pcow-snap.pcow pcow-base.pcow qcow2-snap.qcow2 qcow2-base.qcow2; do
    mv "$f" "/tmp/$f" || exit 2
done
chmod 444 /tmp/pcow-base.pcow /tmp/qcow2-base.qcow2
echo "GB-L1 $(./cloud-hypervisor --version 2>&1 | head -n1); $(./qemu/qemu-system-x86_64 --version | head -n1)"
echo "GB-L1 images ready after $(awk -v a="$T0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')s"

# prepare VARIANT: /tmp/work.* fresh for one run; prints the VMM's disk
# arguments' file.
prepare() {
    rm -f /tmp/work.*
    case $1 in
        raw-dax | raw-blk) cat /tmp/pristine.raw >/tmp/work.raw && echo /tmp/work.raw ;;
        pcow-snap) cp /tmp/pcow-snap.pcow /tmp/work.pcow && echo /tmp/work.pcow ;;
        pcow-ovl) ./pcow-img create -q -b /tmp/pcow-base.pcow -F pcow /tmp/work.pcow && echo /tmp/work.pcow ;;
        qcow2-snap) cp /tmp/qcow2-snap.qcow2 /tmp/work.qcow2 && echo /tmp/work.qcow2 ;;
        qcow2-bak) ./qemu/qemu-img create -q -f qcow2 -b /tmp/qcow2-base.qcow2 -F qcow2 /tmp/work.qcow2 && echo /tmp/work.qcow2 ;;
        *) return 1 ;;
    esac
}

# boot VARIANT JOBS FILE [VMM_LOG_FLAG]: one VM run, its output in
# /tmp/run.log. While it runs, `GB-ALIVE` every 20 s on the console: a
# console silent for longer is a frozen L1 (guest-bench.sh's stall watcher),
# not a slow boot. Only while a VM runs, so that it never lands inside
# the base64 blocks printed after it.
boot() {
    v=$1 jobs=$2 file=$3 vflag=${4:-}
    (while sleep 20; do echo "GB-ALIVE"; done) &
    alive=$!
    # L1's memory while the VM runs (the boot's lowest is printed after
    # it): L1 has no swap, and its tmpfs holds every image.
    (while sleep 1; do grep -E '^MemAvailable:' /proc/meminfo; done >/tmp/mem.txt) &
    memw=$!
    cmd="console=ttyS0 panic=-1 quiet gb.jobs=$(echo "$jobs" | tr ' ' ',') gb.sizes=$SIZES"
    case $v in
        raw-dax | pcow-*)
            # shellcheck disable=SC2086
            timeout -s KILL "$RUN_TIMEOUT" ./cloud-hypervisor $vflag --kernel l2/vmlinuz \
                --initramfs l2/initramfs.cpio --cmdline "$cmd gb.dev=pmem" --cpus boot=1 \
                --memory size=$MEM --pmem file="$file" --serial tty --console off \
                </dev/null >/tmp/run.log 2>&1
            ;;
        *)
            fmt=qcow2
            [ "$v" = raw-blk ] && fmt=raw
            timeout -s KILL "$RUN_TIMEOUT" ./qemu/qemu-system-x86_64 -L ./qemu/share -accel kvm \
                -cpu host -m "$MEM" -smp 1 -nographic -nodefaults -serial stdio -no-reboot \
                -kernel l2/vmlinuz -initrd l2/initramfs.cpio -append "$cmd gb.dev=blk" \
                -drive "file=$file,if=none,id=d0,format=$fmt,cache=writeback" \
                -device virtio-blk-pci,drive=d0 </dev/null >/tmp/run.log 2>&1
            ;;
    esac
    brc=$?
    kill "$alive" "$memw" 2>/dev/null
    wait "$alive" "$memw" 2>/dev/null
    echo "GB-MEMMIN $(awk '{ print $2 }' /tmp/mem.txt | sort -n | head -n1) kB"
    return $brc
}

# The schedule: every boot (the warm-up, each round's variants, the
# profiled boots) has an index; `GB-START i=K ...` before it. SKIP=K (from
# guest-bench.sh, after L1 hung in an earlier attempt) skips the boots
# before index K: they were done, or given up, in that attempt.
sched=-1
# next ROUND VARIANT: says whether the next boot of the schedule runs here.
next() {
    sched=$((sched + 1))
    [ "$sched" -ge "${SKIP:-0}" ] || return 1
    echo "GB-START i=$sched round=$1 variant=$2 at=$(awk -v a="$T0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')s"
    # guest-bench.sh's GB_TEST_FREEZE: a frozen L1, as seen from outside.
    if [ "${FREEZE_AT:-}" = "$sched" ]; then
        while :; do sleep 3600; done
    fi
}

# one ROUND VARIANT JOBS: prepare, boot, report.
nfail=0
one() {
    r=$1 v=$2 jobs=$3
    next "$r" "$v" || return 0
    t=$(up)
    if ! file=$(prepare "$v"); then
        echo "GB-BOOT round=$r variant=$v rc=-1 guest=FAIL wall=0 (preparing the image failed)"
        nfail=$((nfail + 1))
        echo "GB-DONE i=$sched"
        return
    fi
    boot "$v" "$jobs" "$file"
    rc=$?
    wall=$(awk -v a="$t" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')
    g=FAIL
    tr -d '\r' </tmp/run.log >/tmp/run.txt
    grep -q 'L2-RESULT rc=0' /tmp/run.txt && g=ok
    echo "GB-BOOT round=$r variant=$v rc=$rc guest=$g wall=$wall"
    # The job markers and the timing probe's slow events
    # (guest-bench-timing.patch), in the order written, then fio's output.
    sed -n '/^GB-MOUNT/p; /^GB-JOB-/p; /SLOWPROBE/p; /^GB-FIO-BEGIN/,/^GB-FIO-END/p' /tmp/run.txt
    if [ $g != ok ] || [ $rc -ne 0 ]; then
        nfail=$((nfail + 1))
        tail -n 25 /tmp/run.txt | sed 's/^/  L2| /'
    fi
    echo "GB-DONE i=$sched"
}

# rotate N WORDS...: the words, starting with the (N mod count)-th.
rotate() {
    n=$1
    shift
    k=$((n % $#))
    i=0
    out=
    for w in "$@"; do
        if [ $i -ge $k ]; then out="$out $w"; fi
        i=$((i + 1))
    done
    i=0
    for w in "$@"; do
        if [ $i -lt $k ]; then out="$out $w"; fi
        i=$((i + 1))
    done
    echo "${out# }"
}

if [ "${WARMUP:-1}" = 1 ]; then
    # The first KVM VM of this L1, caches: not counted.
    one 0 raw-dax randread
fi
r=1
while [ $r -le "$ROUNDS" ]; do
    # shellcheck disable=SC2086
    for v in $(rotate $((r - 1)) $VARIANTS); do one "$r" "$v" "$JOBS"; done
    echo "GB-L1 round $r done at $(awk -v a="$T0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')s"
    r=$((r + 1))
done

# Profiled runs: the VMM's debug log has one line per guest FLUSH
# ("pmem FLUSH barrier: found= copied= tracked= held_us= scan_us=") and at
# exit the fault counters. Each FLUSH line is counted for the job whose
# GB-JOB-BEGIN..GB-JOB-END it falls in (the VMM writes the serial output
# and its log from one process, in order), and summed here, so that one
# line per job crosses the serial console.
# PROFILE_LOG=1 (GB_PROFILE_LOG): raw-DAX boots once more too, and each
# profiled boot's whole output (the guest's serial and the VMM's log, in
# the order written) crosses the console gzipped and base64-encoded between
# GB-PROF-LOG-BEGIN and GB-PROF-LOG-END, for guest-bench-breakdown.py.
# kvm_stats: L1's KVM's global counters (debugfs), NAME=VALUE per line,
# read by one process (a fork per file costs milliseconds here).
kvm_stats() {
    [ -d /sys/kernel/debug/kvm ] || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
    grep -H . /sys/kernel/debug/kvm/* 2>/dev/null | sed 's|.*/||; s/:/=/'
}
if [ "${PROFILE:-1}" = 1 ]; then
    pvars="pcow-snap pcow-ovl"
    [ "${PROFILE_LOG:-0}" = 1 ] && pvars="$pvars raw-dax"
    for v in $pvars; do
        case " $VARIANTS " in *" $v "*) ;; *) continue ;; esac
        next prof "$v" || continue
        file=$(prepare "$v") || {
            nfail=$((nfail + 1))
            echo "GB-DONE i=$sched"
            continue
        }
        # PROFILE_LOG: L1's KVM counters at each job's start and end (they
        # sum over live VMs only, so they are read while the VM runs: when
        # the guest's GB-JOB-BEGIN/END appears in its output, polled every
        # 0.3 s), added to the boot's output as GB-KVM-SNAP lines.
        if [ "${PROFILE_LOG:-0}" = 1 ]; then
            rm -f /tmp/kvmjobs.txt
            (
                n=0
                while :; do
                    c=$(grep -c '^GB-JOB-' /tmp/run.log 2>/dev/null)
                    if [ "${c:-0}" != "$n" ]; then
                        n=$c
                        m=$(grep '^GB-JOB-' /tmp/run.log | tail -n1 | tr -d '\r')
                        kvm_stats | tr '\n' ' ' | sed "s/^/GB-KVM-SNAP $m at=$(up) /"
                        echo
                    fi
                    sleep 0.3
                done
            ) >/tmp/kvmjobs.txt 2>/dev/null &
            sampler=$!
        fi
        t=$(up)
        boot "$v" "$JOBS" "$file" -vv
        rc=$?
        if [ "${PROFILE_LOG:-0}" = 1 ]; then
            kill "$sampler" 2>/dev/null
            wait "$sampler" 2>/dev/null
        fi
        wall=$(awk -v a="$t" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')
        tr -d '\r' </tmp/run.log >/tmp/run.txt
        g=FAIL
        grep -q 'L2-RESULT rc=0' /tmp/run.txt && g=ok
        [ $g = ok ] && [ $rc -eq 0 ] || nfail=$((nfail + 1))
        if [ "${PROFILE_LOG:-0}" = 1 ]; then
            cat /tmp/kvmjobs.txt >>/tmp/run.txt 2>/dev/null
            echo "GB-PROF-LOG-BEGIN variant=$v rc=$rc guest=$g wall=$wall"
            gzip -9 -c /tmp/run.txt | base64
            echo "GB-PROF-LOG-END"
        fi
        # raw-DAX has no barriers: its log is the only output wanted.
        if [ "$v" = raw-dax ]; then
            echo "GB-DONE i=$sched"
            continue
        fi
        echo "GB-PROF-BOOT variant=$v rc=$rc guest=$g wall=$wall"
        awk -v v="$v" '
            function flush_job() {
                if (job == "") return
                for (i = 2; i <= n; i++) { x = h[i]; j = i - 1; while (j > 0 && h[j] > x) { h[j + 1] = h[j]; j-- } h[j + 1] = x }
                med = n ? h[int((n + 1) / 2)] : 0
                printf "GB-PROF variant=%s job=%s barriers=%d tracked=%d found=%d copied=%d held_ms=%.1f held_p50_us=%d scan_ms=%.1f\n",
                    v, job, n, tracked, found, copied, held / 1000, med, scan / 1000
                job = ""; n = 0; tracked = 0; found = 0; copied = 0; held = 0; scan = 0
            }
            /^GB-JOB-BEGIN job=/ { job = $0; sub(/.*job=/, "", job); n = 0; next }
            /^GB-JOB-END/ { flush_job(); next }
            /pmem FLUSH barrier:/ && job != "" {
                n++
                for (i = 1; i <= NF; i++) {
                    split($i, kv, "=")
                    if (kv[1] == "found") found += kv[2]
                    if (kv[1] == "copied") copied += kv[2]
                    if (kv[1] == "held_us") { held += kv[2]; h[n] = kv[2] }
                    if (kv[1] == "scan_us") scan += kv[2]
                    if (kv[1] == "tracked" && kv[2] == "true") tracked++
                }
            }
            /pmem .*: faults:/ { f = $0; sub(/.*faults: /, "", f); gsub(/,/, "", f) }
            END { printf "GB-PROF-FAULTS variant=%s faults=\"%s\"\n", v, f }' /tmp/run.txt
        sed -n '/^GB-FIO-BEGIN/,/^GB-FIO-END/p' /tmp/run.txt | sed 's/^GB-FIO-BEGIN/GB-PROF-FIO-BEGIN/; s/^GB-FIO-END/GB-PROF-FIO-END/'
        if [ $g != ok ]; then tail -n 25 /tmp/run.txt | sed 's/^/  L2| /'; fi
        echo "GB-DONE i=$sched"
    done
fi
echo "GB-L1 done: $nfail failed run(s), $(awk -v a="$T0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')s"
[ $nfail -eq 0 ]
