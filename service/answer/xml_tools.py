"""Tool calls in Qwen3.5's format (Qwen3-Coder's XML form): the model writes each call as

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

a value as plain text (a string) or as JSON (numbers, booleans, objects, arrays), read by the type its
parameter's schema gives. Here, as tools.py does for Qwen3-VL's JSON form: the grammar that forces such
calls, and the parser that finds them in generated text, streamed or whole — its calls' arguments
given as a JSON object, as every API answers them.
"""

from __future__ import annotations

import json
import re

from .structured import json_rule
from .tools import CLOSE, OPEN, ToolCall, ToolCallDelta, ToolCallParser, _call_id, tags

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n?", re.S)
_END = "</function>"


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _types(function: dict) -> dict[str, set[str]]:
    """Each parameter's JSON types, as its schema names them (a union's every type; none: unknown)."""
    out = {}
    for name, schema in (function.get("parameters", {}).get("properties") or {}).items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        out[name] = set(kind) if isinstance(kind, list) else {kind} if kind else set()
    return out


def value_of(text: str, types: set[str]):
    """A parameter's value from its text: the string itself where the schema says string (or says
    nothing and the text is no JSON), else the JSON it spells."""
    if types == {"string"}:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


_CLOSE_PARAMETER = "\\n</parameter>\\n"  # as Lark writes it


def _parameter(rule: str, name: str, schema: dict) -> list[str]:
    """Lark rules for one parameter, `rule` its name: its tag, then its value — JSON where it is not a
    plain string (a JSON value ends by itself); a string's text within its minLength and maxLength and its
    closing tag as one lexeme, which ends at the first closing tag (as the parser reads it: the lexer
    would otherwise take the closing's newline into the text and meet its `<` too late)."""
    tag = _lark_string(f"<parameter={name}>\n")
    plain = isinstance(schema, dict) and schema.get("type") == "string" and not ({"enum", "const"} & schema.keys())
    if plain:
        least, most = int(schema.get("minLength", 0)), schema.get("maxLength")
        span = f"{{{least},{'' if most is None else int(most)}}}"
        closing = r"\n<\/parameter>\n"
        text = f"/(.|\\n){span}{closing}/ & ~/(.|\\n)*{closing}(.|\\n)+/"
        return [f"{rule}: {tag} {rule.upper()}_VALUE", f"{rule.upper()}_VALUE: {text}"]
    if isinstance(schema, dict) and isinstance(schema.get("const"), str):
        value = _lark_string(schema["const"])
    elif isinstance(schema, dict) and schema.get("type") == "string" and "enum" in schema:
        value = "(" + " | ".join(_lark_string(v) for v in schema["enum"]) + ")"
    else:
        value = json_rule(schema)
    return [f'{rule}: {tag} {value} "{_CLOSE_PARAMETER}"']


def call_rules(functions: list[dict], parallel: bool, tag_tokens: bool = False) -> str:
    """Lark rules defining `calls` (one call, or with `parallel` one or more) of any of `functions`,
    their required parameters in the schema's order, then any optional ones, each value valid."""
    opening, closing = tags(tag_tokens)
    names = [f"function_{i}" for i in range(len(functions))]
    rules = [
        f"calls: call{' (NL call)*' if parallel else ''}",
        f'call: {opening} "\\n" ({" | ".join(names)}) {closing}',
        'NL: "\\n"',
    ]
    for i, function in enumerate(functions):
        parameters = function.get("parameters", {})
        properties = parameters.get("properties") or {}
        required = [p for p in properties if p in (parameters.get("required") or [])]
        parts = []
        for j, name in enumerate(required + [p for p in properties if p not in required]):
            rules += _parameter(f"f{i}_p{j}", name, properties[name])
            parts.append(f"f{i}_p{j}" if name in required else f"f{i}_p{j}?")
        head = _lark_string(f"<function={function['name']}>\n")
        rules.append(f'function_{i}: {head} {" ".join(parts)} "</function>\\n"')
    return "\n".join(rules) + "\n"


class XMLToolCallParser(ToolCallParser):
    """ToolCallParser for the XML form: a call's name goes out once its `<function=…>` line is
    seen, its arguments as a JSON object, a parameter at a time as each one closes."""

    def __init__(self, max_calls: int | None = None, forced: bool = False, functions: list[dict] | None = None):
        super().__init__(max_calls, forced)
        self._types = {f["name"]: _types(f) for f in functions or []}
        self._arguments = ""  # the open call's arguments sent so far
        self._consumed = 0  # where in the block's text the next parameter starts

    def _send(self, out: list, text: str) -> None:
        out.append(ToolCallDelta(len(self.calls), self._head[0], None, text))
        self._arguments += text

    def _stream_arguments(self, out: list, final: bool = False) -> None:
        if self._head is None:
            head = None if self._full() else _FUNCTION.match(self._body)
            if head is None:
                return
            self._head, self._consumed, self._arguments = (_call_id(), head.group(1)), head.end(), ""
            out.append(ToolCallDelta(len(self.calls), self._head[0], head.group(1), ""))
        types = self._types.get(self._head[1], {})
        while (parameter := _PARAMETER.match(self._body, self._consumed)) is not None:
            name, text = parameter.groups()
            value = json.dumps(value_of(text, types.get(name, set())), ensure_ascii=False)
            self._send(out, ("{" if not self._arguments else ", ") + f"{json.dumps(name)}: {value}")
            self._consumed = parameter.end()
        if final:
            self._send(out, "}" if self._arguments else "{}")

    def _finish(self, out: list) -> None:
        """The open block is whole: its call, or its text as content if it names no function."""
        self._stream_arguments(out, final=self._head is not None or _FUNCTION.match(self._body) is not None)
        if self._head is None:
            out.append(OPEN + self._body + CLOSE)
            return
        self.calls.append(ToolCall(self._head[1], self._arguments, self._head[0]))


def parse_calls(text: str, functions: list[dict] | None = None) -> list[ToolCall]:
    """Every whole call in `text` (for tests and tools): what XMLToolCallParser finds."""
    parser = XMLToolCallParser(None, functions=functions)
    parser.feed(text)
    parser.flush()
    return parser.calls
