"""`EngineArgs`: every engine option, once, with its type, default, help and choices.

`LLM(model, **kwargs)`, `LLMEngine.from_engine_args`, and the `serve`, `generate` and `bench`
commands all build their engine from it: `add_cli_args(parser)` registers one flag per field
(vLLM's names), `from_cli_args(args)` reads them back, `create_engine_config()` resolves the
model and validates every value (a `ValueError` naming the option, or a `FileNotFoundError`
for a model that is not there).

Options that vLLM has and that change nothing here (`trust_remote_code`,
`gpu_memory_utilization` on the CPU, `tensor_parallel_size=1`) are accepted with one warning.
`tensor_parallel_size` N > 1 runs N ranks (`distributed_executor_backend`: `mp` or `ray`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_mamba.config import (
    DEFAULT_PREFIX_CACHE_MEMORY_BYTES,
    DEFAULT_SNAPSHOT_INTERVAL,
    DTYPE_CHOICES,
    EXECUTOR_BACKENDS,
    ONE_RANK_QUANTIZATION,
    QUANTIZATION_CHOICES,
    STATE_DTYPE_CHOICES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    derive_max_model_len,
    generation_defaults,
    record_quantization,
    resolve_device,
    resolve_dtype,
    resolve_state_dtype,
)
from vllm_mamba.multimodal.config import MultiModalConfig, check_limits, json_option
from vllm_mamba.multimodal.media import MediaConfig
from vllm_mamba.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:  # imported where used: the CLI's parsers (`add_cli_args`) load no torch
    import torch

logger = logging.getLogger(__name__)


def cpu_auto_dtype(requested: str | torch.dtype, dtype: torch.dtype, device: Any) -> torch.dtype:
    """`dtype="auto"` of a bfloat16 checkpoint on a CPU without bfloat16 instructions: float32.

    There the kernels widen bfloat16 to float32 (`bf16_linear`): single-stream decode gains
    from reading half the bytes, but prefill and batched decode measured slower than float32
    (AVX2 level, `benchmarks/README.md`), so `auto` runs float32 and says why; an explicit
    `dtype="bfloat16"` is kept.
    """
    import torch

    if requested != "auto" or dtype != torch.bfloat16 or str(device) != "cpu":
        return dtype
    from vllm_mamba.ops import cpu_kernels

    if not cpu_kernels.available() or cpu_kernels.native_bf16():
        return dtype
    logger.info(
        "dtype auto: the checkpoint is bfloat16, but this CPU (kernel level %s) has no bfloat16 "
        "instructions, where bfloat16 prefill and batched decode run slower than float32; "
        "running float32 (dtype='bfloat16' forces bfloat16: faster single-stream decode)",
        cpu_kernels.cpu_isa.active_level(),
    )
    return torch.float32


DEVICE_CHOICES = ("auto", "cpu", "cuda")
MAX_SEED = 2**63 - 1


def _opt(help_text: str, **kwargs: Any) -> Any:
    """A dataclass field default with its CLI help (and optional choices / nargs)."""
    default = kwargs.pop("default")
    return field(default=default, metadata={"help": help_text, **kwargs})


@dataclass
class EngineArgs:
    """The options of one engine; see `--help` of `vllm-mamba serve` for each."""

    model: str = _opt(
        "a local Hugging Face model directory, a GGUF file, a shipped name or a hub id", default=""
    )
    tokenizer: str | None = _opt(
        "tokenizer directory or hub id (default: the model's)", default=None
    )
    revision: str | None = _opt("hub revision (branch, tag or commit) of the model", default=None)
    tokenizer_revision: str | None = _opt("hub revision of the tokenizer", default=None)
    download_dir: str | None = _opt("hub cache directory (default: HF_HUB_CACHE)", default=None)
    served_model_name: list[str] | None = _opt(
        "name(s) clients use for the model (default: the model argument)", default=None, nargs="+"
    )
    dtype: str = _opt(
        "weights and activations dtype (auto: the config's, else float32)",
        default="auto",
        choices=DTYPE_CHOICES,
    )
    ssm_state_dtype: str = _opt(
        "dtype of the SSM state (auto: the model's, float32 for Mamba)",
        default="auto",
        choices=STATE_DTYPE_CHOICES,
    )
    quantization: str | None = _opt(
        "quantise the weights while loading: int8 (weight-only, one scale per output channel; "
        "about a quarter of the float32 weight memory), int4 (weight-only, 4-bit groups of 32 "
        "with a float16 scale each; about a seventh; one rank only); w8a8 / w4a8: the int8 / "
        "int4 weights multiplied in integers with activations quantised to int8 blocks of 32 "
        "(llama.cpp's Q8_0; faster on CPUs with VNNI, slightly less accurate: "
        "docs/quantization.md); w4a8_k: w4a8 with the 4-bit weights in a Q4_K-style layout "
        "(a 6-bit scale and min per group of 32 under super-blocks of 256: the same 4.5 bits "
        "a weight, closer to the float weights); unset: float weights",
        default=None,
        choices=QUANTIZATION_CHOICES,
    )
    device: str = _opt(
        "where the model runs (auto: CUDA if present)", default="auto", choices=DEVICE_CHOICES
    )
    max_model_len: int | None = _opt(
        "longest prompt plus output (default: from the model config, else 2048)", default=None
    )
    max_num_seqs: int = _opt("sequences in flight at once (= state slots)", default=256)
    max_num_batched_tokens: int = _opt(
        "tokens per engine step; longer prompts are prefilled in chunks", default=2048
    )
    seed: int = _opt("seed of the engine's sampling generator", default=0)
    block_size: int = _opt(
        "tokens per KV cache block (attention layers of hybrid models)", default=16
    )
    kv_cache_memory_bytes: int | None = _opt(
        "bytes of the KV cache of hybrid models (default: a quarter of the free memory, at "
        "most 4 GiB, on the CPU; half the free GPU memory on CUDA)",
        default=None,
    )
    num_gpu_blocks_override: int | None = _opt(
        "exact number of KV cache blocks of hybrid models (wins over kv_cache_memory_bytes)",
        default=None,
    )
    enable_prefix_caching: bool = _opt(
        "reuse the saved state of earlier prefixes (shared system prompts, chat turns)",
        default=False,
    )
    prefix_cache_memory_bytes: int = _opt(
        "bytes of the prefix cache's state snapshots (one sequence's state each)",
        default=DEFAULT_PREFIX_CACHE_MEMORY_BYTES,
    )
    prefix_snapshot_interval: int = _opt(
        "with prefix caching, also save long prompts' state every this many tokens",
        default=DEFAULT_SNAPSHOT_INTERVAL,
    )
    generation_config: str = _opt(
        "sampling defaults: auto (the model's generation_config.json), vllm (none), or a "
        "directory holding a generation_config.json",
        default="auto",
    )
    threads: int | None = _opt(
        "CPU threads per rank for the model's kernels (default: the CPUs this process may run "
        "on, shared among the tensor-parallel ranks)",
        default=None,
    )
    enforce_eager: bool = _opt("never capture CUDA graphs", default=False)
    disable_log_stats: bool = _opt("no periodic statistics line while busy", default=False)
    trust_remote_code: bool = _opt("accepted for vLLM compatibility; no effect here", default=False)
    gpu_memory_utilization: float | None = _opt(
        "accepted for vLLM compatibility; state slots are sized by --max-num-seqs", default=None
    )
    tensor_parallel_size: int | None = _opt(
        "ranks that split every layer (one process and device each; default 1)", default=None
    )
    distributed_executor_backend: str = _opt(
        "what runs the ranks of tensor_parallel_size > 1: mp (processes on this machine) or "
        "ray (actors of a Ray cluster, across machines)",
        default="mp",
        choices=EXECUTOR_BACKENDS,
    )

    language_model_only: bool = _opt(
        "serve an image-text checkpoint text-only: its vision encoder is not loaded and "
        "images are refused",
        default=False,
    )
    limit_mm_per_prompt: dict[str, Any] | str | None = _opt(
        'the most images one prompt may carry, as JSON: {"image": N} (default 16)',
        default=None,
    )
    mm_processor_kwargs: dict[str, Any] | str | None = _opt(
        "overrides of the image processor's settings, as JSON (Qwen3.5: min_pixels, max_pixels)",
        default=None,
    )
    allowed_local_media_path: str | None = _opt(
        "a directory whose images requests may name as file:// URLs (default: none may)",
        default=None,
    )
    disable_media_fetch: bool = _opt(
        "refuse http(s) image URLs (data: URLs and allowed file:// URLs still work)",
        default=False,
    )
    media_fetch_timeout: float = _opt(
        "seconds to fetch one image URL (connecting, redirects and body)", default=10.0
    )

    speculative_config: dict[str, Any] | str | None = _opt(
        "speculative decoding, as a JSON object with vLLM's keys: method (ngram, draft_model "
        "or mtp), num_speculative_tokens, prompt_lookup_min / prompt_lookup_max (ngram), model "
        "(draft_model), disable_by_batch_size",
        default=None,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string (a directory or a hub id)")
        if isinstance(self.speculative_config, str):  # the CLI's JSON text: the same dict
            try:
                self.speculative_config = json.loads(self.speculative_config)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from err
        for name in ("limit_mm_per_prompt", "mm_processor_kwargs"):  # JSON text: the dict
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, json_option(name, value))

    # ----- the command line -------------------------------------------------------------
    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)
    ) -> argparse.ArgumentParser:
        """Adds one `--flag` per field (except `skip`) to an "engine" group of `parser`."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            kwargs: dict[str, Any] = {"default": f.default, "help": meta.pop("help")}
            if f.type in ("bool", bool):
                kwargs["action"] = "store_true"
            else:
                kwargs["type"] = _cli_type(f)
                kwargs.update(meta)
            group.add_argument(flag, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The `EngineArgs` of parsed flags (fields the parser lacks keep their defaults)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})

    # ----- validation and resolution ----------------------------------------------------
    def check_values(self) -> None:
        """Range checks that need no model; `ValueError` naming the option."""
        optional = (
            "tensor_parallel_size",
            "kv_cache_memory_bytes",
            "num_gpu_blocks_override",
            "threads",
        )
        sized = ("block_size", "prefix_cache_memory_bytes", "prefix_snapshot_interval")
        for name in ("max_num_seqs", "max_num_batched_tokens", *sized, *optional):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(f"max_model_len must be an integer >= 1, got {self.max_model_len!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        gmu = self.gpu_memory_utilization
        if gmu is not None and not (isinstance(gmu, (int, float)) and 0.0 < gmu <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu!r}")
        for name, choices in (
            ("dtype", DTYPE_CHOICES),
            ("ssm_state_dtype", STATE_DTYPE_CHOICES),
            ("device", DEVICE_CHOICES),
            ("distributed_executor_backend", EXECUTOR_BACKENDS),
        ):
            value = getattr(self, name)
            if isinstance(value, str) and value not in choices:
                raise ValueError(f"{name} {value!r} is not one of {', '.join(choices)}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization {self.quantization!r} is not one of "
                f"{', '.join(QUANTIZATION_CHOICES)} (or unset: float weights)"
            )
        spec = SpeculativeConfig.from_value(self.speculative_config)
        if spec is not None and spec.method == "mtp" and (self.tensor_parallel_size or 1) > 1:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size}: speculative method 'mtp' "
                "runs on one rank only (ngram and draft_model run with tensor parallelism)"
            )
        timeout = self.media_fetch_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"media_fetch_timeout must be a number > 0, got {timeout!r}")
        check_limits(json_option("limit_mm_per_prompt", self.limit_mm_per_prompt))
        json_option("mm_processor_kwargs", self.mm_processor_kwargs)
        if self.allowed_local_media_path is not None and not os.path.isdir(
            self.allowed_local_media_path
        ):
            raise ValueError(
                f"allowed_local_media_path {self.allowed_local_media_path!r} is not a directory"
            )
        if self.quantization in ONE_RANK_QUANTIZATION and (self.tensor_parallel_size or 1) > 1:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size}: quantization "
                f"'{self.quantization}' runs on one rank only (tensor_parallel_size 1); use int8 "
                "or w8a8 with tensor parallelism"
            )

    def warn_no_effect(self, device: torch.device) -> None:
        """One warning per vLLM option that is set but does nothing here."""
        if self.trust_remote_code:
            logger.warning("trust_remote_code has no effect: no model here runs remote code")
        if self.gpu_memory_utilization is not None:
            logger.warning(
                "gpu_memory_utilization has no effect on the %s: state slots are sized by "
                "max_num_seqs",
                device.type,
            )
        if self.tensor_parallel_size == 1:
            logger.warning("tensor_parallel_size 1 has no effect: the model runs on one device")

    def create_engine_config(self) -> EngineConfig:
        """Resolves the model (downloading from the hub if needed) and validates every option.

        Raises:
            ValueError: an option out of range or that cannot run on the chosen device.
            FileNotFoundError: the model or tokenizer is not there.
        """
        from vllm_mamba.model_loader import load_hf_config, resolve_model_path
        from vllm_mamba.models.registry import ModelRegistry
        from vllm_mamba.tokenizer import default_tokenizer_source

        self.check_values()
        device = resolve_device(self.device)
        path = resolve_model_path(self.model, self.revision, self.download_dir)
        hf_config = load_hf_config(path)
        record_quantization(hf_config, self.quantization)
        _, arch = ModelRegistry.resolve_model_cls(getattr(hf_config, "architectures", None))
        tokenizer = self.tokenizer or default_tokenizer_source(path)
        tok_path = (
            resolve_model_path(tokenizer, self.tokenizer_revision, self.download_dir)
            if tokenizer
            else path
        )
        dtype = resolve_dtype(self.dtype, hf_config)
        dtype = cpu_auto_dtype(self.dtype, dtype, device)
        state_dtype = resolve_state_dtype(self.ssm_state_dtype)
        for name, value in (("dtype", dtype), ("ssm_state_dtype", state_dtype)):
            check_dtype_on_device(name, value, device)
        model_config = ModelConfig(
            model=self.model,
            path=path,
            hf_config=hf_config,
            architecture=arch,
            dtype=dtype,
            max_model_len=derive_max_model_len(hf_config, self.max_model_len),
            tokenizer=tok_path,
            seed=self.seed,
            served_model_name=list(self.served_model_name or [self.model]),
            sampling_defaults=_checked_defaults(generation_defaults(self.generation_config, path)),
            quantization=self.quantization,
        )
        self.warn_no_effect(device)
        return EngineConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens),
            device=device,
            enforce_eager=self.enforce_eager,
            ssm_state_dtype=state_dtype,
            log_stats=not self.disable_log_stats,
            cache_config=CacheConfig(
                self.block_size,
                self.kv_cache_memory_bytes,
                self.num_gpu_blocks_override,
                bool(self.enable_prefix_caching),
                self.prefix_cache_memory_bytes,
                self.prefix_snapshot_interval,
            ),
            parallel_config=ParallelConfig(
                self.tensor_parallel_size or 1, self.distributed_executor_backend
            ),
            speculative_config=SpeculativeConfig.from_value(self.speculative_config),
            cpu_threads=self.threads,
            multimodal=self._multimodal(arch),
        )

    def _multimodal(self, arch: str) -> MultiModalConfig | None:
        """The image options when `arch` is an image-text model served with images."""
        from vllm_mamba.models.registry import ModelRegistry

        cls, _ = ModelRegistry.resolve_model_cls(arch)
        if not getattr(cls, "supports_images", False) or self.language_model_only:
            return None
        media = MediaConfig(
            allow_fetch=not self.disable_media_fetch,
            allowed_local_media_path=self.allowed_local_media_path,
            fetch_timeout_s=float(self.media_fetch_timeout),
        )
        return MultiModalConfig(
            limit_per_prompt=check_limits(
                json_option("limit_mm_per_prompt", self.limit_mm_per_prompt)
            ),
            processor_kwargs=json_option("mm_processor_kwargs", self.mm_processor_kwargs),
            media=media,
        )


def check_dtype_on_device(name: str, dtype: torch.dtype | None, device: torch.device) -> None:
    """float16 has no CPU kernels: refuse it at startup rather than fail at the first request.

    Raises:
        ValueError: the dtype of option `name` cannot run on the device.
    """
    import torch

    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError(
            f"{name} float16 is not supported on the CPU (its kernels run float32 and "
            f"bfloat16); use bfloat16 or float32"
        )


def _cli_type(f: dataclasses.Field) -> Any:
    """The argparse `type` of a field from its annotation string."""
    text = str(f.type)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def _checked_defaults(defaults: dict[str, Any]) -> dict[str, Any]:
    """Sampling defaults that `SamplingParams` accepts.

    Raises:
        ValueError: naming the generation_config value that is out of range.
    """
    from vllm_mamba.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as err:
        raise ValueError(f"generation_config.json: {err} (--generation-config vllm)") from err
    return defaults
