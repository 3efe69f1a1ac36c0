#!/usr/bin/env bash
# Boot the L1 sandbox (QEMU TCG with AMD SVM, real kvm-amd inside) with a
# payload, and exit with the payload's status.
#
# usage: run-l1.sh PAYLOAD_DIR
#
# PAYLOAD_DIR is copied to /payload in L1 (symlinks followed) and must hold
# run.sh, which L1's init runs with `sh /payload/run.sh` in /payload once
# /dev/kvm exists (PATH starts with /payload). Every dynamically linked ELF
# file in PAYLOAD_DIR gets its shared libraries (from `ldd` on this host)
# copied to the same absolute paths in L1, so a Rust binary runs as is.
# Put the L2 kernel and initramfs there too (see build-l2.sh).
#
# Environment:
#   SANDBOX_TIMEOUT  seconds before QEMU is killed (default 600)
#   SANDBOX_LOG      serial log file (default .cache/sandbox/logs/l1-DATE.log)
#   SANDBOX_MEM      L1 memory (default 1536M); SANDBOX_SMP (default 2)
#   SANDBOX_QUIET=1  do not echo the serial console to stdout
#   SANDBOX_APPEND   extra L1 kernel command-line words
#   SANDBOX_KICK_S   seconds of silence on L1's console after which a byte
#                    is sent to its serial input (default 30; 0: never),
#                    see "L1 that stops" below
#   SANDBOX_OUT=DIR  bring files back: whatever the payload writes under /out
#                    in L1 is extracted into DIR here afterwards (a tar stream
#                    through a virtio-blk disk; SANDBOX_OUT_SIZE, default 2G
#                    sparse, bounds it); a payload may also stream tar
#                    segments to /dev/vda from 16 MiB on while it runs, each
#                    announced by "SANDBOX-OUT-SEGMENT mib=N" once synced:
#                    those are extracted too, even after a timeout
#
# Exit status: the payload's (from "SANDBOX-RESULT rc=N"); 124 on timeout;
# 125 if L1 had no /dev/kvm; 1 if L1 ended without a result marker.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[ $# -eq 1 ] || die "usage: run-l1.sh PAYLOAD_DIR"
payload=$(cd "$1" 2>/dev/null && pwd) || die "payload directory $1 not found"
[ -f "$payload/run.sh" ] || die "$payload/run.sh missing (L1 runs it)"
command -v qemu-system-x86_64 >/dev/null 2>&1 || die "qemu-system-x86_64 not found: run scripts/sandbox/fetch.sh"
command -v cpio >/dev/null 2>&1 || die "cpio not found: run scripts/sandbox/fetch.sh"

timeout_s=${SANDBOX_TIMEOUT:-600}
mkdir -p "$CACHE/logs" "$CACHE/run"
log=${SANDBOX_LOG:-$CACHE/logs/l1-$(date +%Y%m%d-%H%M%S)-$$.log}
# Keep the 30 newest logs.
# (`ls` fails when there is no log yet: a fresh cache must not end the script.)
{ ls -1t "$CACHE/logs/"*.log 2>/dev/null || true; } | tail -n +30 | while IFS= read -r old; do rm -f "$old"; done
"$SANDBOX_SCRIPTS/build-l1.sh" >/dev/null

t_build=$(now)
work=$(mktemp -d "$CACHE/run/l1.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
mkdir -p "$root/payload"
cp -rL "$payload/." "$root/payload/"

# Shared libraries of every dynamic ELF in the payload, at their host paths.
is_dynamic_elf() {
    [ "$(head -c 4 "$1" 2>/dev/null | od -An -c | tr -d ' ')" = '177ELF' ] || return 1
    ldd "$1" >/dev/null 2>&1
}
nlibs=0
while IFS= read -r -d '' f; do
    is_dynamic_elf "$f" || continue
    if ldd "$f" | grep -q 'not found'; then
        die "$f: shared libraries not found on this host: $(ldd "$f" | grep 'not found' | tr -s ' \t' ' ')"
    fi
    for lib in $(ldd "$f" | awk '/=> \// { print $3 } /^[ \t]*\// { print $1 }'); do
        [ -e "$root$lib" ] && continue
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
        nlibs=$((nlibs + 1))
    done
done < <(find "$root/payload" -type f -print0)
# Debian's /lib and /lib64 are symlinks into /usr: mirror that so that either
# spelling of a path works in L1.
if [ -d "$root/lib/x86_64-linux-gnu" ] && [ ! -e "$root/usr/lib/x86_64-linux-gnu" ]; then
    mkdir -p "$root/usr/lib"
    ln -s ../../lib/x86_64-linux-gnu "$root/usr/lib/x86_64-linux-gnu"
fi

pack_cpio "$root" "$work/payload.cpio"
cat "$CACHE/l1/base.cpio" "$work/payload.cpio" >"$work/initrd.cpio"
rm -rf "$root" "$work/payload.cpio"
say "payload $payload: $(du -h "$work/initrd.cpio" | cut -f1) initramfs, $nlibs shared libraries added, packed in $(elapsed "$t_build")s"

append="console=ttyS0 panic=-1 quiet ${SANDBOX_APPEND:-}"
out_args=()
if [ -n "${SANDBOX_OUT:-}" ]; then
    mkdir -p "$SANDBOX_OUT"
    truncate -s "${SANDBOX_OUT_SIZE:-2G}" "$work/out.img"
    out_args=(-drive "file=$work/out.img,format=raw,if=virtio,cache=unsafe")
    append="$append sandbox.out"
fi
# shellcheck disable=SC2054 # commas are QEMU option syntax
qemu=(qemu-system-x86_64
    -accel tcg,thread=multi -cpu EPYC,+svm
    -m "${SANDBOX_MEM:-1536M}" -smp "${SANDBOX_SMP:-2}"
    -nographic -no-reboot -nodefaults -serial stdio
    -kernel "$CACHE/l1/vmlinuz" -initrd "$work/initrd.cpio"
    "${out_args[@]}"
    -append "$append")
# L1 that stops: QEMU 7.2's TCG running L2 under nested SVM can leave an
# interrupt pending in L1's local APIC without the vCPU's request for it,
# and L1's only vCPU then halts for good with no timer armed. Measured on
# 2026-11-26 with gdb on frozen L1s (at L2 boots, about once per 10-20 of
# them): the vCPU thread waiting for work, QEMU's main loop in ppoll
# until the RTC's next midnight; an NMI did not wake L1, raising the
# vCPU's CPU_INTERRUPT_HARD did at once. Any interrupt from a device makes
# QEMU look at the APIC again: after SANDBOX_KICK_S of silence on the
# console a carriage return goes to L1's serial input (the UART's receive
# interrupt). L1's init turns its console's echo off, so the byte never
# shows; a healthy L1 that is only quiet ignores it.
kick_s=${SANDBOX_KICK_S:-30}
case $kick_s in '' | *[!0-9]*) die "SANDBOX_KICK_S must be a number of seconds, not '$kick_s'" ;; esac
mkfifo "$work/serial-in"
# Read-write, so that QEMU's open for reading finds a writer at once.
exec {serial_in}<>"$work/serial-in"
: >"$work/kicks"
kick_watch() { # LOG
    local last=-1 same=0 size
    while sleep 5; do
        # Gone with this script, whatever ended it.
        kill -0 $$ 2>/dev/null || return 0
        size=$(stat -c %s "$1" 2>/dev/null || echo 0)
        if [ "$size" != "$last" ]; then
            same=0 last=$size
            continue
        fi
        same=$((same + 5))
        if [ "$same" -ge "$kick_s" ]; then
            printf '\r' >&"$serial_in"
            echo "$(cut -d' ' -f1 /proc/uptime) $same" >>"$work/kicks"
            same=0
        fi
    done
}
kick_pid=
if [ "$kick_s" -gt 0 ]; then
    kick_watch "$log" &
    kick_pid=$!
fi

say "booting L1 (timeout ${timeout_s}s), serial log: $log"
: >"$log"
t0=$(now)
kvm_t=""
set +e
timeout -k 10 "$timeout_s" "${qemu[@]}" <"$work/serial-in" 2>&1 | {
    while IFS= read -r line || [ -n "$line" ]; do
        line=${line%$'\r'}
        printf '%s\n' "$line" >>"$log"
        case $line in
            *"TCG doesn't support requested feature"*) ;; # expected with -cpu EPYC: log only
            *) [ "${SANDBOX_QUIET:-0}" = 1 ] || printf '%s\n' "$line" ;;
        esac
        case $line in
            *SANDBOX-KVM-READY*) [ -n "$kvm_t" ] || { kvm_t=$(elapsed "$t0"); echo "$kvm_t" >"$work/kvm_t"; } ;;
        esac
    done
}
qrc=${PIPESTATUS[0]}
set -e
total=$(elapsed "$t0")
if [ -n "$kick_pid" ]; then
    kill "$kick_pid" 2>/dev/null || true
    wait "$kick_pid" 2>/dev/null || true
fi
exec {serial_in}>&-
nkicks=$(wc -l <"$work/kicks")
[ "$nkicks" -eq 0 ] || say "L1's console was silent for ${kick_s}s $nkicks time(s): a byte was sent to its serial input each time"

# Segments the payload streamed while it ran ("SANDBOX-OUT-SEGMENT mib=N":
# a tar at N MiB on the out disk, written and synced before the marker):
# extracted even when L1 was cut by the timeout, so what a payload finished
# before a timeout is not lost with it.
if [ -n "${SANDBOX_OUT:-}" ]; then
    nseg=0
    for mib in $(sed -n 's/.*SANDBOX-OUT-SEGMENT mib=\([0-9]*\).*/\1/p' "$log"); do
        # tar stops at the archive's end and dd then dies of SIGPIPE, which
        # pipefail would count as a failure: only tar's status says anything.
        { dd if="$work/out.img" bs=1M skip="$mib" 2>/dev/null || true; } | tar -xf - -C "$SANDBOX_OUT" 2>/dev/null \
            || say "warning: the /out segment at $mib MiB could not be extracted"
        nseg=$((nseg + 1))
    done
    [ "$nseg" -eq 0 ] || say "$nseg /out segment(s) extracted into $SANDBOX_OUT"
fi
result=$(sed -n 's/.*SANDBOX-RESULT rc=\([0-9]*\).*/\1/p' "$log" | tail -n1)
kvm_wall=$(cat "$work/kvm_t" 2>/dev/null || echo "-")
kvm_up=$(sed -n 's/.*SANDBOX-KVM-READY uptime=\([0-9.]*\).*/\1/p' "$log" | head -n1)
say "L1 boot to /dev/kvm: ${kvm_wall}s wall (L1 uptime ${kvm_up:--}s); whole run ${total}s; qemu exit $qrc"
if [ -z "$result" ]; then
    if [ "$qrc" -eq 124 ] || [ "$qrc" -eq 137 ]; then
        say "FAILED: timed out after ${timeout_s}s (log: $log)"
        exit 124
    fi
    say "FAILED: L1 ended without a SANDBOX-RESULT marker (log: $log)"
    exit 1
fi
if [ -n "${SANDBOX_OUT:-}" ] && grep -q 'SANDBOX-OUT ' "$log"; then
    tar -xf "$work/out.img" -C "$SANDBOX_OUT" || { say "FAILED: cannot extract the /out tar stream"; exit 1; }
    say "files from L1 /out extracted into $SANDBOX_OUT"
fi
if [ "$result" -eq 125 ]; then
    say "FAILED: no /dev/kvm in L1 (log: $log)"
elif [ "$result" -ne 0 ]; then
    say "payload failed: rc=$result (log: $log)"
else
    say "payload passed (log: $log)"
fi
exit "$result"
