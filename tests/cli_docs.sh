#!/usr/bin/env bash
# cli_docs.sh BUILD_DIR SOURCE_DIR - the man pages and the shell completions keep up with the
# programs: every long option that `kdad --help`, `kdactl --help` and `kdactl COMMAND --help`
# print is in kdad.8 / kdactl.1 and in both completion files, the man pages give examples,
# and the bash completion, loaded into bash, completes commands, actions and options.
set -euo pipefail
build=$1 src=$2
kdad=$build/daemon/kdad kdactl=$build/client/kdactl
fail() { echo "cli_docs: $*" >&2; exit 1; }
options() { grep -oE -- '--[a-z][a-z0-9-]+' | sort -u; }
man_text() { sed 's/\\-/-/g' "$1"; }

kdad_man=$(man_text "$src/docs/man/kdad.8")
for o in $("$kdad" --help | options); do
  grep -qF -- "$o" <<<"$kdad_man" || fail "kdad.8 lacks $o (kdad --help has it)"
done
ctl_man=$(man_text "$src/docs/man/kdactl.1")
bash_c=$src/client/completion/kdactl.bash zsh_c=$src/client/completion/_kdactl
for cmd in "" hello ping health stats layer slot prefill bench step "bench --decode"; do
  for o in $("$kdactl" $cmd --help | options); do
    [ "$o" = --help ] && continue
    grep -qF -- "$o" <<<"$ctl_man" || fail "kdactl.1 lacks $o (kdactl $cmd --help has it)"
    grep -qF -- "$o" "$bash_c" || fail "the bash completion lacks $o (kdactl $cmd)"
    grep -qF -- "$o" "$zsh_c" || fail "the zsh completion lacks $o (kdactl $cmd)"
  done
done
for m in kdad.8 kdactl.1; do
  grep -q '^\.SH EXAMPLES' "$src/docs/man/$m" || fail "$m has no EXAMPLES section"
done

# The bash completion at work (bash-completion's helpers stubbed: only the words matter).
complete_words() {   # complete_words WORD... : the candidates for the last word
  bash -c '
    _init_completion() { cur=${COMP_WORDS[COMP_CWORD]}; prev=${COMP_WORDS[COMP_CWORD-1]};
                         words=("${COMP_WORDS[@]}"); cword=$COMP_CWORD; }
    _filedir() { :; }
    source "$0"
    COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1))
    _kdactl
    printf "%s\n" "${COMPREPLY[@]}"' "$bash_c" "$@"
}
want() {   # want CANDIDATE WORD...
  local c=$1; shift
  complete_words "$@" | grep -qx -- "$c" || fail "bash completion of '$*' lacks $c"
}
want stats kdactl sta
want alloc kdactl slot al
want register kdactl --json layer reg
want --check kdactl prefill --ch
want --json kdactl bench --js
want bfloat16 kdactl slot save 0x1 --dtype bf
want mixed kdactl bench --dist mi
echo "cli_docs: ok"
