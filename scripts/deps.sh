#!/usr/bin/env bash
# Installs the Debian 12 packages kdad builds against, if any is missing.
# The CUDA toolkit (nvcc) is optional: without it the CUDA backend is skipped.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libuv1-dev libmsgpack-dev libyaml-dev libjson-c-dev
      libcmocka-dev libsystemd-dev systemd
      python3-dev python3-setuptools python3-wheel python3-numpy python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "deps: all present"
