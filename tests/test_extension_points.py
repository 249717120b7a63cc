"""docs/architecture.md's "where a change goes", proven: each example change is made to a copy of the package,
laid out as a wheel installs it (pyproject.toml's package-dir), touching only the files the page lists; the
copy's own `mxforge` command then uses it, while the installed one refuses the same command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import AMD, REPO, cli
from quark_like import write_quark_like

pytestmark = pytest.mark.slow


def package_copy(dest: Path) -> Path:
    """The package from this checkout, laid out as installed (mxforge/, mxforge/quantize/ ...); returns the
    directory to put on PYTHONPATH."""
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dir.items()):  # "mxforge" first: the others go inside it
        shutil.copytree(
            REPO / folder,
            dest / package.replace(".", "/"),
            ignore=shutil.ignore_patterns("__pycache__"),
            dirs_exist_ok=True,
        )
    return dest


def run_copy(root: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`mxforge ARGS` from the copy at `root` (it comes first on the path, before the installed package)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [
            sys.executable,
            "-P",
            "-c",
            "import sys, mxforge.cli.main; assert mxforge.cli.main.__file__.startswith("
            f"{str(root)!r}), mxforge.cli.main.__file__; sys.argv[0] = 'mxforge'; sys.exit(mxforge.cli.main.main())",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=root,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def changed_files(root: Path, pristine: Path) -> set[str]:
    """Files of the copy that differ from (or are not in) the pristine copy."""
    out = set()
    for p in root.rglob("*"):
        if p.is_file() and "__pycache__" not in p.parts:
            rel = p.relative_to(root)
            if not (pristine / rel).is_file() or (pristine / rel).read_bytes() != p.read_bytes():
                out.add(rel.as_posix())
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return package_copy(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def copy(pristine, tmp_path) -> Path:
    return package_copy(tmp_path / "pkg")


@pytest.fixture(scope="module")
def export(tiny_ckpt, tmp_path_factory) -> Path:
    """A Quark-style export of the tiny GLM fixture with AMD's exclusions, fixed up: it loads everywhere."""
    out = tmp_path_factory.mktemp("ext") / "export"
    write_quark_like(tiny_ckpt, out, AMD)
    cli("fixup", str(out), "--quiet", check=True)
    return out


def _validate(run, *args) -> dict:
    proc = run("validate", *args, "--json", "-")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_a_new_engine_release_is_one_profile_file(copy, pristine, export):
    """A release that decides as its predecessor: manifests/engines/<engine>-<version>.toml extending it."""
    (copy / "mxforge/manifests/engines/sglang-0.5.99.toml").write_text(
        'extends = "sglang-0.5.22"\nreleases = ">=0.5.99,<0.5.100"\nread = ["0.5.99"]\n'
        'summary = "a throwaway release that decides as 0.5.22 (tests/test_extension_points.py)"\n'
    )
    assert changed_files(copy, pristine) == {"mxforge/manifests/engines/sglang-0.5.99.toml"}

    new = _validate(lambda *a: run_copy(copy, *a), str(export), "--engines", "sglang==0.5.99")
    old = _validate(lambda *a: run_copy(copy, *a), str(export), "--engines", "sglang-0.5.22")
    assert list(new["checked"]["engines"]) == ["sglang-0.5.99"]
    assert new["ok"] and new["checked"]["engines"]["sglang-0.5.99"] == old["checked"]["engines"]["sglang-0.5.22"]
    refused = cli("validate", str(export), "--engines", "sglang==0.5.99")
    assert refused.returncode == 2 and "sglang==0.5.99" in refused.stderr


def test_a_new_model_family_is_a_module_a_registration_and_its_tables(copy, pristine, export, tmp_path):
    """A family: its module in mxforge/models/, one line in mxforge/models/__init__.py, a [family.<name>] table
    in each engine profile that builds it (and its data: reference config, fixture presets, recipes; this
    throwaway family borrows GLM-5.2's)."""
    (copy / "mxforge/models/toy_moe.py").write_text(
        '"""A throwaway family (tests/test_extension_points.py): GLM-5.2\'s layout under another name."""\n\n'
        "from dataclasses import replace\n\nfrom .glm_moe_dsa import FAMILY as GLM\n\n"
        'FAMILY = replace(GLM, name="toy_moe", title="Toy MoE", architectures=("ToyMoeForCausalLM",), '
        'model_types=("toy_moe",))\n'
    )
    init = copy / "mxforge/models/__init__.py"
    text = init.read_text()
    text, n = re.subn(
        r"^(from mxforge\.models import .+)$", r"\1\nfrom mxforge.models import toy_moe", text, count=1, flags=re.M
    )
    assert n == 1
    text, n = re.subn(r"(FAMILIES: tuple\[Family, \.\.\.\] = \()(.*?)\)", r"\1\2, toy_moe.FAMILY)", text)
    assert n == 1
    init.write_text(text)
    tables = re.compile(r"^\[family\.glm_moe_dsa(?:\.[a-z_]+)?\]\n(?:(?!\[).*\n?)*", re.M)
    profiles = sorted((copy / "mxforge/manifests/engines").glob("*.toml"))
    for profile in profiles:
        text = profile.read_text()
        ours = "".join(m.group(0).replace("[family.glm_moe_dsa", "[family.toy_moe", 1) for m in tables.finditer(text))
        if ours:
            profile.write_text(text.rstrip() + "\n\n" + ours)
    touched = changed_files(copy, pristine)
    assert {"mxforge/models/toy_moe.py", "mxforge/models/__init__.py"} <= touched
    assert touched - {"mxforge/models/toy_moe.py", "mxforge/models/__init__.py"} <= {
        p.relative_to(copy).as_posix() for p in profiles
    }

    toy = tmp_path / "toy"
    shutil.copytree(export, toy, copy_function=os.link)
    config = json.loads((toy / "config.json").read_text())
    config.update(architectures=["ToyMoeForCausalLM"], model_type="toy_moe")
    (toy / "config.json").unlink()
    (toy / "config.json").write_text(json.dumps(config))
    ours, glm = (
        _validate(lambda *a: run_copy(copy, *a), str(toy)),
        _validate(lambda *a: run_copy(copy, *a), str(export)),
    )
    assert ours["ok"] and ours["checked"]["engines"] == glm["checked"]["engines"]
    refused = cli("validate", str(toy))
    assert refused.returncode == 2 and "ToyMoeForCausalLM" in refused.stderr


def test_a_new_scale_rule_is_one_entry(copy, pristine, tiny_ckpt, tmp_path):
    """Another way to choose MXFP4's block scales: one ScaleRule in quantize/scale_rules.py; the shard kernels,
    the recipe's `scale_rule`, the --scale-rule option, the error report and the record in quantization_config
    follow from it; the output fixes up and validates."""
    rules = copy / "mxforge/quantize/scale_rules.py"
    text = rules.read_text()
    anchor = '    ScaleRule("quark", (0,),'
    assert anchor in text
    rules.write_text(
        text.replace(
            anchor,
            '    ScaleRule("up", (0, 1), "a throwaway rule: Quark\'s exponent or one '
            'above (tests/test_extension_points.py)"),\n' + anchor,
            1,
        )
    )
    assert changed_files(copy, pristine) == {"mxforge/quantize/scale_rules.py"}

    out = tmp_path / "out"
    proc = run_copy(copy, "quantize", str(tiny_ckpt), str(out), "--scale-rule", "up", "--quiet", "--workers", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["mxforge"]["scale_rule"] == "up"
    assert run_copy(copy, "fixup", str(out), "--quiet").returncode == 0
    assert _validate(lambda *a: run_copy(copy, *a), str(out))["ok"]
    refused = cli("quantize", str(tiny_ckpt), str(tmp_path / "other"), "--scale-rule", "up")
    assert refused.returncode == 2 and "up" in refused.stderr


def test_a_new_fp8_source_layout_is_one_scheme_entry_and_its_reader(copy, pristine, tmp_path):
    """Another FP8 layout to read: one Fp8Scheme in FP8_SCHEMES and, for a new quant_method, its reader in READERS,
    both in quantize/fp8_source.py; planning, reading and dequantizing follow. The example, "toy": per-channel
    `weight_scale` as compressed-tensors stores it but without `input_scale`, selected by quant_method "toy_fp8";
    it quantizes to the tensors the compressed-tensors checkpoint it was made from quantizes to."""
    from safetensors.torch import load_file, save_file

    from mxforge.models import family_named
    from mxforge.models.fixture import write_fixture

    source = copy / "mxforge/quantize/fp8_source.py"
    text = source.read_text()
    scheme_anchor, reader_anchor = (
        '        Fp8Scheme(\n            "tensor",',
        '    "compressed-tensors": _compressed_tensors,',
    )
    assert text.count(scheme_anchor) == 1 and text.count(reader_anchor) == 1
    toy = (
        '        Fp8Scheme("toy", "channel", "_scale", (), "toy per-channel weight_scale", "quant_method toy_fp8", '
        '"{\\"quant_method\\": \\"toy_fp8\\"} (tests/test_extension_points.py)"),\n'
    )
    text = text.replace(scheme_anchor, toy + scheme_anchor)
    text = text.replace(
        reader_anchor, reader_anchor + '\n    "toy_fp8": lambda qc: SourcePrecision("fp8", None, "toy"),'
    )
    source.write_text(text)
    assert changed_files(copy, pristine) == {"mxforge/quantize/fp8_source.py"}

    channel = tmp_path / "channel"
    write_fixture(channel, "tiny", quiet=True, family=family_named("glm4_moe"), precision="fp8")
    ours = tmp_path / "toy"
    shutil.copytree(channel, ours)
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    dropped = {n for n in index["weight_map"] if n.endswith(".input_scale")}
    assert dropped
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(ours / shard)
        save_file({n: t for n, t in tensors.items() if n not in dropped}, ours / shard, metadata={"format": "pt"})
    kept = {n: s for n, s in index["weight_map"].items() if n not in dropped}
    sizes = {n: t.numel() * t.element_size() for s in set(kept.values()) for n, t in load_file(ours / s).items()}
    index.update(weight_map=kept, metadata={**index.get("metadata", {}), "total_size": sum(sizes.values())})
    (ours / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((ours / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "toy_fp8"}
    (ours / "config.json").write_text(json.dumps(config, indent=2))

    out, reference = tmp_path / "out", tmp_path / "reference"
    proc = run_copy(copy, "quantize", str(ours), str(out), "--quiet", "--workers", "1", "--json", "-")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["source_precision"] == "fp8 (e4m3, toy per-channel weight_scale)"
    cli("quantize", str(channel), str(reference), "--quiet", "--workers", "1", check=True)
    shards = sorted(p.name for p in reference.glob("*.safetensors"))
    assert shards and sorted(p.name for p in out.glob("*.safetensors")) == shards
    for shard in shards:
        got, want = load_file(out / shard), load_file(reference / shard)
        assert got.keys() == want.keys() and all(got[n].equal(want[n]) for n in want), shard
    refused = cli("quantize", str(ours), str(tmp_path / "other"))
    assert refused.returncode == 2 and "toy_fp8" in refused.stderr
