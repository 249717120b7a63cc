"""Bad input: each case is one clear error (exit 2, one line, naming the file/tensor) and OUT holds nothing
that looks complete (no config.json, no index, no .partial files)."""

from __future__ import annotations

import hashlib
import json
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import cli, one_error_line, run_cli
from safetensors.torch import load_file, save_file

from mxforge.checkpoint import INDEX_NAME
from mxforge.errors import CheckpointError, ConfigError, MxforgeError, NonFiniteWeightError
from mxforge.file_hashes import hash_files
from mxforge.provenance import QUANTIZE_STATE_NAME
from mxforge.quantize.run import quantize_checkpoint


@pytest.fixture
def src(tiny_ckpt, tmp_path) -> Path:
    out = tmp_path / "src"
    shutil.copytree(tiny_ckpt, out)
    return out


def _shard_holding(src: Path, tensor: str) -> Path:
    return src / json.loads((src / INDEX_NAME).read_text())["weight_map"][tensor]


def _fill_with_nan(src: Path, name: str) -> None:
    """Rewrite the shard holding `name` with that tensor all NaN."""
    shard = _shard_holding(src, name)
    tensors = load_file(shard)
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, shard)


def _nothing_complete(out: Path) -> None:
    """OUT holds nothing that looks complete: no config.json, no index, no report, no .partial file."""
    if out.exists():
        names = {p.name for p in out.iterdir()}
        assert not names & {"config.json", INDEX_NAME, "mxforge_quantize.json"}, names
        assert not [n for n in names if n.endswith(".partial")], names


def _fails(
    src: Path, out: Path, recipe=None, *, match: str, error: type[MxforgeError] = CheckpointError, **options
) -> str:
    """quantize_checkpoint (what `mxforge quantize` calls) raises `error`, one line naming `match`, and
    leaves nothing in OUT that looks complete; returns the message (what the CLI prints after "error: ")."""
    with pytest.raises(error) as e:
        quantize_checkpoint(src, out, recipe, workers=1, quiet=True, **options)
    msg = str(e.value)
    assert type(e.value) is error and "\n" not in msg and match in msg, repr(e.value)
    _nothing_complete(out)
    return msg


def _fails_in_a_subprocess(src: Path, out: Path, *extra: str, match: str, preexec=None) -> str:
    """`mxforge quantize` in its own process (for limits set on that process): exit 2, one line."""
    proc = subprocess.run(
        [sys.executable, "-m", "mxforge.cli", "quantize", str(src), str(out), "--quiet", "--workers", "1", *extra],
        capture_output=True,
        text=True,
        preexec_fn=preexec,
        timeout=600,
    )
    line = one_error_line(proc)
    assert len(proc.stderr.strip().splitlines()) == 1 and match in line, proc.stderr
    _nothing_complete(out)
    return line


def test_truncated_shard(src, tmp_path):
    shard = sorted(src.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    msg = _fails(src, tmp_path / "out", match=shard.name)
    assert "truncated" in msg


def test_header_sizes_that_lie(src, tmp_path):
    shard = sorted(src.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)
    header[name]["shape"][0] += 1
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    assert len(new) == n
    shard.write_bytes(raw[:8] + new + raw[8 + n :])
    msg = _fails(src, tmp_path / "out", match=shard.name)
    assert name in msg and "header lies" in msg


def test_corrupt_data_caught_by_download_provenance(src, tmp_path):
    shards = sorted(src.glob("*.safetensors"))
    files = [
        {"name": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in shards
    ]
    (src / "mxforge_source.json").write_text(json.dumps({"repo_id": "t/tiny", "files": files}))
    raw = bytearray(shards[1].read_bytes())
    raw[-5] ^= 0xFF  # a flipped bit deep in the data: the header still parses
    shards[1].write_bytes(bytes(raw))
    msg = _fails(src, tmp_path / "out", match=shards[1].name)
    assert "sha256" in msg and "corrupt" in msg


def test_download_verified_sha256_reused_until_the_shard_changes(src, tiny_ckpt, tmp_path):
    """What download leaves (mxforge_source.json + its hash cache) spares quantize the sha256 pass while the
    shards keep their size and mtime; a shard rewritten since is hashed again, and corruption is caught."""
    shards = sorted(src.glob("*.safetensors"))
    files = [
        {"name": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in shards
    ]
    (src / "mxforge_source.json").write_text(json.dumps({"repo_id": "t/tiny", "files": files}))
    hash_files(src, [p.name for p in shards], quiet=True)  # download's verified hashes, by size and mtime
    out, report = tmp_path / "out", tmp_path / "report.json"
    cli("quantize", str(src), str(out), "--quiet", "--workers", "1", "--json", str(report), check=True)
    assert json.loads(report.read_text())["shards_sha256_from_download"] == len(shards)
    state = json.loads((out / QUANTIZE_STATE_NAME).read_text())["shards"]
    assert {n: e["source_sha256"] for n, e in state.items()} == {f["name"]: f["sha256"] for f in files}
    plain = tmp_path / "plain"
    quantize_checkpoint(tiny_ckpt, plain, workers=1, quiet=True)
    for p in shards:
        assert (out / p.name).read_bytes() == (plain / p.name).read_bytes(), p.name

    raw = bytearray(shards[1].read_bytes())
    raw[-5] ^= 0xFF  # rewritten: same size, new mtime, so the cached hash no longer stands for it
    shards[1].write_bytes(bytes(raw))
    msg = _fails(src, tmp_path / "out2", match=shards[1].name)
    assert "sha256" in msg and "corrupt" in msg


def test_index_names_missing_tensor(src, tmp_path):
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"]["model.layers.7.mlp.experts.99.up_proj.weight"] = sorted(set(index["weight_map"].values()))[-1]
    (src / INDEX_NAME).write_text(json.dumps(index))
    _fails(src, tmp_path / "out", match="model.layers.7.mlp.experts.99.up_proj.weight")


def test_index_names_missing_shard(src, tmp_path):
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (src / INDEX_NAME).write_text(json.dumps(index))
    _fails(src, tmp_path / "out", match="model-00009-of-00009.safetensors")


@pytest.mark.quark
@pytest.mark.slow
def test_nan_in_a_weight_to_quantize_is_refused_with_count(src, tmp_path):
    name = "model.layers.7.mlp.experts.3.down_proj.weight"  # the MTP layer's routed expert
    shard = _shard_holding(src, name)
    tensors = load_file(shard)
    w = tensors[name].clone()
    w[0, :3] = float("nan")
    w[5, 7] = float("inf")
    tensors[name] = w
    save_file(tensors, shard)
    msg = _fails(src, tmp_path / "out", match=name, error=NonFiniteWeightError)
    assert "4 NaN/Inf" in msg and "--allow-nonfinite" in msg
    quantize_checkpoint(src, tmp_path / "out2", workers=1, quiet=True, refuse_nonfinite=False)


def test_nan_in_a_kept_weight_is_copied(src, tmp_path):
    _fill_with_nan(src, "model.layers.0.self_attn.q_a_proj.weight")
    assert cli("quantize", str(src), str(tmp_path / "out"), "--quiet", "--workers", "1").returncode == 0


def test_recipe_pattern_matching_nothing(src, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'name = "r"\nscheme = "mxfp4"\n[[quantize]]\nkinds = ["experts"]\n'
        '[[keep]]\nnames = ["model\\\\.layers\\\\.999\\\\..*"]\n'
    )
    msg = _fails(src, tmp_path / "out", recipe, match=str(recipe), error=ConfigError)
    assert "[[keep]] rule 1" in msg and "matches no 2-D weight" in msg


def test_mtp_rule_on_a_checkpoint_without_mtp(src, tmp_path):
    config = json.loads((src / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    config["num_hidden_layers"] += 1  # the former MTP layer becomes an ordinary decoder layer
    (src / "config.json").write_text(json.dumps(config))
    recipe = tmp_path / "mtp.toml"
    recipe.write_text('name = "m"\nscheme = "mxfp4"\n[[quantize]]\nkinds = ["experts"]\nlayers = "mtp"\n')
    _fails(src, tmp_path / "out", recipe, match="no MTP layer", error=ConfigError)


def _file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() rather than being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_out_on_a_full_disk(src, tmp_path):
    """A real write limit on the subprocess (RLIMIT_FSIZE): the filesystem refuses bytes past 1 MB."""
    msg = _fails_in_a_subprocess(
        src, tmp_path / "out", match="no space left for the output", preexec=_file_size_limit(1 << 20)
    )
    assert ".safetensors" in msg and "rerun" in msg
    assert not list((tmp_path / "out").glob("*.safetensors"))


def test_cuda_without_a_gpu(src, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    _fails(src, tmp_path / "out", device="cuda", match="no CUDA device", error=ConfigError)


def test_out_not_ours(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("x")
    _fails(src, out, match="not a previous `mxforge quantize` output", error=MxforgeError)
    assert (out / "precious.txt").read_text() == "x"


def test_error_in_one_worker_stops_the_others_cleanly(src, tmp_path):
    name = "model.layers.4.mlp.experts.0.up_proj.weight"
    _fill_with_nan(src, name)
    proc = run_cli("quantize", str(src), str(tmp_path / "out"), "--quiet", "--workers", "3")
    assert proc.returncode == 2 and name in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").glob("*.partial")) and not (tmp_path / "out" / "config.json").exists()


def test_routed_experts_fused_in_3d_tensors_are_refused_not_copied_bf16(fixture_ckpt, tmp_path):
    """Some Qwen3.5 exports store a layer's routed experts fused, as transformers holds them in memory
    (`mlp.experts.gate_up_proj` [experts, 2 x width, hidden], `mlp.experts.down_proj`): no recipe rule selects a 3-D
    tensor, so they used to be copied bf16 while the config declared MXFP4 experts. One error names the tensor and
    the way out (save_pretrained writes them one by one)."""
    ckpt = fixture_ckpt("tiny", "qwen3_5_moe_text")[0]
    src = tmp_path / "fused"
    shutil.copytree(ckpt, src)
    index = json.loads((src / INDEX_NAME).read_text())
    prefix = "model.layers.1.mlp.experts."
    names = [n for n in index["weight_map"] if n.startswith(prefix)]
    shards = {src / index["weight_map"][n] for n in names}
    tensors = {n: t for f in shards for n, t in load_file(f).items()}
    experts = sorted({int(n[len(prefix) :].split(".")[0]) for n in names})
    fused = {
        prefix + "gate_up_proj": torch.stack(
            [
                torch.cat([tensors[f"{prefix}{j}.gate_proj.weight"], tensors[f"{prefix}{j}.up_proj.weight"]])
                for j in experts
            ]
        ),
        prefix + "down_proj": torch.stack([tensors[f"{prefix}{j}.down_proj.weight"] for j in experts]),
    }
    shard = src / index["weight_map"][names[0]]
    for f in shards:  # each shard without the layer's experts, the first with them fused
        kept = {n: t for n, t in load_file(f).items() if not n.startswith(prefix)}
        save_file({**kept, **(fused if f == shard else {})}, f, metadata={"format": "pt"})
    for n in names:
        del index["weight_map"][n]
    index["weight_map"].update(dict.fromkeys(fused, shard.name))
    (src / INDEX_NAME).write_text(json.dumps(index))
    msg = _fails(src, tmp_path / "out", match=f"{prefix}gate_up_proj")
    assert f"[{len(experts)}, 256, 256]" in msg and "save_pretrained" in msg and shard.name in msg
