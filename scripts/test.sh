#!/usr/bin/env bash
# Sets up everything the tests need on this machine, then runs them (README's test command):
# Redis on 127.0.0.1:6379 (installed with apt-get and started when missing), Prometheus and promtool
# (installed with apt-get when missing), the Python environment in .venv with the test extras at the
# versions of constraints.txt (the image's).
# Extra arguments go to pytest (bash scripts/test.sh -k canon).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

apt_install() {
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@"
  else
    echo "apt-get not found: install $* yourself" >&2
  fi
}

log "redis"
if ! command -v redis-server >/dev/null 2>&1; then
  apt_install redis-server
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --daemonize yes --port 6379 --save "" --appendonly no
  for _ in $(seq 1 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
redis-cli -h 127.0.0.1 -p 6379 ping

log "prometheus"
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  apt_install --no-install-recommends prometheus || echo "prometheus could not be installed; its tests will say so"
fi

log "python environment"
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Every version from constraints.txt, the list the image installs from too (pip itself included; the
# project's build backend, setuptools, with --build-constraint).
.venv/bin/python -m pip install -q -c constraints.txt --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt --build-constraint constraints.txt -e ".[test]"

log "tests"
# The venv's own executables (the routers some tests start) come first on PATH.
. .venv/bin/activate
exec python -m pytest -q "$@"
