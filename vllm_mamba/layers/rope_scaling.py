"""The frequencies of a config's rotary embedding, plain or scaled (`rope_parameters`).

A RoPE table is `cos(p * f_i) * a` and `sin(p * f_i) * a` for positions `p`, the inverse
frequencies `f_i` (one per rotated pair) and an attention factor `a` that scales both. Plain RoPE
has `f_i = base ** (-2i / R)` and `a = 1`; the scaled variants change them, as transformers does:

- `linear` (position interpolation): every frequency divided by `factor`.
- `llama3` (Llama 3.1): long wavelengths (beyond `original_max_position_embeddings /
  low_freq_factor`) divided by `factor`, short ones (below `... / high_freq_factor`) kept, a smooth
  blend between.
- `yarn`: a ramp over the pairs between interpolation (divided by `factor`) and extrapolation
  (kept), bounded by `beta_fast` / `beta_slow` rotations within the original context, and
  `a = 0.1 * ln(factor) + 1` (or `mscale` / `mscale_all_dim`'s ratio, or `attention_factor`).

Types whose frequencies depend on the batch's current length in transformers (`dynamic`,
`longrope`) are refused: a continuously batched engine cannot reproduce them per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

STATIC_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeFrequencies:
    """A RoPE's inverse frequencies `(R/2,)` float32 and the factor on its cos / sin."""

    inv_freq: torch.Tensor
    attention_factor: float = 1.0


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one dict (transformers 5's `rope_parameters`, or the
    older `rope_theta` + `rope_scaling`), with `rope_type` set."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def _exponents(rot_dim: int) -> torch.Tensor:
    """`2i / R` for each rotated pair `i` (on the CPU even while a model is built on `meta`)."""
    return torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim


def _plain(base: float, rot_dim: int) -> torch.Tensor:
    return 1.0 / base ** _exponents(rot_dim)


def plain_frequencies(base: float, rot_dim: int) -> RopeFrequencies:
    """Plain RoPE over `rot_dim` dims: `f_i = base ** (-2i / R)`, no attention factor."""
    return RopeFrequencies(_plain(base, rot_dim))


def _required(params: dict[str, Any], key: str) -> Any:
    value = params.get(key)
    if value is None:
        raise ValueError(f"rope_parameters of type {params['rope_type']!r} need {key!r}")
    return value


def _original_length(params: dict[str, Any], config: Any) -> int:
    value = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if value is None:
        raise ValueError(
            f"rope_parameters of type {params['rope_type']!r} need "
            "'original_max_position_embeddings'"
        )
    return int(value)


def _llama3(params: dict[str, Any], inv_freq: torch.Tensor, config: Any) -> torch.Tensor:
    factor = float(_required(params, "factor"))
    low = float(_required(params, "low_freq_factor"))
    high = float(_required(params, "high_freq_factor"))
    old_len = _original_length(params, config)
    wavelen = 2 * math.pi / inv_freq  # (R/2,)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict[str, Any], base: float, rot_dim: int, config: Any) -> RopeFrequencies:
    old_len = _original_length(params, config)
    factor = params.get("factor") or config.max_position_embeddings / old_len
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def pair_of(rotations: float) -> float:
        """The (fractional) pair index whose wavelength fits `rotations` times in old_len."""
        return rot_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    pairs = torch.arange(rot_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** _exponents(rot_dim)
    extrapolate = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return RopeFrequencies(inv_freq, float(attention_factor))


def rope_frequencies(config: Any, rot_dim: int) -> RopeFrequencies:
    """The inverse frequencies and attention factor of `config`'s RoPE over `rot_dim` dims.

    Raises:
        ValueError: a `rope_type` whose frequencies follow the batch (`dynamic`, `longrope`) or
            that is unknown, or a scaled type missing a parameter; each names the field.
    """
    params = rope_parameters(config)
    rope_type, base = params["rope_type"], float(params["rope_theta"])
    if rope_type not in STATIC_TYPES:
        raise ValueError(
            f"rope_parameters.rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(STATIC_TYPES)})"
        )
    if rope_type == "yarn":
        return _yarn(params, base, rot_dim, config)
    inv_freq = _plain(base, rot_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / float(_required(params, "factor"))
    elif rope_type == "llama3":
        inv_freq = _llama3(params, inv_freq, config)
    return RopeFrequencies(inv_freq)
