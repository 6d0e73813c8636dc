"""One engine in this process, its settings and model loaded as the service loads them, and `ask()`."""

from __future__ import annotations

import statistics

from bench.core.harness import concurrently
from bench.core.inputs import DECODE_PROMPT, QUESTION, encoded_photo


def growing_cache(config, dtype=None):
    """The engine's KV cache class, empty: bench's one import of it (`service.model.kv` today)."""
    from service.model.kv import GrowingCache

    return GrowingCache(config=config, **({"dtype": dtype} if dtype is not None else {}))


class Session:
    """An Engine on `model_path` with the service's settings, `settings` changed (by default INT8,
    caches off); `loaded`: share weights another Session loaded."""

    def __init__(self, model_path, threads: int = 2, loaded=None, **settings):
        from service.engine.engine import Engine
        from service.model.loading import load_model, warm_up
        from service.settings import load_settings

        self._given = {"model_path": model_path, "threads": threads, "quantization": "int8", "cache_enabled": False}
        self._given.update(settings)
        self.settings = load_settings(**self._given)
        if loaded is None:  # as a server serves once warm: the measured kernels' layouts packed
            loaded = load_model(self.settings)
            packing = warm_up(loaded)
            if packing is not None:
                packing.join()
        self.loaded = loaded
        self.engine = Engine(self.loaded, self.settings)
        self.model, self.processor = self.loaded.model, self.loaded.processor
        self.tokenizer = self.processor.tokenizer

    def variant(self, **settings) -> Session:
        """Another engine on the same weights, with `settings` changed."""
        return Session(**{**self._given, **settings}, loaded=self.loaded)

    def picture(self, seed: int = 0, width: int = 448, height: int | None = None):
        """A photo-like JPEG, decoded as a request's picture is."""
        from service.media.images import decode_image

        return decode_image(encoded_photo(".jpg", width, height or width, seed), self.engine.limits.image)

    @staticmethod
    def message(*parts, role: str = "user"):
        """A ChatMessage of `parts`: strings become text, decoded pictures and videos their parts."""
        from service.media.video import DecodedVideo
        from service.model.prompts import ChatMessage, ImagePart, TextPart, VideoPart

        def part(p):
            if isinstance(p, str):
                return TextPart(p)
            return VideoPart(p) if isinstance(p, DecodedVideo) else ImagePart(p)

        return ChatMessage(role, [part(p) for p in parts])

    def request(self, *parts, messages=None, max_tokens: int = 1, temperature: float = 0, **kwargs):
        """A GenerationRequest of `parts` (or `messages`); `kwargs` go to SamplingParams, or to the
        request where they are its fields (received_at, conversation_id, grammar, tools)."""
        from service.engine.engine import GenerationRequest, SamplingParams

        fields = ("received_at", "conversation_id", "grammar", "tools")
        extra = {k: kwargs.pop(k) for k in fields if k in kwargs}
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, **kwargs)
        return GenerationRequest(messages or [self.message(*parts)], params, **extra)

    def ask(self, *parts, **kwargs):
        """The Completion (text, token ids, counts, `timings`) of one request (see `request`)."""
        from service.engine.engine import Completion

        events = self.engine.generate(self.request(*parts, **kwargs))
        return [e for e in events if isinstance(e, Completion)][-1]

    def together(self, requests: list[dict]) -> tuple[list, float]:
        """`ask(*r["parts"], **the rest of r)` for every r at once, each on its own thread: the
        Completions, and the wall time."""
        calls = [lambda r=r: self.ask(*r["parts"], **{k: v for k, v in r.items() if k != "parts"}) for r in requests]
        return concurrently(calls)

    def no_end_of_turn(self) -> dict[int, float]:
        """A logit bias that keeps an answer from ending, so it runs to max_tokens."""
        return {self.tokenizer.convert_tokens_to_ids(t): -100 for t in ("<|im_end|>", "<|endoftext|>")}

    @staticmethod
    def described(decode_tokens: int = 64) -> dict[str, str]:
        """What `first_token_and_decode` measures, for a section's settings line."""
        return {"W1": "448x448 JPEG + question", "decode": f"{decode_tokens} greedy tokens"}

    def first_token_and_decode(self, repeats: int = 3, decode_tokens: int = 64, new_pictures: bool = False) -> dict:
        """The engine's time to first token of a 448×448 photo and a question (W1: median of
        `repeats`; `new_pictures`: a new one each time, else one picture, end of turn allowed) and
        its decode tokens/s over `decode_tokens` greedy tokens of a text prompt (median of `repeats`;
        with `new_pictures`, end of turn biased away)."""
        bias = self.no_end_of_turn() if new_pictures else None
        picture = self.picture(999)
        for _ in range(1 if new_pictures else 2):  # steady state: first requests of a size grow the allocator
            self.ask(picture, "Warm-up.", max_tokens=2)
        w1 = [self.ask(self.picture(i if new_pictures else 0), QUESTION) for i in range(repeats)]
        decode = [self.ask(DECODE_PROMPT, max_tokens=decode_tokens, logit_bias=bias) for _ in range(repeats)]
        return {
            "ttft_s": statistics.median(d.timings.time_to_first_token for d in w1),
            "prefill_s": statistics.median(d.timings.prefill for d in w1),
            "vision_s": statistics.median(d.timings.vision_encode for d in w1),
            "prompt_tokens": w1[0].prompt_tokens,
            "decode_tokens_per_s": statistics.median(d.timings.decode_tokens_per_s for d in decode),
            "tokens": list(decode[0].token_ids),
        }
