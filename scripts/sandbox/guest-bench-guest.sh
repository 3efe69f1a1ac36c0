# shellcheck shell=sh
# L2 guest side of scripts/sandbox/guest-bench.sh (busybox sh; /guest.sh).
#
# build-l2.sh's init runs this with /dev/pmem0 already mounted on /mnt/pmem
# (ext4 -o dax) when the VM has a virtio-pmem device. guest-bench.sh appends
# Debian's fio and its shared libraries to the initramfs (/usr/bin/fio, the
# libraries at their Debian paths, their directories in /etc/gb-libdirs).
#
# Kernel command line:
#   gb.dev=pmem   use /mnt/pmem, which must be mounted with dax (our VMM)
#   gb.dev=blk    mount /dev/vda (virtio-blk, QEMU) on /mnt/blk, ext4, no dax
#   gb.jobs=J,J.. the fio jobs to run, in this order, each on its own file:
#                 randread|randwrite|fsync|seqwrite
#   gb.sizes=J:BYTES,...  each job's data size (randread: /gb-read.dat, made
#                 on the host, must hold at least that)
# Each job is one fio run (psync, iodepth 1, --direct=1):
#   randwrite  4 KiB random writes into a new file (first writes into holes)
#   randread   4 KiB random reads of /gb-read.dat (data in the image's
#              oldest layer: the base, or the snapshot's clusters)
#   fsync      4 KiB random writes into a new file, fsync after each
#   seqwrite   1 MiB sequential writes into a new file
# and then a `sync` outside fio's timing, so that what one job left dirty
# is not flushed by the next one's first fsync. Per job it prints
#   GB-JOB-BEGIN job=J      (before fio starts; the profiled runs attribute
#   GB-JOB-END job=J         the VMM's barrier log lines by these two)
#   GB-FIO-BEGIN job=J dev=D, fio's JSON gzipped and base64-encoded,
#   GB-FIO-END rc=N
# (the serial line costs a VM exit per byte: the JSON alone is ~6 KB).
# Exits non-zero when a job failed (unmounting /mnt/blk itself; the init
# unmounts /mnt/pmem and powers off).
dev=
jobs=
sizes=
for w in $(cat /proc/cmdline); do
    case $w in
        gb.dev=*) dev=${w#*=} ;;
        gb.jobs=*) jobs=$(echo "${w#*=}" | tr ',' ' ') ;;
        gb.sizes=*) sizes=$(echo "${w#*=}" | tr ',' ' ') ;;
    esac
done
fail() {
    echo "GB-GUEST-FAIL: $*"
    exit 1
}
[ -n "$jobs" ] || fail "no gb.jobs= on the kernel command line"
# size JOB: its byte count from gb.sizes.
size_of() {
    for kv in $sizes; do
        if [ "${kv%%:*}" = "$1" ]; then echo "${kv#*:}"; return 0; fi
    done
    return 1
}

case $dev in
    pmem)
        dir=/mnt/pmem
        # -o dax is the point of these variants: a mount without it measures
        # the page cache, not the device.
        grep ' /mnt/pmem ext4 ' /proc/mounts | grep -qw dax \
            || fail "/mnt/pmem is not mounted ext4 -o dax: $(grep ' /mnt/pmem ' /proc/mounts)"
        ;;
    blk)
        dir=/mnt/blk
        i=0
        while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
        [ -b /dev/vda ] || fail "no /dev/vda after 10 s (virtio-blk)"
        mkdir -p $dir
        mount -t ext4 /dev/vda $dir || fail "mount -t ext4 /dev/vda failed"
        ;;
    *) fail "gb.dev=$dev: expected pmem or blk" ;;
esac
echo "GB-MOUNT $(grep " $dir " /proc/mounts)"

# Same options for every variant. --direct=1: on virtio-blk the page cache
# is bypassed, so every request reaches the device; on ext4-dax there is no
# page cache to bypass (DAX reads and writes copy to and from the pmem
# mapping whether or not O_DIRECT is set), so it changes nothing there.
export LD_LIBRARY_PATH
LD_LIBRARY_PATH=$(cat /etc/gb-libdirs)
status=0
for job in $jobs; do
    size=$(size_of "$job") || fail "gb.sizes has no size for $job"
    case $size in '' | *[!0-9]* | 0) fail "$job: size '$size' is not a positive byte count" ;; esac
    case $job in
        randwrite) set -- --filename=$dir/gb-randwrite.dat --rw=randwrite --bs=4k --fallocate=none ;;
        fsync) set -- --filename=$dir/gb-fsync.dat --rw=randwrite --bs=4k --fallocate=none --fsync=1 ;;
        seqwrite) set -- --filename=$dir/gb-seqwrite.dat --rw=write --bs=1M --fallocate=none ;;
        randread)
            [ -f $dir/gb-read.dat ] || fail "$dir/gb-read.dat missing (made on the host)"
            have=$(wc -c <$dir/gb-read.dat)
            [ "$have" -ge "$size" ] || fail "$dir/gb-read.dat has $have bytes, the job reads $size"
            set -- --filename=$dir/gb-read.dat --rw=randread --bs=4k
            ;;
        *) fail "job $job: expected randwrite, randread, fsync or seqwrite" ;;
    esac
    rm -f /tmp/fio.json
    echo "GB-JOB-BEGIN job=$job"
    fio --name="$job" "$@" --ioengine=psync --iodepth=1 --direct=1 --numjobs=1 --size="$size" \
        --output-format=json --output=/tmp/fio.json >/tmp/fio.out 2>&1
    rc=$?
    echo "GB-JOB-END job=$job"
    echo "GB-FIO-BEGIN job=$job dev=$dev"
    if [ -s /tmp/fio.json ]; then
        gzip -9 -c /tmp/fio.json | base64
    fi
    echo "GB-FIO-END rc=$rc"
    if [ $rc -ne 0 ]; then
        sed 's/^/GB-FIO-OUT: /' /tmp/fio.out | tail -n 20
        status=1
    fi
    sync
done
if [ $dev = blk ]; then
    umount $dir || fail "umount $dir failed"
fi
exit $status
