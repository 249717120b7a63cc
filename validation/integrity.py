"""Engine-independent checks: the index and the shards agree, headers parse, sizes add up."""

from __future__ import annotations

from mxforge.checkpoint import INDEX_NAME, Checkpoint
from mxforge.errors import CheckpointError
from mxforge.safetensors_io import ShardHeader
from mxforge.validation.report import Problem

REDOWNLOAD = "re-download or re-create the shard"


TOTAL_SIZE = f"{INDEX_NAME}:metadata.total_size"


def check_index_and_shards(ckpt: Checkpoint) -> tuple[list[Problem], list[Problem], dict, dict[str, ShardHeader]]:
    """Every index key once, every shard present and parseable, no orphans; total_size right.

    Returns the problems, the warnings (what no engine reads: total_size, which Quark's file-to-file export
    counts in whole file bytes), counts of what was checked, and the headers that parsed (by shard name).
    """
    problems: list[Problem] = []
    source = ckpt.source
    for key in ckpt.duplicate_index_keys:
        problems.append(
            Problem(
                "integrity",
                f"{INDEX_NAME}:{key}",
                "tensor listed more than once in weight_map",
                "keep one entry per tensor (the shard that really holds it)",
            )
        )
    headers = {}
    for shard in ckpt.shard_names:
        if not source.exists(shard):
            problems.append(
                Problem(
                    "integrity",
                    shard,
                    "named by the index but missing from the checkpoint",
                    f"{REDOWNLOAD}, or fix the index",
                )
            )
            continue
        try:
            headers[shard] = source.read_header(shard)
        except CheckpointError as e:
            # The reader's own advice ("...; re-download it") is this problem's remedy, said once.
            what = str(e).removeprefix(f"{source.where(shard)}: ").removesuffix("; re-download it")
            problems.append(Problem("integrity", shard, what, REDOWNLOAD))
    total = 0
    for name, shard in ckpt.weight_map.items():
        header = headers.get(shard)
        if header is None:
            continue
        info = header.tensors.get(name)
        if info is None:
            problems.append(
                Problem(
                    "integrity",
                    name,
                    f"index maps it to {shard}, whose header does not hold it",
                    "fix the index or restore the tensor",
                )
            )
        else:
            total += info.nbytes
    for shard, header in headers.items():
        for name in header.tensors:
            if ckpt.weight_map.get(name) != shard:
                problems.append(
                    Problem(
                        "integrity",
                        f"{shard}:{name}",
                        "tensor in the shard is not mapped to it by the index",
                        "add it to the index's weight_map or remove it from the shard",
                    )
                )
    referenced = set(ckpt.shard_names)
    unreferenced = [n for n in source.file_names() if n.endswith(".safetensors") and n not in referenced]
    for name in unreferenced:
        problems.append(
            Problem(
                "integrity",
                name,
                "safetensors file not referenced by the index",
                "remove it, or add its tensors to the index",
            )
        )
    warnings = []
    declared = ckpt.index_metadata.get("total_size")
    if ckpt.has_index and not problems and declared != total:
        warnings.append(
            Problem(
                "index",
                TOTAL_SIZE,
                f"says {declared} but the tensors hold {total} bytes (no engine "
                "reads it; Quark's file-to-file export counts whole files)",
                "run mxforge fixup (sets it)",
            )
        )
    counts = {"shards": len(ckpt.shard_names), "tensors": len(ckpt.weight_map), "bytes": total}
    return problems, warnings, counts, headers
