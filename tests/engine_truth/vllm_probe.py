"""Ask one vLLM release, by executing its own code, how it would load a Quark checkpoint.

Run as a subprocess: `python vllm_probe.py VERSION ANSWER_PATH < request.json` (see probe_io.py for the
request and answer shapes). Executed from the release's wheel: `VllmConfig._get_quantization_config` and
`get_quant_config` (Quark config from `quantization_config`), the model registry, `initialize_model`
(`configure_quant_config`: packed-module mapping and `hf_to_vllm_mapper` of the model class), the target
and draft classes' constructors down to their linears and routed experts (decoder layers, MLA attention,
the DSA indexer, the MoE block with its shared-expert fusion gate), `SpeculativeConfig.hf_config_override`
(which architecture builds the MTP draft) and, per module, `resolve_quant_method` ->
`QuarkConfig.get_quant_method` (exclusion test, scheme selection) at the moment the engine builds it.

Stand-ins (stubs.py): linear layers, the routed-expert layer, norms, embeddings and kernels are inert
objects that record the arguments the engine's code gives them; the platform is an AMD MI355X (ROCm,
gfx950, CDNA4, aiter installed); one GPU (no tensor/pipeline/expert parallelism); the MLA attention base
class accepts anything; the MXFP4 MoE kernel oracle finds no native kernel (emulation); the model config's
`quantization` is "quark" (what ModelConfig reads from `quant_method`). The draft shares the target's
QuarkConfig object, as `replace(vllm_config, ...)` keeps `quant_config` in the release. A case's "env"
(probe_io) sets the server's environment (e.g. the ROCm aiter switches that gate shared-expert fusion).
Answers add "unbuilt" (requested modules the model never builds: decided as a layer of their kind) and
"loader_fuses_shared_experts" (the model-level flag the weight loader reads; None: the model has none).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch  # real torch and transformers before any stub is installed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_truth import probe_io, stubs  # noqa: E402
from engine_truth.wheels import Release  # noqa: E402

Q = "vllm.model_executor.layers.quantization."
MODELS = "vllm.model_executor.models."
MODULES = [
    Q[:-1],
    Q + "base_config",
    Q + "quark.quark",
    Q + "quark.quark_moe",
    Q + "quark.utils",
    Q + "utils.config_utils",
    Q + "utils.ocp_mx_utils",
    Q + "utils.quant_utils",
    "vllm.envs",
    "vllm._aiter_ops",
    "vllm.model_executor.layers.fused_moe.utils",
    "vllm.model_executor.layers.fused_moe.fused_moe_method_base",
    "vllm.transformers_utils.model_arch_config_convertor",
    "vllm.model_executor.model_loader.utils",
    "vllm.model_executor.model_loader.weight_utils",
    MODELS + "registry",
    MODELS + "utils",
    MODELS + "interfaces",
]
# Where the registry's model classes live. No model module is listed: the one the release's registry names for a
# case's architecture (target, and the draft's from SpeculativeConfig) is fetched when asked for, with the model
# modules it imports (Release.import_closure), so a family is learned from its config's architectures.
# Layer modules whose classes build a model's quantizable linears themselves (the gated-delta-net linear attention
# of Qwen3-Next / Qwen3.5: in_proj_qkvz, in_proj_ba, out_proj; its state-dtype base and helpers) are fetched with
# the model modules that import them; their kernels (mamba ops) stay stubs.
MAMBA = "vllm.model_executor.layers.mamba."
MODEL_PACKAGES = (MODELS, "vllm.models.", MAMBA + "gdn.", MAMBA + "abstract", MAMBA + "mamba_utils")
OPTIONAL = [MODELS + "expert_substitution", "vllm.model_executor.layers.fused_moe.expert_substitution"]
SOURCE_ONLY = (  # methods of pydantic config classes (their modules cannot be imported with stubs)
    ("vllm.config.vllm", "VllmConfig._get_quantization_config"),
    ("vllm.config.speculative", "SpeculativeConfig.hf_config_override"),
    ("vllm.config.model", "ModelConfig.use_mla"),  # a property: called with the model config
    ("vllm.transformers_utils.config", "get_hf_text_config"),  # ModelConfig.hf_text_config: a multimodal model's LM
)
LINEAR_CLASSES = (
    "LinearBase",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "DCPGroupColumnParallelLinear",
    "MergedReplicatedLinear",
)
FUSED_MOE = "vllm.model_executor.layers.fused_moe"
MXFP4_ORACLE = FUSED_MOE + ".oracle.mxfp4"


ORACLE_CALLS = [0]  # how often the stand-in oracle answered: a MoE method that asked it has no measured backend


def _no_mxfp4_kernel(*args, **kwargs):
    """The MXFP4 MoE kernel oracle's answer when no native kernel applies: emulation (kernels are out of scope)."""
    ORACLE_CALLS[0] += 1
    return stubs.stub_class(MXFP4_ORACLE + ".Mxfp4MoeBackend").NONE, None


class LogRecorder:
    """Stands in for a module's logger: every message is kept (warning_once too, never deduplicated), so the probe
    reads what the release says while it builds one module (its OCP MX scheme's "Simulated ..." warning)."""

    def __init__(self):
        self.messages: list[str] = []

    def __getattr__(self, name: str):
        return lambda msg="", *args, **kwargs: self.messages.append(str(msg))


LOG = LogRecorder()
EMULATION_MODULES = (Q + "quark.schemes.quark_ocp_mx", Q + "quark.quark_moe")  # their loggers are LOG


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


AMD_MI355X = DeviceCapability(9, 5)


def _value(v):
    return lambda *a, **k: v


class RocmPlatform(stubs.StubBase):
    """`current_platform` on an AMD MI355X: ROCm, gfx950, OCP fp8, native MX; anything else is inert."""

    _stub = True
    device_type = "meta"  # buffers the constructors allocate stay unallocated
    dispatch_key = "CUDA"
    supported_quantization = ["quark"]
    is_rocm, is_cuda_alike, supports_mx = _value(True), _value(True), _value(True)
    is_cuda, is_xpu, is_cpu, is_tpu, is_out_of_tree = (_value(False),) * 5
    is_fp8_fnuz = _value(False)
    fp8_dtype = _value(torch.float8_e4m3fn)
    get_device_capability = _value(AMD_MI355X)
    is_device_capability = staticmethod(lambda cap, *a: cap in (AMD_MI355X, AMD_MI355X.to_int()))
    has_device_capability = staticmethod(
        lambda cap, *a: AMD_MI355X.to_int() >= (cap if isinstance(cap, int) else DeviceCapability(*cap).to_int())
    )
    is_device_capability_family = _value(False)
    get_device_name = _value("AMD Instinct MI355X")


ROCM_ARCH = {
    "on_gfx9": True,
    "on_gfx950": True,
    "on_mi3xx": True,
    "on_cdna": True,
    "get_cdna_version": 4,
    "on_gfx942": False,
    "on_gfx90a": False,
    "on_gfx1x": False,
    "on_rdna": False,
    "on_rdna4": False,
    "on_gfx1250": False,
    "get_rdna_version": 0,
}


class _Group(stubs.StubBase):
    _stub = True
    world_size, rank_in_group, rank, is_first_rank, is_last_rank = 1, 0, 0, True, True
    device_group = stubs.Namespace(size=_value(1), rank=_value(0))


ONE_GPU = {
    "get_tensor_model_parallel_world_size": _value(1),
    "get_tensor_model_parallel_rank": _value(0),
    "get_pp_group": _value(_Group()),
    "get_tp_group": _value(_Group()),
    "get_ep_group": _value(_Group()),
    "get_dp_group": _value(_Group()),
    "get_pcp_group": _value(_Group()),
    "get_dcp_group": _value(_Group()),
}


class InertAttentionBase(torch.nn.Module):
    """Stand-in for the MLA attention-layer base class (MLAAttention): accepts any arguments; a real
    class deriving from it reads back what it sets, and anything the base would have provided is inert."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") and name.endswith("__"):
                raise
            return stubs.StubBase()


DISTRIBUTED_UTILS = "vllm.distributed.utils"
UTILS_OWN = ("ensure_divisibility", "divide")  # the release's own (a multimodal tower's attention sizes its heads)


def overrides(release: Release) -> dict[str, dict]:
    path = release.fetch([DISTRIBUTED_UTILS]).get(DISTRIBUTED_UTILS)
    own = stubs.functions_from_source(path, UTILS_OWN) if path is not None else {}
    linear = {}
    base = stubs.stub_class("vllm.model_executor.layers.linear.LinearBase")
    for name in LINEAR_CLASSES[1:]:
        linear[name] = stubs.StubMeta(
            name,
            (base,),
            {"__module__": "stub", "_stub": True, "__qualname__": f"vllm.model_executor.layers.linear.{name}"},
        )
    linear["LinearBase"] = base
    routed = stubs.stub_class(f"{FUSED_MOE}.RoutedExperts")
    gate = stubs.StubMeta("GateLinear", (linear["ReplicatedLinear"],), {"__module__": "stub", "_stub": True})
    experts = {
        name: stubs.StubMeta(name, (routed,), {"__module__": "stub", "_stub": True})
        for name in ("FusedMoE", "SharedFusedMoE", "FusedMoEFactory")
    }
    return {
        "vllm.platforms": {"current_platform": RocmPlatform()},
        "vllm.platforms.rocm": {k: _value(v) for k, v in ROCM_ARCH.items()},
        "vllm.distributed": {**ONE_GPU, **own},
        "vllm.distributed.parallel_state": ONE_GPU,
        DISTRIBUTED_UTILS: {"get_pp_indices": lambda n, rank, size: (0, n), **own},
        "vllm.model_executor.offloader": {"get_offloader": _value(stubs.Namespace(wrap_modules=list))},
        "vllm.model_executor.layers.linear": linear,
        FUSED_MOE: {"RoutedExperts": routed, "GateLinear": gate, **experts},
        FUSED_MOE + ".layer": {"RoutedExperts": routed, **experts},
        FUSED_MOE + ".routed_experts": {"RoutedExperts": routed},
        FUSED_MOE + ".router.gate_linear": {"GateLinear": gate},
        MXFP4_ORACLE: {"select_mxfp4_moe_backend": _no_mxfp4_kernel},
        "vllm.model_executor.layers.attention": {"MLAAttention": InertAttentionBase},
    }


def load(version: str) -> dict:
    release = Release("vllm", version)
    wanted = MODULES + OPTIONAL + release.package_modules(Q + "quark.schemes")
    sources = release.fetch(wanted)
    missing = [m for m in MODULES if m not in sources]
    if missing:
        raise LookupError(f"vllm {version} has no {missing}")
    source_only = release.fetch([m for m, _ in SOURCE_ONLY])
    # aiter (ROCm kernels) is present, as on an AMD host: a stub
    finder = stubs.install("vllm", sources, overrides=overrides(release))
    # the package re-exports the real base of the MoE quant methods (its __init__ is not executed)
    base = importlib.import_module(FUSED_MOE + ".fused_moe_method_base").FusedMoEMethodBase
    setattr(importlib.import_module(FUSED_MOE), "FusedMoEMethodBase", base)
    mods = {m: importlib.import_module(m) for m in wanted if m in sources and not m.startswith("vllm.models.")}
    oracle = getattr(mods[Q + "quark.quark_moe"], "select_mxfp4_moe_backend", _no_mxfp4_kernel)
    if oracle is not _no_mxfp4_kernel:
        raise LookupError(f"vllm {version}: quark_moe takes its MXFP4 kernel oracle from elsewhere than {MXFP4_ORACLE}")
    for module, name in SOURCE_ONLY:
        if module not in source_only:
            raise LookupError(f"vllm {version} has no {module}")
        mods[name] = stubs.functions_from_source(source_only[module], (name,), module=module)[name]
    mods["_pristine"] = stubs.packed_mappings("vllm")
    mods["_finder"], mods["_release"] = finder, release
    mods["_config_classes"], mods["_config_package"] = config_registry(release), CONFIGS + "s."
    for module in EMULATION_MODULES:
        if module in mods:
            mods[module].logger = LOG
    return mods


CONFIGS = "vllm.transformers_utils.config"


def config_registry(release: Release) -> dict[str, tuple[str, str]]:
    """The release's own config classes, model type -> (module, class): `_CONFIG_REGISTRY` (its get_config builds
    these model types with them, not with transformers') resolved through its configs package's `_CLASS_TO_MODULE`.
    Both are literals in the source, read without executing those modules."""
    registry = stubs.literal_from_source(release.source(CONFIGS), "_CONFIG_REGISTRY")
    modules = stubs.literal_from_source(release.source(CONFIGS + "s"), "_CLASS_TO_MODULE")
    return {t: (modules[c], c) for t, c in registry.items() if c in modules}


def model_class(mods: dict, arch: str) -> type:
    """The registry's entry for `arch`, imported as `_LazyRegisteredModel.load_model_cls` does."""
    entry = mods[MODELS + "registry"]._VLLM_MODELS.get(arch)
    if entry is None:
        raise LookupError(f"the model registry has no {arch}")
    module, name = entry
    if not module.startswith("vllm."):
        module = MODELS + module
    mod = mods["_finder"].import_model(mods["_release"], module, MODEL_PACKAGES, mods["_pristine"])
    if isinstance(mod, stubs.StubModule):
        raise LookupError(f"the registry maps {arch} to {module}, which this probe does not fetch")
    return getattr(mod, name)


def model_config(mods: dict, hf, max_model_len: int = 4096):
    """The server's ModelConfig for `hf` (config.json as loaded): a record of the fields the code reads, with
    `use_mla` computed by the release (`ModelConfig.use_mla`, the arch convertor's `is_deepseek_mla`)."""
    text = mods["get_hf_text_config"](hf)
    mc = stubs.stub_class("vllm.config.ModelConfig")(
        model="/nonexistent",
        hf_config=hf,
        hf_text_config=text,
        quantization="quark",
        quantization_config=None,
        dtype=torch.bfloat16,
        revision=None,
        hf_overrides={},
        max_model_len=max_model_len,
        convert_type="none",
        runner_type="generate",
        model_impl="auto",
        trust_remote_code=False,
        enforce_eager=False,
        architectures=list(hf.architectures),
        using_transformers_backend=_value(False),
    )  # the registry resolved a vLLM class, not the Transformers backend
    convertor = mods["vllm.transformers_utils.model_arch_config_convertor"].ModelArchConfigConvertorBase(hf, text)
    mc.is_deepseek_mla = convertor.is_deepseek_mla()
    mc.use_mla = mods["ModelConfig.use_mla"](mc)
    return mc


def vllm_config(mods: dict, target_mc, qc, draft_mc=None):
    """The server's VllmConfig with default settings on one GPU (a record of the fields the code reads)."""
    cfg = stubs.stub_class("vllm.config.VllmConfig")
    parallel = stubs.stub_class("vllm.config.ParallelConfig")(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        enable_expert_parallel=False,
        enable_eplb=False,
        use_sequence_parallel_moe=False,
        eplb_config=stubs.Namespace(num_redundant_experts=0),
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
        dcp_q_replicate=False,
    )
    spec = (
        None
        if draft_mc is None
        else stubs.stub_class("vllm.config.SpeculativeConfig")(
            method="mtp",
            num_speculative_tokens=1,
            draft_model_config=draft_mc,
            draft_tensor_parallel_size=1,
            moe_backend=None,
            attention_backend=None,
            kv_cache_dtype=None,
        )
    )
    return server_config(
        mods,
        cfg,
        model_config=target_mc,
        quant_config=qc,
        parallel_config=parallel,
        speculative_config=spec,
        scheduler_config=stubs.Namespace(max_num_batched_tokens=8, max_num_seqs=1),
        cache_config=stubs.stub_class("vllm.config.CacheConfig")(
            cache_dtype="auto", block_size=64, mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto"
        ),  # the server defaults (linear-attention state dtypes: the model's)
        load_config=stubs.Namespace(load_format="auto", device=None, model_loader_extra_config={}),
        device_config=stubs.Namespace(device=torch.device("meta")),
        lora_config=None,
        kv_transfer_config=None,
    )


def server_config(mods: dict, cls: type, **fields):
    """A VllmConfig record whose `with_hf_config` (how a multimodal model builds its language model under the
    text config: GLM-5.3-Flash's init_vllm_registered_model) gives the same server settings with the model config
    rebuilt for that config, as the release's method does."""
    import copy
    import types

    config = cls(**fields)

    def with_hf_config(self, hf_config, architectures=None):
        if architectures is not None:
            hf_config = copy.deepcopy(hf_config)
            hf_config.architectures = architectures
        return server_config(mods, cls, **{**fields, "model_config": model_config(mods, hf_config)})

    config.with_hf_config = types.MethodType(with_hf_config, config)
    return config


def quant_config(mods: dict, mc):
    """`VllmConfig._get_quantization_config`: `get_quant_config` (QuarkConfig.from_config), the capability and
    dtype checks, `maybe_update_config`."""
    return mods["VllmConfig._get_quantization_config"](mc, stubs.Namespace(load_format="auto"))


def draft_hf_config(mods: dict, config: dict):
    """The MTP draft's hf_config: the target's config.json through `SpeculativeConfig.hf_config_override`."""
    return mods["SpeculativeConfig.hf_config_override"](probe_io.hf_config(config, mods))


class Build:
    """One model construction: every stand-in layer the engine's code builds, and the decision the release
    makes for each requested module at the moment it is built (as LinearBase / RoutedExperts do)."""

    def __init__(self, mods: dict, wanted: dict[str, str]):
        self.mods, self.wanted = mods, wanted
        self.built: dict[str, stubs.StubBase] = {}
        self.decisions: dict[str, str] = {}

    def __call__(self, obj) -> None:
        prefix = obj._stub_kwargs.get("prefix")
        if not isinstance(prefix, str):
            return
        self.built[prefix] = obj
        if prefix in self.wanted:
            self.decisions[prefix] = decide(self.mods, quant_config_of(self.mods, obj), prefix, obj)


def quant_config_of(mods: dict, layer):
    """The quant config the engine's code built a stand-in layer with (keyword or positional), or None."""
    kwargs = layer._stub_kwargs
    if "quant_config" in kwargs:
        return kwargs["quant_config"]
    base = mods[Q + "base_config"].QuantizationConfig
    return next((a for a in layer._stub_args if isinstance(a, base)), None)


def layer_base(mods: dict, kind: str) -> type:
    quark = mods[Q + "quark.quark"]
    return quark.LinearBase if kind == probe_io.LINEAR else quark.RoutedExperts


def decide(mods: dict, qc, prefix: str, layer) -> str:
    """MXFP4 / bf16 / another scheme, or the error the release raises, for one module built with `qc`.

    A layer built without a quant config is unquantized; with one, the release's `resolve_quant_method`
    picks the method (a linear whose config answers None is a load error, an expert bank falls back to
    the unquantized method), as in LinearBase.__init__ and RoutedExperts._get_quant_method.
    """
    if qc is None:
        return probe_io.BF16
    quark = mods[Q + "quark.quark"]
    is_linear = isinstance(layer, quark.LinearBase)
    resolve = mods[Q + "base_config"].resolve_quant_method  # outside the try: a missing entry point is no decision
    LOG.messages.clear()
    ORACLE_CALLS[0] = 0
    try:
        method = resolve(qc, layer, prefix)
    except Exception as e:  # the release raises while building the layer: a load failure
        return probe_io.error(e)
    return _with_emulation(_decision(mods, method, layer, is_linear), method, is_linear)


def _with_emulation(decision: str, method, is_linear: bool) -> str:
    """The decision marked as the release computes it: emulated (a linear scheme that said "Simulated ...", an expert
    bank whose MoE method chose the emulation backend by itself), unknown (an expert bank whose backend the
    stand-in kernel oracle chose: kernels are out of scope), or as it is (measured native, or no scheme)."""
    if decision in (probe_io.BF16, probe_io.REQUANTIZED) or decision.startswith(probe_io.ERROR):
        return decision
    if is_linear:
        return decision + probe_io.EMULATED if any("Simulated" in m for m in LOG.messages) else decision
    backend = getattr(method, "mxfp4_backend", None)  # the Mxfp4MoeBackend member (a stand-in class of that name)
    name = backend.name if isinstance(getattr(backend, "name", None), str) else getattr(backend, "__name__", None)
    if ORACLE_CALLS[0]:
        return decision + probe_io.EMULATION_UNKNOWN
    return decision + probe_io.EMULATED if name == "EMULATION" else decision


def _decision(mods: dict, method, layer, is_linear: bool) -> str:
    quark = mods[Q + "quark.quark"]
    if method is None:
        return (
            probe_io.error(ValueError("All linear layers should support quant method.")) if is_linear else probe_io.BF16
        )
    if isinstance(method, (quark.UnquantizedLinearMethod, quark.UnquantizedFusedMoEMethod)):
        return probe_io.BF16
    scheme = layer.__dict__.get("scheme") if is_linear else method
    dtype = getattr(scheme, "weight_dtype", None)
    name = type(scheme).__name__
    if name in ("QuarkOCP_MX", "QuarkOCP_MX_MoEMethod") and dtype == "mxfp4":
        return probe_io.REQUANTIZED if getattr(scheme, "dynamic_mxfp4_quant", False) else probe_io.MXFP4
    return probe_io.other(name, dtype, getattr(scheme, "weight_qscheme", None))


def fused_shared_experts(mods: dict, model) -> int | str:
    """Shared experts the built MoE blocks append to their routed-expert bank (DeepseekV2MoE's per-layer
    decision, the fusion gate); "mixed:k/n" when only k of n MoE blocks fuse."""
    blocks = [m for _, m in stubs.walk(model) if is_moe_block(m)]
    # Routed-expert banks built with no shared expert by blocks that never decide fusion (vLLM 0.30's Glm5NextMoE)
    banks = [
        kw
        for _, m in stubs.walk(model)
        if "num_experts" in (kw := getattr(m, "__dict__", {}).get("_stub_kwargs") or {})
    ]
    if not blocks and banks and not any(b.get("n_shared_experts") or b.get("fuse_shared_experts") for b in banks):
        return 0
    if not blocks and getattr(model.config, "n_routed_experts", None):
        raise LookupError(
            f"{type(model).__name__} built no MoE block that decides its own shared-expert fusion (sets "
            "is_fused_shared_expert_enabled beside its routed `experts`): this release decides fusion elsewhere"
        )
    fused = [int(m.n_shared_experts or 0) if m.is_fused_shared_expert_enabled else 0 for m in blocks]
    if len(set(fused)) > 1:
        return f"mixed:{sum(1 for f in fused if f)}/{len(fused)}"
    return fused[0] if fused else 0


def is_moe_block(module) -> bool:
    """A MoE block, known by what it does rather than its class: it decides shared-expert fusion for itself
    (DeepseekV2MoE, Glm4MoE: is_fused_shared_expert_enabled) and holds the routed experts (`experts`)."""
    own = getattr(module, "__dict__", {})
    return "is_fused_shared_expert_enabled" in own and (
        "experts" in own or "experts" in getattr(module, "_modules", {})
    )


def loader_fuses(mods: dict, model) -> bool | None:
    """The model-level flag the release's weight loader reads to route shared experts into the bank (None: the
    model has no such flag, its loader never does)."""
    flags = [
        m.__dict__["is_fused_shared_expert_enabled"]
        for _, m in stubs.walk(model)
        if "is_fused_shared_expert_enabled" in getattr(m, "__dict__", {}) and not is_moe_block(m)
    ]
    return bool(flags[0]) if flags else None


@contextlib.contextmanager
def server_env(env: dict[str, str], mods: dict):
    """Environment variables of the server process: vLLM's defaults plus `env`; the ROCm aiter switches are
    re-read (`rocm_aiter_ops.refresh_env_variables`, the release's own hook)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    ops = mods["vllm._aiter_ops"].rocm_aiter_ops
    ops.refresh_env_variables()
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("VLLM_")]:
            del os.environ[k]
        os.environ.update(saved)
        ops.refresh_env_variables()


def build(mods: dict, cls: type, vcfg, model_cfg, wanted: dict[str, str]):
    """`initialize_model(vllm_config, model_class=cls, model_config=...)` with the decisions recorded;
    the decoder-layer classes of the model's module record the prefixes they are built with."""
    loader = mods["vllm.model_executor.model_loader.utils"]
    rec = Build(mods, wanted)
    blocks: list[str] = []
    patches = []
    module = sys.modules[cls.__module__]
    classes = {
        value
        for name, value in vars(module).items()
        if isinstance(value, type) and name.endswith("DecoderLayer") and issubclass(value, torch.nn.Module)
    }
    built: set[int] = set()
    for value in classes:
        patches.append(mock.patch.object(value, "__init__", _recording_init(value.__init__, blocks, built)))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(torch.device("meta"))
        stack.enter_context(stubs.recording(rec))
        # the registry's class for a model config's architecture (a multimodal model initializes its language model
        # from the text config: GLM-5.3-Flash's Glm5NextForCausalLM)
        resolve = lambda mc: (cls, cls.__name__) if mc is model_cfg else (model_class(mods, mc.architectures[0]),) * 2  # noqa: E731
        stack.enter_context(mock.patch.object(loader, "get_model_architecture", resolve))
        model = loader.initialize_model(vcfg, model_class=cls, model_config=model_cfg)
    return model, rec, blocks


def _recording_init(init, blocks: list[str], built: set[int]):
    """A decoder-layer class's own constructor that first records the prefix its block is built with, once per
    block (a subclass's constructor calling its base's records once). The class itself is kept, not replaced by a
    subclass: a model's code may name its bases (Qwen3.5's `super(Qwen3NextDecoderLayer, self)`)."""

    def __init__(self, *args, **kwargs):
        if id(self) not in built:
            built.add(id(self))
            blocks.append(kwargs.get("prefix", args[1] if len(args) > 1 and isinstance(args[1], str) else None))
        init(self, *args, **kwargs)

    return __init__


def decisions(mods: dict, rec: Build, model, qc, wanted: dict[str, str]) -> tuple[dict, list]:
    """Per requested module: the decision made when the engine built it under that prefix; else, for a module
    found at that path in the built model, the decision for the prefix it was built with (a plain torch
    layer never consults the quant config); a module the model never builds is decided by the model's
    quant config for a layer of its kind, and listed as unbuilt."""
    out, unbuilt = {}, []
    paths = dict(stubs.walk(model))
    for prefix, kind in wanted.items():
        obj = paths.get(prefix)
        if prefix in rec.decisions:
            out[prefix] = rec.decisions[prefix]
        elif isinstance(obj, stubs.StubBase) and isinstance(obj._stub_kwargs.get("prefix"), str):
            out[prefix] = decide(mods, quant_config_of(mods, obj), obj._stub_kwargs["prefix"], obj)
        elif obj is not None and type(obj).__module__.startswith("torch.nn"):
            out[prefix] = probe_io.BF16
        else:
            unbuilt.append(prefix)
            out[prefix] = decide(mods, qc, prefix, layer_base(mods, kind)())
    return out, unbuilt


def probe_case(mods: dict, case: dict) -> dict:
    """One checkpoint config, as one server process sees it: target first, then the MTP draft, sharing the
    target's quant config object; class state and environment start fresh for every case."""
    stubs.restore_packed_mappings(mods["_pristine"])
    with server_env(case.get("env", {}), mods):
        hf = probe_io.hf_config(case["config"], mods)
        target_mc = model_config(mods, hf)
        target_cls = model_class(mods, hf.architectures[0])
        qc = quant_config(mods, target_mc)
        wanted = {p: k for p, k in case["target"]}
        target_model, rec, _ = build(mods, target_cls, vllm_config(mods, target_mc, qc), target_mc, wanted)
        target_dec, target_unbuilt = decisions(mods, rec, target_model, qc, wanted)
        target = {
            "class": target_cls.__name__,
            "packed_modules_mapping": dict(qc.packed_modules_mapping),
            "fused_shared_experts": fused_shared_experts(mods, target_model),
            "loader_fuses_shared_experts": loader_fuses(mods, target_model),
            "decisions": target_dec,
            "unbuilt": target_unbuilt,
        }

        draft_hf = draft_hf_config(mods, case["config"])
        draft_mc = model_config(mods, draft_hf)
        draft_cls = model_class(mods, draft_hf.architectures[0])
        wanted = {p: k for p, k in case["draft"]}
        draft_model, rec, blocks = build(mods, draft_cls, vllm_config(mods, target_mc, qc, draft_mc), draft_mc, wanted)
        draft_dec, draft_unbuilt = decisions(mods, rec, draft_model, qc, wanted)
        if len(blocks) != 1:
            raise RuntimeError(f"{draft_cls.__name__} built {len(blocks)} decoder blocks: {blocks}")
        block = blocks[0]
        under = [o for p, o in rec.built.items() if p.startswith(block + ".")]
        proj = case.get(probe_io.MTP_PROJ, "eh_proj")  # the MTP block's projection of [embedding, hidden]
        eh_path, eh = next(((p, o) for p, o in stubs.walk(draft_model) if p.rpartition(".")[2] == proj), (None, None))
        if eh is None:
            raise LookupError(f"{draft_cls.__name__} has no {proj}")
        stand_in = isinstance(eh, stubs.StubBase)  # else a torch layer, which never consults the quant config
        draft = {
            "class": draft_cls.__name__,
            "architecture": draft_hf.architectures[0],
            "packed_modules_mapping": dict(qc.packed_modules_mapping),
            "block_prefix": block,
            "block_quantized": any(quant_config_of(mods, o) is not None for o in under),
            "eh_proj": {
                "type": type(eh).__name__,
                "prefix": eh._stub_kwargs.get("prefix") if stand_in else eh_path,
                "decision": decide(mods, quant_config_of(mods, eh), eh._stub_kwargs.get("prefix"), eh)
                if stand_in
                else probe_io.BF16,
            },
            "fused_shared_experts": fused_shared_experts(mods, draft_model),
            "loader_fuses_shared_experts": loader_fuses(mods, draft_model),
            "decisions": draft_dec,
            "unbuilt": draft_unbuilt,
        }
    return {"target": target, "draft": draft}


if __name__ == "__main__":
    probe_io.serve(load, probe_case)
