"""`mxforge push`: validate, write the model card, upload resumably, then prove the Hub holds our bytes.

1. Validate with the configured engines; refuse before any network call when it fails (`--force` overrides,
   loudly, and the card says so).
2. Hash every file (cached by size and mtime under CKPT/.cache/mxforge) and write README.md, the model card.
   A README.md that mxforge did not write is kept as README.source.md.
3. Create the repo (and branch) and upload with huggingface_hub's resumable large-folder upload: its
   progress lives in CKPT/.cache/huggingface/upload, so rerunning the same command resumes.
4. Read the Hub's metadata for the branch and compare every file: LFS sha256 (or the git blob id for
   regular files) and size against the local ones.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import HfApi

from .checkpoint import Checkpoint
from .errors import CheckpointError, MxforgeError
from .file_hashes import LOCAL_ONLY_FILES, FileHash, checkpoint_files, hash_file, hash_files
from .cli_support import invocation
from .hub_errors import HubError, HubVerificationError, as_hub_error, hub_endpoint, raise_as_hub_error, redact
from .model_card import CARD_MARKER, CARD_NAME, render_model_card
from .safetensors_io import write_text_atomic

IGNORE_PATTERNS = [".cache/*", "*.partial", ".git/*", *LOCAL_ONLY_FILES]


class PushRefused(MxforgeError):
    """Validation failed and --force was not given; nothing was sent."""


@dataclass
class PushResult:
    repo_id: str
    branch: str
    endpoint: str
    commit: str
    forced: bool
    validation: dict
    files: list[FileHash] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"stage": "push", "repo_id": self.repo_id, "branch": self.branch, "endpoint": self.endpoint,
                "url": f"{self.endpoint}/{self.repo_id}", "commit": self.commit, "forced": self.forced,
                "validation": {"ok": self.validation.get("ok"), "engines": self.validation.get("engines")},
                "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
                "remote_hashes_match": True}


def run_validation(ckpt: Path, engines: list[str] | None, force: bool) -> dict:
    """Validate; refuse (no network call made yet) or, with force, warn loudly on stderr.

    Raises:
        PushRefused: validation failed and force is False.
        CheckpointError: the checkpoint cannot be validated at all.
    """
    from .fixups.validate import validate_checkpoint

    report = validate_checkpoint(ckpt, engines)
    if report.ok:
        return report.as_dict()
    first = report.problems[0].format()
    if not force:
        raise PushRefused(f"{ckpt}: validate found {len(report.problems)} problem(s), so nothing was pushed; first: "
                          f"{first}. Fix them (`mxforge validate {ckpt}` lists all) or pass --force to push anyway")
    print(f"mxforge push: WARNING: --force: pushing {ckpt} although validate found {len(report.problems)} problem(s); "
          "the model card says so:\n" + "\n".join(f"  - {p.format()}" for p in report.problems), file=sys.stderr)
    return report.as_dict()


def write_model_card(ckpt: Path, repo_id: str, validation: dict, forced: bool, command: str,
                     workers: int, quiet: bool) -> list[FileHash]:
    """Hash the checkpoint's files and write README.md; returns the hashes of every file, card included.

    Raises:
        CheckpointError: a shard header or the index cannot be read.
    """
    card = ckpt / CARD_NAME
    if card.exists() and CARD_MARKER not in card.read_text(errors="replace"):
        try:
            card.replace(ckpt / "README.source.md")
        except OSError as e:
            raise CheckpointError(f"{card}: cannot keep the existing README as README.source.md: {e.strerror or e}") from None
    names = [n for n in checkpoint_files(ckpt) if n != CARD_NAME]
    hashes = hash_files(ckpt, names, workers=workers, quiet=quiet, desc="sha256")
    text = render_model_card(Checkpoint.open(ckpt), repo_id=repo_id, files=list(hashes.values()),
                             validation=validation, forced=forced, push_command=command)
    write_text_atomic(card, redact(text))
    sha256, git_sha1 = hash_file(card)
    return [*hashes.values(), FileHash(CARD_NAME, card.stat().st_size, sha256, git_sha1)]


def upload(api: HfApi, ckpt: Path, repo_id: str, branch: str, private: bool, quiet: bool) -> None:
    """Create the repo/branch if needed and upload the folder resumably.

    Raises:
        HubError: no/invalid token, no write access, Hub unreachable, upload aborted (rerun resumes).
    """
    context = {"repo_id": repo_id, "revision": branch, "action": "push to"}
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if branch != "main":
            api.create_branch(repo_id, branch=branch, repo_type="model", exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # upload_large_folder's deprecation notice
            if hasattr(api, "upload_large_folder"):
                api.upload_large_folder(repo_id=repo_id, folder_path=ckpt, repo_type="model", revision=branch,
                                        private=private, ignore_patterns=list(IGNORE_PATTERNS), print_report=False)
            else:  # newer huggingface_hub: upload_folder is the resumable pipeline
                api.upload_folder(repo_id=repo_id, folder_path=ckpt, repo_type="model", revision=branch,
                                  ignore_patterns=list(IGNORE_PATTERNS))
    except RuntimeError as e:  # upload_large_folder gives up after repeated errors; its cause says why
        cause = e.__cause__ or e
        mapped = as_hub_error(cause, **context)
        why = str(mapped).split(": rerun")[0] if mapped else f"{type(cause).__name__}: {cause}"
        raise HubError(redact(f"upload of {ckpt} to {repo_id}@{branch} aborted after repeated errors ({why}); "
                              f"progress is saved in {ckpt}/.cache/huggingface/upload: rerun the same command to resume")) from None
    except Exception as e:
        raise_as_hub_error(e, **context)
        raise


def verify_remote(api: HfApi, repo_id: str, branch: str, files: list[FileHash]) -> str:
    """Compare every local file with the Hub's record of it on `branch`; returns the branch's commit sha.

    Raises:
        HubVerificationError: a file is missing on the Hub or its size/hash differs, naming each one.
        HubError: the metadata cannot be read.
    """
    try:
        info = api.model_info(repo_id, revision=branch, files_metadata=True)
    except Exception as e:
        raise_as_hub_error(e, repo_id=repo_id, revision=branch, action="read back the file hashes of")
        raise
    remote = {s.rfilename: s for s in info.siblings or []}
    bad = []
    for f in files:
        s = remote.get(f.name)
        if s is None:
            bad.append(f"{f.name}: missing on the Hub")
        elif s.lfs is not None:
            if s.lfs.sha256 != f.sha256 or s.lfs.size != f.size:
                bad.append(f"{f.name}: the Hub has sha256 {s.lfs.sha256[:12]}… ({s.lfs.size:,} bytes), "
                           f"local {f.sha256[:12]}… ({f.size:,} bytes)")
        elif s.blob_id != f.git_sha1:
            bad.append(f"{f.name}: the Hub has git blob {str(s.blob_id)[:12]}…, local {f.git_sha1[:12]}…")
    if bad:
        raise HubVerificationError(f"{repo_id}@{branch} ({info.sha}): {len(bad)} file(s) on the Hub differ from "
                                   f"the local checkpoint: {'; '.join(bad)}: rerun the same command to upload them again")
    return info.sha


def push(ckpt: str | Path, repo_id: str, *, private: bool = False, branch: str | None = None, force: bool = False,
         engines: list[str] | None = None, workers: int = 8, quiet: bool = False, command: str | None = None,
         validation: dict | None = None) -> PushResult:
    """Validate, card, upload and verify a checkpoint (see the module docstring).

    `validation`: a ValidationReport.as_dict() the caller has just made of this very checkpoint (mxforge run
    validates as its own stage); it must be clean, and is then not computed again.

    Raises:
        PushRefused: validation failed without --force (before any network call).
        CheckpointError: CKPT is not a readable checkpoint.
        HubError / HubVerificationError: see `upload` and `verify_remote`.
    """
    ckpt = Path(ckpt)
    branch = branch or "main"
    command = redact(command) if command is not None else invocation()
    if validation is None or not validation.get("ok"):
        validation = run_validation(ckpt, engines, force)
    files = write_model_card(ckpt, repo_id, validation, not validation["ok"], command, workers, quiet)
    api = HfApi()
    upload(api, ckpt, repo_id, branch, private, quiet)
    commit = verify_remote(api, repo_id, branch, files)
    return PushResult(repo_id, branch, hub_endpoint(), commit, not validation["ok"], validation, files)
