#!/usr/bin/env bash
# Builds another revision's kdad, kdactl and libkdaclient into .device/bin-base, the BASE_BIN
# of `E2E_ONLY=ab scripts/dev/gpu-check.sh e2e` (the single-client ring rows of this tree's build
# and of REV, interleaved).  Run scripts/dev/gpu-bundle.sh first; debug information is stripped
# here too, so that .device stays under the 64 MiB a transfer to the GPU host takes.
#
#   scripts/dev/gpu-bundle-base.sh REV
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:?usage: scripts/dev/gpu-bundle-base.sh REV}
tree=$(mktemp -d /tmp/kdad-base-XXXXXX)
trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || true; rm -rf "$tree"' EXIT
git worktree add --quiet --detach "$tree" "$rev"
cmake -S "$tree" -B "$tree/build-gpu" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$tree/build-gpu" -j"$(nproc)" --target kdad kdactl >/dev/null
rm -rf .device/bin-base && mkdir -p .device/bin-base
cp "$tree/build-gpu/daemon/kdad" "$tree/build-gpu/client/kdactl" .device/bin-base/
cp -L "$tree/build-gpu/client/libkdaclient.so.0" .device/bin-base/
for f in .device/bin-base/*; do
  [ "$(basename "$f")" = libkdaclient.so.0 ] || strip --strip-debug "$f"
done
echo "bin-base: $(git rev-parse --short "$rev")"
du -sh .device
