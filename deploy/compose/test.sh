#!/usr/bin/env bash
# `make compose-test`: build the images, run docker-compose.yml for real (Redis, three workers,
# nginx), drive it from the host through the load balancer (deploy/compose/drive.py), and tear
# everything down, pass or fail. See deploy/compose/README.md.
#
# The Docker engine: the one `docker info` reaches (DOCKER_HOST or the default socket), else a
# dockerd of its own, started as root with its data in a temporary directory, leaving the host's
# firewall alone (no iptables rules, no docker0 bridge), stopped at the end.
# Settings (environment):
#   MCPB_BASE          base image of the broker (e.g. python:3.11-slim where a registry is reached);
#                      unset: a local Debian bookworm made with debootstrap (base.sh), reused when
#                      the engine has it already
#   MCPB_REDIS_IMAGE   Redis image (e.g. redis:7-alpine); unset: built on the base (redis.Dockerfile)
#   MCPB_NGINX_IMAGE   nginx image (e.g. nginx:1.27-alpine); unset: built on the base (nginx.Dockerfile)
#   MCPB_BASE_CACHE    a file to keep the debootstrap root file system in between runs (base.sh)
#   MCPB_DRIVE_BUDGET  seconds the driver's scenario may take (default 300; it takes about 15)
#   PY                 the Python that runs the driver (needs httpx); default .venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
PY=${PY:-$root/.venv/bin/python}
started=$(date +%s)
say() { echo "[compose-test $(($(date +%s) - started))s] $*"; }

for tool in docker timeout; do
  command -v "$tool" >/dev/null 2>&1 || { echo "compose-test: $tool is missing (apt-get install docker.io)" >&2; exit 1; }
done
if docker compose version >/dev/null 2>&1; then
  compose_cmd=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  compose_cmd=(docker-compose)
else
  echo "compose-test: neither 'docker compose' nor docker-compose (apt-get install docker-compose)" >&2
  exit 1
fi
"$PY" -c 'import httpx' 2>/dev/null || { echo "compose-test: $PY cannot import httpx (make test installs it)" >&2; exit 1; }

work=$(mktemp -d /tmp/mcpb-compose.XXXXXX)
project=mcpbtest$$
dockerd_pid=
compose_up=

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  if [ -n "$compose_up" ]; then
    if [ "$rc" != 0 ]; then
      say "failed (exit $rc): the stack as it was, and the last lines of its logs"
      timeout 30 "${compose_cmd[@]}" -p "$project" -f "$root/docker-compose.yml" ps
      timeout 60 "${compose_cmd[@]}" -p "$project" -f "$root/docker-compose.yml" logs --no-color --tail=60
    fi
    say "tearing the stack down"
    timeout 120 "${compose_cmd[@]}" -p "$project" -f "$root/docker-compose.yml" down -v --remove-orphans -t 10 \
      >"$work/down.log" 2>&1 || { cat "$work/down.log"; [ "$rc" != 0 ] || rc=1; }
    # Whatever down left of the project (a container stuck in removal): gone now.
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$project")
    [ -z "$left" ] || timeout 60 docker rm -f -v $left >/dev/null
  fi
  if [ -n "$dockerd_pid" ]; then
    say "stopping the dockerd this test started (pid $dockerd_pid)"
    kill -TERM "$dockerd_pid" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$dockerd_pid" 2>/dev/null && { say "dockerd did not stop in 30 s: SIGKILL"; kill -KILL "$dockerd_pid"; }
    wait "$dockerd_pid" 2>/dev/null
    say "dockerd stopped"
    # Mounts a killed daemon may leave under its data root, deepest first.
    awk -v w="$work/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r umount -l 2>/dev/null
    umount -l "$work/docker" 2>/dev/null
  fi
  rm -rf "$work"
  say "done in $(($(date +%s) - started)) s, exit $rc"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- the Docker engine ----------------------------------------------------------------------
if timeout 20 docker info >/dev/null 2>&1; then
  say "using the running Docker engine (${DOCKER_HOST:-default socket})"
else
  command -v dockerd >/dev/null 2>&1 || { echo "compose-test: no Docker engine runs and dockerd is missing (apt-get install docker.io)" >&2; exit 1; }
  [ "$(id -u)" = 0 ] || { echo "compose-test: no Docker engine runs, and starting one needs root" >&2; exit 1; }
  export DOCKER_HOST=unix://$work/docker.sock
  # Its images and containers in memory (about 1.5 GB at the peak): faster builds, and removing
  # them at the end is an unmount, not half a minute of deleting files. On disk if that fails.
  mkdir -p "$work/docker"
  mount -t tmpfs -o size=8g,mode=0710 mcpb-compose "$work/docker" 2>/dev/null || say "no tmpfs: the engine's data on disk"
  # Its own data, state and socket; no iptables rules and no docker0: the compose network is a
  # bridge of its own (10.215.0.0/16, nothing else here uses it), reached from the host only
  # through the published loopback port (docker-proxy); builds use the host's network.
  dockerd --data-root "$work/docker" --exec-root "$work/exec" --pidfile "$work/dockerd.pid" \
    --host "$DOCKER_HOST" --iptables=false --ip-forward=false --bridge=none \
    --default-address-pool base=10.215.0.0/16,size=24 >"$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 1 60); do timeout 5 docker info >/dev/null 2>&1 && break; sleep 0.5; done
  timeout 5 docker info >/dev/null 2>&1 || { tail -n 30 "$work/dockerd.log" >&2; echo "compose-test: dockerd did not start" >&2; exit 1; }
  say "started dockerd (pid $dockerd_pid, data in $work/docker)"
fi

# -- images -----------------------------------------------------------------------------------
base=${MCPB_BASE:-mcpb-base:bookworm}
if ! docker image inspect "$base" >/dev/null 2>&1; then
  if [ -n "${MCPB_BASE:-}" ]; then
    timeout 600 docker pull "$base"
  else
    timeout 900 "$root/deploy/compose/base.sh" "$base"
  fi
fi
export MCPB_IMAGE=mcpb-compose-test/broker:latest
say "building $MCPB_IMAGE on $base"
# The context is exactly what the Dockerfile copies (not .venv and other local files).
tar -C "$root" -c --exclude=__pycache__ --exclude='*.pyc' \
    Dockerfile pyproject.toml README.md broker broker_client workers deploy/constraints.txt \
  | timeout 900 docker build --network host --build-arg "BASE=$base" -t "$MCPB_IMAGE" - >"$work/build.log" 2>&1 \
  || { tail -n 40 "$work/build.log" >&2; echo "compose-test: the image did not build" >&2; exit 1; }
if [ -z "${MCPB_REDIS_IMAGE:-}" ]; then
  export MCPB_REDIS_IMAGE=mcpb-compose-test/redis:latest
  timeout 600 docker build --network host --build-arg "BASE=$base" -t "$MCPB_REDIS_IMAGE" - \
    < deploy/compose/redis.Dockerfile >"$work/redis-build.log" 2>&1 \
    || { tail -n 40 "$work/redis-build.log" >&2; exit 1; }
fi
if [ -z "${MCPB_NGINX_IMAGE:-}" ]; then
  export MCPB_NGINX_IMAGE=mcpb-compose-test/nginx:latest
  timeout 600 docker build --network host --build-arg "BASE=$base" -t "$MCPB_NGINX_IMAGE" - \
    < deploy/compose/nginx.Dockerfile >"$work/nginx-build.log" 2>&1 \
    || { tail -n 40 "$work/nginx-build.log" >&2; exit 1; }
fi
size() { docker image inspect -f '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1/1e6}'; }
say "images: broker $(size "$MCPB_IMAGE") (base $base $(size "$base")), redis $(size "$MCPB_REDIS_IMAGE"), nginx $(size "$MCPB_NGINX_IMAGE")"

# -- the stack --------------------------------------------------------------------------------
MCPB_PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export MCPB_PORT MCPB_BIND=127.0.0.1
say "docker-compose up (project $project, load balancer on 127.0.0.1:$MCPB_PORT)"
compose_up=1
timeout 300 "${compose_cmd[@]}" -p "$project" -f "$root/docker-compose.yml" up -d --no-build >"$work/up.log" 2>&1 \
  || { cat "$work/up.log" >&2; echo "compose-test: the stack did not come up" >&2; exit 1; }
# nginx answers once it runs; the workers were ready (/readyz) before it started.
"$PY" - "$MCPB_PORT" <<'EOF' || { echo "compose-test: the load balancer does not answer" >&2; exit 1; }
import sys, time, urllib.request
deadline = time.monotonic() + 30
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/readyz", timeout=2) as response:
            if response.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.5)
EOF
say "up: $(docker ps --filter "label=com.docker.compose.project=$project" --format '{{.Label "com.docker.compose.service"}}={{.Status}}' | sort | tr '\n' ' ')"

timeout 420 "$PY" "$root/deploy/compose/drive.py" --port "$MCPB_PORT" --project "$project" --budget "${MCPB_DRIVE_BUDGET:-300}"
