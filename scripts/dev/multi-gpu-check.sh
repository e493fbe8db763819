#!/usr/bin/env bash
# One kdad per GPU on a GPU host (scripts/dev/gpu-check.sh multi runs it): throughput of one
# daemon serving all H = 32 heads on GPU 0 against two daemons of 16 heads, on GPUs 0 and 1
# (on a host of one GPU both share it), each driven by its own kdactl bench of 64 concurrent
# 1024-token requests over device memory (scripts/bench-ranks.sh).  The head-sharded
# results themselves are test_shard_cuda's (bit for bit against one daemon).
#
#   scripts/dev/multi-gpu-check.sh BIN_DIR      (BIN_DIR holds kdad and kdactl)
#
# Writes $OUT/multi-one.json, multi-two.json (bench-ranks.sh --json, also printed) and
# kdad-multi.log; prints the ratio of the aggregate head-tokens/s last.
set -uo pipefail
bin=${1:?usage: multi-gpu-check.sh BIN_DIR}
out=${OUT:-/tmp/kdad-multi}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
((ngpu > 0)) || { echo "multi-gpu-check: no GPU"; exit 77; }
export KDACTL=$bin/kdactl
pids=()
socks=()

start() {   # start HEADS DEVICE: a kdad on a fresh socket, appended to socks/pids
  local sock
  sock=$(mktemp -u /tmp/kdad-multi-XXXXXX.sock)
  "$bin/kdad" --config bench/e2e-h200.yaml --heads "$1" --device "$2" --socket "$sock" \
    >>"$out/kdad-multi.log" 2>&1 &
  pids+=($!)
  socks+=("$sock")
  for _ in $(seq 1 600); do
    "$KDACTL" --socket "$sock" ping >/dev/null 2>&1 && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "kdad failed to start"; tail -20 "$out/kdad-multi.log"; return 1; }
    sleep 0.1
  done
  return 1
}
stop_all() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  pids=() socks=()
}
trap stop_all EXIT  # also when a daemon fails to start
bench=(--clients 64 --tokens 1024 --dist fixed --seqs 1 --requests 1600 --transport cuda-vmm)

echo "== $ngpu GPU(s); one kdad, H = 32, GPU 0"
start 32 0 || exit 1
OUT= scripts/bench-ranks.sh --json "${socks[@]}" -- "${bench[@]}" | tee "$out/multi-one.json"
stop_all
echo "== two kdad, H = 16 each, GPUs 0 and $((1 % ngpu))"
start 16 0 && start 16 $((1 % ngpu)) || exit 1
OUT= scripts/bench-ranks.sh --json "${socks[@]}" -- "${bench[@]}" | tee "$out/multi-two.json"
stop_all
one=$(grep -o '], "tokens": [^}]*' "$out/multi-one.json" | grep -o '"head_tokens_per_s": [0-9.]*' | grep -o '[0-9.]*$')
two=$(grep -o '], "tokens": [^}]*' "$out/multi-two.json" | grep -o '"head_tokens_per_s": [0-9.]*' | grep -o '[0-9.]*$')
awk -v a="$one" -v b="$two" -v n="$ngpu" 'BEGIN {
  printf "aggregate head-tokens/s: one kdad %.0f, two kdad %.0f: %.2fx (%s)\n", a, b,
         (a > 0 ? b / a : 0), (n >= 2 ? "two GPUs; target >= 1.9x" : "both on one GPU") }'
