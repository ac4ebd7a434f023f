"""RWKV-7 beyond the family suite: BlinkDL's `.pth` format against the `rwkv` package, the two
formats of one checkpoint giving the same outputs, and the errors of what is not supported.

The suite (`tests/models/test_families.py`, family `rwkv7`) runs the fla-hub format against
the `rwkv` package and every engine check; here the `.pth` file itself is served.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch

from tests.helpers.family_checks import hf_reference, prompts
from tests.helpers.prompts import MAX_TOKENS
from tests.helpers.runners import VllmRunner
from tests.helpers.rwkv_checkpoints import rwkv7_state_dict, save_rwkv7
from tests.helpers.tiny_configs import RWKV7
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.model_loader import load_hf_config

NAME = "rwkv7-h32"  # heads of 32: BlinkDL's group-norm epsilon (64e-5) differs from fla's rule


def test_pth_checkpoint_matches_the_rwkv_package() -> None:
    refs = hf_reference(NAME)  # the rwkv package on the .pth file
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    with VllmRunner(tiny_model_dir(NAME, "pth")) as runner:
        outs = runner.generate(prompts(), params)
    for out, (want, ref_lp) in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == want
        lp = torch.tensor([got.logprobs[i][t].logprob for i, t in enumerate(want)])
        torch.testing.assert_close(lp, ref_lp[torch.arange(len(want)), want], rtol=0, atol=1e-4)


def test_pth_config_is_derived_from_the_tensors() -> None:
    config = load_hf_config(tiny_model_dir(NAME, "pth"))
    want = RWKV7[NAME]
    assert config.architectures == ["RWKV7ForCausalLM"]
    for key in ("hidden_size", "num_hidden_layers", "head_dim", "intermediate_size", "vocab_size"):
        assert getattr(config, key) == want[key], key
    for key in ("decay_low_rank_dim", "a_low_rank_dim", "v_low_rank_dim", "gate_low_rank_dim"):
        assert getattr(config, key) == want[key], key
    assert config.group_norm_eps == pytest.approx(64e-5)


def test_both_formats_give_the_same_tokens_in_bfloat16(tmp_path) -> None:  # noqa: ANN001
    """A bfloat16 `.pth` (as BlinkDL ships them) and its fla-hub twin: the same weights."""
    cfg = RWKV7["rwkv7-h64"]
    sd = {k: v.to(torch.bfloat16) for k, v in rwkv7_state_dict(cfg, seed=3).items()}
    pth_dir, hf_dir = tmp_path / "pth", tmp_path / "hf"
    save_rwkv7(cfg, str(hf_dir), "hf", seed=3)
    save_rwkv7(cfg, str(pth_dir), "pth", seed=3)
    torch.save(sd, glob.glob(str(pth_dir / "*.pth"))[0])
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = []
    for path in (pth_dir, hf_dir):
        llm = LLM(str(path), dtype="bfloat16" if path == pth_dir else "float32")
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts()[:4], params)])
        del llm
    assert load_hf_config(str(pth_dir)).torch_dtype == torch.bfloat16
    # the bfloat16 weights rounded in the .pth: the float32 twin agrees on most tokens
    same = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y))
    assert same >= 0.75 * sum(len(x) for x in outs[0]), outs


def test_several_pth_files_are_refused(tmp_path) -> None:  # noqa: ANN001
    src = tiny_model_dir(NAME, "pth")
    for file in os.listdir(src):
        shutil.copy(os.path.join(src, file), tmp_path)
    pth = glob.glob(str(tmp_path / "*.pth"))[0]
    shutil.copy(pth, tmp_path / "another.pth")
    with pytest.raises(ValueError, match="several .pth checkpoints"):
        LLM(str(tmp_path))


def test_a_pth_that_is_not_rwkv7_is_refused(tmp_path) -> None:  # noqa: ANN001
    torch.save({"emb.weight": torch.zeros(4, 8), "blocks.0.att.time_decay": torch.zeros(8)},
               tmp_path / "RWKV-4-tiny.pth")  # fmt: skip
    with pytest.raises(ValueError, match="not an RWKV-7 checkpoint"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("hidden_act", "gelu", "hidden_act"), ("norm_first", False, "norm_first")],
)
def test_unsupported_config_fields_are_named(tmp_path, field: str, value, message: str) -> None:  # noqa: ANN001
    src = tiny_model_dir(NAME)
    for file in os.listdir(src):
        shutil.copy(os.path.join(src, file), tmp_path)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    raw[field] = value
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path))


def test_older_fla_layout_gives_the_same_tokens(tmp_path) -> None:  # noqa: ANN001
    """fla's converter of early 2025: each time mix's six token-shift mixes as one `attn.x_x`
    `(6, H)` (rows r, w, k, v, a, g), a config without `value_dim` and with `fuse_norm`, and a
    safetensors file without metadata: the same tokens as the split layout."""
    from safetensors.torch import load_file, save_file

    new_dir = save_rwkv7(RWKV7[NAME], str(tmp_path / "new"), "hf", seed=4)
    old_dir = tmp_path / "old"
    shutil.copytree(new_dir, old_dir)
    tensors = load_file(os.path.join(new_dir, "model.safetensors"))
    mixes = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
    for prefix in {k[: -len("x_r")] for k in tensors if k.endswith("attn.x_r")}:
        rows = [tensors.pop(prefix + mix).reshape(-1) for mix in mixes]
        tensors[prefix + "x_x"] = torch.stack(rows)  # (6, H)
    assert not any(k.endswith("attn.x_r") for k in tensors)
    save_file(tensors, str(old_dir / "model.safetensors"))  # no metadata
    with open(old_dir / "config.json") as f:
        config = json.load(f)
    config.pop("value_dim", None)
    config["fuse_norm"] = True
    with open(old_dir / "config.json", "w") as f:
        json.dump(config, f)

    params = SamplingParams(temperature=0, max_tokens=8)
    outs = []
    for path in (new_dir, str(old_dir)):
        with VllmRunner(path, max_num_seqs=4) as runner:
            outs.append([o.outputs[0].token_ids for o in runner.generate(prompts()[:4], params)])
    assert outs[0] == outs[1]
    assert len({tuple(t) for t in outs[0]}) > 1
