#!/usr/bin/env bash
# Multi-node launch: one torchrun agent per node, joined by a c10d rendezvous, running `-m hybrid.train`.
# A failed worker group restarts (up to --max-restarts times) and resumes from its newest checkpoint.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: launch/multinode.sh [options] [--] [hydra overrides...]

Run the same command on every node; the agents meet at the rendezvous endpoint
(c10d backend, hosted by the agent on the endpoint's host) and form one job.

Options (each falls back to the environment variable in brackets):
  --nnodes N          number of nodes, or MIN:MAX for elastic jobs   [NNODES]        required
  --node-rank R       this node's index; informational with c10d      [NODE_RANK]     default 0
  --nproc N           ranks per node                                  [NPROC_PER_NODE] default: GPUs, else 2
  --endpoint H[:P]    rendezvous host and port (same on every node)   [MASTER_ADDR, MASTER_PORT] port 29500
  --run-id ID         rendezvous id (same on every node)              [RUN_ID]        default hybrid
  --max-restarts N    worker-group restarts after a failure           [MAX_RESTARTS]  default 3
  --join-timeout S    seconds to wait for the nodes to join           [JOIN_TIMEOUT]  default 600
  --local-addr ADDR   address this node advertises to the others      [LOCAL_ADDR]    default: hostname
  -h, --help          this text
The first argument that is not one of these options (or everything after `--`)
is passed to hybrid.train unchanged, once one process has checked it (python -m
hybrid.tools.check: bad input is one line and exit 2; HYBRID_CHECK=0 skips it).
Extra torchrun flags: TORCHRUN_ARGS="..."; TORCHRUN="cmd" replaces the torchrun
command; HYBRID_MODULE=pkg.mod runs another module instead of hybrid.train with the
same arguments (smoke tests); PYTHON (default python3) runs the check and the filter
that shortens a join timeout's traceback to one line.
NUMA_BINDING=node (default; with GPUs and numactl) binds each rank to its GPU's NUMA
node's CPUs through torchrun --numa-binding; none turns it off (launch/binding.sh).

Fault tolerance: when a rank on any node fails, every agent stops and restarts its
ranks (at most --max-restarts times, 0 = fail at once) and, with checkpoint.resume=auto,
they continue from the newest complete checkpoint of the run (checkpoint.dir/run_name/
step_*, on storage every node sees; incomplete ones are skipped). Save some with
checkpoint.every=N. checkpoint.resume=auto is added unless the overrides set
checkpoint.resume themselves (none: from scratch; PATH: that checkpoint).

Joining: each node says at once what it waits for (node count, endpoint, rendezvous id,
its rank). If not all nodes join within --join-timeout seconds (also when a restart
waits for a node that is gone), the agent ends with one line and exit status 1.
Every rank dies with its node's torchrun agent, even one killed with SIGKILL.

Examples:
  # node 0 and node 1 of a 2-node job, 8 GPUs each (node0 reachable as node0:29500)
  launch/multinode.sh --nnodes 2 --node-rank 0 --nproc 8 --endpoint node0:29500 --run-id exp1 model=gpt-1b parallel=tp2pp4
  launch/multinode.sh --nnodes 2 --node-rank 1 --nproc 8 --endpoint node0:29500 --run-id exp1 model=gpt-1b parallel=tp2pp4
  # emulate 2 nodes x 2 ranks on one machine: run both lines (e.g. in two terminals)
  launch/multinode.sh --nnodes 2 --node-rank 0 --nproc 2 --endpoint localhost:29511 --run-id emu parallel=tp2pp2 &
  launch/multinode.sh --nnodes 2 --node-rank 1 --nproc 2 --endpoint localhost:29511 --run-id emu parallel=tp2pp2
USAGE
}

die() {
  echo "multinode.sh: $*" >&2
  exit 2
}

gpu_count() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

NNODES="${NNODES:-}"
NODE_RANK="${NODE_RANK:-0}"
NPROC="${NPROC_PER_NODE:-}"
ENDPOINT="${MASTER_ADDR:-}${MASTER_ADDR:+:${MASTER_PORT:-29500}}"
RUN_ID="${RUN_ID:-hybrid}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
JOIN_TIMEOUT="${JOIN_TIMEOUT:-600}"
LOCAL_ADDR="${LOCAL_ADDR:-}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --nnodes|--node-rank|--nproc|--endpoint|--run-id|--max-restarts|--join-timeout|--local-addr)
      [[ $# -ge 2 ]] || die "$1 needs a value"
      case "$1" in
        --nnodes) NNODES="$2" ;;
        --node-rank) NODE_RANK="$2" ;;
        --nproc) NPROC="$2" ;;
        --endpoint) ENDPOINT="$2" ;;
        --run-id) RUN_ID="$2" ;;
        --max-restarts) MAX_RESTARTS="$2" ;;
        --join-timeout) JOIN_TIMEOUT="$2" ;;
        --local-addr) LOCAL_ADDR="$2" ;;
      esac
      shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

[[ -n "$NNODES" ]] || die "the node count is required (--nnodes N or NNODES); see -h"
[[ "$NNODES" =~ ^[0-9]+(:[0-9]+)?$ ]] || die "--nnodes must be N or MIN:MAX, got '$NNODES'"
[[ -n "$ENDPOINT" ]] || die "the rendezvous endpoint is required (--endpoint HOST:PORT or MASTER_ADDR); see -h"
[[ "$ENDPOINT" == *:* ]] || ENDPOINT="$ENDPOINT:${MASTER_PORT:-29500}"
if [[ -z "$NPROC" ]]; then
  NPROC="$(gpu_count)"
  [[ "$NPROC" -gt 0 ]] || NPROC=2
fi
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "--nproc must be a positive integer, got '$NPROC'"
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] || die "--node-rank must be a non-negative integer, got '$NODE_RANK'"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "--max-restarts must be a non-negative integer, got '$MAX_RESTARTS'"
[[ "$JOIN_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "--join-timeout must be a positive number of seconds, got '$JOIN_TIMEOUT'"

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

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Bad input is one line here, once per node, before any rank starts (launch/precheck.sh); an elastic job's
# world is not known yet: then everything but the world size is checked.
# shellcheck source=launch/precheck.sh
source "$REPO_ROOT/launch/precheck.sh"
WORLD=""
[[ "$NNODES" == *:* ]] || WORLD=$(( NNODES * NPROC ))
precheck_config multinode.sh "$WORLD" "$NPROC" ${RESUME[@]+"${RESUME[@]}"} "$@"

ARGS=(
  --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC"
  --rdzv_backend=c10d --rdzv_endpoint="$ENDPOINT" --rdzv_id="$RUN_ID" --max_restarts="$MAX_RESTARTS"
  --rdzv_conf="join_timeout=$JOIN_TIMEOUT"
)
[[ -z "$LOCAL_ADDR" ]] || ARGS+=(--local_addr="$LOCAL_ADDR")
# shellcheck disable=SC2206  # TORCHRUN_ARGS is a list of flags, split on purpose
[[ -z "${TORCHRUN_ARGS:-}" ]] || ARGS+=($TORCHRUN_ARGS)

MIN_NODES="${NNODES%%:*}"
NODES="$NNODES"
[[ "$NNODES" != *:* ]] || NODES="$MIN_NODES to ${NNODES#*:}"
echo "multinode.sh: node rank $NODE_RANK waiting up to $JOIN_TIMEOUT s for $NODES node(s) to join at $ENDPOINT" \
  "(rendezvous id $RUN_ID)" >&2
TIMED_OUT="multinode.sh: error: timed out after $JOIN_TIMEOUT s: fewer than $MIN_NODES node(s) joined at $ENDPOINT"
TIMED_OUT+=" (rendezvous id $RUN_ID); start the same command on every node, or raise --join-timeout"

# torchrun ends a rendezvous timeout with a traceback: hybrid.rdzv_timeout (any Python 3, no torch) turns it
# into TIMED_OUT and passes everything else on stderr (the ranks' lines too) through at once; it ignores
# INT/TERM/HUP and ends when every writer is gone. `exec` keeps torchrun on this shell's pid: killing the
# script kills the agent, and the ranks die with it (hybrid.lifeline).
if FILTER="$(command -v "${PYTHON:-python3}")"; then
  exec 2> >(trap '' INT TERM HUP; exec "$FILTER" -m hybrid.rdzv_timeout "$TIMED_OUT" >&2)
fi
# shellcheck source=launch/binding.sh
source "$REPO_ROOT/launch/binding.sh"
# shellcheck disable=SC2086  # TORCHRUN may hold a command with arguments
numa_binding multinode.sh "$(gpu_count)" ${TORCHRUN:-torchrun}
# shellcheck disable=SC2086
exec ${TORCHRUN:-torchrun} "${ARGS[@]}" ${BINDING_ARGS[@]+"${BINDING_ARGS[@]}"} -m "${HYBRID_MODULE:-hybrid.train}" \
  ${RESUME[@]+"${RESUME[@]}"} "$@"
