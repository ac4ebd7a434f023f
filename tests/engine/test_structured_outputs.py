"""Structured outputs (JSON schema, JSON object, regex, choice, grammar) and the logit
constraints (`logit_bias`, `allowed_token_ids`, `bad_words`) through the engine."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator

import jsonschema
import pytest

from tests.helpers.json_schemas import random_object_schema, random_schema
from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.errors import RequestsFailedError
from vllm_mamba.sampling_params import StructuredOutputsParams

PROMPTS = ["The history of the", "def main():", "Once upon a time", "import numpy as np"]


@pytest.fixture(scope="module")
def llm(vllm_runner: type[VllmRunner]) -> Iterator[VllmRunner]:
    with vllm_runner(tiny_model_dir("tied"), max_num_seqs=16) as runner:
        yield runner


def constrained(max_tokens: int = 160, **spec) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec)
    )


def test_random_schemas_validate_in_a_batch_with_free_requests(llm: VllmRunner) -> None:
    """Every output of 32 random schemas parses and validates; the unconstrained requests of
    the same batch give exactly their solo outputs."""
    rng = random.Random(1234)
    schemas = [random_object_schema(rng) if i % 2 else random_schema(rng) for i in range(32)]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    solo = [llm.generate(p, free)[0].outputs[0].token_ids for p in PROMPTS]
    assert not llm.engine.structured_outputs.has_compiler  # free requests never touch it
    params = [
        SamplingParams(
            temperature=[0.0, 1.0, 0.7][i % 3],
            top_p=0.9 if i % 4 == 0 else 1.0,
            seed=i,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for i, schema in enumerate(schemas)
    ]
    prompts = [f"Record {i}: " for i in range(len(schemas))] + PROMPTS
    outs = llm.generate(prompts, params + [free] * len(PROMPTS))
    for schema, out in zip(schemas, outs):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (schema, comp.text)
        jsonschema.validate(json.loads(comp.text), schema)
    assert [o.outputs[0].token_ids for o in outs[len(schemas) :]] == solo
    assert sum(isinstance(json.loads(o.outputs[0].text), dict) for o in outs[: len(schemas)]) >= 16


def test_regex_and_choice_always_match_every_fork(llm: VllmRunner) -> None:
    """n=3 children fork before their first token and each gets a fresh matcher."""
    regexes = [
        r"[a-z]{2,6}-\d{3}",
        r"(yes|no)!",
        r"\d{1,3}(\.\d{1,2})?",
        r"[A-Z][a-z]{0,4} [a-z]{1,6}",
    ]
    choices = ["red", "green", "blue", "dark blue", 'ünïcode "quoted"']
    params = [
        SamplingParams(
            n=3,
            temperature=1.0,
            seed=i,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(regex=rx),
        )
        for i, rx in enumerate(regexes)
    ]
    params += [
        SamplingParams(
            n=3, temperature=1.0, seed=9, structured_outputs=StructuredOutputsParams(choice=choices)
        )
    ]
    outs = llm.generate(PROMPTS + ["Pick a colour:"], params)
    for rx, out in zip(regexes, outs):
        assert len(out.outputs) == 3
        for comp in out.outputs:
            assert comp.finish_reason == "stop" and re.fullmatch(rx, comp.text), (rx, comp.text)
    assert all(c.text in choices for c in outs[-1].outputs)
    texts = {c.text for out in outs for c in out.outputs}
    assert len(texts) > 8  # the forks sample on their own


def test_json_object_and_grammar(llm: VllmRunner) -> None:
    """Any JSON object: a random model may not close it within max_tokens, but what ends with
    "stop" is an object, and the rest is the start of one."""
    prompts = [*PROMPTS, "x", "Record 1:"]
    outs = llm.generate(prompts, constrained(json_object=True, max_tokens=60))
    finished = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(t), dict) for t in finished)
    assert all(o.outputs[0].text.startswith("{") for o in outs)
    grammar = 'root ::= "(" num (" + " num (" + " num)?)? ")"\nnum ::= [1-9] [0-9]?'
    params = SamplingParams(
        n=4, temperature=1.0, seed=2, structured_outputs=StructuredOutputsParams(grammar=grammar)
    )
    for comp in llm.generate(PROMPTS[1], params)[0].outputs:
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?){0,2}\)", comp.text), comp.text


def test_matcher_survives_preemption(llm: VllmRunner) -> None:
    """Preemption by recompute keeps each sequence's matcher; the output is unchanged."""
    schema = {
        "type": "object",
        "properties": {
            "words": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 4},
            "n": {"type": "integer", "minimum": 0, "maximum": 9999},
        },
        "required": ["words", "n"],
    }
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=120,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    alone = [c.text for c in llm.generate(PROMPTS[0], params)[0].outputs]
    engine = llm.engine
    engine.add_request("pre", PROMPTS[0], params)
    final = None
    for step in range(300):
        if step in (4, 9) and engine.scheduler.running:
            engine.scheduler.preempt(engine.scheduler.running[0])
        for out in engine.step():
            final = out
        if not engine.has_unfinished_requests():
            break
    assert final is not None and final.finished
    assert [c.text for c in final.outputs] == alone
    for text in alone:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"json": {"type": "foo"}}, "json"),
        ({"json": "{not json"}, "json"),
        ({"regex": "[a-"}, "regex"),
        ({"grammar": "root ::= "}, "grammar"),
    ],
)
def test_spec_that_cannot_compile_is_a_value_error(llm: VllmRunner, spec: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs.{field} cannot be compiled"):
        llm.generate("x", constrained(**spec))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "spec",
    [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"regex": ""}, {"json": 3}, {"choice": [1]}],
)
def test_structured_outputs_params_are_validated(spec: dict) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**spec)


def test_logit_bias_forces_and_bans(llm: VllmRunner) -> None:
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))[0]
    top = free.outputs[0].token_ids[0]
    forced = SamplingParams(temperature=1.0, seed=0, max_tokens=12, logit_bias={4321: 100})
    assert llm.generate(PROMPTS[0], forced)[0].outputs[0].token_ids == [4321] * 12
    banned = SamplingParams(temperature=0, max_tokens=12, logit_bias={top: -100})
    out = llm.generate(PROMPTS[0], banned)[0].outputs[0]
    assert top not in out.token_ids and out.token_ids[0] != top
    # Log-probabilities stay those of the raw distribution.
    with_lp = SamplingParams(temperature=0, max_tokens=1, logprobs=0, logit_bias={top: -100})
    lp = llm.generate(PROMPTS[0], with_lp)[0].outputs[0].logprobs[0]
    raw = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    raw_lp = llm.generate(PROMPTS[0], raw)[0].outputs[0].logprobs[0]
    assert lp[out.token_ids[0]].rank > raw_lp[top].rank == 1


def test_allowed_token_ids_hold(llm: VllmRunner) -> None:
    allowed = [11, 500, 1234, 7777, 20000]
    params = SamplingParams(n=2, temperature=1.5, seed=5, max_tokens=16, allowed_token_ids=allowed)
    outs = llm.generate(PROMPTS, params)
    tokens = [t for out in outs for c in out.outputs for t in c.token_ids]
    assert set(tokens) <= set(allowed) and len(set(tokens)) >= 3


def test_bad_words_never_appear(llm: VllmRunner) -> None:
    tok = llm.llm.get_tokenizer()
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    # Words the model says when free: multi-token pieces and single tokens of its outputs.
    words = [tok.decode(r[3:5]) for r in ref] + [tok.decode(r[8:9]) for r in ref]
    words = [w for w in words if w.strip()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert outs != ref
    seqs = params.bad_words_token_ids
    assert len(seqs) >= len(words)
    for out in outs:
        for word in seqs:
            n = len(word)
            assert all(out[i : i + n] != word for i in range(len(out) - n + 1)), (word, out)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logit_bias": {60000: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [1, 99999]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
    ],
)
def test_bad_constraints_are_value_errors(llm: VllmRunner, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate("x", SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished_requests()


def test_shipped_model_follows_random_schemas(vllm_runner: type[VllmRunner]) -> None:
    """The shipped model (its own tokenizer and vocabulary), sampled and greedy."""
    rng = random.Random(7)
    schemas = [random_object_schema(rng) for _ in range(8)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for i, schema in enumerate(schemas)
    ]
    with vllm_runner("vllm-mamba/tiny-stdlib", max_num_seqs=8) as runner:
        outs = runner.generate([f"# record {i}\n" for i in range(len(schemas))], params)
    for schema, out in zip(schemas, outs):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (schema, comp.text)
        jsonschema.validate(json.loads(comp.text), schema)


def test_complete_grammar_ends_despite_ignore_eos_and_min_tokens(llm: VllmRunner) -> None:
    spec = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, min_tokens=10, structured_outputs=spec
    )
    comp = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert comp.text in ("yes", "no") and comp.finish_reason == "stop"
    assert len(comp.token_ids) <= 3


def test_grammar_starts_after_its_text(llm: VllmRunner) -> None:
    """With `start_after` (the end of a reasoning part), the output is free until that text
    has been generated, then follows the grammar: the first tokens equal the unconstrained
    greedy run's, the rest is one of the choices. A text never generated leaves the whole
    output free."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        alone = llm.generate(prompt, free)[0].outputs[0]
        head = alone.token_ids[:3]
        marker = llm.engine.tokenizer.decode(head)
        assert marker and alone.text.startswith(marker)
        out = llm.generate(prompt, constrained(40, choice=[" yes", " no"], start_after=marker))[
            0
        ].outputs[0]
        assert out.token_ids[:3] == head, (marker, out.text)
        assert out.text[len(marker) :] in (" yes", " no"), (marker, out.text)
        assert out.finish_reason == "stop"
        never = constrained(12, choice=[" yes"], start_after="\x00never\x00")
        never.ignore_eos = True
        assert llm.generate(prompt, never)[0].outputs[0].token_ids == alone.token_ids


AMBIGUOUS = 'root ::= x\nx ::= x x x | x x | "a" | "aa" | "" | "b"'
"""A grammar whose matching work grows with every token (xgrammar's Earley parser keeps every
way of splitting the text): issue 46 measured 8 s for 120 tokens, all on the engine thread."""


def test_ambiguous_grammar_ends_on_its_matching_budget_others_go_on(llm: VllmRunner) -> None:
    """The request over its budget ends with a 400 `GrammarFailedError` long before its 120
    tokens; the step's other request keeps its output and goes on to its end."""
    engine = llm.engine
    spec = StructuredOutputsParams(grammar=AMBIGUOUS)
    heavy = SamplingParams(
        temperature=1.0, seed=3, max_tokens=120, ignore_eos=True, structured_outputs=spec
    )
    engine.add_request("heavy", "x", heavy)
    engine.add_request("free", PROMPTS[0], SamplingParams(temperature=0, max_tokens=60))
    errors, finals = [], {}
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RequestsFailedError as err:
            errors.append(err)
            outs = err.outputs
        finals.update((o.request_id, o) for o in outs)
    assert len(errors) == 1 and errors[0].request_ids == ["heavy"], errors
    assert errors[0].status == 400 and "structured_outputs.grammar" in str(errors[0])
    assert "too ambiguous" in str(errors[0])
    assert len(finals["heavy"].outputs[0].token_ids) < 60  # it stopped well before its end
    assert finals["free"].finished and len(finals["free"].outputs[0].token_ids) == 60


def test_allowed_token_ids_outside_the_grammar_are_refused(llm: VllmRunner) -> None:
    """No first token both allowed and in the grammar: a ValueError at the door. Allowed
    first tokens that the grammar cannot continue: a 400 `GrammarFailedError` once the next
    mask is empty, never an output cut short as if it had stopped."""
    tok = llm.llm.get_tokenizer()
    brace, cat = tok.convert_tokens_to_ids("{"), 5798
    json_object = StructuredOutputsParams(json_object=True)
    params = SamplingParams(max_tokens=8, allowed_token_ids=[cat], structured_outputs=json_object)
    with pytest.raises(ValueError, match="allowed_token_ids: none of them"):
        llm.generate("x", params)
    assert not llm.engine.has_unfinished_requests()
    params = SamplingParams(
        max_tokens=8, allowed_token_ids=[brace, cat], structured_outputs=json_object
    )
    with pytest.raises(RequestsFailedError, match="allowed_token_ids: after 1 generated") as err:
        llm.generate("x", params)
    assert err.value.status == 400
    assert not llm.engine.has_unfinished_requests()
