"""The README's main job: the whole mxforge pipeline on the embedded default, end to end.

1. builds the tiny GLM-5.2-shaped bf16 fixture (every layer kind plus the MTP layer);
2. serves it as the Hub repo `mxforge-demo/glm-5.2-tiny` from the loopback Hub (tests/support/loopback_hub.py)
   on 127.0.0.1, the same server the tests use;
3. runs the real `mxforge run mxforge-demo/glm-5.2-tiny OUT --push mxforge-demo/glm-5.2-tiny-mxfp4`:
   download (verified), quantize, fixup, validate for every engine profile, push (model card, remote hashes);
4. lists what the Hub now holds.

`--local` skips the Hub: `mxforge run` reads the fixture directory and stops after validate.
Everything lands under OUT (default out/demo); HF_HOME points inside it, so nothing touches your Hub cache.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# The loopback Hub and the Quark-style writer are test code (tests/support/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from loopback_hub import LoopbackHub  # noqa: E402

from mxforge.models.fixture import write_fixture  # noqa: E402

SOURCE_REPO = "mxforge-demo/glm-5.2-tiny"
TARGET_REPO = "mxforge-demo/glm-5.2-tiny-mxfp4"
DEMO_TOKEN = "hf_mxforgeDemoLoopbackToken"


def mxforge(*args: str, env: dict | None = None) -> int:
    print(f"\n$ mxforge {shlex.join(args)}", flush=True)
    return subprocess.call([sys.executable, "-m", "mxforge.cli", *args], env={**os.environ, **(env or {})})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/demo", help="working directory (replaced; default out/demo)")
    p.add_argument("--local", action="store_true", help="no loopback Hub: run from the local fixture, no push")
    args = p.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    source_dir = out / "fixture" / SOURCE_REPO
    print(f"building the tiny GLM-5.2 fixture in {source_dir}", flush=True)
    write_fixture(source_dir, "tiny", seed=0, quiet=True)
    run_dir = out / "run"
    if args.local:
        return mxforge("run", str(source_dir), str(run_dir), "--quiet")

    hub = LoopbackHub(out / "hub", tokens={DEMO_TOKEN: "mxforge-demo"})
    hub.add_repo_from_dir(SOURCE_REPO, source_dir)
    endpoint = hub.start()
    print(f"loopback Hub at {endpoint} serving {SOURCE_REPO}", flush=True)
    env = hub.client_env(out / "hf_home", DEMO_TOKEN)
    try:
        rc = mxforge("run", SOURCE_REPO, str(run_dir), "--push", TARGET_REPO, "--quiet", env=env)
        if rc == 0:
            from huggingface_hub import HfApi

            files = HfApi(endpoint=endpoint, token=DEMO_TOKEN).list_repo_files(TARGET_REPO)
            print(f"\n{TARGET_REPO} on the loopback Hub now holds {len(files)} files: {', '.join(sorted(files))}")
            print(f"model card: {run_dir / 'mxfp4' / 'README.md'}")
        return rc
    finally:
        hub.stop()
        # The run's summary printed the pushed repo's URL: say that it does not answer any more.
        print(
            f"\nthe loopback Hub at {endpoint} lived only for this demo and has stopped, so the URLs above no longer "
            f"answer; what was pushed is the checkpoint in {run_dir / 'mxfp4'}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
