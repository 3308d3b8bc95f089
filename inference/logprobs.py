"""OpenAI's `logprobs` objects, built from the engine's per-token log-probabilities
(`Event.logprobs`: per generated token `(id, logprob, [(id, logprob)] x N)`, the raw model
output's, see inference/sampling.py `token_logprobs`).

- /v1/completions (`logprobs: N`): `{"tokens": [str], "token_logprobs": [float],
  "top_logprobs": [{token: logprob}], "text_offset": [int]}`. Each `top_logprobs` dict holds
  the N most likely tokens and always the sampled one, so up to N + 1 entries (OpenAI's rule).
- /v1/chat/completions (`logprobs: true`, `top_logprobs: N`): `{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] x N}]}`, alternatives in
  decreasing probability.

Token strings: `bytes` are the token's own bytes (`Tokenizer.token_bytes`), so the bytes of
consecutive tokens concatenate to the text even where a character is split over several
tokens (OpenAI's meaning of the field). A token whose bytes are a whole UTF-8 text is that
text; a byte-fallback or byte-level token that holds only part of a character is written
`bytes:\\xe2\\x80` (OpenAI's form; vLLM writes U+FFFD and gives U+FFFD's bytes, which loses
them). An id the tokenizer lacks (a padded vocabulary) is `token_id:N` (vLLM's form) with
`bytes` null.

Values: a logprob below -9999.0, -inf or NaN (a model with non-finite logits) is written
-9999.0, OpenAI's value for "very unlikely", so the JSON stays valid.

`text_offset[i]` is the character offset in the choice's text where token i's text starts:
the tokens' bytes laid end to end and decoded, a token that continues a split character
getting that character's offset. Offsets run on across stream chunks (kept per choice).
"""
from __future__ import annotations

import codecs

LOWEST = -9999.0


def token_text(raw: bytes | None, token_id: int) -> str:
    """The `token` string of a token with bytes `raw` (see the module docstring)."""
    if raw is None:
        return f"token_id:{token_id}"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def prompt_logprobs_object(entries: list, top: int, token_bytes) -> list:
    """vLLM's `prompt_logprobs` from an `Event.prompt_logprobs`: per prompt token None for
    the first, then `{str(id): {"logprob", "rank", "decoded_token"}}` holding the token
    itself (its rank in the vocabulary, 1 = most likely) and the `top` most likely ids
    (ranks 1..top)."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        token, logprob, rank, alternatives = e
        d = {str(token): {"logprob": _value(logprob), "rank": rank,
                          "decoded_token": token_text(token_bytes(token), token)}}
        for j, (i, lp) in enumerate(alternatives[:top]):
            d.setdefault(str(i), {"logprob": _value(lp), "rank": j + 1,
                                  "decoded_token": token_text(token_bytes(i), i)})
        out.append(d)
    return out


def _value(logprob: float) -> float:
    return logprob if logprob >= LOWEST else LOWEST  # NaN compares False: LOWEST too


class LogprobsFormat:
    """How one request's log-probabilities are written: `top` alternatives per token, the
    endpoint (`chat`), `token_bytes(id) -> bytes | None` (the tokenizer's); it keeps each
    choice's text offset between the chunks of a stream."""

    def __init__(self, top: int, chat: bool, token_bytes):
        self.top, self.chat, self.token_bytes = top, chat, token_bytes
        self._offsets: dict[int, list] = {}  # choice -> [characters so far, UTF-8 decoder]

    def _token(self, token_id: int) -> tuple[str, bytes | None]:
        raw = self.token_bytes(token_id)
        return token_text(raw, token_id), raw

    def format(self, index: int, entries: list[tuple]) -> dict:
        """The `logprobs` object of choice `index` for `entries` (its next tokens' `(id,
        logprob, [(id, logprob)])`, in order)."""
        if self.chat:
            return {"content": [self._chat_entry(*e) for e in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        state = self._offsets.setdefault(
            index, [0, codecs.getincrementaldecoder("utf-8")(errors="replace")])
        for token_id, logprob, top in entries:
            text, raw = self._token(token_id)
            alternatives = None  # an echoed prompt's first token: nothing predicts it
            if logprob is not None:
                alternatives = {}
                for i, lp in top[:self.top]:
                    alternatives.setdefault(self._token(i)[0], _value(lp))
                alternatives.setdefault(text, _value(logprob))
            out["tokens"].append(text)
            out["token_logprobs"].append(None if logprob is None else _value(logprob))
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(state[0])
            state[0] += len(state[1].decode(raw or b""))
        return out

    def _chat_entry(self, token_id: int, logprob: float, top: list) -> dict:
        entry = self._chat_item(token_id, logprob)
        entry["top_logprobs"] = [self._chat_item(i, lp) for i, lp in top[:self.top]]
        return entry

    def _chat_item(self, token_id: int, logprob: float) -> dict:
        text, raw = self._token(token_id)
        return {"token": text, "logprob": _value(logprob),
                "bytes": list(raw) if raw is not None else None}
