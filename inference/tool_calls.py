"""Tool calling (`tools`, `tool_choice`; `--enable-auto-tool-choice --tool-call-parser NAME`,
vLLM's flags and parser names): the model writes calls in its chat template's own format,
and they come back as OpenAI `tool_calls`.

Formats (`PARSERS`):
- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`, one block per call, text around them is content.
- `llama3_json` (Llama 3.1 / 3.2): the answer is a JSON object `{"name": ...,
  "parameters": {...}}` (several separated by `;`), optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`.

`tool_choice`: "none" (tools only shown to the template), "auto" (needs
--enable-auto-tool-choice; the parser reads whatever the model wrote), "required" or a named
function: the answer is held by structured decoding (inference/structured.py) to the
parser's format with arguments valid for the function's `parameters` schema, so the call is
valid whatever the model. A streamed answer sends text before a call as content deltas and
each call as one `tool_calls` delta when its text is complete.
"""
from __future__ import annotations

import json
import re
import uuid

from .structured import JSON_LAYOUT

PARSERS = ("hermes", "llama3_json", "mistral")


class ToolError(ValueError):
    """A bad `tools` / `tool_choice`: one line naming it (`param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tools(tools, tool_choice, parser: str | None, auto: bool) -> tuple[list, object]:
    """(tools, tool_choice) checked: `tools` a list of `{"type": "function", "function":
    {"name", "parameters"?}}`; `tool_choice` "none" / "auto" / "required" / `{"type":
    "function", "function": {"name"}}` (default "auto" with tools, as OpenAI). Raises
    `ToolError` for a malformed one, "auto" without --enable-auto-tool-choice, or a forced
    call without --tool-call-parser."""
    if not isinstance(tools, list) or not tools or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and
            isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            and isinstance(t["function"].get("parameters", {}), dict) for t in tools):
        raise ToolError("'tools' must be a non-empty list of {\"type\": \"function\", "
                        "\"function\": {\"name\", \"parameters\"}}", "tools")
    names = [t["function"]["name"] for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or name not in names:
            raise ToolError(f"'tool_choice' names no function of 'tools' ({names})",
                            "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": "
                        "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if choice != "none" and parser is None:
        raise ToolError("this server has no --tool-call-parser; start it with one (hermes, "
                        "llama3_json, mistral) or send tool_choice 'none'", "tool_choice")
    if choice == "auto" and not auto:
        raise ToolError("'auto' tool choice needs the server's --enable-auto-tool-choice",
                        "tool_choice")
    return tools, choice


def forced_grammar(tools: list, choice, parser: str) -> str | None:
    """The Lark grammar (llguidance's, with `%json` schemas) of a forced call: "required"
    (any one tool) or a named function; None for "none" / "auto"."""
    if choice in ("none", "auto"):
        return None
    wanted = [t["function"] for t in tools
              if choice == "required" or t["function"]["name"] == choice["function"]["name"]]
    key = "parameters" if parser == "llama3_json" else "arguments"
    call = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        key: f.get("parameters") or {"type": "object"}},
        "required": ["name", key], "additionalProperties": False} for f in wanted],
        "x-guidance": JSON_LAYOUT}
    body = "%json " + json.dumps(call)
    if parser == "hermes":
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {body}'
    if parser == "mistral":
        return f'start: "[TOOL_CALLS][" call "]"\ncall: {body}'
    return f"start: call\ncall: {body}"


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": args}}


def parse(text: str, parser: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer; text that does not parse as calls stays
    content (vLLM's behaviour)."""
    calls, content = [], text
    try:
        if parser == "hermes":
            blocks = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)
            objs = [json.loads(b) for b in blocks]
            calls = [_call(o["name"], o.get("arguments", {})) for o in objs]
            content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S) \
                if calls else text
        elif parser == "llama3_json":
            body = text.strip().removeprefix("<|python_tag|>").strip()
            if body.startswith("{"):
                objs = [json.loads(p) for p in _split_json(body)]
                calls = [_call(o["name"], o.get("parameters", o.get("arguments", {})))
                         for o in objs]
                content = ""
        elif parser == "mistral" and "[TOOL_CALLS]" in text:
            head, _, body = text.partition("[TOOL_CALLS]")
            objs = json.loads(body.strip())
            calls = [_call(o["name"], o.get("arguments", {})) for o in objs]
            content = head
    except (ValueError, KeyError, TypeError, AttributeError):
        return text or None, []
    return (content.strip() or None) if calls else (text or None), calls


def _split_json(body: str) -> list[str]:
    """JSON objects of a `;`-separated list (Llama 3's several calls)."""
    out, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        obj, end = decoder.raw_decode(body, i)
        out.append(json.dumps(obj))
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return out


class ToolStream:
    """One streamed choice: text before a call's start goes out as content; from a call's
    start (`<tool_call>`, `[TOOL_CALLS]`, a leading `{` for llama3_json) the text is held
    and parsed when the answer ends. `add(text) -> content`, `finish() -> (content,
    calls)`."""

    MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}

    def __init__(self, parser: str):
        self.parser, self.held, self.holding = parser, "", False
        self.seen = ""  # all text so far (for llama3_json's start)

    def add(self, text: str) -> str:
        if self.holding:
            self.held += text
            return ""
        self.held += text
        if self.parser == "llama3_json":
            lead = self.held.lstrip()
            if not lead:
                return ""
            if lead.startswith("{") or lead.startswith("<|python_tag|>") or \
                    "<|python_tag|>".startswith(lead):
                self.holding = lead.startswith("{") or lead.startswith("<|python_tag|>")
                return ""
            out, self.held = self.held, ""
            self.parser = "none"  # plain text answer
            return out
        marker = self.MARKERS.get(self.parser)
        if marker is None:
            out, self.held = self.held, ""
            return out
        at = self.held.find(marker)
        if at >= 0:
            out, self.held, self.holding = self.held[:at], self.held[at:], True
            return out
        keep = next((k for k in range(min(len(marker) - 1, len(self.held)), 0, -1)
                     if self.held.endswith(marker[:k])), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.held = self.held, ""
        if not self.holding or self.parser == "none":
            return rest, []
        content, calls = parse(rest, self.parser)
        return content or "", calls
