"""JSON from outside (config.json, the safetensors index, a shard's header): bounded in size and in nesting depth
before a byte of it is parsed.

Python's json parser recurses once per nested array or object, so a config.json of 100,000 `[` ends in a
RecursionError; `nesting_depth` counts the nesting without parsing (strings skipped as the parser would skip
them), and `loads` refuses anything deeper than MAX_JSON_DEPTH: the limit of serde_json, so a shard's header is
refused at exactly the depth at which `safetensors.safe_open` refuses it (127 containers pass, 128 do not).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

import numpy as np

from mxforge.errors import CheckpointError

MAX_JSON_DEPTH = 127  # serde_json's recursion limit (128) less one: what safetensors accepts
MAX_JSON_BYTES = 64 << 20  # config.json / the index, local or remote (GLM-5.2's index: 6 MB)

_CHUNK = 8 << 20
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPENS, _CLOSES = (ord("["), ord("{")), (ord("]"), ord("}"))


_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_PLAIN_STRING = re.compile(rb'"[^"]*"')


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in `raw` (JSON text as UTF-8 bytes), counted outside strings."""
    if b"\\" in raw:
        return _nesting_with_escapes(raw)
    # No backslash, so no escaped quote: keep only quotes and brackets, drop what the strings hold.
    brackets = _PLAIN_STRING.sub(b"", raw.translate(None, _STRUCTURE))
    brackets = brackets.split(b'"', 1)[0]  # an unterminated string holds the rest
    if not brackets:
        return 0
    arr = np.frombuffer(brackets, dtype=np.uint8)
    steps = ((arr == _OPENS[0]) | (arr == _OPENS[1])).astype(np.int32) * 2 - 1
    return max(int(np.cumsum(steps, dtype=np.int64).max()), 0)


def _nesting_with_escapes(raw: bytes) -> int:
    """How deep arrays and objects nest in `raw` (JSON text as UTF-8 bytes), counted outside strings.

    One vectorised pass: a quote opens or closes a string unless an odd run of backslashes precedes it, and a
    bracket counts only outside strings. For text the parser would refuse, an upper bound of the depth it
    reaches before it refuses (up to the first error the parser sees the same strings)."""
    deepest = level = parity = run_in = 0  # carried from chunk to chunk: depth, in a string, trailing backslashes
    for at in range(0, len(raw), _CHUNK):
        arr = np.frombuffer(raw, dtype=np.uint8, count=min(_CHUNK, len(raw) - at), offset=at)
        n = len(arr)
        positions = np.arange(n, dtype=np.int64)
        last_plain = np.maximum.accumulate(np.where(arr != _BACKSLASH, positions, -1))  # last non-backslash
        quotes = np.flatnonzero(arr == _QUOTE)
        before = np.where(quotes > 0, last_plain[np.maximum(quotes - 1, 0)], -1)
        runs = np.where(before >= 0, quotes - 1 - before, quotes + run_in)  # backslashes right before each quote
        toggles = np.zeros(n, dtype=np.int8)
        toggles[quotes[runs % 2 == 0]] = 1
        inside = (np.cumsum(toggles, dtype=np.int32) + parity) & 1
        outside = inside == 0
        opens = ((arr == _OPENS[0]) | (arr == _OPENS[1])) & outside
        closes = ((arr == _CLOSES[0]) | (arr == _CLOSES[1])) & outside
        steps = opens.astype(np.int32) - closes
        if steps.any():
            levels = np.cumsum(steps, dtype=np.int64) + level
            deepest, level = max(deepest, int(levels.max())), int(levels[-1])
        parity = int(inside[-1])
        run_in = run_in + n if last_plain[-1] < 0 else n - 1 - int(last_plain[-1])
    return deepest


def check_depth(raw: bytes, where: str, what: str) -> None:
    """Raises: CheckpointError: `raw` nests deeper than MAX_JSON_DEPTH (named `where`, described as `what`)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return  # cannot nest deeper than it has brackets
    depth = nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise CheckpointError(
            f"{where}: {what} nests arrays/objects {depth:,} deep, more than the {MAX_JSON_DEPTH} that JSON "
            "readers of checkpoints accept (safetensors' among them): the file is corrupt or hostile; re-download it"
        )


def loads(raw: bytes, where: str, what: str, object_pairs_hook: Callable | None = None) -> Any:
    """Parse JSON bytes of at most MAX_JSON_BYTES, nesting at most MAX_JSON_DEPTH deep.

    Raises:
        CheckpointError: too large, too deep, or not valid JSON (named `where`).
    """
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(
            f"{where}: {what} is {len(raw):,} bytes, more than the {MAX_JSON_BYTES:,} mxforge reads "
            "(a real one is a few MB at most): the file is corrupt or hostile"
        )
    check_depth(raw, where, what)
    try:
        return json.loads(raw, object_pairs_hook=object_pairs_hook)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: {what} is not valid JSON ({e})") from None
