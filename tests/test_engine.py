"""Generation on the real tiny model, fp32 and int8: streaming, sampling, stop strings, cancellation."""

from __future__ import annotations

import pytest
import torch

from service.engine.engine import Completion, GenerationRequest, SamplingParams, TextDelta
from service.errors import PromptTooLong
from service.media.images import decode_image
from service.model.kv import GrowingCache
from service.model.prompts import ChatMessage, ImagePart, TextPart
from service.quant.fusion import fuse_projections

from conftest import generate_config, prepared, transformers_model
from imaging import encode, pattern


def image(engine, width=448, height=448, seed=0):
    return decode_image(encode(pattern(width, height, seed=seed), ".png"), engine.limits.image)


def ask(engine, parts, **params) -> tuple[list[str], Completion]:
    messages = [ChatMessage("user", parts)]
    deltas, done = [], None
    for event in engine.generate(GenerationRequest(messages, SamplingParams(**params))):
        if isinstance(event, TextDelta):
            deltas.append(event.text)
        else:
            done = event
    return deltas, done


def test_answer_streams_in_several_deltas_and_reports_usage(engine):
    deltas, done = ask(
        engine, [ImagePart(image(engine)), TextPart("What is in this picture?")], max_tokens=24, temperature=0
    )
    assert len(deltas) >= 2
    assert "".join(deltas) == done.text
    assert done.completion_tokens == 24 and done.finish_reason == "length"
    assert done.prompt_tokens > 196  # 196 visual tokens for a 448x448 image plus the text
    t = done.timings
    assert t.image_decode > 0 and t.vision_encode > 0 and t.prefill > 0 and t.decode_tokens_per_s > 0
    assert t.queue_wait + t.vision_encode + t.prefill <= t.time_to_first_token <= t.total


def test_streamed_text_equals_plain_generate_for_same_seed(fp32_engine, tiny_dir):
    """The streaming path (prefill in pieces, the scheduler's own decode steps, its sampler) draws
    what model.generate draws for the same seed. fp32 weights: transformers' forward rounds
    differently from the service's (its INT8 logits are within a quantization level; its fp32 ones
    within 1e-5, tests/test_forward.py), so only fp32 can show the draws are the same."""
    engine = fp32_engine
    parts = [ImagePart(image(engine)), TextPart("Describe the colors.")]
    _, done = ask(engine, parts, max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    prompt = prepared(engine, GenerationRequest([ChatMessage("user", parts)]))
    model = transformers_model(tiny_dir)  # transformers' own model and generate(): the reference,
    fuse_projections(model)  # its attention fused as the service's (a KV_DTYPE cache)
    torch.manual_seed(1234)
    with torch.inference_mode():
        out = model.generate(
            input_ids=prompt.input_ids,
            attention_mask=torch.ones_like(prompt.input_ids),
            mm_token_type_ids=prompt.mm_token_type_ids,
            image_grid_thw=prompt.image_grid_thw,
            pixel_values=torch.cat(prompt.pixel_values),
            generation_config=generate_config(engine, SamplingParams(temperature=0.9, top_p=0.9, top_k=50), 20),
            cache=GrowingCache(config=model.config, dtype=getattr(torch, engine.settings.kv_dtype)),  # as KV_DTYPE
        )
    new = out[0, prompt.num_tokens :]
    assert done.text == engine.processor.tokenizer.decode(new, skip_special_tokens=True)


def test_same_seed_same_answer_other_seed_other_answer(engine):
    parts = [TextPart("Tell me a story about a red square.")]
    a = ask(engine, parts, max_tokens=24, temperature=1.0, seed=7)[1].text
    b = ask(engine, parts, max_tokens=24, temperature=1.0, seed=7)[1].text
    c = ask(engine, parts, max_tokens=24, temperature=1.0, seed=8)[1].text
    assert a == b
    assert a != c


def test_pixel_budget_bounds_visual_tokens(engine):
    photo = decode_image(encode(pattern(1920, 1080), ".jpg"), engine.limits.image)
    prompt = prepared(engine, GenerationRequest([ChatMessage("user", [ImagePart(photo), TextPart("hi")])]))
    visual = int(prompt.mm_token_type_ids.sum())
    assert visual <= engine.settings.image_max_pixels // (32 * 32)
    assert visual == int(prompt.image_grid_thw.prod()) // 4


def test_stop_string_ends_the_answer_before_it(fp32_engine):
    parts = [TextPart("Count for me, please.")]
    full = ask(fp32_engine, parts, max_tokens=30, temperature=0)[1].text
    assert len(full) > 6
    stop = full[4:7]
    deltas, done = ask(fp32_engine, parts, max_tokens=30, temperature=0, stop=[stop])
    assert done.finish_reason == "stop"
    assert done.text == full[: full.find(stop)]
    assert stop not in "".join(deltas)


def test_cancel_stops_within_one_token_and_leaves_the_batch(engine):
    request = GenerationRequest(
        [ChatMessage("user", [TextPart("Talk forever.")])], SamplingParams(max_tokens=400, temperature=0)
    )
    generation = engine.submit(request)
    seen, at_cancel = 0, None
    for event in generation:
        seen += 1
        if seen == 3:
            generation.cancel()
            at_cancel = generation.generated_tokens  # read after setting: counts all tokens made before it
        if isinstance(event, Completion):
            done = event
    assert done.finish_reason == "cancelled"
    assert done.completion_tokens <= at_cancel + 1
    assert engine.scheduler.batch_size == 0  # it left the batch


def test_closing_the_stream_early_cancels_and_leaves_the_batch(engine):
    request = GenerationRequest(
        [ChatMessage("user", [TextPart("Talk forever.")])], SamplingParams(max_tokens=400, temperature=0)
    )
    generation = engine.submit(request)
    next(generation), next(generation)
    assert generation.status == "running"
    generation.close()  # what a WSGI server does when the client goes away
    assert generation.status == "cancelled"
    assert engine.scheduler.batch_size == 0
    assert not engine.admission.busy  # the model is free for the next request at once
    stream = engine.generate(request)  # the same through the plain generator (CLI)
    next(stream), next(stream)
    stream.close()
    assert engine.scheduler.batch_size == 0 and not engine.admission.busy


def test_prompt_beyond_context_limit_is_refused(engine):
    words = "many words " * (engine.settings.context_limit)
    with pytest.raises(PromptTooLong):
        prepared(engine, GenerationRequest([ChatMessage("user", [TextPart(words)])]))
