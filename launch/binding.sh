# Sourced by launch/local.sh, multinode.sh and slurm.sbatch: bind each rank to the CPUs of its GPU's NUMA node,
# with torchrun's own `--numa-binding` (it reads the GPU's NUMA node from sysfs and starts the rank under
# numactl). Only where it can work: GPUs on this host, numactl on PATH, a torchrun that has the option. The NIC
# needs no binding: NCCL gives each GPU its nearest NIC by itself (hybrid-diagnose shows which one that is).
#
#   NUMA_BINDING=node (default) | socket | exclusive | core-complex   torchrun's modes
#   NUMA_BINDING=none                                                   no binding (the opt-out)
#
# numa_binding SCRIPT GPUS LAUNCHER...   sets BINDING_ARGS (flags for torchrun) and exports HYBRID_BINDING, the
# line the trainer prints under its rank map; says on stderr what it chose and why (on a host with GPUs, or
# when NUMA_BINDING is set).
numa_binding() {
  local script="$1" gpus="$2" mode="${NUMA_BINDING:-node}"
  shift 2
  [[ "$gpus" =~ ^[0-9]+$ ]] || gpus=0  # a GPU count the scheduler wrote in another form: no binding
  BINDING_ARGS=()
  case "$mode" in
    none) HYBRID_BINDING="none (NUMA_BINDING=none)" ;;
    node|socket|exclusive|core-complex)
      if [[ "$gpus" -lt 1 ]]; then
        HYBRID_BINDING="none (no GPU on this host: each rank may run on any CPU it was given)"
      elif ! command -v numactl >/dev/null 2>&1; then
        HYBRID_BINDING="none (numactl is not installed: apt install numactl, or NUMA_BINDING=none to silence this)"
      elif ! "$@" --help 2>/dev/null | grep -q -- '--numa-binding'; then
        HYBRID_BINDING="none (this torchrun has no --numa-binding; newer torch releases have it)"
      else
        BINDING_ARGS=(--numa-binding="$mode")
        HYBRID_BINDING="$mode (torchrun --numa-binding=$mode: each rank on its GPU's NUMA node's CPUs)"
      fi ;;
    *) echo "$script: error: NUMA_BINDING must be node, socket, exclusive, core-complex or none, got '$mode'" >&2
       exit 2 ;;
  esac
  export HYBRID_BINDING
  # said where it matters: a host with GPUs, or a choice made by hand (a CPU host's runs stay quiet)
  [[ "$gpus" -lt 1 && -z "${NUMA_BINDING:-}" ]] || echo "$script: binding: $HYBRID_BINDING" >&2
}
