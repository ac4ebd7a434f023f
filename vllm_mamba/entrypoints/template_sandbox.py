"""The Jinja sandbox chat templates render in: bounded in time, in the size of every value a
template builds and in the work done before it runs.

Jinja's own `ImmutableSandboxedEnvironment` stops templates from reaching Python internals but
not from using the machine: this one also

- folds nothing at compile time (`optimized=False`, and every filter is wrapped as a
  context filter, which Jinja never evaluates while compiling), so work only happens while a
  render runs against its deadline;
- checks the render's deadline on every call, attribute or item lookup, filter, operator and
  loop iteration (a `for` loop's iterable is wrapped by the code generator);
- refuses, before producing it, any value larger than `MAX_RENDER_CHARS` characters (strings,
  the text of a container when it is printed, joined or serialized) or `MAX_ITEMS` items
  (lists and tuples built with `*` / `+`), any integer over `MAX_INT_BITS` bits, and template
  output over `MAX_RENDER_CHARS` characters (counted while the pieces are joined: `~`, blocks,
  macros and the final output all join through `concat`);
- has no `lipsum` (unbounded work in one call).

`budget()` makes every render on the thread inside it share one deadline, and `resume=True`
continues the deadline of the thread's last budget (a chat request's prefix-cache points
render within the budget of its prompt's render).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import string
import threading
import time
from collections.abc import Callable, Iterable, Iterator, MappingView
from typing import Any

from jinja2 import nodes, pass_context, pass_environment
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace, _PassArg

RENDER_TIMEOUT_S = 2.0
MAX_RENDER_CHARS = 4_000_000
MAX_ITEMS = 100_000  # the most items of a list a template builds (as Jinja's range limit)
MAX_INT_BITS = 100_000
# What one render may build in all (characters of the strings, 32 per item of the collections
# that calls, filters and operators return): values kept alive (`set`, a namespace's list grown
# with `+`) are bounded together, not only one by one.
MAX_BUILT = 32 * MAX_RENDER_CHARS
_ITEM_COST = 32
_MAX_POWER = 1_000
# Filters that iterate their input item by item in Python: refused on inputs of more items.
_ITERATING_FILTERS = frozenset(
    ["batch", "dictsort", "groupby", "list", "map", "max", "min", "reject", "rejectattr"]
    + ["select", "selectattr", "slice", "sort", "sum", "unique"]
)
# Filters that never turn their input into text (their input is not measured).
_NON_TEXT_FILTERS = _ITERATING_FILTERS | frozenset(
    ["abs", "attr", "count", "d", "default", "first", "float", "int", "items", "join", "last"]
    + ["length", "random", "reverse", "round"]
)
# Filters whose work grows faster than their input (quadratic, or Python code per character):
# refused on longer texts.
_SLOW_TEXT_FILTERS = {"striptags": 20_000, "title": 200_000, "urlize": 100_000}
_SLOW_TEXT_FILTERS.update(wordcount=200_000, wordwrap=100_000)
_SCALARS = (str, int, float, type(None))
# `%` conversions: flags, width and precision (a `*` takes them from the arguments).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.S)


class TemplateBudgetError(SecurityError):
    """A template went over the render's time or size budget."""


def _too_large(what: str) -> TemplateBudgetError:
    return TemplateBudgetError(
        f"the chat template built {what} larger than the limit of {MAX_RENDER_CHARS} characters"
    )


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with every loop iteration and every `~` checked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iterables: set[int] = set()  # ids of the `for` iterables being compiled

    def visit_For(self, node: nodes.For, frame: Frame) -> None:  # noqa: N802 - Jinja's name
        self._loop_iterables.add(id(node.iter))
        super().visit_For(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        """A `for` loop's iterable is written as `environment.guard_loop(iterable)`."""
        if id(node) not in self._loop_iterables:
            return super().visit(node, *args, **kwargs)
        self.write("environment.guard_loop(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    def buffer(self, frame: Frame) -> None:
        """Output written to a buffer (blocks, macros, `set` blocks) is counted as it grows."""
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:  # noqa: N802
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _OutputBuffer(list):
    """A block's output pieces, refused once they add up to more than `MAX_RENDER_CHARS`."""

    __slots__ = ("size",)

    def __init__(self) -> None:
        super().__init__()
        self.size = 0

    def append(self, piece: str) -> None:
        self.size += len(piece)
        if self.size > MAX_RENDER_CHARS:
            raise _too_large("an output")
        super().append(piece)

    def extend(self, pieces: Iterable[str]) -> None:
        for piece in pieces:
            self.append(piece)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox (see the module's docstring); one instance serves all threads, each
    rendering against its own deadline."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])
    code_generator_class = _BoundedCodeGenerator

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols"],
            optimized=False,
            finalize=self._printable,
        )
        self._local = threading.local()
        del self.globals["lipsum"]
        del self.filters["pprint"]  # indents by nesting depth: its size is not a value's
        self.filters["join"] = self._join_filter
        self.filters["sum"] = self._sum_filter
        for name, func in list(self.filters.items()):
            self.set_filter(name, func)

    def set_filter(self, name: str, func: Callable[..., Any]) -> None:
        """Adds or replaces a filter, bounded as the built-in ones are."""
        self.filters[name] = self._bounded_filter(name, func)

    # -- time --------------------------------------------------------------------------

    @contextlib.contextmanager
    def budget(self, seconds: float = RENDER_TIMEOUT_S, resume: bool = False) -> Iterator[None]:
        """Renders on this thread inside share one deadline: `seconds` from now, or with
        `resume` the deadline of the last budget this thread left (when there was one). An
        inner `budget` keeps the outer deadline."""
        local = self._local
        if getattr(local, "deadline", None) is not None:
            yield
            return
        last = getattr(local, "last_deadline", None)
        local.deadline = last if resume and last is not None else time.monotonic() + seconds
        try:
            yield
        finally:
            local.last_deadline, local.deadline = local.deadline, None

    def check_time(self) -> None:
        """Raises `TemplateBudgetError` once this thread's deadline has passed."""
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise TemplateBudgetError(f"the chat template ran for more than {RENDER_TIMEOUT_S} s")

    def guard_loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """`iterable`, with the deadline checked before every item."""
        self.check_time()
        for item in iterable:
            self.check_time()
            yield item

    # -- sizes -------------------------------------------------------------------------

    def text_size(
        self, value: Any, limit: int = MAX_RENDER_CHARS, per_item: int = 2, indent: int = 0
    ) -> int:
        """About how many characters `str(value)` has (or its JSON text, with `per_item`
        separator characters and `indent` per nesting level), counted without building it:
        shared references count every time, as printing repeats them, but are measured once.

        Raises:
            TemplateBudgetError: more than `limit`.
        """
        memo: dict[tuple[int, int], int] = {}

        def size(item: Any, depth: int) -> int:
            if isinstance(item, (str, bytes)):
                return len(item)
            if isinstance(item, Namespace):
                item = item._Namespace__attrs  # type: ignore[attr-defined]
            if isinstance(item, dict):
                children: Iterable[Any] = itertools.chain.from_iterable(item.items())
            elif isinstance(item, (list, tuple, set, frozenset, MappingView)):
                children = item
            else:
                return item.bit_length() // 3 + 2 if isinstance(item, int) else 24
            key = (id(item), depth if indent else 0)
            known = memo.get(key)
            if known is not None:
                return known
            if not len(memo) & 0x3FF:
                self.check_time()
            count = 2 * len(item) if isinstance(item, dict) else len(item)
            total = 2 + count * (per_item + (indent * (depth + 1) + 1 if indent else 0))
            for child in children:
                if total > limit:
                    break
                total += size(child, depth + 1)
            if total > limit:
                raise _too_large("a text")
            memo[key] = total
            return total

        total = size(value, 0)
        if total > limit:
            raise _too_large("a text")
        return total

    def to_text(self, value: Any) -> str:
        """`str(value)`, refused before building it when it would be too large."""
        if isinstance(value, str):
            return value
        self.text_size(value)
        return str(value)

    def start_render(self) -> None:
        """A render starts on this thread: nothing of `MAX_BUILT` is spent yet."""
        self._local.built = 0

    def check_result(self, value: Any) -> Any:
        """`value`, unless it is a string or a collection over the limits, or takes what this
        render built over `MAX_BUILT`."""
        if isinstance(value, (str, bytes)):
            count, cost = len(value), 1
        elif isinstance(value, (list, tuple, dict)):
            count, cost = len(value), _ITEM_COST
        else:
            return value
        if count > MAX_RENDER_CHARS:
            del value  # an error's traceback keeps its frames' locals until a gc pass
            raise _too_large("a value")
        self._add_built(count * cost)
        return value

    def _add_built(self, size: int) -> None:
        built = getattr(self._local, "built", 0) + size
        self._local.built = built
        if built > MAX_BUILT:
            raise TemplateBudgetError(
                f"the chat template built more than {MAX_BUILT} characters in all"
            )

    def output_buffer(self) -> list[str]:
        """The list a block, macro or loop body writes its output pieces to."""
        return _OutputBuffer()

    def concat(self, pieces: Iterable[Any]) -> str:  # type: ignore[override]
        """The pieces joined (the template's output, its blocks and `~`), refused as soon as
        the total is over `MAX_RENDER_CHARS`."""
        return self._join(pieces, "")

    def _join(self, pieces: Iterable[Any], sep: str) -> str:
        self.check_time()
        texts, total = [], 0
        for piece in pieces:
            text = self.to_text(piece)
            total += len(text) + (len(sep) if texts else 0)
            if total > MAX_RENDER_CHARS:
                raise _too_large("a text")
            texts.append(text)
        self._add_built(total)
        return sep.join(texts)

    def _printable(self, value: Any) -> Any:
        """`{{ value }}`: printed only when its text is within the limit."""
        if not isinstance(value, str):
            self.text_size(value)
        return value

    # -- operators, calls, filters --------------------------------------------------------

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        """`*`, `**`, `+` and `%`, refused before they build a too large value."""
        self.check_time()
        if operator == "**" and isinstance(right, (int, float)):
            if abs(right) > _MAX_POWER or (
                isinstance(left, int) and abs(left).bit_length() * right > MAX_INT_BITS
            ):
                raise TemplateBudgetError("the chat template raised a number to a too large power")
        elif operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int):
                    limit = MAX_RENDER_CHARS if isinstance(seq, (str, bytes)) else MAX_ITEMS
                    if len(seq) * count > limit:
                        raise _too_large("a value")
            if isinstance(left, int) and isinstance(right, int):
                _check_bits(left.bit_length() + right.bit_length())
        elif operator == "+":
            if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, type(left)):
                limit = MAX_RENDER_CHARS if isinstance(left, (str, bytes)) else MAX_ITEMS
                if len(left) + len(right) > limit:
                    raise _too_large("a value")
            elif isinstance(left, int) and isinstance(right, int):
                _check_bits(max(left.bit_length(), right.bit_length()) + 1)
        elif operator == "%" and isinstance(left, str):
            self._check_percent(left, right)
        return self.check_result(super().call_binop(context, operator, left, right))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """A call from the template, after the deadline and the size its result will have
        are checked (string methods that pad, repeat or join)."""
        __self.check_time()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes)) and not isinstance(__obj, type):
            name = getattr(__obj, "__name__", "")
            if name == "join" and len(args) == 1 and not kwargs and isinstance(owner, str):
                return __self._join(args[0], owner)
            _check_string_method(owner, name, args, kwargs)
        return __self.check_result(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`str.format` / `format_map`, with their field widths and arguments bounded."""
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            self.check_time()
            widths = 0
            for _, _, spec, _ in string.Formatter().parse(fmt):
                if spec and "{" in spec:
                    raise TemplateBudgetError("the chat template nested a format field's spec")
                widths += sum(int(n) for n in re.findall(r"\d+", spec or ""))
            self.text_size([args, kwargs], MAX_RENDER_CHARS - len(fmt) - widths)
            return self.check_result(wrapper(*args, **kwargs))

        return bounded

    def _check_percent(self, fmt: str, args: Any) -> None:
        """`fmt % args` would be within the limit (its widths and precisions counted)."""
        widths = 0
        for width, precision, _ in _PERCENT_SPEC.findall(fmt):
            if "*" in (width, precision):
                raise TemplateBudgetError("the chat template used a `*` width in a % format")
            widths += int(width or 0) + int(precision or 0)
        self.text_size(args, MAX_RENDER_CHARS - len(fmt) - widths)

    def _bounded_filter(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func` checked before (deadline, sizes its arguments imply) and after (its result's
        size); a context filter, so the compiler never runs it on constants."""
        pass_arg = _PassArg.from_obj(func)
        precheck = _FILTER_CHECKS.get(name)
        measure_input = name not in _NON_TEXT_FILTERS
        iterating = name in _ITERATING_FILTERS
        max_text = _SLOW_TEXT_FILTERS.get(name)

        @pass_context
        def bounded(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
            self.check_time()
            if iterating and _sized_over(value, MAX_ITEMS):
                raise TemplateBudgetError(
                    f"the chat template applied {name} to more than {MAX_ITEMS} items"
                )
            if measure_input:
                for item in (value, *args, *kwargs.values()):
                    if not isinstance(item, _SCALARS):
                        self.text_size(item)
            if max_text is not None and len(self.to_text(value)) > max_text:
                raise TemplateBudgetError(
                    f"the chat template applied {name} to more than {max_text} characters"
                )
            if precheck is not None:
                precheck(self, value, *args, **kwargs)
            if pass_arg is _PassArg.context:
                args = (context, value, *args)
            elif pass_arg is _PassArg.eval_context:
                args = (context.eval_ctx, value, *args)
            elif pass_arg is _PassArg.environment:
                args = (self, value, *args)
            else:
                args = (value, *args)
            return self.check_result(func(*args, **kwargs))

        return bounded

    @staticmethod
    @pass_environment
    def _join_filter(
        environment: BoundedEnvironment, value: Iterable[Any], d: str = "", attribute: Any = None
    ) -> str:
        """Jinja's `join`, refused as soon as the text is over the limit."""
        if attribute is not None:
            getter = _attr_getter(environment, attribute)
            value = (getter(item) for item in value)
        return environment._join(value, environment.to_text(d))

    @staticmethod
    @pass_environment
    def _sum_filter(
        environment: BoundedEnvironment, iterable: Iterable[Any], attribute: Any = None, start=0
    ) -> Any:  # noqa: ANN001
        """Jinja's `sum`, each addition checked as the template's `+` is."""
        if attribute is not None:
            getter = _attr_getter(environment, attribute)
            iterable = (getter(item) for item in iterable)
        total = start
        for item in iterable:
            total = environment.call_binop(None, "+", total, item)  # type: ignore[arg-type]
        return total


def _attr_getter(environment: BoundedEnvironment, attribute: Any) -> Callable[[Any], Any]:
    from jinja2.filters import make_attrgetter

    return make_attrgetter(environment, attribute)


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateBudgetError(f"the chat template built an integer over {MAX_INT_BITS} bits")


def _sized_over(value: Any, limit: int) -> bool:
    try:
        return len(value) > limit
    except TypeError:
        return False


def _width(value: Any) -> int:
    """A width argument as a number of characters (a string counts its length)."""
    if isinstance(value, str):
        return len(value)
    return int(value) if isinstance(value, (int, float)) else 0


def _within(size: int) -> None:
    if size > MAX_RENDER_CHARS:
        raise _too_large("a string")


def _replaced_size(text: Any, old: Any, new: Any, count: Any = None) -> int:
    """The length of `text.replace(old, new, count)`."""
    if not isinstance(text, (str, bytes)):
        text, old, new = str(text), str(old), str(new)
    hits = len(text) + 1 if not old else text.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * (len(new) - len(old))


def _check_string_method(owner: str | bytes, name: str, args: tuple, kwargs: dict) -> None:
    """A string method that pads, expands or replaces stays within the limit."""
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _within(_width(args[0]))
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        _within(len(owner) + (owner.count("\t" if isinstance(owner, str) else b"\t") * tabsize))
    elif name == "replace" and len(args) >= 2:
        _within(_replaced_size(owner, *args[:3], **kwargs))
    elif name in ("translate", "maketrans"):
        raise TemplateBudgetError(f"the chat template may not call str.{name}")


def _check_center(env: BoundedEnvironment, value: Any, width: Any = 80) -> None:
    _within(max(len(env.to_text(value)), _width(width)))


def _check_indent(
    env: BoundedEnvironment, value: Any, width: Any = 4, first: bool = False, blank: bool = False
) -> None:
    text = env.to_text(value)
    _within(len(text) + (text.count("\n") + 1) * _width(width))


def _check_wordwrap(
    env: BoundedEnvironment,
    value: Any,
    width: Any = 79,
    break_long_words: bool = True,
    wrapstring: Any = None,
    break_on_hyphens: bool = True,
) -> None:
    text = env.to_text(value)
    _within(len(text) * (1 + len(env.to_text(wrapstring or "\n"))))


def _check_replace(env: BoundedEnvironment, value: Any, old: Any, new: Any, count: Any = None):  # noqa: ANN202
    _within(_replaced_size(env.to_text(value), old, new, count))


def _check_format(env: BoundedEnvironment, value: Any, *args: Any, **kwargs: Any) -> None:
    env._check_percent(env.to_text(value), kwargs or args)


def _check_batch(env: BoundedEnvironment, value: Any, count: Any, *_: Any) -> None:
    if isinstance(count, int) and count > MAX_ITEMS:
        raise TemplateBudgetError(f"the chat template asked for more than {MAX_ITEMS} items")


_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "center": _check_center,
    "indent": _check_indent,
    "wordwrap": _check_wordwrap,
    "replace": _check_replace,
    "format": _check_format,
    "batch": _check_batch,
    "slice": _check_batch,
}
