#!/usr/bin/env bash
# Idempotent set-up: a .venv in the checkout with the CPU torch wheel, mxforge (editable) and test deps.
# Re-runs pip only when pyproject.toml changed since the last successful set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.mxforge-setup
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "mxforge set-up: installing into .venv (first run takes a few minutes)" >&2
  # torch first, pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q --disable-pip-version-check 'torch==2.13.0' 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  # The ray extra too, so that the tests of `--executor ray` run; torch stays pinned in the same resolve.
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,ray]' 'torch==2.13.0' 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  .venv/bin/python -c "import torch, safetensors, huggingface_hub, mxforge.cli.main" || { echo "mxforge set-up failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
