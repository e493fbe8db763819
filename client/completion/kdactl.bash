# bash completion for kdactl (installed as bash-completion/completions/kdactl)

_kdactl()
{
    local cur prev words cword
    _init_completion || return

    local globals="--socket --gpu --json --timeout --retries --retry-delay --no-retry --help --version"
    local commands="hello ping health stats layer slot prefill bench step help"

    case $prev in
        --socket|-s|--input|-i|--output|-o|--weights|-w)
            _filedir
            return ;;
        --timeout|-t|--retries|--retry-delay|--count|-n|--spin|-P|--tokens|-T|--heads|-H|\
        --seqs|-N|--seed|-S|--clients|-c|--depth|-d|--requests|--duration|-D|--warmup|-W|\
        --lengths|-L|--align|-A|--lower-bound|--scale|--dst)
            return ;;
        --dtype)
            COMPREPLY=($(compgen -W "f32 bf16 fp32 float32 bfloat16" -- "$cur"))
            return ;;
        --dist|-l)
            COMPREPLY=($(compgen -W "fixed uniform mixed" -- "$cur"))
            return ;;
        --transport|-x)
            COMPREPLY=($(compgen -W "inline shm auto cuda-ipc cuda-vmm" -- "$cur"))
            return ;;
    esac

    # the command: the first word that is not an option or an option's value
    local i cmd="" action=""
    for ((i = 1; i < cword; i++)); do
        case ${words[i]} in
            --socket|-s|--gpu|-g|--timeout|-t|--retries|--retry-delay) ((i++)) ;;
            -*) ;;
            *) if [[ -z $cmd ]]; then cmd=${words[i]}; elif [[ -z $action ]]; then action=${words[i]}; fi ;;
        esac
    done

    local opts=""
    case $cmd in
        "") COMPREPLY=($(compgen -W "$commands $globals" -- "$cur")); return ;;
        help) COMPREPLY=($(compgen -W "$commands" -- "$cur")); return ;;
        ping) opts="--count --spin --ring" ;;
        stats) opts="--prometheus" ;;
        layer)
            [[ -z $action ]] && { COMPREPLY=($(compgen -W "list register drop" -- "$cur")); return; }
            opts="--weights --lower-bound --scale" ;;
        slot)
            [[ -z $action ]] && { COMPREPLY=($(compgen -W "alloc free reset fork save load info" -- "$cur")); return; }
            opts="--count --empty --dst --output --input --dtype" ;;
        prefill) opts="--input --output --random --tokens --heads --seqs --seed --transport --check" ;;
        bench) opts="--clients --depth --requests --duration --tokens --dist --seqs --lengths --transport --warmup --seed --spin --ring --align --decode --steps" ;;
        step) opts="--input --random --seqs --tokens --seed --repeat" ;;
    esac
    COMPREPLY=($(compgen -W "$opts $globals" -- "$cur"))
}
complete -F _kdactl kdactl
