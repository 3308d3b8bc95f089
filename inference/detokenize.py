"""Incremental detokenization: the text of a growing list of token ids, handed out in pieces
that never split a character and never need taking back.

Decoding the whole output at every step and slicing it by characters breaks with byte-fallback
tokenizers (SentencePiece, Llama-2, Mistral): while a multi-byte character is incomplete the
decoded text ends in one U+FFFD per byte, so character offsets into it do not survive the next
step, and text after the character is skipped or doubled. Decoding the whole output each step
also costs O(n^2) over a request.

The scheme is the one vLLM and TGI use (vLLM's `detokenize_incrementally`): keep two offsets in
*tokens*, `prefix` and `read`. Each step decodes `ids[prefix:read]` (text already handed out)
and `ids[prefix:]`; when the second is longer and does not end in U+FFFD, its extra characters
are new text and both offsets move on. Decoding from `prefix` rather than from `read` gives the
tokenizer a few tokens of context, so decoders that strip a leading space from the first token
(SentencePiece's dummy prefix, Metaspace) or merge across tokens (byte fallback) see the same
neighbourhood in both decodes.
"""
from __future__ import annotations

from typing import Callable

# tokens of context kept before the first new token when the output starts (vLLM keeps 5)
INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    """Text of one request's output ids, piece by piece.

    `decode(ids) -> str` is the tokenizer's (special tokens skipped). `prompt` gives the
    context the first output tokens are decoded in (its last `INITIAL_CONTEXT` ids, none
    for an encoder-decoder), so a first token that starts a word keeps its leading space as
    vLLM keeps it (decoding the output ids alone drops it with SentencePiece / Metaspace
    tokenizers; for byte-level BPE and byte fallback the two agree).

    `add(token)` appends one output id and returns the text it completes, possibly "" while a
    character is incomplete; `finish()` returns what is left, incomplete bytes shown as U+FFFD
    as `decode` shows them. The pieces concatenate to the decoded output (tests/test_detokenize.py
    checks random outputs of real tokenizers), except inside a run of byte tokens that is not
    valid UTF-8: HF's ByteFallback decoder then shows the whole run as U+FFFD, one per byte,
    where the pieces may already hold its valid start.
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt: list[int] = ()):
        self.decode = decode
        self.ids = list(prompt[-INITIAL_CONTEXT:]) if prompt else []
        self.prefix = 0  # ids[prefix:read] are decoded again, as context, at every step
        self.read = len(self.ids)  # ids[:read] have had their text handed out

    def _pending(self) -> tuple[str, str]:
        ids = self.ids
        before = self.decode(ids[self.prefix:self.read]) if self.read > self.prefix else ""
        return before, self.decode(ids[self.prefix:])

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        before, now = self._pending()
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def finish(self) -> str:
        """The text not yet handed out, incomplete characters included (as U+FFFD)."""
        before, now = self._pending()
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""


class OutputText:
    """The text of one request's output, cut at its first stop string: the engine's
    (offline generation) and the API server process's (serving: the engines send ids only).

    `add(token, reason)` appends one output id (`reason`: why the request ends with it, or
    None) and returns the finish reason: "stop" when a stop string appeared (the text is cut
    before it), else `reason`; once a request ends, the incomplete characters left are shown
    as U+FFFD. `new_text(finished)` returns the text not yet handed out; while running it
    holds back a tail that may still become a stop string. `text`: all the text so far."""

    def __init__(self, decode: Callable[[list[int]], str], prompt: list[int] = (),
                 stop: tuple[str, ...] = ()):
        self.detokenizer = IncrementalDetokenizer(decode, prompt)
        self.stop = tuple(stop)
        self.text = ""
        self.sent = 0  # characters of `text` already handed out

    def add(self, token: int, reason: str | None) -> str | None:
        piece = self.detokenizer.add(token)
        if reason is not None:
            piece += self.detokenizer.finish()
        if not piece:
            return reason
        self.text += piece
        if self.stop:  # a new match starts at most len(stop) - 1 characters back
            lo = max(0, len(self.text) - len(piece) - max(map(len, self.stop)) + 1)
            cuts = [c for c in (self.text.find(s, lo) for s in self.stop) if c >= 0]
            if cuts:
                self.text, reason = self.text[:min(cuts)], "stop"
        return reason

    def new_text(self, finished: bool) -> str:
        end = len(self.text)
        if not finished:
            for s in self.stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.text[:end].endswith(s[:k]):
                        end -= k
                        break
        new, self.sent = self.text[self.sent:end], max(self.sent, end)
        return new
