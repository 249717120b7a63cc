"""Bytes shown to people: tqdm progress (GB/s, ETA; silent when disabled) and byte counts in messages."""

from __future__ import annotations

from tqdm import tqdm


def byte_progress(total: int, desc: str, disable: bool = False) -> tqdm:
    """A byte counter shown in decimal units (GB, GB/s) with ETA, on stderr."""
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        disable=disable,
        dynamic_ncols=True,
        smoothing=0.1,
        mininterval=0.5,
    )


def format_bytes(n: int) -> str:
    """Exact bytes, and from 1 kB also in the largest decimal unit that keeps it >= 1, to 3 figures:
    "950 bytes", "10,485,760 bytes (10.5 MB)". Two different sizes never read the same."""
    text = f"{n:,} bytes"
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{text} ({v:.{0 if v >= 100 else 1 if v >= 10 else 2}f} {unit})"
    return text


def fetched_line(stats: dict) -> str:
    """`fetched 1.2 MB in 34 requests: 0.31% of the 402 MB the files read hold (commit abc123)`."""
    if not stats["requests"]:
        return f"fetched nothing: commit {stats['commit'][:12]} was read from the cache ({stats['cache']})"
    return (
        f"fetched {format_bytes(stats['bytes_fetched'])} in {stats['requests']} ranged requests: "
        f"{100 * stats['fraction']:.2f}% of the {format_bytes(stats['files_bytes'])} of the {stats['files_read']} "
        f"files read (commit {stats['commit'][:12]})"
    )
