"""The original `mamba-ssm` checkpoint format (`state-spaces/mamba-130m`, `.../mamba2-130m`).

Those checkpoints have a `config.json` without `model_type`, in mamba-ssm's own terms
(`d_model`, `n_layer`, `vocab_size`, `ssm_cfg`, `rms_norm`, `residual_in_fp32`,
`pad_vocab_size_multiple`, `tie_embeddings`, ...), and a `pytorch_model.bin`. This module turns
such a config into the equivalent transformers `MambaConfig` or `Mamba2Config`, so the
checkpoint runs on the same model classes as its Hugging Face twin.

Weight names already match the Hugging Face ones except `backbone.embedding.weight`, which the
models' `remap_weight_name` maps to `backbone.embeddings.weight` (older Hugging Face checkpoints
say `embedding` too); the saved `lm_head.weight` is the tied embedding. mamba-ssm's norms use
epsilon 1e-5 (the transformers default).

`FORMAT` declares all this to the checkpoint-format registry (`vllm_mamba.models.formats`):
detected by its `config.json`, converted by `convert_mamba_ssm_config`, weights read as Hugging
Face ones, tokenizer `EleutherAI/gpt-neox-20b` (the checkpoints ship none; mamba-ssm's README
uses it).
"""

from __future__ import annotations

from typing import Any

from vllm_mamba.models.formats import CheckpointFormat

MAMBA_SSM_TOKENIZER = "EleutherAI/gpt-neox-20b"

# ssm_cfg keys that only set the initialisation or the training path.
_INIT_ONLY_KEYS = {
    "dt_min",
    "dt_max",
    "dt_init",
    "dt_scale",
    "dt_init_floor",
    "conv_init",
    "A_init_range",
    "use_fast_path",
    "use_mem_eff_path",
    "layer",
}
_MAMBA1_KEYS = {"d_state", "d_conv", "expand", "dt_rank", "conv_bias", "bias"}
_MAMBA2_KEYS = {
    "d_state",
    "d_conv",
    "expand",
    "headdim",
    "ngroups",
    "chunk_size",
    "dt_limit",
    "conv_bias",
    "bias",
    "d_ssm",
    "rmsnorm",
    "norm_before_gate",
    "D_has_hdim",
}


def is_mamba_ssm_config(raw: dict[str, Any]) -> bool:
    """True for a mamba-ssm `config.json` (no `model_type`; has `d_model` and `n_layer`)."""
    return "model_type" not in raw and "d_model" in raw and "n_layer" in raw


def _padded_vocab(raw: dict[str, Any]) -> int:
    """mamba-ssm pads the embedding rows up to a multiple of `pad_vocab_size_multiple`."""
    vocab, multiple = int(raw.get("vocab_size", 50277)), int(raw.get("pad_vocab_size_multiple", 8))
    return -(-vocab // multiple) * multiple


def _check_supported(raw: dict[str, Any], ssm_cfg: dict[str, Any], known: set[str]) -> None:
    """Raises ValueError for mamba-ssm options that change the model beyond these classes."""
    problems = []
    if not raw.get("rms_norm", True):
        problems.append("rms_norm=false (LayerNorm blocks)")
    if raw.get("attn_layer_idx"):
        problems.append("attn_layer_idx (attention layers)")
    if raw.get("d_intermediate", 0):
        problems.append("d_intermediate > 0 (MLP blocks)")
    unknown = sorted(set(ssm_cfg) - known - _INIT_ONLY_KEYS)
    if unknown:
        problems.append(f"ssm_cfg keys {unknown}")
    if not ssm_cfg.get("rmsnorm", True) or ssm_cfg.get("norm_before_gate", False):
        problems.append("a Mamba2 mixer without the gated RMSNorm (norm after gate)")
    if ssm_cfg.get("D_has_hdim", False):
        problems.append("D_has_hdim")
    if problems:
        raise ValueError(f"unsupported mamba-ssm checkpoint config: {'; '.join(problems)}")


def _common(raw: dict[str, Any]) -> dict[str, Any]:
    """The config fields both Mamba generations share."""
    return dict(
        hidden_size=int(raw["d_model"]),
        num_hidden_layers=int(raw["n_layer"]),
        vocab_size=_padded_vocab(raw),
        residual_in_fp32=bool(raw.get("residual_in_fp32", True)),
        tie_word_embeddings=bool(raw.get("tie_embeddings", True)),
        layer_norm_epsilon=1e-5,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def _mamba1_config(raw: dict[str, Any], ssm: dict[str, Any]) -> Any:
    from transformers import MambaConfig

    return MambaConfig(
        **_common(raw),
        state_size=int(ssm.get("d_state", 16)),
        conv_kernel=int(ssm.get("d_conv", 4)),
        expand=int(ssm.get("expand", 2)),
        time_step_rank=ssm.get("dt_rank", "auto"),
        use_conv_bias=bool(ssm.get("conv_bias", True)),
        use_bias=bool(ssm.get("bias", False)),
        architectures=["MambaForCausalLM"],
    )


def _mamba2_config(raw: dict[str, Any], ssm: dict[str, Any]) -> Any:
    from transformers import Mamba2Config

    hidden, expand = int(raw["d_model"]), int(ssm.get("expand", 2))
    head_dim = int(ssm.get("headdim", 64))
    d_ssm = ssm.get("d_ssm")
    if d_ssm is not None and int(d_ssm) != expand * hidden:
        raise ValueError("unsupported mamba-ssm checkpoint config: d_ssm != expand * d_model")
    if (expand * hidden) % head_dim:
        raise ValueError(
            f"mamba-ssm config: expand * d_model ({expand * hidden}) is not a multiple of "
            f"headdim ({head_dim})"
        )
    return Mamba2Config(
        **_common(raw),
        expand=expand,
        num_heads=expand * hidden // head_dim,
        head_dim=head_dim,
        n_groups=int(ssm.get("ngroups", 1)),
        state_size=int(ssm.get("d_state", 128)),
        conv_kernel=int(ssm.get("d_conv", 4)),
        chunk_size=int(ssm.get("chunk_size", 256)),
        time_step_limit=tuple(float(v) for v in ssm.get("dt_limit", (0.0, float("inf")))),
        use_conv_bias=bool(ssm.get("conv_bias", True)),
        use_bias=bool(ssm.get("bias", False)),
        architectures=["Mamba2ForCausalLM"],
    )


def convert_mamba_ssm_config(raw: dict[str, Any]) -> Any:
    """The transformers config (architectures set) equivalent to a mamba-ssm `config.json`.

    Args:
        raw: the parsed `config.json`.

    Returns:
        A `MambaConfig` (`ssm_cfg.layer` absent or `Mamba1`) or a `Mamba2Config`.

    Raises:
        ValueError: the checkpoint uses options these models do not implement (LayerNorm
            blocks, attention or MLP layers, another gated-norm placement, ...).
    """
    ssm = dict(raw.get("ssm_cfg") or {})
    layer = ssm.get("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise ValueError(f"unsupported mamba-ssm layer {layer!r}: expected Mamba1 or Mamba2")
    _check_supported(raw, ssm, _MAMBA1_KEYS if layer == "Mamba1" else _MAMBA2_KEYS)
    return _mamba1_config(raw, ssm) if layer == "Mamba1" else _mamba2_config(raw, ssm)


class MambaSsmFormat(CheckpointFormat):
    """The original mamba-ssm checkpoints (see the module docstring)."""

    name = "mamba_ssm"
    description = "mamba-ssm (config.json with d_model and n_layer, no model_type)"
    default_tokenizer = MAMBA_SSM_TOKENIZER

    def detect(self, path: str, raw: dict[str, Any] | None) -> bool:
        return raw is not None and is_mamba_ssm_config(raw)

    def load_config(self, path: str, raw: dict[str, Any] | None) -> Any:
        assert raw is not None
        return convert_mamba_ssm_config(raw)


FORMAT = MambaSsmFormat()
