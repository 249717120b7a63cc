"""What the bench scripts share for `--markdown FILE`: their printed report, written as a docs/benchmarks.md block
(the command that produced it, then the tables and findings), so that a figure in the docs is pasted, not retyped.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path


def add_markdown_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the command and the report as Markdown to FILE (a block for docs/benchmarks.md)",
    )


def table(header: list[str], rows: list[list[object]], align: str = "") -> list[str]:
    """A Markdown table; `align` has one letter per column, "l" or "r" (default "l")."""
    if any(len(r) != len(header) for r in rows):
        raise ValueError("every row needs one cell per column")
    rule = ["---:" if (align[i : i + 1] == "r") else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    return lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


def command_line(argv: list[str] | None = None, script: str | None = None) -> str:
    """The command that produced a report, as the docs print it: `.venv/bin/python scripts/NAME.py ARGS`, without
    --markdown and its value (where the report was written says nothing about the figures)."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--markdown":
            skip = True
        elif not a.startswith("--markdown="):
            kept.append(a)
    name = Path(script or sys.argv[0]).name
    return shlex.join([".venv/bin/python", f"scripts/{name}", *kept])


def as_markdown(command: str, lines: list[str]) -> str:
    """The block: the command in a bash fence, then `lines`, paragraphs and tables separated by blank lines."""
    body: list[str] = []
    for line in lines:
        is_table = line.startswith("|")
        if body and body[-1] and not (is_table and body[-1].startswith("|")):
            body.append("")
        body.append(line)
    return f"```bash\n{command}\n```\n\n" + "\n".join(body).strip("\n") + "\n"


def write_markdown(path: Path | None, lines: list[str], argv: list[str] | None = None) -> None:
    """Write the block to `path` (nothing when None), through a temporary name."""
    if path is None:
        return
    text = as_markdown(command_line(argv), lines)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def emit_report(args: argparse.Namespace, lines: list[str], figures: object = None) -> None:
    """Print the report's lines, write them as a docs block to --markdown, and `figures` as JSON to --json (for
    scripts that have --json), each where given."""
    print("\n".join(lines))
    write_markdown(args.markdown, lines)
    if getattr(args, "json", None) and figures is not None:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
