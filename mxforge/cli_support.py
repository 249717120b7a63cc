"""Helpers shared by every subcommand: exit codes, the --json option and report output."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="REPORT", nargs="?", const="-", default=None,
                   help="write a JSON report to REPORT ('-' or no value: stdout, replacing the human summary)")


def emit(report: dict, json_target: str | None, human: str) -> None:
    """Print the human summary, and the JSON report where asked (stdout for '-')."""
    if json_target == "-":
        print(json.dumps(report, indent=2, default=str))
        return
    print(human)
    if json_target:
        from .safetensors_io import write_json_atomic

        write_json_atomic(json_target, json.loads(json.dumps(report, default=str)))


def invocation() -> str:
    """This process's command line as `mxforge ...`, with the Hub token masked: stages record it in their
    reports, provenance files and the model card."""
    from .hub_errors import redact  # imports huggingface_hub: only when a command line is recorded

    return redact(shlex.join(["mxforge", *sys.argv[1:]]))
