"""tqdm progress over bytes, showing GB/s and ETA; silent when disabled or not wanted."""

from __future__ import annotations

from tqdm import tqdm


def byte_progress(total: int, desc: str, disable: bool = False) -> tqdm:
    """A byte counter shown in decimal units (GB, GB/s) with ETA, on stderr."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                disable=disable, dynamic_ncols=True, smoothing=0.1, mininterval=0.5)
