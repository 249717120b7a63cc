#!/usr/bin/env bash
# The loopback-Hub suite on the other huggingface_hub major: mxforge supports huggingface_hub 1.x (>= 1.31)
# and 2.x; .venv (scripts/setup.sh, what CI tests) has the newest 2.x, so this builds a second environment,
# .venv-hub1, with the newest 1.x (the same set-up otherwise) and runs there every test that talks to a Hub:
# tests/hub/, tests/run/ and the families' tests that push and pull. Extra arguments go to pytest
# (e.g. -m "not slow" for the quick part, -x to stop at the first failure).
#   MXFORGE_HUB=...   another requirement for the second environment (default: huggingface_hub>=1.31,<2)
set -euo pipefail
cd "$(dirname "$0")/.."
export MXFORGE_VENV=.venv-hub1
export MXFORGE_HUB=${MXFORGE_HUB:-huggingface_hub>=1.31,<2}
bash scripts/setup.sh
"$MXFORGE_VENV/bin/python" -c "import huggingface_hub; print('huggingface_hub', huggingface_hub.__version__)"
exec "$MXFORGE_VENV/bin/python" -m pytest -q tests/hub tests/run tests/models/test_families.py "$@"
