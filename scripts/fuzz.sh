#!/usr/bin/env bash
# Fuzzes with libFuzzer (clang, ASan, UBSan; build-fuzz):
#   wire    what kdad reads from clients (tests/fuzz/fuzz_wire.c), seeded with valid frames
#           (fuzz_seeds) and the inputs kept in tests/fuzz/corpus;
#   config  its configuration parser (tests/fuzz/fuzz_config.c), seeded with
#           config/kdad.yaml and tests/fuzz/config;
#   safetensors  the safetensors reader and kdactl's prefill input check
#           (tests/fuzz/fuzz_safetensors.c), seeded by `fuzz_seeds --safetensors`.
# Runs for SECONDS (default 300) on JOBS processes (default 1) in build-fuzz/run-TARGET,
# growing its corpus/.  A finding is written there as crash-* (libFuzzer prints how to
# reproduce it); once it is fixed, keep it where every ctest run replays it:
# tests/fuzz/corpus/ (wire), tests/fuzz/config/ (config), a case of
# tests/test_safetensors.c (safetensors).
#
#   scripts/fuzz.sh [wire|config|safetensors] [SECONDS] [JOBS]
set -euo pipefail
cd "$(dirname "$0")/.."
target=wire
case ${1:-} in wire|config|safetensors) target=$1; shift ;; esac
seconds=${1:-300} jobs=${2:-1}
dir=build-fuzz
cmake -S . -B "$dir" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKDAD_FUZZ=ON \
      >/dev/null
cmake --build "$dir" -j"$(nproc)" --target "fuzz_$target" fuzz_seeds >/dev/null
# Each target runs in its own folder: its corpus, seeds, logs (fuzz-N.log) and findings.
run=$dir/run-$target
mkdir -p "$run/corpus" "$run/seeds"
case $target in
  wire)        "$dir/tests/fuzz/fuzz_seeds" "$run/seeds" >/dev/null ;;
  config)      cp config/kdad.yaml tests/fuzz/config/* "$run/seeds/" ;;
  safetensors) "$dir/tests/fuzz/fuzz_seeds" --safetensors "$run/seeds" >/dev/null ;;
esac
inputs=(corpus seeds)
[ "$target" = wire ] && [ -d tests/fuzz/corpus ] && inputs+=(../../tests/fuzz/corpus)
cd "$run"
"../tests/fuzz/fuzz_$target" -max_total_time="$seconds" -jobs="$jobs" -workers="$jobs" \
  -max_len=65536 -print_final_stats=1 "${inputs[@]}"
