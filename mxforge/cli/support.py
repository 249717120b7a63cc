"""Helpers shared by every subcommand: the Command table entry, exit codes, shared options and report output."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from typing import Callable

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but a line never breaks inside a hyphenated name (a recipe, a flag): names are copied from
    --help as they are printed."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        flat = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(flat, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


def exit_codes_help(ok: str = "done", problems: str | None = None) -> str:
    """The exit codes, for a command's --help: what 0 (and, where the command has it, 1) means for it."""
    one = f", {EXIT_PROBLEMS} {problems}" if problems else ""
    return (
        f"Exit {EXIT_OK} {ok}{one}, {EXIT_ERROR} could not run (one line on stderr says why), "
        f"{EXIT_INTERRUPTED} interrupted by Ctrl-C (rerun the same command to resume)."
    )


def recipe_help(default: str) -> str:
    """--recipe's help: every shipped recipe (from manifests/recipes/), and the default."""
    from mxforge.quantize.recipe import shipped_recipes

    return f"a shipped recipe's name ({', '.join(shipped_recipes())}) or a recipe TOML's path (default: {default})"


def default_recipes_help() -> str:
    """Each model family's default recipe, as --recipe's default is the source family's."""
    from mxforge.models import FAMILIES

    return "the source's family's own: " + "; ".join(f"{f.default_recipe} for {f.title}" for f in FAMILIES)


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        metavar="REPORT",
        nargs="?",
        const="-",
        default=None,
        help="write a JSON report to REPORT ('-' or no value: stdout, replacing the human summary)",
    )


def add_hub_options(p: argparse.ArgumentParser) -> None:
    """--timeout and --retries for commands that talk to the Hub (see hub_session.HubLimits)."""
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="longest wait for any Hub answer (default: MXFORGE_HUB_TIMEOUT, else HF_HUB_ETAG_TIMEOUT / "
        "HF_HUB_DOWNLOAD_TIMEOUT for files, 10 s each by default, and 60 s for API calls)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=None,
        metavar="N",
        help="attempts after a transient Hub failure (HTTP 5xx / 429, a dropped or silent connection), and at a "
        "file that bring no new byte, before giving up (default: MXFORGE_HUB_RETRIES, else 5)",
    )


def add_remote_options(p: argparse.ArgumentParser) -> None:
    """--revision and the Hub limits, for commands that take a Hub repo id where a checkpoint directory goes."""
    p.add_argument(
        "--revision",
        default=None,
        metavar="R",
        help="with a Hub repo id: branch, tag, commit or "
        "refs/pr/N (default main). Only config.json, the index and shard headers are fetched (ranged "
        "reads, cached by commit under $MXFORGE_CACHE or ~/.cache/mxforge)",
    )
    add_hub_options(p)


def open_checkpoint_arg(args):
    """The checkpoint an argument names: a directory, or a Hub repo id at --revision (a CheckpointSource).

    Raises:
        CheckpointError: it names `mxforge run`'s working directory instead of the checkpoint in it.
    """
    from mxforge.hub.source import open_source

    refuse_run_dir(args.ckpt, args.command)
    return open_source(args.ckpt, args.revision, hub_limits(args))


def refuse_run_dir(path: str, command: str) -> None:
    """Point at OUT/mxfp4 when CKPT is the OUT of `mxforge run` (a working directory, not a checkpoint).

    Raises:
        CheckpointError: `path` holds mxforge run's state file and no config.json.
    """
    from pathlib import Path

    from mxforge.errors import CheckpointError
    from mxforge.provenance import RUN_PRODUCT_DIR, RUN_STATE_NAME

    root = Path(path)
    if (root / RUN_STATE_NAME).is_file() and not (root / "config.json").exists():
        product = root / RUN_PRODUCT_DIR
        raise CheckpointError(
            f"{root}: an `mxforge run` working directory, not a checkpoint; its checkpoint is {product}: "
            f"pass that instead (mxforge {command} {shlex.quote(str(product))} ...)"
        )


def add_engines_option(p: argparse.ArgumentParser) -> None:
    from mxforge.validation.profiles import ENGINES_HELP

    p.add_argument("--engines", default=None, metavar="LIST", help=ENGINES_HELP)


def engines_arg(args) -> list[str] | None:
    """The --engines items (None: every supported release).

    Raises:
        ConfigError: an item names no known engine, profile or supported release.
    """
    from mxforge.validation.profiles import parse_engines_arg

    return parse_engines_arg(args.engines)


def add_follow_symlinks_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--follow-symlinks",
        action="store_true",
        help=f"read {what} through symlinks that lead outside it (default: refuse them)",
    )


@dataclass(frozen=True)
class Command:
    """One subcommand, declared once: what `mxforge --help` says of it (`help`), its own --help prose
    (`description`), its positional arguments as (name, help) pairs, `options` (adds the options only it has),
    the options stages share (see `add_shared_options`) and `run`, which does the work and returns the exit code.
    `register` builds its parser; a new command is one more entry, never a copy of a register function."""

    name: str
    help: str
    description: str
    run: Callable[[argparse.Namespace], int]
    positionals: tuple[tuple[str, str], ...] = ()
    options: Callable[[argparse.ArgumentParser], None] | None = None
    quiet: str | None = None
    follow_symlinks: str | None = None
    remote: bool = False
    hub: bool = False
    engines: bool = False

    def register(self, sub) -> argparse.ArgumentParser:
        """Add this command's parser to `sub` (an add_subparsers action): positionals, own options, shared ones."""
        p = sub.add_parser(self.name, help=self.help, description=self.description, formatter_class=HelpFormatter)
        for name, text in self.positionals:
            p.add_argument(name, help=text)
        if self.options is not None:
            self.options(p)
        add_shared_options(p, self)
        return p


# The positional argument of the commands that read a checkpoint's headers, locally or from the Hub.
CKPT_OR_REPO = ("ckpt", "checkpoint directory, or a Hub repo id (owner/name)")


def add_shared_options(p: argparse.ArgumentParser, command: Command) -> None:
    """The options stages share, last in their --help and in this order: --quiet (its help), --follow-symlinks
    (what it reads through them), --revision and the Hub limits (`remote`) or the Hub limits alone (`hub`),
    --engines, and --json, which every stage has."""
    if command.quiet is not None:
        p.add_argument("--quiet", action="store_true", help=command.quiet)
    if command.follow_symlinks is not None:
        add_follow_symlinks_option(p, command.follow_symlinks)
    if command.remote:
        add_remote_options(p)
    elif command.hub:
        add_hub_options(p)
    if command.engines:
        add_engines_option(p)
    add_json_option(p)


def add_recipe_option(p: argparse.ArgumentParser, *, when: str = "", default: str | None = None) -> None:
    """--recipe: `when` prefixes its help (the condition it applies under), `default` names what it defaults to
    (default: each family's own recipe)."""
    p.add_argument(
        "--recipe", default=None, help=when + recipe_help(default_recipes_help() if default is None else default)
    )


def require_at_least(value: int | None, least: int, option: str) -> None:
    """Refuse an integer option below `least` (None: not given) with one line naming the option.

    Raises:
        MxforgeError: `value` < `least`.
    """
    from mxforge.errors import MxforgeError

    if value is not None and value < least:
        raise MxforgeError(f"{option} must be at least {least}, got {value}", entry=option)


def hub_limits(args):
    """The HubLimits for --timeout / --retries (env and defaults where not given)."""
    from mxforge.hub.session import HubLimits

    return HubLimits.resolve(args.timeout, args.retries)


def emit_exit(report: dict, json_target: str | None, human: str, *, ok: bool = True) -> int:
    """Emit the report (as emit does) and return the exit code its verdict means: EXIT_OK, or EXIT_PROBLEMS."""
    emit(report, json_target, human)
    return EXIT_OK if ok else EXIT_PROBLEMS


def emit(report: dict, json_target: str | None, human: str) -> None:
    """Print the human summary, and the JSON report where asked (stdout for '-')."""
    if json_target != "-":
        print(human)
    if json_target:
        write_report(report, json_target)


def write_report(report: dict, json_target: str) -> None:
    """A --json report: to stdout for '-' (in place of the human summary), else to that file, atomically; values
    JSON has no type for (paths, ...) as their str."""
    if json_target == "-":
        print(json.dumps(report, indent=2, default=str))
        return
    from mxforge.safetensors_io import write_json_atomic

    write_json_atomic(json_target, json.loads(json.dumps(report, default=str)))


def emit_error(e, json_target: str | None, command: str) -> None:
    """With --json, the report of a command that could not run: {"stage", "ok": false, "exit_code": 2, "error":
    its class, "message", and the error's fields (path, shard, tensor, entry, pid, repo_id, revision, filename,
    status)}. A report that cannot be written is not a second error: the message is on stderr already."""
    if json_target is None:
        return
    from mxforge.errors import MxforgeError

    try:
        write_report({"stage": command, "ok": False, "exit_code": EXIT_ERROR, **e.as_dict()}, json_target)
    except MxforgeError:
        pass


def invocation() -> str:
    """This process's command line as `mxforge ...`, with the Hub token masked: stages record it in their
    reports, provenance files and the model card."""
    from mxforge.redaction import redact

    return redact(shlex.join(["mxforge", *sys.argv[1:]]))
