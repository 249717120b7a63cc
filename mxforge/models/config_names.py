"""Where a family's config.json keeps its language model's fields, and what it calls them: the one place that
reads a text config out of a multimodal config and renames a family's fields to mxforge's.

mxforge's layouts read the DeepSeek-V3 lineage's field names at the top level of config.json (`hidden_size`,
`num_hidden_layers`, `n_routed_experts`, `num_nextn_predict_layers`...). Newer families nest the language model
under a sub-config and name some fields otherwise: Qwen3.5 MoE keeps them in `text_config`, with `num_experts` for
the routed-expert count and `mtp_num_hidden_layers` for the MTP layers. A family says so in its family.toml's
`[config]` table (`text`: the sub-config, `fields`: mxforge's name = the family's), and everything that reads or
writes those fields goes through `ConfigNames`: `view` (what a layout is built from), `updated` (a copy of
config.json with fields written back where the family keeps them) and `where` (a field as an error message names
it). Top-level entries (architectures, quantization_config, a vision tower's config) stay where they are.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Mapping

from mxforge.errors import ConfigError

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
KEYS = ("text", "fields")


@dataclass(frozen=True)
class ConfigNames:
    """`text`: the config.json entry holding the language model's fields ("": the top level); `fields`: (mxforge's
    name, the family's name) for each field the family names otherwise."""

    text: str = ""
    fields: tuple[tuple[str, str], ...] = ()

    def stored(self, field: str) -> str:
        """The family's name for mxforge's field `field`."""
        return dict(self.fields).get(field, field)

    def where(self, field: str) -> str:
        """Field `field` as config.json holds it, for messages: `text_config.mtp_num_hidden_layers`."""
        return f"{self.text}.{self.stored(field)}" if self.text else self.stored(field)

    def text_fields(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The mapping that holds the language model's fields as stored (config.json itself, or its `text`).

        Raises:
            ConfigError: `text` is absent or not an object.
        """
        if not self.text:
            return config
        sub = config.get(self.text)
        if not isinstance(sub, dict):
            what = "missing" if self.text not in config else "null" if sub is None else f"a {type(sub).__name__}"
            raise ConfigError(
                f"config.json: {self.text} is {what}; this family "
                f"keeps its language model's fields in a {self.text} object: is this the model's own config.json?",
                filename="config.json",
                entry=self.text,
            )
        return sub

    def view(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The language model's fields under mxforge's names: the top-level entries, overlaid with the text
        config's (where the family nests one), each renamed field read from the family's name only."""
        out = dict(config)
        if self.text:
            text = self.text_fields(config)
            del out[self.text]
            out.update(text)
        for ours, theirs in self.fields:
            value = out.pop(theirs, None)
            out.pop(ours, None)  # a field under mxforge's name the family does not use is not read
            if value is not None:
                out[ours] = value
        return out

    def updated(self, config: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
        """A deep copy of config.json with each of `changes` (mxforge's names) written where the family keeps it.

        Raises:
            ConfigError: the text config is absent or not an object.
        """
        out = copy.deepcopy(dict(config))
        target: dict[str, Any] = out
        if self.text:
            self.text_fields(out)  # an object, or the error
            target = out[self.text]
        for field, value in changes.items():
            target[self.stored(field)] = value
        return out


TOP_LEVEL = ConfigNames()


def parse_config_names(raw: Any, bad) -> ConfigNames:
    """A family.toml `[config]` table (absent: the lineage's top-level fields under mxforge's names).

    Raises:
        what `bad(entry, what)` returns: naming the entry and what is wrong with it.
    """
    if raw is None:
        return TOP_LEVEL
    if not isinstance(raw, dict):
        raise bad("config", "must be a table (text, fields)")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise bad(f"config.{unknown[0]}", f"is not a config entry (known: {', '.join(KEYS)})")
    text = raw.get("text", "")
    if not isinstance(text, str) or (text and not _KEY.fullmatch(text)):
        raise bad("config.text", f"must be the name of a config.json entry (e.g. 'text_config'), not {text!r}")
    fields = raw.get("fields", {})
    if not isinstance(fields, dict):
        raise bad("config.fields", "must be a table: mxforge's field name = the family's")
    for ours, theirs in fields.items():
        if not (_KEY.fullmatch(ours) and isinstance(theirs, str) and _KEY.fullmatch(theirs)):
            raise bad(f"config.fields.{ours}", f"must name a config.json field, not {theirs!r}")
    renamed = list(fields.values())
    clash = sorted({t for t in renamed if renamed.count(t) > 1} | (set(renamed) & set(fields)))
    if clash:
        raise bad("config.fields", f"names {clash[0]!r} for two fields; each field has one name")
    return ConfigNames(text=text, fields=tuple(fields.items()))
