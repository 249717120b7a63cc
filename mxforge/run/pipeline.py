"""`mxforge run`: download -> quantize -> fixup -> validate -> push, resumable across stages.

OUT holds `bf16/` (the downloaded source, when SOURCE is a Hub repo), `mxfp4/` (the product) and
`mxforge_run.json`, the state file: the run's arguments and, per stage, its status, timing, bytes and
report. A rerun with the same arguments skips every stage recorded done whose output is still there and
continues at the first incomplete one (inside quantize, at the first incomplete shard: quantize keeps its
own per-shard state). A finished stage's output is never trusted blindly: download and quantize verify
what they find on disk when they run.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from mxforge.checkpoint import INDEX_NAME, is_local_source
from mxforge.errors import MxforgeError, ValidationFailed
from mxforge.provenance import RUN_PRODUCT_DIR, RUN_SOURCE_DIR, RUN_STATE_NAME, STREAM_STATE_NAME
from mxforge.quantize.error_report import summary_line
from mxforge.quantize.scale_rules import DEFAULT_SCALE_RULE
from mxforge.records import fields_of
from mxforge.safetensors_io import write_json_atomic

if TYPE_CHECKING:  # hub_session imports huggingface_hub: only when a stage talks to the Hub
    from mxforge.hub.session import HubLimits

STAGES = ("download", "quantize", "stream", "fixup", "validate", "push")  # stream: download + quantize, overlapped


@dataclass
class RunOptions:
    source: str
    out: Path
    recipe: str
    engines: list[str] | None = None
    push_repo: str | None = None
    revision: str = "main"
    private: bool = False
    workers: int | None = None
    quiet: bool = False
    command: str | None = None
    follow_symlinks: bool = False  # read a local SOURCE through symlinks that leave it
    hub_limits: "HubLimits | None" = None  # timeouts and retries of Hub requests (None: HubLimits.resolve())
    scale_rule: str | None = None  # overrides the recipe's (quantize/scale_rules.py)
    stream: bool | None = None  # True: --stream, False: --no-stream, None: stream a Hub source that does not fit
    in_flight: int | None = None  # streamed: bf16 shards on disk at once (default: workers + 1)
    executor: str = "local"  # "ray": every shard a Ray task (streamed; mxforge[ray])
    ray_address: str | None = None

    def inputs(self) -> dict:
        """What each stage's output depends on; a change reruns the stages that depend on it."""
        from mxforge.quantize.recipe import load_recipe

        config = self._local_config() if self.recipe is None else None
        if self.recipe is None and config is None:  # a Hub source: its family's default recipe, once downloaded
            recipe_name, recipe_sha, scale_rule = None, None, self.scale_rule
        else:
            recipe = load_recipe(self.recipe, config)
            recipe_name, recipe_sha, scale_rule = recipe.name, recipe.sha256, self.scale_rule or recipe.scale_rule
        return {
            "source": self.source,
            "revision": self.revision,
            "recipe": recipe_name,
            "recipe_sha256": recipe_sha,
            "scale_rule": scale_rule,
            "engines": sorted(self.engines) if self.engines else None,
            "push_repo": self.push_repo,
        }

    def _local_config(self) -> dict | None:
        """config.json of a local SOURCE (None for a Hub repo, or one that cannot be read yet: quantize says why)."""
        from mxforge.checkpoint import Checkpoint

        try:
            return Checkpoint.open(self.source, self.follow_symlinks).config if Path(self.source).is_dir() else None
        except (MxforgeError, OSError):
            return None


# Which stages must run again when one of the run's inputs changes.
INVALIDATED_BY = {
    "recipe_sha256": ("quantize", "stream", "fixup", "validate", "push"),
    "scale_rule": ("quantize", "stream", "fixup", "validate", "push"),
    "engines": ("fixup", "validate", "push"),
    "push_repo": ("push",),
}


def _formats_of(quant: Any, product: str) -> str:
    """The titles of the formats the quantized tensors are in ("MXFP4 + FP8 PTPC"), from the stage's record, or for a
    stream from the product's mxforge_quantize.json ("quantized" where neither says)."""
    from mxforge.formats import formats_title
    from mxforge.provenance import QUANTIZE_NAME, read_record

    fmt = getattr(getattr(quant, "recipe", None), "format", None)
    if not isinstance(fmt, str):
        recipe = (read_record(Path(product), QUANTIZE_NAME) or {}).get("recipe")
        fmt = recipe.get("format") if isinstance(recipe, dict) else None
    return formats_title(fmt) if isinstance(fmt, str) and fmt else "quantized"


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts)


def _report_types() -> dict[str, Any]:
    """Each stage's result class, to read a recorded report back (download and validate are never read back: the
    summary shows neither's report, and validate always runs again)."""
    from mxforge.fixups.fixup import FixupResult
    from mxforge.hub.push import PushResult
    from mxforge.quantize.result import QuantizeResult
    from mxforge.run.stream import StreamResult

    return {"quantize": QuantizeResult, "stream": StreamResult, "fixup": FixupResult, "push": PushResult}


@dataclass(kw_only=True)
class StageRecord:
    """One stage in OUT/mxforge_run.json: its status and, once done, its time, bytes and report (the stage's
    result: DownloadResult, QuantizeResult, StreamResult, FixupResult, ValidationReport, PushResult; a recorded
    report whose class cannot be rebuilt stays its JSON object)."""

    status: str  # "running" | "done" | "failed"
    seconds: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    gb_per_s: float | None = None
    report: Any = None
    skipped: str | None = None  # why a stage had nothing to do (a local source's download: status "skipped")
    product: str | None = None  # done: product_stamp of the checkpoint directory the stage wrote
    error: str | None = None  # failed: the error's message
    error_fields: dict | None = None  # failed: the error's class and fields (MxforgeError.as_dict)

    def as_dict(self) -> dict:
        if self.status == "running":
            return {"status": "running"}
        if self.status == "failed":
            return {"status": "failed", "error": self.error, "error_fields": self.error_fields}
        out: dict[str, Any] = {"status": self.status}
        if self.skipped is not None:
            out["skipped"] = self.skipped
        out |= {"seconds": self.seconds, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}
        if self.skipped is None:
            out["gb_per_s"] = self.gb_per_s
        report = self.report
        out["report"] = report.as_dict() if hasattr(report, "as_dict") else report
        if self.product is not None:
            out["product"] = self.product
        return out

    @classmethod
    def from_dict(cls, stage: str, d: Any) -> StageRecord | None:
        """A recorded stage (None: not an object, so the stage runs again)."""
        if not isinstance(d, dict) or not isinstance(d.get("status"), str):
            return None
        report = d.get("report")
        kind = _report_types().get(stage)
        if kind is not None and isinstance(report, dict) and d["status"] == "done":
            report = kind.from_dict(report)
        return cls(
            status=d["status"],
            seconds=float(d.get("seconds") or 0.0),
            bytes_in=int(d.get("bytes_in") or 0),
            bytes_out=int(d.get("bytes_out") or 0),
            gb_per_s=d.get("gb_per_s"),
            report=report,
            skipped=d.get("skipped"),
            product=d.get("product") if isinstance(d.get("product"), str) else None,
            error=d.get("error"),
            error_fields=d.get("error_fields"),
        )


@dataclass(kw_only=True)
class RunResult:
    """What `mxforge run` returns (and writes with --json): per stage its record, in stage order."""

    STAGE: ClassVar[str] = "run"
    source: str
    out: str
    product: str  # OUT/mxfp4
    pushed_to: str | None
    mode: str | None  # "stream" | "sequential"
    reused_from_earlier_run: list[str]  # stages recorded done by an earlier run and not redone
    stages: dict[str, StageRecord]
    product_bytes: int = 0  # all of OUT/mxfp4 on disk
    redone: str | None = None  # why stages an earlier run had finished were done again

    def as_dict(self) -> dict:
        return {
            "stage": self.STAGE,
            **fields_of(self, "source", "out", "product", "product_bytes", "pushed_to", "mode"),
            **fields_of(self, "reused_from_earlier_run", "redone"),
            "stages": {name: rec.as_dict() for name, rec in self.stages.items()},
        }


FILE_CLOCK_LAG_NS = 20_000_000  # 20 ms: Linux stamps files with its coarse clock (one tick, up to 10 ms, behind)


def _bytes_written_since(path: Path, since_ns: int) -> int:
    """Bytes of the files under `path` written since `since_ns` (time.time_ns()): a stage's output this run, not
    what an earlier run left. File times come from the kernel's coarse clock, a few milliseconds behind
    time.time_ns(), hence the FILE_CLOCK_LAG allowance (a whole second would count an earlier run's files when two
    runs follow within one second)."""
    floor = since_ns - FILE_CLOCK_LAG_NS
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and ".cache" not in p.parts:
            st = p.stat()
            total += st.st_size if st.st_mtime_ns >= floor else 0
    return total


# The stages that write each of OUT's checkpoints, in order (download: OUT/bf16; the rest: OUT/mxfp4).
WRITERS = {"bf16": ("download",), "mxfp4": ("quantize", "stream", "fixup")}


def product_stamp(directory: Path) -> str | None:
    """What a stage leaves in a checkpoint directory, in a few bytes: config.json's and the index's bytes and each
    shard's name and size (None: no config.json). A stage records it when done; a rerun that finds another one
    knows the directory changed under the run (say, `mxforge quantize` run again into OUT/mxfp4 after fixup)."""
    try:
        config = (directory / "config.json").read_bytes()
    except OSError:
        return None
    digest = hashlib.sha256(config)
    try:
        digest.update((directory / INDEX_NAME).read_bytes())
    except OSError:
        digest.update(b"no index")
    for shard in sorted(directory.glob("*.safetensors")):
        digest.update(f"\n{shard.name} {shard.stat().st_size}".encode())
    return digest.hexdigest()


def changed_products(stages: dict[str, StageRecord], stamps: dict[str, str | None]) -> tuple[str, str] | None:
    """(the first stage to redo, what changed) when a checkpoint directory no longer holds what the last stage
    that wrote it recorded; None when each holds what was recorded. `stamps`: product_stamp of each directory.

    The earliest writer whose record matches what is there is still done; the ones after it are redone."""
    for directory, writers in WRITERS.items():
        done = [w for w in writers if w in stages and stages[w].status == "done" and stages[w].product is not None]
        if not done or stages[done[-1]].product == stamps.get(directory):
            continue
        kept = [w for w in done if stages[w].product == stamps.get(directory)]
        first = done[done.index(kept[-1]) + 1] if kept else done[0]
        return first, f"OUT/{directory} changed since {done[-1]} finished"
    return None


class Pipeline:
    """Runs the stages in order, recording each in the state file as it completes."""

    def __init__(self, opts: RunOptions):
        self.opts = opts
        self.out = Path(opts.out)
        self.state_path = self.out / RUN_STATE_NAME
        self.local = is_local_source(opts.source)
        self.bf16_dir = Path(opts.source) if self.local else self.out / RUN_SOURCE_DIR
        self.mxfp4_dir = self.out / RUN_PRODUCT_DIR
        self.state = self._load_state()
        self.redone: str | None = None  # why stages recorded done are redone (a checkpoint changed under the run)
        self._redo_changed_products()
        self.reused: set[str] = set()  # stages recorded done by an earlier run and not redone
        self.validated_files: dict | None = None  # the product's file stamps when validate last read it
        self.validation: Any = None  # validate's ValidationReport, this run's

    def _load_state(self) -> dict:
        """The state file's inputs and mode, with its stages as StageRecords (those the inputs invalidate dropped).

        Raises:
            MxforgeError: the file is corrupt, or holds a run of another source or revision.
        """
        inputs = self.opts.inputs()
        if not self.state_path.exists():
            return {"inputs": inputs, "stages": {}}
        try:
            state = json.loads(self.state_path.read_text())
            old = state["inputs"]
            if not isinstance(old, dict) or not isinstance(state.get("stages"), dict):
                raise TypeError("inputs and stages must be objects")
        except (ValueError, KeyError, TypeError):
            raise MxforgeError(
                f"{self.state_path}: state file is corrupt; remove it to start the run over", path=self.state_path
            ) from None
        if any(old.get(key) != inputs[key] for key in ("source", "revision")) and self._nothing_produced(state):
            return {"inputs": inputs, "stages": {}}  # a run that failed before making anything binds OUT to nothing
        for key in ("source", "revision"):
            if old.get(key) != inputs[key]:
                raise MxforgeError(
                    f"{self.out}: holds a run of {key} {old.get(key)!r}, not {inputs[key]!r}: "
                    "use another OUT directory, or remove this one to start over",
                    path=self.out,
                )
        old.setdefault("scale_rule", DEFAULT_SCALE_RULE)  # a state written before scale rules existed
        for key, stages in INVALIDATED_BY.items():
            if old.get(key) != inputs[key]:
                for stage in stages:
                    state["stages"].pop(stage, None)
        records = {name: StageRecord.from_dict(name, rec) for name, rec in state["stages"].items()}
        state["stages"] = {name: rec for name, rec in records.items() if rec is not None}
        state["inputs"] = inputs
        return state

    def _nothing_produced(self, state: dict) -> bool:
        """Whether the run recorded in `state` finished no stage and wrote nothing in OUT but its state file (and
        the locks under .cache): e.g. `mxforge run empty OUT`, which failed before its first stage finished."""
        if any(isinstance(rec, dict) and rec.get("status") == "done" for rec in state["stages"].values()):
            return False
        for path in self.out.rglob("*"):
            parts = path.relative_to(self.out).parts
            if path.is_file() and parts != (RUN_STATE_NAME,) and ".cache" not in parts:  # .cache: the locks
                return False
        return True

    def _redo_changed_products(self) -> None:
        """Forget the stages whose output changed since they finished, and every stage after them (a stage is done
        only while its output is what it left)."""
        stamps = {"bf16": None if self.local else product_stamp(self.bf16_dir), "mxfp4": product_stamp(self.mxfp4_dir)}
        changed = changed_products(self.state["stages"], stamps)
        if changed is None:
            return
        first, why = changed
        redo = [s for s in STAGES[STAGES.index(first) :] if s in self.state["stages"]]
        for stage in redo:
            self.state["stages"].pop(stage)
        self.redone = f"{why}: redoing {', '.join(redo)}"

    def _save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            self.state_path, {**self.state, "stages": {k: r.as_dict() for k, r in self.state["stages"].items()}}
        )

    def _done(self, stage: str, marker: Path | None) -> bool:
        rec = self.state["stages"].get(stage)
        return bool(rec and rec.status == "done" and (marker is None or marker.exists()))

    def _stage(
        self,
        stage: str,
        work: Callable[[], Any],
        *,
        writes: Path | None = None,
        bytes_out: bool = True,
        bytes_in: Callable[[Any], int] | int = 0,
        always: bool = False,
    ) -> StageRecord:
        """Run one stage unless recorded done (and the checkpoint it writes still has its config.json); record it
        in the state file.

        `writes`: the checkpoint directory the stage writes, whose product_stamp is recorded with it and, with
        `bytes_out`, whose bytes written this run are. `bytes_in`: the bytes the stage processed, or a function of
        its result giving them (a resumed download or quantize processes only what was left)."""
        if not always and self._done(stage, writes / "config.json" if writes is not None else None):
            self.reused.add(stage)
            return self.state["stages"][stage]
        self.state["stages"][stage] = StageRecord(status="running")
        self._save()
        start = time.monotonic()
        started_at = time.time_ns()
        try:
            report = work()
        except MxforgeError as e:  # recorded for whoever reads the state file; the rerun starts this stage again
            self.state["stages"][stage] = StageRecord(status="failed", error=str(e), error_fields=e.as_dict())
            self._save()
            raise
        seconds = time.monotonic() - start
        if callable(bytes_in):
            bytes_in = bytes_in(report)
        rec = StageRecord(
            status="done",
            seconds=round(seconds, 3),
            bytes_in=bytes_in,
            # what this run wrote (a resumed stage skips what is there), as bytes_in is what it read
            bytes_out=_bytes_written_since(writes, started_at)
            if bytes_out and writes is not None and writes.is_dir()
            else 0,
            gb_per_s=round(bytes_in / seconds / 1e9, 4) if seconds > 0 and bytes_in else None,
            report=report,
            product=product_stamp(writes) if writes is not None else None,
        )
        self.state["stages"][stage] = rec
        self._save()
        return rec

    def run(self) -> RunResult:
        """Run every stage not yet done; returns every stage's record.

        Raises:
            ValidationFailed: validate found problems (nothing is pushed).
            MxforgeError: any stage's expected failure, unchanged.
        """
        o = self.opts
        if o.quiet:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        self._check_push_target()
        import contextlib

        from mxforge.dir_lock import directory_lock

        # Every directory the run writes, for the whole run (the stages take the same locks again: re-entrant).
        with contextlib.ExitStack() as locks:
            for directory in (self.out, self.mxfp4_dir) if self.local else (self.out, self.mxfp4_dir, self.bf16_dir):
                locks.enter_context(directory_lock(directory))
            return self._run_stages()

    def _check_push_target(self) -> None:
        """A push target that cannot work (bad id, no token, no write access, --private on a public repo) is
        refused before any stage runs, not after the hours the stages before push take.

        Raises:
            HubError: as check_push_target.
        """
        if self.opts.push_repo and not self._done("push", None):
            from mxforge.hub.target import check_push_target

            check_push_target(self.opts.push_repo, private=self.opts.private, limits=self.opts.hub_limits)

    def _choose_mode(self) -> str:
        """ "stream" or "sequential": as asked, as an earlier run in OUT ran, or, for a Hub source, streamed when
        the disk cannot hold the source and the output at once (stream.choose_stream); the decision is reported.

        Raises:
            MxforgeError: OUT holds a run of the other mode than the one asked for.
        """
        o = self.opts
        earlier = self.state.get("mode")
        asked = None if o.stream is None else ("stream" if o.stream else "sequential")
        if o.executor == "ray":
            if self.local or o.stream is False:
                raise MxforgeError(
                    "--executor ray streams shards from a Hub repo: give a Hub SOURCE, without --no-stream"
                )
            asked = "stream"
        if earlier and asked and earlier != asked:
            raise MxforgeError(
                f"{self.out}: holds a {earlier} run; rerun it {'with' if earlier == 'stream' else 'without'} "
                "--stream, or use another OUT directory",
                path=self.out,
            )
        mode = earlier or asked
        if mode:
            return mode
        if self.local:
            return "sequential"
        from huggingface_hub import HfApi

        from mxforge.disk_space import free_space
        from mxforge.hub.download import remote_files, select
        from mxforge.hub.session import HubLimits, use_hub_limits
        from mxforge.provenance import fetched_patterns
        from mxforge.run.stream import choose_stream

        limits = o.hub_limits or HubLimits.resolve()
        use_hub_limits(limits)
        _, files = remote_files(HfApi(), o.source, o.revision, limits)
        source = sum(f.size for f in select(files, fetched_patterns(), None))  # what a run of it downloads
        self.out.mkdir(parents=True, exist_ok=True)
        _, free = free_space(self.out)
        mode = "stream" if choose_stream(source, free) else "sequential"
        if not o.quiet:
            import sys

            from mxforge.progress import format_bytes

            print(
                f"mxforge run: {mode}: the source is {format_bytes(source)}; a sequential run keeps it and the output "
                f"(up to as large) on disk, {format_bytes(free)} is free"
                + (", so shards are streamed" if mode == "stream" else ""),
                file=sys.stderr,
            )
        return mode

    def _run_stages(self) -> RunResult:
        o = self.opts
        if self.redone and not o.quiet:
            print(f"mxforge run: {self.redone}", file=sys.stderr)
        self._save()
        try:
            self.state["mode"] = self._choose_mode()
        except MxforgeError as e:  # reading the source's file list is the download's first step: its failure
            self.state["stages"]["download"] = StageRecord(status="failed", error=str(e), error_fields=e.as_dict())
            self._save()
            raise
        self._save()
        if self.state["mode"] == "stream":
            self._stage(
                "stream",
                self._stream,
                writes=self.mxfp4_dir,
                bytes_in=lambda report: report.bytes_processed_now,
            )
        else:
            if self.local:
                # nothing ran: recorded as skipped, not done (a run that fails later binds OUT to nothing)
                self.state["stages"]["download"] = StageRecord(
                    status="skipped", skipped=f"local source {self.bf16_dir}"
                )
            else:
                self._stage(
                    "download",
                    self._download,
                    writes=self.bf16_dir,
                    bytes_in=lambda report: report.downloaded_bytes,
                )
            self._stage(
                "quantize",
                self._quantize,
                writes=self.mxfp4_dir,
                bytes_in=lambda report: report.bytes_processed_now or 0,
            )
        self._stage("fixup", self._fixup, writes=self.mxfp4_dir, bytes_out=False)
        # Header-only and cheap: always checked again, never taken from the state file.
        validate = self._stage("validate", self._validate, always=True).report
        if not validate.ok:
            del self.state["stages"]["validate"]  # rerun it next time, after the user's fix
            self._save()
            raise ValidationFailed(
                f"{self.mxfp4_dir}: validation found problems; nothing was pushed:\n"
                + "\n".join(f"  - {p.format()}" for p in validate.problems),
                path=self.mxfp4_dir,
            )
        self.validation = validate
        if o.push_repo:
            self._stage("push", self._push, bytes_in=_dir_bytes(self.mxfp4_dir))
        return self.report()

    # --- the stages, each a thin call into its engine --------------------------------------------
    def _download(self):
        from mxforge.hub.download import download
        from mxforge.provenance import fetched_patterns

        return download(
            self.opts.source,
            self.bf16_dir,
            revision=self.opts.revision,
            include=fetched_patterns(),  # the shards and what the product carries, not the rest of the repo
            quiet=self.opts.quiet,
            command=self.opts.command,
            limits=self.opts.hub_limits,
        )

    def _stream(self):
        from mxforge.hub.session import HubLimits
        from mxforge.run.stream import StreamOptions, StreamRun

        o = self.opts
        return StreamRun(
            StreamOptions(
                source=o.source,
                local=self.local,
                bf16_dir=self.bf16_dir,
                mxfp4_dir=self.mxfp4_dir,
                state_path=self.out / STREAM_STATE_NAME,
                recipe=o.recipe,
                revision=o.revision,
                push_repo=o.push_repo,
                private=o.private,
                workers=o.workers,
                in_flight=o.in_flight,
                quiet=o.quiet,
                command=o.command,
                follow_symlinks=o.follow_symlinks,
                limits=o.hub_limits or HubLimits.resolve(),
                executor=o.executor,
                ray_address=o.ray_address,
                scale_rule=o.scale_rule,
                engines=o.engines,
            )
        ).run()

    def _quantize(self):
        from mxforge.fixups.plan_check import plan_checker
        from mxforge.quantize.run import quantize_checkpoint

        return quantize_checkpoint(
            self.bf16_dir,
            self.mxfp4_dir,
            self.opts.recipe,
            workers=self.opts.workers,
            quiet=self.opts.quiet,
            command=self.opts.command,
            follow_symlinks=self.opts.follow_symlinks,
            scale_rule=self.opts.scale_rule,
            source_record_is_ours=not self.local,  # bf16/'s source record: this run's download wrote it
            check_plan=plan_checker(self.opts.engines),  # refused before quantizing if a release could not load it
        ).summary()  # the per-tensor lists and figures stay in mxfp4/mxforge_quantize.json

    def _fixup(self):
        from mxforge.fixups.fixup import fixup_checkpoint

        return fixup_checkpoint(self.mxfp4_dir, engines=self.opts.engines, command=self.opts.command)

    def _validate(self):
        from mxforge.file_hashes import checkpoint_files, snapshot
        from mxforge.validation.validate import validate_checkpoint

        files = checkpoint_files(self.mxfp4_dir)
        self.validated_files = snapshot(self.mxfp4_dir, files)  # push commits only these, unchanged
        return validate_checkpoint(self.mxfp4_dir, engines=self.opts.engines)

    def _push(self):
        from mxforge.hub.push import push

        assert self.opts.push_repo is not None, "the push stage runs only with a push target"
        return push(
            self.mxfp4_dir,
            self.opts.push_repo,
            private=self.opts.private,
            engines=self.opts.engines,
            quiet=self.opts.quiet,
            command=self.opts.command,
            limits=self.opts.hub_limits,
            validation=self.validation.as_dict(),
            validated_files=self.validated_files,
            preuploaded=self.state.get("mode") == "stream",  # the stream sent each shard as it was made
        )

    def report(self) -> RunResult:
        return RunResult(
            source=self.opts.source,
            out=str(self.out),
            product=str(self.mxfp4_dir),
            product_bytes=_dir_bytes(self.mxfp4_dir) if self.mxfp4_dir.is_dir() else 0,
            pushed_to=self.opts.push_repo,
            mode=self.state.get("mode"),
            reused_from_earlier_run=sorted(self.reused),
            redone=self.redone,
            stages=dict(self.state["stages"]),
        )


def format_run_summary(result: RunResult) -> str:
    """The human summary: per stage time, bytes and GB/s, then what was quantized, fixed and validated."""
    from mxforge.fixups.fixup import FixupResult
    from mxforge.hub.push import PushResult
    from mxforge.quantize.result import QuantizeResult
    from mxforge.run.stream import StreamResult
    from mxforge.validation.report import ValidationReport

    stages = result.stages
    lines = [
        f"mxforge run {result.source} -> {result.product}" + (" (streamed)" if result.mode == "stream" else ""),
        f"  {'stage':<10}{'status':<9}{'time':>9}{'in':>12}{'out':>12}{'GB/s':>8}",
    ]
    if result.redone:
        lines.insert(1, f"  {result.redone}")
    for stage in STAGES:
        rec = stages.get(stage)
        if rec is None:
            continue
        status = "skipped" if rec.skipped else ("earlier" if stage in result.reused_from_earlier_run else rec.status)
        gbs = f"{rec.gb_per_s:.3f}" if rec.gb_per_s else "-"
        lines.append(
            f"  {stage:<10}{status:<9}{rec.seconds:>8.1f}s{rec.bytes_in / 1e9:>10.3f}GB"
            f"{rec.bytes_out / 1e9:>10.3f}GB{gbs:>8}"
        )

    def report_of(stage: str, kind: type) -> Any:
        rec = stages.get(stage)
        return rec.report if rec is not None and isinstance(rec.report, kind) else None

    quant = report_of("quantize", QuantizeResult) or report_of("stream", StreamResult)
    if isinstance(quant, StreamResult):
        per = "; ".join(
            f"{k} {v.bytes / 1e9:.3f} GB at {v.gb_per_s or 0:.3f} GB/s" for k, v in quant.stages.items() if v.shards
        )
        peak = quant.peak_source_bytes_on_disk
        lines.append(
            f"  streamed {quant.shards.streamed_now} of {quant.shards.total} shard(s)"
            f"{' on Ray' if quant.executor == 'ray' else ''}: {per or 'nothing left'}; "
            + (f"peak bf16 on disk {peak / 1e9:.3f} GB " if peak is not None else "")
            + f"(plan: {quant.disk_plan.peak_bytes / 1e9:.3f} GB with the output)"
        )
    if quant is not None and quant.bytes_in is not None:
        name = quant.STAGE
        rec, when = stages[name], "an earlier run" if name in result.reused_from_earlier_run else "this run"
        lines.append(
            f"  {name}: {when} {rec.bytes_in / 1e9:.3f} GB in, {rec.bytes_out / 1e9:.3f} GB out; "
            f"the checkpoint {quant.bytes_in / 1e9:.3f} GB in, {result.product_bytes / 1e9:.3f} GB out"
        )
    if quant is not None and quant.counts is not None:
        c = quant.counts
        lines.append(
            f"  tensors: {c.quantized:,} {_formats_of(quant, result.product)}, {c.kept:,} 2-D weights kept bf16, "
            f"{c.copied:,} copied; "
            f"MTP layer(s) {quant.mtp_layers} ({quant.mtp_tensors} tensors) carried"
        )
        lines.append(f"  {summary_line(quant.error)}")  # a stream's report carries the error it measured too
    fix = report_of("fixup", FixupResult)
    if fix is not None:
        lines.append(
            f"  fixups: {len(fix.applied)} applied" + (f", {len(fix.warnings)} warning(s):" if fix.warnings else "")
        )
        lines += [f"    warning: {w}" for w in fix.warnings]
    val = report_of("validate", ValidationReport)
    if val is not None:
        lines.append(f"  engines: {val.verdict()}")
    push = report_of("push", PushResult)
    if push is not None:
        lines.append(f"  pushed: {push.url} @ {push.commit[:12]} (remote hashes checked)")
    return "\n".join(lines)
