#!/usr/bin/env bash
# Builds the kernel benchmark and the kernel tests of another version of the
# tree, for a same-call A/B on the GPU host (H200 hosts differ by up to 1.5x
# between runs, so only binaries run in one go compare):
#
#   scripts/dev/kernel-variant.sh NAME [REF [PATCH]]
#
# checks out REF (default HEAD) in a temporary worktree, applies PATCH (a
# `git diff` file) if given, builds bench_kernel and test_cuda_kernel with the
# same configuration as scripts/dev/gpu-bundle.sh and copies them to
# .device/bin/bench_kernel_NAME and .device/bin/test_cuda_kernel_NAME.
# `scripts/dev/gpu-check.sh ab` then runs bench_kernel and every variant, twice,
# interleaved; `scripts/dev/gpu-check.sh vtests` runs every variant's kernel tests.
# Example: the working tree against the last commit:
#   git diff > /tmp/wip.patch && scripts/dev/kernel-variant.sh head HEAD
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?usage: kernel-variant.sh NAME [REF [PATCH]]}
ref=${2:-HEAD}
patch=${3:-}
[[ $name =~ ^[A-Za-z0-9_-]+$ ]] || { echo "kernel-variant.sh: NAME must be letters, digits, _ or -" >&2; exit 2; }
[ -z "$patch" ] || patch=$(realpath "$patch")
tree=$(mktemp -d /tmp/kdad-variant-XXXXXX)
trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || true; rm -rf "$tree"' EXIT
git worktree add -q --detach "$tree" "$ref"
[ -z "$patch" ] || git -C "$tree" apply "$patch"
cmake -S "$tree" -B "$tree/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$tree/build" -j"$(nproc)" --target bench_kernel test_cuda_kernel >/dev/null
mkdir -p .device/bin
cp "$tree/build/bench/bench_kernel" ".device/bin/bench_kernel_$name"
cp "$tree/build/tests/test_cuda_kernel" ".device/bin/test_cuda_kernel_$name"
echo ".device/bin/{bench_kernel,test_cuda_kernel}_$name ($(git rev-parse --short "$ref")${patch:+ + $(basename "$patch")})"
