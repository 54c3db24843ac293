#!/usr/bin/env bash
# Ask which model, how many ranks, which demo (text, or about an image) and which port, then launch that demo under
# torchrun.
#
#   demos/start.sh                     answer the questions (Enter takes the [default])
#   demos/start.sh --print             answer them, print the command, run nothing
#   demos/start.sh -- --max_seq_len 2048 --temperature 0.7    extra flags for the demo (see docs/demos.md)
#
# PYTHON picks the interpreter (default: the repository's .venv, set up by `make setup`, else python3).
set -euo pipefail
# Not cd: a relative checkpoint folder is answered from the caller's folder.
repo=$(cd "$(dirname "$0")/.." && pwd)

print_only=false
if [[ "${1:-}" == "--print" ]]; then print_only=true; shift; fi
if [[ "${1:-}" == "--" ]]; then shift; fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi

# ask QUESTION DEFAULT: the answer, or DEFAULT on an empty line. The question goes to stderr, so that
# `--print` leaves only the command on stdout. End of input (a closed pipe) takes the default too.
ask() {
    local answer=""
    printf '%s [%s]: ' "$1" "$2" >&2
    read -r answer || true
    echo "${answer:-$2}"
}

fail() { echo "start.sh: $*" >&2; exit 2; }

checkpoint=$(ask "Checkpoint folder (empty: the built-in SmolLM2-135M-Instruct)" "")
if [[ -n "$checkpoint" && ! -d "$checkpoint" ]]; then fail "no such checkpoint folder: $checkpoint"; fi

ranks=$(ask "Model-parallel ranks (one process each; the built-in model runs at 1, 2, 3, 6 or 9)" "1")
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || fail "ranks must be a positive integer, got '$ranks'"

demo=$(ask "single or multi turn (single: each question alone; multi: a conversation; single_mm, multi_mm: the same about an uploaded image)" "multi")
case "$demo" in
    single | single_turn) script=$repo/demos/single_turn.py ;;
    multi | multi_turn) script=$repo/demos/multi_turn.py ;;
    single_mm | single_turn_mm) script=$repo/demos/single_turn_mm.py ;;
    multi_mm | multi_turn_mm) script=$repo/demos/multi_turn_mm.py ;;
    *) fail "answer single, multi, single_mm or multi_mm, got '$demo'" ;;
esac
if [[ "$script" == *_mm.py && -z "$checkpoint" ]]; then
    fail "the image demos need a vision-language checkpoint folder (llama_type 'llava'); the built-in model reads text only"
fi

port=$(ask "Port for the page" "7860")
[[ "$port" =~ ^[1-9][0-9]*$ && "$port" -le 65535 ]] || fail "port must be 1-65535, got '$port'"

command=("$PYTHON" -m torch.distributed.run --standalone "--nproc-per-node=$ranks" "$script" --port "$port")
if [[ -n "$checkpoint" ]]; then command+=(--pretrained_path "$checkpoint"); fi
command+=("$@")

if $print_only; then
    printf '%q ' "${command[@]}"
    echo
    exit 0
fi
echo "+ ${command[*]}" >&2
echo "open http://127.0.0.1:$port once the model has loaded; Ctrl-C stops every rank" >&2
exec "${command[@]}"
