"""The decode plan (`layers.decode_plan`): decided once per layer when the state cache binds,
reused by every step (no plan-time predicate runs during steps), re-made by a binding, dropped
by `process_weights_after_loading` and by quantisation; the fused and unfused paths of one
engine agree; the one per-step question (`decode_only`) on each kind of step; the step's
embeddings reach only the layers that read them (`ReadsEmbeddings`).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.distributed.parallel_state import SINGLE
from vllm_mamba.layers import fused_decode_layer, rwkv7_decode
from vllm_mamba.layers.decode_plan import (
    CHAIN_MAX_ROWS,
    DecodeScope,
    PlannedLayer,
    decode_only,
    drop_decode_plans,
    plan_decode,
    planned_layers,
)
from vllm_mamba.layers.decoder_layer import DecoderLayer
from vllm_mamba.layers.fused_decode_layer import FusedMambaStep
from vllm_mamba.layers.quantization import quantize_model
from vllm_mamba.layers.rwkv7_decode import FusedRwkv7Step
from vllm_mamba.models.causal_lm import CausalLM, ReadsEmbeddings, StackNames
from vllm_mamba.models.zamba2 import Zamba2MambaLayer
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.dispatch import get_mamba_ops
from vllm_mamba.ops.fused_decode import MAMBA2_PARAMS
from vllm_mamba.ops.table import bind_ops

needs_kernels = pytest.mark.skipif(
    "fused_mamba_decode" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

PROMPTS = [[11, 42, 7, 300, 5], [9, 8], [1234, 77, 31], [5, 6, 7, 5, 6, 7, 5]]


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the fused steps run (by class), the plans made and the plan-time predicates
    evaluated (`plain_weight`, the projections' check, in both planners)."""
    seen: Counter = Counter()

    def counted(owner: object, name: str, key: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            seen[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    counted(FusedMambaStep, "__call__", "mamba step")
    counted(FusedRwkv7Step, "__call__", "rwkv7 step")
    for cls in _planned_classes():
        counted(cls, "make_decode_plan", "plan")
    counted(fused_decode_layer, "plain_weight", "predicate")
    counted(rwkv7_decode, "plain_weight", "predicate")
    return seen


def _planned_classes() -> list[type[PlannedLayer]]:
    """The built-in `PlannedLayer` classes (each overrides `make_decode_plan`)."""
    return [DecoderLayer, Zamba2MambaLayer]


def _llm(name: str) -> LLM:
    return LLM(tiny_model_dir(name), threads=1, max_num_seqs=4, max_model_len=128)


def _generate(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


# (model, the scopes of its planned layers, the fused step class that runs)
CASES = [
    ("tied", {DecodeScope.BLOCK: 2}, "mamba step"),  # Mamba: norm, mixer, residual
    ("mamba2-groups", {DecodeScope.BLOCK: 2}, "mamba step"),
    # a residual multiplier: the Mamba2 and the attention blocks, residual scaled in the kernel
    ("granite-moe-rope", {DecodeScope.BLOCK: 4}, "mamba step"),
    ("zamba2-lora-rope", {DecodeScope.MIXER: 6}, "mamba step"),  # Zamba2's own layers
    ("rwkv7-h64", {DecodeScope.LAYER: 3}, "rwkv7 step"),  # the whole layer
    # Jamba's Mamba mixer's math is not the kernel's; its attention blocks are fused
    ("jamba-gqa", {None: 2, DecodeScope.BLOCK: 2}, None),
]


@needs_kernels
@pytest.mark.parametrize("name,scopes,step", CASES, ids=[c[0] for c in CASES])
def test_plan_is_made_once_when_bound_and_reused_by_every_step(
    name: str, scopes: dict, step: str | None, counts: Counter
) -> None:
    llm = _llm(name)
    model = llm.llm_engine.model
    layers = planned_layers(model)
    plans = [layer.decode_plan for layer in layers]
    assert Counter(p.scope if p else None for p in plans) == scopes
    made = counts["plan"]
    assert made == len(layers), "one plan per layer, made when the state cache bound"
    counts["predicate"] = 0
    _generate(llm)
    assert counts["plan"] == made and counts["predicate"] == 0, "steps must not re-plan"
    assert all(layer.decode_plan is p for layer, p in zip(layers, plans, strict=True))
    if step is None:
        assert counts["mamba step"] == counts["rwkv7 step"] == 0
    else:
        assert counts[step] > 0, "the fused steps did not run"


@needs_kernels
def test_a_delta_plan_keeps_its_keyword_arguments() -> None:
    """A KDA block's plan passes Ling's safe gate bound to the kernel (`lower_bound` -5) and
    scales no residual: the delta steps extend the Mamba steps' fields, and a field added to
    the base must not shift theirs."""
    model = _llm("ling-moe").llm_engine.model
    steps = [p.step for p in (layer.decode_plan for layer in planned_layers(model)) if p]
    assert len(steps) == 3
    assert all(s.kwargs == {"lower_bound": -5.0} and s.residual_scale == 1.0 for s in steps)


@needs_kernels
def test_binding_remakes_the_plans_and_loading_drops_them(counts: Counter) -> None:
    llm = _llm("mamba2-groups")
    engine = llm.llm_engine
    model, cache = engine.model, engine.executor.cache
    before = [layer.decode_plan for layer in planned_layers(model)]
    params_before = [p.step.params for p in before]
    cache.bind(model)  # the same views bound again: new plans, the same decisions
    after = [layer.decode_plan for layer in planned_layers(model)]
    assert all(a is not b for a, b in zip(after, before, strict=True))
    assert [a.scope for a in after] == [b.scope for b in before]
    for a, b in zip(after, params_before, strict=True):
        assert all(x is y or torch.equal(x, y) for x, y in zip(a.step.params, b, strict=True))
    model.process_weights_after_loading()  # the derived weights are new: no plan holds them
    assert all(layer.decode_plan is None for layer in planned_layers(model))
    counts["mamba step"] = 0
    _generate(llm)
    assert counts["mamba step"] == 0, "a dropped plan must leave the layers unfused"
    assert all(p is not None for p in plan_decode(model))
    quantize_model(model, get_mamba_ops("cpu"), "int8")  # new weights: the plans dropped
    assert all(layer.decode_plan is None for layer in planned_layers(model))
    in_proj = MAMBA2_PARAMS.index("in_proj_w")
    assert all(p.step.params[in_proj].dtype == torch.int8 for p in plan_decode(model))


@needs_kernels
@pytest.mark.parametrize("name", ["tied", "granite-moe-rope", "zamba2-lora-rope", "rwkv7-h64"])
def test_fused_and_unfused_paths_of_one_engine_agree(name: str, counts: Counter) -> None:
    """The same engine with its plans, then with them dropped: the same greedy tokens, the
    logprobs equal to float32 rounding (the kernels sum in another order)."""
    llm = _llm(name)
    fused = _generate(llm)
    ran = counts["mamba step"] + counts["rwkv7 step"]
    assert ran > 0
    drop_decode_plans(llm.llm_engine.model)
    unfused = _generate(llm)
    assert counts["mamba step"] + counts["rwkv7 step"] == ran, "no fused step without plans"
    for a, b in zip(fused, unfused, strict=True):
        assert a.token_ids == b.token_ids
        lp_a = torch.tensor([a.logprobs[i][t].logprob for i, t in enumerate(a.token_ids)])
        lp_b = torch.tensor([b.logprobs[i][t].logprob for i, t in enumerate(b.token_ids)])
        torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=1e-4)


def _meta(decodes: int, prefills: int = 0, waves: bool = False, chain_src: bool = True):
    """The fields `decode_only` reads of a step's metadata."""
    return SimpleNamespace(
        num_decodes=decodes,
        num_prefills=prefills,
        decode_waves=((0, decodes),) if waves else None,
        decode_chain_src=torch.zeros(decodes) if waves and chain_src else None,
    )


@torch.inference_mode()
def test_decode_only_is_the_one_step_question() -> None:
    rows = torch.zeros(5, 4)
    assert decode_only(rows, _meta(5))
    assert not decode_only(rows, _meta(4, prefills=1)), "a prefill row"
    assert not decode_only(rows, _meta(3)), "rows that are not decodes"
    assert not decode_only(rows[:0], _meta(0)), "no rows"
    assert decode_only(rows, _meta(5), max_rows=5)
    assert not decode_only(rows, _meta(5), max_rows=4), "more rows than the kernel's cap"
    assert not decode_only(rows, _meta(5, waves=True)), "chains the kernel does not run"
    assert decode_only(rows, _meta(5, waves=True), max_rows=4, chain_rows=CHAIN_MAX_ROWS)
    assert not decode_only(rows, _meta(5, waves=True, chain_src=False), chain_rows=64)
    many = torch.zeros(CHAIN_MAX_ROWS + 1, 4)
    assert not decode_only(many, _meta(CHAIN_MAX_ROWS + 1, waves=True), chain_rows=64)
    with torch.enable_grad():
        assert not decode_only(rows, _meta(5)), "autograd"


class _Layer(nn.Module):
    """Records the arguments it is called with; adds one to the hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def forward(self, *args: object) -> torch.Tensor:
        self.calls.append(args)
        return args[0] + 1


class _EmbedsLayer(ReadsEmbeddings, _Layer):
    """A `_Layer` that declares it reads the step's embeddings."""


def test_embeddings_reach_only_the_layers_that_read_them() -> None:
    config = SimpleNamespace(vocab_size=11, hidden_size=4, tie_word_embeddings=False)
    plain, reader = _Layer(), _EmbedsLayer()
    model = CausalLM(
        config, bind_ops("ref"), SINGLE, names=StackNames(), layers=[plain, reader], norm_eps=1e-5
    )
    for p in model.parameters():
        nn.init.normal_(p)
    ids = torch.tensor([1, 5, 7])
    model(ids, meta="meta")
    embeds = model.stack.token_embedding(ids)
    (args,) = plain.calls
    assert len(args) == 2 and args[1] == "meta"
    (args,) = reader.calls
    assert len(args) == 3 and torch.equal(args[2], embeds)
