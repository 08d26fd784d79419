#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for `make test-slurm` (tests/slurm/): Debian's slurm-wlm and munge,
# one slurmctld and one slurmd per node name, all on this host.
#
#   scripts/slurm_cluster.sh install   apt-get install slurm-wlm munge (as root; nothing when both are there)
#   scripts/slurm_cluster.sh start     write $SLURM_DIR/slurm.conf, start munged, slurmctld (no jobs of an earlier
#                                      start: -c) and the slurmd's, wait until every node is idle; prints
#                                      `export SLURM_CONF=…` for the clients
#   scripts/slurm_cluster.sh stop      stop the daemons this script started (their pid files in $SLURM_DIR)
#   scripts/slurm_cluster.sh status    sinfo of the cluster
#
# Nodes: one per name of this host that resolves to a loopback address (its own name, then the others /etc/hosts
# maps to 127.*), each a slurmd of its own (`slurmd -N NAME`) on its own port: a job's node list then names hosts
# that torchrun's rendezvous reaches, with no /etc/hosts edits. SLURM_NODES caps the count (default 2).
# Environment: SLURM_DIR (state, logs, config; default /tmp/hybrid-slurm), SLURM_NODES, SLURM_CPUS (CPUs per node;
# default this machine's), SLURM_PORT (slurmctld's port, default 6817; the slurmd's take the ones after it).
set -euo pipefail
DIR=${SLURM_DIR:-/tmp/hybrid-slurm}
PORT=${SLURM_PORT:-6817}
CPUS=${SLURM_CPUS:-$(nproc)}

die() { echo "slurm_cluster.sh: $*" >&2; exit 2; }

install() {
    if command -v slurmctld >/dev/null && command -v munged >/dev/null; then return 0; fi
    [[ $(id -u) == 0 ]] || die "install needs root (apt-get install slurm-wlm munge)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }
}

# this host's names that resolve to a loopback address, its own name first (each can be a node). Not
# `localhost`: Slurm reads a node of that name as this host's own name, so the two would be one node.
node_names() {
    local name names=()
    for name in "$(hostname -s)" $(awk '$1 ~ /^127\./ { for (i = 2; i <= NF; i++) print $i }' /etc/hosts); do
        [[ $name == localhost* || " ${names[*]-} " == *" $name "* ]] && continue
        getent hosts "$name" | grep -qE '^127\.' && names+=("$name")
    done
    printf '%s\n' "${names[@]:0:${SLURM_NODES:-2}}"
}

write_conf() {
    local i=0 name
    mkdir -p "$DIR/ctld" "$DIR/log"
    cat > "$DIR/slurm.conf" <<EOF
# written by scripts/slurm_cluster.sh: a one-machine cluster for hybrid's tests
ClusterName=hybrid
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
EOF
    while read -r name; do
        i=$((i + 1))
        echo "NodeName=$name NodeHostname=$name NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS State=UNKNOWN" \
            >> "$DIR/slurm.conf"
    done < <(node_names)
    [[ $i -gt 0 ]] || die "no name of this host resolves to 127.*: a node needs one (see /etc/hosts)"
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$DIR/slurm.conf"
}

start_munge() {
    if munge -n </dev/null >/dev/null 2>&1; then return 0; fi
    [[ -f /etc/munge/munge.key ]] || /usr/sbin/mungekey --create >/dev/null 2>&1 || die "no /etc/munge/munge.key"
    mkdir -p /run/munge && chown munge:munge /run/munge /etc/munge/munge.key 2>/dev/null || true
    runuser -u munge -- /usr/sbin/munged || die "munged did not start"
}

start() {
    command -v slurmctld >/dev/null || die "Slurm is not installed: scripts/slurm_cluster.sh install"
    stop >/dev/null 2>&1 || true
    write_conf
    export SLURM_CONF=$DIR/slurm.conf
    start_munge
    slurmctld -c -i || die "slurmctld did not start: $DIR/log/slurmctld.log"
    local name
    while read -r name; do
        slurmd -N "$name" || die "slurmd $name did not start: $DIR/log/slurmd-$name.log"
    done < <(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$SLURM_CONF")
    wait_idle
    echo "export SLURM_CONF=$SLURM_CONF"
}

# every node idle within 60 s, or the daemons' logs say why not
wait_idle() {
    local nodes
    nodes=$(grep -c '^NodeName=' "$SLURM_CONF")
    for _ in $(seq 120); do
        [[ $(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l) == "$nodes" ]] && return 0
        sleep 0.5
    done
    tail -n 5 "$DIR"/log/*.log >&2 || true
    die "the nodes are not idle after 60 s (sinfo: $(sinfo -h -N -o '%N %T' 2>&1 | tr '\n' ' '))"
}

# each daemon of a pid file TERMed, and waited for (10 s at most), so that a start right after finds its ports free
stop() {
    local file pid
    for file in "$DIR"/slurmd-*.pid "$DIR"/slurmctld.pid; do
        [[ -f $file ]] || continue
        pid=$(cat "$file")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        rm -f "$file"
    done
    return 0
}

status() { SLURM_CONF=$DIR/slurm.conf sinfo -N; }

case "${1:-}" in
    install|start|stop|status) "$1" ;;
    *) die "usage: scripts/slurm_cluster.sh install|start|stop|status" ;;
esac
