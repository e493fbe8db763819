#!/usr/bin/env bash
# Compiles the fused kernel with ptxas's report and fails on what the build's
# spill guard cannot see: wgmma serialised by ptxas (C7510: e.g. a wgmma in a
# non-inlined call; C7511: not enough registers for the wgmma pipeline), which
# is an info line, not a warning, and costs 1.5x or more (bench/RESULTS.md).
#
#   scripts/dev/ptxas-check.sh NVCC SOURCE_DIR CUDA_FLAGS...   (the build's KDAD_CUDA_FLAGS)
set -uo pipefail
usage="usage: ptxas-check.sh NVCC SOURCE_DIR CUDA_FLAGS..."
nvcc=${1:?$usage}
src=${2:?$usage}
shift 2
report=$("$nvcc" "$@" -std=c++17 -I"$src/kernels" -I"$src/kernels/cuda" -Xptxas=-v \
    -c "$src/kernels/cuda/kda_fwd_sm90.cu" -o /dev/null 2>&1) ||
    { echo "$report"; echo "ptxas-check: the kernel does not compile"; exit 1; }
grep -E "registers|spill" <<<"$report"
if grep -E "C751[0-9]|Potential Performance Loss|[1-9][0-9]* bytes spill" <<<"$report"; then
    echo "ptxas-check: FAILED: serialised wgmma or spills in the fused kernel (see above)"
    exit 1
fi
echo "ptxas-check: no serialised wgmma, no spills"
