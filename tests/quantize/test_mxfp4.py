"""MXFP4 numerics compared byte for byte with AMD Quark 0.13's own file-to-file routine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxforge.errors import ConfigError, NonFiniteWeightError
from mxforge.formats import MXFP4
from mxforge.formats.mxfp4 import numerics

quark = pytest.importorskip("mxforge.formats.quark")


def quantize_mxfp4(weight, name=None, **kwargs):
    return MXFP4.quantize(weight, name=name, **kwargs)


def dequantize_mxfp4(codes, scales, inner):
    return MXFP4.dequantize(codes, scales, inner)


def quark_quantize_weight(weight):
    return quark.quark_quantize_weight(MXFP4, weight)


def _ties() -> torch.Tensor:
    """Every multiple of 1/8 in [-8, 8] (all E2M1 rounding ties and their neighbours), block amax 6."""
    values = (torch.arange(-64, 65, dtype=torch.float32) / 8).repeat(31)
    rows = values[: 31 * 128].reshape(-1, 31)
    return torch.cat([rows, torch.full((rows.shape[0], 1), 6.0)], dim=1)


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "gaussian_bf16": (0.02 * torch.randn(96, 1024, generator=g)).to(torch.bfloat16),
        "gaussian_f32": 0.02 * torch.randn(32, 512, generator=g),
        "ties_f32": _ties(),
        "ties_bf16": _ties().to(torch.bfloat16),
        "ties_halved": _ties() * 0.5,
        "all_zero_blocks": torch.cat([torch.zeros(8, 64), torch.randn(8, 64, generator=g)], dim=1).to(torch.bfloat16),
        "tiny_1e-30": (1e-30 * torch.randn(16, 64, generator=g)),
        "huge_1e30": (1e30 * torch.randn(16, 64, generator=g)).to(torch.bfloat16),
        "tiny_and_huge": torch.tensor([[1e-30] * 16 + [1e30] * 16, [1e-40] * 32, [-1e-38] * 31 + [3e38]]),
        "bf16_max": torch.full((2, 32), 3.3895e38).to(torch.bfloat16),
        "in_40_not_multiple_of_32": torch.randn(8, 40, generator=g).to(torch.bfloat16),
        "in_16_shorter_than_a_block": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "in_1000": torch.randn(5, 1000, generator=g),
    }


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: quark_quantize_weight(w) for name, w in _cases().items()}


@pytest.mark.quark
@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("path", ["default", "c_kernel", "numba_kernel", "torch"])
def test_bytes_equal_quark(name, path, references):
    from mxforge.formats.mxfp4 import _kernel as _mxfp4_kernel
    from mxforge.formats.mxfp4._native import bf16_kernel

    weight = _cases()[name]
    ref_codes, ref_scales = references[name]
    codes = torch.empty(ref_codes.shape, dtype=torch.uint8)
    scales = torch.empty(ref_scales.shape, dtype=torch.uint8)
    rows = weight.view(torch.int16).numpy() if weight.dtype == torch.bfloat16 else weight.numpy()
    if path == "default":
        codes, scales = quantize_mxfp4(weight, name)
    elif path == "c_kernel":
        if weight.dtype != torch.bfloat16:
            pytest.skip("the C kernel takes bf16 only (float32 goes to the numba kernel)")
        if bf16_kernel() is None:
            pytest.skip("no working C compiler: the numba kernel serves bf16 here")
        quark_offsets = np.zeros(1, dtype=np.int32)
        assert (
            bf16_kernel()(
                rows.ctypes.data,
                codes.numpy().ctypes.data,
                scales.numpy().ctypes.data,
                *rows.shape,
                quark_offsets.ctypes.data,
                1,
                None,
            )
            == 0
        )
    elif path == "numba_kernel":
        kernel = _mxfp4_kernel.quantize_bf16_rows if weight.dtype == torch.bfloat16 else _mxfp4_kernel.quantize_f32_rows
        assert kernel(rows, codes.numpy(), scales.numpy()) == 0
    else:
        assert numerics.quantize_torch(weight, codes, scales, torch.device("cpu")) == 0
    assert codes.dtype == scales.dtype == torch.uint8
    assert codes.shape == ref_codes.shape and scales.shape == ref_scales.shape
    assert torch.equal(scales, ref_scales), f"{(scales != ref_scales).sum()} scale bytes differ"
    assert torch.equal(codes, ref_codes), f"{(codes != ref_codes).sum()} code bytes differ"


def test_shapes_and_layout():
    codes, scales = quantize_mxfp4(torch.randn(3, 40))
    assert tuple(codes.shape) == (3, 20) and tuple(scales.shape) == (3, 2)
    # all-zero block: scale byte 1 (never 0); first element in the low nibble.
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 6.0, -1.0  # amax 6: scale 2^0 = byte 127; codes 7 (6.0) and 8|2 (-1.0)
    codes, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127]] and codes[0, 0].item() == 0xA7
    assert quantize_mxfp4(torch.zeros(2, 64))[1].tolist() == [[1, 1], [1, 1]]


def test_error_on_gaussian_weights_is_mxfp4_sized():
    w = torch.randn(256, 2048, generator=torch.Generator().manual_seed(0))
    codes, scales = quantize_mxfp4(w)
    rel = (dequantize_mxfp4(codes, scales, 2048) - w).norm() / w.norm()
    assert 0.09 < rel < 0.13


def test_refuses_non_finite_naming_tensor_and_count():
    w = torch.randn(4, 64)
    w[1, 3] = float("nan")
    w[2, 5] = float("inf")
    with pytest.raises(NonFiniteWeightError, match=r"'layers\.3\.w\.weight' holds 2 NaN/Inf"):
        quantize_mxfp4(w, "layers.3.w.weight")


@pytest.mark.quark
def test_non_finite_allowed_matches_quark():
    w = torch.randn(4, 64)
    w[1, 3] = float("nan")
    w[2, 40] = float("inf")
    codes, scales = quantize_mxfp4(w, "w", refuse_nonfinite=False)
    ref = quark_quantize_weight(w)
    assert torch.equal(codes, ref[0]) and torch.equal(scales, ref[1])


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ConfigError, match="odd"):
        quantize_mxfp4(torch.randn(2, 33))
    with pytest.raises(ConfigError, match="2-D"):
        quantize_mxfp4(torch.randn(64))
    with pytest.raises(ConfigError, match="floating-point"):
        quantize_mxfp4(torch.zeros(2, 64, dtype=torch.int32))
