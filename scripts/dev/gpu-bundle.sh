#!/usr/bin/env bash
# Prepares .device/ (git-ignored) for a run on a GPU host that has the NVIDIA
# driver but none of kdad's libraries: the runtime .debs it lacks (from
# KDAD_DEVICE_DEBS, a folder of them, else downloaded with apt-get), the golden
# vectors, and the GPU binaries (kernel tests and benchmark, kdad, kdactl, the
# daemon's GPU suites) built in build-gpu/.  Copy the tree with .device/ to the
# GPU host and run scripts/dev/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .device/debs .device/golden .device/bin
if [ -n "${KDAD_DEVICE_DEBS:-}" ]; then
  cp "$KDAD_DEVICE_DEBS"/*.deb .device/debs/
fi
for pkg in libuv1 libmsgpackc2 libyaml-0-2 libjson-c5 libcmocka0 libsystemd0; do
  ls .device/debs/"$pkg"_*.deb >/dev/null 2>&1 || (cd .device/debs && apt-get download -q "$pkg")
done
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null && cmake --build build-gpu -j"$(nproc)" --target test_wgmma_layout test_cuda_kernel bench_kernel bench_kernel_profile bench_launch bench_ipc \
    kdad kdactl test_daemon_cuda test_daemon_shm_cuda test_daemon_ring_cuda test_daemon_cuda_ipc kda_golden_cases \
    test_cuda_decode test_shard_cuda test_daemon_stream_cuda bench_layers test_daemon_step_cuda
cp build-gpu/golden/*.safetensors .device/golden/
cp build-gpu/tests/test_wgmma_layout build-gpu/tests/test_cuda_kernel build-gpu/tests/test_cuda_decode build-gpu/bench/bench_kernel \
   build-gpu/bench/bench_kernel_profile build-gpu/bench/bench_launch build-gpu/bench/bench_ipc build-gpu/daemon/kdad build-gpu/client/kdactl \
   build-gpu/tests/test_daemon_cuda build-gpu/tests/test_daemon_shm_cuda \
   build-gpu/tests/test_daemon_ring_cuda build-gpu/tests/test_daemon_cuda_ipc \
   build-gpu/tests/test_shard_cuda build-gpu/tests/test_daemon_stream_cuda build-gpu/bench/bench_layers build-gpu/tests/test_daemon_step_cuda \
   .device/bin/
cp -L build-gpu/client/libkdaclient.so.0 .device/bin/   # kdactl's RUNPATH points into build-gpu
# Debug information stripped (libkdaclient's symbols kept) so that .device stays under the
# 64 MiB a transfer to the GPU host takes.
for f in .device/bin/*; do
  [ "$(basename "$f")" = libkdaclient.so.0 ] || strip --strip-debug "$f"
done
du -sh .device
