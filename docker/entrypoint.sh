#!/usr/bin/env bash
# Container entrypoint: one node of a training job = one launcher (app/launch.py: torchrun's agent,
# or for one standalone process its own) running `python -m app.train "$@"` on NPROC local workers,
# supervised so that the node rejoins.
#
#   <image>                      train (flags from TRAIN_* variables)
#   <image> --epochs 3 --resume  train; extra flags go to app.train
#   <image> rdzv-store           run the standalone rendezvous store (python -m app.node store)
#   <image> object-store         run the snapshots' S3 object store (python -m app.node objects)
#   <image> bash | python ...    run that command instead
#
# What this script computes or checks lives in app/node.py; the shell keeps what must be
# shell: holding the GPU and CPU locks, building the torchrun command, supervising it.
#
# Environment (all optional):
#   NNODES            nodes in the job, N or MIN:MAX (default 1). With NNODES=1 and no
#                     RDZV_ENDPOINT, torchrun runs --standalone.
#   NPROC             workers per node (default: one per claimed GPU on a GPU host, else 1)
#   SPARES            warm spares beside the NODES nodes (inplace): sets TRAIN_FULL_SIZE=NODES unless given
#   NODES, GPUS       node containers on this host and the host GPUs the job may use
#                     ("" or all: every GPU); each node claims GPUS/NODES GPUs of its own,
#                     and cores/NODES cores of its own (NODES=1: every core)
#   RDZV_ENDPOINT     host:port of the rendezvous store (see `rdzv-store`)
#   RDZV_ID           rendezvous/job id shared by all nodes (default ftt). A finished job
#                     closes its rendezvous for good: use a new id per job.
#   RDZV_BACKEND      default c10d
#   RDZV_IS_HOST      may this node host the c10d store itself? (default false: a
#                     dedicated store outlives any node)
#   RDZV_CONF_EXTRA   more --rdzv-conf pairs, appended verbatim
#   Fault timings (MAX_RESTARTS, MONITOR_INTERVAL, RDZV_LAST_CALL_TIMEOUT, REJOIN_ATTEMPTS, ...):
#                     defaults and meanings in app/core/policy.py, the one owner; each
#                     variable set here overrides its default
#   NODE_ADDR         this node's address as the other nodes reach it. Unset: a fresh
#                     loopback address 127.a.b.c per start (single host only).
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME   default: lo for a loopback NODE_ADDR, else the
#                     interface that holds NODE_ADDR
#   TORCHRUN_ARGS     extra torchrun flags, e.g. "--log-dir /runs/torchrun"
#   TRAIN_MODULE      python module to run (default app.train)
#   TRAIN_FT          elastic (the default when unset; compose.cpu.yaml sets inplace on hosts without
#                     GPUs), torchft or inplace: in the last two this node is started
#                     standalone and meets the others at TRAIN_LIGHTHOUSE (torchft) or in the
#                     store at TRAIN_GROUP_STORE (inplace); see compose.yaml
set -euo pipefail

log() { echo "[entrypoint] $*" >&2; }

case "${1:-}" in
  rdzv-store) exec python -m app.node store ;;
  object-store) exec python -m app.node objects ;;
  "" | -*) ;;          # no args or flags: train
  *) exec "$@" ;;      # any other command (bash, python -m scripts.prepare ...)
esac

NNODES=${NNODES:-1}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
RDZV_ID=${RDZV_ID:-ftt}
RDZV_BACKEND=${RDZV_BACKEND:-c10d}
TRAIN_MODULE=${TRAIN_MODULE:-app.train}
# With 1, every rendezvous round publishes a fresh MASTER_ADDR:MASTER_PORT and worker rank 0
# hosts the workers' store; with the default sharing, agents keep using rank 0's *agent* store
# across rounds, which goes stale when ranks move after a node is replaced (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

# Warm spares (compose.yaml's service spare, SPARES=N): the job trains on NODES nodes, and every node
# beyond them, of either service, waits as a spare (the trainer's --full-size, inplace mode).
if [ "${SPARES:-0}" != 0 ] && [ -z "${TRAIN_FULL_SIZE:-}" ]; then
  export TRAIN_FULL_SIZE=${NODES:-2}
fi

# A typo in the trainer's flags is one error line here, not a node that keeps rejoining.
if [ "$TRAIN_MODULE" = app.train ]; then
  python -m app.node check-config "$@" || exit 2
fi

# Locks shared by the node containers of this host (in the run directory they share): take_locks
# DIR WANT KIND ID... holds DIR/KIND-ID for WANT of the ids and sets held (the ids) and fds (their
# descriptors, kept open for the node's life); with fewer free it lets go of all and fails. The
# kernel drops a lock the moment its holder dies, so a killed node never leaks what it held.
take_locks() {
  local dir=$1 want=$2 kind=$3 fd id
  shift 3
  held=() fds=()
  mkdir -p "$dir"
  for id in "$@"; do
    exec {fd}>"$dir/$kind-$id"
    if flock -n "$fd"; then held+=("$id") fds+=("$fd"); else exec {fd}>&-; fi
    [ "${#held[@]}" -lt "$want" ] || return 0
  done
  for fd in "${fds[@]}"; do exec {fd}>&-; done
  held=() fds=()
  return 1
}

# GPUs: each node holds a lock per GPU it uses; a node that starts (again) takes GPUs that no
# running node holds, waiting up to a minute for enough of them to be free.
# A node of one GPU in a job with spares (TRAIN_FULL_SIZE) claims none here: its training process
# claims one when the job names it and gives it back while it waits (app/cluster/gpus.py, GpuClaim),
# seeing every GPU the job may use; a node of several GPUs keeps its claim for its life (its own NCCL
# group is bound to them).
claim_gpus() {
  local plan want ids held fds try locks
  plan=$(python -m app.node gpus) || exit 2
  read -r want ids <<<"$plan"
  [ "$want" -gt 0 ] || return 0
  locks="${TRAIN_RUN_DIR:-/runs}/.gpu-locks/$(hostname)"
  if [ "${TRAIN_FULL_SIZE:-0}" != 0 ] && [ "$want" = 1 ]; then
    NODE_GPUS=$(tr ' ' , <<<"$ids")
    export NODE_GPU_LOCKS=$locks NODE_GPU_CLAIM=1 CUDA_VISIBLE_DEVICES=$NODE_GPUS CUDA_DEVICE_ORDER=PCI_BUS_ID
    NODE_GPUS="when-named:$NODE_GPUS"   # the first line's word: one claimed when the job names the node
    [ -n "${NPROC:-}" ] || [ ! -e /dev/nvidiactl ] || NPROC=1
    return 0
  fi
  for ((try = 0; try < 60; try++)); do
    # shellcheck disable=SC2086
    if take_locks "$locks" "$want" gpu $ids; then
      NODE_GPUS=$(IFS=,; echo "${held[*]}")
      export NODE_GPUS CUDA_VISIBLE_DEVICES=$NODE_GPUS CUDA_DEVICE_ORDER=PCI_BUS_ID
      [ -n "${NPROC:-}" ] || [ ! -e /dev/nvidiactl ] || NPROC=$want
      return 0
    fi
    sleep 1
  done
  log "error: no $want free GPUs among $ids: all are held by running nodes of this host"
  exit 2
}

# CPUs: the same way, a node holds a lock per core it runs on (cores/NODES of them) and runs on
# those only, so the nodes of a host never share a core. A node that finds too few free (more node
# containers than NODES, e.g. one added by a scale-up) runs on every core instead, without waiting:
# its processes still take only their share of each (app/cluster/cores.py counts every training process of
# the host), and the processes of a node divide its cores among themselves the same way.
# A node of a job with spares (TRAIN_FULL_SIZE) claims none here: its training processes claim their
# part when the job names them and give it back when they wait (app/cluster/cores.py, CoreClaim), so
# a spare that joins takes the cores of the node it replaces.
claim_cpus() {
  local plan want ids held fds locks="${TRAIN_RUN_DIR:-/runs}/.cpu-locks/$(hostname)"
  plan=$(python -m app.node cpus) || exit 2
  read -r want ids <<<"$plan"
  [ "$want" -gt 0 ] || return 0
  if [ "${TRAIN_FULL_SIZE:-0}" != 0 ]; then
    export NODE_CORE_LOCKS=$locks NODE_CORE_CLAIM=$want
    NODE_CPUS="$want, claimed when named"
    return 0
  fi
  # shellcheck disable=SC2086
  if ! take_locks "$locks" "$want" cpu $ids; then
    log "fewer than $want of the cores $ids are free (more nodes than NODES=$NODES): this node runs on all of them"
    return 0
  fi
  NODE_CPUS=$(IFS=,; echo "${held[*]}")
  export NODE_CPUS
  taskset -pc "$NODE_CPUS" $$ >/dev/null    # this shell, and so every process it starts from now on
}

# Every start of this node takes a fresh address on a single host (all of 127.0.0.0/8 is `lo`),
# which also tells the nodes apart in logs; NODE_ADDR is kept fixed on multi-host setups. The
# rendezvous name of each start is new either way (python -m app.launch).
new_address() {
  if [ -z "$FIXED_ADDR" ]; then
    read -r a b c < <(od -An -N3 -tu1 /dev/urandom)
    NODE_ADDR="127.$((a % 254 + 1)).$((b % 254 + 1)).$((c % 254 + 1))"
  fi
  export NODE_ADDR     # the trainer records it in metrics.jsonl's start row
  case "$NODE_ADDR" in
    127.* | localhost) iface=lo ;;
    *) iface=$(python -m app.node iface "$NODE_ADDR" || true) ;;
  esac
  [ -z "$iface" ] || export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$iface} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$iface}
}

# python -m app.launch is torchrun with the fault policy's timings and restarts (app/launch.py).
torchrun_args() {
  args=(--nproc-per-node "${NPROC:-1}")
  if [ "$NNODES" = 1 ] && [ -z "$RDZV_ENDPOINT" ]; then
    args+=(--standalone)
    mode="standalone"
  else
    [ -n "$RDZV_ENDPOINT" ] || { log "error: NNODES=$NNODES needs RDZV_ENDPOINT=host:port"; exit 2; }
    conf="is_host=${RDZV_IS_HOST:-false}${RDZV_CONF_EXTRA:+,$RDZV_CONF_EXTRA}"
    args+=(--nnodes "$NNODES" --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "$RDZV_ENDPOINT"
           --rdzv-id "$RDZV_ID" --rdzv-conf "$conf" --local-addr "$NODE_ADDR")
    mode="nnodes=$NNODES rdzv=$RDZV_ENDPOINT id=$RDZV_ID"
  fi
  # shellcheck disable=SC2206
  [ -z "${TORCHRUN_ARGS:-}" ] || args+=(${TORCHRUN_ARGS})
}

FIXED_ADDR=${NODE_ADDR:-}
claim_gpus
claim_cpus
new_address
# torchft and inplace modes: this node is its own standalone launch; the nodes meet at the
# Lighthouse (torchft) or in the group store (inplace; both compose.yaml), not in a rendezvous, and
# a node that comes back copies the live state from another (docs/survivor-modes.md).
if [ "${TRAIN_FT:-elastic}" != elastic ]; then
  NNODES=1 RDZV_ENDPOINT=""
  export FT_REPLICA_ID=${FT_REPLICA_ID:-node-$NODE_ADDR}
fi
torchrun_args
describe() {   # the node's first log line: its address, GPUs and command
  local suffix=$1; shift
  log "node $NODE_ADDR ($mode, nproc=${NPROC:-1}, gpus ${NODE_GPUS:-none}, net_if=${iface:-auto}, cpus ${NODE_CPUS:-all}$suffix):" \
      "torchrun -m $TRAIN_MODULE $*"
}
if [ "$mode" = standalone ]; then
  describe "" "$@"
  exec python -m app.launch "${args[@]}" -m "$TRAIN_MODULE" "$@"
fi

# Supervise torchrun instead of exec'ing it. Its agent dies when the rendezvous store goes away
# (a restarted store service, a network cut) or when it runs out of --max-restarts; the node then
# rejoins under a new name, and the job resumes from its newest snapshot. `docker stop` (SIGTERM)
# is passed on to torchrun, which stops its workers cleanly.
eval "$(python -m app.core.policy REJOIN_ATTEMPTS REJOIN_PAUSE)" || exit 2
# The committed step after each failed incarnation: rejoins that find none newer end the node after
# MAX_NO_PROGRESS_RESTARTS (app/progress.py). Measured after a failure only, not before the
# first start, which would cost every container start a torch import.
starts=$(mktemp)
stopping=0 child=""
trap 'stopping=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null' TERM INT
for ((attempt = 0; ; attempt++)); do
  describe ", incarnation $attempt" "$@"
  python -m app.launch "${args[@]}" -m "$TRAIN_MODULE" "$@" &
  child=$!
  rc=0; wait "$child" || rc=$?
  while kill -0 "$child" 2>/dev/null; do   # a trapped signal interrupted the wait: wait again
    rc=0; wait "$child" || rc=$?
  done
  child=""
  # Workers of an agent that crashed may outlive it; they must not hold ports or GPUs.
  pkill -KILL -f "[-]m $TRAIN_MODULE" 2>/dev/null || true
  [ "$rc" -ne 0 ] || exit 0
  [ "$rc" -ne 2 ] || exit 2     # bad input (app/launch.py said which): rejoining cannot help
  [ "$rc" -ne 3 ] || exit 3     # the agent's restarts made no progress (app/launch.py said so)
  [ "$stopping" = 0 ] || exit "$rc"
  if [ "$rc" -eq 4 ]; then      # the job has finished and closed its rendezvous (app/launch.py)
    ((attempt > 0)) || exit 2   # asked to join a finished job: app/launch.py said so in one line
    log "job '$RDZV_ID' finished while this node was away; nothing left to join"
    exit 0
  fi
  if ((attempt + 1 >= REJOIN_ATTEMPTS)); then
    log "torchrun exited $rc; giving up after $REJOIN_ATTEMPTS incarnations"
    exit "$rc"
  fi
  python -m app.progress "$starts" "torchrun exited $rc" "$@" || exit $?
  log "torchrun exited $rc; rejoining as a new node in $REJOIN_PAUSE s"
  sleep "$REJOIN_PAUSE"
  new_address
  torchrun_args
done
