"""The command that serves a checkpoint with MTP speculative decoding, per engine release range.

The command line is the profile's data (`[serve]`); the flags a checkpoint needs there (e.g.
`--disable-shared-experts-fusion`) come from validate's findings. The conformance suite checks that every
flag exists in each release's server arguments.
"""

from __future__ import annotations

from .profiles import Selection

TENSOR_PARALLEL = 8  # one 8-GPU node (the GLM-5.2 write-up ran on 8x MI355X)


def command_for(selection: Selection, model: str, flags: list[str]) -> str:
    base = selection.profile.serve_command.format(model=model, tp=TENSOR_PARALLEL)
    return " ".join([base, *flags])


def serving_commands(report, model: str, selections: list[Selection]) -> list[dict]:
    """Per range of consecutive releases that serve alike: whether they load the checkpoint, the flags they
    need and the command."""
    out: list[dict] = []
    for s in selections:
        flags = report.flags(s.profile.name)
        entry = {"engine": s.profile.engine, "first": s.releases[0], "last": s.releases[-1],
                 "profiles": [s.profile.name], "ok": report.engine_ok(s.profile.name), "flags": flags,
                 "command": command_for(s, model, flags)}
        prev = out[-1] if out else None
        if prev and all(prev[k] == entry[k] for k in ("engine", "ok", "flags", "command")):
            prev["last"] = entry["last"]
            prev["profiles"] += entry["profiles"]
        else:
            out.append(entry)
    for e in out:
        e["releases"] = f"{e['engine']} {e['first']}" + (f"-{e['last']}" if e["last"] != e["first"] else "")
    return out
