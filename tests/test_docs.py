"""The docs stay true: the README fits on a screen, every link and repository path they name resolves, the reference
page is what the manifests generate, and every command option and exit code is documented."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SCREEN = 50  # lines a newcomer sees without scrolling
README_MAX_LINES = 200
# Pages (and the element-format package) that other branches add: a link or path to one is checked once it exists.
PENDING_PATHS = {"docs/install.md"}  # named by a page before it lands
TOP_LEVEL = ("docs", "fixups", "manifests", "mxforge", "quantize", "scripts", "tests", "validation")
LINK_RE = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
PATH_RE = re.compile(r"(?<![\w./~$-])((?:" + "|".join(TOP_LEVEL) + r")/[\w.*/<>{}-]*)")
MODULE_RE = re.compile(r"`(mxforge(?:\.\w+)+)`")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose(text: str) -> str:
    """The text without fenced code blocks (their lines are output and commands, not links or headings)."""
    return re.sub(r"(?ms)^```.*?^```", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_readme_fits_and_leads_with_install_quickstart_and_the_command():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; details belong in docs/"
    first_screen = lines[:SCREEN]
    assert "## Install" in first_screen, "the Install section must start on the first screen"
    assert "## Quickstart" in first_screen, "the Quickstart must start on the first screen"
    assert any(line.startswith("bash scripts/quickstart.sh") for line in first_screen)
    assert any(line.startswith("mxforge run ") for line in first_screen), "the main command, on the first screen"
    assert "docs/install.md" in "\n".join(first_screen)


def test_every_link_resolves_to_a_file_and_heading():
    broken = []
    for page in pages():
        for target in LINK_RE.findall(prose(page.read_text())):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path_part, _, fragment = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            name = rel(dest) if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if name not in PENDING_PATHS:
                    broken.append(f"{rel(page)}: {target} (no such file)")
                continue
            if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{rel(page)}: {target} (no heading #{fragment} in {name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_repository_path_the_docs_name_exists():
    missing = []
    for page in pages():
        for raw in PATH_RE.findall(page.read_text()):
            path = raw.rstrip(".,;:")
            if "<" in path or "{" in path or path in PENDING_PATHS:
                continue  # a placeholder (`manifests/engines/<engine>-<version>.toml`) or a page still to come
            found = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
            if not found:
                missing.append(f"{rel(page)}: {path}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_every_python_name_the_docs_give_exists():
    missing = []
    for page in pages():
        for dotted in set(MODULE_RE.findall(page.read_text())):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                try:
                    for attr in parts[cut:]:
                        obj = getattr(obj, attr)
                except AttributeError:
                    missing.append(f"{rel(page)}: {dotted}")
                break
            else:
                missing.append(f"{rel(page)}: {dotted}")
    assert not missing, "names the docs give that do not exist:\n" + "\n".join(sorted(missing))


def test_reference_page_is_what_the_manifests_generate():
    gen = load_script("gen_reference")
    assert (DOCS / "reference.md").read_text() == gen.render(), (
        "docs/reference.md is stale: run .venv/bin/python scripts/gen_reference.py"
    )


def test_reference_page_covers_every_registry_entry():
    from mxforge.models import FAMILIES
    from mxforge.quantize.fp8_source import FP8_SCHEMES
    from mxforge.quantize.recipe import SCHEMES
    from mxforge.quantize.scale_rules import SCALE_RULES
    from mxforge.validation.profiles import profile_names

    text = load_script("gen_reference").render()
    recipes = [p.stem for p in (ROOT / "manifests" / "recipes").glob("*.toml")]
    names = [*profile_names(), *(f.name for f in FAMILIES), *recipes, *SCALE_RULES, *FP8_SCHEMES, *SCHEMES]
    assert recipes and all(f"`{n}`" in text for n in names), [n for n in names if f"`{n}`" not in text]
    for family in FAMILIES:
        for arch in family.architectures:
            assert f"`{arch}`" in text


def test_reference_page_follows_a_manifest_change(monkeypatch):
    """The page is rendered from the profiles, not written by hand: a changed summary changes the page."""
    gen = load_script("gen_reference")
    from mxforge.validation import profiles

    real = profiles.load_profile
    import dataclasses

    def edited(name, family):
        p = real(name, family)
        return dataclasses.replace(p, summary="EDITED SUMMARY") if name == "vllm-0.30.0" else p

    monkeypatch.setattr(gen, "load_profile", edited)
    assert "EDITED SUMMARY" in gen.render()


def usage_sections() -> dict[str, str]:
    """usage.md's section per command: from its `## `mxforge CMD`` heading to the next `## ` heading."""
    text = (DOCS / "usage.md").read_text()
    sections: dict[str, str] = {}
    for m in re.finditer(r"(?m)^## `mxforge (\w+)`\n(.*?)(?=^## |\Z)", text, re.S):
        sections[m.group(1)] = m.group(2)
    return sections


def test_usage_documents_every_command_and_option():
    from mxforge.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    sections = usage_sections()
    undocumented = []
    for name, command in sub.choices.items():
        if name not in sections:
            undocumented.append(f"mxforge {name}: no `## \\`mxforge {name}\\`` section in docs/usage.md")
            continue
        for action in command._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help" and f"`{option}" not in sections[name]:
                    undocumented.append(f"mxforge {name} {option}")
    assert not undocumented, "undocumented in docs/usage.md:\n" + "\n".join(undocumented)


def test_usage_states_every_exit_code():
    from mxforge.cli.support import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEMS

    text = (DOCS / "usage.md").read_text()
    for code in (EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR, EXIT_INTERRUPTED):
        assert f"**{code}**" in text, f"exit code {code} is not explained in docs/usage.md"


@pytest.mark.parametrize(
    "pattern",
    [r"\bthe lead\b", r"\bhelper [A-Z]\b", r"\bthis stop\b", r"\bthis task\b", r"\bsession notes?\b", r"\blent\b"],
)
def test_docs_speak_about_the_product_not_how_it_is_made(pattern):
    hits = [
        f"{rel(p)}:{i}: {line.strip()}"
        for p in pages()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(pattern, line, re.I)
    ]
    assert not hits, "\n".join(hits)
