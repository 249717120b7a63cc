"""Every error class of mxforge's API, in one place. The CLI prints the message (no traceback) and exits 2
(ValidationFailed: 1); with --json, the report it writes is the error's `as_dict()`.

Each error carries, as keyword fields, the things its message names, as huggingface_hub's errors carry theirs
(`RepositoryNotFoundError.response`...): the file or directory (`path`), the shard, tensor or config/recipe/index
`entry`, the process (`pid`), the Hub repo (`repo_id`, `revision`, `filename`) and the HTTP `status`. A field the
raise site does not know is None; `fields()` lists the others. They survive pickling (worker processes, Ray).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FIELDS = ("path", "shard", "tensor", "entry", "pid", "repo_id", "revision", "filename", "status")


class MxforgeError(Exception):
    """Base class: the message names the file/tensor/entry at fault and what to do about it."""

    def __init__(
        self,
        message: str = "",
        *,
        path: str | os.PathLike | None = None,
        shard: str | None = None,
        tensor: str | None = None,
        entry: str | None = None,
        pid: int | None = None,
        repo_id: str | None = None,
        revision: str | None = None,
        filename: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.shard = shard
        self.tensor = tensor
        self.entry = entry
        self.pid = pid
        self.repo_id = repo_id
        self.revision = revision
        self.filename = filename
        self.status = status

    @property
    def message(self) -> str:
        return str(self)

    def fields(self) -> dict[str, Any]:
        """The keyword fields this error was raised with (those not None)."""
        return {k: getattr(self, k, None) for k in FIELDS if getattr(self, k, None) is not None}

    def with_message(self, message: str, **fields: Any) -> MxforgeError:
        """The same error (class and fields, `fields` added) with another message: for a caller that adds context."""
        return type(self)(message, **{**self.fields(), **fields})

    def as_dict(self) -> dict[str, Any]:
        """What `--json` writes for this error: its class, message and fields (paths as strings)."""
        return {
            "error": type(self).__name__,
            "message": str(self),
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in self.fields().items()},
        }


class CheckpointError(MxforgeError):
    """A checkpoint directory, index or shard is missing, malformed or inconsistent (path; shard, tensor or the
    index entry where known)."""


class ConfigError(MxforgeError):
    """A config.json, recipe or manifest is missing a field or holds a bad value (path where it is a file; entry:
    the field, rule or option)."""


class DiskSpaceError(MxforgeError):
    """The filesystem cannot hold what a stage is about to write (checked before it writes anything; path: the
    directory)."""


class HubError(MxforgeError):
    """The Hub refused a request or could not be reached (repo_id, revision, filename where known; status: the
    HTTP status, None when no answer came)."""


class HubVerificationError(MxforgeError):
    """Bytes on one side do not hash to what the Hub's metadata says (path; repo_id, filename)."""


class PushRefused(MxforgeError):
    """Validation failed and --force was not given; nothing was sent (path: the checkpoint; repo_id)."""


class CheckpointChanged(MxforgeError):
    """A file changed between validation and the commit; nothing was committed (path; filename)."""


class OversizeBody(MxforgeError):
    """The Hub sent (or announced) more bytes than the file's declared size (repo_id, filename)."""


class DirectoryInUse(MxforgeError):
    """Another process holds the directory's lock (path: the directory; pid: the holder, when it wrote it)."""


class UnsafeNameError(MxforgeError):
    """The Hub sent a file name that is not a plain relative path inside DEST (filename; repo_id)."""


class ValidationFailed(MxforgeError):
    """Validation found problems: the pipeline stops before push (exit 1; path: the checkpoint)."""


class NonFiniteWeightError(MxforgeError):
    """A weight to be quantized holds NaN or Inf (Quark would silently encode such blocks as +6.0; path: the
    shard's file, shard, tensor)."""
