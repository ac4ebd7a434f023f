"""Nemotron 3's multi-token prediction head (`NemotronHForCausalLM` with `mtp.*` weights) as
speculative method `mtp`, on the tiny Nemotron-H MoE model with a random head
(`save_tiny_nemotron_with_mtp`: an attention block and a MoE block, most drafts rejected).

transformers does not run the head (it only skips `mtp.*`), so the reference here is written
from vLLM's `NemotronHMultiTokenPredictor`: `x = eh_proj(cat([enorm(embed(t + 1)),
hnorm(h_t)]))`, then each block `x + mixer(norm(x))` (the attention dense and causal over the
whole sequence, no position embedding; the MoE transformers' own `NemotronHMoE`), then
`final_layernorm` and the target's head. A checkpoint with the head runs without speculation
too (its `mtp.*` skipped), and unsupported heads are refused by name. Greedy decoding with the
head equals decoding without it: `test_mtp_engine.py`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.family_checks import GREEDY, alone, prompts, tokens
from tests.helpers.mtp_checkpoints import NEMOTRON, first_drafts, save_tiny_nemotron_with_mtp
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir

pytestmark = pytest.mark.xdist_group("nemotron_h")  # the family's checkpoint and lone runs


def _checkpoint(edit: dict | None = None) -> str:
    path = save_tiny_nemotron_with_mtp(make_tmp_dir("tiny-nemotron-mtp-"))
    if edit:
        config_file = os.path.join(path, "config.json")
        with open(config_file) as f:
            config = json.load(f)
        config.update(edit)
        with open(config_file, "w") as f:
            json.dump(config, f)
    return path


class Reference:
    """The head from the checkpoint's tensors, one whole sequence at a time."""

    def __init__(self, path: str) -> None:
        import transformers
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

        with open(os.path.join(path, "config.json")) as f:
            self.cfg = json.load(f)
        self.t = load_file(os.path.join(path, "model.safetensors"))
        self.embed = self.t["backbone.embeddings.weight"]
        self.head = self.t.get("lm_head.weight", self.embed)
        self.eps = self.cfg["layer_norm_epsilon"]
        self.moe = NemotronHMoE(transformers.AutoConfig.from_pretrained(path)).eval()
        prefix = "mtp.layers.1.mixer."
        state = {k[len(prefix) :]: v for k, v in self.t.items() if k.startswith(prefix)}
        experts = self.cfg["n_routed_experts"]
        for part in ("up_proj", "down_proj"):
            stacked = [state.pop(f"experts.{e}.{part}.weight") for e in range(experts)]
            state[f"experts.{part}"] = torch.stack(stacked)
        self.moe.load_state_dict(state)

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.t[name]

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        c, n = self.cfg, x.shape[0]
        heads, kv_heads, dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        w = {p: self.t[f"mtp.layers.0.mixer.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")}
        q = (x @ w["q_proj"].T).view(n, heads, dim)
        k = (x @ w["k_proj"].T).view(n, kv_heads, dim).repeat_interleave(heads // kv_heads, 1)
        v = (x @ w["v_proj"].T).view(n, kv_heads, dim).repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
        return out @ self.t["mtp.layers.0.mixer.o_proj.weight"].T

    @torch.no_grad()
    def __call__(
        self, hidden: torch.Tensor, next_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden (n, H)` and the following tokens `(n,)` of one whole sequence -> the head's
        output `(n, H)` and logits `(n, V)`."""
        e = self._rms(self.embed[next_ids], "mtp.layers.0.enorm.weight")
        h = self._rms(hidden, "mtp.layers.0.hnorm.weight")
        x = torch.cat([e, h], -1) @ self.t["mtp.layers.0.eh_proj.weight"].T
        x = x + self._attention(self._rms(x, "mtp.layers.0.norm.weight"))
        x = x + self.moe(self._rms(x, "mtp.layers.1.norm.weight")[None])[0]
        out = self._rms(x, "mtp.layers.1.final_layernorm.weight")
        return out, out @ self.head.T


def test_checkpoint_with_the_head_runs_without_speculation() -> None:
    """The head's tensors are skipped (not refused) and change nothing."""
    path = _checkpoint()
    with VllmRunner(path) as runner:
        assert getattr(runner.engine.model, "mtp", None) is None
        assert tokens(runner.generate(prompts(), GREEDY)) == alone(tiny_model_dir(NEMOTRON))


def test_drafts_are_the_reference_heads_predictions() -> None:
    """After each prompt's prefill, the first draft is the argmax of the reference head over
    the target's hidden rows and the following tokens (the sampled one last)."""
    path = _checkpoint()
    ref = Reference(path)
    sequences = [p["prompt_token_ids"] for p in prompts()[3:7]]  # 13 to 100 tokens
    for i, (draft, hidden, following) in enumerate(first_drafts(path, sequences, "nemotron_h_mtp")):
        logits = ref(hidden, following)[1]
        assert draft == int(logits[-1].argmax()), i


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"num_nextn_predict_layers": 2}, "Nemotron-H's MTP has one layer"),
        ({"mtp_layers_block_type": ["mamba", "moe"]}, "mtp_layers_block_type"),
    ],
)
def test_unsupported_heads_are_refused(edit: dict, match: str) -> None:
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match=match):
        VllmRunner(_checkpoint(edit), speculative_config=spec)
