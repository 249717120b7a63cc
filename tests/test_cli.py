"""The `mxforge` command's own surface: --help says what is true today (recipes, defaults, exit codes), and a
mistyped command name gets one line with the closest commands."""

from __future__ import annotations

import argparse
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
    assert len(recipes) == 8
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
