"""`mxforge download` / `mxforge push` against a loopback Hub (tests/support/loopback_hub.py): the real
huggingface_hub client over real HTTP on 127.0.0.1, the real `mxforge` command in a subprocess.
Select with `pytest -k "hub or push or download"`.
"""

from __future__ import annotations

import hashlib
import json
import socket

import numpy as np
import pytest
from helpers import BASE, MTP, OTHER_TOKEN, TOKEN, hub_env, run_cli
from helpers import one_error_line as _one_line_error
from safetensors.numpy import save_file

from mxforge.validation.validate import validate_checkpoint

SHARD = "model-00002-of-00003.safetensors"
BIG = "big.safetensors"


def _env(hub, tmp_path, token: str | None = TOKEN) -> dict:
    # A file that stops progressing fails after 0.5 + 1 s of backoff.
    return hub_env(hub, tmp_path, token, MXFORGE_HUB_RETRIES="2")


def _mx(hub, tmp_path, *args, token: str | None = TOKEN):
    return run_cli(*args, env=_env(hub, tmp_path, token), timeout=300)


def _resolve_gets(hub) -> list[tuple[str, str, str | None]]:
    return [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_download_hub_normal_verifies_and_records_source(hub, tmp_path, tiny_ckpt):
    dest = tmp_path / "dest"
    proc = _mx(hub, tmp_path, "download", "zai/glm-tiny", str(dest), "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    commit = hub.repos["zai/glm-tiny"].branches["main"]
    assert report["commit"] == commit and report["verified"] is True
    for src in tiny_ckpt.iterdir():
        if src.is_file():
            assert (dest / src.name).read_bytes() == src.read_bytes(), src.name
    source = json.loads((dest / "mxforge_source.json").read_text())
    assert source["repo_id"] == "zai/glm-tiny" and source["revision"] == "main" and source["commit"] == commit
    assert source["endpoint"] == hub.endpoint and source["command"].startswith("mxforge download zai/glm-tiny")
    recorded = {f["name"]: f for f in source["files"]}
    assert recorded[SHARD]["sha256"] == _sha256(tiny_ckpt / SHARD) and recorded[SHARD]["lfs"] is True
    assert (
        recorded["config.json"]["lfs"] is False
        and recorded["config.json"]["size"] == (tiny_ckpt / "config.json").stat().st_size
    )

    # A rerun is a no-op on the network: every file is already there and verified.
    hub.requests.clear()
    proc = _mx(hub, tmp_path, "download", "zai/glm-tiny", str(dest), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert _resolve_gets(hub) == []

    # A file already in DEST at full size but with other bytes (another revision, damage) is replaced.
    data = bytearray((dest / SHARD).read_bytes())
    data[-1] ^= 0xFF
    (dest / SHARD).write_bytes(bytes(data))
    proc = _mx(hub, tmp_path, "download", "zai/glm-tiny", str(dest))
    assert proc.returncode == 0 and "replacing 1 existing file(s)" in proc.stderr, proc.stderr
    assert [r[1].rsplit("/", 1)[-1] for r in _resolve_gets(hub)] == [SHARD]
    assert _sha256(dest / SHARD) == _sha256(tiny_ckpt / SHARD)

    # Filters and a revision given as a commit sha.
    only = tmp_path / "only-json"
    proc = _mx(
        hub,
        tmp_path,
        "download",
        "zai/glm-tiny",
        str(only),
        "--revision",
        commit,
        "--include",
        "*.json",
        "--exclude",
        "generation_config.json",
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    names = {f["name"] for f in json.loads((only / "mxforge_source.json").read_text())["files"]}
    assert "config.json" in names and "generation_config.json" not in names
    assert not any(n.endswith(".safetensors") for n in names)


@pytest.fixture
def big_repo(hub, tmp_path):
    """A repo with one 14 MB shard."""
    src = tmp_path / "big-src"
    src.mkdir()
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal(3_500_000).astype(np.float32)}, str(src / BIG))
    (src / "config.json").write_text("{}")
    hub.add_repo_from_dir("zai/big", src)
    return src


def test_download_resumes_after_dropped_connection(hub, tmp_path, big_repo):
    dest = tmp_path / "dest"
    size = (big_repo / BIG).stat().st_size
    hub.drop_at[BIG] = (12_000_000, 1000)  # every attempt dies at byte 12 M: the client's retries run out
    first = _one_line_error(_mx(hub, tmp_path, "download", "zai/big", str(dest), "--quiet"))
    assert BIG in first and "rerun the same command to resume" in first
    assert not (dest / BIG).exists() and not (dest / "mxforge_source.json").exists()
    partial = list((dest / ".cache" / "mxforge" / "download").rglob("*.partial"))
    assert len(partial) == 1 and partial[0].stat().st_size == 12_000_000  # every byte received is kept

    hub.drop_at.clear()
    hub.requests.clear()
    proc = _mx(hub, tmp_path, "download", "zai/big", str(dest), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert [r[2] for r in _resolve_gets(hub)] == ["bytes=12000000-"]  # resumed, not restarted
    assert (dest / BIG).read_bytes() == (big_repo / BIG).read_bytes() and (dest / BIG).stat().st_size == size

    # A single drop is resumed within the same run.
    again = tmp_path / "again"
    hub.drop_at[BIG] = (5_000_000, 1)
    hub.requests.clear()
    proc = _mx(hub, tmp_path, "download", "zai/big", str(again), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert [r[2] for r in _resolve_gets(hub) if r[1].endswith(BIG)] == [None, "bytes=5000000-"]
    assert (again / BIG).read_bytes() == (big_repo / BIG).read_bytes()


def test_download_finishes_a_partial_file_that_is_already_whole(hub, tmp_path, big_repo):
    """A run stopped after the last byte of a file but before its rename: the rerun hashes the kept bytes."""
    from mxforge.hub.transfer import partial_path

    dest = tmp_path / "dest"
    data = (big_repo / BIG).read_bytes()
    partial = partial_path(dest, BIG, hashlib.sha256(data).hexdigest())  # the Hub's ETag of an LFS file
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data)
    proc = _mx(hub, tmp_path, "download", "zai/big", str(dest), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert not [r for r in _resolve_gets(hub) if r[1].endswith(BIG)]  # nothing fetched again
    assert (dest / BIG).read_bytes() == data and not partial.exists()


def test_download_detects_sha256_mismatch(hub, tmp_path, tiny_ckpt):
    dest = tmp_path / "dest"
    hub.corrupt.add(SHARD)  # right size, one byte flipped: only the hash can tell
    line = _one_line_error(_mx(hub, tmp_path, "download", "zai/glm-tiny", str(dest), "--quiet"))
    assert SHARD in line and "do not match the Hub's metadata" in line and "sha256" in line
    assert not (dest / SHARD).exists(), "a corrupt file must not stay looking complete"
    assert not (dest / "mxforge_source.json").exists()
    assert (dest / "model-00001-of-00003.safetensors").exists()  # the good files are kept

    hub.corrupt.clear()
    hub.requests.clear()
    proc = _mx(hub, tmp_path, "download", "zai/glm-tiny", str(dest), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert [r[1].rsplit("/", 1)[-1] for r in _resolve_gets(hub)] == [SHARD]  # only the bad file again
    assert _sha256(dest / SHARD) == _sha256(tiny_ckpt / SHARD)


def test_download_disk_precheck_refuses_before_downloading(hub, tmp_path):
    hub.reported_size[SHARD] = 10**18  # the Hub says one shard is an exabyte
    dest = tmp_path / "dest"
    line = _one_line_error(_mx(hub, tmp_path, "download", "zai/glm-tiny", str(dest), "--quiet"))
    assert "need 1,000,000,000," in line and ") free (largest: " in line  # exact bytes, then in units
    assert SHARD in line and "nothing was downloaded" in line
    assert _resolve_gets(hub) == [] and not dest.exists()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_download_hub_errors_are_one_clear_line(hub, tmp_path):
    dest = str(tmp_path / "dest")
    line = _one_line_error(_mx(hub, tmp_path, "download", "zai/glm-gated", dest, token=None))
    assert "gated" in line and "no token is configured" in line and "HF_TOKEN" in line
    line = _one_line_error(_mx(hub, tmp_path, "download", "zai/glm-gated", dest, token=OTHER_TOKEN))
    assert "gated" in line and "your token has no access" in line
    line = _one_line_error(_mx(hub, tmp_path, "download", "zai/nope", dest))
    assert "zai/nope: repository not found" in line
    line = _one_line_error(_mx(hub, tmp_path, "download", "zai/glm-tiny", dest, "--revision", "v9"))
    assert "revision 'v9' not found" in line
    line = _one_line_error(_mx(hub, tmp_path, "download", "zai/glm-tiny", dest, "--include", "*.gguf"))
    assert "match" in line
    env = {**_env(hub, tmp_path), "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    line = _one_line_error(run_cli("download", "zai/glm-tiny", dest, env=env))
    assert "cannot reach the Hub" in line and "HF_ENDPOINT" in line
    # The gated repo works for the user who was granted access: by HF_TOKEN, or by the token that
    # `hf auth login` saved under HF_HOME.
    proc = _mx(hub, tmp_path, "download", "zai/glm-gated", dest, "--quiet")
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "hf_home").mkdir(exist_ok=True)
    (tmp_path / "hf_home" / "token").write_text(TOKEN)
    proc = _mx(hub, tmp_path, "download", "zai/glm-gated", str(tmp_path / "dest2"), "--quiet", token=None)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def downloaded(hub, tmp_path):
    dest = tmp_path / "ckpt"
    proc = _mx(hub, tmp_path, "download", "zai/glm-tiny", str(dest), "--quiet")
    assert proc.returncode == 0, proc.stderr
    return dest


def test_push_refused_when_validate_fails_before_any_network_call(hub, tmp_path, downloaded):
    from mxforge.formats import MXFP4
    from mxforge.formats.quark import cached_quantization_config

    config_path = downloaded / "config.json"  # a quantization_config on bf16 weights: every engine would quantize
    config = json.loads(config_path.read_text())
    config["quantization_config"] = cached_quantization_config(MXFP4, [])
    config_path.write_text(json.dumps(config))
    hub.requests.clear()
    line = _one_line_error(_mx(hub, tmp_path, "push", str(downloaded), "alice/glm-tiny-mxfp4", "--quiet"))
    assert "nothing was pushed" in line and "would be MXFP4" in line and "--force" in line
    assert hub.requests == [] and "alice/glm-tiny-mxfp4" not in hub.repos
    assert not (downloaded / "README.md").exists()

    # --force pushes anyway, says so loudly, and the card records it.
    proc = _mx(hub, tmp_path, "push", str(downloaded), "alice/glm-tiny-mxfp4", "--force", "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: --force" in proc.stderr and json.loads(proc.stdout)["forced"] is True
    assert "pushed with `--force` although validation failed" in (downloaded / "README.md").read_text()


def test_push_of_an_unquantized_checkpoint_is_refused_unless_forced(hub, tmp_path, downloaded):
    """`mxforge push OUT/bf16 ...` by mistake: refused before any request, and the source directory is left as it
    was (no card written, its own README.md not moved); --force pushes it and says it was not quantized."""
    (downloaded / "README.md").write_text("# the source model's own card\n")
    before = {p.name: p.read_bytes() for p in downloaded.iterdir() if p.is_file()}
    hub.requests.clear()
    line = _one_line_error(_mx(hub, tmp_path, "push", str(downloaded), "alice/glm-tiny-mxfp4", "--quiet"))
    assert f"{downloaded}: not quantized (config.json has no quantization_config" in line
    assert "nothing was pushed or written" in line and "OUT/mxfp4" in line and "--force" in line
    assert hub.requests == [] and {p.name: p.read_bytes() for p in downloaded.iterdir() if p.is_file()} == before
    proc = _mx(hub, tmp_path, "push", str(downloaded), "alice/glm-tiny-mxfp4", "--quiet", "--force")
    assert proc.returncode == 0 and "(NOT quantized: config.json has no quantization_config; --force)" in proc.stdout


def test_push_hub_normal_with_model_card_and_remote_hashes(hub, tmp_path, downloaded):
    (downloaded / "README.md").write_text("# the source model's own card\n")
    push = ("push", str(downloaded), "alice/glm-tiny-mxfp4", "--quiet")
    proc = _mx(hub, tmp_path, *push, "--force", "--private", "--json")  # the bf16 download, pushed as it is
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    repo = hub.repos["alice/glm-tiny-mxfp4"]
    assert repo.private and report["commit"] == repo.branches["main"] and report["remote_hashes_match"]
    remote = repo.commits[repo.branches["main"]].files
    local = {p.name for p in downloaded.iterdir() if p.is_file()}
    assert set(remote) == local and not any(n.startswith(".cache") for n in remote)
    for name, f in remote.items():
        assert f.sha256 == _sha256(downloaded / name), name
    assert remote[SHARD].lfs and not remote["config.json"].lfs
    assert (downloaded / "README.source.md").read_text() == "# the source model's own card\n"

    card = (downloaded / "README.md").read_text()
    source = json.loads((downloaded / "mxforge_source.json").read_text())
    assert "base_model: zai/glm-tiny" in card and source["commit"] in card
    assert "| experts |" in card and "| mtp |" in card and "BF16" in card
    assert "## Quantization recipe\n\nnot recorded" in card and "## Fixups applied\n\nnot recorded" in card
    assert "No `quantization_config` in config.json" in card and "not quantized" in card and "- mxfp4" not in card
    assert "Checkpoint integrity: OK" in card and "loads: sglang 0.5.9-0.5.23, vllm 0.30.0-0.33.0" in card
    for name in local - {"README.md"}:
        assert f"| {name} | {(downloaded / name).stat().st_size:,} | `{_sha256(downloaded / name)}` |" in card, name
    assert source["command"] in card and "mxforge push " in card

    # A second push to a new branch: the branch is created; only the card is new there.
    proc = _mx(hub, tmp_path, *push, "--force", "--branch", "mxfp4-v2")
    assert proc.returncode == 0, proc.stderr
    assert set(repo.commits[repo.branches["mxfp4-v2"]].files) == local


def test_push_resumes_an_interrupted_upload(hub, tmp_path, downloaded):
    hub.fail_commits = 1000  # every commit is refused, after the large files reached the Hub
    line = _one_line_error(_mx(hub, tmp_path, "push", str(downloaded), "alice/resume", "--quiet", "--force"))
    assert "aborted" in line and "injected commit failure" in line and "rerun the same command to resume" in line
    uploaded = {r[1] for r in hub.requests if r[0] == "PUT"}
    assert len(uploaded) == 3  # the three shards reached LFS storage before the commits failed

    hub.fail_commits = 0
    hub.requests.clear()
    proc = _mx(hub, tmp_path, "push", str(downloaded), "alice/resume", "--quiet", "--force")
    assert proc.returncode == 0, proc.stderr
    assert not [r for r in hub.requests if r[0] == "PUT"]  # nothing uploaded twice
    repo = hub.repos["alice/resume"]
    assert SHARD in repo.commits[repo.branches["main"]].files


def test_push_remote_hash_check_detects_mismatch(hub, tmp_path, downloaded):
    hub.misreport_sha256.add(SHARD)
    line = _one_line_error(_mx(hub, tmp_path, "push", str(downloaded), "alice/out", "--quiet", "--force"))
    assert SHARD in line and "differ from the local checkpoint" in line


def test_push_without_token_or_rights_is_one_clear_line(hub, tmp_path, downloaded):
    """Found before the card is written or a file hashed (hub/target.py), and never 'rerun to resume': nothing
    was uploaded."""
    line = _one_line_error(_mx(hub, tmp_path, "push", str(downloaded), "alice/out", "--quiet", "--force", token=None))
    assert "no Hub token is configured; set HF_TOKEN" in line and "nothing was uploaded" in line
    line = _one_line_error(_mx(hub, tmp_path, "push", str(downloaded), "zai/glm-tiny", "--quiet", "--force"))
    assert "cannot create or write repos under 'zai'" in line and "nothing was uploaded" in line
    assert "resume" not in line and not (downloaded / "README.md").exists()


def test_hub_token_never_leaks(hub, tmp_path, tiny_ckpt):
    outputs = []
    dest = tmp_path / "dl"
    report = tmp_path / "reports"
    report.mkdir()
    for args in (
        ("download", "zai/glm-gated", str(dest), "--json", str(report / "dl.json")),
        ("push", str(dest), "alice/leak-check", "--force", "--json", str(report / "push.json")),
        ("download", "zai/glm-gated", str(tmp_path / "x"), "--revision", "nope"),
        ("push", str(dest), "zai/forbidden", "--force"),
    ):
        proc = _mx(hub, tmp_path, *args)
        outputs += [proc.stdout, proc.stderr]
    assert (report / "push.json").exists() and (dest / "README.md").exists()
    for text in outputs:
        assert TOKEN not in text
    for root in (dest, report, tmp_path / "hf_home"):
        for path in root.rglob("*"):
            if path.is_file():
                assert TOKEN.encode() not in path.read_bytes(), path


def test_push_model_card_precision_and_exclusions_on_a_quantized_checkpoint(tmp_path, tiny_ckpt):
    """MXFP4 detection and the exclusions summary, on a small checkpoint shaped like Quark's output."""
    import torch
    from safetensors.torch import save_file as save_torch

    from mxforge.checkpoint import Checkpoint
    from mxforge.file_hashes import hash_files
    from mxforge.hub.card import render_model_card

    ckpt = tmp_path / "q"
    ckpt.mkdir()
    config = json.loads((tiny_ckpt / "config.json").read_text())
    mtp = config["num_hidden_layers"]
    config["quantization_config"] = {
        "quant_method": "quark",
        "exclude": [
            "lm_head",
            f"model.layers.{mtp}.self_attn.o_proj",
            "model.decoder.self_attn.o_proj",
            "re:.*mlp\\.gate$",
        ],
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    save_torch(
        {
            "model.layers.3.mlp.experts.0.up_proj.weight": torch.zeros(64, 128, dtype=torch.uint8),
            "model.layers.3.mlp.experts.0.up_proj.weight_scale": torch.full((64, 8), 127, dtype=torch.uint8),
            "model.layers.3.mlp.gate.e_score_correction_bias": torch.zeros(8, dtype=torch.float32),
            f"model.layers.{mtp}.self_attn.o_proj.weight": torch.zeros(256, 128, dtype=torch.bfloat16),
            "lm_head.weight": torch.zeros(16, 256, dtype=torch.bfloat16),
        },
        str(ckpt / "model.safetensors"),
    )
    (ckpt / "mxforge_quantize.json").write_text(
        json.dumps(
            {
                "recipe": {"name": "mxfp4-moe", "sha256": "ab" * 32, "source": "r.toml", "scheme": "mxfp4"},
                "counts": {"quantized": 1, "kept": 3, "copied": 1},
                "mtp_layers": [mtp],
                "mtp_tensors": 1,
                "command": "mxforge quantize src q",
            }
        )
    )
    (ckpt / "mxforge_fixups.json").write_text(
        json.dumps(
            {
                "fixups": [
                    {
                        "fixup": "alias",
                        "entry": "model.eh_proj",
                        "module": f"model.layers.{mtp}.eh_proj",
                        "engines": ["sglang-0.5.11"],
                        "why": "stored bf16; the engine would build it MXFP4",
                    }
                ],
                "engines": ["sglang-0.5.11", "vllm-0.31.0"],
                "config_backup": "config.json.orig",
                "command": "mxforge fixup q",
            }
        )
    )
    files = list(hash_files(ckpt, ["config.json", "model.safetensors"], quiet=True).values())
    card = render_model_card(
        Checkpoint.open(ckpt),
        repo_id="me/q",
        files=files,
        forced=False,
        push_command="mxforge push q me/q",
        validation={
            "ok": True,
            "path": str(ckpt),
            "problems": [],
            "verdict": "loads: sglang 0.5.11-0.5.15.post1; FAILS: vllm 0.31.0-0.33.0 (...)",
            "serve": [
                {
                    "releases": "sglang 0.5.11-0.5.15.post1",
                    "ok": True,
                    "command": f"python -m sglang.launch_server --model-path {ckpt}",
                },
                {"releases": "vllm 0.31.0-0.33.0", "ok": False, "command": f"vllm serve {ckpt}"},
            ],
        },
    )
    assert "base_model_relation" not in card and "- mxfp4" in card and "MXFP4 weights in AMD Quark's format" in card
    assert "| experts | 1 | MXFP4 ×1 |" in card
    assert (
        "| router | 1 | F32 ×1 |" in card and "| mtp | 1 | BF16 ×1 |" in card and "| embeddings | 1 | BF16 ×1 |" in card
    )
    assert "keeps 4 entries" in card and "| mtp | 1 |" in card and "| regex | 1 | `re:.*mlp\\.gate$` |" in card
    assert "| aliases and globals | 2 |" in card
    assert "- recipe: `mxfp4-moe` (r.toml)" in card and "1 quantized to MXFP4, 3 2-D weights kept" in card
    assert f"| `model.eh_proj` | alias | sglang-0.5.11 | `model.layers.{mtp}.eh_proj` |" in card
    assert "loads: sglang 0.5.11-0.5.15.post1; FAILS: vllm 0.31.0-0.33.0" in card
    assert "| sglang 0.5.11-0.5.15.post1 | yes | `python -m sglang.launch_server --model-path me/q` |" in card
    assert "| vllm 0.31.0-0.33.0 | **no** | `vllm serve me/q` |" in card
    assert "## Source\n\nnot recorded" in card and "# download: not recorded" in card
    assert "mxforge quantize src q" in card and "mxforge fixup q" in card and "mxforge push q me/q" in card


def test_loopback_hub_serves_snapshot_download(hub, tmp_path, tiny_ckpt):
    """The tree listing that huggingface_hub's own snapshot_download needs (used by scripts/bench_hub.py)."""
    from huggingface_hub import snapshot_download

    out = snapshot_download(
        "zai/glm-tiny", local_dir=tmp_path / "snap", cache_dir=tmp_path / "cache", endpoint=hub.endpoint, token=False
    )
    for src in tiny_ckpt.iterdir():
        if src.is_file():
            assert (tmp_path / "snap" / src.name).read_bytes() == src.read_bytes()
    assert str(out) == str((tmp_path / "snap").resolve())


@pytest.mark.quark
def test_quark_file_to_file_export_of_the_published_recipe_is_fixed_then_pushed(hub, tmp_path, tiny_ckpt):
    """Quark 0.13's own file-to-file export with the write-up's recipe (MTP shared expert and eh_proj kept, as
    globs): reported per release before fixup, loads in every release after it, and push accepts it."""
    from quark.torch import ModelQuantizer

    from mxforge.formats import MXFP4
    from mxforge.formats.quark import qconfig

    globs = BASE + [f"*layers.{MTP}.mlp.shared_experts*", f"*layers.{MTP}.eh_proj"]
    ckpt = tmp_path / "quark-export"
    ModelQuantizer(qconfig(MXFP4, globs)).direct_quantize_checkpoint(str(tiny_ckpt), str(ckpt), device="cpu")
    report = validate_checkpoint(ckpt)
    # Quark's index counts whole files in total_size: a warning no engine cares about, not a failure.
    assert [w.subject for w in report.warnings] == ["model.safetensors.index.json:metadata.total_size"]
    assert {r["profile"] for r in report.releases() if not r["ok"]} == {
        "sglang-0.5.9",
        "sglang-0.5.10",
        "sglang-0.5.11",
        "sglang-0.5.12",
        "sglang-0.5.15",
    }
    assert {p.check for p in report.problems} == {"engine"}

    proc = run_cli("fixup", str(ckpt))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = validate_checkpoint(ckpt)
    assert report.ok and not report.warnings and report.verdict() == "loads: sglang 0.5.9-0.5.23, vllm 0.30.0-0.33.0"
    proc = _mx(hub, tmp_path, "push", str(ckpt), "alice/glm-tiny-quark-mxfp4", "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    card = (ckpt / "README.md").read_text()
    assert "loads: sglang 0.5.9-0.5.23, vllm 0.30.0-0.33.0" in card and "vllm serve alice/glm-tiny-quark-mxfp4" in card
