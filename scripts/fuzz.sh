#!/usr/bin/env bash
# Fuzzes with libFuzzer (clang, ASan, UBSan; build-fuzz):
#   wire    what kdad reads from clients (tests/fuzz/fuzz_wire.c), seeded with valid frames
#           (fuzz_seeds) and the inputs kept in tests/fuzz/corpus;
#   config  its configuration parser (tests/fuzz/fuzz_config.c), seeded with
#           config/kdad.yaml and tests/fuzz/config;
#   safetensors  the safetensors reader and kdactl's prefill input check
#           (tests/fuzz/fuzz_safetensors.c), seeded by `fuzz_seeds --safetensors`.
# Runs for SECONDS (default 300) on JOBS processes (default 1), growing
# build-fuzz/corpus-TARGET.  A finding is written to build-fuzz/crash-* (libFuzzer
# prints how to reproduce it); once it is fixed, copy it into tests/fuzz/corpus/ (wire)
# or tests/fuzz/config/ (config), so that every ctest run replays it.
#
#   scripts/fuzz.sh [wire|config|safetensors] [SECONDS] [JOBS]
set -euo pipefail
cd "$(dirname "$0")/.."
target=wire
case ${1:-} in wire|config|safetensors) target=$1; shift ;; esac
seconds=${1:-300} jobs=${2:-1}
dir=build-fuzz
cmake -S . -B "$dir" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKDAD_FUZZ=ON \
      -DKDAD_GOLDEN_DIR="${KDAD_GOLDEN_DIR:-$PWD/../shared/golden}" >/dev/null
cmake --build "$dir" -j"$(nproc)" --target "fuzz_$target" fuzz_seeds >/dev/null
mkdir -p "$dir/corpus-$target"
if [ "$target" = wire ]; then
  mkdir -p "$dir/seeds"
  "$dir/tests/fuzz/fuzz_seeds" "$dir/seeds" >/dev/null
  inputs=("corpus-$target" seeds)
  [ -d tests/fuzz/corpus ] && inputs+=(../tests/fuzz/corpus)
elif [ "$target" = config ]; then
  mkdir -p "$dir/seeds-config"
  cp config/kdad.yaml tests/fuzz/config/* "$dir/seeds-config/"
  inputs=("corpus-$target" seeds-config)
else
  mkdir -p "$dir/seeds-safetensors"
  "$dir/tests/fuzz/fuzz_seeds" --safetensors "$dir/seeds-safetensors" >/dev/null
  inputs=("corpus-$target" seeds-safetensors)
fi
cd "$dir"
"./tests/fuzz/fuzz_$target" -max_total_time="$seconds" -jobs="$jobs" -workers="$jobs" \
  -max_len=65536 -print_final_stats=1 "${inputs[@]}"
