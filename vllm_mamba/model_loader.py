"""Loads a model: resolves a local directory or hub id, reads the config, streams the weights.

The loader knows no checkpoint format and no architecture: the directory's format
(`vllm_mamba.models.formats`: Hugging Face's, or a registered one such as mamba-ssm's or
BlinkDL's RWKV `.pth`) gives the config, the weight files and the checkpoint names mapped onto
the model class's; the class (`ModelRegistry`) gives the rest. Hugging Face weights come from
`model.safetensors`, sharded safetensors with their index, or `pytorch_model.bin` (sharded or
not, read with `torch.load(weights_only=True)`). Every parameter must be present with its
shape; anything missing, unexpected or misshaped is a `ValueError` naming the tensors; the
tensors under a model's `skipped_weights` prefixes are skipped with one log line per prefix,
and the missing tensors under its `opt_in_weights` prefixes (a part built on request, such as a
multi-token prediction head) are named with what asked for them. A tensor-parallel rank reads
only its slices of the sharded parameters (`vllm_mamba.layers.parallel_linear.Shard`),
straight from the safetensors files.

A load-time quantisation recorded in the config (`quantization="int8"` or `"int4"`, see
`vllm_mamba.config.record_quantization`) is applied once the float weights are loaded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from vllm_mamba.config import ONE_RANK_QUANTIZATION, recorded_quantization
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.moe import stack_experts
from vllm_mamba.layers.packed_weights import install_packed_weights, packed_of
from vllm_mamba.layers.parallel_linear import named_shards
from vllm_mamba.layers.quantization import QuantizationReport, quantize_model
from vllm_mamba.model_resolver import resolve_model_path  # noqa: F401 - the loaders' import
from vllm_mamba.models.causal_lm import CausalLM
from vllm_mamba.models.formats import detect_format, read_config_json
from vllm_mamba.models.layer_stream import LayerStream, to_empty
from vllm_mamba.models.prequantized import checkpoint_method, dequantized_weights
from vllm_mamba.models.registry import ModelRegistry
from vllm_mamba.ops.dispatch import get_mamba_ops
from vllm_mamba.ops.grouped_linear import GroupedWeight
from vllm_mamba.worker.huge_pages import move_to_huge_pages, release_freed_heap

logger = logging.getLogger(__name__)


def load_hf_config(path: str) -> Any:
    """Reads the config of a model directory into its transformers config class, through the
    directory's checkpoint format (`config.json` as is, or converted from another format).

    Raises:
        FileNotFoundError: there is no `config.json` and no other format recognises the
            directory.
        ValueError: the config is invalid (transformers' validators' message) or its format
            refuses it.
    """
    raw = read_config_json(path)
    return detect_format(path, raw).load_config(path, raw)


def iterate_weights(path: str, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yields `(name, tensor)` for every tensor of the checkpoint in `path`, under the names
    (and shapes) its format maps the model classes' onto.

    With `lazy`, safetensors tensors come as slices (read on indexing), so a rank reads only
    its part of a sharded parameter.
    """
    fmt = detect_format(path)
    files, kind = fmt.weight_files(path)
    bar = tqdm(files, desc=f"Loading {kind} checkpoint shards", unit="shard", disable=None)
    for file in bar:
        for name, tensor in fmt.read_file(file, kind, lazy):
            yield from fmt.convert_weight(name, tensor)


def load_weights(
    model: CausalLM,
    weights: Iterator[tuple[str, Any]],
    packed: dict[str, GroupedWeight] | None = None,
    stream: LayerStream | None = None,
) -> None:
    """Copies checkpoint tensors into `model`'s parameters, checking names and shapes.

    A tensor that carries a pre-quantised integer layout (`packed_weights.attach_packed`) is
    copied as its float values and its layout recorded under the parameter's name in `packed`
    (refused without a `packed` dict: a tensor-parallel rank reads no integer layouts).

    A tied head (`lm_head.weight` sharing the embedding) may be present or absent; tensors
    under the model's `skipped_weights` prefixes are not loaded (one log line per prefix); a
    tensor that packs several parameters is split by the model's `expand_weight`.

    With a `stream`, the decoder layers are materialised, processed and quantised one at a
    time as their tensors arrive (`vllm_mamba.models.layer_stream`).

    Raises:
        ValueError: naming the missing, unexpected and misshaped tensors.
    """
    params = dict(model.named_parameters())
    if stream is not None:
        stream.expect(params)
    shards = named_shards(model)
    remap = model.remap_weight_name
    tied = {
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if name not in params and any(p is q for q in params.values())
    }
    seen: set[str] = set()
    unexpected, misshaped = [], []
    skipped = dict.fromkeys(model.skipped_weights, 0)
    weights = (
        pair for n, t in model.checkpoint_weights(weights) for pair in model.expand_weight(n, t)
    )
    for raw_name, tensor in weights:
        prefix = next((p for p in skipped if raw_name.startswith(p)), None)
        if prefix is not None:
            skipped[prefix] += 1
            continue
        name = remap(raw_name)
        if name in tied:
            continue
        param = params.get(name) if stream is None else stream.param(name, params)
        if param is None:
            unexpected.append(raw_name)
            continue
        shard = shards.get(name)
        if shard is not None:
            try:
                tensor = shard.read(tensor, raw_name)
            except ValueError as err:
                misshaped.append(str(err))
                continue
        elif not isinstance(tensor, torch.Tensor):
            tensor = tensor[...]  # a whole safetensors slice
        if tuple(param.shape) != tuple(tensor.shape):
            misshaped.append(
                f"{raw_name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
            )
            continue
        layout = packed_of(tensor)
        if layout is not None:
            if packed is None:
                raise ValueError(
                    f"{raw_name}: pre-quantised integer weights load on one rank only "
                    "(tensor_parallel_size 1)"
                )
            packed[name] = layout
        with torch.no_grad():
            param.copy_(tensor)
        seen.add(name)
        if stream is not None:
            stream.loaded(name)
    for prefix, count in skipped.items():
        if count:
            what = model.skipped_weights[prefix]
            logger.info("Skipped %d checkpoint tensors under %r: %s", count, prefix, what)
    missing = sorted(set(params) - seen)
    problems = []
    for prefix, what in model.opt_in_weights.items():  # asked for, absent from the checkpoint
        opted = [n for n in missing if n.startswith(prefix)]
        if opted:
            problems.append(f"{what}, missing tensors: {', '.join(opted)}")
            missing = [n for n in missing if not n.startswith(prefix)]
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if misshaped:
        problems.append(f"misshaped tensors: {'; '.join(misshaped)}")
    if problems:
        raise ValueError("checkpoint does not match the model: " + " | ".join(problems))


# `torch.nn.init`'s in-place initialisers, which every module's `reset_parameters` calls.
_INITIALISERS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_",
)  # fmt: skip


@contextlib.contextmanager
def _without_parameter_init() -> Iterator[None]:
    """Module constructors leave their parameters as allocated: the model is built on the meta
    device, where initial values do not exist, and its weights come from the checkpoint. (A
    random `normal_` on meta also imports `torch._dynamo`, 1-2 s of every cold start.)"""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def check_tensor_parallel(hf_config: Any, tp_size: int) -> tuple[type[nn.Module], str]:
    """The registered class and architecture name of the config, if it can run on `tp_size`
    ranks.

    Raises:
        ValueError: `tp_size > 1` and the architecture has no tensor parallelism (named).
    """
    model_cls, arch = ModelRegistry.resolve_model_cls(getattr(hf_config, "architectures", None))
    if not (isinstance(model_cls, type) and issubclass(model_cls, CausalLM)):
        raise TypeError(
            f"{arch}: the registered class {model_cls!r} is not a vllm_mamba CausalLM (a "
            "model must subclass vllm_mamba.models.causal_lm.CausalLM)"
        )
    if tp_size > 1 and not model_cls.supports_tensor_parallel:
        raise ValueError(
            f"tensor_parallel_size {tp_size}: {arch} does not support tensor parallelism yet"
        )
    return model_cls, arch


def _layer_stream(
    path: str,
    hf_config: Any,
    model: nn.Module,
    tp: TensorParallel,
    method: str | None,
    device: torch.device,
    dtype: torch.dtype,
) -> LayerStream | None:
    """A `LayerStream` for a model quantised at load time where one applies (one rank, a float
    checkpoint that is not GGUF, layers that can be loaded one at a time), else None."""
    if method is None or tp.size > 1 or checkpoint_method(hf_config) is not None:
        return None
    if detect_format(path, read_config_json(path)).name == "gguf":
        return None
    layers = LayerStream.of(model)
    if layers is None:
        return None
    ops = get_mamba_ops(device)
    return LayerStream(
        model,
        layers,
        device,
        dtype,
        lambda module, name: _quietly(quantize_model, module, ops, method, name),
    )


def _quietly(fn: Callable[..., QuantizationReport], *args: Any) -> QuantizationReport:
    """`fn(*args)` without its info log lines (the loader logs one summary)."""
    log = logging.getLogger(quantize_model.__module__)
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        return fn(*args)
    finally:
        log.setLevel(level)


def _log_quantization(
    method: str, rest: QuantizationReport, layers: list[QuantizationReport]
) -> None:
    """One line for the whole model: layers quantised, weight bytes before and after (the
    decoder layers' own reports, `layers`, and the last one over the whole model, `rest`)."""
    count = rest.num_linears + sum(r.num_linears for r in layers)
    before = rest.bytes_before + sum(r.bytes_before - r.bytes_after for r in layers)
    fallbacks = [*rest.int8_fallbacks, *(n for r in layers for n in r.int8_fallbacks)]
    if fallbacks:
        logger.info(
            "%s: %d layers have K not a multiple of 32 and are int8 instead", method, len(fallbacks)
        )
    logger.info(
        "%s: %d linear layers quantised%s; weights %.1f MiB -> %.1f MiB",
        method, count, " one decoder layer at a time" if layers else "", before / 2**20,
        rest.bytes_after / 2**20,
    )  # fmt: skip


def build_model(
    path: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE,
    *,
    mtp: bool = False,
    images: bool = False,
) -> tuple[nn.Module, str]:
    """Instantiates the registered class for the config and loads its weights.

    Args:
        tp: with more than one rank, this rank's shard of the model is built and loaded.
        mtp: also build and load the checkpoint's multi-token prediction head as `model.mtp`
            (speculative method `mtp`, `vllm_mamba.models.mtp.SupportsMTP`); skipped otherwise.
        images: also build and load an image-text model's vision encoder
            (`vllm_mamba.models.image_text.SupportsImages`); skipped otherwise.

    Returns:
        The model in eval mode on `device` with `dtype`, and its architecture name.

    Raises:
        ValueError: tensor parallelism asked of an architecture that does not support it; `mtp`
            asked of one without an MTP head, of a config without MTP layers
            (`mtp_num_hidden_layers`) or of a checkpoint without the `mtp.*` tensors.
    """
    model_cls, arch = check_tensor_parallel(hf_config, tp.size)
    if mtp and not getattr(model_cls, "supports_mtp", False):
        raise ValueError(
            f"speculative method 'mtp': {arch} has no multi-token prediction head (its class "
            "does not declare supports_mtp)"
        )
    with torch.device("meta"), _without_parameter_init():
        ops = get_mamba_ops(device)
        model = model_cls(hf_config, ops, tp) if tp.size > 1 else model_cls(hf_config, ops)
        if mtp:
            model.enable_mtp(ops, tp)
        if images and getattr(model_cls, "supports_images", False):
            model.enable_images(ops)
    method = recorded_quantization(hf_config)
    if method is not None:
        if not model_cls.supports_quantization:
            raise ValueError(f"quantization {method}: {arch} does not support quantization")
        if method in ONE_RANK_QUANTIZATION and tp.size > 1:
            raise ValueError(
                f"tensor_parallel_size {tp.size}: quantization '{method}' runs on one rank only"
            )
    stream = _layer_stream(path, hf_config, model, tp, method, device, dtype)
    if stream is None:
        model = to_empty(model, device, dtype=dtype)
    else:
        stream.materialize_rest()
    model.tie_weights()  # materialising from meta unties shared parameters
    # A pre-quantised checkpoint reaches the model as float weights (FP8 blocks widened;
    # integer layouts recorded in `packed` and put back on the `Linear`s once processed).
    packed: dict[str, GroupedWeight] | None = {} if tp.size == 1 else None
    weights = dequantized_weights(hf_config, iterate_weights(path, lazy=tp.size > 1))
    load_weights(model, weights, packed, stream)
    if stream is None:
        model.process_weights_after_loading()
    else:
        stream.finish()
    if packed:
        install_packed_weights(model, packed, get_mamba_ops(device), method)
    if method is not None:
        report = _quietly(quantize_model, model, get_mamba_ops(device), method)
        _log_quantization(method, report, stream.reports if stream is not None else [])
    stack_experts(model)  # the MoE experts as the fused kernel reads them, in place
    release_freed_heap()  # the experts' copies from before stacking (small blocks: the heap)
    move_to_huge_pages(model)  # on the CPU: decode streams every weight each step
    return model.eval().requires_grad_(False), arch
