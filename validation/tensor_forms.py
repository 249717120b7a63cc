"""What the checkpoint holds for each linear weight: an element format's codes and scales (mxforge/formats/:
MXFP4's uint8 codes + uint8 scales), bf16, or neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from mxforge.formats import FORMATS, Prefer, format_named, stored_pair
from mxforge.safetensors_io import TensorInfo
from mxforge.validation.modules import Linear

BF16 = "bf16"  # a form: else the name of the element format (mxforge.formats) the weight is stored in
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})


def form_title(form: str) -> str:
    """A form for people: "bf16", or the element format's title ("MXFP4")."""
    return form if form == BF16 else format_named(form).title


@dataclass(slots=True)
class Stored:
    """How one linear is stored: `form` a format's name / bf16 / None (missing), and what is wrong with it."""

    linear: Linear
    form: str | None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    defect: str | None = None  # e.g. a scale with the wrong shape; None when well-formed


def stored_form(lin: Linear, infos: Mapping[str, TensorInfo], prefer: Prefer = None) -> Stored:
    """Classify the tensors stored for `lin` (`<name>.weight`, and its scales when stored in an element format);
    `prefer`: the format(s) quantization_config declares, which tell apart formats stored alike
    (mxforge.formats.declared_formats)."""
    weight = infos.get(lin.name + ".weight")
    if weight is None:
        return Stored(lin, None)
    if weight.dtype not in FLOAT_DTYPES:
        pair = stored_pair(infos, weight.name, (lin.out_features, lin.in_features), prefer)
        if pair is not None:
            return Stored(lin, pair.format.name, weight.dtype, weight.shape, pair.defect)
    defect = None
    scales = [f.scale_name(weight.name) for f in FORMATS if f.scale_name(weight.name) in infos]
    if weight.dtype not in FLOAT_DTYPES:
        stored_as = " or ".join(f"{f.title}'s {f.codes_label}" for f in FORMATS)
        defect = f"{weight.name} is {weight.dtype}, neither bf16 nor {stored_as}"
    elif weight.shape != (lin.out_features, lin.in_features):
        defect = f"{weight.name} is {weight.dtype} {list(weight.shape)}, expected {[lin.out_features, lin.in_features]}"
    elif scales:
        defect = f"{scales[0]} is stored beside an unquantized weight; the engine has no slot for it"
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
        elif form != BF16:
            fmt = format_named(form)
            text = f"{fmt.title} ({fmt.codes_label} {list(shape)})"
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
