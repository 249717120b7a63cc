"""What a probe subprocess is asked and answers, and how it is run.

Request (JSON on stdin): {"version": V, "cases": [{"name", "config": config.json as a dict,
"target": [[runtime prefix, kind], ...], "draft": [[runtime prefix, kind], ...]}]}, kind "linear" or
"experts"; a case may add "env": {name: value}, the server's environment variables (probes that model
none ignore it). Answer (JSON written to the path given as argv[2]): {"version", "cases": {name: answer or
{"error": traceback}}}. A decision is "mxfp4", "bf16", "bf16>mxfp4" (loaded bf16, re-quantized to MXFP4 after
loading), "other:<scheme class>[:<weight dtype>][:<weight qscheme>]" (`other`) or "error:<message>"; a probe that can
tell how the module computes adds ":emulated" or ":emulation?" (`EMULATED`, `EMULATION_UNKNOWN`).
A probe may add keys of its own to an answer (the vLLM probe: "unbuilt", "loader_fuses_shared_experts"). A case with
"draft_class_only" true (sglang's probe) asks only which class the release drafts the config's MTP layer with: the
answer is {"draft": {"class": name}}.
"""

from __future__ import annotations

import json
import sys
import traceback

MXFP4, BF16, OTHER, ERROR = "mxfp4", "bf16", "other:", "error:"
REQUANTIZED = "bf16>mxfp4"  # allocated and loaded bf16, re-quantized to MXFP4 after loading


# The releases' scheme objects (`other`: class, weight dtype, weight qscheme) that build a module in one of mxforge's
# element formats, by format name (registry names: mxforge/formats/); any other scheme stays "other:...".
ENGINE_SCHEMES = {
    "other:QuarkW8A8Fp8:per_channel": "fp8_ptpc",  # vLLM's and sglang's linear
    "other:QuarkW8A8Fp8MoEMethod:fp8:per_channel": "fp8_ptpc",  # vLLM's routed experts
    "other:QuarkW8A8FP8MoE:per_channel": "fp8_ptpc",  # sglang's routed experts
    "other:QuarkW8A8Fp8PerBlock": "fp8_block",  # vLLM's linear for Quark's per_block FP8 weights
    **{
        f"other:{scheme}:{fmt}": fmt  # vLLM's OCP MX linear and routed experts
        for scheme in ("QuarkOCP_MX", "QuarkOCP_MX_MoEMethod")
        for fmt in ("mxfp6_e2m3", "mxfp6_e3m2")
    },
}


# Suffixes a probe that can tell adds to a decision: the release computes the module by emulation, or which kernel it
# runs was left to a stand-in (not measured). A decision without one is measured native (or has no scheme).
EMULATED, EMULATION_UNKNOWN = ":emulated", ":emulation?"


def emulation(decision: str) -> bool | None:
    """Whether the release computes the module by emulation (None: not measured)."""
    return None if decision.endswith(EMULATION_UNKNOWN) else decision.endswith(EMULATED)


def form(decision: str) -> str:
    """A decision in mxforge's terms: "mxfp4", "bf16", "bf16>mxfp4", a registry format's name for a scheme that
    builds it (ENGINE_SCHEMES), "other:<scheme>" for any other, "error" for an error."""
    decision = decision.removesuffix(EMULATED).removesuffix(EMULATION_UNKNOWN)
    if decision in (MXFP4, BF16, REQUANTIZED):
        return decision
    if decision.startswith(ERROR):
        return "error"
    return ENGINE_SCHEMES.get(decision, decision)


def allocated(decision: str) -> str:
    """What the release allocates (and so must be stored) for a decision, in mxforge's terms (`form`)."""
    return BF16 if decision == REQUANTIZED else form(decision)


LINEAR, EXPERTS = "linear", "experts"
# A case may name the MTP block's projection of [embedding, hidden] ("eh_proj" in the DeepSeek-V3 lineage, Qwen3.5's
# "fc"); the answer reports it as "eh_proj" whatever its name.
MTP_PROJ = "mtp_proj"
# A case may name the class of the MTP draft's block sglang's probe records instead of building, by the end of its
# name ("DecoderLayer" in the lineage; Qwen3.5's draft builds a whole one-layer "ForCausalLM" text model).
DRAFT_BLOCK_CLASS = "draft_block_class"
DRAFT_CLASS_ONLY = "draft_class_only"


def hf_config(config: dict, mods: dict | None = None):
    """config.json as the server's get_config loads it: with the release's own config class where its registry
    (`mods["_config_classes"]`: model type -> (module, class), imported with what it imports from the package
    `mods["_config_package"]`) lists the model type (GLM-5.3-Flash's Glm5NextConfig: vLLM 0.30-0.31 derives
    `is_moe` in it, sglang copies top-level fields). Else, and where the release's class was written for an older
    transformers than the probe's and leaves its sub-configs as dicts (sglang 0.5.9 pins 4.57.1, 0.5.10 5.3.0),
    as AutoConfig.from_pretrained does: the model type's transformers class."""
    import copy

    import transformers

    entry = (mods or {}).get("_config_classes", {}).get(config.get("model_type"))
    if entry is not None:
        module, name = entry
        within = (mods["_config_package"],)
        cls = getattr(mods["_finder"].import_model(mods["_release"], module, within, mods["_pristine"]), name)
        own = cls.from_dict(copy.deepcopy(config))
        if not any(isinstance(getattr(own, key, None), dict) for key in getattr(cls, "sub_configs", {})):
            return own
    mapping, model_type = transformers.CONFIG_MAPPING, config.get("model_type")
    cls = mapping[model_type] if model_type in mapping else transformers.PretrainedConfig  # a lazy mapping: no .get
    return cls.from_dict(copy.deepcopy(config))


def other(scheme: str, weight_dtype: str | None, weight_qscheme: str | None) -> str:
    """The decision for a scheme other than MXFP4's: "other:<scheme class>[:<weight dtype>][:<weight qscheme>]"
    (the attributes the release's scheme object was built with, where it has them)."""
    return ":".join([OTHER + scheme, *(a for a in (weight_dtype, weight_qscheme) if isinstance(a, str))])


def error(exc: BaseException) -> str:
    return f"{ERROR}{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def serve(load, probe_case) -> None:
    """Entry point of a probe: `python PROBE.py VERSION ANSWER_PATH < request.json`."""
    version, answer_path = sys.argv[1], sys.argv[2]
    request = json.load(sys.stdin)  # {"cases": [...]}
    mods = load(version)
    answers = {}
    for case in request["cases"]:
        try:
            answers[case["name"]] = probe_case(mods, case)
        except Exception:
            answers[case["name"]] = {"error": traceback.format_exc(limit=-6)}
    with open(answer_path, "w") as f:
        json.dump({"version": version, "cases": answers}, f, indent=1, sort_keys=True)


def exclude_cases(config: dict, excludes: dict[str, list[str]], **fields) -> list[dict]:
    """One request case per named exclude list: `config` with its quantization_config's `exclude` replaced, and
    `fields` (the case's "target", "draft" and any other keys) as given."""
    qc = config["quantization_config"]
    return [
        {"name": name, "config": {**config, "quantization_config": {**qc, "exclude": exclude}}, **fields}
        for name, exclude in excludes.items()
    ]


def run_releases(releases: list[tuple[str, str]], cases_of) -> dict[tuple[str, str], dict]:
    """Each (engine, release)'s answers to `cases_of(engine)`, one probe process per release, two at a time (a probe
    is a process of its own: the two use both cores)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2, thread_name_prefix="probe") as pool:
        futures = {(e, r): pool.submit(run_probe, e, r, cases_of(e)) for e, r in releases}
        return {key: f.result() for key, f in futures.items()}


def decisions(part: dict) -> dict[str, str]:
    """A target's or draft's decisions by runtime prefix, without the mark of an emulation the probe left to a
    stand-in (EMULATION_UNKNOWN): what an engine-truth pin compares."""
    return {prefix: d.removesuffix(EMULATION_UNKNOWN) for prefix, d in part["decisions"].items()}


def run_probe(engine: str, version: str, cases: list[dict], timeout: float = 600) -> dict:
    """Run `<engine>_probe.py VERSION` in a fresh interpreter on `cases`; the answers by case name.

    Raises:
        RuntimeError: the probe process failed (its stderr's tail is in the message).
    """
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    probe = Path(__file__).with_name(f"{engine}_probe.py")
    with tempfile.TemporaryDirectory(prefix="mxforge-probe-") as tmp:
        answer = Path(tmp) / "answer.json"
        proc = subprocess.run(
            [sys.executable, str(probe), version, str(answer)],
            input=json.dumps({"cases": cases}),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"},
        )
        if proc.returncode != 0 or not answer.exists():
            raise RuntimeError(f"{engine} {version} probe exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        return json.loads(answer.read_text())["cases"]
