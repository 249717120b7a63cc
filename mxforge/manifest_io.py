"""Load the declarative data shipped in manifests/ (TOML and JSON), by relative path."""

from __future__ import annotations

import json
import tomllib
from importlib import resources
from typing import Any

from mxforge.errors import ConfigError


def manifest_text(relpath: str) -> str:
    """Text of manifests/<relpath>.

    Raises:
        ConfigError: no such manifest.
    """
    node = resources.files("mxforge.manifests").joinpath(*relpath.split("/"))
    if not node.is_file():
        raise ConfigError(f"manifests/{relpath}: no such manifest")
    return node.read_text()


def manifest_names(reldir: str, suffix: str) -> list[str]:
    """The names (without `suffix`) of the files in manifests/<reldir> that end in `suffix`, sorted."""
    node = resources.files("mxforge.manifests").joinpath(*reldir.split("/"))
    return sorted(p.name.removesuffix(suffix) for p in node.iterdir() if p.name.endswith(suffix))


def load_manifest(relpath: str) -> Any:
    """Parse manifests/<relpath> as TOML or JSON by its suffix.

    Raises:
        ConfigError: missing or malformed.
    """
    text = manifest_text(relpath)
    try:
        return json.loads(text) if relpath.endswith(".json") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"manifests/{relpath}: malformed ({e})") from None
