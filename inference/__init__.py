"""Sharded generation: KV cache, sampling, the engine (iteration-level scheduling over the
tp x pp model of one replica), the lockstep controller across ranks and replicas, and the
OpenAI-compatible HTTP server. Never imports training/."""
