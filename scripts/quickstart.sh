#!/usr/bin/env bash
# Quickstart on a fresh Debian 12 machine: install the build dependencies,
# build kdad, and run a KDA prefill.
#
# Until the daemon lands (issue 7) this runs the CPU backend directly on a
# random H = 8, T = 2048 prefill and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target bench_cpu
echo "quickstart: kdad is not built yet; running the reference prefill (CPU backend) directly"
./build/bench/bench_cpu --heads 8 --tokens 2048 --reps 3
