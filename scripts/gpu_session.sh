#!/usr/bin/env bash
# The GPU measurements of a session that is lent a GPU, as one script sized for one device call (docs/gpu.md):
#
#   bash scripts/gpu_session.sh OUT_DIR [--dry-run] [--budget SECONDS] [--steps NAME,NAME,...]
#
# The steps, most wanted first (a step that no longer fits the budget is skipped, and the closing lines say how
# to run the skipped ones in a second call):
#   gpucheck       gpt-1b at bf16_params, eager and compiled: tokens/s, MFU, peak memory against the estimate,
#                  its steps as `Trainer.fit` runs them
#   vs_plain_loop  gpt-1b: hybrid eager and whole-model compiled beside the compiled plain loop: the paired ratio
#                  of tokens/s, GPU busy share, launches and syncs per step
#   gpucheck_llama the same as gpucheck for llama-1b, eager
#   tp_chunk_cost  the chunked TP overlap's GEMMs in pieces beside whole on one GPU (its single-device cost)
#   diagnose       hybrid-diagnose --nccl: the host's real `nvidia-smi topo -m` classified, the NCCL advice for it
#   binding        a 3-step run through launch/local.sh with NUMA binding on a GPU host
#   cp_kernels     context parallelism's ring blocks (cp=1) beside SDPA, bf16, 8 K tokens
#   plan           hybrid-plan calibrated on the GPU: gpt-1b's predicted tokens/s beside gpucheck's measured ones
# --dry-run runs the same steps tiny on the CPU. --budget (default 540 s: one device call is at most 600 s) bounds
# the whole script; each step also has its own limit, so one that hangs cannot eat the others' time.
#
# Output: OUT_DIR/session.log (what ran, how long, what failed or was skipped) and OUT_DIR/session.tgz (every
# step's output and JSON figures), re-packed after each step so a call cut short still returns what finished —
# two files, inside the device tool's eight. Wheels the GPU machine lacks (it reaches no package index) travel in
# .whl/ (scripts/gpu_wheels.sh makes them) and are installed into a private folder when hybrid's imports fail.
# Exit status: 0 when every step ran and passed, 1 when one failed or was skipped, 2 on bad usage.
set -uo pipefail
cd "$(dirname "$0")/.."
ALL=(gpucheck vs_plain_loop gpucheck_llama tp_chunk_cost diagnose binding cp_kernels plan)
usage() { echo "gpu_session: $1 (usage: scripts/gpu_session.sh OUT_DIR [--dry-run] [--budget SECONDS]" \
    "[--steps $(IFS=,; echo "${ALL[*]}")])" >&2; exit 2; }
OUT=${1:-}
[[ -n "$OUT" && "$OUT" != --* ]] || usage "OUT_DIR first"
shift
DRY="" BUDGET=540 STEPS=("${ALL[@]}")
while (( $# )); do
    case "$1" in
        --dry-run) DRY=1 ;;
        --budget) [[ "${2:-}" =~ ^[0-9]+$ ]] || usage "--budget takes whole seconds"; BUDGET=$2; shift ;;
        --steps) IFS=, read -r -a STEPS <<< "${2:-}"; shift ;;
        *) usage "unknown argument '$1'" ;;
    esac
    shift
done
for s in "${STEPS[@]}"; do [[ " ${ALL[*]} " == *" $s "* ]] || usage "unknown step '$s'"; done
PY=${PYTHON:-python3}
MIN_S=${GPU_SESSION_MIN_S:-30}  # a step starts only with this much of the budget left (at least 1)
(( MIN_S >= 1 )) || MIN_S=1
PACK_S=5  # kept back from every step for packing the results
DEADLINE=$(( SECONDS + BUDGET ))
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
: > "$OUT/session.log"
log() { echo "== $*" | tee -a "$OUT/session.log"; }

export PYTHONPATH="${PYTHONPATH:-$PWD}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c "import hydra, omegaconf, datasets" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hybrid-site \
        .whl/*.whl >> "$OUT/session.log" 2>&1 && export PYTHONPATH="/tmp/hybrid-site:$PYTHONPATH"
fi
[[ -n "$DRY" ]] || "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" 2>&1 \
    | tee -a "$OUT/session.log"

command_of() {  # command_of NAME: sets LIMIT and CMD for the step, on the GPU or (--dry-run) tiny on the CPU
    local m=(-m hybrid.bench)
    case "$1${DRY:+-dry}" in
        gpucheck) LIMIT=200 CMD=("$PY" "${m[@]}".gpucheck --no-tests --no-reference --models gpt-1b \
            --settings bf16_params bf16_params+compile --steps 10 --out "$WORK/gpucheck.json") ;;
        gpucheck-dry) LIMIT=120 CMD=("$PY" "${m[@]}".gpucheck --dry-run --no-reference --models gpt-tiny \
            --out "$WORK/gpucheck.json") ;;
        gpucheck_llama) LIMIT=90 CMD=("$PY" "${m[@]}".gpucheck --no-tests --models llama-1b --settings bf16_params \
            --steps 10 --out "$WORK/gpucheck_llama.json") ;;
        gpucheck_llama-dry) LIMIT=120 CMD=("$PY" "${m[@]}".gpucheck --dry-run --models llama-tiny \
            --out "$WORK/gpucheck_llama.json") ;;
        vs_plain_loop) LIMIT=280 CMD=("$PY" "${m[@]}".vs_plain_loop --model gpt-1b --rounds 4 \
            --sides hybrid,hybrid_compiled,plain_compiled --hybrid "train.compile_scope=model" \
            --out "$WORK/vs_plain_loop.json") ;;
        vs_plain_loop-dry) LIMIT=120 CMD=("$PY" "${m[@]}".vs_plain_loop --quick --device cpu --rounds 2 --steps 1 \
            --sides hybrid,hybrid_compiled,plain --hybrid "train.compile_scope=model" \
            --out "$WORK/vs_plain_loop.json") ;;
        tp_chunk_cost) LIMIT=60 CMD=("$PY" "${m[@]}".tp_chunk_cost --device cuda --dtype bf16 --model gpt-1b --tp 2 \
            --seq 4096 --pieces 2 4 8 --rounds 20 --reps 10) ;;
        tp_chunk_cost-dry) LIMIT=60 CMD=("$PY" "${m[@]}".tp_chunk_cost --quick --device cpu) ;;
        diagnose|diagnose-dry) LIMIT=60 CMD=("$PY" -m hybrid.tools.diagnose --nccl --json "$WORK/diagnose.json") ;;
        binding|binding-dry) LIMIT=120 CMD=(env NUMA_BINDING=node PYTHON="$PY" bash launch/local.sh 1
            model=gpt-tiny train.steps=3 logging.wandb.mode=disabled "logging.dir=$WORK/binding-run"
            checkpoint.every=0 checkpoint.resume=none) ;;
        cp_kernels) LIMIT=90 CMD=("$PY" "${m[@]}".cp_kernels --device cuda --dtype bf16 --seq 8192 --heads 16 \
            --head-dim 128) ;;
        cp_kernels-dry) LIMIT=120 CMD=("$PY" "${m[@]}".cp_kernels --quick --device cpu) ;;
        plan) LIMIT=120 CMD=("$PY" -m hybrid.tools.plan model=gpt-1b --cluster hgx-h200 --nodes 1 --per-node 1 \
            --batch 16 --seq 1024 --top 15 --calibrate cuda --json) ;;
        plan-dry) LIMIT=120 CMD=("$PY" -m hybrid.tools.plan model=gpt-tiny --cluster hgx-h200 --nodes 1 --per-node 1 \
            --batch 4 --seq 64 --top 3 --calibrate cpu --json) ;;
    esac
}

FAILED=() SKIPPED=()
step() {  # step NAME: run it under min(its limit, what the budget has left), its output beside its figures
    local name=$1 left=$(( DEADLINE - SECONDS - PACK_S )) start=$SECONDS status
    command_of "$name"
    if (( left < MIN_S )); then
        log "$name SKIPPED: ${left}s of the budget left"
        SKIPPED+=("$name")
        return
    fi
    local limit=$(( LIMIT < left ? LIMIT : left ))
    log "$name ($(date -u +%FT%TZ), limit ${limit}s): ${CMD[*]}"
    timeout "$limit" "${CMD[@]}" > "$WORK/$name.txt" 2>&1
    status=$?
    if (( status != 0 )); then
        log "$name FAILED (status $status$( (( status == 124 )) && echo ": over its ${limit}s")):" \
            "$(tail -n 3 "$WORK/$name.txt" | tr '\n' ' ')"
        FAILED+=("$name")
    fi
    log "$name took $(( SECONDS - start ))s"
    tail -n 12 "$WORK/$name.txt"
    tar czf "$OUT/session.tgz" -C "$WORK" .
}

for s in "${STEPS[@]}"; do step "$s"; done
tar czf "$OUT/session.tgz" -C "$WORK" .
log "done in ${SECONDS}s: failed: ${FAILED[*]:-none}; skipped: ${SKIPPED[*]:-none}"
if (( ${#SKIPPED[@]} )); then
    log "the skipped ones: bash scripts/gpu_session.sh OUT_DIR ${DRY:+--dry-run }--steps $(IFS=,; echo "${SKIPPED[*]}")"
fi
(( ${#FAILED[@]} + ${#SKIPPED[@]} == 0 ))
