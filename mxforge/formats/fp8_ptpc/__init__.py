"""The FP8 PTPC entry of the format registry: FP8 E4M3 weights with one float32 scale per output channel, declared
with dynamic per-token FP8 activations (Quark 0.13's `ptpc_fp8` scheme, `PTPCFP8Scheme`: `FP8E4M3PerChannelSpec`,
weights static along `ch_axis` 0, activations dynamic along 1), as AMD's `-AttnFP8` releases store attention. Its
numerics in numerics.py, bit for bit Quark's."""

from __future__ import annotations

from mxforge.formats.element import FP32, ElementFormat, Kernels, QuarkSpec
from mxforge.formats.fp8_ptpc.numerics import (
    E4M3_VALUES,
    decode_rows,
    quantize_rows_cpu,
    quantize_torch,
    warm_cpu_kernel,
)

FORMAT = ElementFormat(
    name="fp8_ptpc",
    title="FP8 PTPC",
    element="E4M3",
    element_bits=8,
    values=E4M3_VALUES,
    block=None,  # one scale per output channel
    scale=FP32,
    codes_dtype="F8_E4M3",
    quark=QuarkSpec("FP8E4M3PerChannelSpec", "fp8_e4m3", qscheme="per_channel", ch_axis=0, input_ch_axis=1),
    kernels=Kernels(
        encode_cpu=quantize_rows_cpu, encode_torch=quantize_torch, decode=decode_rows, warm=warm_cpu_kernel
    ),
)
