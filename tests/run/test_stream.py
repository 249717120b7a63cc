"""`mxforge run --stream` against the loopback Hub: the pushed checkpoint is byte-identical to a sequential
run's, blobs are pre-uploaded before the one commit, and a real SIGKILL at a chosen point (during a
shard's download, during a pre-upload) followed by a rerun commits the same bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from helpers import cli, hub_env, push_run_args, pushed_files, run_cli, run_push, start_cli

from mxforge.provenance import PUBLISHED_RECORDS, RUN_STATE_NAME, STREAM_STATE_NAME
from mxforge.run.stream import choose_stream, plan_disk

pytestmark = pytest.mark.slow  # streamed and Ray runs end to end, with real kills

SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
# Provenance records the command line that made them; everything else must be the same bytes.
PROVENANCE = {*PUBLISHED_RECORDS, "README.md"}


def _run(hub, tmp_path, out, repo, *extra):
    return run_push("zai/glm-tiny", out, repo, *extra, env=hub_env(hub, tmp_path))


def _same_checkpoint(a: dict[str, bytes], b: dict[str, bytes]) -> None:
    """Same files; the same bytes except provenance, whose JSON may differ only in the recorded command."""
    assert sorted(a) == sorted(b)
    for name in a:
        if name not in PROVENANCE:
            assert a[name] == b[name], name

    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in ("command", "source", "out", "seconds", "gb_per_s")}
        return [strip(v) for v in obj] if isinstance(obj, list) else obj

    for name in ("mxforge_source.json", "mxforge_fixups.json"):
        assert strip(json.loads(a[name])) == strip(json.loads(b[name])), name


def _commits(hub) -> list[int]:
    return [i for i, r in enumerate(hub.requests) if r[0] == "POST" and "/commit/" in r[1]]


def _puts(hub) -> list[int]:
    return [i for i, r in enumerate(hub.requests) if r[0] == "PUT"]


def test_stream_pushes_the_same_checkpoint_as_a_sequential_run(hub, tmp_path):
    out = tmp_path / "stream"
    proc = _run(hub, tmp_path, out, "alice/streamed", "--stream", "--workers", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    stream = report["stages"]["stream"]["report"]
    assert report["mode"] == "stream"
    assert [s for s in ("download", "quantize") if s in report["stages"]] == []
    assert {k: v["shards"] for k, v in stream["stages"].items()} == {"download": 3, "quantize": 3, "upload": 3}
    assert report["stages"]["validate"]["report"]["ok"] is True
    # Each shard's object went up before the one commit, which came after validation; nothing was committed twice.
    puts, commits = _puts(hub), _commits(hub)
    assert len(puts) == 3 and len(commits) == 1 and max(puts) < commits[0]
    # Every bf16 shard was deleted once quantized; only the small files stay.
    assert not list((out / "bf16").glob("*.safetensors"))
    assert (
        stream["peak_source_bytes_on_disk"] <= stream["disk_plan"]["peak_bytes"] - stream["disk_plan"]["output_bytes"]
    )
    # Headers were planned from byte ranges, not whole-file downloads: each shard was fetched whole once.
    whole = [r for r in hub.requests if r[0] == "GET" and r[1].endswith(".safetensors") and r[2] is None]
    assert sorted(r[1].rsplit("/", 1)[1] for r in whole) == SHARDS

    sequential = _run(hub, tmp_path, tmp_path / "sequential", "alice/sequential", "--no-stream", "--workers", "2")
    assert sequential.returncode == 0, sequential.stderr
    assert "download" in json.loads(sequential.stdout)["stages"]
    _same_checkpoint(pushed_files(hub, "alice/streamed"), pushed_files(hub, "alice/sequential"))

    # A rerun has nothing left to do and commits nothing new.
    hub.requests.clear()
    again = _run(hub, tmp_path, out, "alice/streamed")
    assert again.returncode == 0, again.stderr
    assert "stream" in json.loads(again.stdout)["reused_from_earlier_run"]
    assert _puts(hub) == [] and _commits(hub) == []
    # The mode of a run is kept: asking for the other one in the same OUT is one clear error.
    other = run_cli("run", "zai/glm-tiny", str(out), "--no-stream", "--quiet", env=hub_env(hub, tmp_path))
    assert other.returncode == 2 and "holds a stream run" in other.stderr and "Traceback" not in other.stderr


def _killed_run(hub, tmp_path, out, repo: str, route: str, condition, *extra: str) -> None:
    """Run `mxforge run` in its own process group and SIGKILL the whole group from inside the Hub's handler
    the first time `condition(handler)` holds for a request to `route`; the kill must have happened."""
    fired, box = threading.Event(), {}

    def hook(handler) -> None:
        if not fired.is_set() and condition(handler):
            fired.set()
            os.killpg(box["proc"].pid, signal.SIGKILL)
            box["proc"].wait()

    hub.before[route] = hook
    args = [sys.executable, "-m", "mxforge.cli", *push_run_args("zai/glm-tiny", out, repo, *extra)]
    box["proc"] = subprocess.Popen(
        args,
        env={**os.environ, **hub_env(hub, tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    box["proc"].wait(timeout=600)
    hub.before.clear()
    assert fired.is_set() and box["proc"].returncode == -signal.SIGKILL


def _whole_get(shard: str):
    def condition(handler) -> bool:
        rng = handler.headers.get("Range") or ""
        return (
            handler.command == "GET" and handler.path.endswith(shard) and not rng.rstrip().endswith(tuple("0123456789"))
        )

    return condition


def _nth_put(n: int):
    seen = []

    def condition(handler) -> bool:
        seen.append(handler.path)
        return len(seen) == n

    return condition


@pytest.mark.parametrize("point", ["download of the second shard", "pre-upload of the second shard"])
def test_sigkill_mid_stream_then_rerun_commits_the_same_bytes(hub, tmp_path, point, sequential_reference):
    out = tmp_path / "stream"
    route, condition = ("resolve", _whole_get(SHARDS[1])) if point.startswith("download") else ("lfs_put", _nth_put(2))
    _killed_run(
        hub, tmp_path, out, "alice/streamed", route, condition, "--stream", "--workers", "1", "--in-flight", "1"
    )
    # Killed before the commit: nothing of the product is on the Hub, and the run is recorded unfinished.
    assert _commits(hub) == []
    assert json.loads((out / RUN_STATE_NAME).read_text())["stages"]["stream"]["status"] == "running"
    stream_state = json.loads((out / STREAM_STATE_NAME).read_text())
    assert len(list((out / "bf16").glob("*.safetensors"))) <= 1  # --in-flight 1
    held = {p.name for p in hub.blob_dir.iterdir()}  # objects the Hub received whole before the kill
    puts_before = len(_puts(hub))

    rerun = _run(hub, tmp_path, out, "alice/streamed", "--in-flight", "1")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    report = json.loads(rerun.stdout)["stages"]["stream"]["report"]
    assert report["shards"]["quantized_earlier"] >= 1  # the first shard was not made again
    assert report["stages"]["quantize"]["shards"] == 3 - report["shards"]["quantized_earlier"]
    # No object the Hub already held was sent again (it skips them, whether or not our record of it survived).
    sent_again = {hub.requests[i][1].rsplit("/", 1)[1] for i in _puts(hub)[puts_before:]}
    assert sent_again & held == set()
    assert len(_commits(hub)) == 1
    if point.startswith("pre-upload"):
        # Killed as the second object's request arrived; the client never heard back. The Hub holds the first
        # object, and the second too where its whole body had reached the socket before the kill (on a loaded
        # machine it may not have, and the rerun sent it): either way nothing the Hub held was sent again (above).
        first, second = (hub.requests[i][1].rsplit("/", 1)[1] for i in _puts(hub)[:2])
        assert puts_before == 2 and first in held and (second in held or second in sent_again)
        assert set(stream_state["uploaded"]) <= {SHARDS[0]}
    _same_checkpoint(pushed_files(hub, "alice/streamed"), sequential_reference)


def test_stream_from_a_local_source_keeps_it_and_matches_sequential(tiny_ckpt, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_ckpt.iterdir()}
    cli("run", str(tiny_ckpt), str(tmp_path / "seq"), "--quiet", check=True)
    # The single-node path never imports Ray, installed or not.
    code = (
        "import sys; from mxforge.cli.main import main; "
        "rc = main(['run', sys.argv[1], sys.argv[2], '--stream', '--quiet']); "
        "assert rc == 0 and 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tiny_ckpt), str(tmp_path / "str")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in tiny_ckpt.iterdir()} == before

    def files(d):
        return {
            p.name: p.read_bytes()
            for p in (d / "mxfp4").iterdir()
            if p.is_file() and p.name.endswith((".safetensors", ".index.json", "config.json"))
        }

    assert files(tmp_path / "str") == files(tmp_path / "seq")


def test_stream_applies_the_scale_rule_and_reports_the_same_errors_as_sequential(tiny_ckpt, tmp_path):
    """--scale-rule reaches the streamed shard jobs, and the streamed quantize report carries the error report."""
    for mode, extra in (("seq", ()), ("str", ("--stream",))):
        cli("run", str(tiny_ckpt), str(tmp_path / mode), "--scale-rule", "mse", "--quiet", *extra, check=True)

    def files(d):
        return {
            p.name: p.read_bytes()
            for p in (d / "mxfp4").iterdir()
            if p.is_file() and p.name.endswith((".safetensors", "config.json"))
        }

    assert files(tmp_path / "str") == files(tmp_path / "seq")
    config = json.loads((tmp_path / "str" / "mxfp4" / "config.json").read_text())
    assert config["quantization_config"]["mxforge"]["scale_rule"] == "mse"
    errors = [
        json.loads((tmp_path / m / "mxfp4" / "mxforge_quantize.json").read_text())["error"] for m in ("seq", "str")
    ]
    assert errors[0] is not None and errors[0] == errors[1]


def test_disk_plan_and_the_default_mode():
    # GLM-5.2: 1.5 TB of bf16; a 2 TB disk cannot hold the source and the output: streamed.
    assert choose_stream(1_500 * 10**9, 2_000 * 10**9) is True
    assert choose_stream(1_500 * 10**9, 3_500 * 10**9) is False
    # The output plus the in-flight largest source shards.
    assert plan_disk(424, [5, 9, 7, 1], 2) == 424 + 9 + 7


def _process_of_client(handler) -> int:
    """The pid of the local process on the other end of a Hub request (from /proc: the socket's inode)."""
    port = handler.client_address[1]
    inode = None
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port:
            inode = fields[9]
    assert inode is not None, "the client's socket is not in /proc/net/tcp"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]" for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    raise AssertionError("no process holds the client's socket")


@pytest.fixture
def sequential_reference(hub, tmp_path):
    """What a sequential run pushes; then the Hub forgets the shards' objects, so a later run must send them."""
    proc = _run(hub, tmp_path, tmp_path / "sequential", "alice/sequential", "--no-stream", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    expected = pushed_files(hub, "alice/sequential")
    for f in hub.repos["alice/sequential"].resolve("main").files.values():
        if f.lfs:
            f.disk_path.unlink(missing_ok=True)
    hub.requests.clear()
    return expected


@pytest.mark.ray
def test_ray_task_whose_worker_is_killed_is_retried_without_duplicates(hub, tmp_path, sequential_reference):
    pytest.importorskip("ray")
    killed = []

    def kill_uploader(handler) -> None:  # SIGKILL the Ray worker sending the first object, mid-request
        if not killed:
            killed.append(_process_of_client(handler))
            os.kill(killed[0], signal.SIGKILL)

    hub.before["lfs_put"] = kill_uploader
    out = tmp_path / "ray"
    proc = _run(hub, tmp_path, out, "alice/ray", "--executor", "ray", "--workers", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert killed and killed[0] != os.getpid()
    report = json.loads(proc.stdout)["stages"]["stream"]["report"]
    assert report["stages"]["quantize"]["shards"] == 3 and report["stages"]["upload"]["shards"] == 3
    assert len(_commits(hub)) == 1 and _commits(hub)[0] > max(_puts(hub))
    _same_checkpoint(pushed_files(hub, "alice/ray"), sequential_reference)


@pytest.mark.ray
def test_ray_driver_killed_mid_run_then_rerun_commits_the_same_bytes(hub, tmp_path, sequential_reference):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    _killed_run(hub, tmp_path, out, "alice/ray", "lfs_put", _nth_put(2), "--executor", "ray", "--workers", "2")
    assert _commits(hub) == []
    rerun = _run(hub, tmp_path, out, "alice/ray", "--executor", "ray", "--workers", "2")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert len(_commits(hub)) == 1
    _same_checkpoint(pushed_files(hub, "alice/ray"), sequential_reference)


def test_a_downloaded_shard_whose_header_is_not_the_planned_one_is_refused(tiny_ckpt, tmp_path):
    """The plan comes from headers the Hub served by byte range; the shard that arrives must carry the same one."""
    import shutil

    from mxforge.checkpoint import Checkpoint
    from mxforge.errors import CheckpointError
    from mxforge.quantize.plan import check_planned_header, plan_checkpoint
    from mxforge.quantize.recipe import load_recipe

    plan = {s.name: s for s in plan_checkpoint(Checkpoint.open(tiny_ckpt), load_recipe(None)).shards}
    shard = tmp_path / SHARDS[1]
    shutil.copyfile(tiny_ckpt / SHARDS[1], shard)
    check_planned_header(shard, plan[SHARDS[1]])  # the same header: accepted
    with pytest.raises(CheckpointError, match="differs from the one the Hub served by byte range"):
        check_planned_header(shard, plan[SHARDS[0]])
    assert not shard.exists()


def test_the_reported_disk_peak_counts_each_source_shard_once(tmp_path):
    """Each source shard counts as its file, else its unfinished download: while a finished download is renamed
    into place both can be seen, and counting both (all partials, then all files) once reported a peak above the
    disk plan in CI."""
    from types import SimpleNamespace

    from mxforge.hub.session import HubLimits
    from mxforge.hub.transfer import partial_path
    from mxforge.run.stream import StreamOptions, StreamRun, _Shard

    bf16 = tmp_path / "bf16"
    for name, size in (("a.safetensors", 40), ("b.safetensors", 30), ("sub/c.safetensors", 20)):
        partial = partial_path(bf16, name, "etag-" + name)
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(b"x" * size)
    (bf16 / "a.safetensors").write_bytes(b"x" * 100)  # a's download is complete: its partial is being renamed
    (bf16 / "other.json").write_bytes(b"x" * 7)  # not a source shard
    limits = HubLimits(api_timeout=1, metadata_timeout=1, data_timeout=1, retries=1)
    run = StreamRun(StreamOptions("zai/x", False, bf16, tmp_path / "out", tmp_path / "state.json", None, limits=limits))
    shards = [_Shard(SimpleNamespace(name=n)) for n in ("a.safetensors", "b.safetensors", "sub/c.safetensors")]
    assert run._source_bytes_on_disk(shards) == 100 + 30 + 20


def test_a_streamed_run_holds_the_lock_of_every_directory_it_writes(hub, tmp_path, tiny_ckpt):
    """While a streamed run works in OUT, `mxforge quantize SRC OUT/mxfp4` (or a download into OUT/bf16) is refused
    naming the run's pid; it used to run to completion inside the stream's output."""
    from mxforge.dir_lock import directory_lock
    from mxforge.errors import DirectoryInUse
    from mxforge.quantize.run import quantize_checkpoint

    reached, release = threading.Event(), threading.Event()

    def stall(handler) -> None:  # hold the second shard's download until the test is done trying
        if _whole_get(SHARDS[1])(handler):
            reached.set()
            release.wait(120)

    hub.before["resolve"] = stall
    out = tmp_path / "stream"
    proc = start_cli(
        "run",
        "zai/glm-tiny",
        str(out),
        "--stream",
        "--quiet",
        "--workers",
        "1",
        "--in-flight",
        "1",
        env=hub_env(hub, tmp_path),
    )
    try:
        assert reached.wait(300), "the streamed run never fetched its second shard"
        with pytest.raises(DirectoryInUse, match=f"in use by pid {proc.pid}") as e:
            quantize_checkpoint(tiny_ckpt, out / "mxfp4", quiet=True)
        assert (e.value.path, e.value.pid) == (out / "mxfp4", proc.pid)
        assert not (out / "mxfp4" / "config.json").exists()
        with pytest.raises(DirectoryInUse):
            with directory_lock(out / "bf16"):
                pass
    finally:
        release.set()
        stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout + stderr
