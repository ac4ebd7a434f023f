"""Single-stream decode of a small Kimi-Linear-shaped model with and without the fused KDA layer.

The model (random weights, saved once to `--model`): hidden 2048, `--layers` KDA layers with
Kimi-Linear-48B-A3B's KDA heads (32 heads of 128, conv 4, gate rank 128), dense MLPs of 1024
and a vocabulary of 4096, so the KDA layers' weights are most of what a decode step reads.
Two engines in one process, on exactly `--threads` threads, one with the fused KDA layers and
one without (`VLLM_MAMBA_FUSED_DECODE=0`), run `decode b1` alternately, `--reps` times each:
32 timed decode steps of one sequence after a 16-token prompt. The median and best step of
each are printed (the best is the least disturbed by other processes on a shared machine).

    PYTHONPATH=. python benchmarks/kda_decode_bench.py --threads 2 --reps 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

from hybrid_configs import KIMI_LINEAR_CONFIG

DECODE_STEPS = 32

# Kimi Linear's layout (`hybrid_configs.KIMI_LINEAR_CONFIG`) at hidden 2048 with the
# 48B-A3B release's KDA heads; every layer KDA with a dense MLP (`make_model`).
CONFIG = dict(
    KIMI_LINEAR_CONFIG, vocab_size=4096, hidden_size=2048, intermediate_size=1024,
    linear_num_heads=32, linear_head_dim=128, num_attention_heads=32, num_key_value_heads=32,
)  # fmt: skip
PROMPT = list(range(3, 19))  # 16 prompt tokens


def build(path: str, fused: bool, args: argparse.Namespace):  # noqa: ANN201
    """An `LLM` of one sequence on exactly `args.threads` threads, its KDA layers fused or not
    (`VLLM_MAMBA_FUSED_DECODE`, read when the layers' decode plans are made)."""
    from vllm_mamba import LLM
    from vllm_mamba.layers.decode_plan import planned_layers

    os.environ["VLLM_MAMBA_FUSED_DECODE"] = "1" if fused else "0"
    llm = LLM(
        path, max_model_len=512, max_num_seqs=1, disable_log_stats=True, dtype=args.dtype,
        quantization=args.quantization, threads=args.threads,
    )  # fmt: skip
    step_ms(llm, 2)  # warm-up; the plans are made by now
    plans = [la.decode_plan is not None for la in planned_layers(llm.llm_engine.model)]
    assert plans and all(plans) == fused and any(plans) == fused, plans
    return llm


def step_ms(llm, steps: int) -> list[float]:  # noqa: ANN001
    """Milliseconds of each of `steps` decode steps of one sequence after its prompt."""
    from vllm_mamba import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0)
    engine.add_request("r", PROMPT, params)
    engine.step()  # the prompt and the first token
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
    return times


def make_model(path: str, layers: int) -> None:
    """Saves the random-weight model once (hybrid_bench's tokenizer files beside it)."""
    import torch
    import transformers
    from hybrid_bench import TOKENIZER_DIR

    if not os.path.isfile(os.path.join(path, "config.json")):
        config = dict(
            CONFIG, num_hidden_layers=layers, layer_types=["linear_attention"] * layers,
            mlp_layer_types=["dense"] * layers,
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**config))
        model.save_pretrained(path)
    for file in os.listdir(TOKENIZER_DIR):
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/kimi-kda-bench-random")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    make_model(args.model, args.layers)
    import vllm_mamba

    print(f"vllm_mamba from {os.path.dirname(vllm_mamba.__file__)}")
    llms = {"fused": build(args.model, True, args), "unfused": build(args.model, False, args)}
    times: dict[str, list[float]] = {mode: [] for mode in llms}
    for _ in range(args.reps):
        for mode, llm in llms.items():
            times[mode] += step_ms(llm, DECODE_STEPS)
    for mode, t in times.items():
        median, best = statistics.median(t), min(t)
        print(
            f"decode b1 {mode:8s} median {median:7.2f} ms/step ({1000 / median:6.2f} tok/s), "
            f"best {best:7.2f} ms ({1000 / best:6.2f} tok/s), {len(t)} steps"
        )


if __name__ == "__main__":
    main()
