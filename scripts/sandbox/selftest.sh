#!/usr/bin/env bash
# End-to-end check of the nested sandbox, without our VMM:
#   1. fetch + build (cached), L1 boots and has /dev/kvm;
#   2. kvmcheck (static C, built here): KVM_CREATE_VM/VCPU, real-mode code
#      loops and writes to port 0x10, KVM_EXIT_IO + KVM_EXIT_HLT checked;
#   3. unless SANDBOX_SELFTEST_QEMU=0: Debian's qemu-system-x86_64 (with its
#      shared libraries) runs inside L1 with `-accel kvm` and boots the L2
#      kernel + build-l2.sh initramfs with a virtio-pmem device backed by an
#      ext4 image made on the host; the guest mounts /dev/pmem0 with `-o dax`,
#      writes a file, L1 finds the file's content in the image afterwards and
#      sends the image back (run-l1.sh SANDBOX_OUT): e2fsck -fn and debugfs
#      on the host check it.
# Prints timings. Non-interactive and bounded (SANDBOX_TIMEOUT, default 420 s).
# Exit 0 on success; prints SKIPPED and exits 0 only when QEMU cannot run at
# all on this machine; any other problem is a failure (non-zero).
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

skip() {
    printf '\nsandbox selftest: SKIPPED: %s\n' "$*"
    # CI on the project's machines must run the sandbox: a skip there fails.
    if [ -n "${CI:-}" ]; then
        printf 'sandbox selftest: CI is set, so a skip is a failure\n'
        exit 1
    fi
    exit 0
}
t_all=$(now)

# ---- can QEMU run here at all? -----------------------------------------------
if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
        skip "qemu-system-x86_64 is not installed and this user cannot install it (no root, no sudo)"
    fi
fi

say "== fetch (Debian packages, cached in $CACHE)"
t=$(now)
"$SANDBOX_SCRIPTS/fetch.sh"
t_fetch=$(elapsed "$t")

if ! printf 'quit\n' | timeout 60 qemu-system-x86_64 -accel tcg -machine none -nodefaults \
    -display none -monitor stdio >/dev/null 2>&1; then
    skip "qemu-system-x86_64 is installed but cannot start a TCG machine here"
fi

say "== build"
t=$(now)
"$SANDBOX_SCRIPTS/build-l1.sh"
payload=$CACHE/selftest/payload
rm -rf "$payload"
mkdir -p "$payload"
gcc -O2 -Wall -Wextra -static -o "$payload/kvmcheck" "$SANDBOX_SCRIPTS/kvmcheck.c"

with_qemu=${SANDBOX_SELFTEST_QEMU:-1}
if [ "$with_qemu" = 1 ]; then
    cat >"$CACHE/selftest/guest.sh" <<'EOF'
echo "guest: $(uname -r), $(grep -c ^processor /proc/cpuinfo) cpu(s)"
grep -q ' /mnt/pmem ' /proc/mounts || { echo "guest: /dev/pmem0 not mounted"; exit 2; }
grep ' /mnt/pmem ' /proc/mounts
grep -q 'dax' /proc/mounts || { echo "guest: not mounted with dax"; exit 3; }
echo "SELFTEST-L2-CONTENT-7f3a9c" >/mnt/pmem/hello.txt
sync
cat /mnt/pmem/hello.txt
EOF
    "$SANDBOX_SCRIPTS/build-l2.sh" "$CACHE/selftest/guest.sh" "$payload/l2"
    mkdir -p "$payload/qemu/share"
    cp -L "$(command -v qemu-system-x86_64)" "$payload/qemu/qemu-system-x86_64"
    for fw in /usr/share/seabios/bios-256k.bin /usr/share/qemu/kvmvapic.bin \
        /usr/share/qemu/linuxboot_dma.bin /usr/share/qemu/pvh.bin; do
        if [ -f "$fw" ]; then cp -L "$fw" "$payload/qemu/share/"; fi
    done
    [ -f "$payload/qemu/share/bios-256k.bin" ] || die "/usr/share/seabios/bios-256k.bin missing (package seabios)"
    command -v mkfs.ext4 >/dev/null 2>&1 || as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq e2fsprogs >/dev/null
    # The pmem image: ext4 with 4 KiB blocks (what -o dax needs), made here.
    truncate -s 16M "$payload/pmem.img"
    mkfs.ext4 -q -b 4096 -F "$payload/pmem.img"
fi

cat >"$payload/run.sh" <<'EOF'
up() { cut -d' ' -f1 /proc/uptime; }
echo "SELFTEST: /dev/kvm: $(ls -l /dev/kvm)"
t=$(up)
./kvmcheck || { echo "SELFTEST: kvmcheck FAILED"; exit 10; }
echo "SELFTEST: kvmcheck passed (L1 uptime $t -> $(up))"
[ -x ./qemu/qemu-system-x86_64 ] || exit 0

# ext4 image made on the host (in the payload): move it to tmpfs.
mv ./pmem.img /tmp/pmem.img || { echo "SELFTEST: no pmem.img"; exit 11; }
t=$(up)
echo "SELFTEST: booting L2 with qemu -accel kvm (L1 uptime $t)"
timeout 300 ./qemu/qemu-system-x86_64 -L ./qemu/share -accel kvm -cpu host \
    -m 256M,slots=2,maxmem=1G -smp 1 -nographic -nodefaults -serial stdio -no-reboot \
    -kernel l2/vmlinuz -initrd l2/initramfs.cpio -append "console=ttyS0 panic=-1 quiet" \
    -object memory-backend-file,id=pm0,share=on,mem-path=/tmp/pmem.img,size=16M \
    -device virtio-pmem-pci,memdev=pm0,id=pmem0 </dev/null >/tmp/l2.log 2>&1
qrc=$?
sed 's/^/    L2| /' /tmp/l2.log
echo "SELFTEST: qemu -accel kvm exited $qrc after $(awk -v a="$t" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')s"
[ $qrc -eq 0 ] || { echo "SELFTEST: qemu in L1 FAILED"; exit 12; }
grep -q 'L2-RESULT rc=0' /tmp/l2.log || { echo "SELFTEST: L2 guest script FAILED"; exit 13; }
grep -q 'L2-PMEM dev=/dev/pmem0 bytes=16777216 mounted=ext4-dax' /tmp/l2.log || { echo "SELFTEST: L2 pmem check FAILED"; exit 14; }
grep -q 'SELFTEST-L2-CONTENT-7f3a9c' /tmp/pmem.img || { echo "SELFTEST: file written by L2 not found in the image"; exit 15; }
echo "SELFTEST: L2 wrote through virtio-pmem (dax) into the L1 image file"
cp /tmp/pmem.img /out/pmem.img
exit 0
EOF
t_build=$(elapsed "$t")

say "== run L1"
log=$CACHE/logs/selftest-$(date +%Y%m%d-%H%M%S).log
mkdir -p "$CACHE/logs"
t=$(now)
out=$CACHE/selftest/out
rm -rf "$out"
set +e
SANDBOX_OUT=$out SANDBOX_LOG=$log SANDBOX_TIMEOUT=${SANDBOX_TIMEOUT:-420} "$SANDBOX_SCRIPTS/run-l1.sh" "$payload"
rc=$?
# L1's own kernel panicking under QEMU's emulation (seen twice over two days:
# an int3 Oops in __schedule, a fault in vcpu_run, both before the payload
# reported) says nothing of what this selftest checks, which runs no code of
# ours: boot L1 once more, and say so. A second panic fails.
if [ "$rc" -ne 0 ] && ! grep -q 'SANDBOX-RESULT' "$log" && grep -q 'Kernel panic - not syncing' "$log"; then
    say "L1's kernel panicked (log: $log): booting L1 once more"
    log=${log%.log}-retry.log
    rm -rf "$out"
    SANDBOX_OUT=$out SANDBOX_LOG=$log SANDBOX_TIMEOUT=${SANDBOX_TIMEOUT:-420} "$SANDBOX_SCRIPTS/run-l1.sh" "$payload"
    rc=$?
fi
set -e
t_run=$(elapsed "$t")

# The image came back through run-l1.sh's SANDBOX_OUT: check it on the host.
if [ "$rc" -eq 0 ] && [ "$with_qemu" = 1 ]; then
    if ! e2fsck -fn "$out/pmem.img" >"$out/e2fsck.txt" 2>&1; then
        cat "$out/e2fsck.txt"
        say "e2fsck on the image brought back from L1 FAILED"
        rc=20
    elif [ "$(debugfs -R 'cat /hello.txt' "$out/pmem.img" 2>/dev/null)" != SELFTEST-L2-CONTENT-7f3a9c ]; then
        say "/hello.txt in the image brought back from L1 is wrong"
        rc=21
    else
        say "image brought back from L1 (SANDBOX_OUT): e2fsck clean, /hello.txt as the L2 guest wrote it"
    fi
fi

kvm_up=$(sed -n 's/.*SANDBOX-KVM-READY uptime=\([0-9.]*\).*/\1/p' "$log" | head -n1)
l2_t=$(sed -n 's/.*qemu -accel kvm exited [0-9]* after \([0-9.]*\)s.*/\1/p' "$log" | head -n1)
echo
say "timings: fetch ${t_fetch}s, build ${t_build}s, L1 run ${t_run}s (L1 uptime at /dev/kvm ${kvm_up:--}s${l2_t:+, L2 boot+run under nested KVM ${l2_t}s}), total $(elapsed "$t_all")s"
if [ "$rc" -eq 0 ]; then
    if [ "$with_qemu" = 1 ]; then
        say "PASSED: L1 /dev/kvm, kvmcheck, and QEMU -accel kvm booting the L2 kernel with virtio-pmem (dax)"
    else
        say "PASSED: L1 /dev/kvm and kvmcheck (QEMU-in-L1 stage disabled)"
    fi
    echo "sandbox selftest: 1 passed, 0 failed"
    exit 0
fi
say "FAILED (rc=$rc), serial log: $log"
echo "sandbox selftest: 0 passed, 1 failed"
exit "$rc"
