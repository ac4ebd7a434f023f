"""An independent reference of the EMA LM: plain PyTorch over a whole sequence, no engine, no
cache, one loop over time per layer. Greedy decoding reruns the full sequence for every token.

Glossary: L sequence length, H hidden size, C EMA channels, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class EmaReference:
    """The model of a checkpoint directory, float32, computed sequence at a time."""

    def __init__(self, path: str, config: object) -> None:
        self.w = load_file(f"{path}/model.safetensors")
        self.c = config

    def _mixer(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """`x (L, H)` -> `(L, H)`, stepping through time."""
        u, z = (x @ self.w[f"{p}.in_proj.weight"].T).chunk(2, dim=-1)  # (L, C) each
        a = torch.sigmoid(self.w[f"{p}.decay"])  # (C,)
        w1, w2 = self.w[f"{p}.lag_weight"]  # (C,) each
        h = torch.zeros_like(u[0])
        prev1, prev2 = torch.zeros_like(u[0]), torch.zeros_like(u[0])
        rows = []
        for t in range(u.shape[0]):
            h = a * h + (1 - a) * u[t]
            rows.append(h + w1 * prev1 + w2 * prev2)
            prev1, prev2 = u[t], prev1
        m = torch.stack(rows)  # (L, C)
        return (m * F.silu(z)) @ self.w[f"{p}.out_proj.weight"].T

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits `(V,)` of the token after `ids`."""
        w, eps = self.w, self.c.rms_norm_eps
        h = w["model.embed_tokens.weight"][ids]  # (L, H)
        for i in range(self.c.num_hidden_layers):
            p = f"model.layers.{i}"
            h = h + self._mixer(f"{p}.mixer", _rms(h, w[f"{p}.input_layernorm.weight"], eps))
            y = _rms(h, w[f"{p}.post_attention_layernorm.weight"], eps)
            gate, up = y @ w[f"{p}.mlp.gate_proj.weight"].T, y @ w[f"{p}.mlp.up_proj.weight"].T
            h = h + (F.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T
        last = _rms(h[-1], w["model.norm.weight"], eps)  # (H,)
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])  # (V, H)
        return head @ last

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """`max_tokens` greedy tokens after `prompt`."""
        ids = list(prompt)
        for _ in range(max_tokens):
            ids.append(int(self.logits(ids).argmax()))
        return ids[len(prompt) :]
