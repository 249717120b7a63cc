"""Where a family stores its layers: the one place a checkpoint's layer prefixes are spelled and parsed.

Every layer has a global index: decoder layers 0 .. num_hidden_layers-1, then the MTP ("next-n") layers
num_hidden_layers .. + num_nextn_predict_layers - 1. A family says under which names each is stored (its
family.toml's `[layers]` table): the DeepSeek-V3 lineage stores both as `model.layers.{layer}` (the MTP layer of
GLM-5.2 is `model.layers.78`); Qwen3.5 stores its text decoder under `model.language_model.layers.{layer}` and its
MTP layer k as `mtp.layers.{k}`, with the MTP block's own modules (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`)
outside its layers: `mtp_block` `mtp`, `mtp_block_modules` their names, which count as the first MTP layer's.
Everything else (embeddings, the final norm, the head, a vision tower) is global: no layer.

A name from a checkpoint is untrusted: `locate` parses it with a bounded pattern (an index of at most
INDEX_DIGITS digits) and never fails; a template from a family's data is checked by `parse_layer_names`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

INDEX_DIGITS = 6  # a layer index in a name: more digits is no layer (MoeLayout bounds the counts far below)
_COMPONENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
KEYS = ("decoder", "mtp", "mtp_block", "mtp_block_modules")


@dataclass(frozen=True)
class LayerNames:
    """A family's layer prefixes (no trailing dot). `decoder` holds `{layer}`; `mtp` holds `{layer}` (the global
    index) or `{k}` (the MTP layer's own, from 0); `mtp_block`, when not empty, prefixes `mtp_block_modules`, the
    MTP block's modules that lie outside its layers, which count as the first MTP layer's."""

    decoder: str = "model.layers.{layer}"
    mtp: str = "model.layers.{layer}"
    mtp_block: str = ""
    mtp_block_modules: tuple[str, ...] = ()
    _patterns: tuple[re.Pattern, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_patterns", (_pattern(self.decoder), _pattern(self.mtp)))

    def prefix(self, layer: int, num_hidden_layers: int) -> str:
        """The prefix of global layer `layer`, with its trailing dot."""
        if layer < num_hidden_layers:
            return self.decoder.format(layer=layer) + "."
        return self.mtp.format(layer=layer, k=layer - num_hidden_layers) + "."

    def name(self, layer: int, local: str, num_hidden_layers: int) -> str:
        """The stored name of layer-relative `local` of global layer `layer` (`locate`'s inverse)."""
        if layer == num_hidden_layers and local.split(".", 1)[0] in self.mtp_block_modules:
            return f"{self.mtp_block}.{local}"
        return self.prefix(layer, num_hidden_layers) + local

    def locate(self, name: str, num_hidden_layers: int) -> tuple[int | None, str]:
        """(global layer, layer-relative name) of tensor or module `name`; (None, name) for a global one. A name
        under the decoder's prefix past num_hidden_layers is a layer config.json does not declare: its index as
        stored where MTP layers share the decoder's names (the lineage), else no layer."""
        decoder, mtp = self._patterns
        m = mtp.match(name)
        if m:
            return int(m.group(1)) + (num_hidden_layers if "{k}" in self.mtp else 0), name[m.end() :]
        m = decoder.match(name)
        if m and int(m.group(1)) < num_hidden_layers:
            return int(m.group(1)), name[m.end() :]
        if self.mtp_block and name.startswith(self.mtp_block + "."):
            local = name[len(self.mtp_block) + 1 :]
            if local.split(".", 1)[0] in self.mtp_block_modules:
                return num_hidden_layers, local
        return None, name


def _pattern(template: str) -> re.Pattern:
    head, _, tail = template.partition("{")
    return re.compile("^" + re.escape(head) + rf"(\d{{1,{INDEX_DIGITS}}})" + re.escape(tail.partition("}")[2]) + r"\.")


LINEAGE = LayerNames()


def parse_layer_names(raw: Any, bad) -> LayerNames:
    """A family.toml `[layers]` table (absent: the lineage's `model.layers.{layer}` for both).

    Raises:
        what `bad(entry, what)` returns: naming the entry and what is wrong with it.
    """
    if raw is None:
        return LINEAGE
    if not isinstance(raw, dict):
        raise bad("layers", "must be a table (decoder, mtp, mtp_block)")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise bad(f"layers.{unknown[0]}", f"is not a layers entry (known: {', '.join(KEYS)})")
    values = {k: raw.get(k, getattr(LINEAGE, k)) for k in KEYS}
    modules = values.pop("mtp_block_modules")
    if not (
        isinstance(modules, (list, tuple)) and all(isinstance(m, str) and _COMPONENT.fullmatch(m) for m in modules)
    ):
        raise bad("layers.mtp_block_modules", f"must be a list of module names (e.g. ['fc', 'norm']), not {modules!r}")
    if bool(modules) != bool(values["mtp_block"]):
        missing, given = ("mtp_block", "mtp_block_modules") if modules else ("mtp_block_modules", "mtp_block")
        raise bad(f"layers.{missing}", f"is missing: it goes with layers.{given}")
    allowed = {"decoder": ("{layer}",), "mtp": ("{layer}", "{k}"), "mtp_block": ()}
    for key, value in values.items():
        if not isinstance(value, str):
            raise bad(f"layers.{key}", f"must be a string, not {value!r}")
        if key == "mtp_block" and not value:
            continue
        parts = value.split(".")
        holes = [p for p in parts if p.startswith("{")]
        wanted = allowed[key]
        if (
            (len(holes) != (1 if wanted else 0))
            or any(h not in wanted for h in holes)
            or not all(p in wanted or _COMPONENT.fullmatch(p) for p in parts)
            or (wanted and parts[-1] not in wanted)
        ):
            shape = f"dotted names ending in {' or '.join(wanted)}" if wanted else "dotted names"
            raise bad(f"layers.{key}", f"{value!r} must be {shape} (e.g. {getattr(LINEAGE, key) or 'mtp'!r})")
    return LayerNames(**values, mtp_block_modules=tuple(modules))
