"""Ask one sglang release, by executing its own code, how it would load a Quark checkpoint.

Run as a subprocess: `python sglang_probe.py VERSION < request.json > answer.json` (see probe_io.py for
the request and answer shapes). The release's modules that decide quantization are executed from its
wheel: the loader's `_get_quantization_config` (packed-module mapping, name mapper), the Quark config's
`get_quant_method` (exclusion test, fused shards, per-layer schemes), `ModelConfig._config_draft_model`
(which class builds the MTP draft), the draft class's constructor (whole-draft switch, exclusion remap,
`eh_proj`'s type, the decoder block's prefix) and the shared-expert fusion gate. Everything else is an
inert stand-in (stubs.py). The platform is an AMD MI355X (gfx950, capability 9.5): where MXFP4 serves.
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
import types
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_truth import probe_io, stubs  # noqa: E402
from engine_truth.wheels import Release  # noqa: E402

PKG = "sglang.srt."
MODULES = [
    PKG + m
    for m in (
        "layers.quantization.base_config",
        "layers.quantization.quark.utils",
        "layers.quantization.quark.quark",
        "models.utils",
        "configs.model_config",
        "model_loader.loader",
        "model_loader.weight_utils",
        "layers.moe.utils",
        "configs.shared_experts",
    )
]
UTILS = PKG + "utils.common"
# No model module is listed: sglang's ModelRegistry registers the EntryClass of every module of this package, and the
# probe reads those assignments from the sources (entry_modules), then fetches the module that names a case's
# architecture (target, and the draft's from ModelConfig._config_draft_model) with the model modules it imports.
MODEL_PACKAGE = PKG + "models"
# What a model class builds that the probe records instead of building, by the release's naming of model classes:
# the target's layer stack (`<Arch>Model`: DeepseekV2Model, Glm4MoeModel, Glm4MoeLiteModel...) and the draft's decoder
# block (`<Arch>DecoderLayer`), found in the namespaces its constructors run in (`recorded`), not listed per family.
TARGET_STACK, DRAFT_BLOCK = "Model", "DecoderLayer"
AMD_MI355X = (9, 5)
PLATFORM = {
    name: (lambda value: lambda *a, **k: value)(value)
    for name, value in {
        "is_hip": True,
        "is_cuda": False,
        "is_npu": False,
        "is_cpu": False,
        "is_xpu": False,
        "is_musa": False,
        "is_cuda_alike": True,
        "is_hpu": False,
        "is_blackwell_supported": False,
        "is_sm90_supported": False,
        "is_sm100_supported": False,
        "get_device_capability": AMD_MI355X,
        "is_gfx95_supported": True,
    }.items()
}


def _unbuilt_stack(num_hidden_layers, layer_fn, *args, pp_rank=None, pp_size=None, **kwargs):
    """Stand-in for the release's make_layers / make_pp_layers: a layer stack is recorded, not built (as the
    lineage's `<Arch>Model` stacks are), returned in the shape its caller unpacks: the list, with the stage's range
    where a pipeline rank is given (make_layers) or always (make_pp_layers, which passes none)."""
    layers = __import__("torch").nn.ModuleList()
    return layers if kwargs.pop("_list_only", False) else (layers, 0, num_hidden_layers)


STACKS = {
    "make_layers": lambda n, fn, *a, pp_rank=None, pp_size=None, **k: _unbuilt_stack(
        n, fn, _list_only=pp_rank is None or pp_size is None
    ),
    "make_pp_layers": lambda n, fn, *a, **k: _unbuilt_stack(n, fn),
    "make_layers_non_pp": lambda n, fn, *a, **k: _unbuilt_stack(n, fn, _list_only=True),
}


class Recorder(stubs.StubBase):
    """Stand-in for the target's layer stacks and the draft's decoder block: remembers what it was built with (the
    `quant_config` and `prefix` arguments, bound by the signature of the class it replaces: a decoder block takes
    `config, layer_id, quant_config, prefix`, Qwen3.5's draft model `config, quant_config, prefix`); what the model's
    code reads back from it is inert (Qwen3.5 reads its vision tower's deepstack indexes)."""

    _stub = True
    _replaces: type | None = None

    def __bool__(self):
        return True

    def __init__(self, *args, **kwargs):
        import inspect

        try:
            bound = inspect.signature(self._replaces.__init__).bind(self, *args, **kwargs).arguments
        except (TypeError, ValueError, AttributeError):  # no signature to bind to: keywords only
            bound = kwargs
        self.prefix, self.quant_config = bound.get("prefix", ""), bound.get("quant_config")


def recorder_for(cls: type) -> type:
    """A Recorder standing in for `cls`."""
    return type(f"Recorded{cls.__name__}", (Recorder,), {"_replaces": cls, "_stub": True})


def load(version: str) -> dict[str, types.ModuleType]:
    import importlib

    import torch  # noqa: F401  (real torch and transformers first, so stubs never shadow them)
    import transformers  # noqa: F401

    torch.compile = _uncompiled  # a decorator applied at import (glm5_next.py's helpers) would import inductor
    release = Release("sglang", version)
    sources = release.fetch(MODULES + release.package_modules(PKG + "layers.quantization.quark.schemes"))
    utils = {**PLATFORM, **STACKS, **stubs.functions_from_source(release.fetch([UTILS])[UTILS], ("add_prefix",))}
    declare = {"declare_load_time_override": load_time_override(release)}
    finder = stubs.install(
        "sglang", sources, overrides={PKG + "utils": utils, UTILS: utils, OVERRIDES: declare}
    )  # aiter (ROCm kernels) is present, as on an AMD host: a stub
    mods = {m[len(PKG) :]: importlib.import_module(m) for m in MODULES if m in sources}
    mods.update(_finder=finder, _release=release, _entries=entry_modules(release))
    mods.update(_config_classes=config_registry(release), _config_package=CONFIGS + ".")
    mods.update(_pristine=stubs.packed_mappings("sglang"))
    return mods


# Where get_config's registry of sglang's own config classes lives (a package from 0.5.20, one module before)
REGISTRY_MODULES = (PKG + "utils.hf_transformers.common", PKG + "utils.hf_transformers_utils")
CONFIGS = PKG + "configs"


def config_registry(release: Release) -> dict[str, tuple[str, str]]:
    """sglang's own config classes, model type -> (module, class): get_config re-reads a model type in
    `_CONFIG_REGISTRY` with its class (GLM-5.3-Flash's Glm5NextConfig, Qwen3.5's Qwen3_5MoeConfig), not
    transformers'. The registry lists classes imported from the configs package; each class's model_type is read
    from its module's source. Nothing is executed."""
    import ast

    source = next((s for m in REGISTRY_MODULES if "_CONFIG_REGISTRY" in (s := release.source(m) or "")), "")
    registry = stubs.assigned(ast.parse(source).body, "_CONFIG_REGISTRY")
    listed = (
        {n.id for n in ast.walk(registry) if isinstance(n, ast.Name) and n.id.endswith("Config")} if registry else set()
    )
    where = {
        alias.name: node.module
        for node in ast.parse(release.source(CONFIGS) or "").body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(CONFIGS + ".")
        for alias in node.names
        if alias.name in listed
    }
    out: dict[str, tuple[str, str]] = {}
    for module in sorted(set(where.values())):
        for node in ast.parse(release.source(module) or "").body:
            if isinstance(node, ast.ClassDef) and where.get(node.name) == module:
                model_type = stubs.assigned(node.body, "model_type")
                if isinstance(model_type, ast.Constant) and model_type.value:
                    out[model_type.value] = (module, node.name)
    return out


def _uncompiled(fn=None, **options):
    """Stands in for torch.compile: the function as written (kernels are out of the probe's scope)."""
    return fn if fn is not None else (lambda f: f)


def entry_modules(release: Release) -> dict[str, str]:
    """{a name in a model module's EntryClass: that module}, read from the sources of every module of
    MODEL_PACKAGE (what sglang's ModelRegistry imports and registers); nothing is executed."""
    import ast
    import json
    import os

    cached = release.root / "entry_classes.json"  # a wheel's sources never change: read once per release
    if cached.exists():
        return json.loads(cached.read_text())
    modules = [m for m in release.package_modules(MODEL_PACKAGE) if m != MODEL_PACKAGE]
    out: dict[str, str] = {}
    for module, path in release.fetch(modules).items():
        for node in ast.parse(path.read_bytes(), str(path)).body:  # bytes: a BOM or coding line as Python reads it
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
                names = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                out.update({n.id: module for n in names if isinstance(n, ast.Name)})
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
    tmp.write_text(json.dumps(out))
    tmp.replace(cached)
    return out


# arg_groups/overrides.py::declare_load_time_override (0.5.15 - 0.5.17: how a model that refuses shared-expert
# fusion records the refusal) writes through runtime_context and server_args, too heavy to import here. Where its
# writes land is read from its source: each form below names a text of its body and the stores it writes (stubs.py).
OVERRIDES = PKG + "arg_groups.overrides"
DECLARE_WRITES = (
    ("setattr(ctx.server_args, field, value)", "server_args"),  # 0.5.15: onto the published server arguments ...
    ("ctx.record_runtime_overrides(", "flags"),  # ... then the flags tier is re-resolved from them
    ('getattr(server_args, "override", None)', "server_args"),  # 0.5.16: ServerArgs.override
    ("context.override(source, **declared)", "bag"),  # 0.5.17: RuntimeContext.override, into the field's
)  # config bag (its NS("...") namespace in server_args.py)


def load_time_override(release: Release):
    """A stand-in for the release's declare_load_time_override that writes where the release's own body writes:
    into the process-wide stores a model built later in the same process (the MTP draft) reads."""

    def declare_load_time_override(source: str, declared: dict) -> None:
        path = release.fetch([OVERRIDES]).get(OVERRIDES)
        text = path.read_text() if path else ""
        start = text.find("def declare_load_time_override(")
        body = text[start : text.find("\ndef ", start + 1)] if start >= 0 else ""
        stores = [store for form, store in DECLARE_WRITES if form in body]
        if not stores:  # a release that writes elsewhere: fail loudly rather than guess
            raise LookupError(
                f"sglang {release.version}: {OVERRIDES}.declare_load_time_override writes none of the "
                f"known ways (engine_truth/sglang_probe.py DECLARE_WRITES); read it again"
            )
        for field, value in declared.items():
            for store in stores:
                if store != "bag":
                    setattr(stubs.server_state(store), field, value)
                    continue
                namespace = config_namespace(release, field)
                bag = stubs.server_state(namespace[0])
                for part in namespace[1:]:
                    bag = getattr(bag, part)
                setattr(bag, field, value)

    return declare_load_time_override


def config_namespace(release: Release, field: str) -> list[str]:
    """The config bag of a server argument: its `NS("exec.moe")` in the release's server_args.py, split."""
    text = release.source(PKG + "server_args") or ""
    m = re.search(rf"\n    {re.escape(field)}: A\[(.*?)\n    \] = ", text, re.S)
    ns = re.search(r'NS\("([\w.]+)"\)', m.group(1)) if m else None
    if ns is None:
        raise LookupError(f"sglang {release.version}: server_args.py declares no NS(...) namespace for {field}")
    return ns.group(1).split(".")


def model_class(mods: dict, arch: str) -> type:
    """The class sglang's ModelRegistry resolves `arch` to: the EntryClass member of that name."""
    module = mods["_entries"].get(arch)
    if module is None:
        raise LookupError(f"no module of {MODEL_PACKAGE} names {arch} in its EntryClass")
    imported = mods["_finder"].import_model(mods["_release"], module, (MODEL_PACKAGE + ".",), mods["_pristine"])
    entries = getattr(imported, "EntryClass", None)
    for cls in entries if isinstance(entries, (list, tuple)) else [entries]:
        if getattr(cls, "__name__", None) == arch:
            return cls
    raise LookupError(f"{module}.EntryClass holds no class named {arch}")


def draft_architecture(mods: dict, hf) -> str:
    """ModelConfig._config_draft_model rewrites a draft's architecture to the class that builds it."""
    fake = stubs.Namespace(is_draft_model=True, hf_config=hf, hf_text_config=hf, quantization="quark")
    mods["configs.model_config"].ModelConfig._config_draft_model(fake)
    return hf.architectures[0]


def quant_config(mods: dict, cls: type, hf, is_draft: bool):
    """The loader's `_get_quantization_config` for a model of class `cls`, as executed by the release
    (its packed-module mapping is the class attribute itself, which the model's constructor may extend)."""
    loader = mods["model_loader.loader"]
    qc_cls = mods["layers.quantization.quark.quark"].QuarkConfig

    def get_quant_config(model_config, load_config, packed_modules_mapping, *rest):
        raw = copy.deepcopy(hf.quantization_config)
        raw["packed_modules_mapping"] = packed_modules_mapping
        raw["hf_config"] = hf
        return qc_cls.from_config(raw)

    model_config = stubs.Namespace(
        quantization="quark",
        hf_config=hf,
        hf_text_config=hf,
        is_draft_model=is_draft,
        dtype=__import__("torch").bfloat16,
        model_path="/nonexistent",
    )
    with (
        mock.patch.object(loader, "get_model_architecture", lambda mc: (cls, cls.__name__)),
        mock.patch.object(loader, "get_quant_config", get_quant_config),
        mock.patch.object(loader, "get_device_capability", lambda *a: AMD_MI355X, create=True),
    ):
        return loader._get_quantization_config(model_config, stubs.Namespace())


@contextlib.contextmanager
def amd_device():
    import torch

    with mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: AMD_MI355X):
        yield


def recorded(cls: type, suffix: str) -> list[tuple[str, str]]:
    """(module, name) of every torch module class whose name ends in `suffix` that the modules of `cls`'s own
    classes (its MRO, within MODEL_PACKAGE) hold: where its constructors, and those of the models they build
    (a NextN draft's `model`, defined beside it), look the class up."""
    import torch

    out: dict[tuple[str, str], None] = {}
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if not klass.__module__.startswith(MODEL_PACKAGE + ".") or isinstance(module, stubs.StubModule | None):
            continue
        for name, value in vars(module).items():
            if name.endswith(suffix) and isinstance(value, type) and issubclass(value, torch.nn.Module):
                out[(klass.__module__, name)] = None
    return list(out)


def build(mods: dict, cls: type, hf, qc, suffix: str):
    """The loader's `_initialize_model` (shared-expert fusion gate, then the constructor), with the classes named
    `*<suffix>` the constructors can reach (`recorded`: the target's layer stack, the draft's block) recorded
    instead of built."""
    loader = mods["model_loader.loader"]
    model_config = stubs.Namespace(quantization="quark", hf_config=hf, hf_text_config=hf, model_path="/nonexistent")
    import torch

    with contextlib.ExitStack() as stack:
        stack.enter_context(amd_device())
        # The model is built as the release builds it, on the meta device: the modules and their parameters'
        # shapes and dtypes are real, no memory is allocated and no weight initialised (the draft's eh_proj, a
        # torch Linear of 2 x hidden by hidden, took half of a probe's time filling itself with random numbers).
        stack.enter_context(torch.device("meta"))
        for module, name in recorded(cls, suffix):
            original = getattr(sys.modules[module], name)
            stack.enter_context(mock.patch.object(sys.modules[module], name, recorder_for(original)))
        stack.enter_context(mock.patch.object(loader, "get_model_architecture", lambda mc: (cls, cls.__name__)))
        return loader._initialize_model(model_config, stubs.Namespace(), qc)


def fused_shared_experts(model) -> int:
    """How many shared experts the model fuses into its routed-expert bank (the loader's decision where the
    release makes it there, else the constructor's)."""
    decided = model.__dict__.get("shared_experts_config")
    if decided is not None:
        return int(decided.num_fused_shared_experts)
    return int(model.__dict__.get("num_fused_shared_experts") or 0)


def decide(mods: dict, qc, prefix: str, kind: str) -> str:
    """MXFP4 / bf16 / another scheme, or the error the release raises, for one module."""
    if qc is None:
        return probe_io.BF16
    quark = mods["layers.quantization.quark.quark"]
    layer_cls = (
        quark.LinearBase
        if kind == probe_io.LINEAR
        else stubs.stub_class("sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE")
    )
    layer = layer_cls()
    try:
        with amd_device():
            method = qc.get_quant_method(layer, prefix)
    except Exception as e:  # the release raises while deciding: a load failure
        return probe_io.error(e)
    if method is None or type(method).__name__.startswith("Unquantized"):
        return probe_io.BF16
    scheme = getattr(layer, "scheme", None)
    name = type(scheme).__name__
    if "mxfp4" in name.lower():
        return probe_io.MXFP4
    return probe_io.other(name, None, getattr(scheme, "weight_qscheme", None))


def probe_case(mods: dict, case: dict) -> dict:
    """One checkpoint config, as one server process sees it: target first, then the draft (server state is
    shared between them, as in the release, and starts fresh for every case)."""
    stubs.SERVER_STATE.clear()
    stubs.restore_packed_mappings(mods["_pristine"])
    if case.get(probe_io.DRAFT_CLASS_ONLY):  # a family the release does not build: is its class registered, and
        hf = probe_io.hf_config(case["config"], mods)  # which class would it draft with
        return {
            "registered": hf.architectures[0] in mods["_entries"],
            "draft": {"class": draft_architecture(mods, hf)},
        }
    hf = probe_io.hf_config(case["config"], mods)
    target_cls = model_class(mods, hf.architectures[0])
    target_qc = quant_config(mods, target_cls, hf, is_draft=False)
    target_model = build(mods, target_cls, hf, target_qc, TARGET_STACK)
    target = {
        "class": target_cls.__name__,
        "packed_modules_mapping": dict(target_qc.packed_modules_mapping),
        "fused_shared_experts": fused_shared_experts(target_model),
        "decisions": {p: decide(mods, target_qc, p, k) for p, k in case["target"]},
        # The stacks recorded instead of built (the lineage's `<Arch>Model`, Qwen3.5's vision tower): the prefix
        # and whether they were handed the quant config
        "recorded": {
            path: {"prefix": o.prefix, "quantized": o.quant_config is not None}
            for path, o in stubs.walk(target_model)
            if isinstance(o, Recorder)
        },
    }
    draft_hf = probe_io.hf_config(case["config"], mods)
    draft_cls = model_class(mods, draft_architecture(mods, draft_hf))
    draft_qc = quant_config(mods, draft_cls, draft_hf, is_draft=True)
    draft_model = build(mods, draft_cls, draft_hf, draft_qc, case.get(probe_io.DRAFT_BLOCK_CLASS, DRAFT_BLOCK))
    built = list(stubs.walk(draft_model))
    blocks = [o for _, o in built if isinstance(o, Recorder)]
    if len(blocks) != 1:
        raise LookupError(f"{draft_cls.__name__} built {len(blocks)} recorded blocks, not one")
    block, proj = blocks[0], case.get(probe_io.MTP_PROJ, "eh_proj")
    eh_path, eh = next(((p, o) for p, o in built if p.rpartition(".")[2] == proj), (None, None))
    if eh is None:
        raise LookupError(f"{draft_cls.__name__} has no {proj}")
    eh_kwargs = getattr(eh, "_stub_kwargs", {})
    draft = {
        "class": draft_cls.__name__,
        "packed_modules_mapping": dict(draft_qc.packed_modules_mapping),
        "block_prefix": block.prefix,
        "block_quantized": block.quant_config is not None,
        "eh_proj": {
            "type": type(eh).__name__,
            "prefix": eh_kwargs.get("prefix"),
            "decision": decide(mods, eh_kwargs.get("quant_config"), eh_path, probe_io.LINEAR),
        },
        "fused_shared_experts": fused_shared_experts(draft_model),
        "decisions": {p: decide(mods, block.quant_config, p, k) for p, k in case["draft"]},
    }
    return {"target": target, "draft": draft}


if __name__ == "__main__":
    probe_io.serve(load, probe_case)
