"""`mxforge download` and `mxforge push`: the command-line side of hub I/O."""

from __future__ import annotations

import argparse

# cli_support is light; heavy modules (huggingface_hub, hub I/O) are imported inside the functions, at call time.
from mxforge.cli.support import Command, emit_exit, engines_arg, hub_limits, invocation, require_at_least


def _add_workers_option(p: argparse.ArgumentParser, workers_help: str) -> None:
    p.add_argument("--workers", type=int, default=8, help=f"{workers_help} (default 8)")


def _start_transfer(args) -> None:
    """Before download or push reads anything else: refuse a --workers below 1 and, with --quiet, silence
    huggingface_hub's own progress bars."""
    require_at_least(args.workers, 1, "--workers")
    if args.quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def _transfer_args(args) -> dict:
    """What download and push take alike from their options: --workers, --quiet, the Hub limits, the command line.

    Raises:
        MxforgeError: --timeout / --retries (or their variables) out of range.
    """
    return {"workers": args.workers, "quiet": args.quiet, "limits": hub_limits(args), "command": invocation()}


def _download_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default="main", help="branch, tag or commit sha (default main)")
    p.add_argument("--include", action="append", metavar="GLOB", help="download only files matching GLOB (repeatable)")
    p.add_argument("--exclude", action="append", metavar="GLOB", help="skip files matching GLOB (repeatable)")
    _add_workers_option(p, "parallel file downloads and hash threads")


def run_download(args) -> int:
    from mxforge.hub.download import download

    _start_transfer(args)
    r = download(
        args.repo_id,
        args.dest,
        revision=args.revision,
        include=args.include,
        exclude=args.exclude,
        **_transfer_args(args),
    )
    report = r.as_dict()
    return emit_exit(
        report,
        args.json,
        f"downloaded {r.repo_id}@{r.revision} (commit {r.commit}) to {r.dest}: {report['files']} files, "
        f"{report['bytes']:,} bytes, every hash verified against the Hub",
    )


DOWNLOAD = Command(
    "download",
    help="download a Hub repo at one commit, resumably, verifying every file's hash",
    description="Download REPO_ID into DEST through huggingface_hub: resolves the revision to a commit, "
    "checks free disk space first, resumes interrupted files on rerun, verifies every file against the "
    "Hub's sha256 / git hash, and records DEST/mxforge_source.json. Honours HF_TOKEN, HF_ENDPOINT, HF_HOME, "
    "HF_HUB_OFFLINE and the Hub's other usual variables.",
    positionals=(
        ("repo_id", "Hub repo, e.g. zai-org/GLM-5.2"),
        ("dest", "destination directory (created; rerun into the same one to resume)"),
    ),
    options=_download_options,
    quiet="no progress bars",
    hub=True,
    run=run_download,
)


def _push_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--branch", default=None, help="push to this branch (created from main if missing; default main)")
    p.add_argument("--force", action="store_true", help="push even though validate fails (the card says so)")
    _add_workers_option(p, "hash threads")


def run_push(args) -> int:
    from mxforge.cli.support import refuse_run_dir
    from mxforge.hub.push import push

    refuse_run_dir(args.ckpt, "push")
    _start_transfer(args)
    engines = engines_arg(args)
    r = push(
        args.ckpt,
        args.repo_id,
        private=args.private,
        branch=args.branch,
        force=args.force,
        engines=engines,
        follow_symlinks=args.follow_symlinks,
        **_transfer_args(args),
    )
    forced = " (FORCED past failed validation)" if r.forced else ""
    unquantized = " (NOT quantized: config.json has no quantization_config; --force)" if not r.quantized else ""
    return emit_exit(
        r.as_dict(),
        args.json,
        f"pushed {args.ckpt}{unquantized} to {r.endpoint}/{r.repo_id} branch {r.branch} (commit {r.commit}){forced}: "
        f"{len(r.files)} files, every remote sha256 matches the local one",
    )


PUSH = Command(
    "push",
    help="validate, write the model card, upload resumably and verify the remote hashes",
    description="Validate CKPT (refusing, before any network call, when it fails), write its model card "
    "README.md, upload the large files (the Hub keeps what it received: rerun to resume), commit in one commit "
    "only if no file changed since validation, then compare the Hub's sha256 of every file with the "
    "local one. Needs HF_TOKEN (or `hf auth login`) with write access.",
    positionals=(
        ("ckpt", "checkpoint directory"),
        ("repo_id", "target Hub repo, e.g. me/GLM-5.2-MXFP4 (created if missing)"),
    ),
    options=_push_options,
    quiet="no progress bars",
    follow_symlinks="and upload files of CKPT",
    hub=True,
    engines=True,
    run=run_push,
)
