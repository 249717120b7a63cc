"""`mxforge fixup`: make `quantization_config.exclude` say, in every engine's terms, what the checkpoint stores.

Three edits, all derived from the tensors on disk and the engine profiles:
- glob entries (Quark's syntax, which no engine understands) become the exact names of the modules they
  cover that are stored bf16;
- every module stored bf16 that an engine would otherwise build as MXFP4 (or cannot decide on, because
  its fused shards disagree), and every bf16 module of the MTP layer, gets its exact runtime name in that
  engine: `model.decoder.X`, `model.eh_proj`, the fused names, `<layer>.mlp.experts`;
- every module stored in an element format that an engine would build in another one (its `layer_quant_config`
  pattern names `model.layers.N.*`, the draft builds `model.decoder.*`) gets a `layer_quant_config` entry under its
  runtime names in that engine, with the config its pattern gives it.
Nothing else is touched. A second run finds nothing to add and writes nothing.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mxforge.checkpoint import INDEX_NAME, Checkpoint, CheckpointSource, LocalDir, load_json
from mxforge.dir_lock import directory_lock
from mxforge.errors import ConfigError
from mxforge.formats import format_named, layer_config_of
from mxforge.models import layout_of
from mxforge.provenance import CONFIG_BACKUP_NAME, FIXUPS_NAME, keep_original, read_fixups_record, recorded_command
from mxforge.records import fields_of
from mxforge.safetensors_io import write_json_atomic
from mxforge.validation.config_checks import exclude_entries
from mxforge.validation.engine_check import OTHER, check_engine, decide, engine_view, without_fusion
from mxforge.validation.integrity import TOTAL_SIZE
from mxforge.validation.loaded import LoadedCheckpoint, load_checkpoint
from mxforge.validation.matching import DRAFT, is_glob, scheme_format
from mxforge.validation.modules import EngineModule
from mxforge.validation.profiles import EngineProfile, check_engine_items, select
from mxforge.validation.report import MAX_LISTED, Problem
from mxforge.validation.tensor_forms import BF16, form_title
from mxforge.validation.validate import loadability_problems


@dataclass
class FixupResult:
    path: str
    engines: list[str]
    applied: list[dict] = field(default_factory=list)  # what was (or, dry run, would be) changed
    warnings: list[str] = field(default_factory=list)
    remaining: list[Problem] = field(default_factory=list)  # problems editing `exclude` cannot cure
    diff: str = ""
    dry_run: bool = False
    new_config: dict | None = None  # config.json as fixup makes it (None: unchanged)

    @property
    def changed(self) -> bool:
        return bool(self.applied)

    def as_dict(self) -> dict:
        return {
            "stage": "fixup",
            **fields_of(self, "path", "engines", "dry_run", "changed", "applied", "warnings"),
            "remaining": [p.__dict__ for p in self.remaining],
            "ok": not self.remaining,
        }

    @classmethod
    def from_dict(cls, d: dict) -> FixupResult:
        """Read back from `as_dict()` (mxforge run's state file); the diff and the new config are not recorded."""
        return cls(
            path=str(d.get("path", "")),
            engines=[e for e in d.get("engines") or [] if isinstance(e, str)],
            applied=[a for a in d.get("applied") or [] if isinstance(a, dict)],
            warnings=[w for w in d.get("warnings") or [] if isinstance(w, str)],
            remaining=[Problem(**p) for p in d.get("remaining") or [] if isinstance(p, dict)],
            dry_run=bool(d.get("dry_run")),
        )

    def format(self) -> str:
        verb = "would change" if self.dry_run else "changed"
        lines = [
            f"{self.path}: {verb} {len(self.applied)} fixup(s)"
            if self.changed
            else f"{self.path}: nothing to fix ({', '.join(self.engines)})"
        ]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [
            f"  + MTP layer(s) {a['layers']} from {a['source']}: {a['quantized']} weights MXFP4 ({a['why']})"
            for a in self.applied
            if a["fixup"] == "mtp_inject"
        ]
        lines += [
            f"  ~ {a['entry']} -> {a['replaced_by'][0]} (for {', '.join(a['engines'])}: {a['why']})"
            for a in self.applied
            if a["fixup"] == "block_entry_rewrite"
        ]
        aliases = [a for a in self.applied if a["fixup"] == "alias"]
        lines += [f"  + {a['entry']} (for {', '.join(a['engines'])}: {a['why']})" for a in aliases[:MAX_LISTED]]
        if len(aliases) > MAX_LISTED:
            lines.append(f"  ... and {len(aliases) - MAX_LISTED} more aliases (all of them in --json)")
        configs = [a for a in self.applied if a["fixup"] == "layer_config_alias"]
        lines += [
            f"  + layer_quant_config {a['entry']} (for {', '.join(a['engines'])}: {a['why']})"
            for a in configs[:MAX_LISTED]
        ]
        if len(configs) > MAX_LISTED:
            lines.append(
                f"  ... and {len(configs) - MAX_LISTED} more layer_quant_config aliases (all of them in --json)"
            )
        if self.remaining:
            lines.append(f"  {len(self.remaining)} problem(s) that editing quantization_config cannot cure:")
            lines += [f"  - {p.format()}" for p in self.remaining[:MAX_LISTED]]
            if len(self.remaining) > MAX_LISTED:
                lines.append(f"  ... and {len(self.remaining) - MAX_LISTED} more (all of them in --json)")
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
        applied.append(
            {
                "fixup": "glob_rewrite",
                "entry": entry,
                "replaced_by": covered,
                "why": "engines match exact names or 're:' regexes only",
            }
        )
        warnings.append(
            f"exclude entry {entry!r} is a glob no engine understands: replaced by the {len(covered)} exact "
            f"module name(s) it covers that are stored bf16"
            if covered
            else f"exclude entry {entry!r} is a glob no engine understands and covers no module stored bf16: removed"
        )
    return list(dict.fromkeys(out)), applied, warnings


def block_entry_rewrites(
    entries: list[str], loaded: LoadedCheckpoint, profiles: list[EngineProfile], qc: dict | None = None
) -> tuple[list[str], dict[str, dict]]:
    """Exact entries under the MTP block's prefix (Qwen3.5's `mtp.fc`...) rewritten as `re:` entries matching that
    name alone, where a release's draft would otherwise build itself unquantized on seeing them
    (`DraftRule.block_entry_switch`, which tests the entry's text: sglang 0.5.12-0.5.20's `startswith("mtp.")`)
    while the checkpoint stores some of its MTP modules quantized. Every engine matches a `re:` entry by `re.match`,
    so the module stays excluded everywhere; entries naming the routed experts are left (a release that decides the
    experts by child entries matches exact names only). Returns the entries as written and, by original entry, the
    record of each rewrite."""
    block = loaded.layout.layer_names.mtp_block
    switching = [p for p in profiles if p.draft.block_entry_switch != "none"]
    quantized_mtp = any(s.form != BF16 for name, s in loaded.stored.items() if loaded.layout.in_mtp_layer(name))
    if not (block and switching and quantized_mtp):
        return entries, {}
    rewritten = {e: "re:" + re.escape(e) + "$" for e in entries if e.startswith(block + ".") and "mlp.experts" not in e}
    fixes = [
        p.name
        for p in switching
        if engine_view(p, loaded.layout, loaded.linears, entries, qc).roles[DRAFT].unquantized
        and not engine_view(p, loaded.layout, loaded.linears, [rewritten.get(e, e) for e in entries], qc)
        .roles[DRAFT]
        .unquantized
    ]
    if not fixes:
        return entries, {}
    applied = {
        e: {
            "fixup": "block_entry_rewrite",
            "entry": e,
            "replaced_by": [r],
            "engines": fixes,
            "why": f"an exact entry under {block}. makes the draft build itself unquantized, though the checkpoint "
            "stores MTP modules quantized; the regex excludes the same module in every release",
        }
        for e, r in rewritten.items()
    }
    return [rewritten.get(e, e) for e in entries], applied


def alias_entries(profile: EngineProfile, module: EngineModule) -> list[str]:
    """Entries that make `profile`'s release build `module` unquantized: its runtime name, and for a fused
    module also its shards' runtime names (releases that decide fused modules by their shards ignore the
    fused name)."""
    head, _, proj = module.runtime.rpartition(".")
    shards = profile.fused.get(proj, ()) if not module.is_experts else ()
    return [module.runtime] + [f"{head}.{s}" for s in shards]


def needed_aliases(
    entries: list[str], loaded: LoadedCheckpoint, profiles: list[EngineProfile], qc: dict | None = None
) -> list[dict]:
    """The entries each release needs so that every module stored bf16 is built bf16, also when it is served
    with shared-expert fusion switched off; every bf16 module of the MTP layer gets its runtime names."""
    added: dict[str, dict] = {}
    layout, linears = loaded.layout, loaded.linears
    for profile in profiles:
        for _ in range(3):  # an entry that vetoes shared-expert fusion changes the modules built: look again
            view = engine_view(profile, layout, linears, entries + list(added), qc)
            views = [view, without_fusion(view, layout, linears)] if view.fused else [view]
            new = 0
            for v in views:
                for module in v.modules:
                    if {loaded.stored[lin.name].form for lin in module.shards} != {BF16} or not module.quantizable:
                        continue
                    verdict = decide(v, module)
                    if verdict.form == BF16 and (
                        not module.is_mtp or v.roles[DRAFT].entries.matching_entry(module.runtime)
                    ):
                        continue
                    if verdict.form is None:
                        why = "stored bf16; the engine would raise while deciding"
                    elif verdict.form == BF16:
                        why = f"stored bf16; the MTP module's name in {profile.name}"
                    elif verdict.form == OTHER:
                        why = f"stored bf16; the engine would build it with {verdict.form}"
                    else:
                        why = f"stored bf16; the engine would build it {form_title(verdict.form)}"
                    for entry in alias_entries(profile, module):
                        if entry in entries:
                            continue
                        record = {
                            "fixup": "alias",
                            "entry": entry,
                            "module": module.checkpoint,
                            "engines": [],
                            "why": why,
                        }
                        new += _needs(added, record, profile)
            if not new:
                break
    return list(added.values())


def _needs(added: dict[str, dict], record: dict, profile: EngineProfile) -> int:
    """Note that `profile`'s release needs `record`'s entry (`record` kept as the entry's on its first need): 1 when
    this release is new to it, else 0."""
    kept = added.setdefault(record["entry"], record)
    if profile.name in kept["engines"]:
        return 0
    kept["engines"].append(profile.name)
    return 1


def needed_layer_configs(loaded: LoadedCheckpoint, profiles: list[EngineProfile], qc: dict) -> list[dict]:
    """`layer_quant_config` entries under each release's runtime names for every module stored in an element
    format the release would build in another one (a draft that names the MTP layer `model.decoder.*` or
    `model.eh_proj`, where the checkpoint's patterns name `model.layers.N.*`): the module's runtime name, or a
    fused module's shards' (the releases decide those by their shards), given the config the checkpoint's own
    patterns give its checkpoint name. Exact names, so each matches its module alone."""
    added: dict[str, dict] = {}
    layout, linears = loaded.layout, loaded.linears
    for profile in profiles:
        for _ in range(3):  # the entries added can change what a fused module's shards decide: look again
            layers = {**{a["entry"]: a["config"] for a in added.values()}, **(qc.get("layer_quant_config") or {})}
            view = engine_view(profile, layout, linears, exclude_entries(qc), {**qc, "layer_quant_config": layers})
            new = 0
            for v in [view, without_fusion(view, layout, linears)] if view.fused else [view]:
                for module in v.modules:
                    forms = {loaded.stored[lin.name].form for lin in module.shards}
                    form = forms.pop() if len(forms) == 1 else None
                    if form is None or form == BF16 or not module.quantizable:
                        continue
                    verdict = decide(v, module)
                    if verdict.form in (form, BF16):  # bf16: excluded or never quantized, which no config changes
                        continue
                    config = layer_config_of(qc, module.shards[0].name)
                    if scheme_format(profile, config) != format_named(form):
                        continue  # the release would not load the module's own config as stored: validate says why
                    head, _, proj = module.runtime.rpartition(".")
                    if proj in profile.packed_as_itself:
                        continue  # built in the global config whatever layer_quant_config says: validate says so
                    packed = profile.packed_in(module.is_mtp)
                    shards = profile.fused.get(proj, ()) if not module.is_experts and proj in packed else ()
                    for entry in [f"{head}.{s}" for s in shards] or [module.runtime]:
                        if entry in (qc.get("layer_quant_config") or {}):
                            continue
                        record: dict = {
                            "fixup": "layer_config_alias",
                            "entry": entry,
                            "module": module.checkpoint,
                            "format": form,
                            "config": config,
                            "engines": [],
                            "why": f"stored {form_title(form)}; the engine would build it "
                            + (form_title(verdict.form) if verdict.form else f"only with an error ({verdict.reason})"),
                        }
                        new += _needs(added, record, profile)
            if not new:
                break
    return list(added.values())


def harmed_modules(
    loaded: LoadedCheckpoint,
    profiles: list[EngineProfile],
    before: list[str],
    after: list[str],
    qc: dict | None = None,
    after_qc: dict | None = None,
) -> list[tuple[str, str]]:
    """(profile, module) pairs that load under `before` (and `qc`) but not under `after` (and `after_qc`, default
    `qc`): an added entry must never change a decision that was right."""
    harmed = []
    for profile in profiles:
        loading = []
        for entries, config in ((before, qc), (after, qc if after_qc is None else after_qc)):
            view = engine_view(profile, loaded.layout, loaded.linears, entries, config)
            failing = {p.subject for p in check_engine(view, loaded.stored, True)}
            loading.append({m.runtime for m in view.modules} - failing)
        harmed += [(profile.name, m) for m in sorted(loading[0] - loading[1])]
    return harmed


def fixed_quantization_config(
    loaded: LoadedCheckpoint, profiles: list[EngineProfile], qc: dict, *, where: str
) -> tuple[dict, list[dict], list[dict], list[dict], list[str]]:
    """The quantization_config fixup makes of `qc` for `profiles`, and what it applied: (the new config, the glob
    rewrites, the exclude aliases, the layer-config aliases, warnings). `where` names the config in an error.

    Raises:
        ConfigError: an alias would change a decision that was right (never expected: nothing is written).
    """
    entries, applied, warnings = rewrite_globs(exclude_entries(qc), loaded)
    aliases = needed_aliases(entries, loaded, profiles, qc)
    written, rewritten = block_entry_rewrites(entries + [a["entry"] for a in aliases], loaded, profiles, qc)
    for a in aliases:  # an alias under the MTP block's prefix is written as its regex from the start
        a["entry"] = rewritten.pop(a["entry"], {"replaced_by": [a["entry"]]})["replaced_by"][0]
    applied += rewritten.values()
    fixed_qc = {**qc, "exclude": written}
    layer_aliases = needed_layer_configs(loaded, profiles, fixed_qc)
    if layer_aliases:  # first: Quark's and the engines' matching take the first pattern that matches
        fixed_qc["layer_quant_config"] = {
            **{a["entry"]: a["config"] for a in layer_aliases},
            **(qc.get("layer_quant_config") or {}),
        }
    harmed = harmed_modules(loaded, profiles, entries, fixed_qc["exclude"], qc, fixed_qc)
    if harmed:  # never expected: every alias names a module in one release's terms; refuse rather than harm
        raise ConfigError(
            f"{where}: the aliases fixup computed would change how {harmed[0][0]} builds {harmed[0][1]} (and "
            f"{len(harmed) - 1} more); nothing was written. Please report this checkpoint's config.json to the "
            "mxforge maintainers",
            filename="config.json",
        )
    layer_records = [{k: v for k, v in a.items() if k != "config"} for a in layer_aliases]
    return fixed_qc, applied, aliases, layer_records, warnings


def fixup_checkpoint(
    root: "str | Path | CheckpointSource",
    engines: str | list[str] | None = None,
    *,
    dry_run: bool = False,
    command: str | None = None,
    mtp_from: str | Path | None = None,
    recipe: str | None = None,
    quiet: bool = True,
) -> FixupResult:
    """Rewrite config.json's `quantization_config.exclude` so that every selected engine release (`engines`
    as `--engines`; None: every supported release) loads the checkpoint, and repair what no engine reads
    (the index's total_size).

    Keeps the original as config.json.orig (first run only), writes atomically, records what it applied
    in mxforge_fixups.json beside config.json. `dry_run` computes the same and writes nothing.
    `root` may be any CheckpointSource; one that is not a local directory (a Hub repo) is only read, as with
    `dry_run` (hub_pr proposes the result as a pull request). `mtp_from` (a bf16 checkpoint) first re-injects a
    missing MTP layer, quantized per `recipe` (default: the quantizer's default recipe); when the MTP layer is present
    it is left alone.

    Raises:
        CheckpointError: not a checkpoint directory, or a file cannot be written.
        ConfigError: unknown engine selection or recipe, or config.json is not of a supported model family
            (mxforge.models).
        NonFiniteWeightError: a source MTP weight to quantize holds NaN/Inf.
        DirectoryInUse: another mxforge process works in the checkpoint directory (whose lock fixup holds
            while it may write).
    """
    if dry_run or not isinstance(root, (str, os.PathLike)) or not Path(root).is_dir():
        return _fixup_checkpoint(root, engines, dry_run, command, mtp_from, recipe, quiet)
    with directory_lock(root):
        return _fixup_checkpoint(root, engines, dry_run, command, mtp_from, recipe, quiet)


def _fixup_checkpoint(
    root: "str | Path | CheckpointSource",
    engines: str | list[str] | None,
    dry_run: bool,
    command: str | None,
    mtp_from: str | Path | None,
    recipe: str | None,
    quiet: bool,
) -> FixupResult:
    check_engine_items(engines)
    command = recorded_command(command)
    ckpt = Checkpoint.open(root)
    dry_run = dry_run or ckpt.source.local_root is None
    profiles = [sel.profile for sel in select(engines, layout_of(ckpt.config).family)]
    _check_exclude_form(ckpt)
    record = None if dry_run else load_fixups_record(ckpt.root)
    injected, note = _maybe_inject(ckpt, mtp_from, recipe, dry_run, quiet)
    if injected and not dry_run:
        ckpt = Checkpoint.open(ckpt.root)  # the injection rewrote the index and config.json
    loaded, _, index_warnings, _ = load_checkpoint(ckpt)
    result = FixupResult(loaded.ckpt.label, [p.name for p in profiles], dry_run=dry_run)
    if note:
        result.warnings.append(note)
    if injected:
        result.applied.append(injected)
        if not dry_run:
            assert record is not None  # read above unless dry_run
            record_fixups(loaded.ckpt.root, record, [injected], result.engines, command)
    config = loaded.ckpt.config
    qc = loaded.ckpt.quantization_config
    index_fix = _total_size_fix(loaded, index_warnings)
    new_config = None
    if qc is None:
        result.warnings.append("no quantization_config: every engine loads this checkpoint as bf16; nothing to fix")
    else:
        fixed_qc, applied, aliases, layer_aliases, warnings = fixed_quantization_config(
            loaded, profiles, qc, where=loaded.ckpt.source.where("config.json")
        )
        result.applied += applied + aliases + layer_aliases
        result.warnings += warnings
        found, _ = loadability_problems(loaded, profiles, fixed_qc)
        result.remaining = [p for p in found if not p.server_flag]
        needs: dict[tuple[str, str], list[str]] = {}
        for p in found:
            if p.server_flag:
                # a problem that a serving flag avoids is an engine check's, which names its engine
                needs.setdefault((p.server_flag, p.subject), []).append(str(p.engine))
        result.warnings += [
            f"{', '.join(who)}: serve with {flag} ({subject}: no exclude entry avoids it there)"
            for (flag, subject), who in needs.items()
        ]
        if dry_run and injected:
            result.remaining = [p for p in result.remaining if p.check != "mtp"]
        if applied or aliases or layer_aliases:
            new_config = result.new_config = {**config, "quantization_config": fixed_qc}
            old_text, new_text = (json.dumps(c, indent=2) + "\n" for c in (config, new_config))
            result.diff = "".join(
                difflib.unified_diff(
                    old_text.splitlines(True), new_text.splitlines(True), "a/config.json", "b/config.json"
                )
            )
    if index_fix:
        result.applied.append(index_fix)
    if dry_run or not (new_config or index_fix):
        return result
    root = loaded.ckpt.root
    if new_config:
        keep_original(root, "config.json")
    if index_fix:
        keep_original(root, INDEX_NAME)
    # The record next: a kill between the writes leaves fixups recorded but not yet applied, which the
    # rerun applies (and records once); never changes on disk that no record mentions.
    assert record is not None  # read above unless dry_run
    record_fixups(root, record, [a for a in result.applied if a["fixup"] != "mtp_inject"], result.engines, command)
    if new_config:
        write_json_atomic(root / "config.json", new_config)
    if index_fix:
        index = load_json(root / INDEX_NAME, "index")
        index.setdefault("metadata", {})["total_size"] = index_fix["now"]
        write_json_atomic(root / INDEX_NAME, index)
    return result


def _total_size_fix(loaded: LoadedCheckpoint, index_warnings: list) -> dict | None:
    """The index's total_size repair, when it disagrees with the tensors (no engine reads it)."""
    if not any(w.subject == TOTAL_SIZE for w in index_warnings):
        return None
    total = sum(i.nbytes for i in loaded.infos.values())
    return {
        "fixup": "index_total_size",
        "entry": TOTAL_SIZE,
        "was": loaded.ckpt.index_metadata.get("total_size"),
        "now": total,
        "engines": [],
        "why": "total_size counts tensor bytes (Hugging Face's rule); no engine reads it",
    }


def _check_exclude_form(ckpt: Checkpoint) -> None:
    """Refuse to edit an `exclude` that is not a list of strings (before anything is written).

    Raises:
        ConfigError: a malformed `exclude`.
    """
    raw = (ckpt.quantization_config or {}).get("exclude", [])
    if not isinstance(raw, list) or not all(isinstance(e, str) for e in raw):
        raise ConfigError(
            f"{ckpt.source.where('config.json')}: quantization_config.exclude is not a list of module names; "
            "fix it by hand (see mxforge validate) before running fixup",
            filename="config.json",
        )


def _maybe_inject(
    ckpt: Checkpoint, mtp_from, recipe: str | None, dry_run: bool, quiet: bool
) -> tuple[dict | None, str | None]:
    """Re-inject the MTP layer from `mtp_from` when the checkpoint lacks it: (record, note)."""
    if mtp_from is None:
        return None, None
    from mxforge.fixups.mtp_inject import held_mtp_layers, inject_mtp, plan_mtp_injection
    from mxforge.quantize.recipe import load_recipe

    layers = held_mtp_layers(ckpt.weight_map, layout_of(ckpt.config))
    if layers:
        return None, f"--mtp-from: the checkpoint already holds MTP layer(s) {layers}; nothing injected"
    if dry_run:
        plan = plan_mtp_injection(ckpt, Checkpoint.open(mtp_from), load_recipe(recipe, ckpt.config))
        return {
            "fixup": "mtp_inject",
            "layers": plan.layers,
            "source": str(mtp_from),
            "quantized": len(plan.quantize),
            "why": "the export shipped without its MTP layer (dry run: not written)",
        }, None
    return inject_mtp(ckpt, mtp_from, recipe, quiet=quiet), None


def load_fixups_record(root: Path) -> dict:
    """The existing mxforge_fixups.json, or a fresh record when there is none.

    Read before anything is written, so that a damaged record stops the run before config.json changes.

    Raises:
        CheckpointError: the record exists but is not valid JSON or not a fixup record.
    """
    return read_fixups_record(LocalDir(root))


def add_to_record(record: dict, applied: list[dict], engines: list[str], command: str | None) -> dict:
    """`record` (from read_fixups_record) with one more run that applied `applied`; each fixup listed once."""
    record["fixups"] += [a for a in applied if a not in record["fixups"]]  # a rerun after a kill: recorded once
    record["runs"].append({"command": command, "engines": engines, "applied": len(applied)})
    record.update({"engines": engines, "config_backup": CONFIG_BACKUP_NAME, "command": command})
    return record


def record_fixups(root: Path, record: dict, applied: list[dict], engines: list[str], command: str | None) -> None:
    """Append what was applied to `record` (from load_fixups_record) and write it as mxforge_fixups.json
    (beside config.json, never inside quantization_config).

    Raises:
        CheckpointError: the record cannot be written.
    """
    write_json_atomic(root / FIXUPS_NAME, add_to_record(record, applied, engines, command))
