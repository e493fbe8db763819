#!/usr/bin/env bash
# End-to-end benchmark of kdad on a GPU host: per-request latency of
# the six standard workloads over each transport, and throughput of many
# concurrent 1024-token clients with and without batching.  Each measurement
# is one line of $OUT/e2e.jsonl:
#   {"workload", "variant", "summary", "bench": kdactl --json bench,
#    "stats_before": kdactl --json stats, "stats_after": kdactl --json stats}
# The stats pair brackets the measurement: the difference of their batch_us
# sums is where the daemon's time went, per phase, for exactly its batches.
# scripts/dev/e2e-report.py joins the lines with the kernel's own times.
#
#   scripts/dev/e2e-bench.sh BIN_DIR      (BIN_DIR holds kdad and kdactl)
#
# A "socket round trip" and a "ring round trip" line (kdactl --json ping of 2000
# health requests, the second over a frame ring with a polling client) come first
# for each kdad: the floors under any request's latency on this host.
# Variants: "poll" is bench/e2e-h200.yaml as it is (cuda_completion: poll, the
# default); "block" repeats the CUDA IPC latency rows and the 8-client row with
# cuda_completion: block; "spin" repeats them with clients that poll their
# socket for 200 us before sleeping (kdactl bench --spin); "depth2" is the
# 8-client row with two requests in flight per client; "ring-spin" runs the device-memory
# rows over the frame ring (kdactl bench --ring) with clients polling for 2 ms after each
# answer; E2E_ONLY=ring compares it with the socket ("spin-2ms") and with sleeping clients
# ("ring"); E2E_ONLY=ring64 the same on H = 64.  E2E_ONLY=nobatch runs only the batching-off rows,
# E2E_ONLY=ipc only the device-memory rows (CUDA IPC and VMM, all variants), E2E_ONLY=depth2
# only the two-in-flight rows, E2E_ONLY=align the mixed rows packed against sequences at
# 2 MiB boundaries (kdactl bench --align), E2E_ONLY=ring
# only the ring comparison, for quick checks.  E2E_ONLY=ab runs the single-client ring rows
# over VMM (H96, H64) for BIN_DIR and for another build's kdad and kdactl in BASE_BIN,
# interleaved twice: an A/B within one call (scripts/dev/gpu-bundle-base.sh REV makes
# .device/bin-base).
set -uo pipefail
bin=${1:?usage: e2e-bench.sh BIN_DIR}
out=${OUT:-/tmp/kdad-e2e}
mkdir -p "$out"
: > "$out/e2e.jsonl"
: > "$out/e2e-summary.txt"
mixed=1300,547,2048,963,271,3063
uniform=1024,1024,1024,1024,1024,1024,1024,1024
only=${E2E_ONLY:-}
variant=poll
client_args=""

start_kdad() {   # start_kdad HEADS CONFIG: kdad in the background on $sock
  sock=$(mktemp -u /tmp/kdad-e2e-XXXXXX.sock)
  "$bin/kdad" --config "$2" --heads "$1" --socket "$sock" >>"$out/kdad.log" 2>&1 &
  kdad_pid=$!
  for _ in $(seq 1 600); do
    kdactl --socket "$sock" ping >/dev/null 2>&1 && return 0
    kill -0 "$kdad_pid" 2>/dev/null || { echo "kdad failed to start"; tail -20 "$out/kdad.log"; return 1; }
    sleep 0.1
  done
  return 1
}
# kdactl of $bin with its own libkdaclient (two builds meet in E2E_ONLY=ab)
kdactl() { LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$bin/kdactl" "$@"; }
stop_kdad() { kill -TERM "$kdad_pid"; wait "$kdad_pid"; echo "kdad exit $?" >>"$out/kdad.log"; }

stats() { kdactl --socket "$sock" --json stats 2>>"$out/kdactl.err" | tr -d '\n'; }
field() {        # field JSON NAME: the first number after "NAME":
  grep -o "\"$2\": *[-0-9.e+]*" <<<"$1" | head -1 | sed 's/.*: *//'
}
sfield() {       # sfield JSON NAME: the first string after "NAME":
  grep -o "\"$2\": *\"[^\"]*\"" <<<"$1" | head -1 | sed 's/.*: *"//; s/"$//'
}

measure() {      # measure WORKLOAD KDACTL_BENCH_ARGS...: one JSON line
  local name=$1; shift
  local json before after summary
  before=$(stats)
  json=$(kdactl --socket "$sock" --json bench "$@" 2>>"$out/kdactl.err" | tr -d '\n') ||
    echo "bench failed: $name $*" >&2
  after=$(stats)
  [ -n "$json" ] || return 0
  # the latency p50 is the first "p50" of the bench object (latency_ms)
  local p50 tps q r dev ker
  p50=$(field "$json" p50); tps=$(field "$json" tokens_per_s)
  q=$(field "$json" daemon_queue_us_p50); r=$(field "$json" daemon_run_us_p50)
  dev=$(field "$json" daemon_device_us_p50); ker=$(field "$json" daemon_kernel_us_p50)
  summary=$(printf '%s %s: e2e p50 %.3f ms, %.0f tokens/s; daemon p50 us: queue %.0f run %.0f device %.0f kernel %.0f' \
    "$(sfield "$json" transport)" "$variant" "${p50:-0}" "${tps:-0}" "${q:-0}" "${r:-0}" "${dev:-0}" "${ker:-0}")
  echo "$name | $summary" | tee -a "$out/e2e-summary.txt"
  printf '{"workload": "%s", "variant": "%s", "summary": "%s", "bench": %s, "stats_before": %s, "stats_after": %s}\n' \
    "$name" "$variant" "$summary" "$json" "${before:-null}" "${after:-null}" >>"$out/e2e.jsonl"
}

ping_row() {     # the round trip of a health request: the floor under every request's latency
  local json name args
  for name in socket ring; do
    args=""; [ $name = ring ] && args="--ring --spin 2000"
    json=$(kdactl --socket "$sock" --json ping --count 2000 $args 2>>"$out/kdactl.err" | tr -d '\n')
    [ -n "$json" ] || continue
    echo "$name round trip (kdactl ping $args) | p50 $(field "$json" rtt_us_p50) us, p99 $(field "$json" rtt_us_p99) us" |
      tee -a "$out/e2e-summary.txt"
    printf '{"workload": "%s round trip", "variant": "%s", "ping": %s}\n' "$name" "$variant" "$json" >>"$out/e2e.jsonl"
  done
}

latency_rows() { # latency_rows HEADS TRANSPORTS...  ($client_args go to every kdactl bench)
  # 100 requests over device memory (with 20 the client share of their medians was noisy),
  # 20 over shared memory (19 ms each), 8 inline (about a second each)
  local heads=$1 t n; shift
  for t in "$@"; do
    n=100; [ "$t" = shm ] && n=20; [ "$t" = inline ] && n=8
    measure "H$heads fixed 8192" --lengths 8192 --transport "$t" --requests $n --warmup 2 $client_args
    measure "H$heads mixed" --lengths "$mixed" --transport "$t" --requests $n --warmup 2 $client_args
    measure "H$heads uniform 8x1024" --lengths "$uniform" --transport "$t" --requests $n --warmup 2 $client_args
  done
}

clients_row() {  # clients_row CLIENTS TRANSPORT [WORKLOAD]  ($client_args too)
  measure "${3:-H96 clients x 1024}" --tokens 1024 --dist fixed --seqs 1 --clients "$1" \
    --requests $(($1 * 25)) --transport "$2" $client_args
}

ring_rows() {    # ring_rows HEADS VARIANTS...: the frame ring against the socket
  local heads=$1 v; shift
  for v in "$@"; do
    variant=${v%%:*} client_args=${v#*:}
    latency_rows "$heads" cuda-ipc cuda-vmm
    [ "$heads" = 96 ] || continue
    for t in cuda-ipc cuda-vmm; do clients_row 8 $t; done
    [ "$variant" = ring ] || clients_row 64 cuda-vmm
  done
  variant=poll client_args=""
}

if [ -z "$only" ]; then
  for heads in 96 64; do
    start_kdad "$heads" bench/e2e-h200.yaml || exit 1
    ping_row
    latency_rows "$heads" cuda-ipc cuda-vmm shm inline
    [ "$heads" = 64 ] && ring_rows 64 "ring-spin:--ring --spin 2000"
    if [ "$heads" = 96 ]; then
      for c in 8 64; do
        for t in cuda-ipc cuda-vmm shm; do clients_row $c $t; done
      done
    fi
    stop_kdad
  done
elif [ "$only" = ipc ]; then
  start_kdad 96 bench/e2e-h200.yaml || exit 1
  ping_row
  latency_rows 96 cuda-ipc cuda-vmm
  for t in cuda-ipc cuda-vmm; do clients_row 8 $t; done
  stop_kdad
elif [ "$only" = ring ] || [ "$only" = ring64 ]; then
  heads=96; [ "$only" = ring64 ] && heads=64
  start_kdad $heads bench/e2e-h200.yaml || exit 1
  ping_row
  ring_rows $heads "spin-2ms:--spin 2000" "ring-spin:--ring --spin 2000" "ring:--ring"
  stop_kdad
elif [ "$only" = ab ]; then
  new=$bin
  for heads in 96 64; do
    for round in 1 2; do
      for bin in "$new" "${BASE_BIN:?E2E_ONLY=ab compares with the kdad and kdactl in BASE_BIN}"; do
        start_kdad $heads bench/e2e-h200.yaml || exit 1
        variant="ring-spin $(basename "$bin")" client_args="--ring --spin 2000"
        latency_rows $heads cuda-vmm
        stop_kdad
      done
    done
  done
  bin=$new variant=poll client_args=""
fi

# The other completion mode, on the rows it matters for.
if [ -z "$only" ] || [ "$only" = ipc ]; then
  block_cfg=$(mktemp /tmp/kdad-e2e-block-XXXXXX.yaml)
  { cat bench/e2e-h200.yaml; echo "cuda_completion: block"; } > "$block_cfg"
  variant=block
  start_kdad 96 "$block_cfg" || exit 1
  latency_rows 96 cuda-ipc
  clients_row 8 cuda-ipc
  stop_kdad
  variant=poll
  rm -f "$block_cfg"
fi

depth2_rows() {  # 8 clients with two requests in flight each
  variant=depth2 client_args=""
  for t in cuda-ipc cuda-vmm; do
    measure "H96 clients x 1024" --tokens 1024 --dist fixed --seqs 1 --clients 8 --depth 2 \
      --requests 200 --transport $t
  done
  variant=poll
}

# The client side: spinning instead of sleeping, and clients with two requests in flight.
if [ -z "$only" ] || [ "$only" = ipc ]; then
  start_kdad 96 bench/e2e-h200.yaml || exit 1
  variant=spin client_args="--spin 200"
  latency_rows 96 cuda-ipc cuda-vmm
  ring_rows 96 "ring-spin:--ring --spin 2000"
  depth2_rows
  stop_kdad
elif [ "$only" = align ]; then
  # Is the CUDA IPC slowdown of the mixed batch about where its sequences start?  Packed (as
  # a varlen batch holds them) against every sequence at a multiple of 2 MiB.  ALIGNS,
  # ALIGN_HEADS and ALIGN_TRANSPORTS narrow or widen the grid.
  for heads in ${ALIGN_HEADS:-96 64}; do
    start_kdad $heads bench/e2e-h200.yaml || exit 1
    for round in 1 2; do
      for align in ${ALIGNS:-256 2097152}; do
        for t in ${ALIGN_TRANSPORTS:-cuda-ipc cuda-vmm}; do
          variant="ring-spin align $align"
          measure "H$heads mixed" --lengths "$mixed" --transport $t --requests 100 --warmup 2 \
            --ring --spin 2000 --align $align
        done
      done
    done
    stop_kdad
  done
  variant=poll
elif [ "$only" = depth2 ]; then
  start_kdad 96 bench/e2e-h200.yaml || exit 1
  depth2_rows
  stop_kdad
fi

if [ -z "$only" ] || [ "$only" = nobatch ]; then
  start_kdad 96 bench/e2e-h200-nobatch.yaml || exit 1
  for c in 8 64; do
    clients_row $c cuda-ipc "H96 clients x 1024, max_batch_seqs 1"
  done
  stop_kdad
fi
wc -l "$out/e2e.jsonl"
