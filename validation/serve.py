"""The command that serves a checkpoint with MTP speculative decoding, per engine release range.

The command line is the profile's data (`[serve]`); the flags a checkpoint needs there (e.g.
`--disable-shared-experts-fusion`) come from validate's findings. The conformance suite checks that every
flag exists in each release's server arguments.
"""

from __future__ import annotations

from mxforge.validation.profiles import Selection, release_runs

TENSOR_PARALLEL = 8  # one 8-GPU node (the GLM-5.2 write-up ran on 8x MI355X)


def command_for(selection: Selection, model: str, flags: list[str]) -> str:
    base = selection.profile.serve_command.format(model=model, tp=TENSOR_PARALLEL)
    return " ".join([base, *flags])


def serving_commands(report, model: str, selections: list[Selection]) -> list[dict]:
    """Per range of consecutive releases that serve alike: whether they load the checkpoint, the flags they
    need and the command."""

    def how(s: Selection) -> tuple[bool, list[str], str]:
        flags = report.flags(s.profile.name)
        return report.engine_ok(s.profile.name), flags, command_for(s, model, flags)

    return [
        {"releases": label, "profiles": [s.profile.name for s in group], "ok": ok, "flags": flags, "command": command}
        for label, (ok, flags, command), group in release_runs(selections, how)
    ]
