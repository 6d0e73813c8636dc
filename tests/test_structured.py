"""Structured output and logprobs in the engine, on the embedded random model: a grammar holds
whatever the weights, so every answer must parse and validate; a constrained request must not
change its batch neighbours; logprobs must be those of a direct forward."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from prometheus_client import REGISTRY
from test_batching import Stream

from service.answer.structured import OutputGrammar, json_grammar
from service.answer.tools import OPEN, ToolCallParser, call_rules
from service.engine.engine import Engine
from service.generation import Completion, GenerationRequest, SamplingParams
from service.model.prompts import ChatMessage, TextPart

from conftest import make_settings, prepared

RECEIPT = {
    "type": "object",
    "properties": {
        "shop": {"type": "string", "maxLength": 24},
        "paid": {"type": "boolean"},
        "currency": {"enum": ["EUR", "USD", "CHF"]},
        "total": {"type": "integer", "minimum": 0, "maximum": 10000},
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 12},
                    "price": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25},
                },
                "required": ["label", "price"],
                "additionalProperties": False,
            },
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{4,5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "note": {"type": ["string", "null"], "maxLength": 10},
    },
    "required": ["shop", "paid", "currency", "total", "items", "address", "note"],
    "additionalProperties": False,
}
YES_NO = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
SCHEMAS = {"receipt": RECEIPT, "yes/no": YES_NO}


def ask(text: str) -> list[ChatMessage]:
    return [ChatMessage("user", [TextPart(text)])]


def run(engine, grammar: OutputGrammar | None = None, text="Read the receipt.", **params) -> Completion:
    params.setdefault("max_tokens", 300)
    request = GenerationRequest(ask(text), SamplingParams(**params), grammar=grammar)
    *_, done = engine.generate(request)
    assert isinstance(done, Completion)
    return done


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_parses_and_validates_against_its_schema(engine, name, temperature):
    schema = SCHEMAS[name]
    for seed in range(4) if temperature else [0]:  # greedy: one answer, whatever the seed
        done = run(engine, json_grammar(schema, "response_format"), temperature=temperature, seed=seed)
        assert done.finish_reason == "stop", done.text
        jsonschema.validate(json.loads(done.text), schema)


def test_without_the_grammar_the_random_model_writes_no_json(engine):
    """The check above is not vacuous: unconstrained, these weights answer noise."""
    texts = [run(engine, None, temperature=1.0, seed=s, max_tokens=40).text for s in range(4)]
    assert not any(_parses(t) for t in texts)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_json_cut_short_by_max_tokens_or_a_stop_string_is_finish_length(engine):
    grammar = json_grammar(RECEIPT, "response_format")
    assert run(engine, grammar, max_tokens=6).finish_reason == "length"
    cut = run(engine, grammar, stop=['"shop": '])
    assert cut.finish_reason == "length" and cut.text == "{"
    free = run(engine, None, max_tokens=12, seed=1, temperature=0)
    stop = free.text[4:8]  # a piece of the unconstrained answer: a stop string it will meet
    stopped = run(engine, None, stop=[stop], max_tokens=12, seed=1, temperature=0)
    assert stopped.finish_reason in ("stop", "length")
    assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.index(stop)]


def test_compiled_grammars_are_reused_by_schema_and_each_request_starts_fresh(engine):
    def counts():
        return [REGISTRY.get_sample_value("qwen3vl_grammars_total", {"result": r}) or 0 for r in ("compiled", "hit")]

    grammar = json_grammar({**YES_NO, "title": f"cache probe {engine.loaded.quantization}"}, "response_format")
    compiled, hits = counts()
    first, second = run(engine, grammar, seed=1, temperature=1.0), run(engine, grammar, seed=2, temperature=1.0)
    assert counts() == [compiled + 1, hits + 1]
    for done in (first, second):
        jsonschema.validate(json.loads(done.text), YES_NO)


def test_a_schema_the_engine_cannot_enforce_is_a_bad_request(engine):
    from service.errors import BadRequest

    lookbehind = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}
    with pytest.raises(BadRequest) as err:
        run(engine, json_grammar(lookbehind, "response_format"))
    assert err.value.param == "response_format" and err.value.code == "invalid_schema"
    assert "look-around" in err.value.message


def test_forced_tool_calls_always_parse_into_calls_of_the_given_functions(engine):
    functions = [
        {"name": "get_weather", "parameters": YES_NO},
        {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "$defs": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
                "properties": {"ids": {"type": "array", "items": {"$ref": "#/$defs/id"}, "minItems": 1, "maxItems": 2}},
                "required": ["ids"],
                "additionalProperties": False,
            },
        },
    ]
    by_name = {f["name"]: f["parameters"] for f in functions}
    grammar = OutputGrammar("start: calls\n" + call_rules(functions, parallel=True), "tools")
    for seed in range(4):
        done = run(engine, grammar, temperature=1.0, seed=seed)
        assert done.finish_reason == "stop" and done.text.startswith(OPEN)
        parser = ToolCallParser()
        pieces = parser.feed(done.text) + parser.flush()
        assert parser.calls and all(not isinstance(p, str) for p in pieces), done.text
        for call in parser.calls:
            jsonschema.validate(json.loads(call.arguments), by_name[call.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constrained_request_leaves_its_batch_neighbours_bit_identical(engine, temperature):
    grammar = json_grammar(RECEIPT, "response_format")

    def requests():
        params = SamplingParams(max_tokens=60, temperature=temperature, seed=5)
        constrained = SamplingParams(max_tokens=300, temperature=temperature, seed=5)
        return (
            GenerationRequest(ask("Tell me about cats."), params),
            GenerationRequest(ask("Read the receipt."), constrained, grammar=grammar),
        )

    plain_alone, json_alone = (Stream(engine, r).start().join() for r in requests())  # one at a time
    plain, constrained = [Stream(engine, r).start() for r in requests()]
    plain.join(), constrained.join()
    a, b = plain.arrivals, constrained.arrivals
    assert a[0] < b[-1] and b[0] < a[-1]  # decoded in one batch
    assert plain.done.text == plain_alone.done.text and plain.token_ids()
    assert plain.token_ids() == plain_alone.token_ids()
    assert constrained.token_ids() == json_alone.token_ids()
    assert constrained.done.text == json_alone.done.text
    jsonschema.validate(json.loads(constrained.done.text), RECEIPT)


def direct_logits(engine, request, answer: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """One forward of the model over the request's prompt and its answer: (logits, prompt length)."""
    prompt = prepared(engine, request)
    full = torch.cat([prompt.input_ids, torch.tensor([answer])], dim=1)
    with torch.inference_mode():
        logits = engine.model(input_ids=full, mm_token_type_ids=torch.zeros_like(full)).logits[0].float()
    return logits, prompt.num_tokens


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_those_of_a_direct_forward_of_the_model(fp32_engine, cache_dir, temperature):
    # fp32 weights and KV cache: the same numbers as one forward over prompt and answer.
    engine = Engine(fp32_engine.loaded, make_settings(cache_dir, quantization="fp32", kv_dtype="float32"))
    request = GenerationRequest(
        ask("Describe a cat."), SamplingParams(max_tokens=12, temperature=temperature, seed=3, logprobs=3)
    )
    *_, done = engine.generate(request)
    ids = done.token_ids
    assert len(done.logprobs) == len([i for i in ids if i not in engine.loaded.eos_token_ids]) > 0
    logits, prompt_tokens = direct_logits(engine, request, ids)
    start = prompt_tokens - 1
    expected = (logits[start : start + len(done.logprobs)] / (temperature or 1.0)).log_softmax(-1)
    for record, row, token in zip(done.logprobs, expected, ids):
        assert record.token_id == token
        assert record.logprob == pytest.approx(float(row[token]), abs=1e-4)
        top_ids = [i for i, _ in record.top]
        assert top_ids == row.topk(3).indices.tolist()
        assert [lp for _, lp in record.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_logprobs_under_a_grammar_cover_only_the_tokens_it_allows(engine):
    done = run(engine, json_grammar(YES_NO, "response_format"), logprobs=5)
    first = done.logprobs[0]
    assert first.token_bytes == b"{" and first.logprob == pytest.approx(0.0, abs=1e-6)
    assert all(b.startswith(b"{") for b in first.top_bytes)
    assert [i for i, _ in first.top] == [first.token_id]  # the only token the grammar allows first


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_qwen_tool_calls_are_found_in_text_however_it_is_split(piece):
    """What a real Qwen3-VL writes in auto mode (the random model never does): text, then calls."""
    from service.answer.tools import ToolCallDelta

    text = (
        'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Z}rich", '
        '"days": [1, {"n": 2}]}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>'
        "\n<tool_call>\nnot a call\n</tool_call>"
    )
    parser = ToolCallParser()
    out = [o for i in range(0, len(text), piece) for o in parser.feed(text[i : i + piece])] + parser.flush()
    assert "".join(o for o in out if isinstance(o, str)) == "Let me look that up.<tool_call>\nnot a call\n</tool_call>"
    assert [(c.name, c.arguments) for c in parser.calls] == [
        ("get_weather", '{"city": "Z}rich", "days": [1, {"n": 2}]}'),
        ("get_time", "{}"),
    ]
    streamed: dict[int, str] = {}
    for delta in (o for o in out if isinstance(o, ToolCallDelta)):
        streamed[delta.index] = streamed.get(delta.index, "") + delta.arguments
    assert streamed == {0: parser.calls[0].arguments, 1: parser.calls[1].arguments}


def test_presence_frequency_penalties_and_logit_bias_follow_openais_formula(fp32_engine, cache_dir):
    """logits - count * frequency_penalty - (count > 0) * presence_penalty + logit_bias, counts over the
    answer so far: checked through the logprobs against a direct forward (fp32 weights and KV)."""
    engine = Engine(fp32_engine.loaded, make_settings(cache_dir, quantization="fp32", kv_dtype="float32"))
    bias = {5: 2.5, 17: -4.0}
    params = SamplingParams(
        max_tokens=16, temperature=0, logprobs=0, presence_penalty=0.8, frequency_penalty=0.6, logit_bias=bias
    )
    request = GenerationRequest(ask("Describe a cat."), params)
    *_, done = engine.generate(request)
    ids = done.token_ids
    logits, prompt_tokens = direct_logits(engine, request, ids)
    counts, bias_row = torch.zeros(logits.shape[-1]), torch.zeros(logits.shape[-1])
    bias_row[list(bias)] = torch.tensor(list(bias.values()))
    for step, (record, token) in enumerate(zip(done.logprobs, ids)):
        scores = logits[prompt_tokens - 1 + step] - counts * 0.6 - (counts > 0) * 0.8 + bias_row
        assert record.token_id == token == int(scores.argmax())
        assert record.logprob == pytest.approx(float(scores.log_softmax(-1)[token]), abs=1e-4)
        counts[token] += 1
    plain = run(engine, None, "Describe a cat.", max_tokens=16, temperature=0)
    assert plain.text != done.text  # the penalties changed the answer


def test_a_large_logit_bias_forces_its_token(engine):
    token = engine.processor.tokenizer.convert_tokens_to_ids("Ġcat") or 100
    request = GenerationRequest(
        ask("Anything."), SamplingParams(max_tokens=6, temperature=1.0, seed=1, logit_bias={token: 100})
    )
    *_, done = engine.generate(request)
    assert done.token_ids == (token,) * 6


def test_without_parallel_tool_calls_only_the_first_call_is_parsed():
    second = '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n' + second
    for max_calls, names in [(None, ["a", "b"]), (1, ["a"])]:
        parser = ToolCallParser(max_calls)
        out = parser.feed(text) + parser.flush()
        assert [c.name for c in parser.calls] == names
        if max_calls == 1:  # the second block stays text
            assert (
                "".join(o for o in out if isinstance(o, str))
                == '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
            )
