"""INT8_KERNEL=auto against each kernel forced: does the measurement at start pick the fastest?

    flock /tmp/heavy.lock python -m bench.bench_kernels [--rounds 2]

Each kind (auto, fbgemm, onednn, native) is an engine in a fresh process, in the order A B C D D C B A
per round, on the pre-quantized 2B-shaped checkpoint, caches off: the first token of a 448×448 JPEG
and a question (median of 3, a new picture each time), and the engine's own decode tokens/s over 128
greedy tokens of a short text prompt (end of turn biased away; median of 3). `auto` reads the
measurement kept in CACHE_DIR (the first process measures it), as a restarted server does.
"""

from __future__ import annotations

import argparse
import statistics

from tqdm import tqdm

from bench.harness import add_checkpoint_args, checkpoint_of, encoded_photo, image_limits_of, isolated, timing
from bench.results import append_section, markdown_table

KINDS = ("auto", "fbgemm", "onednn", "native")
QUESTION = "What is in this picture? Describe the objects, their colours and where they are."
DECODE_PROMPT = "Tell me a long story about a red square that travels across a blue sky to find a yellow circle."


def measure(model_path: str, threads: int, kernel: str, repeats: int = 3) -> dict:
    from service.engine.engine import Engine, GenerationRequest, SamplingParams
    from service.media.images import decode_image
    from service.model.loading import load_model
    from service.model.prompts import ChatMessage, ImagePart, TextPart
    from service.settings import load_settings

    settings = load_settings(
        model_path=model_path, quantization="int8", threads=threads, cache_enabled=False, int8_kernel=kernel
    )
    loaded = load_model(settings)
    engine = Engine(loaded, settings)
    tokenizer = engine.processor.tokenizer
    no_end = {tokenizer.convert_tokens_to_ids(t): -100 for t in ("<|im_end|>", "<|endoftext|>")}

    def ask(parts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=no_end)
        return list(engine.generate(GenerationRequest([ChatMessage("user", parts)], params)))[-1]

    def picture(seed):
        return decode_image(encoded_photo(".jpg", 448, 448, seed=seed), image_limits_of(engine))

    ask([ImagePart(picture(999)), TextPart("Warm-up.")], 2)
    first = [ask([ImagePart(picture(seed)), TextPart(QUESTION)], 1) for seed in range(repeats)]
    decode = [ask([TextPart(DECODE_PROMPT)], 128) for _ in range(repeats)]
    return {
        "decoder": loaded.kernels.decoder,
        "vision": loaded.kernels.vision,
        "ttft_s": statistics.median(timing(d, "time_to_first_token") for d in first),
        "decode_tokens_per_s": statistics.median(timing(d, "decode_tokens_per_s") for d in decode),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(p)
    p.add_argument("--rounds", type=int, default=2, help="of A B C D D C B A")
    args = p.parse_args(argv)
    model_path = checkpoint_of(args)
    order = [*KINDS, *reversed(KINDS)] * args.rounds
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    for kind in tqdm(order, desc="engines", unit="process"):
        results[kind].append(
            isolated("bench.bench_kernels:measure", model_path=str(model_path), threads=args.threads, kernel=kind)
        )
    med = {
        k: {key: statistics.median(r[key] for r in runs) for key in ("ttft_s", "decode_tokens_per_s")}
        for k, runs in results.items()
    }
    forced = [k for k in KINDS if k != "auto"]
    fastest = max(forced, key=lambda k: med[k]["decode_tokens_per_s"])
    quickest = min(forced, key=lambda k: med[k]["ttft_s"])
    rows = [
        [
            kind,
            f"{results[kind][0]['decoder']} / {results[kind][0]['vision']}",
            med[kind]["ttft_s"],
            f"{med[kind]['ttft_s'] / med[quickest]['ttft_s']:.2f}",
            med[kind]["decode_tokens_per_s"],
            f"{med[kind]['decode_tokens_per_s'] / med[fastest]['decode_tokens_per_s']:.2f}",
        ]
        for kind in KINDS
    ]
    ratio = med["auto"]["decode_tokens_per_s"] / med[fastest]["decode_tokens_per_s"]
    body = markdown_table(
        [
            "INT8_KERNEL",
            "serving decoder / vision",
            "first token (s)",
            "vs the quickest forced",
            "decode (tok/s)",
            "vs the fastest forced",
        ],
        rows,
    ) + (
        f"\n\nMedians over {args.rounds * 2} processes per kind (order A B C D D C B A), each the median of 3 "
        "requests. "
        f"Target: auto decode >= 0.97x the fastest forced kernel ({fastest}): {ratio:.2f} "
        f"({'met' if ratio >= 0.97 else 'missed'})."
    )
    append_section(
        "INT8 kernels: the measured choice against each forced (bench/bench_kernels.py)",
        {"MODEL_PATH": model_path.name, "THREADS": args.threads, "caches": "off", "W1": "448x448 JPEG + question"},
        body,
        threads=args.threads,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
