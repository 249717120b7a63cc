#!/usr/bin/env bash
# The README's main command: set up, then run mxforge on the embedded default (the tiny GLM-5.2 fixture).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=${MXFORGE_DEMO_DIR:-out/quickstart}
rm -rf "$out"
.venv/bin/mxforge fixture "$out/glm-5.2-tiny-bf16" --preset tiny
.venv/bin/mxforge inspect "$out/glm-5.2-tiny-bf16"
