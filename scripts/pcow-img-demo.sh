#!/usr/bin/env bash
# A tour of pcow-img (the second part of scripts/demo.sh): builds it and shows it
# end to end in a temporary directory: a base image with a snapshot, an
# overlay on it with its own snapshot and a rollback, check, info, map, a
# conversion to raw that QEMU's tools check, and compact. Every command is
# printed before it runs. The content is read back after every step
# (`pcow-img io -c "read -P BYTE OFF LEN"` fails on the first wrong byte),
# and the script exits non-zero on any mismatch.
#
# On a fresh Debian 12 machine it installs qemu-utils (qemu-img, qemu-io)
# with apt when they are missing; a Rust toolchain (1.89 or newer) must be
# installed (https://rustup.rs).
#
# Environment: KEEP_DEMO=1 keeps the temporary directory.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

say() { printf '\n## %s\n' "$*"; }
die() { printf '\ndemo.sh: FAILED: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

# Prints a command (arguments with spaces in double quotes), then runs it.
run() {
    local out="" a
    for a in "$@"; do
        case "$a" in
            *[[:space:]]* | "") out+=" \"$a\"" ;;
            *) out+=" $a" ;;
        esac
    done
    printf '$%s\n' "$out"
    "$@"
}

# expect IMAGE BYTE OFFSET LENGTH: every byte of the range reads as BYTE.
expect() {
    run pcow-img io -r -c "read -P $2 $3 $4" "$1" \
        || die "$1: [$3, +$4) does not read as $2"
}

# ---------------------------------------------------------------- set-up

say "prerequisites"
command -v cargo >/dev/null 2>&1 \
    || die "cargo not found: install the Rust toolchain (https://rustup.rs), 1.89 or newer"
if ! command -v qemu-img >/dev/null 2>&1 || ! command -v qemu-io >/dev/null 2>&1; then
    echo "qemu-img/qemu-io missing: installing qemu-utils"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y qemu-utils
fi
echo "cargo:    $(cargo --version)"
echo "qemu-img: $(qemu-img --version | head -n1)"

say "building pcow-img (release)"
run cargo build --release -p pcow --bin pcow-img
target_dir=$(cargo metadata --format-version 1 --no-deps \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[ -x "$target_dir/release/pcow-img" ] || die "pcow-img not found in $target_dir/release"
export PATH="$target_dir/release:$PATH"
echo "using $(command -v pcow-img) ($(pcow-img --version))"

work=$(mktemp -d "${TMPDIR:-/tmp}/pcow-demo.XXXXXX")
if [ "${KEEP_DEMO:-0}" = 1 ]; then
    trap 'echo "kept $work"' EXIT
else
    trap 'rm -rf "$work"' EXIT
fi
cd "$work"
echo "working in $work"

# ---------------------------------------------------------------- base image

say "a 64 MiB base image (64 KiB clusters), written with pcow-img io"
run pcow-img create base.pcow 64M
run pcow-img io -c "write -P 0xaa 0 1M" -c "write -P 0xbb 4M 256K" -c flush base.pcow
expect base.pcow 0xaa 0 1M
expect base.pcow 0xbb 4M 256K
expect base.pcow 0x00 1M 3M # never written: reads as zeros
run pcow-img info base.pcow

say "snapshot 'v1', then more writes: a whole cluster, a new cluster, one 4 KiB page"
run pcow-img snapshot -c v1 base.pcow
run pcow-img io -c "write -P 0xcc 0 64K" -c "write -P 0xdd 8M 4K" -c "write -P 0x11 96K 4K" base.pcow
expect base.pcow 0xcc 0 64K
expect base.pcow 0xaa 64K 32K # the rest of the cluster with the new page: still v1's data
expect base.pcow 0x11 96K 4K
expect base.pcow 0xaa 100K 924K
expect base.pcow 0xdd 8M 4K
run pcow-img snapshot -l base.pcow

# ---------------------------------------------------------------- overlay

say "an overlay on base.pcow (its size is the base's); it reads the base's data"
run pcow-img create -b base.pcow overlay.pcow
expect overlay.pcow 0xcc 0 64K
expect overlay.pcow 0x11 96K 4K
expect overlay.pcow 0xbb 4M 256K

say "writes to the overlay: over a hole of the base, and one page of a base cluster"
run pcow-img io -c "write -P 0xee 1M 1M" -c "write -P 0x22 4M 4K" overlay.pcow
expect overlay.pcow 0xee 1M 1M
expect overlay.pcow 0x22 4M 4K
expect overlay.pcow 0xbb 4100K 252K # the rest of that cluster still comes from the base
expect base.pcow 0x00 1M 3M # the base did not change
expect base.pcow 0xbb 4M 256K

say "snapshot the overlay, overwrite, then roll back to the snapshot"
run pcow-img snapshot -c ov1 overlay.pcow
run pcow-img io -c "write -P 0xff 1M 64K" -c "write -P 0xff 16M 64K" overlay.pcow
expect overlay.pcow 0xff 1M 64K
expect overlay.pcow 0xff 16M 64K
run pcow-img rollback overlay.pcow ov1
expect overlay.pcow 0xee 1M 1M
expect overlay.pcow 0x00 16M 64K
expect overlay.pcow 0x22 4M 4K
run pcow-img snapshot -l overlay.pcow

# ---------------------------------------------------------------- inspection

say "check (exit code 0: clean, 2: corrupt, 3: leaks only)"
for img in base.pcow overlay.pcow; do
    rc=0
    run pcow-img check "$img" || rc=$?
    echo "exit code: $rc"
    [ "$rc" -eq 0 ] || die "check $img exited with $rc"
done

say "info of the whole chain, as JSON"
run pcow-img info --output json --backing-chain overlay.pcow

say "map: where each range of the overlay's content lives"
run pcow-img map overlay.pcow

# ---------------------------------------------------------------- convert

say "convert the overlay's content to a raw file"
run pcow-img convert -O raw overlay.pcow overlay.raw
run ls -ls overlay.raw

say "the same content written by qemu-io into a raw file, and qemu-img compare"
run qemu-img create -f raw expected.raw 64M
run qemu-io -f raw \
    -c "write -P 0xcc 0 64K" -c "write -P 0xaa 64K 32K" -c "write -P 0x11 96K 4K" \
    -c "write -P 0xaa 100K 924K" -c "write -P 0xee 1M 1M" -c "write -P 0x22 4M 4K" \
    -c "write -P 0xbb 4100K 252K" -c "write -P 0xdd 8M 4K" expected.raw
run qemu-img compare -f raw -F raw expected.raw overlay.raw \
    || die "overlay.raw differs from the content qemu-io wrote"
run qemu-io -f raw -r -c "read -P 0xee 1M 1M" -c "read -P 0 16M 64K" overlay.raw \
    || die "qemu-io read unexpected bytes from overlay.raw"
run cmp expected.raw overlay.raw || die "cmp: overlay.raw differs"

say "and back: raw to pcow, checked by converting again"
run pcow-img convert -O pcow overlay.raw roundtrip.pcow
run pcow-img convert -O raw roundtrip.pcow roundtrip.raw
run cmp expected.raw roundtrip.raw || die "the raw -> pcow -> raw round trip changed the content"

# ---------------------------------------------------------------- compact

say "compact: the rollback left a dead layer (the overwrites of 0xff); compact drops it"
size_before=$(stat -c %s overlay.pcow)
run pcow-img compact overlay.pcow
size_after=$(stat -c %s overlay.pcow)
echo "overlay.pcow: $size_before bytes before, $size_after bytes after"
[ "$size_after" -lt "$size_before" ] || die "compact did not shrink overlay.pcow"
run pcow-img check overlay.pcow || die "check after compact failed"
run pcow-img snapshot -l overlay.pcow
run pcow-img convert -O raw overlay.pcow compacted.raw
run cmp expected.raw compacted.raw || die "compact changed the overlay's content"
expect overlay.pcow 0xee 1M 1M

say "demo passed: every read matched the expected content"
echo "(reproduce: $root/scripts/demo.sh; KEEP_DEMO=1 keeps the files)"
