"""An MXFP4 decoder written from the OCP Microscaling Formats (MX) v1.0 specification, for the tests.

It shares no code with mxforge's quantizer (nothing from mxforge is imported): the consumer test uses it
to read mxforge's output as any other library would, from the format alone.

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


def check_quark_mxfp4_config(config: dict) -> None:
    """Refuse a quantization_config that is not Quark's OCP MXFP4 weight format (what this decoder reads)."""
    qc = config.get("quantization_config") or {}
    weight = (qc.get("global_quant_config") or {}).get("weight") or {}
    want = {"dtype": "fp4", "qscheme": "per_group", "group_size": BLOCK, "ch_axis": -1, "scale_format": "e8m0"}
    got = {k: weight.get(k) for k in want}
    if qc.get("quant_method") != "quark" or got != want:
        raise ValueError(f"not a Quark MXFP4 checkpoint: quant_method={qc.get('quant_method')!r}, weight spec {got}")


def decode_checkpoint(
    src: Path, dst: Path, only: Callable[[str], bool] | None = None, **decode_options
) -> dict[str, int]:
    """Write `dst`: `src` (Quark MXFP4) with every MXFP4 weight decoded to bf16 and no quantization_config,
    i.e. a plain bf16 checkpoint any loader reads. Returns counts of decoded and copied tensors.
    `decode_options` (see decode_mxfp4) apply to the weights `only` accepts (default: all); the rest decode
    by the spec.

    MXFP4 values (at most 2 significant bits times a power of two in [2^-127, 2^127]) are exact in bf16.
    """
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    check_quark_mxfp4_config(config)
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
                    options = decode_options if only is None or only(name) else {}
                    tensor = decode_mxfp4(tensor, f.get_tensor(name + "_scale"), **options).to(torch.bfloat16)
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
