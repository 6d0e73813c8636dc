"""Thinking checkpoints in the engine (service/model/thinking.py, service/engine/reasoning.py) on
`tiny-thinking`, the embedded model's Thinking twin: recognised from the checkpoint, the reasoning
apart from the answer, the budget and the switch, grammars and stop strings on the answer only, and
the same bits alone or in a batch, with speculation on or off, with the caches warm or cold."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import jsonschema
import pytest
from test_speculative import run, run_together, same_bits

from service.answer.structured import json_grammar
from service.engine.engine import Engine
from service.generation import GenerationRequest, SamplingParams, TextDelta
from service.limits import RequestLimits
from service.model.loading import load_model, load_processor
from service.model.prompts import ChatMessage, TextPart
from service.model.thinking import detect_thinking
from service.random_checkpoints.chat_templates import THINKING_CHAT_TEMPLATE
from service.settings import DEFAULT_MAX_NEW_TOKENS, THINKING_MAX_NEW_TOKENS

from conftest import make_settings

# Qwen3's hybrid form: thinking on leaves the model free to open <think>; off renders a closed block.
HYBRID_TEMPLATE = THINKING_CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
)
SCHEMA = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engines(cache_dir, tiny_thinking_dir):
    """INT8 engines sharing tiny-thinking: speculation on and off, and one whose caches start empty."""
    loaded = load_model(make_settings(cache_dir, model_path=tiny_thinking_dir))

    def engine(**overrides):
        return Engine(loaded, make_settings(cache_dir, model_path=tiny_thinking_dir, **overrides))

    return {"on": engine(), "off": engine(speculative="off"), "fresh": engine(speculative="off")}


def ask(engine: Engine, text: str = "Tell me about a red square.", *, history=(), max_tokens=24, **kwargs):
    """A greedy request that runs to max_tokens (end of turn biased away)."""
    tokenizer = engine.processor.tokenizer
    bias = {tokenizer.convert_tokens_to_ids(t): -100 for t in ("<|im_end|>", "<|endoftext|>")}
    bias.update(kwargs.pop("logit_bias", {}))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2, logit_bias=bias)
    return GenerationRequest([*history, ChatMessage("user", [TextPart(text)])], params, **kwargs)


def tokens(engine: Engine):
    return engine.inputs.thinking


def test_a_thinking_checkpoint_is_recognised_and_an_instruct_one_is_not(engines, tiny_dir):
    engine = engines["on"]
    thinking = tokens(engine)
    assert engine.info.thinking and not thinking.has_switch
    decode = engine.processor.tokenizer.decode
    assert (decode([thinking.open_id]), decode([thinking.close_id]), decode(thinking.separator_ids)) == (
        "<think>",
        "</think>",
        "\n\n",
    )
    assert detect_thinking(load_processor(tiny_dir)) is None


def test_the_token_cap_leaves_a_thinking_checkpoint_room_to_reason_unless_it_is_set(engines, cache_dir, tiny_dir):
    """MAX_NEW_TOKENS unset: an answer's default cap, or for a thinking checkpoint room for its reasoning and
    the answer (within CONTEXT_LIMIT); set, it is the cap whatever the checkpoint."""
    assert engines["on"].limits.max_new_tokens == THINKING_MAX_NEW_TOKENS > 2 * 1024
    thinking_processor, instruct_processor = engines["on"].processor, load_processor(tiny_dir)
    assert Engine(engines["on"].loaded, make_settings(cache_dir, max_new_tokens=200)).limits.max_new_tokens == 200
    for overrides, thinking, cap, default in (
        ({}, False, DEFAULT_MAX_NEW_TOKENS, 256),
        ({"context_limit": 2048}, True, 2047, 256),
        ({"max_new_tokens": 300, "default_max_tokens": 500}, True, 300, 300),  # a default within the cap
    ):
        processor = thinking_processor if thinking else instruct_processor
        limits = RequestLimits.build(make_settings(cache_dir, **overrides), processor, thinking)
        assert (limits.max_new_tokens, limits.default_max_tokens) == (cap, default)


def test_the_budget_closes_the_reasoning_and_the_answer_follows(engines):
    engine = engines["on"]
    thinking, decode = tokens(engine), engine.processor.tokenizer.decode
    events = list(engine.generate(ask(engine, max_thinking_tokens=6)))
    done, deltas = events[-1], events[:-1]
    ids, closing = list(done.token_ids), [thinking.close_id, *thinking.separator_ids]
    assert ids[6 : 6 + len(closing)] == closing and done.reasoning_tokens == 6 + len(closing)
    assert done.completion_tokens == 24  # max_tokens counts reasoning and answer together
    assert done.reasoning == decode(ids[:6]).strip("\n") and done.reasoning
    answer = ids[6 + len(closing) :]
    assert done.text == decode(answer, skip_special_tokens=True)
    # the answer's ids are kept when they decode to its text exactly (a special token among them does not show)
    assert done.answer_token_ids == (tuple(answer) if decode(answer) == done.text else None)
    kinds = [d.reasoning for d in deltas if isinstance(d, TextDelta) and d.text]
    assert kinds == sorted(kinds, reverse=True) and kinds[0] and not kinds[-1]  # reasoning first, then the answer
    assert [r.reasoning for r in done.logprobs] == [True] * done.reasoning_tokens + [False] * (24 - 9)


def test_a_close_the_model_writes_ends_the_reasoning_and_the_separator_follows(engines):
    engine = engines["on"]
    thinking = tokens(engine)
    done = run(engine, ask(engine, logit_bias={thinking.close_id: 100}))
    closing = [thinking.close_id, *thinking.separator_ids]
    assert list(done.token_ids[: len(closing)]) == closing and done.reasoning_tokens == len(closing)
    assert done.reasoning == "" and done.text.startswith("</think>")  # later ones are the answer's text


def test_thinking_off_without_a_template_switch_closes_the_reasoning_at_once(engines):
    engine = engines["on"]
    off = run(engine, ask(engine, enable_thinking=False))
    zero = run(engine, ask(engine, max_thinking_tokens=0))
    assert off.reasoning == "" and off.reasoning_tokens == 1 + len(tokens(engine).separator_ids)
    assert same_bits(off, zero) and off.text == zero.text


def test_a_hybrid_template_takes_the_switch_and_lets_the_model_open_the_reasoning(
    cache_dir, tiny_thinking_dir, tmp_path
):
    hybrid = tmp_path / "hybrid"
    shutil.copytree(tiny_thinking_dir, hybrid)
    (hybrid / "chat_template.jinja").write_text(HYBRID_TEMPLATE)
    engine = Engine(
        load_model(make_settings(cache_dir, model_path=hybrid)), make_settings(cache_dir, model_path=hybrid)
    )
    thinking = tokens(engine)
    assert thinking.has_switch
    off = run(engine, ask(engine, enable_thinking=False))
    assert off.reasoning is None and off.reasoning_tokens == 0  # the template closed the block
    assert "<think>\n\n</think>\n\n" in engine.inputs.processor.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    opened = run(engine, ask(engine, max_thinking_tokens=3, logit_bias={thinking.open_id: 100}))
    closing = [thinking.close_id, *thinking.separator_ids]
    assert opened.token_ids[0] == thinking.open_id and list(opened.token_ids[4 : 4 + len(closing)]) == closing
    # the opening tag is not shown; the biased model's three thoughts are more of them
    assert opened.reasoning_tokens == 1 + 3 + len(closing) and opened.reasoning == "<think>" * 3
    direct = run(engine, ask(engine))
    assert direct.token_ids[0] != thinking.open_id and direct.reasoning == "" and direct.reasoning_tokens == 0


def test_a_grammar_shapes_the_answer_and_leaves_the_reasoning_free(engines):
    engine = engines["on"]
    free = run(engine, ask(engine, max_thinking_tokens=5))
    shaped = run(
        engine, ask(engine, max_thinking_tokens=5, grammar=json_grammar(SCHEMA, "response_format"), max_tokens=40)
    )
    assert shaped.token_ids[:8] == free.token_ids[:8]  # the same reasoning, the same closing
    jsonschema.validate(json.loads(shaped.text), SCHEMA)
    assert shaped.reasoning == free.reasoning and shaped.finish_reason == "stop"


def test_a_stop_string_acts_on_the_answer_only(engines):
    engine = engines["on"]
    first = run(engine, ask(engine, max_thinking_tokens=8))
    stop = next(w for w in first.reasoning.split() if len(w) > 2 and w not in first.text)
    request = ask(engine, max_thinking_tokens=8)
    again = run(engine, replace(request, params=request.params.model_copy(update={"stop": [stop]})))
    assert again.reasoning == first.reasoning and again.text == first.text and again.finish_reason == "length"


def test_answers_are_the_same_bits_alone_in_a_batch_with_speculation_and_with_warm_caches(engines):
    """Each request alone, speculation off, against all four decoded together with speculation on
    (a budget's forced closing verified as guesses, a grammar's fast-forward); then each one's
    second turn on the engine whose caches hold the first against one whose caches are empty."""
    on, off, fresh = engines["on"], engines["off"], engines["fresh"]
    grammar = json_grammar(SCHEMA, "response_format")
    story = "Tell me a long story about a red square and a blue circle, with many details: {}."
    requests = [
        ask(on, story.format("a number"), max_thinking_tokens=5, grammar=grammar, max_tokens=40),
        ask(on, story.format("the colours"), max_tokens=30),
        ask(on, story.format("no reasoning"), enable_thinking=False),
        ask(on, story.format("count to ten"), max_thinking_tokens=0),
    ]
    alone = [run(off, r) for r in requests]
    together = run_together(on, requests)
    assert all(same_bits(a, b) for a, b in zip(alone, together, strict=True))
    assert sum(d.drafted_tokens for d in together) > 0
    for request, first in zip(requests, together, strict=True):
        said = ChatMessage(
            "assistant", [TextPart(first.text)], token_ids=first.answer_token_ids, reasoning=first.reasoning
        )
        follow_up = [*request.messages, said]
        warm = run(on, ask(on, "And then?", history=follow_up, max_thinking_tokens=4))
        cold = run(fresh, ask(fresh, "And then?", history=follow_up, max_thinking_tokens=4))
        # the first turn's prompt is reused: the history renders without its reasoning from there
        assert same_bits(warm, cold) and warm.cached_tokens >= first.prompt_tokens - 3 > cold.cached_tokens
