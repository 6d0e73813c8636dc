"""Per-token INT8 against the code before it: time to first token and single-stream decode, one run.

    flock /tmp/heavy.lock python -m bench.bench_int8 [--baseline REV] [--rounds 2]

Four kinds of engine, each in a fresh process, in the order A B C D D C B A per round (so drift in
the machine's speed affects all alike), on the same pre-quantized 2B-shaped checkpoint, caches off:
- `baseline`: the `service` package as it was at REV (default 6ed1729, the commit before per-token
  INT8), i.e. torch's dynamic Linear (activations quantized per tensor), q/k/v and gate/up apart;
- `fused, per-tensor`: today's code with every Int8Linear switched to per-tensor activations;
- `fused, per-token`: today's Linears as shipped; these three keep fp32 keys and values, as REV;
- `fused, per-token, bf16 KV`: today's defaults (KV_DTYPE=bfloat16).
TTFT = the engine's `time_to_first_token` for one 448×448 picture and a question (W1, median of
3); decode = the engine's decode tokens/s over 64 greedy tokens of a text prompt (median of 3).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

from tqdm import tqdm

from bench.harness import (
    add_checkpoint_args,
    checkpoint_of,
    encoded_photo,
    image_limits_of,
    isolated,
    short_rev,
    timing,
    tree_at,
)
from bench.results import append_section, markdown_table

BASELINE = "6ed1729"  # the last commit with torch's per-tensor dynamic Linear
QUESTION = "What is in this picture? Describe the objects, their colours and where they are."
DECODE_PROMPT = "Tell me a long story about a red square that travels across a blue sky to find a yellow circle."


def measure(
    model_path: str,
    threads: int,
    activations: str | None = None,
    repeats: int = 3,
    decode_tokens: int = 64,
    max_memory_mb: int | None = None,
    mapped_activations: str | None = None,
    kv_dtype: str | None = None,
) -> dict:
    """W1 time to first token and decode tokens/s of one engine (this process's `service`), and the
    greedy decode's tokens. `activations`: switch the Int8Linears (per_token, per_tensor);
    `mapped_activations`: those of memory-mapped weights (a MAX_MEMORY_MB too small for packed ones);
    `kv_dtype`: KV_DTYPE (None: the default; code older than the setting has fp32 only)."""
    from service.engine.engine import Engine, GenerationRequest, SamplingParams
    from service.media.images import decode_image
    from service.model.loading import load_model
    from service.model.prompts import ChatMessage, ImagePart, TextPart
    from service.settings import load_settings

    settings = load_settings(
        model_path=model_path,
        quantization="int8",
        threads=threads,
        cache_enabled=False,
        max_memory_mb=max_memory_mb,
        **({"kv_dtype": kv_dtype} if kv_dtype else {}),
        **({"int8_kernel": "fbgemm"} if activations else {}),  # per-tensor activations: torch's kernels only
    )
    loaded = load_model(settings)
    if activations is not None:
        from service.quant.int8_linear import set_activations

        set_activations(loaded.model, activations)
    if mapped_activations is not None:
        from service.quant.int8_linear import MappedInt8Linear

        for module in loaded.model.modules():
            if isinstance(module, MappedInt8Linear):
                module.activations = mapped_activations
    engine = Engine(loaded, settings)

    def ask(parts, max_tokens):
        request = GenerationRequest([ChatMessage("user", parts)], SamplingParams(max_tokens=max_tokens, temperature=0))
        done = list(engine.generate(request))[-1]
        if not getattr(done, "token_ids", None):  # code older than Completion.token_ids
            done.token_ids = request.streamer.token_ids
        return done

    picture = decode_image(encoded_photo(".jpg", 448, 448), image_limits_of(engine))
    for _ in range(2):  # steady state: the first requests of a size also pay the allocator's growth
        ask([ImagePart(picture), TextPart("Warm-up.")], 2)
    w1 = [ask([ImagePart(picture), TextPart(QUESTION)], 1) for _ in range(repeats)]
    decode = [ask([TextPart(DECODE_PROMPT)], decode_tokens) for _ in range(repeats)]
    return {
        "ttft_s": statistics.median(timing(d, "time_to_first_token") for d in w1),
        "prefill_s": statistics.median(timing(d, "prefill") for d in w1),
        "vision_s": statistics.median(timing(d, "vision_encode") for d in w1),
        "prompt_tokens": w1[0].prompt_tokens,
        "decode_tokens_per_s": statistics.median(timing(d, "decode_tokens_per_s") for d in decode),
        "decoded_tokens": decode[0].completion_tokens,
        "tokens": decode[0].token_ids,
        "mapped": loaded.weights_mapped,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(p)
    p.add_argument("--baseline", default=BASELINE, help="git revision of the code to compare with")
    p.add_argument("--rounds", type=int, default=2, help="of A B C D D C B A")
    p.add_argument("--revision", default=None, help="git revision for the fused rows (default: the working tree)")
    args = p.parse_args(argv)
    model_path = checkpoint_of(args)
    # (activations, KV_DTYPE): fp32 keys and values as the baseline has, so the rows compare the Linears;
    # the last row is the shipped default (bf16 keys and values), whose cost bench_decode measures too.
    kinds = {
        "baseline": (None, None),
        "fused, per-tensor": ("per_tensor", "float32"),
        "fused, per-token": ("per_token", "float32"),
        "fused, per-token, bf16 KV (the defaults)": ("per_token", "bfloat16"),
    }
    order = [*kinds, *reversed(kinds)] * args.rounds
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    with contextlib.ExitStack() as stack:
        base_tree = stack.enter_context(tree_at(args.baseline))
        now_tree = stack.enter_context(tree_at(args.revision)) if args.revision else None
        for kind in tqdm(order, desc="engines", unit="process"):
            results[kind].append(
                isolated(
                    "bench.bench_int8:measure",
                    tree=base_tree if kind == "baseline" else now_tree,
                    model_path=str(model_path),
                    threads=args.threads,
                    activations=kinds[kind][0],
                    kv_dtype=kinds[kind][1],
                )
            )
    base = {key: statistics.median(r[key] for r in results["baseline"]) for key in ("ttft_s", "decode_tokens_per_s")}
    rows = []
    for kind, runs in results.items():
        med = {
            key: statistics.median(r[key] for r in runs)
            for key, value in runs[0].items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)  # not the token ids, not flags
        }
        rows.append(
            [
                f"{kind} ({short_rev(args.baseline)})" if kind == "baseline" else kind,
                med["prompt_tokens"],
                med["vision_s"],
                med["prefill_s"],
                med["ttft_s"],
                f"{med['ttft_s'] / base['ttft_s']:.3f}",
                med["decode_tokens_per_s"],
                f"{med['decode_tokens_per_s'] / base['decode_tokens_per_s']:.3f}",
            ]
        )
    per_token = rows[2]  # the Linear change alone, against the baseline's fp32 keys and values
    body = markdown_table(
        [
            "engine",
            "W1 prompt tokens",
            "vision encode (s)",
            "prefill (s)",
            "TTFT (s)",
            "TTFT vs baseline",
            "decode (tok/s)",
            "decode vs baseline",
        ],
        rows,
    ) + (
        f"\n\nMedians over {len(order) // len(kinds)} processes per kind (order A B C D D C B A), each the median of 3 "
        f"requests. Targets (fp32 keys and values, as the baseline): per-token TTFT <= 1.10x the baseline's: "
        f"{per_token[5]} ({'met' if float(per_token[5]) <= 1.10 else 'missed'}); decode >= the baseline's: "
        f"{per_token[7]} ({'met' if float(per_token[7]) >= 1.0 else 'missed'})."
    )
    append_section(
        "Per-token INT8 against per-tensor: time to first token and decode (bench/bench_int8.py)",
        {
            "MODEL_PATH": model_path.name,
            "THREADS": args.threads,
            "caches": "off",
            "KV_DTYPE": "float32 but in the last row",
            "decode": "64 greedy tokens",
            "W1": "448x448 JPEG + question",
        },
        body,
        threads=args.threads,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
