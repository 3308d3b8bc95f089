"""Reasoning models' thinking text apart from the answer (`--reasoning-parser`, vLLM's flag
and names): the text between `<think>` and `</think>` goes to the chat message's
`reasoning_content`, the rest to `content`, streamed as deltas of either.

- `deepseek_r1`: the output starts inside the thinking (DeepSeek-R1's template ends the
  prompt with `<think>\\n`; a `<think>` the model writes itself at the start is dropped);
  everything before `</think>` is reasoning, and an output that never closes it is all
  reasoning (vLLM's rule).
- `qwen3`: the model opens the thinking itself: an output that starts with `<think>` is
  reasoning up to `</think>`; one that does not (Qwen3 with `enable_thinking: false`, whose
  template writes an empty think block into the prompt) is all content.

`ReasoningSplitter` works on text pieces as the engine hands them out, holding back only a
tail that may still become one of the tags, so the deltas never need taking back and
concatenate to the non-streamed answer.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


class ReasoningSplitter:
    """One choice's text split into (reasoning, content) pieces (see the module docstring).
    Raises `ValueError` for an unknown parser name."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"--reasoning-parser {parser!r} is not one of {list(PARSERS)}")
        self.parser = parser
        # "start": the opening tag may still come; "think": inside; "answer": after / none
        self.phase = "start"
        self.held = ""  # text not yet handed out (a possible tag's start)

    def add(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the next text piece; either may be empty."""
        self.held += text
        reasoning = content = ""
        if self.phase == "start":
            if OPEN.startswith(self.held.lstrip()) and self.held.strip():
                return "", ""  # "<thi": wait
            if self.held.lstrip().startswith(OPEN):
                self.held = self.held.lstrip()[len(OPEN):]
                self.phase = "think"
            elif self.parser == "deepseek_r1":
                self.phase = "think"
            elif not self.held.strip():
                return "", ""  # leading whitespace only: wait
            else:
                self.phase = "answer"
        if self.phase == "think":
            end = self.held.find(CLOSE)
            if end < 0:
                keep = _tag_start(self.held, CLOSE)
                reasoning, self.held = self.held[:len(self.held) - keep], \
                    self.held[len(self.held) - keep:]
                return reasoning, ""
            reasoning, self.held = self.held[:end], self.held[end + len(CLOSE):]
            self.phase = "answer"
        if self.phase == "answer":
            content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held-back rest, once the output has ended."""
        rest, self.held = self.held, ""
        if self.phase == "think" or (self.phase == "start" and self.parser == "deepseek_r1"):
            return rest, ""
        return "", rest

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output: None for a part that is absent."""
        r1, c1 = self.add(text)
        r2, c2 = self.finish()
        return (r1 + r2) or None, (c1 + c2) or None


def _tag_start(text: str, tag: str) -> int:
    """Characters at the end of `text` that are a proper prefix of `tag` (held back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
