"""BlinkDL's RWKV `.pth` checkpoints (`RWKV-x070-World-0.4B-v2.9-20250107-ctx4096.pth`): one
`torch.save`d dict of tensors, no `config.json`, under the `rwkv` package's names.

A model directory holding one `.pth` file and no `config.json` is read as such a release: the
config is derived from the tensors' shapes (as the `rwkv` package does) into the equivalent
Hugging Face config (`Rwkv7Config`, fla's field names), and the tensors are renamed and
reshaped into the fla-hub layout as they load (`convert_rwkv7_pth_weight`), so both formats run
on one model class. The tokenizer is the RWKV World vocabulary file next to the checkpoint.

RWKV-7 names (`blocks.N.` prefix; C hidden size, R a LoRA rank):

    emb.weight -> model.embeddings.weight          ln_out -> model.norm   head -> lm_head
    ln0 -> layers.0.pre_norm   ln1 -> attn_norm    ln2 -> ffn_norm
    att.x_{r,w,k,v,a,g} (1,1,C) -> attn.x_*         ffn.x_k (1,1,C) -> ffn.x_k (C,)
    att.k_k, att.k_a (1,1,C) -> attn.k_k, k_a (C,)  att.r_k (H,N) -> attn.r_k
    att.{w,a,v}0 (1,1,C) -> attn.{w,a,v}_lora.lora.2.bias (C,)
    att.{w,a,v,g}1 (C,R) -> attn.*_lora.lora.0.weight (R,C)      (transposed)
    att.{w,a,v,g}2 (R,C) -> attn.*_lora.lora.2.weight (C,R)      (transposed)
    att.{receptance,key,value,output} -> attn.{r,k,v,o}_proj       att.ln_x -> attn.g_norm
    ffn.key, ffn.value -> ffn.key, ffn.value

Layer 0's `v0`, `v1`, `v2` (present, unused: layer 0's value is `v_first` itself) are dropped.
The group norm's epsilon is BlinkDL's `64e-5` for every head size.

`FORMAT` declares all this to the checkpoint-format registry (`vllm_mamba.models.formats`), so
neither the loader nor the model class knows the format.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from vllm_mamba.models.formats import CheckpointFormat

__all__ = [
    "FORMAT",
    "GROUP_NORM_EPS",
    "RwkvPthFormat",
    "find_pth_checkpoint",
    "load_pth",
    "pth_config",
    "convert_rwkv7_pth_weight",
]

GROUP_NORM_EPS = 64e-5  # BlinkDL's ln_x epsilon: (1e-5) * head_size_divisor ** 2 with divisor 8
_BLOCK = re.compile(r"^blocks\.(\d+)\.(att|ffn|ln0|ln1|ln2)\.?(.*)$")
_PROJ = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"}
_LORA = re.compile(r"^([wavg])([012])$")
_LN = {"ln0": "pre_norm", "ln1": "attn_norm", "ln2": "ffn_norm"}


def find_pth_checkpoint(path: str) -> str | None:
    """The one `.pth` file of a directory without `config.json`, else None.

    Raises:
        ValueError: several `.pth` files (which one is the model is not knowable).
    """
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(glob.glob(os.path.join(path, "*.pth")))
    if len(files) > 1:
        names = ", ".join(os.path.basename(f) for f in files)
        raise ValueError(
            f"model directory {path!r} holds several .pth checkpoints ({names}); keep one per "
            "directory"
        )
    return files[0] if files else None


def load_pth(file: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, memory-mapped (nothing is read until used)."""
    return torch.load(file, map_location="cpu", mmap=True, weights_only=True)


def pth_config(file: str) -> Any:
    """The Hugging Face config equivalent to a BlinkDL checkpoint, from its tensors' shapes.

    Raises:
        ValueError: not an RWKV-7 checkpoint (the message names what was found).
    """
    sd = load_pth(file)
    if "blocks.0.att.r_k" not in sd:
        kind = "RWKV-4/5/6" if "blocks.0.att.time_decay" in sd else "unknown"
        raise ValueError(
            f"{os.path.basename(file)}: not an RWKV-7 checkpoint (no blocks.0.att.r_k; looks "
            f"{kind}); BlinkDL .pth files are read for RWKV-7 only, RWKV-4 runs from its "
            "Hugging Face format (RwkvForCausalLM)"
        )
    from vllm_mamba.models.rwkv7 import Rwkv7Config

    heads, head_size = sd["blocks.0.att.r_k"].shape
    vocab, hidden = sd["emb.weight"].shape
    layers = 1 + max(int(m[1]) for k in sd if (m := _BLOCK.match(k)))
    v_rank = sd["blocks.1.att.v1"].shape[1] if layers > 1 else 16
    return Rwkv7Config(
        architectures=["RWKV7ForCausalLM"], vocab_size=int(vocab), hidden_size=int(hidden),
        num_hidden_layers=layers, head_dim=int(head_size), num_heads=int(heads),
        decay_low_rank_dim=int(sd["blocks.0.att.w1"].shape[1]),
        a_low_rank_dim=int(sd["blocks.0.att.a1"].shape[1]),
        v_low_rank_dim=int(v_rank), gate_low_rank_dim=int(sd["blocks.0.att.g1"].shape[1]),
        intermediate_size=int(sd["blocks.0.ffn.key.weight"].shape[0]),
        group_norm_eps=GROUP_NORM_EPS, tie_word_embeddings=False,
        torch_dtype=str(sd["emb.weight"].dtype).removeprefix("torch."),
    )  # fmt: skip


def convert_rwkv7_pth_weight(name: str, tensor: Any) -> list[tuple[str, Any]]:
    """One checkpoint tensor under its fla-hub name and shape (see the module docstring); a
    name already in the Hugging Face layout passes through."""
    if name == "emb.weight":
        return [("model.embeddings.weight", tensor)]
    if name == "head.weight":
        return [("lm_head.weight", tensor)]
    if name.startswith("ln_out."):
        return [("model.norm." + name.removeprefix("ln_out."), tensor)]
    m = _BLOCK.match(name)
    if m is None:
        return [(name, tensor)]
    layer, part, rest = int(m[1]), m[2], m[3]
    prefix = f"model.layers.{layer}."
    if part in _LN:
        return [(prefix + _LN[part] + "." + rest, tensor)]
    if part == "ffn":
        return [(prefix + "ffn." + rest, tensor.reshape(-1) if rest == "x_k" else tensor)]
    # the time mix
    base, _, leaf = rest.partition(".")
    if base in _PROJ:
        return [(prefix + f"attn.{_PROJ[base]}.{leaf}", tensor)]
    if base == "ln_x":
        return [(prefix + "attn.g_norm." + leaf, tensor)]
    if base in ("k_k", "k_a"):
        return [(prefix + "attn." + base, tensor.reshape(-1))]
    lora = _LORA.match(base)
    if lora is not None:
        which, index = lora[1], lora[2]
        if which == "v" and layer == 0:
            return []  # unused: layer 0's value is v_first
        target = prefix + f"attn.{which}_lora.lora."
        if index == "0":
            return [(target + "2.bias", tensor.reshape(-1))]
        return [(target + ("0" if index == "1" else "2") + ".weight", tensor.t())]
    return [(prefix + "attn." + rest, tensor)]  # x_r ... x_g (1, 1, C), r_k (H, N)


class RwkvPthFormat(CheckpointFormat):
    """BlinkDL's RWKV-7 `.pth` releases (see the module docstring)."""

    name = "rwkv7_pth"
    description = "BlinkDL RWKV-7 (one .pth file, no config.json)"

    def detect(self, path: str, raw: dict[str, Any] | None) -> bool:
        return raw is None and find_pth_checkpoint(path) is not None

    def load_config(self, path: str, raw: dict[str, Any] | None) -> Any:
        return pth_config(self._file(path))

    def weight_files(self, path: str) -> tuple[list[str], str]:
        return [self._file(path)], "pth"

    def read_file(self, file: str, kind: str, lazy: bool) -> Iterator[tuple[str, Any]]:
        yield from load_pth(file).items()

    def convert_weight(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        return convert_rwkv7_pth_weight(name, tensor)

    @staticmethod
    def _file(path: str) -> str:
        file = find_pth_checkpoint(path)
        if file is None:
            raise FileNotFoundError(f"no BlinkDL RWKV .pth checkpoint in {path!r}")
        return file


FORMAT = RwkvPthFormat()
