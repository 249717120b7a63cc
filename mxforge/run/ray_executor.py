"""`mxforge run --executor ray`: each shard one Ray task, on whichever node Ray schedules it.

A task downloads its bf16 shard from the Hub onto its node (verified against the Hub's sha256), quantizes
it with quantize's own shard job into OUT/mxfp4 (written as NAME.partial, renamed when whole), pre-uploads
the output shard's LFS object (no commit), deletes the bf16 shard and returns the shard's quantize record
and hashes. The driver (mxforge.run.stream) records each result as it arrives, then writes the index,
config.json and fixups, validates and commits once, exactly as a streamed run does.

OUT must be a directory every node sees at the same path (the driver's own disk for a local Ray; NFS,
Lustre, a mounted bucket... on a cluster); on a cluster, bf16 shards stay on each node, in a directory of its
temporary directory that only this user can enter (staging_dir). The Hub token never travels with a task
(start_ray, and docs/security.md "Ray clusters").
A task whose worker or node dies is run again by Ray (`max_retries`), on any node: it writes the same
bytes under the same name, the Hub keeps one object per sha256 and the driver records each shard once,
so a retry leaves neither a duplicate nor a gap. Ray is optional (`pip install mxforge[ray]`): only this
module imports it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mxforge.errors import MxforgeError
from mxforge.file_hashes import file_hash
from mxforge.quantize.scheduler import Lane, ShardScheduler, Step, Threads
from mxforge.safetensors_io import partial_path

if TYPE_CHECKING:  # annotations only: a task imports these on its node
    from mxforge.hub.download import RemoteFile
    from mxforge.hub.session import HubLimits
    from mxforge.quantize.plan import ShardPlan

TASK_RETRIES = 3  # Ray reruns a task whose worker process or node died this many times
# The Hub settings that travel to the tasks in their runtime environment. Never the token: Ray writes every
# runtime environment it creates, in clear, to <ray temp>/session_*/logs/runtime_env_agent.log (on a cluster, the
# head's). HF_TOKEN_PATH, a path to a token file, is not a secret.
HUB_ENV = (
    "HF_ENDPOINT",
    "HF_TOKEN_PATH",
    "HF_HUB_DISABLE_XET",
    "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_ETAG_TIMEOUT",
    "HF_HUB_DOWNLOAD_TIMEOUT",
    "MXFORGE_HUB_TIMEOUT",
    "MXFORGE_HUB_RETRIES",
)
TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # huggingface_hub's; never in a runtime env, argument or result


@dataclass(frozen=True, kw_only=True)
class ShardTask:
    """Everything a node needs for one shard (pickled to the task)."""

    repo_id: str
    commit: str
    remote: RemoteFile
    plan: ShardPlan
    out_dir: str  # OUT/mxfp4, the same path on every node
    work_dir: str | None  # where the bf16 shard goes (None: staging_dir, on the node)
    push_repo: str | None
    branch: str
    limits: HubLimits
    scale_offsets: tuple[int, ...]  # the recipe's scale rule (quantize/scale_rules.py)


def run_shard_task(task: ShardTask) -> dict:
    """Download, quantize and pre-upload one shard on this node; returns its records (see the module docstring).

    Raises:
        MxforgeError: as fetch_verified, run_shard and preupload_file; a staging directory that is not private.
    """
    from huggingface_hub import HfApi

    from mxforge.hub.download import fetch_verified
    from mxforge.hub.session import use_hub_limits
    from mxforge.quantize.plan import check_planned_header
    from mxforge.quantize.shard_job import ShardJob, run_shard

    use_hub_limits(task.limits)
    api = HfApi()
    work, fresh = (Path(task.work_dir), False) if task.work_dir else staging_dir(task.commit)
    try:
        times = {"download": [time.time()]}
        fetch_verified(api, task.repo_id, task.commit, work, task.remote, task.limits)
        check_planned_header(work / task.plan.name, task.plan)
        st = (work / task.plan.name).stat()
        times["download"].append(time.time())
        times["quantize"] = [time.time()]
        job = ShardJob(
            str(work),
            task.out_dir,
            task.plan,
            expected_sha256=task.remote.sha256,
            verified_stat=(st.st_size, st.st_mtime_ns),  # verified just now, in a directory only we can write
            scale_offsets=task.scale_offsets,
        )
        result = run_shard(job)
        (work / task.plan.name).unlink(missing_ok=True)
        times["quantize"].append(time.time())
    finally:
        if fresh:
            shutil.rmtree(work, ignore_errors=True)
    fh = None
    if task.push_repo:
        from mxforge.hub.push import preupload_file

        times["upload"] = [time.time()]
        path = Path(task.out_dir) / task.plan.name
        fh = file_hash(path, task.plan.name)
        preupload_file(api, Path(task.out_dir), task.push_repo, task.branch, fh)
        times["upload"].append(time.time())
    return {"result": result, "file": fh, "times": times, "node": os.uname().nodename}


def staging_dir(commit: str) -> tuple[Path, bool]:
    """(where this node stages the bf16 shards of `commit`, whether it is a fresh directory to remove after the
    task): `<tmp>/mxforge-ray-<uid>/<commit[:16]>`, each level made by os.mkdir with mode 0700 and then checked
    with lstat (a directory, not a link, ours, closed to everyone else): a partial download there is continued by
    a retried task. Where a level is not that (planted by someone who can write the temporary directory), a fresh
    private directory (tempfile.mkdtemp) instead, used once.

    Raises:
        MxforgeError: the temporary directory itself is writable by others without the sticky bit, so that what
            we make in it could be renamed away and replaced (set TMPDIR to a private or sticky directory).
    """
    tmp = Path(tempfile.gettempdir())
    st = os.stat(tmp)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise MxforgeError(
            f"{tmp}: the temporary directory is writable by other users and not sticky, so bf16 shards staged in "
            "it could be swapped or read; set TMPDIR on the Ray nodes to a private directory",
            path=tmp,
        )
    stable = tmp / f"mxforge-ray-{os.getuid()}"
    for level in (stable, stable / commit[:16]):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:
            pass
        if not _is_private_dir(level):
            return Path(tempfile.mkdtemp(prefix="mxforge-ray-")), True
    return stable / commit[:16], False


def _is_private_dir(path: Path) -> bool:
    """A directory (not a link to one) of this user that no one else may enter or write."""
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def start_ray(address: str | None, workers: int):
    """Connect to the Ray cluster at `address`, or start a local one with `workers` CPUs. The Hub's settings
    (HUB_ENV) travel to the tasks in their runtime environment; the token does not (see docs/security.md, "Ray
    clusters"): a local Ray's processes are this process's children and inherit its environment, HF_TOKEN
    included; a cluster's tasks use their node's own credentials (its HF_TOKEN, `hf auth login` state, or the
    token file HF_TOKEN_PATH names)."""
    import ray

    env = {k: os.environ[k] for k in HUB_ENV if k in os.environ}
    kwargs = {"address": address} if address else {"num_cpus": workers, "include_dashboard": False}
    with warnings.catch_warnings():  # Ray's notice about a future change of its GPU env handling
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(runtime_env={"env_vars": env}, logging_level=logging.WARNING, log_to_driver=False, **kwargs)
    return ray


class RayTasks(Lane):
    """A lane whose work runs as Ray tasks (TASK_RETRIES retries each, one CPU), on the cluster at `address` or a
    local Ray with `workers` CPUs; Ray schedules them, so the lane takes every shard at once."""

    def __init__(self, address: str | None, workers: int):
        self.address, self.workers = address, workers
        self.ray = None
        self._remote: dict = {}

    def start(self) -> None:
        self.ray = start_ray(self.address, self.workers)

    def submit(self, fn, *args) -> Future:
        assert self.ray is not None, "the scheduler starts every lane before it submits"
        if fn not in self._remote:
            self._remote[fn] = self.ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(fn)
        return self._remote[fn].remote(*args).future()

    def close(self, failed: bool) -> None:
        if self.ray is not None:
            self.ray.shutdown()


def task_error(name: str, e: BaseException) -> BaseException:
    """The error to raise for shard `name`'s Ray task that failed with `e`: the task's own MxforgeError as it was
    raised (fields included), else one line naming the shard."""
    import ray

    if isinstance(e, ray.exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, MxforgeError):
            return cause
        return MxforgeError(f"shard {name}: its Ray task failed: {cause or e}", shard=name)
    if isinstance(e, ray.exceptions.RayError):
        return MxforgeError(
            f"shard {name}: its Ray task failed {TASK_RETRIES + 1} time(s) ({type(e).__name__}); rerun the same "
            "command to resume",
            shard=name,
        )
    return e


def run_on_ray(run, todo: list, qstate, state, *, address: str | None, workers: int) -> None:
    """Run every shard of `todo` (mxforge.run.stream._Shard) as a Ray task, through quantize's shard scheduler;
    record each result through `run`. Shards quantized earlier but not yet sent are sent from here (OUT is shared).

    Raises:
        MxforgeError: a task's own error (the first one), or a task that failed TASK_RETRIES + 1 times.
    """
    try:
        import ray  # noqa: F401
    except ImportError:
        raise MxforgeError("--executor ray needs Ray: pip install 'mxforge[ray]'") from None
    o = run.o
    work_dir = None if address else str(o.bf16_dir)  # a local Ray shares the driver's disk: resume partials there

    def task(s) -> tuple:
        s.started = time.time()
        return (
            ShardTask(
                repo_id=o.source,
                commit=run.commit,
                remote=s.remote,
                plan=s.plan,
                out_dir=str(o.mxfp4_dir),
                work_dir=work_dir,
                push_repo=o.push_repo,
                branch=o.branch,
                limits=o.limits,
                scale_offsets=run.recipe.scale_offsets,
            ),
        )

    def recorded(s, out: dict) -> None:
        for stage, (start, end) in out["times"].items():
            run.clocks[stage].add(start, s.plan.source_size if stage != "upload" else s.plan.output_size, end)
        s.step = "quantize"
        run.record_quantized(s, out["result"], qstate, state, clock=False)
        if out["file"] is not None:
            run.record_upload(s, out["file"], state, clock=False)

    def uploaded(s, fh) -> None:
        run.record_upload(s, fh, state)

    def begin(s) -> tuple:
        s.started = time.time()
        return (s,)

    steps = [
        Step(
            "shard",
            RayTasks(address, workers),
            run_shard_task,
            args=lambda s, previous: task(s),
            done=recorded,
            abandon=lambda s: partial_path(o.mxfp4_dir / s.plan.name).unlink(missing_ok=True),
            error=lambda s, e: task_error(s.plan.name, e),
        ),
        Step(
            "upload", Threads(o.uploads, "upload"), run.upload_shard, args=lambda s, previous: begin(s), done=uploaded
        ),
    ]
    with contextlib.redirect_stdout(sys.stderr):  # Ray's notices (a worker died, a task is retried) are not our output
        ShardScheduler(steps).run(todo, lambda s: {"upload": "upload", "done": None}.get(s.step, "shard"))
