"""The bandwidth bound of single-stream decode: weight bytes one decode step reads, over the
machine's measured read rate.

A b1 decode step reads every weight of the model once (the token embedding only as one row,
so it is left out, unless the output head is tied to it and reads all of it); at the rate a
large `x.sum()` streams memory, that gives the tokens/s no system can pass at those bytes per
weight. Used by `hybrid_bench.py` and `gguf_bench.py` to print the bound beside each b1 row.

- `read_rate(threads)`: bytes/s of `x.sum()` over a tensor far larger than the caches,
  median of several passes, at `threads` threads.
- `module_bytes_per_token(model)`: bytes a decode step reads from a `torch.nn.Module` (this
  engine's model or transformers').
- `gguf_bytes_per_token(path)`: the same from a GGUF file's tensor bytes.

MoE expert tensors count `top_k / num_experts` of their bytes (the experts one token chooses).
"""

from __future__ import annotations

import bisect
import time

import torch
from torch import nn

READ_BYTES = 512 * 2**20  # the summed tensor: far beyond any L3 cache
READ_PASSES = 7


def read_rate(threads: int, nbytes: int = READ_BYTES, passes: int = READ_PASSES) -> list[float]:
    """Bytes/s of `x.sum()` over a float32 tensor of `nbytes`, one value per pass (the first,
    untimed pass faults the pages in), at `threads` threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4)  # [nbytes / 4] float32
        float(x.sum())
        rates = []
        for _ in range(passes):
            start = time.perf_counter()
            float(x.sum())
            rates.append(nbytes / (time.perf_counter() - start))
        return rates
    finally:
        torch.set_num_threads(before)


def _moe_fraction(config: object) -> float:
    """`top_k / num_experts` of a transformers config (1.0 without experts)."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        experts = next(
            (getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
             if getattr(cfg, k, None)),
            None,
        )  # fmt: skip
        top_k = next(  # Kimi Linear's released config names it `num_experts_per_token`
            (getattr(cfg, k) for k in ("num_experts_per_tok", "num_experts_per_token")
             if getattr(cfg, k, None)),
            None,
        )  # fmt: skip
        if experts and top_k:
            return top_k / experts
    return 1.0


def module_bytes_per_token(model: nn.Module, config: object = None) -> int:
    """Bytes of `model`'s parameters and persistent buffers that one decode step reads, each
    tensor once (tensors are keyed by their first byte and size, not their storage: the engine
    packs many weights into one huge-page arena, and stacks MoE experts into one tensor whose
    rows the experts' weights view): tensors only `nn.Embedding` modules hold (a lookup reads
    one row) are left out; a tied output head shares the embedding's tensor and so counts it.
    Tensors under a module path containing `experts` (not `shared_expert`) count
    `top_k / num_experts` of their bytes, from `config` (default `model.config`); a tensor those
    experts' weights view (their stacked copy for the fused MoE decode) is not counted again."""
    fraction = _moe_fraction(config if config is not None else getattr(model, "config", None))
    holders: dict[tuple[int, int], list[tuple[str, nn.Module]]] = {}  # tensor -> users
    for module_name, module in model.named_modules():
        persistent = [
            (n, b) for n, b in module.named_buffers(recurse=False)
            if n not in module._non_persistent_buffers_set
        ]  # fmt: skip
        for name, tensor in [*module.named_parameters(recurse=False), *persistent]:
            if tensor is None or tensor.device.type == "meta":
                continue
            key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            holders.setdefault(key, []).append((f"{module_name}.{name}", module))

    def is_routed(users: list[tuple[str, nn.Module]]) -> bool:
        return all("experts" in n and "shared_expert" not in n for n, _ in users)

    # A stacked tensor that the routed experts' weights view (held by a decode plan, under a
    # name without `experts`) is read through those views: counted there, not again whole.
    routed_ptrs = sorted(ptr for (ptr, _), users in holders.items() if is_routed(users))
    total = 0.0
    for (ptr, nbytes), users in holders.items():
        if all(isinstance(m, nn.Embedding) for _, m in users):
            continue
        routed = is_routed(users)
        first = bisect.bisect_left(routed_ptrs, ptr)
        if not routed and first < len(routed_ptrs) and routed_ptrs[first] < ptr + nbytes:
            continue
        total += nbytes * (fraction if routed else 1.0)
    return int(total)


def gguf_bytes_per_token(path: str) -> int:
    """Bytes of a GGUF file's tensors one decode step reads: all but `token_embd.weight`
    (counted when there is no `output.weight`, the head tied to it); `*_exps` expert tensors
    count `expert_used_count / expert_count` of their bytes."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field(key: str) -> int | None:
        f = reader.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else None

    experts, used = field("expert_count"), field("expert_used_count")
    fraction = used / experts if experts and used else 1.0
    names = {t.name for t in reader.tensors}
    total = 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        total += int(t.n_bytes) * (fraction if "_exps" in t.name else 1.0)
    return int(total)


def bound_line(name: str, bytes_per_token: int, rate: float, measured: float) -> str:
    """A markdown row: system, MiB/token, GB/s, bound tok/s, measured b1 and its share."""
    bound = rate / bytes_per_token
    return (
        f"| {name} | {bytes_per_token / 2**20:,.1f} | {rate / 1e9:.1f} | {bound:,.1f} "
        f"| {measured:,.1f} | {100 * measured / bound:.0f}% |"
    )


BOUND_HEAD = (
    "| system | weight MiB/token | read GB/s | bound tok/s | b1 tok/s | share of bound |\n"
    "|---|---|---|---|---|---|"
)
