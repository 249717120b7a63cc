#!/usr/bin/env bash
# Lint and type check, configured in pyproject.toml ([tool.ruff], [tool.mypy]); non-zero exit on any finding.
# mypy checks the package as it installs: quantize/, fixups/, validation/ and manifests/ are mxforge.quantize,
# mxforge.fixups, mxforge.validation and mxforge.manifests (see [tool.setuptools] package-dir), so a tree of symlinks in that
# layout is checked and its paths mapped back to the checkout's in the report.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bin=${LINT_BIN:-$repo/.venv/bin}
status=0

"$bin/ruff" check || status=1
"$bin/ruff" format --check --quiet || { echo "ruff format: files above are not formatted (run: .venv/bin/ruff format .)"; status=1; }

tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/mxforge"
for entry in mxforge/*; do
  ln -s "$repo/$entry" "$tree/mxforge/"
done
for sub in quantize fixups validation manifests; do
  ln -s "$repo/$sub" "$tree/mxforge/$sub"
done
# mypy's cache stays in the checkout (ignored), so a re-run checks only what changed.
(cd "$tree" && "$bin/mypy" --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" -p mxforge) \
  | sed -E 's#^mxforge/(quantize|fixups|validation|manifests)/#\1/#'
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
