"""Priorities and exact preemption on the real tiny model (service/engine/admission.py, the
scheduler): the most urgent request is served first, an urgent prefill runs before less urgent
streams decode, a full batch of less urgent sequences gives up a place — and the paused sequence's
answer is the same bits as if it had never been paused (greedy, seeded, under a grammar; INT8 and
4-bit, with exact speculation on), its kept keys and values too."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
from test_batching import Stream, wait_for_tokens
from test_caches import image
from test_structured import RECEIPT

from service.answer.structured import json_grammar
from service.engine.admission import Admission
from service.engine.engine import Engine
from service.errors import QueueFull, Unavailable
from service.generation import Completion, GenerationRequest, SamplingParams
from service.model.prompts import ChatMessage, ImagePart, TextPart

from conftest import weights_settings

BACKGROUND, URGENT = 5, -1


def request(parts, priority=0, conversation_id=None, **params) -> GenerationRequest:
    sampling = SamplingParams(**{"max_tokens": 40, "temperature": 0, "logprobs": 2, **params})
    return GenerationRequest([ChatMessage("user", parts)], sampling, priority=priority, conversation_id=conversation_id)


def run(engine: Engine, req: GenerationRequest) -> Completion:
    return [e for e in engine.generate(req) if isinstance(e, Completion)][0]


def same_bits(a: Completion, b: Completion) -> bool:
    """The same tokens, and every logprob and alternative equal as floats."""
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


def one_place(cache_dir, loaded_model, weights, **overrides) -> Engine:
    """An engine whose batch holds one sequence: any more urgent request must take its place."""
    loaded = loaded_model(weights)  # first: it writes the 4-bit checkpoint the settings name
    settings = weights_settings(
        cache_dir, weights, **{"max_batch_size": 1, "queue_size": 4, "prefill_chunk_tokens": 24, **overrides}
    )
    return Engine(loaded, settings)


class StatusWatch:
    """Every status a generation shows, sampled from a thread of its own until stopped."""

    def __init__(self, stream: Stream):
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(stream,), daemon=True)
        self._thread.start()

    def _watch(self, stream: Stream) -> None:
        while not self._stop.is_set():
            generation = getattr(stream, "generation", None)
            if generation is not None:
                self.seen.add(generation.status)
            time.sleep(0.0005)

    def stop(self) -> set[str]:
        self._stop.set()
        self._thread.join()
        return self.seen


def background_request(engine, kind: str, conversation_id=None) -> GenerationRequest:
    parts = [ImagePart(image(engine, 160, 128, seed=4)), TextPart("Describe the picture, with every detail.")]
    made = request(parts, BACKGROUND, conversation_id)
    if kind == "seeded":
        made = request(parts, BACKGROUND, conversation_id, temperature=0.9, top_p=0.95, seed=7)
    if kind == "grammar":
        made = replace(request(parts, BACKGROUND, conversation_id, max_tokens=80), grammar=json_grammar(RECEIPT, "x"))
    return made


def urgent_request() -> GenerationRequest:
    return request([TextPart("Quick: name a colour.")], URGENT, max_tokens=24)


def preempted_run(engine: Engine, low: GenerationRequest, after_tokens: int = 5) -> tuple[Completion, Completion, set]:
    """`low` runs alone until it has streamed `after_tokens` pieces; then an urgent request arrives
    and takes its place. Returns both Completions and the statuses `low` showed."""
    low_stream = Stream(engine, low).start()
    watch = StatusWatch(low_stream)
    wait_for_tokens(low_stream, after_tokens)
    urgent_stream = Stream(engine, urgent_request()).start()
    urgent_stream.join()
    low_stream.join()
    seen = watch.stop()
    assert low_stream.error is None and urgent_stream.error is None
    return low_stream.done, urgent_stream.done, seen


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["greedy", "seeded", "grammar"])
def test_a_paused_answer_has_the_bits_of_one_never_paused(cache_dir, loaded_model, weights, kind):
    engine = one_place(cache_dir, loaded_model, weights, cache_enabled=False)
    expected_low = run(engine, background_request(engine, kind))
    expected_urgent = run(engine, urgent_request())
    assert expected_low.completion_tokens > 10 and expected_low.preempted == 0

    low, urgent, seen = preempted_run(engine, background_request(engine, kind))
    assert low.preempted == 1 and low.timings.paused > 0 and "paused" in seen
    assert urgent.preempted == 0 and urgent.timings.queue_wait < 1.0  # it did not wait for `low` to end
    assert same_bits(low, expected_low)
    assert same_bits(urgent, expected_urgent)
    if kind == "grammar":
        assert low.text.startswith("{")
    assert not engine.admission.busy and engine.scheduler.batch_size == 0


def test_a_paused_sequence_keeps_the_bits_of_its_keys_and_values(cache_dir, loaded_model):
    """The conversation cache a preempted answer leaves is the bits of the one an uninterrupted answer leaves."""
    paused_engine = one_place(cache_dir, loaded_model, "int8", kv_dtype="float32")
    plain_engine = one_place(cache_dir, loaded_model, "int8", kv_dtype="float32")
    low, _, _ = preempted_run(paused_engine, background_request(paused_engine, "greedy", "kept"))
    plain = run(plain_engine, background_request(plain_engine, "greedy", "kept"))
    assert low.preempted == 1 and same_bits(low, plain)
    a, b = (e.caches.kv.memory.entries.peek("id:kept") for e in (paused_engine, plain_engine))
    assert torch.equal(a.token_ids, b.token_ids) and len(a.cache.layers) > 0
    assert all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.cache.layers, b.cache.layers)
    )


def test_waiters_are_served_most_urgent_first(cache_dir, loaded_model, no_end_of_turn):
    """One place, held by a priority-0 stream; requests of priorities 3, 1, 2 wait (less urgent than
    the holder: none preempts) and get the place in the order 1, 2, 3."""
    engine = one_place(cache_dir, loaded_model, "int8", cache_enabled=False)
    holder = Stream(engine, request([TextPart("Go on.")], 0, max_tokens=400, logit_bias=no_end_of_turn)).start()
    wait_for_tokens(holder, 2)
    waiters = {}
    for priority in (3, 1, 2):
        waiters[priority] = Stream(engine, request([TextPart(f"Priority {priority}.")], priority, max_tokens=3)).start()
        deadline = time.monotonic() + 10
        while sum(1 for t in engine.admission._waiting) < len(waiters):  # queued before the next arrives
            assert time.monotonic() < deadline
            time.sleep(0.005)
    holder.generation.cancel()
    done = {p: s.join().done for p, s in waiters.items()}
    holder.join()
    first_tokens = {p: waiters[p].arrivals[0] for p in waiters}
    assert sorted(first_tokens, key=first_tokens.get) == [1, 2, 3]
    assert all(d.preempted == 0 for d in done.values())


def test_an_urgent_prefill_runs_before_less_urgent_streams_decode(cache_dir, loaded_model, no_end_of_turn):
    """While a more urgent request prefills (a picture: several vision and prompt steps), a background
    stream gets no decode steps; a newcomer of its own priority shares the steps with it instead."""
    settings = weights_settings(cache_dir, "int8", max_batch_size=4, prefill_chunk_tokens=16, cache_enabled=False)
    engine = Engine(loaded_model("int8"), settings)

    def tokens_during_prefill(priority: int, seed: int) -> int:
        streamer = Stream(engine, request([TextPart("Go on.")], BACKGROUND, max_tokens=2000, logit_bias=no_end_of_turn))
        streamer.start()
        wait_for_tokens(streamer, 3)
        parts = [ImagePart(image(engine, 224, 224, seed=seed)), TextPart("What is in this picture?")]
        newcomer = Stream(engine, request(parts, priority, max_tokens=2))
        done = newcomer.start().join().done
        first = newcomer.arrivals[0]
        streamer.generation.cancel()
        streamer.join()
        # the scheduler's work on it: its cache lookup, vision encoder and prompt steps (not its picture's
        # decoding and tokenizing, on its own thread before it queues: a loaded machine stretches those)
        timings = done.timings
        started = first - (timings.cache_lookup + timings.vision_encode + timings.prefill)
        return sum(1 for t in streamer.arrivals if started < t < first)

    assert tokens_during_prefill(URGENT, seed=11) <= 1  # at most the step already under way
    assert tokens_during_prefill(BACKGROUND, seed=12) >= 3


def test_paused_requests_do_not_count_against_the_queue(cache_dir, loaded_model, no_end_of_turn):
    """No queue at all: an urgent request still gets in (it takes a place), a third one gets a 429."""
    engine = one_place(cache_dir, loaded_model, "int8", cache_enabled=False, queue_size=0)
    low = Stream(engine, request([TextPart("Go on.")], BACKGROUND, max_tokens=400, logit_bias=no_end_of_turn)).start()
    wait_for_tokens(low, 2)
    urgent = Stream(engine, request([TextPart("Go on.")], URGENT, max_tokens=400, logit_bias=no_end_of_turn)).start()
    wait_for_tokens(urgent, 2)
    assert low.generation.status == "paused"
    with pytest.raises(QueueFull):
        engine.submit(request([TextPart("And me.")], BACKGROUND))
    low.generation.cancel()  # cancelled while paused: it ends, and gives nothing back twice
    low.join()
    assert low.done.finish_reason == "cancelled" and low.done.preempted == 1
    urgent.generation.cancel()
    urgent.join()
    assert not engine.admission.busy and engine.scheduler.batch_size == 0


def test_requests_of_one_priority_arriving_moments_apart_never_pause_each_other():
    """An older request of the same priority that reaches admission after a younger one (its picture
    took longer to decode) waits: only a less urgent priority gives up a running request's place."""
    admission = Admission(queue_size=1, timeout=1, slots=1, aging=30.0)
    now = time.perf_counter()
    younger = admission.acquire(0, now)
    with pytest.raises(Unavailable):
        admission.acquire(0, now - 0.5)  # half a second older: waits for the place, then times out
    assert younger.holds and not younger.paused and younger.preempted == 0
    assert admission.acquire(-1).holds and younger.paused  # one level more urgent: takes it


def test_nothing_waits_forever_a_request_grows_more_urgent_as_it_waits():
    """Urgency is priority minus one per `aging` seconds in the server: a priority-10 request that
    arrived 11 agings ago goes before a priority-0 one that arrives now."""
    admission = Admission(queue_size=4, timeout=10, slots=1, aging=1.0)
    holder = admission.acquire(-100)  # more urgent than either waiter: neither takes its place
    order, threads = [], []

    def waiter(name, priority, arrived):
        ticket = admission.acquire(priority, arrived)
        order.append(name)
        admission.release(ticket)

    now = time.perf_counter()
    for name, priority, arrived in (("old background", 10, now - 11), ("new default", 0, now)):
        threads.append(threading.Thread(target=waiter, args=(name, priority, arrived)))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while len(admission._waiting) < len(threads):
            assert time.monotonic() < deadline
            time.sleep(0.001)
    admission.release(holder)
    for t in threads:
        t.join(5)
    assert order == ["old background", "new default"]
    # a holder that has aged past a newcomer's urgency keeps its place; a fresh one gives it up
    aged = Admission(queue_size=0, timeout=1, slots=1, aging=1.0)
    aged.acquire(10, time.perf_counter() - 11)  # urgency -1
    with pytest.raises(QueueFull):
        aged.acquire(0)  # urgency 0: no place to take, no queue
    fresh = Admission(queue_size=0, timeout=1, slots=1, aging=1.0)
    paused = fresh.acquire(10)
    assert fresh.acquire(0).holds and paused.paused and not paused.holds
