"""Conversation KV cache and vision-feature cache on the real tiny model, fp32, INT8 and 4-bit.

The contract is exactness: with greedy decoding an engine with caches answers what an engine
without them answers, while reporting (and doing) less work — with INT8 and 4-bit weights bit for bit (every
token's log-probability and its alternatives compared as floats: service/model/forward.py computes a
token alike in every path), with fp32 weights token for token and within float rounding (their
GEMMs round differently with the number of rows). Both reuse any token prefix, the previous answer
included. Answers are 32 tokens long, pictures in most conversations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from prometheus_client import REGISTRY

from service.engine.engine import Completion, Engine, GenerationRequest, SamplingParams, TextDelta
from service.errors import PromptTooLong
from service.media.images import decode_image
from service.model.prompts import ChatMessage, ImagePart, TextPart

from conftest import prepared, weights_settings
from imaging import encode, pattern


def image(engine, width=224, height=224, seed=0):
    return decode_image(encode(pattern(width, height, seed=seed), ".png"), engine.limits.image)


def user(*parts):
    return ChatMessage("user", [TextPart(p) if isinstance(p, str) else ImagePart(p) for p in parts])


def assistant(text):
    return ChatMessage("assistant", [TextPart(text)])


ANSWER_TOKENS = 32


def turn(engine, messages, conversation_id=None, max_tokens=ANSWER_TOKENS):
    """One greedy generation, with each token's log-probability and 3 alternatives: (token ids, Completion)."""
    request = GenerationRequest(
        messages, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3), conversation_id=conversation_id
    )
    done = [e for e in engine.generate(request) if isinstance(e, Completion)][0]
    return list(done.token_ids), done


@dataclass
class Engines:
    cached: Engine  # caches on, starting empty
    plain: Engine  # caches off, the same loaded model

    def ask(self, messages, conversation_id=None, max_tokens=ANSWER_TOKENS) -> Completion:
        """The cached engine's answer, asserted against the cache-free engine's: the same tokens, and
        with INT8 weights the same bits of every log-probability (fp32: within float rounding)."""
        ids, done = turn(self.cached, messages, conversation_id, max_tokens)
        plain_ids, plain = turn(self.plain, messages, max_tokens=max_tokens)
        assert ids == plain_ids, "differs from a full recompute"
        if self.cached.loaded.quantization in ("int8", "int4"):
            assert done.logprobs == plain.logprobs, "not the bits of a full recompute"
        else:
            assert max(abs(a.logprob - b.logprob) for a, b in zip(done.logprobs, plain.logprobs)) < 1e-4
        return done


# The quick tier runs the default bf16 keys and values; the whole suite fp32 too.
@pytest.fixture(params=[pytest.param("float32", marks=pytest.mark.slow), "bfloat16"], ids=["kv-fp32", "kv-bf16"])
def engines(engine, cache_dir, request):
    """Caches on and off, on fp32, INT8 and 4-bit weights, with fp32 and bf16 keys and values (KV_DTYPE)."""
    q, kv = engine.loaded.quantization, request.param
    return Engines(
        cached=Engine(engine.loaded, weights_settings(cache_dir, q, kv_dtype=kv)),
        plain=Engine(engine.loaded, weights_settings(cache_dir, q, kv_dtype=kv, cache_enabled=False)),
    )


def converse(engines, turns, conversation_id=None, max_tokens=ANSWER_TOKENS):
    """Play the user turns, each answer going into the history, each checked by `Engines.ask`."""
    history, dones = [], []
    for message in turns:
        history.append(message)
        done = engines.ask(history, conversation_id, max_tokens)
        dones.append(done)
        history.append(assistant(done.text))
    return dones


def prompt_of(engine, messages):
    return prepared(engine, GenerationRequest(messages))


def image_end(engine, messages) -> int:
    return prompt_of(engine, messages).image_spans[0][1]


def common_prefix(engine, one, other) -> int:
    a, b = prompt_of(engine, one).input_ids[0], prompt_of(engine, other).input_ids[0]
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


class CountingEncoder:
    """The engine's own vision encoder, counting the images it encodes."""

    def __init__(self, encoder):
        self.encoder, self.name, self.images = encoder, encoder.name, 0

    def __call__(self, pixel_values, grid):
        self.images += len(grid)
        return self.encoder(pixel_values, grid)


# -- exactness --------------------------------------------------------------------------------


def test_answers_depend_on_the_picture_so_equal_answers_prove_something(engines):
    """The tiny random model's 8 greedy tokens change with the picture (and the text): an answer
    computed from a wrong cached picture or prefix would not pass for the right one."""
    e = engines.plain
    question = "What is in this picture?"
    answers = {tuple(turn(e, [user(image(e, seed=seed), question)])[0]) for seed in (0, 1, 2)}
    assert len(answers) == 3
    assert turn(e, [user(image(e), question)])[0] != turn(e, [user(image(e), "Describe the colours.")])[0]


def test_second_turn_reuses_cached_prefix_and_answers_the_same(engines):
    a = image(engines.cached)
    first, second = converse(engines, [user(a, "What is in this picture?"), user("Tell me more.")], "c1")
    assert first.cached_tokens == 0
    assert second.cached_tokens >= first.prompt_tokens - 1  # the whole first prompt, image included
    assert second.cached_tokens < second.prompt_tokens


def test_follow_up_adding_a_new_image_answers_the_same(engines):
    e = engines.cached
    turns = [user(image(e), "What is in this picture?"), user(image(e, 320, 128, seed=3), "And this one?")]
    first, second = converse(engines, turns, "c2")
    assert second.cached_tokens >= first.prompt_tokens - 1
    assert second.images == 2 and second.vision_cache_hits == 0


def test_three_turns_with_images_in_first_and_third_answer_the_same(engines):
    e = engines.cached
    turns = [
        user(image(e), "Describe it."),
        user("What colour dominates?"),
        user(image(e, 160, 256, seed=5), "Compare with this."),
    ]
    dones = converse(engines, turns, "c3")
    assert dones[1].cached_tokens >= dones[0].prompt_tokens - 1
    assert dones[2].cached_tokens >= dones[1].prompt_tokens - 1


def test_stateless_client_resending_its_history_is_matched_by_prefix(engines):
    """The OpenAI way: no conversation id, the whole history every time."""
    first, second = converse(engines, [user(image(engines.cached), "What is this?"), user("Why?")])
    assert second.cached_tokens >= first.prompt_tokens - 1


def test_a_kept_answer_is_reused_whole_and_answers_the_same(engines):
    """The native endpoint keeps each answer's generated ids (`ChatMessage.token_ids`): the next
    turn's prompt holds exactly those ids, so the cache covers the first prompt and the answer."""
    question = [user(image(engines.cached), "What is in this picture?")]
    first = engines.ask(question, "c-kept", max_tokens=12)
    assert first.answer_token_ids is not None and len(first.answer_token_ids) >= first.completion_tokens - 1
    kept = ChatMessage("assistant", [TextPart(first.text)], token_ids=first.answer_token_ids)
    second = engines.ask([*question, kept, user("Tell me more.")], "c-kept")
    # All but the answer's last token, which was never fed to the model (unless it was the end-of-turn).
    assert second.cached_tokens >= first.prompt_tokens + len(first.answer_token_ids) - 1


def test_a_kept_answers_ids_replace_its_re_tokenized_text_in_the_prompt(engines):
    e = engines.cached
    tok = e.processor.tokenizer
    text = "Purple squares everywhere."
    spelled = tuple(
        tok.convert_tokens_to_ids(list(tok.tokenize(text)[0]))
        + tok(tok.convert_tokens_to_string(tok.tokenize(text)[1:]), add_special_tokens=False)["input_ids"]
    )
    assert tok.decode(spelled) == text and list(spelled) != tok(text, add_special_tokens=False)["input_ids"]
    history = [user("Hi."), None, user("More.")]
    plain = prompt_of(e, [history[0], assistant(text), history[2]]).input_ids[0].tolist()
    kept = (
        prompt_of(e, [history[0], ChatMessage("assistant", [TextPart(text)], token_ids=spelled), history[2]])
        .input_ids[0]
        .tolist()
    )
    assert any(kept[i : i + len(spelled)] == list(spelled) for i in range(len(kept)))
    assert len(kept) == len(plain) - len(tok(text, add_special_tokens=False)["input_ids"]) + len(spelled)


def test_identical_resent_prompt_reuses_all_but_its_last_token(engines):
    messages = [user(image(engines.cached), "What is in this picture?")]
    first = engines.ask(messages)
    again = engines.ask(messages)
    assert first.cached_tokens == 0
    assert again.cached_tokens == again.prompt_tokens - 1


def test_edited_and_branched_history_is_cropped_never_misused(engines):
    e = engines.cached
    a = image(e)
    q1 = user(a, "What is in this picture?")
    done1 = engines.ask([q1], "c4")
    base = [q1, assistant(done1.text)]
    done2 = engines.ask(base + [user("Tell me more.")], "c4")
    # The client edits its last question: the cache is cropped back to the shared history.
    edited = base + [user("Tell me less.")]
    done = engines.ask(edited, "c4")
    assert done1.prompt_tokens - 1 <= done.cached_tokens < done2.prompt_tokens
    # A branch from the first question with another answer in the history, without an id.
    branch = [q1, assistant("Something else entirely."), user("Go on.")]
    done = engines.ask(branch)
    assert image_end(e, [q1]) < done.cached_tokens <= common_prefix(e, branch, edited)
    # Text inserted before the picture in the first message: nothing from the picture on is reused.
    rewritten = [user("Look.", a, "What is in this picture?")]
    done = engines.ask(rewritten, "c4")
    assert done.cached_tokens <= prompt_of(e, rewritten).image_spans[0][0]


def test_branch_from_another_conversation_leaves_it_its_cache(engines):
    e = engines.cached
    history = [user(image(e), "What is in this picture?")]
    first = engines.ask(history, "c12")
    history += [assistant(first.text), user("Tell me more.")]
    second = engines.ask(history, "c12")
    # Another client starts from the same first question (a copy of the shared prefix serves it)...
    other = engines.ask(history[:1] + [assistant("Nothing."), user("Really?")], "c13")
    assert other.cached_tokens >= first.prompt_tokens - 1
    # ...and c12's own next turn still finds its whole history.
    history += [assistant(second.text), user("Go on.")]
    assert engines.ask(history, "c12").cached_tokens >= second.prompt_tokens - 1


def test_turn_after_another_conversation_with_another_image_size_answers_the_same(engines):
    e = engines.cached
    history = [user(image(e), "What is in this picture?")]
    first = engines.ask(history, "c5")
    converse(engines, [user(image(e, 320, 128, seed=3), "Other conversation.")], "c6")
    history += [assistant(first.text), user("Back to the first picture.")]
    done = engines.ask(history, "c5")
    assert done.cached_tokens >= first.prompt_tokens - 1


def test_same_tokens_with_another_picture_is_a_miss_at_that_image(engines):
    e = engines.cached
    before = [user("I will show you a photo from our holiday by the sea."), assistant("Please do.")]
    first = before + [user(image(e, seed=1), "What is in it?")]
    turn(e, first, "c7")
    other = before + [user(image(e, seed=2), "What is in it?")]  # same size: identical token ids
    assert prompt_of(e, other).input_ids.equal(prompt_of(e, first).input_ids)
    done = engines.ask(other)
    assert 0 < done.cached_tokens <= prompt_of(e, other).image_spans[0][0]


# -- vision-feature cache -----------------------------------------------------------------------


def test_repeated_image_in_a_new_conversation_skips_the_vision_encoder(engines):
    e = engines.cached
    e.prefiller.vision_encoder = counter = CountingEncoder(e.vision_encoder)
    a = image(e)
    engines.ask([user(a, "What is in this picture?")], "c8")
    assert counter.images == 1
    # Text before the image: the KV prefix ends before it, so the picture's features are needed again.
    done = engines.ask([user("Another question.", a, "Which colours?")], "c9")
    assert counter.images == 1 and done.vision_cache_hits == 1
    assert done.cached_tokens == 0  # the vision cache's hit alone


def test_same_picture_opening_a_new_conversation_reuses_its_keys_and_values(engines):
    e = engines.cached
    e.prefiller.vision_encoder = counter = CountingEncoder(e.vision_encoder)
    a = image(e)
    engines.ask([user(a, "What is in this picture?")], "c10")
    done = engines.ask([user(a, "Which colours do you see?")], "c11")
    assert done.cached_tokens >= image_end(e, [user(a, "x")])
    assert counter.images == 1


def test_cached_vision_features_equal_the_encoders(engines):
    e = engines.cached
    prompt = prompt_of(e, [user(image(e), "hi")])
    turn(e, [user(image(e), "hi")], max_tokens=1)
    assert len(e.caches.vision.entries) == 1
    kept = e.caches.vision.get(prompt.spans["image"][0].key)
    fresh = e.vision_encoder(prompt.pixel_values[0], prompt.image_grid_thw)[0]
    assert kept.pooler.equal(fresh.pooler)
    assert all(k.equal(f) for k, f in zip(kept.deepstack, fresh.deepstack, strict=True))


def test_vision_cache_tells_different_pictures_apart(engines):
    e = engines.cached
    e.prefiller.vision_encoder = counter = CountingEncoder(e.vision_encoder)
    turn(e, [user(image(e, seed=1), "one")], max_tokens=2)
    _, done = turn(e, [user("x", image(e, seed=2), "two")], max_tokens=2)
    assert counter.images == 2 and done.vision_cache_hits == 0


# -- bounds ---------------------------------------------------------------------------------------


def engine_with(engine, cache_dir, **settings) -> Engine:
    return Engine(engine.loaded, weights_settings(cache_dir, engine.loaded.quantization, **settings))


def two_conversations(engine):
    """Conversation A (an image), then B (another image), then A's second turn: its Completion."""
    a = [user(image(engine), "What is in this picture?")]
    _, done = turn(engine, a, "A", max_tokens=4)
    turn(engine, [user(image(engine, 192, 192, seed=9), "And here?")], "B", max_tokens=4)
    if engine.caches.kv.disk is not None:
        assert engine.caches.kv.disk.flush(30)  # what memory evicts is on disk by now
    _, again = turn(engine, a + [assistant(done.text), user("More.")], "A", max_tokens=4)
    return a, again


def test_entry_cap_evicts_the_least_recently_used_conversation(engine, cache_dir):
    small = engine_with(engine, cache_dir, conversation_cache_max_entries=1, kv_disk_mb=0)
    a, again = two_conversations(small)
    assert again.cached_tokens < image_end(small, a)  # A's picture was not kept
    roomy = engine_with(engine, cache_dir, kv_disk_mb=0)
    a, again = two_conversations(roomy)
    assert again.cached_tokens > image_end(roomy, a) and again.cached_from == "memory"
    tiered = engine_with(engine, cache_dir, conversation_cache_max_entries=1)  # the disk tier (on by default)
    a, again = two_conversations(tiered)
    assert again.cached_tokens > image_end(tiered, a) and again.cached_from == "disk"


def test_byte_budget_evicts_the_least_recently_used_conversation(engine, cache_dir):
    probe = engine_with(engine, cache_dir)
    turn(probe, [user(image(probe), "What is in this picture?")], "A", max_tokens=4)
    one = probe.caches.kv.memory.entries.nbytes
    assert one > 0
    small = engine_with(engine, cache_dir, conversation_cache_max_bytes=int(one * 1.5), kv_disk_mb=0)
    a, again = two_conversations(small)
    assert again.cached_tokens < image_end(small, a)
    assert 0 < small.caches.kv.memory.entries.nbytes <= int(one * 1.5)
    tiered = engine_with(engine, cache_dir, conversation_cache_max_bytes=int(one * 1.5))
    a, again = two_conversations(tiered)
    assert again.cached_tokens > image_end(tiered, a) and again.cached_from == "disk"


def test_idle_entries_expire_without_further_requests(engine, cache_dir):
    quick = engine_with(engine, cache_dir, cache_ttl_seconds=0.2, kv_disk_mb=0)  # the memory tier's TTL
    expired = [metric("qwen3vl_cache_evictions_total", cache=c, reason="ttl") for c in ("conversation", "vision")]
    history = [user(image(quick), "What is in this picture?")]
    _, done = turn(quick, history, "A", max_tokens=4)
    time.sleep(1.0)
    assert quick.caches.kv.memory.entries.nbytes == 0 and quick.caches.vision.entries.nbytes == 0
    assert [metric("qwen3vl_cache_evictions_total", cache=c, reason="ttl") for c in ("conversation", "vision")] == [
        n + 1 for n in expired
    ]
    history += [assistant(done.text), user("More.")]
    _, again = turn(quick, history, "A", max_tokens=4)
    assert again.cached_tokens == 0 and again.vision_cache_hits == 0
    quick.caches.kv.memory.entries.clear()  # no expiry left to happen during later tests
    quick.caches.vision.entries.clear()


def test_caching_disabled_reuses_and_keeps_nothing(engine, cache_dir):
    off = engine_with(engine, cache_dir, cache_enabled=False)
    history = [user(image(off), "What is in this picture?")]
    _, done = turn(off, history, "A", max_tokens=4)
    _, again = turn(off, history + [assistant(done.text), user("More.")], "A", max_tokens=4)
    assert again.cached_tokens == 0 and again.vision_cache_hits == 0
    assert len(off.caches.kv.memory.entries) == 0 and len(off.caches.vision.entries) == 0


def test_eviction_during_a_generation_does_not_change_its_answer(engines):
    e = engines.cached
    history = [user(image(e), "What is in this picture?")]
    done = engines.ask(history, "A")
    history += [assistant(done.text), user("Tell me more.")]
    request = GenerationRequest(history, SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0), conversation_id="A")
    events = e.generate(request)
    assert isinstance(next(events), TextDelta)
    e.caches.kv.memory.entries.clear()  # everything evicted while the answer streams
    e.caches.vision.entries.clear()
    done = [ev for ev in events if isinstance(ev, Completion)][0]
    assert done.cached_tokens > 0
    assert list(done.token_ids) == turn(engines.plain, history)[0]
    # And the conversation goes on from the cache its last turn left behind.
    assert turn(e, history + [assistant(done.text), user("Go on.")], "A")[1].cached_tokens >= done.prompt_tokens


def test_conversation_beyond_the_context_limit_is_refused_with_422(engine, cache_dir):
    tight = engine_with(engine, cache_dir, context_limit=128, max_new_tokens=16)
    history = [user(image(tight), "What is in this picture?")]
    _, done = turn(tight, history, "A", max_tokens=16)
    history += [assistant(done.text), user("Tell me much more about it. " * 12)]
    with pytest.raises(PromptTooLong) as info:
        turn(tight, history, "A")
    assert info.value.status == 422
    _, done = turn(tight, [user("A short new question.")], "B", max_tokens=4)
    assert done.completion_tokens == 4


# -- visibility -----------------------------------------------------------------------------------


def metric(name, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_count_hits_misses_reused_tokens_evictions_and_bytes(engine, cache_dir):
    e = engine_with(engine, cache_dir, conversation_cache_max_entries=1)
    names = [
        ("qwen3vl_cache_hits_total", {"cache": "conversation"}),
        ("qwen3vl_cache_misses_total", {"cache": "conversation"}),
        ("qwen3vl_cache_hits_total", {"cache": "vision"}),
        ("qwen3vl_cache_reused_tokens_total", {}),
        ("qwen3vl_cache_evictions_total", {"cache": "conversation", "reason": "entries"}),
        ("qwen3vl_cache_bytes", {"cache": "conversation"}),
    ]
    before = [metric(n, **labels) for n, labels in names]
    a = image(e)
    history = [user(a, "What is in this picture?")]
    _, done = turn(e, history, "m1", max_tokens=4)  # miss
    _, second = turn(e, history + [assistant(done.text), user("More.")], "m1", max_tokens=4)  # hit
    turn(e, [user("Again:", a)], "m2", max_tokens=4)  # KV miss, vision hit, evicts m1's entry
    after = [metric(n, **labels) for n, labels in names]
    delta = [x - y for x, y in zip(after, before)]
    assert delta[:5] == [1, 2, 1, second.cached_tokens, 1]
    assert delta[5] == e.caches.kv.memory.entries.nbytes > 0
