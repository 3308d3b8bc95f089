"""Rendering a model's chat template (the Jinja `chat_template` of its tokenizer or GGUF
file) as untrusted code, bounded in time and size.

transformers renders templates in jinja2's `ImmutableSandboxedEnvironment`, which keeps a
template from Python's objects but not from running long or building large values: nested
`range(100000)` loops ran for minutes while the output grew by gigabytes, and a server would
do that per request. `render_chat_template` renders with the same environment (transformers'
filters, globals and extensions: `tojson`, `raise_exception`, `strftime_now`, `dict`,
`namespace`, `{% generation %}`, loop controls) in a subclass that bounds the work:

- time: a deadline (`MAX_SECONDS`) checked at every loop iteration (each `{% for %}`
  iterates through `BoundedSandbox.loop_items`), call, filter, operator and concatenation,
  so it fires in any thread (no signals) and a loop that writes nothing is stopped too;
- size: the rendered text (`MAX_CHARS` characters) is counted while `generate()` yields it;
  every value a call, filter, `+`, `*`, `%` or `~` builds is held to the same bound, checked
  before building where the size is known beforehand (`"a" * n`, `seq | join(sep)`,
  `s | replace(a, b)`, `s | indent(w)`, printf and `str.format` widths, a sum of lists), and
  any integer passed to a call or filter to `MAX_INT_ARG` (`range`, widths, counts);
- a template that reaches for Python objects is refused by the sandbox as before.

Every refusal is one `ChatTemplateError` line naming the problem; so is any other error the
template raises (a syntax error, its own `raise_exception`).
"""
from __future__ import annotations

import contextvars
import functools
import re
import string
import time

import jinja2
import jinja2.runtime
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_SECONDS = 2.0  # a real template renders in milliseconds
MAX_CHARS = 4 * 2**20  # characters of the rendered text and of any value it builds
MAX_INT_ARG = 100_000  # any integer passed to a call or filter (jinja's own range limit)
MAX_INT_BITS = 4096  # integers a template computes
_FIX = "fix or replace chat_template in the model's tokenizer files"


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered: one line naming the problem."""


class _Limit(Exception):
    """A bound `_Budget` enforces (turned into a `ChatTemplateError` by the renderer; not a
    jinja2 error, so nothing in jinja2 handles it on the way)."""


class _Budget:
    """One rendering's deadline and size bound."""

    def __init__(self, seconds: float, chars: int):
        self.seconds, self.chars = seconds, chars
        self.deadline = time.monotonic() + seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Limit(f"ran for more than {self.seconds:g} s")

    def need(self, size: int, what: str) -> None:
        if size > self.chars:
            raise _Limit(f"{what} of {size:,} items, more than the {self.chars:,} allowed")

    def check(self, value):
        if isinstance(value, (str, bytes, list, tuple, dict, set)):
            self.need(len(value), "built a value")
        elif type(value) is int and value.bit_length() > MAX_INT_BITS:
            raise _Limit(f"computed an integer of {value.bit_length():,} bits")
        return value

    def args(self, args, kwargs) -> None:
        self.tick()
        for v in (*args, *kwargs.values()):
            if type(v) is int and abs(v) > MAX_INT_ARG:
                raise _Limit(f"passed the number {v:,} to a call or filter, more than "
                             f"{MAX_INT_ARG:,}")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None)


def _budget() -> _Budget:
    b = _BUDGET.get()
    if b is None:  # rendered outside `render_chat_template`: no work allowed unbounded
        raise _Limit("was rendered without a budget")
    return b


def _length(v) -> int:
    return len(v) if isinstance(v, (str, bytes, list, tuple, dict, set)) else 0


def _printf_width(fmt: str) -> None:
    """Refuse a printf-style format whose width or precision is over `MAX_INT_ARG` or
    taken from the arguments (`*`)."""
    for m in re.finditer(r"%[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?", fmt):
        for n in m.groups():
            if n == "*" or (n and int(n) > MAX_INT_ARG):
                raise _Limit(f"formats with a width or precision of {n}")


def _grows(name: str, args, kwargs) -> int:
    """The size a filter that multiplies its inputs would build (0: not one of them)."""
    value = args[0] if args else None
    if name == "join" and isinstance(value, (list, tuple, str)):
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        return sum(len(v) if isinstance(v, str) else 8 for v in value) + \
            len(value) * _length(sep)
    if name == "replace" and isinstance(value, str) and len(args) > 2:
        old, new = str(args[1]), str(args[2])
        return len(value) + (value.count(old) if old else len(value) + 1) * len(new)
    if name in ("indent", "wordwrap") and isinstance(value, str):
        pad = [v for v in (*args[1:], *kwargs.values()) if isinstance(v, (str, int))]
        width = max([v if type(v) is int else len(v) for v in pad] or [0])
        return len(value) + (value.count("\n") + 1) * width
    if name == "sum" and isinstance(value, (list, tuple)):
        return sum(map(_length, value))
    if name == "tojson":
        indent = args[1] if len(args) > 1 else kwargs.get("indent")
        if indent is not None and _length(indent) + (indent if type(indent) is int else 0) > 16:
            raise _Limit(f"asks tojson for an indent of {indent!r}")
    if name == "format" and isinstance(value, str):
        _printf_width(value)
    return 0


_PASSED = (jinja2.runtime.Context, nodes.EvalContext, jinja2.Environment)


def _bounded_filter(name: str, f):
    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
    def run(*args, **kwargs):
        b = _budget()
        b.args(args, kwargs)
        args = list(args)
        at = next((i for i, a in enumerate(args) if not isinstance(a, _PASSED)), len(args))
        if name in ("join", "sum") and at < len(args) and \
                not isinstance(args[at], (str, list, tuple)):  # a range, map(), ...: listed
            args[at] = b.check(list(BoundedSandbox.loop_items(args[at])))
        b.need(_grows(name, args[at:], kwargs), f"would build with the {name} filter a value")
        return b.check(f(*args, **kwargs))
    return run


class _Codegen(CodeGenerator):
    """Jinja's code generator with `~` (string concatenation) through the environment's
    `concat`, so its result is bounded too."""

    def visit_Concat(self, node, frame):
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the bounds of the module docstring (the active
    `_Budget` is per rendering, in a context variable, so threads render independently)."""

    code_generator_class = _Codegen
    intercepted_binops = frozenset(("+", "*", "**", "%"))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.filters = {n: _bounded_filter(n, f) for n, f in self.filters.items()}

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):  # every loop iterates through loop_items
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("loop_items"), [loop.iter], [],
                                   None, None, lineno=loop.lineno)
        return tree

    @staticmethod
    def loop_items(iterable):
        """`iterable`'s items, the deadline checked before each."""
        b = _budget()
        for item in iterable:
            b.tick()
            yield item

    def concat(self, values) -> str:
        b = _budget()
        b.tick()
        parts = [str(v) for v in values]
        b.need(sum(map(len, parts)), "would concatenate (~) a string")
        return "".join(parts)

    def call_binop(self, context, operator, left, right):
        b = _budget()
        b.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _length(seq) and type(n) is int:
                    b.need(_length(seq) * n, "would repeat (*) a value into one")
            if type(left) is int and type(right) is int:
                bits = left.bit_length() + right.bit_length()
                if bits > MAX_INT_BITS:
                    raise _Limit(f"would multiply into an integer of {bits:,} bits")
        elif operator == "**" and type(left) is int and type(right) is int and \
                abs(left) > 1 and right > 0 and left.bit_length() * right > MAX_INT_BITS:
            raise _Limit(f"would raise {left} to the power {right:,}")
        elif operator == "+" and _length(left) and _length(right):
            b.need(_length(left) + _length(right), "would join (+) a value")
        elif operator == "%" and isinstance(left, str):
            _printf_width(left)
        return b.check(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        b = _budget()
        b.args(args, kwargs)
        return b.check(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            for _, _, spec, _ in string.Formatter().parse(value.__self__):
                widths = re.findall(r"\d+", spec or "")
                if "{" in (spec or "") or any(int(w) > MAX_INT_ARG for w in widths):
                    raise _Limit(f"formats with the field spec {spec!r}")
        return wrapper


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """`source` compiled in a `BoundedSandbox` set up as transformers sets up its own (its
    filters, globals and extensions, taken from the environment it builds)."""
    from transformers.utils.chat_template_utils import _cached_compile_jinja_template

    theirs = _cached_compile_jinja_template("").environment
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[type(e) for e in theirs.extensions.values()])
    env.filters.update({n: _bounded_filter(n, f) for n, f in theirs.filters.items()
                        if f is not jinja2.filters.FILTERS.get(n)})
    env.globals.update({n: g for n, g in theirs.globals.items() if n != "range"})
    return env.from_string(source)


def render_chat_template(source: str, max_seconds: float = MAX_SECONDS,
                         max_chars: int = MAX_CHARS, **variables) -> str:
    """The text of Jinja chat template `source` rendered with `variables` (transformers'
    names: `messages`, `add_generation_prompt`, `bos_token`, ...), bounded as the module
    docstring says. Raises `ChatTemplateError` (a `ValueError`), one line, for a template
    that does not compile, runs past `max_seconds`, builds more than `max_chars`
    characters (or items), reaches for Python objects (jinja2's `SecurityError`) or fails
    (its own `raise_exception` included)."""
    budget = _Budget(max_seconds, max_chars)
    token = _BUDGET.set(budget)
    try:
        template = _compile(source)
        out, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            budget.need(size, "rendered a text")
            budget.tick()
            out.append(piece)
        return "".join(out)
    except _Limit as e:
        raise ChatTemplateError(f"the chat template {e}; refused ({_FIX})") from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template tried to reach Python objects "
                                f"({_one_line(e)}): refused by the sandbox; {_FIX}") from None
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja (line {e.lineno}: "
                                f"{_one_line(e)}); {_FIX}") from None
    except jinja2.exceptions.TemplateError as e:  # raise_exception: the template's message
        raise ChatTemplateError(f"the chat template refused the messages: "
                                f"{_one_line(e)}") from None
    except (RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"the chat template raised {type(e).__name__} (it recursed "
                                f"or allocated without bound); refused ({_FIX})") from None
    except Exception as e:  # noqa: BLE001 - a template fails in any of Python's ways
        raise ChatTemplateError(f"the chat template failed ({type(e).__name__}: "
                                f"{_one_line(e)}); {_FIX}") from None
    finally:
        _BUDGET.reset(token)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]
