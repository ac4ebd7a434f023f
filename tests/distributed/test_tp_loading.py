"""Each rank builds and loads only its shard; what cannot be split is refused up front.

No process group is needed to build a shard, so these run in one process: the shards of the
two ranks put together are the single-rank model's tensors, and each rank holds about half
of the weights.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM
from vllm_mamba.distributed.parallel_state import TensorParallel
from vllm_mamba.executor.ray_executor import _import_ray
from vllm_mamba.model_loader import build_model, load_hf_config
from vllm_mamba.models.mamba import MambaForCausalLM
from vllm_mamba.models.registry import ModelRegistry

CPU = torch.device("cpu")


def _build(path: str, rank: int, size: int) -> torch.nn.Module:
    config = load_hf_config(path)
    return build_model(path, config, torch.float32, CPU, TensorParallel(rank, size))[0]


def _nbytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_mamba_shards_are_the_model_split_by_channels() -> None:
    path = tiny_model_dir("falcon-untied")
    full, shards = _build(path, 0, 1), [_build(path, r, 2) for r in range(2)]
    f, s = full.backbone.layers[1].mixer, [m.backbone.layers[1].mixer for m in shards]
    inter = f.intermediate_size
    x, z = f.in_proj.weight[:inter], f.in_proj.weight[inter:]
    for r, m in enumerate(s):
        half = slice(r * inter // 2, (r + 1) * inter // 2)
        assert torch.equal(m.in_proj.weight, torch.cat([x[half], z[half]]))
        assert torch.equal(m.x_proj.weight, f.x_proj.weight[:, half])
        assert torch.equal(m.A_log, f.A_log[half]) and torch.equal(
            m.conv1d.weight, f.conv1d.weight[half]
        )
        assert torch.equal(m.out_proj.bias, f.out_proj.bias)  # added once, after the sum
    vocab = torch.cat([m.lm_head.weight for m in shards])
    assert torch.equal(vocab, full.lm_head.weight)
    for m in shards:  # every rank holds about half (the norms and x_proj's bias-free rows aside)
        assert _nbytes(m) < 0.52 * _nbytes(full)


def test_mamba2_one_group_is_replicated_and_heads_split() -> None:
    path = tiny_model_dir("mamba2-g1")
    full, shards = _build(path, 0, 1), [_build(path, r, 2) for r in range(2)]
    f, s = full.backbone.layers[0].mixer, [m.backbone.layers[0].mixer for m in shards]
    inter, gn = f.intermediate_size, f.n_groups * f.state_size
    for r, m in enumerate(s):
        assert (m.num_heads, m.n_groups) == (f.num_heads // 2, 1)
        bc = f.conv1d.weight[inter:]  # B and C of the one group: on both ranks
        assert torch.equal(m.conv1d.weight[inter // 2 :], bc)
        assert torch.equal(m.dt_bias, f.dt_bias[r * 2 : r * 2 + 2])
        dt_rows = f.in_proj.weight[2 * inter + 2 * gn :][r * 2 : r * 2 + 2]
        assert torch.equal(m.in_proj.weight[-2:], dt_rows)
    # an odd vocabulary: the last shard ends in a zero row
    emb = torch.cat([m.backbone.embeddings.weight for m in shards])
    assert torch.equal(emb[: full.config.vocab_size], full.backbone.embeddings.weight)
    assert not emb[full.config.vocab_size :].any()


class SingleRankMamba(MambaForCausalLM):
    """A plugin architecture that does not declare tensor parallelism."""

    supports_tensor_parallel = False


def test_architecture_without_tensor_parallelism_is_refused(tmp_path: Path) -> None:
    shutil.copytree(tiny_model_dir("tied"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["SingleRankMamba"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    ModelRegistry.register_model("SingleRankMamba", SingleRankMamba)
    try:
        with pytest.raises(ValueError, match="SingleRankMamba does not support tensor paral"):
            LLM(str(tmp_path), device="cpu", tensor_parallel_size=2)
    finally:
        ModelRegistry._models.pop("SingleRankMamba")


def test_shapes_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple of tensor_paral"):
        _build(tiny_model_dir("mamba2-tied"), 0, 2)


def test_ray_backend_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ValueError, match=r"needs Ray: pip install 'vllm-mamba\[ray\]'"):
        _import_ray()
