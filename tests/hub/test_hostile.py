"""A hostile Hub, a hostile checkpoint, a hostile user (issue 10). Every attack ends in one clear line and
exit 2 (130 for Ctrl-C), writes nothing where it should not, sends the token nowhere else, and takes
bounded time: the Hub timeouts and retries are set small through the environment or --timeout.

The real `mxforge` command in a subprocess, the real huggingface_hub client, the loopback Hub
(tests/support/loopback_hub.py) in its tampering modes on 127.0.0.1. Select with `pytest -k hostile`.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import TOKEN, cli, hub_env, one_error_line, run_cli, start_cli
from loopback_hub import LoopbackHub
from safetensors.numpy import save_file

SHARD = "model-00002-of-00003.safetensors"
ONE = "w.safetensors"  # the only weight file of the repo zai/one
FAST = {"MXFORGE_HUB_TIMEOUT": "1", "MXFORGE_HUB_RETRIES": "1"}  # every Hub wait and retry loop ends in seconds


@pytest.fixture
def hub(hub, tmp_path):
    """The shared test Hub (conftest.py), plus zai/one: one 4 MB weight file."""
    one = tmp_path / "one-src"
    one.mkdir()
    save_file({"w": np.random.default_rng(1).standard_normal(1_000_000).astype(np.float32)}, str(one / ONE))
    (one / "config.json").write_text("{}")
    hub.add_repo_from_dir("zai/one", one)
    return hub


def _env(hub, tmp_path, **extra) -> dict:
    return hub_env(hub, tmp_path, **extra)


def _mx(hub, tmp_path, *args, timeout: float = 60, **env):
    return run_cli(*args, env=_env(hub, tmp_path, **env), timeout=timeout)


def _gets(hub, name: str) -> list[str | None]:
    """The Range header of every GET of `name`'s bytes."""
    return [r[2] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1] and r[1].endswith("/" + name)]


def _partials(dest: Path) -> list[Path]:
    return list((dest / ".cache" / "mxforge" / "download").rglob("*.partial"))


def _wait_for(condition, what: str, deadline_s: float = 30) -> None:
    """Poll until `condition()` holds (the bound only keeps a broken run from hanging the suite)."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.05)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- 1. remote file names ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind", ["dotdot", "nested-dotdot", "absolute", "backslash", "nul", "long-component", "reserved-cache"]
)
def test_hostile_file_names_are_refused_before_anything_is_written(hub, tmp_path, kind):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")  # the size the hostile file declares: the 'already present' path sees it
    name = {
        "dotdot": "../victim.txt",
        "nested-dotdot": "sub/../../victim.txt",
        "absolute": str(victim),
        "backslash": "..\\victim.txt",
        "nul": "victim\0.txt",
        "long-component": "x" * 300,
        "reserved-cache": ".cache/mxforge/hashes.json",
    }[kind]
    hub.add_file("zai/glm-tiny", name, b"HOSTILE!")
    dest = tmp_path / "dest"
    line = one_error_line(_mx(hub, tmp_path, "download", "zai/glm-tiny", str(dest), "--quiet"))
    assert repr(name) in line and "refused because" in line and "nothing was downloaded or deleted" in line
    assert victim.read_bytes() == b"precious"
    assert not dest.exists()  # not even DEST was created
    assert not [r for r in hub.requests if "/resolve/" in r[1]]  # no file was requested


def test_hostile_symlink_inside_dest_does_not_lead_outside(hub, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("keep me")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    hub.add_file("zai/glm-tiny", "sub/config.json", b"HOSTILE")
    line = one_error_line(_mx(hub, tmp_path, "download", "zai/glm-tiny", str(dest), "--quiet"))
    assert "'sub/config.json'" in line and "would land outside" in line and str(dest / "sub") in line
    assert (outside / "config.json").read_text() == "keep me"


def test_hostile_index_naming_a_shard_outside_the_checkpoint(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt, tmp_path / "ckpt")
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    for command in ("validate", "quantize"):
        args = [command, str(ckpt)] + ([str(tmp_path / "out"), "--quiet"] if command == "quantize" else [])
        line = one_error_line(cli(*args))
        assert "'../elsewhere.safetensors'" in line and "refused because" in line and first in line
    assert not (tmp_path / "out").exists()


# --- 2. transfer limits ------------------------------------------------------------------------------
def test_hostile_short_body_with_ignored_range_stops_after_bounded_retries(hub, tmp_path):
    hub.short_body[ONE] = 1_000_000  # every answer: the first 1 MB again, with a Content-Length that says so
    hub.ignore_range.add(ONE)
    dest = tmp_path / "dest"
    line = one_error_line(_mx(hub, tmp_path, "download", "zai/one", str(dest), "--quiet", MXFORGE_HUB_RETRIES="2"))
    assert f"file '{ONE}'" in line and "no new byte in 3 attempt(s)" in line and "rerun the same command" in line
    assert len(_gets(hub, ONE)) == 4  # the first attempt (progress), then 3 that brought nothing
    [partial] = _partials(dest)
    assert partial.stat().st_size == 1_000_000 and not (dest / ONE).exists()

    # Short answers that honour Range still progress: the file completes and verifies.
    hub.ignore_range.clear()
    hub.short_body[ONE] = 1_500_000
    hub.requests.clear()
    proc = _mx(hub, tmp_path, "download", "zai/one", str(dest), "--quiet", MXFORGE_HUB_RETRIES="2")
    assert proc.returncode == 0, proc.stderr
    assert _gets(hub, ONE) == ["bytes=1000000-", "bytes=2500000-", "bytes=4000000-"]
    assert (dest / ONE).read_bytes() == (tmp_path / "one-src" / ONE).read_bytes()


def test_hostile_ignored_range_is_read_past_the_kept_bytes(hub, tmp_path):
    hub.drop_at[ONE] = (2_000_000, 1)  # the first attempt dies at 2 MB
    hub.ignore_range.add(ONE)  # the second gets the whole file again instead of the rest
    dest = tmp_path / "dest"
    proc = _mx(hub, tmp_path, "download", "zai/one", str(dest), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert _gets(hub, ONE) == [None, "bytes=2000000-"]
    assert (dest / ONE).read_bytes() == (tmp_path / "one-src" / ONE).read_bytes()


@pytest.mark.parametrize("announced", [True, False], ids=["announced", "unannounced"])
def test_hostile_long_body_aborts_the_file(hub, tmp_path, announced):
    hub.long_body[ONE] = (5_000_000, announced)
    size = (tmp_path / "one-src" / ONE).stat().st_size
    dest = tmp_path / "dest"
    line = one_error_line(_mx(hub, tmp_path, "download", "zai/one", str(dest), "--quiet"))
    assert f"file '{ONE}'" in line and f"{size:,} bytes its metadata declared" in line
    assert not (dest / ONE).exists() and not _partials(dest)
    assert len(_gets(hub, ONE)) == 1  # not retried: a Hub that sends too much is not asked again


def test_hostile_wrong_hashes_from_the_hub(hub, tmp_path):
    hub.misreport_sha256.add(ONE)
    dest = tmp_path / "dest"
    line = one_error_line(_mx(hub, tmp_path, "download", "zai/one", str(dest), "--quiet"))
    assert ONE in line and "do not match the Hub's metadata and were deleted" in line
    assert not (dest / ONE).exists() and not (dest / "mxforge_source.json").exists()


@pytest.mark.slow
def test_hostile_stalls_at_every_endpoint_end_in_one_line(tmp_path, tiny_ckpt):
    """One stalled endpoint per hub, all at once (stalls cost no CPU, so the test takes as long as the
    slowest: huggingface_hub retries a stalled preupload 5 times with backoff). The timeouts come from
    every source: MXFORGE_HUB_TIMEOUT, --timeout, and huggingface_hub's own HF_HUB_ETAG_TIMEOUT /
    HF_HUB_DOWNLOAD_TIMEOUT (honoured when no mxforge timeout is given)."""
    cases = {  # stalled route: (command, extra env, what the line says)
        "repo_info": (["download", "zai/glm-tiny", "DEST"], {"MXFORGE_HUB_TIMEOUT": "1"}, "stopped answering"),
        "HEAD resolve": (["download", "zai/glm-tiny", "DEST"], {"HF_HUB_ETAG_TIMEOUT": "1"}, "stopped answering"),
        "GET resolve": (
            ["download", "zai/glm-tiny", "DEST"],
            {"HF_HUB_DOWNLOAD_TIMEOUT": "1", "MXFORGE_HUB_RETRIES": "1"},
            "no new byte in 2 attempt(s)",
        ),
        "preupload": (["push", "CKPT", "alice/out", "--force"], {"MXFORGE_HUB_TIMEOUT": "1"}, "stopped answering"),
        "commit": (["push", "CKPT", "alice/out", "--force", "--timeout", "1"], {}, "stopped answering"),
    }
    hubs, procs = [], {}
    try:
        for i, (route, (args, env, _)) in enumerate(cases.items()):
            hub = LoopbackHub(tmp_path / f"hub{i}", tokens={TOKEN: "alice"})
            hub.add_repo_from_dir("zai/glm-tiny", tiny_ckpt)
            hub.stall.add(route)
            hub.start()
            hubs.append(hub)
            args = [a.replace("DEST", str(tmp_path / f"dest{i}")) for a in args]
            args = [str(_copy(tiny_ckpt, tmp_path / f"ckpt{i}")) if a == "CKPT" else a for a in args]
            procs[route] = start_cli(*args, "--quiet", env=_env(hub, tmp_path, **env))
        for route, proc in procs.items():
            proc.stdout, proc.stderr = proc.communicate(timeout=90)
            line = one_error_line(proc)
            assert cases[route][2] in line and "rerun the same command" in line, (route, line)
            assert TOKEN not in proc.stderr
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for hub in hubs:
            hub.stop()


def test_hostile_ctrl_c_stops_at_once_and_keeps_the_partial_file(hub, tmp_path):
    hub.stall_body_at[ONE] = 2_000_000  # 2 MB, then the server goes silent (for longer than the timeout below)
    dest = tmp_path / "dest"
    # PYTHONFAULTHANDLER: if the child outlives the wait, SIGABRT makes it print every thread's stack (an
    # order-dependent hang seen in CI, not reproduced alone: the stacks say where it waits)
    env = _env(hub, tmp_path, MXFORGE_HUB_TIMEOUT="120", PYTHONFAULTHANDLER="1")
    proc = start_cli("download", "zai/one", str(dest), "--quiet", env=env)
    try:
        _wait_for(lambda: any(p.stat().st_size >= 1_000_000 for p in _partials(dest)), "the download to start")
        proc.send_signal(signal.SIGINT)
        try:  # well under the 120 s the stalled read would wait
            proc.stdout, proc.stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, stacks = proc.communicate(timeout=30)
            pytest.fail(
                f"mxforge download still running 60 s after SIGINT (this test process's SIGINT handler: "
                f"{signal.getsignal(signal.SIGINT)!r}); its threads:\n{stacks[-6000:]}"
            )
    finally:
        if proc.poll() is None:
            proc.kill()
    line = one_error_line(proc, code=130)
    assert "interrupted" in line and "rerun the same command to resume" in line
    [partial] = [p for p in _partials(dest) if p.name.startswith(ONE)]  # (config.json's may be in flight too)
    kept = partial.stat().st_size
    assert 0 < kept <= 2_000_000

    hub.stall_body_at.clear()
    hub.requests.clear()
    proc = _mx(hub, tmp_path, "download", "zai/one", str(dest), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert _gets(hub, ONE) == [f"bytes={kept}-"]  # continued, not restarted
    assert (dest / ONE).read_bytes() == (tmp_path / "one-src" / ONE).read_bytes()


# --- 3. push commits only what was validated -----------------------------------------------------------
def test_hostile_push_refuses_a_checkpoint_changed_during_the_upload(hub, tmp_path, tiny_ckpt):
    ckpt = _copy(tiny_ckpt, tmp_path / "ckpt")
    config = ckpt / "config.json"
    edited = config.read_text() + " "

    def edit(handler) -> None:  # someone edits config.json while the push is uploading
        config.write_text(edited)

    hub.before["preupload"] = edit
    line = one_error_line(_mx(hub, tmp_path, "push", str(ckpt), "alice/out", "--quiet", "--force"))
    assert "config.json (modified)" in line and "during the upload" in line and "nothing was committed" in line
    assert f"rerun `mxforge push {ckpt} alice/out`" in line
    repo = hub.repos["alice/out"]
    assert not repo.commits[repo.branches["main"]].files  # the repo exists, but no file was committed

    del hub.before["preupload"]
    proc = _mx(hub, tmp_path, "push", str(ckpt), "alice/out", "--quiet", "--force")  # the advice, followed
    assert proc.returncode == 0, proc.stderr
    committed = repo.commits[repo.branches["main"]].files
    assert committed["config.json"].disk_path.read_text() == edited


# --- 4. the token goes to HF_ENDPOINT's exact origin only ----------------------------------------------------
def test_hostile_redirect_to_another_port_gets_no_token(hub, tmp_path):
    hub.redirect_resolve = True  # file requests: 302 to the same path on another port of 127.0.0.1
    dest = tmp_path / "dest"
    proc = _mx(hub, tmp_path, "download", "zai/one", str(dest), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert hub.mirror_requests, "the redirect was not followed"
    assert not [r for r in hub.mirror_requests if r[2]], hub.mirror_requests  # no Authorization reached it
    assert any(r[0] == "GET" for r in hub.requests if r[1] == "/api/models/zai/one/revision/main")
    assert (dest / ONE).read_bytes() == (tmp_path / "one-src" / ONE).read_bytes()


# --- 5. operating-system failures ------------------------------------------------------------------------
@pytest.fixture
def readonly(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    yield ro
    ro.chmod(0o755)


def _unreadable_config(tiny_ckpt: Path, tmp_path: Path) -> str:
    ckpt = _copy(tiny_ckpt, tmp_path / "locked")
    (ckpt / "config.json").chmod(0)
    return str(ckpt)


def _readonly_copy(tiny_ckpt: Path, tmp_path: Path) -> str:
    ckpt = _copy(tiny_ckpt, tmp_path / "frozen")
    ckpt.chmod(0o555)
    return str(ckpt)


def _full_report(tiny_ckpt: Path, tmp_path: Path) -> str:
    """A --json REPORT whose temporary file is /dev/full: every write ends in ENOSPC."""
    (tmp_path / "report.json.partial").symlink_to("/dev/full")
    return str(tmp_path / "report.json")


OS_CASES = {  # id: (arguments, with RO = a read-only directory, LONG = a 300-character name; the error words)
    "fixture-readonly": (["fixture", "RO/out"], "Permission denied"),
    "fixture-name-too-long": (["fixture", "LONG"], "File name too long"),
    "download-readonly": (["download", "zai/glm-tiny", "RO/dest", "--quiet"], "Permission denied"),
    "download-name-too-long": (["download", "zai/glm-tiny", "LONG", "--quiet"], "File name too long"),
    "run-readonly": (["run", "TINY", "RO/out", "--quiet"], "Permission denied"),
    "quantize-readonly": (["quantize", "TINY", "RO/out", "--quiet"], "Permission denied"),
    "push-readonly": (["push", "FROZEN", "alice/out", "--quiet"], "Permission denied"),
    "fixup-readonly": (["fixup", "FROZEN"], "Permission denied"),
    "validate-unreadable": (["validate", "LOCKED"], "Permission denied"),
    "inspect-unreadable": (["inspect", "LOCKED"], "Permission denied"),
    "inspect-disk-full": (["inspect", "TINY", "--json", "FULL"], "No space left on device"),
}


@pytest.mark.parametrize("case", list(OS_CASES))
def test_hostile_os_failures_are_one_line_and_exit_2(hub, tmp_path, tiny_ckpt, readonly, case):
    args, words = OS_CASES[case]
    if case == "fixup-readonly":
        from helpers import AMD
        from quark_like import write_quark_like

        write_quark_like(tiny_ckpt, tmp_path / "q", AMD)  # a checkpoint fixup has to edit
        tiny = tmp_path / "q"
    else:
        tiny = tiny_ckpt
    subst = {
        "TINY": lambda: str(tiny_ckpt),
        "FROZEN": lambda: _readonly_copy(tiny, tmp_path),
        "LOCKED": lambda: _unreadable_config(tiny_ckpt, tmp_path),
        "FULL": lambda: _full_report(tiny_ckpt, tmp_path),
        "LONG": lambda: str(tmp_path / ("x" * 300)),
    }
    args = [subst[a]() if a in subst else a.replace("RO/", f"{readonly}/") for a in args]
    proc = run_cli(*args, env=_env(hub, tmp_path), timeout=120, as_user=True)
    line = one_error_line(proc)
    assert words in line, line
    for path in tmp_path.rglob("*"):  # nothing half-written that looks complete
        assert not path.name.endswith(".partial") or path.is_symlink(), path


@pytest.mark.parametrize("command", ["download", "push", "run"])
def test_hostile_300_character_repo_id_is_one_line(hub, tmp_path, tiny_ckpt, command):
    repo_id = "zai/" + "x" * 296
    args = {
        "download": ["download", repo_id, str(tmp_path / "dest")],
        "push": ["push", str(tiny_ckpt), repo_id],
        "run": ["run", repo_id, str(tmp_path / "out")],
    }[command]
    line = one_error_line(_mx(hub, tmp_path, *args, "--quiet"))
    assert "300 characters" in line and "96" in line and len(line) < 400
    assert not hub.requests and not (tmp_path / "dest").exists() and not (tmp_path / "out").exists()


# --- 6. symlinks ----------------------------------------------------------------------------------------------
def _link_out(ckpt: Path, name: str, target: Path) -> None:
    """Replace CKPT/name by a symlink to `target` (outside the checkpoint), moving the file there if needed."""
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(ckpt / name, target)
    else:
        (ckpt / name).unlink(missing_ok=True)
    (ckpt / name).symlink_to(target)


def test_hostile_symlinks_leaving_src_are_refused_by_quantize(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path / "src")
    _link_out(src, SHARD, tmp_path / "elsewhere" / SHARD)
    line = one_error_line(cli("quantize", str(src), str(tmp_path / "out"), "--quiet"))
    assert f"{src / SHARD}: symlink to {tmp_path / 'elsewhere' / SHARD}" in line and "--follow-symlinks" in line
    assert not (tmp_path / "out").exists()

    (tmp_path / "secret.txt").write_text("not for OUT")
    (src / "LICENSE").symlink_to(tmp_path / "secret.txt")  # a side file quantize would copy
    proc = cli("quantize", str(src), str(tmp_path / "out"), "--quiet", "--follow-symlinks")
    assert proc.returncode == 0, proc.stderr  # an explicit --follow-symlinks reads through both
    (src / SHARD).unlink()
    shutil.move(tmp_path / "elsewhere" / SHARD, src / SHARD)
    line = one_error_line(cli("quantize", str(src), str(tmp_path / "out2"), "--quiet"))
    assert f"{src / 'LICENSE'}: symlink to" in line and "refusing to copy" in line


def test_hostile_symlinks_leaving_the_checkpoint_are_refused_by_validate_and_push(hub, tmp_path, tiny_ckpt):
    ckpt = _copy(tiny_ckpt, tmp_path / "ckpt")
    _link_out(ckpt, SHARD, tmp_path / "elsewhere" / SHARD)
    line = one_error_line(cli("validate", str(ckpt)))
    assert f"{ckpt / SHARD}: symlink to" in line and "--follow-symlinks" in line

    (ckpt / SHARD).unlink()
    shutil.move(tmp_path / "elsewhere" / SHARD, ckpt / SHARD)
    (ckpt / "passwd").symlink_to("/etc/passwd")
    line = one_error_line(_mx(hub, tmp_path, "push", str(ckpt), "alice/out", "--quiet", "--force"))
    assert f"{ckpt / 'passwd'}: symlink to /etc/passwd" in line and "refusing to upload" in line
    assert not hub.requests and "alice/out" not in hub.repos and not (ckpt / "README.md").exists()


# --- 7. lock, recipe paths, fixup record, odd inputs, disk messages ------------------------------------------
def test_hostile_second_process_on_the_same_directory_is_refused(hub, tmp_path):
    hub.stall_body_at[ONE] = 1_000_000  # the first process hangs in the middle of the download
    env = _env(hub, tmp_path, MXFORGE_HUB_TIMEOUT="120")
    dest, out = tmp_path / "dest", tmp_path / "out"
    first = start_cli("download", "zai/one", str(dest), "--quiet", env=env)
    run = start_cli("run", "zai/one", str(out), "--quiet", env=env)
    try:
        for proc, where in ((first, dest), (run, out)):
            lock = where / ".cache" / "mxforge" / "lock"
            _wait_for(lambda: lock.exists() and lock.read_text().strip() == str(proc.pid), f"{where} to be locked")
        for args, proc in ((["download", "zai/one", str(dest)], first), (["run", "zai/one", str(out)], run)):
            line = one_error_line(_mx(hub, tmp_path, *args, "--quiet", **FAST))
            assert f"in use by pid {proc.pid}" in line and "wait for it to finish" in line
    finally:
        for proc in (first, run):
            proc.kill()
            proc.communicate()
    assert _partials(dest)  # the first one's partial file was left alone


def test_hostile_recipe_paths_must_exist(tiny_ckpt, tmp_path):
    from mxforge.errors import ConfigError
    from mxforge.quantize.recipe import load_recipe

    missing = tmp_path / "nowhere" / "glm-5.2-mxfp4.toml"  # the file name of a shipped recipe
    (tmp_path / "adir.toml").mkdir()
    with pytest.raises(ConfigError, match="no such file; pass an existing recipe TOML"):
        load_recipe(missing)
    with pytest.raises(ConfigError, match="is a directory"):
        load_recipe(tmp_path / "adir.toml")
    with pytest.raises(ConfigError, match="no such file"):
        load_recipe("glm-5.2-mxfp4.toml")  # not a bare name: a path, relative to the working directory
    assert load_recipe("glm-5.2-mxfp4").source == "manifests/recipes/glm-5.2-mxfp4.toml"
    line = one_error_line(cli("quantize", str(tiny_ckpt), str(tmp_path / "out"), "--recipe", str(missing)))
    assert str(missing) in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fails", ["config.json", "mxforge_fixups.json"])
def test_hostile_fixup_record_survives_an_interruption_between_its_two_writes(tiny_ckpt, tmp_path, fails):
    """Each write is atomic (temporary name, then rename), so a run that cannot write FAILS leaves what a
    kill -9 between the two writes leaves: the other file written or not, this one not. The rerun must
    end with every exclude entry fixup added recorded exactly once."""
    from helpers import AMD
    from quark_like import write_quark_like

    ckpt = tmp_path / "q"
    write_quark_like(tiny_ckpt, ckpt, AMD)
    (ckpt / f"{fails}.partial").mkdir()  # where the atomic write of FAILS goes first: it cannot
    one_error_line(cli("fixup", str(ckpt)))
    (ckpt / f"{fails}.partial").rmdir()
    proc = cli("fixup", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    original = json.loads((ckpt / "config.json.orig").read_text())["quantization_config"]["exclude"]
    fixed = json.loads((ckpt / "config.json").read_text())["quantization_config"]["exclude"]
    added = [e for e in fixed if e not in original]
    record = json.loads((ckpt / "mxforge_fixups.json").read_text())
    recorded = [f["entry"] for f in record["fixups"] if f["fixup"] == "alias"]
    assert added and sorted(recorded) == sorted(added)  # all of them, each once


def test_hostile_duplicate_index_keys_are_refused_by_quantize(tiny_ckpt, tmp_path):
    src = _copy(tiny_ckpt, tmp_path / "src")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    pairs = list(index["weight_map"].items())
    key = pairs[0][0]
    body = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs + pairs[:1])  # listed twice, same shard
    index_path.write_text(f'{{"metadata": {json.dumps(index["metadata"])}, "weight_map": {{{body}}}}}')
    line = one_error_line(cli("quantize", str(src), str(tmp_path / "out"), "--quiet"))
    assert f"lists tensor {key!r} more than once" in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["quantize", "validate"])
def test_hostile_integer_config_fields_given_as_strings_are_refused(tiny_ckpt, tmp_path, command):
    src = _copy(tiny_ckpt, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = str(layers)
    (src / "config.json").write_text(json.dumps(config))
    args = [command, str(src)] + ([str(tmp_path / "out"), "--quiet"] if command == "quantize" else [])
    line = one_error_line(cli(*args))
    assert f"num_hidden_layers is '{layers}' (str), not a whole number" in line
    assert f'"num_hidden_layers": {layers}, no quotes' in line


def test_hostile_disk_messages_tell_sizes_apart(hub, tmp_path, tiny_ckpt):
    free = shutil.disk_usage(tmp_path).free
    hub.reported_size[SHARD] = free + 100_000_000  # a little more than there is: equal to 2 decimals in GB
    others = sum(p.stat().st_size for p in tiny_ckpt.iterdir() if p.is_file() and p.name != SHARD)
    line = one_error_line(_mx(hub, tmp_path, "download", "zai/glm-tiny", str(tmp_path / "dest"), "--quiet"))
    need = free + 100_000_000 + others
    assert f"need {need:,} bytes (" in line and "bytes (" in line.split("has only ")[1]
