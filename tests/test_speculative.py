"""Exact speculative decoding (service/engine/drafts.py, the scheduler's verify pass) on the real
tiny model: greedy answers are the same bits with it on and off — alone, in a batch, after a cache
hit, under a grammar — whatever the guesses; so are seeded sampled answers; it is reported.

Guesses come from the grammar and from prompt lookup; to reach every path, some tests also force
them: always right (the answer itself, computed before: every guess accepted) or always wrong."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from prometheus_client import REGISTRY
from test_caches import image
from test_structured import RECEIPT

from service.answer.structured import json_grammar
from service.engine.drafts import DraftBudget, prompt_lookup
from service.engine.engine import Engine
from service.generation import Completion, GenerationRequest, SamplingParams
from service.model.prompts import ChatMessage, ImagePart, TextPart

from conftest import make_settings

ANSWER = 40


@pytest.fixture(scope="module")
def engines(cache_dir, loaded_model):
    """INT8 engines sharing one model: speculation on and off, bf16 and fp32 keys and values."""
    loaded = loaded_model("int8")

    def engine(**overrides):
        return Engine(loaded, make_settings(cache_dir, quantization="int8", **overrides))

    return {
        ("on", "bfloat16"): engine(),
        ("off", "bfloat16"): engine(speculative="off"),
        ("on", "float32"): engine(kv_dtype="float32"),
        ("off", "float32"): engine(speculative="off", kv_dtype="float32"),
    }


KV = pytest.mark.parametrize("kv", ["bfloat16", "float32"], ids=["kv-bf16", "kv-fp32"])


def request(parts, **params) -> GenerationRequest:
    sampling = SamplingParams(**{"max_tokens": ANSWER, "temperature": 0, "logprobs": 2, **params})
    return GenerationRequest([ChatMessage("user", parts)], sampling)


def run(engine: Engine, req: GenerationRequest) -> Completion:
    return [e for e in engine.generate(req) if isinstance(e, Completion)][0]


def run_together(engine: Engine, reqs: list[GenerationRequest]) -> list[Completion]:
    """The requests submitted at once from their own threads (so they decode in one batch)."""
    results = [None] * len(reqs)

    def go(i):
        results[i] = run(engine, reqs[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def same_bits(a: Completion, b: Completion) -> bool:
    """The same tokens, and every logprob and alternative equal as floats."""
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.fixture
def forced_guesses(monkeypatch):
    """force(lambda sequence_tokens: guesses): the drafts every sequence brings, instead of its own."""

    def force(oracle):
        monkeypatch.setattr(
            DraftBudget, "drafts", lambda self, token_ids, constraint, room: (oracle(token_ids)[:room], True)
        )

    return force


def picture_question(engine, seed=0):
    return [ImagePart(image(engine, 224, 160, seed=seed)), TextPart("Describe the picture, with every detail.")]


def answer_oracle(expected: Completion, right: int = 4, wrong: int = 0, after: list[int] = ()):
    """Guesses from an answer computed before: its next `right` tokens, then `wrong` tokens it does
    not hold there (`after`: what to guess past its end)."""
    prompt_length = None
    answer = [*expected.token_ids, *after]

    def oracle(token_ids):
        nonlocal prompt_length
        prompt_length = prompt_length or len(token_ids) - 1
        made = len(token_ids) - prompt_length
        good = answer[made : made + right]
        return good + [(answer[min(made + len(good), len(answer) - 1)] + 1 + i) % 50 for i in range(wrong)]

    return oracle


@KV
def test_right_guesses_are_all_accepted_and_change_no_bit(engines, forced_guesses, kv):
    on, off = engines["on", kv], engines["off", kv]
    parts = picture_question(on)
    expected = run(off, request(parts))
    forced_guesses(answer_oracle(expected))
    got = run(on, request(parts))
    assert same_bits(got, expected)
    assert got.drafted_tokens >= ANSWER // 2 and got.accepted_tokens == got.drafted_tokens


@KV
def test_wrong_guesses_are_all_rejected_and_change_no_bit(engines, forced_guesses, kv):
    on, off = engines["on", kv], engines["off", kv]
    parts = picture_question(on, seed=1)
    expected = run(off, request(parts))
    forced_guesses(lambda token_ids: [(token_ids[-1] + 1 + i) % 50 for i in range(4)])  # never the answer
    got = run(on, request(parts))
    assert same_bits(got, expected)
    assert got.drafted_tokens > 0 and got.accepted_tokens < got.drafted_tokens


def test_the_cache_a_speculative_answer_leaves_is_the_bits_of_one_without(engines, forced_guesses):
    """Rejected rows leave the KV cache as if never written: the kept conversation is the same bits."""
    on, off = engines["on", "bfloat16"], engines["off", "bfloat16"]
    parts = picture_question(on, seed=2)

    def kept():
        return GenerationRequest(
            [ChatMessage("user", parts)], SamplingParams(max_tokens=ANSWER, temperature=0), conversation_id="kept"
        )

    expected = run(off, kept())
    forced_guesses(answer_oracle(expected, right=2, wrong=2))  # every step: two made, then two not
    got = run(on, kept())
    assert got.token_ids == expected.token_ids
    assert 0 < got.accepted_tokens < got.drafted_tokens  # rows verified and cut back, step after step
    a, b = (e.caches.kv.memory.entries.peek("id:kept") for e in (on, off))
    assert torch.equal(a.token_ids, b.token_ids)
    assert len(a.cache.layers) == len(b.cache.layers) > 0
    assert all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.cache.layers, b.cache.layers)
    )


@KV
@pytest.mark.parametrize("guesses", ["own", "4 wrong each"])
def test_greedy_answers_in_a_batch_are_the_same_bits_with_speculation_on_and_off(engines, forced_guesses, kv, guesses):
    """Four requests together, their own guesses (prompt lookup) or 4 wrong ones each (16 rows of
    guesses: more than a step verifies, so some sequences get fewer): each answer the bits of its
    answer without speculation, alone."""
    on, off = engines["on", kv], engines["off", kv]
    makers = [
        lambda: request([TextPart("Repeat after me: red square, blue circle, red square, blue circle.")]),
        lambda: request(picture_question(on, seed=3)),
        lambda: request([TextPart("Hi.")], max_tokens=25),
        lambda: request([TextPart("Count: one two three one two three one two three")]),
    ]
    expected = [run(off, make()) for make in makers]
    if guesses != "own":
        forced_guesses(lambda token_ids: [(token_ids[-1] + 1 + i) % 50 for i in range(4)])
    results = run_together(on, [make() for make in makers])
    assert all(same_bits(r, e) for r, e in zip(results, expected))
    assert sum(r.drafted_tokens for r in results) > 0


def test_a_grammar_guesses_its_forced_tokens_and_the_json_is_the_same_bits(engines):
    """Under a JSON Schema the grammar's forced tokens (keys, quotes, punctuation) are guessed: the
    model makes most of them (the grammar forces the text; the model may spell it in other tokens),
    and the answer is the bits of the answer without speculation."""
    on, off = engines["on", "bfloat16"], engines["off", "bfloat16"]

    def constrained():
        req = request([TextPart("Read the receipt in this message.")], max_tokens=200)
        return replace(req, grammar=json_grammar(RECEIPT, "response_format"))

    expected, got = run(off, constrained()), run(on, constrained())
    assert same_bits(got, expected)
    assert got.accepted_tokens > 10 and got.accepted_tokens >= 0.8 * got.drafted_tokens


@pytest.mark.parametrize("guesses", ["right, then wrong", "own"])
def test_a_seeded_sampled_answer_is_the_same_with_speculation_on_and_off(engines, forced_guesses, guesses):
    """The token is drawn as without guesses and a guess is kept when it is that token (accepted with
    the model's probability of it: the point-mass rule), so the generator is consumed the same way:
    the same tokens and logprobs with speculation on and off — alone and in a batch of four."""
    on, off = engines["on", "bfloat16"], engines["off", "bfloat16"]
    texts = [f"Repeat after me: red square, blue circle, red square, blue circle ({i})." for i in range(4)]

    def sampled(text, seed):
        return request([TextPart(text)], temperature=0.9, top_p=0.95, seed=seed)

    expected = [run(off, sampled(text, seed)) for seed, text in enumerate(texts)]
    assert len({e.token_ids for e in expected}) == 4  # the seeds matter: the comparison is not vacuous
    if guesses != "own":
        forced_guesses(answer_oracle(expected[0], right=2, wrong=2))
    alone = run(on, sampled(texts[0], 0))
    assert same_bits(alone, expected[0])
    if guesses != "own":
        assert 0 < alone.accepted_tokens < alone.drafted_tokens
    together = run_together(on, [sampled(text, seed) for seed, text in enumerate(texts)])
    assert all(same_bits(t, e) for t, e in zip(together, expected))
    assert sum(t.drafted_tokens for t in together) > 0


def test_guesses_past_the_end_of_the_answer_are_neither_kept_nor_counted(engines, forced_guesses):
    """An end of turn among the guesses ends the answer there; the guesses after it were never
    compared, so they are not counted as rejected."""
    on, off = engines["on", "bfloat16"], engines["off", "bfloat16"]
    end = off.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def short(bias):  # an end of turn made likely: the answer ends on its own, before max_tokens
        return request([TextPart("Hi.")], logit_bias={end: bias})

    for bias in (5.0, 4.0, 3.0, 2.5, 2.0, 1.5, 1.0):  # the random model's: the first that ends after a few tokens
        expected = run(off, short(bias))
        if expected.finish_reason == "stop" and 3 <= len(expected.token_ids) < ANSWER:
            break
    assert expected.finish_reason == "stop" and expected.token_ids[-1] == end and len(expected.token_ids) >= 3
    forced_guesses(answer_oracle(expected, right=8, after=[5, 6, 7, 8, 9, 10, 11, 12]))
    got = run(on, short(bias))
    assert same_bits(got, expected) and got.finish_reason == "stop"
    assert got.drafted_tokens > 0 and got.accepted_tokens == got.drafted_tokens


def test_prompt_lookup_guesses_what_followed_the_latest_ngram():
    assert prompt_lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]  # the 3-gram 1 2 3 seen before
    assert prompt_lookup([5, 6, 7, 6], 2) == [7, 6]  # falls back to the 1-gram 6
    assert prompt_lookup([1, 2, 3], 4) == []  # nothing repeats


def test_speculation_off_guesses_nothing_and_a_request_can_turn_it_off(engines):
    parts = [TextPart("Repeat after me: red square, blue circle, red square, blue circle.")]
    assert run(engines["off", "bfloat16"], request(parts)).drafted_tokens == 0
    req = replace(request(parts), speculative=False)
    assert run(engines["on", "bfloat16"], req).drafted_tokens == 0

    def counted():
        return sum(
            REGISTRY.get_sample_value("qwen3vl_draft_tokens_total", {"source": "lookup", "result": r}) or 0
            for r in ("accepted", "rejected")
        )

    before = counted()
    done = run(engines["on", "bfloat16"], request(parts))
    assert done.drafted_tokens > 0  # the repeated phrase is guessed
    assert counted() - before == done.drafted_tokens
