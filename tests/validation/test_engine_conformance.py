"""Engine truth: every claim validate makes about an engine release, checked against that release's own code.

Each supported release's wheel is fetched from PyPI (only the few .py files needed, cached under the user
cache dir) and executed in a subprocess with inert stand-ins for GPU-only imports (tests/engine_truth/).
For every checkpoint of the matrix (mxforge's recipes, Quark-style exports with exact names, globs, `re:`
entries and the whole MTP layer in bf16, each before and after `mxforge fixup`, at 6 routed experts and at
the family's real layout), mxforge's decision for every module of the target model and the MTP draft must
equal the release's. The matrix runs for every model family (mxforge/models/) in every release whose profile
builds it. Needs the package registry (as pip does); deselect offline with `-m "not engines"`.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from engine_truth import matrix, probe_io
from engine_truth.wheels import Release, available_versions

from mxforge.models import FAMILIES, family_named
from mxforge.models.fixture import preset_config
from mxforge.validation.matching import DRAFT, TARGET
from mxforge.validation.profiles import all_profiles, load_profile, release_ranges, select, unsupported_reason
from mxforge.validation.validate import validate_checkpoint

pytestmark = pytest.mark.engines

RELEASES = [(f.name, p.name, r) for f in FAMILIES for p in all_profiles(f) for r in p.read]
IDS = [f"{f}-{p.split('-')[0]}=={r}" for f, p, r in RELEASES]


@pytest.fixture(scope="session")
def family_loaded(family_cases):
    cache: dict[str, dict] = {}

    def get(family_name: str) -> dict:
        if family_name not in cache:
            cache[family_name] = {name: c.load() for name, c in family_cases(family_name).items()}
        return cache[family_name]

    return get


@pytest.fixture(scope="session")
def family_reports(family_cases):
    """validate's report on the pipeline outputs, every release range at once."""
    cache: dict[str, dict] = {}

    def get(family_name: str) -> dict:
        if family_name not in cache:
            cache[family_name] = {
                name: validate_checkpoint(c.path)
                for name, c in family_cases(family_name).items()
                if "/run-" in name or name.endswith("recipe-default/fixed")
            }
        return cache[family_name]

    return get


# The two reasons a profile gives for a sglang release that does not build a family, each a claim about the
# release's code: its registry has no model class for the family's architecture (no module's EntryClass names it), or
# ModelConfig._config_draft_model drafts its MTP layer with a class that cannot load it.
UNREGISTERED, DRAFTED_WITH = "EntryClass", "_config_draft_model"


def not_built() -> list[tuple[str, str, str, str]]:
    """(family, sglang release, the claim: UNREGISTERED or DRAFTED_WITH, the draft class of the family's first release
    that builds it) for every release read whose profile says it does not build the family for one of those reasons,
    or whose range's `first_release` comes later (the claim then that of the family's unsupported ranges, else
    DRAFTED_WITH)."""
    out = []
    for family in FAMILIES:
        built = [p for p in all_profiles(family) if p.engine == "sglang"]
        if not built:
            continue
        ranges = [r for r in release_ranges() if r.engine == "sglang"]
        reasons = {r.name: unsupported_reason(r.name, family) for r in ranges}
        stated = " ".join(why for why in reasons.values() if why)
        for r in ranges:
            why = reasons[r.name] if reasons[r.name] is not None else stated
            claim = UNREGISTERED if UNREGISTERED in why else DRAFTED_WITH if DRAFTED_WITH in why else None
            if claim is None and reasons[r.name] is None:
                claim = DRAFTED_WITH
            if claim is not None:
                out += [
                    (family.name, v, claim, built[0].draft.class_name)
                    for v in r.read
                    if not any(v in p.read for p in built)
                ]
    return out


NOT_BUILT = not_built()


def profile_of(family_name: str, engine: str, release: str):
    """The profile that reads `release` of `engine` for a family (None: no profile of the family reads it)."""
    return next((p for p in all_profiles(family_name) if p.engine == engine and release in p.read), None)


def selected(engines: str, family_name: str, profile_name: str, release: str) -> bool:
    """Whether `--engines engines` selects `release` (of profile `profile_name`) for the family."""
    return any(s.profile.name == profile_name and release in s.releases for s in select(engines, family_name))


@pytest.fixture(scope="session")
def probe_runs() -> dict[tuple[str, str], int]:
    """How many probe processes each (engine, release) has started in this session."""
    return {}


def _releases_asked(items) -> list[tuple[str, str]]:
    """The (engine, release) pairs the selected tests ask `answers` about by their parameters, in run order."""
    out: list[tuple[str, str]] = []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "answers" in getattr(item, "fixturenames", ()) and {"profile_name", "release"} <= set(params):
            key = (params["profile_name"].split("-", 1)[0], params["release"])
            if key not in out:
                out.append(key)
    return out


@pytest.fixture(scope="session")
def answers(request, family_cases, family_loaded, probe_runs):
    """The release's own answers for every case of a family. One probe process per release answers for every
    family its profiles build (each case asked as the family's profile for that release sees it). Probes run in
    two threads: while one release's answers are judged, the next selected release is already being probed
    (a probe is a process of its own: the two use both cores)."""
    futures: dict[tuple[str, str], Future] = {}
    ahead = _releases_asked(request.session.items)
    pool = ThreadPoolExecutor(2, thread_name_prefix="probe")

    def submit(engine: str, release: str) -> Future:
        if (engine, release) not in futures:
            requests = []
            for family in FAMILIES:
                profile = profile_of(family.name, engine, release)
                if profile is None:
                    continue
                loaded = family_loaded(family.name)
                for name, c in family_cases(family.name).items():
                    requests.append({**matrix.request(profile, c, loaded[name]), "name": f"{family.name}:{name}"})
            for family_name in sorted({f for f, v, _, _ in NOT_BUILT if (engine, v) == ("sglang", release)}):
                config = preset_config("tiny", family=family_named(family_name))[0]
                requests.append({"name": f"{family_name}:draft-class", "config": config, probe_io.DRAFT_CLASS_ONLY: 1})
            probe_runs[engine, release] = probe_runs.get((engine, release), 0) + 1
            futures[engine, release] = pool.submit(probe_io.run_probe, engine, release, requests)
        return futures[engine, release]

    def get(family_name: str, profile_name: str, release: str) -> dict:
        key = (load_profile(profile_name, family_name).engine, release)
        future = submit(*key)
        if key in ahead:  # the next release a selected test asks about: probed while this one is judged
            later = [k for k in ahead[ahead.index(key) + 1 :] if k not in futures]
            if later:
                submit(*later[0])
        found = future.result()
        return {name.split(":", 1)[1]: a for name, a in found.items() if name.split(":", 1)[0] == family_name}

    get.submit = submit  # type: ignore[attr-defined]  # every answer of a release, whichever families it builds
    yield get
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize(
    "family_name,release,claim,built_with", NOT_BUILT, ids=[f"{f}-sglang=={r}" for f, r, _, _ in NOT_BUILT]
)
def test_a_release_that_does_not_build_a_family_has_no_class_for_it_or_drafts_it_otherwise(
    family_name, release, claim, built_with, answers
):
    """Where a profile says a release does not build a family, the release's own code says why: its registry has no
    class for the architecture (Qwen3.5's text-only Qwen3_5MoeForCausalLM before sglang 0.5.17), or its
    ModelConfig._config_draft_model picks a class other than the one the family's first building release drafts with
    (GLM-4.7-Flash before 0.5.13: GLM-4.5's GQA Glm4MoeForCausalLMNextN; DeepSeek-V3.2 before 0.5.12: the whole
    model)."""
    found = answers.submit("sglang", release).result()[f"{family_name}:draft-class"]
    assert "error" not in found, found["error"]
    if claim == UNREGISTERED:
        assert found["registered"] is False, found
    else:
        assert found["registered"] and found["draft"]["class"] != built_with, found


def test_one_probe_process_answers_every_family_of_a_release(answers, probe_runs):
    """The newest sglang and vLLM releases build every family: each is asked once, for all of them."""
    for engine, release in (("sglang", "0.5.23"), ("vllm", "0.33.0")):
        families = [f.name for f in FAMILIES if profile_of(f.name, engine, release)]
        assert len(families) == len(FAMILIES) > 1, families
        for family_name in families:
            assert answers(family_name, profile_of(family_name, engine, release).name, release)
        assert probe_runs[engine, release] == 1


@pytest.mark.parametrize("family_name,profile_name,release", RELEASES, ids=IDS)
def test_profile_decides_every_module_as_the_release_does(
    family_name, profile_name, release, family_cases, family_loaded, answers
):
    profile, found = load_profile(profile_name, family_name), answers(family_name, profile_name, release)
    cases, loaded = family_cases(family_name), family_loaded(family_name)
    wrong = {name: matrix.mismatches(profile, loaded[name], found[name]) for name in cases}
    wrong = {name: m for name, m in wrong.items() if m}
    assert not wrong, "\n".join(f"{name}: {len(m)} mismatch(es): " + "; ".join(m[:4]) for name, m in wrong.items())


@pytest.mark.parametrize("family_name,profile_name,release", RELEASES, ids=IDS)
def test_pipeline_output_loads_in_the_release(
    family_name, profile_name, release, family_cases, family_loaded, answers, family_reports
):
    """`mxforge run` output (and its full-layout counterpart) loads per the release's own decisions: every module
    it builds, served with the flags validate names, finds its tensors stored as it allocates them."""
    profile, loaded = load_profile(profile_name, family_name), family_loaded(family_name)
    cases = family_cases(family_name)
    for name, report in family_reports(family_name).items():
        if cases[name].engines is not None and not selected(cases[name].engines, family_name, profile_name, release):
            continue  # made for other releases (a keep-fp8 recipe's run: vLLM); its refusal here is the plan check's
        ckpt, found = loaded[name], answers(family_name, profile_name, release)[name]
        assert report.engine_ok(profile_name), report.format()
        flag = profile.fusion.server_flag in report.flags(profile_name)  # served with fusion off
        view, stand_in = matrix.views(profile, ckpt)[-1 if flag else 0], matrix.stand_ins(ckpt.layout)
        for role in (TARGET, DRAFT):
            fused = found[role]["fused_shared_experts"] and not flag
            for m in view.modules:
                if m.role != role or not matrix.compared(m, stand_in, ckpt.layout.MTP_PROJ):
                    continue
                if fused and ".shared_experts." in m.runtime:
                    continue  # loaded into the bank: checked with the experts below
                engine_form = probe_io.allocated(found[role]["decisions"][m.runtime])
                stored = {ckpt.stored[lin.name].form for lin in m.shards}
                if m.is_experts and fused:
                    shared = [
                        lin
                        for local, lin in ckpt.linears[int(m.checkpoint.split(".")[2])].others.items()
                        if local.startswith("mlp.shared_experts.")
                    ]
                    stored |= {ckpt.stored[lin.name].form for lin in shared}
                assert stored == {engine_form}, f"{name}: {release} builds {m.runtime} {engine_form}, stored {stored}"
        eh = found[DRAFT]["eh_proj"]["decision"]
        proj = ckpt.layout.module_name(ckpt.layout.mtp_layers[0], ckpt.layout.MTP_PROJ)
        eh_stored = {s.form for lin_name, s in ckpt.stored.items() if lin_name == proj}
        assert eh_stored == {eh}, f"{name}: {release} builds eh_proj {eh}, stored {eh_stored}"


def wrong_mapper(family_name: str) -> tuple[tuple[str, str], ...]:
    """A draft name mapper for the releases that have none: DeepSeek-V3's MTP layer, model.layers.61, renamed as
    sglang's draft names it; for a family whose real layout ends before layer 61 (GLM-4.7-Flash: 47 layers), its own
    MTP layer."""
    family = family_named(family_name)
    layout = family.layout_of(preset_config("full-layout", family=family)[0])
    mtp = layout.num_hidden_layers
    if family.layers.decoder != "model.layers.{layer}":  # stored under other names (GLM-5.3-Flash's): its own
        return ((layout.layer_prefix(mtp)[:-1], "model.decoder"),)
    return ((f"model.layers.{min(61, mtp)}", "model.decoder"),)


PERTURBATIONS = {
    "fused names honoured": lambda p: dataclasses.replace(p, fused_name_first=not p.fused_name_first),
    "expert child entries": lambda p: dataclasses.replace(p, expert_child_entries=not p.expert_child_entries),
    "packed modules": lambda p: dataclasses.replace(p, packed=frozenset(p.fused) - p.packed or frozenset()),
    "draft remap": lambda p: dataclasses.replace(
        p, draft=dataclasses.replace(p.draft, remap_mtp_entries=not p.draft.remap_mtp_entries)
    ),
    "whole-draft switch": lambda p: dataclasses.replace(
        p, draft=dataclasses.replace(p.draft, whole_draft_switch=not p.draft.whole_draft_switch)
    ),
    "eh_proj quantizable": lambda p: dataclasses.replace(
        p, draft=dataclasses.replace(p.draft, eh_proj_quantizable=not p.draft.eh_proj_quantizable)
    ),
    "draft fusion": lambda p: dataclasses.replace(p, fusion=dataclasses.replace(p.fusion, draft=not p.fusion.draft)),
    "fusion veto": lambda p: dataclasses.replace(
        p, fusion=dataclasses.replace(p.fusion, veto="none" if p.fusion.veto != "none" else "shared-expert-entry")
    ),
    "expert allow-list": lambda p: dataclasses.replace(
        p, fusion=dataclasses.replace(p.fusion, n_routed_experts=(6, 256))
    ),
    "exclude source": lambda p: dataclasses.replace(
        p,
        exclude_source="raw" if p.exclude_source == "mapped" else "mapped",
        draft=dataclasses.replace(p.draft, name_mapper=wrong_mapper(p.family)),
    ),
    "name mapper": lambda p: dataclasses.replace(
        p,
        draft=dataclasses.replace(p.draft, name_mapper=() if p.draft.name_mapper else wrong_mapper(p.family)),
    ),
    "weights-only MXFP4": lambda p: dataclasses.replace(p, formats_needing_inputs=p.formats_needing_inputs ^ {"mxfp4"}),
    "per-expert layer configs": lambda p: dataclasses.replace(p, expert_layer_configs=not p.expert_layer_configs),
    "layer configs mapped": lambda p: dataclasses.replace(
        p,
        layer_configs_mapped=not p.layer_configs_mapped,
        draft=dataclasses.replace(p.draft, name_mapper=p.draft.name_mapper or wrong_mapper(p.family)),
    ),
    "FP8 PTPC loads": lambda p: dataclasses.replace(
        p, formats=p.formats ^ {"fp8_ptpc"}, formats_needing_inputs=p.formats_needing_inputs - {"fp8_ptpc"}
    ),
    "FP8 PTPC needs inputs": lambda p: dataclasses.replace(
        p, formats_needing_inputs=p.formats_needing_inputs ^ {"fp8_ptpc"}
    ),
    "MXFP6 loads": lambda p: dataclasses.replace(
        p,
        formats=p.formats ^ {"mxfp6_e2m3", "mxfp6_e3m2"},
        formats_emulated=frozenset(),
        linear_formats_emulated_without_inputs=frozenset(),
    ),
    "MXFP6 emulated": lambda p: dataclasses.replace(
        p,
        formats=p.formats | {"mxfp6_e2m3", "mxfp6_e3m2"},
        formats_emulated=p.formats_emulated ^ {"mxfp6_e2m3", "mxfp6_e3m2"},
    ),
    "weights-only MXFP4 linears emulated": lambda p: dataclasses.replace(
        p, linear_formats_emulated_without_inputs=p.linear_formats_emulated_without_inputs ^ {"mxfp4"}
    ),
    "block-entry switch": lambda p: dataclasses.replace(
        p,
        draft=dataclasses.replace(
            p.draft, block_entry_switch={"none": "any", "any": "experts", "experts": "none"}[p.draft.block_entry_switch]
        ),
    ),
    "runtime prefixes": lambda p: dataclasses.replace(
        p, runtime_prefixes=() if p.runtime_prefixes else (("model.", "model.language_model."),)
    ),
    "fusion compares layer configs": lambda p: dataclasses.replace(
        p,
        fusion=dataclasses.replace(
            p.fusion,
            layer_config_bases=() if p.fusion.layer_config_bases else ("model.layers.0", "model.decoder"),
        ),
    ),
}


# One release of each behaviour a perturbation flips.
PINNING_RELEASES = [
    ("sglang-0.5.9", "0.5.9"),
    ("sglang-0.5.10", "0.5.10"),
    ("sglang-0.5.12", "0.5.14"),
    ("sglang-0.5.15", "0.5.15.post1"),
    ("sglang-0.5.16", "0.5.16"),
    ("sglang-0.5.18", "0.5.18"),
    ("sglang-0.5.21", "0.5.21"),
    ("sglang-0.5.22", "0.5.23"),
    ("vllm-0.30.0", "0.30.0"),
    ("vllm-0.31.0", "0.33.0"),
]


# The fields that describe how a release fuses the shared expert: they say something only for a family some release
# fuses (GLM-4.7-Flash's never does on AMD: its gate wants CUDA; "draft fusion" still pins that it does not).
FUSION_DETAIL = ("fusion veto", "expert allow-list", "fusion compares layer configs")


# The fields that describe how a release renames the lineage's MTP layer (`model.layers.N`) for its draft, and how it
# reads the layer configs of a mixed recipe: they say something only for a family stored under the lineage's names,
# and (the FP8 ones) with a mixed-precision recipe among its own.
LINEAGE_DETAIL = ("draft remap", "exclude source", "name mapper", "layer configs mapped")
MIXED_DETAIL = ("FP8 PTPC loads", "FP8 PTPC needs inputs", "layer configs mapped")
# ... and those that say something only for a family whose MTP block has its own prefix (Qwen3.5's `mtp.`)
BLOCK_DETAIL = ("block-entry switch", "runtime prefixes")


def _pinned(family) -> list[str]:
    fuses = any(p.fusion.target or p.fusion.draft for p in all_profiles(family))
    block = bool(family.layers.mtp_block)
    mixed = len(matrix.bf16_recipes(family)) > 2
    return [
        w
        for w in PERTURBATIONS
        if (fuses or w not in FUSION_DETAIL)
        and (not block or w not in LINEAGE_DETAIL)
        and (block or w not in BLOCK_DETAIL)
        and (mixed or w not in MIXED_DETAIL)
    ]


@pytest.mark.parametrize("family_name,what", [(f.name, w) for f in FAMILIES for w in _pinned(f)])
def test_a_profile_edited_wrong_fails_conformance(what, family_name, family_cases, family_loaded, answers):
    """Each field of a profile is pinned by the matrix: flipping it makes some release disagree (the first
    disagreement found is enough; judging every case of every release for each of 52 edits took 400 s)."""
    cases, loaded = family_cases(family_name), family_loaded(family_name)
    builds = {(p.name, r) for p in all_profiles(family_name) for r in p.read}

    def disagreements():
        for profile_name, release in PINNING_RELEASES:
            if (profile_name, release) not in builds:
                continue
            wrong = PERTURBATIONS[what](load_profile(profile_name, family_name))
            found = answers(family_name, profile_name, release)
            yield from ((release, name) for name in cases if matrix.mismatches(wrong, loaded[name], found[name]))

    assert next(disagreements(), None), f"editing '{what}' went unnoticed by every case"


# Releases on either side of the change in sglang 0.5.18 (the draft's fusion gate no longer reads the target's refusal).
REFUSAL_RELEASES = [
    ("sglang-0.5.12", "0.5.14"),
    ("sglang-0.5.15", "0.5.15"),
    ("sglang-0.5.16", "0.5.17"),
    ("sglang-0.5.18", "0.5.18"),
    ("sglang-0.5.19", "0.5.20"),
    ("sglang-0.5.22", "0.5.22"),
]


@pytest.mark.parametrize("profile_name,release", REFUSAL_RELEASES, ids=[r for _, r in REFUSAL_RELEASES])
def test_whether_the_target_refusal_reaches_the_draft_is_pinned(
    profile_name, release, family_cases, family_loaded, answers
):
    """DeepSeek-V3.2's target never fuses its shared expert while its draft's own gate would, so its draft tells
    whether a target's refusal reaches the draft: flipping `fusion.target_refusal_reaches_draft` makes the release
    disagree, where it does (before 0.5.18) and where it does not. (In the other families the target fuses whenever
    the draft could, so they cannot tell.)"""
    family_name = "deepseek_v32"
    cases, loaded = family_cases(family_name), family_loaded(family_name)
    profile = load_profile(profile_name, family_name)
    flipped = not profile.fusion.target_refusal_reaches_draft
    wrong = dataclasses.replace(
        profile, fusion=dataclasses.replace(profile.fusion, target_refusal_reaches_draft=flipped)
    )
    found = answers(family_name, profile_name, release)
    caught = [name for name in cases if matrix.mismatches(wrong, loaded[name], found[name])]
    assert caught, f"{release}: target_refusal_reaches_draft = {flipped} went unnoticed by every case"


@pytest.mark.parametrize("family_name,profile_name,release", RELEASES, ids=IDS)
def test_anchors_and_serving_flags_exist_in_the_release(family_name, profile_name, release):
    """What is read, not executed, must still be in the release's source: a vanished anchor fails loudly."""
    profile = load_profile(profile_name, family_name)
    rel = Release(profile.engine, release)
    for anchor in profile.anchors:
        module = anchor.file[:-3].replace("/", ".")
        text = rel.source(module)
        assert text is not None, f"{release}: {anchor.file} is gone ({anchor.rule})"
        assert anchor.contains in text, (
            f"{release}: {anchor.file} no longer contains {anchor.contains!r} ({anchor.rule})"
        )
    sources = "\n".join(rel.source(m) or "" for m in rel.modules_under(profile.serve_source))
    flags = [w for w in profile.serve_command.split() if w.startswith("--")] + [profile.fusion.server_flag]
    for flag in flags:  # a command-line flag, or an environment variable NAME=VALUE
        name = flag.split("=", 1)[0]
        assert name in sources or name.lstrip("-").replace("-", "_") in sources, f"{release}: no server argument {flag}"


@pytest.mark.parametrize("engine", sorted({r.engine for r in release_ranges()}))
def test_every_release_in_the_supported_span_is_read(engine):
    """No gap: every release on PyPI from the first to the newest read is covered by a profile that read it."""
    read = [r for p in release_ranges() if p.engine == engine for r in p.read]
    span = available_versions(engine, read[0], read[-1])
    assert span == read, f"{engine}: releases on PyPI not read by any profile: {sorted(set(span) - set(read))}"
