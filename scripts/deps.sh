#!/usr/bin/env bash
# Installs the Debian 12 packages kdad builds against, if any is missing: with
# apt-get as root, through sudo otherwise; without either it lists what to install.
# The CUDA toolkit (nvcc) is optional: without it the CUDA backend is skipped.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libuv1-dev libmsgpack-dev libyaml-dev libjson-c-dev
      libcmocka-dev libsystemd-dev systemd
      python3-dev python3-setuptools python3-wheel python3-numpy python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "deps: all present"
  exit 0
fi
as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "deps: these Debian packages are missing: ${missing[*]}" >&2
    echo "deps: install them as root (there is no sudo here):" >&2
    echo "  apt-get update && apt-get install --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
  echo "deps: not root: installing through sudo"
  as_root=(sudo)
fi
echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "deps: all present"
