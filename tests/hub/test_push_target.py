"""A push target is checked before any work is done for it (hub/target.py): `mxforge run ... --push REPO` with a
target that cannot work stops at once, not after download, quantize, fixup and validate.

The checks run in a child process pointed at the loopback Hub (huggingface_hub reads HF_ENDPOINT and the
token when it is imported), calling check_push_target itself; one CLI run shows the pipeline stopping first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import OTHER_TOKEN, TOKEN, hub_env, one_error_line, run_cli

READ_ONLY = "hf_readOnlyTokenOfAlice000000000000"
CHECK = """
import json, sys
from mxforge.errors import MxforgeError
from mxforge.hub.target import check_push_target
try:
    print(json.dumps(check_push_target(sys.argv[1], private=sys.argv[2] == "1").as_dict()))
except MxforgeError as e:
    print(json.dumps({"error": str(e)}))
"""


@pytest.fixture
def accounts(hub, tiny_ckpt):
    """alice's read-only token; alice's roles in three organizations; a public repo of alice's and one of crew's."""
    hub.tokens[READ_ONLY] = "alice"
    hub.read_only_tokens.add(READ_ONLY)
    hub.orgs["alice"] = {"lab": "write", "team": "read", "crew": "contributor"}
    hub.add_repo_from_dir("alice/public", tiny_ckpt)
    hub.add_repo_from_dir("crew/model", tiny_ckpt)
    return hub


def _check(hub, tmp_path, repo_id: str, token: str | None = TOKEN, private: bool = False) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, repo_id, "1" if private else "0"],
        capture_output=True,
        text=True,
        env={**os.environ, **hub_env(hub, tmp_path, token)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    "repo_id, token, private, said",
    [
        ("bad repo name", TOKEN, False, "'bad repo name': not a valid Hub repo id"),
        ("alice/new", None, False, "no Hub token is configured; set HF_TOKEN"),
        ("alice/new", "hf_notAKnownToken", False, "refused the credentials"),
        ("alice/new", READ_ONLY, False, "the token of 'alice' is read-only"),
        ("zai/glm-tiny", TOKEN, False, "belongs to 'alice' (organizations: crew, lab, team), which cannot create or"),
        ("alice/new", OTHER_TOKEN, False, "belongs to 'bob' (no organizations)"),
        ("team/new", TOKEN, False, "'alice' may only read in the organization 'team'"),
        (
            "crew/model",
            TOKEN,
            False,
            "does not allow you to push to crew/model (HTTP 403)",
        ),  # the Hub's auth_check says no
        ("alice/public", TOKEN, True, "alice/public exists and is public, and a push does not change that"),
    ],
)
def test_a_push_target_that_cannot_work_is_refused_in_one_line(accounts, tmp_path, repo_id, token, private, said):
    error = _check(accounts, tmp_path, repo_id, token, private)["error"]
    assert said in error and "\n" not in error and len(error) < 400, error
    assert all(token not in error for token in (TOKEN, OTHER_TOKEN, READ_ONLY))
    assert not any(method != "GET" for method, _, _ in accounts.requests)  # only asked, nothing created


def test_a_push_target_that_can_work_is_described(accounts, tmp_path):
    assert _check(accounts, tmp_path, "alice/new") == {
        "repo_id": "alice/new",
        "user": "alice",
        "exists": False,
        "private": None,
    }
    assert _check(accounts, tmp_path, "lab/new")["exists"] is False  # an organization where alice may write
    assert _check(accounts, tmp_path, "alice/public") == {
        "repo_id": "alice/public",
        "user": "alice",
        "exists": True,
        "private": False,
    }


def test_run_refuses_a_bad_push_target_before_any_stage(hub, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(
        "run", "zai/glm-tiny", str(out), "--push", "zai/glm-tiny-mxfp4", "--quiet", env=hub_env(hub, tmp_path)
    )
    line = one_error_line(proc)
    assert "cannot push to zai/glm-tiny-mxfp4" in line and "which cannot create or write repos under 'zai'" in line
    assert not out.exists()  # nothing downloaded, quantized, or even recorded
    assert not any("/resolve/" in path for _, path, _ in hub.requests)
