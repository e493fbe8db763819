#!/bin/sh
# The test fuzz_wire_seeds: fuzz_seeds writes the seeds into a temporary folder, and
# fuzz_wire_replay runs them and every input kept in CORPUS (when there is one).
#   run_seeds.sh FUZZ_SEEDS FUZZ_WIRE_REPLAY CORPUS
set -e
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$1" "$dir" >/dev/null
if [ -d "$3" ]; then
  "$2" "$dir" "$3"
else
  "$2" "$dir"
fi
