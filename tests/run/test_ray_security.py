"""`--executor ray` against the loopback Hub, as an attacker would look at it: the Hub token must reach no file
under Ray's temporary directory (its logs record every runtime environment it creates) nor OUT, and a node stages
bf16 shards only in a private directory it made, never through a link or a folder another user planted."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import TOKEN, hub_env, run_push

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # Ray runs end to end


@pytest.fixture
def ray_tmp():
    """A short temporary directory for Ray (its socket paths must fit in 107 bytes), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="mxr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _files_holding(token: str, *roots: Path) -> list[str]:
    needle = token.encode()
    found = []
    for root in roots:
        for p in root.rglob("*"):
            try:
                if p.is_file() and not p.is_symlink() and needle in p.read_bytes():
                    found.append(str(p))
            except OSError:  # sockets, files Ray removes as we read
                continue
    return found


def _gated_ray_run(out, repo: str, *extra: str, env: dict):
    """A Ray run of the gated repo that pushes to `repo`: it succeeds, every shard downloaded and uploaded."""
    proc = run_push("zai/glm-gated", out, repo, "--executor", "ray", *extra, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)["stages"]["stream"]["report"]
    assert report["stages"]["download"]["shards"] == 3 and report["stages"]["upload"]["shards"] == 3
    return proc


def test_a_ray_run_writes_the_token_to_no_file(hub, tmp_path, ray_tmp):
    """A gated source and a push: every task needs alice's token, and none may find it in Ray's runtime
    environment (which Ray logs in clear to session_*/logs/runtime_env_agent.log), its arguments or results."""
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    env = hub_env(hub, tmp_path, RAY_TMPDIR=str(ray_tmp))
    proc = _gated_ray_run(out, "alice/ray", "--workers", "2", env=env)
    assert list(ray_tmp.rglob("runtime_env_agent*.log")), "Ray wrote no runtime env log where the test looks"
    assert _files_holding(TOKEN, ray_tmp, out) == []
    assert TOKEN not in proc.stdout + proc.stderr


# --- where a node stages the bf16 shards ----------------------------------------------------------------------
TASK = """
import sys
from pathlib import Path
from huggingface_hub import HfApi
from mxforge.checkpoint import Checkpoint
from mxforge.hub.download import remote_files
from mxforge.hub.session import HubLimits
from mxforge.quantize.plan import plan_checkpoint
from mxforge.quantize.recipe import load_recipe
from mxforge.run.ray_executor import ShardTask, run_shard_task

src, out, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
commit, files = remote_files(HfApi(), "zai/glm-gated", "main")
recipe = load_recipe(None)
plan = {s.name: s for s in plan_checkpoint(Checkpoint.open(src), recipe).shards}[name]
remote = {f.name: f for f in files}[name]
run_shard_task(ShardTask(repo_id="zai/glm-gated", commit=commit, remote=remote, plan=plan, out_dir=out,
    work_dir=None, push_repo=None, branch="main", limits=HubLimits.resolve(), scale_offsets=recipe.scale_offsets))
"""
SHARD = "model-00002-of-00003.safetensors"


def _reference_shard(tiny_ckpt, tmp_path) -> bytes:
    from mxforge.checkpoint import Checkpoint
    from mxforge.quantize.plan import plan_checkpoint
    from mxforge.quantize.recipe import load_recipe
    from mxforge.quantize.shard_job import ShardJob, run_shard

    recipe = load_recipe(None)
    plan = {s.name: s for s in plan_checkpoint(Checkpoint.open(tiny_ckpt), recipe).shards}[SHARD]
    ref = tmp_path / "ref"
    ref.mkdir()
    run_shard(ShardJob(str(tiny_ckpt), str(ref), plan, scale_offsets=recipe.scale_offsets))
    return (ref / SHARD).read_bytes()


def _all_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("planted", ["link", "open folder", "folder of another user"])
def test_a_ray_task_never_stages_shards_where_someone_else_planted_a_folder(hub, tmp_path, tiny_ckpt, planted):
    """A node's staging directory was `$TMPDIR/mxforge-ray/<commit>`, made with mkdir(parents, exist_ok): another
    user of the node could plant a link there to a folder they own (and read the gated weights as they arrive), or
    the folder itself, holding a shard of their own. The task must leave what was planted untouched, write nothing
    in it, and still quantize the Hub's bytes."""
    from huggingface_hub import HfApi

    if planted == "folder of another user" and os.geteuid() != 0:
        pytest.skip("only root can make a folder that another user owns")
    commit = HfApi(endpoint=hub.endpoint, token=TOKEN).repo_info("zai/glm-gated").sha
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    node_tmp.chmod(0o1777)  # as /tmp is
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    decoy = (tiny_ckpt / SHARD).read_bytes()[::-1]  # the shard's size, not its bytes
    # Where mxforge staged before (`mxforge-ray/<commit>`) and where it stages now (`mxforge-ray-<uid>`).
    for name in ("mxforge-ray", f"mxforge-ray-{os.getuid()}"):
        if planted == "link":
            (node_tmp / name).symlink_to(theirs)
        else:
            folder = node_tmp / name / commit[:16]
            folder.mkdir(parents=True)
            (folder / SHARD).write_bytes(decoy)
            for d in (folder, folder.parent):
                d.chmod(0o777 if planted == "open folder" else 0o700)
                if planted == "folder of another user":
                    os.chown(d, 65534, 65534)
    before = _all_files(node_tmp) | _all_files(theirs)
    out = tmp_path / "mxfp4"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", TASK, str(tiny_ckpt), str(out), SHARD],
        capture_output=True,
        text=True,
        env={**os.environ, **hub_env(hub, tmp_path, TMPDIR=str(node_tmp))},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / SHARD).read_bytes() == _reference_shard(tiny_ckpt, tmp_path)
    assert _all_files(node_tmp) | _all_files(theirs) == before  # nothing removed from what was planted
    assert list(theirs.rglob("*")) == []  # nothing made in it (the link's target)
    if planted != "link":
        assert sorted(p.name for p in (node_tmp / "mxforge-ray").rglob("*")) == [commit[:16], SHARD]
    # The task staged in a fresh private directory instead, and removed it.
    assert sorted(p.name for p in node_tmp.iterdir()) == ["mxforge-ray", f"mxforge-ray-{os.getuid()}"]


def test_the_staging_directory_is_private_and_checked(tmp_path, monkeypatch):
    from mxforge.errors import MxforgeError
    from mxforge.run.ray_executor import staging_dir

    node_tmp = tmp_path / "tmp"
    node_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    work, fresh = staging_dir("0123456789abcdef" * 2 + "01234567")
    assert (work, fresh) == (node_tmp / f"mxforge-ray-{os.getuid()}" / "0123456789abcdef", False)
    assert all(stat.S_IMODE(os.lstat(d).st_mode) == 0o700 for d in (work, work.parent))
    assert staging_dir("0123456789abcdef" + "0" * 24) == (work, False)  # the same one again: a retry resumes there
    # A level that is not private (opened up since) is not used: a fresh private directory, used once.
    work.chmod(0o755)
    other, fresh = staging_dir("0123456789abcdef" + "0" * 24)
    assert fresh and other.parent == node_tmp and stat.S_IMODE(os.lstat(other).st_mode) == 0o700
    # A temporary directory that others may write, without the sticky bit: nothing made there can be trusted.
    node_tmp.chmod(0o777)
    with pytest.raises(MxforgeError, match="writable by other users and not sticky") as e:
        staging_dir("f" * 40)
    assert e.value.path == node_tmp


@pytest.fixture
def ray_cluster(tmp_path, ray_tmp):
    """A one-node Ray cluster started as an operator would (`ray start --head`), from an environment without
    HF_TOKEN: the node's own credentials are `hf auth login`'s token file under its HF_HOME, and its TMPDIR is its
    own. Yields (address, node HF_HOME, node TMPDIR); every process of its session is killed afterwards."""
    import socket

    node_home, node_tmp = tmp_path / "node-hf-home", Path(tempfile.mkdtemp(prefix="mxn", dir="/tmp"))
    node_home.mkdir()
    (node_home / "token").write_text(TOKEN)
    (node_home / "token").chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    # RAY_AUTH_MODE: Ray's own cluster token (~/.ray/auth_token, shared by every Ray test on this machine) is not
    # what this test is about
    env |= {"HF_HOME": str(node_home), "TMPDIR": str(node_tmp), "RAY_TMPDIR": str(ray_tmp), "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port)]
        + ["--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--include-dashboard", "false"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield f"127.0.0.1:{port}", node_home, node_tmp
    finally:
        session = head.pid  # the session started for the head: every Ray process of the node is in it
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getsid(int(pid)) == session:
                    os.kill(int(pid), 9)
            except (ProcessLookupError, PermissionError):
                continue
        head.wait(timeout=60)
        shutil.rmtree(node_tmp, ignore_errors=True)


def test_a_ray_cluster_uses_its_nodes_credentials_and_stages_privately(hub, tmp_path, ray_tmp, ray_cluster):
    """`--ray-address`: the driver's HF_TOKEN does not reach the cluster, the node's own (its token file) serves
    the gated download and the push; the node stages in its private directory; no file holds the token but the
    node's own token file."""
    pytest.importorskip("ray")
    address, node_home, node_tmp = ray_cluster
    out = tmp_path / "ray"
    env = hub_env(hub, tmp_path, RAY_TMPDIR=str(ray_tmp), RAY_AUTH_MODE="disabled")
    proc = _gated_ray_run(out, "alice/ray-cluster", "--ray-address", address, env=env)
    assert _files_holding(TOKEN, ray_tmp, out, node_tmp) == []
    assert TOKEN not in proc.stdout + proc.stderr
    staged = node_tmp / f"mxforge-ray-{os.getuid()}"
    assert all(stat.S_IMODE(os.lstat(d).st_mode) == 0o700 for d in [staged, *staged.iterdir()])
    assert not list(staged.rglob("*.safetensors"))  # each bf16 shard deleted once quantized
