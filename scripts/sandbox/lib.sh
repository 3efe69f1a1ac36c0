# Shared helpers for scripts/sandbox/*.sh (sourced, not run).
# shellcheck shell=bash disable=SC2034

SANDBOX_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SANDBOX_SCRIPTS/../.." && pwd)
CACHE=${SANDBOX_CACHE:-$REPO_ROOT/.cache/sandbox}
DEBS=$CACHE/debs
XDIR=$CACHE/x
MANIFEST=$CACHE/packages.txt

# Preferred packages (the ones measured in shared/design/platform-facts.md).
# If the archive no longer has them, fetch.sh takes the newest of the same
# series; override with SANDBOX_L1_KERNEL_PKG / SANDBOX_L2_KERNEL_PKG.
L1_KERNEL_PREFERRED=linux-image-6.12.107+deb12-cloud-amd64-unsigned
L1_KERNEL_PATTERN='^linux-image-6\.12\.[0-9]+\+deb12-cloud-amd64-unsigned$'
L2_KERNEL_PREFERRED=linux-image-6.1.0-56-cloud-amd64
L2_KERNEL_PATTERN='^linux-image-6\.1\.0-[0-9]+-cloud-amd64$'

_me=$(basename "$0")
say() { printf '[%s] %s\n' "$_me" "$*"; }
warn() { printf '[%s] warning: %s\n' "$_me" "$*" >&2; }
die() { printf '[%s] error: %s\n' "$_me" "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# The package names fetch.sh resolved (written to $MANIFEST).
manifest_get() {
    [ -f "$MANIFEST" ] || die "$MANIFEST missing: run scripts/sandbox/fetch.sh first"
    awk -v k="$1" '$1 == k { print $2 }' "$MANIFEST"
}

# Extracted tree of a package fetched by fetch.sh.
pkg_dir() {
    local d=$XDIR/$1
    [ -f "$d/.extracted" ] || die "package $1 not extracted: run scripts/sandbox/fetch.sh"
    printf '%s\n' "$d"
}

# Kernel release (the modules directory name) of an extracted kernel package.
kernel_release() {
    local d
    d=$(pkg_dir "$1")
    local rel
    rel=$(ls "$d/lib/modules" 2>/dev/null | head -n1)
    [ -n "$rel" ] || die "no lib/modules in $d"
    printf '%s\n' "$rel"
}

# Copy kernel modules, with their dependencies (read from each module's
# "depends=" modinfo field, since the package has no modules.dep), decompressed
# into DEST/lib/modules, and print their base names in load order
# (dependencies first). usage: install_modules MODDIR DEST name...
install_modules() {
    local moddir=$1 dest=$2
    shift 2
    mkdir -p "$dest/lib/modules"
    local index
    index=$(find "$moddir/kernel" -name '*.ko*' | awk '{ b = $0; sub(".*/", "", b); sub("\\.ko.*$", "", b); gsub("-", "_", b); print b, $0 }')
    local builtin=""
    [ -f "$moddir/modules.builtin" ] \
        && builtin=$(awk '{ b = $0; sub(".*/", "", b); sub("\\.ko$", "", b); gsub("-", "_", b); print b }' "$moddir/modules.builtin")
    local -A _done=()
    _visit() {
        local n=${1//-/_} path out dep
        [ -n "${_done[$n]:-}" ] && return 0
        _done[$n]=1
        path=$(awk -v n="$n" '$1 == n { print $2; exit }' <<<"$index")
        if [ -z "$path" ] && grep -qx "$n" <<<"$builtin"; then
            return 0 # built into the kernel: nothing to load
        fi
        [ -n "$path" ] || die "module $n not found under $moddir"
        out=$dest/lib/modules/$n.ko
        case $path in
            *.ko.xz) xz -dc "$path" >"$out" ;;
            *.ko.zst) zstd -qdc "$path" >"$out" ;;
            *.ko.gz) gzip -dc "$path" >"$out" ;;
            *.ko) cp "$path" "$out" ;;
            *) die "unexpected module file $path" ;;
        esac
        for dep in $(tr '\0' '\n' <"$out" | sed -n 's/^depends=//p' | tr ',' ' '); do
            _visit "$dep"
        done
    }
    local m
    for m in "$@"; do _visit "$m"; done
    # Print in load order: each module after its dependencies, each once.
    local -A _printed=()
    _emit() {
        local n=$1 dep
        [ -n "${_printed[$n]:-}" ] && return 0
        _printed[$n]=1
        [ -f "$dest/lib/modules/$n.ko" ] || return 0 # built in
        for dep in $(tr '\0' '\n' <"$dest/lib/modules/$n.ko" | sed -n 's/^depends=//p' | tr ',' ' '); do
            _emit "${dep//-/_}"
        done
        printf '%s\n' "$n"
    }
    for m in "$@"; do _emit "${m//-/_}"; done
}

# Busybox root skeleton in DEST.
install_busybox() {
    local dest=$1 bb
    bb=$(pkg_dir busybox-static)/bin/busybox
    [ -x "$bb" ] || die "busybox binary missing at $bb"
    mkdir -p "$dest"/{bin,sbin,dev,proc,sys,tmp,run,mnt,etc,root,usr/bin,usr/sbin}
    cp "$bb" "$dest/bin/busybox"
    local applet
    for applet in $("$bb" --list); do
        [ -e "$dest/bin/$applet" ] || ln -s busybox "$dest/bin/$applet"
    done
}

# Pack DEST into a newc cpio archive at OUT (uncompressed unless COMPRESS=gzip).
pack_cpio() {
    local dest=$1 out=$2 tmp
    tmp=$out.tmp.$$
    if [ "${COMPRESS:-none}" = gzip ]; then
        (cd "$dest" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) | gzip -1 >"$tmp"
    else
        (cd "$dest" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) >"$tmp"
    fi
    mv -f "$tmp" "$out"
}
