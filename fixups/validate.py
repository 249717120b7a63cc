"""`mxforge validate`: would every engine load this checkpoint? Reads headers only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mxforge.checkpoint import Checkpoint
from mxforge.glm_layout import GlmLayout
from mxforge.safetensors_io import PlannedTensor, TensorInfo

from .config_checks import check_layout, check_quant_config, exclude_entries
from .doctor import diagnose
from .engine_check import check_engine
from .integrity import check_index_and_shards
from .matching import ExcludeList, with_mtp_remap
from .modules import LayerLinears, all_linears, checkpoint_linears, engine_modules
from .tensor_forms import Stored, stored_form
from .profiles import EngineProfile, resolve_profiles
from .report import ValidationReport


@dataclass
class LoadedCheckpoint:
    """A checkpoint's config, layout and tensor headers, read once for every check."""

    ckpt: Checkpoint
    layout: GlmLayout
    planned: list[PlannedTensor]   # every tensor config.json implies, bf16 shapes
    linears: dict[int | None, LayerLinears]
    infos: dict[str, TensorInfo]
    stored: dict[str, Stored]      # how each linear is stored, by module name
    unreadable: frozenset[str]     # tensors whose shard is missing or corrupt


def load_checkpoint(root: str | Path) -> tuple[LoadedCheckpoint, list, dict]:
    """Open a checkpoint and parse every header once. Returns it, integrity problems, integrity counts.

    Raises:
        CheckpointError: not a checkpoint directory (no config.json, no index).
        ConfigError: config.json is not a GlmMoeDsaForCausalLM config.
    """
    ckpt = Checkpoint.open(root)
    layout = GlmLayout(ckpt.config)
    problems, counts, headers = check_index_and_shards(ckpt)
    infos, unreadable = {}, set()
    for name, shard in ckpt.weight_map.items():
        header = headers.get(shard)
        info = header.tensors.get(name) if header else None
        if info is None:
            unreadable.add(name)
        else:
            infos[name] = info
    planned = layout.tensors()
    linears = checkpoint_linears(layout, planned)
    stored = {lin.name: stored_form(lin, infos) for lin in all_linears(linears)}
    return LoadedCheckpoint(ckpt, layout, planned, linears, infos, stored, frozenset(unreadable)), problems, counts


def engine_problems(loaded: LoadedCheckpoint, profiles: list[EngineProfile], exclude: list[str]) -> tuple[list, dict]:
    """Per-engine disagreements between what each engine allocates under `exclude` and what is stored."""
    quantized = loaded.ckpt.quantization_config is not None
    main = ExcludeList(tuple(exclude))
    problems, checked = [], {}
    for profile in profiles:
        draft = main
        for layer in loaded.layout.mtp_layers:
            draft = with_mtp_remap(draft, profile, layer)
        modules = engine_modules(profile, loaded.layout, loaded.linears)
        found = check_engine(profile, modules, loaded.stored, main, draft, quantized, loaded.unreadable)
        problems += found
        checked[profile.name] = {"modules": len(modules), "problems": len(found)}
    return problems, checked


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
