"""Structured outputs: grammars compiled with xgrammar, cached, and one matcher per sequence.

A request's `StructuredOutputsParams` (a JSON schema, regex, choice list, EBNF grammar or any
JSON object) is compiled once at `add_request` (a spec xgrammar cannot compile is a
`ValueError` there) and kept in a cache bounded by the compiled grammars' bytes
(`cache_bytes`), keyed by kind and spec, shared by every
request that asks for the same thing. Each sequence gets its own `GrammarMatcher` when it is
first sampled (so the children of `n > 1`, forked before the first generated token, start
fresh); the sampler fills a token bitmask from it for that row only, and the engine advances it
with every accepted token. A matcher that terminates (its grammar is complete and it accepted
EOS) ends the sequence. Preemption by recompute leaves the matcher as it is, since the tokens
it has seen are kept. JSON is generated compact (no free whitespace between tokens), which also
keeps small models from looping on whitespace. xgrammar is imported only when a request uses
structured outputs.

Thread safety: `compile`, `cached` and `put` may run on any thread once `ensure_compiler` has
run. The server compiles in worker processes under a time budget (`grammar_pool.py`) and
attaches the compiled grammar to the spec (`StructuredOutputsParams.compiled`), so the
engine's own `compile` at `add_request` does no work. Building the compiler reads the
tokenizer, so it runs on the engine's thread. Error messages from xgrammar are cleaned of
source paths (`clean_message`). A tokenizer with `token_bytes()` (the RWKV World tokenizer, which
xgrammar cannot read itself) gives xgrammar its raw byte vocabulary.

Matching work is bounded per request. Compiles run off the engine thread, but a matcher runs
on it, between steps, and for an ambiguous grammar (`x ::= x x | "a" | ""`) xgrammar's Earley
parser does more work with every token (filling one mask took 25 ms after 10 tokens, 0.4 s
after 50 and 2.9 s after 110): every other request waits for it. So each sequence's matcher
(`Matcher`) charges the CPU time of its calls to its request (`RequestMatching`), which may
spend `MATCH_BUDGET_S` plus `MATCH_S_PER_TOKEN` per token its matchers accepted (an ordinary
JSON schema or regex costs well under a millisecond a token). A request over its budget, or
one whose `allowed_token_ids` leave no token its grammar allows, is ended by the engine after
the step with `GrammarFailedError`; from then on its matchers do no work. A request whose
`allowed_token_ids` exclude every token its grammar can start with is a `ValueError` at
`add_request` (`prepare`).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from vllm_mamba.errors import RequestsFailedError
from vllm_mamba.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars hold token masks: the cache is bounded by their bytes, not their count.
CACHE_BYTES = 64 * 2**20
# A request's matchers may spend this much CPU time, plus so much per token they accepted.
MATCH_BUDGET_S = 0.1
MATCH_S_PER_TOKEN = 0.001
_PATH = re.compile(r"(?:[\w.~-]*/)+[\w.-]+\.(?:h|hpp|cc|cpp|cxx|c|cu|cuh|py)\b(?::\d+)?")


class StructuredOutputError(ValueError):
    """A structured-outputs spec that cannot be compiled; names the `structured_outputs`
    field at fault."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"SamplingParams.structured_outputs.{kind} cannot be compiled: {why}")
        self.kind = kind
        self.why = why


class GrammarFailedError(RequestsFailedError):
    """Requests ended during generation because of their own grammar (over their matching
    budget, or no token left that both the grammar and `allowed_token_ids` allow): a client
    error (`status` 400). `outputs` are the other requests' outputs of the step, which ran."""

    status = 400

    def __init__(self, request_ids: list[str], message: str, outputs: list[Any]) -> None:
        super().__init__(request_ids, ValueError(message))
        self.args = (message,)
        self.param = "structured_outputs"
        self.outputs = outputs


class RequestMatching:
    """The grammar matching of one request: the CPU time its sequences' matchers spent, the
    tokens they accepted, and, once set, why the request must end (`error`).

    Args:
        kind: the request's structured-outputs kind (for the messages).
        allowed_token_ids: the request's `allowed_token_ids` (None: every token).
        budget_s, per_token_s: the CPU time its matchers may spend, plus so much per token.
    """

    def __init__(
        self,
        kind: str,
        allowed_token_ids: list[int] | None = None,
        budget_s: float = MATCH_BUDGET_S,
        per_token_s: float = MATCH_S_PER_TOKEN,
    ) -> None:
        self.kind = kind
        self.budget_s = budget_s
        self.per_token_s = per_token_s
        self.used_s = 0.0
        self.tokens = 0
        self.error: str | None = None
        self._allowed = None if not allowed_token_ids else torch.tensor(allowed_token_ids)

    def charge(self, seconds: float, tokens: int = 0) -> None:
        """Adds one matcher call's CPU time (and the tokens it accepted)."""
        self.used_s += seconds
        self.tokens += tokens
        allowance = self.budget_s + self.per_token_s * self.tokens
        if self.error is None and self.used_s > allowance:
            self.error = (
                f"structured_outputs.{self.kind}: following the grammar took {self.used_s:.2f} s "
                f"of CPU time over {self.tokens} generated tokens, more than a request may "
                f"spend ({self.budget_s:g} s plus {self.per_token_s * 1e3:g} ms per token); the "
                "grammar is too ambiguous to match token by token: make it unambiguous (no rule "
                "that can match the same text in several ways, no empty alternatives)"
            )

    def check_mask(self, row: torch.Tensor) -> None:
        """Ends the request when the mask row `(ceil(V / 32),)` allows none of
        `allowed_token_ids`."""
        if self._allowed is None or self.error is not None or _any_allowed(row, self._allowed):
            return
        self.error = (
            f"allowed_token_ids: after {self.tokens} generated tokens, none of them is a token "
            f"that structured_outputs.{self.kind} allows next, so no output is possible"
        )


class Matcher:
    """A sequence's xgrammar `GrammarMatcher` whose work is charged to its request
    (`RequestMatching`). Once the request must end it does no more work: masks allow every
    token and tokens are refused, until the engine ends the request after the step."""

    def __init__(self, matcher: Any, request: RequestMatching) -> None:
        self.matcher = matcher
        self.request = request

    @property
    def stopped(self) -> bool:
        """True once the request must end."""
        return self.request.error is not None

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        if self.stopped:
            return
        start = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, index)
        self.request.charge(time.thread_time() - start)
        if index == 0:  # the matcher's own state; a chain's later rows follow unsure drafts
            self.request.check_mask(bitmask[0])

    def accept_token(self, token: int) -> bool:
        if self.stopped:
            return False
        start = time.thread_time()
        accepted = self.matcher.accept_token(token)
        self.request.charge(time.thread_time() - start, tokens=1)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        start = time.thread_time()
        self.matcher.rollback(num_tokens)
        self.request.charge(time.thread_time() - start)

    def __getattr__(self, name: str) -> Any:  # is_terminated, is_completed, ...
        return getattr(self.matcher, name)


def _any_allowed(row: torch.Tensor, ids: torch.Tensor) -> bool:
    """True when the bitmask row allows any of the token ids `ids`."""
    words = row.to(torch.int64)[ids // 32]
    return bool(((words >> (ids % 32)) & 1).any())


def grammar_failures(groups: list[Any], outputs: list[Any]) -> GrammarFailedError | None:
    """The error of the requests among `groups` (`SequenceGroup`s, each with its
    `matching`) that must end because of their grammar, carrying the `outputs` of the
    others; None when there are none."""
    failed = {g.request_id: g.matching.error for g in groups if _failed(g)}
    if not failed:
        return None
    message = next(iter(failed.values()))
    rest = [out for out in outputs if out.request_id not in failed]
    return GrammarFailedError(list(failed), message, rest)


def _failed(group: Any) -> bool:
    return group.matching is not None and group.matching.error is not None


class StructuredOutputs:
    """Compiles and caches grammars for one tokenizer, and makes matchers from them.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: rows of the model's logits (the bitmask covers all of them).
        eos_token_id: the token that ends a sequence (the grammar's stop token).
        cache_bytes: the most memory the cached compiled grammars may hold.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._compiler: Any = None
        self._info: Any = None
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_used = 0
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
            token_bytes = getattr(self.tokenizer, "token_bytes", None)
            if callable(token_bytes):  # a byte vocabulary (RWKV World): the raw bytes of each id
                vocab = list(token_bytes())[: self.vocab_size]
                vocab += [b""] * (self.vocab_size - len(vocab))
                self._info = xgr.TokenizerInfo(
                    vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=stop
                )
            else:
                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
                )
            # xgrammar's own cache is unbounded; this class keeps a bounded one.
            self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)
        return self._compiler

    @property
    def tokenizer_info(self) -> Any:
        """The compiler's `xgrammar.TokenizerInfo` (after `ensure_compiler`)."""
        return self._info

    def cached(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` when it is in the cache (else None).

        Raises:
            StructuredOutputError: the spec is not JSON-serializable.
        """
        key = _key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def put(self, spec: StructuredOutputsParams, compiled: Any) -> None:
        """Caches `compiled` as the grammar of `spec`, evicting the least recently used ones
        while the cache holds more than `cache_bytes`."""
        key = _key(spec)
        size = _size(compiled)
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = compiled
            self._cache_used += size
            while self._cache_used > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_used -= _size(old)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`: the one attached to it (the server compiles in its
        pool and attaches it), the cached one, or one compiled here.

        Raises:
            StructuredOutputError: xgrammar cannot compile the spec (the message says why).
        """
        if spec.compiled is not None:
            return spec.compiled
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        compiler = self.ensure_compiler()
        method, text = grammar_source(spec)
        try:
            compiled = compile_source(compiler, method, text)
        except (RuntimeError, ValueError, TypeError) as err:
            raise StructuredOutputError(spec.kind, clean_message(err)) from err
        self.put(spec, compiled)
        return compiled

    def prepare(self, params: SamplingParams) -> None:
        """Checks a new request's constraints: compiles its grammar, tokenizes its bad words.

        Raises:
            StructuredOutputError: the grammar cannot be compiled.
        """
        so = params.structured_outputs
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        if so is not None:
            compiled = self.compile(so)
            if params.allowed_token_ids and not so.start_after:
                self._check_first_token(compiled, so.kind, params.allowed_token_ids)

    def _check_first_token(self, compiled: Any, kind: str, allowed: list[int]) -> None:
        """ValueError when the grammar allows none of `allowed` as the first token."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)
        if not _any_allowed(mask[0], torch.tensor(allowed)):
            raise ValueError(
                f"SamplingParams.allowed_token_ids: none of them is a token that "
                f"structured_outputs.{kind} allows first, so no output is possible"
            )

    def new_request(self, params: SamplingParams) -> RequestMatching:
        """The matching bookkeeping of one request with `structured_outputs`."""
        assert params.structured_outputs is not None
        return RequestMatching(params.structured_outputs.kind, params.allowed_token_ids)

    def new_matcher(self, params: SamplingParams, request: RequestMatching | None = None) -> Any:
        """A fresh matcher for one sequence of a request with `structured_outputs`, charging
        its work to `request` (the request's `new_request`; a new one when None)."""
        import xgrammar as xgr

        assert params.structured_outputs is not None
        matcher = xgr.GrammarMatcher(self.compile(params.structured_outputs))
        return Matcher(matcher, request or self.new_request(params))


def accept_token(matcher: Any, token: int) -> bool:
    """Advances a sequence's matcher by its new token; True when the sequence must end (the
    grammar is complete, or, which the bitmask should prevent, the token was rejected)."""
    if not matcher.accept_token(token):
        if not getattr(matcher, "stopped", False):  # else the engine ends the request
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


def _key(spec: StructuredOutputsParams) -> tuple[str, str]:
    try:
        return spec.kind, _spec_text(spec)
    except (TypeError, ValueError) as err:
        raise StructuredOutputError(spec.kind, f"not JSON-serializable: {err}") from err


def _size(compiled: Any) -> int:
    return int(getattr(compiled, "memory_size_bytes", 0) or 0)


def grammar_source(spec: StructuredOutputsParams) -> tuple[str, str]:
    """`(method, text)` to compile for `spec`: method `json_schema`, `regex` or `grammar`.

    Raises:
        StructuredOutputError: the spec is not JSON-serializable.
    """
    kind, text = _key(spec)
    if kind == "json":
        return "json_schema", text
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "regex":
        return "regex", text
    if kind == "choice":
        return "grammar", _choice_grammar(spec.choice or [])
    return "grammar", text


def _choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_source(compiler: Any, method: str, text: str) -> Any:
    """Compiles one `grammar_source` result with an xgrammar `GrammarCompiler` (here, or in a
    worker of `grammar_pool`)."""
    if method == "json_schema":
        import xgrammar as xgr

        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
        ebnf = str(grammar)
        if _LENGTH_LIMITED_CHAR not in ebnf:
            return compiler.compile_grammar(grammar)
        return compiler.compile_grammar(_TOKEN.sub(_json_string_char, ebnf))
    if method == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


# xgrammar (0.2.9) writes a character of a string with minLength / maxLength as
# `[^\"\\\r\n]`, which lets a raw tab or other control character (U+0000-U+001F) into
# the string: JSON forbids them, so `json.loads` rejected outputs the grammar had accepted
# (a tool call that ended but could not be read). Such a character class is rewritten to
# the one of an ordinary JSON string character; quoted literals and other classes (each
# matched whole, escapes included) are left as they are.
_LENGTH_LIMITED_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\0-\x1f\"\\]"
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')


def _json_string_char(match: re.Match[str]) -> str:
    return _JSON_CHAR if match.group(0) == _LENGTH_LIMITED_CHAR else match.group(0)


def clean_message(err: BaseException) -> str:
    """xgrammar's message for a client: its first line, without the source location prefix,
    the internal check text, or any file path (`/project/cpp/...recursion_guard.h:42`)."""
    text = str(err).strip()
    text = text.splitlines()[0] if text else type(err).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    text = text.removeprefix("Check failed: (error.empty()) is false: ")
    text = _PATH.sub("<source>", text)
    return text[:500]
