"""Tool calls in Qwen3.5's XML form (service/answer/xml_tools.py): the parser reads a call as it streams,
a character at a time or whole, its arguments a JSON object typed by the tool's schema; the grammar
forces such calls and only such calls (llguidance, on tiny-qwen35's tokenizer, whose `<tool_call>` tags
are tokens of their own)."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from service.answer.tool_forms import ToolForm
from service.answer.tools import ToolCallDelta
from service.answer.xml_tools import XMLToolCallParser, value_of

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        },
        "required": ["city"],
    },
}
CALL = (
    "Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    '<parameter=days>\n3\n</parameter>\n<parameter=where>\n{"lat": 40.7}\n</parameter>\n</function>\n</tool_call>'
)


@pytest.mark.parametrize("step", [1, 7, len(CALL)])
def test_a_call_streamed_in_any_pieces_gives_its_name_then_json_arguments(step):
    parser = XMLToolCallParser(functions=[WEATHER])
    pieces = [p for i in range(0, len(CALL), step) for p in parser.feed(CALL[i : i + step])] + parser.flush()
    assert "".join(p for p in pieces if isinstance(p, str)) == "Let me look."
    deltas = [p for p in pieces if isinstance(p, ToolCallDelta)]
    assert deltas[0].name == "get_weather" and all(d.name is None for d in deltas[1:])
    (call,) = parser.calls
    arguments = json.loads(call.arguments)
    assert arguments == {"city": "New York", "days": 3, "where": {"lat": 40.7}}
    assert "".join(d.arguments for d in deltas) == call.arguments


def test_values_are_read_by_their_schema_type():
    assert value_of("42", {"string"}) == "42"  # a string that looks like a number stays a string
    assert value_of("42", {"integer"}) == 42
    assert value_of("true", set()) is True and value_of("plain words", set()) == "plain words"


def test_a_block_that_names_no_function_is_content():
    parser = XMLToolCallParser(functions=[WEATHER])
    text = "<tool_call>\nnot a call\n</tool_call>"
    assert "".join(p for p in parser.feed(text) + parser.flush() if isinstance(p, str)) == text
    assert parser.calls == []


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    from transformers import AutoTokenizer

    from conftest import built_preset

    hf = AutoTokenizer.from_pretrained(built_preset(cache_dir, "tiny-qwen35"))
    return hf, llguidance.hf.from_tokenizer(hf)


def test_the_grammar_takes_a_call_and_refuses_anything_else(tokenizer):
    hf, lltokenizer = tokenizer
    form = ToolForm(xml=True, tag_tokens=True)
    grammar = llguidance.LLMatcher.grammar_from_lark("start: calls\n" + form.call_rules([WEATHER], parallel=False))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        return matcher.consume_tokens(hf(text, add_special_tokens=False)["input_ids"]) and matcher.is_accepting()

    call = CALL[CALL.index("<tool_call>") :]
    assert accepts(call)
    assert not accepts(call.replace("get_weather", "get_time"))  # another function
    assert not accepts(call.replace("<parameter=days>\n3", "<parameter=days>\nthree"))  # not an integer
    assert not accepts(call.replace("<parameter=city>\nNew York\n</parameter>\n", ""))  # its required parameter
    assert not accepts(CALL)  # text before a forced call
