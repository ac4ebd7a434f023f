"""KV memory one sequence holds, by layer kind, at several context lengths, for models with
sliding-window attention: what the engine's KV groups (`kv_cache.plan_kv_groups`) and block
manager (`engine.block_manager`) keep, against a cache that keeps every token.

The model is built from its released configuration on the meta device (no weights, nothing
run): its attention layers' KV specs are the engine's own (`KVCacheLayer.kv_spec`), and the
sequence is walked through a `BlockManager` as the scheduler does (prefill in chunks of
`--chunk` tokens, then one decode step), so the figures are the engine's accounting, not a
formula. Also printed: the recurrent state bytes per sequence (`state_spec`).

    python benchmarks/sliding_kv_memory.py --arch lfm3 --contexts 4096,32768
    python benchmarks/sliding_kv_memory.py --arch recurrent_gemma   # or zaya, inkling
"""

from __future__ import annotations

import argparse
import math

import torch
import transformers

from vllm_mamba.cache_specs import AttentionSpec
from vllm_mamba.engine.block_manager import BlockManager
from vllm_mamba.kv_cache import plan_kv_groups
from vllm_mamba.layers.cache_layers import kv_cache_layers, stateful_layers
from vllm_mamba.models.registry import ModelRegistry
from vllm_mamba.ops.dispatch import REF_OPS

CONFIGS = {  # --arch: transformers config class and the released checkpoint's keyword arguments
    "lfm3": ("Lfm3Config", {}),  # transformers' defaults are LFM3-1.7B's
    # recurrentgemma-2b's: transformers' defaults but for its one key/value head
    "recurrent_gemma": ("RecurrentGemmaConfig", {"num_key_value_heads": 1}),
    "zaya": ("ZayaConfig", {}),  # transformers' defaults are ZAYA1-8B's
    # Inkling's text model (transformers' defaults: 55 sliding layers of 16 KV heads, 11 full of
    # 8, which share padded tensors)
    "inkling": ("InklingTextConfig", {}),
}
ARCHS = {
    "lfm3": "Lfm3ForCausalLM",
    "recurrent_gemma": "RecurrentGemmaForCausalLM",
    "zaya": "ZayaForCausalLM",
    "inkling": "InklingForCausalLM",
}


def held_bytes(specs: list, context: int, block_size: int, chunk: int) -> dict[str, int]:
    """KV bytes one sequence of `context` tokens holds, sliding and full groups apart: a block
    of a group is a block in each of the pool's tensor sets (a group short of layers leaves
    one unused, as the pool does)."""
    groups = plan_kv_groups(specs)
    blocks = BlockManager(10**7, block_size, groups.windows)
    done = 0
    while done < context:
        num = min(chunk, context - done)
        blocks.allocate(0, done, num)
        done += num
    blocks.allocate(0, done, 1)  # the next decode step
    table = blocks.block_table(0)
    per_block = block_size * sum(s.bytes_per_token() for s in groups.tensor_specs)
    held = {"sliding": 0, "full": 0}
    for g, window in enumerate(groups.windows):
        live = sum(1 for b in table[g :: groups.num_groups] if b >= 0)
        held["full" if window is None else "sliding"] += live * per_block
    return held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=sorted(CONFIGS), default="lfm3")
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = p.parse_args()
    cls_name, overrides = CONFIGS[args.arch]
    config = getattr(transformers, cls_name)(**overrides)
    dtype = getattr(torch, args.dtype)
    model_cls, _ = ModelRegistry.resolve_model_cls(ARCHS[args.arch])
    with torch.device("meta"):
        model = model_cls(config, REF_OPS)
    specs = [layer.kv_spec(dtype) for layer in kv_cache_layers(model)]
    state = sum(
        layer.state_spec().resolve(dtype, None).bytes_per_slot() for layer in stateful_layers(model)
    )
    windows = [s.sliding_window for s in specs if isinstance(s, AttentionSpec)]
    print(
        f"{args.arch}: {len(specs)} attention layers ({sum(w is not None for w in windows)} "
        f"sliding, windows {sorted({w for w in windows if w})}), KV in {args.dtype}, blocks of "
        f"{args.block_size}, prefill chunks of {args.chunk}; recurrent state "
        f"{state / 2**20:.2f} MiB per sequence"
    )
    print("| context | sliding layers | full layers | all layers | every token kept |")
    print("|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        held = held_bytes(specs, context, args.block_size, args.chunk)
        every = sum(s.bytes_per_token() for s in specs) * args.block_size
        every *= math.ceil((context + 1) / args.block_size)
        mib = {k: v / 2**20 for k, v in held.items()}
        print(
            f"| {context} | {mib['sliding']:.1f} MiB | {mib['full']:.1f} MiB | "
            f"{mib['sliding'] + mib['full']:.1f} MiB | {every / 2**20:.1f} MiB |"
        )


if __name__ == "__main__":
    main()
