"""What a request may ask of one engine, as plain data: `RequestLimits.check` is the engine's
own admission check (`Engine.check` calls it), and the API server process, which holds no
engine (inference/core_client.py), runs the same check on a copy before a request crosses to
the engine processes, so a request the engine would refuse gets its 400 there."""
from __future__ import annotations

from dataclasses import dataclass

from .sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """An engine's limits (picklable). `vocab_size`: ids a prompt may hold are
    `[0, vocab_size)`; `max_seq_length`: prompt + max_tokens (encoder-decoder: max_tokens);
    `max_source_length`: an encoder-decoder prompt's tokens; `block_size`, `capacity`: the KV
    cache's blocks of positions and how many it holds (capacity 0: not checked);
    `grammar_unavailable`: why requests with a grammar are refused (None: they run)."""

    vocab_size: int
    max_seq_length: int
    max_source_length: int
    encoder_decoder: bool = False
    block_size: int = 16
    capacity: int = 0
    grammar_unavailable: str | None = None

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise `ValueError` (`SamplingError` for a sampling field, `GrammarError` for a
        grammar this engine cannot run) if the request cannot run."""
        params.validate()
        if params.grammar is not None and self.grammar_unavailable:
            from .structured import GrammarError

            raise GrammarError(self.grammar_unavailable)
        if not prompt:
            raise ValueError("the prompt is empty; send at least one token")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if self.encoder_decoder:
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs are not available for an encoder-decoder "
                                 "model (its prompt is the encoder's input); leave it out")
            if len(prompt) > self.max_source_length:
                raise ValueError(f"the prompt ({len(prompt)} tokens) is longer than the "
                                 f"encoder's {self.max_source_length} tokens; shorten it")
            if params.max_new_tokens > self.max_seq_length:
                raise ValueError(f"max_tokens ({params.max_new_tokens}) exceeds the decoder's "
                                 f"{self.max_seq_length} tokens; lower max_tokens")
            return
        if len(prompt) + params.max_new_tokens > self.max_seq_length:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_new_tokens}) "
                f"exceeds the context of {self.max_seq_length} tokens; shorten the prompt or "
                f"lower max_tokens")
        # the last id is sampled, never written: len + max - 1 positions
        need = -(-(len(prompt) + params.max_new_tokens - 1) // self.block_size)
        if self.capacity and need > self.capacity:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_new_tokens}) "
                f"needs {need} KV cache blocks of {self.block_size} tokens, more than the whole "
                f"cache holds ({self.capacity} blocks, {self.capacity * self.block_size} "
                f"tokens); shorten the prompt or lower max_tokens, or start the server with a "
                f"larger --kv-cache-memory (or a --max-model-len the cache holds)")
