"""A stand-in for AMD Quark's CUDA-only MXFP4 kernels, for vLLM's CPU build in tests/vllm_cpu (see mx.py)."""
