"""Every error class of mxforge's API, in one place. The CLI prints the message (no traceback) and exits 2
(ValidationFailed: 1)."""


class MxforgeError(Exception):
    """Base class: the message names the file/tensor/entry at fault and what to do about it."""


class CheckpointError(MxforgeError):
    """A checkpoint directory, index or shard is missing, malformed or inconsistent."""


class ConfigError(MxforgeError):
    """A config.json, recipe or manifest is missing a field or holds a bad value."""


class DiskSpaceError(MxforgeError):
    """The filesystem cannot hold what a stage is about to write (checked before it writes anything)."""


class HubError(MxforgeError):
    """The Hub refused a request or could not be reached."""


class HubVerificationError(MxforgeError):
    """Bytes on one side do not hash to what the Hub's metadata says."""


class PushRefused(MxforgeError):
    """Validation failed and --force was not given; nothing was sent."""


class CheckpointChanged(MxforgeError):
    """A file changed between validation and the commit; nothing was committed."""


class OversizeBody(MxforgeError):
    """The Hub sent (or announced) more bytes than the file's declared size."""


class DirectoryInUse(MxforgeError):
    """Another process holds the directory's lock."""


class UnsafeNameError(MxforgeError):
    """The Hub sent a file name that is not a plain relative path inside DEST."""


class ValidationFailed(MxforgeError):
    """Validation found problems: the pipeline stops before push (exit 1)."""


class NonFiniteWeightError(MxforgeError):
    """A weight to be quantized holds NaN or Inf (Quark would silently encode such blocks as +6.0)."""
