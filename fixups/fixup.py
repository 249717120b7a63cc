"""`mxforge fixup`: make `quantization_config.exclude` say, in every engine's terms, what the checkpoint stores.

Two edits, both derived from the tensors on disk and the engine profiles:
- glob entries (Quark's syntax, which no engine understands) become the exact names of the modules they
  cover that are stored bf16;
- every module stored bf16 that an engine would otherwise build as MXFP4 (or cannot decide on, because
  its fused shards disagree), and every bf16 module of the MTP layer, gets its exact runtime name in that
  engine: `model.decoder.X`, `model.eh_proj`, the fused names, `<layer>.mlp.experts`.
Nothing else is touched. A second run finds nothing to add and writes nothing.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mxforge.errors import ConfigError
from mxforge.safetensors_io import write_json_atomic

from .config_checks import exclude_entries
from .matching import ExcludeList, ShardsDisagree, engine_excludes, is_glob, with_mtp_remap
from .modules import engine_modules
from .profiles import EngineProfile, resolve_profiles
from .report import Problem
from .tensor_forms import BF16
from .loaded import LoadedCheckpoint, load_checkpoint
from .validate import loadability_problems

FIXUPS_NAME = "mxforge_fixups.json"
BACKUP_NAME = "config.json.orig"


@dataclass
class FixupResult:
    path: str
    engines: list[str]
    applied: list[dict] = field(default_factory=list)    # what was (or, dry run, would be) changed
    warnings: list[str] = field(default_factory=list)
    remaining: list[Problem] = field(default_factory=list)  # problems editing `exclude` cannot cure
    diff: str = ""
    dry_run: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.applied)

    def as_dict(self) -> dict:
        return {"stage": "fixup", "path": self.path, "engines": self.engines, "dry_run": self.dry_run,
                "changed": self.changed, "applied": self.applied, "warnings": self.warnings,
                "remaining": [p.__dict__ for p in self.remaining], "ok": not self.remaining}

    def format(self) -> str:
        verb = "would change" if self.dry_run else "changed"
        lines = [f"{self.path}: {verb} {len(self.applied)} exclude entr{'y' if len(self.applied) == 1 else 'ies'}"
                 if self.changed else f"{self.path}: nothing to fix ({', '.join(self.engines)})"]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  + {a['entry']} (for {', '.join(a['engines'])}: {a['why']})" for a in self.applied if a["fixup"] == "alias"]
        if self.remaining:
            lines.append(f"  {len(self.remaining)} problem(s) that editing quantization_config cannot cure:")
            lines += [f"  - {p.format()}" for p in self.remaining]
        if self.dry_run and self.diff:
            lines.append(self.diff.rstrip("\n"))
        return "\n".join(lines)


def rewrite_globs(entries: list[str], loaded: LoadedCheckpoint) -> tuple[list[str], list[dict], list[str]]:
    """Replace each glob entry by the exact names of the bf16-stored modules it covers (Quark's fnmatch)."""
    bf16_modules = sorted(name for name, s in loaded.stored.items() if s.form == BF16)
    out, applied, warnings = [], [], []
    for entry in entries:
        if not is_glob(entry):
            out.append(entry)
            continue
        covered = [m for m in bf16_modules if fnmatch.fnmatchcase(m, entry)]
        out += covered
        applied.append({"fixup": "glob_rewrite", "entry": entry, "replaced_by": covered,
                        "why": "engines match exact names or 're:' regexes only"})
        warnings.append(f"exclude entry {entry!r} is a glob no engine understands: replaced by the {len(covered)} exact "
                        f"module name(s) it covers that are stored bf16" if covered else
                        f"exclude entry {entry!r} is a glob no engine understands and covers no module stored bf16: removed")
    return list(dict.fromkeys(out)), applied, warnings


def needed_aliases(entries: list[str], loaded: LoadedCheckpoint, profiles: list[EngineProfile]) -> list[dict]:
    """The exact runtime names each engine needs so that every module stored bf16 is built bf16."""
    added: dict[str, dict] = {}
    for profile in profiles:
        main = ExcludeList(tuple(entries) + tuple(added))
        draft = main
        for layer in loaded.layout.mtp_layers:
            draft = with_mtp_remap(draft, profile, layer)
        for module in engine_modules(profile, loaded.layout, loaded.linears):
            forms = {loaded.stored[lin.name].form for lin in module.shards}
            if forms != {BF16} or not module.quantizable:
                continue
            current = draft if module.is_mtp else main
            if current.matching_entry(module.runtime):
                continue
            try:
                would_quantize = not engine_excludes(profile, module.runtime, module.is_experts, current)
                why = "stored bf16; " + ("the engine would build it MXFP4" if would_quantize else f"MTP module as {profile.name} names it")
            except ShardsDisagree:
                would_quantize, why = True, "stored bf16; its shard entries disagree and the engine would raise"
            if not (would_quantize or module.is_mtp):
                continue
            if module.runtime in added:
                added[module.runtime]["engines"].append(profile.name)
            else:
                added[module.runtime] = {"fixup": "alias", "entry": module.runtime, "module": module.checkpoint,
                                         "engines": [profile.name], "why": why}
    return list(added.values())


def fixup_checkpoint(root: str | Path, engines: list[str] | None = None, dry_run: bool = False,
                     command: str | None = None) -> FixupResult:
    """Rewrite config.json's `quantization_config.exclude` so that every engine profile loads the checkpoint.

    Keeps the original as config.json.orig (first run only), writes atomically, records what it applied
    in mxforge_fixups.json beside config.json. `dry_run` computes the same and writes nothing.

    Raises:
        CheckpointError: not a checkpoint directory, or a file cannot be written.
        ConfigError: unknown engine profile, or config.json is not a GlmMoeDsaForCausalLM config.
    """
    profiles = resolve_profiles(engines)
    loaded, _, _ = load_checkpoint(root)
    result = FixupResult(str(loaded.ckpt.root), [p.name for p in profiles], dry_run=dry_run)
    config = loaded.ckpt.config
    qc = loaded.ckpt.quantization_config
    if qc is None:
        result.warnings.append("no quantization_config: every engine loads this checkpoint as bf16; nothing to fix")
        return result
    raw = qc.get("exclude", [])
    if not isinstance(raw, list) or not all(isinstance(e, str) for e in raw):
        raise ConfigError(f"{loaded.ckpt.root / 'config.json'}: quantization_config.exclude is not a list of module "
                          "names; fix it by hand (see mxforge validate) before running fixup")
    before = exclude_entries(qc)
    entries, applied, warnings = rewrite_globs(before, loaded)
    aliases = needed_aliases(entries, loaded, profiles)
    entries += [a["entry"] for a in aliases]
    result.applied, result.warnings = applied + aliases, warnings
    result.remaining, _ = loadability_problems(loaded, profiles, {**qc, "exclude": entries})
    if not result.changed:
        return result
    new_config = {**config, "quantization_config": {**qc, "exclude": entries}}
    old_text, new_text = (json.dumps(c, indent=2) + "\n" for c in (config, new_config))
    result.diff = "".join(difflib.unified_diff(old_text.splitlines(True), new_text.splitlines(True),
                                               "a/config.json", "b/config.json"))
    if dry_run:
        return result
    _write(loaded.ckpt.root, new_config, result, command or shlex.join(["mxforge", *sys.argv[1:]]))
    return result


def _write(root: Path, new_config: dict, result: FixupResult, command: str) -> None:
    backup = root / BACKUP_NAME
    if not backup.exists():
        tmp = backup.with_name(BACKUP_NAME + ".partial")
        shutil.copy2(root / "config.json", tmp)
        tmp.replace(backup)
    record_path = root / FIXUPS_NAME
    record = json.loads(record_path.read_text()) if record_path.exists() else {"stage": "fixup", "fixups": [], "runs": []}
    record["fixups"] += result.applied
    record["runs"].append({"command": command, "engines": result.engines, "applied": len(result.applied)})
    record.update({"engines": result.engines, "config_backup": BACKUP_NAME, "command": command})
    write_json_atomic(root / "config.json", new_config)
    write_json_atomic(record_path, record)
