"""Decode time per token vs context length: transformers' DynamicCache (torch.cat at every step)
against service.caches.kv.GrowingCache (writes into spare room), same model, same process, alternating.

    flock /tmp/heavy.lock python -m bench.bench_kv            # 2B-shaped INT8 checkpoint
    python -m bench.bench_kv --contexts 64 1024 --no-save
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import add_checkpoint_args, checkpoint_of  # noqa: E402
from bench.results import append_section, markdown_table  # noqa: E402


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(p)
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 3072])
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per measurement")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    from transformers import DynamicCache

    from service.caches.kv import HEADROOM, GrowingCache
    from service.model.loading import load_model
    from service.settings import load_settings

    model_path = checkpoint_of(args)
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
    print(table + "\n\n" + note)
    if not args.no_save:
        append_section(
            "KV cache: appending in place vs torch.cat (bench/bench_kv.py)",
            {"MODEL_PATH": model_path.name, "QUANTIZATION": args.quantization, "THREADS": args.threads},
            table + "\n\n" + note,
            threads=args.threads,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
