"""Decode time per token vs context length: transformers' DynamicCache (torch.cat at every step)
against service.caches.kv.GrowingCache (writes into spare room), same model, same process, alternating.

Decision record, frozen at commit 1c7f47a (bench/RESULTS.md § "KV cache: appending in place vs
torch.cat"): the engine's KV cache grows in place since. Rerun it as it was there:

    git worktree add /tmp/kv-record 1c7f47a && cd /tmp/kv-record
    flock /tmp/heavy.lock python -m bench.bench_kv [--contexts 64 1024 3072] [--no-save]
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from bench.core.harness import parse, parser
from bench.core.results import markdown_table, report


def decode_ms(model, cache, context: int, steps: int) -> float:
    """Prefill `context` random tokens into `cache` (pieces of 512), then the median ms of `steps`
    greedy one-token steps after two warm-up steps."""
    ids = torch.randint(0, model.config.text_config.vocab_size, (1, context))
    for start in range(0, context, 512):
        end = min(context, start + 512)
        out = model(
            input_ids=ids[:, start:end],
            position_ids=torch.arange(start, end).view(1, 1, -1).expand(3, 1, -1),
            cache=cache,
            logits_to_keep=1,
        )
    token, times = out.logits[:, -1].argmax(-1, keepdim=True), []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        out = model(
            input_ids=token, position_ids=torch.tensor([[[context + i]]]).expand(3, 1, 1), cache=cache, logits_to_keep=1
        )
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1000


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 3072])
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per measurement")
    args = parse(p, argv)
    from transformers import DynamicCache

    from service.caches.kv import HEADROOM, GrowingCache
    from service.model.loading import load_model
    from service.settings import load_settings

    model_path = args.model_path
    settings = load_settings(
        model_path=model_path, quantization=args.quantization, threads=args.threads, cache_enabled=False
    )
    model = load_model(settings).model
    rows = []
    kinds = {"plain": DynamicCache, "growing": GrowingCache}
    with torch.inference_mode():
        decode_ms(model, DynamicCache(config=model.config), 64, 2)  # warm-up: first-touch page faults
        with tqdm(args.contexts, desc="contexts", unit="context") as bar:
            for context in bar:
                best = {}
                for kind in ("plain", "growing", "growing", "plain"):  # ABBA: drift falls on both alike
                    ms = decode_ms(model, kinds[kind](config=model.config), context, args.steps)
                    best[kind] = min(best.get(kind, ms), ms)
                rows.append([context, best["plain"], best["growing"], f"{best['plain'] / best['growing']:.2f}×"])
    table = markdown_table(["context tokens", "DynamicCache ms/token", "GrowingCache ms/token", "speed-up"], rows)
    note = (
        f"Median of {args.steps} greedy decode steps after the prompt (random tokens, prefilled in pieces of "
        f"512); each cache measured twice per context in ABBA order in one process, the better of the two "
        f"shown; HEADROOM={HEADROOM}."
    )
    return report(
        args,
        "KV cache: appending in place vs torch.cat",
        {"MODEL_PATH": model_path.name, "QUANTIZATION": args.quantization, "THREADS": args.threads},
        table + "\n\n" + note,
    )


if __name__ == "__main__":
    raise SystemExit(main())
