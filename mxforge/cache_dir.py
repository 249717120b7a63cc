"""mxforge's user cache directory, one rule for every cache it keeps (compiled kernel, Quark's config
template, Hub headers by commit, the test suite's engine wheels)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MXFORGE_CACHE"


def cache_root() -> Path:
    """$MXFORGE_CACHE, else $XDG_CACHE_HOME/mxforge, else ~/.cache/mxforge."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mxforge"
