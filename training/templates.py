"""Chat templates rendered within bounds: a model's chat template is code (Jinja) that a hub id or a model folder
brings along, and an API client may name either. transformers renders it in Jinja's sandbox, which stops attribute
tricks but not work: ``{% for i in range(100000) %}{% for j in range(100000) %}`` ran until cancelled, and a string
doubled in a loop built 900 MB. Rendered here, every template is bounded in time and in size:

- each loop iteration, each arithmetic operator and each ``~`` concatenation counts against the rendering's
  deadline (:data:`RENDER_SECONDS`);
- a string, list or tuple that an operator, a ``~`` or a filter (``join``, ``replace``, ``center``, ``indent``,
  ``format``...) would make longer than :data:`MAX_CHARS` is refused before it is made (or, where its size is only
  known after, as soon as it is), and so is the rendered text itself.

A template past either bound raises :class:`TemplateLimit` naming it; the trainer, the dataset helper and the
playground all render through :func:`install`'s environment (transformers' own ``apply_chat_template``, with
Collage's sandbox in place of its ``ImmutableSandboxedEnvironment``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from collage.training.infra.errors import InputError

RENDER_SECONDS = 5.0  # one rendering of a chat template (a real one takes milliseconds)
MAX_CHARS = 1_000_000  # the longest text (or list) a rendering may make: a prompt of a quarter of a million tokens
MAX_POWER = 4096  # the largest exponent `**` takes (10 ** 10 ** 8 is a number that takes minutes to print)


class TemplateLimit(InputError):
    """A chat template passed Collage's bound on a rendering (its time or the size of what it makes)."""


_state = threading.local()  # the running rendering's deadline (each thread renders its own)


def _deadline() -> float:
    return getattr(_state, "deadline", 0.0)


def tick() -> None:
    """A unit of a template's work: past the rendering's deadline, the rendering stops."""
    deadline = _deadline()
    if deadline and time.monotonic() > deadline:
        raise TemplateLimit(
            f"the model's chat template ran for more than {RENDER_SECONDS:.0f} s, Collage's bound on rendering one "
            "prompt (a loop that never ends, or one far too long): fix the template, or use another model"
        )


def _too_long(size: int, what: str) -> TemplateLimit:
    return TemplateLimit(
        f"the model's chat template would make {what} of {size} characters (or items), more than the {MAX_CHARS} "
        "Collage lets one rendering make: fix the template, or use another model"
    )


def bounded(value: Any, what: str = "a text") -> Any:
    """``value`` when it is no longer than :data:`MAX_CHARS` (a str, list or tuple), else :class:`TemplateLimit`."""
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_CHARS:
        raise _too_long(len(value), what)
    return value


def _check_repeat(left: Any, right: Any) -> None:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_CHARS:
            raise _too_long(len(seq) * times, "a repetition")


def _text_size(value: Any) -> int:
    """About how many characters ``value`` takes as text, counted without making that text (a list holding the same
    long string a thousand times counts it a thousand times); stops counting past :data:`MAX_CHARS`."""
    total, stack = 0, [value]
    while stack and total <= MAX_CHARS:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (list, tuple)):
            tick()
            total += 2 * len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            tick()
            total += 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        else:
            total += 24  # a number, None, a bool: short whatever it is
    return total


def _same_arguments(wrapper, original):
    """``wrapper`` takes what ``original`` takes from Jinja (its context or eval context first, when it asks)."""
    if hasattr(original, "jinja_pass_arg"):
        wrapper.jinja_pass_arg = original.jinja_pass_arg
    return wrapper


def _values(args: tuple, passes_context: bool) -> tuple:
    return args[1:] if passes_context else args


def _bounded_join(original):
    passes = hasattr(original, "jinja_pass_arg")

    def join(*args, **kwargs):
        value, rest = _values(args, passes)[0], _values(args, passes)[1:]
        items = value if isinstance(value, (list, tuple)) else list(value)
        separator = str(rest[0] if rest else kwargs.get("d", ""))
        total = len(separator) * max(0, len(items) - 1)
        for item in items:
            tick()
            total += _text_size(item)
            if total > MAX_CHARS:
                raise _too_long(total, "a join")
        return original(*args[: len(args) - len(rest) - 1], items, *rest, **kwargs)

    return _same_arguments(join, original)


def _bounded_replace(original):
    passes = hasattr(original, "jinja_pass_arg")

    def replace(*args, **kwargs):
        s, old, new, *count = _values(args, passes)
        text, old, new = str(s), str(old), str(new)
        found = text.count(old) if old else len(text) + 1
        if count and count[0] is not None:
            found = min(found, int(count[0]))
        size = len(text) + found * max(0, len(new) - len(old))
        if size > MAX_CHARS:
            raise _too_long(size, "a replace")
        return original(*args, **kwargs)

    return _same_arguments(replace, original)


def _bounded_width(original, name: str):
    """A filter whose first argument after the value is a width (``center``, ``indent``, ``wordwrap``,
    ``truncate``): a width past the bound is refused before the text is made."""
    passes = hasattr(original, "jinja_pass_arg")

    def filtered(*args, **kwargs):
        values = _values(args, passes)
        widths = [w for w in (*values[1:2], kwargs.get("width"), kwargs.get("length")) if isinstance(w, int)]
        if any(w > MAX_CHARS for w in widths):
            raise _too_long(max(widths), f"a {name}")
        tick()
        return bounded(original(*args, **kwargs), f"a {name}")

    return _same_arguments(filtered, original)


def _bounded_after(original, name: str):
    """Any other filter (``tojson``, ``format``, ``string``...): its arguments' size as text is counted before it
    runs (a filter makes at most about that much from them), and what it made after."""
    passes = hasattr(original, "jinja_pass_arg")

    def filtered(*args, **kwargs):
        size = sum(_text_size(v) for v in (*_values(args, passes), *kwargs.values()))
        if size > MAX_CHARS:
            raise _too_long(size, f"a {name}")
        return bounded(original(*args, **kwargs), f"a {name}")

    return _same_arguments(filtered, original)


WIDTH_FILTERS = ("center", "indent", "wordwrap", "truncate")
SPECIAL_FILTERS = {"join": _bounded_join, "replace": _bounded_replace}


def _bound_filter(name: str, function):
    if name in SPECIAL_FILTERS:
        return SPECIAL_FILTERS[name](function)
    if name in WIDTH_FILTERS:
        return _bounded_width(function, name)
    return _bounded_after(function, name)


class _BoundedFilters(dict):
    """The environment's filters, each bounded, those set after it was made too (transformers adds ``tojson``)."""

    def __init__(self, filters):
        super().__init__({name: _bound_filter(name, f) for name, f in filters.items()})

    def __setitem__(self, name, function):
        super().__setitem__(name, _bound_filter(name, function))


def _sandbox_classes():
    """The bounded environment, its code generator and its template class (built once jinja2 is imported)."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.environment import Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        """Every loop iteration ticks; every ``~`` is bounded."""

        def visit_For(self, node, frame):
            call = nodes.Call(nodes.EnvironmentAttribute("tick"), [], [], None, None)
            node.body = [nodes.ExprStmt(call, lineno=node.lineno), *node.body]
            return super().visit_For(node, frame)

        def visit_Concat(self, node, frame):
            self.write("environment.bounded(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedTemplate(Template):
        def render(self, *args, **kwargs):
            return "".join(self.generate(*args, **kwargs))

        def generate(self, *args, **kwargs) -> Iterator[str]:
            outer = _deadline()
            _state.deadline = outer or time.monotonic() + RENDER_SECONDS
            try:
                size = 0
                for chunk in super().generate(*args, **kwargs):
                    size += len(chunk)
                    if size > MAX_CHARS:
                        raise _too_long(size, "a prompt")
                    tick()
                    yield chunk
            finally:
                _state.deadline = outer

    class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        template_class = BoundedTemplate
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tick = tick
            self.bounded = bounded
            self.filters = _BoundedFilters(self.filters)

        def call_binop(self, context, operator, left, right):
            tick()
            if operator == "*":
                _check_repeat(left, right)
            elif operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_POWER:
                raise TemplateLimit(f"the model's chat template raises a number to the power {right}, more than "
                                    f"the {MAX_POWER} Collage allows")  # fmt: skip
            elif operator == "%" and isinstance(left, str):
                size = len(left) + _text_size(right)
                if size > MAX_CHARS:
                    raise _too_long(size, "a % format")
            return bounded(super().call_binop(context, operator, left, right), f"a {operator} result")

    return BoundedSandboxedEnvironment


_installed = threading.Lock()


def install() -> None:
    """Render transformers' chat templates in Collage's bounded sandbox (idempotent; per process)."""
    with _installed:
        from transformers.utils import chat_template_utils as ctu

        if getattr(ctu, "_collage_bounded", False):
            return
        # transformers compiles every chat template with this class: replaced by the bounded one
        setattr(ctu, "ImmutableSandboxedEnvironment", _sandbox_classes())  # noqa: B010
        ctu._compile_jinja_template.cache_clear()  # templates compiled before were compiled unbounded
        setattr(ctu, "_collage_bounded", True)  # noqa: B010
