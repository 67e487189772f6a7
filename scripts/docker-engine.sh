#!/usr/bin/env bash
# Bring up a local Docker engine and the inputs for an *offline* image build.
#
# Built for a Debian bookworm host without systemd, without a container
# registry and with internet access only to package registries:
#   - the engine is Debian's docker.io, started by hand in the background;
#   - compose v2 / buildx are not in bookworm, so their plugin binaries are
#     taken from the Debian trixie packages (static Go binaries, run fine);
#   - nothing can be pulled, so the base image is built with mmdebstrap;
#   - containers cannot reach the package registries, so Python packages are
#     downloaded on the host into a wheelhouse that the Dockerfile bind-mounts.
# Mirrors are never hard-coded: they are read from the host's apt sources and
# pip configuration at run time. Every subcommand is idempotent.
set -Eeuo pipefail

PROG=$(basename "$0")
# Any unexpected failure ends the script with one line naming the command.
trap 'echo "[$PROG] ERROR: \"$BASH_COMMAND\" failed (exit $?)" >&2' ERR
TMP_DIRS=()
cleanup() { [ ${#TMP_DIRS[@]} -eq 0 ] || rm -rf "${TMP_DIRS[@]}"; }
trap cleanup EXIT
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Tunables (environment).
FTT_BASE_IMAGE=${FTT_BASE_IMAGE:-ftt-base:bookworm}      # tag of the local base image
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/dockerd.log}          # dockerd output
DOCKERD_ARGS=${DOCKERD_ARGS:-}                            # extra dockerd flags, e.g. "--storage-driver=vfs"
DOCKER_START_TIMEOUT=${DOCKER_START_TIMEOUT:-60}          # seconds to wait for `docker info`
DOCKER_CLI_PLUGIN_DIR=${DOCKER_CLI_PLUGIN_DIR:-/usr/local/lib/docker/cli-plugins}
PLUGIN_SUITE=${PLUGIN_SUITE:-trixie}                      # Debian suite that ships compose v2 / buildx
WHEEL_PYTHON=${WHEEL_PYTHON:-3.11}                        # Python of the image (bookworm: 3.11)
REQUIREMENTS=${REQUIREMENTS:-$ROOT/requirements-image.txt}
# Packages of the base image: python + venv/pip, TLS roots, ps/pkill for
# debugging, tini as the container init.
BASE_PACKAGES=${BASE_PACKAGES:-python3,python3-venv,python3-pip,ca-certificates,procps,tini}

usage() {
  cat <<EOF
Usage: $PROG COMMAND [ARGS]

Set up a local Docker engine and offline build inputs (idempotent).

Commands:
  install          apt-get install docker.io + mmdebstrap + nftables; add the compose v2 and
                   buildx CLI plugins from Debian $PLUGIN_SUITE if missing
  start            start dockerd in the background unless an engine answers;
                   waits up to ${DOCKER_START_TIMEOUT}s (log: $DOCKERD_LOG)
  stop             stop a dockerd started by 'start'
  base-image       build $FTT_BASE_IMAGE with mmdebstrap | docker import (skipped if present)
  wheelhouse [DIR] pip download exactly the lock requirements-image.txt (hashes checked)
                   for cp${WHEEL_PYTHON/./} manylinux x86_64 into DIR (default:
                   .cache/wheelhouse; skipped when complete for this lock)
  wheelhouse-ready PYTHON [DIR]
                   exit 0 when DIR is complete for this lock and PYTHON is the image's
                   Python, so that its wheels install there (the Makefile's .venv)
  ensure [DIR]     install + start + base-image + wheelhouse
  help             this text

Environment: FTT_BASE_IMAGE, DOCKERD_LOG, DOCKERD_ARGS, DOCKER_START_TIMEOUT,
DOCKER_CLI_PLUGIN_DIR, PLUGIN_SUITE, WHEEL_PYTHON, REQUIREMENTS, BASE_PACKAGES, PYTHON.
EOF
}

# say, die, timed, proc_alive, pid_from
# shellcheck source=scripts/host-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/host-lib.sh"

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else die "need root for: $*"
  fi
}

engine_up() { docker info >/dev/null 2>&1; }

# --- apt sources --------------------------------------------------------------
# Print "URI SUITE SIGNED_BY" for every enabled deb source on this host (deb822
# *.sources and one-line *.list formats). SIGNED_BY is "-" when not given.
apt_sources() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    awk '
      function flush(  n, m, i, j, U, S) {
        if (types ~ /(^|[ \t])deb([ \t]|$)/ && enabled !~ /^[Nn][Oo]/) {
          n = split(uris, U, /[ \t]+/); m = split(suites, S, /[ \t]+/)
          for (i = 1; i <= n; i++) for (j = 1; j <= m; j++)
            if (U[i] != "" && S[j] != "") print U[i], S[j], (signed == "" ? "-" : signed)
        }
        types = uris = suites = signed = enabled = ""
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      /^[ \t]/   { next }     # continuation line (e.g. an inline key block)
      {
        key = tolower($1); val = $0; sub(/^[^:]*:[ \t]*/, "", val)
        if (key == "types:") types = val
        else if (key == "uris:") uris = val
        else if (key == "suites:") suites = val
        else if (key == "signed-by:") signed = val
        else if (key == "enabled:") enabled = val
      }
      END { flush() }' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    awk '
      $1 != "deb" { next }
      {
        signed = "-"; i = 2
        if ($2 ~ /^\[/) {               # [opt=val ...] block
          for (; i <= NF; i++) {
            if ($i ~ /^\[?signed-by=/) { s = $i; sub(/^\[?signed-by=/, "", s); sub(/\]$/, "", s); signed = s }
            if ($i ~ /\]$/) { i++; break }
          }
        }
        print $i, $(i + 1), signed
      }' "$f"
  done
}

# shellcheck source=/dev/null
codename() { . /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}"; }

# apt_source_for SUITE: first "URI SUITE SIGNED_BY" line for that suite.
apt_source_for() {
  apt_sources | awk -v s="$1" '$2 == s { print; exit }'
}

# --- install ------------------------------------------------------------------
apt_install() {
  # Keep postinst scripts from starting services (no init system here); we
  # start dockerd ourselves. Only touch policy-rc.d if nobody else owns it.
  local policy=/usr/sbin/policy-rc.d created=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
    as_root chmod 755 "$policy"
    created=1
  fi
  local rc=0
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y --no-install-recommends "$@" >/dev/null || {
    say "apt-get install failed; refreshing package lists and retrying"
    as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y --no-install-recommends "$@" >/dev/null
  } || rc=$?
  [ "$created" -eq 1 ] && as_root rm -f "$policy"
  return "$rc"
}

# Fetch compose v2 / buildx from Debian $PLUGIN_SUITE with a throw-away apt
# configuration that points at the same mirror as the host's own sources.
install_plugins() {
  local want=("$@") src uri signed tmp opts deb bin pkg
  src=$(apt_source_for "$(codename)")
  [ -n "$src" ] || die "no deb source for suite $(codename) in /etc/apt/sources*"
  read -r uri _ signed <<<"$src"
  tmp=$(mktemp -d)
  TMP_DIRS+=("$tmp")
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/parts" "$tmp/x"
  if [ "$signed" = "-" ]; then
    echo "deb $uri $PLUGIN_SUITE main" >"$tmp/sources.list"
  else
    echo "deb [signed-by=$signed] $uri $PLUGIN_SUITE main" >"$tmp/sources.list"
  fi
  opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=$tmp/parts"
        -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache"
        -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "Debug::NoLocking=1"
        -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root")  # temp dir is not _apt-readable
  apt-get "${opts[@]}" update -qq
  for pkg in "${want[@]}"; do
    (cd "$tmp" && apt-get "${opts[@]}" download -qq "$pkg")
  done
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$tmp/x"; done
  as_root mkdir -p "$DOCKER_CLI_PLUGIN_DIR"
  for pkg in "${want[@]}"; do
    bin=$(find "$tmp/x" -type f -path '*cli-plugins*' -name "$pkg" | head -n1)
    [ -n "$bin" ] || die "$pkg binary not found in the $PLUGIN_SUITE package"
    as_root install -m 0755 "$bin" "$DOCKER_CLI_PLUGIN_DIR/$pkg"
    say "installed $DOCKER_CLI_PLUGIN_DIR/$pkg from $(basename "$(ls "$tmp"/"$pkg"_*.deb)")"
  done
}

cmd_install() {
  local pkgs=() plugins=()
  command -v dockerd >/dev/null 2>&1 || pkgs+=(docker.io)
  command -v mmdebstrap >/dev/null 2>&1 || pkgs+=(mmdebstrap)
  # the chaos runner's cuts between node containers (scripts/chaos/host.py's PeerCut)
  command -v nft >/dev/null 2>&1 || pkgs+=(nftables)
  if [ "${#pkgs[@]}" -gt 0 ]; then
    say "apt-get install ${pkgs[*]}"
    apt_install "${pkgs[@]}"
  else
    say "docker.io, mmdebstrap and nftables already installed"
  fi
  command -v docker >/dev/null 2>&1 || die "no docker client after installing docker.io"
  docker compose version >/dev/null 2>&1 || plugins+=(docker-compose)
  docker buildx version >/dev/null 2>&1 || plugins+=(docker-buildx)
  if [ "${#plugins[@]}" -gt 0 ]; then
    install_plugins "${plugins[@]}"
  fi
  say "$(docker compose version 2>&1 | head -n1); buildx $(docker buildx version 2>&1 | awk '{print $2}')"
}

# --- start / stop -----------------------------------------------------------------
DOCKER_PIDFILE=/var/run/docker.pid
DOCKER_SOCK=/var/run/docker.sock


dockerd_pid() { pid_from "$DOCKER_PIDFILE" dockerd; }

cmd_start() {
  local pid waited=0
  if engine_up; then
    say "engine already running (server $(docker version -f '{{.Server.Version}}' 2>/dev/null))"
    return 0
  fi
  command -v dockerd >/dev/null 2>&1 || die "dockerd is not installed (run: $PROG install)"
  pid=$(dockerd_pid)
  if [ -z "$pid" ]; then
    # Leftovers of a daemon that died without cleaning up (the container or
    # VM was stopped): dockerd refuses to start with a live-looking pid file,
    # and a dead socket makes clients hang or fail.
    # dockerd's own containerd: a stale pid file makes dockerd wait for a
    # containerd that is gone ("timeout waiting for containerd to start").
    local cpid=/var/run/docker/containerd/containerd.pid
    as_root rm -f "$DOCKER_PIDFILE" "$DOCKER_SOCK"
    [ -n "$(pid_from "$cpid" containerd)" ] || as_root rm -f "$cpid"
    as_root mkdir -p "$(dirname "$DOCKERD_LOG")"
    echo "=== $(date -Is) $PROG start" | as_root tee -a "$DOCKERD_LOG" >/dev/null
    # setsid: the daemon must outlive this script (and the CI step) and not
    # get its terminal's signals. exec: no copy of this shell (and its traps)
    # lingers in the background.
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    # shellcheck disable=SC2086
    (exec "${sudo[@]}" setsid nohup dockerd $DOCKERD_ARGS >>"$DOCKERD_LOG" 2>&1 </dev/null) &
  fi
  while ! engine_up; do
    if [ "$waited" -ge "$DOCKER_START_TIMEOUT" ]; then
      die "Docker engine did not answer within ${DOCKER_START_TIMEOUT}s; last log lines: $(tail -n2 "$DOCKERD_LOG" 2>/dev/null | cut -c1-200 | paste -sd'|')"
    fi
    if [ "$waited" -ge 2 ] && [ -z "$(dockerd_pid)" ] && ! pgrep -x dockerd >/dev/null; then
      # pgrep: dockerd writes its pid file only after some set-up
      die "dockerd exited during start-up; last log lines: $(grep -v '^===' "$DOCKERD_LOG" 2>/dev/null | tail -n2 | cut -c1-200 | paste -sd'|')"
    fi
    sleep 1
    waited=$((waited + 1))
  done
  say "engine up after ${waited}s (server $(docker version -f '{{.Server.Version}}'), storage $(docker info -f '{{.Driver}}'), log $DOCKERD_LOG)"
}

cmd_stop() {
  local pid i
  pid=$(dockerd_pid)
  [ -n "$pid" ] || { say "no dockerd running (pid file $DOCKER_PIDFILE)"; return 0; }
  as_root kill -TERM "$pid"
  for i in $(seq 1 30); do
    kill -0 "$pid" 2>/dev/null || { say "dockerd (pid $pid) stopped"; return 0; }
    sleep 1
  done
  die "dockerd (pid $pid) did not stop within 30s"
}

# --- base image ---------------------------------------------------------------------
cmd_base_image() {
  local code main sec upd mirrors=()
  engine_up || die "Docker engine is not running (run: $PROG start)"
  if docker image inspect "$FTT_BASE_IMAGE" >/dev/null 2>&1; then
    say "base image $FTT_BASE_IMAGE already present"
    return 0
  fi
  command -v mmdebstrap >/dev/null 2>&1 || die "mmdebstrap is not installed (run: $PROG install)"
  code=$(codename)
  main=$(apt_source_for "$code" | awk '{print $1}')
  upd=$(apt_source_for "$code-updates" | awk '{print $1}')
  sec=$(apt_source_for "$code-security" | awk '{print $1}')
  [ -n "$main" ] || die "no deb source for suite $code in /etc/apt/sources*"
  mirrors+=("deb $main $code main")
  [ -z "$upd" ] || mirrors+=("deb $upd $code-updates main")
  [ -z "$sec" ] || mirrors+=("deb $sec $code-security main")
  say "building $FTT_BASE_IMAGE: mmdebstrap $code (+${BASE_PACKAGES}) | docker import"
  # minbase + the listed packages; apt caches and lists are removed by
  # mmdebstrap's cleanup. The tarball goes straight into `docker import`.
  as_root mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" \
      --format=tar "$code" - "${mirrors[@]}" |
    docker import \
      --change 'ENV LANG=C.UTF-8' \
      --change 'CMD ["/bin/bash"]' \
      - "$FTT_BASE_IMAGE" >/dev/null
  say "base image $FTT_BASE_IMAGE: $(docker image inspect -f '{{.Size}}' "$FTT_BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
}

# --- wheelhouse --------------------------------------------------------------------
pick_python() {
  local py
  for py in "${PYTHON:-}" python3; do
    [ -n "$py" ] || continue
    if command -v "$py" >/dev/null 2>&1 && "$py" -m pip --version >/dev/null 2>&1; then
      echo "$py"; return 0
    fi
  done
  die "no Python with pip found (set PYTHON=/path/to/python)"
}

# The stamp a complete wheelhouse DIR holds: the lock's hash, in a file named for the image's ABI.
stamp_of() { echo "$1/.complete-cp${WHEEL_PYTHON/./}"; }
lock_sum() { sha256sum "$REQUIREMENTS" | awk '{print $1}'; }
complete() { [ -f "$(stamp_of "$1")" ] && [ "$(cat "$(stamp_of "$1")")" = "$(lock_sum)" ]; }

cmd_wheelhouse_ready() {
  local py=$1 dir=${2:-$ROOT/.cache/wheelhouse}
  [ "$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$WHEEL_PYTHON" ] && complete "$dir"
}

cmd_wheelhouse() {
  local dir=${1:-$ROOT/.cache/wheelhouse} abi py i platforms=()
  [ -r "$REQUIREMENTS" ] || die "missing $REQUIREMENTS"
  abi=cp${WHEEL_PYTHON/./}
  mkdir -p "$dir"
  if complete "$dir"; then
    say "wheelhouse $dir complete for $abi ($(du -sh "$dir" | awk '{print $1}'))"
    return 0
  fi
  py=$(pick_python)
  # pip does not expand manylinux_2_X to older glibc tags, so list every
  # glibc from 2.17 (manylinux2014) up to 2.36 (bookworm) explicitly.
  platforms+=(--platform manylinux2014_x86_64)
  for i in $(seq 17 36); do platforms+=(--platform "manylinux_2_${i}_x86_64"); done
  # --require-hashes: every wheel must match a hash of the lock, and a package the lock
  # does not pin is an error, so the wheelhouse holds exactly the locked set. --no-cache-dir: pip's
  # cache would keep a second copy of its 3 GB (CI's disk ran out on that; .venv installs from here).
  say "pip download --require-hashes -r $(basename "$REQUIREMENTS") for $abi into $dir (uses $py and its pip config)"
  "$py" -m pip download --quiet --progress-bar off --no-cache-dir --dest "$dir" --require-hashes \
    --only-binary=:all: --implementation cp --python-version "$WHEEL_PYTHON" --abi "$abi" \
    "${platforms[@]}" -r "$REQUIREMENTS" 2>&1 |
    { grep -v 'is ignored: it is neither a file nor a directory' || true; }  # noise from file:// indexes
  lock_sum >"$(stamp_of "$dir")"
  say "wheelhouse $dir: $(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | awk '{print $1}')"
}

# --- ensure --------------------------------------------------------------------------
cmd_ensure() {
  timed install cmd_install
  timed start cmd_start
  timed base-image cmd_base_image
  timed wheelhouse cmd_wheelhouse "$@"
}

main() {
  local cmd=${1:-help}
  [ $# -eq 0 ] || shift
  case "$cmd" in
    install) timed install cmd_install ;;
    start) timed start cmd_start ;;
    stop) cmd_stop ;;
    base-image) timed base-image cmd_base_image ;;
    wheelhouse) timed wheelhouse cmd_wheelhouse "$@" ;;
    wheelhouse-ready) cmd_wheelhouse_ready "$@" || exit 1 ;;      # a plain answer: no ERROR line
    ensure) cmd_ensure "$@" ;;
    help | -h | --help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

main "$@"
