"""`POST /v1/completions`: prompts in, one engine request per prompt, choices out (whole, or
streamed as server-sent events).

A batch of `P` prompts with `n` completions each gives `P * n` choices; choice `i * n + j` is
completion `j` of prompt `i`.

With `echo` and `logprobs`, a choice's logprobs cover the prompt's tokens (scored by the
prefill itself: the engine's prompt logprobs, entry 0 null) and then the generated ones, so
`token_logprobs[i]` is log p(token i | tokens before it) over the whole text. This is what
lm-evaluation-harness sums for a loglikelihood. `max_tokens: 0` with `echo` returns the prompt
alone: the engine runs with `max_tokens=1` (the sampled token comes from the prefill's last
position, so no extra forward) and the server drops that token.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_mamba.engine.async_engine import AsyncLLMEngine
from vllm_mamba.entrypoints.openai.errors import (
    ENGINE_ERRORS,
    APIError,
    engine_error_status,
    internal_error_message,
)
from vllm_mamba.entrypoints.openai.logprobs import (
    completion_logprobs,
    join_logprobs,
    prompt_logprobs_json,
    token_texts,
)
from vllm_mamba.entrypoints.openai.metrics import ServerMetrics
from vllm_mamba.entrypoints.openai.output_constraints import (
    ConstraintError,
    compile_structured,
    structured_source,
)
from vllm_mamba.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from vllm_mamba.entrypoints.openai.served_model import ServedModel
from vllm_mamba.entrypoints.openai.streaming import (
    SSE_DONE,
    TextDeltas,
    merge_streams,
    sse,
    sse_error,
    unless_disconnected,
)
from vllm_mamba.outputs import CompletionOutput, RequestOutput
from vllm_mamba.sampling_params import SamplingParams

Prompt = str | list[int]


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The request's prompts: a string or token ids is one prompt, a list of them a batch.

    Raises:
        APIError: an empty batch.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt is empty: give a string, token ids or a list of them", 400, "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


class OpenAIServingCompletion:
    """Handles completion requests against one engine."""

    def __init__(self, engine: AsyncLLMEngine, model: ServedModel, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model = model
        self.metrics = metrics

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        """Runs a completion request and answers it (a stream when `req.stream`)."""
        model_name = self.model.resolve(req.model)
        unsupported = req.unsupported_field()
        if unsupported is not None:
            raise APIError(f"{unsupported} is not supported by this server", 400, unsupported)
        if req.suffix:
            raise APIError("suffix is not supported", 400, "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of must equal n (or be unset)", 400, "best_of")
        if req.max_tokens == 0 and not req.echo:
            raise APIError("max_tokens must be >= 1 (0 only with echo)", 400, "max_tokens")
        prompts = prompt_list(req.prompt)
        prompt_only = req.echo and req.max_tokens == 0
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        max_tokens = 1 if prompt_only else req.max_tokens
        try:
            source = structured_source(req)
            structured = source and source.params
            params = req.sampling_params(max_tokens, req.logprobs, prompt_logprobs, structured)
            await compile_structured(self.engine, source)
        except ConstraintError as err:
            raise APIError(str(err), 400, err.field) from err
        request_id = random_id("cmpl")
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        arrival = time.monotonic()
        streams = []
        try:
            added = await self.engine.add_requests(list(zip(ids, prompts)), params)
            for one in added:
                stream = self.metrics.track(one, arrival)
                streams.append(_without_generation(stream) if prompt_only else stream)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        if req.stream:
            body = self._stream(req, params, request_id, model_name, streams, ids)
            return StreamingResponse(body, media_type="text/event-stream")
        finals = await unless_disconnected(raw, self._collect(streams, ids))
        if finals is None:
            return Response(status_code=499)
        response = CompletionResponse(id=request_id, model=model_name, choices=[])
        completion_tokens = 0
        for i, out in enumerate(finals):
            for comp in out.outputs:
                choice = await self._choice(req, i * req.n + comp.index, out, comp)
                response.choices.append(choice)
                completion_tokens += len(comp.token_ids)
        response.usage = _usage(finals, completion_tokens)
        return JSONResponse(response.model_dump())

    async def _collect(self, streams: list, ids: list[str]) -> list[RequestOutput]:
        """Every prompt's final output; aborts them all when interrupted."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge_streams(streams):
                finals[i] = out
        finally:
            for rid, out in zip(ids, finals):
                if out is None or not out.finished:
                    self.engine.abort(rid)
        return finals  # type: ignore[return-value]

    async def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return await self.engine.run_tokenizer(self.engine.tokenizer.decode, out.prompt_token_ids)

    async def _echo_logprobs(self, out: RequestOutput, top_k: int) -> CompletionLogprobs:
        """The logprobs of the prompt's tokens, from the prefill; entry 0 is null."""
        token_ids, entries = out.prompt_token_ids, out.prompt_logprobs
        assert entries is not None and len(entries) == len(token_ids), "prompt logprobs missing"
        texts = token_texts(token_ids, entries)
        texts[0] = await self.engine.run_tokenizer(self.engine.tokenizer.decode, token_ids[:1])
        return completion_logprobs(token_ids, entries, texts, top_k)

    async def _choice(
        self, req: CompletionRequest, index: int, out: RequestOutput, comp: CompletionOutput
    ) -> CompletionChoice:
        """One whole choice, with the prompt (and its logprobs) in front when `echo`."""
        prefix = await self._prompt_text(out) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            entries = comp.logprobs or []
            texts = token_texts(comp.token_ids, entries)
            logprobs = completion_logprobs(
                comp.token_ids, entries, texts, req.logprobs, len(prefix)
            )
            if req.echo:
                logprobs = join_logprobs(await self._echo_logprobs(out, req.logprobs), logprobs)
        return CompletionChoice(
            index=index,
            text=prefix + comp.text,
            logprobs=logprobs,
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
            prompt_logprobs=(
                None
                if req.prompt_logprobs is None
                else prompt_logprobs_json(out.prompt_logprobs, req.prompt_logprobs)
            ),
        )

    async def _stream(
        self,
        req: CompletionRequest,
        params: SamplingParams,
        request_id: str,
        model_name: str,
        streams: list,
        ids: list[str],
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed completion."""
        deltas = [TextDeltas(params.stop_list) for _ in streams]
        prefixes: list[str] = [""] * len(streams)
        finals: list[RequestOutput | None] = [None] * len(streams)
        done: set[int] = set()
        completion_tokens = 0
        try:
            async for i, out in merge_streams(streams):
                if req.echo and finals[i] is None:
                    prefixes[i] = await self._prompt_text(out)
                finals[i] = out
                choices = []
                for comp in out.outputs:
                    index = i * req.n + comp.index
                    first = comp.index not in deltas[i].sent_tokens
                    choice = self._delta(req, deltas[i], comp, index, done, len(prefixes[i]))
                    if choice is None:
                        continue
                    if first and req.echo:
                        await self._echo_first(req, out, choice, prefixes[i])
                    choices.append(choice)
                    if comp.finished:
                        completion_tokens += len(comp.token_ids)
                if choices:
                    yield sse(CompletionResponse(id=request_id, model=model_name, choices=choices))
            if req.include_usage:
                usage = _usage(finals, completion_tokens)  # type: ignore[arg-type]
                chunk = CompletionResponse(id=request_id, model=model_name, choices=[], usage=usage)
                yield sse(chunk)
            yield SSE_DONE
        except ENGINE_ERRORS as err:
            yield sse_error(str(err), engine_error_status(err))
            yield SSE_DONE
        except Exception as err:  # a bug: the client gets an error event, not a cut stream
            yield sse_error(internal_error_message(err), 500)
            yield SSE_DONE
        finally:
            for rid, out in zip(ids, finals):
                if out is None or not out.finished:
                    self.engine.abort(rid)

    async def _echo_first(
        self, req: CompletionRequest, out: RequestOutput, choice: CompletionChoice, prefix: str
    ) -> None:
        """Puts the prompt (and its logprobs) in front of a streamed choice's first delta."""
        choice.text = prefix + choice.text
        if req.logprobs is not None:
            generated = choice.logprobs or CompletionLogprobs()
            choice.logprobs = join_logprobs(await self._echo_logprobs(out, req.logprobs), generated)

    @staticmethod
    def _delta(
        req: CompletionRequest,
        deltas: TextDeltas,
        comp: CompletionOutput,
        index: int,
        done: set[int],
        prefix_len: int,
    ) -> CompletionChoice | None:
        """The new part of one choice, or None when it has nothing new.

        `prefix_len` is the length of the echoed prompt in front of the choice's text.
        """
        if index in done:
            return None
        offset = prefix_len + deltas.sent_chars.get(comp.index, 0)
        text = deltas.text(comp.index, comp.text, comp.finished)
        start, end = deltas.tokens(comp.index, len(comp.token_ids))
        if comp.finished:
            done.add(index)
        elif not text and start == end:
            return None
        logprobs = None
        if req.logprobs is not None and comp.logprobs is not None:
            token_ids, entries = comp.token_ids[start:end], comp.logprobs[start:end]
            texts = token_texts(token_ids, entries)
            logprobs = completion_logprobs(token_ids, entries, texts, req.logprobs, offset)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
        )


async def _without_generation(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Passes a `max_tokens: 0` request's outputs through with their generated token dropped."""
    async for out in stream:
        outputs = [
            replace(
                comp,
                text="",
                token_ids=[],
                cumulative_logprob=0.0,
                logprobs=None if comp.logprobs is None else [],
                finish_reason="length" if comp.finished else None,
                stop_reason=None,
            )
            for comp in out.outputs
        ]
        yield replace(out, outputs=outputs)


def _usage(finals: list[RequestOutput], completion_tokens: int) -> UsageInfo:
    """Token counts: each prompt once, every completion."""
    return UsageInfo.of([out for out in finals if out is not None], completion_tokens)
