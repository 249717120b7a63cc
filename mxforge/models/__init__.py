"""Model families: one module per family, chosen from config.json (`architectures`, then `model_type`).

Everything outside this package asks the family (`family_of`, `layout_of`); no other module names an
architecture. Adding a family = one module here (its layout and tensor kinds, joined to its data by
`load_family`) + its data in manifests/ (`models/<manifest>.family.toml`, reference config, fixture presets,
recipes) + its `[family.<name>]` tables in the engine profiles (manifests/engines/).
"""

from __future__ import annotations

from typing import Any, Mapping

from mxforge.errors import ConfigError
from mxforge.models import (
    deepseek_v3,
    deepseek_v32,
    glm4_moe,
    glm4_moe_lite,
    glm5_next,
    glm_moe_dsa,
    qwen3_5_moe,
    qwen3_5_moe_text,
)
from mxforge.models.family import Family
from mxforge.models.layout import MoeLayout

FAMILIES: tuple[Family, ...] = (
    glm_moe_dsa.FAMILY,
    deepseek_v3.FAMILY,
    deepseek_v32.FAMILY,
    glm4_moe.FAMILY,
    glm4_moe_lite.FAMILY,
    qwen3_5_moe.FAMILY,
    qwen3_5_moe_text.FAMILY,
    glm5_next.FAMILY,
)
DEFAULT_FAMILY = FAMILIES[0]  # what `mxforge fixture` builds unless told otherwise

__all__ = ["DEFAULT_FAMILY", "FAMILIES", "Family", "MoeLayout", "family_named", "family_of", "layout_of"]


def family_of(config: Mapping[str, Any]) -> Family:
    """The family of a config.json: by `architectures[0]`, else by `model_type`.

    Raises:
        ConfigError: neither names a supported family.
    """
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    for family in FAMILIES:
        if arch in family.architectures:
            return family
    if arch is None:
        for family in FAMILIES:
            if model_type in family.model_types:
                return family
    supported = "; ".join(f"{f.title}: {', '.join(f.architectures)}" for f in FAMILIES)
    raise ConfigError(
        f"config.json: architecture {arch!r} (model_type {model_type!r}) is not a model family mxforge "
        f"supports ({supported}); check that this is the checkpoint you meant",
        filename="config.json",
        entry="architectures",
    )


def layout_of(config: Mapping[str, Any]) -> MoeLayout:
    """The layout config.json implies, under its family's rules.

    Raises:
        ConfigError: unsupported family, or a required field missing or not an integer.
    """
    return family_of(config).layout_of(config)


def family_named(name: str) -> Family:
    """The family whose manifest key is `name` (e.g. "glm_moe_dsa").

    Raises:
        ConfigError: no such family.
    """
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ConfigError(f"unknown model family {name!r}; choose one of {', '.join(f.name for f in FAMILIES)}", entry=name)
