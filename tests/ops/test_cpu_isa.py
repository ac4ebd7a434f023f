"""The CPU kernels at every ISA level this machine runs, forced through `VLLM_MAMBA_CPU_ISA`.

The rest of the suite runs the level `cpu_isa` picks (the highest). Here each lower level runs
the C++ kernel tests against their `_ref` twins in a subprocess of its own (a process imports
one kernel build), and the engine's float32 generations (greedy tokens and their logprobs)
on tiny Mamba, Mamba2, Gated DeltaNet and short-conv hybrid checkpoints are compared across
all levels.
The levels differ in vector width and FMA contraction, so logprobs agree to float32
rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba.ops import cpu_isa, cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="C++ extension vllm_mamba._C_<level> is not built (pip install -e .)",
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT = cpu_isa.active_level()
LOWER = [level for level in cpu_isa.supported_levels() if level != DEFAULT]

# Kernel tests against the references; the engine-level checks of these files are left to the
# cross-level generation test below.
KERNEL_TESTS = [
    "tests/ops/test_cpu_kernels.py",
    "tests/ops/test_cpu_ssd.py",
    "tests/ops/test_dynamic_conv.py",
    "tests/ops/test_gated_delta.py",
    "tests/ops/test_gated_rms_norm.py",
    "tests/ops/test_grouped_linear.py",
    "tests/ops/test_int4_linear.py",
    "tests/ops/test_int8_linear.py",
    "tests/ops/test_int_dot_linear.py",
    "tests/ops/test_kda.py",
    "tests/ops/test_linear.py",
    "tests/ops/test_paged_attention.py",
    "tests/ops/test_rwkv_kernels.py",
    "tests/ops/test_rwkv7_decode_layer.py",
    "tests/ops/test_fused_decode.py",
    "tests/ops/test_fused_short_conv_decode.py",
    "tests/ops/test_fused_attention_decode.py",
    "tests/ops/test_fused_gdn_decode.py",
    "tests/ops/test_fused_kda_decode.py",
    "tests/ops/test_fused_ffn_decode.py",
    "tests/ops/test_hyper_connection_op.py",
    "tests/ops/test_rglru.py",
    "tests/ops/test_mlstm.py",
]

# One child per level: the float32 generations of the models given, then `dtype="auto"` on a
# bfloat16 checkpoint (the last argument); one process pays the imports once.
PER_LEVEL = """
import json, sys
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.ops import cpu_isa, cpu_kernels
out = {"level": cpu_isa.active_level(), "runs": []}
for path in sys.argv[1:-1]:
    llm = LLM(path, dtype="float32", seed=0)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1)
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 17, 300, 2], [11] * 9, [1000, 20, 3])]
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        out["runs"].append({"model": path, "tokens": list(c.token_ids), "logprobs": lps})
    llm.llm_engine.executor.shutdown()
llm = LLM(sys.argv[-1], dtype="auto")
out["auto_dtype"] = str(llm.llm_engine.config.model_config.dtype)
out["native_bf16"] = bool(cpu_kernels.native_bf16())
llm.llm_engine.executor.shutdown()
print("RESULT " + json.dumps(out))
"""
GENERATED = ("tied", "mamba2-groups", "qwen3_5-gqa", "lfm2-gqa")


def _env(level: str) -> dict[str, str]:
    env = dict(os.environ)
    env[cpu_isa.ENV_VAR] = level
    return env


def test_supported_levels_are_ordered_and_include_the_active_one() -> None:
    levels = cpu_isa.supported_levels()
    assert DEFAULT == levels[-1]
    if levels[0] == "generic":
        assert list(levels) == ["generic", "avx2", "avx512"][: len(levels)]


def test_forcing_an_unknown_or_unsupported_level_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv(cpu_isa.ENV_VAR, "sse9")
    with pytest.raises(ValueError, match="VLLM_MAMBA_CPU_ISA='sse9' is not a level"):
        cpu_isa.requested_level()
    monkeypatch.setattr(cpu_isa, "supported_levels", lambda: ("generic",))
    monkeypatch.setattr(cpu_isa, "_machine", lambda: "x86_64")
    monkeypatch.setenv(cpu_isa.ENV_VAR, "avx512")
    with pytest.raises(ValueError, match="supports only \\['generic'\\]"):
        cpu_isa.requested_level()


def test_levels_follow_the_cpu_flags(monkeypatch) -> None:
    monkeypatch.setattr(cpu_isa, "_machine", lambda: "x86_64")
    v3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    cases = {
        frozenset({"sse2"}): ("generic",),
        v3: ("generic", "avx2"),
        v3 - {"f16c"}: ("generic",),
        v4: ("generic", "avx2", "avx512"),
        v4 - {"avx512vl"}: ("generic", "avx2"),
        v4 - {"fma"}: ("generic",),  # AVX-512 without the levels below is not a level
    }
    for flags, levels in cases.items():
        monkeypatch.setattr(cpu_isa, "_cpu_flags", lambda f=flags: set(f))
        cpu_isa.supported_levels.cache_clear()
        assert cpu_isa.supported_levels() == levels, sorted(flags)
    cpu_isa.supported_levels.cache_clear()


def test_the_loaded_build_is_the_one_its_name_says() -> None:
    level, module = cpu_isa.load()
    assert level == DEFAULT
    assert module.__name__ == f"vllm_mamba._C_{level}"
    assert module.ISA == level


@pytest.mark.parametrize("level", LOWER)
def test_kernels_match_their_references_at_a_forced_level(level: str) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    cmd += [*KERNEL_TESTS, "-k", "not engine"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(level), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


@functools.cache
def _per_level() -> dict[str, dict]:
    """`PER_LEVEL`'s result at each level this machine runs (once per process; the two tests
    below share an xdist group)."""
    paths = [tiny_model_dir(n) for n in GENERATED]
    bf16 = os.path.join(make_tmp_dir("tiny-tied-bf16-"), "bf16")
    shutil.copytree(tiny_model_dir("tied"), bf16)
    with open(os.path.join(bf16, "config.json")) as f:
        config = json.load(f)
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    with open(os.path.join(bf16, "config.json"), "w") as f:
        json.dump(config, f)
    results = {}
    for level in cpu_isa.supported_levels():
        proc = subprocess.run(
            [sys.executable, "-c", PER_LEVEL, *paths, bf16],
            cwd=ROOT, env=_env(level), capture_output=True, text=True,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        results[level] = json.loads(line.removeprefix("RESULT "))
        assert results[level]["level"] == level
    return results


@pytest.mark.xdist_group("cpu-isa-levels")
def test_engine_generations_agree_across_levels() -> None:
    results = _per_level()
    ref = results[DEFAULT]["runs"]
    for level, res in results.items():
        assert len(res["runs"]) == len(ref) == 3 * len(GENERATED)
        for got, want in zip(res["runs"], ref):
            assert got["tokens"] == want["tokens"], (level, got["model"])
            diffs = [abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])]
            assert max(diffs) < 1e-4, (level, got["model"], max(diffs))


@pytest.mark.xdist_group("cpu-isa-levels")
def test_auto_dtype_of_a_bfloat16_checkpoint_follows_the_cpu() -> None:
    """`dtype="auto"` keeps a bfloat16 checkpoint's dtype where the kernel build multiplies
    bfloat16 natively and runs float32 where it does not (forced avx2 here, or any CPU
    without AVX512-BF16/AMX)."""
    for level, res in _per_level().items():
        native = res["native_bf16"]
        assert res["auto_dtype"] == ("torch.bfloat16" if native else "torch.float32"), level
        if level != "avx512":
            assert not native, level
