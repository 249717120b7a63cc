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


# What registering the throwaway family adds to the copy (_add_toy_family)
TOY_FILES = {"mxforge/models/toy_moe.py", "mxforge/models/__init__.py"} | {
    f"mxforge/manifests/models/toy-moe.{suffix}" for suffix in ("family.toml", "config.json", "fixtures.toml")
}


def _toy_validates_as_glm(copy: Path, export: Path, tmp_path: Path) -> Path:
    """GLM-5.2's export relabelled as the throwaway family (a hard-linked copy) validates in the copy exactly as
    GLM-5.2's does, release by release; the relabelled copy."""
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
    return toy


def _add_toy_family(copy: Path, family_toml_extra: str = "") -> None:
    """Registers the throwaway family `toy_moe` in the copy: GLM-5.2's layout, data and recipes under another name
    (its module, its line in FAMILIES, its three manifests/models/ files, `family_toml_extra` appended to its
    family.toml)."""
    (copy / "mxforge/models/toy_moe.py").write_text(
        '"""A throwaway family (tests/test_extension_points.py): GLM-5.2\'s layout under another name."""\n\n'
        "from mxforge.models.family import load_family\nfrom mxforge.models.glm_moe_dsa import GlmMoeDsaLayout\n"
        "from mxforge.models.tensor_kinds import LINEAGE_KIND_RULES\n\n\n"
        "class ToyMoeLayout(GlmMoeDsaLayout):\n    pass\n\n\n"
        'FAMILY = load_family("toy-moe", layout=ToyMoeLayout, kind_rules=LINEAGE_KIND_RULES)\n'
        "ToyMoeLayout.family = FAMILY\n"
    )
    models = copy / "mxforge/manifests/models"
    renamed = {"glm_moe_dsa": "toy_moe", "GlmMoeDsaForCausalLM": "ToyMoeForCausalLM", "GLM-5 / 5.1 / 5.2": "Toy MoE"}
    for suffix in ("family.toml", "config.json", "fixtures.toml"):
        text = (models / f"glm-5.2.{suffix}").read_text()
        for old, new in renamed.items():
            text = text.replace(f'"{old}"', f'"{new}"')
        (models / f"toy-moe.{suffix}").write_text(text + (family_toml_extra if suffix == "family.toml" else ""))
    init = copy / "mxforge/models/__init__.py"
    text = init.read_text()
    text, n = re.subn(
        r"^(from mxforge\.models import )", r"from mxforge.models import toy_moe\n\1", text, count=1, flags=re.M
    )
    assert n == 1
    text, n = re.subn(
        r"(FAMILIES: tuple\[Family, \.\.\.\] = \()(.*?)\)",
        lambda m: f"{m.group(1)}{m.group(2).rstrip().rstrip(',')}, toy_moe.FAMILY)",
        text,
        flags=re.S,
    )
    assert n == 1
    init.write_text(text)


def test_a_new_model_family_is_a_module_a_registration_its_data_and_its_tables(copy, pristine, export, tmp_path):
    """A family: its module in mxforge/models/ (layout, tensor kinds, joined to its data), one line in
    mxforge/models/__init__.py, its data in manifests/models/ (<manifest>.family.toml, reference config, fixture
    presets; recipes are named there) and a [family.<name>] table in each engine profile that builds it. The
    throwaway family borrows GLM-5.2's layout, data and recipes under another name."""
    _add_toy_family(copy)
    tables = re.compile(r"^\[family\.glm_moe_dsa(?:\.[a-z_]+)?\]\n(?:(?!\[).*\n?)*", re.M)
    profiles = sorted((copy / "mxforge/manifests/engines").glob("*.toml"))
    for profile in profiles:
        text = profile.read_text()
        ours = "".join(m.group(0).replace("[family.glm_moe_dsa", "[family.toy_moe", 1) for m in tables.finditer(text))
        if ours:
            profile.write_text(text.rstrip() + "\n\n" + ours)
    touched = changed_files(copy, pristine)
    assert TOY_FILES <= touched
    assert touched - TOY_FILES <= {p.relative_to(copy).as_posix() for p in profiles}
    made = run_copy(copy, "fixture", str(tmp_path / "toy-fixture"), "--family", "toy_moe", "--preset", "tiny")
    assert made.returncode == 0, made.stderr
    assert json.loads((tmp_path / "toy-fixture/config.json").read_text())["architectures"] == ["ToyMoeForCausalLM"]

    toy = _toy_validates_as_glm(copy, export, tmp_path)
    refused = cli("validate", str(toy))
    assert refused.returncode == 2 and "ToyMoeForCausalLM" in refused.stderr


def test_a_family_like_another_states_only_what_differs(copy, pristine, export, tmp_path):
    """A family whose checkpoints are another's under other names states in each engine profile only what differs:
    `like = "<family>"` reads the other's table as that profile has it (Qwen3.5 MoE's text-only model). The
    throwaway family's tables are one line in the two base profiles, and every release decides its checkpoint as
    GLM-5.2's, later profiles' changes to GLM-5.2's tables included."""
    _add_toy_family(copy)
    bases = [copy / f"mxforge/manifests/engines/{name}.toml" for name in ("sglang-0.5.9", "vllm-0.30.0")]
    for profile in bases:
        profile.write_text(profile.read_text().rstrip() + '\n\n[family.toy_moe]\nlike = "glm_moe_dsa"\n')
    assert changed_files(copy, pristine) == TOY_FILES | {p.relative_to(copy).as_posix() for p in bases}
    _toy_validates_as_glm(copy, export, tmp_path)


TOY_LAYERS = """
[layers]
decoder = "model.language_model.layers.{layer}"
mtp = "mtp.layers.{k}"
mtp_block = "mtp"
mtp_block_modules = ["eh_proj", "enorm", "hnorm"]
"""


def test_where_a_family_stores_its_layers_is_its_layers_table(copy, pristine, tiny_ckpt, tmp_path):
    """Where a family stores its layers is data: the `[layers]` table of its family.toml
    (mxforge/models/layer_names.py). The throwaway family stores GLM-5.2's layers as Qwen3.5 stores its own: the
    decoder under `model.language_model.layers.N`, MTP layer k as `mtp.layers.k` and the MTP block's eh_proj / enorm
    / hnorm as `mtp.*`. Its fixture, quantized with the default recipe, holds GLM-5.2's quantized tensors under
    those names with the same decisions (the exclude list, renamed), and inspect finds the same MTP layer."""
    from mxforge.checkpoint import Checkpoint

    _add_toy_family(copy, TOY_LAYERS)
    assert changed_files(copy, pristine) == TOY_FILES
    toy_src, toy_out, glm_out = tmp_path / "toy-src", tmp_path / "toy-out", tmp_path / "glm-out"
    made = run_copy(copy, "fixture", str(toy_src), "--family", "toy_moe", "--preset", "tiny", "--quiet")
    assert made.returncode == 0, made.stderr
    quantized = run_copy(copy, "quantize", str(toy_src), str(toy_out), "--quiet", "--workers", "1")
    assert quantized.returncode == 0, quantized.stderr
    cli("quantize", str(tiny_ckpt), str(glm_out), "--quiet", "--workers", "1", check=True)

    hidden = json.loads((glm_out / "config.json").read_text())["num_hidden_layers"]

    def renamed(name: str) -> str:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None:
            return name
        layer, local = int(m.group(1)), name[m.end() :]
        if layer < hidden:
            return f"model.language_model.layers.{layer}.{local}"
        return f"mtp.{local}" if local.split(".")[0] in ("eh_proj", "enorm", "hnorm") else f"mtp.layers.0.{local}"

    def stored(root: Path) -> dict:
        return {n: (i.dtype, i.shape) for n, i in Checkpoint.open(root).tensor_infos().items()}

    toy, glm = stored(toy_out), stored(glm_out)
    assert toy == {renamed(n): v for n, v in glm.items()}
    assert "mtp.layers.0.mlp.experts.0.up_proj.weight_scale" in toy and "mtp.eh_proj.weight" in toy
    excluded = {
        root: json.loads((root / "config.json").read_text())["quantization_config"]["exclude"]
        for root in (toy_out, glm_out)
    }
    assert sorted(excluded[toy_out]) == sorted(renamed(e) for e in excluded[glm_out])
    assert "mtp.eh_proj" in excluded[toy_out] and "mtp.layers.0.self_attn.o_proj" in excluded[toy_out]
    shown = json.loads(run_copy(copy, "inspect", str(toy_out), "--json", "-").stdout)
    mtp = sum(1 for n in toy if n.startswith("mtp."))
    assert shown["by_kind"]["mtp"]["tensors"] == mtp > 0
    assert shown["layers"]["decoder_layers"] == hidden


TOY_CONFIG = (
    '\n[config]\ntext = "text_config"\n'
    '[config.fields]\nn_routed_experts = "num_experts"\nnum_nextn_predict_layers = "mtp_num_hidden_layers"\n'
)
TOP_LEVEL_ENTRIES = ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype")


def test_where_a_family_keeps_its_config_fields_is_its_config_table(copy, pristine, tiny_ckpt, tmp_path):
    """Where a family's config.json keeps its language model's fields, and what it calls them, is data: the
    `[config]` table of its family.toml (mxforge/models/config_names.py). The throwaway family nests GLM-5.2's fields
    in `text_config` and names the expert and MTP counts as Qwen3.5 MoE does (`num_experts`,
    `mtp_num_hidden_layers`). Its fixture writes them there, its quantized output holds GLM-5.2's tensors with the
    same decisions, keeps the nesting, and inspect names the fields as the family stores them."""
    from mxforge.checkpoint import Checkpoint

    _add_toy_family(copy, TOY_CONFIG)
    models = copy / "mxforge/manifests/models"
    flat = json.loads((models / "toy-moe.config.json").read_text())
    renames = {"n_routed_experts": "num_experts", "num_nextn_predict_layers": "mtp_num_hidden_layers"}
    nested = {k: v for k, v in flat.items() if k in TOP_LEVEL_ENTRIES}
    nested["text_config"] = {renames.get(k, k): v for k, v in flat.items() if k not in TOP_LEVEL_ENTRIES}
    (models / "toy-moe.config.json").write_text(json.dumps(nested, indent=2))
    toy_src, toy_out, glm_out = tmp_path / "toy-src", tmp_path / "toy-out", tmp_path / "glm-out"
    made = run_copy(copy, "fixture", str(toy_src), "--family", "toy_moe", "--preset", "tiny", "--quiet")
    assert made.returncode == 0, made.stderr
    glm_config = json.loads((tiny_ckpt / "config.json").read_text())
    written = json.loads((toy_src / "config.json").read_text())
    assert set(written) == set(nested) and "n_routed_experts" not in written["text_config"]
    assert written["text_config"]["num_experts"] == glm_config["n_routed_experts"]
    assert written["text_config"]["mtp_num_hidden_layers"] == glm_config["num_nextn_predict_layers"] == 1
    assert written["text_config"]["hidden_size"] == glm_config["hidden_size"]  # the preset's, written nested
    quantized = run_copy(copy, "quantize", str(toy_src), str(toy_out), "--quiet", "--workers", "1")
    assert quantized.returncode == 0, quantized.stderr
    cli("quantize", str(tiny_ckpt), str(glm_out), "--quiet", "--workers", "1", check=True)

    def stored(root: Path) -> dict:
        return {n: (i.dtype, i.shape) for n, i in Checkpoint.open(root).tensor_infos().items()}

    assert stored(toy_out) == stored(glm_out)
    out_config = json.loads((toy_out / "config.json").read_text())
    glm_qc = json.loads((glm_out / "config.json").read_text())["quantization_config"]
    assert sorted(out_config["quantization_config"]["exclude"]) == sorted(glm_qc["exclude"])
    assert (
        out_config["text_config"] == written["text_config"] and "quantization_config" not in out_config["text_config"]
    )
    shown = json.loads(run_copy(copy, "inspect", str(toy_out), "--json", "-").stdout)
    assert shown["mtp"]["declared_by"] == ["text_config.num_hidden_layers", "text_config.mtp_num_hidden_layers"]
    assert shown["mtp"]["present_layers"] == [glm_config["num_hidden_layers"]] and shown["mtp"]["complete"]
    broken = tmp_path / "broken"
    shutil.copytree(toy_src, broken)
    (broken / "config.json").write_text(json.dumps({**written, "text_config": None}))
    refused = run_copy(copy, "quantize", str(broken), str(tmp_path / "never"), "--quiet")
    assert refused.returncode == 2 and "config.json: text_config is null; this family keeps" in refused.stderr, (
        refused.stderr
    )
    assert not (tmp_path / "never" / "config.json").exists()


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


# The new element format of the example: its entry and its kernel, one module. Bit for bit Quark's (the test checks).
FP4_G16 = '''"""FP4 per group of 16 with a float32 scale (E2M1 elements; the scale is the group's amax / 6), as
Quark 0.13's `FP4PerGroupSpec(group_size=16)` writes it, with a torch kernel (a throwaway of
tests/test_extension_points.py)."""

from __future__ import annotations

from mxforge.formats.element import (
    ElementFormat,
    Kernels,
    QuarkSpec,
    ScaleFormat,
    add_error_stats,
    decode_table,
    magnitude_codes,
    pack_codes,
    unpack_codes,
)

BLOCK, BITS = 16, 4
VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FLOAT32 = ScaleFormat("float32", "float32", "F32")  # Quark writes scale_format "float32"


def encode_torch(weight, codes, scales, device, offsets=(0,), stats=None) -> int:
    import torch

    rows, inner = weight.shape
    nblocks = scales.shape[1] // 4
    x = weight.to(device=device, dtype=torch.float32)
    nonfinite = int((~torch.isfinite(x)).sum())
    x = torch.nn.functional.pad(x, (0, nblocks * BLOCK - inner)).reshape(rows, nblocks, BLOCK)
    scale = x.abs().amax(dim=-1) / max(VALUES)
    q = x.abs() / scale.unsqueeze(-1)
    mag = magnitude_codes(q, VALUES)
    if stats is not None:
        table = torch.tensor(VALUES, dtype=torch.float64, device=device)
        add_error_stats(x.abs(), table[mag.long()] * scale.double().unsqueeze(-1), q > 6, torch.isfinite(scale), stats)
    code = mag | (((x < 0) & (mag > 0)).to(torch.uint8) << (BITS - 1))
    codes.copy_(torch.from_numpy(pack_codes(code.reshape(rows, -1)[:, :inner].cpu().numpy(), BITS)))
    scales.copy_(scale.cpu().contiguous().view(torch.uint8).reshape(rows, -1))
    return nonfinite


def encode_cpu(rows, codes, scales, offsets=(0,), stats=None) -> int:
    import torch

    w = torch.from_numpy(rows)
    w = w.view(torch.bfloat16) if rows.dtype.itemsize == 2 else w  # bf16 bits, as the shard jobs pass them
    return encode_torch(w, torch.from_numpy(codes), torch.from_numpy(scales), torch.device("cpu"), offsets, stats)


def decode(codes, scales, inner):
    return decode_table(VALUES, FLOAT32, BLOCK, unpack_codes(codes, BITS), scales, inner)


FORMAT = ElementFormat(
    name="fp4_g16",
    title="FP4 G16",
    element="E2M1",
    element_bits=BITS,
    values=VALUES,
    block=BLOCK,
    scale=FLOAT32,
    codes_dtype="U8",
    quark=QuarkSpec("FP4PerGroupSpec", "fp4"),
    kernels=Kernels(encode_cpu=encode_cpu, encode_torch=encode_torch, decode=decode),
)
'''
# Wrong on purpose: a group of 8, and a code table with its subnormal at 0.25 (another element type's).
MUTANTS = {
    "block": ("BLOCK, BITS = 16, 4", "BLOCK, BITS = 8, 4"),
    "code table": ("VALUES = (0.0, 0.5,", "VALUES = (0.0, 0.25,"),
}


def throwaway_vllm() -> str:
    """A throwaway profile extending vLLM 0.31.0's that also lists FP4 G16 (every format its parent lists, too)."""
    from mxforge.validation.profiles import load_profile

    formats = sorted(load_profile("vllm-0.31.0", "glm_moe_dsa").formats | {"fp4_g16"})
    return (
        'extends = "vllm-0.31.0"\nreleases = ">=0.99,<0.100"\nread = ["0.99"]\n'
        'summary = "a throwaway release that loads FP4 G16 (tests/test_extension_points.py)"\n\n'
        f"[schemes]\nformats = {json.dumps(formats)}\n"
    )


def add_fp4_g16(root: Path, entry: str = FP4_G16) -> None:
    """The change the docs (docs/formats.md) list for an element format: its module and its line in FORMATS."""
    (root / "mxforge/formats/fp4_g16.py").write_text(entry)
    init = root / "mxforge/formats/__init__.py"
    text, n = re.subn(
        r"^from mxforge\.formats import (.*)$",
        r"from mxforge.formats import \1, fp4_g16",
        init.read_text(),
        flags=re.M,
    )
    text, m = re.subn(
        r"^(FORMATS: tuple\[ElementFormat, \.\.\.\] = \([^)]*?),?(\s*)\)$", r"\1, fp4_g16.FORMAT\2)", text, flags=re.M
    )
    assert n == m == 1
    init.write_text(text)


def _quark_spec(is_dynamic: bool = False):
    from quark.torch.quantization.config.config import FP4PerGroupSpec

    return FP4PerGroupSpec(ch_axis=-1, group_size=16, is_dynamic=is_dynamic).to_quantization_spec()


def _quark_fp4_g16(weight):
    """(codes, scales) of Quark 0.13's own file-to-file routine for FP4 per group of 16 (the reference numbers)."""
    from quark.torch.quantization import file2file_quantization as f2f

    out: dict = {}
    f2f._single_stage_quantize_weight(weight, "w.weight", "w", _quark_spec(), out, "ref.safetensors")
    return out["w.weight"], out["w.weight_scale"]


def _quark_fp4_g16_dequantized(codes, scales):
    """Quark's own dequantization of stored FP4 G16 codes (what its model loading runs), in bf16."""
    import torch
    from quark.torch.export.nn.modules.realquantizer import get_real_quantizer

    quantizer = get_real_quantizer(
        qspec=_quark_spec(),
        quantizer=None,
        reorder=True,
        real_quantized=True,
        float_dtype=torch.bfloat16,
        device=torch.device("cpu"),
        scale_shape=tuple(scales.shape),
    )
    quantizer.scale = scales.clone()
    return quantizer(codes).to(torch.bfloat16)


def _tensors(root: Path) -> dict:
    from safetensors.torch import load_file

    return {n: t for shard in sorted(root.glob("*.safetensors")) for n, t in load_file(shard).items()}


@pytest.mark.quark
def test_a_new_element_format_is_one_entry_and_its_kernel(copy, pristine, tiny_ckpt, tmp_path):
    """An element format is one registry entry with its kernel (mxforge/formats/<name>.py and its line in
    FORMATS): a recipe rule's `format` selects it, and quantize (bytes and quantization_config Quark 0.13's own for
    FP4 per group of 16 with float32 scales), dequantize (Quark's own dequantization), fixup and validate follow.
    Fixup and validate say per release that its profile does not vouch for the format; a release whose profile lists
    it (the third file, a throwaway vLLM profile) validates it. A wrong block size or code table gives bytes other than
    Quark's."""
    import torch
    from quark.torch.quantization.config.config import QConfig, QLayerConfig

    add_fp4_g16(copy)
    (copy / "mxforge/manifests/engines/vllm-0.99.toml").write_text(throwaway_vllm())
    assert changed_files(copy, pristine) == {
        "mxforge/formats/fp4_g16.py",
        "mxforge/formats/__init__.py",
        "mxforge/manifests/engines/vllm-0.99.toml",
    }
    recipe = tmp_path / "glm-5.2-fp4-g16.toml"
    shipped = (REPO / "manifests/recipes/glm-5.2-mxfp4.toml").read_text()
    recipe.write_text(shipped.replace("[[quantize]]\n", '[[quantize]]\nformat = "fp4_g16"\n'))

    out = tmp_path / "out"
    proc = run_copy(copy, "quantize", str(tiny_ckpt), str(out), "--recipe", str(recipe), "--quiet", "--json", "-")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["recipe"]["format"] == "fp4_g16" and report["error"]["overall"]["rel_rmse"] > 0
    source, ours = _tensors(tiny_ckpt), _tensors(out)
    quantized = report["tensors"]["quantized"]
    assert quantized and all(ours[n].shape == (source[n].shape[0], source[n].shape[1] // 2) for n in quantized)
    for name in quantized:
        codes, scales = _quark_fp4_g16(source[name])
        assert torch.equal(ours[name], codes) and torch.equal(ours[name + "_scale"], scales), name
    quark_qc = QConfig(
        global_quant_config=QLayerConfig(weight=_quark_spec(), input_tensors=_quark_spec(is_dynamic=True))
    ).to_dict()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["global_quant_config"] == quark_qc["global_quant_config"]

    deq = tmp_path / "bf16"
    assert run_copy(copy, "dequantize", str(out), str(deq), "--quiet").returncode == 0
    unpacked = _tensors(deq)
    for name in quantized:
        assert torch.equal(unpacked[name], _quark_fp4_g16_dequantized(ours[name], ours[name + "_scale"])), name

    fixed = run_copy(copy, "fixup", str(out), "--quiet")  # writes the entries; exit 1: no profile but one vouches
    assert fixed.returncode == 1 and "has not measured that they load FP4 G16" in fixed.stdout, fixed.stdout
    every = _validate(lambda *a: run_copy(copy, *a), str(out))
    engines = every["checked"]["engines"]
    assert not every["ok"] and "vllm-0.99" in engines
    unvouched = {p["engine"] for p in every["problems"] if "has not measured that they load FP4 G16" in p["message"]}
    assert unvouched == set(engines) - {"vllm-0.99"}, every["problems"][:3]
    throwaway = _validate(lambda *a: run_copy(copy, *a), str(out), "--engines", "vllm==0.99")
    assert throwaway["ok"] and list(throwaway["checked"]["engines"]) == ["vllm-0.99"], throwaway["problems"][:3]
    refused = cli("quantize", str(tiny_ckpt), str(tmp_path / "other"), "--recipe", str(recipe))
    assert refused.returncode == 2 and "fp4_g16" in refused.stderr

    for what, (right, wrong) in MUTANTS.items():
        mutant = package_copy(tmp_path / f"mutant-{what.replace(' ', '-')}")
        assert FP4_G16.count(right) == 1
        add_fp4_g16(mutant, FP4_G16.replace(right, wrong))
        bad = tmp_path / f"bad-{what.replace(' ', '-')}"
        proc = run_copy(mutant, "quantize", str(tiny_ckpt), str(bad), "--recipe", str(recipe), "--quiet")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        theirs = _tensors(bad)
        assert not any(torch.equal(theirs[n], ours[n]) for n in quantized), what  # Quark's bytes, as checked above
