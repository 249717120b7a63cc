"""The command that serves a checkpoint, with MTP speculative decoding when it has an MTP layer, per release range.

The command line is the profile's data (`[serve]`); the flags a checkpoint needs there (e.g.
`--disable-shared-experts-fusion`) come from validate's findings. The conformance suite checks that every
flag exists in each release's server arguments.
"""

from __future__ import annotations

from mxforge.validation.profiles import Selection, release_runs

TENSOR_PARALLEL = 8  # one 8-GPU node (the GLM-5.2 write-up ran on 8x MI355X)


def command_for(selection: Selection, model: str, flags: list[str], speculative: bool = True) -> str:
    """The release's serving command for `model` with `flags`; with MTP speculative decoding unless told not."""
    p = selection.profile
    base = (p.serve_command if speculative else p.serve_base).format(model=model, tp=TENSOR_PARALLEL)
    return " ".join([base, *flags])


def serving_commands(report, model: str, selections: list[Selection], speculative: bool = True) -> list[dict]:
    """Per range of consecutive releases that serve alike: whether they load the checkpoint, the flags they
    need and the command (with MTP speculative decoding when `speculative`: the checkpoint has an MTP layer)."""

    def how(s: Selection) -> tuple[bool, list[str], str]:
        flags = report.flags(s.profile.name)
        return report.engine_ok(s.profile.name), flags, command_for(s, model, flags, speculative)

    return [
        {
            "releases": label,
            "profiles": [s.profile.name for s in group],
            "ok": ok,
            "flags": flags,
            "command": command,
            "speculative": speculative,
        }
        for label, (ok, flags, command), group in release_runs(selections, how)
    ]
