"""The `mxforge` command's own surface: --help says what is true today (recipes, defaults, exit codes), and a
mistyped command name gets one line with the closest commands."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from helpers import REPO

from mxforge.cli.main import COMMANDS, build_parser, main
from mxforge.cli.support import EXIT_ERROR, EXIT_INTERRUPTED
from mxforge.models import FAMILIES


def _help(*command: str) -> str:
    parser = build_parser()
    if command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[command[0]]
    return " ".join(parser.format_help().split())  # argparse wraps lines: compare words


def test_help_lists_every_shipped_recipe_and_each_familys_default():
    recipes = sorted(p.stem for p in (REPO / "manifests" / "recipes").glob("*.toml"))
    assert recipes == sorted({r for family in FAMILIES for r in family.recipes})  # a family's (or two's), no other
    for command in ("run", "quantize"):
        text = _help(command)
        assert all(r in text for r in recipes), (command, text)
        for family in FAMILIES:  # the default is the source family's, not GLM-5.2's for every family
            assert f"{family.default_recipe} for {family.title}" in text, (command, family.name)
    assert all(r in _help("fixup") for r in recipes)


def test_help_states_every_exit_code():
    for command in ((), ("run",), ("validate",), ("fixup",)):
        text = _help(*command)
        assert re.search(rf"\b{EXIT_INTERRUPTED} interrupted by Ctrl-C", text), command
        assert re.search(rf"\b{EXIT_ERROR} could not run", text), command


@pytest.mark.parametrize(
    "typed, said",
    [
        ("valdiate", "'valdiate' is not a command; did you mean 'validate'?"),
        ("qunatize", "did you mean 'quantize' or 'dequantize'?"),
        ("frobnicate", "choose from " + ", ".join(COMMANDS)),
    ],
)
def test_a_mistyped_command_gets_one_line_with_the_closest_commands(typed, said, capsys):
    assert main([typed, "some/dir"]) == EXIT_ERROR
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith("mxforge: error: ") and said in line and captured.out == ""


def test_every_command_is_one_entry_with_the_shared_options_last():
    """A subcommand is one Command entry: its name is its key, and its parser ends with the shared options
    (--json last, which every stage has)."""
    from mxforge.cli.support import Command

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)
    for name, command in COMMANDS.items():
        assert isinstance(command, Command) and command.name == name
        assert sub.choices[name]._actions[-1].option_strings == ["--json"], name


@pytest.mark.parametrize(
    "argv, line",
    [
        (["download", "owner/name", "{tmp}/d", "--workers", "0"], "--workers must be at least 1, got 0"),
        (["push", "{tmp}/ckpt", "me/x", "--workers", "-1"], "--workers must be at least 1, got -1"),
        (["run", "owner/name", "{tmp}/out", "--in-flight", "0"], "--in-flight must be at least 1, got 0"),
        (["fixture", "{tmp}/f", "--gib", "0"], "--gib must be positive, got 0.0"),
    ],
)
def test_an_out_of_range_count_is_one_line_naming_the_option(argv, line, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*argv, "--json", str(tmp_path / "report.json")]) == EXIT_ERROR
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"mxforge {argv[0]}: error: {line}"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["stage"], report["exit_code"], report["entry"]) == (argv[0], EXIT_ERROR, line.split()[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # nothing else written
