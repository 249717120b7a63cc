"""A hostile Hub, round 3 (issue 20, items 4, 5, 10, 11 and 13): listings that never end, files a product must not
carry, transient HTTP errors, forged mxforge records in a source, garbled messages and a held keep-alive.

The loopback Hub (tests/support/loopback_hub.py) serves the hostile answers over real HTTP on 127.0.0.1 to the real
huggingface_hub client: `fail[route]` (an HTTP status, n times or always), `lose_answer[route]` (done, answer lost),
`hold_after[route]` (a keep-alive connection then never answered), `before[route]` (any answer at all). The library
is called in a subprocess that has the Hub's environment (`_library`), one `mxforge run` per product path.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import AMD, REPO, TOKEN, hub_env, pushed_files, run_cli
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import httpx  # httpx on huggingface_hub 1.x, httpx2 on 2.x
from loopback_hub import LoopbackHub
from quark_like import write_quark_like
from safetensors.numpy import save_file

from mxforge.errors import CheckpointError
from mxforge.safetensors_io import read_header

ONE = "w.safetensors"  # zai/one: config.json and this one weight file
FORGED = "FORGED-BY-THE-SOURCE"  # in every forged record and backup: must never reach a product or the Hub

RUNNER = r"""
import json, sys
from mxforge.errors import MxforgeError
ns = {}
try:
    exec(sys.argv[1], ns)
    out = {"result": ns.get("result")}
except MxforgeError as e:
    out = {"error": type(e).__name__, "message": str(e)}
print("\n" + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_ckpt) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-hub")
    one = root / "one"
    one.mkdir()
    save_file({"w": np.random.default_rng(1).standard_normal(1_000_000).astype(np.float32)}, str(one / ONE))
    (one / "config.json").write_text("{}")
    write_quark_like(tiny_ckpt, root / "amd", AMD, glob_exclude=True)
    return {"zai/one": one, "amd/glm-mxfp4": root / "amd", "zai/hostile": _hostile_source(tiny_ckpt, root / "hostile")}


@pytest.fixture
def hub(hub, sources):
    """The shared test Hub (conftest.py), plus zai/one (one 4 MB weight file), amd/glm-mxfp4 (a Quark-style export
    whose exclusions need a fixup: --create-pr lists the open pull requests before opening one) and zai/hostile
    (the tiny checkpoint with what a product must not carry: _hostile_source)."""
    for repo, path in sources.items():
        hub.add_repo_from_dir(repo, path)
    return hub


def _library(hub, tmp_path, code: str, timeout: float = 120, **env) -> dict:
    """Run `code` (which sets `result`) against the Hub in a fresh interpreter: {"result": ...} or the MxforgeError's
    {"error": class name, "message": ...}. A hang fails the test at `timeout`."""
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **hub_env(hub, tmp_path, **env)},
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _hits(hub, method: str, fragment: str) -> list:
    return [r for r in hub.requests if r[0] == method and fragment in r[1]]


# --- 4. every paginated Hub call has a page, entry and time limit ------------------------------------------------
def _pull_requests(n: int, first: int = 1) -> list[dict]:
    return [
        {
            "num": first + i,
            "title": "not mxforge's",
            "status": "open",
            "isPullRequest": True,
            "author": {"name": "mallory"},
            "repo": {"name": "amd/glm-mxfp4", "type": "model"},
            "createdAt": "2026-01-01T00:00:00.000Z",
        }
        for i in range(n)
    ]


def _listing(page_of, delay: float = 0.0):
    """A `before` hook answering the discussion list with page_of(page number) (after `delay` seconds)."""

    def answer(handler) -> bool:
        time.sleep(delay)
        handler._send_json(page_of(int(handler.query.get("p", ["0"])[0])))
        return True

    return answer


LISTINGS = {  # the Hub's answer to page p, seconds it takes, --timeout; the error's words (None: the list just ends)
    "empty-pages-announcing-1e12": (lambda p: {"count": 1e12, "start": p * 50, "discussions": []}, 0, "10", None),
    "the-same-page-forever": (
        lambda p: {"count": 10**12, "start": 0, "discussions": _pull_requests(50)},
        0,
        "10",
        "did not end within 100 pages (100 page(s), 5,000 entries read)",
    ),
    "6000-entries-in-one-page": (
        lambda p: {"count": 6000, "start": 0, "discussions": _pull_requests(6000)},
        0,
        "10",
        "did not end within 5,000 entries (1 page(s), 6,000 entries read)",
    ),
    "slow-pages-forever": (  # each page in time, the listing not: HubLimits.api_deadline, 2 x 1 s + 0.5 s backoff
        lambda p: {"count": 10**12, "start": p * 50, "discussions": _pull_requests(50, 1 + 50 * p)},
        0.25,
        "1",
        "did not end within 2 s",
    ),
}


@pytest.mark.parametrize("case", list(LISTINGS))
def test_hostile_pull_request_listing_is_bounded(hub, tmp_path, case):
    """`fixup --create-pr` lists the open pull requests; huggingface_hub's get_repo_discussions asked for pages
    for as long as the answer's `count` said there were more (48,020 requests in 30 s). Every bound ends it."""
    page_of, delay, timeout, words = LISTINGS[case]
    hub.before["discussions"] = _listing(page_of, delay)
    out = _library(
        hub,
        tmp_path,
        "from mxforge.hub.pr import create_fixup_pr\nresult = create_fixup_pr('amd/glm-mxfp4', dry_run=True).status",
        timeout=90,
        MXFORGE_HUB_TIMEOUT=timeout,
        MXFORGE_HUB_RETRIES="1",
    )
    pages = len(_hits(hub, "GET", "/discussions"))
    if words is None:
        assert out == {"result": "dry-run"} and pages == 1  # an empty page ends the list
        return
    assert out["error"] == "HubError", out
    assert out["message"].startswith("amd/glm-mxfp4: the list of its open pull requests: the Hub's listing")
    assert words in out["message"] and "check HF_ENDPOINT" in out["message"], out["message"]
    assert pages <= 100 and not hub.repos["amd/glm-mxfp4"].pulls


MAX_LISTED_FILES = 50_000  # mxforge.hub.api's ceiling (test_the_ceilings_are_the_documented_ones)


def test_the_ceilings_are_the_documented_ones():
    from mxforge.hub import api

    assert (api.MAX_LISTED_FILES, api.MAX_PAGES, api.MAX_ITEMS) == (MAX_LISTED_FILES, 100, 5_000)


def test_hostile_file_list_longer_than_the_ceiling_is_refused(hub, tmp_path):
    siblings = [{"rfilename": f"f{i}.json", "size": 1, "blobId": "0" * 40} for i in range(MAX_LISTED_FILES + 1)]
    sha = hub.repos["zai/one"].branches["main"]
    hub.before["repo_info"] = lambda h: h._send_json({"id": "zai/one", "sha": sha, "siblings": siblings}) or True
    out = _library(
        hub,
        tmp_path,
        f"from mxforge.hub.download import download\nresult = download('zai/one', {str(tmp_path / 'd')!r})",
    )
    assert (
        out["error"] == "HubError" and f"zai/one@main: the Hub lists {MAX_LISTED_FILES + 1:,} files" in out["message"]
    )
    assert not (tmp_path / "d").exists()


# --- 10. transient HTTP errors are retried where a retry is safe -------------------------------------------------
DOWNLOAD = "from mxforge.hub.download import download\nresult = download('zai/one', DEST, quiet=True).commit"
# force: the tiny bf16 fixture is not quantized, and push refuses that unless forced (the Hub is what is tested)
PUSH = "from mxforge.hub.push import push\nresult = push(CKPT, 'alice/out', quiet=True, force=True).commit"
REMOTE = (
    "from mxforge.hub.source import open_source\nfrom mxforge.validation.validate import validate_checkpoint\n"
    "result = validate_checkpoint(open_source('zai/glm-tiny')).ok"
)
PR = "from mxforge.hub.pr import create_fixup_pr\nresult = create_fixup_pr('amd/glm-mxfp4').status"
ONCE = {  # what runs: the routes answering HTTP 500 once, all at once
    "download": (DOWNLOAD, ["repo_info", "HEAD resolve", "GET resolve"]),
    "push": (PUSH, ["create_repo", "preupload", "lfs_batch", "commit", "repo_info"]),
    "remote-validate": (REMOTE, ["repo_info", "GET resolve"]),
    "create-pr": (PR, ["repo_info", "GET resolve", "discussions", "commit"]),
}


def _code(code: str, tmp_path: Path, tiny_ckpt: Path) -> str:
    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        shutil.copytree(tiny_ckpt, ckpt)
    return f"DEST, CKPT = {str(tmp_path / 'dest')!r}, {str(ckpt)!r}\n{code}"


@pytest.mark.parametrize("stage", list(ONCE))
def test_hostile_one_transient_500_on_each_request_is_retried(hub, tmp_path, tiny_ckpt, stage):
    code, routes = ONCE[stage]
    for route in routes:
        hub.fail[route] = (500, 1)
    out = _library(hub, tmp_path, _code(code, tmp_path, tiny_ckpt), MXFORGE_HUB_TIMEOUT="5", MXFORGE_HUB_RETRIES="2")
    assert "error" not in out, out
    assert {route: hub.fail[route][1] for route in routes} == dict.fromkeys(routes, 0)  # each one did answer 500
    if stage == "push":
        assert len(_hits(hub, "POST", "/commit/")) == 2  # the failed one and one that landed
        assert pushed_files(hub, "alice/out")["config.json"] == (tiny_ckpt / "config.json").read_bytes()
    if stage == "create-pr":
        assert out["result"] == "opened" and len(hub.repos["amd/glm-mxfp4"].pulls) == 1


ALWAYS = {  # route answering 503 every time: (code, the error's words, requests made to it)
    "repo_info": (DOWNLOAD, "answered HTTP 503 after 3 attempts when asked to read the file list of zai/one@main"),
    "HEAD resolve": (DOWNLOAD, "answered HTTP 503 after 3 attempts when asked to download zai/one@"),
    "GET resolve": (DOWNLOAD, "no new byte in 3 attempt(s)"),
    "commit": (PUSH, "answered HTTP 503 after 3 attempts when asked to push to alice/out@main"),
}


@pytest.mark.parametrize("route", list(ALWAYS))
def test_hostile_persistent_503_ends_in_one_error_after_the_bounded_retries(hub, tmp_path, tiny_ckpt, route):
    code, words = ALWAYS[route]
    hub.fail[route] = (503, -1)
    out = _library(hub, tmp_path, _code(code, tmp_path, tiny_ckpt), MXFORGE_HUB_TIMEOUT="5", MXFORGE_HUB_RETRIES="2")
    assert out.get("error") == "HubError" and words in out["message"], out
    method, _, name = route.rpartition(" ")
    path = {"repo_info": "/api/models/zai/one", "resolve": "/resolve/", "commit": "/commit/"}[name]
    asked = [r for r in hub.requests if path in r[1] and (not method or r[0] == method)]
    files = 2 if name == "resolve" else 1  # config.json and w.safetensors, each given up after 3 attempts
    assert len(asked) == 3 * files, asked
    if route == "commit":
        assert "rerun the same command to resume" in out["message"]
        assert not pushed_files(hub, "alice/out")  # nothing landed


def test_hostile_commit_whose_answer_is_lost_is_not_made_twice(hub, tmp_path, tiny_ckpt):
    """The Hub makes the commit, then the connection drops before the answer: the branch is read back, and it
    holds every file, so the push is done; a blind retry (what huggingface_hub refuses to do) commits twice."""
    hub.lose_answer["commit"] = 1
    out = _library(hub, tmp_path, _code(PUSH, tmp_path, tiny_ckpt), MXFORGE_HUB_TIMEOUT="5", MXFORGE_HUB_RETRIES="2")
    assert "error" not in out, out
    repo = hub.repos["alice/out"]
    assert len(_hits(hub, "POST", "/commit/")) == 1 and len(repo.commits) == 2  # the initial one and ours
    assert out["result"] == repo.branches["main"]


def test_hostile_pull_request_whose_answer_is_lost_is_not_opened_twice(hub, tmp_path):
    hub.lose_answer["commit"] = 1
    out = _library(hub, tmp_path, PR, MXFORGE_HUB_TIMEOUT="5", MXFORGE_HUB_RETRIES="2")
    assert out == {"result": "opened"}
    assert len(hub.repos["amd/glm-mxfp4"].pulls) == 1 and len(_hits(hub, "POST", "/commit/")) == 1


def test_hostile_retry_after_of_a_billion_seconds_waits_at_most_the_timeout(hub, tmp_path, tiny_ckpt):
    """huggingface_hub's own retry of a preupload sleeps as long as the server's Retry-After says."""
    left = [1]

    def busy(handler) -> bool:
        if not left[0]:
            return False
        left[0] -= 1
        handler._send_json({"error": "busy"}, 503, {"Retry-After": "1000000000"})
        return True

    hub.before["preupload"] = busy
    started = time.monotonic()
    out = _library(hub, tmp_path, _code(PUSH, tmp_path, tiny_ckpt), timeout=60, MXFORGE_HUB_TIMEOUT="2")
    assert "error" not in out and not left[0], out
    assert time.monotonic() - started < 50


# --- 13. messages without doubled words; a held keep-alive connection is not blamed on the next stage --------------
DOUBLED = re.compile(r"\b([a-z]+) \1\b")  # "of of", "to to" (case-sensitive: "--recipe RECIPE" is meant)
SOURCES = ("mxforge", "quantize", "validation", "fixups")


def _string_templates():
    """Every string literal and f-string of the package's source, placeholders shown as {}, with its place."""
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value
                else:
                    continue
                yield f"{path.relative_to(REPO)}:{node.lineno}", text


def test_source_message_templates_have_no_doubled_words():
    found = [(where, m.group(0)) for where, text in _string_templates() for m in DOUBLED.finditer(text)]
    assert not found, found


MAPPERS = {"as_hub_error", "raise_as_hub_error", "repo_info"}  # the calls that take an `action` for the message


def _actions() -> set[str]:
    """Every `action=` the source passes to the Hub error mapping (an f-string's placeholders as a number)."""
    found = {"reach"}  # as_hub_error's default
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                func = getattr(node, "func", None)
                if not isinstance(node, ast.Call) or getattr(func, "id", getattr(func, "attr", None)) not in MAPPERS:
                    continue
                for kw in node.keywords:
                    if kw.arg == "action" and isinstance(kw.value, ast.Constant):
                        found.add(kw.value.value)
                    elif kw.arg == "action" and isinstance(kw.value, ast.JoinedStr):
                        found.add("".join(v.value if isinstance(v, ast.Constant) else "7" for v in kw.value.values))
    return found


def _hub_failures() -> list[BaseException]:
    request = httpx.Request("GET", "https://huggingface.co/api/models/zai/x")
    failures: list[BaseException] = [
        httpx.ConnectError("refused", request=request),
        httpx.ReadTimeout("timed out", request=request),
        httpx.RemoteProtocolError("Server disconnected", request=request),
        httpx.ReadError("reset", request=request),
    ]
    for status in (401, 403, 500, 503):
        response = httpx.Response(status, request=request, json={"error": "no"})
        failures.append(HfHubHTTPError(f"{status} error", response=response))
    retried = HfHubHTTPError("500 error", response=httpx.Response(500, request=request))
    retried.mxforge_attempts = 6  # type: ignore[attr-defined]  # as session.retrying leaves it
    return [*failures, retried]


def test_every_hub_error_message_reads_without_doubled_words():
    """Each Hub failure mapped for each action the code passes, and as push reports an aborted upload: the
    message once read "the Hub stopped answering during read the file list of of zai/x" and "during push to of"."""
    from mxforge.errors import HubError
    from mxforge.hub.errors import as_hub_error
    from mxforge.hub.push import _raise_upload_failure

    actions = _actions()
    assert {"read the file list of", "push to", "download", "open a pull request on"} <= actions
    for e in _hub_failures():
        for action in actions:
            for filename in (None, "config.json"):
                message = str(as_hub_error(e, repo_id="zai/x", revision="main", filename=filename, action=action))
                assert not DOUBLED.search(message), (action, message)
        with pytest.raises(HubError) as raised:
            _raise_upload_failure(e, "upload of /ckpt", "alice/out", "main")
        assert not DOUBLED.search(str(raised.value)), str(raised.value)


@pytest.mark.parametrize("extra", [7, -7], ids=["trailing-bytes", "truncated"])
def test_shard_size_messages_read_well(tmp_path, extra):
    path = tmp_path / "s.safetensors"
    save_file({"w": np.zeros(16, dtype=np.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data + b"\0" * extra if extra > 0 else data[:extra])
    with pytest.raises(CheckpointError) as raised:
        read_header(path)
    words = "the shard has trailing bytes" if extra > 0 else "the shard is truncated"
    assert words in str(raised.value) and not DOUBLED.search(str(raised.value)), str(raised.value)
    assert "is has" not in str(raised.value)


def test_hostile_held_keep_alive_connection_is_not_blamed_on_the_next_stage(hub, tmp_path):
    """The Hub answers `mxforge run`'s first look at the repo (its file list, to choose the mode), keeps that
    connection open and never answers on it again. The download stage must not inherit it: it used to, and
    waited out its timeout, and the run failed with "stopped answering during read the file list of of" blamed
    on the download."""
    hub.hold_after["repo_info"] = 1
    env = hub_env(hub, tmp_path, MXFORGE_HUB_TIMEOUT="20", MXFORGE_HUB_RETRIES="0")
    proc = run_cli("run", "zai/glm-tiny", str(tmp_path / "out"), "--quiet", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert hub.held_connections == 1  # the server did hold it; nothing waited on it
    assert json.loads((tmp_path / "out" / "mxforge_run.json").read_text())["stages"]["download"]["seconds"] < 20


def test_hostile_held_connection_within_a_stage_is_retried_on_a_new_one(hub, tmp_path):
    """Within one download (one file at a time), the next request on the held connection (the next file's
    metadata) times out; it is sent again on a new connection instead of failing the download."""
    hub.hold_after["GET resolve"] = 1
    code = f"DEST = {str(tmp_path / 'd')!r}\n{DOWNLOAD.replace('quiet=True', 'workers=1, quiet=True')}"
    out = _library(hub, tmp_path, code, MXFORGE_HUB_TIMEOUT="2", MXFORGE_HUB_RETRIES="1")
    assert "error" not in out, out
    assert hub.held_connections == 1 and (tmp_path / "d" / ONE).stat().st_size > 0


# --- 5 and 11. a product carries only the allowlist, and never mxforge's own files from its source --------------------
def _hostile_source(tiny_ckpt: Path, dest: Path) -> Path:
    """The tiny checkpoint plus what a product must not carry: weights in other formats, a safetensors file the
    index does not name, an unknown file, forged mxforge records and backups; and a license it must carry."""
    shutil.copytree(tiny_ckpt, dest)
    rng = np.random.default_rng(5)
    (dest / "pytorch_model.bin").write_bytes(rng.bytes(20_000_000))  # more than the whole tiny checkpoint
    (dest / "consolidated.pth").write_bytes(rng.bytes(100_000))
    save_file({"x": np.zeros(1000, dtype=np.float32)}, str(dest / "extra.safetensors"))
    (dest / "notes.txt").write_text("not part of a checkpoint")
    (dest / "LICENSE").write_text("MIT, say")
    (dest / "mxforge_fixups.json").write_text(json.dumps({"stage": "fixup", "fixups": [], "runs": [FORGED]}))
    (dest / "mxforge_quantize.json").write_text(json.dumps({"stage": "quantize", "source": FORGED}))
    (dest / "config.json.orig").write_text(json.dumps({"forged": FORGED}))
    (dest / "model.safetensors.index.json.orig").write_text(FORGED)
    (dest / "mxforge_run.json").write_text(FORGED)
    return dest


NOT_CARRIED = (
    "pytorch_model.bin",
    "consolidated.pth",
    "extra.safetensors",
    "notes.txt",
    "mxforge_run.json",
    "model.safetensors.index.json.orig",
)


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and ".cache" not in p.parts)


def _check_product(out: Path, pushed: dict[str, bytes]) -> None:
    product = out / "mxfp4"
    assert (product / "LICENSE").read_text() == "MIT, say" and pushed["LICENSE"] == b"MIT, say"
    assert (product / "tokenizer.json").exists() and "tokenizer.json" in pushed
    for name in NOT_CARRIED:
        assert not (product / name).exists() and name not in pushed, name
    for path in product.iterdir():  # mxforge's own files in the product are this run's, not the source's
        assert path.is_dir() or FORGED not in path.read_text(errors="replace"), path
    for name, data in pushed.items():
        assert FORGED.encode() not in data, name
    assert "config.json.orig" not in pushed


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_hostile_hub_source_product_carries_only_the_allowlist(hub, tmp_path, tiny_ckpt, mode):
    """A Hub source with a 3 MB pytorch_model.bin beside its shards (and forged records): the streamed plan once
    ignored it, it was downloaded, copied into mxfp4/ and pushed (the sequential path copied it too)."""
    out = tmp_path / "out"
    env = hub_env(hub, tmp_path)
    proc = run_cli("run", "zai/hostile", str(out), "--push", "alice/out", mode, "--quiet", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    _check_product(out, pushed_files(hub, "alice/out"))
    # Never downloaded (a sequential run fetches every *.safetensors: which ones the index names is known after)
    fetched = {r[1].rsplit("/", 1)[1] for r in hub.requests if "/resolve/" in r[1] and "/zai/hostile/" in r[1]}
    never = {*NOT_CARRIED, "mxforge_fixups.json", "mxforge_quantize.json", "config.json.orig"}
    assert not fetched & (never - ({"extra.safetensors"} if mode == "--no-stream" else set())), fetched
    if mode == "--stream":
        report = json.loads(proc.stdout)["stages"]["stream"]["report"]
        plan = report["disk_plan"]
        assert plan["peak_bytes"] >= _tree_bytes(out), (plan, _tree_bytes(out))  # every byte fetched is planned
        [note] = [n for n in report["notes"] if n.startswith("not carried into the product")]
        assert "pytorch_model.bin (weights the index does not name, or in another format)" in note, note
        assert "mxforge_fixups.json" in note and "(mxforge's own record or backup, never taken from a source)" in note


def test_hostile_local_source_product_carries_only_the_allowlist(hub, tmp_path, sources):
    src = sources["zai/hostile"]  # read only: the run writes to OUT
    out = tmp_path / "out"
    proc = run_cli("run", str(src), str(out), "--push", "alice/out", env=hub_env(hub, tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    _check_product(out, pushed_files(hub, "alice/out"))
    [note] = [line for line in proc.stderr.splitlines() if "not carried into the product" in line]
    assert note.startswith("mxforge quantize: not carried into the product: ") and "pytorch_model.bin" in note, note
    record = json.loads((out / "mxfp4" / "mxforge_fixups.json").read_text())  # fixup's own, of this product
    assert record["runs"] and all(isinstance(r, dict) for r in record["runs"])

    from mxforge.quantize.dequantize import dequantize_checkpoint

    planted = {"pytorch_model.bin": b"x" * 100, "mxforge_source.json": FORGED.encode()}
    for name, data in planted.items():
        (out / "mxfp4" / name).write_bytes(data)
    dequantize_checkpoint(out / "mxfp4", tmp_path / "bf16", quiet=True)
    for name in (*planted, "README.md", "mxforge_fixups.json", "mxforge_quantize.json", "config.json.orig"):
        assert not (tmp_path / "bf16" / name).exists(), name
    assert (tmp_path / "bf16" / "LICENSE").exists()


def test_loopback_hub_serves_the_switches_it_documents(tmp_path, tiny_ckpt):
    """The fault switches this file relies on, on the loopback Hub itself (so a broken switch cannot make a test
    above pass for nothing)."""
    hub = LoopbackHub(tmp_path / "hub", tokens={TOKEN: "alice"})
    hub.add_repo_from_dir("zai/glm-tiny", tiny_ckpt)
    hub.start()
    try:
        url = f"{hub.endpoint}/api/models/zai/glm-tiny"
        hub.fail["repo_info"] = (502, 1)
        with httpx.Client(timeout=2) as client:
            assert [client.get(url).status_code for _ in range(2)] == [502, 200]
            hub.hold_after["repo_info"] = 1
            assert client.get(url).status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                client.get(url)  # the same connection: held
            assert client.get(url).status_code == 200  # a new one
        hub.lose_answer["repo_info"] = 1
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(url, timeout=2)
    finally:
        hub.stop()
