"""The C++ CPU backend: which op of which family each `torch.ops.vllm_mamba` kernel implements.

The kernels live in `csrc/` and are built, once per ISA level, into the extensions
`vllm_mamba._C_<level>` by `pip install --no-build-isolation -e .`; `cpu_isa.load()` imports
the one this CPU runs, which registers the ops and their schemas (`csrc/bindings.cpp` and the
`TORCH_LIBRARY_FRAGMENT`s next to some kernels). `CPP_OPS` names each kernel once, with the
family op it implements; its Python wrapper is made from the loaded schema and the op's
reference (`cpp_wrapper`): the reference's parameters, names and defaults, passed to the kernel
in the schema's order (float and int scalars converted; `CppOp.args` where the schema splits a
parameter), so a schema that drifts from the reference fails at registration. The wrappers are
attributes of this module under the kernel's name (`cpu_kernels.gated_delta_varlen`), and
`register()` registers them as the `cpp` backend's ops (with `linear`, `int8_linear`,
`int4_linear`, `grouped_linear`, `w8a8_linear`, `w4a8_linear`). The kernels copy
non-contiguous activations to contiguous ones themselves; the states are updated in place and
must be contiguous.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vllm_mamba import envs
from vllm_mamba.ops import cpu_isa
from vllm_mamba.ops.families import register_op_impl, registered_families
from vllm_mamba.ops.grouped_linear import grouped_linear_cpp, has_grouped_kernel
from vllm_mamba.ops.int4_linear import has_int4_kernel, int4_linear_cpp
from vllm_mamba.ops.int8_linear import has_int8_kernel, int8_linear_cpp
from vllm_mamba.ops.int_dot_linear import has_int_dot_kernels, w4a8_linear_cpp, w8a8_linear_cpp
from vllm_mamba.ops.linear import block_linear_ref
from vllm_mamba.ops.table import MambaOps, bind_ops

try:
    _EXTENSION_LOADED = cpu_isa.load() is not None  # registers torch.ops.vllm_mamba.*
except OSError:
    _EXTENSION_LOADED = False


@dataclass(frozen=True)
class CppOp:
    """One C++ kernel that implements a family op: `torch.ops.vllm_mamba.<name>`.

    `args` gives the Python expression of each schema argument that is not the reference's
    parameter of the same name; `required` ops must be in the build for `available()`.
    """

    family: str
    op: str
    name: str
    args: Mapping[str, str] = field(default_factory=dict)
    required: bool = True


CPP_OPS: tuple[CppOp, ...] = (
    CppOp("causal_conv1d", "varlen", "causal_conv1d_varlen"),
    CppOp("causal_conv1d", "update", "causal_conv1d_update"),
    CppOp("selective_scan", "varlen", "selective_scan_varlen"),
    CppOp("selective_scan", "update", "selective_state_update"),
    # The recurrence token by token (exact for any chunk_size, which it only checks).
    CppOp("ssd", "chunk_scan_varlen", "ssd_chunk_scan_varlen",
          {"dt_min": "dt_limit[0]", "dt_max": "dt_limit[1]"}),
    CppOp("ssd", "state_update", "ssd_state_update"),
    CppOp("gated_rms_norm", "gated_rms_norm", "gated_rms_norm"),
    CppOp("paged_attention", "reshape_and_cache", "reshape_and_cache"),
    CppOp("paged_attention", "decode", "paged_decode_attention"),
    CppOp("paged_attention", "prefill", "paged_prefill_attention"),
    CppOp("gated_delta", "varlen", "gated_delta_varlen"),
    CppOp("gated_delta", "update", "gated_delta_update"),
    CppOp("gated_delta", "norm_gate", "rms_norm_gated"),
    CppOp("kda", "varlen", "kda_varlen"),
    CppOp("kda", "update", "kda_update"),
    CppOp("kda", "norm_gate", "kda_norm_gate"),
    CppOp("mla", "cache_write", "mla_cache_write"),
    CppOp("mla", "decode_attention", "mla_decode_attention"),
    CppOp("mla", "prefill_attention", "mla_prefill_attention"),
    CppOp("short_conv", "update", "short_conv_update"),
    CppOp("short_conv", "varlen", "short_conv_varlen"),
    CppOp("rwkv7", "varlen", "rwkv7_varlen"),
    CppOp("rwkv7", "update", "rwkv7_update"),
    CppOp("rwkv7", "shift_mix", "rwkv7_shift_mix"),
    CppOp("rwkv7", "fused_update", "rwkv7_fused_update"),
    # Weight-streaming stages up to 8 rows, GEMMs above (`csrc/fused_decode_rwkv7.cpp`).
    CppOp("rwkv7", "decode_layer", "fused_rwkv7_decode"),
    CppOp("mlstm", "varlen", "mlstm_varlen"),
    CppOp("mlstm", "update", "mlstm_update"),
    CppOp("rglru", "varlen", "rglru_varlen"),
    CppOp("rglru", "update", "rglru_update"),
    CppOp("dynamic_conv", "varlen", "dynamic_conv_varlen"),
    CppOp("dynamic_conv", "update", "dynamic_conv_update"),
    CppOp("cca", "conv_varlen", "cca_conv_varlen"),
    CppOp("cca", "conv_update", "cca_conv_update"),
    CppOp("rwkv4", "varlen", "rwkv4_varlen"),
    CppOp("rwkv4", "update", "rwkv4_update"),
    # `csrc/fused_decode_mamba*.cpp`; the layers run unfused without them.
    CppOp("fused_decode", "mamba", "fused_mamba_decode", required=False),
    CppOp("fused_decode", "mamba2", "fused_mamba2_decode", required=False),
    # `csrc/fused_decode_gdn.cpp` (a Gated DeltaNet block), `fused_decode_short_conv.cpp`
    # (LFM2's), `fused_decode_attention.cpp` (an attention block), `fused_decode_ffn.cpp` (a
    # feed-forward stage: dense MLP, MoE); the layers run unfused without them.
    CppOp("gated_delta", "decode_layer", "fused_gdn_decode", required=False),
    CppOp("gated_delta", "chain_replay", "gdn_chain_replay", required=False),
    CppOp("kda", "decode_layer", "fused_kda_decode", required=False),  # `fused_decode_kda.cpp`
    CppOp("short_conv", "decode_layer", "fused_short_conv_decode", required=False),
    CppOp("paged_attention", "decode_layer", "fused_attention_decode", required=False),
    CppOp("ffn", "mlp_decode", "fused_mlp_decode", required=False),
    CppOp("ffn", "moe_decode", "fused_moe_decode", required=False),
    CppOp("ffn", "moe_experts", "moe_experts", required=False),  # `csrc/moe_experts.cpp`
    # `csrc/hyper_connection.cpp`: GLM-5-Next's mHC weights (the reference without it).
    CppOp("hyper_connection", "mhc_weights", "mhc_weights", required=False),
    # `csrc/argmax.cpp`: the greedy sampler's argmax (torch's without it).
    CppOp("sampling", "argmax_rows", "argmax_rows", required=False),
)  # fmt: skip
# The kernels Python calls by name outside the families: `linear`'s, the int8 / 4-bit / grouped
# linear wrappers' (`vllm_mamba.ops.int8_linear`, `int4_linear`, `grouped_linear`,
# `int_dot_linear`), the Q4_K-style quantiser (`vllm_mamba.ops.q4k`) and the build's switches.
LINEAR_OPS = ("linear_small_batch", "bf16_linear", "bf16_gemm_linear")
OTHER_OPS = (
    "int8_linear",
    "int4_linear",
    "grouped_linear",
    "w8a8_linear",
    "w4a8_linear",
    "int_dot_instruction",
    "q4k_quantize",
    "native_bf16",
    "amx_int8",
    "set_flush_denormal_all_threads",
)
SMALL_BATCH = 8  # rows up to which `linear` streams the weight with the matrix-vector kernel
BF16_GEMM_ROWS = 32  # bfloat16 rows up to which `linear` takes `bf16_gemm_linear` (kMaxRows)


def library_ops() -> frozenset[str]:
    """The names of the ops the loaded build registers under `torch.ops.vllm_mamba` (from
    their schemas); empty without a build."""
    if not _EXTENSION_LOADED:
        return frozenset()
    prefix = "vllm_mamba::"
    schemas = torch._C._jit_get_all_schemas()
    return frozenset(s.name[len(prefix) :] for s in schemas if s.name.startswith(prefix))


def available() -> bool:
    """Whether the extension is built and registers every required op.

    Returns:
        True when a kernel build (`cpu_isa`) imports and `torch.ops.vllm_mamba` has every
        required op of `CPP_OPS` and `LINEAR_OPS`.
    """
    required = [op.name for op in CPP_OPS if op.required] + list(LINEAR_OPS)
    return _EXTENSION_LOADED and all(hasattr(torch.ops.vllm_mamba, name) for name in required)


def _missing(name: str) -> Callable[..., Any]:
    """A stand-in for kernel `name` where the build lacks it: calling it raises."""

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torch.ops.vllm_mamba.{name} is not in the loaded C++ extension")

    missing.__name__ = missing.__qualname__ = name
    return missing


def cpp_wrapper(op: CppOp, ref: Callable[..., Any]) -> Callable[..., Any]:
    """A Python function with `ref`'s parameters that calls kernel `op` (see the module).

    Raises:
        TypeError: a schema argument that is not one of `ref`'s parameters, a parameter of
            `ref` that the schema does not take, or a schema default that is not `ref`'s.
    """
    schema = getattr(torch.ops.vllm_mamba, op.name).default._schema
    params = inspect.signature(ref).parameters
    call = []
    for arg in schema.arguments:
        expr = op.args.get(arg.name, arg.name)
        if arg.name not in op.args and arg.name not in params:
            raise TypeError(f"{op.name}: schema argument {arg.name!r} is no parameter of {ref}")
        param = params.get(arg.name)
        if param is None:
            kind = str(arg.type)
        else:  # an annotation is a string under `from __future__ import annotations`
            kind = param.annotation
            kind = kind if isinstance(kind, str) else getattr(kind, "__name__", "")
        call.append(f"{kind}({expr})" if kind in ("float", "int") else expr)
        if param is not None and arg.has_default_value():
            if param.default is param.empty or param.default != arg.default_value:
                raise TypeError(f"{op.name}: default of {arg.name!r} differs from {ref.__name__}'s")
    used = set(re.findall(r"\w+", " ".join(call)))
    unused = [p for p in params if p not in used]
    if unused:
        raise TypeError(f"{op.name}: the schema takes no {unused} of {ref.__name__}")
    defaults = {f"_d_{p.name}": p.default for p in params.values() if p.default is not p.empty}
    signature = ", ".join(
        f"{p.name}=_d_{p.name}" if p.default is not p.empty else p.name for p in params.values()
    )
    source = f"def {op.name}({signature}):\n    return _kernel({', '.join(call)})\n"
    namespace: dict[str, Any] = {"_kernel": getattr(torch.ops.vllm_mamba, op.name), **defaults}
    exec(source, namespace)  # the source is made from the schema and the reference only
    fn = namespace[op.name]
    fn.__module__, fn.__qualname__ = __name__, op.name
    fn.__doc__ = f"`torch.ops.vllm_mamba.{op.name}`: the C++ kernel of `{ref.__name__}`."
    fn.__signature__ = inspect.signature(ref)
    return fn


def _wrappers() -> dict[str, Callable[..., Any]]:
    """The wrapper of every kernel of `CPP_OPS` (a raising stand-in where the build lacks it)."""
    families = registered_families()
    made = {}
    for op in CPP_OPS:
        if _EXTENSION_LOADED and hasattr(torch.ops.vllm_mamba, op.name):
            made[op.name] = cpp_wrapper(op, families[op.family].ops[op.op].ref)
        else:
            made[op.name] = _missing(op.name)
    return made


globals().update(_wrappers())


def register() -> None:
    """Registers the kernels of `CPP_OPS` the build has, `linear`, and the int8 / 4-bit /
    grouped / integer-dot kernels where built, as the `cpp` backend's ops."""
    for op in CPP_OPS:
        if hasattr(torch.ops.vllm_mamba, op.name):
            register_op_impl(op.family, "cpp", **{op.op: globals()[op.name]})
    register_op_impl("linear", "cpp", linear=linear, block_linear=block_linear)
    if has_int8_kernel():
        register_op_impl("linear", "cpp", int8_linear=int8_linear_cpp)
    if has_int4_kernel():
        register_op_impl("linear", "cpp", int4_linear=int4_linear_cpp)
    if has_grouped_kernel():
        register_op_impl("linear", "cpp", grouped_linear=grouped_linear_cpp)
    if has_int_dot_kernels():
        register_op_impl("linear", "cpp", w8a8_linear=w8a8_linear_cpp, w4a8_linear=w4a8_linear_cpp)


@functools.cache
def native_bf16() -> bool:
    """Whether the loaded kernel build multiplies bfloat16 natively (AVX512-BF16 or AMX, in the
    avx512 build only): then bfloat16 GEMMs run as bfloat16, else widened to float32."""
    return _EXTENSION_LOADED and bool(torch.ops.vllm_mamba.native_bf16())


def flush_denormals() -> None:
    """Flushes denormal floats to zero on this thread and on every thread of torch's intra-op
    pool (`csrc/denormals.cpp`); without the extension, on this thread and later threads."""
    torch.set_flush_denormal(True)
    if _EXTENSION_LOADED and hasattr(torch.ops.vllm_mamba, "set_flush_denormal_all_threads"):
        torch.ops.vllm_mamba.set_flush_denormal_all_threads(True)


@functools.cache
def _has_bf16_gemm() -> bool:
    """Whether `bf16_gemm_linear` is built and this CPU multiplies bfloat16 natively."""
    return native_bf16() and "bf16_gemm_linear" in library_ops()


def _onednn_linear_available() -> bool:
    """Whether torch has oneDNN's linear op, unless `VLLM_MAMBA_ONEDNN_LINEAR=0`."""
    if not envs.VLLM_MAMBA_ONEDNN_LINEAR:
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN_LINEAR = _onednn_linear_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x (..., K) @ weight (N, K)^T + bias` -> `(..., N)`, by the fastest path for the shape.

    Up to `SMALL_BATCH` rows (decode) the C++ kernel `linear_small_batch` streams the weight
    once at close to memory speed. More float32 rows (prefill, many-stream decode: bound by
    compute) go through oneDNN's float32 GEMM (`mkldnn._linear_pointwise`, full float32
    precision), which reached 2.3x the rate of `F.linear`'s MKL GEMM on the AMD CPUs measured
    (`benchmarks/README.md`). bfloat16 weights on a CPU without bfloat16 instructions
    (`native_bf16`) go through `bf16_linear`, which widens them to float32 in registers or
    blocks instead of `F.linear`'s slow bfloat16 path there; on a CPU with them, bfloat16 rows
    up to `BF16_GEMM_ROWS` (no bias) through `bf16_gemm_linear` (`csrc/bf16_gemm.h`: the
    weight read in place, where `F.linear`'s bfloat16 GEMM reorders it at every call). Other
    dtypes, devices and autograd use `F.linear`.
    """
    on_cpu = x.device.type == "cpu" and not torch.is_grad_enabled() and weight.is_contiguous()
    if (
        on_cpu
        and x.dim() == 2
        and x.shape[0] <= SMALL_BATCH
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype in (torch.float32, torch.bfloat16)
    ):
        return torch.ops.vllm_mamba.linear_small_batch(x, weight, bias)
    if on_cpu and x.dim() == 2 and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16:
        if bias is None and x.shape[0] <= BF16_GEMM_ROWS and _has_bf16_gemm():
            return torch.ops.vllm_mamba.bf16_gemm_linear(x, weight)
    if (
        on_cpu
        and x.dim() == 2
        and weight.dtype == torch.bfloat16
        and x.dtype in (torch.float32, torch.bfloat16)
        and not native_bf16()
    ):
        return torch.ops.vllm_mamba.bf16_linear(x, weight, bias)
    if (
        _ONEDNN_LINEAR
        and on_cpu
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.numel() > 0
    ):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`block_linear_ref` (`x (T, G K)`, block-diagonal `weight (G, N, K)`, `bias (G, N)`) ->
    `(T, G N)`. Up to `SMALL_BATCH` rows the C++ kernel `linear_small_batch` streams the
    blocks once and sums each row exactly as alone (a speculative chain's rows equal the
    tokens decoded one by one); more rows, one batched matmul."""
    if (
        x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and weight.is_contiguous()
        and x.dim() == 2
        and x.shape[0] <= SMALL_BATCH
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype in (torch.float32, torch.bfloat16)
    ):
        return torch.ops.vllm_mamba.linear_small_batch(x, weight, bias)
    return block_linear_ref(x, weight, bias)


GEMM_ROWS = 512  # rows of one oneDNN call, at most (`csrc/onednn_linear.h`: kGemmRows)


def gemm_rows(m: int) -> int:
    """The rows one oneDNN call runs for `m` rows (1 <= m <= GEMM_ROWS): up to 32 a multiple
    of 8, above four sizes per doubling (m in (2^j, 2^(j+1)] rounds up to a multiple of
    2^(j-2)). The same rule as `gemm_rows` in `csrc/onednn_linear.h`."""
    if m <= 32:
        return -(-m // 8) * 8
    step = 1 << max(0, (m - 1).bit_length() - 3)
    return -(-m // step) * step


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """oneDNN's float32 GEMM on a bounded set of row counts.

    oneDNN JIT-compiles a primitive for every distinct row count and caches it twice (its
    primitive cache and ideep's, 1,024 entries each, about 0.6 MB per shape whatever the
    weight's size); with a row count that changes with every step's batch, a server's RSS grew
    for thousands of requests (issue 33's soak). So at most `GEMM_ROWS` rows go in one call,
    padded with zero rows to `gemm_rows(rows)`: 20 shapes per weight, all seen soon, for at most 7
    extra rows up to 32 (where the weight's streaming dominates) and under 25% above; a new shape
    also costs a JIT compile (about 1 ms).
    """
    rows = x.reshape(-1, x.shape[-1])
    parts = []
    for start in range(0, rows.shape[0], GEMM_ROWS):
        part = rows[start : start + GEMM_ROWS]
        m = part.shape[0]
        padded = gemm_rows(m)
        if padded != m:
            part = torch.cat([part, part.new_zeros(padded - m, part.shape[1])])
        parts.append(torch.ops.mkldnn._linear_pointwise(part, weight, bias, "none", [], "")[:m])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def make_ops() -> MambaOps:
    """The ops table of the C++ backend (`bind_ops("cpp")`)."""
    return bind_ops("cpp")
