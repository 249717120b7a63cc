"""Write a checkpoint in AMD Quark's MXFP4 export format from a bf16 one, for tests and benchmarks.

It reproduces what Quark's file-to-file mode decides and writes (quark-mxfp4.md): every `.weight` with
two or more dimensions is quantized unless its module name matches an `exclude` fnmatch pattern, or ends
in `norm`, or contains `embed`; the exported `exclude` lists the exact module names that matched.
Names, dtypes and shapes are exact; the MXFP4 bytes are placeholders (zero codes, scale 2^0), since the
validate and fixup stages read headers only. Real quantization is `mxforge quantize`'s job.
"""

from __future__ import annotations

import fnmatch
import math
import re
from pathlib import Path
from typing import Mapping

from mxforge.checkpoint import INDEX_NAME, Checkpoint, write_index
from mxforge.formats import MXFP4, ElementFormat
from mxforge.formats.quark import cached_quantization_config
from mxforge.safetensors_io import PlannedTensor, ShardWriter, TensorInfo, copy_atomic, write_json_atomic

PLACEHOLDER_SCALE = MXFP4.scale.bias  # the E8M0 byte for 2^0


def quark_quantization_config(exclude: list[str]) -> dict:
    """quantization_config as Quark 0.13 exports it for the "mxfp4" scheme: Quark's own (the quantizer's cached
    copy), with `exclude` in the order given (AMD's published exports keep their patterns' order)."""
    return {**cached_quantization_config(MXFP4, []), "exclude": list(exclude)}


def quark_quantizes(module: str, shape: tuple[int, ...], excluded: re.Pattern | None) -> bool | None:
    """True: quantized; False: excluded by a pattern; None: never a candidate (not a >=2-D weight, norm, embed).
    `excluded`: the patterns as one regex (`fnmatch_any`)."""
    if len(shape) < 2 or module.endswith("norm") or "embed" in module:
        return None
    return not (excluded is not None and excluded.match(module))


def fnmatch_any(patterns: list[str]) -> re.Pattern | None:
    """One regex that matches what any of the fnmatch `patterns` matches (fnmatchcase is a match of each one's
    translation; a real-layout export tests 150,000 names against ~200 patterns)."""
    return re.compile("|".join(fnmatch.translate(p) for p in patterns)) if patterns else None


def write_quark_like(
    src: str | Path,
    out: str | Path,
    patterns: list[str],
    *,
    glob_exclude: bool = False,
    drop_layers: tuple[int, ...] = (),
    sparse: bool | None = None,
    formats: Mapping[str, ElementFormat] | None = None,
    quantization_config: dict | None = None,
) -> list[str]:
    """Write `src` (bf16) to `out` as Quark would with exclusion `patterns`; returns the written exclude list.

    `glob_exclude` writes the patterns themselves into `exclude` (exports edited by hand or by other tools),
    instead of Quark's exact names. `drop_layers` leaves those layers out entirely (exports that lost the
    MTP layer). `sparse` writes headers with holes for data (default: when the source is sparse). `formats`
    stores the quantized modules it names in their format instead of MXFP4 (placeholder bytes: zeros), and
    `quantization_config` is then the config to write (a mixed recipe's, with its `layer_quant_config`).

    Raises:
        CheckpointError: `src` is not a checkpoint, or a shard cannot be written.
    """
    src_ckpt = Checkpoint.open(src)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=False)
    excluded_re = fnmatch_any(patterns)
    dropped = tuple(f"model.layers.{n}." for n in drop_layers)
    infos = src_ckpt.tensor_infos()
    if sparse is None:
        sparse = any(h.file_size > 4096 * 8 and _is_sparse(h.path) for h in list(src_ckpt.headers.values())[:1])
    excluded: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    by_shard: dict[str, list[str]] = {}
    for name, shard in src_ckpt.weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    for shard in src_ckpt.shard_names:
        planned: list[PlannedTensor] = []
        sources: dict[str, TensorInfo | tuple[int, int]] = {}
        for name in sorted(by_shard.get(shard, ())):
            if name.startswith(dropped):
                continue
            info = infos[name]
            module = name.removesuffix(".weight")
            decision = quark_quantizes(module, info.shape, excluded_re) if name.endswith(".weight") else None
            if decision:
                fmt = (formats or {}).get(module, MXFP4)
                stored = fmt.stored(name, (info.shape[0], math.prod(info.shape[1:])))
                planned += stored
                sources[name] = (0, math.prod(stored[0].shape))
                scale = PLACEHOLDER_SCALE if fmt == MXFP4 else 0
                sources[stored[1].name] = (scale, math.prod(stored[1].shape) * fmt.scale.itemsize)
            else:
                if decision is False:
                    excluded.append(module)
                planned.append(PlannedTensor(name, info.dtype, info.shape))
                sources[name] = info
        if not planned:
            continue
        with ShardWriter(out / shard, planned) as writer, open(src_ckpt.root / shard, "rb") as f:
            if sparse:
                writer.skip_to_end()
            else:
                for t in writer.order:
                    source = sources[t.name]
                    if isinstance(source, tuple):  # placeholder MXFP4 bytes: (byte value, count)
                        data = bytes([source[0]]) * source[1]
                    else:
                        f.seek(source.start)
                        data = f.read(source.nbytes)
                    writer.write(t.name, data)
        weight_map.update({t.name: shard for t in planned})
        total += sum(t.nbytes for t in planned)
    exclude = list(patterns) if glob_exclude else sorted(excluded)
    config = dict(src_ckpt.config)
    config["quantization_config"] = quantization_config or quark_quantization_config(exclude)
    for path in src_ckpt.root.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name not in ("config.json", INDEX_NAME):
            copy_atomic(path, out / path.name)
    write_index(out, weight_map, total)
    write_json_atomic(out / "config.json", config)
    return exclude


def _is_sparse(path: Path) -> bool:
    st = path.stat()
    return st.st_blocks * 512 < st.st_size // 2
