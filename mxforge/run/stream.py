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

import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mxforge.checkpoint import INDEX_NAME, Checkpoint
from mxforge.dir_lock import check_out_dir
from mxforge.disk_space import free_space, require_free_space
from mxforge.errors import CheckpointError, MxforgeError
from mxforge.file_hashes import FileHash, HashCache, file_hash
from mxforge.progress import byte_progress, format_bytes
from mxforge.provenance import QUANTIZE_STATE_NAME
from mxforge.safetensors_io import partial_path, read_header, write_json_atomic

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

    def as_dict(self) -> dict:
        span = (self.last - self.first) if self.first is not None and self.last is not None else 0.0
        return {
            "shards": self.shards,
            "bytes": self.bytes,
            "busy_seconds": round(self.busy, 3),
            "span_seconds": round(span, 3),
            "gb_per_s": round(self.bytes / span / 1e9, 4) if span > 0 else None,
        }


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
            return Checkpoint.open(o.bf16_dir, o.follow_symlinks), None, None
        from huggingface_hub import HfApi

        from mxforge.hub.download import fetch_verified, remote_files, source_record_entry, write_source_record
        from mxforge.hub.session import use_hub_limits
        from mxforge.hub.source import HubSource
        from mxforge.safe_paths import check_remote_name

        use_hub_limits(o.limits)
        self.api = api = HfApi()
        commit, files = remote_files(api, o.source, o.revision)
        for f in files:
            check_remote_name(f.name, f"{o.source}@{o.revision}")
        self.commit = commit
        o.bf16_dir.mkdir(parents=True, exist_ok=True)
        small = [f for f in files if not f.name.endswith(".safetensors")]
        hashes = {f.name: fetch_verified(api, o.source, commit, o.bf16_dir, f, o.limits) for f in small}
        ckpt = Checkpoint.open(o.bf16_dir)  # config.json and the index, downloaded and verified just now
        by_name = {f.name: f for f in files}
        missing = [s for s in ckpt.shard_names if s not in by_name]
        if missing:
            raise MxforgeError(
                f"{o.source}@{commit[:12]}: {INDEX_NAME} names shard {missing[0]!r}, which the repo does "
                f"not hold ({len(missing)} such); the source repo is incomplete"
            )
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
                        f"list says {by_name[name].size:,}; the source repo is broken or hostile"
                    )
        ckpt.headers = headers  # the cached property, filled from the Hub: planning needs no shard on disk
        for f in files:  # provenance as `mxforge download` records it; shards by the Hub's sha256, verified on arrival
            if f.name not in hashes:
                hashes[f.name] = FileHash(f.name, f.size, f.sha256 or "", f.blob_id or "")
        write_source_record(
            o.bf16_dir,
            o.source,
            o.revision,
            commit,
            [source_record_entry(f, hashes[f.name]) for f in files],
            None,
            None,
            o.command,
        )
        return ckpt, by_name, commit

    def run(self) -> dict:
        """Stream every shard not yet done, then write the index, side files and config.json; returns the report.

        Raises:
            DiskSpaceError: the output plus the in-flight source shards cannot fit (before any shard is fetched).
            MxforgeError: any stage's error (download, verify, quantize, pre-upload), unchanged; finished
                shards stay recorded for the rerun.
        """
        from mxforge.quantize.plan import plan_checkpoint
        from mxforge.quantize.recipe import load_recipe
        from mxforge.quantize.run import (
            _remove_strays,
            default_workers,
            finish_checkpoint,
            side_files,
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
        plan.refuse_cross_shard_scales("a streamed run deletes each source shard once it is quantized")
        to_copy = side_files(o.bf16_dir)
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
        _remove_strays(o.mxfp4_dir, plan)
        workers = o.workers or default_workers(len(plan.shards))
        in_flight = max(1, o.in_flight or workers + 1)
        self._check_disk(plan, shards, in_flight)
        todo = [s for s in shards if s.step != "done"]
        if o.push_repo and todo:  # the repo (empty until push's commit) must exist to receive objects
            from mxforge.hub.push import prepare_repo

            self._hub_call(lambda: prepare_repo(self.api_for_push(), o.push_repo, o.branch, o.private))
        if todo and o.executor == "ray":
            from mxforge.run.ray_executor import run_on_ray

            run_on_ray(self, todo, qstate, state, o.ray_address, workers)
        elif todo:
            self._stream(todo, workers, in_flight, qstate, state)
        accounted = finish_checkpoint(o.bf16_dir, o.mxfp4_dir, recipe, ckpt, plan, to_copy)
        elapsed = time.monotonic() - started
        quantized = self.clocks["quantize"]
        written = write_provenance(
            o.bf16_dir,
            o.mxfp4_dir,
            recipe,
            plan,
            "cpu",
            workers,
            qstate,
            quantized.shards,
            len(shards) - quantized.shards,
            quantized.bytes,
            elapsed,
            accounted,
            o.command,
            self.sha256_from_download,
        )
        report = self._report(recipe, plan, shards, todo, workers, in_flight, accounted, elapsed)
        # The error measured while quantizing (mxfp4/mxforge_quantize.json has the per-tensor figures).
        report["error"] = {k: v for k, v in written["error"].items() if k != "tensors"} if written["error"] else None
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
        peak = plan_disk(
            output,
            [] if o.local else [s.plan.source_size for s in shards if s.step in ("download", "quantize")],
            in_flight,
        )
        have = sum((o.mxfp4_dir / s.plan.name).stat().st_size for s in shards if s.step in ("upload", "done")) + (
            0 if o.local else sum(s.plan.source_size for s in shards if s.verified)
        )
        _, free = free_space(o.mxfp4_dir)
        source = sum(s.plan.source_size for s in shards)
        self.disk_plan = {
            "source_bytes": source,
            "output_bytes": output,
            "in_flight_source_shards": in_flight,
            "peak_bytes": peak,
            "on_disk_bytes": have,
            "free_bytes": free,
        }
        self._say(
            f"streaming {len(shards)} shard(s), at most {in_flight} bf16 shard(s) on disk at once: peak disk "
            f"{format_bytes(peak)} (output {format_bytes(output)} + source shards in flight), against "
            f"{format_bytes(source)} of source; {format_bytes(free)} free"
        )
        require_free_space(
            o.mxfp4_dir,
            peak - have,
            f"the streamed run's output ({format_bytes(output)}) and {in_flight} source shard(s) in flight",
            "free space, or lower --in-flight",
        )

    # --- 2: the overlapped stages -------------------------------------------------------------------
    def _stream(self, todo: list[_Shard], workers: int, in_flight: int, qstate, state: _State) -> None:
        from mxforge.quantize.run import shard_worker, start_worker_pool
        from mxforge.quantize.shard_job import ShardJob, finish_shard

        o = self.o
        offsets = self.recipe.scale_offsets
        jobs = {
            s.plan.name: ShardJob(
                str(o.bf16_dir), str(o.mxfp4_dir), s.plan, "cpu", True, s.source_sha256, scale_offsets=offsets
            )
            for s in todo
        }
        quantizing = [s for s in todo if s.step in ("download", "quantize")]
        # Worker processes first (fork), before any thread of ours exists.
        pool, counter = (
            start_worker_pool(min(workers, max(1, len(quantizing))), list(jobs.values()))
            if quantizing
            else (None, None)
        )
        if pool is not None:
            pool.submit(int).result()
        threads = ThreadPoolExecutor(o.downloads + o.uploads + workers, thread_name_prefix="stream")
        running: dict = {}  # future -> (kind, shard)

        def idle(step: str) -> list[_Shard]:
            busy = {id(s) for _, s in running.values()}
            return [s for s in todo if s.step == step and id(s) not in busy]

        def count(kind: str) -> int:
            return sum(1 for k, _ in running.values() if k == kind)

        def on_disk() -> int:  # bf16 shards downloading, downloaded or being quantized
            busy = {id(s) for _, s in running.values()}
            return sum(1 for s in todo if s.step in ("download", "quantize") and (s.verified or id(s) in busy))

        total = sum(s.plan.source_size for s in quantizing)
        seen, failed = 0, True
        from mxforge.hub.transfer import CANCEL

        CANCEL.clear()
        bar = byte_progress(total, "stream (quantized)", disable=o.quiet)
        dl_bar = byte_progress(
            sum(s.plan.source_size for s in todo if s.step == "download"), "download", disable=o.quiet
        )
        try:
            while any(s.step != "done" for s in todo):
                if not o.local:
                    for s in idle("download"):
                        if s.verified or count("download") >= o.downloads or on_disk() >= in_flight:
                            continue
                        s.started = time.time()
                        running[threads.submit(self._download, s, dl_bar)] = ("download", s)
                for s in idle("quantize"):
                    if (o.local or s.verified) and count("quantize") + count("finish") < workers:
                        assert pool is not None, "the worker pool starts when any shard is to be quantized"
                        jobs[s.plan.name] = ShardJob(
                            str(o.bf16_dir), str(o.mxfp4_dir), s.plan, "cpu", True, s.source_sha256, s.verified, offsets
                        )
                        s.started = time.time()
                        running[pool.submit(shard_worker, jobs[s.plan.name])] = ("quantize", s)
                for s in idle("upload"):
                    if count("upload") < o.uploads:
                        s.started = time.time()
                        running[threads.submit(self.upload_shard, s)] = ("upload", s)
                done, _ = wait(list(running), timeout=0.2, return_when=FIRST_COMPLETED)
                if counter is not None:
                    bar.update(counter.value - seen)
                    seen = counter.value
                self.peak_source_bytes = max(self.peak_source_bytes, self._source_bytes_on_disk(todo))
                for future in done:
                    kind, s = running.pop(future)
                    result = future.result()  # a stage's error stops the run here
                    if kind == "download":
                        self.record_download(s, result, state)
                    elif kind == "quantize":
                        running[threads.submit(finish_shard, result, o.mxfp4_dir)] = ("finish", s)
                    elif kind == "finish":
                        self.record_quantized(s, result, qstate, state)
                        if not o.local:
                            (o.bf16_dir / s.plan.name).unlink(missing_ok=True)
                    else:
                        self.record_upload(s, result, state)
            failed = False
        except BrokenProcessPool:
            raise MxforgeError(
                "a quantize worker process died (killed for memory?); rerun the same command to "
                "resume, with fewer --workers if memory is short"
            ) from None
        finally:
            if failed:
                CANCEL.set()  # downloads stop at their next chunk, keeping their partial files
                for process in list((getattr(pool, "_processes", None) or {}).values()):
                    if process.is_alive():
                        process.terminate()
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            threads.shutdown(wait=not failed, cancel_futures=True)
            if failed:
                for s in todo:
                    partial_path(o.mxfp4_dir / s.plan.name).unlink(missing_ok=True)
            bar.close()
            dl_bar.close()

    # Each step's outcome, recorded (by the one thread that runs the scheduler) as soon as it is known.
    def record_download(self, s: _Shard, stamp: tuple[int, int], state: _State) -> None:
        assert s.remote is not None, "only a Hub source's shards are downloaded"
        self.clocks["download"].add(s.started, s.plan.source_size)
        s.verified, s.source_sha256 = stamp, s.remote.sha256
        state.data["downloaded"][s.plan.name] = {"sha256": s.source_sha256, "stamp": list(stamp)}
        state.save()
        s.step = "quantize"

    def record_quantized(self, s: _Shard, result, qstate, state: _State, clock: bool = True) -> None:
        """The output shard is in place: record it; its bf16 shard is no longer needed (the caller deletes it)."""
        qstate.record(result)
        self.sha256_from_download += result.sha256_from_download
        if clock:
            self.clocks["quantize"].add(s.started, s.plan.source_size)
        if state.data["downloaded"].pop(s.plan.name, None) is not None:
            state.save()
        s.verified = None
        s.step = "upload" if self.o.push_repo else "done"

    def record_upload(self, s: _Shard, fh: FileHash, state: _State, clock: bool = True) -> None:
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
    def _report(self, recipe, plan, shards, todo, workers, in_flight, accounted, elapsed) -> dict:
        from mxforge.quantize.state import tool_versions

        o = self.o
        return {
            "stage": "stream",
            "source": o.source,
            "commit": self.commit,
            "out": str(o.mxfp4_dir),
            "push_target": f"{o.push_repo}@{o.branch}" if o.push_repo else None,
            "recipe": {"name": recipe.name, "sha256": recipe.sha256},
            "source_precision": plan.precision.describe(),
            "workers": workers,
            "downloads": o.downloads,
            "uploads": o.uploads,
            "in_flight": in_flight,
            "shards": {
                "total": len(shards),
                "streamed_now": len(todo),
                "done_earlier": len(shards) - len(todo),
                "quantized_earlier": len(shards) - self.clocks["quantize"].shards,
            },
            "disk_plan": self.disk_plan,
            "executor": o.executor,
            # sampled by the local scheduler; Ray's nodes keep theirs in their own temporary directories
            "peak_source_bytes_on_disk": self.peak_source_bytes if o.executor == "local" else None,
            "stages": {k: c.as_dict() for k, c in self.clocks.items()},
            "counts": {k: accounted[k] for k in ("quantized", "kept", "copied")},
            "mtp_layers": list(plan.layout.mtp_layers),
            "mtp_tensors": accounted["mtp_tensors"],
            "bytes_in": sum(s.source_size for s in plan.shards),
            "bytes_out": sum(s.output_size for s in plan.shards),
            "bytes_processed_now": self.clocks["quantize"].bytes,
            "downloaded_bytes": self.clocks["download"].bytes,
            "uploaded_bytes": self.clocks["upload"].bytes,
            "seconds": round(elapsed, 3),
            "tool_versions": tool_versions(),
            "notes": self.notes,
        }
