#!/usr/bin/env python
"""Write docs/reference.md from the data it describes: the engine profiles (manifests/engines/), the model families
(mxforge.models.FAMILIES, manifests/models/), the recipes (manifests/recipes/) and the format registries (recipe
schemes, scale rules, FP8 source layouts, MXFP4's element format).

    .venv/bin/python scripts/gen_reference.py           # rewrite docs/reference.md
    .venv/bin/python scripts/gen_reference.py --check   # exit 1 (and say so) when docs/reference.md is stale

tests/test_docs.py regenerates the page and compares, so the page cannot drift from the manifests.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from mxforge.formats import FORMATS, format_named
from mxforge.formats.element import DTYPE_LABELS
from mxforge.models import FAMILIES, Family
from mxforge.models.tensor_kinds import KINDS
from mxforge.quantize.fp8_source import FP8_SCHEMES
from mxforge.quantize.recipe import LAYER_SCOPES, SCHEMES, load_recipe, shipped_recipes
from mxforge.quantize.scale_rules import DEFAULT_SCALE_RULE, SCALE_RULES
from mxforge.validation.profiles import EngineProfile, load_profile, profile_names, unsupported_reason

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"
GENERATOR = "scripts/gen_reference.py"
# validation.profiles.VETOES in words (a veto added there without words here stops the generator).
VETO_WORDS = {
    "none": "nothing",
    "shared-expert-entry": "any excluded shared-expert entry",
    "shared-expert-entry-outside-draft": "an excluded shared-expert entry outside the MTP layer",
}


def _cell(value: object) -> str:
    """A table cell: pipes escaped, never empty."""
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if text else "-"


def _code(value: object) -> str:
    return f"`{value}`" if str(value) else "-"


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _collapsed(rows: list[list[object]]) -> list[list[object]]:
    """Consecutive rows that agree past their first cell (the profile) become one row naming every profile."""
    out: list[list[object]] = []
    for row in rows:
        if out and out[-1][1:] == row[1:]:
            out[-1][0] = f"{out[-1][0]}, {row[0]}"
        else:
            out.append(list(row))
    return out


def _releases(p: EngineProfile) -> str:
    """A profile's specifier set, lower bound first (SpecifierSet's own str sorts them as text)."""
    specs = sorted(p.releases, key=lambda s: (s.operator not in (">=", ">", "=="), str(s)))
    return ",".join(str(s) for s in specs)


def _release_span(family: Family) -> str:
    """The releases that build `family`, per engine, contiguous profiles merged: "sglang 0.5.9-0.5.23, vllm ..."."""
    spans: list[tuple[str, str, str, int]] = []  # engine, first, last, index of the last profile
    for index, name in enumerate(profile_names()):
        if unsupported_reason(name, family):
            continue
        p = load_profile(name, family)
        if spans and spans[-1][0] == p.engine and spans[-1][3] == index - 1:
            spans[-1] = (p.engine, spans[-1][1], p.read[-1], index)
        else:
            spans.append((p.engine, p.read[0], p.read[-1], index))
    parts: dict[str, list[str]] = {}
    for engine, first, last, _ in spans:
        parts.setdefault(engine, []).append(first if first == last else f"{first}-{last}")
    return ", ".join(f"{engine} {', '.join(ranges)}" for engine, ranges in parts.items())


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _profiles_for(family: Family) -> list[EngineProfile]:
    return [load_profile(n, family) for n in profile_names() if not unsupported_reason(n, family)]


def _mtp_layers(family: Family) -> str:
    layout = family.layout_of(family.reference())
    return ", ".join(f"`{layout.layer_prefix(layer)[:-1]}`" for layer in layout.mtp_layers) or "none"


def _section(title: str, intro: str) -> list[str]:
    """A section's opening lines: its `##` title, then the paragraph that says what its tables hold."""
    return [f"## {title}", "", intro, ""]


def _engine_releases() -> list[str]:
    out = _section(
        "Engine releases",
        "One profile per range of releases that decide alike (`manifests/engines/<profile>.toml`; later profiles "
        "`extends` an earlier one and state only what changed). `read` lists the releases whose wheels were "
        "executed by the conformance suite; `--engines` accepts an engine, a profile name or a version "
        "specifier within these ranges, and a release outside them is refused.",
    )
    rows = []
    for name in profile_names():
        built = [load_profile(name, f) for f in FAMILIES if not unsupported_reason(name, f)]
        if not built:
            rows.append([_code(name), "", "", "", "none", ""])
            continue
        p = max(built, key=lambda b: len(b.read))  # a family built from a later release reads fewer of them
        families = ", ".join(_code(b.family) + ("" if b.read == p.read else f" (from {b.read[0]})") for b in built)
        rows.append([_code(name), p.engine, _code(_releases(p)), ", ".join(p.read), families, p.summary])
    out += _table(["profile", "engine", "releases", "read", "families built", "what changes"], rows)
    out.append("Families a profile does not build, and why:")
    out.append("")
    for name in profile_names():
        for family in FAMILIES:
            reason = unsupported_reason(name, family)
            if reason:
                out.append(f"- `{name}`, `{family.name}`: {reason}")
    out.append("")
    return out


def _families() -> list[str]:
    out = _section(
        "Model families",
        "A checkpoint's family is chosen from `config.json` (`architectures[0]`, else `model_type`); "
        "`mxforge fixture --family` takes the family name. The first recipe is the family's default.",
    )
    rows = []
    for f in FAMILIES:
        rows.append(
            [
                _code(f.name),
                f.title,
                ", ".join(_code(a) for a in f.architectures),
                _mtp_layers(f),
                ", ".join(_code(r) for r in f.recipes),
                _code(f.fp8_format) if f.fp8_format else "none known",
                _release_span(f),
            ]
        )
    out += _table(
        [
            "family",
            "models",
            "architectures",
            "MTP layer (reference config)",
            "recipes",
            "FP8 release layout",
            "engine releases",
        ],
        rows,
    )
    out.append("### Reference configs and published inventories")
    out.append("")
    rows = []
    for f in FAMILIES:
        published = ", ".join(
            f"{k} {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k} {v}" for k, v in f.published
        )
        rows.append([_code(f.name), _code(f"manifests/{f.reference_config}"), published, f.inventory_source])
    out += _table(
        ["family", "reference config", "published inventory (the full-layout fixture checks it)", "source"], rows
    )
    out.append("### Fixture presets (`mxforge fixture --preset`)")
    out.append("")
    rows = []
    for f in FAMILIES:
        for preset, settings in f.fixture_presets().items():
            rows.append([_code(f.name), _code(preset), settings.get("description", "")])
    out += _table(["family", "preset", "what it is"], rows)
    return out


def _draft_names(p: EngineProfile) -> str:
    d = p.draft
    mapper = "; ".join(f"`{a}` -> `{b}`" for a, b in d.name_mapper)
    parts = [f"block `{d.block_prefix}`", f"outer `{d.outer_prefix}`"]
    if mapper:
        parts.append(f"mapper {mapper}")
    return ", ".join(parts)


def _fusion(p: EngineProfile) -> str:
    f = p.fusion
    who = [w for w, on in (("target", f.target), ("draft", f.draft)) if on]
    if not who:
        return "never fuses"
    experts = " or ".join(str(n) for n in f.n_routed_experts)
    where = f" at {experts} routed experts" if experts else " at any expert count"
    verb = " fuses" if len(who) == 1 else " fuse"
    veto = "" if f.veto == "none" else f"; vetoed by {VETO_WORDS[f.veto]}"
    reach = "; a target's refusal reaches the draft" if f.target_refusal_reaches_draft else ""
    configs = (
        "; refused unless `layer_quant_config` gives the shared expert the routed experts' config at "
        + ", ".join(_code(b) for b in f.layer_config_bases)
        if f.layer_config_bases
        else ""
    )
    return " and ".join(who) + verb + where + veto + reach + configs


def _per_family_rules() -> list[str]:
    out = _section(
        "How each release builds each family",
        "The profile fields validate and fixup act on, per family (what they mean: "
        "[engines.md](engines.md)). *exclude read*: `raw` (quantization_config's list as written) or `mapped` "
        "(after the draft's name mapper); *MTP entries remapped*: `model.layers.N.X` entries also reach the draft "
        "under its names; *whole-draft switch*: excluding `model.layers.N` itself builds the whole draft "
        "unquantized; *fused name first*: an entry naming a fused module excludes it (else only its shards' "
        "entries decide); *expert child entries*: any `<layer>.mlp.experts.*` entry excludes the experts.",
    )
    for f in FAMILIES:
        out.append(f"### `{f.name}` ({f.title})")
        out.append("")
        rows = []
        for p in _profiles_for(f):
            rows.append(
                [
                    _code(p.name),
                    _code(p.draft.class_name),
                    _draft_names(p),
                    p.exclude_source,
                    _yes(p.draft.remap_mtp_entries),
                    _yes(p.draft.whole_draft_switch),
                    _yes(p.draft.eh_proj_quantizable),
                    _yes(p.fused_name_first),
                    ", ".join(_code(m) for m in sorted(p.packed)) or "none",
                    _yes(p.expert_child_entries),
                    _fusion(p),
                ]
            )
        out += _table(
            [
                "profiles",
                "MTP draft class",
                "draft names",
                "exclude read",
                "MTP entries remapped",
                "whole-draft switch",
                "`eh_proj` quantizable",
                "fused name first",
                "packed (decided by shards)",
                "expert child entries",
                "shared-expert fusion",
            ],
            _collapsed(rows),
        )
        rows = []
        for p in _profiles_for(f):
            fused = "; ".join(f"`{k}` = {' + '.join(v)}" for k, v in sorted(p.fused.items()))
            never = ", ".join(_code(m) for m in sorted(p.never_quantized))
            requant = ", ".join(_code(m) for m in p.requantized_when_excluded) or "none"
            formats = ", ".join(
                format_named(n).title
                + (" (with dynamic activations of it declared)" if n in p.formats_needing_inputs else "")
                + (" (emulated)" if n in p.formats_emulated else "")
                + (" (emulated in weights-only linears)" if n in p.linear_formats_emulated_without_inputs else "")
                for n in sorted(p.formats)
            )
            match = p.layer_config_match + ("; keys through the draft's name mapper" if p.layer_configs_mapped else "")
            rows.append([_code(p.name), fused, never, requant, formats or "none", match])
        out += _table(
            [
                "profiles",
                "fused modules",
                "never quantized",
                "re-quantized when excluded",
                "element formats loaded",
                "`layer_quant_config` match",
            ],
            _collapsed(rows),
        )
    return out


def _serving() -> list[str]:
    out = _section(
        "Serving commands",
        "What validate prints to serve a checkpoint with MTP speculative decoding (`{model}` and `{tp}` filled "
        "in; a release that needs it gets the fusion flag appended).",
    )
    rows = []
    for name in profile_names():
        builds = [f for f in FAMILIES if not unsupported_reason(name, f)]
        if builds:
            p = load_profile(name, builds[0])
            rows.append([_code(name), _code(p.serve_command), _code(p.fusion.server_flag)])
    return out + _table(["profiles", "command", "fusion off"], _collapsed(rows))


def _recipes() -> list[str]:
    out = _section(
        "Recipes",
        "Shipped recipes (`manifests/recipes/<name>.toml`; `--recipe NAME`, or any recipe TOML by its path). "
        "`[[keep]]` rules win over `[[quantize]]` rules; a weight no rule selects stays bf16, and so does "
        f"every tensor that is not a 2-D linear weight. Layer scopes: {', '.join(_code(s) for s in LAYER_SCOPES)}.",
    )
    default_of = {f.default_recipe for f in FAMILIES}
    family_of = {r: [f.name for f in FAMILIES if r in f.recipes] for r in shipped_recipes()}
    rows = []
    for name in shipped_recipes():
        r = load_recipe(name)

        def rules(action: str) -> str:
            return "; ".join(
                ", ".join(
                    p
                    for p in (
                        "kinds " + "+".join(rule.kinds) if rule.kinds else "",
                        f"layers {rule.layers}",
                        "names " + " ".join(f"`{n.pattern}`" for n in rule.names) if rule.names else "",
                    )
                    if p
                )
                for rule in r.rules
                if rule.action == action
            )

        families = ", ".join(_code(f) for f in family_of[name])
        default = " (default)" if name in default_of else ""
        rows.append(
            [
                _code(name),
                (families + default) if families else "-",
                r.description,
                _code(r.scheme),
                rules("quantize"),
                rules("keep") or "-",
                _code(r.scale_rule),
            ]
        )
    return out + _table(["recipe", "family", "what", "scheme", "MXFP4", "kept bf16", "scale rule"], rows)


def _formats() -> list[str]:
    out = ["## Formats", ""]
    out.append("### Element formats written (the registry, mxforge/formats/)")
    out.append("")
    rows = []
    for f in FORMATS:
        magnitudes = sorted({abs(v) for v in f.values if math.isfinite(v)})
        if len(magnitudes) <= 16:
            grid = "±{" + ", ".join(f"{v:g}" for v in magnitudes) + "}"
        else:  # an 8-bit table: its range
            grid = f"±[{magnitudes[1]:g} .. {magnitudes[-1]:g}] and 0 ({len(magnitudes)} magnitudes)"
        if any(not math.isfinite(v) for v in f.values):
            grid += f"; NaN {', '.join(f'0x{c:02X}' for c, v in enumerate(f.values) if not math.isfinite(v))}"
        scale = (
            f"{f.scale.title}: 2^(code-{f.scale.bias}); {f.scale.nan_code} = NaN"
            if f.scale.nan_code is not None
            else f"{f.scale.title}: the value itself"
        )
        per_row = "[out]" if f.block is None else f"[out, ceil(in/{f.block})]"
        rows.append(
            [
                f"{f.title} (`{f.name}`)",
                f"{f.element} ({f.element_bits} bits)",
                grid,
                "one output channel (row)"
                if f.block is None
                else f"{f.block} values along the input dimension (the last block may be shorter)",
                scale,
                f"`X.weight` {f.codes_label} [out, in*{f.element_bits}/8] + `X.weight{f.scale_suffix}` "
                f"{DTYPE_LABELS.get(f.scale.dtype, f.scale.dtype)} {per_row}",
            ]
        )
    out += _table(["format", "element", "values", "block", "scale", "stored as"], rows)
    out.append("### Recipe schemes (`scheme = ...`)")
    out.append("")
    rows = [
        [_code(s), "MXFP4", "dynamic MXFP4" if acts else "none declared (weights only)"] for s, acts in SCHEMES.items()
    ]
    out += _table(["scheme", "weights", "activations"], rows)
    out.append("### Scale rules (`--scale-rule`, recipe `scale_rule`)")
    out.append("")
    rows = []
    for r in SCALE_RULES.values():
        default = " (default)" if r.name == DEFAULT_SCALE_RULE else ""
        rows.append([_code(r.name) + default, ", ".join(f"{o:+d}" if o else "0" for o in r.offsets), r.description])
    scale = next(f.scale.title for f in FORMATS if f.scale_rules)
    out += _table(["rule", f"{scale} exponent offsets tried (from Quark's)", "what"], rows)
    out.append("### FP8 source layouts (read by `quantize` and `run`)")
    out.append("")
    rows = []
    for s in FP8_SCHEMES.values():
        rows.append(
            [
                _code(s.name),
                s.granularity,
                _code("X.weight" + s.scale_suffix),
                ", ".join(_code("X." + c) for c in s.siblings) or "-",
                s.supported,
            ]
        )
    out += _table(["layout", "one scale per", "scale tensor", "also consumed", "config.json that selects it"], rows)
    out.append("### Tensor kinds (recipe `kinds`)")
    out.append("")
    out.append(", ".join(_code(k) for k in KINDS) + ".")
    out.append("")
    rows = []
    seen: dict[tuple, list[str]] = {}
    for f in FAMILIES:
        seen.setdefault(tuple((k, p.pattern) for k, p in f.kind_rules), []).append(f.name)
    for rules, families in seen.items():
        for kind, pattern in rules:
            rows.append([", ".join(_code(n) for n in families), _code(kind), _code(pattern)])
    out.append(
        "How each family's tensor names fall into kinds (first match wins, on the name after `model.layers.N.`; "
        "anything else is `other`):"
    )
    out.append("")
    return out + _table(["families", "kind", "pattern"], rows)


def render() -> str:
    lines = [
        "# Reference: engine releases, model families, recipes and formats",
        "",
        f"Generated by `{GENERATOR}` from `manifests/` and mxforge's registries: do not edit this page by hand; "
        f"change the data, then run `.venv/bin/python {GENERATOR}`. What the terms mean: "
        "[concepts.md](concepts.md); why the engines differ: [engines.md](engines.md).",
        "",
    ]
    for section in (_engine_releases, _families, _per_family_rules, _serving, _recipes, _formats):
        lines += section()
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/reference.md instead of writing it")
    ap.add_argument("--out", type=Path, default=REFERENCE, help="where to write (default docs/reference.md)")
    args = ap.parse_args()
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run .venv/bin/python {GENERATOR}", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    tmp = args.out.with_name(args.out.name + ".partial")
    tmp.write_text(text)
    tmp.replace(args.out)
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
