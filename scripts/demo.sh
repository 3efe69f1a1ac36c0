#!/usr/bin/env bash
# The project's main job (the README's first command), on a fresh Debian 12
# machine with a Rust toolchain: installs what is missing, builds
# everything, then
#   1. scripts/vm-demo.sh: boots a stock Linux guest with cloud-hypervisor
#      on a thin pcow pmem device (ext4 with -o dax), twice, with an
#      offline snapshot in between; on this project's machines (whose KVM
#      cannot run a stock Linux guest) inside the nested sandbox, and says
#      so;
#   2. scripts/pcow-img-demo.sh: pcow-img end to end (base image, overlay,
#      snapshots, rollback, check, map, convert checked by qemu-img,
#      compact).
# Exits non-zero if anything fails.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
"$here/vm-demo.sh"
"$here/pcow-img-demo.sh"
