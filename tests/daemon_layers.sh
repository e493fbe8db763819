#!/usr/bin/env bash
# daemon_layers.sh ARCHIVE SOURCE_DIR - the daemon's modules call downwards
# only (docs/daemon.md, Architecture).
#
#  1. Calls: from nm over the objects of kdad_core, file A calls file B when
#     A uses a symbol B defines.  No file may reach itself again through
#     such calls (callbacks given at creation, as libuv's, are how a lower
#     module reports upwards).
#  2. Includes: conn.c and server.c include no daemon header but their own
#     and log.h.
set -euo pipefail
archive=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# "object symbol" for definitions and for uses
nm -A --defined-only "$archive" 2>/dev/null |
  awk '$(NF-1) ~ /^[TDBR]$/ { split($1, p, ":"); o = p[2]; sub(/\.c\.o$/, "", o); print o, $NF }' \
  > "$tmp/defs"
nm -A --undefined-only "$archive" 2>/dev/null |
  awk '{ split($1, p, ":"); o = p[2]; sub(/\.c\.o$/, "", o); print o, $NF }' > "$tmp/uses"

status=0
awk '
  NR == FNR { def[$2] = $1; next }
  ($2 in def) && def[$2] != $1 && !(($1, def[$2]) in e) {
    e[$1, def[$2]] = $1 " -> " def[$2] " (" $2 ")"; v[$1]; v[def[$2]]
  }
  END {
    for (k in e) r[k] = 1 # transitive closure (a few dozen files)
    for (m in v) for (a in v) if ((a, m) in r) for (b in v) if ((m, b) in r) r[a, b] = 1
    bad = 0
    for (k in e) {
      split(k, ab, SUBSEP)
      if ((ab[2], ab[1]) in r) { print "cycle: " e[k] " and back"; bad = 1 }
    }
    exit bad
  }' "$tmp/defs" "$tmp/uses" || status=1

for f in conn.c server.c; do
  own=${f%.c}.h
  extra=$(grep -o '^#include "[^"]*"' "$src/$f" | sed 's/#include "//; s/"$//' |
          grep -vx -e "$own" -e log.h -e kdaproto.h || true)
  if [ -n "$extra" ]; then
    echo "$f includes daemon headers besides its own and log.h: $extra"
    status=1
  fi
done
for h in conn.h server.h; do
  extra=$(grep -o '^#include "[^"]*"' "$src/$h" | sed 's/#include "//; s/"$//' |
          grep -vx -e kdaproto.h || true)
  if [ -n "$extra" ]; then
    echo "$h includes daemon headers: $extra"
    status=1
  fi
done
[ $status -eq 0 ] && echo "daemon layers: calls go downwards; conn.c and server.c stand alone"
exit $status
