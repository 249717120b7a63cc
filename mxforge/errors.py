"""Expected failures. The CLI prints their message (no traceback) and exits 2."""


class MxforgeError(Exception):
    """Base class: the message names the file/tensor/entry at fault and what to do about it."""


class CheckpointError(MxforgeError):
    """A checkpoint directory, index or shard is missing, malformed or inconsistent."""


class ConfigError(MxforgeError):
    """A config.json, recipe or manifest is missing a field or holds a bad value."""
