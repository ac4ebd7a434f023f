"""Structured outputs: grammars compiled with xgrammar, cached, and one matcher per sequence.

A request's `StructuredOutputsParams` (a JSON schema, regex, choice list, EBNF grammar or any
JSON object) is compiled once at `add_request` (a spec xgrammar cannot compile is a
`ValueError` there) and kept in a bounded cache keyed by kind and spec, shared by every
request that asks for the same thing. Each sequence gets its own `GrammarMatcher` when it is
first sampled (so the children of `n > 1`, forked before the first generated token, start
fresh); the sampler fills a token bitmask from it for that row only, and the engine advances it
with every accepted token. A matcher that terminates (its grammar is complete and it accepted
EOS) ends the sequence. Preemption by recompute leaves the matcher as it is, since the tokens
it has seen are kept. JSON is generated compact (no free whitespace between tokens), which also
keeps small models from looping on whitespace. xgrammar is imported only when a request uses
structured outputs.

Thread safety: `compile` may run on any thread once `ensure_compiler` has run (the server
compiles on its tokenizer thread, so a slow grammar does not hold up the engine's steps; the
engine's own `compile` at `add_request` then finds it in the cache). Building the compiler
reads the tokenizer, so it runs on the engine's thread.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from vllm_mamba.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 256


class StructuredOutputError(ValueError):
    """A structured-outputs spec that cannot be compiled; names the `structured_outputs`
    field at fault."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"SamplingParams.structured_outputs.{kind} cannot be compiled: {why}")
        self.kind = kind
        self.why = why


class StructuredOutputs:
    """Compiles and caches grammars for one tokenizer, and makes matchers from them.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: rows of the model's logits (the bitmask covers all of them).
        eos_token_id: the token that ends a sequence (the grammar's stop token).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def has_compiler(self) -> bool:
        """True once the compiler is built (then `compile` may run on any thread)."""
        return self._compiler is not None

    def ensure_compiler(self) -> Any:
        """The grammar compiler for this tokenizer, built on first use (it reads the
        tokenizer: call it first on the thread that owns the tokenizer)."""
        if self._compiler is None:
            import xgrammar as xgr

            stop = None if self.eos_token_id is None else [self.eos_token_id]
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
            )
            # xgrammar's own cache is unbounded; this class keeps a bounded one.
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`, from the cache when it was compiled before.

        Raises:
            StructuredOutputError: xgrammar cannot compile the spec (the message says why).
        """
        kind = spec.kind
        try:
            text = _spec_text(spec)
        except (TypeError, ValueError) as err:
            raise StructuredOutputError(kind, f"not JSON-serializable: {err}") from err
        key = (kind, text)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiler = self.ensure_compiler()
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "choice":
                compiled = compiler.compile_grammar(_choice_grammar(spec.choice or []))
            else:
                compiled = compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as err:
            raise StructuredOutputError(kind, _first_line(err)) from err
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def prepare(self, params: SamplingParams) -> None:
        """Checks a new request's constraints: compiles its grammar, tokenizes its bad words.

        Raises:
            StructuredOutputError: the grammar cannot be compiled.
        """
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        if params.structured_outputs is not None:
            self.compile(params.structured_outputs)

    def new_matcher(self, params: SamplingParams) -> Any:
        """A fresh matcher for one sequence of a request with `structured_outputs`."""
        import xgrammar as xgr

        assert params.structured_outputs is not None
        return xgr.GrammarMatcher(self.compile(params.structured_outputs))


def accept_token(matcher: Any, token: int) -> bool:
    """Advances a sequence's matcher by its new token; True when the sequence must end (the
    grammar is complete, or, which the bitmask should prevent, the token was rejected)."""
    if not matcher.accept_token(token):
        logger.warning("the grammar rejected token %d; ending the sequence", token)
        return True
    return matcher.is_terminated()


def _spec_text(spec: StructuredOutputsParams) -> str:
    """The spec as text: what is compiled, and the cache key."""
    if spec.json is not None:
        if isinstance(spec.json, dict):
            return json.dumps(spec.json)
        return spec.json
    if spec.choice is not None:
        return json.dumps(spec.choice)
    return spec.regex or spec.grammar or ""


def _choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(err: BaseException) -> str:
    """xgrammar's message without its source location prefix and trailing blank lines."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text.removeprefix("Check failed: (error.empty()) is false: ")
