#!/usr/bin/env bash
# client_install.sh BUILD_DIR SOURCE_DIR SANITIZE - installs the build into a
# temporary prefix and uses libkdaclient the way a serving stack would: the
# header, the .so with its SONAME and only kdac_* exported, kdaclient.pc
# (relocatable) to compile and link the epoll example, and the CMake package
# to build the libuv example against the static library.
set -euo pipefail
build=$(realpath "$1") src=$(realpath "$2") sanitize=$3
if [ "$sanitize" = ON ]; then
  echo "skipped: an ASan build's libraries need -fsanitize, which kdaclient.pc does not carry"
  exit 77
fi
prefix=$(mktemp -d /tmp/kdac-install-XXXXXX)
trap 'rm -rf "$prefix"' EXIT
fail() { echo "client_install: $*" >&2; exit 1; }

cmake --install "$build/client" --prefix "$prefix" >/dev/null
libdir=$(dirname "$(find "$prefix" -name 'libkdaclient.so.0' | head -1)")
[ -n "$libdir" ] || fail "libkdaclient.so.0 was not installed"
for f in include/kdaclient.h bin/kdactl; do
  [ -e "$prefix/$f" ] || fail "$f was not installed"
done
[ -e "$libdir/libkdaclient.a" ] || fail "libkdaclient.a was not installed"
[ -e "$libdir/cmake/kdaclient/kdaclientConfig.cmake" ] || fail "no CMake package"
soname=$(objdump -p "$libdir/libkdaclient.so.0" | awk '/SONAME/ {print $2}')
[ "$soname" = libkdaclient.so.0 ] || fail "SONAME is '$soname'"
leaked=$(nm -D --defined-only "$libdir/libkdaclient.so.0" | awk '{print $3}' | grep -v '^kdac_' || true)
[ -z "$leaked" ] || fail "symbols exported beyond kdac_*: $leaked"

export PKG_CONFIG_PATH="$libdir/pkgconfig"
[ "$(pkg-config --modversion kdaclient)" = 0.1.0 ] || fail "pkg-config version"
[ "$(pkg-config --variable=prefix kdaclient | xargs realpath)" = "$(realpath "$prefix")" ] ||
  fail "kdaclient.pc does not find its prefix"
# shellcheck disable=SC2046
cc -std=c11 -D_GNU_SOURCE -Wall -Werror "$src/client/examples/prefill_epoll.c" \
  $(pkg-config --cflags --libs kdaclient) -Wl,-rpath,"$libdir" -o "$prefix/prefill_epoll"
# (grep reads whole outputs: with pipefail, an early exit of grep -q would fail the pipe)
deps=$(ldd "$prefix/prefill_epoll")
grep -q "libkdaclient.so.0 => $libdir" <<<"$deps" ||
  fail "the example does not load the installed library"
# With no daemon it must say so, not crash.
out=$(KDAD_SOCKET="$prefix/none.sock" "$prefix/prefill_epoll" 2>&1 || true)
echo "$out" | grep -q "daemon not running" || fail "example without a daemon said: $out"

mkdir "$prefix/app"
cat > "$prefix/app/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.25)
project(app C)
find_package(kdaclient 0.1 REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(UV REQUIRED IMPORTED_TARGET libuv)
add_executable(app "$src/client/examples/prefill_libuv.c")
target_link_libraries(app PRIVATE kdaclient::kdaclient_static PkgConfig::UV)
CMAKE
cmake -S "$prefix/app" -B "$prefix/app/build" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$prefix/app/build" >/dev/null
deps=$(ldd "$prefix/app/build/app")
if grep -q libkdaclient <<<"$deps"; then
  fail "the static build links libkdaclient.so"
fi
syms=$(nm "$prefix/app/build/app")
grep -qE ' [Tt] kdac_prefill_send$' <<<"$syms" || fail "the static build lacks kdac_prefill_send"
echo "client_install: ok ($prefix)"
