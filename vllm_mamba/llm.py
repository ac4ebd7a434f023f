"""`LLM`: the offline API. Load a model once, then `generate` for many prompts at once;
`shutdown()` (or leaving `with LLM(...) as llm:`) stops its tensor-parallel workers and leaves
their process group, so another engine can start in the same process."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.engine.llm_engine import LLMEngine, PromptInput
from vllm_mamba.entrypoints.chat_cache_points import chat_cache_points
from vllm_mamba.entrypoints.chat_utils import (
    ChatTemplate,
    ImageRef,
    check_template_kwargs,
    conversation_message,
    load_images,
)
from vllm_mamba.outputs import RequestOutput
from vllm_mamba.sampling_params import SamplingParams


class LLM:
    """A model loaded into an engine, for batch generation.

    Args:
        model: a local Hugging Face model directory, a GGUF file, a shipped name or a hub id.
        **kwargs: any `EngineArgs` option, with vLLM's names: `tokenizer`, `revision`,
            `download_dir`, `dtype` (`auto`, `float32`, `bfloat16`, `float16`),
            `max_num_seqs` (sequences in flight = state slots), `max_num_batched_tokens`
            (tokens per forward; longer prompts are prefilled in chunks), `max_model_len`,
            `seed`, `enforce_eager`, `device` (`auto`, `cpu`, `cuda`), `ssm_state_dtype`, ...

    Raises:
        TypeError: an option `EngineArgs` does not have.
        ValueError: an option out of range, or one that cannot run on the device.
        FileNotFoundError: the model is not there.
        EngineStartupError: the model loaded but its warm-up failed.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"LLM() got unknown engine option(s) {', '.join(unknown)}; "
                f"the options are: {', '.join(sorted(known - {'model'}))}"
            )
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()
        self._closed = False

    def shutdown(self) -> None:
        """Aborts what is left, stops the engine's workers and leaves their process group
        (idempotent); the `LLM` generates no more afterwards."""
        if self._closed:
            return
        self._closed = True
        engine = self.llm_engine
        engine.abort_request(
            [g.request_id for g in (*engine.scheduler.running, *engine.scheduler.waiting)]
        )
        engine.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """An `LLM` with the options of `args` (as built by `EngineArgs.from_cli_args`)."""
        return cls(**dataclasses.asdict(args))

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults from its `generation_config.json` (vLLM's
        `generation_config="auto"`), else `SamplingParams()`."""
        return self.llm_engine.get_default_sampling_params()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to conversations, rendered with the model's chat template (as
        the server renders them: tools, earlier tool calls and results, documents and
        template variables reach the template).

        Args:
            messages: one conversation (OpenAI-style messages: `role`, `content` as text or
                parts, and `name`, `tool_calls`, `tool_call_id` where they apply) or a list of
                conversations. An image-text model takes image parts: `image_url` (a
                `data:` URL, an `http(s)://` URL, a `file://` URL under
                `allowed_local_media_path`) and `image_pil` (a `PIL.Image.Image`).
            sampling_params: one for all conversations, or one per conversation.
            use_tqdm: show a progress bar.
            chat_template: a template (file or text) instead of the tokenizer's.
            add_generation_prompt: end each prompt with the start of an assistant turn.
            continue_final_message: end each prompt inside its last message, so the model
                continues it (not with `add_generation_prompt`).
            tools: OpenAI-style tool definitions passed to the template as `tools`.
            documents: passed to the template as `documents`.
            chat_template_kwargs: more template variables, e.g. `{"enable_thinking": False}`.

        Returns:
            One `RequestOutput` per conversation, in input order.

        Raises:
            ValueError: the model has no chat template and none was given, or a message
                that cannot be rendered.
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation or a list of conversations")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        template = ChatTemplate(self.llm_engine.tokenizer, chat_template)
        kwargs = check_template_kwargs(chat_template_kwargs)
        inputs = self.llm_engine.inputs
        prompts: list[PromptInput] = []
        images_ok = inputs.images is not None
        for conversation in conversations:
            refs: list[ImageRef] | None = [] if images_ok else None
            turns = [
                conversation_message(m, refs, f"messages[{i}]") for i, m in enumerate(conversation)
            ]
            text = template.render(
                turns,
                add_generation_prompt,
                tools=tools,
                documents=documents,
                template_kwargs=kwargs,
                continue_final_message=continue_final_message,
            )
            ids = inputs.encode(text, add_special_tokens=False)
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
            if refs:
                assert inputs.images is not None
                prompt["multi_modal_data"] = {"image": load_images(refs, inputs.images.media)}
            if self.llm_engine.prefix_cache is not None and len(turns) > 1:
                # Snapshots where messages end: a later conversation sharing them hits.
                prompt["cache_points"] = chat_cache_points(
                    lambda prefix: template.render(
                        prefix, False, tools=tools, documents=documents, template_kwargs=kwargs
                    ),
                    turns,
                    text,
                    ids,
                    functools.partial(inputs.encode, add_special_tokens=False),
                )
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        """The engine's tokenizer."""
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates completions for all prompts together (continuous batching).

        Args:
            prompts: a string, a list of strings, token ids (`{"prompt_token_ids": [...]}`),
                or a list of those. A dict may hold `prompt`, `prompt_token_ids`,
                `cache_points` and, for an image-text model, `multi_modal_data`
                (`{"image": PIL image or list}`, one placeholder token per image in the
                prompt); any other field is refused.
            sampling_params: one for all prompts, or one per prompt.
            use_tqdm: show a progress bar with token throughput.

        Returns:
            One finished `RequestOutput` per prompt, in input order.

        Raises:
            ValueError: a bad prompt or parameter (a prompt field the engine does not use,
                such as `multi_modal_data`, is named); nothing is left in the engine.
            RequestsFailedError: a step failed; every request of this call was ended and
                the engine can serve the next call.
        """
        if self._closed:
            raise RuntimeError("this LLM was shut down")
        prompt_list = self._as_list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
        engine = self.llm_engine
        request_ids = [f"gen-{next(self._ids)}" for _ in prompt_list]
        try:
            for rid, prompt, params in zip(request_ids, prompt_list, params_list):
                engine.add_request(rid, prompt, params)
        except Exception:
            engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    @staticmethod
    def _as_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        return prompts

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} tok/s")
        except BaseException:
            engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]
