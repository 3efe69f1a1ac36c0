#!/usr/bin/env bash
# Fetch everything the nested sandbox needs, from Debian's archive only.
#
# Host side (installed with apt-get if missing): qemu-system-x86, cpio,
# xz-utils, gcc (selftest's static KVM check).
# Guest side (apt-get download + dpkg-deb -x into .cache/sandbox, not
# installed): the L1 kernel (6.12 cloud, modules kvm/kvm-amd), the L2 kernel
# (6.1 cloud), busybox-static.
#
# Idempotent: packages already in .cache/sandbox/debs are not downloaded again.
# Writes .cache/sandbox/packages.txt (role, package, version).
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

t0=$(now)
mkdir -p "$DEBS" "$XDIR"

apt_updated=0
apt_update_once() {
    [ "$apt_updated" -eq 1 ] && return 0
    say "apt-get update"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
}

# ---- host tools -------------------------------------------------------------
need_pkgs=()
command -v qemu-system-x86_64 >/dev/null 2>&1 || need_pkgs+=(qemu-system-x86)
command -v cpio >/dev/null 2>&1 || need_pkgs+=(cpio)
command -v xz >/dev/null 2>&1 || need_pkgs+=(xz-utils)
command -v gcc >/dev/null 2>&1 || need_pkgs+=(gcc libc6-dev)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    say "installing host packages: ${need_pkgs[*]}"
    apt_update_once
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

# ---- resolve package names ---------------------------------------------------
has_candidate() {
    local c
    c=$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ { print $2 }')
    [ -n "$c" ] && [ "$c" != "(none)" ]
}

newest_matching() {
    apt-cache search --names-only "$1" 2>/dev/null | awk '{ print $1 }' | grep -E "$1" | sort -V | tail -n1
}

resolve() { # role override preferred pattern
    local role=$1 override=$2 preferred=$3 pattern=$4 name
    if [ -n "$override" ]; then
        has_candidate "$override" || { apt_update_once; has_candidate "$override"; } \
            || die "$role: package $override (from the environment) not in the archive"
        name=$override
    elif has_candidate "$preferred"; then
        name=$preferred
    else
        apt_update_once
        if has_candidate "$preferred"; then
            name=$preferred
        else
            name=$(newest_matching "$pattern")
            [ -n "$name" ] || die "$role: no package matches $pattern (apt-cache search)"
            warn "$role: $preferred is not in the archive; using $name"
        fi
    fi
    printf '%s\n' "$name"
}

# apt-cache needs lists; an empty cache on a fresh machine means no update yet.
if ! has_candidate busybox-static; then apt_update_once; fi

L1=$(resolve l1-kernel "${SANDBOX_L1_KERNEL_PKG:-}" "$L1_KERNEL_PREFERRED" "$L1_KERNEL_PATTERN")
L2=$(resolve l2-kernel "${SANDBOX_L2_KERNEL_PKG:-}" "$L2_KERNEL_PREFERRED" "$L2_KERNEL_PATTERN")
BB=busybox-static

# ---- download + extract ------------------------------------------------------
deb_of() { ls "$DEBS/$1"_*_amd64.deb 2>/dev/null | head -n1; }

t_dl=$(now)
downloaded=0
for p in "$L1" "$L2" "$BB"; do
    if [ -n "$(deb_of "$p")" ]; then
        continue
    fi
    say "apt-get download $p"
    if ! (cd "$DEBS" && apt-get download -q "$p" 2>&1 | grep -v 'unsandboxed' || true; [ -n "$(ls "$DEBS/$p"_*_amd64.deb 2>/dev/null)" ]); then
        # The package lists may be stale (the archive dropped that version).
        apt_update_once
        (cd "$DEBS" && apt-get download -q "$p") || die "apt-get download $p failed"
    fi
    downloaded=1
    [ -n "$(deb_of "$p")" ] || die "apt-get download $p produced no .deb in $DEBS"
done
dl_time=$(elapsed "$t_dl")

t_x=$(now)
for p in "$L1" "$L2" "$BB"; do
    d=$XDIR/$p
    [ -f "$d/.extracted" ] && continue
    say "dpkg-deb -x $(basename "$(deb_of "$p")")"
    rm -rf "$d.tmp" "$d"
    mkdir -p "$d.tmp"
    dpkg-deb -x "$(deb_of "$p")" "$d.tmp"
    touch "$d.tmp/.extracted"
    mv "$d.tmp" "$d"
done
x_time=$(elapsed "$t_x")

ver_of() { dpkg-deb -f "$(deb_of "$1")" Version; }
host_ver() { dpkg-query -W -f '${Version}' "$1" 2>/dev/null || echo "?"; }
{
    printf 'l1-kernel %s %s\n' "$L1" "$(ver_of "$L1")"
    printf 'l2-kernel %s %s\n' "$L2" "$(ver_of "$L2")"
    printf 'busybox %s %s\n' "$BB" "$(ver_of "$BB")"
    printf 'host-qemu qemu-system-x86 %s\n' "$(host_ver qemu-system-x86)"
    printf 'host-cpio cpio %s\n' "$(host_ver cpio)"
} >"$MANIFEST.tmp"
mv -f "$MANIFEST.tmp" "$MANIFEST"

say "packages:"
sed 's/^/    /' "$MANIFEST"
if [ "$downloaded" -eq 1 ]; then
    say "download: ${dl_time}s, extract: ${x_time}s, total: $(elapsed "$t0")s"
else
    say "all packages cached (extract: ${x_time}s), total: $(elapsed "$t0")s"
fi
