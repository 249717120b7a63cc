"""The MXFP6 entries of the format registry: OCP MX FP6 (6-bit elements, an E8M0 scale per 32), E2M3 (2 exponent
bits with bias 1, 3 mantissa bits: largest 7.5) and E3M2 (3 exponent bits with bias 3, 2 mantissa bits: largest 28),
as Quark 0.13's `OCP_MXFP6E2M3Spec` / `OCP_MXFP6E3M2Spec` write them: four codes packed into three bytes, the first
in the lowest bits. The numerics are OCP MX's for any element (formats/ocp_mx.py), bit for bit Quark's."""

from __future__ import annotations

from mxforge.formats.element import E8M0, ElementFormat, QuarkSpec
from mxforge.formats.ocp_mx import BLOCK, MxElement, mx_kernels

E2M3 = MxElement(bits=6, mantissa_bits=3, bias=1)
E3M2 = MxElement(bits=6, mantissa_bits=2, bias=3)


def _entry(name: str, title: str, element: str, mx: MxElement, spec_class: str, dtype: str) -> ElementFormat:
    return ElementFormat(
        name=name,
        title=title,
        element=element,
        element_bits=mx.bits,
        values=mx.values,
        block=BLOCK,
        scale=E8M0,
        codes_dtype="U8",
        quark=QuarkSpec(spec_class, dtype),
        kernels=mx_kernels(mx),
        scale_rules=True,
    )


E2M3_FORMAT = _entry("mxfp6_e2m3", "MXFP6 E2M3", "E2M3", E2M3, "OCP_MXFP6E2M3Spec", "fp6_e2m3")
E3M2_FORMAT = _entry("mxfp6_e3m2", "MXFP6 E3M2", "E3M2", E3M2, "OCP_MXFP6E3M2Spec", "fp6_e3m2")
