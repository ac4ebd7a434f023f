"""The multi-token prediction heads of GLM-5-Next and Qwen4-Exp as speculative method `mtp`, on
the tiny models with random heads (`save_tiny_glm5_with_mtp`, `save_tiny_qwen4_with_mtp`; most
drafts rejected). Greedy decoding with the heads equals decoding without them:
`test_mtp_engine.py`.

transformers 5.24 skips both heads, so each reference is wired from transformers' own modules
by the serving implementations' arithmetic, and fed transformers' own target states:

- GLM-5-Next (vLLM's `Glm5NextMTP`, the GLM-4.5 MTP layer): `x = eh_proj(cat([enorm(e),
  hnorm(h)]))` with `e = embed(t + 1)` zeroed at position 0 and `h` the target's output (the
  streams' mean after the final norm), then a decoder layer without hyper-connections
  (`Glm5NextTextAttention` with its own indexer, `Glm5NextTextMoE`), `shared_head.norm`, the
  target's head.
- Qwen4-Exp (SGLang's `Qwen4ExpForCausalLMMTP`): `fc_embedding(pre_fc_norm_embedding(e))`
  added to every stream of `fc_hidden(pre_fc_norm_hidden(s))`, `s` the target's last layer's
  streams (one norm over all of them), then a one-layer `Qwen4ExpTextModel` (an indexed
  attention layer, no n-gram embeddings) from that state and its `hyper_connection_mixer`, the
  target's head.

The prompts reach 100 tokens, far past the tiny selection budgets (8 tokens), so the heads'
own indexers drop tokens.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.family_checks import GREEDY, alone, prompts, tokens
from tests.helpers.mtp_checkpoints import (
    GLM5,
    QWEN4,
    save_tiny_glm5_with_mtp,
    save_tiny_qwen4_with_mtp,
)
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir

SAVERS = {"glm5_next": save_tiny_glm5_with_mtp, "qwen4_exp": save_tiny_qwen4_with_mtp}
SEQUENCES = [3, 4, 5, 6]  # prompts of 13 to 100 tokens


def _checkpoint(family: str) -> str:
    return SAVERS[family](make_tmp_dir(f"tiny-{family}-mtp-"))


def _part(tensors: dict, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix`, relative to it."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w + 1.0 if zero_centred else w)


class GlmReference:
    """GLM-5-Next's target (transformers' model) and its MTP layer from the checkpoint."""

    def __init__(self, path: str) -> None:
        import transformers
        from transformers.models.glm5_next import modeling_glm5_next as hf

        model = transformers.Glm5NextForConditionalGeneration.from_pretrained(path).eval()
        self.trunk = model.model.language_model
        self.head = model.lm_head.weight
        text = copy.deepcopy(model.config.text_config)
        n = text.num_hidden_layers
        text.layer_types = [*text.layer_types, "indexed_attention"]
        text.indexer_types = [*text.indexer_types, "full"]
        text.mlp_layer_types = [*text.mlp_layer_types, text.mlp_layer_types[-1]]
        text._attn_implementation = "eager"
        self.eps = text.rms_norm_eps
        self.t = _part(load_file(os.path.join(path, "model.safetensors")),
                       f"model.language_model.layers.{n}.")  # fmt: skip
        self.attn = hf.Glm5NextTextAttention(text, n).eval()
        self.attn.load_state_dict(_part(self.t, "self_attn."))
        self.moe = hf.Glm5NextTextMoE(text).eval()
        moe = _part(self.t, "mlp.")
        experts = text.n_routed_experts
        moe["experts.gate_up_proj"] = torch.stack([
            torch.cat([moe.pop(f"experts.{e}.{p}_proj.weight") for p in ("gate", "up")])
            for e in range(experts)
        ])  # fmt: skip
        moe["experts.down_proj"] = torch.stack(
            [moe.pop(f"experts.{e}.down_proj.weight") for e in range(experts)]
        )
        self.moe.load_state_dict(moe)

    @torch.no_grad()
    def __call__(self, ids: list[int], following: torch.Tensor) -> torch.Tensor:
        """Prompt `ids (P,)` and the tokens that follow each position `(P,)` -> the MTP's
        logits `(P, V)`."""
        h = self.trunk(input_ids=torch.tensor([ids])).last_hidden_state[0]  # (P, H)
        e = self.trunk.embed_tokens(following)
        e[0] = 0.0  # position 0
        x = torch.cat([_rms(e, self.t["enorm.weight"], self.eps),
                       _rms(h, self.t["hnorm.weight"], self.eps)], -1)  # fmt: skip
        x = (x @ self.t["eh_proj.weight"].T)[None]  # (1, P, H)
        mask = torch.ones(1, len(ids), dtype=torch.bool)
        attn, _, _ = self.attn(_rms(x, self.t["input_layernorm.weight"], self.eps), mask)
        x = x + attn
        x = x + self.moe(_rms(x, self.t["post_attention_layernorm.weight"], self.eps))
        return _rms(x[0], self.t["shared_head.norm.weight"], self.eps) @ self.head.T


class Qwen4Reference:
    """Qwen4-Exp's target (transformers' model) and its MTP head from the checkpoint."""

    def __init__(self, path: str) -> None:
        import transformers

        model = transformers.Qwen4ExpForCausalLM.from_pretrained(path).eval()
        self.trunk = model.model
        self.head = model.lm_head.weight
        config = copy.deepcopy(model.config)
        config.num_hidden_layers = 1
        config.layer_types = ["indexed_attention"]
        config.ple_layer_ids = []
        config._attn_implementation = "eager"
        self.cfg = config
        tensors = _part(load_file(os.path.join(path, "model.safetensors")), "mtp.")
        self.mtp = transformers.Qwen4ExpTextModel(config).eval()
        state = {k: v for k, v in tensors.items() if k.startswith(("layers.", "hyper_connection"))}
        missing, unexpected = self.mtp.load_state_dict(state, strict=False)
        assert not unexpected and all(k.startswith("embed_tokens") for k in missing), missing
        self.t = tensors

    @torch.no_grad()
    def __call__(self, ids: list[int], following: torch.Tensor) -> torch.Tensor:
        """As `GlmReference.__call__`."""
        cfg, t = self.cfg, self.t
        kept: list[torch.Tensor] = []
        hook = self.trunk.layers[-1].register_forward_hook(lambda m, a, out: kept.append(out))
        self.trunk(input_ids=torch.tensor([ids]))
        hook.remove()
        streams = kept[0][0]  # (P, N * H): the last layer's output, before the mixer
        e = _rms(self.trunk.embed_tokens(following), t["pre_fc_norm_embedding.weight"],
                 cfg.rms_norm_eps, zero_centred=True) @ t["fc_embedding.weight"].T  # fmt: skip
        s = _rms(streams, t["pre_fc_norm_hidden.weight"], cfg.rms_norm_eps, zero_centred=True)
        s = s.view(len(ids), cfg.hc_count, cfg.hidden_size) @ t["fc_hidden.weight"].T
        start = (e[:, None] + s).flatten(1)[None]  # (1, P, N * H)

        def replace(module: torch.nn.Module, args: tuple) -> tuple:
            return (start, *args[1:])

        hook = self.mtp.layers[0].register_forward_pre_hook(replace)
        out = self.mtp(inputs_embeds=torch.zeros(1, len(ids), cfg.hidden_size))
        hook.remove()
        return out.last_hidden_state[0] @ self.head.T


REFERENCES = {"glm5_next": GlmReference, "qwen4_exp": Qwen4Reference}


def _engine_heads(
    path: str, sequences: list[list[int]]
) -> list[tuple[int, torch.Tensor, list[int]]]:
    """Per prompt, alone on an engine drafting one token with `mtp`: the first draft after the
    prompt's prefill, the head's logits over the prompt's rows `(P, V)` (the head's KV written
    at every position), and the token sampled after the prompt."""
    from vllm_mamba import SamplingParams

    out = []
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with VllmRunner(path, speculative_config=spec) as runner:
        engine = runner.engine
        head = engine.model.mtp
        for i, prompt in enumerate(sequences):
            rows: list[torch.Tensor] = []
            hook = head.register_forward_hook(lambda m, a, o, kept=rows: kept.append(o.clone()))
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0))
            engine.step()  # the whole prompt
            hook.remove()
            seq = engine.scheduler.running[0].seqs[0]
            with torch.no_grad():
                logits = head.compute_logits(rows[0][: len(prompt)])
            out.append((seq.spec_token_ids[0], logits, seq.output_token_ids[:1]))
            engine.abort_request(f"r{i}")
    return out


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_head_is_the_reference(family: str) -> None:
    """After each prompt's prefill, the head's logits at every row of the prompt equal the
    reference's over the target's states and the following tokens (the sampled one last), and
    the first draft is their argmax at the last row."""
    path = _checkpoint(family)
    ref = REFERENCES[family](path)
    sequences = [prompts()[i]["prompt_token_ids"] for i in SEQUENCES]
    for i, (draft, logits, sampled) in enumerate(_engine_heads(path, sequences)):
        want = ref(sequences[i], torch.tensor(sequences[i][1:] + sampled))
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        assert draft == int(want[-1].argmax()), i


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_checkpoint_with_the_head_runs_without_speculation(family: str) -> None:
    """Without `mtp` the head's tensors are skipped (not refused) and the tokens are the
    model's without them."""
    path = _checkpoint(family)
    with VllmRunner(path) as runner:
        assert getattr(runner.engine.model, "mtp", None) is None
        assert not runner.engine.model.keep_streams
        got = tokens(runner.generate(prompts(), GREEDY))
    assert got == alone(tiny_model_dir({"glm5_next": GLM5, "qwen4_exp": QWEN4}[family]))


def test_glm_refuses_more_than_one_mtp_layer() -> None:
    """GLM's head has one layer (its norms and projection are the head's): two are a
    ValueError naming `num_nextn_predict_layers`."""
    path = _checkpoint("glm5_next")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["text_config"]["num_nextn_predict_layers"] = 2
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="num_nextn_predict_layers 2"):
        VllmRunner(path, speculative_config=spec)
