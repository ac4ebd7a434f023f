"""Tiny checkpoints with a multi-token prediction head, for the MTP tests (the head's own and
the engine's speculative decoding).

transformers does not model the head, so `save_tiny_with_mtp` copies a tiny model of
`tests.tiny_models` and adds random `mtp.*` tensors under the released checkpoints' names and
shapes: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc (H, 2H)`, `norm`, and one
full-attention decoder layer `layers.0` (gated `q_proj (2 Hq D, H)`, `k_proj`, `v_proj`,
`o_proj`, per-head `q_norm` / `k_norm`, the two layer norms) with the family's feed-forward:

- `qwen3_5` (`qwen3_5-gqa`): a dense MLP `mlp.{gate,up,down}_proj`;
- `qwen3_5_moe` (`qwen3_5-moe-top2`): the MoE with fused experts, `mlp.experts.gate_up_proj
  (E, 2F, H)` and `mlp.experts.down_proj (E, H, F)`, as the Qwen3.5-MoE releases store them,
  plus `mlp.gate`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`;
- `qwen3_next` (`qwen3-next-moe`): the MoE with per-expert tensors `mlp.experts.E.*`, as the
  Qwen3-Next releases store them.

`save_tiny_nemotron_with_mtp` does the same for the tiny Nemotron-H MoE model with Nemotron 3's
head (`nemotron_mtp_tensors`: `enorm`, `hnorm`, `eh_proj`, an attention and a MoE block,
`final_layernorm`).

Qwen3.5's config gets `mtp_num_hidden_layers: 1` (the releases' text config has it); Qwen3-Next's
names no depth, as its releases (one layer is assumed). Zero-centred norm weights are drawn
from N(0, 0.1^2), the matrices from N(0, std^2) with the family's weight scale.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import MODEL_FAMILY, tiny_model_dir

VARIANTS = {
    "qwen3_5": "qwen3_5-gqa",
    "qwen3_5_moe": "qwen3_5-moe-top2",
    "qwen3_next": "qwen3-next-moe",
}


def _is_moe(family: str, config: dict) -> bool:
    """Whether the MTP layer (index 0) has the MoE, by the family's rule."""
    if not config.get("num_experts"):
        return False
    if family != "qwen3_next":
        return True
    return 0 not in (config.get("mlp_only_layers") or []) and 1 % config["decoder_sparse_step"] == 0


def mtp_tensors(family: str, config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors for a model of `family` with `config` (its config.json)."""
    g = torch.Generator().manual_seed(seed + 1000)
    std = MODEL_FAMILY[VARIANTS[family]].weight_std
    hidden, heads, kv_heads, dim = (
        config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
        config["head_dim"],
    )  # fmt: skip

    def matrix(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    def norm(size: int) -> torch.Tensor:
        return torch.randn(size, generator=g) * 0.1

    layer = "mtp.layers.0."
    out = {
        "mtp.pre_fc_norm_embedding.weight": norm(hidden),
        "mtp.pre_fc_norm_hidden.weight": norm(hidden),
        "mtp.fc.weight": matrix(hidden, 2 * hidden),
        "mtp.norm.weight": norm(hidden),
        layer + "input_layernorm.weight": norm(hidden),
        layer + "post_attention_layernorm.weight": norm(hidden),
        layer + "self_attn.q_proj.weight": matrix(2 * heads * dim, hidden),
        layer + "self_attn.k_proj.weight": matrix(kv_heads * dim, hidden),
        layer + "self_attn.v_proj.weight": matrix(kv_heads * dim, hidden),
        layer + "self_attn.o_proj.weight": matrix(hidden, heads * dim),
        layer + "self_attn.q_norm.weight": norm(dim),
        layer + "self_attn.k_norm.weight": norm(dim),
    }
    mlp = layer + "mlp."
    if not _is_moe(family, config):
        inter = config["intermediate_size"]
        out.update({
            mlp + "gate_proj.weight": matrix(inter, hidden),
            mlp + "up_proj.weight": matrix(inter, hidden),
            mlp + "down_proj.weight": matrix(hidden, inter),
        })  # fmt: skip
        return out
    experts, inter, shared = (
        config["num_experts"], config["moe_intermediate_size"],
        config["shared_expert_intermediate_size"],
    )  # fmt: skip
    out.update({
        mlp + "gate.weight": matrix(experts, hidden),
        mlp + "shared_expert.gate_proj.weight": matrix(shared, hidden),
        mlp + "shared_expert.up_proj.weight": matrix(shared, hidden),
        mlp + "shared_expert.down_proj.weight": matrix(hidden, shared),
        mlp + "shared_expert_gate.weight": matrix(1, hidden),
    })  # fmt: skip
    if family == "qwen3_5_moe":  # fused, as the Qwen3.5-MoE releases
        out[mlp + "experts.gate_up_proj"] = matrix(experts, 2 * inter, hidden)
        out[mlp + "experts.down_proj"] = matrix(experts, hidden, inter)
    else:
        for e in range(experts):
            out[f"{mlp}experts.{e}.gate_proj.weight"] = matrix(inter, hidden)
            out[f"{mlp}experts.{e}.up_proj.weight"] = matrix(inter, hidden)
            out[f"{mlp}experts.{e}.down_proj.weight"] = matrix(hidden, inter)
    return out


def _save_with(source: str, path: str, edit: dict, head: Callable[[dict, dict], dict]) -> str:
    """Copies checkpoint `source` into `path` (created if needed) with `edit` in its config
    and the tensors `head(config, tensors)` added; returns `path`."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(source):
        shutil.copy(os.path.join(source, name), path)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    if edit:
        config.update(edit)
        with open(config_file, "w") as f:
            json.dump(config, f, indent=2)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    tensors.update(head(config, tensors))
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


def save_tiny_with_mtp(family: str, path: str, seed: int = 0) -> str:
    """Saves the tiny model of `family` (`qwen3_5`, `qwen3_5_moe` or `qwen3_next`) with a random
    MTP head into directory `path` (created if needed) and returns `path`."""
    if family not in VARIANTS:
        raise ValueError(f"family {family!r}: one of {sorted(VARIANTS)}")
    edit = {} if family == "qwen3_next" else {"mtp_num_hidden_layers": 1}
    return _save_with(
        tiny_model_dir(VARIANTS[family]), path, edit,
        lambda config, _: mtp_tensors(family, config, seed),
    )  # fmt: skip


NEMOTRON = "nemotron-h-moe"
# Nemotron 3's MTP step, as the releases (`mtp_layers_block_type`): an attention block then a
# MoE block, drawn in the shapes of the tiny model's own blocks of those kinds.
NEMOTRON_MTP_BLOCKS = (("full_attention", 2), ("moe", 1))  # (kind, the target's block index)


def nemotron_mtp_tensors(tensors: dict[str, torch.Tensor], hidden: int, seed: int = 0) -> dict:
    """Random `mtp.*` tensors of a Nemotron-H MTP head under the releases' names:
    `layers.0.{enorm,hnorm}`, `layers.0.eh_proj (H, 2H)`, each block's `norm` and `mixer.*` in
    the shapes of the target's block of that kind (`tensors`, the tiny checkpoint's), and the
    last block's `final_layernorm`. Plain norms are drawn from N(1, 0.1^2), score-correction
    biases from N(0, 0.1^2), the rest from N(0, std^2)."""
    g = torch.Generator().manual_seed(seed + 2000)
    std = MODEL_FAMILY[NEMOTRON].weight_std

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        noise = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            return 1.0 + 0.1 * noise
        return noise * (0.1 if name.endswith("e_score_correction_bias") else std)

    last = len(NEMOTRON_MTP_BLOCKS) - 1
    out = {
        "mtp.layers.0.enorm.weight": draw("enorm.weight", (hidden,)),
        "mtp.layers.0.hnorm.weight": draw("hnorm.weight", (hidden,)),
        "mtp.layers.0.eh_proj.weight": draw("eh_proj.weight", (hidden, 2 * hidden)),
        f"mtp.layers.{last}.final_layernorm.weight": draw("final_layernorm.weight", (hidden,)),
    }
    for i, (_, source) in enumerate(NEMOTRON_MTP_BLOCKS):
        prefix = f"backbone.layers.{source}."
        for name, t in tensors.items():
            if name.startswith(prefix):
                mtp_name = f"mtp.layers.{i}." + name[len(prefix) :]
                out[mtp_name] = draw(mtp_name, tuple(t.shape))
    return out


def save_tiny_nemotron_with_mtp(path: str, seed: int = 0) -> str:
    """Saves the tiny Nemotron-H MoE model with a random MTP head (`nemotron_mtp_tensors`) and
    `num_nextn_predict_layers: 1`, `mtp_layers_block_type` in its config, into directory
    `path` (created if needed); returns `path`."""
    edit = {
        "num_nextn_predict_layers": 1,
        "mtp_layers_block_type": [kind for kind, _ in NEMOTRON_MTP_BLOCKS],
    }
    return _save_with(
        tiny_model_dir(NEMOTRON), path, edit,
        lambda config, tensors: nemotron_mtp_tensors(tensors, config["hidden_size"], seed),
    )  # fmt: skip


LING = "ling-moe"
LING_MTP_SOURCE = 2  # ling-moe's MLA + MoE layer: the MTP layer's shapes


def save_tiny_ling_with_mtp(path: str, seed: int = 0) -> str:
    """Saves the tiny Ling 3 model with one random MTP layer under the releases' names
    (`model.layers.{num_hidden_layers}.`: `enorm`, `hnorm`, `eh_proj (H, 2H)`, an MLA and MoE
    decoder layer in the shapes of the target's layer `LING_MTP_SOURCE`, `final_layernorm`, and
    `shared_head.head`, the head again) into directory `path`; returns `path`. Plain norms
    are drawn from N(1, 0.1^2), score-correction biases from N(0, 0.1^2), the rest from
    N(0, std^2)."""
    g = torch.Generator().manual_seed(seed + 3000)
    std = MODEL_FAMILY[LING].weight_std

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        noise = torch.randn(shape, generator=g)
        if name.endswith(("norm.weight", "layernorm.weight")):
            return 1.0 + 0.1 * noise
        return noise * (0.1 if name.endswith("expert_bias") else std)

    def head(config: dict, tensors: dict) -> dict:
        layer, hidden = f"model.layers.{config['num_hidden_layers']}.", config["hidden_size"]
        source = f"model.layers.{LING_MTP_SOURCE}."
        out = {
            layer + "enorm.weight": draw("enorm.weight", (hidden,)),
            layer + "hnorm.weight": draw("hnorm.weight", (hidden,)),
            layer + "eh_proj.weight": draw("eh_proj.weight", (hidden, 2 * hidden)),
            layer + "final_layernorm.weight": draw("final_layernorm.weight", (hidden,)),
            layer + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        }
        for name, t in tensors.items():
            if name.startswith(source):
                mtp_name = layer + name[len(source) :]
                out[mtp_name] = draw(mtp_name, tuple(t.shape))
        return out

    return _save_with(tiny_model_dir(LING), path, {"num_nextn_predict_layers": 1}, head)


GLM5 = "glm5-next-moe"
GLM5_MTP_SOURCE = 1  # glm5-next-moe's full DSA + MoE layer: the MTP layer's shapes


def _drawer(variant: str, seed: int) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """Draws a random tensor by name: plain norm weights from N(1, 0.1^2), zero-centred ones
    (`zero_centred`) and score-correction biases from N(0, 0.1^2), the rest from N(0, std^2)
    with the variant's weight scale."""
    g = torch.Generator().manual_seed(seed)
    std = MODEL_FAMILY[variant].weight_std

    def draw(name: str, shape: tuple[int, ...], zero_centred: bool = False) -> torch.Tensor:
        noise = torch.randn(shape, generator=g)
        if name.endswith(("norm.weight", "layernorm.weight")) and not zero_centred:
            return 1.0 + 0.1 * noise
        small = zero_centred or name.endswith(("e_score_correction_bias", "norm.bias"))
        return noise * (0.1 if small else std)

    return draw


def save_tiny_glm5_with_mtp(path: str, seed: int = 0) -> str:
    """Saves the tiny GLM-5-Next model with one random MTP layer under the release's names
    (`model.language_model.layers.{num_hidden_layers}.`: `enorm`, `hnorm`, `eh_proj (H, 2H)`,
    `shared_head.norm`, `shared_head.head` (the head again), and a DSA + MoE decoder layer
    without hyper-connections in the shapes of the target's layer `GLM5_MTP_SOURCE`) into
    directory `path`; returns `path`."""
    draw = _drawer(GLM5, seed + 4000)

    def head(config: dict, tensors: dict) -> dict:
        text = config["text_config"]
        prefix = "model.language_model.layers."
        layer, hidden = f"{prefix}{text['num_hidden_layers']}.", text["hidden_size"]
        source = f"{prefix}{GLM5_MTP_SOURCE}."
        out = {
            layer + "enorm.weight": draw("enorm.weight", (hidden,)),
            layer + "hnorm.weight": draw("hnorm.weight", (hidden,)),
            layer + "eh_proj.weight": draw("eh_proj.weight", (hidden, 2 * hidden)),
            layer + "shared_head.norm.weight": draw("shared_head.norm.weight", (hidden,)),
            layer + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        }
        for name, t in tensors.items():
            if name.startswith(source) and ".hc_" not in name:
                mtp_name = layer + name[len(source) :]
                out[mtp_name] = draw(mtp_name, tuple(t.shape))
        return out

    return _save_with(tiny_model_dir(GLM5), path, {}, head)


QWEN4 = "qwen4-exp-ple"
QWEN4_MTP_SOURCE = 3  # qwen4-exp-ple's indexed attention layer (no n-gram embeddings)


def save_tiny_qwen4_with_mtp(path: str, seed: int = 0) -> str:
    """Saves the tiny Qwen4-Exp model with a random MTP head under the release's names
    (`mtp.`: `pre_fc_norm_embedding (H)`, `pre_fc_norm_hidden (N * H)`, `fc_embedding`,
    `fc_hidden (H, H)`, `hyper_connection_mixer.*`, and `layers.0`, the target's layer
    `QWEN4_MTP_SOURCE`'s shapes with the experts stacked, `experts.gate_up_proj (E, 2F, H)`
    and `experts.down_proj (E, H, F)`, as the release stores them) and
    `mtp_num_hidden_layers: 1` into directory `path`; returns `path`. The zero-centred norms
    are drawn from N(0, 0.1^2)."""
    draw = _drawer(QWEN4, seed + 5000)

    def head(config: dict, tensors: dict) -> dict:
        hidden, streams = config["hidden_size"], config["hc_count"]
        out = {
            "mtp.pre_fc_norm_embedding.weight": draw("e", (hidden,), zero_centred=True),
            "mtp.pre_fc_norm_hidden.weight": draw("h", (streams * hidden,), zero_centred=True),
            "mtp.fc_embedding.weight": draw("fc_embedding", (hidden, hidden)),
            "mtp.fc_hidden.weight": draw("fc_hidden", (hidden, hidden)),
        }
        for name, t in tensors.items():
            if name.startswith("model.hyper_connection_mixer."):
                mtp_name = "mtp." + name[len("model.") :]
                out[mtp_name] = draw(mtp_name, tuple(t.shape), zero_centred="norm" in name)
        source = f"model.layers.{QWEN4_MTP_SOURCE}."
        experts: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            if not name.startswith(source):
                continue
            rest = name[len(source) :]
            zero_centred = "norm" in rest  # every norm of the model is zero-centred
            value = draw(rest, tuple(t.shape), zero_centred=zero_centred)
            if rest.startswith("mlp.experts."):
                e, part = rest[len("mlp.experts.") :].split(".", 1)
                experts.setdefault(int(e), {})[part.split(".")[0]] = value
            else:
                out["mtp.layers.0." + rest] = value
        order = sorted(experts)
        out["mtp.layers.0.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order]
        )
        out["mtp.layers.0.mlp.experts.down_proj"] = torch.stack(
            [experts[e]["down_proj"] for e in order]
        )
        return out

    return _save_with(tiny_model_dir(QWEN4), path, {"mtp_num_hidden_layers": 1}, head)


def first_drafts(
    path: str, prompts: list[list[int]], method: str = "mtp"
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Per prompt, alone on an engine on `path` drafting one token with `method`: the first
    draft after the prompt's prefill, the target's hidden rows of the prompt `(P, H)`, and the
    tokens that follow each row `(P,)` (the prompt's next ones, then the sampled one)."""
    from tests.helpers.runners import VllmRunner
    from vllm_mamba import SamplingParams

    out = []
    spec = {"method": method, "num_speculative_tokens": 1}
    with VllmRunner(path, speculative_config=spec) as runner:
        engine = runner.engine
        for i, prompt in enumerate(prompts):
            captured: list[torch.Tensor] = []
            hook = engine.model.register_forward_hook(
                lambda m, a, rows, kept=captured: kept.append(rows.clone())
            )
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0))
            engine.step()  # the whole prompt: hidden rows of positions 0 .. P - 1
            hook.remove()
            seq = engine.scheduler.running[0].seqs[0]
            draft = seq.spec_token_ids[0]
            engine.abort_request(f"r{i}")
            following = torch.tensor(prompt[1:] + seq.output_token_ids[:1])
            out.append((draft, captured[0][: len(prompt)], following))
    return out
