#!/usr/bin/env bash
# Seed corpora for the fuzz targets (docs/fuzzing.md), made with the real
# writer: builds pcow-img (`cargo build --release -p pcow`), creates images
# (empty, written, with snapshots, compacted, resized, with a base chain, a
# raw base, a cycle; 4K, 16K, 64K and 2M clusters) in a temporary directory
# and copies them into fuzz/corpus/<target>/ as seed-* files (git-ignored;
# nothing binary is committed). Existing non-seed corpus files are kept.
#
# Sizes stay small (< 1 MiB per target): 2 MiB-cluster images are only
# seeded as their first 8 KiB (header slot A), and the chain inputs use
# 4 KiB clusters.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
die() { printf 'fuzz-seeds.sh: error: %s\n' "$*" >&2; exit 1; }

cargo build --release -p pcow --bin pcow-img >&2 || die "cannot build pcow-img"
img="${CARGO_TARGET_DIR:-$root/target}/release/pcow-img"
[ -x "$img" ] || die "$img not found"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

p() { "$img" "$@" >/dev/null; }
# w IMAGE 'write -P B OFF LEN' ...: qemu-io style writes.
w() {
    local f=$1 c args=()
    shift
    for c in "$@"; do args+=(-c "$c"); done
    p io "${args[@]}" "$f"
}

open_dir="$root/fuzz/corpus/image_open"
chain_dir="$root/fuzz/corpus/image_chain"
ops_dir="$root/fuzz/corpus/image_ops"
mkdir -p "$open_dir" "$chain_dir" "$ops_dir"
rm -f "$open_dir"/seed-* "$chain_dir"/seed-* "$ops_dir"/seed-*

# ------------------------------------------------------------ image_open
cd "$tmp"
p create -c 4K empty-4k.pcow 1M
p create -c 64K empty-64k.pcow 1M
p create -c 16K empty-16k.pcow 256K

p create -c 4K written-4k.pcow 1M
w written-4k.pcow 'write -P 0xab 0 4K' 'write -P 0x11 6K 3K' 'write -P 0x22 512K 8K' 'flush'

p create -c 4K snaps-4k.pcow 512K
w snaps-4k.pcow 'write -P 0x01 0 12K'
p snapshot -c one snaps-4k.pcow
w snaps-4k.pcow 'write -P 0x02 4K 4K' 'write -P 0x03 256K 4K'
p snapshot -c two snaps-4k.pcow
w snaps-4k.pcow 'write -P 0x04 8K 1K'
p snapshot -a one snaps-4k.pcow
w snaps-4k.pcow 'write -P 0x05 100K 4K'
p snapshot -d two snaps-4k.pcow

p create -c 16K snaps-16k.pcow 256K
w snaps-16k.pcow 'write -P 0x31 0 20K'
p snapshot -c s1 snaps-16k.pcow
w snaps-16k.pcow 'write -P 0x32 16K 4K'
cp snaps-16k.pcow compacted-16k.pcow
p snapshot -a s1 compacted-16k.pcow
p compact compacted-16k.pcow
p resize snaps-16k.pcow +64K

p create -c 64K written-64k.pcow 1M
w written-64k.pcow 'write -P 0x41 68K 4K'

p create -c 4K base-4k.pcow 256K
w base-4k.pcow 'write -P 0x51 0 8K'
p create -c 4K -b base-4k.pcow -F pcow overlay-4k.pcow
w overlay-4k.pcow 'write -P 0x52 4K 4K'

p create -c 2M empty-2m.pcow 4M
head -c 8192 empty-2m.pcow >trunc-2m.pcow

for f in empty-4k empty-64k empty-16k written-4k snaps-4k snaps-16k compacted-16k \
    written-64k base-4k overlay-4k trunc-2m; do
    cp "$f.pcow" "$open_dir/seed-$f"
done

# ------------------------------------------------------------ image_chain
# Layout: byte 0 (even: 2 files, odd: 3), then u32 LE lengths of all files
# but the last, then the files a, b[, c].
# The format string is built on purpose (\xNN escapes).
# shellcheck disable=SC2059
le32() { printf "\\x$(printf %02x $(($1 & 255)))\\x$(printf %02x $((($1 >> 8) & 255)))\\x$(printf %02x $((($1 >> 16) & 255)))\\x$(printf %02x $((($1 >> 24) & 255)))"; }
size() { stat -c %s "$1"; }
chain2() { # OUT A B
    { printf '\x00'; le32 "$(size "$2")"; cat "$2" "$3"; } >"$1"
}
chain3() { # OUT A B C
    { printf '\x01'; le32 "$(size "$2")"; le32 "$(size "$3")"; cat "$2" "$3" "$4"; } >"$1"
}

# Each chain in its own directory, with the names the target uses.
chain() { rm -rf "$tmp/chain" && mkdir "$tmp/chain" && cd "$tmp/chain"; }
chain # a -> b -> c, all pcow, a snapshot in b
p create -c 4K c 128K
w c 'write -P 0x61 0 8K'
p create -c 4K -b c -F pcow b
w b 'write -P 0x62 4K 4K'
p snapshot -c sb b
p create -c 4K -b b a
w a 'write -P 0x63 8K 4K'
chain3 "$chain_dir/seed-pcow3" a b c
rm c && cp b c # c is a copy of b, so it names itself: a cycle below the top
chain3 "$chain_dir/seed-pcow3-copy" a b c
chain # a -> b, pcow, larger overlay
p create -c 4K b 64K
w b 'write -P 0x65 0 64K'
p create -c 4K -b b -F pcow a 128K
w a 'write -P 0x66 60K 8K'
chain2 "$chain_dir/seed-pcow2" a b
chain # a -> b -> c raw
head -c 65536 /dev/zero | tr '\0' '\141' >c
p create -c 4K -b c -F raw b 128K
w b 'write -P 0x64 0 4K'
p create -c 4K -b b a
chain3 "$chain_dir/seed-raw3" a b c
chain # a -> b raw (probed)
head -c 12288 /dev/zero | tr '\0' '\142' >b
p create -c 4K -b b a 16K
chain2 "$chain_dir/seed-raw2" a b
chain # a cycle: a names b, b names a (unsafe rebase only rewrites the name)
p create -c 4K b 64K
p create -c 4K -b b a
p rebase -u -b a b 2>/dev/null || true
chain2 "$chain_dir/seed-cycle" a b
chain # a names itself
p create -c 4K a 64K
p rebase -u -b a a 2>/dev/null || true
chain2 "$chain_dir/seed-self" a a
chain # the top names a missing base
p create -c 4K d 64K
p create -c 4K -b d a
chain2 "$chain_dir/seed-missing" a a
cd "$tmp"

# ------------------------------------------------------------ image_ops
# Structured inputs (arbitrary): any bytes decode to some sequence; these
# give the fuzzer a start with each cluster size and long sequences.
for i in 0 1 2 3; do
    # shellcheck disable=SC2059
    { printf "\\x$(printf %02x "$i")\\x03"; head -c 512 /dev/urandom; } >"$ops_dir/seed-c$i"
done
for n in 64 256 1024; do
    head -c "$n" /dev/urandom >"$ops_dir/seed-rand$n"
done

# api_http: real requests as ch-remote and curl send them.
api_dir="$root/fuzz/corpus/api_http"
mkdir -p "$api_dir"
rm -f "$api_dir"/seed-*
req() { # NAME METHOD ACTION [BODY]
    local body=${4:-}
    printf '%s /api/v1/%s HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' \
        "$2" "$3" "${#body}" "$body" >"$api_dir/seed-$1"
}
req ping GET vmm.ping
req boot PUT vm.boot
req info GET vm.info
req create PUT vm.create '{"payload":{"kernel":"/k","cmdline":"console=ttyS0"},"cpus":{"boot_vcpus":2,"max_vcpus":2},"memory":{"size":268435456},"pmem":[{"file":"/a.pcow","id":"p0","discard_writes":false}],"serial":{"mode":"Tty"},"console":{"mode":"Off"}}'
req add-pmem PUT vm.add-pmem '{"file":"/b.img","size":2097152,"id":"p1"}'
req snapshot PUT vm.pmem-snapshot '{"id":"p0","tag":"t1"}'
req overlay PUT vm.pmem-overlay '{"id":"p0","file":"/ov.pcow"}'
req rollback PUT vm.pmem-rollback '{"id":"p0","snapshot":"t1","reset":true}'
req snapshot-delete PUT vm.pmem-snapshot-delete '{"id":"p0","snapshot":"1"}'
req flush PUT vm.pmem-flush '{"id":"p0"}'
req counters GET vm.counters
req power-button PUT vm.power-button
req nmi PUT vm.nmi
req resize PUT vm.resize '{"desired_vcpus":2,"desired_ram":1073741824,"desired_balloon":0}'
req remove-device PUT vm.remove-device '{"id":"p1"}'
req add-disk PUT vm.add-disk '{"path":"/d.raw","readonly":false,"id":"d0"}'
req snapshot-vm PUT vm.snapshot '{"destination_url":"file:///snap"}'
req restore PUT vm.restore '{"source_url":"file:///snap","prefault":false,"memory_restore_mode":"Copy","resume":false}'
req vmm-shutdown PUT vmm.shutdown

# options: values of each option kind.
opt_dir="$root/fuzz/corpus/options"
mkdir -p "$opt_dir"
rm -f "$opt_dir"/seed-*
i=0
for v in 'file=/a.pcow,size=64M,id=p0,discard_writes=on' 'boot=2,max=2' 'size=1G' 'tty' \
    'file=/tmp/serial.log' 'path=/tmp/ch.sock' '--kernel /k --pmem file=/a file=/b --cpus boot=2 -vv'; do
    printf '%s' "$v" >"$opt_dir/seed-$i"
    i=$((i + 1))
done

# pmem_queue: one FLUSH chain (queue size 16, descriptors at 0x0, avail ring
# at 0x1000, used ring at 0x2000, request at 0x3000, status at 0x3100).
q_dir="$root/fuzz/corpus/pmem_queue"
mkdir -p "$q_dir"
rm -f "$q_dir"/seed-*
python3 - "$q_dir/seed-flush" <<'PY'
import struct, sys
m = bytearray(0x3200)
m[0:5] = bytes([4, 0, 0x10, 0x20, 0])  # size 1<<4, desc 0x0, avail 0x1000, used 0x2000
# The first bytes double as the selectors: the descriptors start at 16.
m[0] = 4; m[1] = 0; m[2] = 0x10; m[3] = 0x20
struct.pack_into('<QIHH', m, 0x10 * 0, 0, 0, 0, 0)
struct.pack_into('<QIHH', m, 16, 0x3000, 4, 1, 2)     # desc 1: request, NEXT -> 2
struct.pack_into('<QIHH', m, 32, 0x3100, 4, 2, 0)     # desc 2: status, WRITE
struct.pack_into('<HHH', m, 0x1000, 0, 1, 1)          # avail: flags, idx 1, ring[0] = 1
open(sys.argv[1], 'wb').write(m)
PY

# snapshot_state, snapshot_config: a snapshot directory's state.json (the
# envelope as vmm::snapshot::dir writes it: two RAM ranges, below and above
# the 32-bit hole) and config.json (the VmConfig as vm.info shows it).
st_dir="$root/fuzz/corpus/snapshot_state"
cf_dir="$root/fuzz/corpus/snapshot_config"
mkdir -p "$st_dir" "$cf_dir"
rm -f "$st_dir"/seed-* "$cf_dir"/seed-*
printf '%s' '{"version":1,"memory":{"ranges":[{"gpa":0,"size":3221225472},{"gpa":4294967296,"size":1073741824}]},"vcpus":[{"regs":{"rip":4096}}],"vm":{"clock":1},"devices":{"serial":{"lcr":3}},"pmem":[{"id":"_pmem0"}]}' >"$st_dir/seed-two-ranges"
printf '%s' '{"version":1,"memory":{"ranges":[{"gpa":0,"size":4096}]},"vcpus":null,"vm":null,"devices":null,"pmem":[]}' >"$st_dir/seed-minimal"
printf '%s' '{"version":2,"memory":{}}' >"$st_dir/seed-v2"
printf '%s' '{"cpus":{"boot_vcpus":2,"max_vcpus":2},"memory":{"size":268435456},"payload":{"kernel":"/dev/null","cmdline":"console=ttyS0"},"rng":{"src":"/dev/urandom"},"pmem":[{"file":"/dev/null","id":"p0"}],"serial":{"mode":"Tty"},"console":{"mode":"Off"}}' >"$cf_dir/seed-full"
printf '%s' '{"memory":{"size":1048576},"payload":{"kernel":"/proc/self/exe"}}' >"$cf_dir/seed-minimal"

# image_open_alloc: the same images as image_open (it opens them as they
# are and as sparse files).
alloc_dir="$root/fuzz/corpus/image_open_alloc"
mkdir -p "$alloc_dir"
rm -f "$alloc_dir"/seed-*
cp "$open_dir"/seed-* "$alloc_dir"/

cd "$root"
for t in image_open image_open_alloc image_chain image_ops api_http options pmem_queue snapshot_state snapshot_config; do
    printf '%-12s %3d seeds, %7d bytes\n' "$t" \
        "$(find "fuzz/corpus/$t" -name 'seed-*' | wc -l)" \
        "$(cat fuzz/corpus/$t/seed-* | wc -c)"
done
