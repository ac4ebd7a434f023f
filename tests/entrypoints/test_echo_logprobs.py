"""Echoed prompt logprobs on `/v1/completions` against `transformers`' log-softmax over the same
tokens, with whole and chunked prefill; `max_tokens: 0`; the tokenizer routes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL_NAME, RunningServer, launch_server
from tests.helpers.runners import HfRunner

PROMPTS = [
    "Hello, my name is",
    "The capital of France is Paris, and the capital of Italy is Rome; the capital of Spain is",
    "In 1905,",
    "x",
]
TOP_K = 3
MAX_TOKENS = 3
# float32 on both sides, through different kernels (GEMM, or the small-batch matrix-vector
# kernel for short chunks): the random model's logits reach the hundreds, so round-off is about
# 1e-4; a logprob of the wrong position or from a wrong state is off by far more.
ATOL = 3e-4

# Whole prefill, and chunks of 5 tokens shared by the prompts of one request.
BUDGETS = {"whole": "2048", "chunked": "5"}


@pytest.fixture(scope="module", params=list(BUDGETS))
def echo_server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with launch_server("--max-num-batched-tokens", BUDGETS[request.param]) as running:
        yield running


@pytest.fixture(scope="module")
def hf(hf_runner: type[HfRunner], echo_server: RunningServer) -> HfRunner:
    """transformers on the directory the server serves."""
    return hf_runner(echo_server.model_dir)


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)


def complete(server: RunningServer, **body) -> dict:  # noqa: ANN003
    resp = post(server, "/v1/completions", {"model": MODEL_NAME, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def check_choice(hf: HfRunner, prompt: str, choice: dict, max_tokens: int) -> None:
    """One echoed choice against transformers: every position, its top-k, offsets."""
    tokenizer = hf.tokenizer
    ids = hf.greedy(tokenizer.encode(prompt), max_tokens)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    generated = tokenizer.decode(ids[len(ids) - max_tokens :])
    assert choice["text"] == prompt + generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf.logprobs(ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=ATOL)
        top = lp["top_logprobs"][i]
        values, top_ids = ref[i - 1].topk(TOP_K)
        assert list(top)[:TOP_K] == [tokenizer.decode([t]) for t in top_ids.tolist()]
        assert list(top.values())[:TOP_K] == pytest.approx(values.tolist(), abs=ATOL)
        chosen = tokenizer.decode([ids[i]])
        assert len(top) == (TOP_K if ids[i] in top_ids.tolist() else TOP_K + 1)
        assert top[chosen] == pytest.approx(lp["token_logprobs"][i], abs=ATOL)
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets


def test_echo_logprobs_match_transformers(echo_server: RunningServer, hf: HfRunner) -> None:
    out = complete(echo_server, prompt=PROMPTS, max_tokens=MAX_TOKENS, logprobs=TOP_K, echo=True)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == len(PROMPTS)
    generated = [c["text"][len(p) :] for p, c in zip(PROMPTS, choices)]
    assert len(set(generated)) == len(generated), "the generations are not varied"
    for prompt, choice in zip(PROMPTS, choices):
        check_choice(hf, prompt, choice, MAX_TOKENS)


def test_token_id_prompts_echo(echo_server: RunningServer, hf: HfRunner) -> None:
    """Token-id prompts (what lm-eval sends) get the same logprobs as their text."""
    ids = [hf.tokenizer.encode(p) for p in PROMPTS[:2]]
    kwargs = dict(max_tokens=1, logprobs=1, echo=True, seed=1234)
    by_ids = complete(echo_server, prompt=ids, **kwargs)["choices"]
    by_text = complete(echo_server, prompt=PROMPTS[:2], **kwargs)["choices"]
    assert [c["logprobs"] for c in by_ids] == [c["logprobs"] for c in by_text]
    assert [len(c["logprobs"]["tokens"]) for c in by_ids] == [len(i) + 1 for i in ids]


def test_max_tokens_zero_echo(echo_server: RunningServer, hf: HfRunner) -> None:
    out = complete(echo_server, prompt=PROMPTS[:2], max_tokens=0, logprobs=TOP_K, echo=True)
    assert out["usage"]["completion_tokens"] == 0
    for prompt, choice in zip(PROMPTS, sorted(out["choices"], key=lambda c: c["index"])):
        assert choice["finish_reason"] == "length"
        check_choice(hf, prompt, choice, 0)
    plain = complete(echo_server, prompt=PROMPTS[0], max_tokens=0, echo=True)["choices"][0]
    assert plain["text"] == PROMPTS[0] and plain["logprobs"] is None
    resp = post(echo_server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def stream_choices(server: RunningServer, body: dict) -> dict[int, dict]:
    """The chunks of a streamed completion reassembled per choice index."""
    merged: dict[int, dict] = {}
    body = {"model": MODEL_NAME, "temperature": 0, "stream": True, **body}
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=server.headers, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                into = merged.setdefault(choice["index"], {"text": "", "logprobs": {}})
                into["text"] += choice["text"]
                for key, values in (choice["logprobs"] or {}).items():
                    into["logprobs"].setdefault(key, []).extend(values)
    return merged


@pytest.mark.parametrize("max_tokens", [0, MAX_TOKENS])
def test_streamed_echo_equals_whole(echo_server: RunningServer, max_tokens: int) -> None:
    body = dict(prompt=PROMPTS[:2], max_tokens=max_tokens, logprobs=TOP_K, echo=True)
    whole = complete(echo_server, **body)["choices"]
    streamed = stream_choices(echo_server, body)
    for choice in whole:
        assert streamed[choice["index"]] == {"text": choice["text"], "logprobs": choice["logprobs"]}


def test_tokenize_detokenize(echo_server: RunningServer, hf: HfRunner) -> None:
    server = echo_server
    tokenizer = hf.tokenizer
    text = PROMPTS[1]
    body = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    messages = [{"role": "user", "content": "Hi there"}]
    chat = post(server, "/tokenize", {"model": MODEL_NAME, "messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode("user: Hi there\nassistant:")
    bad = post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert post(server, "/tokenize", {"messages": []}).status_code == 400


def test_tokenizer_info(echo_server: RunningServer) -> None:
    info = httpx.get(f"{echo_server.url}/tokenizer_info").json()
    assert info["eos_token"] == info["bos_token"] == "<|endoftext|>"
    assert info["pad_token"] == "<|padding|>"
    assert info["tokenizer_class"] and info["model_max_length"] == 2048
    assert "assistant:" in info["chat_template"]
