"""The OpenAI API's request and response shapes (/v1/completions, /v1/chat/completions),
independent of the HTTP layer: parse and validate a JSON body into token-id prompts and
`SamplingParams`, and build response / stream-chunk objects.

Every bad input raises `APIError(status, message, param, code)`; `error_body` is the OpenAI
error object `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from .logprobs import LogprobsFormat
from .sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from .structured import GrammarError, grammar_of

MAX_N = 16
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 512  # chat: at most this, or what is left of the context
# OpenAI fields this server does not implement: refused when set to anything but an "off"
# value (SDKs send those), never silently ignored. Field -> its own off values beyond
# null / false / 0 / empty.
UNSUPPORTED = {name: () for name in ("suffix", "logit_bias", "functions", "function_call")}
UNSUPPORTED.update(best_of=(1,))
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's fields
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer system


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = \
            status, message, param, code, kind


def error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


@dataclass
class Parsed:
    """A validated request: `prompts` (token ids) x `n` choices, sampling, streaming."""

    chat: bool
    model: str
    prompts: list[list[int]]
    n: int
    params: list[SamplingParams]  # one per choice, in choice order (prompt-major)
    stream: bool
    include_usage: bool
    logprobs: LogprobsFormat | None = None  # None: the request asked for no logprobs
    reasoning_parser: str | None = None  # chat: --reasoning-parser (inference/reasoning.py)
    tool_parser: str | None = None  # chat with tools (inference/tool_calls.py): its format
    echo: list[str] | None = None  # /v1/completions `echo`: each prompt's text, put first
    # vLLM's `prompt_logprobs`: alternatives per prompt token shown (None: not asked)
    prompt_logprobs: int | None = None
    token_bytes: object = None  # the tokenizer's `token_bytes(id)` (prompt_logprobs)

    @property
    def echo_logprobs(self) -> bool:
        """`echo` with `logprobs`: the prompt's tokens lead each choice's logprobs."""
        return self.echo is not None and self.logprobs is not None


def _field(body: dict, name: str, kinds, default):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in
                                    (kinds if isinstance(kinds, tuple) else (kinds,))):
        raise APIError(400, f"'{name}' has the wrong type ({type(v).__name__})", name)
    return v


def max_prompt_chars(tokenizer, max_seq_length: int) -> int | None:
    """Characters a text prompt may have before it is tokenized: a token covers at most
    `tokenizer.max_token_chars` characters, so a longer text cannot fit `max_seq_length`
    tokens and is refused without the work of tokenizing it (None: no tokenizer)."""
    return None if tokenizer is None else max_seq_length * tokenizer.max_token_chars


def _check_text(text: str, limit: int | None, param: str) -> None:
    """Refuse text that cannot be UTF-8 (a lone surrogate from a JSON escape) or that is
    longer than any prompt that fits the context (`max_prompt_chars`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"'{param}' holds a character that is not valid Unicode text "
                            f"({e.reason} at position {e.start}); send UTF-8 text", param) \
            from None
    if limit is not None and len(text) > limit:
        raise APIError(400, f"'{param}' has {len(text)} characters, more than any prompt that "
                            f"fits the context ({limit} characters at most); shorten it",
                       param, "context_length_exceeded")


def parse(raw: bytes, *, chat: bool, tokenizer, model_names: list[str], check,
          max_seq_length: int, seed_source, max_choices: int = 256,
          max_prompt_chars: int | None = None, defaults: dict | None = None,
          tool_parser: str | None = None, auto_tools: bool = False) -> Parsed:
    """Validate a request body. `check(prompt, params)` is the engine's own check (raises
    ValueError / SamplingError); `seed_source()` gives a seed when the request has none.
    `max_choices` bounds prompts x n; `max_prompt_chars` a text prompt's characters (both
    checked before tokenizing). `defaults` (`sampling_defaults`) replace OpenAI's defaults of
    temperature, top_p, top_k and max_tokens when the request leaves them out.
    `tool_parser` / `auto_tools`: the server's --tool-call-parser and
    --enable-auto-tool-choice (inference/tool_calls.py)."""
    body, model = _body(raw, model_names)
    tools, forced, parser = _tools(body, chat, tool_parser, auto_tools)
    n = _field(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"'n' must be in [1, {MAX_N}], got {n}", "n")
    if tokenizer is None:
        raise APIError(400, "this server has no tokenizer; it cannot read text prompts")
    prompts = _chat_prompt(body, tokenizer, n, max_choices, max_prompt_chars, tools) if chat else \
        _completion_prompts(body, tokenizer, n, max_choices, max_prompt_chars)
    if any(not p for p in prompts):
        raise APIError(400, "the prompt is empty; send at least one token",
                       "messages" if chat else "prompt")
    stream = _field(body, "stream", bool, False)
    shown = _prompt_logprobs(body, stream)
    echo = _echo(body, chat, prompts, tokenizer)
    params, top = _sampling(body, chat, prompts, n, check, max_seq_length, seed_source,
                            defaults or {}, forced, shown, echo is not None)
    stream_options = body.get("stream_options") or {}
    return Parsed(chat, model, prompts, n, params, stream,
                  bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
                  None if top is None else LogprobsFormat(top, chat, tokenizer.token_bytes),
                  tool_parser=parser, echo=echo, prompt_logprobs=shown,
                  token_bytes=tokenizer.token_bytes)


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs` (0..MAX_LOGPROBS alternatives per prompt token; None: not
    asked). Not with `stream` (vLLM refuses it there too)."""
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or \
            not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"'prompt_logprobs' must be an integer in [0, {MAX_LOGPROBS}] (-1, "
                            f"the whole vocabulary, is above this server's limit), got "
                            f"{value!r}", "prompt_logprobs")
    if stream:
        raise APIError(400, "'prompt_logprobs' is not available with 'stream': true; send the "
                            "request without streaming", "prompt_logprobs")
    return value


def _echo(body: dict, chat: bool, prompts: list[list[int]], tokenizer):
    """/v1/completions `echo`: the prompts' texts (decoded from their ids, as vLLM echoes a
    token-id prompt) put before each answer; None when not asked. With `logprobs` the
    prompt's tokens lead each choice's logprobs (the first one's value null, OpenAI's
    form)."""
    if not _field(body, "echo", bool, False):
        return None
    if chat:
        raise APIError(400, "'echo' is a /v1/completions field", "echo")
    texts = body["prompt"] if isinstance(body["prompt"], list) and all(
        isinstance(p, str) for p in body["prompt"]) else [body["prompt"]] \
        if isinstance(body["prompt"], str) else None
    return texts if texts is not None else [tokenizer.decode(p) for p in prompts]


def _tools(body: dict, chat: bool, parser: str | None, auto: bool):
    """(tools for the template, the forced call's grammar or None, the parser reading the
    answer's calls or None) of a request."""
    from .tool_calls import ToolError, check_tools, forced_grammar

    if body.get("tools") in (None, []):
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
        return None, None, None
    if not chat:
        raise APIError(400, "'tools' is a /v1/chat/completions field", "tools")
    try:
        tools, choice = check_tools(body["tools"], body.get("tool_choice"), parser, auto)
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    if choice == "none":
        return tools, None, None
    forced = forced_grammar(tools, choice, parser)
    if forced is not None:
        try:
            forced = grammar_of("grammar", forced)
        except GrammarError as e:
            raise APIError(400, f"a function's 'parameters' schema cannot be used: {e}",
                           "tools") from None
    return tools, forced, parser


def _body(raw: bytes, model_names: list[str]) -> tuple[dict, str]:
    """The JSON object of the request and its model name; unsupported fields refused."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON too deeply to read") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":
        raise APIError(400, "'model' is required", "model")
    if not isinstance(model, str):
        raise APIError(400, f"'model' must be a string, got {model!r}", "model")
    if model not in model_names:
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                            f"{model_names}", "model", "model_not_found")
    for name, off in UNSUPPORTED.items():
        if body.get(name) not in (None, False, 0, "", [], {}, *off):
            raise APIError(400, f"'{name}' is not supported by this server; leave it out",
                           name)
    return body, model


def _chat_prompt(body: dict, tokenizer, n: int, max_choices: int,
                 max_prompt_chars: int | None, tools: list | None = None) -> list[list[int]]:
    """The token ids of /v1/chat/completions' messages in the chat template (`tools` shown
    to it)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and (
                isinstance(m.get("content"), str) or
                (m.get("content") is None and m.get("tool_calls"))) for m in messages):
        raise APIError(400, "'messages' must be a non-empty list of {role, content} "
                            "objects with string content (null only beside an assistant's "
                            "tool_calls)", "messages")
    roles = {m["role"] for m in messages} - set(ROLES)
    if roles:
        raise APIError(400, f"unsupported message role(s) {sorted(roles)}; use one of "
                            f"{list(ROLES)}", "messages")
    if n > max_choices:
        raise APIError(400, f"n ({n}) is more than this server's "
                            f"--max-request-choices ({max_choices})", "n")
    _check_text("".join(m.get("content") or "" for m in messages), max_prompt_chars, "messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or "messages" in kwargs:
        raise APIError(400, "'chat_template_kwargs' must be an object of the template's "
                            "variables (e.g. {\"enable_thinking\": false}), without "
                            "'messages'", "chat_template_kwargs")
    try:
        return [tokenizer.apply_chat_template([_template_message(m) for m in messages],
                                              tools=tools, **kwargs)]
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 - a template may reject roles in its own way
        raise APIError(400, f"the chat template rejected the messages: {e}",
                       "messages") from None


def _template_message(m: dict) -> dict:
    """A message as chat templates read it: developer as system; an assistant's tool calls
    with their `arguments` as objects (transformers' form; OpenAI sends JSON text); a tool
    result with its `tool_call_id` and `name`."""
    out = {"role": "system" if m["role"] == "developer" else m["role"],
           "content": m.get("content")}
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            raise APIError(400, "'tool_calls' of a message must be a list of {id, type, "
                                "function: {name, arguments}}", "messages")
        out["tool_calls"] = []
        for c in calls:
            f = dict(c["function"])
            if isinstance(f.get("arguments"), str):
                try:
                    f["arguments"] = json.loads(f["arguments"])
                except ValueError:
                    raise APIError(400, "a tool call's 'arguments' must be JSON text",
                                   "messages") from None
            out["tool_calls"].append({**c, "function": f})
    return out


def _completion_prompts(body: dict, tokenizer, n: int, max_choices: int,
                        max_prompt_chars: int | None) -> list[list[int]]:
    """The token ids of /v1/completions' prompt(s): text, texts, ids or lists of ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        items = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
        items = prompt
    else:
        raise APIError(400, "'prompt' must be a string, a list of strings, or token ids",
                       "prompt")
    if len(items) * n > max_choices:
        raise APIError(400, f"{len(items)} prompts x n {n} = {len(items) * n} choices, "
                            f"more than this server's --max-request-choices "
                            f"({max_choices}); split the request", "prompt")
    for p in items:
        if isinstance(p, str):
            _check_text(p, max_prompt_chars, "prompt")
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]


def _sampling(body: dict, chat: bool, prompts: list[list[int]], n: int, check,
              max_seq_length: int, seed_source, d: dict, forced: str | None = None,
              shown: int | None = None, echo: bool = False) -> tuple[list, int | None]:
    """`SamplingParams` of every choice (prompt-major), each checked by the engine, and the
    logprobs alternatives asked for (None: no logprobs). The engine scores the prompt with
    `shown` alternatives (`prompt_logprobs`), or with `logprobs`' under `echo`."""
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    longest = max(len(p) for p in prompts)
    default_tokens = DEFAULT_COMPLETION_TOKENS if not chat else \
        max(1, min(DEFAULT_CHAT_TOKENS, max_seq_length - longest))
    if "max_tokens" in d:  # the model's max_new_tokens, within what the context leaves
        default_tokens = max(1, min(d["max_tokens"], max_seq_length - longest))
    # OpenAI's newer name wins; a null one (SDKs send it) is as if absent
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens")
                       if body.get(k) is not None), default_tokens)
    seed = body.get("seed")
    ignore_eos = _field(body, "ignore_eos", bool, False)  # vLLM's extra parameter
    top = _logprobs(body, chat)
    if echo and top is not None:
        shown = max(shown or 0, top)
    grammar = structured_grammar(body)
    if forced is not None:  # a forced tool call's grammar
        if grammar is not None:
            raise APIError(400, "a forced tool call ('tool_choice') cannot be combined with "
                                "'response_format' or 'structured_outputs'", "tool_choice")
        grammar = forced
    params = []
    for prompt in prompts:
        for j in range(n):
            sp = SamplingParams(
                max_new_tokens=max_tokens, temperature=_or(body, "temperature", d, 1.0),
                top_k=_or(body, "top_k", d, 0) or 0, top_p=_or(body, "top_p", d, 1.0),
                seed=(seed + j if isinstance(seed, int) and not isinstance(seed, bool)
                      else seed if seed is not None else seed_source()),
                stop=stop, ignore_eos=ignore_eos, logprobs=top, grammar=grammar,
                prompt_logprobs=shown)
            try:
                check(prompt, sp)
            except GrammarError as e:
                raise APIError(400, str(e), "response_format") from None
            except SamplingError as e:
                raise APIError(400, str(e), e.param) from None
            except ValueError as e:
                raise APIError(400, str(e), "max_tokens" if "max_tokens" in str(e) else
                               "messages" if chat else "prompt",
                               "context_length_exceeded" if "context" in str(e) else None) \
                    from None
            params.append(sp)
    return params, top


def structured_grammar(body: dict) -> str | None:
    """The llguidance grammar a request holds its output to (inference/structured.py), from
    OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`) or vLLM's `structured_outputs` (one of
    `json`, `regex`, `choice`, `grammar` (Lark), `json_object`); None: free text. A schema
    or grammar llguidance refuses, or a missing llguidance, is a 400 with the reason."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "'response_format' must be an object such as {\"type\": "
                            "\"json_object\"}", "response_format")
    kind = (fmt or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"'response_format.type' must be 'text', 'json_object' or "
                            f"'json_schema', got {kind!r}", "response_format")
    param, value = "response_format", None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise APIError(400, "'response_format.json_schema' must be an object with a "
                                "'schema' (a JSON schema object)", param)
        kind, value = "json", spec["schema"]
    if so is not None:
        if kind != "text":
            raise APIError(400, "send either 'response_format' or 'structured_outputs', not "
                                "both", "structured_outputs")
        given = [k for k in STRUCTURED_KEYS if isinstance(so, dict) and
                 so.get(k) not in (None, False)]
        if len(given) != 1:
            raise APIError(400, f"'structured_outputs' must set exactly one of "
                                f"{list(STRUCTURED_KEYS)}, got {given or so!r}",
                           "structured_outputs")
        param, kind, value = "structured_outputs", given[0], so[given[0]]
    if kind == "text":
        return None
    try:
        return grammar_of(kind, value)
    except GrammarError as e:
        raise APIError(400, f"invalid {param}: {e}", param) from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token the request asks for (None: no logprobs). Chat: `logprobs`
    true/false and `top_logprobs` 0..MAX_LOGPROBS (needs logprobs true); completions:
    `logprobs` 0..MAX_LOGPROBS (OpenAI allows 5, vLLM its --max-logprobs, default 20)."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"'logprobs' is true or false on /v1/chat/completions, got "
                                f"{value!r}; ask for alternatives with 'top_logprobs'",
                           "logprobs")
        if top is not None and value is not True:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if not value:
            return None
        name, value = "top_logprobs", 0 if top is None else top
    else:
        if top is not None:
            raise APIError(400, "'top_logprobs' is a /v1/chat/completions field; on "
                                "/v1/completions send 'logprobs': N (the alternatives per "
                                "token)", "top_logprobs")
        if value is None or value is False:
            return None
        name = "logprobs"
    if isinstance(value, bool) or not isinstance(value, int) or \
            not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"'{name}' must be an integer in [0, {MAX_LOGPROBS}], got "
                            f"{value!r}", name)
    return value


def _or(body: dict, name: str, defaults: dict, fallback):
    """The request's `name`, else the model's default, else OpenAI's."""
    v = body.get(name)
    return defaults.get(name, fallback) if v is None else v


def sampling_defaults(generation_config: dict) -> dict:
    """Request defaults from a model's generation config, as vLLM's `--generation-config
    auto` takes them: temperature, top_p, top_k, and max_new_tokens as max_tokens (do_sample
    is not read, as in vLLM). Fields this server cannot apply (min_p, repetition_penalty) are
    left out; `infer.py` names them."""
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "max_new_tokens": "max_tokens"}
    return {ours: generation_config[hf] for hf, ours in names.items()
            if generation_config.get(hf) is not None}


def tokenize(raw: bytes, *, tokenizer, model_names: list[str], max_seq_length: int,
             max_prompt_chars: int | None = None) -> dict:
    """POST /tokenize (vLLM's): `{"prompt": text}` or `{"messages": [...], "tools"?}` (the
    chat template's ids, `add_generation_prompt` true) -> `{"count", "max_model_len", "tokens",
    "token_strs"}`; the ids are those /v1/completions or /v1/chat/completions feed the model
    (`add_special_tokens` defaults to false here, as those endpoints add none; true adds
    the tokenizer's own, BOS for Llama-style ones). `return_token_strs`: each id's
    `logprobs.token_text`. The model name is optional (vLLM's)."""
    body = _tool_body(raw, model_names)
    if tokenizer is None:
        raise APIError(400, "this server has no tokenizer")
    special = _field(body, "add_special_tokens", bool, False)
    if "messages" in body:
        if body.get("add_generation_prompt") is False:
            raise APIError(400, "'add_generation_prompt': false is not supported; the chat "
                                "ids end with the assistant's prompt", "add_generation_prompt")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and
                                      all(isinstance(t, dict) for t in tools)):
            raise APIError(400, "'tools' must be a list of tool objects", "tools")
        ids = _chat_prompt(body, tokenizer, 1, 1, max_prompt_chars, tools or None)[0]
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string (or send 'messages')", "prompt")
        _check_text(prompt, max_prompt_chars, "prompt")
        ids = tokenizer._hf(prompt, add_special_tokens=True)["input_ids"] \
            if special and getattr(tokenizer, "_hf", None) is not None else \
            tokenizer.encode(prompt)
    strs = None
    if _field(body, "return_token_strs", bool, False):
        from .logprobs import token_text

        strs = [token_text(tokenizer.token_bytes(i), i) for i in ids]
    return {"count": len(ids), "max_model_len": max_seq_length, "tokens": list(ids),
            "token_strs": strs}


def detokenize(raw: bytes, *, tokenizer, model_names: list[str], vocab_size: int) -> dict:
    """POST /detokenize (vLLM's): `{"tokens": [ids]}` -> `{"prompt": text}` (special tokens
    dropped, as in generated text)."""
    body = _tool_body(raw, model_names)
    if tokenizer is None:
        raise APIError(400, "this server has no tokenizer")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError(400, "'tokens' must be a list of token ids", "tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is not in [0, {vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(ids)}


def _json_object(raw: bytes) -> dict:
    """The request body as a JSON object (400 when it is not one)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def lora_request(raw: bytes, load: bool) -> dict:
    """The body of POST /v1/load_lora_adapter `{lora_name, lora_path}` (`load`) or
    /v1/unload_lora_adapter `{lora_name}` (vLLM's fields), each a non-empty string."""
    body = _json_object(raw)
    for field in ("lora_name", "lora_path") if load else ("lora_name",):
        if not isinstance(body.get(field), str) or not body[field]:
            raise APIError(400, f"'{field}' must be a non-empty string", field)
    return body


def _tool_body(raw: bytes, model_names: list[str]) -> dict:
    """The JSON object of a /tokenize or /detokenize request (its model, if named, served)."""
    body = _json_object(raw)
    if body.get("model") not in (None, "", *model_names):
        raise APIError(404, f"the model {body['model']!r} does not exist; this server serves "
                            f"{model_names}", "model", "model_not_found")
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _logprobs_of(parsed: Parsed, index: int, entries: list | None) -> dict | None:
    return None if parsed.logprobs is None else parsed.logprobs.format(index, entries or [])


def response(rid: str, parsed: Parsed, texts: list[str], reasons: list[str],
             usage_: dict, logprobs: list[list] | None = None,
             prompt_logprobs: list[list | None] | None = None) -> dict:
    """The non-streaming response object; `logprobs[i]`: choice i's `Event.logprobs`, all
    its tokens (when the request asked); `prompt_logprobs[i]`: its `Event.prompt_logprobs`
    (when the engine scored its prompt)."""
    prompt_lps = prompt_logprobs or [None] * len(texts)
    if parsed.echo_logprobs:
        logprobs = [echoed(parsed, i, prompt_lps[i]) + (logprobs[i] if logprobs else [])
                    for i in range(len(texts))]
    lps = [_logprobs_of(parsed, i, logprobs[i] if logprobs else None)
           for i in range(len(texts))]
    if parsed.chat:
        choices = []
        for i, (t, r) in enumerate(zip(texts, reasons)):
            message = _message(parsed, t)
            choices.append({"index": i, "message": message, "logprobs": lps[i],
                            "finish_reason": "tool_calls" if message.get("tool_calls") and
                            r == "stop" else r})
        obj = "chat.completion"
    else:
        echo = parsed.echo or [""] * len(parsed.prompts)
        choices = [{"index": i, "text": echo[i // parsed.n] + t, "logprobs": lps[i],
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
        if parsed.prompt_logprobs is not None:  # vLLM's field, per choice
            for i, c in enumerate(choices):
                c["prompt_logprobs"] = _prompt_object(parsed, prompt_lps[i])
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": parsed.model,
           "choices": choices, "usage": usage_}
    if parsed.chat and parsed.prompt_logprobs is not None:  # vLLM's field: the one prompt's
        out["prompt_logprobs"] = _prompt_object(parsed, prompt_lps[0])
    return out


def echoed(parsed: Parsed, index: int, entries: list | None) -> list:
    """Choice `index`'s `Event.prompt_logprobs` as the leading `logprobs` entries under
    `echo` (`(id, logprob, [(id, logprob)])`, the first token's logprob None)."""
    prompt = parsed.prompts[index // parsed.n]
    return [(t, None, None) if e is None else (t, e[1], e[3])
            for t, e in zip(prompt, entries or [None] * len(prompt))]


def _prompt_object(parsed: Parsed, entries: list | None) -> list | None:
    from .logprobs import prompt_logprobs_object

    return None if entries is None else prompt_logprobs_object(
        entries, parsed.prompt_logprobs, parsed.token_bytes)


def _message(parsed: Parsed, text: str) -> dict:
    """The assistant message of a whole chat answer (thinking apart with a reasoning
    parser)."""
    out = {"role": "assistant", "content": text}
    if parsed.reasoning_parser is not None:
        from .reasoning import ReasoningSplitter

        reasoning, out["content"] = ReasoningSplitter(parsed.reasoning_parser).split(text)
        out["reasoning_content"] = reasoning
    if parsed.tool_parser is not None:
        from .tool_calls import parse as parse_calls

        content, calls = parse_calls(out["content"] or "", parsed.tool_parser)
        if calls:
            out["content"], out["tool_calls"] = content, calls
    return out


def chunk(rid: str, parsed: Parsed, index: int, text: str | None, reason: str | None,
          first: bool = False, logprobs: list | None = None,
          reasoning: str | None = None, tool_calls: list | None = None) -> dict:
    """One streamed chunk for choice `index` (text delta, reasoning delta (chat with a
    reasoning parser) and/or finish reason; `logprobs`: the `Event.logprobs` of the tokens
    it carries, when the request asked)."""
    lp = _logprobs_of(parsed, index, logprobs) if logprobs else None
    if parsed.chat:
        delta = {"role": "assistant", "content": ""} if first else \
            ({"content": text} if text else {})
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": parsed.model,
           "choices": [choice]}
    if parsed.include_usage:  # OpenAI: every chunk has usage, null but in the last one
        out["usage"] = None
    return out
