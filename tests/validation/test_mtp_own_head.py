"""GLM-4.6 ships its MTP layer without the embed_tokens and shared_head.head of its own that GLM-4.5's carries
(glm4_moe's OMITTABLE_MTP_TENSORS). Such a checkpoint quantizes, fixes up and validates for every release; the
releases' own code is the proof that it loads: vLLM's Glm4MoeMTP.load_weights, executed from each wheel, fills
the draft's embedding and head from the model's; every sglang release's EAGLE worker (read from its wheel) gives
a NEXTN draft the target's embedding and head. Another family missing the same tensors is still refused."""

from __future__ import annotations

import ast
import json
import shutil
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import cli
from safetensors.torch import load_file, save_file

from mxforge.models import family_named
from mxforge.models.fixture import write_fixture
from mxforge.validation.profiles import all_profiles

GLM4 = family_named("glm4_moe")
OWN_HEAD = ("embed_tokens.weight", "shared_head.head.weight")


def _releases(engine: str) -> list[str]:
    return sorted({r for p in all_profiles(GLM4) if p.engine == engine for r in p.read})


def without_own_head(src: Path, dest: Path) -> int:
    """A copy of checkpoint `src` whose MTP layer lacks its own embed_tokens and shared_head.head (GLM-4.6's
    layout); returns that layer's index."""
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    layer = config["num_hidden_layers"]
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    drop = {f"model.layers.{layer}.{n}" for n in OWN_HEAD}
    assert drop <= set(index["weight_map"])
    for shard in {index["weight_map"][n] for n in drop}:
        tensors = load_file(dest / shard)
        save_file({n: t for n, t in tensors.items() if n not in drop}, dest / shard, metadata={"format": "pt"})
    dropped_bytes = sum(
        t.numel() * t.element_size() for t in (load_file(src / index["weight_map"][n])[n] for n in drop)
    )
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if n not in drop}
    index["metadata"]["total_size"] -= dropped_bytes
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return layer


@pytest.fixture(scope="module")
def glm46_like(tmp_path_factory) -> tuple[Path, int]:
    root = tmp_path_factory.mktemp("glm46")
    write_fixture(root / "glm45", "tiny", quiet=True, family=GLM4)
    return root / "glm46", without_own_head(root / "glm45", root / "glm46")


def test_a_glm46_layout_quantizes_fixes_up_and_validates_for_every_release(glm46_like, tmp_path):
    src, layer = glm46_like
    out = tmp_path / "out"
    cli("quantize", str(src), str(out), "--quiet", "--workers", "1", check=True)
    cli("fixup", str(out), "--quiet", check=True)
    proc = cli("validate", str(out), "--json", "-")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], proc.stdout
    assert report["checked"]["engines"] and all(report["checked"]["engines"].values())
    assert any(f"MTP layer {layer}:" in n and "without its own embed_tokens.weight" in n for n in report["notes"])
    inspected = json.loads(cli("inspect", str(src), "--json", "-", check=True).stdout)
    assert inspected["mtp"]["complete"]


def test_other_mtp_tensors_and_other_families_are_still_required(glm46_like, tmp_path):
    """Only glm4_moe may omit them, and only them: DeepSeek-V3's MTP layer without its head is refused, as is a
    GLM-4.6 layout without the MTP layer's eh_proj."""
    write_fixture(tmp_path / "v3", "tiny", quiet=True, family=family_named("deepseek_v3"))
    layer = without_own_head(tmp_path / "v3", tmp_path / "v3-no-head")
    proc = cli("validate", str(tmp_path / "v3-no-head"))
    assert proc.returncode == 1 and f"model.layers.{layer}.shared_head.head.weight" in proc.stdout

    src, layer = glm46_like
    broken = tmp_path / "no-eh-proj"
    shutil.copytree(src, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    name = f"model.layers.{layer}.eh_proj.weight"
    shard = index["weight_map"].pop(name)
    tensors = load_file(broken / shard)
    del tensors[name]
    save_file(tensors, broken / shard, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = cli("validate", str(broken))
    assert proc.returncode == 1 and name in proc.stdout


@pytest.mark.engines
@pytest.mark.parametrize("release", _releases("vllm"))
def test_vllm_fills_the_drafts_embedding_and_head_from_the_models(glm46_like, release):
    """The release's Glm4MoeMTP.load_weights (and the helpers it names: get_spec_layer_idx_from_weight_name,
    default_weight_loader), run over a GLM-4.6-layout checkpoint's non-expert tensors into the draft's parameters:
    its embedding and head hold the model's embed_tokens and lm_head, and no MTP parameter is left unloaded."""
    from engine_truth.wheels import Release

    src, layer = glm46_like
    rel = Release("vllm", release)
    models = "vllm.model_executor.models."
    helpers = {
        **rel.functions(models + "utils", ("get_spec_layer_idx_from_weight_name",), {}),
        **rel.functions("vllm.model_executor.model_loader.weight_utils", ("default_weight_loader",), {}),
    }
    namespace = {
        "torch": torch,
        "typing": typing,
        "Callable": Callable,
        "Iterable": Iterable,
        **helpers,
        # Routed experts are not fed (none of the tensors in question is one): no expert mapping is needed.
        "fused_moe_make_expert_params_mapping": lambda *a, **k: [],
    }
    methods = rel.functions(
        models + "glm4_moe_mtp", ("load_weights", "_rewrite_spec_layer_name"), namespace, owner="Glm4MoeMTP"
    )
    config = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    tensors = {n: t for s in sorted(set(index["weight_map"].values())) for n, t in load_file(src / s).items()}
    outer = {n: t for n, t in tensors.items() if n.startswith(f"model.layers.{layer}.") and ".mlp." not in n}
    outer = {n: t for n, t in outer.items() if ".self_attn." not in n and "layernorm" not in n}
    fed = {
        **outer,
        "lm_head.weight": tensors["lm_head.weight"],
        "model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
    }
    fed["model.layers.0.self_attn.o_proj.weight"] = tensors[
        "model.layers.0.self_attn.o_proj.weight"
    ]  # target's: skipped

    p = f"model.layers.{layer}."
    shapes = {
        "model.embed_tokens.weight": tensors["model.embed_tokens.weight"].shape,
        p + "shared_head.head.weight": tensors["lm_head.weight"].shape,
        **{n: t.shape for n, t in outer.items()},
    }
    params = {
        n: torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16), requires_grad=False) for n, s in shapes.items()
    }
    draft = type("Draft", (), dict(methods))()
    draft.config = SimpleNamespace(**config)
    draft.is_fused_shared_expert_enabled = False
    draft.model = SimpleNamespace(mtp_start_layer_idx=layer)
    draft.named_parameters = params.items
    loaded = draft.load_weights(iter(fed.items()))

    assert loaded == set(params), f"{release}: unloaded {set(params) - loaded}, unexpected {loaded - set(params)}"
    assert torch.equal(params[p + "shared_head.head.weight"], tensors["lm_head.weight"])
    assert torch.equal(params["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(params[p + "eh_proj.weight"], tensors[p + "eh_proj.weight"])


@pytest.mark.engines
@pytest.mark.parametrize("release", _releases("sglang"))
def test_sglang_gives_a_nextn_draft_the_targets_embedding_and_head(release):
    """Read, not executed (the worker needs a running server): the EAGLE worker that runs NEXTN drafts replaces
    the draft's embedding and head with the target's (`set_embed_and_head(embed, head)` outside the EAGLE3
    branch), and the draft class has that method."""
    from engine_truth.wheels import Release

    rel = Release("sglang", release)
    suffixes = (".eagle_worker", ".eagle_worker_v2")  # the v1 worker, where the release still has it, and v2
    workers = [m for m in rel.package_modules("sglang.srt.speculative") if m.endswith(suffixes)]
    assert any(m.endswith(".eagle_worker_v2") for m in workers), f"{release}: no eagle_worker_v2"
    for worker in workers:
        tree = ast.parse(rel.source(worker) or "")
        branches = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.If)
            and "is_eagle3" in ast.unparse(node.test)
            and not ast.unparse(node.test).startswith("not")
        ]
        not_eagle3 = "\n".join(ast.unparse(stmt) for node in branches for stmt in node.orelse)
        assert "set_embed_and_head(embed, head)" in not_eagle3, f"{release}: {worker}"
    models = "\n".join(
        rel.source(f"sglang.srt.models.{m}") or "" for m in ("glm4_moe_nextn", "glm4_moe", "deepseek_v2")
    )
    assert "def set_embed_and_head" in models, f"{release}: the GLM-4 NextN draft cannot take the target's head"
