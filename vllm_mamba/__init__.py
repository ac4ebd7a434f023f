"""vllm_mamba: a vLLM-style inference engine for state-space models."""
