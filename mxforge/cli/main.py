"""The `mxforge` command: one subcommand per pipeline stage.

Each subcommand is one `Command` entry (cli/support.py): its --help prose, positionals, own options, the
shared options it takes, and `run`, which does the work and returns the exit code. The stages' entries live
in cli/hub.py, cli/quantize.py, cli/fixup.py and cli/validate.py, the others here; COMMANDS lists them all.
Exit codes: 0 done, 1 validation found problems, 2 could not run: expected failures (MxforgeError) and
every operating-system failure (read-only or full disk, permissions, names too long) print one line to
stderr, with no traceback; 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import sys

from mxforge import __version__
from mxforge.cli import fixup as fixups_cli
from mxforge.cli import hub as hub_cli
from mxforge.cli import quantize as quantize_cli
from mxforge.cli import validate as validation_cli
from mxforge.cli.support import (  # noqa: F401 (EXIT_* re-exported)
    CKPT_OR_REPO,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PROBLEMS,
    Command,
    HelpFormatter,
    add_engines_option,
    add_recipe_option,
    emit,
    emit_error,
    emit_exit,
    engines_arg,
    exit_codes_help,
    hub_limits,
    invocation,
    open_checkpoint_arg,
    require_at_least,
)
from mxforge.errors import MxforgeError
from mxforge.formats import FORMATS, format_named


# --- fixture ---------------------------------------------------------------------------------------
def fixture_options(p: argparse.ArgumentParser) -> None:
    from mxforge.models import DEFAULT_FAMILY, FAMILIES

    p.add_argument("--preset", choices=("tiny", "bench", "full-layout"), default="tiny", help="the size (default tiny)")
    p.add_argument(
        "--family",
        choices=[f.name for f in FAMILIES],
        default=DEFAULT_FAMILY.name,
        help="model family: "
        + "; ".join(f"{f.name} ({f.title})" for f in FAMILIES)
        + f" (default {DEFAULT_FAMILY.name})",
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp8"),
        default="bf16",
        help="bf16 (default), or fp8: the layout of the family's official FP8 release, the same bf16 content "
        "as F8_E4M3 weights with their scales and the release's quantization_config (DeepSeek-V3/V3.2, GLM-5.x: "
        "F32 128x128 block scales `weight_scale_inv`; GLM-4.5: compressed-tensors, per-channel `weight_scale` "
        "and a static `input_scale`)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights are deterministic for a seed (default 0)")
    p.add_argument(
        "--gib",
        type=float,
        default=None,
        help="bench only: approximate size in GiB of the bf16 layout (default 2; FP8 is about 0.6x)",
    )


def run_fixture(args) -> int:
    from mxforge.models.fixture import write_fixture

    if args.gib is not None and args.gib <= 0:
        raise MxforgeError(f"--gib must be positive, got {args.gib}", entry="--gib")
    result = write_fixture(
        args.out,
        args.preset,
        seed=args.seed,
        gib=args.gib,
        quiet=args.quiet,
        family=args.family,
        precision=args.precision,
    )
    return emit_exit(
        result.as_dict(),
        args.json,
        f"wrote {result.family} {result.precision} {result.preset} fixture to {result.out}: "
        f"{result.tensors:,} tensors, {result.shards} shards, total_size {result.total_size:,} bytes "
        f"(seed {result.seed})",
    )


FIXTURE = Command(
    "fixture",
    help="write a model family's bf16 or FP8 checkpoint (tests, benchmarks, demos)",
    description="Write a checkpoint of a model family (--family) laid out like its real one, in bf16 or "
    "(--precision fp8) as the family's FP8 release stores it. Presets, per family "
    "(manifests/models/<manifest>.fixtures.toml, named by the family's manifest, not by its --family name): "
    "tiny (seconds, a few MB, every layer kind and the MTP layer); bench (real expert shapes, "
    "--gib sets the size); full-layout (the real model's every tensor and shard, e.g. GLM-5.2's "
    "59,585 tensors in 282 shards, 1.5 TB apparent, as sparse files: real headers, but every "
    "weight reads as zeros; for metadata stages only).",
    positionals=(("out", "output directory (created; must be empty or absent)"),),
    options=fixture_options,
    quiet="no progress bar",
    run=run_fixture,
)


# --- inspect ---------------------------------------------------------------------------------------
def run_inspect(args) -> int:
    from mxforge.validation.inspect import format_inspect, inspect_checkpoint

    report = inspect_checkpoint(open_checkpoint_arg(args))
    return emit_exit(report, args.json, format_inspect(report))


INSPECT = Command(
    "inspect",
    help="summarize a checkpoint: tensor kinds, dtypes, layers, MTP, quantization_config",
    description="Summarize a checkpoint from its headers alone (no tensor data is read).",
    positionals=(CKPT_OR_REPO,),
    remote=True,
    run=run_inspect,
)


# --- dequantize ------------------------------------------------------------------------------------
def run_dequantize(args) -> int:
    from mxforge.quantize.dequantize import dequantize_checkpoint

    r = dequantize_checkpoint(
        args.ckpt, args.out, quiet=args.quiet, command=invocation(), follow_symlinks=args.follow_symlinks
    )
    for warning in r["warnings"]:
        print(f"mxforge dequantize: warning: {warning}", file=sys.stderr)
    return emit_exit(
        r,
        args.json,
        f"dequantized {r['source']} -> {r['out']}: {r['dequantized']:,} weights to bf16 ("
        + ", ".join(f"{n:,} {format_named(f).title}" for f, n in r["by_format"].items())
        + "), "
        f"{r['copied']:,} tensors copied, {r['shards']} shards; {r['bytes_out'] / 1e9:.2f} GB written in "
        f"{r['seconds']:.1f} s",
    )


DEQUANTIZE = Command(
    "dequantize",
    help="a quantized checkpoint (any element format, mixed) back to bf16 (streaming), for evaluation and debugging",
    description="Write OUT as the bf16 checkpoint that CKPT's quantized weights encode: each "
    + "; ".join(f"{f.title}: {f.codes_label} X.weight with its X.weight{f.scale_suffix}" for f in FORMATS)
    + " becomes a bf16 X.weight (exactly the encoded values; where formats are stored alike, each module's is the "
    "one its quantization_config layer config names); every "
    "other tensor is copied byte for byte; config.json loses its quantization_config. Streaming "
    "(bounded memory), each file written under a temporary name and renamed when whole.",
    positionals=(
        ("ckpt", "quantized checkpoint directory (e.g. mxforge quantize's OUT)"),
        ("out", "output directory: new, empty, or an earlier dequantize output (redone)"),
    ),
    quiet="no progress bar",
    follow_symlinks="CKPT",
    run=run_dequantize,
)


# --- run -------------------------------------------------------------------------------------------
def run_options(p: argparse.ArgumentParser) -> None:
    add_recipe_option(p)
    quantize_cli.add_scale_rule_option(p)
    add_engines_option(p)
    p.add_argument("--push", metavar="REPO_ID", default=None, help="push the validated checkpoint to this Hub repo")
    p.add_argument("--private", action="store_true", help="with --push: create the repo private")
    p.add_argument("--revision", default="main", help="revision of SOURCE when it is a Hub repo (default main)")
    p.add_argument("--workers", type=int, default=None, help="quantize worker processes (default: one per core)")
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="per shard: download, quantize, pre-upload the output shard's blob, delete the bf16 shard, with "
        "the stages overlapped; disk holds the output plus a few bf16 shards. Default: streamed when SOURCE is "
        "a Hub repo and the disk cannot hold the source and the output at once (the choice is reported)",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        default=None,
        metavar="N",
        help="with --stream: bf16 shards on disk at once (default: workers + 1)",
    )
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="ray: every shard a Ray task that downloads, quantizes and pre-uploads it on its node; the "
        "driver validates and commits once (needs mxforge[ray]; OUT must be visible to every node)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --executor ray: the cluster to join (e.g. ray://head:10001 or auto; default: start a "
        "local Ray with --workers CPUs)",
    )


def run_run(args) -> int:
    from mxforge.errors import ValidationFailed
    from mxforge.records import fields_of
    from mxforge.run.pipeline import Pipeline, RunOptions, format_run_summary

    same_names = ("source", "out", "recipe", "scale_rule", "revision", "private", "workers", "quiet")
    opts = RunOptions(
        **fields_of(args, *same_names, "follow_symlinks", "stream", "in_flight", "executor", "ray_address"),
        engines=engines_arg(args),
        push_repo=args.push,
        command=invocation(),
        hub_limits=hub_limits(args),
    )
    require_at_least(args.in_flight, 1, "--in-flight")
    pipeline = Pipeline(opts)
    try:
        report = pipeline.run()
    except ValidationFailed as e:
        emit(pipeline.report().as_dict(), args.json, format_run_summary(pipeline.report()))
        print(f"mxforge run: {e}", file=sys.stderr)
        return EXIT_PROBLEMS
    return emit_exit(report.as_dict(), args.json, format_run_summary(report))


RUN = Command(
    "run",
    help="the whole pipeline: download, quantize, fixup, validate, push; resumable",
    description="Run download (when SOURCE is a Hub repo id), quantize, fixup, validate and, with "
    "--push, push. OUT/bf16 holds the download, OUT/mxfp4 the product, OUT/mxforge_run.json the state: "
    "rerun the same command after a crash to continue at the first incomplete stage (and inside "
    "quantize, at the first incomplete shard). "
    + exit_codes_help(problems="validation found problems (nothing pushed)"),
    positionals=(
        ("source", "Hub repo id (owner/name) or a local bf16 or FP8 checkpoint directory"),
        ("out", "working directory (created; rerun with the same one to resume)"),
    ),
    options=run_options,
    quiet="no progress bars",
    follow_symlinks="a local SOURCE",
    hub=True,
    run=run_run,
)

# Every subcommand, in the order mxforge --help lists them.
COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        FIXTURE,
        INSPECT,
        hub_cli.DOWNLOAD,
        quantize_cli.QUANTIZE,
        DEQUANTIZE,
        fixups_cli.FIXUP,
        validation_cli.VALIDATE,
        hub_cli.PUSH,
        RUN,
    )
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxforge",
        description="bf16 MoE checkpoints to MXFP4 that load in sglang and vLLM, MTP intact.",
        epilog=exit_codes_help(problems="validation found problems (validate, fixup, run)"),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mxforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.register(sub)
    return parser


# What to do about an operating-system failure, by errno.
OS_ADVICE = {
    errno.ENOSPC: "free space or choose another directory",
    errno.EDQUOT: "free space or choose another directory",
    errno.EROFS: "the filesystem is read-only: choose another directory",
    errno.EACCES: "check the permissions, or choose another directory",
    errno.EPERM: "check the permissions, or choose another directory",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.EMFILE: "raise the open-file limit (ulimit -n)",
}


def os_error_line(e: OSError) -> str:
    """One line for an OSError: the file, the system's words, and what to do."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    advice = "fix the cause and rerun the same command"
    if e.errno is not None:
        advice = OS_ADVICE.get(e.errno, advice)
    return f"{where + ': ' if where else ''}{e.strerror or e}: {advice}"


def unknown_command(argv: list[str]) -> str | None:
    """The one-line error for a command name that is not one (with the closest commands), or None."""
    name = next((a for a in argv if not a.startswith("-")), None)
    if name is None or name in COMMANDS:
        return None
    close = difflib.get_close_matches(name, COMMANDS, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"choose from {', '.join(COMMANDS)}"
    return f"mxforge: error: {name!r} is not a command; {hint} (mxforge --help describes each)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    unknown = unknown_command(argv)
    if unknown:
        print(unknown, file=sys.stderr)
        return EXIT_ERROR
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except MxforgeError as e:
        print(f"mxforge {args.command}: error: {e}", file=sys.stderr)
        emit_error(e, getattr(args, "json", None), args.command)
        return EXIT_ERROR
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return EXIT_OK
    except OSError as e:
        print(f"mxforge {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(
            f"mxforge {args.command}: interrupted; partial files are kept: rerun the same command to resume",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        # Download threads may sit in a socket read until their timeout: do not wait for them. What they
        # wrote is a prefix of the file, which the rerun continues.
        os._exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
