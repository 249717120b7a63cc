#!/usr/bin/env bash
# Idempotent set-up of a development environment: a virtual environment in the checkout (.venv, or
# $MXFORGE_VENV) with torch, mxforge (editable) and the dev and ray extras. Re-runs pip only when
# pyproject.toml, this script or the settings below changed since the last successful set-up.
#
# The torch build is chosen here, not in the package metadata (which takes any build: docs/install.md).
# mxforge computes on the CPU, and PyPI's torch for Linux is a multi-GB CUDA build, so: $MXFORGE_TORCH
# (default torch==2.13.0) from PyTorch's CPU index ($MXFORGE_TORCH_INDEX; empty: none) when that index can be
# reached, else from the configured indexes (a machine with the CPU wheel on disk, as CI has, takes it from
# there). A torch already installed that meets $MXFORGE_TORCH is kept; every later step keeps it too.
#
# huggingface_hub: $MXFORGE_HUB (default: the newest 2.x, what CI tests); scripts/test_hub_versions.sh runs
# the Hub tests in a second environment with the newest 1.x.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MXFORGE_VENV:-.venv}
TORCH=${MXFORGE_TORCH:-torch==2.13.0}
TORCH_INDEX=${MXFORGE_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
HUB=${MXFORGE_HUB:-huggingface_hub>=2,<3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp=$VENV/.mxforge-setup
want=$( (cat pyproject.toml scripts/setup.sh && echo "$TORCH|$TORCH_INDEX|$HUB") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "mxforge set-up: installing into $VENV (first run takes a few minutes)" >&2
  pip() {  # pip's own exit status; the warnings this machine's pip configuration causes left out
    local rc=0
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" > "$VENV/.mxforge-pip.log" 2>&1 || rc=$?
    grep -v "is ignored: it is neither" "$VENV/.mxforge-pip.log" >&2 || true
    return $rc
  }
  index=()
  if [ -n "$TORCH_INDEX" ]; then
    if "$VENV/bin/python" - "$TORCH_INDEX" <<'EOF'; then
import socket, sys, urllib.parse
u = urllib.parse.urlsplit(sys.argv[1])
try:
    socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=5).close()
except (OSError, TypeError):
    sys.exit(1)
EOF
      index=(--extra-index-url "$TORCH_INDEX")
    else
      echo "mxforge set-up: $TORCH_INDEX cannot be reached; taking $TORCH from the configured indexes" >&2
    fi
  fi
  pip install -q "${index[@]}" "$TORCH"
  # The version pip knows it by (PyPI's CUDA build says 2.x.y, though torch.__version__ says 2.x.y+cu130).
  torch_version=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))") \
    || { echo "mxforge set-up: torch did not install ($TORCH)" >&2; exit 1; }
  # The resolve of mxforge's own requirements keeps that torch, whatever asks for another.
  echo "torch==$torch_version" > "$VENV/.mxforge-torch-constraint.txt"
  pip install -q -c "$VENV/.mxforge-torch-constraint.txt" -e '.[dev,ray]' "$HUB"
  "$VENV/bin/python" -c "import torch, safetensors, huggingface_hub, mxforge.cli.main" \
    || { echo "mxforge set-up failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
