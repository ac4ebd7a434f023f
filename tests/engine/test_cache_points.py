"""Cache points: a prompt dict's `"cache_points"` make the prefix cache save a snapshot at those
token offsets while prefilling, so the second request sharing a prefix (a chat system prompt)
hits even though the first was alone in the cache; and `chat_cache_points`, which finds a chat
prompt's message ends.

Without cache points a request alone in the cache leaves snapshots only at interval multiples
and its own ends, so the second request with the same system prompt and another question finds
nothing shorter than the interval (today's behaviour, asserted here as the baseline).
"""

from __future__ import annotations

import asyncio
import random

import jinja2
import pytest

from tests.helpers.runners import VllmRunner, assert_drained
from tests.tiny_models import TOKENIZER_DIR, tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.engine.arg_utils import EngineArgs
from vllm_mamba.engine.async_engine import AsyncLLMEngine
from vllm_mamba.engine.input_processor import MAX_CACHE_POINTS
from vllm_mamba.entrypoints.chat_cache_points import chat_cache_points

MODELS = {
    "mamba2": lambda: tiny_model_dir("mamba2-groups"),
    "jamba": lambda: tiny_model_dir("jamba-gqa"),
    "bamba": lambda: tiny_model_dir("bamba-gqa"),
}
GREEDY = SamplingParams(temperature=0, max_tokens=5)
# The default snapshot interval (512) is longer than these prompts, as a system prompt of a few
# hundred tokens is shorter than it in the user report.
ENGINE = dict(max_num_batched_tokens=48, block_size=16)
SYSTEM_LEN = 61  # unaligned to KV blocks and to chunks


def _prompts(seed: int = 0) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(100, 50000) for _ in range(SYSTEM_LEN)]
    questions = [[rng.randrange(100, 50000) for _ in range(5 + i)] for i in range(3)]
    return system, [system + q for q in questions]


def _req(prompt: list[int], points: list[int] | None) -> dict:
    req: dict = {"prompt_token_ids": prompt}
    if points is not None:
        req["cache_points"] = points
    return req


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_second_request_hits_the_cache_point(name: str) -> None:
    path = MODELS[name]()
    system, prompts = _prompts()
    with VllmRunner(path, **ENGINE) as off:
        ref = _tokens(off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))
    # Before: the first request alone leaves no snapshot where the second diverges.
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as on:
        seq = [on.generate(_req(p, None), GREEDY)[0] for p in prompts[:2]]
        assert _tokens(seq) == ref[:2]
        assert [o.num_cached_tokens for o in seq] == [0, 0]
    # After: a cache point at the end of the system prompt.
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as on:
        seq = [on.generate(_req(p, [SYSTEM_LEN]), GREEDY)[0] for p in prompts]
        assert _tokens(seq) == ref
        assert seq[0].num_cached_tokens == 0
        assert seq[1].num_cached_tokens == seq[2].num_cached_tokens == SYSTEM_LEN
        # Only the first request's own cache point needs to be given.
        late = on.generate(_req(prompts[1][:-1] + [7], None), GREEDY)[0]
        assert late.num_cached_tokens >= SYSTEM_LEN
    # Sent together in one step: the later ones start from the first one's snapshot.
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as on:
        outs = on.generate([_req(p, [SYSTEM_LEN]) for p in prompts], GREEDY)
        assert _tokens(outs) == ref
        assert all(o.num_cached_tokens >= SYSTEM_LEN for o in outs[1:])
    # (Together without cache points hits too, today: later requests wait for the branch point.)
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as on:
        outs = on.generate([_req(p, None) for p in prompts], GREEDY)
        assert _tokens(outs) == ref
        assert all(o.num_cached_tokens >= SYSTEM_LEN for o in outs[1:])


def test_several_points_and_snapshot_budget() -> None:
    """Every cache point of a chat-like prompt is saved (a later turn sharing the first two
    messages starts at the second point); with two snapshot slots the points are still cut and
    the outputs still equal the cache-off engine's, within the slot budget."""
    path = MODELS["mamba2"]()
    system, prompts = _prompts(seed=1)
    turn1 = prompts[0]
    points = [SYSTEM_LEN, len(turn1) - 2]
    turn2 = turn1[:-2] + [11, 12, 13, 14]
    with VllmRunner(path, **ENGINE) as off:
        ref = _tokens(off.generate([{"prompt_token_ids": p} for p in (turn1, turn2)], GREEDY))
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as on:
        first = on.generate(_req(turn1, points), GREEDY)[0]
        cache = on.engine.prefix_cache
        assert cache.match(turn1, SYSTEM_LEN).num_tokens == SYSTEM_LEN
        second = on.generate(_req(turn2, None), GREEDY)[0]
        assert _tokens([first, second]) == ref
        assert second.num_cached_tokens == len(turn1) - 2
        slot_bytes = on.engine.cache.bytes_per_slot()
    tight = dict(ENGINE, prefix_cache_memory_bytes=2 * slot_bytes)
    with VllmRunner(path, enable_prefix_caching=True, **tight) as on:
        cache = on.engine.prefix_cache
        outs = [on.generate(_req(p, [5, 20, SYSTEM_LEN, len(p) - 1]), GREEDY)[0] for p in prompts]
        assert cache.num_snapshots <= 2
        with VllmRunner(path, **ENGINE) as off:
            assert _tokens(outs) == _tokens(
                off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
            )


def test_points_are_released_on_finish_and_abort() -> None:
    path = MODELS["jamba"]()
    system, prompts = _prompts(seed=2)
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as runner:
        engine = runner.engine
        for i, p in enumerate(prompts):
            engine.add_request(f"a{i}", _req(p, [3, SYSTEM_LEN]), SamplingParams(max_tokens=30))
        group = engine.scheduler.waiting[0]
        assert group.cache_points == [3, SYSTEM_LEN]
        assert [n.depth for n in group.cache_point_nodes] == [3, SYSTEM_LEN]
        engine.step()
        engine.abort_request([f"a{i}" for i in range(len(prompts))])
        assert group.cache_point_nodes == [] and group.path_node is None
        cache = engine.prefix_cache
        stack = list(cache.tree.root.children.values())
        while stack:
            node = stack.pop()
            assert not node.users
            stack.extend(node.children.values())
        runner.generate(_req(prompts[0], [SYSTEM_LEN]), GREEDY)
    # (leaving the runner asserts the tree holds no path once the snapshots are evicted)


def test_validation() -> None:
    path = MODELS["mamba2"]()
    prompt = list(range(100, 120))
    with VllmRunner(path, enable_prefix_caching=True, **ENGINE) as runner:
        engine = runner.engine
        bad = [
            ("not-a-list", "must be a list"),
            (5, "must be a list"),
            ([3, 4.0], "must be a list"),
            ([True], "must be a list"),
            ([0], "outside the prompt"),
            ([20], "outside the prompt"),
            ([-1, 3], "outside the prompt"),
            (list(range(1, MAX_CACHE_POINTS + 2)), "more than"),
        ]
        long_prompt = list(range(100, 200))
        for points, match in bad:
            p = long_prompt if match == "more than" else prompt
            with pytest.raises(ValueError, match=f"cache_points.*{match}"):
                engine.add_request("r", {"prompt_token_ids": p, "cache_points": points})
        assert not engine.has_unfinished_requests()
        # Duplicates are dropped, the rest sorted; None and [] mean none; a text prompt's points
        # are offsets into its token ids.
        engine.add_request("r", {"prompt_token_ids": prompt, "cache_points": (9, 3, 9)})
        engine.add_request("s", {"prompt_token_ids": prompt, "cache_points": None})
        engine.add_request("t", {"prompt": "def f(x):\n    return x + 1\n", "cache_points": [2]})
        points = [g.cache_points for g in engine.scheduler.waiting]
        assert points == [[3, 9], [], [2]]
        engine.abort_request(["r", "s", "t"])
        # Exactly MAX_CACHE_POINTS is accepted.
        full = list(range(1, MAX_CACHE_POINTS + 1))
        runner.generate({"prompt_token_ids": long_prompt, "cache_points": full}, GREEDY)
    # Prefix caching off: accepted (and validated), ignored.
    with VllmRunner(path, **ENGINE) as off:
        out = off.generate({"prompt_token_ids": prompt, "cache_points": [5]}, GREEDY)[0]
        assert out.num_cached_tokens in (None, 0)
        with pytest.raises(ValueError, match="cache_points"):
            off.generate({"prompt_token_ids": prompt, "cache_points": [50]}, GREEDY)


def test_async_engine_keeps_cache_points() -> None:
    """`AsyncLLMEngine.add_requests` re-tokenizes prompts into a new dict: the points go with
    it (the second request hits), and a bad one is refused before entering the engine."""
    system, prompts = _prompts(seed=3)

    async def main() -> list[int | None]:
        args = EngineArgs(
            model=MODELS["mamba2"](), max_model_len=512, max_num_seqs=8, enable_prefix_caching=True
        )
        engine = AsyncLLMEngine.from_engine_args(args)
        try:
            cached = []
            for i, p in enumerate(prompts[:2]):
                stream = await engine.add_request(f"r{i}", _req(p, [SYSTEM_LEN]), GREEDY)
                cached.append([out async for out in stream][-1].num_cached_tokens)
            with pytest.raises(ValueError, match="cache_points"):
                await engine.add_request("bad", _req(prompts[0], [0]), GREEDY)
            await engine.call(assert_drained, engine.engine)
            return cached
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == [0, SYSTEM_LEN]


# ----- chat_cache_points ------------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Refuses a conversation that does not end with a user message (as some real templates do).
STRICT = (
    "{% if messages[-1].role != 'user' %}{{ raise_exception('must end with user') }}{% endif %}"
    + CHATML
)
# No separator: the end of one message and the start of the next may merge into one token.
GLUED = "{% for m in messages %}{{ m.content }}{% endfor %}"


def _render(source: str):  # noqa: ANN202 - (messages, add_generation_prompt) -> str
    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    template = jinja2.Environment().from_string(source)
    return lambda messages, gen=False: template.render(
        messages=messages, add_generation_prompt=gen, raise_exception=raise_exception
    )


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant. " * 12 + "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
    {"role": "user", "content": "And of Spain?"},
]


def _chat(tokenizer, source: str, messages: list[dict], **kw) -> tuple[list[int], list[int]]:  # noqa: ANN001
    render = _render(source)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    text = render(messages, True)
    ids = encode(text)
    points = chat_cache_points(lambda m: render(m), messages, text, ids, encode, **kw)
    return points, ids


def test_chat_cache_points_chatml(tokenizer) -> None:  # noqa: ANN001
    render = _render(CHATML)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    points, ids = _chat(tokenizer, CHATML, CONVERSATION)
    expected = []
    for k in range(1, len(CONVERSATION)):
        head = encode(render(CONVERSATION[:k]))
        assert ids[: len(head)] == head  # ChatML's "\n<|im_start|>" never merges
        expected.append(len(head))
    assert points == expected and len(points) == len(CONVERSATION) - 1
    # At most max_points: always the system prompt's end, then the last ones.
    few, _ = _chat(tokenizer, CHATML, CONVERSATION, max_points=3)
    assert few == [expected[0], expected[-2], expected[-1]]
    assert _chat(tokenizer, CHATML, CONVERSATION, max_points=1)[0] == [expected[0]]
    assert _chat(tokenizer, CHATML, CONVERSATION, max_points=0)[0] == []
    assert _chat(tokenizer, CHATML, CONVERSATION[:1])[0] == []


def test_chat_cache_points_failed_renders_and_merges(tokenizer) -> None:  # noqa: ANN001
    # A template refusing partial conversations gives the points of those it renders.
    points, ids = _chat(tokenizer, STRICT, CONVERSATION)
    render = _render(CHATML)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    user_ends = [k for k in range(1, len(CONVERSATION)) if CONVERSATION[k - 1]["role"] == "user"]
    assert points == [len(encode(render(CONVERSATION[:k]))) for k in user_ends]
    # Tokens merging across a boundary: the point is the common prefix, shorter than the
    # prefix's own encoding ("Hi, hello" + "world": " hello" becomes " hell" "ow" "orld").
    glued = [
        {"role": "user", "content": "Hi, hello"},
        {"role": "user", "content": "world"},
        {"role": "user", "content": " and more"},
    ]
    points, ids = _chat(tokenizer, GLUED, glued)
    first = encode("Hi, hello")
    assert len(first) == 3 and ids[:2] == first[:2] and ids[2] != first[2]
    assert points == [2, len(encode("Hi, helloworld"))]
    for p in points:
        assert 0 < p < len(ids)
    # A render that is not a prefix of the prompt (another template) gives nothing.
    other = _render(GLUED)
    text = render(CONVERSATION, True)
    assert chat_cache_points(other, CONVERSATION, text, encode(text), encode) == []
