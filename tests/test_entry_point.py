"""The `mxforge` command as a user starts it, in its own process: one test per exit path (0 done, 1 validation
found problems, 2 could not run; 130, Ctrl-C, is tests/hub/test_hostile.py's) and per command's argument
parsing. Every other test runs the CLI in-process (helpers.cli) or calls the library; this file proves that
in-process runs and the entry point say the same."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest
from helpers import AMD, cli, one_error_line, run_cli
from quark_like import write_quark_like

from mxforge.cli.main import COMMANDS


@pytest.fixture(scope="module")
def export(tiny_ckpt, tmp_path_factory):
    """A Quark-style export with AMD's exclusions: old sglang releases cannot load its MTP draft."""
    out = tmp_path_factory.mktemp("entry") / "q"
    write_quark_like(tiny_ckpt, out, AMD)
    return out


def test_exit_0_done(tiny_ckpt):
    proc = run_cli("validate", str(tiny_ckpt))
    assert proc.returncode == 0 and "OK" in proc.stdout and not proc.stderr, proc.stdout + proc.stderr
    assert (proc.stdout, proc.stderr) == (cli("validate", str(tiny_ckpt)).stdout, "")


def test_exit_1_validation_found_problems(export):
    proc = run_cli("validate", str(export))
    assert proc.returncode == 1 and "FAILS: sglang 0.5.9-0.5.10.post1 (" in proc.stdout and not proc.stderr, proc.stderr
    same = cli("validate", str(export))
    assert (same.returncode, same.stdout, same.stderr) == (1, proc.stdout, "")


def test_exit_2_could_not_run_is_one_line(tmp_path):
    proc = run_cli("inspect", str(tmp_path))
    line = one_error_line(proc)
    assert line.startswith("mxforge inspect: error: ") and "no config.json" in line and str(tmp_path) in line
    assert proc.stderr == line + "\n" and not proc.stdout
    same = cli("inspect", str(tmp_path))
    assert (same.returncode, same.stdout, same.stderr) == (2, "", proc.stderr)


def test_console_script_is_the_same_command(tiny_ckpt):
    """The installed `mxforge` script (pyproject's [project.scripts]) runs mxforge.cli.main:main."""
    script = os.path.join(os.path.dirname(sys.executable), "mxforge")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("mxforge "), proc.stderr
    assert cli("--version").stdout == proc.stdout


@pytest.mark.parametrize("command", list(COMMANDS))
def test_argument_parsing(command):
    """Each command's parser, in the real process: a missing argument is a usage error (exit 2, argparse's
    lines, no traceback); --help exits 0."""
    proc = run_cli(command)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"usage: mxforge {command} "), proc.stderr
    assert "the following arguments are required" in proc.stderr
    same = cli(command)
    assert (same.returncode, same.stderr) == (2, proc.stderr)
    assert cli(command, "--help").returncode == 0


def _process_state() -> dict:
    """What a CLI run could leave behind in the process that ran it."""
    from tqdm import tqdm

    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    return {
        "environ": dict(os.environ),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "signals": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)},
        "log handlers": {lg.name: list(lg.handlers) for lg in loggers},
        "log levels": {lg.name: lg.level for lg in loggers},
        "progress bars": len(getattr(tqdm, "_instances", ())),
        "stdio": (sys.stdout, sys.stderr),
    }


@pytest.mark.quark
def test_in_process_cli_leaves_nothing_behind(tiny_ckpt, tmp_path):
    """helpers.cli runs one command after another in the test process: a run (with its progress bars, a worker
    pool, its environment) leaves the next one the process it found."""
    cache = {"MXFORGE_CACHE": str(tmp_path / "cache")}

    def commands(n: int) -> None:
        out = tmp_path / f"out{n}"
        assert (
            cli("quantize", str(tiny_ckpt), str(out), "--json", str(tmp_path / f"q{n}.json"), env=cache).returncode == 0
        )
        assert cli("fixup", str(out), "--quiet").returncode == 0
        assert cli("validate", str(out), env=cache).returncode == 0
        assert cli("inspect", str(tmp_path / "nope")).returncode == 2

    commands(0)  # first imports (Quark's logger, numba's caches) happen once per process
    before = _process_state()
    commands(1)
    assert _process_state() == before
    assert (tmp_path / "out1" / "config.json").read_bytes() == (tmp_path / "out0" / "config.json").read_bytes()
