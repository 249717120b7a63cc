import json
import os

import pytest
import torch
from helpers import cli
from safetensors import safe_open

from mxforge.checkpoint import Checkpoint
from mxforge.models import family_named, layout_of
from mxforge.models.fixture import plan_shards, write_fixture
from mxforge.safetensors_io import PlannedTensor


def _headers(ckpt):
    c = Checkpoint.open(ckpt)
    return c, c.tensor_infos()


def test_tiny_matches_layout_and_index(tiny_ckpt):
    ckpt, infos = _headers(tiny_ckpt)
    layout = layout_of(ckpt.config)
    expected = {t.name: t for t in layout.tensors()}
    assert set(infos) == set(expected)
    for name, info in infos.items():
        assert (info.dtype, info.shape) == (expected[name].dtype, expected[name].shape), name
    assert ckpt.index_metadata["total_size"] == sum(i.nbytes for i in infos.values())
    assert len(ckpt.shard_names) >= 3
    for side in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_ckpt / side).is_file()


def test_tiny_covers_every_layer_kind(tiny_ckpt):
    ckpt, infos = _headers(tiny_ckpt)
    layout = layout_of(ckpt.config)
    decoder = range(layout.num_hidden_layers)
    assert any(not layout.is_moe(i) for i in decoder) and any(layout.is_moe(i) for i in decoder)
    kinds = {(layout.is_moe(i), layout.has_indexer(i)) for i in decoder}
    assert kinds == {(False, True), (True, True), (True, False)}  # dense, MoE full-indexer, MoE shared-indexer
    mtp = layout.num_hidden_layers
    assert list(layout.mtp_layers) == [mtp]
    for part in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "self_attn.indexer.wk.weight",
        "mlp.shared_experts.gate_proj.weight",
        "mlp.experts.0.down_proj.weight",
    ):
        assert f"model.layers.{mtp}.{part}" in infos
    assert infos[f"model.layers.{mtp}.eh_proj.weight"].shape == (layout["hidden_size"], 2 * layout["hidden_size"])
    assert infos["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == "F32"


def test_indexshare_schedule_matches_transformers_and_storage(tiny_ckpt):
    from transformers import GlmMoeDsaConfig

    ckpt, infos = _headers(tiny_ckpt)
    layout = layout_of(ckpt.config)
    assert layout.indexer_types() == GlmMoeDsaConfig(**ckpt.config).indexer_types
    for i in layout.all_layers:
        has = f"model.layers.{i}.self_attn.indexer.wk.weight" in infos
        assert has == layout.has_indexer(i), i
    # GLM-5.2 itself: full on 0, 1, 2, 6, 10, ..., 74 (21 layers), shared on the other 57
    real = layout_of(family_named("glm_moe_dsa").reference()).indexer_types()
    full = [i for i, t in enumerate(real) if t == "full"]
    assert full == [0, 1, 2] + list(range(6, 78, 4)) and len(full) == 21


def test_mtp_layer_sits_in_the_last_shards(tiny_ckpt):
    ckpt, _ = _headers(tiny_ckpt)
    mtp = layout_of(ckpt.config).num_hidden_layers
    order = ckpt.shard_names
    layout = layout_of(ckpt.config)
    mtp_shards = {ckpt.weight_map[n] for n in ckpt.weight_map if layout.layer_of(n) == mtp}
    other_shards = {ckpt.weight_map[n] for n in ckpt.weight_map if layout.layer_of(n) != mtp}
    assert max(order.index(s) for s in mtp_shards) == len(order) - 1
    assert min(order.index(s) for s in mtp_shards) >= max(order.index(s) for s in other_shards)


def test_quantizable_in_dims_are_multiples_of_32(tiny_ckpt):
    _, infos = _headers(tiny_ckpt)
    for name, info in infos.items():
        if len(info.shape) == 2 and "embed_tokens" not in name:
            assert info.shape[1] % 32 == 0, name


def test_tiny_matches_what_transformers_saves(tiny_ckpt, tmp_path):
    """Non-MTP names and shapes equal what transformers' GlmMoeDsaForCausalLM writes for the same config."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    ckpt, infos = _headers(tiny_ckpt)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**ckpt.config))
    model.save_pretrained(tmp_path / "hf")
    theirs = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            theirs.update({k: tuple(s.get_slice(k).get_shape()) for k in s.keys()})
    mtp = ckpt.config["num_hidden_layers"]
    layout = layout_of(ckpt.config)
    ours = {k: v.shape for k, v in infos.items() if layout.layer_of(k) != mtp}
    assert ours == theirs


def test_weights_are_deterministic_and_trained_like(tmp_path, tiny_ckpt):
    write_fixture(tmp_path / "again", "tiny", seed=0, quiet=True)
    write_fixture(tmp_path / "other", "tiny", seed=1, quiet=True)
    for f in sorted(tiny_ckpt.iterdir()):
        assert (tmp_path / "again" / f.name).read_bytes() == f.read_bytes(), f.name
    shard = "model-00002-of-00003.safetensors"
    assert (tmp_path / "other" / shard).read_bytes() != (tiny_ckpt / shard).read_bytes()
    ckpt = Checkpoint.open(tiny_ckpt)
    name = "model.layers.3.mlp.experts.0.gate_proj.weight"
    with safe_open(tiny_ckpt / ckpt.weight_map[name], "pt") as s:
        w = s.get_tensor(name).float()
    std = w.std().item()
    assert 0.015 < std < 0.05
    assert (w.abs() > 6 * 0.02).any()  # rare outliers exist ...
    assert (w.abs() > 6 * 0.02).float().mean() < 0.01  # ... and are rare
    assert torch.isfinite(w).all()


def test_full_layout_counts_and_sparse_disk_use(full_layout_ckpt):
    ckpt, infos = _headers(full_layout_ckpt)
    assert len(infos) == 59_585
    assert len(ckpt.shard_names) == 282
    assert ckpt.index_metadata["total_size"] == 1_506_659_919_872 == sum(i.nbytes for i in infos.values())
    assert sum(1 for n in infos if n.startswith("model.layers.78.")) == 791
    assert ckpt.shard_names[-1] in {ckpt.weight_map[n] for n in infos if n.startswith("model.layers.78.")}
    assert infos["model.layers.5.mlp.experts.255.down_proj.weight"].shape == (6144, 2048)
    used = sum(os.stat(p).st_blocks * 512 for p in full_layout_ckpt.iterdir())
    assert used < 200 * 2**20, f"full-layout should be sparse, uses {used} bytes"


@pytest.mark.slow
def test_bench_preset_has_real_expert_shapes(tmp_path):
    write_fixture(tmp_path / "b", "bench", gib=0.75, quiet=True)
    ckpt, infos = _headers(tmp_path / "b")
    assert infos["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (2048, 6144)
    assert infos["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (6144, 2048)
    total = ckpt.index_metadata["total_size"]
    assert abs(total - 0.75 * 2**30) < 0.2 * 2**30
    assert len(ckpt.shard_names) >= 2


def test_plan_shards_exact_count():
    tensors = [PlannedTensor(f"t{i}", "BF16", (100 + i,)) for i in range(50)]
    for n in (1, 3, 7, 50):
        shards = plan_shards(tensors, shards=n)
        assert len(shards) == n and [t for s in shards for t in s] == tensors


def test_cli_fixture_and_errors(tmp_path):
    proc = cli("fixture", str(tmp_path / "t"), "--preset", "tiny", "--seed", "3", "--quiet", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["preset"] == "tiny" and report["seed"] == 3 and report["shards"] == 3
    again = cli("fixture", str(tmp_path / "t"), "--preset", "tiny")
    assert again.returncode == 2 and "not an empty directory" in again.stderr and "Traceback" not in again.stderr
    bad = cli("fixture", str(tmp_path / "u"), "--preset", "tiny", "--gib", "1")
    assert bad.returncode == 2 and "bench preset only" in bad.stderr
    assert "zeros" in cli("fixture", "--help").stdout
