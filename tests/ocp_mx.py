"""MXFP4 and MXFP6 decoders written from the OCP Microscaling Formats (MX) v1.0 specification, and an FP8 PTPC decoder
written from the OCP 8-bit floating point specification (E4M3), for the tests.

It shares no code with mxforge's quantizer (nothing from mxforge is imported): the consumer test uses it
to read mxforge's output as any other library would, from the format alone.

FP8 PTPC (Quark's per-channel FP8 weights): `X.weight` float8_e4m3fn [out, in] (OCP FP8 E4M3: bit 7 sign, 4 exponent
bits with bias 7, 3 mantissa bits; exponent 0 subnormal, 2^-6 * mantissa / 8; S.1111.111 NaN, no infinities) and
`X.weight_scale` float32 [out]: element (i, j) is E4M3(code) * scale[i]. Which weights are in which format, a
reader learns from `quantization_config`: a module's layer config is the first `layer_quant_config` pattern that
fnmatches its name, else the global one (Quark's rule).

Spec (OCP MX v1.0): a block of k = 32 elements shares one scale X; element i is X * P_i.
- Elements: FP4 E2M1, bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal
  (0.5 * mantissa), otherwise 2^(e-1) * (1 + mantissa / 2). No Inf or NaN codes: max normal 6.0.
- Scale: E8M0, an unsigned 8-bit exponent with bias 127, value 2^(s-127); 0xFF is NaN.
Storage, as Quark's export writes it (reference/quark-mxfp4.md): `X.weight` uint8 [out, in/2], two E2M1
codes per byte, the first element in the LOW nibble; `X.weight_scale` uint8 [out, ceil(in/32)] along
the input dimension, the last block shorter when in is not a multiple of 32.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK = 32
E8M0_NAN = 0xFF
E8M0_BIAS = 127
# Each format's relative RMS error on Gaussian weights, the size of the noise reference the real-consumer tests
# (tests/quantize/test_consumer.py, tests/vllm_cpu) bound a checkpoint's error by: MXFP4's from
# reference/quark-mxfp4.md; FP8 PTPC's measured with torch's own float8_e4m3fn conversion of rows scaled by
# amax / 448 (0.0261-0.0265 for rows of 256-6144); MXFP6's measured with Quark's numerics (mxforge's kernels, bit for
# bit Quark's: tests/formats/test_mxfp6.py) on Gaussian rows of 256-6144, decoded here: E2M3 0.0283, E3M2 0.0528
# (tests/quantize/test_consumer.py::test_mxfp6_noise_figures_are_measured).
FORMAT_REL_RMS = {"mxfp4": 0.112, "fp8_ptpc": 0.026, "mxfp6_e2m3": 0.028, "mxfp6_e3m2": 0.053}


def e2m1_value(code: int) -> float:
    """The value of a 4-bit E2M1 code, from its sign, exponent and mantissa bits."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    magnitude = 0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


E2M1_TABLE = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float32)


def e8m0_table(bias: int = E8M0_BIAS) -> torch.Tensor:
    """The 256 E8M0 scale values (float32; 2^-127 is a float32 subnormal, exact); 0xFF is NaN."""
    values = torch.tensor([2.0 ** (s - bias) for s in range(256)], dtype=torch.float64).to(torch.float32)
    values[E8M0_NAN] = float("nan")
    return values


def decode_mxfp4(
    codes: torch.Tensor, scales: torch.Tensor, *, low_nibble_first: bool = True, scale_bias: int = E8M0_BIAS
) -> torch.Tensor:
    """float32 [out, in] from packed codes uint8 [out, in/2] and E8M0 scales uint8 [out, ceil(in/32)].

    `low_nibble_first` and `scale_bias` exist so a test can decode deliberately wrong and watch it fail.
    """
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or codes.dim() != 2 or scales.dim() != 2:
        raise ValueError(
            f"MXFP4 needs 2-D uint8 codes and scales, got {codes.dtype}{list(codes.shape)} "
            f"and {scales.dtype}{list(scales.shape)}"
        )
    rows, in_features = codes.shape[0], codes.shape[1] * 2
    blocks = -(-in_features // BLOCK)
    if scales.shape != (rows, blocks):
        raise ValueError(f"{in_features} inputs need scales [{rows}, {blocks}], got {list(scales.shape)}")
    low, high = (codes & 0x0F).long(), (codes >> 4).long()
    first, second = (low, high) if low_nibble_first else (high, low)
    elements = E2M1_TABLE[torch.stack((first, second), dim=-1).reshape(rows, in_features)]
    block_scale = e8m0_table(scale_bias)[scales.long()].repeat_interleave(BLOCK, dim=1)[:, :in_features]
    return elements * block_scale


# OCP MX v1.0's FP6 elements: (exponent bits, mantissa bits, exponent bias); bit 5 is the sign, no Inf or NaN codes.
FP6_ELEMENTS = {"e2m3": (2, 3, 1), "e3m2": (3, 2, 3)}


def fp6_value(code: int, element: str) -> float:
    """The value of a 6-bit FP6 code (E2M3: largest 7.5; E3M2: largest 28), from its sign, exponent and mantissa
    bits; exponent 0 is subnormal: 2^(1 - bias) * mantissa / 2^mantissa_bits."""
    e_bits, m_bits, bias = FP6_ELEMENTS[element]
    sign = -1.0 if code & 0b100000 else 1.0
    exponent, mantissa = (code >> m_bits) & ((1 << e_bits) - 1), code & ((1 << m_bits) - 1)
    if exponent == 0:
        return sign * 2.0 ** (1 - bias) * mantissa / 2**m_bits
    return sign * 2.0 ** (exponent - bias) * (1 + mantissa / 2**m_bits)


def decode_mxfp6(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    element: str,
    first_in_low_bits: bool = True,
    scale_bias: int = E8M0_BIAS,
) -> torch.Tensor:
    """float32 [out, in] from packed codes uint8 [out, in*3/4] and E8M0 scales uint8 [out, ceil(in/32)].

    Storage, as Quark 0.13 packs FP6 (quark/torch/utils/pack.py, Pack_fp6, whose comments draw the layout): each
    run of four codes v0..v3 along the row is one 24-bit word v0 | v1 << 6 | v2 << 12 | v3 << 18, stored as three
    bytes, least significant first. `element` is "e2m3" or "e3m2"; `first_in_low_bits` and `scale_bias` exist so a
    test can decode deliberately wrong and watch it fail.
    """
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] % 3:
        raise ValueError(f"MXFP6 needs 2-D uint8 codes of 3-byte groups, got {codes.dtype}{list(codes.shape)}")
    rows, in_features = codes.shape[0], codes.shape[1] // 3 * 4
    blocks = -(-in_features // BLOCK)
    if scales.shape != (rows, blocks):
        raise ValueError(f"{in_features} inputs need scales [{rows}, {blocks}], got {list(scales.shape)}")
    groups = codes.reshape(rows, -1, 3).long()
    word = groups[..., 0] | groups[..., 1] << 8 | groups[..., 2] << 16
    order = range(4) if first_in_low_bits else range(3, -1, -1)
    fields = torch.stack([(word >> (6 * k)) & 0x3F for k in order], dim=-1).reshape(rows, in_features)
    table = torch.tensor([fp6_value(c, element) for c in range(64)], dtype=torch.float32)
    block_scale = e8m0_table(scale_bias)[scales.long()].repeat_interleave(BLOCK, dim=1)[:, :in_features]
    return table[fields] * block_scale


def e4m3_value(code: int) -> float:
    """The value of an 8-bit OCP FP8 E4M3 code, from its sign, exponent and mantissa bits (0x7F, 0xFF: NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * 2.0**-6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


E4M3_TABLE = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float32)


def decode_fp8_ptpc(codes: torch.Tensor, scales: torch.Tensor, *, scale_factor: float = 1.0) -> torch.Tensor:
    """float32 [out, in] from float8_e4m3fn codes [out, in] and float32 per-row scales [out] (`scale_factor`: a
    deliberately wrong decode multiplies them)."""
    if codes.dtype != torch.float8_e4m3fn or codes.dim() != 2 or scales.shape != (codes.shape[0],):
        raise ValueError(
            f"FP8 PTPC needs float8_e4m3fn [out, in] and [out] scales, got {codes.dtype}{list(codes.shape)}"
        )
    return E4M3_TABLE[codes.view(torch.uint8).long()] * (scales.float() * scale_factor)[:, None]


# The weight specs this decoder reads (Quark's QuantizationSpec fields), by the name its options use.
WEIGHT_SPECS = {
    "mxfp4": {"dtype": "fp4", "qscheme": "per_group", "group_size": BLOCK, "ch_axis": -1, "scale_format": "e8m0"},
    "fp8_ptpc": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "group_size": None, "ch_axis": 0},
    **{
        f"mxfp6_{e}": {
            "dtype": f"fp6_{e}",
            "qscheme": "per_group",
            "group_size": BLOCK,
            "ch_axis": -1,
            "scale_format": "e8m0",
        }
        for e in FP6_ELEMENTS
    },
}


def _format_of(layer_config: dict | None) -> str:
    weight = (layer_config or {}).get("weight") or {}
    for name, want in WEIGHT_SPECS.items():
        if {k: weight.get(k) for k in want} == want:
            return name
    raise ValueError(f"not a weight format this decoder reads: {weight}")


def module_format(quantization_config: dict, module: str) -> str:
    """The format Quark's quantization_config gives `module`: its first fnmatch `layer_quant_config` pattern's
    layer config, else the global one."""
    import fnmatch

    for pattern, config in (quantization_config.get("layer_quant_config") or {}).items():
        if fnmatch.fnmatchcase(module, pattern):
            return _format_of(config)
    return _format_of(quantization_config.get("global_quant_config"))


def check_quark_config(config: dict) -> None:
    """Refuse a quantization_config that is not Quark's, with MXFP4, FP8 PTPC or MXFP6 weights (what this decoder
    reads)."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "quark":
        raise ValueError(f"not a Quark checkpoint: quant_method={qc.get('quant_method')!r}")
    for layer in [qc.get("global_quant_config"), *(qc.get("layer_quant_config") or {}).values()]:
        _format_of(layer)


def decode_checkpoint(
    src: Path,
    dst: Path,
    only: Callable[[str], bool] | None = None,
    fp8_options: dict | None = None,
    mxfp6_options: dict | None = None,
    **decode_options,
) -> dict[str, int]:
    """Write `dst`: `src` (Quark: MXFP4, FP8 PTPC, MXFP6 E2M3 / E3M2 per layer config) with every quantized weight
    decoded to bf16 and no quantization_config, i.e. a plain bf16 checkpoint any loader reads. Returns counts of
    decoded and copied tensors. `decode_options` (see decode_mxfp4) apply to the MXFP4 weights, `fp8_options`
    (decode_fp8_ptpc) to the FP8 PTPC ones, `mxfp6_options` (decode_mxfp6) to the MXFP6 ones, that `only` accepts
    (default: all); the rest decode by the spec.

    MXFP4 and MXFP6 values (at most 4 significant bits times a power of two in [2^-127, 2^127]) are exact in bf16; an
    FP8 PTPC value (an E4M3 value times a float32 scale) is rounded to bf16, as an engine computing in bf16 rounds it.
    """
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    check_quark_config(config)
    qc = config["quantization_config"]
    index = json.loads((src / "model.safetensors.index.json").read_text())
    dst.mkdir(parents=True)
    counts = {"decoded": 0, "copied": 0}
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        with safe_open(str(src / shard), framework="pt") as f:
            names = set(f.keys())
            for name in sorted(names):
                if name.endswith(".weight_scale") and name[: -len("_scale")] in names:
                    continue
                tensor = f.get_tensor(name)
                if name + "_scale" in names:
                    chosen = only is None or only(name)
                    scale = f.get_tensor(name + "_scale")
                    fmt = module_format(qc, name.removesuffix(".weight"))
                    if fmt == "fp8_ptpc":
                        tensor = decode_fp8_ptpc(tensor, scale, **(fp8_options or {} if chosen else {}))
                    elif fmt.startswith("mxfp6_"):
                        options = (mxfp6_options or {}) if chosen else {}
                        tensor = decode_mxfp6(tensor, scale, **{"element": fmt.removeprefix("mxfp6_"), **options})
                    else:
                        tensor = decode_mxfp4(tensor, scale, **(decode_options if chosen else {}))
                    tensor = tensor.to(torch.bfloat16)
                    counts["decoded"] += 1
                else:
                    counts["copied"] += 1
                out[name] = tensor
                weight_map[name] = shard
        save_file(out, str(dst / shard), metadata={"format": "pt"})
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    if (src / "generation_config.json").exists():
        shutil.copyfile(src / "generation_config.json", dst / "generation_config.json")
    return counts
