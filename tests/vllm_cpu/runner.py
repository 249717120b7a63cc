"""Run one checkpoint in vLLM's CPU build and report what it computed; executed by a vllm-cpu environment's Python
(tests/vllm_cpu/environment.py), never imported by the test process.

    python runner.py JOBS.json OUT.json

JOBS is a list of jobs, run one after another in this process (vLLM's import, seconds, is paid once); OUT the list
of their results. A job: {"model": dir, "speculative": bool, "prompts": [[token ids]], "passes": [...],
"stop_after_load": bool, "language_model_only": bool (a multimodal model built without its vision tower),
"no_torchvision": bool (read by the test, which puts stand-in 8 on this process's PYTHONPATH)}.
With stop_after_load (for a model whose attention cannot run here: DeepSeek sparse attention, whose backend the
stand-in picks) the run stops once target and draft are built and loaded, before the KV cache is set up: its OUT
then has "quantized" and no passes. Otherwise the engine is built once
(in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0) with the stand-ins of standins/vllm_cpu_standins.py, then each
pass runs in order:
- {"kind": "logprobs", "name": N}: teacher-forced logprobs of every prompt token under the target (vLLM's
  prompt_logprobs) and, with the MTP draft on, under the draft as served: the draft's hidden states for the prompt
  are captured from its forward (the drafter's model's forward, wrapped; its input ids are checked to be the prompt
  shifted by one), and the draft's own compute_logits gives position i's logprob of token i + 2.
- {"kind": "generate", "name": N, "max_tokens": T}: greedy output tokens with the top-2 logprobs of each step.
- {"kind": "perturb", "seed": S, "params": {"target": {name: R}, "draft": {...}}}: Gaussian noise of R x each
  tensor's RMS (per expert for 3-D expert weights) added to the named parameters, and with "inputs": {"target":
  {module: R}, ...} noise of R x each row's RMS added to those modules' inputs at every call (a forward pre-hook);
  {"kind": "restore"} undoes both.
- {"kind": "env", "set": {NAME: VALUE}}: environment for the passes after it (the stand-ins read
  MXFORGE_STANDIN_MISDECODE at each call).
OUT: {"load_error": null or the error's last lines, "quantized": {"target": {parameter: "mxfp4" | "fp8"},
"draft": {...}} (the weights vLLM allocated as uint8 or float8), "passes": {name: result}}. A load that raises is
reported, not re-raised: where vLLM refuses a checkpoint is what the broken-variant tests compare with validate.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "standins"), str(HERE.parent)]  # the Quark kernel stand-in; tests/ocp_mx.py
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: the stand-ins and the hooks reach the engine
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

CAPTURED: list = []


class StopAfterLoad(Exception):
    """Raised where the worker would size its KV cache: target and draft are built and their weights loaded."""


def _models(worker) -> dict:
    runner = worker.model_runner
    models = {"target": runner.model}
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and getattr(drafter, "model", None) is not None:
        models["draft"] = drafter.model
    return models


def _quantized(worker) -> dict:
    """{role: {parameter: "mxfp4" | "fp8"}} for the weights vLLM allocated in a quantized dtype."""
    import torch

    kinds = {torch.uint8: "mxfp4", torch.float8_e4m3fn: "fp8"}
    return {
        role: {n: kinds[p.dtype] for n, p in m.named_parameters() if p.dtype in kinds and n.endswith("weight")}
        for role, m in _models(worker).items()
    }


def _hook(worker) -> None:
    """Record each draft forward's input ids and output. The instance's forward is wrapped rather than a forward
    hook registered: vLLM's @support_torch_compile models (DeepSeekMTP) replace __call__, which skips hooks."""
    model = _models(worker).get("draft")
    if model is None:
        return
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        CAPTURED.append((kwargs["input_ids"] if "input_ids" in kwargs else args[0], out))
        return out

    model.forward = recording


def _draft_logprobs(worker, prompt: list[int]) -> list[float]:
    import torch

    model = _models(worker)["draft"]
    ids, hidden = CAPTURED[0]
    hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    n = len(prompt)
    if ids is None or ids[: n - 1].tolist() != prompt[1:]:
        raise RuntimeError("the draft's first forward was not the prompt shifted by one; cannot align its logprobs")
    with torch.no_grad():
        logits = model.compute_logits(hidden[: n - 2]).float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(n - 2), torch.tensor(prompt[2:])].tolist()


HOOKS: list = []


def _input_noise(rel_rms: float, gen):
    """A forward pre-hook adding Gaussian noise of rel_rms x each row's RMS to a module's first input."""
    import torch

    def hook(module, args):
        if not args or not torch.is_tensor(args[0]) or not args[0].is_floating_point():
            return None
        x = args[0].float()
        rms = x.pow(2).mean(dim=-1, keepdim=True).sqrt()
        noisy = x + torch.randn(x.shape, generator=gen) * rms * rel_rms
        return (noisy.to(args[0].dtype), *args[1:])

    return hook


def _perturb(worker, pass_: dict, saved: dict) -> None:
    import torch

    gen = torch.Generator().manual_seed(pass_["seed"])
    for role, model in _models(worker).items():
        params = dict(model.named_parameters())
        for name, rel_rms in sorted(pass_.get("inputs", {}).get(role, {}).items()):
            HOOKS.append(model.get_submodule(name).register_forward_pre_hook(_input_noise(rel_rms, gen)))
        for name, rel_rms in sorted(pass_["params"].get(role, {}).items()):
            p = params[name]
            saved.setdefault((role, name), p.data.clone())
            base = saved[(role, name)].float()
            dims = tuple(range(1, base.dim())) if base.dim() == 3 else tuple(range(base.dim()))
            rms = base.pow(2).mean(dim=dims, keepdim=True).sqrt()
            noise = torch.randn(base.shape, generator=gen) * rms * rel_rms
            p.data.copy_((base + noise).to(p.dtype))


def _restore(worker, saved: dict) -> None:
    """Undo _perturb: the input-noise hooks removed, the saved parameters copied back."""
    while HOOKS:
        HOOKS.pop().remove()
    for (role, name), data in saved.items():
        dict(_models(worker)[role].named_parameters())[name].data.copy_(data)
    saved.clear()


def _caused_by_stop(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, StopAfterLoad):
            return True
        e = e.__cause__ or e.__context__
    return False


def run_job(job: dict) -> dict:
    """One checkpoint: build the engine, run the passes (see the module doc); OUT."""
    from vllm import LLM
    from vllm.v1.worker.cpu_worker import CPUWorker

    result: dict = {"load_error": None, "quantized": {}, "passes": {}}

    def stop(worker):
        result["quantized"] = _quantized(worker)
        raise StopAfterLoad

    CPUWorker.determine_available_memory = stop if job.get("stop_after_load") else DETERMINE_MEMORY[0]
    os.environ.pop("MXFORGE_STANDIN_MISDECODE", None)
    spec = {"method": "mtp", "num_speculative_tokens": 1} if job["speculative"] else None
    try:
        llm = LLM(
            job["model"],
            enforce_eager=True,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=job.get("max_model_len", 256),
            max_num_seqs=max(1, len(job["prompts"])),
            max_num_batched_tokens=1024,
            kv_cache_memory_bytes=128 << 20,
            speculative_config=spec,
            seed=0,
            enable_prefix_caching=False,  # passes repeat the prompts: each must be computed again, not read back
            # a multimodal model: its language model alone (no vision tower, no image processor to build)
            **({"language_model_only": True} if job.get("language_model_only") else {}),
        )
    except Exception as e:  # where vLLM refuses the checkpoint: reported for the test to compare
        if not _caused_by_stop(e):
            result["load_error"] = "".join(traceback.format_exception(e)[-6:])[-3000:]
        return result
    try:
        _passes(llm, job, result)
    finally:
        del llm
    return result


def _passes(llm, job: dict, result: dict) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    result["quantized"] = llm.collective_rpc(_quantized)[0]
    if job["speculative"]:
        llm.collective_rpc(_hook)
    prompts = job["prompts"]
    saved: dict = {}
    for p in job["passes"]:
        kind = p["kind"]
        if kind == "env":
            os.environ.update(p["set"])
        elif kind == "perturb":
            llm.collective_rpc(_perturb, args=(p, saved))
        elif kind == "restore":
            llm.collective_rpc(_restore, args=(saved,))
        elif kind == "logprobs":
            target, draft = [], []
            for ids in prompts:  # one at a time: the draft capture is then this prompt's alone
                CAPTURED.clear()
                [out] = llm.generate(
                    [TokensPrompt(prompt_token_ids=ids)],
                    SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False),
                    use_tqdm=False,
                )
                target.append([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
                if job["speculative"]:
                    draft.append(llm.collective_rpc(_draft_logprobs, args=(ids,))[0])
            result["passes"][p["name"]] = {"target": target, "draft": draft or None}
        elif kind == "generate":
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                SamplingParams(max_tokens=p["max_tokens"], temperature=0, logprobs=2, detokenize=False),
                use_tqdm=False,
            )
            result["passes"][p["name"]] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "top2": [
                    [
                        [x.logprob for x in sorted(step.values(), key=lambda x: -x.logprob)[:2]]
                        for step in o.outputs[0].logprobs
                    ]
                    for o in outs
                ],
            }
        else:
            raise ValueError(f"unknown pass kind {kind!r}")


DETERMINE_MEMORY: list = []


def main(jobs_path: str, out_path: str) -> None:
    """Run every job of JOBS (a list) in this process, one engine after another; OUT is the list of their OUTs."""
    import gc

    import vllm_cpu_standins

    vllm_cpu_standins.install()
    vllm_cpu_standins.install_sparse_attention()  # only a sparse-attention model's layers ever ask for it
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.v1.worker.cpu_worker import CPUWorker

    DETERMINE_MEMORY.append(CPUWorker.determine_available_memory)
    outs = []
    for job in json.loads(Path(jobs_path).read_text()):
        outs.append(run_job(job))
        gc.collect()
        cleanup_dist_env_and_memory()
    tmp = Path(f"{out_path}.partial")
    tmp.write_text(json.dumps(outs))
    tmp.replace(out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
