"""`mxforge validate`: argument parsing and output (the work is in validate.py)."""

from __future__ import annotations

import argparse

# mxforge.cli.main imports this module to build its COMMANDS table: what a run needs is imported at call time.
from mxforge.cli.support import CKPT_OR_REPO, Command, engines_arg, exit_codes_help, open_checkpoint_arg
from mxforge.formats import FORMATS


def _validate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--deep",
        action="store_true",
        help="also read every block scale ("
        + ", ".join(f"{f.title}: {f.scale.title} {f.scale.nan_code} = NaN" for f in FORMATS)
        + ") and check files "
        "against the download's sha256 manifest (reads data: minutes on a full checkpoint)",
    )


def run_validate(args) -> int:
    from mxforge.cli.support import emit_exit
    from mxforge.errors import MxforgeError
    from mxforge.validation.validate import validate_checkpoint

    source = open_checkpoint_arg(args)
    if args.deep and source.local_root is None:
        raise MxforgeError(
            f"{args.ckpt}: --deep reads every MXFP4 scale and hashes every file, i.e. the whole "
            "checkpoint: mxforge download it first, then validate the directory with --deep"
        )
    report = validate_checkpoint(source, engines_arg(args), deep=args.deep, quiet=args.quiet)
    return emit_exit(report.as_dict(), args.json, report.format(), ok=report.ok)


VALIDATE = Command(
    "validate",
    help="check, before upload, that the checkpoint is intact and loads in each engine",
    description="Check index/shard integrity, quantization_config, that every tensor config.json "
    "implies is stored (MTP layer included) and, per engine profile, that every module the engine "
    "builds finds the dtype and shape it allocates. Reads headers only. " + exit_codes_help("clean", "problems found"),
    positionals=(CKPT_OR_REPO,),
    options=_validate_options,
    quiet="no progress bar (--deep)",
    remote=True,
    engines=True,
    run=run_validate,
)
