"""Regular expressions from outside are matched in bounded time, with exactly `re`'s answers (mxforge.bounded_re)."""

from __future__ import annotations

import random
import re

import pytest
from helpers import deadline

from mxforge import bounded_re
from mxforge.bounded_re import compile_bounded
from mxforge.errors import ConfigError

# What exclude lists and recipes hold in practice (Quark, compressed-tensors and mxforge's own), and more.
REAL = [
    r"model\.layers\.78\.(self_attn\..*|mlp\.shared_experts\..*|eh_proj)$",
    r".*o_proj",
    r".*self_attn.*",
    r".*mlp\.gate$",
    r"model\.layers\.[0-3]",
    r"model\.layers\.\d+\.mlp\.experts\.\d+\..*",
    r".*lm_head",
    r"model.layers.[0-9]+.mlp.gate$",
    r"(?i).*MLP\.GATE",
    r"^model\.(embed_tokens|norm)$",
    r".*\.(q|k|v)_proj",
    r".*(?<!shared_)experts.*",
    r"(?!.*mlp).*",
    r"model\.layers\.(?:[0-9]|[1-6][0-9]|7[0-7])\.self_attn\..*",
    r"model\.layers\.\d{2}\.",
    r".*\bgate\b.*",
    r"model\.decoder\..*|model\.eh_proj",
    r"mlp\.experts\.\d+\.(gate|up|down)_proj",
]
NAMES = [
    "model.layers.78.self_attn.q_a_proj",
    "model.layers.78.mlp.shared_experts.down_proj",
    "model.layers.78.eh_proj",
    "model.layers.3.mlp.gate",
    "model.layers.12.mlp.experts.255.up_proj",
    "model.layers.12.mlp.shared_experts.gate_up_proj",
    "model.decoder.mlp.experts",
    "lm_head",
    "model.embed_tokens",
    "model.norm",
    "model.layers.2.MLP.GATE",
    "",
    "model.layers.7\n",
    "mlp.experts.3.gate_proj",
]
ATOMS = ["a", "b", ".", r"\.", "[ab]", "[^a]", r"\d", r"\w", r"\W", r"\s", r"\b", r"\B", "^", "$", r"\A", r"\Z", ""]
ATOMS += ["(?i:A)", "[a-c]", "\n", r"[\d.]", "ß", "K", "İ", "ſ"]


def _random_pattern(rng: random.Random, depth: int) -> str:
    r = rng.random()
    if depth == 0 or r < 0.3:
        return rng.choice(ATOMS)
    if r < 0.5:
        return _random_pattern(rng, depth - 1) + _random_pattern(rng, depth - 1)
    if r < 0.6:
        return f"({_random_pattern(rng, depth - 1)}|{_random_pattern(rng, depth - 1)})"
    if r < 0.7:
        quantifier = rng.choice(["*", "+", "?", "*?", "{2}", "{0,3}", "{1,}", "??", "{,2}"])
        return f"(?:{_random_pattern(rng, depth - 1)}){quantifier}"
    if r < 0.76:
        return f"(?={_random_pattern(rng, depth - 1)})"
    if r < 0.82:
        return f"(?!{_random_pattern(rng, depth - 1)})"
    if r < 0.86:
        return "(?<=" + rng.choice(["a", "b.", r"\d", "[ab]", "ab|ba"]) + ")"
    if r < 0.9:
        return "(?<!" + rng.choice(["a", r"\.", "x"]) + ")"
    return _random_pattern(rng, depth - 1) + rng.choice(["*", "+", "?"])


def _agree(pattern: str, subjects) -> None:
    expected = re.compile(pattern)
    bounded = compile_bounded(pattern, where="test")
    for s in subjects:
        for mode in ("match", "fullmatch", "search"):
            want = getattr(expected, mode)(s) is not None
            assert getattr(bounded, mode)(s) == want, f"{mode}({pattern!r}, {s!r}): re says {want}"


@pytest.mark.parametrize("pattern", REAL)
def test_real_patterns_answer_as_re_does(pattern):
    _agree(pattern, NAMES)


def test_generated_patterns_answer_as_re_does():
    """Flags, Unicode case folding (ß, K, İ, ſ), anchors at newlines, lookarounds, nullable repeats: 1,500
    patterns x 12 subjects x 3 questions."""
    rng = random.Random(20)
    alphabet = "ab.x1 \nAKkßs_İiſ"
    checked = 0
    while checked < 1_500:
        pattern = rng.choice(["", "(?i)", "(?s)", "(?m)", "(?a)", "(?x)"]) + _random_pattern(rng, 4)
        try:
            re.compile(pattern)
            compile_bounded(pattern, where="test")
        except (re.error, ConfigError):
            continue
        subjects = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(12)]
        _agree(pattern, subjects)
        checked += 1


@pytest.mark.parametrize("pattern", [r"(.|.)*Z", r"(a+)+b", r"(a|aa)*c", r"(.*)*x", r".*.*.*.*.*.*.*.*.*.*.*.*Z"])
def test_catastrophic_patterns_answer_at_once(pattern):
    subject = "a" * 40 + "." * 40
    short = subject[:14]  # short enough for re to answer too
    _agree(pattern, [short])
    bounded = compile_bounded(pattern, where="test")
    with deadline(10, f"matching {pattern!r}"):
        assert [bounded.match(subject), bounded.fullmatch(subject), bounded.search(subject)] == [False] * 3
    assert bounded.work < 10_000  # automaton steps, not a time: linear in the pattern and the name


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"(a)\1", "backreference"),
        (r"(?P<x>a)(?P=x)", "backreference"),
        (r"(a)?(?(1)b|c)", "conditional"),
        (r"(?>a+)b", "atomic group"),
        (r"a++b", "possessive repeat"),
        ("a" * 1_001, "1,001 characters"),
        ("(" * 101 + ")" * 101, "nests groups more than 100 deep"),
        (r"(?:a{100}){100}", "more than 2,000 automaton states"),
    ],
)
def test_what_cannot_be_matched_in_bounded_time_is_one_error_naming_the_entry(pattern, why):
    with pytest.raises(ConfigError, match=re.escape(why)) as e:
        compile_bounded(pattern, where="config.json: quantization_config.exclude[3]")
    message = str(e.value)
    assert message.startswith("config.json: quantization_config.exclude[3]: regular expression") and "\n" not in message


def test_invalid_patterns_raise_re_error_as_re_compile_does():
    with pytest.raises(re.error, match="missing \\), unterminated subpattern"):
        compile_bounded("model.layers.(", where="test")


def test_a_pattern_that_keeps_building_states_stops_at_its_work_budget(monkeypatch):
    """A pattern whose DFA has 2^13 states, fed names that visit new ones, runs out of its budget (lowered here)."""
    monkeypatch.setattr(bounded_re, "MAX_WORK", 20_000)
    monkeypatch.setattr(bounded_re, "_CACHE", {})
    bounded = compile_bounded(r"(?:a|b)*a(?:a|b){12}", where="recipe r.toml: names pattern")
    rng = random.Random(1)
    with pytest.raises(ConfigError, match="recipe r.toml: names pattern: .* more than 20,000 automaton steps"):
        for _ in range(10_000):
            bounded.fullmatch("".join(rng.choice("ab") for _ in range(30)))


def test_too_many_patterns_in_one_list_is_one_error():
    bounded_re.check_pattern_count(bounded_re.MAX_PATTERNS, "x")
    with pytest.raises(ConfigError, match="x: 257 regular expressions, more than the 256"):
        bounded_re.check_pattern_count(257, "x")


def test_a_compiled_pattern_travels_to_worker_processes():
    """Recipes are pickled to quantize's workers; the one-character patterns inside have no source to pickle."""
    import pickle

    pattern = r"model\.layers\.\d+\.mlp\.experts\..*"
    copy = pickle.loads(pickle.dumps(compile_bounded(pattern, where="recipe r.toml: names pattern")))
    assert copy.pattern == pattern and copy.fullmatch("model.layers.3.mlp.experts.1.up_proj")
