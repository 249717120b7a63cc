"""Scale rules: how the E8M0 exponent of each block of an MX format is chosen. One place, as data.

Every rule starts from Quark 0.13's exponent (mxforge/formats/mxfp4/numerics.py documents it) and lists the
exponent offsets it tries, in order of preference. With one candidate the block gets Quark's exponent: bit for
bit what Quark writes. With several, each candidate's squared reconstruction error over the block is computed
(the elements rounded exactly as Quark rounds them for that scale) and the smallest wins; a tie keeps the
earlier candidate, so Quark's exponent wins every tie. Offsets that would leave the byte range [1, 254]
are skipped. The on-disk format is the same for every rule: only which exponent a block gets differs.

The block error is summed in float32 in a fixed order that all three kernels (C, numba, torch) follow
exactly, so every kernel picks the same exponent: element i goes to lane i % 8 (each lane summed in
element order), then the lanes are combined as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). A format's kernels take a
rule's offsets where its entry says so (`ElementFormat.scale_rules`: MXFP4's do).
"""

from __future__ import annotations

from dataclasses import dataclass

from mxforge.errors import ConfigError

DEFAULT_SCALE_RULE = "quark"


@dataclass(frozen=True)
class ScaleRule:
    name: str
    offsets: tuple[int, ...]  # exponent offsets from Quark's, tried in order; ties keep the earlier one
    description: str

    @property
    def is_quark(self) -> bool:
        return self.offsets == (0,)


SCALE_RULES = {
    r.name: r
    for r in (
        ScaleRule("quark", (0,), "Quark 0.13's exponent (\"even\" mode): bit-identical to Quark's output"),
        ScaleRule(
            "mse",
            (0, 1, -1),
            "per block, the exponent among Quark's, one above and one below with the smallest "
            "squared reconstruction error (ties keep Quark's)",
        ),
    )
}


def get_scale_rule(name: str | None) -> ScaleRule:
    """The rule called `name` (None: the default).

    Raises:
        ConfigError: an unknown name, listing the known ones.
    """
    rule = SCALE_RULES.get(name or DEFAULT_SCALE_RULE)
    if rule is None:
        raise ConfigError(f"scale rule {name!r} is not known; choose one of {sorted(SCALE_RULES)}", entry=name)
    return rule
