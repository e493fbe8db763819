#!/usr/bin/env bash
# service_install.sh MODE BUILD_DIR SOURCE_DIR - kdad installed as a system service.
#
#   layout  `cmake --install --prefix /usr` into a DESTDIR: every file where an operator and
#           systemd expect it, the units (kdad.service and the kdad@.service template)
#           configured for that prefix, the installed kdad accepting the installed
#           configuration, and a reinstall that keeps an edited /etc/kdad/kdad.yaml.
#           Another prefix configures the units for itself.
#   units   the installed units through systemd's own tools, offline: systemd-analyze
#           verify of kdad.service and of the template's instances kdad@0 and
#           kdad@GPU-<uuid> with their sockets (any warning fails; man: links checked when
#           man(1) is present, the man pages linted when groff is), systemd-analyze security
#           (exposure at most 2.0, each), the template's settings equal to the plain unit's
#           but for the instance's own, systemd-sysusers and systemd-tmpfiles applied to
#           the DESTDIR as a root.
#           Exits 77 (skipped) and says so when these tools are not installed.
set -euo pipefail
mode=$1 build=$(realpath "$2") src=$(realpath "$3")
fail() { echo "service_install $mode: $*" >&2; exit 1; }
root=$(mktemp -d /tmp/kdad-service-XXXXXX)
trap 'rm -rf "$root"' EXIT

install_into() {  # install_into DESTDIR PREFIX
  DESTDIR=$1 cmake --install "$build" --prefix "$2" >"$root/install.log" 2>&1 ||
    { cat "$root/install.log" >&2; fail "cmake --install --prefix $2 failed"; }
}
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
under() { case $1 in /*) echo "$1" ;; *) echo "/usr/$1" ;; esac; }  # a cache dir, prefix /usr

dest=$root/dest
install_into "$dest" /usr
unitdir=$dest$(under "$(cache KDAD_SYSTEMD_UNITDIR)")
sysusersdir=$dest$(under "$(cache KDAD_SYSUSERSDIR)")
tmpfilesdir=$dest$(under "$(cache KDAD_TMPFILESDIR)")

case $mode in
layout)
  for f in usr/sbin/kdad usr/bin/kdactl; do
    [ -x "$dest/$f" ] || fail "$f is not installed (executable)"
  done
  [ ! -e "$dest/usr/bin/kdad" ] || fail "kdad belongs in sbin, not bin"
  for f in usr/include/kdaclient.h etc/kdad/kdad.yaml usr/share/man/man8/kdad.8 \
           usr/share/man/man1/kdactl.1 usr/share/doc/kdad/daemon.md \
           usr/share/doc/kdad/client.md usr/share/doc/kdad/kda.md usr/share/doc/kdad/PROTOCOL.md \
           usr/share/doc/kdad/kdad.yaml usr/share/bash-completion/completions/kdactl \
           usr/share/zsh/vendor-completions/_kdactl; do
    [ -f "$dest/$f" ] || fail "$f is not installed"
  done
  pc=$(find "$dest/usr" -name kdaclient.pc)
  [ -n "$pc" ] || fail "kdaclient.pc is not installed"
  [ -n "$(find "$dest/usr" -name libkdaclient.so.0)" ] || fail "libkdaclient.so.0 is not installed"
  PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --exists kdaclient || fail "kdaclient.pc is unusable"
  for f in "$unitdir/kdad.service" "$unitdir/kdad.socket" "$unitdir/kdad@.service" \
           "$unitdir/kdad@.socket" "$sysusersdir/kdad.conf" "$tmpfilesdir/kdad.conf"; do
    [ -f "$f" ] || fail "${f#"$dest"} is not installed"
  done
  cmp -s "$dest/etc/kdad/kdad.yaml" "$src/config/kdad.yaml" ||
    fail "/etc/kdad/kdad.yaml is not the documented default"
  for f in kdad.socket kdad@.socket; do
    cmp -s "$unitdir/$f" "$src/systemd/$f" || fail "$f differs from the source"
  done
  cmp -s "$sysusersdir/kdad.conf" "$src/systemd/kdad.sysusers" || fail "sysusers.d/kdad.conf"
  cmp -s "$tmpfilesdir/kdad.conf" "$src/systemd/kdad.tmpfiles" || fail "tmpfiles.d/kdad.conf"

  unit=$unitdir/kdad.service
  grep -qx 'ExecStart=/usr/sbin/kdad --config /etc/kdad/kdad.yaml' "$unit" ||
    fail "ExecStart of the unit: $(grep ExecStart= "$unit")"
  ! grep -q '@[A-Z_]*@' "$unit" || fail "unsubstituted variables in kdad.service"
  grep -qx 'ListenStream=/run/kdad/kdad.sock' "$unitdir/kdad.socket" || fail "socket path"
  # The template: GPU %i on its own socket, the shared configuration unless the instance's
  # environment file names another, and that file's flags.
  tunit=$unitdir/kdad@.service
  grep -qx 'ExecStart=/usr/sbin/kdad --config ${KDAD_CONFIG} --backend cuda --device %i $KDAD_ARGS' \
    "$tunit" || fail "ExecStart of the template: $(grep ExecStart= "$tunit")"
  grep -qx 'Environment=KDAD_CONFIG=/etc/kdad/kdad.yaml' "$tunit" || fail "template: KDAD_CONFIG"
  grep -qx 'EnvironmentFile=-/etc/kdad/kdad-%i.env' "$tunit" || fail "template: EnvironmentFile"
  grep -qx 'Requires=kdad@%i.socket' "$tunit" || fail "template: its socket"
  ! grep -q '@[A-Z_]*@' "$tunit" || fail "unsubstituted variables in kdad@.service"
  grep -qx 'ListenStream=/run/kdad/kdad-%i.sock' "$unitdir/kdad@.socket" || fail "template socket"
  out=$("$dest/usr/sbin/kdad" --check-config "$dest/etc/kdad/kdad.yaml" 2>&1) ||
    fail "the installed kdad refuses the installed configuration: $out"

  # A reinstall keeps the operator's configuration and updates everything else.
  sed -i 's/^  level: info$/  level: debug  # edited by the operator/' "$dest/etc/kdad/kdad.yaml"
  grep -q 'edited by the operator' "$dest/etc/kdad/kdad.yaml" || fail "could not edit the config"
  cp "$dest/etc/kdad/kdad.yaml" "$root/edited.yaml"
  echo "# stale" >>"$unitdir/kdad.socket"
  install_into "$dest" /usr
  cmp -s "$dest/etc/kdad/kdad.yaml" "$root/edited.yaml" ||
    fail "reinstalling overwrote /etc/kdad/kdad.yaml"
  grep -q "Keeping: $dest/etc/kdad/kdad.yaml" "$root/install.log" ||
    fail "the reinstall did not say it kept the configuration"
  cmp -s "$unitdir/kdad.socket" "$src/systemd/kdad.socket" || fail "reinstall left a stale unit"
  out=$("$dest/usr/sbin/kdad" --check-config "$dest/etc/kdad/kdad.yaml" 2>&1) ||
    fail "the edited configuration: $out"

  # Another prefix: binaries and configuration under it, the unit pointing there.
  other=$root/other
  install_into "$other" /opt/kdad
  [ -x "$other/opt/kdad/sbin/kdad" ] || fail "prefix /opt/kdad: no sbin/kdad"
  [ -f "$other/etc/opt/kdad/kdad/kdad.yaml" ] || fail "prefix /opt/kdad: no /etc/opt/kdad config"
  ounit=$(find "$other" -name kdad.service)
  grep -qx 'ExecStart=/opt/kdad/sbin/kdad --config /etc/opt/kdad/kdad/kdad.yaml' "$ounit" ||
    fail "prefix /opt/kdad: $(grep ExecStart= "$ounit")"
  ounit=$(find "$other" -name 'kdad@.service')
  grep -q '^ExecStart=/opt/kdad/sbin/kdad ' "$ounit" &&
    grep -qx 'Environment=KDAD_CONFIG=/etc/opt/kdad/kdad/kdad.yaml' "$ounit" &&
    grep -qx 'EnvironmentFile=-/etc/opt/kdad/kdad/kdad-%i.env' "$ounit" ||
    fail "prefix /opt/kdad: the template: $(grep -E '^(ExecStart|Environment)' "$ounit")"
  echo "service_install layout: ok"
  ;;
units)
  for tool in systemd-analyze systemd-sysusers systemd-tmpfiles; do
    command -v "$tool" >/dev/null ||
      { echo "skipped: $tool is not installed (Debian package systemd)"; exit 77; }
  done
  # verify resolves ExecStart= on this machine: point it at the DESTDIR's kdad.  The man:
  # links are checked when man(1) is present (MANPATH: the DESTDIR's pages).
  check=$root/check
  mkdir "$check"
  # The template is verified through instances (an ordinal, a UUID), as systemd loads it.
  for unit in kdad.service kdad@.service; do
    sed "s|^ExecStart=/usr/sbin/kdad |ExecStart=$dest/usr/sbin/kdad |" "$unitdir/$unit" \
      >"$check/$unit"
  done
  cp "$unitdir/kdad.socket" "$unitdir/kdad@.socket" "$check/"
  man=no
  if command -v man >/dev/null; then man=yes; else echo "note: man(1) absent, man: links unchecked"; fi
  uuid=GPU-5a1c0e1e-0000-1111-2222-333344445555
  for pair in "kdad.service kdad.socket" "kdad@0.service kdad@0.socket" \
              "kdad@$uuid.service kdad@$uuid.socket"; do
    set -- $pair
    if ! out=$(MANPATH=$dest/usr/share/man systemd-analyze verify --man=$man \
                 "$check/$1" "$check/$2" 2>&1) || [ -n "$out" ]; then
      fail "systemd-analyze verify $1: $out"
    fi
  done
  # No drift: the template's settings are the plain unit's, but for the instance's own.
  settings() {  # the unit's settings, comments and the instance's own lines left out
    grep -v -e '^#' -e '^$' -e '^Description=' -e '^Requires=' -e '^Also=' -e '^ExecStart=' \
      -e '^Environment' -e '^After=kdad' "$1"
  }
  diff <(settings "$check/kdad.service") <(settings "$check/kdad@.service") >"$root/drift" ||
    fail "kdad@.service and kdad.service differ beyond the instance: $(cat "$root/drift")"
  diff <(grep -v -e '^#' -e '^Description=' -e '^ListenStream=' "$check/kdad.socket") \
       <(grep -v -e '^#' -e '^Description=' -e '^ListenStream=' "$check/kdad@.socket") \
       >"$root/drift" || fail "kdad@.socket and kdad.socket differ: $(cat "$root/drift")"
  # The man pages the units point to: no groff warning (when groff is there to ask).
  if command -v groff >/dev/null; then
    for page in man8/kdad.8 man1/kdactl.1; do
      out=$(groff -man -ww -z "$dest/usr/share/man/$page" 2>&1)
      [ -z "$out" ] || fail "groff warns about $page: $out"
    done
  else
    echo "note: groff absent, man pages not linted"
  fi
  for unit in kdad.service kdad@0.service; do
    if ! out=$(systemd-analyze security --offline=true --threshold=20 "$check/$unit" 2>&1); then
      fail "systemd-analyze security $unit: exposure above 2.0: $(echo "$out" | tail -1)"
    fi
    echo "$out" | tail -1
  done

  # sysusers.d and tmpfiles.d applied to the DESTDIR as if it were the root file system.
  systemd-sysusers --root="$dest" >/dev/null 2>&1 || fail "systemd-sysusers --root failed"
  grep -q '^kdad:x:[0-9]*:[0-9]*:.*:/var/lib/kdad:' "$dest/etc/passwd" || fail "no user kdad"
  grep -q '^kdad-clients:x:' "$dest/etc/group" || fail "no group kdad-clients"
  grep -q '^kdad:x:' "$dest/etc/group" || fail "no group kdad"
  uid=$(awk -F: '$1 == "kdad" {print $3}' "$dest/etc/passwd")
  systemd-tmpfiles --root="$dest" --create >/dev/null 2>&1 || fail "systemd-tmpfiles --root failed"
  [ "$(stat -c '%u %a' "$dest/run/kdad")" = "$uid 755" ] ||
    fail "/run/kdad: $(stat -c '%u %a' "$dest/run/kdad"), expected $uid 755"
  [ "$(stat -c '%u %a' "$dest/var/lib/kdad")" = "$uid 750" ] || fail "/var/lib/kdad"
  echo "service_install units: ok"
  ;;
*) fail "unknown mode (layout or units)" ;;
esac
