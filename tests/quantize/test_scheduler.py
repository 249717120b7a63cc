"""The one shard scheduler (quantize/scheduler.py) on its own: shards move through steps within each step's bounds,
the first failure (or Ctrl-C, seen within a wait slice) interrupts every lane and abandons every shard's half-done
work, and a worker process that dies is one MxforgeError. The modes that use it are tested end to end in
test_quantize_resume.py, tests/run/test_stream.py and tests/run/test_run.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from mxforge.errors import MxforgeError
from mxforge.quantize.scheduler import (
    SLICE_SECONDS,
    WORKER_DIED,
    Inline,
    ShardScheduler,
    ShardWorkers,
    Step,
    Threads,
)


class Probe:
    """Counts how many shards run a step at once."""

    def __init__(self):
        self.now = self.most = 0
        self.lock = threading.Lock()

    def work(self, shard, seconds: float = 0.02):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(seconds)
        with self.lock:
            self.now -= 1
        return shard * 10


def test_shards_move_through_the_steps_within_each_bound():
    fetch, crunch, log = Probe(), Probe(), []
    steps = [
        Step(
            "fetch",
            Threads(4, "fetch"),
            fetch.work,
            done=lambda s, r: "crunch",
            admit=lambda s: sched.busy("fetch") < 2,
        ),
        Step(
            "crunch",
            Threads(4, "crunch"),
            crunch.work,
            args=lambda s, fetched: (s if fetched is None else fetched,),  # what the step before returned, if any
            done=lambda s, r: log.append((s, r)),
        ),
    ]
    sched: ShardScheduler[int] = ShardScheduler(steps)
    sched.run(list(range(8)), lambda s: "fetch" if s % 2 else "crunch")  # even shards start further on
    assert fetch.most == 2 and crunch.most <= 4
    assert sorted(log) == sorted((s, s * 100 if s % 2 else s * 10) for s in range(8))


def test_the_first_failure_interrupts_every_lane_and_abandons_every_shard():
    interrupted, abandoned = threading.Event(), []
    slow = Threads(2, "slow", on_interrupt=interrupted.set)

    def work(shard):
        if shard == 3:
            raise MxforgeError("shard 3 is broken", shard=str(shard))
        interrupted.wait(30)  # a transfer that stops when its lane is interrupted
        return shard

    steps = [
        Step("slow", slow, work, done=lambda s, r: None, abandon=abandoned.append),
        Step("fails", Inline(), work, done=lambda s, r: None),
    ]
    started = time.monotonic()
    with pytest.raises(MxforgeError, match="shard 3 is broken") as e:
        ShardScheduler(steps).run([1, 2, 3], lambda s: "fails" if s == 3 else "slow")
    assert e.value.shard == "3" and interrupted.is_set() and sorted(abandoned) == [1, 2, 3]
    assert time.monotonic() - started < 10


def test_ctrl_c_is_seen_within_a_wait_slice_and_abandons_the_shards():
    abandoned = []
    steps = [
        Step(
            "sleep",
            Threads(1, "sleep"),
            time.sleep,
            args=lambda s, _: (3,),
            done=lambda s, r: None,
            abandon=abandoned.append,
        )
    ]

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            ShardScheduler(steps).run(["a"], lambda s: "sleep")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # the sleeping thread is not waited for (Threads does not wait on failure): the run ends at once
    assert time.monotonic() - started < 0.3 + 4 * SLICE_SECONDS and abandoned == ["a"]


def _die(_job):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_process_that_dies_is_one_error_saying_what_to_do(tiny_ckpt):
    from mxforge.checkpoint import Checkpoint
    from mxforge.quantize.plan import plan_checkpoint
    from mxforge.quantize.recipe import load_recipe
    from mxforge.quantize.shard_job import ShardJob

    plan = plan_checkpoint(Checkpoint.open(tiny_ckpt), load_recipe(None))
    jobs = [ShardJob(str(tiny_ckpt), "/nonexistent", s) for s in plan.shards]
    workers = ShardWorkers(2, jobs)
    assert workers.forks
    with pytest.raises(MxforgeError) as e:
        ShardScheduler([Step("die", workers, _die, done=lambda s, r: None)]).run(jobs, lambda j: "die")
    assert str(e.value) == WORKER_DIED


def test_formats_without_a_compiled_cpu_kernel_are_quantized_in_spawned_workers(tmp_path):
    """Workers are forked only when every format's CPU kernel for its inputs runs without torch (Kernels.warm):
    MXFP6's portable kernel (no C compiler, or MXFORGE_KERNEL=portable as here) runs torch ops, and a worker forked
    from a process whose torch thread pool already ran waited on it forever (an in-process quantize after the
    fixture was written: the consumer test hung). Run in a child process with a deadline, so a regression fails
    here instead of hanging the suite."""
    import os
    import subprocess
    import sys

    from mxforge.formats import format_named
    from mxforge.formats.ocp_mx import c_kernel

    e2m3 = format_named("mxfp6_e2m3")
    assert e2m3.kernels.warm is not None and not e2m3.kernels.warm({"BF16", "F32"})  # float32 rows: torch
    assert e2m3.kernels.warm({"BF16"}) == (c_kernel(e2m3.kernels.encode_cpu.args[0]) is not None)

    recipe = tmp_path / "mxfp6.toml"
    recipe.write_text('name = "w6"\nscheme = "mxfp4"\n[[quantize]]\nkinds = ["experts"]\nformat = "mxfp6_e2m3"\n')
    script = f"""
import torch
from mxforge.cli.main import main
from mxforge.models.fixture import write_fixture
torch.set_num_threads(2)
write_fixture({str(tmp_path / "src")!r}, "tiny", quiet=True)
torch.randn(512, 512) @ torch.randn(512, 512)  # this process's torch thread pool has run
main(["quantize", {str(tmp_path / "src")!r}, {str(tmp_path / "out")!r}, "--recipe", {str(recipe)!r},
      "--workers", "2", "--quiet"])
"""
    env = {**os.environ, "MXFORGE_KERNEL": "portable"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
