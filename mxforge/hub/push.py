"""`mxforge push`: validate, write the model card, upload, then prove the Hub holds our bytes.

1. Refuse symlinks that leave CKPT (unless --follow-symlinks); stamp every file (size, mtime, inode).
2. Refuse a checkpoint without quantization_config (a bf16 source pushed by mistake) unless `--force`. Validate
   with the configured engines; refuse before any network call when it fails (`--force` overrides, loudly, and
   the card says so). Then ask the Hub whether the token may push to the target (hub/target.py).
3. Hash every file (cached by size and mtime under CKPT/.cache/mxforge) and write README.md, the model card.
   A README.md that mxforge did not write is kept as README.source.md (before the stamps are taken).
4. Create the repo (and branch), upload the LFS files (the Hub skips objects it already holds, so a rerun
   resumes), then, right before the one commit, check that every file still has the stamp it had when
   validation read it and the hash it had when the card was written: anything changed, added or removed
   stops the push before the commit. Small files are committed from the bytes that were hashed.
5. Read the Hub's metadata for the branch and compare every file: LFS sha256 (or the git blob id for
   regular files) and size against the local ones.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from huggingface_hub import CommitOperationAdd, HfApi

from mxforge.checkpoint import Checkpoint
from mxforge.dir_lock import directory_lock
from mxforge.errors import CheckpointChanged, CheckpointError, HubError, HubVerificationError, MxforgeError, PushRefused
from mxforge.file_hashes import FileHash, FileStamp, checkpoint_files, file_hash, hash_files, snapshot
from mxforge.hub.api import repo_info
from mxforge.hub.card import CARD_MARKER, CARD_NAME, SOURCE_CARD_NAME, render_model_card
from mxforge.hub.errors import as_hub_error, check_repo_id, checked_commit, hub_endpoint
from mxforge.hub.session import CANCEL, HubLimits, fresh_connections, is_transient, retrying, use_hub_limits
from mxforge.hub.target import check_push_target
from mxforge.provenance import recorded_command
from mxforge.records import fields_of
from mxforge.redaction import redact
from mxforge.safetensors_io import write_text_atomic

INLINE_MAX_BYTES = 10 << 20  # the Hub stores files above 10 MB in LFS; smaller ones are committed from memory


@dataclass
class PushResult:
    repo_id: str
    branch: str
    endpoint: str
    commit: str
    forced: bool
    validation: dict
    files: list[FileHash] = field(default_factory=list)
    quantized: bool = True  # False: pushed with --force without quantization_config

    def as_dict(self) -> dict:
        return {
            "stage": "push",
            **fields_of(self, "repo_id", "branch", "endpoint", "url", "commit", "forced", "quantized"),
            "validation": {"ok": self.validation.get("ok"), "engines": self.validation.get("engines")},
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
            "remote_hashes_match": True,
        }

    @classmethod
    def from_dict(cls, d: dict) -> PushResult:
        """Read back from `as_dict()` (mxforge run's state file): the validation verdict and the files' sha256
        only (no git sha1), as recorded."""
        return cls(
            repo_id=str(d.get("repo_id", "")),
            branch=str(d.get("branch", "")),
            endpoint=str(d.get("endpoint", "")),
            commit=str(d.get("commit", "")),
            forced=bool(d.get("forced")),
            validation=dict(d.get("validation") or {}),
            files=[
                FileHash(f["name"], f["size"], f["sha256"], "")
                for f in d.get("files") or []
                if isinstance(f, dict) and {"name", "size", "sha256"} <= f.keys()
            ],
            quantized=d.get("quantized") is not False,
        )

    @property
    def url(self) -> str:
        return f"{self.endpoint}/{self.repo_id}"


def run_validation(ckpt: Checkpoint, engines: list[str] | None, force: bool) -> dict:
    """Validate; refuse (no network call made yet) or, with force, warn loudly on stderr.

    Raises:
        PushRefused: validation failed and force is False.
        CheckpointError: the checkpoint cannot be validated at all.
    """
    from mxforge.validation.validate import validate_checkpoint

    report = validate_checkpoint(ckpt, engines)
    root = ckpt.root
    if report.ok:
        return report.as_dict()
    first = report.problems[0].format()
    if not force:
        raise PushRefused(
            f"{root}: validate found {len(report.problems)} problem(s), so nothing was pushed; first: "
            f"{first}. Fix them (`mxforge validate {root}` lists all) or pass --force to push anyway",
            path=root,
        )
    print(
        f"mxforge push: WARNING: --force: pushing {root} although validate found {len(report.problems)} problem(s); "
        "the model card says so:\n" + "\n".join(f"  - {p.format()}" for p in report.problems),
        file=sys.stderr,
    )
    return report.as_dict()


def refuse_unquantized(ckpt: Checkpoint, force: bool) -> bool:
    """Whether `ckpt` is quantized (has a quantization_config); refuse, before anything is written or sent, to push
    one that is not (a bf16 source pushed by mistake, e.g. OUT/bf16 for OUT/mxfp4) unless forced.

    Raises:
        PushRefused: no quantization_config and force is False.
    """
    if ckpt.quantization_config is not None:
        return True
    root = ckpt.root
    if not force:
        raise PushRefused(
            f"{root}: not quantized (config.json has no quantization_config: its weights are as the source "
            "stores them), so nothing was pushed or written; push the checkpoint mxforge made (mxforge run's "
            f"OUT/mxfp4, mxforge quantize's OUT), or pass --force to push this one as it is (its model card is "
            f"then written into it as {CARD_NAME})"
        )
    return False


def keep_source_card(ckpt: Path) -> bool:
    """Move a README.md that mxforge did not write to README.source.md (the card takes its place); True if moved.

    Raises:
        CheckpointError: it cannot be moved.
    """
    card = ckpt / CARD_NAME
    if not card.exists() or CARD_MARKER in card.read_text(errors="replace"):
        return False
    try:
        card.replace(ckpt / SOURCE_CARD_NAME)
    except OSError as e:
        raise CheckpointError(
            f"{card}: cannot keep the existing README as {SOURCE_CARD_NAME}: {e.strerror or e}", path=card
        ) from None
    return True


def write_model_card(
    ckpt: Path,
    names: list[str],
    *,
    repo_id: str,
    validation: dict,
    forced: bool,
    command: str | None,
    workers: int,
    quiet: bool,
    follow_symlinks: bool = False,
) -> list[FileHash]:
    """Hash `names` (the checkpoint's files but the card) and write README.md; returns every file's hashes, card
    included.

    Raises:
        CheckpointError: a shard header or the index cannot be read.
    """
    card = ckpt / CARD_NAME
    hashes = hash_files(ckpt, names, workers=workers, quiet=quiet, desc="sha256")
    text = render_model_card(
        Checkpoint.open(ckpt, follow_symlinks),
        repo_id=repo_id,
        files=list(hashes.values()),
        validation=validation,
        forced=forced,
        push_command=command,
    )
    write_text_atomic(card, redact(text))
    return [*hashes.values(), file_hash(card, CARD_NAME)]


def refuse_changes(
    ckpt: Path, expected: dict[str, FileStamp], follow_symlinks: bool, when: str, push_command: str
) -> None:
    """Refuse when CKPT's files are not exactly `expected` (same names, sizes, mtimes, inodes).

    Raises:
        CheckpointChanged: naming what changed, and how to push what is there now.
    """
    now = snapshot(ckpt, checkpoint_files(ckpt, follow_symlinks))
    changed = sorted(
        [f"{n} (modified)" for n in expected.keys() & now.keys() if expected[n] != now[n]]
        + [f"{n} (new)" for n in now.keys() - expected.keys()]
        + [f"{n} (removed)" for n in expected.keys() - now.keys()]
    )
    if changed:
        listed = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise CheckpointChanged(
            f"{ckpt}: changed after validation ({listed}) {when}; nothing was committed. Let "
            f"whatever writes to {ckpt} finish, then rerun `{push_command}` to validate and push "
            "the files as they are then",
            path=ckpt,
        )


def _operation(ckpt: Path, f: FileHash) -> CommitOperationAdd:
    """What to commit for one file: small files as the very bytes hashed, large ones by path (LFS) once
    huggingface_hub's own sha256 of them agrees with ours.

    Raises:
        CheckpointChanged: the file's bytes no longer hash to `f`.
    """
    path = ckpt / f.name
    if f.size <= INLINE_MAX_BYTES:
        data = path.read_bytes()
        op = CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=data)
    else:
        op = CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(path))
    if op.upload_info.sha256.hex() != f.sha256 or op.upload_info.size != f.size:
        raise CheckpointChanged(
            f"{path}: its bytes changed after validation hashed them; nothing was committed. "
            "Rerun the push to validate and push the file as it is now",
            path=path,
        )
    return op


def upload(
    api: HfApi,
    ckpt: Path,
    repo_id: str,
    *,
    branch: str,
    private: bool,
    files: list[FileHash],
    before_commit,
    workers: int,
    limits: HubLimits,
    preuploaded: bool = False,
) -> None:
    """Create the repo/branch if needed, upload the LFS objects, call `before_commit()`, then commit every file.
    `preuploaded`: the large files are on the Hub already (huggingface_hub's bar would count zero files: off).

    Raises:
        CheckpointChanged: from `before_commit` or a file that no longer hashes as it did (nothing committed).
        HubError: no/invalid token, no write access, Hub unreachable or silent, upload aborted (rerun resumes:
            the Hub keeps the LFS objects it received).
    """
    sending = False
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            ops = list(pool.map(lambda f: _operation(ckpt, f), files))
        prepare_repo(api, repo_id, branch, private, limits)
        sending = True
        with hub_bars_off() if preuploaded else nullcontext():
            api.preupload_lfs_files(repo_id, additions=ops, repo_type="model", revision=branch)
        before_commit()
        commit_once(api, repo_id, branch, ops, files, limits)
    except MxforgeError:
        raise
    except Exception as e:
        _raise_upload_failure(e, f"upload of {ckpt}", repo_id, branch, sent=sending)


def commit_once(
    api: HfApi, repo_id: str, branch: str, ops: list[CommitOperationAdd], files: list[FileHash], limits: HubLimits
) -> None:
    """Commit `ops` (the files `files` describe) onto `branch`. A commit that failed transiently (is_transient: a
    5xx, a dropped or silent connection) may still have landed, its answer lost: the branch is read back first,
    and the commit is sent again (the same operations, uploaded already) only when it does not hold every file
    as `files` describes it. huggingface_hub never retries a commit by itself, since a blind retry can commit
    twice.

    Raises:
        the last attempt's exception after `limits.retries` more attempts (or any other at once).
        HubError: the branch cannot be read back.
    """
    failures = 0
    while True:
        try:
            api.create_commit(
                repo_id,
                operations=ops,
                commit_message=f"Upload {len(ops)} files with mxforge",
                repo_type="model",
                revision=branch,
            )
            return
        except Exception as e:
            failures += 1
            if not is_transient(e) or failures > limits.retries:
                setattr(e, "mxforge_attempts", failures)
                raise
        if CANCEL.wait(limits.backoff(failures)):
            raise KeyboardInterrupt
        try:
            verify_remote(api, repo_id, branch, files, limits)
            return  # it had landed
        except HubVerificationError:
            pass  # not (all) there: commit again


def _raise_upload_failure(e: Exception, what: str, repo_id: str, branch: str, sent: bool = True) -> None:
    """Raise the one-line HubError for an upload that failed with `e` (or `e` itself when it is no Hub error).
    `sent`: whether file bytes may have reached the Hub (else nothing was uploaded, and there is nothing to resume).
    """
    mapped = as_hub_error(e, repo_id=repo_id, revision=branch, action="push to")
    if mapped is None:
        raise e
    why = str(mapped).split(": rerun")[0]
    then = (
        "the Hub keeps the large files it already received: rerun the same command to resume"
        if sent
        else "nothing was uploaded: fix that, then rerun"
    )
    raise HubError(redact(f"{what} to {repo_id}@{branch} aborted ({why}); {then}")) from None


def prepare_repo(api: HfApi, repo_id: str, branch: str, private: bool, limits: HubLimits) -> None:
    """Create the repo, and the branch when not main, unless they exist (an empty repo shows nothing); each call is
    retried after a transient failure (with exist_ok, a second attempt after one that landed changes nothing)."""
    retrying(lambda: api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True), limits)
    if branch != "main":
        retrying(lambda: api.create_branch(repo_id, branch=branch, repo_type="model", exist_ok=True), limits)


@dataclass
class _HubBars:
    """hub_bars_off's callers, across threads: how many are inside, and whether the first one turned the bars off."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    depth: int = 0
    turned_off: bool = False


_HUB_BARS = _HubBars()


@contextmanager
def hub_bars_off() -> Iterator[None]:
    """huggingface_hub's progress bars off for the block (several threads at once), back as they were after.

    A one-file pre-upload shows a bar only when it has nothing to send ('Upload 0 LFS files: 0it', once per
    shard the Hub already holds on a resumed stream); the streamed run shows its own progress."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    bars = _HUB_BARS
    with bars.lock:
        if bars.depth == 0:
            bars.turned_off = not are_progress_bars_disabled()
            if bars.turned_off:
                disable_progress_bars()
        bars.depth += 1
    try:
        yield
    finally:
        with bars.lock:
            bars.depth -= 1
            if bars.depth == 0 and bars.turned_off:
                enable_progress_bars()


def preupload_file(api: HfApi, ckpt: Path, repo_id: str, branch: str, f: FileHash) -> None:
    """Send one file's LFS object to the Hub without committing it (the Hub skips an object it holds): a
    streamed run pre-uploads each output shard as it is made, and push's one commit later refers to it.
    The repo must exist (prepare_repo).

    Raises:
        CheckpointChanged: the file no longer hashes to `f`.
        HubError: as `upload` (a rerun resumes).
    """
    try:
        with hub_bars_off():
            api.preupload_lfs_files(repo_id, additions=[_operation(ckpt, f)], repo_type="model", revision=branch)
    except MxforgeError:
        raise
    except Exception as e:
        _raise_upload_failure(e, f"pre-upload of {ckpt / f.name}", repo_id, branch)


def verify_remote(api: HfApi, repo_id: str, branch: str, files: list[FileHash], limits: HubLimits) -> str:
    """Compare every local file with the Hub's record of it on `branch`; returns the branch's commit sha.

    Raises:
        HubVerificationError: a file is missing on the Hub or its size/hash differs, naming each one.
        HubError: the metadata cannot be read.
    """
    info = repo_info(api, repo_id, branch, limits, files_metadata=True, action="read back the file hashes of")
    remote = {s.rfilename: s for s in info.siblings or []}
    bad = []
    for f in files:
        s = remote.get(f.name)
        if s is None:
            bad.append(f"{f.name}: missing on the Hub")
        elif s.lfs is not None:
            if s.lfs.sha256 != f.sha256 or s.lfs.size != f.size:
                bad.append(
                    f"{f.name}: the Hub has sha256 {s.lfs.sha256[:12]}… ({s.lfs.size:,} bytes), "
                    f"local {f.sha256[:12]}… ({f.size:,} bytes)"
                )
        elif s.blob_id != f.git_sha1:
            bad.append(f"{f.name}: the Hub has git blob {str(s.blob_id)[:12]}…, local {f.git_sha1[:12]}…")
    if bad:
        raise HubVerificationError(
            f"{repo_id}@{branch} ({info.sha}): {len(bad)} file(s) on the Hub differ from "
            f"the local checkpoint: {'; '.join(bad)}: rerun the same command to upload them again",
            repo_id=repo_id,
        )
    return checked_commit(info.sha, f"{repo_id}@{branch}")


def push(
    ckpt: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    branch: str | None = None,
    force: bool = False,
    engines: list[str] | None = None,
    workers: int = 8,
    quiet: bool = False,
    command: str | None = None,
    validation: dict | None = None,
    validated_files: dict[str, FileStamp] | None = None,
    follow_symlinks: bool = False,
    limits: HubLimits | None = None,
    preuploaded: bool = False,
) -> PushResult:
    """Validate, card, upload and verify a checkpoint (see the module docstring). Holds CKPT's lock.

    `validation` with `validated_files`: a clean ValidationReport.as_dict() the caller has just made of this
    very checkpoint (mxforge run validates as its own stage) and the file stamps taken when it did; it is then
    not computed again, and the commit is refused unless the files still have those stamps. `preuploaded`: a
    streamed run has sent the large files already (no upload progress to show).

    Raises:
        PushRefused: validation failed without --force (before any network call).
        CheckpointError: CKPT is not a readable checkpoint, or holds a symlink leaving it.
        CheckpointChanged: a file changed between validation and the commit (nothing committed).
        HubError / HubVerificationError: see `upload` and `verify_remote`.
    """
    ckpt = Path(ckpt)
    branch = branch or "main"
    check_repo_id(repo_id)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a directory; pass the checkpoint directory to push", path=ckpt)
    command = recorded_command(command)
    with directory_lock(ckpt):
        quantized = refuse_unquantized(Checkpoint.open(ckpt, follow_symlinks), force)
        moved = keep_source_card(ckpt)
        if validation is None or not validation.get("ok") or validated_files is None:
            validated_files = snapshot(ckpt, checkpoint_files(ckpt, follow_symlinks))
            validation = run_validation(Checkpoint.open(ckpt, follow_symlinks), engines, force)
        # Whether this token may push there, asked before the card is written and every file hashed.
        check_push_target(repo_id, private=private, limits=limits)
        expected = {n: s for n, s in validated_files.items() if n != CARD_NAME}
        if moved and CARD_NAME in validated_files:  # validated as README.md, moved aside since: the same file
            expected[SOURCE_CARD_NAME] = validated_files[CARD_NAME]
        files = write_model_card(
            ckpt,
            sorted(expected),
            repo_id=repo_id,
            validation=validation,
            forced=not validation["ok"],
            command=command,
            workers=workers,
            quiet=quiet,
            follow_symlinks=follow_symlinks,
        )
        expected[CARD_NAME] = snapshot(ckpt, [CARD_NAME])[CARD_NAME]
        push_command = f"mxforge push {ckpt} {repo_id}"
        refuse_changes(ckpt, expected, follow_symlinks, "while it was hashed", push_command)
        limits = limits or HubLimits.resolve()
        use_hub_limits(limits)
        fresh_connections()
        api = HfApi()
        upload(
            api,
            ckpt,
            repo_id,
            branch=branch,
            private=private,
            files=files,
            workers=workers,
            before_commit=lambda: refuse_changes(ckpt, expected, follow_symlinks, "during the upload", push_command),
            limits=limits,
            preuploaded=preuploaded,
        )
        commit = verify_remote(api, repo_id, branch, files, limits)
    return PushResult(
        repo_id=repo_id,
        branch=branch,
        endpoint=hub_endpoint(),
        commit=commit,
        forced=not validation["ok"],
        validation=validation,
        files=files,
        quantized=quantized,
    )
