#!/usr/bin/env bash
# Builds everything and runs the whole test suite twice: a normal build (CUDA
# code compiled when nvcc is present; GPU tests skip without a GPU) and an
# AddressSanitizer + UndefinedBehaviorSanitizer build.
#
#   scripts/test.sh            both builds
#   KDAD_TEST_FAST=1 scripts/test.sh   the normal build only
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
golden=${KDAD_GOLDEN_DIR:-}   # empty: the golden cases regenerated in the build folder

run_suite() {   # run_suite BUILD_DIR [cmake args...]
  local dir=$1; shift
  cmake -S . -B "$dir" -DKDAD_GOLDEN_DIR="$golden" "$@" >/dev/null
  cmake --build "$dir" -j"$jobs"
  ctest --test-dir "$dir" --output-on-failure -j"$jobs" 2>&1 | tee "$dir/ctest.log"
  return "${PIPESTATUS[0]}"
}

status=0
echo "== build: release (with CUDA when nvcc is present)"
run_suite build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKDAD_WERROR=ON || status=1
if [ -z "${KDAD_TEST_FAST:-}" ]; then
  echo "== build: ASan + UBSan"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_suite build-asan -DCMAKE_BUILD_TYPE=Debug -DKDAD_SANITIZE=ON -DKDAD_WERROR=ON || status=1
fi
echo "== summary"
for d in build build-asan; do
  [ -f "$d/ctest.log" ] && echo "$d: $(grep -E 'tests passed|tests failed' "$d/ctest.log" | tail -1)"
done
exit $status
