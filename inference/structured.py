"""Structured outputs: generation held to a grammar (a JSON schema, any JSON object, a
regular expression, a Lark grammar or a list of choices) by masking, at each sampled
position, every id that cannot continue a text the grammar accepts.

The grammar engine is llguidance (Microsoft's Rust library behind Guidance, also one of vLLM's
structured-output backends; docs/DECISIONS.md has the measurements that chose it over
xgrammar and outlines-core). It is an optional dependency (the `serve` extra): without it a
structured request is refused with a 400 naming the package.

- `grammar_of(kind, value)` turns a request's constraint into an llguidance grammar and
  checks it (`GrammarError`, one line with llguidance's reason: the HTTP layer's 400).
- `GrammarBackend(tokenizer, vocab_size)` holds the tokenizer as llguidance sees it (built
  once per engine, ~0.4 s for a 49k vocabulary) and makes one `Matcher` per request.
- `Matcher` follows a request's output: `accept(token)` after every generated id (on every
  rank, so all ranks agree when the grammar ends the request), `mask()` the `[V]` bool
  tensor of allowed ids at the next position (computed on the last pipeline stage only,
  in a worker thread while the forward runs: see Engine.step), and `masks_for(drafts)` the
  masks along a speculative run (each draft consumed, then rolled back).
"""
from __future__ import annotations

import json

MISSING = ("structured outputs (response_format, structured_outputs, tool_choice) need the "
           "'llguidance' package on the server; install it (pip install 'shardzoo[serve]')")
# JSON is written on one line, `{"a": 1, "b": [2, 3]}` (a schema's own "x-guidance" wins):
# free whitespace would let a model pad its answer with newlines until max_tokens
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
KINDS = ("json", "json_object", "regex", "grammar", "choice")


class GrammarError(ValueError):
    """A constraint that cannot be used: one line naming the problem."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError(MISSING) from None
    return llguidance


def grammar_of(kind: str, value) -> str:
    """The llguidance grammar (its JSON text) of a constraint, checked.

    kind: "json" (a JSON schema, dict or text), "json_object" (any JSON object; value
    ignored), "regex" (Rust regex syntax), "grammar" (Lark syntax, llguidance's dialect),
    "choice" (a non-empty list of strings: exactly one of them).
    Raises `GrammarError` for a malformed value, a grammar llguidance refuses (its message),
    or when llguidance is not installed."""
    ll = _llguidance().LLMatcher
    if kind == "json":
        if isinstance(value, (dict, bool)):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise GrammarError(f"a JSON schema must be an object, got {type(value).__name__}")
        grammar = ll.grammar_from_json_schema(value, defaults=JSON_LAYOUT)
    elif kind == "json_object":
        grammar = ll.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
    elif kind == "regex":
        if not isinstance(value, str):
            raise GrammarError(f"a regex must be a string, got {type(value).__name__}")
        grammar = ll.grammar_from_regex(value)
    elif kind == "grammar":
        if not isinstance(value, str):
            raise GrammarError(f"a grammar must be a string, got {type(value).__name__}")
        grammar = ll.grammar_from_lark(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(
                isinstance(c, str) and c for c in value):
            raise GrammarError("'choice' must be a non-empty list of non-empty strings")
        grammar = ll.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    else:
        raise GrammarError(f"unknown constraint {kind!r}; use one of {list(KINDS)}")
    why = ll.validate_grammar(grammar)
    if why:
        raise GrammarError(" ".join(why.split())[:500])
    return grammar


def backend(tokenizer, vocab_size: int):
    """A `GrammarBackend` for `tokenizer`, or an `Unavailable` saying why there is none
    (llguidance missing, not a Hugging Face fast tokenizer): the engine then refuses
    structured requests with that reason."""
    try:
        return GrammarBackend(tokenizer, vocab_size)
    except GrammarError as e:
        return Unavailable(str(e))


class Unavailable:
    """No grammar backend: `unavailable` is the reason a structured request is refused."""

    def __init__(self, reason: str):
        self.unavailable = reason


class GrammarBackend:
    """llguidance's view of one tokenizer (`models.tokenizer.Tokenizer`, Hugging Face kind)
    over a model vocabulary of `vocab_size` ids (ids the tokenizer lacks are never allowed).

    Raises `GrammarError` when llguidance is missing or the tokenizer is not a Hugging Face
    fast tokenizer (llguidance reads its vocabulary from tokenizer.json)."""

    def __init__(self, tokenizer, vocab_size: int):
        ll = _llguidance()
        import llguidance.hf

        hf = getattr(tokenizer, "_hf", None)
        if hf is None or not getattr(hf, "is_fast", False):
            raise GrammarError("structured outputs need a Hugging Face fast tokenizer "
                               "(tokenizer.json); this model's tokenizer is not one")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
        self._ll = ll
        self.unavailable = None

    def matcher(self, grammar: str) -> "Matcher":
        return Matcher(self._ll.LLMatcher(self.tokenizer, grammar), self.vocab_size)


class Matcher:
    """One request's position in its grammar (see the module docstring)."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.torch as lt

        self.m, self.vocab_size, self._lt = matcher, vocab_size, lt
        self._bits = lt.allocate_token_bitmask(1, vocab_size)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())

    def accept(self, token: int) -> None:
        """Move past a generated id. An id the grammar refuses (EOS under `ignore_eos`)
        leaves the matcher in its error state: `done` is then true and the request ends."""
        if not self.m.is_stopped():
            self.m.consume_token(int(token))

    @property
    def done(self) -> bool:
        """The grammar is complete (nothing may follow) or was broken."""
        return self.m.is_stopped() or self.m.is_error()

    def mask(self):
        """`[V]` bool: the ids allowed at the next position (the EOS ids where the text so
        far is complete)."""
        import torch

        self._lt.fill_next_token_bitmask(self.m, self._bits, 0)
        return _unpack(self._bits[0], self.vocab_size, torch)

    def masks_for(self, drafts: list[int]) -> list:
        """The masks at the k + 1 positions of a speculative run: before each draft and after
        the last one, each draft consumed to reach the next (then all rolled back). Where a
        draft breaks the grammar the list stops: the target's id there differs from that
        draft (its mask refuses it), so later positions are never read."""
        out, consumed = [], 0
        for d in [*drafts, None]:
            out.append(self.mask())
            if d is None or self.m.is_stopped() or self.m.validate_tokens([int(d)]) != 1:
                break
            self.m.consume_token(int(d))
            consumed += 1
        self.m.rollback(consumed)
        return out


def _unpack(bits, vocab_size: int, torch):
    """`[ceil(V / 32)]` int32 bitmask -> `[V]` bool (bit j of word w: id 32 w + j)."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits.unsqueeze(1) >> shifts) & 1).bool().flatten()[:vocab_size]


def apply_masks(logits, masks: list):
    """Set the refused ids of each row of `logits [b, V]` to -inf (rows whose mask is None
    are left alone); returns `logits`."""
    for i, m in enumerate(masks):
        if m is not None:
            logits[i].masked_fill_(~m.to(logits.device), float("-inf"))
    return logits
