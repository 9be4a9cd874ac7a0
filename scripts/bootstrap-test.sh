#!/usr/bin/env bash
# What the test suite needs besides Python, checked (and brought up) before it runs, by `make test` and
# by .ci/run alike: redis-server and redis-cli (a Redis on 127.0.0.1:6379 is started when none answers),
# haproxy (the L4 balancer in front of gateway replicas), Debian's chromium and chromium-driver (the
# console's browser tests), kubectl (its built-in kustomize renders deploy/k8s), Debian's postgresql
# (initdb and postgres for the throwaway clusters of the ledger's PostgreSQL tests; none is started here).
#
# Nothing is skipped silently: anything missing stops here at once with the one command that installs
# it, and the suite then runs with TOKENWAY_REQUIRE_REDIS=1 / TOKENWAY_REQUIRE_BROWSER=1 /
# TOKENWAY_REQUIRE_POSTGRES=1, so a test
# whose real part is gone fails instead of skipping.
#
#   scripts/bootstrap-test.sh            check; start Redis if it is installed but not running
#   scripts/bootstrap-test.sh --install  the same, installing what is missing with apt-get first (CI, as root)
set -euo pipefail

log() { echo "[bootstrap] $*"; }

install=0
[ "${1:-}" = "--install" ] && install=1

CHROMIUM="${TOKENWAY_CHROMIUM:-/usr/bin/chromium}"
CHROMEDRIVER="${TOKENWAY_CHROMEDRIVER:-/usr/bin/chromedriver}"
REDIS_HOST=127.0.0.1
REDIS_PORT=6379

# The Debian packages of whatever is missing, one per missing part.
missing() {
  local pkgs=()
  command -v redis-server >/dev/null 2>&1 || pkgs+=(redis-server)
  command -v redis-cli >/dev/null 2>&1 || pkgs+=(redis-tools)
  command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || pkgs+=(haproxy)
  [ -x "$CHROMIUM" ] || pkgs+=(chromium)
  [ -x "$CHROMEDRIVER" ] || pkgs+=(chromium-driver)
  command -v kubectl >/dev/null 2>&1 || pkgs+=(kubectl)
  compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || pkgs+=(postgresql) # tests/support/postgres.py
  echo "${pkgs[*]:-}"
}

need="$(missing)"
if [ -n "$need" ] && [ "$install" = 1 ]; then
  log "installing $need"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # shellcheck disable=SC2086
  apt-get install -y -q $need >/dev/null
  need="$(missing)"
fi
if [ -n "$need" ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo "
  echo "[bootstrap] the test suite needs what is not installed here: $need" >&2
  echo "[bootstrap] fix it with:" >&2
  echo "    ${sudo}apt-get install -y $need" >&2
  exit 1
fi

if ! redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping >/dev/null 2>&1; then
  log "starting redis-server on $REDIS_HOST:$REDIS_PORT (no persistence)"
  (cd "${TMPDIR:-/tmp}" && redis-server --bind "$REDIS_HOST" --port "$REDIS_PORT" --save '' --appendonly no --daemonize yes >/dev/null)
  for _ in $(seq 1 100); do
    redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
    sleep 0.1
  done
fi
if ! redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; then
  echo "[bootstrap] Redis does not answer on $REDIS_HOST:$REDIS_PORT (is the port taken by something else?)" >&2
  echo "[bootstrap] fix it with:" >&2
  echo "    redis-server --bind $REDIS_HOST --port $REDIS_PORT --save '' --appendonly no --daemonize yes" >&2
  exit 1
fi
log "ready: Redis answers on $REDIS_HOST:$REDIS_PORT; haproxy, chromium + chromedriver, kubectl, postgresql installed"
