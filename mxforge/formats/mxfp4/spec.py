"""MXFP4's facts: OCP MX E2M1 elements with an E8M0 scale per block of 32 (the numbers are documented in
numerics.py); the entry (`mxforge/formats/mxfp4/__init__.py`) and every kernel take them from here."""

from __future__ import annotations

from mxforge.formats.element import rounding_boundaries

BLOCK = 32  # elements per E8M0 scale (element.E8M0: OCP MX's scale; Quark gives an all-zero block byte 1)
# The E2M1 code table: bit 3 the sign, then two exponent bits (bias 1) and one mantissa bit.
E2M1_MANTISSA_BITS, E2M1_EMAX, SIGN_BIT = 1, 2, 3  # E2M1: 1 mantissa bit, largest exponent 2^2, sign in bit 3
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Where |x| / scale moves up a code: ties (0.25, 1.25, 2.5, 5) go to the even code below; (0.75, 1.75, 3.5) above.
UP_AT_OR_ABOVE = tuple(b for b, up in rounding_boundaries(E2M1_VALUES) if up)
UP_ABOVE = tuple(b for b, up in rounding_boundaries(E2M1_VALUES) if not up)
TWICE_GRID = tuple(int(2 * v) for v in E2M1_VALUES[:8])  # twice the E2M1 magnitude of codes 0..7: integers
MAX_VALUE = max(E2M1_VALUES)
ERROR_LANES = 8  # a scale rule's block error is summed in this many lanes (quantize/scale_rules.py)
