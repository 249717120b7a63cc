"""Plain-words diagnosis of checkpoints made elsewhere: what kind of export this is, and what it means."""

from __future__ import annotations

from typing import Mapping

from mxforge.models import MoeLayout
from mxforge.validation.config_checks import exclude_entries
from mxforge.validation.loaded import LoadedCheckpoint
from mxforge.validation.matching import is_glob
from mxforge.validation.tensor_forms import BF16, form_title


def diagnose(loaded: LoadedCheckpoint, qc: Mapping | None) -> list[str]:
    """Sentences describing the export: exclude style (exact / glob / regex), the MTP layer's state, and layers
    stored beyond those config.json declares."""
    layout, linears, stored, infos = loaded.layout, loaded.linears, loaded.stored, loaded.infos
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
        prefix = layout.layer_prefix(layer)
        group = linears[layer]
        omitted = sorted(n for n in layout.omittable() if layout.layer_of(n) == layer and n not in infos)
        forms = [
            stored[lin.name].form
            for lin in (*group.experts, *group.others.values())
            if lin.name + ".weight" not in omitted
        ]
        unreadable = [n for n in loaded.unreadable if layout.layer_of(n) == layer]
        if unreadable and all(f is None for f in forms):
            shards = sorted({loaded.ckpt.weight_map[n] for n in unreadable})
            notes.append(
                f"MTP layer {layer} cannot be judged: its tensors are in {', '.join(shards)}, which could not be "
                "read (see the problem listed for it)"
            )
        elif all(f is None for f in forms):
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
                    f"; without its own {', '.join(layout.locate(n)[1] for n in omitted)} (as the release ships "
                    "it: engines use the model's embedding and head)"
                    if omitted
                    else ""
                )
            )
    notes += undeclared_layer_notes(layout, loaded.ckpt.weight_map)
    return notes


def undeclared_layer_notes(layout: MoeLayout, weight_map: Mapping[str, str]) -> list[str]:
    """Layers the checkpoint stores past those config.json declares (num_hidden_layers decoder layers, then
    num_nextn_predict_layers MTP layers): no engine builds them. When the first of them holds an MTP layer's own
    tensors (eh_proj, enorm, hnorm), it is an MTP layer that config.json no longer declares."""
    declared = len(layout.all_layers)
    beyond: dict[int, int] = {}
    for name in weight_map:
        layer = layout.layer_of(name)
        if layer is not None and layer >= declared:
            beyond[layer] = beyond.get(layer, 0) + 1
    if not beyond:
        return []
    layers = sorted(beyond)
    tensors = sum(beyond.values())
    nextn = layout.field_name("num_nextn_predict_layers")
    said = (
        f"{layout.field_name('num_hidden_layers')} {layout.num_hidden_layers}, {nextn} "
        f"{layout.config.get('num_nextn_predict_layers', 'absent')}"
    )
    first = layers[0]
    if first == declared and layout.stores_mtp_layer(first, weight_map):
        return [
            f"{layout.layer_prefix(first)}* holds an MTP layer ({beyond[first]} tensors, eh_proj included) that "
            f"config.json does not declare ({said}): as declared, this checkpoint has no MTP layer, no engine builds "
            "it and it serves without speculative decoding; if it is the model's MTP layer, set "
            f"{nextn} to {len(layers)} in config.json and validate again"
        ]
    return [
        f"the checkpoint stores layer(s) {layers} ({tensors} tensors) beyond the {declared} layers config.json "
        f"declares ({said}): no engine builds them"
    ]
