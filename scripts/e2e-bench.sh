#!/usr/bin/env bash
# End-to-end benchmark of kdad on a GPU host (issue 4): per-request latency of
# the six standard workloads over each transport, and throughput of many
# concurrent 1024-token clients with and without batching.  Each measurement
# is one `kdactl --json bench` line appended to $OUT/e2e.jsonl, tagged with
# its workload; scripts/e2e-report.py joins them with the kernel's own times.
#
#   scripts/e2e-bench.sh BIN_DIR      (BIN_DIR holds kdad and kdactl)
set -uo pipefail
bin=${1:?usage: e2e-bench.sh BIN_DIR}
out=${OUT:-/tmp/kdad-e2e}
mkdir -p "$out"
: > "$out/e2e.jsonl"
mixed=1300,547,2048,963,271,3063
uniform=1024,1024,1024,1024,1024,1024,1024,1024

start_kdad() {   # start_kdad HEADS CONFIG: kdad in the background on $sock
  sock=$(mktemp -u /tmp/kdad-e2e-XXXXXX.sock)
  "$bin/kdad" --config "$2" --heads "$1" --socket "$sock" >>"$out/kdad.log" 2>&1 &
  kdad_pid=$!
  for _ in $(seq 1 600); do
    "$bin/kdactl" --socket "$sock" ping >/dev/null 2>&1 && return 0
    kill -0 "$kdad_pid" 2>/dev/null || { echo "kdad failed to start"; tail -20 "$out/kdad.log"; return 1; }
    sleep 0.1
  done
  return 1
}
stop_kdad() { kill -TERM "$kdad_pid"; wait "$kdad_pid"; echo "kdad exit $?" >>"$out/kdad.log"; }

measure() {      # measure WORKLOAD KDACTL_BENCH_ARGS...: one JSON line
  local name=$1; shift
  local json
  json=$("$bin/kdactl" --socket "$sock" --json bench "$@" 2>>"$out/kdactl.err") || echo "bench failed: $name $*" >&2
  [ -n "$json" ] && printf '{"workload": "%s", "bench": %s}\n' "$name" "$(echo "$json" | tr -d '\n')" >>"$out/e2e.jsonl"
}

# E2E_ONLY=nobatch runs only the batching-off comparison.
for heads in 96 64; do
  [ "${E2E_ONLY:-}" = nobatch ] && break
  start_kdad "$heads" bench/e2e-h200.yaml || exit 1
  for t in cuda-ipc shm inline; do
    n=20; [ "$t" = inline ] && n=8
    measure "H$heads fixed 8192" --lengths 8192 --transport "$t" --requests $n --warmup 2
    measure "H$heads mixed" --lengths "$mixed" --transport "$t" --requests $n --warmup 2
    measure "H$heads uniform 8x1024" --lengths "$uniform" --transport "$t" --requests $n --warmup 2
  done
  if [ "$heads" = 96 ]; then
    for c in 8 64; do
      for t in cuda-ipc shm; do
        measure "H96 clients x 1024" --tokens 1024 --dist fixed --seqs 1 --clients $c --requests $((c * 25)) --transport "$t"
      done
    done
  fi
  stop_kdad
done

start_kdad 96 bench/e2e-h200-nobatch.yaml || exit 1
for c in 8 64; do
  measure "H96 clients x 1024, max_batch_seqs 1" --tokens 1024 --dist fixed --seqs 1 --clients $c --requests $((c * 25)) --transport cuda-ipc
done
stop_kdad
wc -l "$out/e2e.jsonl"
