"""The element-format seam: one registry entry defines a format (mxforge/formats/), its facts agree with Quark's own
spec classes and with the OCP MX specification, and no module outside mxforge/formats/ spells them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from ocp_mx import BLOCK, E2M1_TABLE, E8M0_BIAS, E8M0_NAN

from mxforge.errors import ConfigError
from mxforge.formats import (
    DEFAULT_FORMAT,
    FORMATS,
    MXFP4,
    format_named,
    format_of_spec,
    stored_pair,
    stored_pairs,
    weight_of_scale,
)
from mxforge.formats.element import pack_codes, unpack_codes
from mxforge.safetensors_io import TensorInfo

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("mxforge", "quantize", "validation", "fixups", "scripts")  # the code that ships or operators run
FORMATS_DIR = REPO / "mxforge" / "formats"

# A format's facts, as code spells them: Quark's spec values and class names, the stored scale suffix, the codes'
# dtype; the block size, the E8M0 bias, its NaN code and Quark's largest scale byte; nibble arithmetic.
FACT_WORDS = re.compile(r"\b(fp4|fp6\w*|fp8_e\dm\d|e8m0|e2m1|e2m3|e3m2|weight_scale|OCP_MX\w*|U8|uint8)\b", re.I)
FACT_INTS = {32, 127, 254, 255}
# What the scan finds that is not an element format's fact, and why.
NOT_FORMAT_FACTS = {
    ("mxforge/cli/main.py", "weight_scale"): "compressed-tensors FP8 sources' own scale name (an FP8 source layout)",
    ("mxforge/cli/quantize.py", "weight_scale"): "compressed-tensors FP8 sources' own scale name (help text)",
    ("quantize/fp8_source.py", "weight_scale"): "compressed-tensors FP8 sources' own scale name (Fp8Scheme labels)",
    ("mxforge/models/fixture.py", "weight_scale"): "compressed-tensors FP8 fixtures' companions (FP8_LAYOUTS)",
    ("scripts/bench_fp8.py", "weight_scale"): "compressed-tensors FP8 sources' scales, read by the FP8 benchmark",
    ("mxforge/safetensors_io.py", "U8"): "safetensors' own dtype tables",
    ("quantize/fp8_source.py", "codes >> 3 & 15"): "an FP8 source's own E4M3 exponent bits (fp8_source.py)",
    ("mxforge/dir_lock.py", 32): "the bytes of a lock owner record read back",
    ("mxforge/safe_paths.py", 255): "NAME_MAX, the longest file name",
    ("mxforge/safe_paths.py", 32): "ASCII control characters (below space)",
    ("mxforge/safe_paths.py", 127): "ASCII DEL",
    ("mxforge/json_input.py", 127): "serde_json's recursion limit less one (safetensors' header depth)",
}


def _docstring_ids(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }


def format_facts(path: Path, root: Path = REPO) -> list[tuple[str, str | int, int]]:
    """(file, fact, line) for each format fact the code of `path` spells (docstrings and comments are prose)."""
    tree = ast.parse(path.read_text(), str(path))
    docs, rel, out = _docstring_ids(tree), path.relative_to(root).as_posix(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out += [(rel, m.group(0), node.lineno) for m in FACT_WORDS.finditer(node.value)]
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value in FACT_INTS:
            out.append((rel, node.value, node.lineno))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.RShift, ast.BitAnd)):  # nibbles: >> 4, & 0xF
            nibble = 4 if isinstance(node.op, ast.RShift) else 0xF
            if any(isinstance(s, ast.Constant) and s.value == nibble for s in (node.left, node.right)):
                out.append((rel, ast.unparse(node), node.lineno))
    return out


def _product_files(root: Path = REPO) -> list[Path]:
    return [p for d in PRODUCT for p in sorted((root / d).rglob("*.py")) if FORMATS_DIR not in p.parents]


def test_no_module_outside_the_formats_package_spells_a_format_fact():
    """Adding an element format touches mxforge/formats/ only: its block size, scale codes, Quark names, stored
    names and packing are asked of the registry everywhere else."""
    found = [
        f"{rel}:{line}: {fact!r}"
        for path in _product_files()
        for rel, fact, line in format_facts(path)
        if (rel, fact if isinstance(fact, int) else fact.removeprefix(".")) not in NOT_FORMAT_FACTS
    ]
    assert not found, "element-format facts outside mxforge/formats/:\n" + "\n".join(found)


def test_the_scan_sees_planted_facts(tmp_path):
    """The scan above is not vacuous: each kind of fact is found in a module that spells it."""
    planted = tmp_path / "quantize" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(
        '"""A docstring may say fp4, 32 and weight_scale."""\n'
        'SPEC = {"dtype": "fp4", "scale_format": "e8m0"}\n'
        "def f(name, codes, inner):\n"
        '    return name + ".weight_scale", -(-inner // 32), codes >> 4, codes & 0xF, 255\n'
    )
    facts = {fact for _, fact, _ in format_facts(planted, tmp_path)}
    assert facts == {"fp4", "e8m0", "weight_scale", 32, "codes >> 4", "codes & 15", 255}
    assert _product_files()


def test_the_registry_names_each_format_once():
    assert len({f.name for f in FORMATS}) == len(FORMATS) and DEFAULT_FORMAT is MXFP4
    assert format_named("mxfp4") is MXFP4
    with pytest.raises(ConfigError, match=r"unknown element format 'nvfp4'; choose one of mxfp4"):
        format_named("nvfp4")


def test_mxfp4_is_the_ocp_mx_specification():
    """The entry's code table, block and scale are OCP MX v1.0's FP4 E2M1 / E8M0 (tests/ocp_mx.py, written from the
    specification without mxforge)."""
    assert MXFP4.values == tuple(E2M1_TABLE.tolist()) and MXFP4.element_bits == 4 and MXFP4.max_value == 6.0
    assert (MXFP4.block, MXFP4.scale.bias, MXFP4.scale.nan_code) == (BLOCK, E8M0_BIAS, E8M0_NAN)
    assert MXFP4.packed_shapes((3, 40)) == ((3, 20), (3, 2))
    assert [t.name for t in MXFP4.stored("m.weight", (8, 64))] == ["m.weight", "m.weight_scale"]
    assert MXFP4.describe() == "uint8 E2M1 codes, two per byte, with one E8M0 `weight_scale` byte per 32 weights"
    with pytest.raises(ConfigError, match="MXFP4 packs two codes per byte and in-dimension 33 is odd"):
        MXFP4.packed_shapes((2, 33))


@pytest.mark.quark
def test_every_entry_is_quarks_own_spec():
    """What an entry says Quark writes (dtype, qscheme, group size, scale format) is what its Quark spec class
    writes, and the registry recognizes that spec as the entry (and nothing else as it)."""
    from mxforge.formats.quark import kept_layer_config, specs
    from mxforge.models.fixture import FP8_QUANTIZATION_CONFIG

    for fmt in FORMATS:
        if fmt.kept_only:  # Quark writes its layer config for a kept source module (a DeepSeek-V3-style source's)
            kept = kept_layer_config(FP8_QUANTIZATION_CONFIG)
            weight, inputs = kept["weight"], kept["input_tensors"]
        else:
            weight, inputs = (s.to_dict() for s in specs(fmt))
        assert {k: weight[k] for k in fmt.spec_fields} == fmt.spec_fields
        assert weight["is_dynamic"] is False and inputs["is_dynamic"] is True
        assert format_of_spec(weight) is fmt and fmt.matches_input_spec(inputs)
        assert format_of_spec(inputs) is (None if fmt.quark.input_qscheme else fmt)
        size_key = "block_size" if fmt.block_rows > 1 else "group_size"
        assert format_of_spec({**weight, size_key: (fmt.block or 2) // 2}) is None


def test_codes_pack_little_endian_along_the_row():
    """The generic packing is MXFP4's (the first code in the low nibble) and round-trips at every width."""
    rng = np.random.default_rng(0)
    for bits in (4, 6, 8):
        codes = rng.integers(0, 1 << bits, size=(3, 32), dtype=np.uint8)
        packed = pack_codes(codes, bits)
        assert packed.shape == (3, 32 * bits // 8) and np.array_equal(unpack_codes(packed, bits), codes)
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    packed = MXFP4.quantize(w)[0].numpy()
    nibbles = unpack_codes(packed, MXFP4.element_bits)
    assert np.array_equal(nibbles[:, 0::2], packed & 0xF) and np.array_equal(nibbles[:, 1::2], packed >> 4)


def _info(name: str, dtype: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name, dtype, shape, 0, 0)


def test_stored_pairs_is_the_one_test_of_codes_with_scales():
    infos = {
        "a.weight": _info("a.weight", "U8", (8, 32)),
        "a.weight_scale": _info("a.weight_scale", "U8", (8, 2)),
        "b.weight": _info("b.weight", "U8", (8, 32)),
        "b.weight_scale": _info("b.weight_scale", "U8", (8, 3)),  # the wrong block count for in = 64
        "c.weight": _info("c.weight", "U8", (8, 32)),  # no scales: a plain uint8 tensor
        "d.weight": _info("d.weight", "BF16", (8, 64)),
        "d.weight_scale": _info("d.weight_scale", "U8", (8, 2)),  # beside a bf16 weight: not a pair
        "e.bias": _info("e.bias", "U8", (8, 32)),
        "e.bias_scale": _info("e.bias_scale", "U8", (8, 2)),
    }
    pairs = stored_pairs(infos)
    assert set(pairs) == {"a.weight", "b.weight"}
    assert pairs["a.weight"].format is MXFP4 and pairs["a.weight"].defect is None and pairs["a.weight"].shape == (8, 64)
    assert "b.weight_scale is U8 [8, 3], expected U8 [8, 2]" in pairs["b.weight"].defect
    missing = stored_pair(infos, "c.weight", (8, 64))  # where config.json says it is a quantized linear
    assert missing is not None and "c.weight_scale is missing" in missing.defect
    assert weight_of_scale("model.layers.0.mlp.experts.3.up_proj.weight_scale") == (
        "model.layers.0.mlp.experts.3.up_proj.weight"
    )
    assert weight_of_scale("x.weight_scale_inv") is None and weight_of_scale("x.weight") is None
