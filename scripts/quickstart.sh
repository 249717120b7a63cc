#!/usr/bin/env bash
# The README's main command: set up, then run the whole pipeline on the embedded default: the tiny
# GLM-5.2 fixture served by the loopback Hub, downloaded, quantized, fixed up, validated and pushed back.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
