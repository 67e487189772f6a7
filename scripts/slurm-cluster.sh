#!/usr/bin/env bash
# Bring up a real Slurm cluster on this one host: munged, slurmctld and
# SLURM_NODES slurmd daemons, each slurmd a Slurm node of its own.
#
# Built for a Debian bookworm host without systemd (a container or sandbox):
#   - Slurm is Debian's slurm-wlm (22.05) with munge, installed with apt-get;
#   - the daemons are started by hand in the background, as root
#     (SlurmUser=root), not through init scripts;
#   - no cgroups: proctrack/linuxproc and task/none, so it runs where cgroups
#     cannot be delegated; nothing limits a job's CPUs or memory;
#   - several slurmd on one host (NodeName=n[1-N], all on this host, one port
#     each): Debian builds Slurm with multiple-slurmd support, so a job can
#     span "nodes" exactly as on a real cluster. SLURM_NODES=1 runs one node
#     named after the host instead.
# The configuration lives in SLURM_CONF_DIR (/etc/slurm, where Debian's
# commands look) and is written only when absent or written by this script
# before, never over somebody else's. Every subcommand is idempotent.
set -Eeuo pipefail

PROG=$(basename "$0")
# Any unexpected failure ends the script with one line naming the command.
trap 'echo "[$PROG] ERROR: \"$BASH_COMMAND\" failed (exit $?)" >&2' ERR

# Tunables (environment).
SLURM_NODES=${SLURM_NODES:-2}                       # slurmd daemons = Slurm nodes on this host
SLURM_CPUS=${SLURM_CPUS:-$(nproc)}                  # CPUs each node offers (all of them: no binding)
SLURM_CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}
SLURM_STATE_DIR=${SLURM_STATE_DIR:-/var/lib/slurm}  # slurmctld state and slurmd spool
SLURM_LOG_DIR=${SLURM_LOG_DIR:-/var/log/slurm}
SLURM_RUN_DIR=${SLURM_RUN_DIR:-/run/slurm}          # pid files
SLURMCTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}                    # node i listens on SLURMD_PORT + i - 1
SLURM_PARTITION=${SLURM_PARTITION:-debug}
SLURM_START_TIMEOUT=${SLURM_START_TIMEOUT:-60}      # seconds to wait for idle nodes
SLURM_CRED_EXPIRE=${SLURM_CRED_EXPIRE:-10}          # seconds a requeued job waits before it may run again
SLURM_PACKAGES=${SLURM_PACKAGES:-slurm-wlm munge}

MARKER="# Written by scripts/$PROG; rewritten by it, edit the script instead."
CONF=$SLURM_CONF_DIR/slurm.conf
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PIDFILE=/run/munge/munged.pid
export SLURM_CONF=$CONF

usage() {
  cat <<EOF
Usage: $PROG COMMAND

Run a Slurm cluster of $SLURM_NODES node(s) on this host (idempotent).

Commands:
  install   apt-get install $SLURM_PACKAGES if missing
  config    write $CONF and cgroup.conf, create the munge key if missing
  start     start munged, slurmctld and the slurmd daemons unless running;
            waits up to ${SLURM_START_TIMEOUT}s for every node to be idle
  ensure    install + config + start (restarts daemons whose config changed)
  stop      cancel every job, stop slurmd, slurmctld and munged; nothing of
            Slurm's stays running
  status    sinfo and squeue
  help      this text

Environment: SLURM_NODES, SLURM_CPUS, SLURM_CONF_DIR, SLURM_STATE_DIR,
SLURM_LOG_DIR, SLURM_RUN_DIR, SLURMCTLD_PORT, SLURMD_PORT, SLURM_PARTITION,
SLURM_START_TIMEOUT, SLURM_CRED_EXPIRE, SLURM_PACKAGES.
EOF
}

# say, die, timed, proc_alive, pid_from
# shellcheck source=scripts/host-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/host-lib.sh"

need_root() { [ "$(id -u)" -eq 0 ] || die "run as root (Slurm's daemons and /etc/slurm need it)"; }

# Node names: n1..nN, or the host's own short name for a single node.
node_names() {
  local i
  if [ "$SLURM_NODES" -eq 1 ]; then hostname -s; return; fi
  for i in $(seq 1 "$SLURM_NODES"); do echo "n$i"; done
}

# --- install ------------------------------------------------------------------
cmd_install() {
  need_root
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
      && command -v munged >/dev/null; then
    say "already installed: $(slurmd -V)"
    return 0
  fi
  # Keep postinst scripts from starting services (no init system here); we
  # start the daemons ourselves. Only touch policy-rc.d if nobody else owns it.
  local policy=/usr/sbin/policy-rc.d created=0 rc=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    created=1
  fi
  say "apt-get install $SLURM_PACKAGES"
  # shellcheck disable=SC2086
  {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $SLURM_PACKAGES >/dev/null || {
      say "apt-get install failed; refreshing package lists and retrying"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $SLURM_PACKAGES >/dev/null
    }
  } || rc=$?
  [ "$created" -eq 0 ] || rm -f "$policy"
  [ "$rc" -eq 0 ] || die "apt-get install $SLURM_PACKAGES failed (exit $rc)"
  say "installed: $(slurmd -V)"
}

# --- config -------------------------------------------------------------------
# slurm.conf for this host on stdout.
render_conf() {
  local host names i=0 name
  host=$(hostname -s)
  mapfile -t names < <(node_names)
  cat <<EOF
$MARKER
ClusterName=local
SlurmctldHost=$host
SlurmctldPort=$SLURMCTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits for its old credentials to expire before it runs again
# (Slurm's default: 120s); one host launches a step in well under a second.
AuthInfo=cred_expire=$SLURM_CRED_EXPIRE
StateSaveLocation=$SLURM_STATE_DIR/slurmctld
SlurmdSpoolDir=$SLURM_STATE_DIR/slurmd/%n
SlurmctldPidFile=$SLURM_RUN_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$SLURM_LOG_DIR/slurmctld.log
SlurmdLogFile=$SLURM_LOG_DIR/slurmd-%n.log
# No cgroups: processes are tracked through /proc and tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Look at pending jobs every few seconds (default 60): a requeued job runs as
# soon as it may.
SchedulerParameters=sched_interval=2,bf_interval=5
MpiDefault=none
# A node that restarts is usable again at once; a requeued job may run again.
ReturnToService=2
JobRequeue=1
# Seconds between the SIGTERM and the SIGKILL that end a job: time for the
# trainer to write its snapshot.
KillWait=30
SlurmctldTimeout=30
SlurmdTimeout=60
MinJobAge=300
EOF
  for name in "${names[@]}"; do
    echo "NodeName=$name NodeHostname=$host NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i)) CPUs=$SLURM_CPUS State=UNKNOWN"
    i=$((i + 1))
  done
  echo "PartitionName=$SLURM_PARTITION Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
}

render_cgroup_conf() {
  # Read by the daemons even when no cgroup plugin is in use; nothing here
  # may need a writable cgroup hierarchy.
  cat <<EOF
$MARKER
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
}

# write_if_changed FILE CONTENT: write FILE (refusing files not written by
# this script); returns 0 when it changed, 1 when it was already so.
write_if_changed() {
  local file=$1 content=$2
  if [ -e "$file" ]; then
    [ "$(cat "$file")" != "$content" ] || return 1
    head -n1 "$file" | grep -qxF "$MARKER" || die "$file exists and was not written by $PROG; move it away first"
  fi
  printf '%s\n' "$content" >"$file"
  say "wrote $file"
}

CONF_CHANGED=0
cmd_config() {
  need_root
  command -v slurmd >/dev/null || die "Slurm is not installed (run: $PROG install)"
  [[ "$SLURM_NODES" =~ ^[1-9][0-9]*$ ]] || die "SLURM_NODES must be a positive integer, got '$SLURM_NODES'"
  mkdir -p "$SLURM_CONF_DIR" "$SLURM_STATE_DIR/slurmctld" "$SLURM_LOG_DIR" "$SLURM_RUN_DIR"
  local name
  for name in $(node_names); do mkdir -p "$SLURM_STATE_DIR/slurmd/$name"; done
  if write_if_changed "$CONF" "$(render_conf)"; then CONF_CHANGED=1; fi
  if write_if_changed "$SLURM_CONF_DIR/cgroup.conf" "$(render_cgroup_conf)"; then CONF_CHANGED=1; fi
  if [ ! -s "$MUNGE_KEY" ]; then
    mkdir -p "$(dirname "$MUNGE_KEY")"
    mungekey --create --keyfile="$MUNGE_KEY" --force
    say "created $MUNGE_KEY"
  fi
  # munged refuses a key or directories that others may read or write.
  chown munge:munge "$MUNGE_KEY" /etc/munge
  chmod 0400 "$MUNGE_KEY"
  chmod 0700 /etc/munge
}

# --- daemons ------------------------------------------------------------------

munged_pid() { pid_from "$MUNGE_PIDFILE" munged; }
slurmctld_pid() { pid_from "$SLURM_RUN_DIR/slurmctld.pid" slurmctld; }
slurmd_pid() { pid_from "$SLURM_RUN_DIR/slurmd-$1.pid" slurmd; }

# wait_pid FILE NAME: the daemon's pid once it has written its pid file (a
# daemon forks first and writes the file after).
wait_pid() {
  local i pid
  for i in $(seq 1 20); do
    pid=$(pid_from "$1" "$2")
    [ -z "$pid" ] || { echo "$pid"; return 0; }
    sleep 0.25
  done
  echo "no pid file yet"
}

# Every live process named NAME (comm), by pid.
pids_named() {
  local entry
  for entry in /proc/[0-9]*; do
    if proc_alive "${entry#/proc/}" "$1"; then echo "${entry#/proc/}"; fi
  done
}

# stop_pid PID NAME: SIGTERM, then wait up to 30s (SIGKILL after that).
stop_pid() {
  local pid=$1 name=$2 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 1 60); do
    proc_alive "$pid" "$name" || { say "$name (pid $pid) stopped"; return 0; }
    sleep 0.5
  done
  kill -KILL "$pid" 2>/dev/null || true
  say "$name (pid $pid) killed after 30s"
}

start_munged() {
  [ -z "$(munged_pid)" ] || return 0
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  rm -f "$MUNGE_PIDFILE"
  # munged daemonizes itself and runs as the munge user, like Debian's init script.
  runuser -u munge -- munged
  local i
  for i in $(seq 1 20); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && { say "munged up (pid $(munged_pid))"; return 0; }
    sleep 0.5
  done
  die "munged does not answer; see /var/log/munge/munged.log"
}

start_slurmctld() {
  [ -z "$(slurmctld_pid)" ] || return 0
  rm -f "$SLURM_RUN_DIR/slurmctld.pid"
  echo "=== $(date -Is) $PROG start" >>"$SLURM_LOG_DIR/slurmctld.log"
  # -i: ignore state whose nodes no longer exist (a changed SLURM_NODES).
  slurmctld -i || die "slurmctld did not start; last log lines: $(tail -n3 "$SLURM_LOG_DIR/slurmctld.log" | paste -sd'|')"
  say "slurmctld started (pid $(wait_pid "$SLURM_RUN_DIR/slurmctld.pid" slurmctld))"
}

start_slurmd() {
  local name=$1 log=$SLURM_LOG_DIR/slurmd-$1.log
  [ -z "$(slurmd_pid "$name")" ] || return 0
  rm -f "$SLURM_RUN_DIR/slurmd-$name.pid"
  echo "=== $(date -Is) $PROG start" >>"$log"
  slurmd -N "$name" || die "slurmd -N $name did not start; last log lines: $(tail -n3 "$log" | paste -sd'|')"
  say "slurmd $name started (pid $(wait_pid "$SLURM_RUN_DIR/slurmd-$name.pid" slurmd))"
}

# Every node listed by sinfo, each idle (or allocated/mixed: busy is up too).
nodes_up() {
  local states
  states=$(sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
  [ "$(wc -l <<<"$states")" -eq "$SLURM_NODES" ] || return 1
  ! grep -qvE ' (idle|allocated|mixed|completing)$' <<<"$states"
}

cmd_start() {
  need_root
  [ -s "$CONF" ] || die "no $CONF (run: $PROG config)"
  start_munged
  start_slurmctld
  local name waited=0
  for name in $(node_names); do start_slurmd "$name"; done
  while ! nodes_up; do
    if [ "$waited" -ge $((SLURM_START_TIMEOUT * 2)) ]; then
      die "nodes not idle within ${SLURM_START_TIMEOUT}s: $(sinfo -h -N -o '%N=%T' 2>&1 | paste -sd' ') (logs: $SLURM_LOG_DIR)"
    fi
    # A node that was down before (a killed slurmd) stays down until told.
    if [ "$waited" -eq 10 ]; then
      scontrol update NodeName="$(node_names | paste -sd,)" State=RESUME 2>/dev/null || true
    fi
    sleep 0.5
    waited=$((waited + 1))
  done
  say "cluster up: $(sinfo -h -o '%P %D nodes %t %N' | paste -sd' ')"
}

# Stop the daemons (jobs first), leaving no Slurm or munge process behind.
cmd_stop() {
  need_root
  local jobs pid pidfile name i
  if [ -n "$(slurmctld_pid)" ]; then
    jobs=$(squeue -h -o %A 2>/dev/null | paste -sd' ')
    if [ -n "$jobs" ]; then
      say "cancelling jobs $jobs"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for i in $(seq 1 80); do
        [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break
        sleep 0.5
      done
    fi
  fi
  # Every slurmd with a pid file here, also those of nodes a changed
  # SLURM_NODES no longer lists.
  for pidfile in "$SLURM_RUN_DIR"/slurmd-*.pid; do
    pid=$(pid_from "$pidfile" slurmd)
    [ -z "$pid" ] || stop_pid "$pid" slurmd
  done
  pid=$(slurmctld_pid)
  [ -z "$pid" ] || stop_pid "$pid" slurmctld
  # Job step daemons outlive a slurmd; they belong to this cluster.
  for pid in $(pids_named slurmstepd); do stop_pid "$pid" slurmstepd; done
  pid=$(munged_pid)
  [ -z "$pid" ] || stop_pid "$pid" munged
  for name in slurmd slurmctld slurmstepd munged; do
    [ -z "$(pids_named "$name")" ] || die "$name still running: pid(s) $(pids_named "$name" | paste -sd' ')"
  done
  say "stopped: no slurmctld, slurmd, slurmstepd or munged left"
}

cmd_ensure() {
  timed install cmd_install
  timed config cmd_config
  if [ "$CONF_CHANGED" -eq 1 ] && { [ -n "$(slurmctld_pid)" ] || [ -n "$(pids_named slurmd)" ]; }; then
    say "configuration changed: restarting the daemons"
    cmd_stop
  fi
  timed start cmd_start
}

main() {
  local cmd=${1:-help}
  [ $# -eq 0 ] || shift
  case "$cmd" in
    install) timed install cmd_install ;;
    config) cmd_config ;;
    start) timed start cmd_start ;;
    ensure) cmd_ensure ;;
    stop) cmd_stop ;;
    status) sinfo; squeue ;;
    help | -h | --help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

main "$@"
