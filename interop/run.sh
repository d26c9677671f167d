#!/usr/bin/env bash
# Run the official MCP conformance suite against a freshly started broker.
#
#   bash interop/run.sh            # what `make interop` runs
#
# Environment (all optional):
#   INTEROP_URL          test a server that is already running (skips start/stop), e.g. http://127.0.0.1:8080/mcp
#   INTEROP_SERVER_CMD   command that starts the server; "{port}" is replaced by a free port
#                        (default: .venv/bin/mcp-broker serve --port {port} --demo)
#   INTEROP_HEALTH_PATH  readiness path polled until it returns 200 (default: /healthz)
#   INTEROP_REVISIONS    space-separated requirement sets to run (default: "2025-11-25 2026-07-28")
#   INTEROP_OUT          where results go (default: interop/.results, wiped at each run)
#   INTEROP_TOOLING      where Node 22 and the suite are installed (default: interop/.tooling)
#   INTEROP_BASELINE     baseline file (default: interop/baseline.txt)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
TOOLING="${INTEROP_TOOLING:-$HERE/.tooling}"
OUT="${INTEROP_OUT:-$HERE/.results}"
BASELINE="${INTEROP_BASELINE:-$HERE/baseline.txt}"
REVISIONS="${INTEROP_REVISIONS:-2025-11-25 2026-07-28}"
HEALTH_PATH="${INTEROP_HEALTH_PATH:-/healthz}"
SCENARIO_TIMEOUT_MS=20000     # per scenario, passed to the suite
SUITE_TIMEOUT_S=120           # hard cap for one requirement set
STARTUP_TIMEOUT_S=30          # server must be healthy within this

NODE_VERSION=22.23.3
CONFORMANCE_VERSION=0.2.0-alpha.12

PYTHON="$ROOT/.venv/bin/python"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"

log() { printf 'interop: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

# --- tooling: Node 22 + the conformance suite, pinned by tooling/package-lock.json -------------
NODE="$TOOLING/node_modules/node/bin/node"
SUITE="$TOOLING/node_modules/@modelcontextprotocol/conformance/dist/index.js"

tooling_ok() {
  [ -x "$NODE" ] && [ -f "$SUITE" ] || return 1
  [ "$("$NODE" --version 2>/dev/null)" = "v$NODE_VERSION" ] || return 1
  [ "$("$NODE" "$SUITE" --version 2>/dev/null)" = "$CONFORMANCE_VERSION" ] || return 1
  cmp -s "$HERE/tooling/package-lock.json" "$TOOLING/package-lock.json"
}

install_tooling() {
  command -v npm >/dev/null || die "npm is needed to install Node $NODE_VERSION and the conformance suite"
  log "installing Node $NODE_VERSION and @modelcontextprotocol/conformance@$CONFORMANCE_VERSION into $TOOLING"
  mkdir -p "$TOOLING"
  cp "$HERE/tooling/package.json" "$HERE/tooling/package-lock.json" "$TOOLING/"
  # The `node` package fetches its platform binary in an install script: scripts must run.
  (cd "$TOOLING" && npm ci --no-audit --no-fund --ignore-scripts=false --loglevel=error) >&2 \
    || die "npm ci failed in $TOOLING"
  tooling_ok || die "tooling still incomplete after install (node: $("$NODE" --version 2>&1 || true))"
}

tooling_ok || install_tooling

# --- server ----------------------------------------------------------------------------------
SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$SERVER_PID" 2>/dev/null; then
      log "server did not stop within 10s; killing it"
      kill -KILL -- "-$SERVER_PID" 2>/dev/null || kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
  fi
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

rm -rf "$OUT"
mkdir -p "$OUT"

free_port() {
  "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

if [ -n "${INTEROP_URL:-}" ]; then
  URL="$INTEROP_URL"
  log "testing the running server at $URL"
else
  PORT="$(free_port)"
  DEFAULT_CMD="$ROOT/.venv/bin/mcp-broker serve --port {port} --demo"
  CMD="${INTEROP_SERVER_CMD:-$DEFAULT_CMD}"
  CMD="${CMD//\{port\}/$PORT}"
  URL="http://127.0.0.1:$PORT/mcp"
  log "starting: $CMD"
  # A process group of its own, so stopping it also stops anything it spawned.
  setsid bash -c "exec $CMD" >"$OUT/server.log" 2>&1 </dev/null &
  SERVER_PID=$!
  HEALTH="http://127.0.0.1:$PORT$HEALTH_PATH"
  deadline=$((SECONDS + STARTUP_TIMEOUT_S))
  until "$PYTHON" - "$HEALTH" <<'PY' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
    sys.exit(0 if r.status == 200 else 1)
PY
  do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      tail -n 40 "$OUT/server.log" >&2 || true
      die "server exited before it became healthy (log: $OUT/server.log)"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 40 "$OUT/server.log" >&2 || true
      die "server not healthy at $HEALTH after ${STARTUP_TIMEOUT_S}s"
    fi
    sleep 0.3
  done
  log "server healthy at $HEALTH"
fi

# --- the suite -------------------------------------------------------------------------------
suite_failed=0
for rev in $REVISIONS; do
  log "running requirement set $rev against $URL"
  "$NODE" "$SUITE" list --server --requirements "$rev" >"$OUT/$rev.scenarios.txt" 2>&1 \
    || die "cannot list the scenarios of $rev (see $OUT/$rev.scenarios.txt)"
  rc=0
  timeout --kill-after=10 "$SUITE_TIMEOUT_S" \
    "$NODE" "$SUITE" server --url "$URL" --requirements "$rev" \
      --timeout "$SCENARIO_TIMEOUT_MS" -o "$OUT/$rev" >"$OUT/$rev.log" 2>&1 || rc=$?
  # 0: all required scenarios pass, 1: some fail. Anything else: the suite itself broke.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ]; then
    log "the suite exited with $rc for $rev (124 = timed out after ${SUITE_TIMEOUT_S}s); see $OUT/$rev.log"
    tail -n 20 "$OUT/$rev.log" >&2 || true
    suite_failed=1
  fi
done

if [ -n "$SERVER_PID" ] && ! kill -0 "$SERVER_PID" 2>/dev/null; then
  log "the server died during the run (log: $OUT/server.log)"
  suite_failed=1
fi
stop_server

rc=0
"$PYTHON" "$HERE/compare.py" --out "$OUT" --baseline "$BASELINE" --revisions "$REVISIONS" || rc=$?
[ "$suite_failed" -eq 0 ] || rc=1
exit "$rc"
