"""What `mxforge quantize` returns and records: QuantizeResult, written as OUT/mxforge_quantize.json (`as_dict`,
the same JSON document as before it was typed) and read back from it (`from_dict`: the run summary of a resumed
run, the model card). A record written by an older mxforge, or missing a field, reads as None there ("not
recorded"); a value of the wrong type reads as None too: a record is a description, never trusted input.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Self

from mxforge.records import fields_of


# Readers of a recorded JSON value, for the from_dict of every stage result: the value if of the type, else None.
def read_str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def read_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def read_count(v: Any) -> int:
    """A recorded count: 0 where it is missing or not an integer."""
    return read_int(v) or 0


def read_num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def read_obj(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def read_named(d: Any, read: Callable[[Any], Any], *names: str) -> dict[str, Any]:
    """Each of `names`, read from the recorded object `d` by `read` (a read_* above)."""
    d = read_obj(d)
    return {name: read(d.get(name)) for name in names}


def read_fields(cls: type, d: Any, read: Callable[[Any], Any]) -> dict[str, Any]:
    """Each field of the dataclass `cls`, read from the recorded object `d` by `read`."""
    return read_named(d, read, *(f.name for f in fields(cls)))


@dataclass(frozen=True, kw_only=True)
class FlatRecord:
    """A record whose JSON object is its fields, by name, in their declared order (scalars only)."""

    def as_dict(self) -> dict:
        return fields_of(self, *(f.name for f in fields(self)))


@dataclass(frozen=True, kw_only=True)
class FiguresRecord(FlatRecord):
    """Integer figures of a report: each reads back as 0 where it is not recorded."""

    @classmethod
    def from_dict(cls, d: Any) -> Self:
        return cls(**read_fields(cls, d, read_count))


@dataclass(frozen=True, kw_only=True)
class CountsRecord(FlatRecord):
    """Counts recorded together: read back whole or not at all (None: an older or damaged record)."""

    @classmethod
    def from_dict(cls, d: Any) -> Self | None:
        values = read_fields(cls, d, read_int)
        return None if None in values.values() else cls(**values)


@dataclass(frozen=True, kw_only=True)
class RecipeRecord(FlatRecord):
    """The recipe a checkpoint was quantized with (quantize/recipe.py)."""

    name: str | None
    sha256: str | None
    source: str | None  # the TOML's path, or the shipped recipe's name
    scheme: str | None
    format: str | None  # the element format's registry name (mxforge/formats)
    scale_rule: str | None

    @classmethod
    def from_dict(cls, d: Any) -> RecipeRecord:
        return cls(**read_fields(cls, d, read_str))


@dataclass(frozen=True, kw_only=True)
class TensorCounts(CountsRecord):
    """Source tensors by fate: quantized, 2-D weights kept (bf16), FP8 weights kept as the source stores them, others
    copied byte for byte."""

    quantized: int
    kept: int
    copied: int
    kept_source: int = 0

    @classmethod
    def from_dict(cls, d: Any) -> Self | None:
        """As recorded; a report from before FP8 could be kept as stored has no kept_source: it kept none."""
        return super().from_dict({"kept_source": 0, **d} if isinstance(d, dict) else d)


@dataclass(frozen=True, kw_only=True)
class ShardCounts(CountsRecord):
    total: int
    quantized_now: int
    skipped_complete: int  # complete and still valid from an earlier run


@dataclass(kw_only=True)
class QuantizeResult:
    """The quantize report (OUT/mxforge_quantize.json). Fields as in the JSON document, in its order."""

    STAGE: ClassVar[str] = "quantize"
    source: str | None  # SRC, resolved
    out: str | None  # OUT, resolved
    recipe: RecipeRecord
    source_precision: str | None  # "bf16", or the FP8 layout read as bf16 (fp8_source.SourcePrecision.describe)
    family: str | None  # the model family's title (mxforge.models)
    device: str | None
    workers: int | None
    shards: ShardCounts | None
    shards_sha256_from_download: int | None  # shards whose download-verified sha256 was reused, not recomputed
    counts: TensorCounts | None
    fp8_scales_consumed: int | None  # FP8 sources: weight and input scale tensors consumed, not written
    mtp_layers: list[int] | None
    mtp_tensors: int | None
    bytes_in: int | None
    bytes_out: int | None
    bytes_processed_now: int | None
    seconds: float | None
    gb_per_s: float | None
    tool_versions: dict[str, str] = field(default_factory=dict)
    command: str | None = None
    tensors: dict[str, list[str]] | None = None  # per fate, every tensor name (only in mxforge_quantize.json)
    error: dict | None = None  # error_report.error_report(); None: not measured
    fixups_dropped: int = 0  # fixups an earlier `mxforge fixup` applied to OUT, gone with config.json written anew

    def as_dict(self) -> dict:
        out = {
            "stage": self.STAGE,
            "source": self.source,
            "out": self.out,
            "recipe": self.recipe.as_dict(),
            "source_precision": self.source_precision,
            "family": self.family,
            "device": self.device,
            "workers": self.workers,
            "shards": self.shards.as_dict() if self.shards else None,
            "shards_sha256_from_download": self.shards_sha256_from_download,
            "counts": self.counts.as_dict() if self.counts else None,
            "fp8_scales_consumed": self.fp8_scales_consumed,
            "mtp_layers": self.mtp_layers,
            "mtp_tensors": self.mtp_tensors,
            "fixups_dropped": self.fixups_dropped,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "bytes_processed_now": self.bytes_processed_now,
            "seconds": self.seconds,
            "gb_per_s": self.gb_per_s,
            "tool_versions": self.tool_versions,
            "command": self.command,
        }
        if self.tensors is not None:
            out["tensors"] = self.tensors
        out["error"] = self.error
        return out

    def summary(self) -> QuantizeResult:
        """The same without the per-tensor lists (what `mxforge run` keeps in its state file)."""
        from dataclasses import replace

        error = {k: v for k, v in self.error.items() if k != "tensors"} if self.error else self.error
        return replace(self, tensors=None, error=error)

    @classmethod
    def from_dict(cls, d: Any) -> QuantizeResult:
        d = read_obj(d)
        mtp = d.get("mtp_layers")
        tensors = d.get("tensors")
        return cls(
            source=read_str(d.get("source")),
            out=read_str(d.get("out")),
            recipe=RecipeRecord.from_dict(d.get("recipe")),
            source_precision=read_str(d.get("source_precision")),
            family=read_str(d.get("family")),
            device=read_str(d.get("device")),
            workers=read_int(d.get("workers")),
            shards=ShardCounts.from_dict(d.get("shards")),
            shards_sha256_from_download=read_int(d.get("shards_sha256_from_download")),
            counts=TensorCounts.from_dict(d.get("counts")),
            fp8_scales_consumed=read_int(d.get("fp8_scales_consumed")),
            mtp_layers=[i for i in mtp if read_int(i) is not None] if isinstance(mtp, list) else None,
            mtp_tensors=read_int(d.get("mtp_tensors")),
            fixups_dropped=read_int(d.get("fixups_dropped")) or 0,
            bytes_in=read_int(d.get("bytes_in")),
            bytes_out=read_int(d.get("bytes_out")),
            bytes_processed_now=read_int(d.get("bytes_processed_now")),
            seconds=read_num(d.get("seconds")),
            gb_per_s=read_num(d.get("gb_per_s")),
            tool_versions={k: v for k, v in read_obj(d.get("tool_versions")).items() if isinstance(v, str)},
            command=read_str(d.get("command")),
            tensors=tensors if isinstance(tensors, dict) else None,
            error=d.get("error") if isinstance(d.get("error"), dict) else None,
        )
