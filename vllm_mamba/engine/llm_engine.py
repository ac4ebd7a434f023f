"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduler step at a time.

`add_request` tokenizes and validates through `InputProcessor` (bad input raises `ValueError`
before anything enters the engine); `step` schedules, turns the schedule into a plain-data
`worker.step.Step` (`step_builder.StepBuilder`), runs it through the executor (the only call
into the worker), appends the sampled tokens, detokenizes, applies stop conditions and frees
the slots of finished sequences. A step
that raises ends only its own requests (`RequestsFailedError`). `pause_request` holds a request
out of the steps, with what it holds, until `resume_request` (the server's back-pressure on a
client that does not read).

With `enable_prefix_caching`, `engine.prefix_cache` holds the state snapshots and
`prefix_steps.PrefixCacheSteps` does the engine's part of each step with them; with it off,
`prefix_steps.NoPrefixSteps` does nothing, so the step calls the same hooks either way.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Iterable
from typing import Any

from vllm_mamba.cache_specs import KVSpec
from vllm_mamba.config import EngineConfig
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.engine.block_manager import BlockManager
from vllm_mamba.engine.input_processor import InputProcessor, PromptInput
from vllm_mamba.engine.output_processor import OutputProcessor
from vllm_mamba.engine.prefix_cache import PrefixCache
from vllm_mamba.engine.prefix_steps import NoPrefixSteps, PrefixCacheSteps
from vllm_mamba.engine.scheduler import Scheduler, SchedulerOutput
from vllm_mamba.engine.sequence import Sequence, SequenceGroup
from vllm_mamba.engine.spec_steps import NoSpecSteps, SpecDecodeSteps, make_proposer
from vllm_mamba.engine.stats import EngineCounters, StatsSnapshot, now
from vllm_mamba.engine.step_builder import StepBuilder
from vllm_mamba.engine.structured_outputs import StructuredOutputs, grammar_failures
from vllm_mamba.errors import EngineStartupError, RequestsFailedError, is_fatal
from vllm_mamba.executor import make_executor
from vllm_mamba.kv_cache import KVCacheSizing, plan_num_blocks
from vllm_mamba.multimodal.config import image_inputs
from vllm_mamba.ops import cpu_isa
from vllm_mamba.ops.dispatch import get_mamba_ops
from vllm_mamba.outputs import RequestOutput
from vllm_mamba.sampling_params import SamplingParams
from vllm_mamba.state_cache import SlotLayout
from vllm_mamba.tokenizer import cached_tokenizer
from vllm_mamba.worker.model_runner import RunnerConfig

logger = logging.getLogger(__name__)

SPEC_STATE_BYTES = 1 << 30  # spare state slots of speculative decoding, at most

WARMUP_REQUEST_ID = "vllm-mamba-warmup"


class LLMEngine:
    """The synchronous engine shared by `LLM` and the server's async loop.

    Construction loads the weights, allocates the state cache, runs one warm-up prefill and
    decode (so a configuration that cannot run fails here, not at the first request) and logs
    a banner saying what was loaded.

    Raises:
        EngineStartupError: the warm-up failed or gave non-finite log-probabilities.
    """

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        started = time.perf_counter()
        mc = config.model_config
        self.config = config
        self.tokenizer = tokenizer
        # Each rank's worker sets its process up (threads, denormals) and loads its shard.
        self.executor = make_executor(config)
        self.kernels = get_mamba_ops(config.device).name
        if self.kernels == "cpp":  # the ISA level of the kernel build in use
            self.kernels = f"cpp ({cpu_isa.active_level()})"
        specs = self.executor.cache_specs()
        self.state_bytes_per_slot = specs.state_bytes_per_slot()
        self.num_snapshot_slots = self._num_snapshot_slots(self.state_bytes_per_slot)
        self.max_spec_chains = self._max_spec_chains(self.state_bytes_per_slot)
        spec_k = config.speculative_config.num_speculative_tokens if self.max_spec_chains else 0
        # The one owner of the slot layout: the runner and the prefix cache read it.
        self.slot_layout = SlotLayout(
            config.num_state_slots, self.num_snapshot_slots, self.max_spec_chains, spec_k
        )
        sizing = self._plan_kv_cache(specs.kv)
        self.executor.init_caches(self.slot_layout.num_slots, sizing)
        self.cache, self.kv_cache = self.executor.cache, self.executor.kv_cache
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = getattr(mc.hf_config, "eos_token_id", None)
        self.structured_outputs = StructuredOutputs(tokenizer, mc.vocab_size, self.eos_token_id)
        runner_config = RunnerConfig(
            eos_token_id=self.eos_token_id,
            spare_slot_base=self.slot_layout.spare_base,
            max_drafts=self.slot_layout.max_drafts,
            # Prefix caching saves finished sequences with their last hidden row.
            keep_sampled_hidden=self.num_snapshot_slots > 0,
        )
        self.executor.init_runner(runner_config)
        self.step_builder = StepBuilder(self.structured_outputs, self.eos_token_id, mc.vocab_size)
        sc = config.scheduler_config
        blocks = None
        if self.kv_cache is not None:
            blocks = BlockManager(
                self.kv_cache.num_blocks, self.kv_cache.block_size, self.kv_cache.groups.windows
            )
        self.prefix_cache = None
        if self.num_snapshot_slots:
            self.prefix_cache = PrefixCache(
                self.slot_layout, blocks, config.cache_config.prefix_snapshot_interval
            )
        self.scheduler = Scheduler(
            sc.max_num_seqs, sc.max_num_batched_tokens, blocks, self.prefix_cache,
            self.max_spec_chains,
        )  # fmt: skip
        self.stats = EngineCounters()
        self.inputs = InputProcessor(
            tokenizer, mc.vocab_size, mc.max_model_len, image_inputs(config, tokenizer)
        )
        self.outputs = OutputProcessor(tokenizer, self.eos_token_id, mc.max_model_len)
        self.prefix_steps: PrefixCacheSteps | NoPrefixSteps = NoPrefixSteps()
        if self.prefix_cache is not None:
            self.prefix_steps = PrefixCacheSteps(self.prefix_cache, self.step_builder, self.outputs)
        self.spec_steps: SpecDecodeSteps | NoSpecSteps = NoSpecSteps()
        if config.speculative_config is not None:
            self.spec_steps = SpecDecodeSteps(
                config.speculative_config,
                make_proposer(config.speculative_config, self),
                self.step_builder,
                self.scheduler,
                self.outputs,
                mc.max_model_len,
            )
        self._warm_up()
        self.load_seconds = time.perf_counter() - started
        self._log_banner()

    @property
    def model(self) -> Any:
        """Rank 0's model (the whole model with one rank), for inspection."""
        return self.executor.model

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Resolves and loads `args.model` (a local directory or a hub id) into a new engine.

        Raises:
            ValueError: an option out of range or that cannot run on the device.
            FileNotFoundError: the model or its tokenizer is not there.
            EngineStartupError: the model loaded but cannot run as configured.
        """
        config = args.create_engine_config()
        return cls(config, cached_tokenizer(config.model_config.tokenizer))

    def _num_snapshot_slots(self, slot_bytes: int) -> int:
        """Prefix-cache snapshot slots that fit its memory budget (0 when it is off)."""
        cc = self.config.cache_config
        if not cc.enable_prefix_caching:
            return 0
        return max(cc.prefix_cache_memory_bytes // max(slot_bytes, 1), 1)

    def _max_spec_chains(self, slot_bytes: int) -> int:
        """Sequences that may speculate in one step (0 when speculation is off): each needs
        `num_speculative_tokens` spare state slots, within `SPEC_STATE_BYTES`."""
        spec = self.config.speculative_config
        if spec is None:
            return 0
        chains = self.config.num_state_slots
        if spec.disable_by_batch_size is not None:
            chains = min(chains, spec.disable_by_batch_size)
        per_chain = max(spec.num_speculative_tokens * slot_bytes, 1)
        return max(min(chains, SPEC_STATE_BYTES // per_chain), 1)

    def _plan_kv_cache(self, specs: list[KVSpec]) -> KVCacheSizing | None:
        """The KV pool's sizing for the model's attention layers; None when it has none."""
        if not specs:
            return None
        mc, cc = self.config.model_config, self.config.cache_config
        return plan_num_blocks(
            specs,
            cc.block_size,
            self.config.scheduler_config.max_num_seqs,
            mc.max_model_len,
            self.config.device,
            cc.kv_cache_memory_bytes,
            cc.num_gpu_blocks_override,
        )

    def _warm_up(self) -> None:
        """One short prefill and decode through every configured path; leaves no trace."""
        vocab = min(self.config.model_config.vocab_size, len(self.tokenizer))
        prompt = [t % vocab for t in (1, 2, 3, 4)]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)
        try:
            self.add_request(WARMUP_REQUEST_ID, prompt, params)
            finished: list[RequestOutput] = []
            while self.has_unfinished_requests():
                finished += [o for o in self.step() if o.finished]
        except Exception as err:
            self.abort_request(WARMUP_REQUEST_ID)
            raise EngineStartupError(self._startup_failure(repr(err))) from err
        logprob = finished[-1].outputs[0].cumulative_logprob if finished else None
        if logprob is None or not math.isfinite(logprob):
            raise EngineStartupError(self._startup_failure(f"log-probability {logprob}"))
        self.stats = EngineCounters()
        self.step_builder.reset()
        self.prefix_steps.reset()
        self.spec_steps.reset()

    def _startup_failure(self, what: str) -> str:
        mc = self.config.model_config
        return (
            f"the model cannot run with dtype {str(mc.dtype).removeprefix('torch.')} on "
            f"{self.config.device} with the {self.kernels} kernels: the warm-up gave {what}"
        )

    def _log_banner(self) -> None:
        mc = self.config.model_config
        per_seq = self.state_bytes_per_slot
        logger.info(
            "Loaded %s (%s) in %.1f s: dtype %s, state dtype %s, device %s%s, kernels %s, "
            "max_model_len %d, %d state slots x %.3f MiB = %.2f MiB of state, "
            "max_num_batched_tokens %d; weights %.1f MiB, peak resident memory %.1f MiB",
            mc.model,
            mc.architecture,
            self.load_seconds,
            str(mc.dtype).removeprefix("torch."),
            "/".join(str(d).removeprefix("torch.") for d in self.cache.state_dtypes()) or "-",
            self.config.device,
            f" ({threads} threads)" if (threads := self.executor.platform.threads) else "",
            self.kernels,
            mc.max_model_len,
            self.config.num_state_slots,
            per_seq / 2**20,
            per_seq * self.config.num_state_slots / 2**20,
            self.config.scheduler_config.max_num_batched_tokens,
            self.model.weight_bytes() / 2**20,
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        )
        if self.prefix_cache is not None:
            logger.info(
                "Prefix caching: %d snapshot slots x %.3f MiB = %.2f MiB, a snapshot every %d "
                "prompt tokens and at every branch point, prompt end and sequence end",
                self.num_snapshot_slots,
                per_seq / 2**20,
                per_seq * self.num_snapshot_slots / 2**20,
                self.prefix_cache.snapshot_interval,
            )
        if self.kv_cache is not None:
            sizing = self.kv_cache.sizing
            groups = self.kv_cache.groups
            per_seq = groups.blocks_per_seq(
                mc.max_model_len,
                sizing.block_size,
                self.config.scheduler_config.max_num_batched_tokens,
            )
            logger.info(
                "KV cache (%d attention layers, %s%s): %d blocks x %d tokens = %d tokens, "
                "%.2f MiB; %.1f sequences of max_model_len %d fit",
                len(self.kv_cache.specs),
                sizing.source,
                _describe_groups(groups.windows),
                sizing.num_blocks,
                sizing.block_size,
                sizing.num_tokens,
                self.kv_cache.nbytes() / 2**20,
                sizing.num_blocks / per_seq,
                mc.max_model_len,
            )
        if mc.sampling_defaults:
            logger.info(
                "Default sampling parameters from the model's generation_config.json: %s "
                "(--generation-config vllm to ignore them)",
                mc.sampling_defaults,
            )

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (`generation_config`), else `SamplingParams()`."""
        return SamplingParams(**self.config.model_config.sampling_defaults)

    def stats_snapshot(self) -> StatsSnapshot:
        """A snapshot of the queues, slots and counters (call it on the engine's thread)."""
        slots, c = self.scheduler.slots, self.stats
        return StatsSnapshot(
            time=now(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            slots_used=slots.num_used,
            slots_total=slots.num_slots,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            steps=c.steps,
            failed_requests=c.failed_requests,
            preemptions=c.preemptions,
            kv_blocks_used=self.scheduler.block_manager.num_used_blocks,
            kv_blocks_total=self.scheduler.block_manager.num_blocks,
            prefix_cache_queries=self.prefix_steps.queries,
            prefix_cache_hits=self.prefix_steps.hits,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        """The speculative-decoding fields of a `StatsSnapshot` (none when it is off)."""
        c = self.spec_steps.counters
        if c is None:
            return {}
        return {
            "spec_enabled": True,
            "spec_num_drafts": c.num_drafts,
            "spec_num_draft_tokens": c.num_draft_tokens,
            "spec_num_accepted_tokens": c.num_accepted_tokens,
            "spec_accepted_per_pos": tuple(c.accepted_per_pos),
        }

    # ----- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request.

        A prompt dict may carry `"cache_points"` (token offsets where the prefix cache saves
        a snapshot while prefilling: see `InputProcessor.cache_points`).

        Raises:
            ValueError: bad prompt (or cache points) or parameters, or a request id already
                in use.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids, mm = self.inputs.process(prompt)
        cache_points = self.inputs.cache_points(prompt, len(ids), mm)
        self.inputs.check_params(params)
        self.structured_outputs.prepare(params)
        if params.n > self.scheduler.slots.num_slots:
            raise ValueError(
                f"SamplingParams.n ({params.n}) is more than max_num_seqs "
                f"({self.scheduler.slots.num_slots})"
            )
        if any(
            g.request_id == request_id for g in (*self.scheduler.running, *self.scheduler.waiting)
        ):
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self._max_tokens(len(ids), params)
        seq = Sequence(seq_id=self.scheduler.new_seq_id(), index=0, prompt_token_ids=ids)
        if mm is not None:
            seq.prompt_keys = mm.cache_keys
        group = SequenceGroup(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            seqs=[seq],
            max_tokens=max_tokens,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            cache_points=cache_points,
            mm=mm,
        )
        if arrival_time is not None:
            group.arrival_time = arrival_time
        self.scheduler.add(group)

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's output budget: `max_tokens`, else what is left of `max_model_len`
        after the prompt (on a hybrid model, also of the KV cache).

        As vLLM, every model refuses a prompt that leaves no room for output (as long as
        `max_model_len`) and a `max_tokens` beyond what the prompt leaves, with vLLM's
        messages. A hybrid model also refuses a request whose `n` sequences need more KV
        blocks than the whole pool holds (each may have to be recomputed on its own after a
        preemption, so all `n` count).

        Raises:
            ValueError: naming the limit (`'max_tokens' ...` when it is too large).
        """
        max_model_len = self.config.model_config.max_model_len
        if prompt_len >= max_model_len:
            raise ValueError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your request has {prompt_len} input tokens. Please reduce the length of the "
                "input messages."
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
            if self.kv_cache is not None:
                longest = self.kv_cache.groups.max_seq_tokens(
                    self.kv_cache.num_blocks // params.n, self.kv_cache.block_size,
                    self.config.scheduler_config.max_num_batched_tokens,
                )  # fmt: skip
                if longest is not None:
                    max_tokens = max(min(max_tokens, longest - prompt_len), 1)
        elif prompt_len + max_tokens > max_model_len:
            raise ValueError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {max_model_len} tokens and your request "
                f"has {prompt_len} input tokens ({max_tokens} > {max_model_len} - {prompt_len})."
            )
        if self.kv_cache is not None:
            self._check_fits(prompt_len, max_tokens, params.n)
        return max_tokens

    def _check_fits(self, prompt_len: int, max_tokens: int, n: int) -> None:
        """ValueError unless `n` sequences of prompt plus `max_tokens` fit the KV cache."""
        assert self.kv_cache is not None
        total = prompt_len + max_tokens
        bs, num_blocks = self.kv_cache.block_size, self.kv_cache.num_blocks
        chunk = self.config.scheduler_config.max_num_batched_tokens
        need = n * self.kv_cache.groups.blocks_per_seq(total, bs, chunk)
        if need > num_blocks:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) needs {need} KV "
                f"cache blocks of {bs} tokens (n={n}), more than the whole KV cache holds "
                f"({num_blocks} blocks, {num_blocks * bs} tokens); raise "
                f"kv_cache_memory_bytes or num_gpu_blocks_override, or lower max_tokens"
            )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests (unknown ids are ignored) and frees their slots."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self.scheduler.abort(rid)
            for seq in group.seqs if group is not None else []:
                self.spec_steps.on_finished(seq)
                self.step_builder.finish(seq)

    def pause_request(self, request_id: str) -> None:
        """Stops scheduling a request until `resume_request`; it keeps its slots and KV blocks
        (and can be preempted like others). Unknown ids are ignored. Only the server pauses,
        for a client that does not read; `LLM.generate` never does."""
        self.scheduler.set_paused(request_id, True)

    def resume_request(self, request_id: str) -> None:
        """Schedules a paused request again, from where it stopped; unknown ids are ignored."""
        self.scheduler.set_paused(request_id, False)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def has_unpaused_requests(self) -> bool:
        """True while any request that is not paused waits or runs: a step has work."""
        return self.scheduler.has_unpaused()

    # ----- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns the outputs of the requests that progressed.

        Raises:
            RequestsFailedError: the step failed; its requests were ended and their slots
                freed, and the engine can go on stepping.
            GrammarFailedError: (a `RequestsFailedError`) the step ran, but requests had to
                end because of their grammar (`structured_outputs`); the others' outputs are
                its `outputs`.
        """
        preempted = self.scheduler.num_preemptions
        step = self.scheduler.schedule()
        self.stats.preemptions += self.scheduler.num_preemptions - preempted
        if not step.scheduled:
            return []
        ran = False
        # A failed step may not have made the rollbacks it carried: their requests end too.
        rolled_back = self.step_builder.pending_rollback_requests
        try:
            outputs = self._run_step(step)
            ran = True
        except Exception as err:
            if is_fatal(err):
                raise
            failed = sorted({item.group.request_id for item in step.scheduled} | {*rolled_back})
            logger.exception("an engine step failed; ending its requests %s", failed)
            self.abort_request(failed)
            self.stats.failed_requests += len(failed)
            raise RequestsFailedError(failed, err) from err
        finally:
            self.prefix_steps.end_step(step, failed=not ran)
        failure = grammar_failures([item.group for item in step.scheduled], outputs)
        if failure is not None:  # over their matching budget, or no allowed token left
            self.abort_request(failure.request_ids)
            self.stats.failed_requests += len(failure.request_ids)
            raise failure
        return outputs

    def _run_step(self, step: SchedulerOutput) -> list[RequestOutput]:
        started = time.monotonic()
        for item in step.scheduled:
            if item.group.first_scheduled_time is None:
                item.group.first_scheduled_time = started
        scored = self.prefix_steps.before_forward(step)
        result = self.executor.execute(self.step_builder.build(step, scored))
        self.stats.steps += 1
        touched: dict[str, SequenceGroup] = {}
        now_s = time.monotonic()
        for hit in step.hits:  # scored from a saved hidden row: before the chunk's own
            chunk = result.hidden_logprobs.get(hit.group.request_id)
            if chunk is not None and hit.seq.index == 0:
                self.outputs.append_prompt_logprobs(hit.group, chunk)
        for item in step.scheduled:
            if item.is_spec:  # counted once its chain is verified (`spec_steps.apply`)
                continue
            item.seq.num_computed_tokens += item.num_tokens
            for child in item.children:
                child.num_computed_tokens = item.seq.num_computed_tokens
            if item.seq.num_computed_tokens <= len(item.seq.prompt_token_ids):
                self.stats.prompt_tokens += item.num_tokens
            chunk = result.prompt_logprobs.get(item.group.request_id)
            if chunk is not None:
                self.outputs.append_prompt_logprobs(item.group, chunk)
        self.prefix_steps.after_forward(step, result)
        spec_hidden, appended = self.spec_steps.apply(step, result, now_s)
        self.stats.generation_tokens += appended
        for item in step.scheduled:
            if item.is_spec:
                seq, touched[item.group.request_id] = item.seq, item.group
                if seq.status.finished:
                    self.prefix_steps.on_finished(item.group, seq, spec_hidden[seq.seq_id])
                    self._forget(seq)
                continue
            for seq in [item.seq, *item.children]:
                if seq.seq_id in result.samples:
                    row, out = result.samples[seq.seq_id]
                    self.outputs.append_token(item.group, seq, row, out, now_s)
                    self.stats.generation_tokens += 1
                    if seq.status.finished:
                        hidden = result.sampled_hidden.get(seq.seq_id)
                        self.prefix_steps.on_finished(item.group, seq, hidden)
                        self._forget(seq)
                    touched[item.group.request_id] = item.group
        self.scheduler.remove_finished()
        self.spec_steps.propose(self.scheduler.running)
        return [g.to_output() for g in touched.values()]

    def _forget(self, seq: Sequence) -> None:
        """A finished sequence leaves: the proposer, the worker (with the next step) and the
        scheduler (its slot and KV blocks) forget it."""
        self.spec_steps.on_finished(seq)
        self.step_builder.finish(seq)
        self.scheduler.finish_seq(seq)


def _describe_groups(windows: tuple[int | None, ...]) -> str:
    """The banner's words for the KV groups: empty for one full-attention group."""
    if windows == (None,):
        return ""
    kinds = ", ".join("full" if w is None else f"window {w}" for w in windows)
    return f"; {len(windows)} KV groups: {kinds}"
