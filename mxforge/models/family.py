"""What a model family supplies to the rest of mxforge: how to read its config.json, and where its data lives.

A family has two halves: its data (names, architectures, recipes, published inventory, FP8 release format) in
manifests/models/<manifest>.family.toml, read by `load_family`, and its code (the layout class and tensor-kind
rules) in its module in mxforge/models/, which joins the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from mxforge.errors import ConfigError
from mxforge.manifest_io import load_manifest
from mxforge.models.config_names import TOP_LEVEL, ConfigNames, parse_config_names
from mxforge.models.layer_names import LINEAGE, LayerNames, parse_layer_names
from mxforge.models.layout import FP8_LAYOUTS


@dataclass(frozen=True)
class Family:
    """One model family: the architectures it covers and everything mxforge needs to know about them.

    Engine profiles (manifests/engines/*.toml) hold per-release, per-family data under `[family.<name>]`;
    a release without that table does not build this family.
    """

    name: str  # key in manifests (engine profiles, fixture presets): the model_type
    title: str  # the models, for people: "GLM-5 / 5.1 / 5.2"
    architectures: tuple[str, ...]  # config.json `architectures[0]` values
    model_types: tuple[str, ...]  # config.json `model_type` values
    layout: type  # a MoeLayout subclass, built from config.json alone
    # The stem of the family's data in manifests/models/: <manifest>.config.json (the real published config.json of
    # its reference model) and <manifest>.fixtures.toml (the fixture presets).
    manifest: str
    recipes: tuple[str, ...]  # shipped recipes for this family; the first is the default
    kind_rules: tuple[tuple[str, re.Pattern], ...]  # tensor kinds, first match wins (mxforge.models.tensor_kinds)
    inventory_source: str = ""  # where the published inventory figures come from
    # The published checkpoint's inventory, for the full-layout fixture to reproduce: tensors, parameters
    # (elements), shards, and its precision ("bf16", or "fp8-block" for 128x128 block-scaled e4m3); where only
    # the Hub's rounded figure is known, "parameters_b" (billions, to 0.01) instead of "parameters"; where only a
    # size is, "size_gb" (the checkpoint's bytes in GB, to 0.1).
    published: tuple[tuple[str, object], ...] = ()
    # The layout of the family's official FP8 release (a key of mxforge.models.layout.FP8_LAYOUTS: "block" for
    # DeepSeek-style 128x128 `weight_scale_inv`, "compressed-tensors-channel" for per-channel `weight_scale` with a
    # static `input_scale`), and the 2-D weights it keeps bf16 (a regex on the tensor name; compressed-tensors: the
    # config's `ignore` list); every other 2-D linear weight is e4m3 with its scales. "" = no FP8 release known.
    fp8_format: str = ""
    fp8_bf16_weights: str = ""
    # The quantization_config key under which a block-FP8 release lists the modules it keeps bf16 (Qwen's:
    # "modules_to_not_convert"); "" = none (DeepSeek's and GLM's list nothing).
    fp8_ignore_key: str = ""
    # Where its layers are stored (the `[layers]` table; absent: `model.layers.{layer}`, MTP layers after the
    # decoder's, as the DeepSeek-V3 lineage stores them)
    layers: LayerNames = LINEAGE
    # Where its config.json keeps the language model's fields and what it calls them (the `[config]` table; absent:
    # at the top level, under the lineage's names)
    config: ConfigNames = TOP_LEVEL

    @property
    def has_fp8_release(self) -> bool:
        return bool(self.fp8_format)

    def layout_of(self, config: Mapping[str, Any]):
        """This family's layout of config.json (built from its language model's fields, under mxforge's names).

        Raises:
            ConfigError: a required field missing or out of range, or the text config absent.
        """
        return self.layout(self.config.view(config))

    @property
    def reference_config(self) -> str:
        """The manifests path of the reference model's published config.json."""
        return f"models/{self.manifest}.config.json"

    @property
    def fixtures(self) -> str:
        """The manifests path of the fixture presets."""
        return f"models/{self.manifest}.fixtures.toml"

    @property
    def default_recipe(self) -> str:
        return self.recipes[0]

    def reference(self) -> dict:
        """The real published config.json of the family's reference model (a fresh copy)."""
        return load_manifest(self.reference_config)

    def fixture_presets(self) -> dict:
        """Fixture presets (tiny, bench, full-layout): overrides of the reference config, shard plan."""
        return load_manifest(self.fixtures)


CODE_FIELDS = ("layout", "kind_rules", "manifest")  # what the family's module supplies, not its manifest
REQUIRED_KEYS = ("name", "title", "architectures", "model_types", "recipes")
# The published inventory's figures and their types ("parameters_b": the Hub's rounded count, in billions), and
# the precisions a published checkpoint can have ("fp8-block": 128x128 block-scaled e4m3).
PUBLISHED_FIGURES: dict[str, type] = {
    "tensors": int,
    "parameters": int,
    "parameters_b": float,
    "size_gb": float,
    "shards": int,
    "precision": str,
}
PRECISIONS = ("bf16", "fp8-block")
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")  # a manifest key: engine profiles' [family.<name>], fixture presets


def family_manifest(manifest: str) -> str:
    """The manifests path of a family's data."""
    return f"models/{manifest}.family.toml"


def load_family(manifest: str, *, layout: type, kind_rules: tuple[tuple[str, re.Pattern], ...]) -> Family:
    """The family whose data is manifests/models/<manifest>.family.toml, with its code half (layout class, tensor
    kinds) from its module.

    Raises:
        ConfigError: the file is missing or malformed, or an entry is unknown, missing or of the wrong type (the
            message names the file and the entry).
    """
    relpath = family_manifest(manifest)
    return parse_family(
        load_manifest(relpath), relpath=relpath, manifest=manifest, layout=layout, kind_rules=kind_rules
    )


def parse_family(
    data: dict[str, Any],
    *,
    relpath: str,
    manifest: str,
    layout: type,
    kind_rules: tuple[tuple[str, re.Pattern], ...],
) -> Family:
    """A family from the parsed TOML of manifests/<relpath> (see `load_family`).

    Raises:
        ConfigError: an entry is unknown, missing or of the wrong type.
    """
    keys = [f.name for f in fields(Family) if f.name not in CODE_FIELDS]

    def bad(entry: str, what: str) -> ConfigError:
        return ConfigError(f"manifests/{relpath}: {entry} {what}", filename=f"manifests/{relpath}", entry=entry)

    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise bad(unknown[0], f"is not a family entry (known: {', '.join(keys)})")
    for key in REQUIRED_KEYS:
        if key not in data:
            raise bad(key, "is missing")
    values: dict[str, Any] = {}
    for key in keys:
        if key not in data:
            continue
        value = data[key]
        if key in ("architectures", "model_types", "recipes"):
            if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
                raise bad(key, "must be a non-empty list of non-empty strings")
            value = tuple(value)
        elif key == "published":
            if not isinstance(value, dict):
                raise bad(key, "must be a table")
            for figure, v in value.items():
                kind = PUBLISHED_FIGURES.get(figure)
                if kind is None:
                    raise bad(f"published.{figure}", f"is not a figure (known: {', '.join(PUBLISHED_FIGURES)})")
                if not isinstance(v, kind) or isinstance(v, bool) or (kind is str and v not in PRECISIONS):
                    what = f"one of {', '.join(PRECISIONS)}" if kind is str else f"a number ({kind.__name__})"
                    raise bad(f"published.{figure}", f"must be {what}, not {v!r}")
            value = tuple(value.items())
        elif key == "layers":
            value = parse_layer_names(value, bad)
        elif key == "config":
            value = parse_config_names(value, bad)
        elif not isinstance(value, str) or (key in REQUIRED_KEYS and not value):
            raise bad(key, "must be a non-empty string" if key in REQUIRED_KEYS else "must be a string")
        values[key] = value
    if not NAME_RE.fullmatch(values["name"]):
        raise bad("name", f"{values['name']!r} must be lower-case letters, digits and _ (it keys the manifests)")
    fp8_format, fp8_bf16 = values.get("fp8_format", ""), values.get("fp8_bf16_weights", "")
    if fp8_format and fp8_format not in FP8_LAYOUTS:
        raise bad("fp8_format", f"{fp8_format!r} is not an FP8 layout (known: {', '.join(FP8_LAYOUTS)})")
    if values.get("fp8_ignore_key") and fp8_format != "block":
        raise bad("fp8_ignore_key", 'is for a block-FP8 release (fp8_format = "block")')
    if bool(fp8_format) != bool(fp8_bf16):
        raise bad("fp8_bf16_weights" if fp8_format else "fp8_format", "must be given with the other FP8 entry")
    try:
        re.compile(fp8_bf16)
    except re.error as e:
        raise bad("fp8_bf16_weights", f"is not a regular expression ({e})") from None
    return Family(**values, layout=layout, kind_rules=kind_rules, manifest=manifest)
