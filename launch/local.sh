#!/usr/bin/env bash
# Single-node launch: torchrun --standalone with NPROC ranks running `python -m hybrid.train`.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: launch/local.sh [NPROC] [hydra overrides...]

Runs `torchrun --standalone --nproc_per_node=NPROC -m hybrid.train OVERRIDES` on this machine.

  NPROC      ranks to start (default: number of GPUs, or 2 without GPUs)
  overrides  passed to hybrid.train unchanged, e.g. model=gpt-tiny parallel=tp2 train.steps=50

Environment:
  OMP_NUM_THREADS  threads per rank (default: max(1, cores / NPROC))
  TORCHRUN         torchrun command to use (default: torchrun)
  HYBRID_MODULE    module to run instead of hybrid.train (smoke tests)

Examples:
  launch/local.sh                                   # all GPUs (or 2 CPU ranks), default config
  launch/local.sh 8 model=gpt-1b parallel=tp2pp4
  launch/local.sh 4 parallel=tp2pp2 logging.wandb.mode=disabled
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

CORES="$(nproc 2>/dev/null || echo 1)"
THREADS=$(( CORES / NPROC ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}"

# Make `-m hybrid.train` importable from any working directory without installing the package.
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# shellcheck disable=SC2086  # TORCHRUN may hold a command with arguments (e.g. "python -m torch.distributed.run")
exec ${TORCHRUN:-torchrun} --standalone --nproc_per_node="$NPROC" -m "${HYBRID_MODULE:-hybrid.train}" "$@"
