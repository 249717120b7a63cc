"""The block FP8 entry of the format registry: FP8 E4M3 weights with one float32 scale per 128 x 128 tile, as
DeepSeek-V3/R1/V3.2's and GLM-5.x's FP8 releases store them (`quant_method: "fp8"`, `weight_block_size`).

mxforge never quantizes to it (`kept_only`): Quark 0.13 has no spec class that does, only its file-to-file
`keep_excluded_layers_as_original_model_state`, which keeps a block-FP8 source's excluded weights as they are: the
E4M3 codes byte for byte under `X.weight`, the source's `X.weight_scale_inv` tile scales (the factor a code is
multiplied by) byte for byte under Quark's name `X.weight_scale`, and a `layer_quant_config` entry per module with
Quark's `per_block` spec (formats/quark.py asks Quark for it). A recipe's `[[keep]]` rule with `format = "source"`
does the same (quantize/plan.py). Decoding is the source's own: code value times its tile's scale.
"""

from __future__ import annotations

import functools

from mxforge.formats.element import FP32, ElementFormat, Kernels, QuarkSpec
from mxforge.formats.fp8_ptpc.numerics import E4M3_VALUES, decode_rows

TILE = 128  # rows and columns one scale covers (DeepSeek's and GLM's weight_block_size [128, 128])
KEPT_ONLY = (
    "it is the block FP8 of DeepSeek's and GLM's FP8 releases, which mxforge keeps from such a source byte for byte "
    '(a [[keep]] rule with format = "source"); no Quark 0.13 spec quantizes to it'
)


def _not_a_target(*_args, **_kwargs) -> int:
    raise AssertionError("block FP8 is kept from a source, never encoded (ElementFormat.quantize refuses it first)")


FORMAT = ElementFormat(
    name="fp8_block",
    title="FP8 block",
    element="E4M3",
    element_bits=8,
    values=E4M3_VALUES,
    block=TILE,
    block_rows=TILE,
    scale=FP32,
    codes_dtype="F8_E4M3",
    # Quark's per_block weights, declared with dynamic FP8 activations in groups of one tile's width
    quark=QuarkSpec(None, "fp8_e4m3", qscheme="per_block", input_qscheme="per_group", input_group_size=TILE),
    kernels=Kernels(
        encode_cpu=_not_a_target, encode_torch=_not_a_target, decode=functools.partial(decode_rows, block=TILE)
    ),
    kept_only=KEPT_ONLY,
)
