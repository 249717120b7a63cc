"""A real consumer for GLM-5.3-Flash: transformers' own `Glm5NextForConditionalGeneration` (Kimi delta attention, NoPE
MLA with the DSA indexer, mHC, on CPU through its reference PyTorch kernels) computes the target model's logits from
the bf16 source and from mxforge's output decoded by tests/ocp_mx.py (written from the OCP MX v1.0 spec, sharing
nothing with mxforge), the default recipe's (MXFP4 experts) and the FP8-attention recipe's (KDA and MLA projections
in FP8 PTPC). Each must stay within BOUND_FACTOR of a noise reference at its formats' magnitudes (tests/consumer.py,
the method of test_consumer.py); a misread decode must not.

The MTP layer is not compared: transformers does not build this family's (only the engines' drafts do), and its
decoder layer class carries mHC, which the MTP layer has not, so it cannot host it as test_consumer.py hosts
GLM-5.2's.
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

# It quantizes and runs transformers' model a dozen times: on one worker, which builds each module fixture once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("consumer-glm5-next")]

FAMILY = "glm5_next"
RECIPES = {"glm-5.3-flash-mxfp4": {"mxfp4"}, "glm-5.3-flash-mxfp4-attn-fp8": {"mxfp4", "fp8_ptpc"}}


@torch.no_grad()
def target_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """The target model's next-token logits of a bf16 GLM-5.3-Flash checkpoint, computed in float32 by transformers
    (weights as stored, upcast exactly); the MTP layer's tensors are left unread."""
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the load report lists the MTP tensors, and the kernels' fallback notice
    logging.disable_progress_bar()
    try:
        model = Glm5NextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()
    return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def source(fixture_ckpt) -> tuple[Path, torch.Tensor, torch.Tensor, float]:
    """(the tiny bf16 fixture, the token batch, its logits, the sharpening that gives them a trained LM's entropy)."""
    ckpt = fixture_ckpt("tiny", FAMILY)[0]
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    ids = token_batch(text["vocab_size"], text["pad_token_id"])
    logits = target_logits(ckpt, ids)
    return ckpt, ids, logits, sharpening(logits)


@pytest.fixture(scope="module", params=sorted(RECIPES))
def quantized(request, source, tmp_path_factory) -> tuple[str, Path, dict, dict]:
    """(recipe, `mxforge quantize` of the fixture with it, the noise reference's figures, the bounds)."""
    ckpt, ids, logits, scale = source
    work = tmp_path_factory.mktemp("consumer-glm5-next")
    cli("quantize", str(ckpt), str(work / "out"), "--recipe", request.param, "--quiet", check=True)
    draws = []
    for seed in range(NOISE_DRAWS):
        write_noisy(ckpt, quantized_formats(work / "out"), work / f"noise{seed}", seed)
        draws.append(compare(logits, target_logits(work / f"noise{seed}", ids), scale))
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
    _, ids, logits, scale = source
    recipe, out, noise, bounds = quantized
    decode_checkpoint(out, decoded, **decode_options)
    m = compare(logits, target_logits(decoded, ids), scale)
    print(f"\n{recipe}{' ' + str(decode_options) if decode_options else ''}: {m} (noise {noise}, bounds {bounds})")
    broken = [k for k in ("kl", "kl_raw") if m[k] > bounds[k]] + (["top1"] if m["top1"] < bounds["top1"] else [])
    return m, broken


def test_glm5_next_logits_match_source(source, quantized, tmp_path):
    recipe, out, _, _ = quantized
    assert set(quantized_formats(out).values()) == RECIPES[recipe]
    _, broken = measured(source, quantized, tmp_path / "decoded")
    assert not broken, broken


# Misreadings of one format, the rest decoded by the spec (tests/ocp_mx.py's decode_checkpoint options), per format
MISREADS = {
    "mxfp4": {"low_nibble_first": False},  # the two codes of a byte swapped
    "fp8_ptpc": {"fp8_options": {"scale_factor": 2.0}},  # the attention's channel scales read twice as large
}


@pytest.mark.parametrize(
    ("quantized", "fmt"), [(r, f) for r in sorted(RECIPES) for f in sorted(RECIPES[r])], indirect=["quantized"]
)
def test_a_misread_decode_breaks_the_bounds(fmt, source, quantized, tmp_path):
    """The bounds can fail: the same output with one of its formats misread breaks them."""
    _, broken = measured(source, quantized, tmp_path / "decoded", **MISREADS[fmt])
    assert broken, f"a misread {fmt} decode stayed within the bounds"
