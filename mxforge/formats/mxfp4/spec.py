"""MXFP4's facts: OCP MX E2M1 elements with an E8M0 scale per block of 32 (the numbers are documented in
numerics.py); the entry (`mxforge/formats/mxfp4/__init__.py`) and every kernel take them from here."""

from __future__ import annotations

from mxforge.formats.element import rounding_boundaries
from mxforge.formats.ocp_mx import BLOCK, ERROR_LANES, MxElement

__all__ = ["BLOCK", "E2M1", "E2M1_VALUES", "ERROR_LANES", "UP_ABOVE", "UP_AT_OR_ABOVE"]

# E2M1: bit 3 the sign, then two exponent bits (bias 1) and one mantissa bit; the OCP MX block and the scale rules'
# error lanes are every MX format's (ocp_mx.py).
E2M1 = MxElement(bits=4, mantissa_bits=1, bias=1)
E2M1_VALUES = E2M1.values  # 0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives
# Where |x| / scale moves up a code: ties (0.25, 1.25, 2.5, 5) go to the even code below; (0.75, 1.75, 3.5) above.
UP_AT_OR_ABOVE = tuple(b for b, up in rounding_boundaries(E2M1_VALUES) if up)
UP_ABOVE = tuple(b for b, up in rounding_boundaries(E2M1_VALUES) if not up)
