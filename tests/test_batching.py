"""Continuous batching on the real tiny model: requests decoded together answer exactly as alone
(fp32 and INT8, whose Linears quantize each token on its own), join mid-way, leave when cancelled,
prefill interleaved with the batch's decoding."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from prometheus_client import REGISTRY

from service.engine.engine import Completion, Engine, GenerationRequest, SamplingParams, TextDelta
from service.engine.sampling import Sampler
from service.errors import QueueFull
from service.media.images import decode_image
from service.model.loading import load_model
from service.model.prompts import ChatMessage, ImagePart, TextPart
from service.vision.steps import image_steps, run_to_end

from conftest import make_settings, prepared, transformers_model
from imaging import encode, pattern


@pytest.fixture(scope="module")
def engines(cache_dir, loaded_model):
    """fp32 and int8 engines with small prefill chunks, so prompts prefill in several pieces (INT8
    loaded for them: the kernels measured at load are measured on pieces of that size)."""
    made = {}
    for quantization in ("fp32", "int8"):
        settings = make_settings(
            cache_dir, quantization=quantization, max_batch_size=4, prefill_chunk_tokens=24, cache_enabled=False
        )
        loaded = loaded_model("fp32") if quantization == "fp32" else load_model(settings)
        made[quantization] = Engine(loaded, settings)
    bf16_kv = make_settings(
        cache_dir,
        quantization="int8",
        max_batch_size=4,
        prefill_chunk_tokens=24,
        cache_enabled=False,
        kv_dtype="bfloat16",
    )
    made["int8, bf16 KV"] = Engine(made["int8"].loaded, bf16_kv)
    return made


def picture(engine, size=256, seed=0):
    return decode_image(encode(pattern(size, size, seed=seed), ".png"), engine.limits.image)


def request(parts, max_tokens=24, **params) -> GenerationRequest:
    return GenerationRequest(
        [ChatMessage("user", parts)], SamplingParams(max_tokens=max_tokens, **{"temperature": 0, **params})
    )


class Stream:
    """One request run through Engine.submit on its own thread, recording when each token arrived."""

    def __init__(self, engine: Engine, req: GenerationRequest, close_after: int | None = None):
        self.engine, self.request, self.close_after = engine, req, close_after
        self.arrivals: list[float] = []
        self.tokens_at_close = 0
        self.done: Completion | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)

    def start(self) -> Stream:
        self.thread.start()
        return self

    def _run(self):
        self.generation = generation = self.engine.submit(self.request)
        try:
            for event in generation:
                if isinstance(event, TextDelta):
                    self.arrivals.append(time.perf_counter())
                    if self.close_after is not None and len(self.arrivals) >= self.close_after:
                        self.tokens_at_close = generation.generated_tokens
                        return  # closed in `finally`: what the HTTP layer does when the client goes away
                else:
                    self.done = event
        except Exception as exc:  # the request's error, as its HTTP handler would see it
            self.error = exc
        finally:
            generation.close()

    def join(self) -> Stream:
        self.thread.join(120)
        assert not self.thread.is_alive()
        return self

    def token_ids(self) -> list[int]:
        return self.generation.token_ids


def alone(engine, req: GenerationRequest) -> list[int]:
    return Stream(engine, req).start().join().token_ids()


def wait_for_tokens(stream: Stream, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(stream.arrivals) < n:
        assert time.monotonic() < deadline and stream.thread.is_alive()
        time.sleep(0.002)


def prompts(engine):
    """Different lengths, pictures of different sizes: different rope deltas and KV lengths."""
    return [
        lambda: request([TextPart("Hi.")], max_tokens=30),
        lambda: request([ImagePart(picture(engine, 256)), TextPart("What is in this picture, in detail?")]),
        lambda: request(
            [TextPart("Tell me a long story about a red square and a blue circle, please.")], max_tokens=20
        ),
        lambda: request([ImagePart(picture(engine, 128, seed=2)), TextPart("And this one?")], max_tokens=28),
    ]


QUANTIZATIONS = pytest.mark.parametrize("quantization", ["fp32", "int8"])


@pytest.mark.parametrize("quantization", ["fp32", "int8", "int8, bf16 KV"])
def test_greedy_answers_decoded_together_equal_each_alone(engines, quantization, monkeypatch):
    engine = engines[quantization]
    makers = prompts(engine)
    expected = [alone(engine, make()) for make in makers]
    batch_sizes = []
    step = engine.scheduler._decode_step
    monkeypatch.setattr(
        engine.scheduler, "_decode_step", lambda: (batch_sizes.append(engine.scheduler.batch_size), step())
    )
    streams = [Stream(engine, make()).start() for make in makers]
    for s in streams:
        s.join()
    assert [s.token_ids() for s in streams] == expected
    assert max(batch_sizes) >= 3  # they really ran together


@QUANTIZATIONS
def test_a_request_joining_mid_way_answers_as_alone_and_does_not_wait_for_the_batch(engines, quantization):
    engine = engines[quantization]
    long_one = request([TextPart("Go on and on about squares.")], max_tokens=80)
    joiner = lambda: request([ImagePart(picture(engine, 192, seed=5)), TextPart("Describe it.")], max_tokens=16)
    expected = alone(engine, joiner())
    first = Stream(engine, long_one).start()
    wait_for_tokens(first, 10)
    second = Stream(engine, joiner()).start().join()
    assert second.token_ids() == expected
    assert first.thread.is_alive() and first.done is None  # it finished while the first one was still decoding
    first.join()
    assert first.token_ids() == alone(engine, request([TextPart("Go on and on about squares.")], max_tokens=80))


@QUANTIZATIONS
def test_a_sequence_cancelled_mid_way_leaves_at_once_and_the_others_stay_exact(engines, quantization):
    engine = engines[quantization]
    makers = prompts(engine)[:3]
    expected = [alone(engine, make()) for make in makers]
    quitter = Stream(engine, request([TextPart("Talk forever.")], max_tokens=200), close_after=4)
    streams = [Stream(engine, make()) for make in makers]
    for s in [quitter, *streams]:
        s.start()
    quitter.join()
    assert quitter.generation.status == "cancelled"
    # It left within a step of the close (one more token may have been in flight as it was read).
    assert len(quitter.token_ids()) <= quitter.tokens_at_close + 2
    assert [s.join().token_ids() for s in streams] == expected
    assert engine.scheduler.batch_size == 0 and not engine.admission.busy


@QUANTIZATIONS
def test_seeded_sampling_in_a_batch_equals_alone(engines, quantization):
    """Each sequence draws from its own generator: neighbours do not shift its random numbers."""
    engine = engines[quantization]

    def sampled(seed):
        return GenerationRequest(
            [ChatMessage("user", [TextPart("Make something up.")])],
            SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed),
        )

    expected = [alone(engine, sampled(seed)) for seed in (1, 2, 3)]
    streams = [Stream(engine, sampled(seed)).start() for seed in (1, 2, 3)]
    assert [s.join().token_ids() for s in streams] == expected
    assert len({tuple(e) for e in expected}) == 3


def test_a_temperature_so_small_that_the_scores_overflow_answers_greedily(engines):
    """Logits / 1e-45 are ±inf and their softmax NaN: the request gets the distribution's limit
    (the greedy answer), alone and in a batch, instead of an error."""
    engine = engines["fp32"]
    greedy = alone(engine, request([TextPart("Make something up.")]))
    tiny = [
        Stream(engine, request([TextPart("Make something up.")], temperature=1e-45, seed=s)).start() for s in (1, 2)
    ]
    neighbour = Stream(engine, request([TextPart("Hi.")], max_tokens=30)).start()
    assert [s.join().token_ids() for s in tiny] == [greedy, greedy]
    assert neighbour.join().error is None and [s.error for s in tiny] == [None, None]


@pytest.mark.parametrize("fail_at", [1, 5], ids=["first token", "mid-answer"])
def test_a_sampling_failure_ends_only_its_own_request(engines, monkeypatch, fail_at):
    """A failure while choosing one sequence's token (here injected for seed 666) ends that request
    with the error at once — it does not hang — and its batch neighbours answer as alone."""
    engine = engines["fp32"]
    makers = prompts(engine)[:2]
    expected = [alone(engine, make()) for make in makers]
    real_call, calls = Sampler.__call__, {"n": 0, "batch_at_failure": 0}

    def failing_for_seed_666(self, token_ids, logits, allowed=None):
        if self.generator.initial_seed() == 666:
            calls["n"] += 1
            if calls["n"] == fail_at:
                calls["batch_at_failure"] = engine.scheduler.batch_size
                raise RuntimeError("injected sampling failure")
        return real_call(self, token_ids, logits, allowed)

    monkeypatch.setattr(Sampler, "__call__", failing_for_seed_666)
    victim = Stream(engine, request([TextPart("Talk.")], max_tokens=40, seed=666))
    streams = [Stream(engine, make()) for make in makers]
    for s in [*streams, victim]:
        s.start()
    victim.join()
    assert isinstance(victim.error, RuntimeError) and "injected" in str(victim.error)
    assert len(victim.token_ids()) == fail_at - 1
    if fail_at > 1:  # it failed inside a decode step shared with its neighbours
        assert calls["batch_at_failure"] >= 2
    assert [s.join().token_ids() for s in streams] == expected
    assert engine.scheduler.batch_size == 0 and not engine.admission.busy


def test_prefill_of_a_newcomer_is_interleaved_with_the_batchs_decoding(engines):
    engine = engines["fp32"]
    runner = Stream(engine, request([TextPart("Keep talking.")], max_tokens=150)).start()
    wait_for_tokens(runner, 3)
    newcomer = Stream(engine, request([ImagePart(picture(engine, 448)), TextPart("What is it?")], max_tokens=2))
    submitted = time.perf_counter()
    newcomer.start().join()
    during = [t for t in runner.arrivals if submitted < t < newcomer.arrivals[0]]
    # Each vision block and each prompt piece is followed by a decode step of the runner (a delta
    # each, but for a token held back as an incomplete UTF-8 character).
    pieces = -(-newcomer.done.prompt_tokens // engine.settings.prefill_chunk_tokens)
    assert len(during) >= pieces - 2
    runner.generation.cancel()
    runner.join()


def test_beyond_the_batch_requests_wait_in_the_queue_and_beyond_the_queue_get_429(cache_dir, loaded_model):
    settings = make_settings(cache_dir, quantization="fp32", max_batch_size=2, queue_size=1)
    engine = Engine(loaded_model("fp32"), settings)
    running = [Stream(engine, request([TextPart("Go on.")], max_tokens=300)).start() for _ in range(2)]
    for s in running:
        wait_for_tokens(s, 2)
    waiter = Stream(engine, request([TextPart("Me next.")], max_tokens=3)).start()
    deadline = time.monotonic() + 10
    while (REGISTRY.get_sample_value("qwen3vl_queue_depth", {"priority": "default"}) or 0) < 1:  # the queue's gauge
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(QueueFull):
        engine.submit(request([TextPart("And me.")]))
    running[0].generation.cancel()
    waiter.join()
    assert waiter.done.completion_tokens == 3 and waiter.done.timings.queue_wait > 0
    running[1].generation.cancel()
    running[1].join()


def test_batch_size_one_runs_one_generation_at_a_time(cache_dir, loaded_model):
    settings = make_settings(cache_dir, quantization="fp32", max_batch_size=1)
    engine = Engine(loaded_model("fp32"), settings)
    streams = [Stream(engine, request([TextPart("hello")], max_tokens=30)).start() for _ in range(2)]
    a, b = sorted((s.join().arrivals for s in streams), key=lambda arrivals: arrivals[0])
    assert a[-1] <= b[0]


def test_a_closed_engine_leaves_no_scheduler_thread_and_ends_what_it_ran(cache_dir, loaded_model):
    """The CLI closes its engine before exiting: a scheduler thread left inside torch when the
    interpreter ends aborts the process ("terminate called without an active exception")."""
    engine = Engine(loaded_model("fp32"), make_settings(cache_dir, quantization="fp32"))
    before = {t for t in threading.enumerate() if t.name == "batch-scheduler"}
    finished = list(engine.generate(request([TextPart("hello")], max_tokens=3)))
    (scheduler,) = {t for t in threading.enumerate() if t.name == "batch-scheduler"} - before
    ends = engine.processor.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    endless = request([TextPart("hello")], max_tokens=1000, logit_bias={end: -100 for end in ends})
    running = Stream(engine, endless).start()
    while not running.arrivals:
        time.sleep(0.01)
    engine.close()
    assert isinstance(finished[-1], Completion) and not scheduler.is_alive()
    assert running.join().done.finish_reason == "cancelled"  # cut short by the close, not run to its end


def test_vision_tower_in_steps_equals_transformers_own_encoder(engines, tiny_dir):
    """Within float rounding: the tower's float operations are the fixed-order ones (float_ops.py)."""
    engine = engines["fp32"]
    prompt = prepared(engine, request([ImagePart(picture(engine, 320)), TextPart("x")]))
    with torch.inference_mode():
        own = transformers_model(tiny_dir).model.get_image_features(prompt.pixel_values[0], prompt.image_grid_thw)
    steps = run_to_end(image_steps(engine.vision_encoder, prompt.pixel_values[0], prompt.image_grid_thw))
    theirs = [own.pooler_output[0], *(layer[0] for layer in own.deepstack_features)]
    assert len(theirs) == len(steps.deepstack) + 1
    for a, b in zip([steps.pooler, *steps.deepstack], theirs):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_conversations_decoded_together_each_keep_their_kv_cache(fp32_engine, engines):
    """Every finished sequence leaves its KV cache in the conversation cache: second turns sent
    together reuse their own first turns and answer as an engine without caches."""
    fresh = engines["fp32"]  # caches off

    def turn(conversation, question, history=()):
        messages = [*history, ChatMessage("user", [TextPart(question)])]
        return GenerationRequest(messages, SamplingParams(max_tokens=12, temperature=0), conversation_id=conversation)

    questions = {"a": "Tell me about squares.", "b": "And what about circles, in a few words?"}
    firsts = {c: Stream(fp32_engine, turn(c, q)).start() for c, q in questions.items()}
    histories = {
        c: [ChatMessage("user", [TextPart(questions[c])]), ChatMessage("assistant", [TextPart(s.join().done.text)])]
        for c, s in firsts.items()
    }
    seconds = {c: Stream(fp32_engine, turn(c, "Go on.", histories[c])).start() for c in questions}
    for c, s in seconds.items():
        s.join()
        assert s.done.cached_tokens > 0
        assert s.token_ids() == alone(fresh, turn(c, "Go on.", histories[c]))
