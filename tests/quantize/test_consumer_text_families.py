"""A real consumer for the families no vLLM CPU release computes here: transformers' own model classes, on CPU through
their reference PyTorch kernels, compute the target model's logits from the bf16 source and from mxforge's output
decoded by tests/ocp_mx.py (written from the OCP MX v1.0 spec, sharing nothing with mxforge). Each output must stay
within BOUND_FACTOR of a noise reference at its formats' magnitudes (tests/consumer.py, the method of
test_consumer.py); a misread decode must not.

- GLM-5.3-Flash (`Glm5NextForConditionalGeneration`: Kimi delta attention, NoPE MLA with the DSA indexer, mHC): the
  default recipe's output (MXFP4 experts) and the FP8-attention recipe's (KDA and MLA projections in FP8 PTPC).
- Qwen3.5 MoE text only (`Qwen3_5MoeForCausalLM`: gated delta nets and gated full attention, every layer MoE): the
  default recipe's output and the FP8-attention recipe's (the delta nets' and full attention's projections FP8 PTPC).
  vLLM CPU computes the multimodal family's language model (tests/vllm_cpu/); this is its text-only form.

The MTP layer is not compared: transformers builds neither family's (only the engines' drafts do).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from consumer import (
    BOUND_FACTOR,
    NOISE_DRAWS,
    compare,
    quantized_formats,
    sharpening,
    token_batch,
    top1_slack,
    write_noisy,
)
from helpers import cli
from ocp_mx import decode_checkpoint

from mxforge.models import family_named

# It quantizes and runs transformers' models a dozen times: on one worker, which builds each module fixture once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("consumer-text-families")]

# family -> (transformers' class of its checkpoints, {recipe: the formats its output holds})
FAMILIES = {
    "glm5_next": (
        "Glm5NextForConditionalGeneration",
        {"glm-5.3-flash-mxfp4": {"mxfp4"}, "glm-5.3-flash-mxfp4-attn-fp8": {"mxfp4", "fp8_ptpc"}},
    ),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeForCausalLM",
        {"qwen3.5-moe-mxfp4": {"mxfp4"}, "qwen3.5-moe-mxfp4-attn-fp8": {"mxfp4", "fp8_ptpc"}},
    ),
}
CASES = [(f, r) for f, (_, recipes) in FAMILIES.items() for r in sorted(recipes)]


@torch.no_grad()
def target_logits(family: str, ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """The target model's next-token logits of a bf16 checkpoint of `family`, computed in float32 by transformers
    (weights as stored, upcast exactly); the MTP layer's tensors are left unread."""
    import transformers
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the load report lists the MTP tensors, and the kernels' fallback notice
    logging.disable_progress_bar()
    try:
        model_class = getattr(transformers, FAMILIES[family][0])
        model = model_class.from_pretrained(ckpt, dtype=torch.float32).eval()
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()
    return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def source(request, fixture_ckpt) -> tuple[str, Path, torch.Tensor, torch.Tensor, float]:
    """(the family, its tiny bf16 fixture, the token batch, its logits, the sharpening that gives them a trained LM's
    entropy)."""
    family = request.param
    ckpt = fixture_ckpt("tiny", family)[0]
    text = family_named(family).config.view(json.loads((ckpt / "config.json").read_text()))
    ids = token_batch(text["vocab_size"], text.get("pad_token_id") or text["vocab_size"])
    logits = target_logits(family, ckpt, ids)
    return family, ckpt, ids, logits, sharpening(logits)


@pytest.fixture(scope="module")
def quantized(request, source, tmp_path_factory) -> tuple[str, Path, dict, dict]:
    """(recipe, `mxforge quantize` of the fixture with it, the noise reference's figures, the bounds)."""
    family, ckpt, ids, logits, scale = source
    work = tmp_path_factory.mktemp("consumer-text-families")
    cli("quantize", str(ckpt), str(work / "out"), "--recipe", request.param, "--quiet", check=True)
    draws = []
    for seed in range(NOISE_DRAWS):
        write_noisy(ckpt, quantized_formats(work / "out"), work / f"noise{seed}", seed)
        draws.append(compare(logits, target_logits(family, work / f"noise{seed}", ids), scale))
    noise = {k: sum(d[k] for d in draws) / NOISE_DRAWS for k in draws[0]}
    positions = logits.shape[:2].numel()
    bounds = {
        "kl": BOUND_FACTOR * noise["kl"],
        "kl_raw": BOUND_FACTOR * noise["kl_raw"],
        "top1": 1 - top1_slack(1 - noise["top1"], positions),
    }
    return request.param, work / "out", noise, bounds


def measured(source, quantized, decoded: Path, **decode_options) -> tuple[dict, list[str]]:
    """The decoded output's figures against the source, and the bounds they break."""
    family, _, ids, logits, scale = source
    recipe, out, noise, bounds = quantized
    decode_checkpoint(out, decoded, **decode_options)
    m = compare(logits, target_logits(family, decoded, ids), scale)
    print(f"\n{recipe}{' ' + str(decode_options) if decode_options else ''}: {m} (noise {noise}, bounds {bounds})")
    broken = [k for k in ("kl", "kl_raw") if m[k] > bounds[k]] + (["top1"] if m["top1"] < bounds["top1"] else [])
    return m, broken


@pytest.mark.parametrize(("source", "quantized"), CASES, indirect=True, ids=[r for _, r in CASES])
def test_logits_match_source(source, quantized, tmp_path):
    recipe, out, _, _ = quantized
    assert set(quantized_formats(out).values()) == FAMILIES[source[0]][1][recipe]
    _, broken = measured(source, quantized, tmp_path / "decoded")
    assert not broken, broken


# Misreadings of one format, the rest decoded by the spec (tests/ocp_mx.py's decode_checkpoint options), per format
MISREADS = {
    "mxfp4": {"low_nibble_first": False},  # the two codes of a byte swapped
    "fp8_ptpc": {"fp8_options": {"scale_factor": 2.0}},  # the attention's channel scales read twice as large
}
MISREAD_CASES = [(f, r, fmt) for f, r in CASES for fmt in sorted(FAMILIES[f][1][r])]


@pytest.mark.parametrize(
    ("source", "quantized", "fmt"),
    MISREAD_CASES,
    indirect=["source", "quantized"],
    ids=[f"{r}-{fmt}" for _, r, fmt in MISREAD_CASES],
)
def test_a_misread_decode_breaks_the_bounds(fmt, source, quantized, tmp_path):
    """The bounds can fail: the same output with one of its formats misread breaks them."""
    _, broken = measured(source, quantized, tmp_path / "decoded", **MISREADS[fmt])
    assert broken, f"a misread {fmt} decode stayed within the bounds"
