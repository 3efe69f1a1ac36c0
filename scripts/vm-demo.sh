#!/usr/bin/env bash
# The main job: boot a stock Linux guest with our `cloud-hypervisor` on a
# pcow pmem device, twice, with an offline snapshot in between.
#
#   1. builds `cloud-hypervisor` and `pcow-img` (release), fetches the guest
#      kernel and busybox from Debian's archive (scripts/sandbox/fetch.sh);
#   2. makes an ext4 filesystem on the host (mkfs.ext4 -d, with a hello.txt)
#      and converts it to a thin pcow image (`pcow-img convert -O pcow`);
#   3. boots the guest: it mounts /dev/pmem0 with `-o dax`, reads hello.txt,
#      counts its boots in a file, writes 2 MiB, syncs (a virtio-pmem FLUSH:
#      a pcow barrier), powers off (the VMM exits 0);
#   4. `pcow-img check`, `snapshot -c`, boots again (the guest sees its
#      first boot's files), `snapshot -l`, `info`.
#
# Where this machine's KVM cannot run a stock Linux guest (no /dev/kvm, or
# the emulating "kvm_pvm" KVM of the project's machines, see
# shared/design/platform-facts.md), the same session runs inside the nested
# sandbox (QEMU TCG with SVM, real kvm-amd inside; scripts/sandbox/) and
# says so. Exits non-zero on any failure.
#
# Environment: DEMO_MODE=host|sandbox forces the mode; KEEP_DEMO=1 keeps
# the work directory.
set -euo pipefail
# shellcheck source=sandbox/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/sandbox/lib.sh"
cd "$REPO_ROOT"
target=${CARGO_TARGET_DIR:-$REPO_ROOT/target}

say "== prerequisites"
command -v cargo >/dev/null 2>&1 \
    || die "cargo not found: install the Rust toolchain (https://rustup.rs), 1.89 or newer"
if ! command -v mkfs.ext4 >/dev/null 2>&1; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq e2fsprogs
fi
if ! dpkg -s libclang-dev >/dev/null 2>&1 && [ -x /usr/bin/apt-get ]; then
    # The userfaultfd crate's bindings are generated at build time.
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev
fi

say "== build (release): cloud-hypervisor, pcow-img"
cargo build --release -q -p vmm --bin cloud-hypervisor -p pcow --bin pcow-img
"$SANDBOX_SCRIPTS/fetch.sh"

mode=${DEMO_MODE:-}
if [ -z "$mode" ]; then
    if [ ! -c /dev/kvm ]; then
        mode=sandbox
        why="this machine has no /dev/kvm"
    elif [ -d /sys/module/kvm_pvm ]; then
        mode=sandbox
        why="this machine's /dev/kvm is the emulating kvm_pvm, which cannot run a stock Linux guest"
    else
        mode=host
    fi
fi
if [ "$mode" = sandbox ]; then
    say "running the guest inside the nested sandbox: ${why:-DEMO_MODE=sandbox}"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/pcow-vm-demo.XXXXXX")
[ "${KEEP_DEMO:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
payload=$work/payload
mkdir -p "$payload" "$work/fs"

# The guest's part (runs as /guest.sh after the L2 init mounted the pmem).
cat >"$work/guest.sh" <<'EOF'
echo "guest: Linux $(uname -r), $(grep -c ^processor /proc/cpuinfo) vCPU(s)"
grep ' /mnt/pmem ' /proc/mounts
df -h /mnt/pmem | tail -n 1
cat /mnt/pmem/hello.txt
n=$(cat /mnt/pmem/boots 2>/dev/null || echo 0)
n=$((n + 1))
echo "$n" >/mnt/pmem/boots
echo "guest: boot number $n of this image"
dd if=/dev/urandom of="/mnt/pmem/data-$n" bs=1M count=2 2>/dev/null
sync
ls -l /mnt/pmem
# Serial input: the session types a line into the VMM's standard input once
# it sees this prompt; the guest reads it from its console (ttyS0).
echo "guest: type a line"
if read -t 60 line; then
    echo "guest: read from the serial console: $line"
else
    echo "guest: no serial input"
fi
EOF
"$SANDBOX_SCRIPTS/build-l2.sh" "$work/guest.sh" "$payload/l2" >/dev/null

say "== a thin pcow image with an ext4 filesystem made on the host"
echo "Hello from the host: this file was put in the image by mkfs.ext4 -d" >"$work/fs/hello.txt"
truncate -s 128M "$work/raw.img"
mkfs.ext4 -q -b 4096 -d "$work/fs" -F "$work/raw.img"
"$target/release/pcow-img" convert -O pcow "$work/raw.img" "$payload/demo.pcow"
"$target/release/pcow-img" info "$payload/demo.pcow"
cp "$target/release/cloud-hypervisor" "$target/release/pcow-img" "$payload/"

# The session: the same commands on the host or in L1.
cat >"$payload/session.sh" <<'EOF'
set -e
img=$1
boot() {
    echo
    echo "\$ cloud-hypervisor --kernel l2/vmlinuz --initramfs l2/initramfs.cpio --cmdline \"console=ttyS0 panic=-1 quiet\" --cpus boot=2 --memory size=256M --pmem file=$img --serial tty --console off"
    # Standard input is a FIFO: a line is typed into it when the guest asks.
    rm -f /tmp/demo-in /tmp/demo-out
    mkfifo /tmp/demo-in
    exec 3<>/tmp/demo-in
    timeout 300 ./cloud-hypervisor --kernel l2/vmlinuz --initramfs l2/initramfs.cpio \
        --cmdline "console=ttyS0 panic=-1 quiet" --cpus boot=2 --memory size=256M \
        --pmem "file=$img" --serial tty --console off </tmp/demo-in >/tmp/demo-out 2>&1 &
    vmm=$!
    tail -f /tmp/demo-out &
    tailer=$!
    i=0
    while ! grep -q 'guest: type a line' /tmp/demo-out && [ $i -lt 600 ] && kill -0 $vmm 2>/dev/null; do
        sleep 0.2
        i=$((i + 1))
    done
    printf 'hello-typed-on-the-host\n' >&3
    wait $vmm
    rc=$?
    sleep 0.3
    kill $tailer 2>/dev/null
    exec 3>&-
    echo "cloud-hypervisor exited $rc"
    [ $rc -eq 0 ] || exit 20
    grep -q 'read from the serial console: hello-typed-on-the-host' /tmp/demo-out \
        || { echo "the guest did not read the line typed into the serial console"; exit 26; }
}
boot
echo; echo "\$ pcow-img check $img"; ./pcow-img check "$img" || exit 21
echo; echo "\$ pcow-img snapshot -c after-first-boot $img"; ./pcow-img snapshot -c after-first-boot "$img" || exit 22
boot
echo; echo "\$ pcow-img snapshot -l $img"; ./pcow-img snapshot -l "$img" || exit 23
echo; echo "\$ pcow-img check $img"; ./pcow-img check "$img" || exit 24
echo; echo "\$ pcow-img info $img"; ./pcow-img info "$img" || exit 25
echo; ls -ls "$img"
EOF

if [ "$mode" = host ]; then
    say "== booting on this machine's KVM"
    (cd "$payload" && sh ./session.sh "$payload/demo.pcow")
else
    cat >"$payload/run.sh" <<'EOF'
mv demo.pcow /tmp/demo.pcow
sh ./session.sh /tmp/demo.pcow || exit $?
cp /tmp/demo.pcow /out/
EOF
    say "== booting L1 (QEMU TCG with SVM), which runs the session with its real KVM"
    # One L1 vCPU: with two, the L1 kernel under multi-threaded TCG has been
    # seen to oops in kvm after several VM creations (see vmm-scenarios.sh).
    SANDBOX_SMP=${SANDBOX_SMP:-1} SANDBOX_OUT=$work/out SANDBOX_TIMEOUT=${SANDBOX_TIMEOUT:-600} \
        "$SANDBOX_SCRIPTS/run-l1.sh" "$payload" \
        || die "the session in the sandbox failed (exit $?)"
    say "== the image, back on the host"
    "$target/release/pcow-img" check "$work/out/demo.pcow"
    "$target/release/pcow-img" snapshot -l "$work/out/demo.pcow"
    ls -ls "$work/out/demo.pcow"
fi
say "PASSED: a stock Linux guest booted twice on a pcow pmem device (mode: $mode)"
