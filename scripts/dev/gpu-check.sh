#!/usr/bin/env bash
# Runs on the GPU host: the GPU tests, compute-sanitizer on a varlen batch, and
# the kernel benchmark, from binaries built on a build machine and copied in
# .device/ (scripts/dev/gpu-bundle.sh).  Full logs go to $OUT (one logs.tar.gz
# beside the JSON results, so that few files travel back); a short summary is
# printed last.
#
#   scripts/dev/gpu-check.sh [layout] [kernel] [decode] [sanitize] [bench] [launch] [ipc] [profile] [daemon] [e2e] [ab] [vtests] [multi] [stream]
#   (default: all but ab, vtests, multi and stream).  `decode` is the step kernel's tests and memcheck.  `multi` is one kdad per GPU: test_shard_cuda and
#   scripts/dev/multi-gpu-check.sh (two GPUs on nvidia-h200-x2; on one GPU both daemons share it).  `launch` is bench_launch: what starting a batch costs; `ipc`
#   is bench_ipc: the kernel on CUDA IPC memory against local memory, by allocation size and
#   tensor placement.  `bench` and the full `e2e` together take more than 600 s when kdactl
#   bench draws all its inputs (~7 s per e2e row; it draws 4 MiB now).  The daemon suites find kdad under the build directory
#   they were compiled for, so `daemon` recreates that path.  `ab` runs bench_kernel
#   and every .device/bin/bench_kernel_* (scripts/dev/kernel-variant.sh) twice,
#   interleaved, on the six standard workloads; `vtests` runs every variant's
#   .device/bin/test_cuda_kernel_*.  `stream` runs the stream-ordered prefills' GPU suite
#   (test_daemon_stream_cuda) and bench_layers (the 20-layer loop: in process, kdad synchronised,
#   kdad stream-ordered with and without the device-side wait, a bare second process as the
#   floor, each with its semaphore words in host memory, the done word in device memory, or
#   both in device memory; h200-layers.json).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/kdad-gpu}
mkdir -p "$out" /tmp/debs
for f in .device/debs/*.deb; do dpkg -x "$f" /tmp/debs; done
export LD_LIBRARY_PATH=$PWD/.device/bin:/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KDAD_GOLDEN_DIR=$PWD/.device/golden
export KDA_TEST_SEED=${KDA_TEST_SEED:-$(date +%s)}
steps=${*:-layout kernel decode sanitize bench launch ipc profile daemon e2e}
bin=.device/bin
declare -A status

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$out/gpu.txt"
for step in $steps; do
  case $step in
    layout)   timeout 60 $bin/test_wgmma_layout > "$out/layout.log" 2>&1 ;;
    kernel)   timeout 300 $bin/test_cuda_kernel > "$out/kernel.log" 2>&1 ;;
    decode)   timeout 200 $bin/test_cuda_decode > "$out/decode.log" 2>&1; rc=$?
              KDA_GPU_TEST_QUICK=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
                $bin/test_cuda_decode > "$out/decode-memcheck.log" 2>&1; (exit $((rc | $?))) ;;
    sanitize) KDA_GPU_TEST_QUICK=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
                $bin/test_cuda_kernel > "$out/memcheck.log" 2>&1; rc=$?
              KDA_GPU_TEST_QUICK=1 timeout 240 compute-sanitizer --tool racecheck --error-exitcode 9 \
                $bin/test_cuda_kernel > "$out/racecheck.log" 2>&1; (exit $((rc | $?))) ;;
    bench)    # the clocks under load, for the host variance in bench/RESULTS.md
              (sleep 8; nvidia-smi -q -d CLOCK,PERFORMANCE > "$out/clocks.log" 2>&1) &
              timeout 400 $bin/bench_kernel --json "$out/h200-kernel.json" > "$out/bench.log" 2>&1
              rc=$?; wait; (exit $rc) ;;
    launch)   timeout 60 $bin/bench_launch > "$out/launch.log" 2>&1 ;;
    ipc)      timeout 120 $bin/bench_ipc > "$out/ipc.log" 2>&1 ;;
    profile)  timeout 300 $bin/bench_kernel_profile --reps 3 > "$out/profile.log" 2>&1 ;;
    daemon)   built=$(strings $bin/test_daemon_cuda | grep -m1 -E '^/.*build[^/]*$')
              mkdir -p "$built/daemon" "$built/client" && cp $bin/kdad "$built/daemon/" && cp $bin/kdactl "$built/client/"
              rc=0
              for t in test_daemon_cuda test_daemon_shm_cuda test_daemon_ring_cuda test_daemon_cuda_ipc; do
                timeout 300 $bin/$t >> "$out/daemon.log" 2>&1 || rc=1
              done
              (exit $rc) ;;
    e2e)      OUT=$out timeout 560 bash scripts/dev/e2e-bench.sh $bin > "$out/e2e.log" 2>&1 ;;
    multi)    # one kdad per GPU: the sharded client on cuda, then one daemon against two
              built=$(strings $bin/test_shard_cuda | grep -m1 -E '^/.*build[^/]*$')
              mkdir -p "$built/daemon" "$built/client" && cp $bin/kdad "$built/daemon/" && cp $bin/kdactl "$built/client/"
              KDAD_SOURCE_DIR=$PWD timeout 300 $bin/test_shard_cuda > "$out/multi.log" 2>&1; rc=$?
              OUT=$out timeout 280 bash scripts/dev/multi-gpu-check.sh $bin >> "$out/multi.log" 2>&1
              (exit $((rc | $?))) ;;
    vtests)   rc=0
              for t in $bin/test_cuda_kernel_*; do
                [ -x "$t" ] || continue
                echo "== $(basename "$t")" >> "$out/vtests.log"
                timeout 200 "$t" >> "$out/vtests.log" 2>&1 || rc=1
              done
              (exit $rc) ;;
    stream)   built=$(strings $bin/test_daemon_stream_cuda | grep -m1 -E '^/.*build[^/]*$')
              mkdir -p "$built/daemon" && cp $bin/kdad "$built/daemon/"
              timeout 300 $bin/test_daemon_stream_cuda > "$out/stream.log" 2>&1; rc=$?
              timeout 280 $bin/bench_layers --kdad $bin/kdad --json "$out/h200-layers.json" \
                > "$out/layers.log" 2>&1 || rc=1
              (exit $rc) ;;
    ab)       rc=0
              for round in 1 2; do
                for b in $bin/bench_kernel $bin/bench_kernel_*; do
                  [ -x "$b" ] && [ "$b" != $bin/bench_kernel_profile ] || continue
                  echo "== $(basename "$b") (round $round)" >> "$out/ab.log"
                  timeout 120 "$b" >> "$out/ab.log" 2>&1 || rc=1
                done
              done
              (exit $rc) ;;
    *)        echo "unknown step $step"; continue ;;
  esac
  status[$step]=$?
done

echo "== seed $KDA_TEST_SEED"
for step in $steps; do
  case $step in
    layout)   cat "$out/layout.log" ;;
    kernel)   grep -E '^\s+\S.*(out|state)|FAILED|PASSED|SKIP|error' "$out/kernel.log" | tail -40 ;;
    decode)   grep -E '^\s+\S.*(out|state)|FAILED|PASSED|SKIP|error' "$out/decode.log" | tail -30
              grep -h 'ERROR SUMMARY' "$out/decode-memcheck.log" ;;
    sanitize) grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY|Error|hazard' "$out/memcheck.log" "$out/racecheck.log" 2>/dev/null | sort | uniq -c | head ;;
    bench)    tail -36 "$out/bench.log"
              grep -m3 -E 'Performance State|^\s+SM\s+:' "$out/clocks.log" | sed 's/^ */under load: /' ;;
    launch)   cat "$out/launch.log" ;;
    ipc)      cat "$out/ipc.log" ;;
    profile)  grep '^profile' "$out/profile.log" | sed 's/cycles per chunk://' ;;
    daemon)   grep -E 'PASSED|FAILED|SKIP|tests? run' "$out/daemon.log" | tail -12 ;;
    e2e)      tail -5 "$out/e2e.log"; cut -c1-300 "$out/e2e.jsonl" | head -30 ;;
    ab)       grep -E '^== |^H(96|64) (fixed 8192|mixed|uniform 8x1024) ' "$out/ab.log" | cut -c1-62 ;;
    vtests)   grep -E '^== |^-- |FAILED|PASSED|clusters' "$out/vtests.log" | head -40 ;;
    multi)    grep -E 'GPU\(s\)|PASSED|FAILED|ERROR|^aggregate' "$out/multi.log" | tail -12 ;;
    stream)   grep -E 'PASSED|FAILED|SKIP|median|done word|READY_TIMEOUT|tests? run' "$out/stream.log" | tail -12
              tail -24 "$out/layers.log" ;;
  esac
  echo "== $step: exit ${status[$step]}"
done

# Few files travel back: the logs go as one archive, beside the
# results (h200-kernel.json, e2e.jsonl, e2e-summary.txt); one archive per $OUT, so give each
# run of this script in one call its own (OUT=$OUT/name).
logs=$(cd "$out" && ls -- *.log *.err gpu.txt 2>/dev/null)
if [ -n "$logs" ]; then
  (cd "$out" && tar czf logs.tar.gz $logs && rm -f $logs)
fi
