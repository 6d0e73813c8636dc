"""Decode: the engine's decode step (service/model/forward.py) against transformers' forward, by context length.

Decision record, frozen at commit fbd07c3 (bench/RESULTS.md § "Decode step: lean vs transformers'
forward"): the engine decodes with its lean step since. Rerun it as it was there:

    git worktree add /tmp/decode-record fbd07c3 && cd /tmp/decode-record
    flock /tmp/heavy.lock python -m bench.bench_decode                 # 2B-shaped INT8 checkpoint, 2 threads
    python -m bench.bench_decode --contexts 64 1024 --no-engines --no-save

Part 1, one process, the model loaded once: per-step time of a decode step at each context length
(KV caches of that many positions; their values do not change the time), single stream and a
batch of 4 sequences of different lengths (the context, ¾, ½ and ¼ of it), the two step kinds
alternating (A B B A):
- `transformers`: the model's forward (what the service ran before): one sequence, or the batch
  left-padded into one cache with an attention mask;
- `lean`: service/model/forward.TextForward, each sequence attending to its own cache (service/native/attention.c).
For the lean single stream also: the share of the step in the INT8 kernels and in attention
(torch.profiler), the KV bytes read per step, and tokens/s as a share of the bandwidth ceiling
(bytes read per token ÷ a streaming-read measurement with the same threads, same run).
Part 2 (unless --no-engines): the engine end to end, today's code against the code before the
lean step (`--baseline`, each in fresh processes, A B B A): single-stream decode tokens/s and the
aggregate of 4 concurrent streams.
The plot (decode tokens/s against context) is bench/plots/decode_context-amx-xeon.png.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.core.harness import interleaved, isolated, medians, parse, parser, short_rev, tree_at
from bench.core.results import line_plot, markdown_table, plot_file, plot_link, report
from bench.core.session import Session

BASELINE = "6ed1729"  # the session's start: per-tensor INT8, transformers forward, left-padded batches
INT8_KERNELS = (
    "quantized::linear_with_input_q_dq_qweight_dq_output_fp32",
    "quantized::linear_dynamic",
    "onednn::qlinear_pointwise",
    "native_int8",  # the service's own kernel (a ctypes call: named for the profiler by `_label_native_calls`)
)
ATTENTION = ("aten::scaled_dot_product_attention", "exact_attention")  # transformers', the service's
LONG_PROMPTS = (1000, 3000)  # prompt tokens whose time to first token part 2 measures
SENTENCE = "The harbour was quiet in the early morning, boats resting on grey water. "


def read_bandwidth_gbps(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Memory read bandwidth (GB/s) with `threads` threads (bench/core/ceiling.py), left set for the steps."""
    from bench.core.ceiling import read_bandwidth

    torch.set_num_threads(threads)
    return read_bandwidth(threads, int(gib * 1024**3), repeats) / 1e9


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


def synthetic_cache(config, tokens: int, seed: int, dtype=torch.float32):
    """A GrowingCache holding `tokens` positions of random keys and values (as a prefill leaves it)."""
    from service.caches.kv import GrowingCache

    text = config.text_config
    shape = (1, text.num_key_value_heads, tokens, text.head_dim)
    g = torch.Generator().manual_seed(seed)
    return GrowingCache(
        ddp_cache_data=[
            (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(text.num_hidden_layers)
        ],
        config=config,
    )


class TransformersStep:
    """A decode step through the model's forward (as the service did before): one sequence on its
    own cache, several left-padded into one cache (packed once, as the scheduler did on joining)
    with an attention mask hiding the padding."""

    def __init__(self, model):
        self.model = model

    def pack(self, caches: list) -> tuple:
        from service.caches.kv import GrowingCache

        if len(caches) == 1:
            return caches[0], None
        width = max(c.get_seq_length() for c in caches)
        pad = [width - c.get_seq_length() for c in caches]
        packed = GrowingCache(
            config=self.model.config,
            ddp_cache_data=[
                tuple(
                    torch.cat(
                        [torch.nn.functional.pad(getattr(c.layers[i], kind), (0, 0, p, 0)) for c, p in zip(caches, pad)]
                    )
                    for kind in ("keys", "values")
                )
                for i in range(len(caches[0].layers))
            ],
        )
        return packed, torch.tensor(pad)

    def __call__(self, token_ids, positions, packed) -> torch.Tensor:
        cache, pad = packed
        mask = None
        if pad is not None:
            mask = (torch.arange(cache.get_seq_length() + 1)[None, :] >= pad[:, None]).long()
        out = self.model(
            input_ids=token_ids[:, None],
            position_ids=positions.view(1, -1, 1).expand(3, -1, 1),
            attention_mask=mask,
            cache=cache,
            logits_to_keep=1,
        )
        return out.logits[:, -1]


class LabelledAttention:
    """The service's attention kernel, named `exact_attention` in torch.profiler's tables."""

    def __init__(self, attention):
        self.attention = attention

    def supports(self, head_dim: int) -> bool:
        return self.attention.supports(head_dim)

    def __call__(self, *args):
        with torch.profiler.record_function("exact_attention"):
            return self.attention(*args)


def lean_forward(model):
    """service/model/forward.TextForward as the engine builds it, its attention labelled for the profiler."""
    from service.model.attention import ExactAttention
    from service.model.forward import TextForward

    return TextForward(model, LabelledAttention(ExactAttention.load()))


class LeanStep:
    """service/model/forward.TextForward over the sequences' own caches, one row each."""

    def __init__(self, model):
        self.step = lean_forward(model)

    @staticmethod
    def pack(caches: list) -> list:
        return caches

    def __call__(self, token_ids, positions, caches) -> torch.Tensor:
        from service.model.forward import Rows

        return self.step(token_ids, positions, [Rows(c, 1) for c in caches])


def _crop(packed, lengths: list[int]) -> None:
    caches = packed if isinstance(packed, list) else [packed[0]]
    for cache, n in zip(caches, lengths):
        cache.crop(n - cache.get_seq_length())


def step_ms(step, caches: list, steps: int) -> float:
    """Median ms of `steps` decode steps (after one warm-up) over `caches`, cropped back afterwards."""
    packed = step.pack(caches)
    owned = packed if isinstance(packed, list) else [packed[0]]
    lengths = [c.get_seq_length() for c in owned]
    positions = torch.tensor([c.get_seq_length() for c in caches])
    token_ids = torch.arange(1, len(caches) + 1)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        step(token_ids, positions + i, packed)
        times.append(time.perf_counter() - t0)
    _crop(packed, lengths)
    return statistics.median(times[1:]) * 1000


def _label_native_calls() -> None:
    """Name the native INT8 kernel's calls in torch.profiler's tables (it is no torch op)."""
    from service.quant.int8_linear import Int8Linear

    forward = Int8Linear._forward_native
    if getattr(forward, "labelled", False):
        return

    def labelled(self, flat):
        with torch.profiler.record_function("native_int8"):
            return forward(self, flat)

    labelled.labelled = True
    Int8Linear._forward_native = labelled


def profile_shares(step, caches: list, steps: int = 5) -> dict:
    """Shares of the step's wall time in the INT8 kernels and in attention, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    _label_native_calls()
    lengths = [c.get_seq_length() for c in caches]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(torch.arange(1, len(caches) + 1), torch.tensor(lengths) + i, caches)
        wall = time.perf_counter() - t0
    _crop(caches, lengths)
    totals = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
    return {
        "kernels": sum(totals.get(k, 0.0) for k in INT8_KERNELS) / wall,
        "attention": sum(totals.get(k, 0.0) for k in ATTENTION) / wall,
    }


def prefill_piece(forward, cache, tokens: int, repeats: int = 3) -> dict:
    """A prefill piece of `tokens` text tokens after `cache` through the engine's forward: median
    ms, and its shares in the INT8 kernels and in attention."""
    from torch.profiler import ProfilerActivity, profile

    from service.model.forward import Rows

    _label_native_calls()
    start = cache.get_seq_length()
    ids = torch.randint(0, forward.lm_head.out_features, (tokens,))
    positions = torch.arange(start, start + tokens)

    def run():
        forward(ids, positions, [Rows(cache, tokens)], logits_rows=torch.tensor([tokens - 1]))
        cache.crop(-tokens)

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    totals = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
    return {
        "ms": statistics.median(times) * 1000,
        "kernels": sum(totals.get(k, 0.0) for k in INT8_KERNELS) / wall,
        "attention": sum(totals.get(k, 0.0) for k in ATTENTION) / wall,
    }


def sweep(model_path: str, threads: int, contexts: list[int], steps: int, batch: int, piece: int) -> dict:
    """Part 1 (in this process)."""
    from service.memory import kv_cache_bytes
    from service.model.loading import load_model
    from service.settings import load_settings

    settings = load_settings(model_path=model_path, quantization="int8", threads=threads, cache_enabled=False)
    model = load_model(settings).model
    kinds = {"transformers": TransformersStep(model), "lean": LeanStep(model)}
    kinds["lean, bf16 KV"] = kinds["lean"]  # the same step: the caches' dtype differs
    weights = weight_bytes_read_per_token(model)
    bandwidth = read_bandwidth_gbps(threads)
    rows = []
    with torch.inference_mode():
        for step in kinds.values():  # first-call costs
            step_ms(step, [synthetic_cache(model.config, 64, 0)], 2)
        for context in tqdm(contexts, desc="contexts", unit="context"):
            single = [synthetic_cache(model.config, context, 1)]
            several = [
                synthetic_cache(model.config, max(1, context * (batch - i) // batch), 2 + i) for i in range(batch)
            ]
            caches = {
                "transformers": (single, several),
                "lean": (single, several),
                "lean, bf16 KV": (
                    [synthetic_cache(model.config, context, 1, torch.bfloat16)],
                    [
                        synthetic_cache(model.config, max(1, context * (batch - i) // batch), 2 + i, torch.bfloat16)
                        for i in range(batch)
                    ],
                ),
            }
            ms = {}
            for kind in ("transformers", "lean", "lean, bf16 KV", "lean, bf16 KV", "lean", "transformers"):
                for name, group in zip(("1", str(batch)), caches[kind]):
                    value = step_ms(kinds[kind], group, steps)
                    ms[kind, name] = min(ms.get((kind, name), value), value)
            shares = profile_shares(kinds["lean"], single)
            prefill = prefill_piece(kinds["lean"].step, single[0], piece)
            kv = kv_cache_bytes(model.config, context)
            ceiling = bandwidth * 1e9 / (weights + kv)
            rows.append(
                {
                    "context": context,
                    "transformers_ms": ms["transformers", "1"],
                    "lean_ms": ms["lean", "1"],
                    "transformers_batch_ms": ms["transformers", str(batch)],
                    "lean_batch_ms": ms["lean", str(batch)],
                    "kv_mb": kv / 1e6,
                    "bf16_ms": ms["lean, bf16 KV", "1"],
                    "bf16_batch_ms": ms["lean, bf16 KV", str(batch)],
                    "kernels_share": shares["kernels"],
                    "attention_share": shares["attention"],
                    "ceiling_tps": ceiling,
                    "prefill_ms": prefill["ms"],
                    "prefill_kernels": prefill["kernels"],
                    "prefill_attention": prefill["attention"],
                }
            )
    return {
        "rows": rows,
        "bandwidth_gbps": bandwidth,
        "weight_gb": weights / 1e9,
        "kv_bytes_per_token": kv_cache_bytes(model.config, 1),
    }


def engine_throughput(model_path: str, threads: int, streams: int, tokens: int) -> dict:
    """Part 2 (in this process's `service`): decode tokens/s of one stream and of `streams` at once."""
    session = Session(model_path, threads, max_batch_size=max(streams, 1))
    prompts = [
        "Tell me a long story about a red square.",
        "Describe a harbour in the morning, in detail.",
        "List every colour you know, with a word about each.",
        "Explain how a bicycle works, step by step.",
    ]
    session.ask(prompts[0], max_tokens=tokens)  # warm-up
    single = [session.ask(prompts[0], max_tokens=tokens).timings.decode_tokens_per_s for _ in range(3)]
    sent = time.perf_counter()  # every stream's timings counted from here
    requests = [
        {"parts": [prompts[i % len(prompts)]], "max_tokens": tokens, "received_at": sent} for i in range(streams)
    ]
    together, _ = session.together(requests)
    generated = sum(d.completion_tokens - 1 for d in together)
    # from the first stream's first token to the last stream's end
    span = max(d.timings.total for d in together) - min(d.timings.time_to_first_token for d in together)
    long_prompts = {}
    per_sentence = len(session.tokenizer(SENTENCE)["input_ids"])  # this checkpoint's tokenizer
    for length in LONG_PROMPTS:  # time to first token of a long text prompt (prefill at growing context)
        done = session.ask(SENTENCE * max(1, length // per_sentence) + " Summarise it.", max_tokens=tokens)
        long_prompts[str(length)] = {
            "prompt_tokens": done.prompt_tokens,
            "ttft_s": done.timings.time_to_first_token,
            "prefill_s": done.timings.prefill,
        }
    return {
        "single_tps": statistics.median(single),
        "aggregate_tps": generated / span,
        "streams_tokens": [d.completion_tokens for d in together],
        "long_prompts": long_prompts,
    }


def plot(rows: list[dict], title: str) -> Path:
    contexts = [r["context"] for r in rows]
    lines = [
        (contexts, [1000 / r["transformers_ms"] for r in rows], "s--", "transformers forward (before)"),
        (contexts, [1000 / r["lean_ms"] for r in rows], "o-", "lean decode step"),
        (contexts, [r["ceiling_tps"] for r in rows], ":", "bandwidth ceiling"),
    ]
    xlabel, ylabel = "context tokens (KV cache length)", "decode tokens/s, one stream"
    return line_plot(plot_file("decode_context"), title, xlabel, ylabel, lines, xscale="log")


def main(argv=None) -> int:
    p = parser(__doc__, baseline=BASELINE)
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 64, 256, 1024, 3072])
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per measurement")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument(
        "--piece", type=int, default=64, help="prefill piece measured at each context (PREFILL_CHUNK_TOKENS)"
    )
    p.add_argument("--no-engines", action="store_true", help="skip part 2")
    args = parse(p, argv)
    model_path = args.model_path
    part1 = isolated(
        "bench.records.bench_decode:sweep",
        model_path=str(model_path),
        threads=args.threads,
        contexts=args.contexts,
        steps=args.steps,
        batch=args.batch,
        piece=args.piece,
    )
    rows = part1["rows"]
    base = rows[0]
    table = markdown_table(
        [
            "context",
            "transformers ms/step",
            "lean ms/step",
            "speed-up",
            f"batch of {args.batch}: transformers ms",
            f"batch of {args.batch}: lean ms",
            "batch speed-up",
            "lean tok/s",
            "share of ceiling",
            "INT8 kernels share",
            "attention share",
            "KV read/step (MB)",
            f"lean slowdown vs {base['context']}",
        ],
        [
            [
                r["context"],
                r["transformers_ms"],
                r["lean_ms"],
                f"{r['transformers_ms'] / r['lean_ms']:.2f}x",
                r["transformers_batch_ms"],
                r["lean_batch_ms"],
                f"{r['transformers_batch_ms'] / r['lean_batch_ms']:.2f}x",
                1000 / r["lean_ms"],
                f"{1000 / r['lean_ms'] / r['ceiling_tps']:.0%}",
                f"{r['kernels_share']:.0%}",
                f"{r['attention_share']:.0%}",
                f"{r['kv_mb']:.0f}",
                f"{1 - base['lean_ms'] / r['lean_ms']:.0%}",
            ]
            for r in rows
        ],
    )
    kv_table = markdown_table(
        [
            "context",
            "fp32 KV ms/step",
            "bf16 KV ms/step",
            "bf16 vs fp32",
            f"batch of {args.batch}: fp32 KV ms",
            f"batch of {args.batch}: bf16 KV ms",
            "batch bf16 vs fp32",
            "KV bytes per token, fp32 / bf16",
        ],
        [
            [
                r["context"],
                r["lean_ms"],
                r["bf16_ms"],
                f"{r['lean_ms'] / r['bf16_ms']:.2f}x",
                r["lean_batch_ms"],
                r["bf16_batch_ms"],
                f"{r['lean_batch_ms'] / r['bf16_batch_ms']:.2f}x",
                f"{part1['kv_bytes_per_token'] // 1024} KiB / {part1['kv_bytes_per_token'] // 2048} KiB",
            ]
            for r in rows
        ],
    )
    prefill_table = markdown_table(
        [
            "context",
            f"prefill piece of {args.piece} tokens (ms)",
            "ms per token",
            "INT8 kernels share",
            "attention share",
        ],
        [
            [
                r["context"],
                r["prefill_ms"],
                r["prefill_ms"] / args.piece,
                f"{r['prefill_kernels']:.0%}",
                f"{r['prefill_attention']:.0%}",
            ]
            for r in rows
        ],
    )
    body = (
        table
        + "\n\n"
        + kv_table
        + "\n\n"
        + prefill_table
        + (
            "\n\nOne process; each step kind measured twice per context (A B B A), the better median of "
            f"{args.steps} steps shown. Batch lengths: the context, 3/4, 1/2 and 1/4 of it. Weights read per token "
            f"{part1['weight_gb']:.2f} GB (int8 decoder + lm_head + norms); streaming read "
            f"{part1['bandwidth_gbps']:.1f} GB/s measured in the same run; ceiling = bandwidth / (weights + the "
            "context's fp32 KV). Shares from "
            "torch.profiler over 5 lean steps (inclusive op times / wall time, profiler overhead included). The second "
            "table: the lean step with keys and values cached in bf16 (KV_DTYPE=bfloat16; attention in bf16) against "
            "fp32, same run. The "
            "third table: one prefill piece after a cache of that many tokens, through the model's forward (the "
            "engine's prefill path), median of 3, shares from one profiled run."
        )
    )
    if not args.no_engines:
        kwargs = {"model_path": str(model_path), "threads": args.threads, "streams": args.batch, "tokens": 64}
        with tree_at(args.baseline) as tree:
            target = "bench.records.bench_decode:engine_throughput"
            runs = interleaved(target, {"before": kwargs, "now": kwargs}, 1, {"before": tree})
        med = medians(runs, ("single_tps", "aggregate_tps"))
        single, aggregate = (med["now"][m] / med["before"][m] for m in ("single_tps", "aggregate_tps"))
        body += (
            "\n\n"
            + markdown_table(
                ["engine", "one stream (tok/s)", f"{args.batch} streams, aggregate (tok/s)"],
                [
                    [
                        f"before ({short_rev(args.baseline)})",
                        med["before"]["single_tps"],
                        med["before"]["aggregate_tps"],
                    ],
                    ["now", med["now"]["single_tps"], med["now"]["aggregate_tps"]],
                    ["now / before", f"{single:.2f}x", f"{aggregate:.2f}x"],
                ],
            )
            + (
                "\n\nThe engine end to end (scheduler, sampling, streaming; caches off; 64 greedy tokens; text prompts "
                "of ~20 tokens), each in fresh processes in the order before, now, now, before; medians. Targets: one "
                f"stream "
                f">= 1.3x before: {single:.2f}x ({'met' if single >= 1.3 else 'missed'}); {args.batch} streams >= 1.2x "
                f"before: {aggregate:.2f}x ({'met' if aggregate >= 1.2 else 'missed'})."
            )
        )
        long_rows = []
        for length in LONG_PROMPTS:
            cells = {k: [r["long_prompts"][str(length)] for r in v] for k, v in runs.items()}
            ttft = {k: statistics.median(c["ttft_s"] for c in v) for k, v in cells.items()}
            long_rows.append(
                [
                    cells["now"][0]["prompt_tokens"],
                    ttft["before"],
                    ttft["now"],
                    f"{ttft['before'] / ttft['now']:.2f}x",
                    f"{ttft['now'] / cells['now'][0]['prompt_tokens'] * 1000:.2f}",
                ]
            )
        body += (
            "\n\n"
            + markdown_table(
                [
                    "text prompt (tokens)",
                    "TTFT before (s)",
                    "TTFT now (s)",
                    "now faster by",
                    "now: ms per prompt token",
                ],
                long_rows,
            )
            + (
                "\n\nLong text prompts through the same engines (one request each, prefilled in pieces "
                "of PREFILL_CHUNK_TOKENS after the pieces before them: attention grows with the context)."
            )
        )
    png = plot(rows, f"{model_path.name}, {args.threads} threads, INT8: decode tokens/s vs context")
    body += f"\n\n![decode tokens/s against context]({plot_link(png)})"
    return report(
        args,
        "Decode step: lean vs transformers' forward, by context",
        {"MODEL_PATH": model_path.name, "THREADS": args.threads, "QUANTIZATION": "int8"},
        body,
    )


if __name__ == "__main__":
    raise SystemExit(main())
