"""`mxforge run --stream`: per shard download -> quantize -> pre-upload -> delete the bf16 shard, overlapped.

1. Read the source's file list; download its small files (config, index, tokenizer...) and read every
   shard's safetensors header from the Hub by byte range, so quantize plans the whole checkpoint (and
   refuses bad input) before any shard is downloaded. Report the disk plan and refuse when it cannot fit.
2. Shards flow through three bounded stages at once: `downloads` threads fetch and verify shards (never
   more than `in_flight` bf16 shards on disk), `workers` processes quantize them (quantize's own shard
   job, fsync and rename), and, with a push target, `uploads` threads send each output shard's LFS object
   to the Hub without committing it. A bf16 shard is deleted as soon as its output shard is recorded.
3. Write the index, side files and config.json as quantize does. Fixup, validate and the one commit
   (push: the Hub already holds the shards' objects) are the pipeline's own stages that follow.

Resumable per shard: quantize's state file records each output shard against its source's sha256, and
OUT/mxforge_stream.json records each shard's verified download and its pre-upload (to which repo, which
sha256). A rerun after a kill at any point skips what is recorded and makes the same bytes.
Peak disk: the output plus at most `in_flight` source shards (and their partial downloads).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mxforge.checkpoint import INDEX_NAME, Checkpoint
from mxforge.dir_lock import check_out_dir, directory_lock
from mxforge.disk_space import free_space, require_free_space
from mxforge.errors import CheckpointError, MxforgeError
from mxforge.file_hashes import FileHash, HashCache, file_hash
from mxforge.progress import byte_progress, format_bytes
from mxforge.provenance import QUANTIZE_STATE_NAME, SOURCE_NAME, carried_files, carried_from, fetched_patterns
from mxforge.quantize.result import (
    FiguresRecord,
    FlatRecord,
    TensorCounts,
    read_count,
    read_int,
    read_named,
    read_num,
    read_obj,
    read_str,
)
from mxforge.records import fields_of
from mxforge.safetensors_io import read_header, write_json_atomic

if TYPE_CHECKING:  # annotations only: the Hub and the quantizer are imported when a run needs them
    from mxforge.hub.download import RemoteFile
    from mxforge.hub.session import HubLimits
    from mxforge.quantize.plan import ShardPlan

STREAM_STATE_FORMAT = 1


@dataclass
class StreamOptions:
    source: str  # Hub repo id, or a local checkpoint directory (nothing is downloaded or deleted)
    local: bool
    bf16_dir: Path  # where source shards land (the local source itself when local)
    mxfp4_dir: Path
    state_path: Path
    recipe: str | None
    scale_rule: str | None = None  # --scale-rule (None: the recipe's)
    engines: str | list[str] | None = None  # --engines: the releases the plan must load in (None: every supported)
    revision: str = "main"
    push_repo: str | None = None
    branch: str = "main"
    private: bool = False
    workers: int | None = None
    in_flight: int | None = None  # source shards on disk at once (default: workers + 1)
    downloads: int = 2
    uploads: int = 2
    quiet: bool = False
    command: str | None = None
    follow_symlinks: bool = False
    limits: HubLimits = field(kw_only=True)  # timeouts and retries of every Hub request
    executor: str = "local"  # "local": threads and worker processes here; "ray": one Ray task per shard
    ray_address: str | None = None  # None: a local Ray instance with `workers` CPUs


@dataclass
class StageClock:
    """Busy time and bytes of one stage, and the wall-clock span from its first start to its last end."""

    bytes: int = 0
    busy: float = 0.0
    first: float | None = None
    last: float | None = None
    shards: int = 0

    def add(self, started: float, nbytes: int, ended: float | None = None) -> None:
        """One shard's step, from `started` to `ended` (default now), in time.time() seconds (comparable across
        processes and, for Ray tasks, nodes with synchronized clocks)."""
        ended = time.time() if ended is None else ended
        self.bytes += nbytes
        self.busy += ended - started
        self.first = started if self.first is None else min(self.first, started)
        self.last = ended if self.last is None else max(self.last, ended)
        self.shards += 1

    def figures(self) -> StageFigures:
        span = (self.last - self.first) if self.first is not None and self.last is not None else 0.0
        return StageFigures(
            shards=self.shards,
            bytes=self.bytes,
            busy_seconds=round(self.busy, 3),
            span_seconds=round(span, 3),
            gb_per_s=round(self.bytes / span / 1e9, 4) if span > 0 else None,
        )


@dataclass(frozen=True, kw_only=True)
class StageFigures(FlatRecord):
    """One stage of a streamed run as reported: shards, bytes, busy time, wall-clock span and throughput."""

    shards: int
    bytes: int
    busy_seconds: float
    span_seconds: float
    gb_per_s: float | None

    @classmethod
    def from_dict(cls, d: Any) -> StageFigures:
        d = read_obj(d)
        return cls(
            shards=read_count(d.get("shards")),
            bytes=read_count(d.get("bytes")),
            busy_seconds=read_num(d.get("busy_seconds")) or 0.0,
            span_seconds=read_num(d.get("span_seconds")) or 0.0,
            gb_per_s=read_num(d.get("gb_per_s")),
        )


@dataclass(frozen=True, kw_only=True)
class DiskPlan(FiguresRecord):
    """What a streamed run adds to disk at its peak (plan_disk), against what is there and free."""

    source_bytes: int
    output_bytes: int
    in_flight_source_shards: int
    side_file_bytes: int  # config, index and carried files fetched into bf16/ and their copies in mxfp4/
    peak_bytes: int
    on_disk_bytes: int
    free_bytes: int


@dataclass(frozen=True, kw_only=True)
class StreamShards(FiguresRecord):
    total: int
    streamed_now: int
    done_earlier: int
    quantized_earlier: int


@dataclass(kw_only=True)
class StreamResult:
    """What a streamed (or Ray) run returns and `mxforge run` records as its stream stage's report."""

    STAGE: ClassVar[str] = "stream"
    # The integer figures, each recorded under its field's name (0 where a record lacks it).
    COUNTS: ClassVar[tuple[str, ...]] = (
        "workers",
        "downloads",
        "uploads",
        "in_flight",
        "bytes_in",
        "bytes_out",
        "bytes_processed_now",
        "downloaded_bytes",
        "uploaded_bytes",
    )
    source: str
    commit: str | None  # the Hub source's commit (None: a local source)
    out: str
    push_target: str | None  # REPO@BRANCH the shards' objects went to
    recipe_name: str | None
    recipe_sha256: str | None
    source_precision: str | None
    workers: int
    downloads: int
    uploads: int
    in_flight: int
    shards: StreamShards
    disk_plan: DiskPlan
    executor: str
    peak_source_bytes_on_disk: int | None  # sampled by the local scheduler; None on Ray (each node's own disk)
    stages: dict[str, StageFigures]
    counts: TensorCounts | None
    mtp_layers: list[int]
    mtp_tensors: int | None
    bytes_in: int
    bytes_out: int
    bytes_processed_now: int
    downloaded_bytes: int
    uploaded_bytes: int
    seconds: float
    tool_versions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: dict | None = None  # the quantization error measured (its summary; mxfp4/mxforge_quantize.json: per tensor)

    def as_dict(self) -> dict:
        return {
            "stage": self.STAGE,
            **fields_of(self, "source", "commit", "out", "push_target"),
            "recipe": {"name": self.recipe_name, "sha256": self.recipe_sha256},
            **fields_of(self, "source_precision", "workers", "downloads", "uploads", "in_flight"),
            "shards": self.shards.as_dict(),
            "disk_plan": self.disk_plan.as_dict(),
            **fields_of(self, "executor", "peak_source_bytes_on_disk"),
            "stages": {k: v.as_dict() for k, v in self.stages.items()},
            "counts": self.counts.as_dict() if self.counts else None,
            **fields_of(self, "mtp_layers", "mtp_tensors", "bytes_in", "bytes_out", "bytes_processed_now"),
            **fields_of(self, "downloaded_bytes", "uploaded_bytes", "seconds", "tool_versions", "notes", "error"),
        }

    @classmethod
    def from_dict(cls, d: Any) -> StreamResult:
        """Read back from `mxforge run`'s state file (the summary of a resumed run)."""
        d = read_obj(d)
        recipe = read_obj(d.get("recipe"))
        mtp = d.get("mtp_layers")
        return cls(
            source=read_str(d.get("source")) or "",
            commit=read_str(d.get("commit")),
            out=read_str(d.get("out")) or "",
            push_target=read_str(d.get("push_target")),
            recipe_name=read_str(recipe.get("name")),
            recipe_sha256=read_str(recipe.get("sha256")),
            source_precision=read_str(d.get("source_precision")),
            shards=StreamShards.from_dict(d.get("shards")),
            disk_plan=DiskPlan.from_dict(d.get("disk_plan")),
            executor=read_str(d.get("executor")) or "local",
            peak_source_bytes_on_disk=read_int(d.get("peak_source_bytes_on_disk")),
            stages={k: StageFigures.from_dict(v) for k, v in read_obj(d.get("stages")).items()},
            counts=TensorCounts.from_dict(d.get("counts")),
            mtp_layers=[i for i in mtp if read_int(i) is not None] if isinstance(mtp, list) else [],
            mtp_tensors=read_int(d.get("mtp_tensors")),
            **read_named(d, read_count, *cls.COUNTS),
            seconds=read_num(d.get("seconds")) or 0.0,
            tool_versions={k: v for k, v in read_obj(d.get("tool_versions")).items() if isinstance(v, str)},
            notes=[n for n in d.get("notes") or [] if isinstance(n, str)],
            error=d.get("error") if isinstance(d.get("error"), dict) else None,
        )


@dataclass
class _Shard:
    plan: ShardPlan
    remote: RemoteFile | None = None  # None for a local source
    verified: tuple[int, int] | None = None  # (size, mtime_ns) at which the bf16 shard was verified
    source_sha256: str | None = None
    step: str = "download"  # download -> quantize -> upload -> done
    started: float = 0.0


@dataclass
class _State:
    """OUT/mxforge_stream.json: the source commit, and per shard its verified download and its pre-upload."""

    path: Path
    data: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path, source: str, commit: str | None) -> "_State":
        import json

        try:
            data = json.loads(path.read_text())
            if not (
                isinstance(data, dict)
                and data.get("format") == STREAM_STATE_FORMAT
                and data.get("source") == source
                and data.get("commit") == commit
            ):
                data = {}
        except (OSError, ValueError):
            data = {}
        data = data or {"format": STREAM_STATE_FORMAT, "source": source, "commit": commit}
        data.setdefault("downloaded", {})
        data.setdefault("uploaded", {})
        return cls(path, data)

    def save(self) -> None:
        write_json_atomic(self.path, self.data)


def _begin(s: _Shard) -> _Shard:
    """Stamp the start of a shard's step (StageClock), as it is handed to its lane."""
    s.started = time.time()
    return s


def plan_disk(output_bytes: int, source_sizes: list[int], in_flight: int) -> int:
    """Peak bytes a streamed run adds to disk: the whole output plus the `in_flight` largest source shards."""
    return output_bytes + sum(sorted(source_sizes, reverse=True)[:in_flight])


def choose_stream(source_bytes: int, free_bytes: int) -> bool:
    """Whether a Hub source must be streamed: a sequential run keeps the whole source and the output (never
    larger than the source) on disk at once, so it needs up to twice the source's size."""
    return 2 * source_bytes > free_bytes


class StreamRun:
    def __init__(self, opts: StreamOptions):
        self.o = opts
        self.clocks = {"download": StageClock(), "quantize": StageClock(), "upload": StageClock()}
        self.peak_source_bytes = 0
        self.sha256_from_download = 0
        self.notes: list[str] = []
        self.commit: str | None = None  # the Hub source's commit (None for a local source)

    # --- 1: source, plan, disk plan -------------------------------------------------------------------
    def _say(self, text: str) -> None:
        self.notes.append(text)
        if not self.o.quiet:
            print(f"mxforge run: {text}", file=sys.stderr)

    def _open_source(self):
        """(checkpoint with every header, remote files by name or None, commit or None)."""
        o = self.o
        if o.local:
            ckpt = Checkpoint.open(o.bf16_dir, o.follow_symlinks)
            self.carried = carried_from(o.bf16_dir, ckpt.shard_names)
            written = [o.bf16_dir / n for n in (*self.carried.names, "config.json", INDEX_NAME)]
            self.side_bytes = {"fetched": 0, "copied": sum(p.stat().st_size for p in written if p.is_file())}
            return ckpt, None, None
        from huggingface_hub import HfApi

        from mxforge.hub.download import fetch_verified, remote_files, source_record_entry, write_source_record
        from mxforge.hub.session import fresh_connections, use_hub_limits
        from mxforge.hub.source import HubSource
        from mxforge.safe_paths import check_remote_name

        use_hub_limits(o.limits)
        fresh_connections()
        self.api = api = HfApi()
        commit, files = remote_files(api, o.source, o.revision, o.limits)
        for f in files:
            check_remote_name(f.name, f"{o.source}@{o.revision}")
        self.commit = commit
        o.bf16_dir.mkdir(parents=True, exist_ok=True)
        by_name = {f.name: f for f in files}
        first = [by_name[n] for n in ("config.json", INDEX_NAME) if n in by_name]
        hashes = {f.name: fetch_verified(api, o.source, commit, o.bf16_dir, f, o.limits) for f in first}
        ckpt = Checkpoint.open(o.bf16_dir)  # config.json and the index, downloaded and verified just now
        missing = [s for s in ckpt.shard_names if s not in by_name]
        if missing:
            raise MxforgeError(
                f"{o.source}@{commit[:12]}: {INDEX_NAME} names shard {missing[0]!r}, which the repo does "
                f"not hold ({len(missing)} such); the source repo is incomplete",
                repo_id=o.source,
            )
        # Only what the product carries is fetched (besides the shards); the rest is named once, not downloaded.
        shards = set(ckpt.shard_names)
        self.carried = carried_files([n for n in by_name if n not in shards])
        small = [*first, *(by_name[n] for n in self.carried.names)]
        later = small[len(first) :]
        hashes.update({f.name: fetch_verified(api, o.source, commit, o.bf16_dir, f, o.limits) for f in later})
        fetched = sum(f.size for f in small)
        self.side_bytes = {"fetched": fetched, "copied": fetched}  # each one is copied into OUT/mxfp4 (or rewritten)
        fetching = {f.name for f in small} | shards
        files = [f for f in files if f.name in fetching]  # what this run fetches, as its source record says
        headers = {}
        for name in ckpt.shard_names:
            local = o.bf16_dir / name
            try:  # a shard an earlier run left whole (it is verified before use): its own header
                if local.stat().st_size == by_name[name].size:
                    headers[name] = read_header(local)
            except (OSError, CheckpointError):
                pass
        remote = [name for name in ckpt.shard_names if name not in headers]
        if remote:  # the rest from the Hub by byte ranges, as validate reads a Hub repo (cached by commit)
            hub = HubSource(o.source, commit, o.limits)
            hub.prefetch_headers(remote)
            for name in remote:
                headers[name] = hub.read_header(name)
                if hub.file_sizes[name] != by_name[name].size:
                    raise CheckpointError(
                        f"{hub.where(name)}: the Hub serves {hub.file_sizes[name]:,} bytes, its file "
                        f"list says {by_name[name].size:,}; the source repo is broken or hostile",
                        filename=name,
                        repo_id=o.source,
                    )
        ckpt.headers = headers  # the cached property, filled from the Hub: planning needs no shard on disk
        for f in files:  # provenance as `mxforge download` records it; shards by the Hub's sha256, verified on arrival
            if f.name not in hashes:
                hashes[f.name] = FileHash(f.name, f.size, f.sha256 or "", f.blob_id or "")
        write_source_record(
            o.bf16_dir,
            repo_id=o.source,
            revision=o.revision,
            commit=commit,
            files=[source_record_entry(f, hashes[f.name]) for f in files],
            include=fetched_patterns(),  # what a run fetches, as the sequential run's download records it
            exclude=None,
            command=o.command,
        )
        return ckpt, by_name, commit

    def run(self) -> StreamResult:
        """Stream every shard not yet done, then write the index, side files and config.json; returns the report.
        Holds the lock (dir_lock) of every directory it writes: OUT/mxfp4 and, for a Hub source, OUT/bf16.

        Raises:
            DirectoryInUse: another mxforge process works in one of them.
            DiskSpaceError: the output plus the in-flight source shards cannot fit (before any shard is fetched).
            MxforgeError: any stage's error (download, verify, quantize, pre-upload), unchanged; finished
                shards stay recorded for the rerun.
        """
        with contextlib.ExitStack() as locks:
            locks.enter_context(directory_lock(self.o.mxfp4_dir))
            if not self.o.local:
                locks.enter_context(directory_lock(self.o.bf16_dir))
            return self._run()

    def _run(self) -> StreamResult:
        from mxforge.fixups.plan_check import plan_checker
        from mxforge.quantize.plan import plan_checkpoint
        from mxforge.quantize.recipe import load_recipe
        from mxforge.quantize.run import (
            default_workers,
            finish_checkpoint,
            remove_strays,
            write_provenance,
        )
        from mxforge.quantize.state import ResumeState, tool_versions

        o = self.o
        started = time.monotonic()
        self.commit = None
        ckpt, remote, commit = self._open_source()
        recipe = load_recipe(o.recipe, ckpt.config).with_scale_rule(o.scale_rule)  # None: the family's default
        self.recipe = recipe
        plan = plan_checkpoint(ckpt, recipe)
        # refused before any shard is streamed if a release could not load it
        plan_checker(o.engines)(plan, recipe, ckpt)
        plan.refuse_cross_shard_scales("a streamed run deletes each source shard once it is quantized")
        to_copy = self.carried.names + ([] if o.local else [SOURCE_NAME])  # the source record _open_source wrote
        note = self.carried.note()
        if note:
            self._say(note)
        check_out_dir(o.bf16_dir, o.mxfp4_dir, QUANTIZE_STATE_NAME, "quantize")
        o.mxfp4_dir.mkdir(parents=True, exist_ok=True)
        qstate = ResumeState(o.mxfp4_dir, recipe.sha256, tool_versions(), recipe.scale_rule)
        state = _State.load(o.state_path, o.source, commit)
        if o.push_repo:
            target = f"{o.push_repo}@{o.branch}"
            if state.data.get("push_target") != target:
                state.data["uploaded"] = {}
                state.data["push_target"] = target
        shards = [self._shard_status(s, remote, qstate, state) for s in plan.shards]
        qstate.save()
        state.save()
        remove_strays(o.mxfp4_dir, plan)
        workers = o.workers or default_workers(len(plan.shards))
        in_flight = max(1, o.in_flight or workers + 1)
        self._check_disk(plan, shards, in_flight)
        todo = [s for s in shards if s.step != "done"]
        if o.push_repo and todo:  # the repo (empty until push's commit) must exist to receive objects
            from mxforge.hub.push import prepare_repo

            self._hub_call(lambda: prepare_repo(self.api_for_push(), o.push_repo, o.branch, o.private, o.limits))
        if todo and o.executor == "ray":
            from mxforge.run.ray_executor import run_on_ray

            run_on_ray(self, todo, qstate, state, address=o.ray_address, workers=workers)
        elif todo:
            self._stream(todo, qstate, state, workers=workers, in_flight=in_flight)
        accounted = finish_checkpoint(o.bf16_dir, o.mxfp4_dir, recipe=recipe, ckpt=ckpt, plan=plan, side_files=to_copy)
        elapsed = time.monotonic() - started
        quantized = self.clocks["quantize"]
        written = write_provenance(
            o.bf16_dir,
            o.mxfp4_dir,
            recipe=recipe,
            plan=plan,
            device="cpu",
            workers=workers,
            state=qstate,
            quantized_now=quantized.shards,
            skipped=len(shards) - quantized.shards,
            bytes_read=quantized.bytes,
            elapsed=elapsed,
            accounted=accounted,
            command=o.command,
            sha256_from_download=self.sha256_from_download,
        )
        report = self._report(
            recipe=recipe,
            plan=plan,
            shards=shards,
            todo=todo,
            workers=workers,
            in_flight=in_flight,
            accounted=accounted,
            elapsed=elapsed,
        )
        # The error measured while quantizing (mxfp4/mxforge_quantize.json has the per-tensor figures).
        report.error = {k: v for k, v in written.error.items() if k != "tensors"} if written.error else None
        return report

    def _shard_status(self, s, remote, qstate, state) -> _Shard:
        """Where one shard stands, from the state files and the disk."""
        o = self.o
        shard = _Shard(s)
        if o.local:
            done = qstate.is_done(s.name, o.bf16_dir, o.mxfp4_dir, s.header_sha256)
            shard.source_sha256 = qstate.shards[s.name]["source_sha256"] if done else None
        else:
            f = remote[s.name]
            shard.remote, shard.source_sha256 = f, f.sha256
            done = qstate.output_done(s.name, o.mxfp4_dir, s.header_sha256, f.sha256)
            path = o.bf16_dir / s.name
            if done:
                path.unlink(missing_ok=True)  # quantized and recorded, then killed before the delete
                state.data["downloaded"].pop(s.name, None)
            else:
                rec = state.data["downloaded"].get(s.name)
                try:
                    st = path.stat()
                    if rec and rec.get("sha256") == f.sha256 and [st.st_size, st.st_mtime_ns] == rec.get("stamp"):
                        shard.verified = (st.st_size, st.st_mtime_ns)
                except FileNotFoundError:
                    state.data["downloaded"].pop(s.name, None)
        if not done:
            qstate.forget(s.name)
            shard.step = "quantize" if (o.local or shard.verified) else "download"
        elif o.push_repo and not self._uploaded(s.name, state):
            shard.step = "upload"
        else:
            shard.step = "done"
        return shard

    def _uploaded(self, name: str, state: _State) -> bool:
        rec = state.data["uploaded"].get(name)
        cached = HashCache(self.o.mxfp4_dir).get(name)
        return bool(rec and cached is not None and rec == cached.sha256)

    def _check_disk(self, plan, shards: list[_Shard], in_flight: int) -> None:
        o = self.o
        output = sum(s.output_size for s in plan.shards)
        side = self.side_bytes["fetched"] + self.side_bytes["copied"]  # config, index, carried files and copies
        peak = side + plan_disk(
            output,
            [] if o.local else [s.plan.source_size for s in shards if s.step in ("download", "quantize")],
            in_flight,
        )
        have = sum((o.mxfp4_dir / s.plan.name).stat().st_size for s in shards if s.step in ("upload", "done")) + (
            0 if o.local else sum(s.plan.source_size for s in shards if s.verified) + self.side_bytes["fetched"]
        )
        _, free = free_space(o.mxfp4_dir)
        source = sum(s.plan.source_size for s in shards)
        self.disk_plan = DiskPlan(
            source_bytes=source,
            output_bytes=output,
            in_flight_source_shards=in_flight,
            side_file_bytes=side,
            peak_bytes=peak,
            on_disk_bytes=have,
            free_bytes=free,
        )
        self._say(
            f"streaming {len(shards)} shard(s), at most {in_flight} bf16 shard(s) on disk at once: peak disk "
            f"{format_bytes(peak)} (output {format_bytes(output)} + source shards in flight + {format_bytes(side)} "
            "of config, index and carried files with their copies), against "
            f"{format_bytes(source)} of source; {format_bytes(free)} free"
        )
        require_free_space(
            o.mxfp4_dir,
            peak - have,
            what=f"the streamed run's output ({format_bytes(output)}) and {in_flight} source shard(s) in flight",
            remedy="free space, or lower --in-flight",
        )

    # --- 2: the overlapped stages -------------------------------------------------------------------
    def _stream(self, todo: list[_Shard], qstate, state: _State, *, workers: int, in_flight: int) -> None:
        """download -> quantize -> finish -> upload per shard, through quantize's shard scheduler."""
        from mxforge.hub.transfer import CANCEL
        from mxforge.quantize.scheduler import ShardScheduler, ShardWorkers, Step, Threads, quantize_steps
        from mxforge.quantize.shard_job import ShardJob

        o = self.o
        offsets = self.recipe.scale_offsets

        def job(s: _Shard) -> ShardJob:
            return ShardJob(
                str(o.bf16_dir),
                str(o.mxfp4_dir),
                s.plan,
                expected_sha256=s.source_sha256,
                verified_stat=s.verified,
                scale_offsets=offsets,
            )

        quantizing = [s for s in todo if s.step in ("download", "quantize")]
        # Always processes (one worker too): the scheduler's thread keeps downloads and uploads going meanwhile.
        pool = ShardWorkers(min(workers, max(1, len(quantizing))), [job(s) for s in quantizing], processes=True)
        downloads = Threads(o.downloads, "download", on_interrupt=CANCEL.set)  # a cancelled one keeps its partial
        uploads = Threads(o.uploads, "upload")
        finishers = Threads(workers, "fsync", wait_on_failure=True)

        def on_disk() -> int:  # bf16 shards downloading, downloaded or being quantized
            return sum(1 for s in todo if s.step in ("download", "quantize") and (s.verified or sched.is_running(s)))

        def quantized(s: _Shard, result) -> str | None:
            self.record_quantized(s, result, qstate, state)
            if not o.local:
                (o.bf16_dir / s.plan.name).unlink(missing_ok=True)
            return s.step if s.step != "done" else None

        steps = [
            Step(
                "download",
                downloads,
                self._download,
                args=lambda s, previous: (_begin(s), dl_bar),
                admit=lambda s: sched.busy("download") < o.downloads and on_disk() < in_flight,
                done=lambda s, stamp: self.record_download(s, stamp, state),
            ),
            *quantize_steps(
                pool,
                finishers,
                o.mxfp4_dir,
                job=lambda s: job(_begin(s)),
                name=lambda s: s.plan.name,
                recorded=quantized,
                admit=lambda s: (o.local or s.verified is not None) and sched.busy("quantize", "finish") < workers,
            ),
            Step(
                "upload",
                uploads,
                self.upload_shard,
                args=lambda s, previous: (_begin(s),),
                admit=lambda s: sched.busy("upload") < o.uploads,
                done=lambda s, fh: self.record_upload(s, fh, state),
            ),
        ]
        sched: ShardScheduler[_Shard] = ShardScheduler(
            steps,
            on_tick=lambda: setattr(
                self, "peak_source_bytes", max(self.peak_source_bytes, self._source_bytes_on_disk(todo))
            ),
        )
        CANCEL.clear()
        sched.start()  # the worker processes fork before the progress bars' thread exists
        pool.bar = bar = byte_progress(
            sum(s.plan.source_size for s in quantizing), "stream (quantized)", disable=o.quiet
        )
        dl_bar = byte_progress(
            sum(s.plan.source_size for s in todo if s.step == "download"), "download", disable=o.quiet
        )
        try:
            sched.run(todo, lambda s: s.step if s.step != "done" else None)
        finally:
            bar.close()
            dl_bar.close()

    # Each step's outcome, recorded (by the one thread that runs the scheduler) as soon as it is known.
    def record_download(self, s: _Shard, stamp: tuple[int, int], state: _State) -> str:
        assert s.remote is not None, "only a Hub source's shards are downloaded"
        self.clocks["download"].add(s.started, s.plan.source_size)
        s.verified, s.source_sha256 = stamp, s.remote.sha256
        state.data["downloaded"][s.plan.name] = {"sha256": s.source_sha256, "stamp": list(stamp)}
        state.save()
        s.step = "quantize"
        return s.step

    def record_quantized(self, s: _Shard, result, qstate, state: _State, *, clock: bool = True) -> None:
        """The output shard is in place: record it; its bf16 shard is no longer needed (the caller deletes it)."""
        qstate.record(result)
        self.sha256_from_download += result.sha256_from_download
        if clock:
            self.clocks["quantize"].add(s.started, s.plan.source_size)
        if state.data["downloaded"].pop(s.plan.name, None) is not None:
            state.save()
        s.verified = None
        s.step = "upload" if self.o.push_repo else "done"

    def record_upload(self, s: _Shard, fh: FileHash, state: _State, *, clock: bool = True) -> None:
        """The output shard's object is on the Hub: record it; the shard is done."""
        cache = HashCache(self.o.mxfp4_dir)  # push's model card reads the hashes from here, without a re-read
        cache.put(fh)
        cache.save()
        state.data["uploaded"][s.plan.name] = fh.sha256
        state.save()
        if clock:
            self.clocks["upload"].add(s.started, s.plan.output_size)
        s.step = "done"

    def api_for_push(self):
        from huggingface_hub import HfApi

        if getattr(self, "push_api", None) is None:
            from mxforge.hub.session import use_hub_limits

            use_hub_limits(self.o.limits)
            self.push_api = HfApi()
        return self.push_api

    def _hub_call(self, call):
        from mxforge.hub.errors import raise_as_hub_error

        try:
            return call()
        except MxforgeError:
            raise
        except Exception as e:
            raise_as_hub_error(e, repo_id=self.o.push_repo, revision=self.o.branch, action="push to")
            raise

    def _download(self, s: _Shard, bar) -> tuple[int, int]:
        from mxforge.hub.download import fetch_verified
        from mxforge.quantize.plan import check_planned_header

        assert self.commit is not None and s.remote is not None, "only a Hub source's shards are downloaded"
        fetch_verified(self.api, self.o.source, self.commit, self.o.bf16_dir, s.remote, self.o.limits, bar)
        check_planned_header(self.o.bf16_dir / s.plan.name, s.plan)
        st = (self.o.bf16_dir / s.plan.name).stat()
        return st.st_size, st.st_mtime_ns

    def upload_shard(self, s: _Shard) -> FileHash:
        from mxforge.hub.push import preupload_file

        assert self.o.push_repo is not None, "a shard is uploaded only with a push target"
        path = self.o.mxfp4_dir / s.plan.name
        fh = file_hash(path, s.plan.name)
        preupload_file(self.api_for_push(), self.o.mxfp4_dir, self.o.push_repo, self.o.branch, fh)
        return fh

    def _source_bytes_on_disk(self, todo: list[_Shard]) -> int:
        """bf16 bytes on disk now: each source shard's file, else its unfinished download. The download is looked at
        first, so one renamed into place meanwhile counts once (summing all partials, then all files, had counted
        such a shard twice under load)."""
        if self.o.local:
            return 0
        from mxforge.hub.transfer import partial_bytes_by_file

        partials = partial_bytes_by_file(self.o.bf16_dir)
        total = 0
        for s in todo:
            try:
                total += (self.o.bf16_dir / s.plan.name).stat().st_size
            except FileNotFoundError:
                total += partials.get(s.plan.name, 0)
        return total

    # --- 3: report ------------------------------------------------------------------------------------
    def _report(
        self, *, recipe, plan, shards, todo, workers: int, in_flight: int, accounted: dict, elapsed: float
    ) -> StreamResult:
        from mxforge.quantize.state import tool_versions

        o = self.o
        return StreamResult(
            source=o.source,
            commit=self.commit,
            out=str(o.mxfp4_dir),
            push_target=f"{o.push_repo}@{o.branch}" if o.push_repo else None,
            recipe_name=recipe.name,
            recipe_sha256=recipe.sha256,
            source_precision=plan.precision.describe(),
            workers=workers,
            downloads=o.downloads,
            uploads=o.uploads,
            in_flight=in_flight,
            shards=StreamShards(
                total=len(shards),
                streamed_now=len(todo),
                done_earlier=len(shards) - len(todo),
                quantized_earlier=len(shards) - self.clocks["quantize"].shards,
            ),
            disk_plan=self.disk_plan,
            executor=o.executor,
            peak_source_bytes_on_disk=self.peak_source_bytes if o.executor == "local" else None,
            stages={k: c.figures() for k, c in self.clocks.items()},
            counts=TensorCounts(quantized=accounted["quantized"], kept=accounted["kept"], copied=accounted["copied"]),
            mtp_layers=list(plan.layout.mtp_layers),
            mtp_tensors=accounted["mtp_tensors"],
            bytes_in=sum(s.source_size for s in plan.shards),
            bytes_out=sum(s.output_size for s in plan.shards),
            bytes_processed_now=self.clocks["quantize"].bytes,
            downloaded_bytes=self.clocks["download"].bytes,
            uploaded_bytes=self.clocks["upload"].bytes,
            seconds=round(elapsed, 3),
            tool_versions=tool_versions(),
            notes=self.notes,
        )
