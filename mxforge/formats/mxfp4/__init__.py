"""The MXFP4 entry of the format registry: OCP MX FP4 (E2M1 elements, an E8M0 scale per 32), as Quark 0.13's
`OCP_MXFP4Spec` writes it; its numerics in numerics.py (C, numba and torch kernels, bit for bit Quark's)."""

from __future__ import annotations

from mxforge.formats.element import E8M0, ElementFormat, Kernels, QuarkSpec
from mxforge.formats.mxfp4.numerics import decode_rows, quantize_rows_cpu, quantize_torch, warm_cpu_kernel
from mxforge.formats.mxfp4.spec import BLOCK, E2M1_VALUES

FORMAT = ElementFormat(
    name="mxfp4",
    title="MXFP4",
    element="E2M1",
    element_bits=4,
    values=E2M1_VALUES,
    block=BLOCK,
    scale=E8M0,
    codes_dtype="U8",
    quark=QuarkSpec("OCP_MXFP4Spec", "fp4"),
    kernels=Kernels(
        encode_cpu=quantize_rows_cpu, encode_torch=quantize_torch, decode=decode_rows, warm=warm_cpu_kernel
    ),
    scale_rules=True,
)
