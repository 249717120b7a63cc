"""Element formats: one registry entry per format (its package or module here), everything about it in one place.

An entry (`ElementFormat`, element.py) defines the format completely: element bits and code table, block size,
scale format and its NaN code, packing and the stored tensor names, dtypes and shapes, the QuantizationSpec Quark
writes for it into `quantization_config` (formats/quark.py builds it with Quark's own classes), which layer configs
an engine's scheme takes as it (its spec fields), and its kernels (encode and decode, bit for bit Quark's).
Everything outside this package asks the registry (`format_named`, `format_of_spec`, `stored_pairs`, an entry's
fields); no other module spells a format's facts (tests/formats/test_registry.py scans for them). Adding a format
= its module here + one line in FORMATS (docs/formats.md).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable, Mapping

from mxforge.errors import ConfigError
from mxforge.formats import fp8_block, fp8_ptpc, mxfp4, mxfp6
from mxforge.formats.element import ERROR_STATS, ElementFormat
from mxforge.safetensors_io import TensorInfo

# (block FP8 is kept from a block-FP8 source only: its entry's kept_only says why)
FORMATS: tuple[ElementFormat, ...] = (
    mxfp4.FORMAT,
    fp8_ptpc.FORMAT,
    mxfp6.E2M3_FORMAT,
    mxfp6.E3M2_FORMAT,
    fp8_block.FORMAT,
)
DEFAULT_FORMAT = FORMATS[0]  # what a recipe rule quantizes to unless it names a `format`
MXFP4 = mxfp4.FORMAT  # for the few release behaviours that are MXFP4's own (vLLM 0.30's re-quantization)
FP8_BLOCK = fp8_block.FORMAT  # what a block-FP8 source's weights kept as stored are (recipes' format "source")
# Quark schemes a recipe may name that mxforge does not write, and why (a recipe naming one is refused with it).
REFUSED_FORMATS = {
    "fp8": "Quark's fp8 scheme declares static per-tensor FP8 activation scales, which need calibration data; "
    "mxforge quantizes weights only (use 'fp8_ptpc': per-channel FP8 weights with dynamic per-token activations)",
    "mxfp4_fp8": "W4A8 (MXFP4 weights with static FP8 activations) needs calibrated activation scales; mxforge "
    "quantizes weights only (use 'mxfp4')",
    "int4_fp8": "W4A8 needs calibrated activation scales; mxforge quantizes weights only",
}

__all__ = [
    "DEFAULT_FORMAT",
    "ERROR_STATS",
    "FORMATS",
    "FP8_BLOCK",
    "MXFP4",
    "REFUSED_FORMATS",
    "ElementFormat",
    "StoredPair",
    "format_named",
    "formats_title",
    "format_of_spec",
    "stored_pair",
    "stored_pairs",
    "declared_format",
    "declared_formats",
    "layer_config_of",
    "weight_of_scale",
]


def format_named(name: str) -> ElementFormat:
    """The entry called `name` (a recipe rule's `format`).

    Raises:
        ConfigError: no such format, listing the known ones.
    """
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise ConfigError(f"unknown element format {name!r}; choose one of {', '.join(f.name for f in FORMATS)}")


def formats_title(record: str) -> str:
    """The titles of a recorded '+'-joined list of registry names ("mxfp4+fp8_ptpc" -> "MXFP4 + FP8 PTPC"; a name
    the registry does not know is shown as it is)."""
    titles = []
    for name in record.split("+"):
        try:
            titles.append(format_named(name).title)
        except ConfigError:
            titles.append(name)
    return " + ".join(titles)


def format_of_spec(spec: Mapping | None) -> ElementFormat | None:
    """The format a QuantizationSpec dict (a layer config's `weight` or `input_tensors`) names, if any."""
    return next((f for f in FORMATS if f.matches_spec(spec)), None)


def declared_format(quantization_config: Mapping | None) -> ElementFormat | None:
    """The format a Quark quantization_config's global weight spec names, if any."""
    qc = quantization_config if isinstance(quantization_config, Mapping) else {}
    layer = qc.get("global_quant_config")
    return format_of_spec(layer.get("weight")) if isinstance(layer, Mapping) else None


def layer_config_of(quantization_config: Mapping | None, module: str) -> dict | None:
    """The layer config a Quark quantization_config gives checkpoint module `module` (Quark's `_find_matched_config`:
    the first `layer_quant_config` pattern that fnmatches the name, else the global config)."""
    qc = quantization_config if isinstance(quantization_config, Mapping) else {}
    layers = qc.get("layer_quant_config")
    for pattern, config in (layers if isinstance(layers, Mapping) else {}).items():
        if isinstance(pattern, str) and fnmatch.fnmatchcase(module, pattern):
            return config if isinstance(config, dict) else None
    layer = qc.get("global_quant_config")
    return layer if isinstance(layer, dict) else None


def declared_formats(quantization_config: Mapping | None) -> Callable[[str], ElementFormat | None]:
    """Per weight name `X.weight`, the format quantization_config declares for module `X` (`layer_config_of`): what
    tells apart formats whose codes and scales are stored alike (MXFP6 E2M3 and E3M2) in a mixed checkpoint."""

    def of(weight_name: str) -> ElementFormat | None:
        config = layer_config_of(quantization_config, weight_name.removesuffix(".weight"))
        weight = config.get("weight") if config is not None else None
        return format_of_spec(weight) if isinstance(weight, Mapping) else None

    return of


Prefer = ElementFormat | Callable[[str], "ElementFormat | None"] | None


def weight_of_scale(name: str) -> str | None:
    """`X.weight` for a scale tensor's name `X.weight_scale` (any format's suffix); None for any other name."""
    for fmt in FORMATS:
        weight = name.removesuffix(fmt.scale_suffix)
        if weight != name and weight.endswith(".weight"):
            return weight
    return None


@dataclass(frozen=True)
class StoredPair:
    """A weight stored in an element format: its codes under `X.weight` and its block scales."""

    format: ElementFormat
    weight: TensorInfo
    scale: TensorInfo | None  # None: missing (a defect)
    defect: str | None = None  # what does not fit (shapes, dtypes); None when well-formed

    @property
    def shape(self) -> tuple[int, int]:
        """The `[out, in]` of the weight the codes hold."""
        return self.weight.shape[0], self.format.unpacked_inner(self.weight.shape[1])


def stored_pair(
    infos: Mapping[str, TensorInfo],
    weight_name: str,
    shape: tuple[int, int] | None = None,
    prefer: Prefer = None,
) -> StoredPair | None:
    """How `weight_name` is stored, if as an element format's codes: the one test of "codes + scales" every
    stage uses. `shape` is the weight's `[out, in]` where the caller knows it (from config.json), else the codes'
    shape implies it; where two formats' codes and scales could both fit (same dtypes and scales: MXFP6 E2M3 and
    E3M2; a weight narrower than one block), `prefer` wins: the format quantization_config declares, one for the
    whole checkpoint or per weight name (`declared_formats`). None: the weight is absent or not stored as codes
    (e.g. bf16)."""
    weight = infos.get(weight_name)
    if weight is None or not weight_name.endswith(".weight"):
        return None
    if callable(prefer):
        prefer = prefer(weight_name)
    candidates = sorted((f for f in FORMATS if f.codes_dtype == weight.dtype), key=lambda f: f != prefer)
    pairs = []
    for fmt in candidates:
        scale = infos.get(fmt.scale_name(weight_name))
        if scale is None and shape is None:
            continue  # no scale beside it, nothing says it is codes: a plain tensor of that dtype
        pairs.append(StoredPair(fmt, weight, scale, fmt.pair_defect(weight, scale, shape)))
    return next((p for p in pairs if p.defect is None), pairs[0] if pairs else None)


def stored_pairs(infos: Mapping[str, TensorInfo], prefer: Prefer = None) -> dict[str, StoredPair]:
    """Every weight of a checkpoint stored as an element format's codes with its scales beside it, by name
    (`prefer`: see stored_pair)."""
    out = {}
    for name in infos:
        pair = stored_pair(infos, name, prefer=prefer)
        if pair is not None and pair.scale is not None:
            out[name] = pair
    return out
