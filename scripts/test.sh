#!/usr/bin/env bash
# Runs the whole otel-kvtrace test suite on a fresh machine: creates .venv, installs the package with
# its dev extra, installs headless Chromium (Debian) for the HTML report test, then runs pytest.
# Used verbatim by CI (.ci/run). Fails loudly: any failed step stops the run with a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PY" -m venv .venv
fi
echo "==> installing otel-kvtrace[dev]"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'

if ! command -v chromium >/dev/null 2>&1; then
  echo "==> installing Debian chromium (headless browser for the HTML report test)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

echo "==> running tests"
exec .venv/bin/python -m pytest -q "$@"
