"""Ling 3's multi-token prediction layer (`BailingHybridForCausalLM`, `model.layers.{N}`) as
speculative method `mtp`, on the tiny Ling model with a random MTP layer
(`save_tiny_ling_with_mtp`: MLA and MoE, most drafts rejected).

transformers 5.24 only skips the layer, so the reference is written from vLLM's
`BailingMoeV3MultiTokenPredictorLayer`: `x = eh_proj(cat([enorm(embed(t + 1)), hnorm(h_t)]))`,
then the decoder layer (`x + attn(input_layernorm(x))`, `x + moe(post_attention_layernorm(x))`),
then `final_layernorm` and the target's head; the MLA and the MoE are transformers' own
`BailingHybridAttention` and `BailingHybridMoE` loaded with the layer's tensors, the
attention causal over the whole sequence at the target's positions. Greedy decoding with the
head equals decoding without it: `test_mtp_engine.py`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.family_checks import GREEDY, alone, prompts, tokens
from tests.helpers.mtp_checkpoints import LING, first_drafts, save_tiny_ling_with_mtp
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir

pytestmark = pytest.mark.xdist_group("ling")  # the family's checkpoint and lone runs


class Reference:
    """The MTP layer from the checkpoint's tensors, one whole sequence at a time."""

    def __init__(self, path: str) -> None:
        import transformers
        from transformers.models.bailing_hybrid import modeling_bailing_hybrid as hf

        config = transformers.AutoConfig.from_pretrained(path)
        config._attn_implementation = "eager"
        with open(os.path.join(path, "config.json")) as f:
            self.cfg = json.load(f)
        self.t = load_file(os.path.join(path, "model.safetensors"))
        self.p = f"model.layers.{self.cfg['num_hidden_layers']}."
        self.embed = self.t["model.word_embeddings.weight"]
        self.head = self.t["lm_head.weight"]
        self.eps = self.cfg["rms_norm_eps"]
        layer = config.num_hidden_layers - 1  # any MLA layer's index builds the same modules
        self.attn = hf.BailingHybridAttention(config, layer).eval()
        self.attn.load_state_dict(self._part("attention.", {"dense.": "o_proj."}))
        self.moe = hf.BailingHybridMoE(config).eval()
        state = self._part("mlp.", {"gate.expert_bias": "gate.e_score_correction_bias"})
        experts = self.cfg["num_experts"]
        gate_up = [
            torch.cat([state.pop(f"experts.{e}.{p}_proj.weight") for p in ("gate", "up")])
            for e in range(experts)
        ]
        state["experts.gate_up_proj"] = torch.stack(gate_up)
        state["experts.down_proj"] = torch.stack(
            [state.pop(f"experts.{e}.down_proj.weight") for e in range(experts)]
        )
        self.moe.load_state_dict(state)
        self.rotary = hf.BailingHybridRotaryEmbedding(config)

    def _part(self, prefix: str, renames: dict[str, str]) -> dict[str, torch.Tensor]:
        """The layer's tensors under `prefix`, relative to it, with `renames` applied."""
        out = {}
        for name, t in self.t.items():
            if name.startswith(self.p + prefix):
                rest = name[len(self.p + prefix) :]
                for old, new in renames.items():
                    rest = rest.replace(old, new)
                out[rest] = t
        return out

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.t[self.p + name]

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """`hidden (n, H)` and the following tokens `(n,)` of one whole sequence -> the logits
        `(n, V)`."""
        n = hidden.shape[0]
        e = self._rms(self.embed[next_ids], "enorm.weight")
        h = self._rms(hidden, "hnorm.weight")
        x = (torch.cat([e, h], -1) @ self.t[self.p + "eh_proj.weight"].T)[None]  # (1, n, H)
        cos_sin = self.rotary(x, torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        attn, _ = self.attn(self._rms(x, "input_layernorm.weight"), cos_sin, mask)
        x = x + attn
        x = x + self.moe(self._rms(x, "post_attention_layernorm.weight"))
        return self._rms(x[0], "final_layernorm.weight") @ self.head.T


def test_checkpoint_with_the_layer_runs_without_speculation() -> None:
    path = save_tiny_ling_with_mtp(make_tmp_dir("tiny-ling-mtp-"))
    with VllmRunner(path) as runner:
        assert getattr(runner.engine.model, "mtp", None) is None
        assert tokens(runner.generate(prompts(), GREEDY)) == alone(tiny_model_dir(LING))


def test_drafts_are_the_reference_layers_predictions() -> None:
    """After each prompt's prefill, the first draft is the argmax of the reference over the
    target's hidden rows and the following tokens (the sampled one last)."""
    path = save_tiny_ling_with_mtp(make_tmp_dir("tiny-ling-mtp-"))
    ref = Reference(path)
    sequences = [p["prompt_token_ids"] for p in prompts()[3:7]]  # 13 to 100 tokens
    for i, (draft, hidden, following) in enumerate(first_drafts(path, sequences, "mtp")):
        logits = ref(hidden, following)
        assert draft == int(logits[-1].argmax()), i
