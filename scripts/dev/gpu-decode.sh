#!/usr/bin/env bash
# Decode steps on a GPU host, end to end: kdad's step suite on the cuda
# backend, then `kdactl bench --decode` over CUDA IPC memory for the standard
# rows (fp32 pool), each next to the daemon's own kernel time and the
# state-bytes floor (read and write every state once at 4.27 TB/s), and the
# daemon's batch phases (p50) of that row's steps.  Each row runs twice: over
# the socket with a sleeping client, and over a frame ring with a polling
# client (--ring --spin 2000).  With a kdad-base next to kdad (the bundle
# copies $KDAD_BASE there), both builds run the rows, interleaved,
# $ROUNDS times (default 2).
#
#   scripts/dev/gpu-decode.sh bundle   (on the build machine) builds build-gpu's kdad,
#                                  kdactl and test_daemon_step_cuda into $DECODE_DIR
#                                  (default .device/decode), with this script
#   scripts/dev/gpu-decode.sh          (on the GPU host, from the repository root) runs them;
#                                  logs and decode.jsonl under $OUT, tables last
set -uo pipefail
cd "$(dirname "$0")/../.."
dir=${DECODE_DIR:-.device/decode}
if [ "${1:-}" = bundle ]; then
  set -e
  shared=${KDAD_SHARED:-$PWD/../shared}
  mkdir -p "$dir/debs" "$dir/bin"
  cp "$shared"/device-debs/*.deb "$dir/debs/"
  ls "$dir"/debs/libjson-c5_*.deb >/dev/null 2>&1 || (cd "$dir/debs" && apt-get download -q libjson-c5)
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build-gpu -j"$(nproc)" --target kdad kdactl test_daemon_step_cuda
  cp build-gpu/daemon/kdad build-gpu/client/kdactl build-gpu/tests/test_daemon_step_cuda "$dir/bin/"
  cp -L build-gpu/client/libkdaclient.so.0 "$dir/bin/"
  [ -z "${KDAD_BASE:-}" ] || cp "$KDAD_BASE" "$dir/bin/kdad-base"
  cp scripts/dev/gpu-decode.sh "$dir/"
  for f in "$dir"/bin/*; do
    [ "$(basename "$f")" = libkdaclient.so.0 ] || strip --strip-debug "$f"
  done
  du -sh "$dir"
  exit 0
fi

out=${OUT:-/tmp/kdad-decode}
mkdir -p "$out" /tmp/debs
for f in "$dir"/debs/*.deb; do dpkg -x "$f" /tmp/debs; done
export LD_LIBRARY_PATH=$PWD/$dir/bin:/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$dir/bin
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"

# The suite finds kdad under the build directory it was compiled for.
built=$(strings $bin/test_daemon_step_cuda | grep -m1 -E '^/.*build[^/]*$')
mkdir -p "$built/daemon" && cp $bin/kdad "$built/daemon/"
timeout 300 $bin/test_daemon_step_cuda > "$out/test_daemon_step_cuda.log" 2>&1
suite=$?

cfg=$out/decode.yaml
printf 'backend: cuda\nslots: 512\nstate_dtype: f32\nlog:\n  level: notice\n' > "$cfg"
: > "$out/decode.jsonl"
start_kdad() {   # start_kdad KDAD HEADS
  sock=$(mktemp -u /tmp/kdad-decode-XXXXXX.sock)
  $bin/$1 --config "$cfg" --heads "$2" --socket "$sock" >>"$out/kdad.log" 2>&1 &
  kdad_pid=$!
  for _ in $(seq 1 600); do
    $bin/kdactl --socket "$sock" ping >/dev/null 2>&1 && return 0
    kill -0 "$kdad_pid" 2>/dev/null || { echo "kdad failed to start"; tail -20 "$out/kdad.log"; return 1; }
    sleep 0.1
  done
  return 1
}
stop_kdad() { kill -TERM "$kdad_pid"; wait "$kdad_pid"; }
field() { grep -o "\"$2\": *[0-9.e+-]*" <<<"$1" | head -1 | sed 's/.*: *//'; }
phase() { grep -o "\"$2\": *{ *\"p50\": *[0-9]*" <<<"$1" | head -1 | grep -o '[0-9]*$'; }

builds=kdad; [ -x $bin/kdad-base ] && builds="kdad kdad-base"
printf '%-16s %-10s %-7s %10s %10s %10s %10s %10s %9s\n' row build client kernel_ms e2e_p50_ms \
  e2e_p99_ms around_us floor_ms e2e/floor > "$out/table.txt"
printf '%-16s %-10s %-7s %6s %6s %6s %6s %6s %6s %6s %7s %7s\n' row build client form stage \
  launch wait notice unstage reply kernel device > "$out/phases.txt"
for round in $(seq 1 "${ROUNDS:-2}"); do
 for heads in 32 96; do
  for build in $builds; do
   start_kdad $build $heads || continue
   for spec in 256x1 64x1 256x4; do
    n=${spec%x*}; t=${spec#*x}
    [ $heads = 96 ] && [ $spec != 256x1 ] && continue
    for client in socket ring; do
      args=""; [ $client = ring ] && args="--ring --spin 2000"
      json=$(timeout 120 $bin/kdactl --socket "$sock" --json bench --decode --seqs $n --tokens $t \
             --steps 2000 --warmup 50 --transport cuda-ipc $args 2>>"$out/kdactl.err" | tr -d '\n')
      stats=$($bin/kdactl --socket "$sock" --json stats 2>>"$out/kdactl.err" | tr -d '\n')
      echo "{\"row\": \"H$heads decode $spec\", \"build\": \"$build\", \"client\": \"$client\", \"round\": $round, \"bench\": ${json:-null}, \"stats\": ${stats:-null}}" >> "$out/decode.jsonl"
      k=$(field "$json" kernel_p50_us); p50=$(field "$json" step_p50_us); p99=$(field "$json" step_p99_us)
      around=$(field "$json" around_kernel_p50_us)
      # read + write each state once: n x H x 64 KiB x 2 at 4.27 TB/s
      floor=$(awk -v n=$n -v h=$heads 'BEGIN{printf "%.3f", n*h*65536*2/4.27e12*1e3}')
      awk -v r="H$heads $spec" -v b=$build -v c=$client -v k="${k:-0}" -v p="${p50:-0}" -v q="${p99:-0}" \
          -v a="${around:-0}" -v f=$floor \
        'BEGIN{printf "%-16s %-10s %-7s %10.3f %10.3f %10.3f %10.1f %10.3f %9.2f\n", r, b, c, k/1e3, p/1e3, q/1e3, a, f, (f>0?p/1e3/f:0)}' \
        >> "$out/table.txt"
      line=$(printf '%-16s %-10s %-7s' "H$heads $spec" $build $client)
      for ph in form stage launch wait notice unstage reply; do line+=$(printf ' %6s' "$(phase "$stats" $ph)"); done
      for ph in kernel device; do line+=$(printf ' %7s' "$(phase "$stats" $ph)"); done
      echo "$line" >> "$out/phases.txt"
    done
   done
   stop_kdad
  done
 done
done
echo "test_daemon_step_cuda: exit $suite (log: test_daemon_step_cuda.log)"
tail -12 "$out/test_daemon_step_cuda.log"
echo "batch phases p50 (us), the last 1024 steps of each row:"
cat "$out/phases.txt"
cat "$out/table.txt"
