#!/usr/bin/env bash
# Quickstart on a fresh Debian 12 machine: install the build dependencies,
# build what `cmake --install build` installs (kdad, kdactl, libkdaclient; the
# tests are scripts/test.sh's), start kdad with its built-in configuration
# (backend auto: the GPU when there is a usable one, else the CPU) on a
# temporary socket with H = 8 heads, run one random KDA prefill of 2048 tokens
# through it, and stop it (SIGTERM drains and exits 0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target kdad kdactl kdaclient kdaclient_static

dir=$(mktemp -d /tmp/kdad-quickstart-XXXXXX)
sock=$dir/kdad.sock
kdactl() { ./build/client/kdactl --socket "$sock" "$@"; }

echo "quickstart: starting kdad on $sock (built-in configuration, --heads 8)"
./build/daemon/kdad --socket "$sock" --heads 8 >"$dir/kdad.log" 2>&1 &
pid=$!
stop() {
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    wait "$pid" || true
  fi
  rm -rf "$dir"
}
trap stop EXIT

# kdad answers once its backend is up (a CUDA context takes a moment).
for _ in $(seq 1 300); do
  kdactl ping >/dev/null 2>&1 && break
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "quickstart: kdad exited during start-up; its log:" >&2
    cat "$dir/kdad.log" >&2
    exit 1
  fi
  sleep 0.1
done

kdactl hello
echo
kdactl prefill --random --tokens 2048 --heads 8
echo

kill -TERM "$pid"
status=0
wait "$pid" || status=$?
echo "quickstart: kdad drained and exited with status $status; its log:"
sed 's/^/  /' "$dir/kdad.log"
exit "$status"
