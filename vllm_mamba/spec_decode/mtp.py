"""The multi-token prediction head, for speculative method `mtp`: it lives with the models
(`vllm_mamba.models.mtp`), whose checkpoints hold it; re-exported here under its old path."""

from vllm_mamba.models.mtp import MTP_PREFIX, MultiTokenPredictor, SupportsMTP, mtp_num_layers

__all__ = ["MTP_PREFIX", "MultiTokenPredictor", "SupportsMTP", "mtp_num_layers"]
