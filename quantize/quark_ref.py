"""AMD Quark 0.13 itself, as the reference: its file-to-file per-weight routine and its config objects.

Quark's import takes ~20 s and JIT-compiles a C++ extension, so this module is imported lazily, only
where Quark is needed (writing `quantization_config`, tests, the benchmark, non-finite weights).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from mxforge.cache_dir import cache_root

os.environ.setdefault("QUARK_LOG_LEVEL", "warning")  # Quark's import logs at INFO to the terminal otherwise


@functools.lru_cache(maxsize=None)
def mxfp4_specs():
    """(weight spec, input spec) of Quark's "mxfp4" scheme: static weights, dynamic activations, OCP MX."""
    from quark.torch.quantization.config.config import OCP_MXFP4Spec

    weight = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()
    inputs = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=True).to_quantization_spec()
    return weight, inputs


def mxfp4_qconfig(exclude: list[str], quantize_inputs: bool = True):
    """A Quark `QConfig` for MXFP4 weights (and dynamic MXFP4 inputs), excluding `exclude` (fnmatch patterns)."""
    from quark.torch.quantization.config.config import QConfig, QLayerConfig

    weight, inputs = mxfp4_specs()
    layer = QLayerConfig(weight=weight, input_tensors=inputs if quantize_inputs else None)
    return QConfig(global_quant_config=layer, exclude=list(exclude))


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


def cached_quantization_config(exclude: list[str], quantize_inputs: bool = True) -> dict:
    """`export_quantization_config` for this scheme, without importing Quark on every run.

    Quark builds the config once per (Quark version, scheme, this file) and it is kept in the user's cache
    (MXFORGE_CACHE, else $XDG_CACHE_HOME/mxforge or ~/.cache/mxforge); `exclude` is the only part that
    varies, and Quark writes it as the sorted list, which is what is substituted here.
    """
    path = cache_root() / f"quark-config-{_cache_key(quantize_inputs)}.json"
    try:
        template = json.loads(path.read_text())
    except (OSError, ValueError):
        announce_quark_import(path.parent)
        template = export_quantization_config(mxfp4_qconfig([], quantize_inputs))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
            tmp.write_text(json.dumps(template))
            os.replace(tmp, path)
        except OSError:
            pass  # no cache: Quark is simply imported again next time
    template["exclude"] = sorted(exclude)
    return template


def announce_quark_import(cache: Path) -> None:
    """Say on stderr, before it starts, that Quark is about to be imported: its first import compiles a C++
    extension and the process then sits silent for up to a minute (a no-op when Quark is loaded already)."""
    if "quark.torch" in sys.modules:
        return
    print(
        f"mxforge: loading AMD Quark {metadata.version('amd-quark')} to build its quantization_config (the first "
        f"import compiles Quark's C++ extension: about a minute); the result is cached in {cache}",
        file=sys.stderr,
        flush=True,
    )


def _cache_key(quantize_inputs: bool) -> str:
    """Quark's version, the scheme, and the code that builds the config (an edit elsewhere in this file keeps it)."""
    version = metadata.version("amd-quark")
    builders = (mxfp4_specs, mxfp4_qconfig, export_quantization_config)
    code = hashlib.sha256("".join(inspect.getsource(f) for f in builders).encode()).hexdigest()[:12]
    return f"{version}-mxfp4-{'w-a' if quantize_inputs else 'w'}-{code}"


def quark_quantize_weight(weight):
    """(codes, scale bytes) from Quark's own file-to-file per-tensor routine, for a torch weight."""
    from quark.torch.quantization import file2file_quantization as f2f

    spec, _ = mxfp4_specs()
    out: dict = {}
    f2f._single_stage_quantize_weight(weight, "w.weight", "w", spec, out, "ref.safetensors")
    return out["w.weight"], out["w.weight_scale"]


def quark_dequantize_weight(codes, scales, float_dtype):
    """Quark's own dequantization of a real-quantized MXFP4 weight (what its model loading runs): the
    StaticScaledRealQuantizer of the weight spec, fed the packed codes and the E8M0 scale bytes."""
    import torch
    from quark.torch.export.nn.modules.realquantizer import get_real_quantizer

    spec, _ = mxfp4_specs()
    quantizer = get_real_quantizer(
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
