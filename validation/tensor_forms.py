"""What the checkpoint holds for each linear weight: MXFP4 (uint8 codes + uint8 scales), bf16, or neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from mxforge.errors import ConfigError
from mxforge.quantize.mxfp4 import packed_shapes
from mxforge.safetensors_io import TensorInfo
from mxforge.validation.modules import Linear

MXFP4, BF16 = "mxfp4", "bf16"
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})


def mxfp4_shapes(out_features: int, in_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of `weight` (two 4-bit codes per byte) and `weight_scale` (one byte per 32) for a quantized linear
    (the quantizer's own `packed_shapes`).

    Raises:
        ConfigError: an odd in-dimension, which MXFP4 cannot pack.
    """
    return packed_shapes((out_features, in_features))


@dataclass(slots=True)
class Stored:
    """How one linear is stored: `form` MXFP4 / bf16 / None (missing), and what is wrong with it, if anything."""

    linear: Linear
    form: str | None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    defect: str | None = None  # e.g. a scale with the wrong shape; None when well-formed


def stored_form(lin: Linear, infos: Mapping[str, TensorInfo]) -> Stored:
    """Classify the tensors stored for `lin` (`<name>.weight`, `<name>.weight_scale`)."""
    weight = infos.get(lin.name + ".weight")
    if weight is None:
        return Stored(lin, None)
    scale = infos.get(lin.name + ".weight_scale")
    if weight.dtype == "U8":
        try:
            w_shape, s_shape = mxfp4_shapes(lin.out_features, lin.in_features)
        except ConfigError as e:
            return Stored(lin, MXFP4, "U8", weight.shape, f"{weight.name} is uint8, but {e}")
        defect = None
        if weight.shape != w_shape:
            defect = f"{weight.name} is uint8 {list(weight.shape)}, expected {list(w_shape)}"
        elif scale is None:
            defect = f"{lin.name}.weight_scale is missing (an MXFP4 weight needs its uint8 {list(s_shape)} scales)"
        elif scale.dtype != "U8" or scale.shape != s_shape:
            defect = f"{scale.name} is {scale.dtype} {list(scale.shape)}, expected U8 {list(s_shape)}"
        return Stored(lin, MXFP4, "U8", weight.shape, defect)
    defect = None
    if weight.dtype not in FLOAT_DTYPES:
        defect = f"{weight.name} is {weight.dtype}, neither bf16 nor MXFP4's uint8"
    elif weight.shape != (lin.out_features, lin.in_features):
        defect = f"{weight.name} is {weight.dtype} {list(weight.shape)}, expected {[lin.out_features, lin.in_features]}"
    elif scale is not None:
        defect = f"{scale.name} is stored beside an unquantized weight; the engine has no slot for it"
    return Stored(lin, BF16, weight.dtype, weight.shape, defect)


def describe_stored(items: list[Stored]) -> str:
    """'bf16 [2048, 6144] x2' / 'MXFP4 (uint8 [2048, 3072]) x16, bf16 [64, 256] x8'."""
    groups: dict[tuple, int] = {}
    for s in items:
        key = (s.form, s.dtype, s.shape)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (form, dtype, shape), n in groups.items():
        if form is None:
            text = "nothing"
        elif form == MXFP4:
            text = f"MXFP4 (uint8 {list(shape)})"
        else:
            text = f"{'bf16' if dtype == 'BF16' else dtype.lower()} {list(shape)}"
        parts.append(text + (f" x{n}" if n > 1 else ""))
    return ", ".join(parts)


def braced(names: list[str]) -> str:
    """Several names as one: `a.{gate,up}_proj`; `a.experts.{0..7}.{gate,up,down}_proj` for expert sets."""
    if len(names) == 1:
        return names[0]
    pre = _common_prefix(names)
    suf = _common_prefix([n[len(pre) :][::-1] for n in names])[::-1]
    middles = list(dict.fromkeys(n[len(pre) : len(n) - len(suf)] for n in names))
    split = [m.split(".", 1) for m in middles]
    if all(len(p) == 2 and p[0].isdigit() for p in split):
        ids = sorted({int(p[0]) for p in split})
        tails = list(dict.fromkeys(p[1] for p in split))
        tail = tails[0] if len(tails) == 1 else "{" + ",".join(tails) + "}"
        return f"{pre}{{{ids[0]}..{ids[-1]}}}.{tail}{suf}"
    return pre + "{" + ",".join(middles) + "}" + suf


def _common_prefix(names: list[str]) -> str:
    first, last = min(names), max(names)
    i = 0
    while i < min(len(first), len(last)) and first[i] == last[i]:
        i += 1
    return first[:i]
