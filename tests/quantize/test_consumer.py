"""A real consumer: mxforge's output (MXFP4, and a mixed recipe's MXFP4 + FP8 PTPC) read by code that shares
nothing with mxforge, run through transformers' GLM-5.2 modules, and compared with the bf16 source on logits: the
target model, the MTP layer alone (fed the source's hidden states) and the MTP layer as served (fed its own
target's).

transformers' own Quark integration cannot run this checkpoint (test_transformers_quark_path_... pins why),
so tests/ocp_mx.py, written from the OCP MX v1.0 spec, decodes the MXFP4 weights into a plain bf16
checkpoint, which transformers loads exactly as it loads the source. Both compute in float32 (weights as
stored, upcast exactly): in bf16 arithmetic, rounding alone flips DSA top-k selections and moves the
tiny model's logits about as much as MXFP4 does.

Bounds (docs/benchmarks.md, "Quality"): KL is taken at a common sharpening that brings the source's mean entropy to
SHARP_ENTROPY nats, a trained LM's (the fixture's random weights give near-uniform logits), and also
unsharpened. The reference is a structureless perturbation of the format's magnitude: Gaussian noise of
FORMAT_REL_RMS[format] x each quantized tensor's RMS on the same tensors, averaged over NOISE_DRAWS draws. The
output must stay within BOUND_FACTOR of the reference's KL and top-1 disagreement; misread formats do not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from consumer import (
    BOUND_FACTOR,
    NOISE_DRAWS,
    compare,
    quantized_formats,
    quantized_weight_names,
    sharpening,
    token_batch,
    top1_slack,
    write_noisy,
)
from helpers import MXFP6_RECIPE, cli
from ocp_mx import (
    FORMAT_REL_RMS,
    decode_checkpoint,
    decode_fp8_ptpc,
    decode_mxfp4,
    decode_mxfp6,
    e2m1_value,
    e8m0_table,
    fp6_value,
)
from safetensors import safe_open

pytestmark = pytest.mark.slow  # quantizes and runs the model through transformers (a minute a setup)

SCALE_RULES = [None, "mse"]  # None: Quark's rule (the default); others go to `mxforge quantize --scale-rule RULE`

MIXED_RECIPE = "glm-5.2-mxfp4-attn-fp8"  # MXFP4 experts, FP8 PTPC attention (AMD's AttnFP8 layout)
COMPUTE_DTYPE = torch.float32


HEADS = ("target", "mtp", "mtp_served")


@dataclass
class Logits:
    target: torch.Tensor  # [B, S, V]: the model's next-token logits
    hidden: torch.Tensor  # [B, S, H]: the target's final (post-norm) hidden states
    mtp: torch.Tensor  # [B, S-1, V]: the MTP layer's logits (token after next), fed the SOURCE's hidden states
    mtp_served: torch.Tensor  # the same, fed this checkpoint's own hidden states, as an engine serves it


def _load_model(ckpt: Path, config, dtype: torch.dtype):
    from transformers import GlmMoeDsaForCausalLM
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the load report lists the MTP tensors the target model ignores
    logging.disable_progress_bar()
    try:
        return GlmMoeDsaForCausalLM.from_pretrained(ckpt, config=config, dtype=dtype).eval()
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()


def _mtp_config(config):
    """The config with the MTP layer as one more decoder layer, so transformers builds and loads it
    (experts fused by its own weight conversion). The MTP layer is MoE and runs its own indexer."""
    mtp = config.__class__.from_dict(config.to_dict())
    mtp.num_hidden_layers = config.num_hidden_layers + 1
    mtp.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"]
    mtp.indexer_types = list(config.indexer_types) + ["full"]
    mtp.layer_types = list(config.layer_types) + [config.layer_types[-1]]
    return mtp


def _mtp_head_tensors(ckpt: Path, layer: int) -> dict[str, torch.Tensor]:
    """enorm, hnorm, eh_proj and shared_head.norm: the MTP tensors no transformers module holds."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for short in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        name = f"model.layers.{layer}.{short}"
        with safe_open(str(ckpt / index[name]), framework="pt") as f:
            out[short] = f.get_tensor(name)
    return out


@torch.no_grad()
def consumer_logits(
    ckpt: Path, ids: torch.Tensor, source_hidden: torch.Tensor | None = None, dtype: torch.dtype = COMPUTE_DTYPE
) -> Logits:
    """Target and MTP logits of a bf16 GLM-5.2 checkpoint, computed with transformers' modules.

    MTP, as sglang's DeepseekModelNextN.forward (and vLLM's DeepSeekMultiTokenPredictorLayer) runs it: the
    draft token's embedding and the target's final (post-norm) hidden state of the position before it,
    each RMS-normed (enorm, hnorm), concatenated in that order, projected by eh_proj, then the decoder
    block at the draft tokens' positions, then shared_head.norm and the target's lm_head. It runs twice:
    on `source_hidden` (the bf16 source's hidden states: the MTP layer's own error, alone) and on this
    checkpoint's own (the served chain, target error included).
    """
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRMSNorm

    config = GlmMoeDsaConfig.from_pretrained(ckpt)
    target = _load_model(ckpt, config, dtype)
    hidden = target.model(input_ids=ids).last_hidden_state
    target_logits = target.lm_head(hidden).float()
    del target

    layer = config.num_hidden_layers
    host = _load_model(ckpt, _mtp_config(config), dtype)
    head = _mtp_head_tensors(ckpt, layer)

    def norm(weight):
        module = GlmMoeDsaRMSNorm(config.hidden_size, config.rms_norm_eps).to(dtype)
        module.weight.copy_(weight)
        return module

    enorm, hnorm, final_norm = (norm(head[n]) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"))
    embeds = host.model.embed_tokens(ids[:, 1:])

    def mtp(previous_hidden):
        x = torch.cat((enorm(embeds), hnorm(previous_hidden[:, :-1].to(dtype))), dim=-1)
        x = torch.nn.functional.linear(x, head["eh_proj.weight"].to(dtype))
        batch, steps = x.shape[:2]
        positions = torch.arange(1, steps + 1).expand(batch, steps)
        causal = torch.full((steps, steps), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)
        x, _ = host.model.layers[layer](
            x,
            attention_mask=causal.expand(batch, 1, steps, steps),
            position_ids=positions,
            position_embeddings=host.model.rotary_emb(x, positions),
        )
        return host.lm_head(final_norm(x)).float()

    served = mtp(hidden)
    return Logits(target_logits, hidden, served if source_hidden is None else mtp(source_hidden), served)


def weight_rel_rms(source: Path, decoded: Path) -> float:
    """sqrt(sum of squared errors / sum of squares) over the tensors that differ from the source."""
    err = ref = 0.0
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(index.values())):
        with safe_open(str(source / shard), framework="pt") as a, safe_open(str(decoded / shard), framework="pt") as b:
            for name in a.keys():
                x, y = a.get_tensor(name).double(), b.get_tensor(name).double()
                if not torch.equal(x, y):
                    err, ref = err + (y - x).pow(2).sum().item(), ref + x.pow(2).sum().item()
    return math.sqrt(err / ref)


@dataclass
class Reference:
    ids: torch.Tensor
    source: Logits
    scale: dict[str, float]  # per head: the sharpening found on the source's logits
    bounds: dict[str, dict]  # per head: max KL, min top-1
    noise: dict[str, dict]  # per head: the noise reference's KL and top-1


def against_source(ref: Reference, logits: Logits) -> dict[str, dict]:
    return {head: compare(getattr(ref.source, head), getattr(logits, head), ref.scale[head]) for head in HEADS}


def measure(ref: Reference, ckpt: Path) -> dict[str, dict]:
    return against_source(ref, consumer_logits(ckpt, ref.ids, ref.source.hidden))


def violations(ref: Reference, measured: dict[str, dict]) -> list[str]:
    out = []
    for head, m in measured.items():
        b = ref.bounds[head]
        for kl in ("kl", "kl_raw"):
            if m[kl] > b[kl]:
                out.append(f"{head}: {kl} {m[kl]:.4g} > {b[kl]:.4g}")
        if m["top1"] < b["top1"]:
            out.append(f"{head}: top-1 {m['top1']:.3f} < {b['top1']:.3f}")
    return out


def breaks_every_head(label: str, ckpt: Path, ref: Reference, tmp_path: Path, **decode_options) -> None:
    """`ckpt` decoded with `decode_options` (a deliberate misreading: decode_checkpoint's) breaks the bounds of every
    head."""
    decoded = tmp_path / "decoded"
    decode_checkpoint(ckpt, decoded, **decode_options)
    measured = measure(ref, decoded)
    print("\n" + report(label, ref, measured))
    assert {v.split(":")[0] for v in violations(ref, measured)} == set(HEADS), violations(ref, measured)


def report(label: str, ref: Reference, measured: dict[str, dict]) -> str:
    b = ref.bounds
    return "\n".join(
        f"{label:>28} {head:>10}: KL {m['kl']:.4g} (bound {b[head]['kl']:.4g}), unsharpened "
        f"{m['kl_raw']:.4g} (bound {b[head]['kl_raw']:.4g}), top-1 {m['top1']:.3f} (bound {b[head]['top1']:.3f})"
        for head, m in measured.items()
    )


@pytest.fixture(scope="module")
def default_mxfp4(quantized_tiny) -> Path:
    """`mxforge quantize` of the tiny fixture, default recipe (the session's: conftest.py)."""
    return quantized_tiny


@pytest.fixture(scope="module")
def source_logits(tiny_ckpt) -> tuple[torch.Tensor, Logits]:
    """The token batch and the bf16 source's logits."""
    config = json.loads((tiny_ckpt / "config.json").read_text())
    ids = token_batch(config["vocab_size"], config["pad_token_id"])
    return ids, consumer_logits(tiny_ckpt, ids)


def noise_reference(tiny_ckpt, quantized: Path, source_logits, tmp_path_factory) -> Reference:
    """Source logits, sharpening and the bounds, from the noise reference on the tensors (and in the formats) of
    `quantized`."""
    ids, source = source_logits
    scale = {head: sharpening(getattr(source, head)) for head in HEADS}
    ref = Reference(ids, source, scale, {}, {})
    draws = []
    for seed in range(NOISE_DRAWS):
        noisy = tmp_path_factory.mktemp("consumer") / f"noise{seed}"
        write_noisy(tiny_ckpt, quantized_formats(quantized), noisy, seed)
        draws.append(measure(ref, noisy))
    ref.noise = {head: {k: sum(d[head][k] for d in draws) / NOISE_DRAWS for k in draws[0][head]} for head in draws[0]}
    positions = {head: getattr(source, head).shape[:2].numel() for head in HEADS}
    ref.bounds = {
        head: {
            "kl": BOUND_FACTOR * m["kl"],
            "kl_raw": BOUND_FACTOR * m["kl_raw"],
            "top1": 1 - top1_slack(1 - m["top1"], positions[head]),
        }
        for head, m in ref.noise.items()
    }
    print("\n" + report(f"noise reference (mean of {NOISE_DRAWS})", ref, ref.noise))
    return ref


@pytest.fixture(scope="module")
def reference(tiny_ckpt, default_mxfp4, source_logits, tmp_path_factory) -> Reference:
    """The bounds for the default recipe's output (MXFP4)."""
    ref = noise_reference(tiny_ckpt, default_mxfp4, source_logits, tmp_path_factory)
    # Context, not a bound: the source's own weights computed in bf16 instead of float32.
    print(
        report(
            "source, bf16 arithmetic",
            ref,
            against_source(ref, consumer_logits(tiny_ckpt, ref.ids, ref.source.hidden, torch.bfloat16)),
        )
    )
    return ref


@pytest.fixture(scope="module")
def mixed(tiny_ckpt, tmp_path_factory) -> Path:
    """`mxforge quantize` of the tiny fixture with the shipped mixed recipe (MXFP4 experts, FP8 PTPC attention)."""
    out = tmp_path_factory.mktemp("consumer-mixed") / "out"
    cli("quantize", str(tiny_ckpt), str(out), "--recipe", MIXED_RECIPE, "--quiet", check=True)
    return out


@pytest.fixture(scope="module")
def mixed_reference(tiny_ckpt, mixed, source_logits, tmp_path_factory) -> Reference:
    """The bounds for the mixed recipe's output: each tensor's noise at its own format's magnitude."""
    return noise_reference(tiny_ckpt, mixed, source_logits, tmp_path_factory)


@pytest.fixture(scope="module")
def mxfp6(tiny_ckpt, tmp_path_factory) -> Path:
    """`mxforge quantize` of the tiny fixture with MXFP6_RECIPE (MXFP6 E2M3 experts, E3M2 attention)."""
    work = tmp_path_factory.mktemp("consumer-mxfp6")
    (work / "mxfp6.toml").write_text(MXFP6_RECIPE)
    cli("quantize", str(tiny_ckpt), str(work / "out"), "--recipe", str(work / "mxfp6.toml"), "--quiet", check=True)
    return work / "out"


@pytest.fixture(scope="module")
def mxfp6_reference(tiny_ckpt, mxfp6, source_logits, tmp_path_factory) -> Reference:
    """The bounds for the MXFP6 output: each tensor's noise at its element's magnitude."""
    return noise_reference(tiny_ckpt, mxfp6, source_logits, tmp_path_factory)


@pytest.mark.parametrize("rule", SCALE_RULES, ids=lambda r: r or "quark")
def test_mxfp4_logits_match_source(rule, tiny_ckpt, default_mxfp4, reference, tmp_path):
    if rule is None:
        ckpt = default_mxfp4
    else:
        ckpt = tmp_path / "mxfp4"
        cli("quantize", str(tiny_ckpt), str(ckpt), "--quiet", "--scale-rule", rule, check=True)
    decoded = tmp_path / "decoded"
    counts = decode_checkpoint(ckpt, decoded)
    assert counts["decoded"] == len(quantized_weight_names(default_mxfp4)) > 0
    measured = measure(reference, decoded)
    print(
        f"\nweight relative RMS error over the {counts['decoded']} MXFP4 tensors: "
        f"{weight_rel_rms(tiny_ckpt, decoded):.4f}"
    )
    print(report(f"mxfp4 ({rule or 'quark'})", reference, measured))
    assert not violations(reference, measured), report(f"mxfp4 ({rule or 'quark'})", reference, measured)


def test_mixed_precision_logits_match_source(tiny_ckpt, mixed, mixed_reference, tmp_path):
    """The mixed recipe's output, each weight decoded by the format its layer config names, stays within the bounds
    of noise at each format's magnitude."""
    formats = quantized_formats(mixed)
    assert set(formats.values()) == {"mxfp4", "fp8_ptpc"}, formats
    decoded = tmp_path / "decoded"
    counts = decode_checkpoint(mixed, decoded)
    assert counts["decoded"] == len(formats)
    measured = measure(mixed_reference, decoded)
    print(report(MIXED_RECIPE, mixed_reference, measured))
    assert not violations(mixed_reference, measured), report(MIXED_RECIPE, mixed_reference, measured)


def test_mxfp6_logits_match_source(mxfp6, mxfp6_reference, tmp_path):
    """MXFP6 E2M3 experts and E3M2 attention, decoded by the spec decoder the layer configs name, stay within the
    bounds of noise at each element's magnitude, target and MTP layer."""
    formats = quantized_formats(mxfp6)
    assert set(formats.values()) == {"mxfp6_e2m3", "mxfp6_e3m2"}, formats
    decoded = tmp_path / "decoded"
    assert decode_checkpoint(mxfp6, decoded)["decoded"] == len(formats)
    measured = measure(mxfp6_reference, decoded)
    print(report("mxfp6 (e2m3 experts, e3m2 attention)", mxfp6_reference, measured))
    assert not violations(mxfp6_reference, measured), report("mxfp6", mxfp6_reference, measured)


# Misreadings of MXFP6 (everything else decoded right): the four codes of a 3-byte group taken in reverse order, and
# the scales read one binade high.
WRONG_MXFP6_DECODES = {
    "codes in reverse order": {"first_in_low_bits": False},
    "scale x2 (E8M0 bias 126)": {"scale_bias": 126},
}


@pytest.mark.parametrize("wrong", WRONG_MXFP6_DECODES)
def test_wrong_mxfp6_decode_breaks_the_bounds(wrong, mxfp6, mxfp6_reference, tmp_path):
    breaks_every_head(wrong, mxfp6, mxfp6_reference, tmp_path, mxfp6_options=WRONG_MXFP6_DECODES[wrong])


def test_mxfp6_noise_figures_are_measured():
    """FORMAT_REL_RMS's MXFP6 figures are what Quark's numerics (mxforge's kernels) give on Gaussian rows, read back
    by the spec decoder, which agrees bit for bit with mxforge's own decoding there."""
    from mxforge.formats import format_named

    for name in ("mxfp6_e2m3", "mxfp6_e3m2"):
        fmt = format_named(name)
        for inner in (256, 6144):
            w = torch.randn(256, inner, generator=torch.Generator().manual_seed(inner)).to(torch.bfloat16)
            codes = torch.zeros(256, fmt.packed_inner(inner), dtype=torch.uint8)
            scales = torch.zeros(256, fmt.blocks(inner), dtype=torch.uint8)
            fmt.kernels.encode_torch(w, codes, scales, torch.device("cpu"))
            decoded = decode_mxfp6(codes, scales, element=name.removeprefix("mxfp6_"))
            assert torch.equal(decoded, fmt.dequantize(codes, scales, inner)), name
            rel = ((decoded - w.float()).pow(2).sum() / w.float().pow(2).sum()).sqrt().item()
            assert rel == pytest.approx(FORMAT_REL_RMS[name], rel=0.03), (name, inner, rel)


# Misreadings of FP8 PTPC alone (the MXFP4 weights decoded right): the attention of every layer, MTP included.
WRONG_FP8_DECODES = {"FP8 scale x2": {"scale_factor": 2.0}, "FP8 scale /2": {"scale_factor": 0.5}}


@pytest.mark.parametrize("wrong", WRONG_FP8_DECODES)
def test_wrong_fp8_decode_breaks_the_bounds(wrong, mixed, mixed_reference, tmp_path):
    breaks_every_head(wrong, mixed, mixed_reference, tmp_path, fp8_options=WRONG_FP8_DECODES[wrong])


WRONG_DECODES = {
    "swapped nibbles": {"low_nibble_first": False},
    "scale x2 (E8M0 bias 126)": {"scale_bias": 126},
    "scale /2 (E8M0 bias 128)": {"scale_bias": 128},
}


@pytest.mark.parametrize("wrong", WRONG_DECODES)
def test_wrong_decode_breaks_the_bounds(wrong, default_mxfp4, reference, tmp_path):
    """The bounds can fail: a decode that misreads the format by one convention breaks them, on every head."""
    breaks_every_head(wrong, default_mxfp4, reference, tmp_path, **WRONG_DECODES[wrong])


def test_mtp_comparison_sees_the_mtp_layer(default_mxfp4, reference, tmp_path):
    """transformers drops the layers past num_hidden_layers; the MTP path must still read them: a wrong
    decode of the MTP layer alone leaves the target's logits as they were and breaks the MTP bounds."""
    mtp_prefix = f"model.layers.{json.loads((default_mxfp4 / 'config.json').read_text())['num_hidden_layers']}."
    decoded, right = tmp_path / "decoded", tmp_path / "right"
    decode_checkpoint(default_mxfp4, decoded, only=lambda name: name.startswith(mtp_prefix), low_nibble_first=False)
    decode_checkpoint(default_mxfp4, right)
    wrong_logits = consumer_logits(decoded, reference.ids, reference.source.hidden)
    right_logits = consumer_logits(right, reference.ids, reference.source.hidden)
    assert torch.equal(wrong_logits.target, right_logits.target)
    measured = against_source(reference, wrong_logits)
    print("\n" + report("swapped nibbles, MTP layer", reference, measured))
    assert {v.split(":")[0] for v in violations(reference, measured)} >= {"mtp"}, violations(reference, measured)
    assert not [v for v in violations(reference, measured) if v.startswith("target:")]


def test_spec_decoder_agrees_with_mxforge_dequantize(default_mxfp4):
    """Two decoders written apart (this one from the spec, mxforge's for its error figures) agree bit for
    bit on every MXFP4 tensor of the output: a disagreement means one of them misreads the format."""
    from mxforge.formats import MXFP4

    names = quantized_weight_names(default_mxfp4)
    index = json.loads((default_mxfp4 / "model.safetensors.index.json").read_text())["weight_map"]
    for name in sorted(names):
        with safe_open(str(default_mxfp4 / index[name]), framework="pt") as f:
            codes, scales = f.get_tensor(name), f.get_tensor(name + "_scale")
        ours = decode_mxfp4(codes, scales)
        assert torch.equal(ours, MXFP4.dequantize(codes, scales, ours.shape[1])), name


def test_decoder_reads_the_spec_values():
    """tests/ocp_mx.py against the OCP MX v1.0 tables, and the nibble order and ragged last block."""
    assert [e2m1_value(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert [e2m1_value(c) for c in range(8, 16)] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    scales = e8m0_table()
    assert scales[127] == 1.0 and scales[0] == 2.0**-127 and scales[254] == 2.0**127 and scales[255].isnan()
    # 48 inputs: one block of 32 (scale 2^1) and a short block of 16 (scale 2^-2); byte = second << 4 | first.
    codes = torch.zeros(1, 24, dtype=torch.uint8)
    codes[0, 0] = 0x7A  # elements 0, 1: code 0xA = -1.0, code 0x7 = 6.0
    codes[0, 16] = 0x0F  # elements 32, 33: -6.0, 0.0
    got = decode_mxfp4(codes, torch.tensor([[128, 125]], dtype=torch.uint8))
    assert got.shape == (1, 48)
    assert got[0, :2].tolist() == [-2.0, 12.0] and got[0, 32:34].tolist() == [-1.5, 0.0]
    assert got[0, 2:32].abs().sum() == 0 and got[0, 34:].abs().sum() == 0
    with pytest.raises(ValueError, match="scales"):
        decode_mxfp4(codes, torch.tensor([[128]], dtype=torch.uint8))


def test_mxfp6_decoder_reads_the_spec_values():
    """OCP MX v1.0's FP6 tables (E2M3: 0.125 steps to 1, largest 7.5; E3M2: smallest 0.0625, largest 28) and Quark's
    packing: four codes in three bytes, the first in the lowest bits."""
    assert [fp6_value(c, "e2m3") for c in range(9)] == [i / 8 for i in range(9)]
    assert fp6_value(31, "e2m3") == 7.5 and fp6_value(32 + 31, "e2m3") == -7.5
    assert fp6_value(1, "e3m2") == 0.0625 and fp6_value(4, "e3m2") == 0.25 and fp6_value(31, "e3m2") == 28.0
    # 32 inputs, one block (scale 2^0): codes 1, 2, 3, 63 (E2M3: 0.125, 0.25, 0.375, -7.5) then zeros.
    word = 1 | 2 << 6 | 3 << 12 | 63 << 18
    codes = torch.zeros(1, 24, dtype=torch.uint8)
    codes[0, :3] = torch.tensor([word & 0xFF, word >> 8 & 0xFF, word >> 16], dtype=torch.uint8)
    got = decode_mxfp6(codes, torch.tensor([[127]], dtype=torch.uint8), element="e2m3")
    assert got.shape == (1, 32) and got[0, :4].tolist() == [0.125, 0.25, 0.375, -7.5] and got[0, 4:].abs().sum() == 0
    with pytest.raises(ValueError, match="scales"):
        decode_mxfp6(codes, torch.tensor([[127, 127]], dtype=torch.uint8), element="e2m3")


@pytest.mark.quark
def test_transformers_quark_path_cannot_run_routed_experts(default_mxfp4):
    """Why the consumer decodes the weights itself. transformers loads a `quant_method: quark` checkpoint
    through QuarkHfQuantizer, which calls Quark's `_map_to_quark`: it replaces nn.Linear modules with
    QParamsLinear. GLM-5.2's routed experts are no nn.Linear in transformers 5: GlmMoeDsaExperts holds two
    fused 3-D parameters, so Quark leaves them alone; transformers' weight conversion still stacks the
    per-expert packed uint8 codes into them, while their scales, renamed to `experts.gate_up_proj_scale` /
    `experts.down_proj_scale`, match nothing and are dropped. The model holds raw FP4 codes as expert
    weights and no scale, and its forward fails on the uint8 weight (5.16.1). transformers 5.24.0 checks the
    stacked shapes first and refuses the load itself. If this test fails, transformers has learnt to run the
    checkpoint: make it the consumer."""
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    try:
        model, info = GlmMoeDsaForCausalLM.from_pretrained(
            default_mxfp4, dtype=torch.bfloat16, output_loading_info=True
        )
    except RuntimeError as e:  # the packed codes do not fit the fused expert parameters: no model at all
        assert "ignore_mismatched_sizes" in str(e), (transformers.__version__, e)
        return
    config = model.config
    moe = model.model.layers[config.first_k_dense_replace].mlp
    assert type(moe.shared_experts.gate_proj).__name__ == "QParamsLinear"  # the nn.Linear modules do convert
    assert moe.experts.gate_up_proj.dtype == torch.uint8
    assert moe.experts.gate_up_proj.shape[-1] == config.hidden_size // 2  # packed codes, not weights
    assert not any("scale" in name for name in moe.experts.state_dict())
    assert any(k.endswith("mlp.experts.gate_up_proj_scale") for k in info["unexpected_keys"]), info["unexpected_keys"]
    with pytest.raises(RuntimeError, match="Byte"):
        model(token_batch(config.vocab_size, config.pad_token_id)[:1, :8])


def test_spec_decoders_agree_with_mxforge_dequantize_on_every_format(mixed):
    """The same on the mixed output: each weight read by the decoder of the format its layer config names equals
    mxforge's decoding of it in the registry's entry for that format."""
    from mxforge.formats import format_named

    index = json.loads((mixed / "model.safetensors.index.json").read_text())["weight_map"]
    for name, fmt in sorted(quantized_formats(mixed).items()):
        with safe_open(str(mixed / index[name]), framework="pt") as f:
            codes, scales = f.get_tensor(name), f.get_tensor(name + "_scale")
        ours = decode_fp8_ptpc(codes, scales) if fmt == "fp8_ptpc" else decode_mxfp4(codes, scales)
        assert torch.equal(ours, format_named(fmt).dequantize(codes, scales, ours.shape[1])), name


def test_mxfp6_decoder_agrees_with_mxforge_dequantize(mxfp6):
    """The same on the MXFP6 output: every E2M3 and E3M2 weight."""
    from mxforge.formats import format_named

    index = json.loads((mxfp6 / "model.safetensors.index.json").read_text())["weight_map"]
    for name, fmt in sorted(quantized_formats(mxfp6).items()):
        with safe_open(str(mxfp6 / index[name]), framework="pt") as f:
            codes, scales = f.get_tensor(name), f.get_tensor(name + "_scale")
        ours = decode_mxfp6(codes, scales, element=fmt.removeprefix("mxfp6_"))
        assert torch.equal(ours, format_named(fmt).dequantize(codes, scales, ours.shape[1])), name
