"""Tiny RWKV-7 checkpoints in BlinkDL's `.pth` layout and fla-hub's Hugging Face layout, and
the `rwkv` package (an independent RWKV-7 in pure PyTorch) as their reference.

`rwkv7_state_dict` draws a BlinkDL state dict from a tiny config (fla's field names): weights
around the scales the released models have (decays spread over the channels, mixes in [0, 1],
`k_a` near 1), so greedy generations vary. `save_rwkv7` writes it either as the `.pth` file
the `rwkv` package reads, or converted to the fla-hub layout (`config.json` with
`model_type: rwkv7`, `model.safetensors`), each beside the GPT-NeoX tokenizer.

`RwkvPackageRunner` runs the `.pth` file through `rwkv.model.RWKV` (RWKV-7, the CPU path, no
JIT, float32): a prompt as one `forward` over its tokens, then one token per call, as the
package's own pipeline does.
"""

from __future__ import annotations

import json
import os

import torch

V7_ENV = {"RWKV_V7_ON": "1", "RWKV_JIT_ON": "0", "RWKV_CUDA_ON": "0"}


def rwkv7_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A BlinkDL RWKV-7 state dict for `config` (hidden_size, num_hidden_layers, head_dim,
    the four LoRA ranks, intermediate_size, vocab_size)."""
    g = torch.Generator().manual_seed(seed)
    C, L, N = config["hidden_size"], config["num_hidden_layers"], config["head_dim"]
    H, F, V = C // N, config["intermediate_size"], config["vocab_size"]

    def rnd(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    def uni(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=g)

    sd = {"emb.weight": rnd(V, C, std=0.5)}
    sd["blocks.0.ln0.weight"], sd["blocks.0.ln0.bias"] = rnd(C, std=0.1, mean=1), rnd(C, std=0.1)
    for i in range(L):
        b, att, ffn = f"blocks.{i}.", f"blocks.{i}.att.", f"blocks.{i}.ffn."
        for ln in ("ln1", "ln2"):
            sd[b + ln + ".weight"], sd[b + ln + ".bias"] = rnd(C, std=0.1, mean=1), rnd(C, std=0.1)
        for mix in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[att + mix] = uni(1, 1, C)
        lora = {"w": config["decay_low_rank_dim"], "a": config["a_low_rank_dim"],
                "v": config["v_low_rank_dim"], "g": config["gate_low_rank_dim"]}  # fmt: skip
        for name, rank in lora.items():
            sd[att + f"{name}1"] = rnd(C, rank, std=C**-0.5)
            sd[att + f"{name}2"] = rnd(rank, C, std=rank**-0.5)
        sd[att + "w0"] = (torch.linspace(-4, 1, C) + rnd(C, std=0.5)).view(1, 1, C)
        sd[att + "a0"] = rnd(1, 1, C, std=0.5)
        sd[att + "v0"] = rnd(1, 1, C, std=0.5, mean=0.5)
        sd[att + "k_k"] = rnd(1, 1, C, std=0.1, mean=0.8)
        sd[att + "k_a"] = rnd(1, 1, C, std=0.1, mean=1.0)
        sd[att + "r_k"] = rnd(H, N, std=0.3)
        for proj in ("receptance", "key", "value", "output"):
            sd[att + proj + ".weight"] = rnd(C, C, std=C**-0.5)
        sd[att + "ln_x.weight"], sd[att + "ln_x.bias"] = rnd(C, std=0.1, mean=1), rnd(C, std=0.1)
        sd[ffn + "x_k"] = uni(1, 1, C)
        sd[ffn + "key.weight"] = rnd(F, C, std=C**-0.5)
        sd[ffn + "value.weight"] = rnd(C, F, std=F**-0.5)
    sd["ln_out.weight"], sd["ln_out.bias"] = rnd(C, std=0.1, mean=1), rnd(C, std=0.1)
    sd["head.weight"] = rnd(V, C, std=C**-0.5 * 3)
    return sd


def to_fla_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights under fla-hub's names and shapes (written here independently of the
    engine's loader, from fla's `RWKV7Model` module tree)."""
    out = {
        "model.embeddings.weight": sd["emb.weight"],
        "model.norm.weight": sd["ln_out.weight"],
        "model.norm.bias": sd["ln_out.bias"],
        "lm_head.weight": sd["head.weight"],
        "model.layers.0.pre_norm.weight": sd["blocks.0.ln0.weight"],
        "model.layers.0.pre_norm.bias": sd["blocks.0.ln0.bias"],
    }
    layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for i in range(layers):
        b, m = f"blocks.{i}.", f"model.layers.{i}."
        for src, dst in (("ln1", "attn_norm"), ("ln2", "ffn_norm"), ("att.ln_x", "attn.g_norm")):
            for leaf in ("weight", "bias"):
                out[f"{m}{dst}.{leaf}"] = sd[f"{b}{src}.{leaf}"]
        for mix in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            out[f"{m}attn.{mix}"] = sd[f"{b}att.{mix}"]
        out[f"{m}attn.k_k"] = sd[f"{b}att.k_k"].flatten()
        out[f"{m}attn.k_a"] = sd[f"{b}att.k_a"].flatten()
        out[f"{m}attn.r_k"] = sd[f"{b}att.r_k"]
        for src, dst in (("receptance", "r"), ("key", "k"), ("value", "v"), ("output", "o")):
            out[f"{m}attn.{dst}_proj.weight"] = sd[f"{b}att.{src}.weight"]
        for name in ("w", "a", "v", "g"):
            if name == "v" and i == 0:
                continue
            out[f"{m}attn.{name}_lora.lora.0.weight"] = sd[f"{b}att.{name}1"].t().contiguous()
            out[f"{m}attn.{name}_lora.lora.2.weight"] = sd[f"{b}att.{name}2"].t().contiguous()
            if name != "g":
                out[f"{m}attn.{name}_lora.lora.2.bias"] = sd[f"{b}att.{name}0"].flatten()
        out[f"{m}ffn.x_k"] = sd[f"{b}ffn.x_k"].flatten()
        out[f"{m}ffn.key.weight"] = sd[f"{b}ffn.key.weight"]
        out[f"{m}ffn.value.weight"] = sd[f"{b}ffn.value.weight"]
    return out


def save_rwkv7(config: dict, path: str, fmt: str, seed: int = 0) -> str:
    """Writes tiny RWKV-7 `config` into directory `path` as `pth` (BlinkDL) or `hf`
    (fla-hub), beside the GPT-NeoX tokenizer; returns `path`."""
    from safetensors.torch import save_file

    from tests.tiny_models import copy_tokenizer

    os.makedirs(path, exist_ok=True)
    sd = rwkv7_state_dict(config, seed)
    if fmt == "pth":
        torch.save(sd, os.path.join(path, "rwkv7-tiny.pth"))
    else:
        assert fmt == "hf", fmt
        save_file({k: v.contiguous() for k, v in to_fla_layout(sd).items()},
                  os.path.join(path, "model.safetensors"))  # fmt: skip
        hf = {"model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"], **config,
              "norm_eps": 1e-5, "norm_bias": True, "norm_first": True, "hidden_act": "sqrelu",
              "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
        if config["head_dim"] != 64:  # BlinkDL's group-norm epsilon is 64e-5 at every size
            hf["group_norm_eps"] = 64e-5
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf, f, indent=1)
    copy_tokenizer(path)
    return path


class RwkvPackageRunner:
    """The `rwkv` package's RWKV-7 on a `.pth` checkpoint, float32 on the CPU."""

    def __init__(self, pth_file: str) -> None:
        os.environ.update(V7_ENV)  # read when rwkv.model is first imported
        from rwkv.model import RWKV

        assert pth_file.endswith(".pth")
        self.model = RWKV(model=pth_file[: -len(".pth")], strategy="cpu fp32")

    @torch.no_grad()
    def greedy_logprobs(self, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
        """`max_tokens` greedy tokens after `prompt` and the log-softmax of each step
        `(max_tokens, V)`."""
        logits, state = self.model.forward(list(prompt), None)
        tokens, steps = [], []
        for _ in range(max_tokens):
            lp = logits.float().log_softmax(-1)
            steps.append(lp)
            tokens.append(int(lp.argmax()))
            logits, state = self.model.forward([tokens[-1]], state)
        return tokens, torch.stack(steps)
