"""Tool calls in Qwen's format: the model writes each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the chat template tells it so and
renders earlier calls back the same way). Here: the grammar that forces such calls, and the parser
that finds them in generated text, streamed or whole."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from .structured import json_rule

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=_call_id)


def _call_schema(function: dict) -> dict:
    """{"name": <this function>, "arguments": <its parameters>}, with the parameters' own definitions
    at the root (where their `$ref`s point)."""
    parameters = dict(function.get("parameters") or {"type": "object"})
    definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **definitions,
    }


def call_rules(functions: list[dict], parallel: bool) -> str:
    """Lark rules defining `calls`: one call (or, `parallel`, one or more) of any of `functions`
    (OpenAI function objects: name, parameters), each argument object valid against its schema."""
    names = [f"function_{i}" for i in range(len(functions))]
    rules = [
        f"calls: call{' (NL call)*' if parallel else ''}",
        'NL: "\\n"',
        f'call: "{OPEN}\\n" ({" | ".join(names)}) "\\n{CLOSE}"',
        *(f"{name}: {json_rule(_call_schema(f))}" for name, f in zip(names, functions)),
    ]
    return "\n".join(rules) + "\n"


def parse_call(body: str) -> ToolCall | None:
    """The call in one <tool_call> block's text, or None if it is not {"name": str, "arguments": ...}."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        return ToolCall(call["name"], arguments)
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Splits streamed text into content and ToolCalls. Text that may be the start of a call tag is
    held back until it is known; a block that does not parse is content, as written."""

    def __init__(self):
        self._held = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        buf = self._held + text
        while True:
            if not self._in_call:
                start = buf.find(OPEN)
                if start < 0:
                    hold = max((k for k in range(1, len(OPEN)) if buf.endswith(OPEN[:k])), default=0)
                    # Whitespace before a call separates it, it is no content: held until text follows.
                    keep = len(buf[: len(buf) - hold].rstrip())
                    self._emit(out, buf[:keep])
                    self._held = buf[keep:]
                    return out
                self._emit(out, buf[:start].rstrip())
                buf, self._in_call = buf[start + len(OPEN) :], True
            else:
                end = buf.find(CLOSE)
                if end < 0:
                    self._held = buf
                    return out
                body, buf, self._in_call = buf[:end], buf[end + len(CLOSE) :], False
                call = parse_call(body)
                if call is None:
                    out.append(OPEN + body + CLOSE)
                else:
                    self.calls.append(call)
                    out.append(call)

    def flush(self) -> list[str | ToolCall]:
        """What is still held when the text ends: an unclosed block or a partial tag, as content."""
        held, self._held = self._held, ""
        text = (OPEN + held) if self._in_call else held
        self._in_call = False
        return [text] if text.strip() or (text and not self.calls) else []

    def _emit(self, out: list, text: str) -> None:
        if text and (text.strip() or not self.calls):  # whitespace between calls is no content
            out.append(text)
