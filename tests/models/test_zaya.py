"""ZAYA1 beyond the family suite: the layer plan read off the config (each kind's RoPE and
window, the convs' widths, which routers carry the previous layer's state), the `cca` ops
against transformers' two `nn.Conv1d`s and the delayed value over chunks and decode steps, and
the skip expert; int8 and bfloat16 close to float32.

The skip expert is never chosen by the family suite's checkpoints: transformers' loading
(`ZayaPreTrainedModel._init_weights`) sets the last balancing bias back to -1 whatever the
checkpoint holds, and at -1 the skip expert cannot win (the experts' probabilities plus their
biases stay above `p_skip - 1`). So it is checked twice here against transformers: its MoE
block on tokens that choose the skip expert, and the engine on a checkpoint whose skip bias
chooses it, with transformers given the checkpoint's bias back after loading.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import tiny_configs as cfg
from tests.helpers.family_checks import LOGPROB_ATOL, teacher_forced
from tests.helpers.prompts import MAX_TOKENS, make_prompts
from tests.helpers.runners import HfRunner, VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import build_hf_model, copy_tokenizer, tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.layers.zaya_moe import ZayaMoE
from vllm_mamba.models.zaya import ZayaForCausalLM
from vllm_mamba.ops import cca, cpu_kernels
from vllm_mamba.ops.dispatch import get_mamba_ops

CPU = torch.device("cpu")
needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
MAIN = "zaya-gqa"
SKIP_BIAS = 0.0  # the skip expert's balancing bias in the skip checks: chosen at times
# As tests/models/test_lfm3.py: top-1 agreement with float32 at >= 75% of positions, the
# sequence's own token's logprob off by <= 0.4 on average (measured on zaya-gqa: int8 95% and
# 0.22, bfloat16 95% and 0.25).
TOP1_AGREEMENT = 0.75
MEAN_LOGPROB_DIFF = 0.4


@pytest.mark.parametrize("variant", [None, *cfg.ZAYA], ids=lambda v: v or "ZAYA1-8B")
def test_layers_as_transformers(variant: str | None) -> None:
    """Per layer: transformers' inverse frequencies for its kind, its window (the config's for
    `hybrid_sliding`, none for `hybrid`), the convs' history `K0 + K1 - 2`, and a router that
    reads the previous layer's state everywhere but the first layer."""
    import transformers

    fields = cfg.ZAYA[variant] if variant else {}
    config = transformers.ZayaConfig(**fields)
    rotary = transformers.models.zaya.modeling_zaya.ZayaRotaryEmbedding(config)
    with torch.device("meta"):
        model = ZayaForCausalLM(config, get_mamba_ops(CPU))
    for index, (kind, layer) in enumerate(zip(config.layer_types, model.model.layers)):
        attn = layer.self_attn
        want = getattr(rotary, f"{kind}_inv_freq")
        torch.testing.assert_close(attn.rotary.freqs.inv_freq, want, rtol=0, atol=0)
        assert attn.rotary.rot_dim == 2 * want.numel()
        window = config.sliding_window if kind == "hybrid_sliding" else 0
        assert attn.attn.sliding_window == window
        spec = attn.qkv_proj.state_spec()
        assert spec.tensors[0].shape[-1] == config.cca_time0 + config.cca_time1 - 2
        assert (layer.mlp.gate.router_states_scale is not None) == (index > 0)


def test_refused_configs() -> None:
    """A biased LM head, and KV heads that do not split over the ranks (the key residual
    averages each KV head's queries)."""
    import transformers

    with torch.device("meta"):
        with pytest.raises(ValueError, match="lm_head_bias"):
            ZayaForCausalLM(transformers.ZayaConfig(lm_head_bias=True), get_mamba_ops(CPU))
        config = transformers.ZayaConfig(**cfg.ZAYA["zaya-mqa"])
        with pytest.raises(ValueError, match="num_key_value_heads"):
            ZayaForCausalLM(config, get_mamba_ops(CPU), TensorParallel(rank=0, size=3))


def _transformers_convs(x: torch.Tensor, depthwise: nn.Conv1d, grouped: nn.Conv1d) -> torch.Tensor:
    """transformers' CCA conv path over one whole sequence `x (L, C)` -> `(L, C)`."""
    hist = depthwise.kernel_size[0] + grouped.kernel_size[0] - 2
    padded = nn.functional.pad(x.T[None], (hist, 0))  # (1, C, K - 1 + L)
    return grouped(depthwise(padded))[0].T


def _conv_ops(impl: str) -> tuple:
    """The `cca` family's conv ops of a backend: (varlen, update)."""
    if impl == "ref":
        return cca.cca_conv_varlen_ref, cca.cca_conv_update_ref
    return cpu_kernels.cca_conv_varlen, cpu_kernels.cca_conv_update


@pytest.mark.parametrize("impl", ["ref", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("kernels", [(2, 2), (3, 2), (1, 4)])
def test_cca_ops_match_transformers_convs_over_chunks_and_decodes(
    kernels: tuple[int, int], impl: str
) -> None:
    """Three sequences (one padding row among them) prefilled in two chunks each (the second
    from the saved history, chunks shorter than the history included), then decoded token by
    token: both convs as transformers' `nn.Conv1d`s over each whole sequence (the references
    and the C++ kernels, `csrc/cca.cpp`), and the shift as the previous token's input (the
    fresh sequence's first token reading `initial`)."""
    conv_varlen, conv_update = _conv_ops(impl)
    g = torch.Generator().manual_seed(0)
    heads, dim = 3, 8
    channels = heads * dim
    depthwise = nn.Conv1d(channels, channels, kernels[0], groups=channels)
    grouped = nn.Conv1d(channels, channels, kernels[1], groups=heads)
    with torch.no_grad():
        for p in [*depthwise.parameters(), *grouped.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    dw = (depthwise.weight[:, 0].detach(), depthwise.bias.detach())
    gw = (grouped.weight.detach(), grouped.bias.detach())
    lengths, cut, decodes = [9, 2, 6], [4, 1, 6], 3
    seqs = [torch.randn(n + decodes, channels, generator=g) for n in lengths]
    hist = sum(kernels) - 2
    conv = torch.full((5, channels, hist), 7.0)  # slots 1, 3, 4; 0 and 2 must stay untouched
    shift = torch.full((5, channels), 7.0)
    initial = torch.randn(channels, generator=g)
    slots = torch.tensor([1, 3, 4], dtype=torch.int32)
    got_conv: list[list[torch.Tensor]] = [[], [], []]
    got_shift: list[list[torch.Tensor]] = [[], [], []]
    for part, has_initial in ((0, False), (1, True)):
        bounds = [(0, c) if part == 0 else (c, n) for c, n in zip(cut, lengths)]
        x = torch.cat([s[a:b] for s, (a, b) in zip(seqs, bounds)] + [seqs[0][:2]])
        sizes = [b - a for a, b in bounds] + [2]  # a padding sequence last
        qsl = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
        idx = torch.cat([slots, torch.tensor([PAD_SLOT_ID], dtype=torch.int32)])
        flags = torch.tensor([has_initial] * 4)
        out = conv_varlen(x, *dw, *gw, conv, qsl, idx, flags)
        prev = cca.cca_shift_varlen_ref(x, shift, initial, qsl, idx, flags)
        for i in range(3):
            got_conv[i].append(out[qsl[i] : qsl[i + 1]])
            got_shift[i].append(prev[qsl[i] : qsl[i + 1]])
    for step in range(decodes):
        x = torch.stack([s[n + step] for s, n in zip(seqs, lengths)] + [seqs[0][0]])
        idx = torch.cat([slots, torch.tensor([PAD_SLOT_ID], dtype=torch.int32)])
        out = conv_update(x, conv, *dw, *gw, idx)
        prev = cca.cca_shift_update_ref(x, shift, idx)
        for i in range(3):
            got_conv[i].append(out[i : i + 1])
            got_shift[i].append(prev[i : i + 1])
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            want = _transformers_convs(seq, depthwise, grouped)
            torch.testing.assert_close(torch.cat(got_conv[i]), want, rtol=1e-5, atol=1e-5)
            previous = torch.cat([initial[None], seq[:-1]])
            torch.testing.assert_close(torch.cat(got_shift[i]), previous, rtol=0, atol=0)
    untouched = [0, 2]
    assert bool((conv[untouched] == 7.0).all()) and bool((shift[untouched] == 7.0).all())


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cca_cpp_convs_match_reference(dtype: torch.dtype) -> None:
    """ZAYA1-8B's conv shape (10 groups of 128 channels, widths 2 and 2) in float32 and
    bfloat16: prefill of a fresh, a saved, an empty fresh and a padding sequence, then decode rows,
    against the references (bfloat16: both round each conv's output, in their own orders)."""
    g = torch.Generator().manual_seed(1)
    channels, dim = 1280, 128
    weights = (
        torch.randn(channels, 2, generator=g) * 0.5, torch.randn(channels, generator=g) * 0.1,
        torch.randn(channels, dim, 2, generator=g) * 0.05, torch.randn(channels, generator=g) * 0.1,
    )  # fmt: skip
    dw_w, dw_b, g_w, g_b = (w.to(dtype) for w in weights)
    x = torch.randn(24, channels, generator=g).to(dtype)
    qsl = torch.tensor([0, 9, 9, 20, 24], dtype=torch.int32)
    idx = torch.tensor([3, 1, 0, PAD_SLOT_ID], dtype=torch.int32)
    flags = torch.tensor([False, True, False, True])  # the empty sequence fresh: its slot zeroed
    states = torch.randn(4, channels, 2, generator=g).to(dtype)
    got_states, want_states = states.clone(), states.clone()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-2, "rtol": 2e-2}
    got = cpu_kernels.cca_conv_varlen(x, dw_w, dw_b, g_w, g_b, got_states, qsl, idx, flags)
    want = cca.cca_conv_varlen_ref(x, dw_w, dw_b, g_w, g_b, want_states, qsl, idx, flags)
    torch.testing.assert_close(got[:20], want[:20], **tol)
    torch.testing.assert_close(got_states, want_states, atol=0, rtol=0)
    rows = torch.tensor([3, 0], dtype=torch.int32)
    got = cpu_kernels.cca_conv_update(x[:2], got_states, dw_w, dw_b, g_w, g_b, rows)
    want = cca.cca_conv_update_ref(x[:2], want_states, dw_w, dw_b, g_w, g_b, rows)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_states, want_states, atol=0, rtol=0)


@pytest.mark.parametrize("index", [0, 1])
def test_moe_with_skip_expert_matches_transformers(index: int) -> None:
    """The MoE block of layer `index` (the first without a carried router state) on tokens
    some of which choose the skip expert: outputs and the router state passed on equal
    transformers' `ZayaSparseMoeBlock`'s."""
    import transformers
    from transformers.models.zaya.modeling_zaya import ZayaSparseMoeBlock

    config = transformers.ZayaConfig(**cfg.ZAYA[MAIN])
    ref = ZayaSparseMoeBlock(config, index).eval()
    g = torch.Generator().manual_seed(index)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.6)
        ref.gate.balancing_biases.copy_(torch.randn(config.num_experts + 1, generator=g) * 0.1)
        ref.gate.balancing_biases[-1] = SKIP_BIAS
    moe = ZayaMoE(
        config.hidden_size, config.router_hidden_size, config.num_experts,
        config.moe_intermediate_size, config.rms_norm_eps, index > 0, config.hidden_act,
        get_mamba_ops(CPU),
    )  # fmt: skip
    state = {
        name: t
        for raw, tensor in ref.state_dict().items()
        for name, t in ZayaForCausalLM.expand_weight(f".mlp.{raw}", tensor)
    }
    moe.load_state_dict({name.removeprefix(".mlp."): t for name, t in state.items()})
    x = torch.randn(1, 40, config.hidden_size, generator=g)
    carried = torch.randn(1, 40, config.router_hidden_size, generator=g) if index else None
    with torch.no_grad():
        want, want_state = ref(x, carried)
        skipped = int((ref.gate(x, carried)[1] == 0).sum())  # their weights are masked to 0
        got, got_state = moe(x[0], None if carried is None else carried[0])
    assert 0 < skipped < 40
    # float32 rounding of sums of terms up to ~300 (std 0.6 weights): transformers' float32
    # is 8e-5 (layer 0) and 2.4e-4 (layer 1) off its float64 run, this block 7e-5 and 3e-4,
    # at most 1.1e-6 of the largest output; a different expert would be off by O(1).
    torch.testing.assert_close(got, want[0], rtol=0, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(got_state, want_state[0], rtol=0, atol=1e-5)


def test_skip_expert_engine_matches_transformers() -> None:
    """zaya-gqa with the skip expert's balancing bias at `SKIP_BIAS`: greedy tokens equal and
    top-5 logprobs within the suite's bound of transformers' (given the checkpoint's bias back
    after loading), with tokens routed to the skip expert on every layer."""
    model = build_hf_model(MAIN)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.balancing_biases[-1] = SKIP_BIAS
    path = make_tmp_dir("tiny-zaya-skip-")
    model.save_pretrained(path)
    copy_tokenizer(path)
    hf = HfRunner(path, "ZayaForCausalLM")
    skipped = torch.zeros(len(hf.model.model.layers), dtype=torch.int64)  # tokens, per layer
    with torch.no_grad():
        for index, layer in enumerate(hf.model.model.layers):
            gate = layer.mlp.gate
            gate.balancing_biases[-1] = SKIP_BIAS  # reset to -1 by transformers' loading
            gate.register_forward_hook(
                lambda m, _, out, i=index: skipped.__setitem__(i, skipped[i] + (out[1] == 0).sum())
            )
    prompts = make_prompts()[::3]
    refs = hf.generate_greedy_logprobs(prompts, MAX_TOKENS)
    assert bool((skipped > 0).all()), skipped
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    with VllmRunner(path) as runner:
        outs = runner.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, (want, ref_lp) in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == want
        assert len(set(want)) >= MAX_TOKENS // 2
        for step, entry in enumerate(got.logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:5]
            values = torch.tensor([lp.logprob for _, lp in top])
            torch.testing.assert_close(
                values, ref_lp[step].topk(5).values, rtol=0, atol=LOGPROB_ATOL
            )


def test_int8_and_bfloat16_stay_close_to_float32() -> None:
    """int8 weights (the experts' and the router's `Linear`s too) and bfloat16 (the conv
    histories and the delayed value in bfloat16; the residual stream float32) against
    float32."""
    want_top1, want_own = teacher_forced(tiny_model_dir(MAIN))
    for engine in ({"quantization": "int8"}, {"dtype": "bfloat16"}):
        top1, own = teacher_forced(tiny_model_dir(MAIN), **engine)
        agreement = sum(a == b for a, b in zip(top1, want_top1)) / len(top1)
        assert agreement >= TOP1_AGREEMENT, (engine, agreement)
        assert (own - want_own).abs().mean() <= MEAN_LOGPROB_DIFF, engine
