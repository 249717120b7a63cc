"""`mxforge fixup`: argument parsing and output (the work is in fixup.py, mtp_inject.py, hub_pr.py)."""

from __future__ import annotations

import argparse

# mxforge.cli.main imports this module to build its COMMANDS table, so its helpers are imported inside the
# functions below (at call time), never at import time.
from mxforge.cli.support import (
    Command,
    add_recipe_option,
    emit_exit,
    engines_arg,
    exit_codes_help,
    open_checkpoint_arg,
)


def _fixup_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the unified diff of config.json; write nothing "
        "(with --create-pr: also the pull request's description; nothing is sent)",
    )
    p.add_argument(
        "--create-pr",
        action="store_true",
        help="REPO_ID only: open a pull request on the Hub changing "
        "config.json (and adding mxforge_fixups.json), computed from the remote headers; a second call finds "
        "the open one instead",
    )
    p.add_argument(
        "--mtp-from",
        metavar="BF16_SRC",
        default=None,
        help="first re-inject a missing MTP layer from this bf16 checkpoint (a new shard; index and config updated)",
    )
    add_recipe_option(
        p, when="with --mtp-from: the recipe that quantizes the MTP layer: ", default="the family's default"
    )


def run_fixup(args) -> int:
    from mxforge.cli.support import invocation
    from mxforge.errors import ConfigError
    from mxforge.fixups.fixup import fixup_checkpoint

    if args.recipe and not args.mtp_from:
        raise ConfigError("--recipe applies only with --mtp-from BF16_SRC")
    source = None if args.create_pr else open_checkpoint_arg(args)
    if source is None or source.local_root is None:
        return _run_remote_fixup(args, source)
    result = fixup_checkpoint(
        source,
        engines_arg(args),
        dry_run=args.dry_run,
        mtp_from=args.mtp_from,
        recipe=args.recipe,
        quiet=args.quiet,
        command=invocation(),
    )
    return _emit_fixup(args, result)


def _run_remote_fixup(args, source) -> int:
    """fixup of a Hub repo: --create-pr (or --dry-run) only; a repo cannot be edited in place."""
    from mxforge.checkpoint import is_local_source
    from mxforge.cli.support import hub_limits, invocation
    from mxforge.errors import MxforgeError
    from mxforge.fixups.fixup import fixup_checkpoint

    if args.mtp_from:
        raise MxforgeError("--mtp-from writes a new shard: it needs a local checkpoint directory, not a Hub repo")
    if args.create_pr:
        if is_local_source(args.ckpt):
            raise MxforgeError(f"{args.ckpt}: --create-pr takes a Hub repo id (owner/name), not a directory")
        from mxforge.hub.pr import create_fixup_pr

        pr = create_fixup_pr(
            args.ckpt,
            args.revision,
            engines_arg(args),
            dry_run=args.dry_run,
            limits=hub_limits(args),
            command=invocation(),
        )
        return emit_exit(pr.as_dict(), args.json, pr.format(), ok=not pr.fixup.remaining)
    if not args.dry_run:
        raise MxforgeError(
            f"{args.ckpt}: a Hub repo cannot be edited in place: pass --create-pr to propose the fix "
            "as a pull request, or --dry-run to see it"
        )
    result = fixup_checkpoint(source, engines_arg(args), dry_run=True, command=invocation())
    return _emit_fixup(args, result)


def _emit_fixup(args, result) -> int:
    return emit_exit(result.as_dict(), args.json, result.format(), ok=not result.remaining)


FIXUP = Command(
    "fixup",
    help="write the MTP exclusion aliases each engine needs; rewrite glob exclusions",
    description="Edit quantization_config.exclude so that each engine builds bf16 exactly the modules "
    "stored bf16: exact aliases for the MTP layer (model.decoder.*, model.eh_proj, fused names, "
    "<layer>.mlp.experts) and glob entries rewritten into exact names. Idempotent. Keeps "
    "config.json.orig, records what it applied in mxforge_fixups.json. "
    + exit_codes_help("when every engine can load the result", "when problems remain that the config cannot cure"),
    positionals=(
        (
            "ckpt",
            "checkpoint directory (config.json is edited in place), or a Hub repo id with --create-pr or --dry-run",
        ),
    ),
    options=_fixup_options,
    quiet="no progress bar (--mtp-from)",
    remote=True,
    engines=True,
    run=run_fixup,
)
