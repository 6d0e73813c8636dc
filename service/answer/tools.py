"""Tool calls in Qwen's format: the model writes each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the chat template tells it so and
renders earlier calls back the same way). Here: the grammar that forces such calls, and the parser
that finds them in generated text, streamed or whole."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from .stops import partial_suffix
from .structured import json_rule

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The head of a call as Qwen writes it: once it is seen, the arguments can stream as they come.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=_call_id)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the `index`-th call: its first piece names it (`name`, `id`), later ones carry
    only more argument text."""

    index: int
    id: str
    name: str | None
    arguments: str


def _call_schema(function: dict) -> dict:
    """{"name": <this function>, "arguments": <its parameters>}, with the parameters' own definitions
    at the root (where their `$ref`s point)."""
    parameters = dict(function["parameters"])
    definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **definitions,
    }


def tags(tag_tokens: bool) -> tuple[str, str]:
    """The call tags as Lark writes them: the tokens `<tool_call>` and `</tool_call>` where the tokenizer
    has them as tokens of their own (the releases' do: llguidance matches such a token only by name), else
    their text."""
    return (f"{OPEN}", f"{CLOSE}") if tag_tokens else (f'"{OPEN}"', f'"{CLOSE}"')


def call_rules(functions: list[dict], parallel: bool, tag_tokens: bool = False) -> str:
    """Lark rules defining `calls`: one call (or, `parallel`, one or more) of any of `functions`
    (OpenAI function objects: name, parameters), each argument object valid against its schema."""
    names = [f"function_{i}" for i in range(len(functions))]
    opening, closing = tags(tag_tokens)
    rules = [
        f"calls: call{' (NL call)*' if parallel else ''}",
        'NL: "\\n"',
        f'call: {opening} "\\n" ({" | ".join(names)}) "\\n" {closing}',
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
    """Splits streamed text into content (str) and tool calls (ToolCallDelta pieces; `calls` gets
    each call once it closes). Text that may begin a call tag is held back until it is known. A
    call's arguments stream as they come once its head (`{"name": ..., "arguments": `) is seen,
    less a tail that may be the call's own closing brace; a block that never shows that head is
    parsed when it closes, and is content, as written, if it does not parse. Beyond `max_calls`,
    blocks are content too. `forced`: the grammar made the answer calls only, so what is held when
    the text ends is a call cut before its name (by the token limit): dropped, never content."""

    def __init__(self, max_calls: int | None = None, forced: bool = False):
        self.max_calls = max_calls
        self.forced = forced
        self._held = ""  # outside a call: a possible start of a tag, or whitespace before one
        self._in_call = False
        self._body = ""  # the open block's text after its tag
        self._head: tuple[str, str] | None = None  # (id, name) once the head is seen
        self._args_at = 0  # where the arguments start in _body
        self._sent = 0  # how much of the arguments went out
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        while text:
            text = self._feed_call(text, out) if self._in_call else self._feed_content(text, out)
        return out

    def flush(self) -> list[str | ToolCallDelta]:
        """What is still held when the text ends: an unclosed call (its arguments' tail), an unclosed
        block without a head or a partial tag (content)."""
        out: list[str | ToolCallDelta] = []
        if self._in_call and self._head is not None:
            self._finish(out)
        elif not self.forced:
            text = (OPEN + self._body) if self._in_call else self._held
            if text.strip() or (text and not self.calls):
                out.append(text)
        self._held, self._body, self._in_call = "", "", False
        return out

    def _feed_content(self, text: str, out: list) -> str:
        """Content up to the next call tag; returns the text after the tag ("" if none)."""
        buf = self._held + text
        start = buf.find(OPEN)
        if start < 0:
            hold = partial_suffix(buf, OPEN)
            # Whitespace before a call separates it, it is no content: held until text follows.
            keep = len(buf[: len(buf) - hold].rstrip())
            self._emit(out, buf[:keep])
            self._held = buf[keep:]
            return ""
        self._emit(out, buf[:start].rstrip())
        self._held, self._in_call, self._body, self._head, self._sent = "", True, "", None, 0
        return buf[start + len(OPEN) :]

    def _feed_call(self, text: str, out: list) -> str:
        """Text of the open block; returns what follows its closing tag ("" if it is still open)."""
        self._body += text
        end = self._body.find(CLOSE)
        if end < 0:
            self._stream_arguments(out)
            return ""
        self._body, rest = self._body[:end], self._body[end + len(CLOSE) :]
        self._finish(out)
        self._in_call = False
        return rest

    def _stream_arguments(self, out: list, final: bool = False) -> None:
        if self._head is None:
            if self._full():
                return
            head = _HEAD.match(self._body)
            if head is None:
                return
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                name = head.group(1)
            self._head, self._args_at = (_call_id(), name), head.end()
            out.append(ToolCallDelta(len(self.calls), self._head[0], name, ""))
        if self._sent == 0:  # the arguments start at their first non-blank character
            rest = self._body[self._args_at :]
            self._args_at += len(rest) - len(rest.lstrip())
        arguments = self._body[self._args_at :]
        if final:  # the arguments' exact extent, if they are JSON; else all but the call's brace
            try:
                upto = json.JSONDecoder().raw_decode(arguments)[1]
            except ValueError:
                upto = len(arguments.rstrip()) - arguments.rstrip().endswith("}")
        else:  # hold back a partial closing tag, then a brace that may close the call
            shown = arguments[: len(arguments) - partial_suffix(arguments, CLOSE)].rstrip()
            upto = len(shown) - shown.endswith("}")
        if upto > self._sent:
            out.append(ToolCallDelta(len(self.calls), self._head[0], None, arguments[self._sent : upto]))
            self._sent = upto

    def _finish(self, out: list) -> None:
        """The open block is whole: its call, or its text as content."""
        self._stream_arguments(out, final=True)
        if self._head is None:  # not in Qwen's layout (keys in another order, say): parsed whole
            call = None if self._full() else parse_call(self._body)
            if call is None:
                out.append(OPEN + self._body + CLOSE)
                return
            out.append(ToolCallDelta(len(self.calls), call.id, call.name, call.arguments))
            self.calls.append(call)
            return
        call_id, name = self._head
        self.calls.append(ToolCall(name, self._body[self._args_at :][: self._sent], call_id))

    def _full(self) -> bool:
        return self.max_calls is not None and len(self.calls) >= self.max_calls

    def _emit(self, out: list, text: str) -> None:
        if text and (text.strip() or not self.calls):  # whitespace between calls is no content
            out.append(text)
