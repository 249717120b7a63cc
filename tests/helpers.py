"""What the tests share besides fixtures (those are in conftest.py): the fixtures' constants, the test Hub's
tokens and environment, and running the `mxforge` command as a user does. Test files import from here, never
from conftest.py or from each other."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

from mxforge.models import family_named

GLM5 = family_named("glm_moe_dsa")  # the family the shared fixtures below belong to

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def load_script(name: str):
    """A module of scripts/ (they import their siblings by bare name, so scripts/ goes on the path)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MTP = 7  # the tiny fixture's num_hidden_layers: its MTP layer
# AMD's published GLM-5.2 MXFP4 exclusions (glm-5.2.md): attention, routers, lm_head, dense MLPs ...
BASE = ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj"]
AMD = BASE + [f"*layers.{MTP}.*"]  # ... and the whole MTP layer

# Release behaviours of the GLM family's engine profiles, proven against each release's own code by
# test_engine_conformance.py (the `engines` suite); the offline tests build their expectations on them.
# sglang before GLM's own draft class (0.5.16): MTP exclusions written as model.layers.N.* never reach the draft.
BEFORE_GLM_DRAFT = {"sglang-0.5.9", "sglang-0.5.10", "sglang-0.5.11", "sglang-0.5.12", "sglang-0.5.15"}
# Releases whose draft builds eh_proj as a plain nn.Linear: never quantized.
EH_PROJ_LINEAR = {"sglang-0.5.9", "sglang-0.5.10", "vllm-0.30.0", "vllm-0.31.0"}
# Releases without the "any <layer>.mlp.experts.* entry excludes the experts" rule.
NO_EXPERT_CHILD_RULE = {
    "sglang-0.5.9",
    "sglang-0.5.10",
    "sglang-0.5.11",
    "sglang-0.5.12",
    "sglang-0.5.15",
    "sglang-0.5.16",
    "sglang-0.5.18",
    "sglang-0.5.19",
}

# The loopback Hub's users (conftest.py's `hub`): alice holds TOKEN, bob OTHER_TOKEN. Neither may ever be
# written into a file, a report or an error message.
# A block-FP8 replica whose merged kept-FP8 shards are not whole 128-row tiles (vLLM's validate_fp8_block_shape), per
# family: (config overrides of the tiny preset, [(a merged module then ragged, its first shard)]). The lineage's:
# q_lora_rank 64 (fused_qkv_a_proj's q_a_proj shard) and the expert width 64 (the MTP layer's kept shared experts);
# Qwen3.5's: the shared expert's width 64 (the MTP layer's shared expert is kept FP8; its gate and up shards merge).
RAGGED_TILES = {
    "qwen3_5_moe": ({"shared_expert_intermediate_size": 64}, [(".mlp.shared_expert.gate_up_proj", "gate_proj")]),
    # its attention is bf16 in the FP8 release: the MTP layer's shared expert is the kept block-FP8 merge
    "glm5_next": ({"moe_intermediate_size": 64}, [(".shared_experts.gate_up_proj", "gate_proj")]),
}
RAGGED_TILES["qwen3_5_moe_text"] = RAGGED_TILES["qwen3_5_moe"]  # the same language model, stored text only
RAGGED_TILES_LINEAGE = (
    {"q_lora_rank": 64, "moe_intermediate_size": 64},
    [(".self_attn.fused_qkv_a_proj", "q_a_proj"), (".shared_experts.gate_up_proj", "gate_proj")],
)


# Shipped recipes whose output loads in some releases of their family only, and those releases (`--engines`): a run
# must select them, as their users must; the default run is refused, naming the others (tests/models/test_families.py
# checks that, so an entry goes stale loudly). GLM-5.3-Flash: vLLM builds every attention linear unquantized, and
# vLLM 0.30's model packs gate_up_proj from itself, so it builds the dense MLP and shared experts in the global format
# (MXFP4) or bf16 only.
RECIPE_ENGINES = {
    "glm-5.3-flash-mxfp4-attn-fp8": "sglang",
    "glm-5.3-flash-mxfp4-mtp-fp8": "sglang vllm>=0.31",
    "glm-5.3-flash-mxfp4-keep-fp8": "vllm>=0.31",
}
# The engines whose releases load FP8 kept as stored in that format (manifests/engines: formats), by the format a
# source layout keeps its weights in (Fp8Scheme.kept_as): a keep-source recipe's run selects them, as its users must
# (sglang refuses or mis-loads block FP8 in every release: the plan check says so). Absent: every engine loads it
# (compressed-tensors FP8 kept as FP8 PTPC).
KEEP_SOURCE_ENGINES = {"fp8_block": "vllm"}


def engines_for(recipe: str, kept_as: str | None = None) -> str | None:
    """The `--engines` a run of shipped `recipe` selects (None: every release): its RECIPE_ENGINES entry, else, for a
    recipe keeping an FP8 source's weights as stored in format `kept_as`, that format's KEEP_SOURCE_ENGINES."""
    return RECIPE_ENGINES.get(recipe) or (KEEP_SOURCE_ENGINES.get(kept_as) if kept_as else None)


def engines_args(recipe: str, kept_as: str | None = None) -> list[str]:
    """`engines_for` as command-line arguments: `["--engines", E]`, or none."""
    only = engines_for(recipe, kept_as)
    return ["--engines", only] if only else []


def ragged_tiles(family: str) -> tuple[dict, list[tuple[str, str]]]:
    """(overrides, [(ragged merged module suffix, its first shard)]) of `family`'s RAGGED_TILES replica."""
    return RAGGED_TILES.get(family, RAGGED_TILES_LINEAGE)


TOKEN = "hf_mxforgeTESTtokenDoNotLeak0123456789"
OTHER_TOKEN = "hf_otherUserToken9876543210"


def hub_env(hub, tmp_path: Path, token: str | None = TOKEN, **extra: str) -> dict:
    """The environment that points the mxforge command (huggingface_hub) at a loopback Hub, as `token`'s
    owner (None: anonymous), plus `extra` variables."""
    return hub.client_env(tmp_path / "hf_home", token, **extra)


def _without_root_overrides() -> None:
    """As root, give up the capabilities that ignore file permissions, so that a read-only directory is
    read-only to this process as it is to a user (a no-op for a normal user)."""
    if os.geteuid() == 0:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone for the program exec'd next
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_cli(
    *args: str, check: bool = False, env: dict | None = None, timeout: float = 600, as_user: bool = False
) -> subprocess.CompletedProcess:
    """Run the installed `mxforge` entry point (via this interpreter) as a user would.

    `as_user`: file permissions apply even when the tests run as root."""
    proc = subprocess.run(
        [sys.executable, "-m", "mxforge.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        preexec_fn=_without_root_overrides if as_user else None,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"mxforge {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def push_run_args(source: str, out: Path, repo: str, *extra: str) -> list[str]:
    """`mxforge run SOURCE OUT --push REPO --quiet` and `extra`: a run that pushes, without progress bars."""
    return ["run", source, str(out), "--push", repo, "--quiet", *extra]


def run_push(source: str, out: Path, repo: str, *extra: str, env: dict) -> subprocess.CompletedProcess:
    """`mxforge run ... --push REPO` (push_run_args) in its own process, its report on stdout (--json -)."""
    return run_cli(*push_run_args(source, out, repo, "--json", "-", *extra), env=env, timeout=600)


# What huggingface_hub reads once, at import: a Hub command runs in its own process (run_cli with hub_env).
READ_AT_IMPORT = (
    "HF_ENDPOINT",
    "HF_HOME",
    "HF_TOKEN",
    "HF_HUB_DISABLE_XET",
    "HF_HUB_ETAG_TIMEOUT",
    "HF_HUB_DOWNLOAD_TIMEOUT",
)


def cli(*args: str, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `mxforge ARGS` in this process, as the entry point does (`mxforge.cli.main.main`), without an
    interpreter start-up: its exit code and what it printed, as run_cli returns them.

    The CLI keeps no state between calls that could leak into the next one: it installs no signal or logging
    handler, never changes directory, and reads its environment at call time (`env` is set for the call only,
    as is sys.argv, which `invocation()` records). Not for: a Hub command (huggingface_hub reads HF_* once, at
    import: run_cli with hub_env), Ctrl-C (main then ends the process), limits set on the process (run_cli's
    as_user, a preexec_fn), or killing a run. Warnings go to pytest's recorder, not to `stderr`: the exit-path
    tests (tests/test_entry_point.py) check the real process's stderr line by line."""
    from mxforge.cli.main import main

    env = env or {}
    assert not set(env) & set(READ_AT_IMPORT), f"{sorted(set(env) & set(READ_AT_IMPORT))}: use run_cli"
    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in env}
    saved_argv = sys.argv
    try:
        os.environ.update(env)
        sys.argv = ["mxforge", *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse: --help, --version, a usage error
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    proc = subprocess.CompletedProcess(["mxforge", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"mxforge {' '.join(args)} exited {code}:\n{proc.stdout}\n{proc.stderr}")
    return proc


# The child's first statement: Python's own Ctrl-C handling, whatever this test process passes down. A process
# started with SIGINT ignored keeps it ignored, and Python then installs no KeyboardInterrupt handler at all (a
# shell's background jobs rely on that); a CI worker was once seen with SIGINT ignored by the time a Ctrl-C test ran,
# and its `mxforge download` sat in its wait loop, alive, 60 s after the SIGINT.
_DEFAULT_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start `mxforge` in the background (for signals and concurrent runs), with Python's default Ctrl-C handling
    (_DEFAULT_SIGINT); read it with communicate()."""
    main = "import runpy; runpy.run_module('mxforge.cli', run_name='__main__', alter_sys=True)"
    return subprocess.Popen(
        [sys.executable, "-c", f"{_DEFAULT_SIGINT}; {main}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def kill_group(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGKILL the process group `proc` leads (started with start_new_session) and wait until none of its processes
    still runs. `proc.wait()` reaps the leader only; a forked worker still dying shares the leader's flock on
    OUT/.cache/mxforge/lock until it has exited, so a rerun at that moment is rightly told OUT is in use (for
    milliseconds; seconds on a loaded machine). Zombies waiting for init hold nothing and do not count."""
    import signal
    import time

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + timeout
    while _running_in_group(proc.pid):
        assert time.monotonic() < end, f"process group {proc.pid} still runs {timeout} s after SIGKILL"
        time.sleep(0.01)


def _running_in_group(pgid: int) -> list[int]:
    """Pids of the processes of group `pgid` that are not zombies (Linux: /proc/PID/stat)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            found.append(int(entry))
    return found


def one_error_line(proc, code: int = 2) -> str:
    """The single `mxforge ...` line of a run that failed with `code` and no traceback."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mxforge ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def pushed_files(hub, repo: str) -> dict[str, bytes]:
    """The files of `repo`'s main branch on a loopback Hub, by name: what a push committed."""
    commit = hub.repos[repo].resolve("main")
    return {name: f.disk_path.read_bytes() for name, f in commit.files.items()}


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Fail the test (not hang it) when the block runs longer than `seconds` (SIGALRM: the main thread only; Python's
    `re` checks for signals while it backtracks, so a runaway regex is interrupted too)."""
    import signal

    def expired(signum, frame):
        raise AssertionError(f"{what} took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# A recipe in both MXFP6 elements (no shipped recipe writes MXFP6: neither engine serves it natively): routed and
# decoder shared experts E2M3, attention E3M2, the rest bf16. The conformance matrix's "mxfp6" style and the consumer
# test's MXFP6 output.
MXFP6_RECIPE = """
name = "mxfp6"
scheme = "mxfp4"
[[quantize]]
kinds = ["experts"]
format = "mxfp6_e2m3"
[[quantize]]
kinds = ["shared_experts"]
layers = "decoder"
format = "mxfp6_e2m3"
[[quantize]]
kinds = ["attention"]
format = "mxfp6_e3m2"
"""
