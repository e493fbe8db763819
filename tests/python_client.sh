#!/usr/bin/env bash
# python_client.sh BUILD_DIR SOURCE_DIR GOLDEN_DIR - installs the Python package the way
# docs/python.md says (a venv with the system's packages, pip install --no-build-isolation
# from a copy of the sources, so that parallel runs never share a build folder), then runs
# its tests and the serving-stack example against this build's kdad (CPU backend).
# KDAD_PYTHON picks the interpreter (default: Debian's /usr/bin/python3).
set -euo pipefail
build=$(realpath "$1") src=$(realpath "$2") golden=$3
py=${KDAD_PYTHON:-/usr/bin/python3}
[ -x "$py" ] || py=$(command -v python3)
missing=""
"$py" -c 'import venv, ensurepip' 2>/dev/null || missing+=" python3-venv"
"$py" -c 'import numpy' 2>/dev/null || missing+=" python3-numpy"
"$py" -c 'import setuptools' 2>/dev/null || missing+=" python3-setuptools"
"$py" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
  missing+=" python3-dev"
if [ -n "$missing" ]; then
  echo "skipped: $py lacks$missing (scripts/deps.sh installs them)"
  exit 77
fi
work=$(mktemp -d /tmp/kdaclient-py-XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
for d in python client proto examples; do cp -r "$src/$d" "$work/src/"; done
rm -rf "$work/src/python/build" "$work/src/python/"*.egg-info "$work/src/python/kdaclient/"*.so

"$py" -m venv --system-site-packages "$work/v"
"$work/v/bin/pip" install -q --no-build-isolation --no-index "$work/src/python"
cd "$work"   # not the sources: the installed package is the one imported
"$work/v/bin/python" -c 'import kdaclient, sys; print("kdaclient", kdaclient.__version__, kdaclient._kdaclient.__file__)'
export KDAD_BIN=$build/daemon/kdad KDAD_GOLDEN_DIR=$golden KDAD_EXAMPLES_DIR=$work/src/examples
"$work/v/bin/python" -m unittest -v kdaclient_tests.test_api kdaclient_tests.test_async \
  kdaclient_tests.test_errors kdaclient_tests.test_step kdaclient_tests.test_ordered \
  kdaclient_tests.test_golden kdaclient_tests.test_example kdaclient_tests.test_cuda
