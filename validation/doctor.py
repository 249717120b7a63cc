"""Plain-words diagnosis of checkpoints made elsewhere: what kind of export this is, and what it means."""

from __future__ import annotations

from typing import Mapping

from mxforge.models import MoeLayout
from mxforge.safetensors_io import TensorInfo
from mxforge.validation.config_checks import exclude_entries
from mxforge.validation.matching import is_glob
from mxforge.validation.modules import LayerLinears
from mxforge.validation.tensor_forms import BF16, Stored, form_title


def diagnose(
    layout: MoeLayout,
    linears: dict[int | None, LayerLinears],
    stored: Mapping[str, Stored],
    infos: Mapping[str, TensorInfo],
    qc: Mapping | None,
) -> list[str]:
    """Sentences describing the export: exclude style (exact / glob / regex) and the MTP layer's state."""
    notes = []
    if qc is None:
        notes.append("no quantization_config: every engine loads this checkpoint unquantized (bf16)")
    else:
        entries = exclude_entries(qc)
        globs = [e for e in entries if is_glob(e)]
        regexes = [e for e in entries if e.startswith("re:")]
        exact = len(entries) - len(globs) - len(regexes)
        if globs:
            notes.append(
                f"exclude holds {len(globs)} glob entr{'y' if len(globs) == 1 else 'ies'} ({', '.join(globs[:6])}"
                f"{', ...' if len(globs) > 6 else ''}): Quark understands them, no engine does; "
                "mxforge fixup rewrites them into exact names"
            )
        if exact:
            notes.append(f"exclude lists {exact} exact module name(s) (the form Quark writes on export)")
        if regexes:
            notes.append(f"exclude holds {len(regexes)} 're:' regex entr{'y' if len(regexes) == 1 else 'ies'}")
        if any(".shared_experts" in e for e in entries):
            notes.append(
                "exclude names shared experts: sglang and vLLM then run them unfused from the routed experts "
                "(a speed cost, not an error)"
            )
    for layer in layout.mtp_layers:
        prefix = f"model.layers.{layer}."
        group = linears[layer]
        omitted = sorted(n for n in layout.omittable() if n.startswith(prefix) and n not in infos)
        forms = [
            stored[lin.name].form
            for lin in (*group.experts, *group.others.values())
            if lin.name + ".weight" not in omitted
        ]
        if all(f is None for f in forms):
            notes.append(
                f"MTP layer {layer} is missing: the export ships no {prefix}* tensors, so MTP cannot be used; "
                "re-inject it with mxforge fixup --mtp-from BF16_SRC --recipe RECIPE"
            )
        elif forms and all(f == BF16 for f in forms):
            notes.append(f"MTP layer {layer} is entirely bf16 ({len(forms)} linear weights)")
        else:
            quantized = ", ".join(
                f"{forms.count(f)} linear weights {form_title(f)}"
                for f in dict.fromkeys(forms)
                if f not in (None, BF16)
            )
            notes.append(
                f"MTP layer {layer}: {quantized or '0 linear weights quantized'}, {forms.count(BF16)} bf16"
                + (f", {forms.count(None)} missing" if None in forms else "")
                + (
                    f"; without its own {', '.join(n.removeprefix(prefix) for n in omitted)} (as the release ships "
                    "it: engines use the model's embedding and head)"
                    if omitted
                    else ""
                )
            )
    return notes
