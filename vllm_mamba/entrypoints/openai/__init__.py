"""The OpenAI-compatible HTTP server (`vllm-mamba serve MODEL`)."""
