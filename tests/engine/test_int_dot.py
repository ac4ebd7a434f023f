"""`quantization="w8a8"` / `"w4a8"` / `"w4a8_k"`: integer dot products in the engine.

- End to end against transformers: the same checkpoint with the quantised weights replaced by
  their dequantised values (`_dequantised_checkpoint`), and each `Linear` that the engine runs
  with integer dots fed its input quantised to int8 blocks of 32 and back (a forward pre-hook,
  the Q8_0 formula written here). Teacher-forced: the same top-1 token at every position and
  log-probabilities within `LOGPROB_ATOL`.
- The fused decode layers (Mamba, Mamba2) against the unfused ones (`VLLM_MAMBA_FUSED_DECODE=0`).
- Which layers take integer dots (K not a multiple of 32: weight-only int8), the report, the
  refusal of tensor parallelism for w4a8, the CLI flag, the reference ops.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.engine.test_int8 import MODELS, _dequantised_checkpoint, _sequences, _teacher_forced
from tests.helpers.runners import HfRunner, VllmRunner
from tests.ops.test_fused_decode import _generate
from tests.ops.test_fused_decode import fused_calls as fused_calls  # a fixture, used by name
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.config import record_quantization
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.quantization import quantize_model, uses_int_dot
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.ops.dispatch import get_mamba_ops

# Two paths round the same float32 values in different orders (log-probabilities within 4e-6
# here), and an input at a rounding boundary of its int8 block may then take the next code: one
# step (d = max|x| / 127) of one activation, times weights of N(0, 0.3^2) in these random tiny
# models. Measured: one position in 57 moved by 2.5e-3 (engine vs transformers, w4a8,
# mamba-tied, generic build) and one in 54 by 0.029 (fused vs unfused, w4a8, tied, avx512);
# every other position within 4e-6. So: every position within FLIP_ATOL, all but FLIPS of them
# within LOGPROB_ATOL (of generated tokens: all but FLIPS sequences, below).
LOGPROB_ATOL = 1e-4
FLIP_ATOL = 0.1
FLIPS = 2


def assert_generated_within_flips(got_lp: list[list[float]], want_lp: list[list[float]]) -> None:
    """Two paths' generated log-probabilities, sequence by sequence: every position within
    FLIP_ATOL, and at most FLIPS sequences with a position past LOGPROB_ATOL. A flipped
    activation changes the state and cache that every later position of its sequence reads, so
    a flip is counted once per sequence (measured, qwen3_5-gqa w4a8_k fused vs unfused over 12
    prompt seeds: 34 of 1,008 positions past LOGPROB_ATOL, in runs after a sequence's first
    flip, 13 positions of one sequence in one seed; the same 35 with the attention kernel's
    scores summed in another order)."""
    flipped = 0
    for x, y in zip(got_lp, want_lp, strict=True):
        diff = [abs(a - b) for a, b in zip(x, y, strict=True)]
        assert max(diff, default=0.0) <= FLIP_ATOL
        flipped += any(d > LOGPROB_ATOL for d in diff)
    assert flipped <= FLIPS


def _q8(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) quantised to int8 per block of 32 (scale max|x| / 127, round half to even)
    and back, in x's dtype."""
    blocks = x.float().unflatten(-1, (-1, 32))  # (..., K / 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1.0)), 0.0)
    return (q.clamp(-127, 127) * d).flatten(-2).to(x.dtype)


def _int_dot_linears(path: str, method: str) -> set[str]:
    """The names of the engine's `Linear`s that take integer dots under `method`."""
    hf_config = load_hf_config(path)
    record_quantization(hf_config, method)
    model, _ = build_model(path, hf_config, torch.float32, torch.device("cpu"))
    return {n for n, m in model.named_modules() if isinstance(m, Linear) and uses_int_dot(m)}


def _fake_quantised_reference(path: str, method: str) -> HfRunner:
    """transformers on the dequantised checkpoint, the int-dot layers' inputs quantised."""
    names = _int_dot_linears(path, method)
    hf = HfRunner(_dequantised_checkpoint(path, method))
    modules = dict(hf.model.named_modules())
    assert names and names <= set(modules), sorted(names - set(modules))
    for name in names:
        modules[name].register_forward_pre_hook(lambda _, args: (_q8(args[0]), *args[1:]))
    return hf


@pytest.mark.parametrize("method", ["w8a8", "w4a8", "w4a8_k"])
@pytest.mark.parametrize("name", ["mamba-tied", "mamba2"])
def test_engine_matches_fake_quantised_transformers(name: str, method: str) -> None:
    path = MODELS[name]()
    seqs = _sequences(50000)
    top_e, lp_e = _teacher_forced(path, seqs, method)
    hf = _fake_quantised_reference(path, method)
    top_r, lp_r = [], []
    for seq in seqs:
        logprobs = hf.logprobs(list(seq))  # (T, V)
        for pos in range(1, len(seq)):
            top_r.append(int(logprobs[pos - 1].argmax()))
            lp_r.append(float(logprobs[pos - 1, seq[pos]]))
    diff = (lp_e - torch.tensor(lp_r, dtype=torch.float64)).abs()
    print(f"{name} {method}: |dlogprob| top {diff.sort(descending=True).values[:6].tolist()}")
    assert top_e == top_r
    assert float(diff.max()) <= FLIP_ATOL and int((diff > LOGPROB_ATOL).sum()) <= FLIPS


@pytest.mark.parametrize("method", ["w8a8", "w4a8", "w4a8_k"])
@pytest.mark.parametrize("name", ["tied", "mamba2-groups"])
def test_fused_decode_equals_unfused(
    name: str,
    method: str,
    monkeypatch: pytest.MonkeyPatch,
    fused_calls: dict[str, int],  # noqa: F811 (the fixture imported above)
) -> None:
    monkeypatch.delenv("VLLM_MAMBA_OPS", raising=False)
    model = tiny_model_dir(name)
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    want, want_lp, planned = _generate(model, method, "auto")
    assert planned is None and fused_calls["fused"] == 0
    monkeypatch.delenv("VLLM_MAMBA_FUSED_DECODE")
    got, got_lp, planned = _generate(model, method, "auto")
    assert planned is not None and fused_calls["fused"] > 0, "the fused kernels did not run"
    assert got == want
    assert_generated_within_flips(got_lp, want_lp)


def test_layers_and_the_weight_only_fallback() -> None:
    with VllmRunner(tiny_model_dir("tied"), quantization="w4a8", max_num_seqs=1) as runner:
        model = runner.engine.model
        mixer = model.backbone.layers[0].mixer
        for linear in (mixer.in_proj, mixer.x_proj, mixer.out_proj):
            assert linear.weight.dtype == torch.uint8 and uses_int_dot(linear)
        assert not uses_int_dot(mixer.dt_proj) and mixer.dt_proj.weight.dtype == torch.float32
        assert model.lm_head.weight.dtype == torch.int8 and uses_int_dot(model.lm_head)
        assert runner.engine.config.model_config.quantization == "w4a8"
    # hidden 48: in_proj's K is not a multiple of 32: int8 weight-only, in the report
    path = tiny_model_dir("untied")
    model, _ = build_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    report = quantize_model(model, get_mamba_ops(torch.device("cpu")), "w8a8")
    mixer = model.backbone.layers[0].mixer
    assert mixer.in_proj.weight.dtype == torch.int8 and not uses_int_dot(mixer.in_proj)
    assert uses_int_dot(mixer.out_proj)
    layers = [f"backbone.layers.{i}.mixer.in_proj" for i in range(3)]
    assert set(report.weight_only) == {*layers, "lm_head"} and not report.int8_fallbacks


def test_w4a8_k_layers_hold_q4k_super_blocks() -> None:
    """Under w4a8_k every 4-bit `Linear` holds the Q4_K-style scale bytes (`ops.q4k`: 16 per
    row and super-block of 256, the last one partial), runs integer dots, and the layers take
    them fused; the LM head stays int8."""
    with VllmRunner(tiny_model_dir("qwen3_5-gqa"), quantization="w4a8_k", max_num_seqs=1) as run:
        model = run.engine.model
        four_bit = [
            m for m in model.modules() if isinstance(m, Linear) and m.weight.dtype == torch.uint8
        ]
        assert len(four_bit) >= 4
        for linear in four_bit:
            n, k = linear.weight.shape[0], 2 * linear.weight.shape[1]
            assert linear.weight_scale.dtype == torch.uint8 and uses_int_dot(linear)
            assert tuple(linear.weight_scale.shape) == (n, -(-k // 256) * 16)
        assert model.lm_head.weight.dtype == torch.int8 and uses_int_dot(model.lm_head)
        assert all(layer.decode_plan is not None for layer in model.layers)


@pytest.mark.parametrize("method", ["w4a8", "w4a8_k"])
def test_4bit_int_dots_with_tensor_parallelism_are_a_value_error(method: str) -> None:
    args = EngineArgs(model=tiny_model_dir("tied"), quantization=method, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2.*{method}"):
        args.create_engine_config()
    with pytest.raises(ValueError, match="quantization 'w4'"):
        EngineArgs(model=tiny_model_dir("tied"), quantization="w4").create_engine_config()


@pytest.mark.parametrize("method", ["w8a8", "w4a8", "w4a8_k"])
def test_cli_flag(method: str) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--quantization", method])
    parsed = EngineArgs.from_cli_args(argparse.Namespace(model="m", **vars(args)))
    assert parsed.quantization == method


def test_reference_ops_run_the_same_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """`VLLM_MAMBA_OPS=ref` (no extension needed): the same tokens as the C++ kernels."""
    path, seqs = MODELS["mamba-tied"](), _sequences(50000)
    top_cpp, lp_cpp = _teacher_forced(path, seqs, "w8a8")
    monkeypatch.setenv("VLLM_MAMBA_OPS", "ref")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with VllmRunner(path, max_num_seqs=4, quantization="w8a8") as runner:
        outs = runner.generate([{"prompt_token_ids": list(s)} for s in seqs], params)
        assert runner.engine.model.lm_head.int8_op.__name__ == "w8a8_linear_ref"
    own = [
        out.prompt_logprobs[p][s[p]].logprob for s, out in zip(seqs, outs) for p in range(1, len(s))
    ]
    diff = (torch.tensor(own, dtype=torch.float64) - lp_cpp).abs()
    assert float(diff.max()) <= FLIP_ATOL and int((diff > LOGPROB_ATOL).sum()) <= FLIPS


def test_rwkv7_layers_with_integer_dots_run_unfused() -> None:
    """The fused RWKV-7 layer's products are weight-only: under w8a8 its layers are unplanned,
    so the engine's integer-dot products are the unfused layers'."""
    with VllmRunner(tiny_model_dir("rwkv7-h64"), quantization="w8a8", max_num_seqs=1) as runner:
        layers = runner.engine.model.layers
        assert all(layer.decode_plan is None for layer in layers)
    with VllmRunner(tiny_model_dir("rwkv7-h64"), quantization="int8", max_num_seqs=1) as runner:
        assert all(layer.decode_plan is not None for layer in runner.engine.model.layers)


@pytest.mark.parametrize(
    ("name", "method"),
    [
        ("qwen3_5-gqa", "w8a8"),
        ("lfm2-gqa", "w4a8"),
        ("qwen3_5-gqa", "w4a8_k"),
    ],
)
def test_fused_hybrid_blocks_equal_unfused(
    name: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hybrids' fused blocks (Gated DeltaNet, short conv, attention, feed-forward) with
    integer dots against their unfused layers: greedy tokens equal, log-probabilities within
    the contract above; every layer of the model planned."""
    from tests.ops.test_fused_attention_decode import _generate as generate

    monkeypatch.delenv("VLLM_MAMBA_OPS", raising=False)
    model = tiny_model_dir(name)
    monkeypatch.setenv("VLLM_MAMBA_FUSED_DECODE", "0")
    want, want_lp = generate(model, method)
    monkeypatch.delenv("VLLM_MAMBA_FUSED_DECODE")
    with VllmRunner(model, quantization=method, max_num_seqs=1) as runner:
        layers = runner.engine.model.layers
        assert all(layer.decode_plan is not None for layer in layers)
        assert all(layer.ffn_plan is not None for layer in layers)
    got, got_lp = generate(model, method)
    assert got == want
    assert_generated_within_flips(got_lp, want_lp)


def test_tied_tables_read_their_rows_from_the_strip_layout() -> None:
    """A tied LM head under w8a8 / w4a8 is stored in strips; the embeddings reading its table
    (`Int8Embedding`, `Int4Embedding`, `VocabParallelEmbedding`) look up the same rows as from
    the plain table, for a vocabulary that is not whole strips."""
    from vllm_mamba.distributed.parallel_state import SINGLE
    from vllm_mamba.layers.parallel_linear import VocabParallelEmbedding
    from vllm_mamba.layers.quantization import Int4Embedding, Int8Embedding
    from vllm_mamba.ops.int4_linear import quantize_int4
    from vllm_mamba.ops.int8_linear import quantize_int8
    from vllm_mamba.ops.int_dot_linear import pack_w4a8, pack_w8a8
    from vllm_mamba.ops.q4k import dequantize_q4k, quantize_q4k

    table = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([36, 0, 17, 15, 16, 36])
    q8, s8 = quantize_int8(table)
    q4, s4 = quantize_int4(table)
    plain8 = Int8Embedding(q8, s8, torch.float32)(ids)
    assert torch.equal(Int8Embedding(pack_w8a8(q8), s8, torch.float32, strips=True)(ids), plain8)
    want4 = Int4Embedding(q4, s4, torch.float32)(ids)
    got4 = Int4Embedding(*pack_w4a8(q4, s4), torch.float32, strips=True)(ids)
    assert torch.equal(got4, want4)
    qk, sk = quantize_q4k(table)  # Q4_K-style: the rows of the dequantised table
    got_k = Int4Embedding(*pack_w4a8(qk, sk), torch.float32, strips=True)(ids)
    assert torch.equal(got_k, dequantize_q4k(qk, sk, torch.float32)[ids])
    vocab = VocabParallelEmbedding(37, 64, SINGLE)
    stored = torch.nn.Parameter(pack_w8a8(q8), requires_grad=False)
    vocab.use_int8_table(stored, s8, torch.float32, strips=True)
    assert torch.equal(vocab(ids), plain8)
