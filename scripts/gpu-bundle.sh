#!/usr/bin/env bash
# Prepares .device/ (git-ignored) for a GPU run: the runtime .debs the GPU
# host lacks, the golden vectors, and the GPU binaries (kernel tests and
# benchmark, kdad, kdactl, the daemon's GPU suites) from build-gpu/.  Then
# call the device tool with carry [".device"] and `scripts/gpu-check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${KDAD_SHARED:-$PWD/../shared}
mkdir -p .device/debs .device/golden .device/bin
cp "$shared"/device-debs/*.deb .device/debs/
ls .device/debs/libjson-c5_*.deb >/dev/null 2>&1 || (cd .device/debs && apt-get download -q libjson-c5)
cp "$shared"/golden/*.safetensors .device/golden/
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null && cmake --build build-gpu -j"$(nproc)" --target test_wgmma_layout test_cuda_kernel test_cuda_decode bench_kernel bench_kernel_profile bench_launch bench_ipc \
    kdad kdactl test_daemon_cuda test_daemon_shm_cuda test_daemon_ring_cuda test_daemon_cuda_ipc \
    test_shard_cuda test_daemon_stream_cuda bench_layers
cp build-gpu/tests/test_wgmma_layout build-gpu/tests/test_cuda_kernel build-gpu/tests/test_cuda_decode build-gpu/bench/bench_kernel \
   build-gpu/bench/bench_kernel_profile build-gpu/bench/bench_launch build-gpu/bench/bench_ipc build-gpu/daemon/kdad build-gpu/client/kdactl \
   build-gpu/tests/test_daemon_cuda build-gpu/tests/test_daemon_shm_cuda \
   build-gpu/tests/test_daemon_ring_cuda build-gpu/tests/test_daemon_cuda_ipc \
   build-gpu/tests/test_shard_cuda build-gpu/tests/test_daemon_stream_cuda build-gpu/bench/bench_layers \
   .device/bin/
cp -L build-gpu/client/libkdaclient.so.0 .device/bin/   # kdactl's RUNPATH points into build-gpu
# Debug information stripped (libkdaclient's symbols kept) so that .device fits a call's
# carry (64 MiB).
for f in .device/bin/*; do
  [ "$(basename "$f")" = libkdaclient.so.0 ] || strip --strip-debug "$f"
done
du -sh .device
