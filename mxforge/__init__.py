"""mxforge: bf16 MoE checkpoints to MXFP4 checkpoints that load in sglang and vLLM, MTP intact."""

__version__ = "0.1.0"
