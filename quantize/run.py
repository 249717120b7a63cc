"""`mxforge quantize`: a bf16 checkpoint to a Quark-format MXFP4 checkpoint, streaming, parallel, resumable.

Order of work, so that OUT never looks complete before it is: plan everything from headers (bad input
fails here, before any write); quantize shards in worker processes, each renamed into place when whole
and recorded in the state file; check every source tensor is in the output; then write the index, the
side files, config.json with Quark's quantization_config, and mxforge_quantize.json last.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path
from typing import Callable

from mxforge.checkpoint import Checkpoint, write_index
from mxforge.dir_lock import check_out_dir, directory_lock
from mxforge.disk_space import require_free_space
from mxforge.errors import CheckpointError, ConfigError
from mxforge.progress import byte_progress
from mxforge.provenance import (
    CONFIG_BACKUP_NAME,
    FIXUPS_NAME,
    INDEX_BACKUP_NAME,
    QUANTIZE_NAME,
    QUANTIZE_STATE_NAME,
    SOURCE_NAME,
    carried_from,
    read_record,
    recorded_command,
    source_hashes,
)
from mxforge.quantize.error_report import error_report
from mxforge.quantize.plan import QuantizePlan, ShardPlan, plan_checkpoint
from mxforge.quantize.recipe import Recipe, load_recipe
from mxforge.quantize.result import QuantizeResult, RecipeRecord, ShardCounts, TensorCounts
from mxforge.quantize.scheduler import Inline, ShardScheduler, ShardWorkers, Threads, quantize_steps
from mxforge.quantize.shard_job import ShardJob, ShardResult
from mxforge.quantize.state import ResumeState, tool_versions
from mxforge.safe_paths import refuse_links_leaving
from mxforge.safetensors_io import copy_atomic, read_header, write_json_atomic


def default_workers(shards: int) -> int:
    """One worker per usable CPU core, no more than there are shards to do."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, shards))


def quantize_checkpoint(
    src,
    out,
    recipe: Recipe | str | None = None,
    *,
    workers: int | None = None,
    device: str = "cpu",
    quiet: bool = False,
    refuse_nonfinite: bool = True,
    command: str | None = None,
    follow_symlinks: bool = False,
    scale_rule: str | None = None,
    measure_errors: bool = True,
    source_record_is_ours: bool = False,
    check_plan: Callable[[QuantizePlan, Recipe, Checkpoint], None] | None = None,
) -> QuantizeResult:
    """Quantize checkpoint `src` into `out` with `recipe`; returns the report (also in OUT/mxforge_quantize.json).

    OUT carries SRC's non-weight files that provenance.carried_files allows; `source_record_is_ours`: SRC's
    mxforge_source.json was written by the caller's own download of SRC for this product (mxforge run), so OUT
    carries it too (no other mxforge record, state or backup is ever taken from SRC). `check_plan` may refuse the
    plan (raising) before anything is written: mxforge run's check that the output would load in the releases it
    serves (fixups/plan_check.py).

    `scale_rule` (scale_rules.py) overrides the recipe's. The report's "error" section is measured while
    quantizing (error_report.py); `measure_errors=False` skips that (None), only to measure its cost.

    Rerunning on the same OUT resumes: shards already complete and still valid are skipped. Holds OUT's
    lock (dir_lock) throughout. SRC's files must not be symlinks leading out of SRC unless `follow_symlinks`.

    Raises:
        CheckpointError: bad source (missing/truncated/corrupt shard, index naming a missing tensor or
            shard or listing one twice, lying header, a symlink leaving SRC), OUT unusable or full, or a
            source tensor missing from the output.
        ConfigError: bad recipe, a rule matching nothing, bad --workers/--device.
        NonFiniteWeightError: NaN/Inf in a weight to quantize (unless refuse_nonfinite=False).
        DirectoryInUse: another mxforge process works in OUT.
    """
    src, out = Path(src), Path(out)
    recipe = recipe if isinstance(recipe, Recipe) or recipe is None else load_recipe(recipe)
    _check_device(device)
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}", entry="--workers")
    ckpt = Checkpoint.open(src, follow_symlinks)
    recipe = (recipe or load_recipe(None, ckpt.config)).with_scale_rule(scale_rule)  # None: the family's default
    carried = carried_from(src, ckpt.shard_names, ours=[SOURCE_NAME] if source_record_is_ours else [])
    to_copy = carried.names
    refuse_links_leaving(src, to_copy, follow=follow_symlinks, action="copy")
    plan = plan_checkpoint(ckpt, recipe)
    if check_plan is not None:
        check_plan(plan, recipe, ckpt)
    check_out_dir(src, out, QUANTIZE_STATE_NAME, "quantize")
    with directory_lock(out):
        report = _quantize_into(
            src,
            out,
            recipe=recipe,
            ckpt=ckpt,
            plan=plan,
            to_copy=to_copy,
            workers=workers,
            device=device,
            quiet=quiet,
            refuse_nonfinite=refuse_nonfinite,
            command=command,
            measure_errors=measure_errors,
        )
    note = carried.note()
    if note and not quiet:
        print(f"mxforge quantize: {note}", file=sys.stderr)
    return report


def _quantize_into(
    src: Path,
    out: Path,
    *,
    recipe: Recipe,
    ckpt: Checkpoint,
    plan: QuantizePlan,
    to_copy: list[str],
    workers: int | None,
    device: str,
    quiet: bool,
    refuse_nonfinite: bool,
    command: str | None,
    measure_errors: bool,
) -> QuantizeResult:
    started = time.monotonic()
    versions = tool_versions()
    state = ResumeState(out, recipe.sha256, versions, recipe.scale_rule)
    todo = [s for s in plan.shards if not state.is_done(s.name, src, out, s.header_sha256)]
    skipped = len(plan.shards) - len(todo)
    for s in todo:
        state.forget(s.name)
    state.save()  # marks OUT as ours before any shard is written, so a rerun after a kill may resume into it
    remove_strays(out, plan)
    _check_free_space(out, todo)
    expected = source_hashes(src)
    verified = _download_verified(src, expected)
    jobs = [
        ShardJob(
            str(src),
            str(out),
            s,
            device=device,
            refuse_nonfinite=refuse_nonfinite,
            expected_sha256=expected.get(s.name),
            verified_stat=verified.get(s.name),
            scale_offsets=recipe.scale_offsets,
            measure_errors=measure_errors,
        )
        for s in sorted(todo, key=lambda s: -s.source_size)
    ]
    workers = workers or default_workers(len(jobs))
    total = sum(s.source_size for s in todo)
    with byte_progress(total, "quantize", disable=quiet) as bar:
        results = _run_jobs(jobs, workers, state, bar)
    accounted = finish_checkpoint(src, out, recipe=recipe, ckpt=ckpt, plan=plan, side_files=to_copy)
    return write_provenance(
        src,
        out,
        recipe=recipe,
        plan=plan,
        device=device,
        workers=workers,
        state=state,
        quantized_now=len(todo),
        skipped=skipped,
        bytes_read=total,
        elapsed=time.monotonic() - started,
        accounted=accounted,
        command=command,
        sha256_from_download=sum(r.sha256_from_download for r in results),
        measure_errors=measure_errors,
    )


def finish_checkpoint(
    src: Path, out: Path, *, recipe: Recipe, ckpt: Checkpoint, plan: QuantizePlan, side_files: list[str]
) -> dict[str, int]:
    """Once every output shard is in place: check them against the plan, then write the index, the side
    files and config.json (what makes OUT a checkpoint); returns verify_output's counts, with
    "fixups_dropped": the fixups an earlier `mxforge fixup` had applied to OUT, which this config.json and
    index no longer hold (their record and backups are removed with them: nothing may claim them).

    Raises:
        CheckpointError: a planned tensor is missing from the output, or a file cannot be written.
    """
    accounted = verify_output(plan, out)
    _write_index(plan, out)
    for name in side_files:
        copy_atomic(src / name, out / name)
    _write_config(ckpt.config, recipe, plan, out)
    accounted["fixups_dropped"] = 0 if FIXUPS_NAME in side_files else drop_fixup_record(out)
    return accounted


def drop_fixup_record(out: Path) -> int:
    """Remove the fixup record and fixup's backups from OUT, whose config.json and index quantize has just
    written anew; returns how many fixups the record listed (0: none was there)."""
    record = read_record(out, FIXUPS_NAME)
    if record is None and not (out / FIXUPS_NAME).exists():
        return 0
    for name in (FIXUPS_NAME, CONFIG_BACKUP_NAME, INDEX_BACKUP_NAME):
        (out / name).unlink(missing_ok=True)
    fixups = (record or {}).get("fixups")
    return len(fixups) if isinstance(fixups, list) else 0


def _check_device(device: str) -> None:
    if device == "cpu":
        return
    if device.split(":")[0] != "cuda":
        raise ConfigError(f"--device {device!r}: choose cpu or cuda", entry="--device")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: no CUDA device is visible to torch {torch.__version__} "
            f"(built with CUDA {torch.version.cuda}); use --device cpu",
            entry="--device",
        )


def remove_strays(out: Path, plan: QuantizePlan) -> None:
    """Partial files from an interrupted run, and shards that are not part of this plan."""
    planned = {s.name for s in plan.shards}
    for p in out.iterdir():
        if p.name.endswith(".partial") or (p.suffix == ".safetensors" and p.name not in planned):
            p.unlink()


def _check_free_space(out: Path, todo: list[ShardPlan]) -> None:
    require_free_space(
        out,
        sum(s.output_size for s in todo),
        what="the remaining output shards",
        remedy="free space or choose another OUT",
    )


def _download_verified(src: Path, expected: dict[str, str]) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of each shard whose sha256 `mxforge download` verified (its hash cache) and that
    still has that size and mtime: its recorded sha256 stands for its bytes, as everywhere mxforge caches
    hashes, so quantize need not hash it again. Touching or rewriting the file makes quantize hash it."""
    if not expected:
        return {}
    from mxforge.file_hashes import HashCache

    cache, out = HashCache(src), {}
    for name, sha256 in expected.items():
        known = cache.get(name)
        if known is not None and known.sha256 == sha256:
            try:
                st = (src / name).stat()
            except OSError:
                continue
            if st.st_size == known.size:
                out[name] = (st.st_size, st.st_mtime_ns)
    return out


# --- the shards, through the scheduler ------------------------------------------------------------
def _run_jobs(jobs: list[ShardJob], workers: int, state: ResumeState, bar) -> list[ShardResult]:
    """Run shard jobs (in worker processes when workers > 1), recording each finished shard at once.

    Raises:
        MxforgeError: a worker's error (the first one), or a worker that died (e.g. killed for memory).
    """
    results: list[ShardResult] = []
    if not jobs:
        return results

    def recorded(job: ShardJob, result: ShardResult) -> None:
        state.record(result)
        results.append(result)

    pool = ShardWorkers(workers, jobs, bar=bar)
    finishers = Threads(workers, "fsync", wait_on_failure=True) if pool.forks else Inline()
    steps = quantize_steps(
        pool, finishers, Path(jobs[0].out_dir), job=lambda job: job, name=lambda job: job.plan.name, recorded=recorded
    )
    ShardScheduler(steps).run(jobs, lambda job: "quantize")
    return results


# --- finishing -------------------------------------------------------------------------------------
def verify_output(plan: QuantizePlan, out: Path) -> dict[str, int]:
    """Every source tensor must be in the output as planned (read back from the written headers).

    Raises:
        CheckpointError: a tensor is missing or differs from the plan; the MTP layer is named first.
    """
    counts = {"quantized": 0, "kept": 0, "kept_source": 0, "copied": 0, "scale": 0, "mtp_tensors": 0}
    for shard in plan.shards:
        header = read_header(out / shard.name)
        for t in shard.tensors:
            for o in t.outputs():
                got = header.tensors.get(o.name)
                if got is None or (got.dtype, got.shape) != (o.dtype, o.shape):
                    what = "MTP layer tensor" if plan.layout.in_mtp_layer(t.source.name) else "tensor"
                    raise CheckpointError(
                        f"{out / shard.name}: source {what} {t.source.name!r} is missing from the "
                        f"output (expected {o.name} {o.dtype}{list(o.shape)}); rerun to redo the shard",
                        path=out / shard.name,
                        tensor=t.source.name,
                    )
            counts[t.fate] += 1
            counts["mtp_tensors"] += plan.layout.in_mtp_layer(t.source.name)
    if plan.layout.mtp_layers and not counts["mtp_tensors"]:
        raise CheckpointError(
            f"{out}: config.json declares MTP layer(s) {list(plan.layout.mtp_layers)} "
            "but the output holds none of their tensors",
            path=out,
        )
    return counts


def _write_index(plan: QuantizePlan, out: Path) -> None:
    weight_map = {o.name: s.name for s in plan.shards for t in s.tensors for o in t.outputs()}
    total = sum(o.nbytes for s in plan.shards for t in s.tensors for o in t.outputs())
    write_index(out, weight_map, total)


def _write_config(config: dict, recipe: Recipe, plan: QuantizePlan, out: Path) -> None:
    """config.json with quantization_config as Quark's file-to-file writes it (same JSON layout)."""
    config = copy.deepcopy(config)
    quantization_config = plan.quantization_config(recipe, config.get("quantization_config"))
    drop_quantization_config(config)
    config["quantization_config"] = quantization_config
    # Quark's layout exactly: indent 4, UTF-8 as is, no trailing newline.
    write_json_atomic(out / "config.json", config, indent=4, ensure_ascii=False, trailing_newline=False)


def drop_quantization_config(config: dict) -> None:
    """Remove quantization_config from a config and from every config nested in it (text_config...)."""
    config.pop("quantization_config", None)
    for value in config.values():
        if isinstance(value, dict):
            drop_quantization_config(value)


def write_provenance(
    src: Path,
    out: Path,
    *,
    recipe: Recipe,
    plan: QuantizePlan,
    device: str,
    workers: int,
    state: ResumeState,
    quantized_now: int,
    skipped: int,
    bytes_read: int,
    elapsed: float,
    accounted: dict,
    command: str | None,
    sha256_from_download: int,
    measure_errors: bool = True,
) -> QuantizeResult:
    """The quantize report, with the error report of every shard in `state`, written to OUT/QUANTIZE_NAME
    (the sequential and the streamed run both end here); returns it.

    `quantized_now` / `skipped`: shards quantized by this run / found complete; `bytes_read`: the source bytes this
    run processed; `accounted`: verify_output's counts; `sha256_from_download`: shards whose download-verified
    sha256 stood for their bytes."""
    result = QuantizeResult(
        source=str(src.resolve()),
        out=str(out.resolve()),
        recipe=RecipeRecord(
            name=recipe.name,
            sha256=recipe.sha256,
            source=recipe.source,
            scheme=recipe.scheme,
            format=recipe.format_record,
            scale_rule=recipe.scale_rule,
        ),
        source_precision=plan.precision.describe(),
        family=plan.layout.family.title,
        device=device,
        workers=workers,
        shards=ShardCounts(total=len(plan.shards), quantized_now=quantized_now, skipped_complete=skipped),
        shards_sha256_from_download=sha256_from_download,
        counts=TensorCounts(
            quantized=accounted["quantized"],
            kept=accounted["kept"],
            kept_source=accounted["kept_source"],
            copied=accounted["copied"],
        ),
        fp8_scales_consumed=accounted["scale"],
        mtp_layers=list(plan.layout.mtp_layers),
        mtp_tensors=accounted["mtp_tensors"],
        fixups_dropped=accounted.get("fixups_dropped", 0),
        bytes_in=sum(s.source_size for s in plan.shards),
        bytes_out=sum(s.output_size for s in plan.shards),
        bytes_processed_now=bytes_read,
        seconds=round(elapsed, 3),
        gb_per_s=round(bytes_read / elapsed / 1e9, 4) if elapsed > 0 else None,
        tool_versions=state.versions,
        command=recorded_command(command),
        tensors={fate: plan.names(fate) for fate in ("quantized", "kept", "kept_source", "copied")},
        error=error_report(
            state.errors(s.name for s in plan.shards),
            plan.layout,
            recipe.scale_rule,
            {f"{m}.weight": f.name for m, f in plan.module_formats().items()},
        )
        if measure_errors
        else None,
    )
    write_json_atomic(out / QUANTIZE_NAME, result.as_dict())
    return result
