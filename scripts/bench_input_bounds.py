#!/usr/bin/env python
"""What the bounds on input from outside cost and save (docs/security.md, "Checkpoints, configs and recipes").

In one run, side by side:
- regex: Python's `re.match` against mxforge.bounded_re on a real exclude pattern over the full GLM-5.2 layout's
  module names (per-call cost, first call and warm), and on the backtracking `(.|.)*Z` at growing name lengths
  (`re` doubles with each character; bounded_re stays linear);
- headers: reading a header of 1.2 M zero-size tensors (refused before parsing: time and peak memory), and the
  strict parser on a real-size shard header (GLM-5.2's largest: about 1,100 tensors) against json.loads alone;
- JSON: the nesting count on GLM-5.2's 6 MB index against parsing it.

    .venv/bin/python scripts/bench_input_bounds.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import struct
import sys
import tempfile
import time
from pathlib import Path

from bench_markdown import add_markdown_option, emit_report, table


def _best(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _names() -> list[str]:
    from mxforge.manifest_io import manifest_text
    from mxforge.models import layout_of

    layout = layout_of(json.loads(manifest_text("models/glm-5.2.config.json")))
    return sorted({t.name.removesuffix(".weight") for t in layout.tensors()})


def bench_regex() -> dict:
    from mxforge.bounded_re import compile_bounded

    names = _names()
    pattern = r"model\.layers\.\d+\.(self_attn\..*|mlp\.shared_experts\..*|eh_proj)$"
    plain = re.compile(pattern)
    t = time.perf_counter()
    bounded = compile_bounded(pattern, where="bench")
    first = [bounded.match(n) for n in names]
    first_s = time.perf_counter() - t
    assert first == [plain.match(n) is not None for n in names]

    def warm() -> None:  # the automaton built, the per-name answers forgotten
        bounded._answers.clear()
        [bounded.match(n) for n in names]

    warm_s = _best(warm)
    re_s = _best(lambda: [plain.match(n) for n in names])
    growth = []
    hostile = compile_bounded(r"(.|.)*Z", where="bench")
    for n in (16, 18, 20, 22):
        subject = "a" * n
        re_time = _best(lambda: re.match(r"(.|.)*Z", subject), repeat=1)
        ours = _best(lambda: (hostile._answers.clear(), hostile.match(subject)), repeat=3)
        growth.append({"chars": n, "re_s": round(re_time, 4), "bounded_s": round(ours, 6)})
    long_name = "a" * 4096
    return {
        "names": len(names),
        "pattern": pattern,
        "re_us_per_name": round(re_s / len(names) * 1e6, 3),
        "bounded_first_pass_us_per_name": round(first_s / len(names) * 1e6, 3),
        "bounded_warm_us_per_name": round(warm_s / len(names) * 1e6, 3),  # answers not remembered
        "bounded_remembered_us_per_name": round(_best(lambda: [bounded.match(n) for n in names]) / len(names) * 1e6, 3),
        "backtracking": growth,
        "bounded_4096_chars_s": round(_best(lambda: (hostile._answers.clear(), hostile.match(long_name)), repeat=3), 5),
    }


def bench_headers(work: Path) -> dict:
    from mxforge.errors import CheckpointError
    from mxforge.models import DEFAULT_FAMILY
    from mxforge.safetensors_io import parse_header, read_header

    entries = b",".join(b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(1_200_000))
    raw = b"{" + entries + b"}"
    path = work / "zero.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    del entries
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    try:
        read_header(path)
        refused = False
    except CheckpointError:
        refused = True
    refuse_s = time.perf_counter() - t
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    # A real-size shard header: 1,100 GLM-5.2 expert tensors.
    layout = DEFAULT_FAMILY.layout_of(DEFAULT_FAMILY.reference())
    real = {
        layout.module_name(i // 768, f"mlp.experts.{(i // 3) % 256}.{p}") + ".weight": None
        for i, p in zip(range(1100), ["gate_proj", "up_proj", "down_proj"] * 400)
    }
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in real:
        header[name] = {"dtype": "BF16", "shape": [2048, 6144], "data_offsets": [offset, offset + 2048 * 6144 * 2]}
        offset += 2048 * 6144 * 2
    text = json.dumps(header).encode()
    strict = _best(lambda: parse_header("bench", text, 8 + len(text) + offset))
    loads = _best(lambda: json.loads(text))
    return {
        "zero_size_header_bytes": len(raw),
        "zero_size_refused": refused,
        "zero_size_refused_s": round(refuse_s, 3),
        "zero_size_peak_rss_growth_mb": round(grown_mb, 1),
        "real_header_bytes": len(text),
        "real_header_parse_ms": round(strict * 1e3, 3),
        "json_loads_alone_ms": round(loads * 1e3, 3),
    }


def bench_json() -> dict:
    from mxforge.json_input import nesting_depth

    names = _names()
    index = {
        "metadata": {"total_size": 1},
        "weight_map": {f"{n}.weight": "model-00001-of-00282.safetensors" for n in names},
    }
    raw = json.dumps(index).encode()
    return {
        "index_bytes": len(raw),
        "nesting_count_ms": round(_best(lambda: nesting_depth(raw)) * 1e3, 2),
        "json_loads_ms": round(_best(lambda: json.loads(raw)) * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    add_markdown_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {"regex": bench_regex(), "json": bench_json(), "headers": bench_headers(Path(tmp))}
    rows = [
        [section, name, json.dumps(value)] for section, figures in results.items() for name, value in figures.items()
    ]
    lines = table(["bound", "case", "measured"], rows)
    emit_report(args, lines, results)


if __name__ == "__main__":
    sys.exit(main())
