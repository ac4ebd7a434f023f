"""Engine configuration: the model (from its Hugging Face config), scheduler and state cache."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_mamba.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:  # torch is imported when a dtype is resolved: the CLI's parsers load none
    import torch

    from vllm_mamba.multimodal.config import MultiModalConfig

DEFAULT_SNAPSHOT_INTERVAL = 512  # prompt tokens between prefix-cache snapshots
DEFAULT_PREFIX_CACHE_MEMORY_BYTES = 1 << 30  # the snapshot slots' budget

_DTYPE_NAMES = {  # name -> the torch dtype's attribute
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
DTYPE_CHOICES = ("auto", *_DTYPE_NAMES)
STATE_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# Load-time quantisation: int8 / int4 weight-only; w8a8 / w4a8 the same weights multiplied with
# activations quantised to int8 blocks (integer dot products, `vllm_mamba.ops.int_dot_linear`);
# w4a8_k as w4a8 with the 4-bit weights in the Q4_K-style layout (`vllm_mamba.ops.q4k`).
QUANTIZATION_CHOICES = ("int8", "int4", "w8a8", "w4a8", "w4a8_k")
ONE_RANK_QUANTIZATION = ("int4", "w4a8", "w4a8_k")  # 4-bit weights: tensor_parallel_size 1 only
DEFAULT_MAX_MODEL_LEN = 2048


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any) -> torch.dtype:
    """Turns `auto` or a dtype name into a torch dtype.

    Args:
        dtype: `auto`, `float32`, `bfloat16`, `float16` (or a torch dtype).
        hf_config: the model's config; `auto` takes its `torch_dtype` (float32 when unset).

    Returns:
        The torch dtype to run in.
    """
    import torch

    dtypes = _dtypes()
    if isinstance(dtype, torch.dtype):
        if dtype not in dtypes.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(config_dtype, str):
            config_dtype = dtypes.get(config_dtype)
        return config_dtype if config_dtype in dtypes.values() else torch.float32
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16, float16")
    return dtypes[dtype]


def _dtypes() -> dict[str, torch.dtype]:
    """Each dtype name's torch dtype."""
    import torch

    return {name: getattr(torch, attr) for name, attr in _DTYPE_NAMES.items()}


def resolve_state_dtype(name: str) -> torch.dtype | None:
    """`auto` (None: the model's choice) or a dtype name for the SSM state."""
    if name == "auto":
        return None
    if name not in STATE_DTYPE_CHOICES:
        raise ValueError(
            f"ssm_state_dtype {name!r} is not supported; "
            f"use one of {', '.join(STATE_DTYPE_CHOICES)}"
        )
    return _dtypes()[name]


def record_quantization(hf_config: Any, quantization: str | None) -> None:
    """Records a load-time quantisation in the model's config, where the loader reads it.

    It goes in `quantization_config` (`{"quant_method": "int8"}`), the field transformers sets
    on a model it quantises while loading; every process that builds the model gets it with
    the config.

    A checkpoint that ships quantised weights the engine reads (FP8 with block scales,
    `models.prequantized`) keeps its own record under `checkpoint_quantization`: it is read as
    float weights and quantised again.

    Raises:
        ValueError: `quantization` is not supported, or the checkpoint is pre-quantised in a
            format the engine does not read.
    """
    from vllm_mamba.models.prequantized import checkpoint_method

    shipped = checkpoint_method(hf_config)  # refuses a pre-quantised format it cannot read
    if quantization is None:
        return
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization {quantization!r} is not supported; use one of "
            f"{', '.join(QUANTIZATION_CHOICES)}, or leave it unset for float weights"
        )
    record: dict[str, Any] = {"quant_method": quantization}
    if shipped is not None:  # read as float (FP8 blocks dequantised), then quantised again
        record["checkpoint_quantization"] = hf_config.quantization_config
    hf_config.quantization_config = record


def recorded_quantization(hf_config: Any) -> str | None:
    """The load-time quantisation `record_quantization` put in the config, or None."""
    existing = getattr(hf_config, "quantization_config", None)
    method = existing.get("quant_method") if isinstance(existing, dict) else None
    return method if method in QUANTIZATION_CHOICES else None


def resolve_device(device: str | torch.device) -> torch.device:
    """`auto` picks CUDA when a GPU is present, else the CPU."""
    import torch

    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return resolved


def text_config(hf_config: Any) -> Any:
    """The language model's config: `text_config` of an image-text config, else the config."""
    sub = getattr(hf_config, "text_config", None)
    return sub if sub is not None else hf_config


def derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    """The longest prompt plus output a sequence may have."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"max_model_len must be >= 1, got {requested}")
        return requested
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(text_config(hf_config), key, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_MAX_MODEL_LEN


# generation_config.json keys that set sampling defaults, and their SamplingParams names.
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(source: str, model_path: str) -> dict[str, Any]:
    """The sampling defaults of a `generation_config.json` (vLLM's `--generation-config`).

    Args:
        source: `auto` (the model directory's file), `vllm` (no defaults) or a directory.
        model_path: the model's local directory.

    Returns:
        `SamplingParams` keyword arguments for the keys the file sets.

    Raises:
        ValueError: a directory without a readable `generation_config.json`.
    """
    if source == "vllm":
        return {}
    folder = model_path if source == "auto" else source
    file = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(file):
        if source == "auto":
            return {}
        raise ValueError(f"generation_config {source!r} has no generation_config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"generation_config: cannot read {file}: {err}") from err
    defaults = {
        ours: raw[key] for key, ours in _GENERATION_KEYS.items() if raw.get(key) is not None
    }
    if defaults.get("top_k") == 0:  # transformers' "no top-k"
        del defaults["top_k"]
    return defaults


@dataclass
class ModelConfig:
    """What is loaded and how: the resolved local path, its HF config, dtype and limits."""

    model: str
    path: str
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    tokenizer: str
    seed: int = 0
    served_model_name: list[str] | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    quantization: str | None = None

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding (may exceed the tokenizer's vocabulary)."""
        return int(text_config(self.hf_config).vocab_size)


@dataclass
class SchedulerConfig:
    """Per-step limits: sequences in flight and tokens in one forward."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass
class CacheConfig:
    """The paged KV cache of hybrid models (attention-free models have none).

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_bytes: the pool's byte budget (None: the default share of memory,
            see `vllm_mamba.kv_cache`).
        num_gpu_blocks_override: an exact block count, which wins over any budget.
        enable_prefix_caching: keep state snapshots of prefixes for reuse.
        prefix_cache_memory_bytes: bytes of the snapshot slots (each holds one sequence's
            conv and SSM states of every layer).
        prefix_snapshot_interval: long prompts are also saved every this many tokens.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = False
    prefix_cache_memory_bytes: int = DEFAULT_PREFIX_CACHE_MEMORY_BYTES
    prefix_snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass
class ParallelConfig:
    """Tensor parallelism: how many ranks share each layer, and what runs them.

    Attributes:
        tensor_parallel_size: ranks (processes, one device each) that split every layer.
        distributed_executor_backend: `mp` (worker processes on this machine) or `ray`
            (Ray actors, across the machines of a Ray cluster).
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"


@dataclass
class EngineConfig:
    """Everything the engine needs to start."""

    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    enforce_eager: bool = False
    ssm_state_dtype: torch.dtype | None = None
    log_stats: bool = True
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    cpu_threads: int | None = None  # None: the available CPUs (`worker/cpu_threads.py`)
    multimodal: MultiModalConfig | None = None  # None: the model serves no images

    def ranks_per_machine(self) -> int:
        """Tensor-parallel ranks sharing this machine's CPUs (Ray spreads them: one)."""
        pc = self.parallel_config
        return pc.tensor_parallel_size if pc.distributed_executor_backend == "mp" else 1

    @property
    def uses_mtp(self) -> bool:
        """Speculative decoding with the model's own MTP head (it is built and loaded)."""
        return self.speculative_config is not None and self.speculative_config.method == "mtp"

    @property
    def num_state_slots(self) -> int:
        """One state slot per sequence that may run at once."""
        return self.scheduler_config.max_num_seqs
