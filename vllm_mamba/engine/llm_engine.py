"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduler step at a time.

`add_request` tokenizes and validates (bad input raises `ValueError` before anything enters
the engine); `step` schedules, runs the model once, appends the sampled tokens, detokenizes,
applies stop conditions and frees the slots of finished sequences.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_mamba.attention.selector import select_attention_backend
from vllm_mamba.config import (
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    derive_max_model_len,
    resolve_device,
    resolve_dtype,
    resolve_state_dtype,
)
from vllm_mamba.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from vllm_mamba.engine.model_runner import ModelRunner, PromptLogprobChunk, StepResult
from vllm_mamba.engine.scheduler import Scheduler
from vllm_mamba.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from vllm_mamba.mamba_cache import MambaCache
from vllm_mamba.model_loader import build_model, load_hf_config, resolve_model_path
from vllm_mamba.outputs import Logprob, PositionLogprobs, RequestOutput
from vllm_mamba.sampling_params import SamplingParams
from vllm_mamba.tokenizer import default_tokenizer_source, load_tokenizer

PromptInput = str | list[int] | dict[str, Any]


@dataclass
class EngineStats:
    """Counters for metrics and benchmarks."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0


class LLMEngine:
    """The synchronous engine shared by `LLM` and the server's async loop."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        mc = config.model_config
        self.config = config
        self.tokenizer = tokenizer
        model, _ = build_model(mc.path, mc.hf_config, mc.dtype, config.device)
        self.model = model
        self.backend = select_attention_backend(type(model))
        shape = model.get_mamba_state_shape(mc.hf_config, mc.dtype)
        if config.ssm_state_dtype is not None:
            shape = dataclasses.replace(shape, ssm_dtype=config.ssm_state_dtype)
        self.cache = MambaCache(shape, config.num_state_slots, config.device)
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = getattr(mc.hf_config, "eos_token_id", None)
        self.runner = ModelRunner(
            model, self.cache, self.backend, config.device, mc.seed, self.eos_token_id
        )
        sc = config.scheduler_config
        if config.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_cuda_graphs(sc.max_num_seqs)
        self.scheduler = Scheduler(sc.max_num_seqs, sc.max_num_batched_tokens)
        self.stats = EngineStats()
        self._token_text: dict[int, str] = {}

    @classmethod
    def from_args(
        cls,
        model: str,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        device: str = "auto",
        ssm_state_dtype: str = "auto",
    ) -> LLMEngine:
        """Resolves and loads `model` (a local directory or a hub id) into a new engine."""
        path = resolve_model_path(model)
        hf_config = load_hf_config(path)
        from vllm_mamba.models.registry import ModelRegistry

        _, arch = ModelRegistry.resolve_model_cls(getattr(hf_config, "architectures", None))
        tokenizer = tokenizer or default_tokenizer_source(path)
        tok_path = resolve_model_path(tokenizer) if tokenizer else path
        model_config = ModelConfig(
            model=model,
            path=path,
            hf_config=hf_config,
            architecture=arch,
            dtype=resolve_dtype(dtype, hf_config),
            max_model_len=derive_max_model_len(hf_config, max_model_len),
            tokenizer=tok_path,
            seed=seed,
        )
        config = EngineConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
            device=resolve_device(device),
            enforce_eager=enforce_eager,
            ssm_state_dtype=resolve_state_dtype(ssm_state_dtype),
        )
        return cls(config, load_tokenizer(tok_path))

    # ----- requests -------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Returns `(text or None, token ids)` of a prompt, validated.

        Raises:
            ValueError: empty, too long, or with token ids outside the vocabulary.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string or token ids, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError("prompt must be a string")
            ids = self.tokenizer.encode(text, add_special_tokens=True) if text else []
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        max_len = self.config.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, more than max_model_len ({max_len})"
            )
        return text, ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request.

        Raises:
            ValueError: bad prompt or parameters, or a request id already in use.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize_prompt(prompt)
        if params.n > self.scheduler.slots.num_slots:
            raise ValueError(
                f"SamplingParams.n ({params.n}) is more than max_num_seqs "
                f"({self.scheduler.slots.num_slots})"
            )
        if any(
            g.request_id == request_id for g in (*self.scheduler.running, *self.scheduler.waiting)
        ):
            raise ValueError(f"request_id {request_id!r} is already in use")
        room = self.config.model_config.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else max(room, 1)
        seq = Sequence(seq_id=self.scheduler.new_seq_id(), index=0, prompt_token_ids=ids)
        group = SequenceGroup(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            seqs=[seq],
            max_tokens=max_tokens,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if arrival_time is not None:
            group.arrival_time = arrival_time
        self.scheduler.add(group)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests (unknown ids are ignored) and frees their slots."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.scheduler.abort(rid)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ----- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns the outputs of the requests that progressed."""
        step = self.scheduler.schedule()
        if not step.scheduled:
            return []
        result = self.runner.execute(step)
        self.stats.steps += 1
        touched: dict[str, SequenceGroup] = {}
        now = time.monotonic()
        for item in step.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            for child in item.children:
                child.num_computed_tokens = item.seq.num_computed_tokens
            if item.seq.num_computed_tokens <= len(item.seq.prompt_token_ids):
                self.stats.prompt_tokens += item.num_tokens
            chunk = result.prompt_logprobs.get(item.group.request_id)
            if chunk is not None:
                self._append_prompt_logprobs(item.group, chunk)
            for seq in [item.seq, *item.children]:
                if seq.seq_id in result.samples:
                    self._append_token(item.group, seq, result, now)
                    touched[item.group.request_id] = item.group
        self.scheduler.remove_finished()
        return [g.to_output() for g in touched.values()]

    def _append_token(
        self, group: SequenceGroup, seq: Sequence, result: StepResult, now: float
    ) -> None:
        row, out = result.samples[seq.seq_id]
        token = out.token_ids[row]
        params = group.params
        seq.output_token_ids.append(token)
        self.stats.generation_tokens += 1
        if group.first_token_time is None:
            group.first_token_time = now
        group.last_token_time = now
        seq.cumulative_logprob += out.token_logprobs[row]
        if params.logprobs is not None:
            entry = {
                tid: Logprob(lp, rank + 1, self._text_of(tid))
                for rank, (tid, lp) in enumerate(zip(out.topk_ids[row], out.topk_logprobs[row]))
            }
            entry.setdefault(
                token, Logprob(out.token_logprobs[row], out.token_ranks[row], self._text_of(token))
            )
            seq.output_logprobs.append(entry)
        self._check_stop(group, seq, token)
        if seq.status.finished:
            self.scheduler.finish_seq(seq)

    def _check_stop(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        """Detokenizes `token` into the sequence's text and applies the stop conditions."""
        params = group.params
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens
            )
        is_eos = token == self.eos_token_id and not params.ignore_eos
        is_stop_token = token in params.stop_token_ids
        new_text = seq.detokenizer.add(token)
        if not (is_eos or is_stop_token) or params.include_stop_str_in_output:
            seq.output_text += new_text
        n_out = len(seq.output_token_ids)
        if n_out >= params.min_tokens:
            if is_eos or is_stop_token:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token if is_stop_token and not is_eos else None
                return
            match = find_stop_string(seq.output_text, len(new_text), params.stop_list)
            if match is not None:
                stop, index = match
                cut = index + len(stop) if params.include_stop_str_in_output else index
                seq.output_text = seq.output_text[:cut]
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = stop
                return
        if n_out >= group.max_tokens or seq.num_tokens >= self.config.model_config.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    def _append_prompt_logprobs(self, group: SequenceGroup, chunk: PromptLogprobChunk) -> None:
        assert group.prompt_logprobs is not None and len(group.prompt_logprobs) == chunk.start
        prompt = group.prompt_token_ids
        for j, lp in enumerate(chunk.token_logprobs):
            target = prompt[chunk.start + j]
            entry: PositionLogprobs = {
                tid: Logprob(tlp, rank + 1, self._text_of(tid))
                for rank, (tid, tlp) in enumerate(zip(chunk.topk_ids[j], chunk.topk_logprobs[j]))
            }
            entry.setdefault(target, Logprob(lp, chunk.token_ranks[j], self._text_of(target)))
            group.prompt_logprobs.append(entry)

    def _text_of(self, token_id: int) -> str:
        """The text of one token, cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text
