"""What the hybrid families' GGUF mappings share: metadata reading and tensor renaming.

- `Metadata`: one architecture's `<arch>.*` keys read with clear errors; floats come back as
  the shortest decimal that float32 rounds to the stored value (GGUF keeps `1e-6` as the
  float32 `9.99999997e-07`; the config gets `1e-6` back).
- `common_config`: the fields every llama.cpp text model writes the same way (sizes, heads,
  epsilon, vocabulary, token ids, tied head, RoPE).
- `Renamer`: GGUF names to Hugging Face names through two tables (global tensors, and per
  block `blk.N.<suffix>` -> `<layers prefix>.N.<suffix>`), for the tensors taken as they are.
- Helpers for the converter's transforms: experts stacked into `(E, ...)` tensors, norms
  written as `1 + w`, `A_log` written as `-exp(A_log)`, row permutations.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.gguf.metadata import TENSOR_NAMES, TENSOR_SHAPES, decimal
from vllm_mamba.layers.packed_weights import attach_packed, packed_of, rows_of
from vllm_mamba.ops.grouped_linear import GroupedWeight, pack_nibbles

__all__ = [
    "LLAMA_GLOBALS",
    "conv_filter",
    "stacked_experts",
    "Metadata",
    "Pairs",
    "Renamer",
    "a_log_from_a",
    "common_config",
    "mamba2_tensor",
    "minus_one",
    "per_layer",
    "permute_columns",
    "register_family",
    "rope_qk_tensor",
    "split_block",
    "tensor_names",
    "unpermute_rope",
    "unstack_experts",
]


_MISSING = object()
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


class Metadata:
    """One GGUF architecture's metadata (`<arch>.<key>`), read with errors naming the key."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.raw, self.arch = metadata, arch

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.raw

    def get(self, key: str, default: Any = _MISSING) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.raw:
            return self.raw[full]
        if default is _MISSING:
            raise ValueError(f"GGUF metadata {full} is missing (needed for {self.arch})")
        return default

    def int(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, default)
        if isinstance(value, (list, tuple)):
            raise ValueError(f"GGUF metadata {self.arch}.{key} is a per-layer list: {value}")
        return int(value)

    def float(self, key: str, default: Any = _MISSING) -> float:
        return decimal(self.get(key, default))


def per_layer(value: Any, n: int, key: str) -> list:
    """A GGUF value that is either one number for all layers or a list of `n`."""
    if isinstance(value, (list, tuple)):
        if len(value) < n:
            raise ValueError(f"GGUF metadata {key} has {len(value)} entries for {n} layers")
        return list(value[:n])
    return [value] * n


def _tied(metadata: dict[str, Any]) -> bool:
    return "output.weight" not in tensor_names(metadata)


def _rope_parameters(m: Metadata, partial: float | None) -> dict[str, Any]:
    """transformers' `rope_parameters` from `<arch>.rope.*` (default, linear or YaRN)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": m.float("rope.freq_base")}
    kind = m.get("rope.scaling.type", "none")
    if kind == "linear":
        params.update(rope_type="linear", factor=m.float("rope.scaling.factor"))
    elif kind == "yarn":
        params.update(
            rope_type="yarn",
            factor=m.float("rope.scaling.factor"),
            original_max_position_embeddings=m.int("rope.scaling.original_context_length"),
        )
        for key, name in (
            ("rope.scaling.yarn_ext_factor", "extrapolation_factor"),
            ("rope.scaling.yarn_attn_factor", "attention_factor"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            if m.has(key):
                params[name] = m.float(key)
    elif kind != "none":
        raise ValueError(f"GGUF metadata {m.arch}.rope.scaling.type {kind!r} is not supported")
    if partial is not None:
        params["partial_rotary_factor"] = partial
    return params


def common_config(
    metadata: dict[str, Any],
    m: Metadata,
    *,
    eps_key: str = "attention.layer_norm_rms_epsilon",
    eps_name: str = "rms_norm_eps",
    rope: bool = True,
    partial: float | None = None,
) -> dict[str, Any]:
    """The fields every llama.cpp text model writes alike (see the module docstring)."""
    embedding = metadata.get(TENSOR_SHAPES, {}).get("token_embd.weight")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if embedding is None and tokens is None:
        raise ValueError("GGUF metadata tokenizer.ggml.tokens is missing (the vocabulary size)")
    config: dict[str, Any] = {
        # the embedding's rows (the tokenizer may hold fewer: llama.cpp does not pad it)
        "vocab_size": int(embedding[0]) if embedding is not None else len(tokens),
        "hidden_size": m.int("embedding_length"),
        "num_hidden_layers": m.int("block_count") - m.int("nextn_predict_layers", 0),
        eps_name: m.float(eps_key),
        "tie_word_embeddings": _tied(metadata),
    }
    if m.has("context_length"):
        config["max_position_embeddings"] = m.int("context_length")
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):  # fmt: skip
        if f"tokenizer.ggml.{key}" in metadata:
            config[name] = int(metadata[f"tokenizer.ggml.{key}"])
    if rope:
        config["rope_parameters"] = _rope_parameters(m, partial)
    return config


def split_block(name: str) -> tuple[int | None, str]:
    """`blk.3.ssm_a` -> (3, "ssm_a"); a global tensor's name -> (None, name)."""
    match = _BLOCK.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else (None, name)


class Renamer:
    """GGUF -> Hugging Face names for the tensors a family keeps as they are."""

    def __init__(self, arch: str, globals_: dict[str, str], block: dict[str, str],
                 prefix: str = "model.layers") -> None:  # fmt: skip
        self.arch, self.globals, self.block, self.prefix = arch, globals_, block, prefix

    def __call__(self, name: str) -> str:
        bid, suffix = split_block(name)
        if bid is None and name in self.globals:
            return self.globals[name]
        if bid is not None and suffix in self.block:
            return f"{self.prefix}.{bid}.{self.block[suffix]}"
        raise ValueError(f"GGUF tensor {name!r} is not known for architecture {self.arch}")


def minus_one(tensor: torch.Tensor) -> torch.Tensor:
    """A norm weight the converter wrote as `1 + w` (zero-centred norms): `w`, in float32.

    `(1 + w) - 1` is exact in float32, so the model's `1 + w` is the stored value again.
    """
    return tensor.float() - 1.0


def a_log_from_a(tensor: torch.Tensor) -> torch.Tensor:
    """`A_log` from the `A = -exp(A_log)` the converter wrote (float32 rounding apart)."""
    return torch.log(-tensor.float())


def unstack_experts(
    tensor: torch.Tensor, template: str, name: str, count: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(E, N, K)` stacked experts -> `template.format(e)` with each `(N, K)` (float values).

    Raises:
        ValueError: not 3-D, or not `count` experts.
    """
    if tensor.dim() != 3 or (count is not None and tensor.shape[0] != count):
        raise ValueError(
            f"GGUF tensor {name!r}: expected stacked experts ({count}, N, K), got "
            f"{tuple(tensor.shape)}"
        )
    for e in range(tensor.shape[0]):
        yield template.format(e), tensor[e].contiguous()


def permute_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor[index]` (a row permutation), keeping an attached integer layout."""
    return rows_of(tensor, index)


class Pairs:
    """Tensors the converter split in two (or more), held until a block's parts are all read.

    Keyed by the config's id and the block; each entry holds the config itself, so the id
    stays that config's while parts wait (the engine's `expand_weight` holds pieces alike).
    """

    def __init__(self) -> None:
        self._held: dict[tuple[int, int, str], tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}

    def add(
        self, config: dict[str, Any], bid: int, group: str, part: str, tensor: torch.Tensor,
        parts: tuple[str, ...],
    ) -> dict[str, torch.Tensor] | None:  # fmt: skip
        """Holds `part` of `group` in block `bid`; all of `parts` once complete, else None."""
        key = (id(config), bid, group)
        held = self._held.setdefault(key, (config, {}))[1]
        held[part] = tensor
        if set(held) != set(parts):
            return None
        del self._held[key]
        return held


def unpermute_rope(tensor: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's `LlamaModel.permute` of q / k rows (each head's two rotary halves
    interleaved) over `n_head` heads: a row permutation (an integer layout is kept)."""
    rows = tensor.shape[0]
    forward = torch.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2)
    return rows_of(tensor, torch.argsort(forward.reshape(-1)))


def tensor_names(metadata: dict[str, Any]) -> list[str]:
    """The file's tensor names (`GGUFFormat`'s `TENSOR_NAMES`)."""
    names = metadata.get(TENSOR_NAMES)
    if names is None:
        raise ValueError(f"GGUF metadata {TENSOR_NAMES} (the file's tensor names) is missing")
    return sorted(names)


_MAMBA2 = {
    "ssm_a": "A_log",
    "ssm_d": "D",
    "ssm_conv1d.weight": "conv1d.weight",
    "ssm_conv1d.bias": "conv1d.bias",
    "ssm_dt.bias": "dt_bias",
    "ssm_in.weight": "in_proj.weight",
    "ssm_in.bias": "in_proj.bias",
    "ssm_norm.weight": "norm.weight",
    "ssm_out.weight": "out_proj.weight",
    "ssm_out.bias": "out_proj.bias",
}


def mamba2_tensor(
    suffix: str, tensor: torch.Tensor, prefix: str
) -> tuple[str, torch.Tensor] | None:
    """A Mamba2 mixer tensor as llama.cpp's `Mamba2Model` wrote it, back under `prefix`
    (`model.layers.3.mamba.`): `A` `(H, 1)` -> `A_log (H,)`, `D (H, 1)` -> `(H,)`, the conv
    `(C, K)` -> `(C, 1, K)`, the gated norm `(G, D / G)` -> `(D,)`; None if not one."""
    name = _MAMBA2.get(suffix)
    if name is None:
        return None
    if suffix == "ssm_a":
        tensor = a_log_from_a(tensor).reshape(-1)
    elif suffix in ("ssm_d", "ssm_norm.weight"):
        tensor = tensor.reshape(-1)
    elif suffix == "ssm_conv1d.weight":
        tensor = tensor.reshape(tensor.shape[0], 1, tensor.shape[1])
    return prefix + name, tensor


_QK = ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")


def rope_qk_tensor(
    suffix: str, tensor: torch.Tensor, config: dict[str, Any], prefix: str
) -> tuple[str, torch.Tensor] | None:
    """An attention q / k tensor that llama.cpp's `LlamaModel` permuted, back as
    `<prefix>{q,k}_proj.{weight,bias}` (`unpermute_rope` over the config's heads); None if the
    tensor is not one."""
    if suffix not in _QK:
        return None
    q = suffix.startswith("attn_q")
    heads = config["num_attention_heads" if q else "num_key_value_heads"]
    return f"{prefix}{'q' if q else 'k'}_proj.{suffix.rsplit('.', 1)[1]}", unpermute_rope(
        tensor, heads
    )


def register_family(archs: tuple[str, ...], config_fn: Any, tensors_fn: Any) -> None:
    """Registers each of `archs` with `config_fn(metadata, arch)` and
    `tensors_fn(arch, name, tensor, config)`."""
    from vllm_mamba.gguf.arch import GGUFArchitecture, register_gguf_architecture

    for arch in archs:
        register_gguf_architecture(
            GGUFArchitecture(
                arch,
                lambda metadata, arch=arch: config_fn(metadata, arch),
                lambda name, tensor, config, arch=arch: tensors_fn(arch, name, tensor, config),
            )
        )


# The global tensors every llama.cpp text model names alike (the final norm differs).
LLAMA_GLOBALS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
}


def stacked_experts(
    name: str, tensor: torch.Tensor, table: dict[str, str], moe: str, count: int
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """`blk.N.<stacked>` -> `model.layers.N.<moe>.experts.E.<table[stacked]>.weight` for each
    expert (float values), if the tensor's suffix is in `table`; else None."""
    bid, suffix = split_block(name)
    if suffix not in table:
        return None
    template = f"model.layers.{bid}.{moe}.experts.{{}}.{table[suffix]}.weight"
    return unstack_experts(tensor, template, name, count)


def conv_filter(tensor: torch.Tensor) -> torch.Tensor:
    """A depthwise conv filter the converter squeezed to `(C, K)`, back as `(C, 1, K)`."""
    return tensor.reshape(tensor.shape[0], 1, tensor.shape[-1])


def permute_columns(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor[:, index]` (a column permutation, `index (K,)`), keeping an attached integer
    layout when the permutation moves whole groups of columns (as head-by-head reorders do
    for heads a multiple of the group wide); else a plain float tensor."""
    out = tensor[:, index].contiguous()
    layout = packed_of(tensor)
    if layout is None:
        return out
    k, g = layout.shape[1], layout.group
    blocks = index.reshape(k // g, g)
    starts = blocks[:, 0]
    if not (
        torch.equal(blocks, starts[:, None] + torch.arange(g)) and bool((starts % g == 0).all())
    ):
        return out
    groups = starts // g
    codes = layout.code_values()[:, index]
    codes = pack_nibbles(codes) if layout.bits == 4 else codes.to(layout.codes.dtype)
    offsets = None if layout.offsets is None else layout.offsets[:, groups].contiguous()
    permuted = GroupedWeight(
        codes.contiguous(), layout.scales[:, groups].contiguous(), offsets, layout.bits, g
    )
    return attach_packed(out, permuted)
