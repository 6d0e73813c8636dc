"""Serving benchmarks at the engine level: start → ready and RSS, time to first token split into
image decode / vision encode / prefill, decode tokens/s against the memory-bandwidth ceiling, and
fp32 versus INT8 side by side. One fresh process per kind of weights (`measure`).
"""

from __future__ import annotations

import time

import psutil

from bench.harness import (
    GIB,
    encoded_photo,
    isolated,
    peak_rss_bytes,
    read_bandwidth_gbps,
    rss_bytes,
    seconds_since_process_start,
)

QUESTION = "Describe this picture in detail: what objects, colors and shapes are in it?"
DECODE_PROMPT = "Tell me a long story about a red square that travels across a blue sky to find a yellow circle."

KINDS = {  # label → (which checkpoint, QUANTIZATION)
    "int8 pre-quantized": ("int8", "int8"),
    "int8 quantized at load": ("source", "int8"),
    "fp32": ("source", "fp32"),
}


def weight_bytes_read_per_token(model) -> int:
    """Bytes of weights one decode step reads: every decoder and lm_head weight once; of the
    embedding only one row, so none of it."""
    from service.quant.int8_linear import Int8Linear, MappedInt8Linear

    lm = model.model.language_model
    embed = lm.get_input_embeddings()
    total = 0
    for module in [*lm.modules(), model.lm_head]:
        if module is embed:
            continue
        if isinstance(module, (Int8Linear, MappedInt8Linear)):
            total += module.in_features * module.out_features
        total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def measure(model_path: str, quantization: str, threads: int, image_max_pixels: int, decode_tokens: int) -> dict:
    """Start the engine in this fresh process, then time a 1080p-photo question and a decode run."""
    imports_from = seconds_since_process_start()
    import torch
    from transformers import StoppingCriteria

    from service.engine.engine import Engine, GenerationRequest, SamplingParams
    from service.media.images import decode_image
    from service.memory import kv_cache_bytes, release_memory, unreclaimable_bytes
    from service.model.loading import load_model
    from service.model.prompts import ChatMessage, ImagePart, TextPart, prepare_prompt
    from service.settings import load_settings

    imported = seconds_since_process_start()
    settings = load_settings(
        model_path=model_path,
        quantization=quantization,
        threads=threads,
        cache_enabled=False,
        image_max_pixels=image_max_pixels,
    )
    loaded = load_model(settings)
    engine = Engine(loaded, settings)
    ready = seconds_since_process_start()
    cpu = psutil.Process().cpu_times()
    out = dict(
        start_to_ready_s=ready,
        cpu_until_ready_s=cpu.user + cpu.system,
        python_and_imports_s=imported,
        harness_s=imports_from,
        load_s=loaded.load_seconds,
        peak_rss_start_gib=peak_rss_bytes() / GIB,
        rss_ready_gib=rss_bytes() / GIB,
    )

    def ask(jpeg: bytes, max_tokens: int):
        t0 = time.perf_counter()
        image = decode_image(jpeg, engine.limits.image)
        request = GenerationRequest(
            [ChatMessage("user", [ImagePart(image), TextPart(QUESTION)])],
            SamplingParams(max_tokens=max_tokens, temperature=0),
            received_at=t0,
        )
        prompt = prepare_prompt(engine.processor, request.messages, engine.limits.prompt)
        done = list(engine.generate(request))[-1]
        merge = loaded.processor.image_processor.merge_size**2
        return done, int(prompt.image_grid_thw.prod(-1).sum()) // merge

    ask(encoded_photo(".jpg", 640, 480), 2)  # warm-up
    done, visual_tokens = ask(encoded_photo(".jpg"), 1)
    t = done.timings
    out.update(
        image_decode_ms=t.image_decode * 1000,
        vision_encode_s=t.vision_encode,
        prefill_s=t.prefill,
        ttft_s=t.time_to_first_token,
        visual_tokens=visual_tokens,
        prompt_tokens=done.prompt_tokens,
    )

    class StepClock(StoppingCriteria):
        """Records when each token is ready (generate calls it once per token)."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = loaded.processor.tokenizer(DECODE_PROMPT, return_tensors="pt").input_ids
    clock = StepClock()
    loaded.model.model.rope_deltas = None
    with torch.inference_mode():
        loaded.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=decode_tokens,
            min_new_tokens=decode_tokens,
            do_sample=False,
            stopping_criteria=[clock],
        )
    decode_tps = (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])
    release_memory()
    out.update(
        steady_rss_gib=rss_bytes() / GIB,
        steady_unreclaimable_gib=unreclaimable_bytes() / GIB,
        peak_rss_serving_gib=peak_rss_bytes() / GIB,
        decode_tokens_per_s=decode_tps,
    )
    bandwidth = read_bandwidth_gbps(threads)
    mean_context = ids.shape[1] + decode_tokens / 2
    per_token = weight_bytes_read_per_token(loaded.model) + kv_cache_bytes(loaded.model.config, int(mean_context))
    ceiling = bandwidth * 1e9 / per_token
    out.update(
        read_bandwidth_gbps=bandwidth,
        bytes_per_token_gb=per_token / 1e9,
        ceiling_tokens_per_s=ceiling,
        share_of_ceiling=decode_tps / ceiling,
        weights_mapped=loaded.weights_mapped,
        int8_weight_gb=int8_weight_bytes(loaded.model) / 1e9,
        prepack_gbps_per_thread=prepack_rate_gbps(),
    )
    return out


def int8_weight_bytes(model) -> int:
    """Bytes of int8 weights the loader packs (every Int8Linear)."""
    from service.quant.int8_linear import Int8Linear

    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Int8Linear))


def prepack_rate_gbps(rows: int = 6144, cols: int = 2048, repeats: int = 3) -> float:
    """How fast torch packs int8 weights for FBGEMM, on one thread (one Linear packs serially)."""
    import torch

    from service.quant.int8_linear import Int8Linear

    weight = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
    scales = torch.full((rows,), 1e-3)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        Int8Linear(weight, scales, None)
        best = min(best, time.perf_counter() - t0)
    return rows * cols / best / 1e9


def run_kinds(kinds: list[str], source, int8, threads: int, image_max_pixels: int, decode_tokens: int) -> dict:
    from tqdm import tqdm

    results = {}
    for kind in tqdm(kinds, desc="weights", unit="process"):
        which, quantization = KINDS[kind]
        path = int8 if which == "int8" else source
        results[kind] = isolated(
            "bench.serving:measure",
            model_path=str(path),
            quantization=quantization,
            threads=threads,
            image_max_pixels=image_max_pixels,
            decode_tokens=decode_tokens,
        )
    return results


ROWS = {  # scenario → [(row label, result key, format)]
    "start": [
        ("start → ready (s, from process start)", "start_to_ready_s", "{:.2f}"),
        ("… of which Python + imports (s)", "python_and_imports_s", "{:.2f}"),
        ("… of which load_model (s)", "load_s", "{:.2f}"),
        ("CPU time until ready, all threads (s)", "cpu_until_ready_s", "{:.2f}"),
        ("peak RSS during start (GiB)", "peak_rss_start_gib", "{:.2f}"),
        ("RSS when ready (GiB)", "rss_ready_gib", "{:.2f}"),
        ("steady RSS after requests (GiB)", "steady_rss_gib", "{:.2f}"),
        ("… not reclaimable (RSS − file-backed) (GiB)", "steady_unreclaimable_gib", "{:.2f}"),
        ("peak RSS while serving (GiB)", "peak_rss_serving_gib", "{:.2f}"),
        ("int8 weights packed at start (GB)", "int8_weight_gb", "{:.2f}"),
        ("torch int8 prepack rate, one thread (GB/s)", "prepack_gbps_per_thread", "{:.3f}"),
    ],
    "ttft": [
        ("visual tokens (1920×1080 JPEG)", "visual_tokens", "{}"),
        ("prompt tokens", "prompt_tokens", "{}"),
        ("image decode (ms)", "image_decode_ms", "{:.1f}"),
        ("vision encode (s)", "vision_encode_s", "{:.2f}"),
        ("prefill (s)", "prefill_s", "{:.2f}"),
        ("time to first token (s)", "ttft_s", "{:.2f}"),
    ],
    "decode": [
        ("decode (tokens/s)", "decode_tokens_per_s", "{:.2f}"),
        ("weights + KV read per token (GB)", "bytes_per_token_gb", "{:.3f}"),
        ("read bandwidth, same run (GB/s)", "read_bandwidth_gbps", "{:.1f}"),
        ("bandwidth ceiling (tokens/s)", "ceiling_tokens_per_s", "{:.2f}"),
        ("decode / ceiling", "share_of_ceiling", "{:.0%}"),
    ],
}


def table(results: dict, scenarios: list[str]) -> str:
    from bench.results import markdown_table

    kinds = list(results)
    rows = [[label, *(fmt.format(results[k][key]) for k in kinds)] for s in scenarios for label, key, fmt in ROWS[s]]
    return markdown_table(["", *kinds], rows)
