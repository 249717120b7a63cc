"""Survey engine releases: one row per release, one column per behaviour an engine profile records.

    .venv/bin/python tests/engine_truth/survey.py sglang 0.5.9 0.5.10 ...    # or: vllm 0.30.0 ...

Each behaviour is measured by executing the release's own code (the probes) on a diagnostic
`quantization_config` built on the real GLM-5.2 config: the table is where profile boundaries come
from (docs/development.md: "Adding an engine release").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_truth.probe_io import run_probe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# A layer config without quantization, as Quark exports a QLayerConfig() that quantizes nothing.
NULL_SPEC = {"weight": None, "input_tensors": None, "output_tensors": None, "bias": None, "target_device": None}


def glm_config(experts: int = 256) -> dict:
    from mxforge.formats import MXFP4
    from mxforge.formats.quark import cached_quantization_config

    config = json.loads((ROOT / "manifests/models/glm-5.2.config.json").read_text())
    config["n_routed_experts"] = experts
    config["quantization_config"] = cached_quantization_config(MXFP4, [])
    return config


def diagnostic_cases(engine: str) -> list[dict]:
    """One case per question; each excludes just what the question needs."""
    config = glm_config()
    n = config["num_hidden_layers"]
    mtp = f"model.layers.{n}"
    draft_block = "model.decoder" if engine == "sglang" else mtp
    fused_qkv = "fused_qkv_a_proj_with_mqa" if engine == "sglang" else "fused_qkv_a_proj"

    def case(name, exclude, target=(), draft=(), experts=256, lqc=None, global_weight=True, inputs=True, env=None):
        c = glm_config(experts)
        if not inputs:
            c["quantization_config"]["global_quant_config"]["input_tensors"] = None
        c["quantization_config"]["exclude"] = list(exclude)
        spec = c["quantization_config"]["global_quant_config"]
        if lqc is not None:
            c["quantization_config"]["layer_quant_config"] = {k: (spec if v else NULL_SPEC) for k, v in lqc.items()}
        if not global_weight:
            c["quantization_config"]["global_quant_config"] = NULL_SPEC
        return {
            "name": name,
            "config": c,
            "target": [list(t) for t in target],
            "draft": [list(d) for d in draft],
            **({"env": env} if env else {}),
        }

    shared = ("gate_proj", "up_proj", "down_proj")
    cases = [
        case(
            "plain",
            [],
            target=[("model.layers.0.mlp.gate_up_proj", "linear")],
            draft=[(f"{draft_block}.mlp.experts", "experts")],
        ),
        case(
            "fused_name",
            [f"model.layers.0.self_attn.{fused_qkv}", "model.layers.0.mlp.gate_up_proj"],
            target=[(f"model.layers.0.self_attn.{fused_qkv}", "linear"), ("model.layers.0.mlp.gate_up_proj", "linear")],
        ),
        case(
            "shard_names",
            [
                "model.layers.0.self_attn.q_a_proj",
                "model.layers.0.self_attn.kv_a_proj_with_mqa",
                "model.layers.0.mlp.gate_proj",
                "model.layers.0.mlp.up_proj",
            ],
            target=[(f"model.layers.0.self_attn.{fused_qkv}", "linear"), ("model.layers.0.mlp.gate_up_proj", "linear")],
        ),
        case("one_shard", ["model.layers.0.mlp.gate_proj"], target=[("model.layers.0.mlp.gate_up_proj", "linear")]),
        case(
            "expert_child",
            ["model.layers.3.mlp.experts.0.gate_proj"],
            target=[("model.layers.3.mlp.experts", "experts")],
        ),
        case(
            "mtp_names",
            [f"{mtp}.self_attn.o_proj", f"{mtp}.eh_proj", f"{mtp}.mlp.experts.0.gate_proj"],
            draft=[(f"{draft_block}.self_attn.o_proj", "linear"), (f"{draft_block}.mlp.experts", "experts")],
        ),
        case(
            "layer61",
            ["model.layers.61.self_attn.o_proj"],
            target=[("model.layers.61.self_attn.o_proj", "linear")],
            draft=[(f"{draft_block}.self_attn.o_proj", "linear")],
        ),
        case("whole_mtp", [mtp], draft=[(f"{draft_block}.self_attn.o_proj", "linear")]),
        case(
            "alias_names",
            ["model.decoder.self_attn.o_proj", "model.eh_proj"],
            draft=[(f"{draft_block}.self_attn.o_proj", "linear")],
        ),
        case("fuse_none", [], experts=256),
        case("fuse_6", [], experts=6),
        case("fuse_veto_target", [f"model.layers.3.mlp.shared_experts.{p}" for p in shared]),
        case("fuse_veto_mtp", [f"{mtp}.mlp.shared_experts.{p}" for p in shared]),
        case("fuse_veto_alias", [f"model.decoder.mlp.shared_experts.{p}" for p in shared]),
        case(
            "lqc_null_mtp",
            [],
            lqc={f"{mtp}.*": False},
            target=[("model.layers.0.self_attn.o_proj", "linear")],
            draft=[(f"{draft_block}.self_attn.o_proj", "linear")],
        ),
        case("lqc_null_glob", [], lqc={f"*layers.{n}.*": False}, draft=[(f"{draft_block}.self_attn.o_proj", "linear")]),
        case(
            "lqc_experts_only",
            [],
            lqc={"*mlp.experts*": True},
            global_weight=False,
            target=[("model.layers.3.mlp.experts", "experts"), ("model.layers.3.self_attn.o_proj", "linear")],
        ),
        case(
            "lqc_expert_entry",
            [],
            lqc={"model.layers.3.mlp.experts.0.gate_proj": True},
            global_weight=False,
            target=[("model.layers.3.mlp.experts", "experts")],
        ),
        case(
            "lqc_fused_shards",
            [],
            lqc={"*q_a_proj": False},
            target=[(f"model.layers.0.self_attn.{fused_qkv}", "linear")],
        ),
        case(
            "weights_only",
            [],
            inputs=False,
            target=[("model.layers.3.mlp.experts", "experts"), ("model.layers.3.self_attn.o_proj", "linear")],
        ),
        case(
            "lqc_excluded",
            ["model.layers.0.self_attn.o_proj"],
            lqc={"*o_proj": False},
            target=[("model.layers.0.self_attn.o_proj", "linear")],
        ),
    ]
    if engine == "vllm":
        # vLLM only: the indexer's wk + weights_proj are one linear built without a quant config; shared-expert
        # fusion is a ROCm aiter switch (server environment), with no expert-count allow-list, and must agree
        # across all MoE layers of a model.
        fse = {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1"}
        indexer = [f"model.layers.0.self_attn.indexer.{m}" for m in ("wq_b", "wk_weights_proj")]
        cases += [
            case(
                "indexer",
                [],
                target=[(m, "linear") for m in indexer],
                draft=[(f"{mtp}.self_attn.indexer.{m}", "linear") for m in ("wq_b", "wk_weights_proj")],
            ),
            case("fuse_env_only", [], env={"VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1"}),
            case("fuse_aiter", [], env=fse),
            case("fuse_aiter_6", [], experts=6, env=fse),
            case("fuse_aiter_veto_target", [f"model.layers.3.mlp.shared_experts.{p}" for p in shared], env=fse),
            case("fuse_aiter_veto_mtp", [f"{mtp}.mlp.shared_experts.{p}" for p in shared], env=fse),
        ]
    return cases


def summarize(answers: dict) -> dict:
    def d(case, role, key):
        a = answers[case]
        if "error" in a:
            return "ERR"
        return a[role]["decisions"].get(key, "-") if key else a[role]

    def short(v):
        return {"mxfp4": "Q", "bf16": "bf16"}.get(v, v if len(str(v)) < 14 else str(v)[:14])

    plain = answers["plain"]
    if "error" in plain:
        return {"error": plain["error"].splitlines()[-1]}
    row = {
        "draft": plain["draft"]["class"],
        "block": plain["draft"].get("block_prefix"),
        "eh_proj": f"{plain['draft']['eh_proj']['type']}/{short(plain['draft']['eh_proj']['decision'])}",
        "packed": ",".join(sorted(plain["target"]["packed_modules_mapping"])),
    }
    for name, a in answers.items():
        if "error" in a:
            row[name] = "ERR " + a["error"].strip().splitlines()[-1][:60]
            continue
        vals = [short(v) for role in ("target", "draft") for v in a[role]["decisions"].values()]
        if name.startswith("fuse_") and name != "fused_name":
            vals = [f"t{a['target']['fused_shared_experts']}d{a['draft']['fused_shared_experts']}"]
            # vLLM: the model-level flag its weight loader reads, where it disagrees with what the MoE blocks built
            vals += [
                f"{role[0]}loader:{a[role]['loader_fuses_shared_experts']}"
                for role in ("target", "draft")
                if "loader_fuses_shared_experts" in a[role]
                and bool(a[role]["loader_fuses_shared_experts"]) != bool(a[role]["fused_shared_experts"])
            ]
        if name == "whole_mtp":
            vals.append("blockQ" if a["draft"]["block_quantized"] else "blockBF16")
        if name == "alias_names" or name == "mtp_names":
            vals.append("eh:" + short(a["draft"]["eh_proj"]["decision"]))
        if vals:
            row[name] = " ".join(vals)
    return row


def main(argv: list[str]) -> int:
    engine, versions = argv[0], argv[1:]
    cases = diagnostic_cases(engine)
    for v in versions:
        row = summarize(run_probe(engine, v, cases))
        print(json.dumps({"version": v, **row}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
