"""The bench scripts can write what they measured as a docs/benchmarks.md block (`--markdown FILE`): the command
that produced the figures, then their tables, so that a figure in the docs is pasted, not retyped."""

from __future__ import annotations

import pytest
from helpers import SCRIPTS, load_script


def test_bench_markdown_block():
    md = load_script("bench_markdown")
    lines = [
        "source: 2.25 GB",
        *md.table(["contender", "seconds"], [["copy", "1.11"], ["mxforge | 2 workers", "1.89"]], align="lr"),
        "mxforge / quark: 13.4x",
    ]
    command = md.command_line(["--repeat", "5", "--markdown", "out.md", "--gib=2"], script="/x/scripts/bench_q.py")
    assert command == ".venv/bin/python scripts/bench_q.py --repeat 5 --gib=2"
    assert md.as_markdown(command, lines) == (
        "```bash\n.venv/bin/python scripts/bench_q.py --repeat 5 --gib=2\n```\n\n"
        "source: 2.25 GB\n\n"
        "| contender | seconds |\n|---|---:|\n| copy | 1.11 |\n| mxforge \\| 2 workers | 1.89 |\n\n"
        "mxforge / quark: 13.4x\n"
    )
    with pytest.raises(ValueError):
        md.table(["a", "b"], [["only one"]])


def test_write_markdown_replaces_the_file_whole(tmp_path):
    md = load_script("bench_markdown")
    out = tmp_path / "figures.md"
    out.write_text("old")
    md.write_markdown(out, ["| a |", "|---|", "| 1 |"], argv=["--markdown", str(out)])
    assert out.read_text().startswith("```bash\n.venv/bin/python scripts/")
    assert out.read_text().endswith("| a |\n|---|\n| 1 |\n")
    assert not list(tmp_path.glob("*.partial"))
    md.write_markdown(None, ["ignored"])  # no --markdown: nothing written


@pytest.mark.parametrize("script", sorted(p.stem for p in SCRIPTS.glob("bench_*.py") if p.stem != "bench_markdown"))
def test_every_bench_script_can_write_its_tables(script):
    source = (SCRIPTS / f"{script}.py").read_text()
    assert "add_markdown_option(" in source and "emit_report(args, lines" in source, (
        f"scripts/{script}.py: give it --markdown FILE (scripts/bench_markdown.py) for docs/benchmarks.md"
    )
