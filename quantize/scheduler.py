"""One shard scheduler: every mode of running quantize (the worker pool of `mxforge quantize`, `mxforge run
--stream`, `--executor ray`) moves its shards through a list of steps, each step run in a lane.

A *step* is one thing done to one shard (download, quantize, finish: fsync and rename, upload...): the function
that does it, the lane it runs in, when a shard may start it (`admit`: bounds beyond the lane's size, such as the
bf16 shards a streamed run may hold on disk), what to do with its result on the scheduler's thread (`done`:
record it, and name the shard's next step), and what to undo for every shard when the run fails (`abandon`:
remove a half-written output). A *lane* is where a step's work runs: this thread (`Inline`), a pool of
threads (`Threads`), quantize's worker processes (`ShardWorkers`), or anything else that hands back a
`concurrent.futures.Future` (the Ray executor's tasks).

The scheduler fills every lane as far as each step admits, then waits for the first result in 0.2 s slices
(so a Ctrl-C reaches Python at once, whatever the lanes are blocked on), ticks the lanes (progress bars) and
records what finished; each step's result goes to the shard's next step. The first error stops the run:
every lane is interrupted (downloads cancelled, worker processes terminated), closed, and every step
abandons its shards' half-done work; then the error is raised, as the lane translates it (a worker process
that died is one MxforgeError). What a step recorded before stays recorded: a rerun resumes from there.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any, Generic, TypeVar

from mxforge.errors import MxforgeError
from mxforge.quantize.shard_job import ShardJob, ShardResult, finish_shard, run_shard
from mxforge.safetensors_io import partial_path

T = TypeVar("T")
SLICE_SECONDS = 0.2  # the longest the scheduler waits before it looks again (and Ctrl-C is seen)
WORKER_DIED = (
    "a quantize worker process died (killed for memory?); rerun the same command to resume, with fewer "
    "--workers if memory is short"
)


class Lane:
    """Where a step's work runs. Subclasses hand back a Future from `submit`."""

    forks = False  # True: start() starts processes, so the scheduler starts this lane before any other

    def start(self) -> None:
        """Make the lane ready (start processes, connect to a cluster); called once, before any submit."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        raise NotImplementedError

    def tick(self) -> None:
        """Called on the scheduler's thread after every wait (progress bars)."""

    def interrupt(self) -> None:
        """The run failed or was interrupted: stop the work in flight now (before any lane is closed)."""

    def close(self, failed: bool) -> None:
        """Release the lane; after a failure, work still queued is cancelled."""

    def error(self, e: BaseException) -> BaseException:
        """The error to raise for a step of this lane that failed with `e` (default: `e` itself)."""
        return e


class Inline(Lane):
    """The scheduler's own thread: `submit` runs the work at once (an error other than Ctrl-C comes back
    in the future, as from any lane)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future


class Threads(Lane):
    """A pool of `size` threads. After a failure the lane does not wait for work in flight unless
    `wait_on_failure` (a download blocked in a socket read would hold the run until its timeout)."""

    def __init__(self, size: int, name: str, *, wait_on_failure: bool = False, on_interrupt=None):
        self.size, self.name = size, name
        self.wait_on_failure = wait_on_failure
        self.on_interrupt = on_interrupt
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(self.size, thread_name_prefix=self.name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        assert self._pool is not None, "the scheduler starts every lane before it submits"
        return self._pool.submit(fn, *args)

    def interrupt(self) -> None:
        if self.on_interrupt is not None:
            self.on_interrupt()

    def close(self, failed: bool) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=not failed or self.wait_on_failure, cancel_futures=True)


# --- quantize's worker processes -------------------------------------------------------------------
_counter: Synchronized[int] | None = None  # set in each worker process by _init_worker


def _init_worker(counter: Synchronized[int]) -> None:
    global _counter
    _counter = counter


def _quantize_in_worker(job: ShardJob) -> ShardResult:
    counter = _counter
    assert counter is not None, "runs only in a process started by ShardWorkers"

    def progress(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    return run_shard(job, progress, finish=False)  # the scheduler's finish step fsyncs and renames


class ShardWorkers(Lane):
    """Quantize's workers: `size` processes (forked with the compiled kernel loaded, on CPU), or the
    scheduler's own thread when `size` is 1. Its steps run `run_job` (a ShardJob to a ShardResult), which
    leaves `SHARD.partial` for the finish step. `bar`: the progress bar of the source bytes processed."""

    def __init__(self, size: int, jobs: Sequence[ShardJob], *, bar=None, processes: bool | None = None):
        self.size = size
        self._jobs = list(jobs)
        self.bar = bar  # may be set after start(), so that its thread starts after the fork
        self._pool: ProcessPoolExecutor | None = None
        self._counter: Synchronized[int] | None = None
        self._seen = 0
        self.forks = (size > 1 if processes is None else processes) and bool(self._jobs)
        self.run_job: Callable[[ShardJob], ShardResult] = _quantize_in_worker if self.forks else self._run_here

    def _run_here(self, job: ShardJob) -> ShardResult:
        return run_shard(job, self.bar.update if self.bar is not None else lambda n: None, finish=False)

    def start(self) -> None:
        if not self.forks:
            return
        ctx: BaseContext = mp.get_context("spawn")
        quantized = [t for job in self._jobs for t in job.plan.tensors if t.format is not None]
        formats = {t.format.name: t.format for t in quantized if t.format is not None}.values()
        # fork: workers start at once with the compiled kernels already loaded, when every format's kernels for
        # its inputs run without torch (Kernels.warm): one that runs torch ops (MXFP6 from float32, or where no C
        # compiler works) is spawned instead, since torch's thread pool does not survive fork once this process
        # has used it (a forked worker then waits on it forever).
        if (
            self._jobs[0].device == "cpu"
            and "fork" in mp.get_all_start_methods()
            and all(
                f.kernels.warm is not None and f.kernels.warm({t.read_dtype for t in quantized if t.format == f})
                for f in formats
            )
        ):
            ctx = mp.get_context("fork")
        self._counter = ctx.Value("q", 0)
        self._pool = ProcessPoolExecutor(self.size, mp_context=ctx, initializer=_init_worker, initargs=(self._counter,))
        self._pool.submit(int).result()  # every process forked now, before the scheduler's threads exist

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return Inline().submit(fn, *args) if self._pool is None else self._pool.submit(fn, *args)

    def tick(self) -> None:
        if self._counter is not None and self.bar is not None:
            value = self._counter.value
            self.bar.update(value - self._seen)
            self._seen = value

    def interrupt(self) -> None:
        for process in list((getattr(self._pool, "_processes", None) or {}).values()):
            if process.is_alive():
                process.terminate()

    def close(self, failed: bool) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.tick()

    def error(self, e: BaseException) -> BaseException:
        return MxforgeError(WORKER_DIED) if isinstance(e, BrokenProcessPool) else e


# --- steps and the scheduler -----------------------------------------------------------------------
@dataclass
class Step(Generic[T]):
    """One thing done to a shard: `fn(*args(shard, previous result))` in `lane`; then `done(shard, result)` on
    the scheduler's thread, which records it and returns the shard's next step (None: the shard is finished).

    `admit(shard)`: whether the shard may start the step now, beyond the lane's own size (default: yes).
    `abandon(shard)`: called for every shard when the run fails, to remove what the step leaves half done.
    `error(shard, e)`: the error to raise when the step failed with `e` (default: the lane's `error`)."""

    name: str
    lane: Lane
    fn: Callable[..., Any]
    done: Callable[[T, Any], str | None]
    args: Callable[[T, Any], tuple] = lambda shard, previous: (shard,)
    admit: Callable[[T], bool] = lambda shard: True
    abandon: Callable[[T], None] | None = None
    error: Callable[[T, BaseException], BaseException] | None = None


class ShardScheduler(Generic[T]):
    """Moves shards through `steps` (see the module docstring). `on_tick`: called after every wait."""

    def __init__(self, steps: Sequence[Step[T]], on_tick: Callable[[], None] | None = None):
        self.steps = {s.name: s for s in steps}
        lanes = list({id(s.lane): s.lane for s in steps}.values())
        self.lanes: list[Lane] = sorted(lanes, key=lambda lane: not lane.forks)  # processes before any thread
        self.on_tick = on_tick
        self._running: dict[Future, tuple[Step[T], int]] = {}
        self._running_ids: set[int] = set()
        self._started = False

    def start(self) -> None:
        """Start every lane, those that start processes first (before any thread of the lanes exists); run()
        starts them if this was not called before."""
        if not self._started:
            self._started = True
            for lane in self.lanes:
                lane.start()

    def busy(self, *steps: str) -> int:
        """How many shards are running one of `steps` now."""
        return sum(1 for step, _ in self._running.values() if step.name in steps)

    def is_running(self, shard: T) -> bool:
        """Whether `shard` is running a step now."""
        return id(shard) in self._running_ids

    def run(self, shards: Sequence[T], first: Callable[[T], str | None]) -> None:
        """Run every shard from its first step (`first(shard)`; None: nothing to do) to its end.

        Raises:
            MxforgeError (or KeyboardInterrupt): the first step that failed, as its lane translates it; every
                lane is stopped and every step's half-done work abandoned first.
        """
        at = {i: first(shard) for i, shard in enumerate(shards)}
        carry: dict[int, Any] = {}
        unknown = {name for name in at.values() if name is not None} - set(self.steps)
        assert not unknown, f"no such step: {sorted(unknown)}"
        failed = True
        try:
            self.start()
            while any(name is not None for name in at.values()):
                self._fill(shards, at, carry)
                assert self._running, "no shard can start a step: a step's admit() never lets one in"
                done, _ = wait(list(self._running), timeout=SLICE_SECONDS, return_when=FIRST_COMPLETED)
                self._tick()
                for future in done:
                    step, i = self._running.pop(future)
                    self._running_ids.discard(id(shards[i]))
                    try:
                        result = future.result()
                    except BaseException as e:
                        mapped = step.error(shards[i], e) if step.error is not None else step.lane.error(e)
                        if mapped is e:
                            raise
                        raise mapped from None
                    carry[i] = result
                    at[i] = step.done(shards[i], result)
            failed = False
        finally:
            self._stop(shards, failed)
        self._tick()

    def _fill(self, shards: Sequence[T], at: dict[int, str | None], carry: dict[int, Any]) -> None:
        busy = {i for _, i in self._running.values()}
        for step in self.steps.values():
            for i, shard in enumerate(shards):
                if at[i] == step.name and i not in busy and step.admit(shard):
                    future = step.lane.submit(step.fn, *step.args(shard, carry.get(i)))
                    self._running[future] = (step, i)
                    self._running_ids.add(id(shard))
                    busy.add(i)

    def _tick(self) -> None:
        for lane in self.lanes:
            lane.tick()
        if self.on_tick is not None:
            self.on_tick()

    def _stop(self, shards: Sequence[T], failed: bool) -> None:
        if failed:
            for lane in self.lanes:
                lane.interrupt()
        for lane in self.lanes:
            lane.close(failed)
        self._running.clear()
        self._running_ids.clear()
        if failed:
            for step in self.steps.values():
                if step.abandon is not None:
                    for shard in shards:
                        step.abandon(shard)


# --- the quantize and finish steps every mode shares ------------------------------------------------
def quantize_steps(
    workers: ShardWorkers,
    finishers: Lane,
    out_dir: Path,
    *,
    job: Callable[[T], ShardJob],
    name: Callable[[T], str],
    recorded: Callable[[T, ShardResult], str | None],
    admit: Callable[[T], bool] = lambda shard: True,
) -> list[Step[T]]:
    """[quantize, finish]: `job(shard)` quantized by `workers` into `out_dir/NAME.partial` (`name(shard)`), then
    fsynced and renamed into place by `finishers`; `recorded(shard, result)` records the finished shard and names
    its next step. A failed run removes every shard's partial output."""
    return [
        Step(
            "quantize",
            workers,
            workers.run_job,
            done=lambda shard, result: "finish",
            args=lambda shard, previous: (job(shard),),
            admit=admit,
            abandon=lambda shard: partial_path(out_dir / name(shard)).unlink(missing_ok=True),
        ),
        Step("finish", finishers, finish_shard, done=recorded, args=lambda shard, result: (result, out_dir)),
    ]
