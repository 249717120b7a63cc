"""What a model family supplies to the rest of mxforge: how to read its config.json, and where its data lives."""

from __future__ import annotations

import re
from dataclasses import dataclass


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
    # the Hub's rounded figure is known, "parameters_b" (billions, to 0.01) instead of "parameters".
    published: tuple[tuple[str, object], ...] = ()
    # The layout of the family's official FP8 release (a key of mxforge.models.layout.FP8_LAYOUTS: "block" for
    # DeepSeek-style 128x128 `weight_scale_inv`, "compressed-tensors-channel" for per-channel `weight_scale` with a
    # static `input_scale`), and the 2-D weights it keeps bf16 (a regex on the tensor name; compressed-tensors: the
    # config's `ignore` list); every other 2-D linear weight is e4m3 with its scales. "" = no FP8 release known.
    fp8_format: str = ""
    fp8_bf16_weights: str = ""

    @property
    def has_fp8_release(self) -> bool:
        return bool(self.fp8_format)

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
        from mxforge.manifest_io import load_manifest

        return load_manifest(self.reference_config)

    def fixture_presets(self) -> dict:
        """Fixture presets (tiny, bench, full-layout): overrides of the reference config, shard plan."""
        from mxforge.manifest_io import load_manifest

        return load_manifest(self.fixtures)
