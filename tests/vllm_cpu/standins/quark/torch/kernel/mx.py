"""Torch stand-ins for the two functions of Quark's `quark.torch.kernel.mx` that vLLM's MXFP4 emulation calls
(`vllm.model_executor.layers.quantization.utils.mxfp4_utils`): Quark's own are CUDA/HIP kernels, and vLLM's CPU
build has no other MXFP4 path.

- `dq_mxfp4(x, scale, float_dtype)`: packed E2M1 codes uint8 [..., K/2] and E8M0 scales uint8 [..., K/32] to
  float_dtype [..., K], decoded by tests/ocp_mx.py (written from the OCP MX v1.0 spec, nothing of mxforge's).
- `qdq_mxfp4(x, scale_calculation_mode)`: the dynamic MXFP4 activation fake-quantization a W4A4 layer applies to
  its input: `quantize_mxfp4` (blocks of 32 along the last dimension, Quark's "even" scale, reference/quark-mxfp4.md),
  then `dq_mxfp4`. `quantize_mxfp4` also stands in for AITER's `dynamic_mxfp4_quant`, with which vLLM 0.30
  re-quantizes a DeepSeek-V3-family MXFP4 checkpoint's excluded attention at load (vllm_cpu_standins.py).

MXFORGE_STANDIN_MISDECODE=1 decodes with the nibbles swapped: the suite's check that a wrong decode is caught.
"""

from __future__ import annotations

import os

import torch
from ocp_mx import BLOCK, E2M1_TABLE, decode_mxfp4

E2M1_GRID = E2M1_TABLE[:8]  # the magnitudes of codes 0-7 (bit 3 is the sign)
EMAX_E2M1 = 2  # the largest E2M1 exponent: 6.0 = 1.5 * 2^2


def dq_mxfp4(x: torch.Tensor, scale: torch.Tensor, float_dtype: torch.dtype) -> torch.Tensor:
    """Decode stored MXFP4 weights (nibbles swapped under MXFORGE_STANDIN_MISDECODE=1)."""
    return _decode(x, scale, float_dtype, misdecode=os.environ.get("MXFORGE_STANDIN_MISDECODE") == "1")


def _decode(x: torch.Tensor, scale: torch.Tensor, float_dtype: torch.dtype, *, misdecode: bool) -> torch.Tensor:
    codes = x.reshape(-1, x.shape[-1]).contiguous()
    scales = scale.reshape(-1, scale.shape[-1]).contiguous()
    out = decode_mxfp4(codes, scales, low_nibble_first=not misdecode)
    return out.reshape(*x.shape[:-1], x.shape[-1] * 2).to(float_dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed E2M1 codes uint8 [..., K/2] and E8M0 scales uint8 [..., K/32] of `x` [..., K] (K a multiple of 32):
    Quark's "even" scale (reference/quark-mxfp4.md: the block's amax rounded up at a mantissa >= 1.75, floor(log2)
    - 2, the byte clamped to [1, 254]), elements x / scale rounded half to even onto the E2M1 grid, saturating
    at 6, -0 stored as +0."""
    k = x.shape[-1]
    if k % BLOCK:
        raise NotImplementedError(f"stand-in MXFP4 quantization: last dimension {k} is not a multiple of {BLOCK}")
    blocks = x.float().reshape(-1, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    bits = amax.view(torch.int32) + (1 << 21)
    byte = (((bits >> 23) & 0xFF) - EMAX_E2M1).clamp(1, 254)
    scaled = blocks / torch.pow(2.0, byte.float() - 127)
    grid = E2M1_GRID.to(scaled.device)
    mids = (grid[1:] + grid[:-1]) / 2
    mag = scaled.abs().clamp(max=6.0)
    idx = torch.bucketize(mag, mids, right=True)  # the nearest grid point; at a midpoint, the upper one
    tie = (idx > 0) & (mag == mids[(idx - 1).clamp(min=0)])
    idx = torch.where(tie & (idx % 2 == 1), idx - 1, idx)  # ties to the even code
    codes = (idx | ((scaled < 0) & (idx > 0)).long() << 3).to(torch.uint8).reshape(-1, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.reshape(*x.shape[:-1], k // 2), byte.to(torch.uint8).reshape(*x.shape[:-1], k // BLOCK)


def qdq_mxfp4(x: torch.Tensor, scale_calculation_mode: str = "even") -> torch.Tensor:
    """`x` quantized to MXFP4 and decoded back, in x's dtype (dynamic activation fake-quantization)."""
    if scale_calculation_mode != "even":
        raise NotImplementedError(f"stand-in qdq_mxfp4: scale_calculation_mode {scale_calculation_mode!r}")
    codes, scales = quantize_mxfp4(x)
    # decoded right always: the misdecode check swaps the weights' nibbles only (swapping the activations' too
    # would swap both operands of every product the same way and change nothing)
    return _decode(codes, scales, x.dtype, misdecode=False)
