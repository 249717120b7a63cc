"""The `mxforge` command: one subcommand per pipeline stage.

Each subcommand is a (register, run) pair: `register` adds its arguments, `run` does the work and returns
the exit code. Stage subcommands live beside their engines (hub_cli, quantize/cli, fixups/cli) and share
the helpers in cli_support.
Expected failures (MxforgeError) print one line to stderr and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from . import __version__, hub_cli
from .cli_support import EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, add_json_option, emit  # noqa: F401 (re-exported)
from .errors import MxforgeError
from .fixups import cli as fixups_cli
from .quantize import cli as quantize_cli


# --- fixture ---------------------------------------------------------------------------------------
def register_fixture(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("fixture", help="write a GLM-5.2-shaped bf16 checkpoint (tests, benchmarks, demos)",
                       description="Write a GLM-5.2-shaped bf16 checkpoint laid out like the real one. Presets: "
                       "tiny (seconds, a few MB, every layer kind and the MTP layer); bench (real expert shapes, "
                       "--gib sets the size); full-layout (all 59,585 tensors in 282 shards, 1.5 TB apparent, as "
                       "sparse files: real headers, but every weight reads as zeros; for metadata stages only).")
    p.add_argument("out", help="output directory (created; must be empty or absent)")
    p.add_argument("--preset", choices=("tiny", "bench", "full-layout"), default="tiny")
    p.add_argument("--seed", type=int, default=0, help="weights are deterministic for a seed (default 0)")
    p.add_argument("--gib", type=float, default=None, help="bench only: approximate size in GiB (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_json_option(p)
    return p


def run_fixture(args) -> int:
    from .fixture import write_fixture

    if args.gib is not None and args.gib <= 0:
        raise MxforgeError(f"--gib must be positive, got {args.gib}")
    result = write_fixture(args.out, args.preset, seed=args.seed, gib=args.gib, quiet=args.quiet)
    emit(result.as_dict(), args.json, f"wrote {result.preset} fixture to {result.out}: {result.tensors:,} tensors, "
         f"{result.shards} shards, total_size {result.total_size:,} bytes (seed {result.seed})")
    return EXIT_OK


# --- inspect ---------------------------------------------------------------------------------------
def register_inspect(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect", help="summarize a checkpoint: tensor kinds, dtypes, layers, MTP, quantization_config",
                       description="Summarize a checkpoint from its headers alone (no tensor data is read).")
    p.add_argument("ckpt", help="checkpoint directory")
    add_json_option(p)
    return p


def run_inspect(args) -> int:
    from .inspect_ckpt import format_inspect, inspect_checkpoint

    report = inspect_checkpoint(args.ckpt)
    emit(report, args.json, format_inspect(report))
    return EXIT_OK


COMMANDS: dict[str, tuple[Callable, Callable]] = {
    "fixture": (register_fixture, run_fixture),
    "inspect": (register_inspect, run_inspect),
    "download": (hub_cli.register_download, hub_cli.run_download),
    "quantize": (quantize_cli.register_quantize, quantize_cli.run_quantize),
    "fixup": (fixups_cli.register_fixup, fixups_cli.run_fixup),
    "validate": (fixups_cli.register_validate, fixups_cli.run_validate),
    "push": (hub_cli.register_push, hub_cli.run_push),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mxforge", description="bf16 MoE checkpoints to MXFP4 that load in sglang and vLLM, MTP intact.")
    parser.add_argument("--version", action="version", version=f"mxforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (register, _) in COMMANDS.items():
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except MxforgeError as e:
        print(f"mxforge {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"mxforge {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
