#!/usr/bin/env bash
# The GPU measurements of a session that is lent a GPU, as one script (docs/gpu.md):
#
#   bash scripts/gpu_session.sh OUT_DIR            on the GPU machine: gpu-check at gpt-1b, then hybrid (eager,
#                                                  and the whole model compiled) beside the compiled plain loop,
#                                                  figures as JSON in OUT_DIR; then CP's ring blocks (cp=1) beside
#                                                  SDPA on one GPU; then the chunked TP overlap's GEMMs in
#                                                  pieces beside whole on one GPU (its single-device cost);
#                                                  then hybrid-plan calibrated on the GPU: gpt-1b's predicted
#                                                  tokens/s per micro batch, beside gpucheck's measured ones;
#                                                  then hybrid-diagnose --nccl (the host's real topo -m classified)
#                                                  and a 3-step run through launch/local.sh (its NUMA binding)
#   bash scripts/gpu_session.sh OUT_DIR --dry-run  the same steps on the CPU, tiny (what CI can check)
#
# Wheels the GPU machine lacks (it reaches no package index) travel in .whl/ and are installed into a private
# folder first. Each step has its own time limit, so one that hangs cannot eat the others' time; a failed step
# is reported and the next one still runs; the exit status is 1 when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_session.sh OUT_DIR [--dry-run]}
DRY=${2:-}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --target /tmp/hybrid-site .whl/*.whl && export PYTHONPATH="/tmp/hybrid-site:$PWD"
fi
export PYTHONPATH="${PYTHONPATH:-$PWD}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
failed=0

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output beside its figures
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%FT%TZ), limit ${limit}s): $*" | tee -a "$OUT/session.log"
    if ! timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; then
        echo "== $name FAILED (status $?): $(tail -n 3 "$OUT/$name.txt" | tr '\n' ' ')" | tee -a "$OUT/session.log"
        failed=1
    fi
    tail -n 25 "$OUT/$name.txt"
}

if [[ "$DRY" == "--dry-run" ]]; then
    step gpucheck 300 "$PY" -m hybrid.bench.gpucheck --dry-run --no-tests --out "$OUT/gpucheck.json"
    step vs_plain_loop 300 "$PY" -m hybrid.bench.vs_plain_loop --quick --device cpu --rounds 2 --steps 1 \
        --sides hybrid,hybrid_compiled,plain --hybrid "train.compile_scope=model" --out "$OUT/vs_plain_loop.json"
    step cp_kernels 120 "$PY" -m hybrid.bench.cp_kernels --quick --device cpu
    step tp_chunk_cost 60 "$PY" -m hybrid.bench.tp_chunk_cost --quick --device cpu
    step plan 120 "$PY" -m hybrid.tools.plan model=gpt-tiny --cluster hgx-h200 --nodes 1 --per-node 1 --batch 4 \
        --seq 64 --top 3 --calibrate cpu --json
else
    "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/session.log"
    step gpucheck 280 "$PY" -m hybrid.bench.gpucheck --no-tests --models gpt-1b --steps 10 --out "$OUT/gpucheck.json"
    step vs_plain_loop 280 "$PY" -m hybrid.bench.vs_plain_loop --model gpt-1b --rounds 4 \
        --sides hybrid,hybrid_compiled,plain_compiled --hybrid "train.compile_scope=model" \
        --out "$OUT/vs_plain_loop.json"
    step cp_kernels 90 "$PY" -m hybrid.bench.cp_kernels --device cuda --dtype bf16 --seq 8192 --heads 16 --head-dim 128
    step tp_chunk_cost 60 "$PY" -m hybrid.bench.tp_chunk_cost --device cuda --dtype bf16 --model gpt-1b --tp 2 \
        --seq 4096 --pieces 2 4 8 --rounds 20 --reps 10
    step plan 120 "$PY" -m hybrid.tools.plan model=gpt-1b --cluster hgx-h200 --nodes 1 --per-node 1 --batch 16 \
        --seq 1024 --top 15 --calibrate cuda --json
    # a real `nvidia-smi topo -m` classified, the NCCL advice for it; the launch script's NUMA binding on a GPU host
    step diagnose 60 "$PY" -m hybrid.tools.diagnose --nccl --json "$OUT/diagnose.json"
    step binding 120 env NUMA_BINDING=node PYTHON="$PY" bash launch/local.sh 1 model=gpt-tiny train.steps=3 \
        logging.wandb.mode=disabled "logging.dir=$OUT/binding-run" checkpoint.every=0 checkpoint.resume=none
fi
exit $failed
