"""The published model card, end to end: `mxforge run --push` from a Hub source that has its own card, on
the loopback Hub. The card carries the source's license and pipeline_tag (and nothing a hostile card
could inject), the error table, the serving commands, each command once; fixup's backups stay local."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers import TOKEN, hub_env, run_cli
from loopback_hub import LoopbackHub

from mxforge.checkpoint import Checkpoint
from mxforge.progress import format_bytes
from mxforge.provenance import CONFIG_BACKUP_NAME

pytestmark = pytest.mark.slow  # a full run --push to build the card it reads

SOURCE_CARD = """---
license: apache-2.0
pipeline_tag: text-generation
license_link: "https://example.com/LICENSE\\n- injected: tag"
language:
- en
---
# GLM tiny

The source model's own card.
"""


@pytest.fixture(scope="module")
def pushed(tiny_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("card")
    src = work / "src"
    shutil.copytree(tiny_ckpt, src, copy_function=os.link)
    (src / "README.md").write_text(SOURCE_CARD)
    hub = LoopbackHub(work / "hub", tokens={TOKEN: "alice"})
    hub.add_repo_from_dir("zai/glm-tiny", src)
    hub.start()
    env = hub_env(hub, work)
    try:
        out = work / "run"
        args = ("run", "zai/glm-tiny", str(out), "--scale-rule", "mse", "--push", "alice/glm-tiny-mxfp4", "--quiet")
        proc = run_cli(*args, "--json", "-", env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        summary = run_cli(*args, env=env, timeout=600)  # every stage reused: the summary comes from the state
        assert summary.returncode == 0, summary.stderr
        from huggingface_hub import HfApi, hf_hub_download

        api = HfApi(endpoint=hub.endpoint, token=TOKEN)
        remote = set(api.list_repo_files("alice/glm-tiny-mxfp4"))
        card = open(
            hf_hub_download(
                "alice/glm-tiny-mxfp4", "README.md", endpoint=hub.endpoint, token=TOKEN, cache_dir=work / "dl"
            )
        ).read()
        yield {"out": out, "report": json.loads(proc.stdout), "summary": summary.stdout, "remote": remote, "card": card}
    finally:
        hub.stop()


def test_card_carries_license_and_pipeline_tag_but_nothing_injected(pushed):
    card = pushed["card"]
    front = card.split("---")[1]
    assert "\nlicense: apache-2.0\n" in front and "\npipeline_tag: text-generation\n" in front
    assert "injected" not in card and "license_link" not in front  # not a plain value: left out
    assert "README.source.md" in pushed["remote"]  # the source's card itself is published beside ours


def test_card_has_the_error_table_and_the_scale_rule(pushed):
    card, error = pushed["card"], pushed["report"]["stages"]["quantize"]["report"]["error"]
    assert "## Quantization error" in card and "scale rule `mse`" in card
    overall = error["overall"]
    assert f"| **all** | {error['tensors_measured']:,} | {overall['rel_rmse']:.4f} | {overall['snr_db']} |" in card
    for cls in ("experts", "shared_experts", "mtp"):
        assert f"| {cls} | {error['by_class'][cls]['tensors']:,} | {error['by_class'][cls]['rel_rmse']:.4f} |" in card
    assert f"`{error['worst'][0]['name']}`" in card
    assert "tensors" not in error  # the per-tensor figures stay in mxfp4/mxforge_quantize.json
    assert (
        len(json.loads((pushed["out"] / "mxfp4" / "mxforge_quantize.json").read_text())["error"]["tensors"])
        == error["tensors_measured"]
    )


def test_run_summary_reports_the_error(pushed):
    assert "error (mse scale rule" in pushed["summary"] and "relative RMSE" in pushed["summary"]


def test_card_lists_each_command_once_and_the_serving_commands(pushed):
    card = pushed["card"]
    commands = card.split("## Commands")[1].split("```bash\n")[1].split("```")[0].strip().splitlines()
    assert len(commands) == len(set(commands)) == 1 and commands[0].startswith("mxforge run zai/glm-tiny")
    assert card.count("mxforge run zai/glm-tiny") == 1
    assert "| yes | `python -m sglang.launch_server --model-path alice/glm-tiny-mxfp4" in card
    assert "`vllm serve alice/glm-tiny-mxfp4" in card


def test_fixup_backup_stays_local(pushed):
    mxfp4 = pushed["out"] / "mxfp4"
    assert (mxfp4 / CONFIG_BACKUP_NAME).exists()  # fixup rewrote config.json for the older releases
    assert CONFIG_BACKUP_NAME not in pushed["remote"] and "config.json" in pushed["remote"]
    assert not any(name.endswith(".orig") for name in pushed["remote"])


def test_card_states_the_size_and_the_bf16_bytes_saved(pushed, tiny_ckpt):
    """The bf16 figure is the source's own tensor bytes (the source is bf16; every quantized weight counted at 2 bytes
    an element, its scales not at all), the size the output's."""

    def tensor_bytes(root) -> int:
        return sum(i.nbytes for i in Checkpoint.open(root).tensor_infos().values())

    stored, bf16 = tensor_bytes(pushed["out"] / "mxfp4"), tensor_bytes(tiny_ckpt)
    assert 0 < stored < bf16
    assert (
        f"Size: the tensors take {format_bytes(stored)}; in bf16 they would take {format_bytes(bf16)}: "
        f"{format_bytes(bf16 - stored)} saved ({(bf16 - stored) / bf16:.1%} of bf16)."
    ) in pushed["card"]
