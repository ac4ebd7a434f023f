"""Regression tests for issue 46's template-sandbox findings (a request's `chat_template` with
`--trust-request-chat-template`): constants folded while compiling, before the render's
deadline (and kept in the compile cache), `lipsum`, unchecked `~`, padding and repeating
filters and methods, and a chat's prefix-cache renders each with a fresh deadline. Each is
refused before it builds anything large (the heap's peak is measured), and well inside the
deadline; ordinary templates render as stock Jinja renders them.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Iterator

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vllm_mamba.entrypoints import chat_utils
from vllm_mamba.entrypoints.chat_cache_points import chat_cache_points
from vllm_mamba.entrypoints.chat_utils import ChatTemplate, TemplateRenderError

MB = 2**20
TURNS = [{"role": "user", "content": "hi"}]
# Each would build (or, folded while compiling, keep in the compile cache) hundreds of MB.
HUGE = {
    "folded center": "{{ 'x'|center(300000000) }}",
    "center method": "{{ 'x'.center(300000000) }}",
    "~ doubling": "{% set s = 'xxxxxxxx' %}" + "{% set s = s ~ s %}" * 26 + "{{ s|length }}",
    "+ doubling": "{% set s = 'xxxxxxxx' %}" + "{% set s = s + s %}" * 25 + "{{ s|length }}",
    "% width": "{{ '%300000000s' % 'x' }}",
    "format width": "{{ '%300000000s'|format('x') }}",
    "str.format width": "{{ '{:>300000000}'.format('x') }}",
    "replace": "{{ ('x' * 1000000)|replace('x', 'y' * 100) }}",
    "indent": "{{ ('\n' * 1000000)|indent(300) }}",
    "join of shared strings": "{{ (['x' * 1000000] * 300)|join }}",
    "printed shared lists": "{% set a = ['x' * 1000] * 1000 %}{{ [a] * 300 }}",
    "tojson of shared lists": "{% set a = ['x' * 1000] * 1000 %}{{ ([a] * 300)|tojson }}",
    "loop output": "{% set s = 'x' * 1000000 %}{% for i in range(300) %}{{ s }}{% endfor %}",
    "macro output": "{% macro m() %}{% for i in range(100000) %}{{ 'x' * 3000 }}{% endfor %}"
    "{% endmacro %}{{ m()|length }}",
}


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    class Tokenizer:
        chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        bos_token = "<s>"

    return ChatTemplate(Tokenizer(), trust_request_templates=True)


@pytest.fixture()
def heap() -> Iterator[None]:
    tracemalloc.start()
    yield
    tracemalloc.stop()


@pytest.mark.parametrize("source", HUGE.values(), ids=HUGE.keys())
def test_huge_values_are_refused_before_they_are_built(
    template: ChatTemplate, heap: None, source: str
) -> None:
    start = time.monotonic()
    with pytest.raises(TemplateRenderError):
        template.render(TURNS, True, template=source)
    elapsed = time.monotonic() - start
    current, peak = tracemalloc.get_traced_memory()
    assert peak < 64 * MB  # the value itself would be 300 MB and more
    assert current < 32 * MB  # nothing large kept (no gc.collect: cycles would hold it)
    assert elapsed < chat_utils.RENDER_TIMEOUT_S  # refused, not timed out


def test_values_kept_alive_are_bounded_together(template: ChatTemplate, heap: None) -> None:
    """Each value within the size limit, but a namespace keeps all of them: 1 GB before."""
    source = (
        "{% set ns = namespace(kept=[]) %}{% for i in range(1000) %}"
        "{% set ns.kept = ns.kept + [('x' * 1000000) ~ i] %}{% endfor %}{{ ns.kept|length }}"
    )
    with pytest.raises(TemplateRenderError):
        template.render(TURNS, True, template=source)
    assert tracemalloc.get_traced_memory()[1] < 256 * MB


def test_integers_are_bounded(template: ChatTemplate) -> None:
    with pytest.raises(TemplateRenderError):  # 3.3 million bits: each step adds 1000 times
        template.render(TURNS, True, template="{{ ((10 ** 1000) ** 1000) % 7 }}")
    with pytest.raises(TemplateRenderError):
        template.render(TURNS, True, template="{% set a = 2 ** 900 %}{{ (a * a) ** 999 % 7 }}")
    assert template.render(TURNS, True, template="{{ 2 ** 64 }} {{ 10 ** 1000 % 7 }}") == (
        f"{2**64} {10**1000 % 7}"
    )


def test_lipsum_cannot_hold_the_thread(template: ChatTemplate) -> None:
    start = time.monotonic()
    with pytest.raises(TemplateRenderError):  # 6.5 s in one call, between deadline checks
        template.render(TURNS, True, template="{{ lipsum(n=60000) }}")
    assert time.monotonic() - start < 1.5


def test_loops_without_calls_stop_at_the_deadline(
    template: ChatTemplate, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat_utils, "RENDER_TIMEOUT_S", 0.3)
    source = "{% set r = range(10000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(TemplateRenderError, match="ran for more than"):
        template.render(TURNS, True, template=source)
    assert time.monotonic() - start < 2.0  # 10^8 iterations without a check inside the loops


def test_prefix_cache_renders_share_the_requests_budget(
    template: ChatTemplate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat's cache-point renders (8 prefixes here) continue its prompt's render budget
    instead of each taking a fresh one (which made 8 more budgets of template work)."""
    monkeypatch.setattr(chat_utils, "RENDER_TIMEOUT_S", 0.5)
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    source = "{% if messages|length < 9 %}" + spin + "{% endif %}{{ messages|length }}"
    turns = [{"role": "user", "content": str(i)} for i in range(9)]
    start = time.monotonic()
    text = template.render(turns, False, template=source)  # the whole chat: no spinning
    points = chat_cache_points(
        lambda prefix: template.render(prefix, False, template=source),
        turns,
        text,
        list(text.encode()),
        lambda s: list(s.encode()),
    )
    elapsed = time.monotonic() - start
    assert text == "9" and points == []
    assert elapsed < 2.5  # one 0.5 s budget in all; 4 s when each prefix had its own


def test_request_templates_are_bounded_in_length(template: ChatTemplate) -> None:
    source = "x" * (chat_utils.MAX_REQUEST_TEMPLATE_CHARS + 1)
    with pytest.raises(TemplateRenderError, match="characters long"):
        template.render(TURNS, True, template=source)
    assert template.render(TURNS, True, template="x" * 1000) == "x" * 1000


ORDINARY = """\
{%- set ns = namespace(last=messages|length - 1, seen=[]) -%}
{%- macro show(m) -%}[{{ m.role|upper }}] {{ m.content|trim }}{%- endmacro -%}
{%- if tools -%}{{ tools|tojson }}
{{ tools[0]|tojson(indent=2) }}
{%- endif -%}
{%- for m in messages[::-1] if m.role != 'tool' -%}
  {%- if loop.first %}{{ '%s/%d' % (m.role, loop.length) }}{% endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {{ loop.index0 ~ ':' ~ show(m) ~ '\\n' }}
  {%- if m.content.startswith('<think>') -%}
    {{- m.content.split('</think>')[-1].lstrip('\\n') -}}
  {%- endif -%}
  {{ '{:>6}|{}'.format(m.role, m.content|length) }} {{ m.content|replace('a', 'A')|center(30) }}
  {{- (m.content ~ ' ') * 2 }}{{ m.content|wordwrap(10)|indent(2) }}
  {%- if loop.last %}{% break %}{% endif -%}
{%- endfor -%}
{{ messages|map(attribute='role')|unique|sort|join(', ') }} {{ messages|sum(attribute='n') }}
{{ (messages|selectattr('role', 'eq', 'user')|list|length) + 1 }} {{ [1, 2] + [3] }} {{ 2 ** 10 }}
{{ range(3)|list }} {{ ('ab' * 3)|truncate(4, True, '') }} {{ dict(a=1).items()|list }}
{%- set block %}{{ bos_token }}{% for i in range(3) %}{{ i }}{% endfor %}{% endset %}{{ block }}
{%- if add_generation_prompt %}<assistant>{% endif -%}"""


def test_ordinary_templates_render_as_stock_jinja_does(template: ChatTemplate) -> None:
    stock = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    stock.filters["tojson"] = lambda v, indent=None: json.dumps(
        v, ensure_ascii=False, indent=indent
    )
    turns = [
        {"role": "system", "content": "Be brief.", "n": 1},
        {"role": "user", "content": "  a banana  ", "n": 2},
        {"role": "assistant", "content": "<think>\nhm</think>\n\nIt is a fruit.", "n": 3},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": [1, "é"]}}}]
    want = stock.from_string(ORDINARY).render(
        messages=turns, tools=tools, add_generation_prompt=True, bos_token="<s>"
    )
    got = template.render(turns, True, template=ORDINARY, tools=tools)
    assert got == want and "A bAnAnA" in got
