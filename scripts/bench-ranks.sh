#!/usr/bin/env bash
# bench-ranks.sh - kdactl bench against several kdad at once, one load-generating process
# per daemon (one kdad per GPU: each rank of a tensor-parallel engine drives its own
# daemon, which serves its share of the heads).  All ranks start together and run the
# same workload; the report gives each daemon's throughput and the aggregate.
#
#   scripts/bench-ranks.sh [--json] TARGET... -- KDACTL_BENCH_ARGS...
#
# TARGET: a socket path (anything with a '/'), or a GPU ordinal or UUID (kdactl --gpu:
# the socket of kdad@N).  KDACTL: the kdactl to run (default: kdactl from PATH, else
# build/client/kdactl).  OUT (optional): a folder that keeps each rank's kdactl --json
# bench document (rank-R.json).  --json prints one JSON document instead of the table.
# Use --duration SEC so that every rank measures the same window; in count mode
# (--requests) the aggregate divides all tokens by the longest rank's time.
#
# Throughput: tokens/s is prefilled tokens per second of a daemon, each token carrying
# the daemon's H_r heads; head-tokens/s (tokens/s x H_r) adds up across ranks that serve
# different heads, and equals tokens/s x H of one daemon serving all H heads at that
# rate.  A head-sharded request (kdac_shard_prefill) puts the same tokens on every rank,
# so its throughput is the slowest rank's tokens/s.
#
# Example, two instances against one (H = 32, 64 concurrent 1024-token requests):
#   scripts/bench-ranks.sh 0 1 -- --clients 64 --tokens 1024 --duration 20
#   scripts/bench-ranks.sh /run/kdad/kdad.sock -- --clients 64 --tokens 1024 --duration 20
set -euo pipefail
json=false
targets=()
while (($#)); do
  case $1 in
  --json) json=true ;;
  --) shift; break ;;
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) targets+=("$1") ;;
  esac
  shift
done
((${#targets[@]})) || { echo "bench-ranks: no TARGET (a socket or a GPU); see --help" >&2; exit 2; }
kdactl=${KDACTL:-$(command -v kdactl || echo "$(dirname "$0")/../build/client/kdactl")}
[ -x "$kdactl" ] || { echo "bench-ranks: no kdactl at $kdactl (set KDACTL)" >&2; exit 2; }
work=$(mktemp -d /tmp/kdad-bench-ranks-XXXXXX)
trap 'rm -rf "$work"' EXIT

# Every rank connects first (its hello), then all start on one signal: a file appearing.
pids=()
for r in "${!targets[@]}"; do
  t=${targets[$r]}
  case $t in */*) where=(--socket "$t") ;; *) where=(--gpu "$t") ;; esac
  "$kdactl" "${where[@]}" hello >/dev/null 2>"$work/rank-$r.err" ||
    { echo "bench-ranks: rank $r ($t): $(cat "$work/rank-$r.err")" >&2; exit 3; }
  (while [ ! -e "$work/go" ]; do sleep 0.01; done
   exec "$kdactl" "${where[@]}" --json bench "$@" >"$work/rank-$r.json" 2>"$work/rank-$r.err") &
  pids+=($!)
done
touch "$work/go"
failed=0
for r in "${!pids[@]}"; do
  wait "${pids[$r]}" || { failed=1; echo "bench-ranks: rank $r (${targets[$r]}) failed:" \
                                        "$(cat "$work/rank-$r.err")" >&2; }
done
((failed == 0)) || exit 1
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && cp "$work"/rank-*.json "$OUT/"; fi

num() { grep -o "\"$2\": *[-0-9.e+]*" "$1" | head -1 | sed 's/.*: *//'; }
rows=() tokens=0 seconds=0 head_tps=0 slowest=
for r in "${!targets[@]}"; do
  f=$work/rank-$r.json
  heads=$(num "$f" heads) tok=$(num "$f" tokens) sec=$(num "$f" seconds)
  tps=$(num "$f" tokens_per_s) rps=$(num "$f" requests_per_s) p50=$(num "$f" p50)
  tokens=$((tokens + tok))
  seconds=$(awk -v a="$seconds" -v b="$sec" 'BEGIN { print (b > a ? b : a) }')
  head_tps=$(awk -v a="$head_tps" -v t="$tps" -v h="$heads" 'BEGIN { printf "%.1f", a + t * h }')
  slowest=$(awk -v a="${slowest:-$tps}" -v t="$tps" 'BEGIN { print (t < a ? t : a) }')
  rows+=("$r ${targets[$r]} $heads $tok $sec $rps $tps $p50")
done
agg_tps=$(awk -v t="$tokens" -v s="$seconds" 'BEGIN { printf "%.1f", (s > 0 ? t / s : 0) }')

if $json; then
  printf '{"ranks": ['
  for i in "${!rows[@]}"; do
    read -r r t heads tok sec rps tps p50 <<<"${rows[$i]}"
    ((i)) && printf ', '
    printf '{"rank": %s, "target": "%s", "heads": %s, "tokens": %s, "seconds": %s, ' \
      "$r" "$t" "$heads" "$tok" "$sec"
    printf '"requests_per_s": %s, "tokens_per_s": %s, "head_tokens_per_s": %s, "p50_ms": %s}' \
      "$rps" "$tps" "$(awk -v t="$tps" -v h="$heads" 'BEGIN { printf "%.1f", t * h }')" "$p50"
  done
  printf '], "tokens": %s, "seconds": %s, "tokens_per_s": %s, "head_tokens_per_s": %s, ' \
    "$tokens" "$seconds" "$agg_tps" "$head_tps"
  printf '"sharded_tokens_per_s": %s}\n' "$slowest"
  exit 0
fi
printf '%-4s %5s %10s %8s %10s %12s %14s %9s  %s\n' rank heads tokens seconds requests/s \
  tokens/s head-tokens/s p50_ms target
for row in "${rows[@]}"; do
  read -r r t heads tok sec rps tps p50 <<<"$row"
  printf '%-4s %5s %10s %8.2f %10.1f %12.1f %14.1f %9.2f  %s\n' "$r" "$heads" "$tok" "$sec" \
    "$rps" "$tps" "$(awk -v t="$tps" -v h="$heads" 'BEGIN { print t * h }')" "$p50" "$t"
done
printf '%-4s %5s %10s %8.2f %10s %12.1f %14.1f %9s  %s\n' all "" "$tokens" "$seconds" "" \
  "$agg_tps" "$head_tps" "" "${#targets[@]} daemons"
printf 'head-sharded requests (every rank the same tokens): %.1f tokens/s (the slowest rank)\n' \
  "$slowest"
