# Sourced by the host set-up scripts (scripts/docker-engine.sh, scripts/slurm-cluster.sh), which
# set PROG: their messages, step timing, and telling a daemon started by hand (pid file + name)
# from a dead one or a stranger that reused its pid.

say() { echo "[$PROG] $*"; }
# Fail with exactly one line on stderr.
die() { echo "[$PROG] ERROR: $*" >&2; exit 1; }

# timed NAME CMD...: run a step and report how long it took. (No `||` here:
# that would switch off errexit inside the step.)
timed() {
  local name=$1 start
  shift
  start=$(date +%s.%N)
  "$@"
  say "$name: done in $(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}')s"
}

# proc_alive PID NAME: PID runs NAME and is not a zombie. (A daemon killed with -9 can leave zombie
# children when nothing reaps them; kill -0 still succeeds on those.)
proc_alive() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] && [ "$(awk '{print $3}' <<<"$stat")" != Z ]
}

# pid_from FILE NAME: the pid in FILE if that process is a live NAME.
pid_from() {
  local pid
  [ -s "$1" ] || return 0
  pid=$(cat "$1")
  if proc_alive "$pid" "$2"; then echo "$pid"; fi
}
