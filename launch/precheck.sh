# Sourced by launch/local.sh, multinode.sh and slurm.sbatch: validate the configuration once, in one
# process, before torchrun starts any rank (python -m hybrid.tools.check, the same composition and checks
# the ranks make). Bad input is then one `hybrid: error: ...` line and exit status 2, instead of the same
# line from every rank followed by torchrun's failure summary. Skipped with HYBRID_CHECK=0, and when
# HYBRID_MODULE runs another module (its arguments are its own). A Python that cannot run the check (no
# torch or hydra there: another environment than torchrun's) leaves it to the ranks, with one warning.

# precheck_config SCRIPT WORLD RANKS_PER_NODE ARGS...   (WORLD empty: not known yet, e.g. an elastic job)
precheck_config() {
  local script="$1" world="$2" per_node="$3" py="${PYTHON:-python3}" out status=0
  shift 3
  [[ "${HYBRID_CHECK:-1}" != 0 && -z "${HYBRID_MODULE:-}" ]] || return 0
  local sizes=()
  [[ -z "$world" ]] || sizes=(--world "$world" --ranks-per-node "$per_node")
  out="$("$py" -m hybrid.tools.check ${sizes[@]+"${sizes[@]}"} -- "$@" 2>&1 >/dev/null)" || status=$?
  if [[ $status -eq 2 ]]; then
    printf '%s\n' "$out" >&2
    exit 2
  elif [[ $status -ne 0 ]]; then
    echo "$script: warning: the configuration check did not run ($py -m hybrid.tools.check exited $status);" \
      "the ranks check it" >&2
  fi
}
