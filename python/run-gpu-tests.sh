#!/usr/bin/env bash
# run-gpu-tests.sh KDAD [PYTHON] - on a host with an sm_90 GPU and PyTorch: the CUDA tests of
# kdaclient (kdaclient_tests.test_cuda), then examples/kimi_linear_stack.py with PyTorch
# projections on the GPU against a kdad on the cuda backend.  KDAD is a kdad built with CUDA;
# PYTHON (default python3) needs torch and numpy.  The module is the one beside this script
# (python3 setup.py build_ext --inplace, on any CPython >= 3.11: it is abi3).
set -euo pipefail
kdad=$(realpath "$1")
py=${2:-python3}
cd "$(dirname "$0")"
export KDAD_BIN=$kdad PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$py" -c 'import kdaclient, torch; print("kdaclient", kdaclient.__version__, "torch", torch.__version__, torch.cuda.get_device_name())'
status=0
"$py" -m unittest -v kdaclient_tests.test_cuda || status=1

dir=$(mktemp -d /tmp/kdaclient-gpu-XXXXXX)
"$kdad" --backend cuda --heads 32 --slots 256 --socket "$dir/kdad.sock" --log-level warning \
  >"$dir/kdad.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 600); do
  [ -S "$dir/kdad.sock" ] && break
  sleep 0.1
done
"$py" ../examples/kimi_linear_stack.py --socket "$dir/kdad.sock" --device cuda --d-model 512 \
  --layers 4 --prompts 512,300,100,17 --chunk 64 --steps 8 || status=1
exit $status
