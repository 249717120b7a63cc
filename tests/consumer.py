"""The consumer comparison's measures, shared by every model a real consumer runs (tests/quantize/test_consumer*.py):
a fixed token batch, KL and top-1 agreement against the bf16 source at a common sharpening, and the structureless
noise reference (Gaussian noise of each format's relative RMS error on the tensors a checkpoint quantizes) whose
figures, times BOUND_FACTOR, bound a quantized checkpoint's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from ocp_mx import FORMAT_REL_RMS, module_format
from safetensors import safe_open
from safetensors.torch import save_file

BATCH, SEQ = 8, 64  # 512 positions; SEQ > the tiny fixtures' DSA index_topk, so DSA's top-k selection acts
TOKEN_SEED = 1234
SHARP_ENTROPY = 2.5  # nats: a trained LM's next-token entropy (perplexity ~12)
NOISE_DRAWS = 3  # the reference is the mean over independent draws (seeds 0, 1, 2)
BOUND_FACTOR = 2.0


def token_batch(vocab: int, pad_token_id: int) -> torch.Tensor:
    """The fixed batch of token ids, drawn below the special tokens."""
    return torch.randint(0, min(vocab, pad_token_id), (BATCH, SEQ), generator=torch.Generator().manual_seed(TOKEN_SEED))


def sharpening(logits: torch.Tensor, entropy: float = SHARP_ENTROPY) -> float:
    """The factor s for which softmax(s * logits) has the given mean entropy (bisection in log s)."""
    lo, hi = 1e-2, 1e4
    for _ in range(80):
        s = (lo * hi) ** 0.5
        logp = (logits * s).log_softmax(-1)
        if -(logp.exp() * logp).sum(-1).mean().item() > entropy:
            lo = s
        else:
            hi = s
    return (lo * hi) ** 0.5


def compare(source: torch.Tensor, other: torch.Tensor, scale: float) -> dict:
    """KL(source || other), mean over positions, at the common sharpening `scale` (and unsharpened: kl_raw),
    and top-1 agreement."""

    def kl(s: float) -> float:
        p, q = (source * s).log_softmax(-1), (other * s).log_softmax(-1)
        return (p.exp() * (p - q)).sum(-1).mean().item()

    return {"kl": kl(scale), "kl_raw": kl(1.0), "top1": (source.argmax(-1) == other.argmax(-1)).float().mean().item()}


def quantized_weight_names(ckpt: Path) -> set[str]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    return {n[: -len("_scale")] for n in index if n.endswith(".weight_scale")}


def quantized_formats(ckpt: Path) -> dict[str, str]:
    """Each quantized weight's format, as its quantization_config gives it (the spec decoder's reading)."""
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    return {n: module_format(qc, n.removesuffix(".weight")) for n in quantized_weight_names(ckpt)}


def write_noisy(source: Path, names: dict[str, str], out: Path, seed: int) -> None:
    """`source` with Gaussian noise of FORMAT_REL_RMS[format] x the tensor's RMS added to each tensor of `names`
    (tensor name -> its format)."""
    out.mkdir(parents=True)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(source / shard), framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in sorted(f.keys())}
        for n in sorted(names & tensors.keys()):
            x = tensors[n].float()
            sigma = FORMAT_REL_RMS[names[n]] * x.pow(2).mean().sqrt()
            tensors[n] = (x + sigma * torch.randn(x.shape, generator=gen)).to(torch.bfloat16)
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
    for side in ("config.json", "model.safetensors.index.json"):
        (out / side).write_bytes((source / side).read_bytes())


def top1_slack(disagreement: float, positions: int) -> float:
    """The top-1 disagreement allowed: BOUND_FACTOR x the reference's, plus two standard deviations of its
    count (Poisson) so that a head with few disagreements (the MTP layer alone: ~5 of 448) is not judged
    on one or two positions."""
    return BOUND_FACTOR * disagreement + 2 * math.sqrt(disagreement / positions)
