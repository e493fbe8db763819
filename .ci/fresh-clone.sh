#!/usr/bin/env bash
# The repository as a stranger gets it: clones the committed tree into an empty
# temporary folder (nothing beside the checkout, no golden files, no build) and
# runs the README's two commands there, then the install steps the README
# gives after the quickstart (DESTDIR install of the whole build).  Prints how
# long each command took.  The clone's test run is the normal build only
# (KDAD_TEST_FAST=1); the ASan build runs in the main CI step.
#
#   .ci/fresh-clone.sh [REPO]     (default: the repository this script is in)
set -euo pipefail
repo=$(realpath "${1:-$(dirname "$0")/..}")
tmp=$(mktemp -d /tmp/kdad-fresh-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
git clone --quiet --no-local "$repo" "$tmp/kdad"
cd "$tmp/kdad"
unset KDAD_GOLDEN_DIR
[ -z "$(ls -A "$tmp" | grep -v '^kdad$')" ] || { echo "fresh-clone: $tmp is not empty" >&2; exit 1; }

log() { echo "$tmp/log-${1//[^A-Za-z0-9]/_}"; }
step() {   # step NAME COMMAND...: runs it, logs to $(log NAME), prints the time
  local name=$1 t0 rc=0; shift
  t0=$(date +%s)
  "$@" >"$(log "$name")" 2>&1 || rc=$?
  printf 'fresh-clone: %-28s %4ds  exit %d\n' "$name" $(($(date +%s) - t0)) "$rc"
  if [ "$rc" -ne 0 ]; then
    tail -40 "$(log "$name")" >&2
    exit 1
  fi
}

step "scripts/quickstart.sh" scripts/quickstart.sh
grep -q "kdad drained and exited with status 0" "$(log scripts/quickstart.sh)" ||
  { echo "fresh-clone: the quickstart did not end with kdad's clean exit" >&2; exit 1; }
step "DESTDIR=... cmake --install" env DESTDIR="$tmp/root" cmake --install build
for f in usr/local/sbin/kdad usr/local/bin/kdactl usr/local/include/kdaclient.h \
         usr/local/share/man/man1/kdactl.1 usr/local/share/doc/kdad/kda.md; do
  [ -e "$tmp/root/$f" ] || { echo "fresh-clone: the install lacks /$f" >&2; exit 1; }
done
ls "$tmp"/root/usr/local/lib*/libkdaclient.so.0 "$tmp"/root/usr/local/lib*/libkdaclient.a \
   >/dev/null || { echo "fresh-clone: the install lacks libkdaclient" >&2; exit 1; }
step "scripts/test.sh" env KDAD_TEST_FAST=1 scripts/test.sh
grep -E 'tests passed|tests failed' build/ctest.log | tail -1
