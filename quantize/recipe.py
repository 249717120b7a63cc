"""Quantization recipes: which weights become MXFP4, as data (manifests/recipes/*.toml), validated on load.

A recipe names a scheme and ordered rules. `[[keep]]` rules win over `[[quantize]]` rules; a weight no
rule matches is kept. A rule selects 2-D linear weights by tensor kind (`mxforge.models.tensor_kinds`: experts,
shared_experts, router, dense_mlp, attention, indexer, mtp_proj, embeddings, other), by layer scope
(`all`, `decoder` = layers 0..num_hidden_layers-1, `mtp` = the MTP layers after them, from config.json)
and optionally by `names`, regular expressions that must match the whole module name. Every rule must
match something in the checkpoint it is applied to. A `[[quantize]]` rule may name the element `format` its
weights are stored in (mxforge/formats/, default "mxfp4"); rules may name different ones (mixed precision): the
first `[[quantize]]` rule's format is quantization_config's global scheme and every module stored in another is
given its scheme in Quark's `layer_quant_config` (`layer_config_patterns`). A `[[keep]]` rule keeps weights bf16
(an FP8 source's weights as the bf16 their scales make of them), or, with `format = "source"`, as the source stores
them: an FP8 source's block-FP8 weights byte for byte (mxforge/formats/fp8_block.py; Quark's
`keep_excluded_layers_as_original_model_state`), any other as it is. `scale_rule` (optional, default
"quark") names how each block's scale is chosen (scale_rules.py) in the formats whose kernels take one;
`--scale-rule` overrides it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from mxforge.bounded_re import BoundedPattern, check_pattern_count, compile_bounded
from mxforge.errors import ConfigError
from mxforge.formats import DEFAULT_FORMAT, REFUSED_FORMATS, ElementFormat, format_named
from mxforge.manifest_io import manifest_names, manifest_text
from mxforge.models import DEFAULT_FAMILY, MoeLayout, family_of
from mxforge.models.tensor_kinds import KINDS
from mxforge.quantize.scale_rules import DEFAULT_SCALE_RULE, SCALE_RULES, get_scale_rule

Decision = Literal["quantize", "keep"]
RECIPES_DIR = "recipes"  # shipped recipes: manifests/recipes/<name>.toml
DEFAULT_RECIPE = DEFAULT_FAMILY.default_recipe  # with no checkpoint to ask; else its family's default
SCHEMES = {"mxfp4": True, "w_mxfp4": False}  # scheme -> are dynamic MXFP4 activations declared?
LAYER_SCOPES = ("all", "decoder", "mtp")
TOP_KEYS = {"name", "description", "scheme", "quantize", "keep", "scale_rule"}
METADATA_KEY = "mxforge"  # quantization_config's key for what Quark's schema has no field for (Quark ignores it)
RULE_KEYS = {"kinds", "layers", "names", "format"}
KEEP_SOURCE = "source"  # a [[keep]] rule's `format`: keep the weights as the source stores them


def is_linear_weight_name(name: str) -> bool:
    """Quark file-to-file's notion of a Linear weight, by name: `X.weight`, X not a norm, not an embedding."""
    module, _, param = name.rpartition(".")
    return bool(module) and param == "weight" and not module.endswith("norm") and "embed" not in module


@dataclass(frozen=True)
class Rule:
    action: Decision
    index: int  # position among the recipe's rules of this action, for messages
    kinds: tuple[str, ...]
    layers: str
    names: tuple[BoundedPattern, ...]  # matched in bounded time (mxforge.bounded_re): a recipe may be hostile
    format: ElementFormat | None = None  # what a [[quantize]] rule stores its weights as (None for [[keep]])
    keep_source: bool = False  # a [[keep]] rule's `format = "source"`: FP8 weights stay as the source stores them

    def matches(self, tensor_name: str, layout: MoeLayout) -> bool:
        if self.kinds and layout.kind_of(tensor_name) not in self.kinds:
            return False
        layer = layout.layer_of(tensor_name)
        if self.layers == "decoder" and (layer is None or layout.is_mtp(layer)):
            return False
        if self.layers == "mtp" and (layer is None or not layout.is_mtp(layer)):
            return False
        module = tensor_name.removesuffix(".weight")
        return not self.names or any(p.fullmatch(module) for p in self.names)

    def describe(self) -> str:
        parts = [
            f"kinds={list(self.kinds)}" if self.kinds else "",
            f"layers={self.layers!r}",
            f"names={[p.pattern for p in self.names]}" if self.names else "",
            f"format={self.format.name!r}" if self.format is not None and self.format != DEFAULT_FORMAT else "",
            f"format={KEEP_SOURCE!r}" if self.keep_source else "",
        ]
        return f"[[{self.action}]] rule {self.index + 1} ({', '.join(p for p in parts if p)})"


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    scheme: str
    rules: tuple[Rule, ...]
    source: str  # where it was loaded from
    sha256: str  # of the recipe file's bytes
    scale_rule: str = DEFAULT_SCALE_RULE

    def decide(self, tensor_name: str, layout: MoeLayout) -> Decision:
        """ "quantize" or "keep" for a tensor name; non-weights, norms and embeddings are always kept.

        The caller keeps tensors that are not 2-D floating point whatever this says.
        """
        rule = self.matching_rule(tensor_name, layout)
        return "quantize" if rule is not None and rule.action == "quantize" else "keep"

    def matching_rule(self, tensor_name: str, layout: MoeLayout) -> Rule | None:
        if not is_linear_weight_name(tensor_name):
            return None
        for rule in self.rules:  # keep rules first
            if rule.matches(tensor_name, layout):
                return rule
        return None

    def check_matches(self, candidate_names: Iterable[str], layout: MoeLayout, where: str) -> None:
        """Every rule must select at least one of the 2-D weights in `candidate_names` (keep rules: at all).

        Raises:
            ConfigError: a rule that matches nothing, naming the rule and the checkpoint.
        """
        names = list(candidate_names)
        for rule in self.rules:
            if not any(rule.matches(n, layout) for n in names if is_linear_weight_name(n)):
                scope = (
                    f" (this checkpoint has no MTP layer: {layout.field_name('num_nextn_predict_layers')} is 0)"
                    if rule.layers == "mtp" and not layout.mtp_layers
                    else ""
                )
                raise ConfigError(
                    f"recipe {self.source}: {rule.describe()} matches no 2-D weight in {where}{scope}; "
                    "fix the rule or choose a recipe for this checkpoint"
                )

    @property
    def quantize_inputs(self) -> bool:
        return SCHEMES[self.scheme]

    @property
    def formats(self) -> tuple[ElementFormat, ...]:
        """The element formats its [[quantize]] rules store weights in, in rule order: the first is the global one."""
        return tuple(dict.fromkeys(r.format for r in self.rules if r.format is not None))

    @property
    def global_format(self) -> ElementFormat:
        """The format of quantization_config's global scheme: the first [[quantize]] rule's."""
        return self.formats[0]

    @property
    def format_record(self) -> str:
        """The formats as mxforge_quantize.json records them: registry names joined by '+', the global first."""
        return "+".join(f.name for f in self.formats)

    def format_of(self, tensor_name: str, layout: MoeLayout) -> ElementFormat | None:
        """The format a tensor the recipe quantizes is stored in (None: the recipe keeps it)."""
        rule = self.matching_rule(tensor_name, layout)
        return rule.format if rule is not None and rule.action == "quantize" else None

    @property
    def keeps_source_weights(self) -> bool:
        """Whether a [[keep]] rule keeps weights as the source stores them (its output differs from the same
        recipe's without it only on an FP8 source)."""
        return any(rule.keep_source for rule in self.rules)

    def keeps_source(self, tensor_name: str, layout: MoeLayout) -> bool:
        """Whether a [[keep]] rule with `format = "source"` keeps the tensor (as the source stores it)."""
        rule = self.matching_rule(tensor_name, layout)
        return rule is not None and rule.keep_source

    @property
    def scale_offsets(self) -> tuple[int, ...]:
        """The shard kernels' exponent offsets for this recipe's scale rule (scale_rules.py)."""
        return get_scale_rule(self.scale_rule).offsets

    def with_scale_rule(self, scale_rule: str | None) -> "Recipe":
        """This recipe with `--scale-rule` applied (None: the recipe's own).

        Raises:
            ConfigError: an unknown scale rule, or one the recipe's format has no kernel for.
        """
        if scale_rule is None:
            return self
        rule = get_scale_rule(scale_rule)
        _check_scale_rule(rule.name, self.formats, f"recipe {self.source}")
        return dataclasses.replace(self, scale_rule=rule.name)

    def quantization_config(
        self,
        excluded_modules: list[str],
        module_formats: dict[str, ElementFormat] | None = None,
        source_layer_configs: dict[str, dict] | None = None,
    ) -> dict:
        """`quantization_config` for config.json, built with Quark's own config objects (cached per Quark version):
        the global scheme is `global_format`'s, `exclude` the kept modules and `layer_quant_config` gives every
        module of `module_formats` (quantized module -> its format) stored in another format its scheme, and each
        module kept as the source stores it its layer config under its exact name (`source_layer_configs`, as
        Quark's keep_excluded_layers_as_original_model_state writes them: formats/quark.kept_layer_config).

        With Quark's scale rule it is exactly Quark's; another rule is recorded under METADATA_KEY (the recipe
        and the rule), a key Quark's reader and the engines ignore: the tensors' format is the same."""
        from mxforge.formats.quark import cached_layer_config, cached_quantization_config

        config = cached_quantization_config(self.global_format, sorted(excluded_modules), self.quantize_inputs)
        patterns = layer_config_patterns(module_formats or {}, self.global_format, excluded_modules)
        layer_configs = {fmt: cached_layer_config(fmt, self.quantize_inputs) for fmt in set(patterns.values())}
        config["layer_quant_config"] = {pattern: layer_configs[fmt] for pattern, fmt in patterns.items()}
        config["layer_quant_config"].update(sorted((source_layer_configs or {}).items()))
        rule = get_scale_rule(self.scale_rule)
        if not rule.is_quark:
            config[METADATA_KEY] = {
                "recipe": self.name,
                "recipe_sha256": self.sha256,
                "scale_rule": rule.name,
                "scale_rule_description": rule.description,
            }
        return config


def layer_config_patterns(
    module_formats: dict[str, ElementFormat], global_format: ElementFormat, kept: Iterable[str] = ()
) -> dict[str, ElementFormat]:
    """`layer_quant_config` keys (fnmatch patterns, Quark's and the engines' matching) for every module of
    `module_formats` not stored in `global_format`, sorted. A module's pattern is the first of these that matches no
    module stored otherwise (quantized in another format, or `kept` bf16): its name from its layer number on, the
    layer's prefix and the other numbers made `*` (`*.self_attn.q_a_proj`, which also matches the names an engine's
    MTP draft builds the layer under, `model.decoder.self_attn.q_a_proj`); its whole name with its numeric parts
    (layer, expert) made `*`; with fewer of them made `*` (the layer number kept first:
    `model.layers.78.mlp.experts.*.up_proj`), down to the exact name. A kept module is in `exclude`, which Quark and
    the engines test first, yet a pattern must not match it either: vLLM 0.30.0 re-quantizes excluded DeepSeek
    attention with the layer config that matches it, which must then be MXFP4."""
    stored: dict[str, ElementFormat | None] = {**dict.fromkeys(kept), **module_formats}
    others = [m for m, f in module_formats.items() if f != global_format]
    matched: dict[str, list[str]] = {}  # candidate pattern -> the quantized modules it matches
    out: dict[str, ElementFormat] = {}
    for module in others:
        fmt = module_formats[module]
        if any(fnmatch.fnmatchcase(module, p) and f == fmt for p, f in out.items()):
            continue  # an earlier module's pattern covers it
        parts = _glob_escaped(module).split(".")
        numeric = [i for i, p in enumerate(parts) if p.isdigit()]
        candidates = [
            ".".join("*" if i in numeric[keep:] else p for i, p in enumerate(parts)) for keep in range(len(numeric) + 1)
        ]
        if numeric:  # from the layer number on, whatever prefix the layer has in an engine's model
            tail = ["*" if i in numeric else p for i, p in enumerate(parts) if i > numeric[0]]
            candidates.insert(0, ".".join(["*", *tail]))
        for candidate in candidates:
            if candidate not in matched:
                matched[candidate] = [m for m in stored if fnmatch.fnmatchcase(m, candidate)]
            if all(stored[m] == fmt for m in matched[candidate]):
                out[candidate] = fmt
                break
    return dict(sorted(out.items()))


def _glob_escaped(name: str) -> str:
    """`name` with fnmatch's special characters made literal (a checkpoint's module names are not trusted)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def shipped_recipes() -> list[str]:
    """The names of the recipes shipped in manifests/recipes/ (what `--recipe NAME` takes), sorted."""
    return manifest_names(RECIPES_DIR, ".toml")


def load_recipe(name_or_path: str | Path | None = None, config: dict | None = None) -> Recipe:
    """Load and validate a recipe: a path to a TOML file, or the bare name of one shipped in manifests/recipes/;
    None: the default recipe of `config`'s model family (no config: of the default family).

    A value with a '/' or a .toml suffix is a path and must be an existing file; anything else is a
    shipped recipe's name. So a mistyped path never falls back to a shipped recipe of the same file name.

    Raises:
        ConfigError: not found (or a directory), malformed TOML, unknown keys, bad scheme/kind/layer scope/regex.
    """
    value = str(name_or_path or (family_of(config).default_recipe if config is not None else DEFAULT_RECIPE))
    if "/" not in value and not value.endswith(".toml"):
        try:
            raw, source = manifest_text(f"{RECIPES_DIR}/{value}.toml").encode(), f"manifests/{RECIPES_DIR}/{value}.toml"
        except ConfigError:
            raise ConfigError(
                f"recipe {value!r}: no such file manifests/{RECIPES_DIR}/{value}.toml shipped; "
                f"pass a shipped name such as {DEFAULT_RECIPE!r}, or a recipe TOML by its path (e.g. ./{value}.toml)"
            ) from None
    else:
        path = Path(value)
        if not path.is_file():
            what = "is a directory, not a recipe file" if path.is_dir() else "no such file"
            raise ConfigError(
                f"recipe {value}: {what}; pass an existing recipe TOML, or a shipped recipe by its bare "
                f"name (e.g. {DEFAULT_RECIPE!r})"
            )
        raw, source = path.read_bytes(), str(path)
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"recipe {source}: malformed TOML ({e})") from None
    return parse_recipe(data, source, hashlib.sha256(raw).hexdigest())


def parse_recipe(data: dict, source: str, sha256: str) -> Recipe:
    """Validate a parsed recipe table.

    Raises:
        ConfigError: unknown keys, bad values, bad regexes, or no quantize rule.
    """
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise ConfigError(f"recipe {source}: unknown key(s) {sorted(unknown)}; allowed: {sorted(TOP_KEYS)}")
    for key in ("name", "scheme"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ConfigError(f"recipe {source}: {key!r} must be a non-empty string", entry=key)
    if data["scheme"] not in SCHEMES:
        raise ConfigError(
            f"recipe {source}: scheme {data['scheme']!r} is not supported; choose one of {sorted(SCHEMES)}"
        )
    keep_rules, quantize_rules = _rule_list(data, "keep", source), _rule_list(data, "quantize", source)
    check_pattern_count(
        sum(len(r["names"]) for r in keep_rules + quantize_rules if isinstance(r.get("names"), list)),
        f"recipe {source}: names",
    )
    rules = [_parse_rule(r, "keep", i, source) for i, r in enumerate(keep_rules)]
    quantize = [_parse_rule(r, "quantize", i, source) for i, r in enumerate(quantize_rules)]
    if not quantize:
        raise ConfigError(f"recipe {source}: no [[quantize]] rule, so it would quantize nothing")
    rule = data.get("scale_rule", DEFAULT_SCALE_RULE)
    if rule not in SCALE_RULES:
        raise ConfigError(
            f"recipe {source}: scale_rule {rule!r} is not known; choose one of {sorted(SCALE_RULES)}",
            entry="scale_rule",
        )
    _check_scale_rule(rule, tuple(dict.fromkeys(r.format or DEFAULT_FORMAT for r in quantize)), f"recipe {source}")
    return Recipe(
        data["name"], str(data.get("description", "")), data["scheme"], tuple(rules + quantize), source, sha256, rule
    )


def _check_scale_rule(name: str, formats: tuple[ElementFormat, ...], where: str) -> None:
    """A scale rule other than Quark's needs a format whose kernels take one (it applies to those; the others are
    encoded with Quark's scale).

    Raises:
        ConfigError: none of `formats` takes it; names them and the rule.
    """
    if not get_scale_rule(name).is_quark and not any(f.scale_rules for f in formats):
        titles = " and ".join(f.title for f in formats)
        raise ConfigError(
            f"{where}: scale rule {name!r} is not available for {titles} (its kernels encode Quark's scale only); "
            f"use scale_rule 'quark' with format(s) {', '.join(repr(f.name) for f in formats)}"
        )


def _rule_list(data: dict, key: str, source: str) -> list:
    rules = data.get(key, [])
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise ConfigError(f"recipe {source}: {key!r} must be an array of tables ([[{key}]])", entry=key)
    return rules


def _parse_rule(raw: dict, action: Decision, index: int, source: str) -> Rule:
    rule = f"[[{action}]] rule {index + 1}"
    where = f"recipe {source}: {rule}"
    unknown = set(raw) - RULE_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(RULE_KEYS)}", entry=rule)
    kinds = raw.get("kinds", [])
    if not isinstance(kinds, list) or any(k not in KINDS for k in kinds):
        raise ConfigError(f"{where}: kinds {kinds!r} must be a list drawn from {list(KINDS)}", entry=rule)
    layers = raw.get("layers", "all")
    if layers not in LAYER_SCOPES:
        raise ConfigError(
            f"{where}: layers {layers!r} must be one of {list(LAYER_SCOPES)} "
            "(layer numbers come from config.json, never from the recipe)",
            entry=rule,
        )
    names = raw.get("names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}: names must be a list of regular expressions", entry=rule)
    if not kinds and not names:
        raise ConfigError(f"{where}: give kinds or names, or the rule would select every weight", entry=rule)
    compiled = []
    for pattern in names:
        try:
            compiled.append(compile_bounded(pattern, where=f"{where}: names pattern"))
        except re.error as e:
            raise ConfigError(f"{where}: names pattern {pattern!r} is not a valid regular expression ({e})") from None
    if action == "keep":
        if raw.get("format", KEEP_SOURCE) != KEEP_SOURCE:
            raise ConfigError(
                f"{where}: a [[keep]] rule's format can only be {KEEP_SOURCE!r} (keep the weights as the source "
                f"stores them, an FP8 source's FP8 included; without it they are kept bf16), not {raw['format']!r}",
                entry=rule,
            )
        return Rule(action, index, tuple(kinds), layers, tuple(compiled), keep_source="format" in raw)
    name = raw.get("format", DEFAULT_FORMAT.name)
    if not isinstance(name, str):
        raise ConfigError(f"{where}: format must be a string, the name of an element format")
    if name in REFUSED_FORMATS:
        raise ConfigError(f"{where}: format {name!r} is not written by mxforge: {REFUSED_FORMATS[name]}", entry=rule)
    try:
        fmt = format_named(name)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if fmt.kept_only:
        raise ConfigError(
            f"{where}: mxforge does not quantize to format {name!r}: {fmt.kept_only}. Keep such weights with a "
            f'[[keep]] rule and format = "{KEEP_SOURCE}"',
            entry=rule,
        )
    return Rule(action, index, tuple(kinds), layers, tuple(compiled), fmt)
