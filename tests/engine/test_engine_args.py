"""`EngineArgs`: every option reaches the engine the same way through `LLM(**kw)`, `serve`,
`generate` and `bench`; startup fails fast with one clear message; the banner says what loaded.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.engine.llm_engine import LLMEngine
from vllm_mamba.entrypoints.cli import build_parser, main
from vllm_mamba.errors import EngineStartupError
from vllm_mamba.worker.model_runner import ModelRunner

# A value different from the default for every option, as Python and as command-line words.
NON_DEFAULTS: dict[str, tuple[Any, list[str]]] = {
    "tokenizer": ("some/tokenizer", ["some/tokenizer"]),
    "revision": ("v2", ["v2"]),
    "tokenizer_revision": ("v3", ["v3"]),
    "download_dir": ("/tmp/hub-cache", ["/tmp/hub-cache"]),
    "served_model_name": (["a", "b"], ["a", "b"]),
    "dtype": ("bfloat16", ["bfloat16"]),
    "ssm_state_dtype": ("bfloat16", ["bfloat16"]),
    "quantization": ("int8", ["int8"]),
    "device": ("cpu", ["cpu"]),
    "max_model_len": (77, ["77"]),
    "max_num_seqs": (5, ["5"]),
    "max_num_batched_tokens": (33, ["33"]),
    "seed": (9, ["9"]),
    "threads": (1, ["1"]),
    "generation_config": ("vllm", ["vllm"]),
    "block_size": (32, ["32"]),
    "kv_cache_memory_bytes": (2**20, [str(2**20)]),
    "num_gpu_blocks_override": (64, ["64"]),
    "enable_prefix_caching": (True, []),
    "prefix_cache_memory_bytes": (2**24, [str(2**24)]),
    "prefix_snapshot_interval": (64, ["64"]),
    "enforce_eager": (True, []),
    "disable_log_stats": (True, []),
    "trust_remote_code": (True, []),
    "gpu_memory_utilization": (0.5, ["0.5"]),
    "tensor_parallel_size": (1, ["1"]),
    "distributed_executor_backend": ("ray", ["ray"]),
    "language_model_only": (True, []),
    "limit_mm_per_prompt": ({"image": 2}, ['{"image": 2}']),
    "mm_processor_kwargs": ({"max_pixels": 1024}, ['{"max_pixels": 1024}']),
    "allowed_local_media_path": ("/tmp", ["/tmp"]),
    "disable_media_fetch": (True, []),
    "media_fetch_timeout": (3.0, ["3.0"]),
    "speculative_config": (
        {"method": "ngram", "num_speculative_tokens": 2},
        ['{"method": "ngram", "num_speculative_tokens": 2}'],
    ),
}


@pytest.fixture
def engine_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Captures the `vllm_mamba` logger (which does not propagate to the root)."""
    logger = logging.getLogger("vllm_mamba")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


SERVER_ONLY = ("served_model_name",)  # `generate`, `chat` and `bench` have no such flag


def test_every_field_has_a_case() -> None:
    fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    assert fields == set(NON_DEFAULTS)


def _from_command(command: list[str], name: str) -> EngineArgs:
    value, words = NON_DEFAULTS[name]
    args = build_parser().parse_args([*command, "--" + name.replace("_", "-"), *words])
    return EngineArgs.from_cli_args(args)


@pytest.mark.parametrize("name", sorted(NON_DEFAULTS))
def test_option_reaches_the_engine_the_same_way(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    value = NON_DEFAULTS[name][0]
    seen: list[EngineArgs] = []
    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(lambda cls, a: seen.append(a)))
    LLM("m/x", **{name: value})
    want = EngineArgs(model="m/x", **{name: value})
    assert seen == [want]
    assert getattr(want, name) == value != getattr(EngineArgs(model="m/x"), name)
    assert _from_command(["serve", "m/x"], name) == want
    for command in (["generate", "--model", "m/x"], ["bench", "latency", "--model", "m/x"]):
        if name in SERVER_ONLY:  # no server, no such flag
            with pytest.raises(SystemExit):
                _from_command(command, name)
        else:
            assert _from_command(command, name) == want


def test_loaded_engine_reflects_the_options() -> None:
    with VllmRunner(
        tiny_model_dir("tied"),
        max_num_seqs=3,
        max_model_len=99,
        max_num_batched_tokens=17,
        seed=5,
        ssm_state_dtype="bfloat16",
        served_model_name=["tiny"],
        disable_log_stats=True,
    ) as runner:
        llm, engine = runner.llm, runner.engine
        config = engine.config
        assert config.scheduler_config.max_num_seqs == 3 == engine.scheduler.slots.num_slots
        assert config.scheduler_config.max_num_batched_tokens == 17
        assert config.model_config.max_model_len == 99
        assert config.model_config.seed == 5
        assert config.model_config.served_model_name == ["tiny"]
        # the option applies to the recurrent states; the conv histories keep the model dtype
        assert engine.cache.state_dtypes() == [torch.bfloat16]
        layer = engine.cache.layer(0)
        assert layer["ssm"].dtype == torch.bfloat16
        assert layer["conv"].dtype == config.model_config.dtype
        assert not config.log_stats
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_float16_on_cpu_is_a_clear_startup_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="float16 is not supported on the CPU"):
        LLM(tiny_model_dir("tied"), dtype="float16", device="cpu")
    code = main(["generate", "--model", tiny_model_dir("tied"), "--dtype", "float16"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: dtype float16 is not supported") and "Traceback" not in err


def test_unknown_option_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="unknown engine option.*gpu_memory_fraction"):
        LLM(tiny_model_dir("tied"), gpu_memory_fraction=0.9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
        ({"max_model_len": 0}, "max_model_len must be an integer >= 1"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*63 - 1\]"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
        ({"distributed_executor_backend": "mpi"}, "distributed_executor_backend 'mpi' is not"),
        ({"dtype": "int8"}, "dtype 'int8' is not one of"),
    ],
)
def test_bad_values_name_the_option(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dir("tied"), **kwargs)


def test_missing_local_directory_is_reported_as_such() -> None:
    with pytest.raises(FileNotFoundError, match="model directory '/no/such/model' does not exist"):
        LLM("/no/such/model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("./relative/missing/model")


def test_unknown_flag_prints_the_subcommand_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["serve", "m/x"], ["generate"], ["bench", "throughput"]):
        with pytest.raises(SystemExit) as exc:
            main([*command, "--no-such-flag"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"usage: vllm-mamba {command[0]}"), err
        assert "unrecognized arguments: --no-such-flag" in err


def test_vllm_flags_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "m/x",
            "--disable-log-requests",
            "--trust-remote-code",
            "--gpu-memory-utilization",
            "0.8",
            "--tensor-parallel-size",
            "1",
            "--chat-template",
            "{{ messages }}",
            "--uvicorn-log-level",
            "warning",
        ]
    )
    assert not args.log_requests and args.chat_template == "{{ messages }}"
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("vllm-mamba ")


def test_no_effect_options_warn_once_each(engine_log: pytest.LogCaptureFixture) -> None:
    LLM(
        tiny_model_dir("tied"),
        trust_remote_code=True,
        gpu_memory_utilization=0.7,
        tensor_parallel_size=1,
        max_num_seqs=2,
    )
    warnings = [r.getMessage() for r in engine_log.records if r.levelno == logging.WARNING]
    for option in ("trust_remote_code", "gpu_memory_utilization", "tensor_parallel_size"):
        assert sum(option in w and "no effect" in w for w in warnings) == 1, warnings


def test_banner_says_what_was_loaded(engine_log: pytest.LogCaptureFixture) -> None:
    LLM(tiny_model_dir("tied"), max_num_seqs=3, max_model_len=50)
    banner = [r.getMessage() for r in engine_log.records if r.getMessage().startswith("Loaded ")]
    assert len(banner) == 1
    for part in ("MambaForCausalLM", "dtype float32", "device cpu", "kernels ", "max_model_len 50"):
        assert part in banner[0], banner[0]
    assert "3 state slots" in banner[0] and "MiB of state" in banner[0]


def test_warm_up_failure_is_a_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: ModelRunner, step: Any) -> Any:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(ModelRunner, "execute", broken)
    with pytest.raises(EngineStartupError, match="cannot run with dtype float32.*kernel exploded"):
        LLM(tiny_model_dir("tied"))


def test_warm_up_leaves_no_trace() -> None:
    with VllmRunner(tiny_model_dir("tied"), max_num_seqs=2) as runner:
        runner.assert_drained()
        assert runner.engine.stats.prompt_tokens == runner.engine.stats.generation_tokens == 0
