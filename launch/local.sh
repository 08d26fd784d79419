#!/usr/bin/env bash
# Single-node launch: torchrun --standalone with NPROC ranks running `python -m hybrid.train`;
# a failed worker group restarts (up to MAX_RESTARTS times) and resumes from its newest checkpoint.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: launch/local.sh [NPROC] [hydra overrides...]

Runs on this machine:
  torchrun --standalone --nproc_per_node=NPROC --max-restarts=MAX_RESTARTS \
      -m hybrid.train [checkpoint.resume=auto] OVERRIDES

  NPROC      ranks to start (default: number of GPUs, or 2 without GPUs)
  overrides  passed to hybrid.train unchanged, e.g. model=gpt-tiny parallel=tp2 train.steps=50

Fault tolerance: when a rank fails, torchrun stops and restarts all ranks (at most MAX_RESTARTS
times) and, with checkpoint.resume=auto, they continue from the newest complete checkpoint of the
run (checkpoint.dir/run_name/step_*; incomplete ones are skipped). Save some with checkpoint.every=N.
checkpoint.resume=auto is added unless the overrides set checkpoint.resume themselves:
checkpoint.resume=none starts from scratch, checkpoint.resume=PATH resumes that checkpoint.
Running a command again therefore continues its run: a finished run has nothing to do (one line,
exit 0); other training settings than the checkpoint's (train.lr, seed, batch, optim.*, model.*,
data.*, ...) are refused (exit 2) unless checkpoint.allow_changes=true. Another NPROC resumes
resharded; another tp/pp is another run_name (add run_name=OLD_NAME to continue the old run).

Environment:
  MAX_RESTARTS     worker-group restarts after a failure (default: 3; 0 = fail at once)
  OMP_NUM_THREADS  threads per rank (default: max(1, cores / NPROC))
  TORCHRUN         torchrun command to use (default: torchrun; "$PYTHON -m torch.distributed.run"
                   when PYTHON is set or no torchrun is on PATH)
  PYTHON           the Python whose torch runs the job (default: python3 when torchrun is absent)
  HYBRID_MODULE    module to run instead of hybrid.train (smoke tests); gets the same arguments
  HYBRID_CHECK     0: skip the configuration check before launch (python -m hybrid.tools.check, one
                   process: bad input is one line and exit 2 before any rank starts)
  NUMA_BINDING     node (default): each rank on its GPU's NUMA node's CPUs (torchrun --numa-binding;
                   with GPUs and numactl); socket, exclusive, core-complex: torchrun's other modes;
                   none: no binding (launch/binding.sh)

Examples:
  launch/local.sh                                   # all GPUs (or 2 CPU ranks), default config
  launch/local.sh 8 model=gpt-1b parallel=tp2pp4
  launch/local.sh 4 parallel=tp2pp2 logging.wandb.mode=disabled
  launch/local.sh 2 checkpoint.every=50             # restartable: saves every 50 steps, resumes after a crash
  MAX_RESTARTS=0 launch/local.sh 2 checkpoint.resume=none   # no restarts, always from scratch
USAGE
}

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  usage
  exit 0
fi

gpu_count() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
  NPROC="$1"
  shift
else
  NPROC="$(gpu_count)"
  [[ "$NPROC" -gt 0 ]] || NPROC=2
fi
if [[ "$NPROC" -lt 1 ]]; then
  echo "local.sh: NPROC must be >= 1, got $NPROC" >&2
  exit 2
fi
MAX_RESTARTS="${MAX_RESTARTS:-3}"
if [[ ! "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "local.sh: MAX_RESTARTS must be a non-negative integer, got '$MAX_RESTARTS'" >&2
  exit 2
fi

# torch >= 2.5 shares the agent's TCPStore with the ranks and keeps it across restarts: a restarted
# rank then reads its peers' addresses of the failed attempt and gloo/NCCL set-up fails (pytorch#135712).
# A fresh store per attempt (hosted by rank 0, as before 2.5) makes restarts work.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
# Restarted ranks resume by themselves, unless the overrides choose checkpoint.resume (or +, ++, ~ it).
RESUME=(checkpoint.resume=auto)
for arg in "$@"; do
  if [[ "$arg" =~ ^[+~]*checkpoint\.resume(=|$) ]]; then RESUME=(); fi
done

CORES="$(nproc 2>/dev/null || echo 1)"
THREADS=$(( CORES / NPROC ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}"

# Make `-m hybrid.train` importable from any working directory without installing the package.
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Bad input is one line here, once, before any rank starts (launch/precheck.sh).
# shellcheck source=launch/precheck.sh
source "$REPO_ROOT/launch/precheck.sh"
precheck_config local.sh "$NPROC" "$NPROC" ${RESUME[@]+"${RESUME[@]}"} "$@"

# The launcher: $TORCHRUN if given; else the torchrun of $PYTHON when PYTHON is given (`make run PYTHON=…`)
# or no torchrun is on PATH (a venv not activated); else torchrun.
if [[ -n "${TORCHRUN:-}" ]]; then
  read -r -a LAUNCHER <<< "$TORCHRUN"  # may hold a command with arguments (e.g. "python -m torch.distributed.run")
elif [[ -n "${PYTHON:-}" ]] || ! command -v torchrun >/dev/null 2>&1; then
  LAUNCHER=("${PYTHON:-python3}" -m torch.distributed.run)
else
  LAUNCHER=(torchrun)
fi
# shellcheck source=launch/binding.sh
source "$REPO_ROOT/launch/binding.sh"
numa_binding local.sh "$(gpu_count)" "${LAUNCHER[@]}"
exec "${LAUNCHER[@]}" --standalone --nproc_per_node="$NPROC" --max-restarts="$MAX_RESTARTS" \
  ${BINDING_ARGS[@]+"${BINDING_ARGS[@]}"} -m "${HYBRID_MODULE:-hybrid.train}" ${RESUME[@]+"${RESUME[@]}"} "$@"
