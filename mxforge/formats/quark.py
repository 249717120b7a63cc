"""AMD Quark 0.13 itself, per element format: its config objects (what `quantization_config` says) and its
file-to-file per-weight routine and model-loading dequantizer (the reference numbers every kernel is tested against).

Quark's import takes ~20 s and JIT-compiles a C++ extension, so this module is imported lazily, only
where Quark is needed (writing `quantization_config`, tests, the benchmark, non-finite weights). Quark imports
transformers, whose release mxforge leaves to the environment (an engine pins its own: docs/install.md), so
a Quark that cannot be imported there is said in one line (`_quark`) rather than as a traceback.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from mxforge.cache_dir import cache_root
from mxforge.errors import MxforgeError

if TYPE_CHECKING:
    from mxforge.formats.element import ElementFormat

os.environ.setdefault("QUARK_LOG_LEVEL", "warning")  # Quark's import logs at INFO to the terminal otherwise


def _quark(module: str) -> ModuleType:
    """Quark's `module`, imported on first use.

    Raises:
        MxforgeError: Quark cannot be imported in this environment (not installed, or a transformers / torch
            it was not made for): which releases are installed, what failed, and what to do.
    """
    try:
        return importlib.import_module(module)
    except Exception as e:  # an ImportError, or whatever a transformers Quark was not made for raises on import
        said = (str(e).strip().splitlines() or [""])[0][:200]
        installed = ", ".join(f"{d} {_installed(d)}" for d in ("amd-quark", "transformers", "torch"))
        raise MxforgeError(
            f"Quark could not be imported ({type(e).__name__}: {said}; installed: {installed}): mxforge needs it to "
            "write quantization_config. Install amd-quark==0.13 and a transformers release it imports with "
            "(docs/install.md names those tested)"
        ) from e


def _installed(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=None)
def specs(fmt: ElementFormat):
    """(weight spec, input spec) of Quark's scheme for `fmt`: static weights, dynamic activations (the entry's spec
    class: an OCP_MXSpec subclass, or FP8E4M3PerChannelSpec for PTPC)."""
    import dataclasses

    config = _quark("quark.torch.quantization.config.config")
    assert fmt.quark.spec_class, f"{fmt.title} is kept from a source, never quantized to: it has no Quark spec class"
    spec_class = getattr(config, fmt.quark.spec_class)
    # a spec class whose block is a parameter (Quark's non-MX per-group specs) is given the entry's
    block = {"group_size": fmt.block} if "group_size" in {f.name for f in dataclasses.fields(spec_class)} else {}
    weight = spec_class(ch_axis=fmt.quark.ch_axis, is_dynamic=False, **block).to_quantization_spec()
    inputs = spec_class(ch_axis=fmt.quark.input_ch_axis, is_dynamic=True, **block).to_quantization_spec()
    return weight, inputs


def qconfig(
    fmt: ElementFormat,
    exclude: list[str],
    quantize_inputs: bool = True,
    layer_formats: dict[str, ElementFormat] | None = None,
):
    """A Quark `QConfig` for `fmt` weights (and dynamic `fmt` inputs), excluding `exclude` (fnmatch patterns);
    `layer_formats` gives the modules a pattern matches another format's scheme (`layer_quant_config`)."""
    config = _quark("quark.torch.quantization.config.config")

    def layer(f: ElementFormat):
        weight, inputs = specs(f)
        return config.QLayerConfig(weight=weight, input_tensors=inputs if quantize_inputs else None)

    layers = {pattern: layer(f) for pattern, f in (layer_formats or {}).items()}
    return config.QConfig(global_quant_config=layer(fmt), layer_quant_config=layers, exclude=list(exclude))


def export_quantization_config(qconfig) -> dict:
    """`quantization_config` exactly as Quark's file-to-file export writes it into config.json."""
    out = qconfig.to_dict()
    out["export"] = {
        "kv_cache_group": [],
        "min_kv_scale": 0.0,
        "pack_method": "reorder",
        "weight_format": "real_quantized",
        "weight_merge_groups": None,
    }
    out["exclude"] = sorted(qconfig.exclude)
    return out


def cached_quantization_config(fmt: ElementFormat, exclude: list[str], quantize_inputs: bool = True) -> dict:
    """`export_quantization_config` for this scheme, without importing Quark on every run.

    Quark builds the config once per (Quark version, format, scheme, this file) and it is kept in the user's cache
    (MXFORGE_CACHE, else $XDG_CACHE_HOME/mxforge or ~/.cache/mxforge); `exclude` is the only part that
    varies, and Quark writes it as the sorted list, which is what is substituted here.
    """
    path = cache_root() / f"quark-config-{_cache_key(fmt, quantize_inputs)}.json"
    template = _cached_json(path, lambda: export_quantization_config(qconfig(fmt, [], quantize_inputs)))
    template["exclude"] = sorted(exclude)
    return template


def _cached_json(path: Path, build) -> dict:
    """The JSON object cached at `path`, else `build()` (which imports Quark: announced first), cached there by
    rename; a cache that cannot be written is skipped (Quark is simply asked again next time)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    announce_quark_import(path.parent)
    built = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        tmp.write_text(json.dumps(built))
        os.replace(tmp, path)
    except OSError:
        pass
    return built


def cached_layer_config(fmt: ElementFormat, quantize_inputs: bool = True) -> dict:
    """The layer config (`QLayerConfig.to_dict()`) of `fmt`'s scheme, as Quark writes it into `layer_quant_config`:
    the global scheme's entry of `cached_quantization_config` for that format."""
    return cached_quantization_config(fmt, [], quantize_inputs)["global_quant_config"]


def kept_layer_config(source_quantization_config: dict) -> dict:
    """The layer config (`QLayerConfig.to_dict()`) Quark's file-to-file writes into `layer_quant_config` for a module
    of a block-FP8 source it keeps as stored (`keep_excluded_layers_as_original_model_state`), given the source's
    `quantization_config` (its `weight_block_size`, `fmt`, `activation_scheme`, ... are what Quark reads).

    Quark itself derives it: its exclude-aware config builder runs on a one-module stand-in of the source (one
    FP8 weight with its scales, and the source's quantization_config) in a temporary directory. Cached per Quark
    version, source config and this code, as cached_quantization_config is.

    Raises:
        ConfigError: Quark refuses the source's quantization_config (e.g. static activation scales), with its
            reason.
    """
    source = json.dumps(source_quantization_config, sort_keys=True)
    code = hashlib.sha256((inspect.getsource(_quark_kept_layer_config) + source).encode()).hexdigest()[:16]
    path = cache_root() / f"quark-kept-config-{_installed('amd-quark')}-{code}.json"
    return _cached_json(path, lambda: _quark_kept_layer_config(source_quantization_config))


def _quark_kept_layer_config(source_quantization_config: dict) -> dict:
    import tempfile

    import torch
    from safetensors.torch import save_file

    from mxforge.errors import ConfigError

    f2f = _quark("quark.torch.quantization.file2file_quantization")
    config = _quark("quark.torch.quantization.config.config")
    block = source_quantization_config.get("weight_block_size") or [1, 1]
    with tempfile.TemporaryDirectory(prefix="mxforge-quark-kept-") as tmp:
        weight = torch.zeros(int(block[0]), int(block[1]), dtype=torch.float8_e4m3fn)
        save_file({"m.weight": weight, "m.weight_scale_inv": torch.ones(1, 1)}, str(Path(tmp) / "model.safetensors"))
        hf_config = {"quantization_config": source_quantization_config}
        (Path(tmp) / "config.json").write_text(json.dumps(hf_config))
        try:
            # the global scheme plays no part in a kept module's entry: Quark's empty layer config stands for it
            keep_m = config.QConfig(global_quant_config=config.QLayerConfig(), exclude=["m"])
            built = f2f._build_exclude_aware_quant_config(tmp, keep_m, hf_config, True)
        except ValueError as e:
            raise ConfigError(f"Quark keeps no FP8 weights of this source: {e}") from e
    return built.layer_quant_config["m"].to_dict()


def announce_quark_import(cache: Path) -> None:
    """Say on stderr, before it starts, that Quark is about to be imported: its first import compiles a C++
    extension and the process then sits silent for up to a minute (a no-op when Quark is loaded already)."""
    if "quark.torch" in sys.modules:
        return
    print(
        f"mxforge: loading AMD Quark {_installed('amd-quark')} to build its quantization_config (the first "
        f"import compiles Quark's C++ extension: about a minute); the result is cached in {cache}",
        file=sys.stderr,
        flush=True,
    )


def _cache_key(fmt: ElementFormat, quantize_inputs: bool) -> str:
    """Quark's version, the format and scheme, and the code that builds the config (an edit elsewhere in this file
    keeps the cache)."""
    version = _installed("amd-quark")
    builders = (specs, qconfig, export_quantization_config)
    source = "".join(inspect.getsource(getattr(f, "__wrapped__", f)) for f in builders) + str(fmt.quark.spec_class)
    code = hashlib.sha256(source.encode()).hexdigest()[:12]
    return f"{version}-{fmt.name}-{'w-a' if quantize_inputs else 'w'}-{code}"


def quark_quantize_weight(fmt: ElementFormat, weight):
    """(codes, scales) from Quark's own file-to-file per-tensor routine for a torch weight, as uint8 tensors of
    the bytes Quark stores (codes of a float8 format viewed as their bytes)."""
    import torch

    f2f = _quark("quark.torch.quantization.file2file_quantization")
    spec, _ = specs(fmt)
    out: dict = {}
    name = "w.weight"
    f2f._single_stage_quantize_weight(weight, name, "w", spec, out, "ref.safetensors")
    codes, scales = out[name], out[fmt.scale_name(name)]
    return codes.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8).reshape(codes.shape[0], -1)


def quark_dequantize_weight(fmt: ElementFormat, codes, scales, float_dtype):
    """Quark's own dequantization of a real-quantized weight (what its model loading runs): the
    StaticScaledRealQuantizer of the weight spec, fed the stored codes and the scale bytes."""
    import torch

    realquantizer = _quark("quark.torch.export.nn.modules.realquantizer")
    spec, _ = specs(fmt)
    quantizer = realquantizer.get_real_quantizer(
        qspec=spec,
        quantizer=None,
        reorder=True,
        real_quantized=True,
        float_dtype=float_dtype,
        device=torch.device("cpu"),
        scale_shape=tuple(scales.shape),
    )
    quantizer.scale = scales.clone()
    return quantizer(codes)
