#!/usr/bin/env python
"""Benchmark FP8 -> MXFP4 against bf16 -> MXFP4 on the same content, and Quark's FP8 path where it can run.

In one run, on one bench fixture written as its family's FP8 release stores it (`mxforge fixture --preset bench
--precision fp8 --gib N`) and on the bf16 checkpoint that FP8 stands for (each weight dequantized by the reference
formula, float32 product rounded to bf16, as DeepSeek's `inference/fp8_cast_bf16.py` makes the bf16 of its FP8
release): `mxforge quantize` of each (a subprocess, end to end), alternating, best of --repeat. From a
compressed-tensors source both write byte-identical shards (its FP8 is quantized from the bf16 it stands for); from
a block-FP8 source mxforge quantizes the float32 product without the bf16 rounding, as Quark 0.13's file-to-file
does (tests/quantize/test_keep_source.py checks every byte against Quark's), so the MXFP4 differs from the bf16
checkpoint's: the script measures how many codes and scales that changes. Then Quark's own file-to-file on the FP8
source: it dequantizes FP8 with a Triton kernel (`_weight_dequant_fp8`) and its entry refuses any device but CUDA,
so it runs only where Triton (and a GPU) is; the script says so when it cannot.

    .venv/bin/python scripts/bench_fp8.py [--gib 1] [--family F] [--workdir DIR] [--repeat 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quantize  # noqa: E402
from bench_markdown import add_markdown_option, emit_report  # noqa: E402
from bench_quantize import run_measured, warm, weight_bytes  # noqa: E402

QUARK_FP8_SNIPPET = bench_quantize.QUARK_SNIPPET  # the same file-to-file call, on the FP8 source


SCALE_SUFFIXES = ("_scale_inv", "_scale")  # block FP8 (DeepSeek), compressed-tensors (GLM-4.5-FP8)
CONSUMED = ("_scale_inv", ".weight_scale", ".input_scale")  # an FP8 source's tensors the bf16 it stands for lacks


def scale_of(f, name: str):
    """The scale tensor of FP8 weight `name` in an open safetensors file."""
    keys = set(f.keys())
    return f.get_tensor(next(name + s for s in SCALE_SUFFIXES if name + s in keys))


def expanded_scale(q, s):
    """A weight's scales as float32, broadcastable to it: per channel [out, 1], per tensor [1, 1], or 128x128 blocks
    repeated."""
    rows, cols = q.shape
    s = s.float()
    if s.numel() == 1 or tuple(s.shape) in ((rows, 1), (rows,)):
        return s.reshape(-1, 1)
    return s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]


def reference_bf16(q, s):
    """The bf16 an FP8 weight stands for: float32(e4m3) * float32(its scale), rounded to bf16 (torch)."""
    import torch

    return (q.float() * expanded_scale(q, s)).to(torch.bfloat16)


def write_dequantized(src: Path, dst: Path) -> None:
    """The FP8 checkpoint `src` as the bf16 checkpoint it stands for (no scales, no quantization_config)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mxforge.checkpoint import INDEX_NAME, write_index

    dst.mkdir(parents=True)
    weight_map, total = {}, 0
    for shard in sorted(src.glob("*.safetensors")):
        out = {}
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if name.endswith(CONSUMED):
                    continue
                t = f.get_tensor(name)
                out[name] = reference_bf16(t, scale_of(f, name)) if t.dtype == torch.float8_e4m3fn else t
        save_file(out, dst / shard.name, metadata={"format": "pt"})
        weight_map.update({n: shard.name for n in out})
        total += sum(t.numel() * t.element_size() for t in out.values())
    write_index(dst, weight_map, total)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", INDEX_NAME):
            shutil.copyfile(p, dst / p.name)


def fp32_vs_bf16_numerics(src: Path, limit: int = 24) -> dict:
    """MXFP4 of the float32 products (Quark's FP8 path, and mxforge's for block FP8) vs of their bf16 rounding (the
    bf16 checkpoint, DeepSeek's reference), over the first `limit` FP8 weights: the share of codes and of block
    scales that differ."""
    import torch
    from safetensors import safe_open

    from mxforge.formats import MXFP4
    from mxforge.formats.element import unpack_codes

    codes_diff = codes_total = scales_diff = scales_total = 0
    seen = 0
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if seen >= limit or not name.endswith(".weight"):
                    continue
                q = f.get_tensor(name)
                if q.dtype != torch.float8_e4m3fn:
                    continue
                rows, cols = q.shape
                fp32 = q.float() * expanded_scale(q, scale_of(f, name))
                results = []
                for x in (fp32.numpy(), fp32.to(torch.bfloat16).view(torch.int16).numpy()):
                    codes_shape, scales_shape = MXFP4.packed_shapes((rows, cols))
                    codes, scales = np.empty(codes_shape, np.uint8), np.empty(scales_shape, np.uint8)
                    MXFP4.kernels.encode_cpu(np.ascontiguousarray(x), codes, scales, (0,), None)
                    results.append((codes, scales))
                (c32, s32), (c16, s16) = results
                # compare codes, not the bytes that pack them
                u32, u16 = (unpack_codes(c, MXFP4.element_bits) for c in (c32, c16))
                codes_diff += int((u32 != u16).sum())
                codes_total += u32.size
                scales_diff += int((s32 != s16).sum())
                scales_total += s32.size
                seen += 1
    return {
        "weights": seen,
        "codes_differing": codes_diff / max(1, codes_total),
        "scales_differing": scales_diff / max(1, scales_total),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the bf16 it stands for (the FP8 source is ~half)")
    ap.add_argument("--family", default=None, help="model family (mxforge fixture --family; default: its default)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    add_markdown_option(ap)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mxforge-bench-fp8-"))
    work.mkdir(parents=True, exist_ok=True)
    mxforge = [sys.executable, "-m", "mxforge.cli"]
    from mxforge.models import DEFAULT_FAMILY

    args.family = args.family or DEFAULT_FAMILY.name
    fp8 = work / f"fp8-{args.family}-{args.gib:g}gib"
    bf16 = work / f"bf16-of-fp8-{args.family}-{args.gib:g}gib"
    if not (fp8 / "config.json").exists():
        shutil.rmtree(fp8, ignore_errors=True)
        subprocess.run(
            [
                *mxforge,
                "fixture",
                str(fp8),
                "--preset",
                "bench",
                "--gib",
                str(args.gib),
                "--family",
                args.family,
                "--precision",
                "fp8",
                "--quiet",
            ],
            check=True,
        )
    if not (bf16 / "config.json").exists():
        shutil.rmtree(bf16, ignore_errors=True)
        write_dequantized(fp8, bf16)
    sizes = {"fp8": weight_bytes(fp8), "bf16": weight_bytes(bf16)}
    warmup = work / "warmup"
    shutil.rmtree(warmup, ignore_errors=True)
    subprocess.run([*mxforge, "fixture", str(warmup / "src"), "--precision", "fp8", "--quiet"], check=True)
    subprocess.run([*mxforge, "quantize", str(warmup / "src"), str(warmup / "out"), "--quiet"], check=True)
    results: dict = {}
    outs = {name: work / f"out-{name}" for name in ("fp8", "bf16", "quark-fp8")}
    for _ in range(args.repeat):
        for name, src in (("fp8", fp8), ("bf16", bf16)):
            warm(src)
            subprocess.run(["sync"])
            shutil.rmtree(outs[name], ignore_errors=True)
            cmd = [*mxforge, "quantize", str(src), str(outs[name]), "--quiet"]
            if args.workers:
                cmd += ["--workers", str(args.workers)]
            seconds, peak, _ = run_measured(cmd)
            bench_quantize._best(results, name, seconds, peak, bench_quantize.LAST_CPU_SECONDS)
    same = {
        p.name: p.read_bytes() == (outs["bf16"] / p.name).read_bytes()
        for p in sorted(outs["fp8"].iterdir())
        if p.suffix == ".safetensors" or p.name in ("config.json", "model.safetensors.index.json")
    }

    exclude = json.loads((outs["fp8"] / "config.json").read_text())["quantization_config"]["exclude"]
    (work / "exclude.json").write_text(json.dumps(exclude))
    shutil.rmtree(outs["quark-fp8"], ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-c", QUARK_FP8_SNIPPET, str(fp8), str(outs["quark-fp8"]), str(work / "exclude.json")],
        capture_output=True,
        text=True,
    )
    # Quark logs an error and returns (exit 0, nothing written) where it cannot dequantize: judge by its output.
    quark = {"ran": proc.returncode == 0 and (outs["quark-fp8"] / "config.json").exists()}
    if not quark["ran"]:
        errors = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if "QUARK-ERROR" in ln or "Error" in ln]
        quark["error"] = (
            re.sub(r"\x1b\[[0-9;]*m|\[QUARK-ERROR\]: ", "", errors[-1]).strip() if errors else f"exit {proc.returncode}"
        )
    numerics = fp32_vs_bf16_numerics(fp8)

    for name, r in results.items():
        r["source_bytes"] = sizes[name]
        r["gb_per_s"] = sizes[name] / r["seconds"] / 1e9
    report = {
        "family": args.family,
        "cores": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
        "results": results,
        "fp8_vs_bf16_seconds": results["fp8"]["seconds"] / results["bf16"]["seconds"],
        "fp8_vs_bf16_cpu_seconds": results["fp8"]["cpu_seconds"] / results["bf16"]["cpu_seconds"],
        "fp8_vs_bf16_source_bytes": sizes["fp8"] / sizes["bf16"],
        "outputs_identical": same,
        "quark_fp8": quark,
        "quark_fp8_numerics": numerics,
    }
    lines: list[str] = []
    lines.append(
        f"{args.family} bench, {report['cores']} cores, load average {report['load_average'][0]:.2f}: the same "
        f"content as FP8 ({sizes['fp8'] / 1e9:.2f} GB) and as bf16 ({sizes['bf16'] / 1e9:.2f} GB)"
    )
    lines.append(f"| {'source':<6} | {'seconds':>8} | {'source GB/s':>11} | {'CPU-s':>6} | {'peak RSS':>9} |")
    lines.append(f"|{'-' * 8}|{'-' * 9}:|{'-' * 12}:|{'-' * 7}:|{'-' * 10}:|")
    for name, r in results.items():
        lines.append(
            f"| {name:<6} | {r['seconds']:>8.2f} | {r['gb_per_s']:>11.3f} | {r['cpu_seconds']:>6.2f} | "
            f"{r['peak_rss'] / 2**30:>5.2f} GiB |"
        )
    lines.append(
        f"FP8 / bf16: wall {report['fp8_vs_bf16_seconds']:.2f}x, CPU {report['fp8_vs_bf16_cpu_seconds']:.2f}x, "
        f"source bytes {report['fp8_vs_bf16_source_bytes']:.2f}x (best of {args.repeat} alternating runs each)"
    )
    lines.append(f"outputs byte-identical (shards, config.json, index): {sum(same.values())}/{len(same)}")
    if quark["ran"]:
        quark_same = {
            p.name: p.read_bytes() == (outs["fp8"] / p.name).read_bytes()
            for p in sorted(outs["quark-fp8"].glob("*.safetensors"))
        }
        report["quark_fp8"]["shards_identical_to_mxforge"] = quark_same
        lines.append(
            f"Quark 0.13 file-to-file on the FP8 source ran; shards identical to mxforge's: "
            f"{sum(quark_same.values())}/{len(quark_same)}"
        )
    else:
        lines.append(f"Quark 0.13 file-to-file on the FP8 source cannot run on this machine: {quark['error']}")
    lines.append(
        f"MXFP4 of the float32 product (Quark's FP8 path) vs of its bf16 rounding (the bf16 checkpoint's), over "
        f"{numerics['weights']} weights: {100 * numerics['codes_differing']:.3f}% of codes, "
        f"{100 * numerics['scales_differing']:.3f}% of scales differ"
    )
    emit_report(args, lines, report)


if __name__ == "__main__":
    main()
