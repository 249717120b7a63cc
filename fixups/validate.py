"""`mxforge validate`: would every engine load this checkpoint? Reads headers only."""

from __future__ import annotations

from pathlib import Path

from .config_checks import check_layout, check_quant_config, exclude_entries
from .doctor import diagnose
from .engine_check import engine_problems
from .loaded import load_checkpoint
from .profiles import resolve_profiles
from .report import ValidationReport


def validate_checkpoint(root: str | Path, engines: list[str] | None = None) -> ValidationReport:
    """Check integrity, quantization_config, layout/MTP completeness and, per engine profile, loadability.

    `engines=None` (or empty) checks every profile. Returns a report; `report.ok` is False when problems
    were found.

    Raises:
        CheckpointError: the checkpoint cannot be checked at all (not a directory, no config.json, no index).
        ConfigError: unknown engine profile, or config.json is not a GlmMoeDsaForCausalLM config.
    """
    profiles = resolve_profiles(engines)
    loaded, problems, counts = load_checkpoint(root)
    report = ValidationReport(str(loaded.ckpt.root), [p.name for p in profiles])
    report.problems += problems
    report.checked["integrity"] = counts
    qc = loaded.ckpt.quantization_config
    has_uint8 = any(i.dtype == "U8" and n.endswith(".weight") for n, i in loaded.infos.items())
    report.problems += check_quant_config(qc, has_uint8)
    layout_problems, forms = check_layout(loaded.layout, loaded.planned, loaded.stored, loaded.infos, loaded.unreadable)
    report.problems += layout_problems
    report.checked["linears"] = forms
    found, checked = engine_problems(loaded, profiles, exclude_entries(qc))
    report.problems += found
    report.checked["engines"] = checked
    report.notes = diagnose(loaded.layout, loaded.linears, loaded.stored, loaded.infos, qc)
    return report
