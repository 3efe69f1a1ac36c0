#!/usr/bin/env bash
# The paper's guest-level table, measured in the nested sandbox: fio inside
# the same Debian L2 guest (6.1 cloud kernel, build-l2.sh's busybox
# initramfs plus Debian's fio and its shared libraries) on six storage
# variants, in ONE L1 boot:
#   ext4 -o dax on virtio-pmem, our cloud-hypervisor (release build):
#     pcow-snap   a thin pcow image after `pcow-img snapshot -c` (writes copy)
#     pcow-ovl    a pcow overlay (`pcow-img create -b`) on a pcow base
#     raw-dax     a raw file (THE BASELINE: every ratio is to raw-dax)
#   ext4 (no dax) on virtio-blk, Debian's QEMU in the same L1 (-accel kvm):
#     qcow2-snap  a thin qcow2 after `qemu-img snapshot -c`
#     qcow2-bak   a qcow2 overlay with a backing file (`qemu-img create -b`)
#     raw-blk     a raw image
# and four fio jobs (guest-bench-guest.sh): 4 KiB random write, 4 KiB random
# read, 4 KiB random write with fsync after each, 1 MiB sequential write.
# Every (round, variant) is one VM boot on a fresh image that runs the jobs
# one after the other (a `sync` between them, outside fio's timing); within
# a round the variants boot one after the other (their order rotated every
# round), so the variants sit side by side in time. One boot per job would
# be purer but does not fit: with fio's libraries (about 80 MiB) in the
# initramfs, a boot and one fio start (its dynamic linking, emulated) take
# 10-25 s here, more under QEMU. The host
# then parses fio's JSON (guest-bench-report.py), prints the medians and
# ratios, and writes docs/guest-benchmarks.md and its plot.
#
# All of it is emulated (nested KVM inside QEMU TCG): absolute numbers mean
# nothing; the doc says which way emulation bends each ratio.
#
# Environment:
#   GB_ROUNDS       rounds (default 3)
#   GB_JOBS         jobs, in the order each boot runs them (default
#                   "randread randwrite fsync seqwrite": the read first,
#                   on the image as it was made)
#   GB_VARIANTS     variants (default all six, in the order above)
#   GB_SIZE_RANDWRITE, GB_SIZE_RANDREAD, GB_SIZE_FSYNC, GB_SIZE_SEQWRITE
#                   each job's bytes (K/M suffixes; defaults 8M, 8M, 1M, 32M)
#   GB_FS_MIB       the ext4 file system's size (default 128)
#   GB_MEM          the L2 guest's memory (default 512M: the initramfs with
#                   fio and its libraries is about 45 MiB, unpacked twice)
#   GB_PROFILE=0    skip the profiled pcow boots (VMM debug log) at the end
#   GB_PROFILE_LOG=1  raw-dax is profiled too, and every profiled boot's
#                   whole output (serial + VMM log) is kept in the serial
#                   log for guest-bench-breakdown.py (see the doc's "Where
#                   pcow's time goes")
#   GB_WARMUP=0     skip the warm-up boot (raw-dax, randread; not counted)
#   GB_DIRTY_RING=off  our VMM reads KVM's dirty bitmap in L1 instead of its
#                   dirty ring (PCOW_DIRTY_RING=off, docs/vmm.md): to compare
#                   the two
#   GB_DOC          output document (default docs/guest-benchmarks.md; `-`
#                   writes none)
#   GB_RUN_TIMEOUT  s, one VM boot (default 600: killed and failed past it)
#   GB_EST_BOOT_S   s, the estimate of one VM boot (all jobs) the L1 timeout
#                   is made of (default: from the job sizes, see below)
#   GB_TIMEOUT_FACTOR  margin on that estimate (default 2)
#   SANDBOX_TIMEOUT overrides the L1 timeout computed from those (per
#                   L1 attempt)
#   GB_STALL_S      s without a byte on L1's console after which L1 counts
#                   as frozen: its QEMU is killed and a new L1 carries on
#                   from the boot that froze (default 180; L1 prints
#                   GB-ALIVE every 20 s while a VM runs)
#   GB_L1_ATTEMPTS  L1 boots at most (default 4, plus one per 6 VM boots
#                   of the run: L1 froze 1, 4 and 1 times in runs of 37, 37
#                   and 5 VM boots on 2026-11-27; 4 attempts lost 7 of 12
#                   rounds of the second)
#   SANDBOX_KICK_S  default 0 here: a frozen L1 is restarted, not woken
#                   (run-l1.sh; a woken boot's fio numbers hold the freeze)
#   GB_TEST_FREEZE=K  test the restart: L1 goes silent (sleeps) when boot K
#                   of the schedule starts, in the first GB_TEST_FREEZE_TIMES
#                   (default 1) attempts
#   GB_REPORT_ONLY=LOG  parse an earlier run's serial log again (no L1);
#                   GB_NOTE: a paragraph for the document's Results section
# Exit 0 when every run succeeded; non-zero when any run failed or the L1
# run did not finish; SKIPPED + exit 0 only when QEMU cannot run at all.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

skip() {
    printf '\nguest bench: SKIPPED: %s\n' "$*"
    exit 0
}
t_all=$(now)
cd "$REPO_ROOT"
W=$CACHE/guest-bench
payload=$W/payload
DOC=${GB_DOC:-docs/guest-benchmarks.md}
ROUNDS=${GB_ROUNDS:-3}
JOBS=${GB_JOBS:-randread randwrite fsync seqwrite}
VARIANTS=${GB_VARIANTS:-pcow-snap pcow-ovl raw-dax qcow2-snap qcow2-bak raw-blk}
FS_MIB=${GB_FS_MIB:-128}
MEM=${GB_MEM:-512M}
RUN_TIMEOUT=${GB_RUN_TIMEOUT:-600}
WARMUP=${GB_WARMUP:-1}
PROFILE=${GB_PROFILE:-1}
PROFILE_LOG=${GB_PROFILE_LOG:-0}
case $ROUNDS in '' | *[!0-9]* | 0) die "GB_ROUNDS must be a positive integer, not '$ROUNDS'" ;; esac
case $FS_MIB in '' | *[!0-9]* | 0) die "GB_FS_MIB must be a positive integer (MiB), not '$FS_MIB'" ;; esac
case $RUN_TIMEOUT in '' | *[!0-9]* | 0) die "GB_RUN_TIMEOUT must be a positive integer (s), not '$RUN_TIMEOUT'" ;; esac
for j in $JOBS; do
    case $j in randwrite | randread | fsync | seqwrite) ;; *) die "GB_JOBS: unknown job '$j' (randwrite randread fsync seqwrite)" ;; esac
done
for v in $VARIANTS; do
    case $v in pcow-snap | pcow-ovl | raw-dax | qcow2-snap | qcow2-bak | raw-blk) ;;
        *) die "GB_VARIANTS: unknown variant '$v' (pcow-snap pcow-ovl raw-dax qcow2-snap qcow2-bak raw-blk)" ;;
    esac
done
case " $VARIANTS " in *" raw-dax "*) ;; *) die "GB_VARIANTS must include raw-dax: it is the baseline of every ratio" ;; esac

# bytes SIZE: K/M suffixes to bytes.
bytes() {
    case $1 in
        *[!0-9KkMm]* | '' | [KkMm]*) return 1 ;;
        *[Kk]) echo $((${1%[Kk]} * 1024)) ;;
        *[Mm]) echo $((${1%[Mm]} * 1048576)) ;;
        *) echo "$1" ;;
    esac
}
declare -A SIZE
for j in randwrite randread fsync seqwrite; do
    var=GB_SIZE_${j^^}
    case $j in randwrite | randread) def=8M ;; fsync) def=1M ;; seqwrite) def=32M ;; esac
    SIZE[$j]=$(bytes "${!var:-$def}") || die "$var='${!var}' is not a size (N, NK or NM)"
    [ "${SIZE[$j]}" -ge 4096 ] || die "$var must be at least 4K"
done
# Room on the file system: the file to read, plus the largest new file, plus
# ext4's own (journal, tables): a quarter, at least 8 MiB.
need=$(((SIZE[randread] + $(printf '%s\n' "${SIZE[randwrite]}" "${SIZE[fsync]}" "${SIZE[seqwrite]}" | sort -n | tail -n1)) / 1048576))
[ $((need + 8 + need / 4)) -le "$FS_MIB" ] \
    || die "GB_FS_MIB=$FS_MIB is too small for the job sizes (${need} MiB of files): raise it"

report() { # LOG L1_SECONDS
    python3 "$SANDBOX_SCRIPTS/guest-bench-report.py" --log "$1" --doc "$DOC" \
        --plot="${DOC%.md}.svg" --l1-seconds "$2" --rounds "$ROUNDS" --jobs "$JOBS" \
        --variants "$VARIANTS" --sizes "randwrite=${SIZE[randwrite]} randread=${SIZE[randread]} fsync=${SIZE[fsync]} seqwrite=${SIZE[seqwrite]}" \
        --fs-mib "$FS_MIB" --mem "$MEM" --manifest "$MANIFEST" --command "$CMDLINE" \
        --load "${LOAD:-}" --images "${IMAGES:-}" --note "${GB_NOTE:-}"
}
# The command as run, with the knobs that change what is measured.
CMDLINE="$({ env | grep -E '^GB_(ROUNDS|JOBS|VARIANTS|SIZE_[A-Z]+|FS_MIB|MEM|PROFILE|PROFILE_LOG|WARMUP|DIRTY_RING)=' || true; } | sort | sed "s/=\\(.*\\)/='\\1'/" | tr '\n' ' ')scripts/sandbox/guest-bench.sh"
if [ -n "${GB_REPORT_ONLY:-}" ]; then
    [ -f "$GB_REPORT_ONLY" ] || die "GB_REPORT_ONLY=$GB_REPORT_ONLY: no such log"
    report "$GB_REPORT_ONLY" 0
    exit $?
fi

tdir=${CARGO_TARGET_DIR:-target}
case $tdir in /*) ;; *) tdir=$REPO_ROOT/$tdir ;; esac

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
host_pkgs=()
command -v mkfs.ext4 >/dev/null 2>&1 || host_pkgs+=(e2fsprogs)
command -v qemu-img >/dev/null 2>&1 || host_pkgs+=(qemu-utils)
command -v gnuplot >/dev/null 2>&1 || host_pkgs+=(gnuplot-nox)
command -v python3 >/dev/null 2>&1 || host_pkgs+=(python3)
if [ ${#host_pkgs[@]} -gt 0 ]; then
    say "installing host packages: ${host_pkgs[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${host_pkgs[@]}" >/dev/null \
        || die "apt-get install ${host_pkgs[*]} failed"
fi

# ---- fio: Debian's package, extracted; its libraries from this host -------------
# fio is linked against every engine's library (rbd, rados, gluster, nbd,
# pmem, rdma...): the dynamic loader needs them all, although the psync
# engine uses none. They are Debian's too: the ones this host lacks are
# installed from fio's Depends, then `ldd` on the extracted binary finds them.
fio_deb=$(find "$DEBS" -maxdepth 1 -name 'fio_*_amd64.deb' | sort | head -n1)
if [ -z "$fio_deb" ]; then
    say "apt-get download fio"
    (cd "$DEBS" && apt-get download -q fio 2>&1 | grep -v unsandboxed) || true
    fio_deb=$(find "$DEBS" -maxdepth 1 -name 'fio_*_amd64.deb' | sort | head -n1)
    if [ -z "$fio_deb" ]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        (cd "$DEBS" && apt-get download -q fio) || die "apt-get download fio failed"
        fio_deb=$(find "$DEBS" -maxdepth 1 -name 'fio_*_amd64.deb' | sort | head -n1)
    fi
fi
fio_ver=$(dpkg-deb -f "$fio_deb" Version)
fio_x=$XDIR/fio
if [ ! -f "$fio_x/.extracted" ] || [ "$(cat "$fio_x/.extracted")" != "$fio_ver" ]; then
    rm -rf "$fio_x"
    mkdir -p "$fio_x"
    dpkg-deb -x "$fio_deb" "$fio_x"
    echo "$fio_ver" >"$fio_x/.extracted"
fi
FIO=$fio_x/usr/bin/fio
[ -x "$FIO" ] || die "$fio_deb has no usr/bin/fio"
if ldd "$FIO" | grep -q 'not found'; then
    missing=()
    for p in $(dpkg-deb -f "$fio_deb" Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/[[:space:]]//g'); do
        case $p in lib* | zlib*) ;; *) continue ;; esac
        dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    say "installing fio's libraries this host lacks: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
fi
if ldd "$FIO" | grep -q 'not found'; then
    die "fio's shared libraries not found: $(ldd "$FIO" | grep 'not found' | tr -s ' \t' ' ')"
fi

say "== cargo build --release (cloud-hypervisor + pcow-img)"
cargo build --release -q -p vmm --bin cloud-hypervisor -p pcow --bin pcow-img \
    || die "cargo build of cloud-hypervisor/pcow-img failed"
PCOW_IMG=$tdir/release/pcow-img

say "== build (L1, L2 + fio, images, payload)"
t_build=$(now)
"$SANDBOX_SCRIPTS/build-l1.sh" >/dev/null
rm -rf "$W"
mkdir -p "$payload/qemu/share" "$W/fs" "$W/fio-root/usr/bin" "$W/fio-root/etc"
# The L2 initramfs: build-l2.sh's (with virtio_blk for the QEMU variants),
# then a second cpio archive with fio (the kernel unpacks concatenated
# archives in turn).
SANDBOX_L2_MODULES=virtio_blk "$SANDBOX_SCRIPTS/build-l2.sh" "$SANDBOX_SCRIPTS/guest-bench-guest.sh" "$payload/l2" >/dev/null
cp "$FIO" "$W/fio-root/usr/bin/fio"
libdirs=
for lib in $(ldd "$FIO" | awk '/=> \// { print $3 } /^[ \t]*\// { print $1 }'); do
    mkdir -p "$W/fio-root$(dirname "$lib")"
    cp -L "$lib" "$W/fio-root$lib"
    d=$(dirname "$lib")
    case ":$libdirs:" in *":$d:"*) ;; *) libdirs=${libdirs:+$libdirs:}$d ;; esac
done
echo "$libdirs" >"$W/fio-root/etc/gb-libdirs"
# The same tree must run fio on its own: a library missing from it fails
# here, not in a guest.
LD_LIBRARY_PATH=$libdirs chroot "$W/fio-root" /usr/bin/fio --version >/dev/null 2>"$W/fio-chroot.err" \
    || die "fio does not run from its initramfs tree: $(head -c 400 "$W/fio-chroot.err")"
fio_mib=$(du -sm "$W/fio-root" | cut -f1)
pack_cpio "$W/fio-root" "$W/fio.cpio"
cat "$W/fio.cpio" >>"$payload/l2/initramfs.cpio"
rm -rf "$W/fio-root" "$W/fio.cpio"

# QEMU in L1 (as selftest.sh): the binary (its libraries: run-l1.sh), the
# firmware, and qemu-img for the overlays.
cp -L "$(command -v qemu-system-x86_64)" "$payload/qemu/qemu-system-x86_64"
cp -L "$(command -v qemu-img)" "$payload/qemu/qemu-img"
for fw in /usr/share/seabios/bios-256k.bin /usr/share/qemu/kvmvapic.bin \
    /usr/share/qemu/linuxboot_dma.bin /usr/share/qemu/pvh.bin /usr/share/qemu/vgabios-stdvga.bin \
    /usr/share/qemu/efi-virtio.rom; do
    if [ -f "$fw" ]; then cp -L "$fw" "$payload/qemu/share/"; fi
done
[ -f "$payload/qemu/share/bios-256k.bin" ] || die "/usr/share/seabios/bios-256k.bin missing (package seabios)"
for b in cloud-hypervisor pcow-img; do
    strip --strip-debug -o "$payload/$b" "$tdir/release/$b" 2>/dev/null || cp "$tdir/release/$b" "$payload/$b"
done

# The file system: ext4 with 4 KiB blocks (what -o dax needs) holding the
# file the read job reads (random bytes). Every variant starts from these
# same bytes: raw as is; pcow and qcow2 converted from it (thin: they hold
# only what the file system wrote).
head -c "${SIZE[randread]}" /dev/urandom >"$W/fs/gb-read.dat"
truncate -s "${FS_MIB}M" "$W/gb.raw"
mkfs.ext4 -q -b 4096 -F -d "$W/fs" "$W/gb.raw"
gzip -1 -c "$W/gb.raw" >"$payload/pristine.raw.gz"
"$PCOW_IMG" convert -f raw -O pcow "$W/gb.raw" "$payload/pcow-snap.pcow"
"$PCOW_IMG" snapshot -q -c gb-before "$payload/pcow-snap.pcow"
"$PCOW_IMG" convert -f raw -O pcow "$W/gb.raw" "$payload/pcow-base.pcow"
qemu-img convert -f raw -O qcow2 "$W/gb.raw" "$payload/qcow2-snap.qcow2"
qemu-img snapshot -c gb-before "$payload/qcow2-snap.qcow2"
qemu-img convert -f raw -O qcow2 "$W/gb.raw" "$payload/qcow2-base.qcow2"
pcow_info=$("$PCOW_IMG" info "$payload/pcow-snap.pcow" | grep -i -m1 cluster | tr -s ' ' || true)
qcow2_info=$(qemu-img info "$payload/qcow2-snap.qcow2" | grep -i -m1 cluster | tr -s ' ' || true)
IMAGES="pcow: ${pcow_info:-?}, $(($(stat -c %s "$payload/pcow-snap.pcow") / 1024)) KiB file; qcow2: ${qcow2_info:-?}, $(($(stat -c %s "$payload/qcow2-snap.qcow2") / 1024)) KiB file."
rm -f "$W/gb.raw"
{
    echo "ROUNDS=$ROUNDS"
    echo "JOBS='$JOBS'"
    echo "VARIANTS='$VARIANTS'"
    echo "SIZES=randwrite:${SIZE[randwrite]},randread:${SIZE[randread]},fsync:${SIZE[fsync]},seqwrite:${SIZE[seqwrite]}"
    echo "MEM=$MEM"
    echo "WARMUP=$WARMUP"
    echo "RUN_TIMEOUT=$RUN_TIMEOUT"
    echo "PROFILE=$PROFILE"
    echo "PROFILE_LOG=$PROFILE_LOG"
    echo "DIRTY_RING='${GB_DIRTY_RING:-}'"
} >"$payload/gb.conf"
cp "$SANDBOX_SCRIPTS/guest-bench-l1.sh" "$payload/run.sh"
say "built in $(elapsed "$t_build")s: L2 initramfs $(du -m "$payload/l2/initramfs.cpio" | cut -f1) MiB (fio $fio_ver and its libraries: $fio_mib MiB); images: pcow ${pcow_info:-?}; qcow2 ${qcow2_info:-?}"

# ---- L1 -----------------------------------------------------------------------------
# The timeout: L1 boot, unpacking and output (90 s), plus every VM boot at
# the estimate times the factor. The estimate, from a run on 2026-11-26 (2
# busy cores, load 5-6): a boot whose jobs do almost nothing took 24-63 s
# (each fio start links its ~50 libraries under emulation: seconds each;
# QEMU's boot is the slower), so 45 s, plus the jobs at the slowest rate
# any variant had in that run: randread 110 IOPS, randwrite 80 IOPS, fsync
# 20 IOPS, seqwrite 10 MiB/s.
nvar=$(wc -w <<<"$VARIANTS")
nboots=$((ROUNDS * nvar))
[ "$WARMUP" = 1 ] && nboots=$((nboots + 1))
[ "$PROFILE" = 1 ] && nboots=$((nboots + 2))
[ "$PROFILE" = 1 ] && [ "$PROFILE_LOG" = 1 ] && nboots=$((nboots + 1))
est=${GB_EST_BOOT_S:-$((45 + SIZE[randread] / 4096 / 110 + SIZE[randwrite] / 4096 / 80 + SIZE[fsync] / 4096 / 20 + SIZE[seqwrite] / 1048576 / 10))}
factor=${GB_TIMEOUT_FACTOR:-2}
export SANDBOX_SMP=${SANDBOX_SMP:-1}
mkdir -p "$CACHE/logs"
log=$CACHE/logs/guest-bench-$(date +%Y%m%d-%H%M%S).log
: >"$log"
# A frozen L1 (seen three times on 2026-11-26, each during a VM boot: L1's
# QEMU at 0% CPU, nothing on the console, the in-L1 per-boot timeout never
# firing, as nothing in L1 runs any more) would otherwise sit until the
# whole-run timeout. While a VM boots, L1 prints `GB-ALIVE` every 20 s;
# the watcher kills this script's own L1 QEMU (a descendant, found by
# parent pid) once the attempt's serial log has not grown for GB_STALL_S.
# A new L1 then carries on from the boot that hung (retried once; hung
# again, it is recorded as failed and the next one runs): what was done
# before the hang keeps its verdict, and the combined log has every
# attempt's output in order, with a GB-HOST line per hang.
STALL_S=${GB_STALL_S:-180}
# run-l1.sh would wake a stuck L1 with a byte on its serial input after
# SANDBOX_KICK_S of silence (see there); here a boot that stopped for that
# long would keep its fio numbers with the stop inside them, so a frozen L1
# is restarted from the boot that froze instead (unless SANDBOX_KICK_S is
# given).
export SANDBOX_KICK_S=${SANDBOX_KICK_S:-0}
case $STALL_S in '' | *[!0-9]* | 0) die "GB_STALL_S must be a positive integer (s), not '$STALL_S'" ;; esac
ATTEMPTS=${GB_L1_ATTEMPTS:-$((4 + nboots / 6))}
case $ATTEMPTS in '' | *[!0-9]* | 0) die "GB_L1_ATTEMPTS must be a positive integer, not '$ATTEMPTS'" ;; esac
descendants() {
    local c
    for c in $(ps -o pid= --ppid "$1"); do
        echo "$c"
        descendants "$c"
    done
}
watch_stall() { # LOG STALL_S ROOT_PID FLAG_FILE
    local last=-1 same=0 size p
    while sleep 10; do
        size=$(stat -c %s "$1" 2>/dev/null || echo 0)
        if [ "$size" = "$last" ]; then same=$((same + 10)); else same=0 last=$size; fi
        if [ "$same" -ge "$2" ]; then
            echo "$same" >"$4"
            for p in $(descendants "$3"); do
                [ "$(cat "/proc/$p/comm" 2>/dev/null)" = qemu-system-x86 ] && kill "$p" 2>/dev/null
            done
            return 0
        fi
    done
}
t=$(now)
# The host's load while L1 runs (other jobs share the 2 cores): sampled
# every 20 s, reported as its range.
(while :; do cut -d' ' -f1 /proc/loadavg; sleep 20; done) >"$W/load.txt" &
load_pid=$!
skip_to=0
attempt=0
freezes=0
hangs=
declare -A hung_before
while :; do
    attempt=$((attempt + 1))
    left=$((nboots - skip_to))
    [ "$left" -ge 1 ] || left=1
    l1_timeout=${SANDBOX_TIMEOUT:-$((90 + left * est * factor))}
    part=$log.$attempt
    sed -i '/^SKIP=/d; /^FREEZE_AT=/d' "$payload/gb.conf"
    echo "SKIP=$skip_to" >>"$payload/gb.conf"
    if [ -n "${GB_TEST_FREEZE:-}" ] && [ "$attempt" -le "${GB_TEST_FREEZE_TIMES:-1}" ]; then
        echo "FREEZE_AT=$GB_TEST_FREEZE" >>"$payload/gb.conf"
    fi
    say "== run L1, attempt $attempt ($left of $nboots VM boots left, about ${est}s each, L1 vCPUs $SANDBOX_SMP, timeout ${l1_timeout}s, stall ${STALL_S}s), serial log: $part"
    rm -f "$W/stalled"
    watch_stall "$part" "$STALL_S" $$ "$W/stalled" &
    stall_pid=$!
    set +e
    SANDBOX_QUIET=1 SANDBOX_LOG=$part SANDBOX_TIMEOUT=$l1_timeout \
        "$SANDBOX_SCRIPTS/run-l1.sh" "$payload" | grep --line-buffered '^\[run-l1'
    rc=${PIPESTATUS[0]}
    set -e
    kill "$stall_pid" 2>/dev/null || true
    wait "$stall_pid" 2>/dev/null || true
    tr -d '\r' <"$part" >>"$log"
    [ -f "$W/stalled" ] || break
    freezes=$((freezes + 1))
    # A block cut by the freeze is closed here, as failed, so that the
    # next attempt's lines do not land in it.
    if [ "$(grep -a -c '^GB-FIO-BEGIN' "$part")" -gt "$(grep -a -c '^GB-FIO-END' "$part")" ]; then
        echo "GB-FIO-END rc=-2" >>"$log"
    fi
    # Which boot hung: the last one started and not done.
    started=$(tr -d '\r' <"$part" | grep -a '^GB-START i=' | tail -n1 || true)
    k=$(sed -n 's/^GB-START i=\([0-9]*\) .*/\1/p' <<<"$started")
    if [ -z "$k" ]; then
        hangs="${hangs:+$hangs; }attempt $attempt: L1 froze before its first boot"
        next_skip=$skip_to
    elif tr -d '\r' <"$part" | grep -a -q "^GB-DONE i=$k\$"; then
        hangs="${hangs:+$hangs; }attempt $attempt: L1 froze between boots (after boot $k)"
        next_skip=$((k + 1))
    else
        r=$(sed -n 's/.* round=\([^ ]*\) .*/\1/p' <<<"$started")
        v=$(sed -n 's/.* variant=\([^ ]*\) .*/\1/p' <<<"$started")
        if [ -z "${hung_before[$k]:-}" ]; then
            hung_before[$k]=1
            action=retried
            next_skip=$k
        else
            action="given up (hung twice)"
            next_skip=$((k + 1))
            # The boot's verdict: failed (the report names it).
            if [ "$r" = prof ]; then
                echo "GB-PROF-BOOT variant=$v rc=-2 guest=HUNG wall=0" >>"$log"
            else
                echo "GB-BOOT round=$r variant=$v rc=-2 guest=HUNG wall=0" >>"$log"
            fi
        fi
        hangs="${hangs:+$hangs; }attempt $attempt: L1 froze during the boot of $v (round $r), $action"
    fi
    echo "GB-HOST l1-hung attempt=$attempt stalled_s=$(cat "$W/stalled") boot=${k:-none} next=$next_skip" >>"$log"
    say "L1 froze (nothing on its console for $(cat "$W/stalled")s; its QEMU was killed): ${hangs##*; }"
    if [ "$attempt" -ge "$ATTEMPTS" ]; then
        say "giving up after $attempt L1 attempts (GB_L1_ATTEMPTS)"
        break
    fi
    skip_to=$next_skip
done
kill "$load_pid" 2>/dev/null || true
wait "$load_pid" 2>/dev/null || true
LOAD=$(sort -n "$W/load.txt" | awk 'NR == 1 { lo = $1 } { hi = $1; n++ } END { if (n) printf "%s-%s (%d samples, every 20 s)", lo, hi, n }')
t_l1=$(elapsed "$t")
if [ -n "$hangs" ]; then
    GB_NOTE="${GB_NOTE:+$GB_NOTE }L1 froze $freezes time(s) in this run and was restarted by guest-bench.sh, carrying on from the boot that hung: $hangs (the L1 time includes the ${STALL_S}-s waits before each restart)."
    [ -f "$W/stalled" ] && GB_NOTE="$GB_NOTE The last attempt froze too and the run stopped there."
fi
tr -d '\r' <"$log" | grep -a -E '^(GB-BOOT|GB-PROF|GB-L1|GB-HOST|GB-FIO-END|  L2\| )' | grep -v -a -E 'GB-PROF-(FIO|LOG)' | sed 's/^/  /' || true
set +e
report "$log" "$t_l1"
prc=$?
set -e
say "L1 run ${t_l1}s (rc $rc), total $(elapsed "$t_all")s; serial log: $log"
[ ! -f "$W/stalled" ] || die "L1 froze in its last attempt ($attempt of GB_L1_ATTEMPTS=$ATTEMPTS; log $log)"
[ "$rc" -eq 0 ] || die "the L1 run failed (run-l1.sh exit $rc$([ "$rc" -eq 124 ] && echo ": timeout after ${l1_timeout}s"); log $log)"
[ "$prc" -eq 0 ] || die "the report failed (exit $prc; log $log)"
