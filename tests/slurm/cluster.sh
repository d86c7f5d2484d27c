#!/usr/bin/env bash
# Usage: tests/slurm/cluster.sh up|down|env
#
# A real one-host Slurm for areal's tests: munged, slurmctld and two slurmd ("n1", "n2",
# each a NodeName with its own port on this host) running as root without systemd, on
# loopback, with no accounting and no cgroups. Each node advertises AREAL_SLURM_CPUS
# CPUs (default 4; more than the machine has is allowed by config_overrides), so a 2-core
# machine can host a "2-node" layout.
#
#   up    start what is not running (idempotent) and wait until both nodes are idle
#   down  stop the daemons and remove the state directory (idempotent)
#   env   print the line to export for sbatch/squeue/srun: SLURM_CONF=...
#
# State (configs, munge key and socket, spool, logs, pid files) lives under
# $AREAL_SLURM_DIR (default /tmp/areal-slurm). Ports: 16817 (slurmctld), 16818-16819
# (slurmd). Needs root and Debian's slurm-wlm and munge packages (apt-get install -y
# slurm-wlm munge).
set -euo pipefail

DIR=${AREAL_SLURM_DIR:-/tmp/areal-slurm}
CPUS=${AREAL_SLURM_CPUS:-4}
CTLD_PORT=16817
HOST=$(hostname)
CONF=$DIR/slurm.conf

die() { echo "cluster.sh: $*" >&2; exit 1; }

alive() {  # alive PIDFILE: the pid in it is a running process
  [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

write_config() {
  mkdir -p "$DIR/munge" "$DIR/ctld" "$DIR/spool" "$DIR/log"
  chmod 700 "$DIR/munge"
  if [[ ! -s $DIR/munge/munge.key ]]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$DIR/munge/munge.key"
  fi
  cat >"$CONF.tmp" <<CONF
ClusterName=areal-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=16818 CPUs=$CPUS State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=16819 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
  mv "$CONF.tmp" "$CONF"

}

up() {
  [[ $(id -u) == 0 ]] || die "needs root (the daemons run as root)"
  command -v slurmctld >/dev/null && command -v munged >/dev/null ||
    die "slurm-wlm and munge are not installed: apt-get install -y slurm-wlm munge"
  write_config
  export SLURM_CONF=$CONF
  if ! alive "$DIR/munged.pid"; then
    munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
      --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" \
      --seed-file="$DIR/munge/munged.seed"
  fi
  if ! alive "$DIR/slurmctld.pid"; then
    slurmctld -f "$CONF"
  fi
  for node in n1 n2; do
    mkdir -p "$DIR/spool/$node"
    if ! alive "$DIR/slurmd-$node.pid"; then
      slurmd -f "$CONF" -N "$node"
    fi
  done
  for _ in $(seq 1 60); do
    if [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c -E ' (idle|mix|alloc)$') == 2 ]]; then
      return 0
    fi
    # a node left down by an earlier run comes back
    scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  sinfo -N >&2 || true
  tail -n 20 "$DIR"/log/*.log >&2 || true
  die "the nodes did not become idle within 60 s (logs above, under $DIR/log)"
}

down() {
  for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
    [[ -e $pidfile ]] || continue
    if alive "$pidfile"; then
      pid=$(cat "$pidfile")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$DIR"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  env) echo "SLURM_CONF=$CONF" ;;
  *) die "usage: tests/slurm/cluster.sh up|down|env" ;;
esac
