#!/bin/sh
# The fuzz_*_seeds tests: SEEDER writes seeds into a temporary folder, and REPLAY runs them
# and every input kept in CORPUS (when that folder exists).
#   run_seeds.sh REPLAY CORPUS SEEDER [SEEDER_ARGS...]
set -e
replay=$1 corpus=$2
shift 2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$@" "$dir" >/dev/null
if [ -d "$corpus" ]; then
  "$replay" "$dir" "$corpus"
else
  "$replay" "$dir"
fi
