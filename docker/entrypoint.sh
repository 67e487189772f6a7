#!/usr/bin/env bash
# Container entrypoint: environment variables -> one `torchrun` (elastic agent)
# that runs `python -m app.train "$@"` on NPROC_PER_NODE local workers.
#
#   <image>                      train (flags from TRAIN_* variables)
#   <image> --epochs 3 --resume  train; extra flags go to app.train
#   <image> rdzv-store           run the standalone rendezvous TCPStore
#   <image> bash | python ...    run that command instead
#
# Environment (all optional):
#   NNODES            nodes, N or MIN:MAX (default 1). With NNODES=1 and no
#                     RDZV_ENDPOINT, torchrun runs --standalone.
#   NPROC_PER_NODE    workers per node: N, gpu, cpu or auto (default 1)
#   RDZV_ENDPOINT     host:port of the rendezvous store (see `rdzv-store`)
#   RDZV_ID           rendezvous/job id shared by all nodes (default ftt).
#                     A finished job closes its rendezvous for good: use a new
#                     id per job or restart the store.
#   RDZV_BACKEND      default c10d
#   RDZV_IS_HOST      may this node host the c10d store itself? (default false:
#                     a dedicated store outlives any node)
#   RDZV_JOIN_TIMEOUT, RDZV_LAST_CALL_TIMEOUT, RDZV_READ_TIMEOUT,
#   RDZV_CLOSE_TIMEOUT, RDZV_HEARTBEAT_TIMEOUT, RDZV_KEEP_ALIVE_INTERVAL,
#   RDZV_KEEP_ALIVE_MAX_ATTEMPT   -> --rdzv-conf (seconds / counts)
#   RDZV_CONF_EXTRA   appended verbatim to --rdzv-conf (k=v,k=v)
#   MAX_RESTARTS      worker-group restarts before the node gives up (default 3)
#   MONITOR_INTERVAL  seconds between worker health checks (default 1)
#   NODE_ADDR         this node's address as seen by the other nodes. Unset: a
#                     fresh loopback address 127.a.b.c per container start
#                     (single host only; see "Node identity" below).
#   GLOO_SOCKET_IFNAME  interface for gloo; default: lo for loopback
#                     NODE_ADDR, else the interface that holds NODE_ADDR.
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE  default 1 (see below)
#   TORCHRUN_ARGS     extra torchrun flags, e.g. "--log-dir /runs/x/torchrun"
#   TRAIN_MODULE      python module to run (default app.train)
#   RDZV_STORE_PORT   port of `rdzv-store` (default 29400)
#
# Node identity. The c10d rendezvous names a node "<addr>_<pid>_<n>", where
# addr is --local-addr or else the FQDN (torch/distributed/elastic/rendezvous/
# dynamic_rendezvous.py: _NodeDescGenerator.generate). Containers on one host
# with network_mode=host share the host name, and each fresh PID namespace
# gives the agent the same pid, so two nodes get the same name, the
# rendezvous counts them as one and the job splits into separate world-size-1
# jobs. Every start of this script therefore passes a --local-addr of its own:
# NODE_ADDR if given, or else a random 127.a.b.c: the whole 127.0.0.0/8 is
# routed to `lo`, so it is also a working MASTER_ADDR for peers on this host.
set -euo pipefail

log() { echo "[entrypoint] $*" >&2; }

# --- special commands -----------------------------------------------------------
case "${1:-}" in
  rdzv-store)
    # A TCPStore server and nothing else. Nodes connect as clients
    # (is_host=false), so killing or restarting any node never takes the
    # rendezvous state down. The store binds every interface of the host.
    shift
    export RDZV_STORE_PORT=${RDZV_STORE_PORT:-29400}
    exec python -c '
import os, signal, sys
from datetime import timedelta
import torch.distributed as dist
port = int(os.environ["RDZV_STORE_PORT"])
store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                      multi_tenant=True, timeout=timedelta(seconds=60))
print(f"[rdzv-store] TCPStore listening on port {store.port}", flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    signal.pause()
'
    ;;
  "" | -*) ;;          # no args or flags: train
  *) exec "$@" ;;      # any other command (bash, python -m scripts.prepare ...)
esac

# --- torchrun arguments --------------------------------------------------------------
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
RDZV_ID=${RDZV_ID:-ftt}
RDZV_BACKEND=${RDZV_BACKEND:-c10d}
MAX_RESTARTS=${MAX_RESTARTS:-3}
MONITOR_INTERVAL=${MONITOR_INTERVAL:-1}
TRAIN_MODULE=${TRAIN_MODULE:-app.train}

# Workers get MASTER_ADDR/MASTER_PORT from the rendezvous. With the default
# TCP-store sharing, rank 0's *agent* hosts the workers' store and other agents
# cache its address across rounds (dynamic_rendezvous.py next_rendezvous:
# _bootstrap_store_info is only rebuilt when None or on a new rank 0), which
# goes stale when ranks move after a node is replaced. With 1, every round
# publishes a fresh MASTER_ADDR:MASTER_PORT and worker rank 0 hosts the store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

# Address of the network interface holding $1 (via SIOCGIFADDR), empty if none.
iface_of() {
  python - "$1" <<'EOF'
import fcntl, socket, struct, sys
want = socket.gethostbyname(sys.argv[1])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _, name in socket.if_nameindex():
    try:
        raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
    except OSError:
        continue
    if socket.inet_ntoa(raw[20:24]) == want:
        print(name)
        break
EOF
}

# Validate the trainer's flags and TRAIN_* variables once, before joining: a typo is one
# error line and exit 2 here, not a node that keeps rejoining with a config that cannot work.
if [ "$TRAIN_MODULE" = app.train ]; then
  python - "$@" <<'EOF' || exit 2
import sys
from app.config import parse
from app.errors import UserError
try:
    parse(sys.argv[1:])
except UserError as exc:
    sys.exit(f"error: {exc}")
EOF
fi

FIXED_ADDR=${NODE_ADDR:-}
# Every incarnation of this node needs a name the rendezvous has never seen: a name still
# listed as a participant of the last round makes a returning node believe it is already in
# it (dynamic_rendezvous.py, _RendezvousJoinOp: "state.complete and is_participant" -> FINISH).
new_identity() {
  if [ -z "$FIXED_ADDR" ]; then
    # Single host: a fresh 127.a.b.c; the whole 127.0.0.0/8 is routed to lo.
    read -r a b c < <(od -An -N3 -tu1 /dev/urandom)
    NODE_ADDR="127.$((a % 254 + 1)).$((b % 254 + 1)).$((c % 254 + 1))"
  else
    # A fixed address (multi-host): the name also holds the agent's pid, which a fresh PID
    # namespace makes the same at every container start; use up a random number of pids.
    NODE_ADDR=$FIXED_ADDR
    for ((i = 0; i < RANDOM % 1000; i++)); do ( : ); done
  fi
}

torchrun_args() {
  case "$NODE_ADDR" in
    127.* | localhost) : "${GLOO_SOCKET_IFNAME:=lo}" ;;   # single host: all traffic on lo
    *) : "${GLOO_SOCKET_IFNAME:=$(iface_of "$NODE_ADDR" || true)}" ;;
  esac
  [ -z "${GLOO_SOCKET_IFNAME:-}" ] || export GLOO_SOCKET_IFNAME
  args=(--nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS"
        --monitor-interval "$MONITOR_INTERVAL")
  if [ "$NNODES" = 1 ] && [ -z "$RDZV_ENDPOINT" ]; then
    args+=(--standalone)
    mode="standalone"
  else
    [ -n "$RDZV_ENDPOINT" ] || { log "ERROR: NNODES=$NNODES needs RDZV_ENDPOINT=host:port"; exit 2; }
    conf="is_host=${RDZV_IS_HOST:-false}"
    conf+=",join_timeout=${RDZV_JOIN_TIMEOUT:-600}"        # wait this long for min nodes
    conf+=",last_call_timeout=${RDZV_LAST_CALL_TIMEOUT:-2}"   # after min nodes, wait for more
    conf+=",read_timeout=${RDZV_READ_TIMEOUT:-60}"         # store operations
    conf+=",close_timeout=${RDZV_CLOSE_TIMEOUT:-30}"
    conf+=",heartbeat=${RDZV_HEARTBEAT_TIMEOUT:-5}"
    # A dead node is dropped from the rendezvous after interval * attempts seconds without a
    # heartbeat, and survivors cannot form the next round before that: torchrun's 5 s x 3 made
    # every recovery wait 15 s. One small store write per node per second costs nothing.
    conf+=",keep_alive_interval=${RDZV_KEEP_ALIVE_INTERVAL:-1}"
    conf+=",keep_alive_max_attempt=${RDZV_KEEP_ALIVE_MAX_ATTEMPT:-3}"
    [ -z "${RDZV_CONF_EXTRA:-}" ] || conf+=",$RDZV_CONF_EXTRA"
    args+=(--nnodes "$NNODES" --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "$RDZV_ENDPOINT"
           --rdzv-id "$RDZV_ID" --rdzv-conf "$conf" --local-addr "$NODE_ADDR")
    mode="nnodes=$NNODES rdzv=$RDZV_ENDPOINT id=$RDZV_ID"
  fi
  # shellcheck disable=SC2206
  [ -z "${TORCHRUN_ARGS:-}" ] || args+=(${TORCHRUN_ARGS})
}

# Has the job under RDZV_ID finished? A finished job closes its rendezvous for good, and
# torchrun then refuses every join (RendezvousClosedError): retrying cannot help.
rdzv_closed() {
  python - "$RDZV_BACKEND" "$RDZV_ENDPOINT" "$RDZV_ID" 2>/dev/null <<'EOF'
import sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
backend, endpoint, run_id = sys.argv[1:4]
params = RendezvousParameters(backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1,
                              is_host="false", read_timeout="10")
try:
    sys.exit(0 if get_rendezvous_handler(params).is_closed() else 1)
except Exception:
    sys.exit(1)      # unreachable or unknown: not known to be closed
EOF
}

new_identity
torchrun_args
if [ "$mode" = standalone ]; then
  log "node $NODE_ADDR (standalone, nproc=$NPROC_PER_NODE): torchrun -m $TRAIN_MODULE $*"
  exec torchrun "${args[@]}" -m "$TRAIN_MODULE" "$@"
fi

# Supervise torchrun instead of exec'ing it. Its agent dies when the rendezvous store goes
# away (a restarted store service, a network cut) or when it runs out of --max-restarts; the
# node then rejoins under a new identity, and the job resumes from its newest snapshot.
# `docker stop` (SIGTERM) is passed on to torchrun, which stops its workers cleanly.
REJOIN_ATTEMPTS=${REJOIN_ATTEMPTS:-10}
stopping=0 child=""
trap 'stopping=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null' TERM INT
for ((attempt = 0; ; attempt++)); do
  log "node $NODE_ADDR ($mode, nproc=$NPROC_PER_NODE, gloo_if=${GLOO_SOCKET_IFNAME:-auto}, incarnation $attempt): torchrun -m $TRAIN_MODULE $*"
  torchrun "${args[@]}" -m "$TRAIN_MODULE" "$@" &
  child=$!
  rc=0; wait "$child" || rc=$?
  while kill -0 "$child" 2>/dev/null; do   # a trapped signal interrupted the wait: wait again
    rc=0; wait "$child" || rc=$?
  done
  child=""
  # Workers of an agent that crashed may outlive it; they must not hold ports or GPUs.
  pkill -KILL -f "[-]m $TRAIN_MODULE" 2>/dev/null || true
  [ "$rc" -ne 0 ] || exit 0
  [ "$stopping" = 0 ] || exit "$rc"
  if rdzv_closed; then
    if ((attempt == 0)); then   # asked to join a job that had already finished
      log "error: job '$RDZV_ID' has finished and closed its rendezvous; continue it under a new id," \
          "e.g. RDZV_ID=$RDZV_ID-2 docker compose run --rm trainer --resume"
      exit 2
    fi
    log "job '$RDZV_ID' finished while this node was away; nothing left to join"
    exit 0
  fi
  if ((attempt + 1 >= REJOIN_ATTEMPTS)); then
    log "torchrun exited $rc; giving up after $REJOIN_ATTEMPTS incarnations"
    exit "$rc"
  fi
  log "torchrun exited $rc; rejoining as a new node in 2 s"
  sleep 2
  new_identity
  torchrun_args
done
