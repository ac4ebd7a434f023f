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

Two types change their frequencies with the sequence's length (transformers'
`dynamic_rope_update`, applied once per forward call at `max(position_ids) + 1`); each is a
`LengthScaling` beside the frequencies the table holds:

- `dynamic` (NTK): up to `M = max_position_embeddings` tokens the plain frequencies; a sequence
  of `S` tokens beyond it uses the base `b * (factor * S / M - (factor - 1)) ** (R / (R - 2))`.
  (transformers 5.24 measures from `max_position_embeddings`, not from an
  `original_max_position_embeddings` the config may also carry.)
- `longrope` (Phi-3): `1 / (short_factor_i * b ** (2i / R))` up to
  `original_max_position_embeddings` tokens, `long_factor` beyond; both with the attention factor
  `sqrt(1 + ln(factor) / ln(original))` (`factor` defaults to `max_position_embeddings /
  original`) unless `attention_factor` is given.

Which length a token's rotation uses is the rotary layer's business (`rotary_embedding.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

STATIC_TYPES = ("default", "linear", "llama3", "yarn")
LENGTH_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class LengthScaling:
    """Frequencies for sequences longer than `threshold` tokens: `dynamic`'s NTK base per
    length (`ntk_factor`, `base`) or `longrope`'s one long set (`long_inv_freq`)."""

    threshold: int
    rot_dim: int
    base: float = 0.0
    ntk_factor: float = 0.0
    long_inv_freq: torch.Tensor | None = None

    def frequencies(self, lengths: torch.Tensor) -> torch.Tensor:
        """`(N, R/2)` float32 inverse frequencies of sequences of `lengths (N,)` tokens (each
        longer than `threshold`), in transformers' float32 order of operations."""
        if self.long_inv_freq is not None:
            long = self.long_inv_freq.to(lengths.device)
            return long.expand(lengths.shape[0], -1)
        dim, factor = self.rot_dim, self.ntk_factor
        scaled = factor * lengths.long() / self.threshold - (factor - 1)  # (N,) float32
        base = self.base * scaled ** (dim / (dim - 2))  # (N,)
        exponents = _exponents(dim).to(lengths.device)  # (R/2,)
        return 1.0 / base[:, None] ** exponents


@dataclass(frozen=True)
class RopeFrequencies:
    """A RoPE's inverse frequencies `(R/2,)` float32 and the factor on its cos / sin; with
    `by_length`, those are the frequencies up to its threshold only."""

    inv_freq: torch.Tensor
    attention_factor: float = 1.0
    by_length: LengthScaling | None = None


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one dict (transformers 5's `rope_parameters`, or the
    older `rope_theta` + `rope_scaling`), with `rope_type` set (`mrope` read as `default`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    # Qwen2-VL's older configs name M-RoPE a type; transformers reads it as plain RoPE (the
    # sections only split the frequencies between position rows, equal for text).
    params["rope_type"] = "default" if rope_type == "mrope" else rope_type
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


def mla_softmax_scale(config: Any, qk_head_dim: int) -> float:
    """DeepSeek's MLA softmax scale: `qk_head_dim ** -0.5`, times `mscale(factor,
    mscale_all_dim) ** 2` under a scaled RoPE that names `mscale_all_dim` (transformers'
    `yarn_apply_mscale`)."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(config)
    mscale_all = params.get("mscale_all_dim")
    if params.get("rope_type", "default") != "default" and mscale_all:
        scale *= _yarn_mscale(float(params["factor"]), float(mscale_all)) ** 2
    return scale


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


def _dynamic(params: dict[str, Any], base: float, rot_dim: int, config: Any) -> RopeFrequencies:
    factor = float(_required(params, "factor"))
    length = int(config.max_position_embeddings)
    # At `max_position_embeddings` tokens the NTK base is `base` itself (as transformers'
    # initial frequencies compute it, in Python floats).
    start = base * ((factor * length / length) - (factor - 1)) ** (rot_dim / (rot_dim - 2))
    rule = LengthScaling(length, rot_dim, base=base, ntk_factor=factor)
    return RopeFrequencies(_plain(start, rot_dim), by_length=rule)


def _factor_list(params: dict[str, Any], key: str, rot_dim: int) -> torch.Tensor:
    values = _required(params, key)
    if not isinstance(values, (list, tuple)) or len(values) != rot_dim // 2:
        raise ValueError(
            f"rope_parameters.{key} must list {rot_dim // 2} numbers (one per rotated pair), "
            f"got {values!r}"
        )
    return torch.tensor([float(v) for v in values], dtype=torch.float32, device="cpu")


def _longrope(params: dict[str, Any], base: float, rot_dim: int, config: Any) -> RopeFrequencies:
    old_len = _original_length(params, config)
    factor = params.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / old_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None and factor <= 1:
        attention_factor = 1.0
    elif attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(old_len))
    powers = base ** _exponents(rot_dim)  # (R/2,)
    short = 1.0 / (_factor_list(params, "short_factor", rot_dim) * powers)
    long = 1.0 / (_factor_list(params, "long_factor", rot_dim) * powers)
    rule = LengthScaling(old_len, rot_dim, long_inv_freq=long)
    return RopeFrequencies(short, float(attention_factor), by_length=rule)


def rope_frequencies(config: Any, rot_dim: int) -> RopeFrequencies:
    """The inverse frequencies and attention factor of `config`'s RoPE over `rot_dim` dims.

    Raises:
        ValueError: an unknown `rope_type`, or a scaled type missing a parameter (or with
            factor lists of the wrong length); each names the field.
    """
    params = rope_parameters(config)
    rope_type, base = params["rope_type"], float(params["rope_theta"])
    if rope_type not in STATIC_TYPES + LENGTH_TYPES:
        raise ValueError(
            f"rope_parameters.rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(STATIC_TYPES + LENGTH_TYPES)})"
        )
    if rope_type == "yarn":
        return _yarn(params, base, rot_dim, config)
    if rope_type == "dynamic":
        return _dynamic(params, base, rot_dim, config)
    if rope_type == "longrope":
        return _longrope(params, base, rot_dim, config)
    inv_freq = _plain(base, rot_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / float(_required(params, "factor"))
    elif rope_type == "llama3":
        inv_freq = _llama3(params, inv_freq, config)
    return RopeFrequencies(inv_freq)
