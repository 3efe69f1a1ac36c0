# shellcheck shell=sh disable=SC2086,SC2317
# L1 side of scripts/sandbox/vmm-scenarios.sh: the payload's run.sh (busybox
# sh, run by L1's init in /payload). Runs the VMM scenarios one after the
# other, each VMM run under `timeout -s KILL`, and leaves the images in /out
# for the host-side checks.
#
# /payload holds: vmm.conf (VMM=ch|qemu, SIZE, SIZE6 (scenario 6) and SIZE8
# (scenario 8's raw device) in bytes,
# BOOT_TIMEOUT=s, SCENARIOS, S9_FILES (scenario 9's file count)),
# cloud-hypervisor and ch-remote (VMM=ch) or qemu/ (VMM=qemu, the stand-in:
# raw images only, see img_* below; no API, so no scenario 9), pcow-img,
# l2/{vmlinuz,initramfs.cpio}, img/*.
# Markers (parsed by vmm-scenarios.sh):
#   VMMSC-BOOT NAME exit=N time=S [TIMEOUT]   one VMM run (L2 serial follows,
#                                             prefixed "  L2[NAME]| ")
#   VMMSC-INFO K key=value                    facts the host checks use
#   VMMSC-API NAME rc=N: OUTPUT               one ch-remote call (scenario 9;
#                                             stdout+stderr, one line)
#   VMMSC-RESULT K PASS|FAIL reason           scenario K's L1-side verdict
cd /payload || exit 1
. ./vmm.conf
# GUEST_VERBOSE=1 (VMMSC_GUEST_VERBOSE): the guest kernel logs its boot.
KCMD="console=ttyS0 panic=-1 quiet"
[ "${GUEST_VERBOSE:-0}" = 1 ] && KCMD="console=ttyS0 panic=-1 ignore_loglevel"
L=/tmp/logs

# ---- the VMM ------------------------------------------------------------------
# vmm_exec PMEM_SPECS EXTRA_CMDLINE [OPTS]: exec the VMM (Cloud Hypervisor's
# options; the QEMU stand-in translates them). PMEM_SPECS: one --pmem value or
# several separated by spaces (one device each, in order). OPTS, words:
# cpus=N (--cpus boot=N, default 1), v (-v: info log lines on stderr), vv
# (-vv: debug lines too, ours only),
# reboot (the QEMU stand-in reboots in place instead of exiting, as ours does),
# api=PATH (--api-socket path=PATH; ours only), console=MODE (--console MODE,
# default off; ours only), mem=SIZE (--memory size=SIZE, default 256M).
vmm_exec() {
    cpus=1
    verbose=
    noreboot=-no-reboot
    api=
    console=off
    mem=256M
    for o in ${3:-}; do
        case $o in
            cpus=*) cpus=${o#cpus=} ;;
            v) verbose=-v ;;
            vv) verbose=-vv ;;
            reboot) noreboot= ;;
            api=*) api=${o#api=} ;;
            console=*) console=${o#console=} ;;
            mem=*) mem=${o#mem=} ;;
        esac
    done
    # VMM_LOG=vv (VMMSC_VMM_LOG): debug lines from every VMM run.
    [ "${VMM_LOG:-}" = vv ] && verbose=-vv
    pm=$1
    cmd=$2
    set --
    if [ "$VMM" = ch ]; then
        for p in $pm; do set -- "$@" --pmem "$p"; done
        [ -z "$api" ] || set -- "$@" --api-socket "path=$api"
        exec ./cloud-hypervisor $verbose --kernel l2/vmlinuz --initramfs l2/initramfs.cpio \
            --cmdline "$KCMD $cmd" --cpus boot=$cpus --memory size=$mem \
            "$@" --serial tty --console "$console"
    fi
    k=0
    for p in $pm; do
        file=
        size=
        share=on
        IFS=,
        for kv in $p; do
            case $kv in
                file=*) file=${kv#file=} ;;
                size=*) size=${kv#size=} ;;
                discard_writes=on) share=off ;;
            esac
        done
        unset IFS
        [ -n "$size" ] || size=$(stat -c %s "$file")
        set -- "$@" -object "memory-backend-file,id=pm$k,share=$share,mem-path=$file,size=$size" \
            -device virtio-pmem-pci,memdev=pm$k,id=pmem$k
        k=$((k + 1))
    done
    exec ./qemu/qemu-system-x86_64 -L ./qemu/share -accel kvm -cpu host \
        -m $mem,slots=$((k + 1)),maxmem=1G -smp $cpus -nographic -nodefaults -serial stdio $noreboot \
        -kernel l2/vmlinuz -initrd l2/initramfs.cpio -append "$KCMD $cmd" "$@"
}
if [ "${1:-}" = __vmm ]; then
    shift
    vmm_exec "$@"
fi
# __restore OPTS SOCKET: a new VMM process restoring a VM snapshot
# (`--restore OPTS`, Cloud Hypervisor's syntax), its API on SOCKET, -v (or
# -vv with VMM_LOG=vv). Everything else (kernel, pmem, serial) comes from the
# snapshot's config.
if [ "${1:-}" = __restore ]; then
    v_=-v
    [ "${VMM_LOG:-}" = vv ] && v_=-vv
    exec ./cloud-hypervisor $v_ --api-socket "path=$3" --restore "$2"
fi
# __empty SOCKET: a VMM with nothing but its API (a VM comes by vm.restore).
if [ "${1:-}" = __empty ]; then
    v_=-v
    [ "${VMM_LOG:-}" = vv ] && v_=-vv
    exec ./cloud-hypervisor $v_ --api-socket "path=$2"
fi

up() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$1" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }'; }
mkdir -p $L /out

# boot NAME PMEM_SPECS EXTRA_CMDLINE [OPTS]: one VMM run (vmm_exec), serial
# (and the VMM's stderr) in $L/NAME.log; sets vrc (the VMM's exit status; 137
# after the timeout's SIGKILL).
boot() {
    t=$(up)
    timeout -s KILL "$BOOT_TIMEOUT" sh "$0" __vmm "$2" "$3" "${4:-}" </dev/null >$L/$1.log 2>&1
    vrc=$?
    s=$(since "$t")
    to=
    [ $vrc -eq 137 ] && awk -v s="$s" -v t="$BOOT_TIMEOUT" 'BEGIN { exit !(s >= t - 1) }' && to=" TIMEOUT"
    echo "VMMSC-BOOT $1 exit=$vrc time=${s}s$to"
    tr -d '\r' <$L/$1.log | sed "s/^/  L2[$1]| /"
}
# booted_ok NAME: the VMM exited 0 and the guest's checks passed (else sets why).
booted_ok() {
    if [ "$vrc" -ne 0 ]; then
        why="$1: VMM exit $vrc$to$(guest_said "$1")"
        return 1
    fi
    if ! grep -q 'L2-RESULT rc=0' $L/$1.log; then
        why="$1: guest failed$(guest_said "$1")"
        return 1
    fi
}
# The guest's last word: its GUEST-FAIL line, else its last L2- marker.
guest_said() {
    g=$(grep -o 'GUEST-FAIL.*' $L/$1.log | head -n1)
    [ -n "$g" ] || g=$(grep -o 'L2-[A-Z]*.*' $L/$1.log | tail -n1)
    [ -n "$g" ] || g="no L2 marker (serial: $(grep -v '^ *$' $L/$1.log | tail -n1 | cut -c1-100))"
    printf ' (%s)' "$g"
}
manifest_of() { sed -n 's/.*GUEST-MANIFEST \([0-9a-f]*\).*/\1/p' $L/$1.log | tail -n1; }
pmem_line_ok() { # NAME BYTES
    grep -q "L2-PMEM dev=/dev/pmem0 bytes=$2 mounted=ext4-dax" $L/$1.log && return 0
    why="$1: expected 'L2-PMEM dev=/dev/pmem0 bytes=$2 mounted=ext4-dax', got '$(grep -o 'L2-PMEM.*' $L/$1.log)'"
    return 1
}
sha() { sha256sum "$1" | cut -d' ' -f1; }

# alive PID: the process exists and is not a zombie (kill -0 succeeds on a
# zombie until the shell reaps it).
alive() { [ -r /proc/$1/stat ] && [ "$(cut -d' ' -f3 /proc/$1/stat)" != Z ]; }
# stall_dump PID: where each thread of the VMM (PID is the sh that execs it)
# waits, for a run about to be SIGKILLed: state, wchan, syscall, kernel stack.
stall_dump() {
    echo "VMMSC-STALL threads of pid $1:"
    for t in /proc/$1/task/*; do
        echo "VMMSC-STALL $(basename $t) $(cat $t/comm 2>/dev/null) state=$(cut -d' ' -f3 $t/stat 2>/dev/null) wchan=$(cat $t/wchan 2>/dev/null) syscall=$(cut -d' ' -f1 $t/syscall 2>/dev/null)"
        sed 's/^/VMMSC-STALL     /' $t/stack 2>/dev/null | head -n 12
    done
}
# boot_watch NAME PMEM_SPECS EXTRA_CMDLINE OPTS MAX_BOOTS: as boot, but the VMM
# runs in the background and is SIGKILLed as soon as its serial shows more
# than MAX_BOOTS guest boots (L2-BOOTED): a guest that reboots forever (its
# first boot's writes lost) fails at once instead of at the timeout; also
# when a guest that said GUEST-REBOOTING has not booted again
# REBOOT_STALL seconds (default 45) later (the reboot hung): then where the
# VMM's threads wait is printed (VMMSC-STALL lines). Prints how long each
# reboot took (VMMSC-INFO reboot).
boot_watch() {
    t=$(up)
    sh "$0" __vmm "$2" "$3" "$4" </dev/null >$L/$1.log 2>&1 &
    pid=$!
    to=
    tr_=
    gaps=
    first=
    while alive $pid; do
        sleep 0.2
        nb=$(grep -c L2-BOOTED $L/$1.log)
        nr=$(grep -c GUEST-REBOOTING $L/$1.log)
        [ -n "$first" ] || [ "$nb" -eq 0 ] || first=$(since "$t")
        if [ "$nb" -gt "$5" ]; then
            to=" (SIGKILL: more than $5 guest boots)"
        elif [ "$nr" -ge "$nb" ] && [ "$nr" -gt 0 ]; then
            # A reboot is pending: since when?
            [ -n "$tr_" ] || tr_=$(up)
            awk -v a="$tr_" -v b="$(up)" -v s="${REBOOT_STALL:-45}" 'BEGIN { exit !(b - a > s) }' \
                && to=" (SIGKILL: no new guest boot ${REBOOT_STALL:-45} s after GUEST-REBOOTING)"
        else
            [ -z "$tr_" ] || gaps="$gaps $(since "$tr_")"
            tr_=
        fi
        awk -v a="$t" -v b="$(up)" -v s="$BOOT_TIMEOUT" 'BEGIN { exit !(b - a > s) }' && to=" TIMEOUT"
        if [ -n "$to" ]; then
            # Not into the log: the VMM, still running, writes there at its
            # own offset.
            stall_dump $pid >$L/$1.stall
            kill -9 $pid
            break
        fi
    done
    wait $pid
    vrc=$?
    echo "VMMSC-BOOT $1 exit=$vrc time=$(since "$t")s$to"
    tr -d '\r' <$L/$1.log | sed "s/^/  L2[$1]| /"
    [ ! -f $L/$1.stall ] || cat $L/$1.stall
    [ -z "$gaps" ] || echo "VMMSC-INFO reboot $1 VMM start -> L2-BOOTED: $first s; GUEST-REBOOTING -> next L2-BOOTED:$gaps s"
}
# vmm_logged NAME TEXT: the VMM's -v log has TEXT (always true for the QEMU
# stand-in, which has no such log).
vmm_logged() { [ "$VMM" != ch ] || grep -qF "$2" $L/$1.log; }

# ---- images -------------------------------------------------------------------
# With our VMM the images are pcow and pcow-img does the offline work. The
# QEMU stand-in cannot read pcow: it gets raw copies (pcow-img convert), and
# snapshots/overlays are emulated with copies; the images go back to the host
# as pcow either way.
img_in() { # NAME -> prints the image's path in /tmp
    if [ "$VMM" = ch ]; then
        mv img/$1.pcow /tmp/$1.pcow && echo /tmp/$1.pcow
    else
        pcow-img convert -f pcow -O raw img/$1.pcow /tmp/$1.img && rm img/$1.pcow && echo /tmp/$1.img
    fi
}
img_overlay() { # BASE_NAME OVERLAY_NAME -> prints the overlay's path
    if [ "$VMM" = ch ]; then
        (cd /tmp && pcow-img create -b "$1.pcow" -F pcow "$2.pcow" >/dev/null) && echo /tmp/$2.pcow
    else
        cp /tmp/$1.img /tmp/$2.img && echo /tmp/$2.img
    fi
}
img_snapshot() { # -c|-a TAG IMAGE
    if [ "$VMM" = ch ]; then
        pcow-img snapshot "$1" "$2" "$3"
    elif [ "$1" = -c ]; then
        cp "$3" "$3.snap-$2"
    else
        cp "$3.snap-$2" "$3"
    fi
}
# img_check IMAGE: sets crc to pcow-img check's status (0 under the stand-in).
img_check() {
    if [ "$VMM" = ch ]; then
        pcow-img check "$1" >$L/check.txt 2>&1
        crc=$?
        echo "VMMSC-CHECK $(basename "$1") rc=$crc: $(tr '\n' ' ' <$L/check.txt | cut -c1-200)"
    else
        crc=0
    fi
}
img_out() { # IMAGE...: to /out (as pcow)
    for i in "$@"; do
        case $i in
            *.pcow) cp "$i" /out/ ;;
            *.img) pcow-img convert -f raw -O pcow "$i" "/out/$(basename "$i" .img).pcow" ;;
        esac
    done
}

# ---- scenarios ----------------------------------------------------------------
sc1() {
    img=$(img_in s1) || { why="no image"; return 1; }
    boot s1-write "file=$img" "l2.scenario=s1write"
    img_out "$img"
    booted_ok s1-write && pmem_line_ok s1-write "$SIZE" || return 1
    m1=$(manifest_of s1-write)
    img_check "$img"
    [ $crc -eq 0 ] || { why="pcow-img check after the first boot: rc=$crc"; return 1; }
    len=$(stat -c %s "$img")
    echo "VMMSC-INFO 1 file_bytes=$len virtual_bytes=$SIZE"
    note="image file $((len / 1024)) KiB for $((SIZE / 1048576)) MiB virtual"
    if [ "$VMM" = ch ] && [ $((len * 4)) -ge "$SIZE" ]; then
        why="image file is $len bytes, not far smaller than its virtual size $SIZE"
        return 1
    fi
    boot s1-read "file=$img,size=$((SIZE / 1048576))M" "l2.scenario=s1read"
    img_out "$img"
    booted_ok s1-read && pmem_line_ok s1-read "$SIZE" || return 1
    [ "$(manifest_of s1-read)" = "$m1" ] || { why="second boot sees listing $(manifest_of s1-read), first wrote $m1"; return 1; }
    note="$note; 2nd boot read back every file"
}

sc2() {
    img=$(img_in s2) || { why="no image"; return 1; }
    boot s2-v1 "file=$img" "l2.scenario=s2v1"
    booted_ok s2-v1 || { img_out "$img"; return 1; }
    m1=$(manifest_of s2-v1)
    img_snapshot -c v1 "$img" || { why="pcow-img snapshot -c v1 failed"; return 1; }
    boot s2-change "file=$img" "l2.scenario=s2change"
    booted_ok s2-change || { img_out "$img"; return 1; }
    m2=$(manifest_of s2-change)
    [ "$m2" != "$m1" ] || { why="the changes did not change the listing"; return 1; }
    img_snapshot -a v1 "$img" || { why="pcow-img snapshot -a v1 failed"; return 1; }
    img_check "$img"
    [ $crc -eq 0 ] || { why="pcow-img check after the rollback: rc=$crc"; img_out "$img"; return 1; }
    boot s2-verify "file=$img" "l2.scenario=s2verify"
    img_out "$img"
    booted_ok s2-verify || return 1
    [ "$(manifest_of s2-verify)" = "$m1" ] || { why="after rollback the listing is $(manifest_of s2-verify), the snapshot's was $m1"; return 1; }
    note="listing v1 $(echo "$m1" | cut -c1-12), changed $(echo "$m2" | cut -c1-12), after rollback = v1"
}

sc3() {
    base=$(img_in s3base) || { why="no image"; return 1; }
    h0=$(sha "$base")
    ova=$(img_overlay s3base s3ov-a) && ovb=$(img_overlay s3base s3ov-b) || { why="cannot create the overlays"; return 1; }
    boot s3-a "file=$ova" "l2.scenario=s3ovl l2.tag=a"
    booted_ok s3-a || { img_out "$base" "$ova" "$ovb"; return 1; }
    boot s3-b "file=$ovb" "l2.scenario=s3ovl l2.tag=b"
    booted_ok s3-b || { img_out "$base" "$ova" "$ovb"; return 1; }
    boot s3-a-again "file=$ova" "l2.scenario=s3check l2.tag=a"
    img_out "$base" "$ova" "$ovb"
    booted_ok s3-a-again || return 1
    h1=$(sha "$base")
    echo "VMMSC-INFO 3 base_sha_before=$h0 base_sha_after=$h1"
    [ "$h0" = "$h1" ] || { why="the base changed: sha256 $h0 -> $h1"; return 1; }
    for i in "$base" "$ova" "$ovb"; do
        img_check "$i"
        [ $crc -eq 0 ] || { why="pcow-img check $(basename "$i"): rc=$crc"; return 1; }
    done
    note="a and b each saw the base + own changes, base sha256 unchanged"
}

sc4() {
    base=$(img_in s4root) || { why="no image"; return 1; }
    h0=$(sha "$base")
    ov=$(img_overlay s4root s4ov) || { why="cannot create the overlay"; return 1; }
    boot s4-root "file=$ov" "root=/dev/pmem0 rootflags=dax l2.scenario=s4root"
    img_out "$base" "$ov"
    if ! grep -q 'L2-ROOT dev=/dev/pmem0 .*mounted=yes' $L/s4-root.log; then
        why="initramfs did not mount /dev/pmem0 as root$(guest_said s4-root)"
        return 1
    fi
    grep -q 'L2-ROOTFS-INIT' $L/s4-root.log || { why="the root image's /sbin/init did not start$(guest_said s4-root)"; return 1; }
    booted_ok s4-root || return 1
    h1=$(sha "$base")
    [ "$h0" = "$h1" ] || { why="the base changed: sha256 $h0 -> $h1"; return 1; }
    img_check "$ov"
    [ $crc -eq 0 ] || { why="pcow-img check s4ov: rc=$crc"; return 1; }
    note="switch_root to $(grep -o 'GUEST-ROOT.*' $L/s4-root.log | cut -d' ' -f2-), wrote /var/s4-written.txt, base unchanged"
}

sc5() {
    img=$(img_in s5) || { why="no image"; return 1; }
    want=${S5_KILL_AFTER:-12}
    t=$(up)  # (boot's variable too)
    sh "$0" __vmm "file=$img" "l2.scenario=s5loop" </dev/null >$L/s5-loop.log 2>&1 &
    pid=$!
    i=0
    while [ $i -lt $((BOOT_TIMEOUT * 10)) ] && kill -0 $pid 2>/dev/null && ! grep -qE "^SYNCED $want(\$|[^0-9])" $L/s5-loop.log; do
        sleep 0.1
        i=$((i + 1))
    done
    alive=no
    kill -0 $pid 2>/dev/null && alive=yes
    kill -9 $pid 2>/dev/null
    wait $pid
    vrc=$?
    echo "VMMSC-BOOT s5-loop exit=$vrc time=$(since "$t")s (SIGKILL when SYNCED $want appeared; alive=$alive)"
    tr -d '\r' <$L/s5-loop.log | sed "s/^/  L2[s5-loop]| /"
    nsync=$(sed -n 's/^SYNCED \([0-9]*\).*/\1/p' $L/s5-loop.log | tail -n1)
    nsync=${nsync:-0}
    echo "VMMSC-INFO 5 synced=$nsync"
    if [ "$alive" = no ] || [ "$nsync" -lt "$want" ]; then
        img_out "$img"
        why="the guest never reported SYNCED $want (VMM exit $vrc$(guest_said s5-loop))"
        return 1
    fi
    img_check "$img"
    c1=$crc
    if [ $c1 -ne 0 ] && [ $c1 -ne 3 ]; then
        img_out "$img"
        why="pcow-img check after SIGKILL: rc=$c1 (corrupt)"
        return 1
    fi
    boot s5-verify "file=$img" "l2.scenario=s5verify l2.n=$nsync"
    img_out "$img"
    booted_ok s5-verify || return 1
    img_check "$img"
    if [ $crc -ne 0 ] && [ $crc -ne 3 ]; then
        why="pcow-img check after the verifying boot: rc=$crc"
        return 1
    fi
    note="killed after SYNCED $nsync, check rc=$c1 after the kill (rc=$crc after the next boot), all $nsync files intact"
}

sc6() {
    raw=/tmp/s6.raw
    gunzip -c img/s6.raw.gz >$raw && rm img/s6.raw.gz || { why="no image"; return 1; }
    boot s6-raw "file=$raw" "l2.scenario=s6raw"
    booted_ok s6-raw && pmem_line_ok s6-raw "$SIZE6" || { cp $raw /out/; return 1; }
    grep -q S6-RAW-MARKER-5b1d0c $raw || { why="the guest's write did not reach the raw file"; cp $raw /out/; return 1; }
    h0=$(sha $raw)
    boot s6-discard "file=$raw,discard_writes=on" "l2.scenario=s6discard"
    cp $raw /out/
    booted_ok s6-discard && pmem_line_ok s6-discard "$SIZE6" || return 1
    h1=$(sha $raw)
    echo "VMMSC-INFO 6 sha_before_discard=$h0 sha_after_discard=$h1"
    [ "$h0" = "$h1" ] || { why="discard_writes=on: the file changed (sha256 $h0 -> $h1)"; return 1; }
    ! grep -q S6-DISCARD-MARKER-9e2c47 $raw || { why="discard_writes=on: the guest's write reached the file"; return 1; }
    note="raw: write reached the file; discard_writes=on: read back in the guest, file byte-identical"
}

# sc7_reboot V: (a) `reboot -f` with the kernel's default method, (b) with
# reboot=t (triple fault): one VMM process, two guest boots.
sc7_reboot() {
    v=$1
    n=s7-reboot-$v${2:+-$2}
    # Repeats (S7_REBOOTS) boot fresh copies of the same image.
    [ -f img/s7$v.pcow ] || cp /tmp/s7$v.pristine img/s7$v.pcow
    img=$(img_in s7$v) || { why="no image"; return 1; }
    kc="l2.scenario=s7reboot l2.tag=$v"
    [ $v = b ] && kc="$kc reboot=t"
    boot_watch $n "file=$img" "$kc" "v reboot" 2
    img_out "$img"
    if [ -n "$to" ]; then
        why="$n: VMM exit $vrc$to; serial ends: '$(grep -v '^ *$' $L/$n.log | tail -n1 | tr -d '\r' | cut -c1-120)'"
        return 1
    fi
    booted_ok $n || return 1
    nb=$(grep -c L2-BOOTED $L/$n.log)
    [ "$nb" -eq 2 ] || { why="$n: $nb guest boots in the VMM run, expected 2"; return 1; }
    grep -q "GUEST-OK s7reboot: boot 2" $L/$n.log || { why="$n: the second boot did not see the first's file$(guest_said $n)"; return 1; }
    if [ "$VMM" = ch ]; then
        n1=$(grep -c 'guest started (boot 1)' $L/$n.log)
        n2=$(grep -c 'guest started (boot 2)' $L/$n.log)
        n3=$(grep -c 'guest started (boot [3-9]' $L/$n.log)
        [ "$n1" -eq 1 ] && [ "$n2" -eq 1 ] && [ "$n3" -eq 0 ] \
            || { why="$n: VMM log has 'guest started (boot 1)' x$n1, '(boot 2)' x$n2, later boots x$n3; expected 1, 1, 0"; return 1; }
        grep -q 'guest reset: booting again' $L/$n.log || { why="$n: no 'guest reset: booting again' in the VMM log"; return 1; }
        grep -q 'guest powered off' $L/$n.log || { why="$n: no 'guest powered off' in the VMM log"; return 1; }
    fi
    img_check "$img"
    [ $crc -eq 0 ] || { why="pcow-img check s7$v: rc=$crc"; return 1; }
    how=$(grep -o 'guest power event: Reset\|triple fault' $L/$n.log | head -n1)
    echo "VMMSC-INFO 7 $n=ok reset_by='${how:-?}'"
}

# sc7_term: SIGTERM while the guest writes + syncs in a loop.
sc7_term() {
    img=$(img_in s7c) || { why="no image"; return 1; }
    want=${S7_TERM_AFTER:-5}
    t=$(up)
    sh "$0" __vmm "file=$img" "l2.scenario=s7loop" "v" </dev/null >$L/s7-term.log 2>&1 &
    pid=$!
    i=0
    while [ $i -lt $((BOOT_TIMEOUT * 10)) ] && alive $pid && ! grep -qE "^SYNCED $want(\$|[^0-9])" $L/s7-term.log; do
        sleep 0.1
        i=$((i + 1))
    done
    was_alive=no
    alive $pid && was_alive=yes
    kill -TERM $pid 2>/dev/null
    tt=$(up)
    while alive $pid && awk -v a="$tt" -v b="$(up)" 'BEGIN { exit !(b - a < 10) }'; do
        sleep 0.1
    done
    late=
    alive $pid && { late=" (still running 10 s after SIGTERM: SIGKILL)"; kill -9 $pid; }
    wait $pid
    vrc=$?
    dt=$(since "$tt")
    echo "VMMSC-BOOT s7-term exit=$vrc time=$(since "$t")s (SIGTERM when SYNCED $want appeared; alive=$was_alive; exited ${dt}s after it)$late"
    tr -d '\r' <$L/s7-term.log | sed "s/^/  L2[s7-term]| /"
    nsync=$(sed -n 's/^SYNCED \([0-9]*\).*/\1/p' $L/s7-term.log | tail -n1)
    nsync=${nsync:-0}
    echo "VMMSC-INFO 7 synced=$nsync term_exit_s=$dt"
    if [ "$was_alive" = no ] || [ "$nsync" -lt "$want" ]; then
        img_out "$img"
        why="s7-term: the guest never reported SYNCED $want (VMM exit $vrc$(guest_said s7-term))"
        return 1
    fi
    if [ -n "$late" ] || [ $vrc -ne 0 ]; then
        img_out "$img"
        why="s7-term: after SIGTERM the VMM exited $vrc in ${dt}s$late, expected 0 within 10 s ($(grep -v '^SYNCED' $L/s7-term.log | tail -n2 | tr '\n' ' ' | cut -c1-200))"
        return 1
    fi
    if [ "$VMM" = ch ]; then
        vmm_logged s7-term 'stopped by signal 15' || { img_out "$img"; why="s7-term: no 'stopped by signal 15' in the VMM log"; return 1; }
        vmm_logged s7-term 'final barrier' || { img_out "$img"; why="s7-term: no 'final barrier' in the VMM log"; return 1; }
    fi
    img_check "$img"
    c1=$crc
    [ $c1 -eq 0 ] || { img_out "$img"; why="pcow-img check after SIGTERM: rc=$c1, expected 0 (the final barrier ran)"; return 1; }
    boot s7-term-verify "file=$img" "l2.scenario=s7verify l2.n=$nsync"
    img_out "$img"
    booted_ok s7-term-verify || return 1
    img_check "$img"
    [ $crc -eq 0 ] || { why="pcow-img check after the verifying boot: rc=$crc"; return 1; }
    tnote="SIGTERM after SYNCED $want: exit 0 in ${dt}s, check rc=0, all $nsync synced files intact"
}

sc7() {
    whys=
    # S7_REBOOTS (VMMSC_S7_REBOOTS, default 1): each reboot variant this
    # many times (a hunt for rare reboot hangs); stops at a variant's first
    # failure.
    reps=${S7_REBOOTS:-1}
    for v in a b; do cp img/s7$v.pcow /tmp/s7$v.pristine; done
    for part in "reboot a" "reboot b" term; do
        why=
        set -- $part
        k7=1
        while :; do
            rep=
            [ $k7 -gt 1 ] && rep=$k7
            if ! sc7_$1 ${2:-} $rep; then
                whys="${whys:+$whys; }$why"
                break
            fi
            [ $1 = reboot ] && [ $k7 -lt $reps ] || break
            k7=$((k7 + 1))
        done
    done
    [ "$reps" -gt 1 ] && echo "VMMSC-INFO 7 reboot_repeats=$reps"
    why=$whys
    [ -z "$whys" ] || return 1
    note="reboot -f (default method) and reboot=t: 1 VMM run each, 2 guest boots, file seen by boot 2; $tnote"
}

sc8() {
    img=$(img_in s8) || { why="no image"; return 1; }
    raw=/tmp/s8raw.raw
    gunzip -c img/s8raw.raw.gz >$raw && rm img/s8raw.raw.gz || { why="no raw image"; return 1; }
    boot s8-two "file=$img file=$raw" "l2.scenario=s8two" "cpus=2"
    img_out "$img"
    cp $raw /out/
    booted_ok s8-two && pmem_line_ok s8-two "$SIZE" || return 1
    grep -q "GUEST-CPUS n=2 " $L/s8-two.log || { why="s8-two: the guest does not see 2 CPUs: $(grep -o 'GUEST-CPUS.*' $L/s8-two.log)"; return 1; }
    tr -d '\r' <$L/s8-two.log | grep -q "GUEST-PMEM-SIZES pmem0=$SIZE pmem1=$SIZE8\$" \
        || { why="s8-two: expected 'GUEST-PMEM-SIZES pmem0=$SIZE pmem1=$SIZE8', got '$(grep -o 'GUEST-PMEM-SIZES.*' $L/s8-two.log)'"; return 1; }
    grep -q S8-RAW-MARKER-3f6a91 $raw || { why="the guest's write to /dev/pmem1 did not reach the raw file"; return 1; }
    img_check "$img"
    [ $crc -eq 0 ] || { why="pcow-img check s8: rc=$crc"; return 1; }
    note="2 vCPUs; pmem0 pcow $((SIZE / 1048576)) MiB + pmem1 raw $((SIZE8 / 1048576)) MiB, both ext4 dax, written, synced; raw file has its marker; check rc=0"
}

# ---- scenario 9: the API (ch-remote) on a running guest ------------------------
SOCK=/tmp/ch.sock
# api NAME ARGS...: one ch-remote call; stdout in $L/api-NAME.out, stderr in
# $L/api-NAME.err, status in arc; logged as a VMMSC-API line.
api() {
    an=$1
    shift
    ./ch-remote --api-socket $SOCK --timeout 30 "$@" >$L/api-$an.out 2>$L/api-$an.err
    arc=$?
    echo "VMMSC-API $an rc=$arc: $(cat $L/api-$an.out $L/api-$an.err | tr '\n' ' ' | tr -s ' ' | cut -c1-400)"
}
api_err() { tr '\n' ' ' <$L/api-$1.err | cut -c1-200; }
# JSON answers, without a JSON tool: flatten, then pick.
flat_json() { tr -d ' \n\r' <$L/api-$1.out; }
json_state() { flat_json "$1" | sed -n 's/.*"state":"\([A-Za-z]*\)".*/\1/p'; }
json_pid() { flat_json "$1" | sed -n 's/.*"pid":\([0-9]*\).*/\1/p'; }
json_tags() { flat_json "$1" | grep -o '"tag":"[^"]*"' | cut -d'"' -f4 | tr '\n' ' ' | sed 's/ $//'; }
json_chain_len() { flat_json "$1" | sed -n 's/.*"chain":\[\([^]]*\)\].*/\1/p' | tr ',' '\n' | grep -c .; }
last_synced() { s_=$(sed -n 's/^SYNCED \([0-9]*\).*/\1/p' "$1" | tail -n1); echo "${s_:-0}"; }
synced_ge() { [ "$(last_synced "$1")" -ge "$2" ]; }
# until_ SECONDS CMD...: runs CMD every 0.1 s until it succeeds (0), or the
# VMM ($pid) is gone, or SECONDS passed (1).
until_() {
    lim_=$1
    shift
    t0_=$(up)
    while ! "$@"; do
        alive $pid || return 1
        awk -v a="$t0_" -v b="$(up)" -v s="$lim_" 'BEGIN { exit !(b - a > s) }' && return 1
        sleep 0.1
    done
}
# snapshot_tags IMAGE: the tags `pcow-img snapshot -l` lists.
snapshot_tags() { pcow-img snapshot -l "$1" 2>&1 | awk '$1 ~ /^[0-9]+$/ { print $2 }' | tr '\n' ' ' | sed 's/ $//'; }
# vmm_end NAME T0 MAX_BOOTS STOP_PATTERN [KILL_NOW]: waits (at most
# BOOT_TIMEOUT since T0) for the background VMM $pid to exit; SIGKILLs it at
# once with KILL_NOW, or when its serial shows more than MAX_BOOTS guest boots
# or STOP_PATTERN more than once; sets vrc and to, prints VMMSC-BOOT and the
# serial (as boot).
vmm_end() {
    to=
    [ -n "${5:-}" ] && alive $pid && to=" (SIGKILL: $5)"
    while [ -z "$to" ] && alive $pid; do
        if [ "$(grep -c L2-BOOTED $L/$1.log)" -gt "$3" ]; then
            to=" (SIGKILL: more than $3 guest boots)"
        elif [ "$(grep -c "$4" $L/$1.log)" -gt 1 ]; then
            to=" (SIGKILL: '$4' twice)"
        elif awk -v a="$2" -v b="$(up)" -v s="$BOOT_TIMEOUT" 'BEGIN { exit !(b - a > s) }'; then
            to=" TIMEOUT"
        else
            sleep 0.2
        fi
    done
    [ -z "$to" ] || kill -9 $pid 2>/dev/null
    wait $pid
    vrc=$?
    echo "VMMSC-BOOT $1 exit=$vrc time=$(since "$2")s$to"
    tr -d '\r' <$L/$1.log | sed "s/^/  L2[$1]| /"
}

# live_run NAME PMEM_SPECS EXTRA_CMDLINE MAX_BOOTS STOP_PATTERN STEPS: the
# VMM (-v, the API on $SOCK) in the background as $pid, STEPS (a function
# that sets why on failure) while it runs, then vmm_end (at once with
# SIGKILL when the steps failed).
live_run() {
    rm -f $SOCK
    t=$(up)
    sh "$0" __vmm "$2" "$3" "v api=$SOCK" </dev/null >$L/$1.log 2>&1 &
    pid=$!
    why=
    if $6 && [ -z "$why" ]; then
        vmm_end "$1" "$t" "$4" "$5"
    else
        vmm_end "$1" "$t" "$4" "$5" "the API steps failed"
    fi
}

# sc9_snap TAG AFTER: once the serial shows SYNCED AFTER, records the last
# SYNCED n the serial log shows (rec_TAG), sends pmem-snapshot TAG, records
# the last SYNCED once it answered (post_TAG, information only).
sc9_snap() {
    until_ 60 synced_ge $L/s9-live.log "$2" \
        || { why="s9-live: no SYNCED $2 before the $1 request (last SYNCED $(last_synced $L/s9-live.log)$(alive $pid || echo ", the VMM is gone: the guest's $N9 files done before L1's API work? raise VMMSC_S9_FILES"))"; return 1; }
    r_=$(last_synced $L/s9-live.log)
    api snapshot-$1 pmem-snapshot "id=_pmem0,tag=$1"
    p_=$(last_synced $L/s9-live.log)
    eval "rec_$1=$r_ post_$1=$p_"
    echo "VMMSC-INFO 9 snap_$1=$r_ snap_$1_post=$p_"
    [ $arc -eq 0 ] || { why="s9-live: pmem-snapshot id=_pmem0,tag=$1: rc=$arc ($(api_err snapshot-$1))"; return 1; }
    [ "$(json_tags snapshot-$1)" = "$1" ] || { why="s9-live: pmem-snapshot $1 answered '$(flat_json snapshot-$1 | cut -c1-150)'"; return 1; }
}

# The API work while the guest loops (sets why on failure).
sc9_live_api() {
    until_ 60 test -S $SOCK || { why="s9-live: no API socket $SOCK$(guest_said s9-live)"; return 1; }
    api ping ping
    [ $arc -eq 0 ] && [ "$(json_pid ping)" = "$pid" ] || { why="s9-live: ping: rc=$arc, pid '$(json_pid ping)', expected $pid"; return 1; }
    sc9_snap s1 3 || return 1
    sc9_snap s2 $((rec_s1 + 3)) || return 1
    api info-base pmem-info
    [ $arc -eq 0 ] || { why="s9-live: pmem-info: rc=$arc ($(api_err info-base))"; return 1; }
    tb=$(json_tags info-base)
    cb=$(json_chain_len info-base)
    [ "$tb" = "s1 s2" ] && [ "$cb" -eq 1 ] || { why="s9-live: pmem-info before the overlay: snapshots '$tb' (expected 's1 s2'), chain of $cb (expected 1)"; return 1; }
    until_ 60 synced_ge $L/s9-live.log $((rec_s2 + 2)) || { why="s9-live: no SYNCED $((rec_s2 + 2)) before the overlay"; return 1; }
    rec_ov=$(last_synced $L/s9-live.log)
    api overlay pmem-overlay id=_pmem0,file=/tmp/s9ov.pcow
    echo "VMMSC-INFO 9 overlay_after=$rec_ov"
    [ $arc -eq 0 ] || { why="s9-live: pmem-overlay id=_pmem0,file=/tmp/s9ov.pcow: rc=$arc ($(api_err overlay))"; return 1; }
    flat_json overlay | grep -q '"base":"[^"]*s9.pcow"' || { why="s9-live: pmem-overlay answered '$(flat_json overlay | cut -c1-150)', no base s9.pcow"; return 1; }
    sc9_snap s3 $((rec_ov + 3)) || return 1
    api info-ov pmem-info
    [ $arc -eq 0 ] || { why="s9-live: pmem-info: rc=$arc ($(api_err info-ov))"; return 1; }
    to_=$(json_tags info-ov)
    co=$(json_chain_len info-ov)
    flat_json info-ov | grep -q '"file":"/tmp/s9ov.pcow"' || { why="s9-live: pmem-info after the overlay: the device's file is not /tmp/s9ov.pcow: $(flat_json info-ov | cut -c1-200)"; return 1; }
    [ "$co" -eq 2 ] || { why="s9-live: pmem-info after the overlay: chain of $co, expected 2: $(flat_json info-ov | sed -n 's/.*\("chain":\[[^]]*\]\).*/\1/p')"; return 1; }
    case " $to_ " in *" s3 "*) ;; *) why="s9-live: pmem-info after the overlay lists snapshots '$to_', no s3"; return 1 ;; esac
    api flush pmem-flush _pmem0
    [ $arc -eq 0 ] && flat_json flush | grep -q '"pages_copied":[0-9]' || { why="s9-live: pmem-flush _pmem0: rc=$arc ($(api_err flush)$(flat_json flush | cut -c1-100))"; return 1; }
    api info info
    [ $arc -eq 0 ] && [ "$(json_state info)" = Running ] || { why="s9-live: info: rc=$arc, state '$(json_state info)', expected Running"; return 1; }
    done_at=$(last_synced $L/s9-live.log)
    echo "VMMSC-INFO 9 api_done_at=$done_at files=$N9 info_base='$tb' info_overlay='$to_'"
    [ "$done_at" -lt "$N9" ] || { why="s9-live: the guest wrote its $N9 files before L1's API work ended (SYNCED $done_at): raise VMMSC_S9_FILES"; return 1; }
}

# Run A: snapshots, an overlay, flush, info while the guest writes + syncs
# f1..fN9, then the guest powers off; offline checks of both files.
sc9_live() {
    img=$(img_in s9) || { why="no image"; return 1; }
    N9=${S9_FILES:-22}
    rec_s1=0 rec_s2=0 rec_s3=0 rec_ov=0 done_at=0
    live_run s9-live "file=$img" "l2.scenario=s9loop l2.n=$N9" 1 GUEST-NEVER sc9_live_api
    ov=/tmp/s9ov.pcow
    img_out "$img"
    [ -f $ov ] && img_out $ov
    [ -z "$why" ] || return 1
    booted_ok s9-live || return 1
    vmm_logged s9-live 'guest powered off' || { why="s9-live: no 'guest powered off' in the VMM log"; return 1; }
    # Offline: the snapshots where they were taken, both files clean.
    tb=$(snapshot_tags $img)
    to_=$(snapshot_tags $ov)
    echo "VMMSC-INFO 9 base_snapshots='$tb' overlay_snapshots='$to_'"
    [ "$tb" = "s1 s2" ] || { why="pcow-img snapshot -l s9.pcow (the base): '$tb', expected 's1 s2'"; return 1; }
    [ "$to_" = s3 ] || { why="pcow-img snapshot -l s9ov.pcow (the overlay): '$to_', expected 's3'"; return 1; }
    pcow-img info $ov >$L/s9ov.info 2>&1
    grep -q '^backing file: s9.pcow ' $L/s9ov.info || { why="pcow-img info s9ov.pcow: '$(grep -i backing $L/s9ov.info | head -n1)', expected 'backing file: s9.pcow'"; return 1; }
    for i in $img $ov; do
        img_check $i
        [ $crc -eq 0 ] || { why="pcow-img check $(basename $i) after the live run: rc=$crc"; return 1; }
    done
}

# Run B: a guest on the overlay (snapshot s3): pmem-rollback without reset is
# refused (409), with --reset the same VMM process restarts the guest on s3.
sc9_reset() {
    ov=/tmp/s9ov.pcow
    h0=$(sha /tmp/s9.pcow)
    live_run s9-reset "file=$ov" "l2.scenario=s9reset l2.n=$rec_s3" 2 GUEST-S9-WAIT-RESET sc9_reset_api
    mkdir -p /out/s9r
    cp /tmp/s9.pcow $ov /out/s9r/
    [ -z "$why" ] || return 1
    booted_ok s9-reset || return 1
    nb=$(grep -c L2-BOOTED $L/s9-reset.log)
    [ "$nb" -eq 2 ] || { why="s9-reset: $nb guest boots, expected 2"; return 1; }
    grep -q 'GUEST-OK s9reset: boot 2' $L/s9-reset.log || { why="s9-reset: boot 2 did not verify the snapshot$(guest_said s9-reset)"; return 1; }
    vmm_logged s9-reset 'guest started (boot 2)' || { why="s9-reset: no 'guest started (boot 2)' in the VMM log"; return 1; }
    vmm_logged s9-reset 'rolled back to snapshot' || { why="s9-reset: no 'rolled back to snapshot' in the VMM log"; return 1; }
    [ "$(sha /tmp/s9.pcow)" = "$h0" ] || { why="s9-reset: the base s9.pcow changed"; return 1; }
    img_check $ov
    [ $crc -eq 0 ] || { why="pcow-img check s9ov.pcow after the reset run: rc=$crc"; return 1; }
}
sc9_reset_api() {
    until_ 60 grep -q GUEST-S9-WAIT-RESET $L/s9-reset.log \
        || { why="s9-reset: boot 1 never said GUEST-S9-WAIT-RESET$(guest_said s9-reset)"; return 1; }
    api reset-ping0 ping
    pid0=$(json_pid reset-ping0)
    api rollback-noreset pmem-rollback id=_pmem0,snapshot=s3
    [ $arc -eq 1 ] || { why="s9-reset: pmem-rollback id=_pmem0,snapshot=s3 without reset on a running VM: rc=$arc, expected 1 (409)"; return 1; }
    grep -qi 'reset' $L/api-rollback-noreset.err || { why="s9-reset: the refused rollback's message does not mention reset: $(api_err rollback-noreset)"; return 1; }
    api info-noreset info
    [ "$(json_state info-noreset)" = Running ] || { why="s9-reset: after the refused rollback the state is '$(json_state info-noreset)'"; return 1; }
    api rollback-reset pmem-rollback id=_pmem0,snapshot=s3,reset=on
    [ $arc -eq 0 ] && [ "$(json_tags rollback-reset)" = s3 ] || { why="s9-reset: pmem-rollback id=_pmem0,snapshot=s3,reset=on: rc=$arc ($(api_err rollback-reset)$(flat_json rollback-reset | cut -c1-100))"; return 1; }
    api info-reset info
    [ $arc -eq 0 ] && [ "$(json_state info-reset)" = Running ] || { why="s9-reset: info after the reset: rc=$arc, state '$(json_state info-reset)', expected Running"; return 1; }
    api reset-ping1 ping
    pid1=$(json_pid reset-ping1)
    [ "$pid0" = "$pid" ] && [ "$pid1" = "$pid" ] || { why="s9-reset: ping pid before/after the reset $pid0/$pid1, VMM $pid"; return 1; }
}

sc9() {
    [ "$VMM" = ch ] || { why="needs our VMM's API (VMMSC_VMM=qemu has none)"; return 1; }
    sc9_live || return 1
    lnote="live: s1 after SYNCED $rec_s1, s2 after $rec_s2, overlay after $rec_ov, s3 after $rec_s3 (L1 done at $done_at of $N9); base has s1 s2, overlay s3, check 0 x2"
    sc9_reset || return 1
    note="$lnote; rollback without reset refused ($(head -n1 $L/api-rollback-noreset.err | cut -c1-60)...), --reset: same VMM (pid $pid), state Running, boot 2 saw s3's f1..f$rec_s3, exit 0"
}

# ---- scenario 10: a full file system pauses the guest ---------------------------
# The image lives on a tmpfs with room for the image and about 10 MiB more; the
# guest writes S10_BYTES into one file. The VMM must pause the guest (state
# Paused, pause_reason and the device's out_of_space set), a resume while the
# file system is still full must be refused with the guest still paused, and
# after L1 grows the tmpfs, resume must let the guest finish: the file is
# complete and synced, check clean, and a second boot reads it back.
S10FS=/tmp/s10fs
s10_paused() {
    ./ch-remote --api-socket $SOCK --timeout 10 info >$L/s10-poll.out 2>&1 || return 1
    tr -d ' \n\r' <$L/s10-poll.out | grep -q '"state":"Paused"' || return 1
    tr -d ' \n\r' <$L/s10-poll.out | grep -q '"pause_reason":"[^"]'
}
sc10_api() {
    until_ 60 test -S $SOCK || { why="s10-fill: no API socket$(guest_said s10-fill)"; return 1; }
    until_ $BOOT_TIMEOUT s10_paused || { why="s10-fill: the VM never paused for space (the guest: $(guest_said s10-fill); last info: $(tr -d ' \n\r' <$L/s10-poll.out | cut -c1-200))"; return 1; }
    api s10-info-paused info
    reason=$(tr -d '\n\r' <$L/api-s10-info-paused.out | sed -n 's/.*"pause_reason": *"\([^"]*\)".*/\1/p')
    echo "VMMSC-INFO 10 pause_reason='$(echo "$reason" | cut -c1-160)' fs_used_kib=$(df -k $S10FS | awk 'NR == 2 { print $3 }') image_bytes=$(stat -c %s $S10FS/s10.pcow)"
    echo "$reason" | grep -q 'No space left on device' || { why="s10-fill: pause_reason does not name ENOSPC: $reason"; return 1; }
    api s10-pmem-info pmem-info
    tr -d '\n\r' <$L/api-s10-pmem-info.out | grep -q '"out_of_space": *"[^"]*No space left on device' || { why="s10-fill: pmem-info has no out_of_space: $(flat_json s10-pmem-info | cut -c1-200)"; return 1; }
    # No progress while paused: the serial log does not grow.
    s0=$(stat -c %s $L/s10-fill.log)
    sleep 1
    s1=$(stat -c %s $L/s10-fill.log)
    [ "$s0" = "$s1" ] || { why="s10-fill: the guest printed while paused ($s0 -> $s1 bytes of serial)"; return 1; }
    api s10-resume-full resume
    [ $arc -ne 0 ] || { why="s10-fill: resume with the file system still full was accepted"; return 1; }
    grep -q 'still out of space' $L/api-s10-resume-full.err || { why="s10-fill: the refused resume does not say why: $(api_err s10-resume-full)"; return 1; }
    api s10-info-still info
    [ "$(json_state s10-info-still)" = Paused ] || { why="s10-fill: after the refused resume the state is '$(json_state s10-info-still)'"; return 1; }
    mount -o remount,size=$((S10_FS_KIB + 65536))k $S10FS || { why="s10-fill: growing the tmpfs failed"; return 1; }
    api s10-resume resume
    [ $arc -eq 0 ] || { why="s10-fill: resume after freeing space: rc=$arc ($(api_err s10-resume))"; return 1; }
    api s10-info-running info
    [ "$(json_state s10-info-running)" = Running ] || { why="s10-fill: state after the resume '$(json_state s10-info-running)'"; return 1; }
    ! flat_json s10-info-running | grep -q '"pause_reason"' || { why="s10-fill: pause_reason not cleared (vm.info leaves it out once the VM runs again): $(flat_json s10-info-running | cut -c1-200)"; return 1; }
}
sc10() {
    [ "$VMM" = ch ] || { why="needs our VMM (pause on a full disk, the API)"; return 1; }
    img0=$(img_in s10) || { why="no image"; return 1; }
    mkdir -p $S10FS
    # Room for the image, its 4 MiB pool and about 10 MiB of growth.
    S10_FS_KIB=$(($(stat -c %s "$img0") / 1024 + 14336))
    mount -t tmpfs -o size=${S10_FS_KIB}k tmpfs $S10FS || { why="mount -t tmpfs failed"; return 1; }
    mv "$img0" $S10FS/s10.pcow
    img=$S10FS/s10.pcow
    live_run s10-fill "file=$img" "l2.scenario=s10fill l2.n=$S10_BYTES" 1 GUEST-NEVER sc10_api
    [ -z "$why" ] || { img_out "$img"; umount $S10FS; return 1; }
    booted_ok s10-fill || { img_out "$img"; umount $S10FS; return 1; }
    vmm_logged s10-fill 'VM paused' || { why="s10-fill: no 'VM paused' in the VMM log"; img_out "$img"; umount $S10FS; return 1; }
    img_check "$img"
    c1=$crc
    boot s10-verify "file=$img" "l2.scenario=s10verify l2.n=$S10_BYTES"
    img_out "$img"
    umount $S10FS
    [ $c1 -eq 0 ] || { why="pcow-img check after the paused run: rc=$c1"; return 1; }
    booted_ok s10-verify || return 1
    note="paused for space ($(echo "$reason" | sed 's/.*\(No space left on device\).*/\1/')), resume refused while full, resumed after the tmpfs grew, $((S10_BYTES / 1048576)) MiB file complete, check rc=0, read back on the next boot"
}

# ---- scenario 11: the kill campaign ----------------------------------------------
# S11_ITERS iterations on one image chain. Each boots the VMM with the API,
# the guest first verifies every file earlier iterations reported synced, then
# writes and syncs files; L1 sends a random API operation (snapshot, overlay,
# snapshot delete, or none) in the background and kill -9s the VMM at a random
# moment: after a random number of SYNCED lines and a random delay, so that
# some kills land inside the API operation. After each kill: the chain's files
# pass `pcow-img check` (0 or 3, leaks only); an overlay whose request never
# answered is kept if its file is a valid image on the current top (the VMM
# may have switched to it) and dropped otherwise; a chain of 3 is committed
# offline. A last boot verifies everything and powers off.
rnd() { od -An -N2 -tu2 /dev/urandom | tr -d ' '; }
s11_depth() { pcow-img info "$1" 2>/dev/null | grep -c '^backing file:' | awk -v d=1 '{ print d + $1 }'; }
sc11() {
    [ "$VMM" = ch ] || { why="needs our VMM's API"; return 1; }
    top=$(img_in s11) || { why="no image"; return 1; }
    iters=${S11_ITERS:-10}
    list=none
    depth=1
    snaps=
    nsnap=0 nov=0 ndel=0 ncommit=0 midapi=0 rc0=0 rc3=0 files=0
    i=1
    while [ $i -le "$iters" ]; do
        rm -f $SOCK
        t=$(up)
        sh "$0" __vmm "file=$top" "l2.scenario=s11loop l2.tag=$i l2.list=$list" "api=$SOCK" </dev/null >$L/s11.log 2>&1 &
        pid=$!
        kill_at=$((1 + $(rnd) % 5))
        op=$(($(rnd) % 4))
        [ $op -eq 2 ] && [ $depth -ge 3 ] && op=1
        [ $op -eq 3 ] && [ -z "$snaps" ] && op=1
        delay_ms=$(($(rnd) % 400))
        if ! until_ $BOOT_TIMEOUT grep -qE 'S11-VERIFIED|GUEST-FAIL' $L/s11.log; then
            kill -9 $pid 2>/dev/null
            wait $pid
            tr -d '\r' <$L/s11.log | sed "s/^/  L2[s11-$i]| /" | tail -n 30
            why="iteration $i: the guest never verified (VMM alive: $(alive $pid && echo yes || echo no))$(guest_said s11)"
            return 1
        fi
        if grep -q GUEST-FAIL $L/s11.log; then
            kill -9 $pid 2>/dev/null
            wait $pid
            tr -d '\r' <$L/s11.log | sed "s/^/  L2[s11-$i]| /" | tail -n 30
            why="iteration $i: $(grep -o 'S11-VERIFIED.*' $L/s11.log | head -n1): synced files lost$(guest_said s11)"
            echo "VMMSC-INFO 11 failed_at=$i lost=$(sed -n 's/.*S11-VERIFIED files=[0-9]* bad=\([0-9]*\).*/\1/p' $L/s11.log | head -n1)"
            return 1
        fi
        files=$(sed -n 's/.*S11-VERIFIED files=\([0-9]*\).*/\1/p' $L/s11.log | head -n1)
        op_at=$((1 + $(rnd) % kill_at))
        until_ 60 synced_ge $L/s11.log $op_at || true
        ov=
        apid=
        case $op in
            1) ./ch-remote --api-socket $SOCK --timeout 30 pmem-snapshot "id=_pmem0,tag=k$i" >$L/s11-api.out 2>&1 &
               apid=$! ;;
            2) ov=/tmp/s11-ov$i.pcow
               ./ch-remote --api-socket $SOCK --timeout 30 pmem-overlay "id=_pmem0,file=$ov" >$L/s11-api.out 2>&1 &
               apid=$! ;;
            3) victim=${snaps%% *}
               ./ch-remote --api-socket $SOCK --timeout 30 pmem-snapshot-delete "id=_pmem0,snapshot=$victim" >$L/s11-api.out 2>&1 &
               apid=$! ;;
        esac
        until_ 60 synced_ge $L/s11.log $kill_at || true
        usleep $((delay_ms * 1000)) 2>/dev/null || sleep 0.$(printf '%03d' $delay_ms)
        if ! alive $pid; then
            wait $pid
            vrc=$?
            tr -d '\r' <$L/s11.log | sed "s/^/  L2[s11-$i]| /" | tail -n 30
            why="iteration $i: the VMM ended by itself (exit $vrc) before the kill$(guest_said s11)"
            return 1
        fi
        kill -9 $pid 2>/dev/null
        wait $pid
        arc=-
        if [ -n "$apid" ]; then
            wait $apid
            arc=$?
            [ $arc -eq 0 ] || midapi=$((midapi + 1))
        fi
        n=$(last_synced $L/s11.log)
        echo "VMMSC-INFO 11 iteration=$i op=$op api_rc=$arc kill_after_synced=$kill_at+${delay_ms}ms synced=$n verified=$files"
        case $op in
            1) [ $arc -eq 0 ] && { nsnap=$((nsnap + 1)); snaps="$snaps${snaps:+ }k$i"; } ;;
            3) [ $arc -eq 0 ] && { ndel=$((ndel + 1)); snaps=${snaps#"$victim"}; snaps=${snaps# }; } ;;
        esac
        if [ -n "$ov" ]; then
            keep=no
            if [ $arc -eq 0 ]; then
                keep=yes
            elif [ -f $ov ] && pcow-img check $ov >/dev/null 2>&1; then
                keep=yes
            elif [ -f $ov ]; then
                pcow-img check $ov >$L/check.txt 2>&1
                [ $? -eq 3 ] && keep=yes
            fi
            if [ $keep = yes ]; then
                pcow-img info $ov 2>&1 | grep -q "^backing file: $(basename $top) " \
                    || { why="iteration $i: overlay $ov does not name $(basename $top) as its base: $(pcow-img info $ov 2>&1 | grep -i backing)"; return 1; }
                top=$ov
                depth=$((depth + 1))
                nov=$((nov + 1))
                snaps=
            else
                rm -f $ov
            fi
        fi
        # Every file of the chain: clean, or leaks only.
        f=$top
        while [ -n "$f" ]; do
            img_check "$f"
            case $crc in
                0) rc0=$((rc0 + 1)) ;;
                3) rc3=$((rc3 + 1)) ;;
                *) why="iteration $i: pcow-img check $(basename $f) after kill -9: rc=$crc"; return 1 ;;
            esac
            b=$(pcow-img info "$f" 2>/dev/null | sed -n 's/^backing file: \([^ ]*\).*/\1/p')
            f=${b:+/tmp/$b}
        done
        [ "$n" -gt 0 ] && list=$([ "$list" = none ] || printf '%s,' "$list")$i:$n
        if [ $depth -ge 3 ]; then
            b=/tmp/$(pcow-img info "$top" | sed -n 's/^backing file: \([^ ]*\).*/\1/p')
            pcow-img commit "$top" >$L/commit.txt 2>&1 || { why="iteration $i: pcow-img commit $(basename $top): $(head -c 200 $L/commit.txt)"; return 1; }
            rm -f "$top"
            top=$b
            depth=$((depth - 1))
            ncommit=$((ncommit + 1))
            snaps=
        fi
        i=$((i + 1))
    done
    boot s11-verify "file=$top" "l2.scenario=s11verify l2.list=$list"
    verified=$(sed -n 's/.*S11-VERIFIED files=\([0-9]*\) bad=\([0-9]*\).*/\1 \2/p' $L/s11-verify.log | head -n1)
    mkdir -p /out/s11
    f=$top
    while [ -n "$f" ]; do
        cp "$f" /out/s11/
        b=$(pcow-img info "$f" 2>/dev/null | sed -n 's/^backing file: \([^ ]*\).*/\1/p')
        f=${b:+/tmp/$b}
    done
    echo "VMMSC-INFO 11 top=$(basename $top .pcow) iterations=$iters snapshots=$nsnap overlays=$nov deletes=$ndel commits=$ncommit kills_in_api=$midapi checks_rc0=$rc0 checks_rc3=$rc3 verified_final='$verified'"
    echo "VMMSC-INFO 11 list=$list"
    booted_ok s11-verify || return 1
    img_check "$top"
    [ $crc -eq 0 ] || { why="pcow-img check after the final boot: rc=$crc"; return 1; }
    note="$iters kills, 0 failures, lost 0 of ${verified% *} synced files (final boot); ops: $nsnap snapshots, $nov overlays, $ndel deletes, $ncommit commits, $midapi kills before the API answered; checks rc0=$rc0 rc3=$rc3"
}

# ---- scenario 12: write tracking under KVM ------------------------------------------
# The guest's writes reach the region through KVM (EPT), not through a host
# thread: the barrier must find them by write tracking alone: KVM's dirty
# log of the memslot (every barrier of a boot but its first, which scans
# once) or, where KVM gives no dirty log, WP-async and PAGEMAP_SCAN. Boot
# 1 writes t.bin (S12_BYTES, "s12 A"); L1 takes an offline snapshot, so in
# boot 2 t.bin's clusters are read-only history, mapped private and tracked.
# In boot 2 (the VMM at debug level logs each FLUSH's barrier) the guest runs
# steps, each its work and a sync between S12-BEGIN and S12-END:
#   idle    nothing written: the barriers find (almost) nothing
#   read    t.bin read whole: reads are not writes
#   write1  every 8th page of t.bin overwritten in place (B): each one
#           copy-on-write, found (the clusters stay partly in the snapshot,
#           so they stay private)
#   idle2   nothing: pages the last barrier copied are not found again
#           (without write tracking every private page would be)
#   write2  the same pages again (C): already private, protected again by
#           the last barrier: found again (WP-async under KVM)
# "Almost nothing" allows S12_SLACK pages (journal, superblock, atime). Boot 3
# reads t.bin back; check clean; the host compares the flattened image.
S12_SLACK=64
# s12_steps LOG: "step barriers found copied held_us scan_us untracked
# logged" per step (untracked: a barrier found its pages with neither
# tracking; logged: barriers that followed KVM's dirty log).
s12_steps() {
    # The guest's marker and the VMM's log line can share a line (the
    # guest's text comes first, its newline after the log line): a barrier
    # logged on a BEGIN line belongs to that step, one on an END line not.
    tr -d '\r' <"$1" | awk '
        match($0, /S12-BEGIN [A-Za-z0-9]+/) { cur = substr($0, RSTART + 10, RLENGTH - 10); order[++n] = cur }
        /S12-END / { cur = "" }
        /FLUSH barrier: found=/ && cur != "" {
            tr = 0; lg = 0; uh = 0
            for (i = 1; i <= NF; i++) {
                split($i, kv, "=")
                if (kv[1] == "found") f[cur] += kv[2]
                if (kv[1] == "copied") c[cur] += kv[2]
                if (kv[1] == "held_us") h[cur] += kv[2]
                if (kv[1] == "scan_us") s[cur] += kv[2]
                if (kv[1] == "tracked" && kv[2] == "true") tr = 1
                if (kv[1] == "logged" && kv[2] == "true") lg = 1
                if (kv[1] == "unheld" && kv[2] == "true") uh = 1
            }
            if (!tr && !lg) untracked[cur] = 1
            l[cur] += lg
            u[cur] += uh
            b[cur]++
        }
        END { for (i = 1; i <= n; i++) { k = order[i]; printf "%s %d %d %d %d %d %d %d %d\n", k, b[k], f[k], c[k], h[k], s[k], untracked[k], l[k], u[k] } }'
}
sc12() {
    [ "$VMM" = ch ] || { why="needs our VMM (its barrier log)"; return 1; }
    img=$(img_in s12) || { why="no image"; return 1; }
    boot s12-prep "file=$img" "l2.scenario=s12prep l2.n=$S12_BYTES"
    booted_ok s12-prep || { img_out "$img"; return 1; }
    pcow-img snapshot -c s12a "$img" >$L/s12-snap.txt 2>&1 || { why="pcow-img snapshot -c: $(head -c 200 $L/s12-snap.txt)"; img_out "$img"; return 1; }
    boot s12-track "file=$img" "l2.scenario=s12track l2.n=$S12_BYTES" "vv"
    booted_ok s12-track || { img_out "$img"; return 1; }
    s12_steps $L/s12-track.log >$L/s12-steps.txt
    echo "VMMSC-INFO 12 steps (step barriers found copied held_us scan_us untracked logged unheld): $(tr '\n' ';' <$L/s12-steps.txt)"
    pages=$((S12_BYTES / 4096 / 8))
    nlogged=0
    nunheld=0
    while read -r st nb found copied held scan untracked logged unheld; do
        [ "$nb" -gt 0 ] || why="${why:+$why; }$st: no FLUSH barrier logged"
        [ "$untracked" = 0 ] || why="${why:+$why; }$st: a barrier ran without write tracking"
        nlogged=$((nlogged + logged))
        nunheld=$((nunheld + unheld))
        case $st in
            idle | read | idle2)
                [ "$found" -le $S12_SLACK ] || why="${why:+$why; }$st: $found pages found (nothing of t.bin was written; at most $S12_SLACK allowed)" ;;
            write1 | write2)
                [ "$found" -ge $pages ] && [ "$found" -le $((pages + S12_SLACK)) ] \
                    || why="${why:+$why; }$st: $found pages found for $pages written" ;;
        esac
    done <$L/s12-steps.txt
    [ "$(wc -l <$L/s12-steps.txt)" -eq 5 ] || why="${why:+$why; }expected 5 steps, got: $(tr '\n' ';' <$L/s12-steps.txt)"
    # Stock KVM has a dirty log: the barriers after the boot's first follow it.
    [ "$nlogged" -gt 0 ] || why="${why:+$why; }no barrier followed KVM's dirty log"
    # L1's kvm-amd stops a vCPU at a full ring: the VMM reads the ring there.
    how=$(sed -n "s/.*barriers follow KVM's dirty log: its \(dirty [a-z]*\).*/\1/p" $L/s12-track.log | head -n1)
    [ "$how" = "dirty ring" ] || why="${why:+$why; }the VMM did not read KVM's dirty ring (${how:-no log line})"
    img_check "$img"
    c1=$crc
    boot s12-verify "file=$img" "l2.scenario=s12verify l2.n=$S12_BYTES"
    img_out "$img"
    [ -z "$why" ] || return 1
    [ $c1 -eq 0 ] || { why="pcow-img check after the tracking run: rc=$c1"; return 1; }
    booted_ok s12-verify || return 1
    note="guest writes through KVM found by write tracking: $(awk '{ printf "%s%s %d", (NR > 1 ? ", " : ""), $1, $3 }' $L/s12-steps.txt) pages ($pages written per write step); $nlogged barriers on KVM's $how ($nunheld of them without pausing the vCPU); check rc=0; t.bin read back on the next boot"
}

# ---- scenario 13: a preallocated image ------------------------------------------
# L1 converts scenario 13's thin ext4 image with pcow-img convert -o
# preallocation=falloc; the guest writes and reads it back as in scenario 1.
# The VMM's last lines (-v) report no fault at all (every cluster mapped
# shared from the start), check is clean, and the file holds the whole
# virtual size. The same writes into a copy of the thin image first must
# fault.
s13_faults() { # NAME: "WRITE READ" from the VMM's faults line
    sed -n 's/.*pmem [^:]*: faults: \([0-9]*\) write, \([0-9]*\) read.*/\1 \2/p' $L/$1.log | tail -n1
}
sc13() {
    [ "$VMM" = ch ] || { why="needs the pcow VMM (VMMSC_VMM=ch)"; return 1; }
    thin=$(img_in s13) || { why="no image"; return 1; }
    img=/tmp/s13p.pcow
    pcow-img convert -O pcow -o preallocation=falloc "$thin" "$img" >$L/s13-convert.txt 2>&1 \
        || { why="pcow-img convert -o preallocation=falloc: $(tr '\n' ' ' <$L/s13-convert.txt | cut -c1-200)"; return 1; }
    # The same writes into a copy of the thin image fault: the counters
    # count.
    cp "$thin" /tmp/s13thin.pcow
    rm -f "$thin"
    boot s13-thin "file=/tmp/s13thin.pcow" "l2.scenario=s1write" v
    rm -f /tmp/s13thin.pcow
    booted_ok s13-thin || return 1
    ft=$(s13_faults s13-thin)
    [ "${ft%% *}" -gt 0 ] 2>/dev/null || { why="the thin image's boot: expected write faults, the VMM said '${ft:-nothing}'"; return 1; }
    len=$(stat -c %s "$img")
    [ "$len" -ge "$SIZE" ] || { why="preallocated file is $len bytes, less than its virtual size $SIZE"; return 1; }
    boot s13-write "file=$img" "l2.scenario=s1write" v
    booted_ok s13-write && pmem_line_ok s13-write "$SIZE" || { img_out "$img"; return 1; }
    f=$(s13_faults s13-write)
    [ "$f" = "0 0" ] || { why="expected no write or read fault, the VMM said '${f:-nothing}'"; img_out "$img"; return 1; }
    m1=$(manifest_of s13-write)
    img_check "$img"
    [ $crc -eq 0 ] || { why="pcow-img check after the first boot: rc=$crc"; img_out "$img"; return 1; }
    boot s13-read "file=$img" "l2.scenario=s1read" v
    img_out "$img"
    rm -f "$img"
    booted_ok s13-read && pmem_line_ok s13-read "$SIZE" || return 1
    [ "$(manifest_of s13-read)" = "$m1" ] || { why="second boot sees listing $(manifest_of s13-read), first wrote $m1"; return 1; }
    f2=$(s13_faults s13-read)
    [ "$f2" = "0 0" ] || { why="second boot: expected no fault, the VMM said '${f2:-nothing}'"; return 1; }
    echo "VMMSC-INFO 13 file_bytes=$len virtual_bytes=$SIZE"
    note="preallocated in L1 (file $((len / 1048576)) MiB for $((SIZE / 1048576)) MiB virtual); two boots wrote and read back every file with 0 faults (the thin image: ${ft%% *} write faults); check rc=0"
}

# ---- scenario 15: the ACPI power button (and an NMI) over the API ---------------
# The guest writes a file, starts busybox acpid, says GUEST-S15-NMI-WAIT; L1
# sends `ch-remote nmi`, the guest finds "NMI received" in its kernel log and
# says GUEST-S15-WAITING; L1 sends `ch-remote power-button`: the guest's
# handler runs, it writes a second file and powers off cleanly; the VMM exits
# 0 (as on any guest power-off), the image checks clean.
sc15_api() {
    until_ 60 grep -q GUEST-S15-NMI-WAIT $L/s15-button.log \
        || { why="s15: the guest never said GUEST-S15-NMI-WAIT$(guest_said s15-button)"; return 1; }
    api s15-nmi nmi
    [ $arc -eq 0 ] || { why="s15: ch-remote nmi: rc=$arc ($(api_err s15-nmi))"; return 1; }
    until_ 60 grep -q GUEST-S15-WAITING $L/s15-button.log \
        || { why="s15: the guest did not see the NMI$(guest_said s15-button)"; return 1; }
    api s15-info info
    [ "$(json_state s15-info)" = Running ] || { why="s15: state '$(json_state s15-info)' before the button, expected Running"; return 1; }
    api s15-button power-button
    [ $arc -eq 0 ] || { why="s15: ch-remote power-button: rc=$arc ($(api_err s15-button))"; return 1; }
}
sc15() {
    [ "$VMM" = ch ] || { why="needs our VMM's API (VMMSC_VMM=qemu has none)"; return 1; }
    img=$(img_in s15) || { why="no image"; return 1; }
    live_run s15-button "file=$img" "l2.scenario=s15button" 1 GUEST-NEVER sc15_api
    img_out "$img"
    [ -z "$why" ] || return 1
    booted_ok s15-button || return 1
    grep -q GUEST-S15-PRESSED $L/s15-button.log || { why="s15: the guest's power button handler did not run$(guest_said s15-button)"; return 1; }
    vmm_logged s15-button 'ACPI power button pressed' || { why="s15: no 'ACPI power button pressed' in the VMM log"; return 1; }
    vmm_logged s15-button 'guest powered off' || { why="s15: no 'guest powered off' in the VMM log"; return 1; }
    img_check "$img"
    [ $crc -eq 0 ] || { why="pcow-img check after the power button: rc=$crc"; return 1; }
    nmi=$(sed -n 's/.*GUEST-S15-NMI \(.*\)/\1/p' $L/s15-button.log | tr -d '\r' | head -n1 | cut -c1-80)
    case $nmi in *"NMI received for unknown reason"*) ;; *) why="s15: the guest took the NMI for something else: '$nmi'"; return 1 ;; esac
    note="guest logged '$nmi' after vm.nmi; vm.power-button: acpid ran its handler, the guest powered off, VMM exit 0, check rc=0"
}

# ---- scenario 14: virtio-rng and virtio-console in a real guest -------------------
# --console pty: the guest (console=ttyS0 console=hvc0, modules virtio-rng and
# virtio_console) reads /dev/hwrng (virtio_rng the current source, two reads
# of 512 bytes that differ and are not all zero), lists its PCI functions
# (console 00:01.0, rng 00:02.0, as upstream orders them), checks that hvc0 is
# a kernel console, and starts a login-less shell on /dev/hvc0. L1 takes the
# pty's path from the VMM's log, reads the pty, and sends the shell a line
# whose answer only a shell can give (HVC-ECHO-$((6*7)) -> HVC-ECHO-42); the
# guest powers off once the shell ran it.
sc14() {
    [ "$VMM" = ch ] || { why="needs our VMM (--console pty)"; return 1; }
    t=$(up)
    sh "$0" __vmm "" "console=hvc0 l2.scenario=s14dev" "console=pty" </dev/null >$L/s14-dev.log 2>&1 &
    pid=$!
    pty=
    i=0
    while [ -z "$pty" ] && [ $i -lt 300 ] && alive $pid; do
        sleep 0.1
        pty=$(sed -n 's/.*console: pseudo-terminal \(\/dev\/pts\/[0-9]*\).*/\1/p' $L/s14-dev.log | head -n1)
        i=$((i + 1))
    done
    cpid=
    if [ -n "$pty" ]; then
        cat "$pty" >$L/s14-hvc.txt 2>/dev/null &
        cpid=$!
    fi
    to=
    sent=0
    while alive $pid; do
        sleep 0.2
        if [ -n "$pty" ] && grep -q GUEST-HVC-SHELL $L/s14-dev.log && ! grep -q HVC-ECHO-42 $L/s14-hvc.txt 2>/dev/null; then
            # Sent again every 5 s until answered (the shell may not read yet).
            if [ $((sent % 25)) -eq 0 ]; then
                printf 'echo HVC-ECHO-$((6*7)); echo ran >/tmp/hvc-done\n' >"$pty"
            fi
            sent=$((sent + 1))
        fi
        if awk -v a="$t" -v b="$(up)" -v s="$BOOT_TIMEOUT" 'BEGIN { exit !(b - a > s) }'; then
            to=" TIMEOUT"
            kill -9 $pid
            break
        fi
    done
    wait $pid
    vrc=$?
    [ -z "$cpid" ] || { kill $cpid 2>/dev/null; wait $cpid 2>/dev/null; }
    echo "VMMSC-BOOT s14-dev exit=$vrc time=$(since "$t")s$to"
    tr -d '\r' <$L/s14-dev.log | sed "s/^/  L2[s14-dev]| /"
    # (The shell's prompt ends without a newline: add one.)
    { tr -d '\r' <$L/s14-hvc.txt 2>/dev/null; echo; } | sed "s/^/  HVC[s14-dev]| /" | tail -n 20
    [ -n "$pty" ] || { why="the VMM's log names no pseudo-terminal for the console"; return 1; }
    booted_ok s14-dev || return 1
    grep -q 'HVC-ECHO-42' $L/s14-hvc.txt || { why="no HVC-ECHO-42 from the shell on hvc0 through $pty"; return 1; }
    grep -q 'GUEST-PCI 0000:00:01.0 0x1af4:0x1043' $L/s14-dev.log || { why="00:01.0 is not the virtio console: $(grep -o 'GUEST-PCI 0000:00:01.0.*' $L/s14-dev.log)"; return 1; }
    grep -q 'GUEST-PCI 0000:00:02.0 0x1af4:0x1044' $L/s14-dev.log || { why="00:02.0 is not the virtio-rng: $(grep -o 'GUEST-PCI 0000:00:02.0.*' $L/s14-dev.log)"; return 1; }
    note="$(grep -o 'GUEST-RNG.*' $L/s14-dev.log | head -n1); the shell on hvc0 answered through $pty"
}

# ---- scenarios 16-19: VM snapshot, restore and clones ----------------------------
# The source VM runs with the API and with its standard input a FIFO that L1
# holds open (read-write, so that neither side ever sees an end of file or a
# SIGPIPE, even after a kill -9); `--serial tty` makes that input the guest's
# ttyS0 input. The guest (vmm-guest.sh cmd_reader) reacts to lines
# "L1CMD ...": the only way L1 can tell a source VM from its restored copies,
# which run the same guest from the same instant. A restored VM takes its
# serial settings from the snapshot's config: `tty` again, so its serial is
# the new VMM process's standard output (its own log here) and its input that
# process's standard input (its own FIFO).
# vm_fifo SLOT: a fresh FIFO /tmp/vmin-SLOT, held open on fd SLOT (3..9).
vm_fifo() {
    eval "exec $1>&-"
    rm -f /tmp/vmin-$1
    mkfifo /tmp/vmin-$1 || return 1
    eval "exec $1<>/tmp/vmin-$1"
}
# vm_say SLOT WORDS...: one command line on that VM's serial input.
vm_say() {
    s_=$1
    shift
    printf 'L1CMD %s\n' "$*" >/tmp/vmin-$s_
    echo "VMMSC-SAY slot=$s_: $*"
}
# vm_tell NAME SLOT WORDS...: vm_say, then the guest's acknowledgement
# (GUEST-CMD WORDS) in NAME's serial log within 30 s (while $pid lives);
# else sets why (the line never reached the guest).
vm_tell() {
    tn_=$1
    ts_=$2
    shift 2
    vm_say $ts_ "$@"
    until_ 30 grep -qF "GUEST-CMD $*" $L/$tn_.log && return 0
    why="$tn_: the guest did not acknowledge '$*' (no GUEST-CMD line) within 30 s of L1 writing it to the VMM's standard input, its serial input (VMM alive: $(alive $pid && echo yes || echo no))"
    return 1
}
# vm_start NAME SLOT SOCKET PMEM_SPECS EXTRA_CMDLINE [OPTS]: the source VMM
# (vmm_exec, -v, the API on SOCKET) in the background as $pid, started at $t.
vm_start() {
    vm_fifo $2 || { why="$1: mkfifo failed"; return 1; }
    rm -f $3
    t=$(up)
    sh "$0" __vmm "$4" "$5" "v api=$3 ${6:-}" </tmp/vmin-$2 >$L/$1.log 2>&1 &
    pid=$!
}
# vm_restore NAME SLOT SOCKET RESTORE_OPTS: a new VMM process with
# `--restore RESTORE_OPTS` in the background as $pid, started at $t.
vm_restore() {
    vm_fifo $2 || { why="$1: mkfifo failed"; return 1; }
    rm -f $3
    t=$(up)
    sh "$0" __restore "$4" "$3" </tmp/vmin-$2 >$L/$1.log 2>&1 &
    pid=$!
    echo "VMMSC-RESTORE $1: --restore $4"
}
# vm_running SOCKET: vm.info through SOCKET answers state Running.
vm_running() {
    ./ch-remote --api-socket "$1" --timeout 10 info >$L/running.out 2>&1 || return 1
    tr -d ' \n\r' <$L/running.out | grep -q '"state":"Running"'
}
# counts NAME: the COUNT numbers in NAME's serial log, one a line.
counts() { tr -d '\r' <$L/$1.log | sed -n 's/^COUNT \([0-9][0-9]*\)$/\1/p'; }
count_n() { [ "$(counts "$1" | wc -l)" -ge "$2" ]; }
# frozen_of DIR: the frozen pcow file DIR/state.json names for _pmem0.
frozen_of() { tr -d ' \n\r' <"$1/state.json" 2>/dev/null | grep -o '"frozen":"[^"]*"' | head -n1 | cut -d'"' -f4; }
# chain_of IMAGE: the image and its bases (pcow-img info's "backing file:",
# relative to the image's directory unless absolute), one path a line.
chain_of() {
    f_=$1
    n_=0
    while [ -n "$f_" ] && [ $n_ -lt 64 ]; do
        echo "$f_"
        b_=$(pcow-img info "$f_" 2>/dev/null | sed -n 's/^backing file: \([^ ]*\).*/\1/p')
        case $b_ in
            "") f_= ;;
            /*) f_=$b_ ;;
            *) f_=$(dirname "$f_")/$b_ ;;
        esac
        n_=$((n_ + 1))
    done
}
# chain_check IMAGE CODES: pcow-img check on every file of the chain; each
# must answer one of CODES ("0" or "0 3"); else sets why.
chain_check() {
    for f in $(chain_of "$1"); do
        img_check "$f"
        case " $2 " in *" $crc "*) ;; *) why="${why:+$why; }pcow-img check $(basename "$f"): rc=$crc, expected one of: $2"; return 1 ;; esac
    done
}
# chain_out IMAGE DIR: the chain's files into /out/DIR (the host flattens it).
chain_out() {
    mkdir -p /out/$2
    for f in $(chain_of "$1"); do cp "$f" /out/$2/; done
}
# dir_sums DIR [FILE...]: sha256 of every file under DIR and of each FILE.
dir_sums() {
    d_=$1
    shift
    { find "$d_" -type f | sort | xargs sha256sum; for f in "$@"; do sha256sum "$f"; done; } 2>&1 | sha256sum | cut -d' ' -f1
}
# dir_meta DIR: a digest of DIR's files' names, sizes, mtimes and inodes and
# of the content of its JSON files: cheap enough while a VM waits (a sha256
# of memory-ranges takes half a minute in L1 under TCG).
dir_meta() {
    { find "$1" -type f | sort | xargs stat -c '%n %s %Y %i'; cat "$1"/*.json; } 2>&1 | sha256sum | cut -d' ' -f1
}
# vm_snapshot NAME DIR: pause the VM on $SOCK, snapshot into DIR (made
# empty), and check it is still Paused (sets why).
vm_snapshot() {
    rm -rf "$2"
    mkdir -p "$2"
    api $1-pause pause
    [ $arc -eq 0 ] || { why="$1: ch-remote pause: rc=$arc ($(api_err $1-pause))"; return 1; }
    ts_=$(up)
    api $1-snapshot snapshot "file://$2"
    echo "VMMSC-INFO snapshot $1 took=$(since "$ts_")s files='$(ls "$2" | tr '\n' ' ')'"
    [ $arc -eq 0 ] || { why="$1: ch-remote snapshot file://$2: rc=$arc ($(api_err $1-snapshot))"; return 1; }
    [ -f "$2/state.json" ] && [ -f "$2/config.json" ] || { why="$1: the snapshot directory holds '$(ls "$2" | tr '\n' ' ')', no state.json/config.json"; return 1; }
    api $1-info-after info
    [ "$(json_state $1-info-after)" = Paused ] || { why="$1: state '$(json_state $1-info-after)' after the snapshot, expected Paused"; return 1; }
}

# Scenario 16: the guest counts; pause, snapshot, kill -9 of the source,
# restore in a new process (resume=on): the count goes on from where it was
# and the guest still works. Also: a snapshot of the Running VM is refused
# and changes nothing.
S16DIR=/tmp/snap16
sc16() {
    s16_run
    r_=$?
    rm -rf $S16DIR
    return $r_
}
s16_run() {
    [ "$VMM" = ch ] || { why="needs our VMM (vm.snapshot, vm.restore)"; return 1; }
    img=$(img_in s16) || { why="no image"; return 1; }
    SOCK=/tmp/ch.sock
    vm_start s16-source 5 $SOCK "file=$img" "l2.scenario=s16count" || return 1
    until_ 120 grep -q '^COUNT 20' $L/s16-source.log \
        || { vmm_end s16-source "$t" 1 GUEST-NEVER "no COUNT 20"; chain_out "$img" s16; why="s16-source: no COUNT 20$(guest_said s16-source)"; return 1; }
    rm -rf $S16DIR
    mkdir -p $S16DIR
    api s16-snap-running snapshot "file://$S16DIR"
    if [ $arc -eq 0 ] || [ -n "$(ls -A $S16DIR)" ] || [ "$(ls /tmp | grep -c '^s16\.pcow\.')" -ne 0 ]; then
        why="a snapshot of the Running VM: rc=$arc, directory '$(ls -A $S16DIR | tr '\n' ' ')', frozen files '$(ls /tmp | grep '^s16\.pcow\.' | tr '\n' ' ')' (expected a refusal that changes nothing)"
        vmm_end s16-source "$t" 1 GUEST-NEVER "the running snapshot was not refused"
        chain_out "$img" s16
        return 1
    fi
    refused=$(api_err s16-snap-running | cut -c1-80)
    if ! vm_snapshot s16 $S16DIR; then
        vmm_end s16-source "$t" 1 GUEST-NEVER "the snapshot failed"
        chain_out "$img" s16
        return 1
    fi
    c0=$(counts s16-source | tail -n1)
    vmm_end s16-source "$t" 1 GUEST-NEVER "kill -9 after the snapshot"
    frozen=$(frozen_of $S16DIR)
    echo "VMMSC-INFO 16 last_count_before=$c0 frozen=$frozen"
    [ -n "$frozen" ] && [ -f "$frozen" ] || { why="state.json names no frozen pcow file for _pmem0 (got '$frozen'): $(tr -d '\n' <$S16DIR/state.json | grep -o '"pmem".\{0,200\}')"; chain_out "$img" s16; return 1; }
    vm_restore s16-restored 6 /tmp/ch2.sock "source_url=file://$S16DIR,resume=on" || return 1
    if ! until_ 60 count_n s16-restored 5; then
        vmm_end s16-restored "$t" 0 GUEST-NEVER "fewer than 5 COUNT lines"
        chain_out "$img" s16
        why="s16-restored: fewer than 5 COUNT lines 60 s after the restore (VMM exit $vrc$(guest_said s16-restored))"
        return 1
    fi
    if ! vm_tell s16-restored 6 go; then
        vmm_end s16-restored "$t" 0 GUEST-NEVER "no GUEST-CMD"
        chain_out "$img" s16
        return 1
    fi
    vmm_end s16-restored "$t" 0 GUEST-NEVER
    chain_out "$img" s16
    counts s16-restored >$L/s16-counts
    c1=$(head -n1 $L/s16-counts)
    cn=$(tail -n1 $L/s16-counts)
    echo "VMMSC-INFO 16 first_count_after=$c1 last_count_after=$cn lines_after=$(wc -l <$L/s16-counts)"
    grep -q L2-BOOTED $L/s16-restored.log && { why="s16-restored: the guest booted again (L2-BOOTED) instead of going on"; return 1; }
    [ "$c1" -gt 0 ] && [ "$c1" -ge $((c0 - 3)) ] && [ "$c1" -le $((c0 + 3)) ] \
        || { why="s16-restored: first COUNT $c1 after the restore, last before the snapshot $c0 (expected $((c0 - 3))..$((c0 + 3)))"; return 1; }
    # One by one; the VMM's log lines share the file with the serial output
    # and can land inside a COUNT line, so up to 2 numbers may be missing,
    # but the count never goes back or stands still.
    back=$(awk 'NR > 1 && $1 <= p { printf "%d->%d ", p, $1 } { p = $1 }' $L/s16-counts)
    [ -z "$back" ] || { why="s16-restored: the count goes back or repeats: $back"; return 1; }
    missing=$(awk 'NR == 1 { f = $1 } { n++; l = $1 } END { print l - f + 1 - n }' $L/s16-counts)
    [ "$missing" -le 2 ] || { why="s16-restored: $missing numbers missing between COUNT $c1 and $cn"; return 1; }
    booted_ok s16-restored || return 1
    grep -q GUEST-S16-WORKS $L/s16-restored.log || { why="s16-restored: no GUEST-S16-WORKS$(guest_said s16-restored)"; return 1; }
    chain_check "$img" 0 || return 1
    note="Running snapshot refused ($refused); paused at COUNT $c0, snapshot, kill -9, restored: COUNT $c1..$cn, then wrote, fsynced and read back a file, powered off, exit 0; check rc=0 on $(chain_of "$img" | wc -l) files"
}

# Scenario 17: the pmem content at the snapshot instant. A synced, snapshot,
# the source resumes and writes B; a restore without the pmem override while
# the source runs is refused (naming the override); after the source's
# poweroff the restore rolls the image back: no B even with caches dropped.
S17DIR=/tmp/snap17
sc17() {
    s17_run
    r_=$?
    rm -rf $S17DIR
    return $r_
}
s17_run() {
    [ "$VMM" = ch ] || { why="needs our VMM (vm.snapshot, vm.restore)"; return 1; }
    img=$(img_in s17) || { why="no image"; return 1; }
    SOCK=/tmp/ch.sock
    vm_start s17-source 5 $SOCK "file=$img" "l2.scenario=s17pmem" || return 1
    until_ 120 grep -q GUEST-S17-A-SYNCED $L/s17-source.log \
        || { vmm_end s17-source "$t" 1 GUEST-NEVER "no GUEST-S17-A-SYNCED"; chain_out "$img" s17; why="s17-source: no GUEST-S17-A-SYNCED$(guest_said s17-source)"; return 1; }
    if ! vm_snapshot s17 $S17DIR; then
        vmm_end s17-source "$t" 1 GUEST-NEVER "the snapshot failed"
        chain_out "$img" s17
        return 1
    fi
    api s17-resume resume
    [ $arc -eq 0 ] || { why="s17: resume after the snapshot: rc=$arc ($(api_err s17-resume))"; vmm_end s17-source "$t" 1 GUEST-NEVER "resume failed"; chain_out "$img" s17; return 1; }
    # The source runs on the image: a restore onto it is refused, naming
    # the pmem override.
    spid=$pid
    st=$t
    h0=$(dir_meta $S17DIR)
    timeout -s KILL 60 sh "$0" __restore "source_url=file://$S17DIR,resume=on" /tmp/ch3.sock </dev/null >$L/s17-refused.log 2>&1
    rrc=$?
    echo "VMMSC-BOOT s17-refused exit=$rrc"
    tr -d '\r' <$L/s17-refused.log | sed "s/^/  L2[s17-refused]| /" | tail -n 5
    pid=$spid
    t=$st
    if [ $rrc -eq 0 ] || ! grep -v '^\[' $L/s17-refused.log | grep -qE 'pmem=|override'; then
        why="s17: a restore without the pmem override while the source runs: exit $rrc, expected a refusal naming the pmem override: $(tail -n 2 $L/s17-refused.log | tr '\n' ' ' | cut -c1-200)"
        vmm_end s17-source "$t" 1 GUEST-NEVER "the restore was not refused"
        chain_out "$img" s17
        return 1
    fi
    [ "$(dir_meta $S17DIR)" = "$h0" ] || { why="s17: the refused restore changed the snapshot directory (names, sizes, mtimes or JSON)"; vmm_end s17-source "$t" 1 GUEST-NEVER "snapshot changed"; return 1; }
    api s17-info-running info
    [ "$(json_state s17-info-running)" = Running ] || { why="s17: the source is '$(json_state s17-info-running)' after the refused restore, expected Running"; vmm_end s17-source "$t" 1 GUEST-NEVER "source not running"; return 1; }
    vm_tell s17-source 5 writeb || { vmm_end s17-source "$t" 1 GUEST-NEVER "no GUEST-CMD"; chain_out "$img" s17; return 1; }
    vmm_end s17-source "$t" 1 GUEST-NEVER
    chain_out "$img" s17src
    booted_ok s17-source || { chain_out "$img" s17; why="$why (the source)"; return 1; }
    grep -q GUEST-S17-B-SYNCED $L/s17-source.log || { why="s17-source: no GUEST-S17-B-SYNCED$(guest_said s17-source)"; chain_out "$img" s17; return 1; }
    chain_check "$img" 0 || return 1
    vm_restore s17-restored 6 /tmp/ch2.sock "source_url=file://$S17DIR,resume=on" || return 1
    SOCK=/tmp/ch2.sock
    if ! until_ 60 vm_running $SOCK; then
        vmm_end s17-restored "$t" 0 GUEST-NEVER "not Running"
        SOCK=/tmp/ch.sock
        chain_out "$img" s17
        why="s17-restored: not Running 60 s after the restore (VMM exit $vrc: $(tail -n 3 $L/s17-restored.log | tr '\n' ' ' | cut -c1-200))"
        return 1
    fi
    SOCK=/tmp/ch.sock
    vm_tell s17-restored 6 verify || { vmm_end s17-restored "$t" 0 GUEST-NEVER "no GUEST-CMD"; chain_out "$img" s17; return 1; }
    vmm_end s17-restored "$t" 0 GUEST-NEVER
    chain_out "$img" s17
    grep -q L2-BOOTED $L/s17-restored.log && { why="s17-restored: the guest booted again (L2-BOOTED) instead of going on"; return 1; }
    booted_ok s17-restored || return 1
    grep -q GUEST-S17-VERIFIED $L/s17-restored.log || { why="s17-restored: no GUEST-S17-VERIFIED$(guest_said s17-restored)"; return 1; }
    chain_check "$img" 0 || return 1
    note="source wrote B after the snapshot and powered off; restore while it ran refused ($(grep -v '^\[' $L/s17-refused.log | grep -E 'pmem=|override' | head -n1 | tr -d '\r' | cut -c1-100)); restored: $(grep -o 'GUEST-S17-LS .*' $L/s17-restored.log | tr -d '\r' | cut -c1-60) (no B after drop_caches), powered off, exit 0, check rc=0"
}

# Scenario 18: three clones restored at once from one snapshot, each with its
# own overlay (pmem=[_pmem0@FILE]) and RAM mapped copy-on-write; each writes
# its own file and sees only its own; the snapshot is unchanged.
S18DIR=/tmp/snap18
sc18() {
    s18_run
    r_=$?
    rm -rf $S18DIR
    return $r_
}
s18_run() {
    [ "$VMM" = ch ] || { why="needs our VMM (vm.snapshot, vm.restore)"; return 1; }
    img=$(img_in s18) || { why="no image"; return 1; }
    SOCK=/tmp/ch.sock
    vm_start s18-source 5 $SOCK "file=$img" "l2.scenario=s18clone" "mem=192M" || return 1
    until_ 120 grep -q GUEST-S18-READY $L/s18-source.log \
        || { vmm_end s18-source "$t" 1 GUEST-NEVER "no GUEST-S18-READY"; why="s18-source: no GUEST-S18-READY$(guest_said s18-source)"; return 1; }
    if ! vm_snapshot s18 $S18DIR; then
        vmm_end s18-source "$t" 1 GUEST-NEVER "the snapshot failed"
        return 1
    fi
    vmm_end s18-source "$t" 1 GUEST-NEVER "kill -9 after the snapshot"
    frozen=$(frozen_of $S18DIR)
    [ -n "$frozen" ] && [ -f "$frozen" ] || { why="state.json names no frozen pcow file for _pmem0 (got '$frozen')"; return 1; }
    h0=$(dir_sums $S18DIR "$frozen")
    # Clones 1 and 2: `cloud-hypervisor --restore`; clone 3: an empty VMM,
    # then `ch-remote restore` and `ch-remote resume` (both upstream ways).
    for k in 1 2 3; do
        rm -f /tmp/s18-clone$k.pcow
        ropts="source_url=file://$S18DIR,memory_restore_mode=copyonwrite,pmem=[_pmem0@/tmp/s18-clone$k.pcow]"
        if [ $k -lt 3 ]; then
            vm_restore s18-clone$k $((5 + k)) /tmp/ch-c$k.sock "$ropts,resume=on" || return 1
        else
            vm_fifo 8 || { why="mkfifo failed"; return 1; }
            rm -f /tmp/ch-c3.sock
            t=$(up)
            sh "$0" __empty /tmp/ch-c3.sock </tmp/vmin-8 >$L/s18-clone3.log 2>&1 &
            pid=$!
            SOCK=/tmp/ch-c3.sock
            if until_ 30 test -S $SOCK; then
                api s18-c3-restore restore "$ropts"
                [ $arc -eq 0 ] || why="clone 3: ch-remote restore $ropts: rc=$arc ($(api_err s18-c3-restore))"
                api s18-c3-info info
                [ -n "$why" ] || [ "$(json_state s18-c3-info)" = Paused ] || why="clone 3: state '$(json_state s18-c3-info)' after vm.restore, expected Paused"
                [ -n "$why" ] || api s18-c3-resume resume
                [ -n "$why" ] || [ $arc -eq 0 ] || why="clone 3: ch-remote resume: rc=$arc ($(api_err s18-c3-resume))"
            else
                why="clone 3: the empty VMM made no API socket"
            fi
            SOCK=/tmp/ch.sock
        fi
        eval "p$k=$pid t$k=$t"
    done
    for k in 1 2 3; do
        eval "pid=\$p$k"
        until_ 60 vm_running /tmp/ch-c$k.sock || why="${why:+$why; }clone $k: not Running 60 s after the restore ($(tail -n 2 $L/s18-clone$k.log | tr '\n' ' ' | cut -c1-160))"
    done
    for k in 1 2 3; do
        eval "pid=\$p$k"
        [ -n "$why" ] || vm_tell s18-clone$k $((5 + k)) clone $k || break
    done
    w_=$why
    for k in 1 2 3; do
        eval "pid=\$p$k t=\$t$k"
        if [ -n "$w_" ]; then vmm_end s18-clone$k "$t" 0 GUEST-NEVER "a clone failed"; else vmm_end s18-clone$k "$t" 0 GUEST-NEVER; fi
        eval "vrc$k=$vrc"
    done
    why=$w_
    mkdir -p /out/s18
    cp "$frozen" /out/s18/
    for k in 1 2 3; do [ -f /tmp/s18-clone$k.pcow ] && cp /tmp/s18-clone$k.pcow /out/s18/; done
    [ -z "$why" ] || return 1
    h1=$(dir_sums $S18DIR "$frozen")
    echo "VMMSC-INFO 18 frozen=$(basename "$frozen") snapshot_sums_before=$h0 after=$h1"
    for k in 1 2 3; do
        eval "vrc=\$vrc$k"
        to=
        booted_ok s18-clone$k || return 1
        grep -q L2-BOOTED $L/s18-clone$k.log && { why="clone $k: the guest booted again (L2-BOOTED)"; return 1; }
        grep -q "GUEST-S18-LS k=$k: clone-$k.txt" $L/s18-clone$k.log || { why="clone $k: $(grep -o 'GUEST-S18-LS.*' $L/s18-clone$k.log)"; return 1; }
        pcow-img info /tmp/s18-clone$k.pcow 2>&1 | grep -q "^backing file: .*$(basename "$frozen")" \
            || { why="clone $k: /tmp/s18-clone$k.pcow does not name $(basename "$frozen") as its base: $(pcow-img info /tmp/s18-clone$k.pcow 2>&1 | grep -i backing)"; return 1; }
        chain_check /tmp/s18-clone$k.pcow 0 || return 1
    done
    [ "$h0" = "$h1" ] || { why="the snapshot directory or the frozen file changed while the clones ran (sha256 of all files $h0 -> $h1)"; return 1; }
    note="3 clones (copyonwrite RAM, own overlays; 2 by --restore, 1 by vm.restore on an empty VMM) ran at once, each saw only its own file, powered off, exit 0; snapshot dir + frozen file byte-identical; check rc=0"
}

# Scenario 19: kill -9 of the source VMM during `ch-remote snapshot`, at a
# random delay, S19_ITERS times, each from a fresh source VM on the same
# image. After each: every file of the image's chain checks 0 or 3 (leaks
# only), and the snapshot directory either restores (onto a clone overlay, so
# the image is left alone) to a guest that answers, or is refused as
# incomplete (and the refusal creates no clone file). A last boot verifies
# every iteration's file.
S19DIR=/tmp/snap19
sc19() {
    [ "$VMM" = ch ] || { why="needs our VMM (vm.snapshot, vm.restore)"; return 1; }
    img=$(img_in s19) || { why="no image"; return 1; }
    SOCK=/tmp/ch.sock
    iters=${S19_ITERS:-5}
    maxms=${S19_MAX_MS:-6000}
    nok=0 ninc=0 rc3=0
    i=1
    while [ $i -le "$iters" ]; do
        vm_start s19-src-$i 5 $SOCK "file=$img" "l2.scenario=s19loop l2.tag=$i" "mem=192M" || return 1
        if ! until_ 120 grep -qE 'GUEST-S19-READY|GUEST-FAIL' $L/s19-src-$i.log || grep -q GUEST-FAIL $L/s19-src-$i.log; then
            vmm_end s19-src-$i "$t" 1 GUEST-NEVER "not ready"
            chain_out "$img" s19
            why="iteration $i: the source guest did not get ready$(guest_said s19-src-$i)"
            return 1
        fi
        api s19-pause-$i pause
        [ $arc -eq 0 ] || { why="iteration $i: pause: rc=$arc ($(api_err s19-pause-$i))"; vmm_end s19-src-$i "$t" 1 GUEST-NEVER "pause failed"; chain_out "$img" s19; return 1; }
        rm -rf $S19DIR
        mkdir -p $S19DIR
        delay=$(($(rnd) % (maxms + 1)))
        ./ch-remote --api-socket $SOCK --timeout 30 snapshot "file://$S19DIR" >$L/s19-snap.out 2>&1 &
        apid=$!
        usleep $((delay * 1000)) 2>/dev/null || sleep "$(awk -v d=$delay 'BEGIN { printf "%.3f", d / 1000 }')"
        done_before=no
        alive $apid || done_before=yes
        vmm_end s19-src-$i "$t" 1 GUEST-NEVER "kill -9 ${delay} ms into the snapshot" >$L/s19-src.out
        head -n1 $L/s19-src.out
        wait $apid
        arc=$?
        echo "VMMSC-INFO 19 iteration=$i kill_after_ms=$delay snapshot_rc=$arc answered_before_kill=$done_before files='$(ls $S19DIR | tr '\n' ' ')' ch-remote: $(tr '\n' ' ' <$L/s19-snap.out | cut -c1-120)"
        for f in $(chain_of "$img"); do
            img_check "$f"
            case $crc in
                0) ;;
                3) rc3=$((rc3 + 1)) ;;
                *) why="iteration $i (kill ${delay} ms into the snapshot): pcow-img check $(basename "$f"): rc=$crc"; chain_out "$img" s19; return 1 ;;
            esac
        done
        # The snapshot directory: restored onto a clone, or refused as
        # incomplete.
        clone=/tmp/s19-clone.pcow
        rm -f $clone
        vm_restore s19-restore-$i 6 /tmp/ch2.sock "source_url=file://$S19DIR,resume=on,pmem=[_pmem0@$clone]" || return 1
        until_ 60 vm_running /tmp/ch2.sock || true
        if alive $pid; then
            if ! vm_tell s19-restore-$i 6 alive; then
                vmm_end s19-restore-$i "$t" 0 GUEST-NEVER "no GUEST-CMD"
                why="iteration $i (snapshot rc=$arc): $why"
                chain_out "$img" s19
                return 1
            fi
            vmm_end s19-restore-$i "$t" 0 GUEST-NEVER
            booted_ok s19-restore-$i || { why="iteration $i (kill ${delay} ms into the snapshot, snapshot rc=$arc): the restored VM: $why"; chain_out "$img" s19; return 1; }
            grep -q "GUEST-S19-ALIVE tag=$i" $L/s19-restore-$i.log || { why="iteration $i: the restored guest did not answer$(guest_said s19-restore-$i)"; chain_out "$img" s19; return 1; }
            chain_check $clone 0 || { why="iteration $i: $why"; chain_out "$img" s19; return 1; }
            nok=$((nok + 1))
            echo "VMMSC-INFO 19 iteration=$i restored=yes"
        else
            vmm_end s19-restore-$i "$t" 0 GUEST-NEVER
            if [ $vrc -eq 0 ] || ! grep -qi incomplete $L/s19-restore-$i.log; then
                why="iteration $i (kill ${delay} ms into the snapshot, snapshot rc=$arc): the restore neither ran nor was refused as incomplete: exit $vrc: $(grep -v '^ *$' $L/s19-restore-$i.log | tail -n 2 | tr '\n' ' ' | cut -c1-200)"
                chain_out "$img" s19
                return 1
            fi
            [ ! -e $clone ] || { why="iteration $i: the refused restore left $clone behind"; chain_out "$img" s19; return 1; }
            ninc=$((ninc + 1))
            echo "VMMSC-INFO 19 iteration=$i restored=no refused='$(grep -io '[^:]*incomplete.*' $L/s19-restore-$i.log | head -n1 | tr -d '\r' | cut -c1-100)'"
        fi
        rm -rf $S19DIR $clone
        i=$((i + 1))
    done
    # Every iteration's file, from a fresh boot on the image.
    vm_start s19-final 5 $SOCK "file=$img" "l2.scenario=s19loop l2.tag=$i" "mem=192M" || return 1
    until_ 120 grep -qE 'GUEST-S19-READY|GUEST-FAIL' $L/s19-final.log || true
    vm_tell s19-final 5 alive || { vmm_end s19-final "$t" 1 GUEST-NEVER "no GUEST-CMD"; chain_out "$img" s19; return 1; }
    vmm_end s19-final "$t" 1 GUEST-NEVER
    chain_out "$img" s19
    echo "VMMSC-INFO 19 iters=$iters restored=$nok refused_incomplete=$ninc checks_rc3=$rc3 chain=$(chain_of "$img" | wc -l)"
    booted_ok s19-final || return 1
    chain_check "$img" "0 3" || return 1
    note="$iters kill -9s at 0..$maxms ms into the snapshot: $nok restored and answered, $ninc refused as incomplete; every check 0 or 3 (rc3 x$rc3); the final boot read every iteration's file ($(chain_of "$img" | wc -l) files in the chain)"
}

# out_flush: what the scenario left in /out goes to the host at once, as a tar
# segment on /dev/vda after the previous one (from 16 MiB on: L1's init
# writes its own, final, tar at offset 0), then /out is emptied. run-l1.sh
# extracts every segment its marker names, even when L1 is cut by its
# timeout, so a later timeout cannot take the images of a finished scenario.
OUT_MIB=16
out_flush() {
    [ -b /dev/vda ] || return 0
    [ -n "$(ls -A /out)" ] || return 0
    bytes=$(tar -cf - -C /out . | wc -c)
    tar -cf - -C /out . | dd of=/dev/vda bs=1M seek=$OUT_MIB conv=notrunc,fsync 2>/dev/null
    echo "SANDBOX-OUT-SEGMENT mib=$OUT_MIB bytes=$bytes"
    OUT_MIB=$((OUT_MIB + (bytes + 1048575) / 1048576))
    rm -rf /out/* /out/.[!.]* 2>/dev/null
}

run() { # K FUNCTION
    t_sc=$(up)
    why=
    note=
    echo "VMMSC-START $1 uptime=$t_sc"
    if $2; then
        verdict="PASS $(since "$t_sc")s: $note"
    else
        verdict="FAIL $(since "$t_sc")s: $why"
    fi
    out_flush
    echo "VMMSC-RESULT $1 $verdict"
}

echo "VMMSC-L1 vmm=$VMM scenarios=$SCENARIOS"
[ "$VMM" = ch ] && echo "VMMSC-L1 $(./cloud-hypervisor --version 2>&1 | head -n1)"
for k in $SCENARIOS; do
    run "$k" "sc$k"
done
echo "VMMSC-L1 done, /tmp: $(df -k /tmp | awk 'NR == 2 { print $3 }') KiB used, /out: $(du -sk /out | cut -f1) KiB"
exit 0
