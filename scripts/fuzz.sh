#!/usr/bin/env bash
# Fuzzes what kdad reads from clients (tests/fuzz/fuzz_wire.c) with libFuzzer:
# builds build-fuzz with clang, ASan and UBSan, seeds it with valid frames
# (fuzz_seeds) and the inputs kept in tests/fuzz/corpus, and runs for SECONDS
# (default 300) on JOBS processes (default 1), growing build-fuzz/corpus.  A
# finding is written to build-fuzz/crash-* (libFuzzer prints how to reproduce
# it); once it is fixed, copy it into tests/fuzz/corpus/, so that every ctest
# run replays it (fuzz_wire_seeds).
#
#   scripts/fuzz.sh [SECONDS] [JOBS]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build-fuzz
cmake -S . -B "$dir" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKDAD_FUZZ=ON \
      -DKDAD_GOLDEN_DIR="${KDAD_GOLDEN_DIR:-$PWD/../shared/golden}" >/dev/null
cmake --build "$dir" -j"$(nproc)" --target fuzz_wire fuzz_seeds >/dev/null
mkdir -p "$dir/corpus" "$dir/seeds"
"$dir/tests/fuzz/fuzz_seeds" "$dir/seeds" >/dev/null
inputs=(corpus seeds)
[ -d tests/fuzz/corpus ] && inputs+=(../tests/fuzz/corpus)
seconds=${1:-300} jobs=${2:-1}
cd "$dir"
./tests/fuzz/fuzz_wire -max_total_time="$seconds" -jobs="$jobs" -workers="$jobs" \
  -max_len=65536 -print_final_stats=1 "${inputs[@]}"
