"""`mxforge validate`: would every engine release load this checkpoint? Reads headers only."""

from __future__ import annotations

from pathlib import Path

from mxforge.checkpoint import Checkpoint, CheckpointSource
from mxforge.validation.config_checks import check_layout, check_quant_config, exclude_entries
from mxforge.validation.deep_checks import check_sha256, scan_scales
from mxforge.validation.doctor import diagnose
from mxforge.validation.engine_check import engine_problems
from mxforge.validation.loaded import LoadedCheckpoint, load_checkpoint
from mxforge.validation.profiles import EngineProfile, check_engine_items, select
from mxforge.validation.report import Problem, ValidationReport
from mxforge.validation.serve import serving_commands
from mxforge.validation.tensor_forms import BF16, form_title


def loadability_problems(loaded: LoadedCheckpoint, profiles: list[EngineProfile], qc: dict | None) -> tuple[list, dict]:
    """Problems with `qc` as the checkpoint's quantization_config: its form, missing tensors (MTP layer
    included), and per engine profile every module whose allocation disagrees with the stored tensors."""
    quantized = frozenset(s.form for s in loaded.stored.values() if s.form is not None and s.form != BF16)
    problems = check_quant_config(qc, quantized)
    layout_problems, forms = check_layout(loaded.layout, loaded.planned, loaded.stored, loaded.infos, loaded.unreadable)
    problems += layout_problems
    found, engines = engine_problems(loaded, profiles, exclude_entries(qc), qc)
    return problems + found, {"linears": forms, "engines": engines}


def load_warnings(selections, checked: dict) -> list[Problem]:
    """What loads but does not compute as stored, per release range: bf16 modules re-quantized to MXFP4 after loading,
    and modules of a format the release computes by emulation (slow)."""
    out = []
    for s in selections:
        found = checked.get("engines", {}).get(s.profile.name, {})

        def warn(message: str, remedy: str) -> None:
            out.append(Problem("engine", s.profile.name, message, remedy, s.profile.name))

        n = found.get("requantized_at_load", 0)
        if n:
            warn(
                f"{s.label} loads {n} excluded attention module(s) bf16 and re-quantizes them to MXFP4 after loading "
                "(dynamic_mxfp4_quant): the checkpoint loads, but those modules do not compute in bf16 there",
                "serve with a later release to keep them bf16",
            )
        emulated = found.get("emulated") or {}
        if emulated:
            what = ", ".join(f"{n} {form_title(f)}" for f, n in sorted(emulated.items()))
            warn(
                f"{s.label} computes {what} module(s) by emulation (weights dequantized on the fly, matmuls in high "
                "precision): the checkpoint loads and computes the same function, slowly",
                "for speed, quantize these modules to a format the release runs natively, or serve with another engine",
            )
    return out


def validate_checkpoint(
    root: str | Path | CheckpointSource | Checkpoint,
    engines: str | list[str] | None = None,
    *,
    deep: bool = False,
    quiet: bool = True,
) -> ValidationReport:
    """Check integrity, quantization_config, layout/MTP completeness and, per engine release, loadability.

    `root` is a checkpoint directory, a CheckpointSource (a Hub repo: mxforge.hub.source) or an open Checkpoint.
    `engines` selects releases as `--engines` does (None: every supported release). Headers only, unless
    `deep`: then every MXFP4 scale is read (a 255 byte is NaN) and files are checked against the download's
    sha256 manifest (progress shown unless `quiet`). Returns a report; `report.ok` is False when problems
    were found (warnings, which no engine fails on, do not count).

    Raises:
        CheckpointError: the checkpoint cannot be checked at all (not a directory, no config.json, no index).
        ConfigError: an unknown engine selection, or config.json is not of a supported model family (mxforge.models).
    """
    check_engine_items(engines)
    loaded, problems, warnings, counts = load_checkpoint(root)
    selections = select(engines, loaded.layout.family)
    report = ValidationReport(loaded.ckpt.label, selections, problems, warnings)
    report.checked["integrity"] = counts
    qc = loaded.ckpt.quantization_config
    found, checked = loadability_problems(loaded, [s.profile for s in selections], qc)
    report.add(found)
    report.checked.update(checked)
    report.warnings += load_warnings(selections, checked)
    if deep:
        scale_problems, scale_bytes = scan_scales(loaded.ckpt.root, loaded.ckpt.weight_map, loaded.infos, quiet)
        hash_problems, hashed = check_sha256(loaded.ckpt.root, quiet)
        report.problems += scale_problems + hash_problems
        report.checked["deep"] = {"scale_bytes": scale_bytes, "sha256": hashed}
    report.notes = diagnose(loaded, qc)
    report.serve = serving_commands(
        report, loaded.ckpt.source.model_path, selections, speculative=bool(loaded.layout.mtp_layers)
    )
    fetched = loaded.ckpt.source.stats()
    if fetched is not None:
        report.checked["fetched"] = fetched
    return report
