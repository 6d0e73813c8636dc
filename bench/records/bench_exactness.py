"""One computation per token: its cost (first token, prefill, decode) and what it buys (a cache hit
answers with the bits of a fresh server), this tree against the code before it, in one run.

Decision record, frozen at commit b298cf4 (bench/RESULTS.md § "Exact by construction"): every
token is computed once, by one kernel path, since. Rerun it as it was there:

    git worktree add /tmp/exactness-record b298cf4 && cd /tmp/exactness-record
    flock /tmp/heavy.lock python -m bench.bench_exactness [--baseline REV] [--rounds 2]

Each engine runs in a fresh process, in the order A B B A per round, on the pre-quantized 2B-shaped
checkpoint with the service's defaults (INT8, bf16 keys and values, INT8_KERNEL as set):
- W1: one 448×448 JPEG and a question, caches off: time to first token and its prefill (median of 3);
- a ~1,000-token text prompt, caches off: time to first token (attention's share grows with context);
- decode: 64 greedy tokens of a short text prompt, the engine's own decode tokens/s (median of 3);
- the stateless client of the exactness issue: turn 1 = picture + "Describe the picture." (32
  greedy tokens); turn 2 = the whole history resent + a question, answered (a) by the engine that
  holds turn 1's keys and values, (b) by an engine with nothing cached. Compared: the answer's token
  ids and the bits of every token's log-probability and its 5 alternatives.
(tests/test_exactness_http.py keeps the second part, on the embedded model.)
"""

from __future__ import annotations

from bench.core.harness import interleaved, medians, parse, parser, short_rev, tree_at
from bench.core.results import markdown_table, report
from bench.core.session import Session

BASELINE = "bd51502"  # the last commit whose prefill ran transformers' forward and decode its own step
LONG_PROMPT = " ".join(f"Item {i}: a square of side {i % 17} next to a circle of radius {i % 11}." for i in range(70))


def measure(model_path: str, threads: int) -> dict:
    """Timings and the resend scenario of one engine (this process's `service`)."""
    plain = Session(model_path, threads)
    timings = plain.first_token_and_decode()
    long = [plain.ask(LONG_PROMPT) for _ in range(2)]
    cached = plain.variant(cache_enabled=True)
    picture = plain.picture()
    first = cached.ask(picture, "Describe the picture.", max_tokens=32)
    history = [plain.message(picture, "Describe the picture."), plain.message(first.text, role="assistant")]
    second = [*history, plain.message("And what colour is it?")]
    hit = cached.ask(messages=second, max_tokens=32, logprobs=5)
    fresh = plain.ask(messages=second, max_tokens=32, logprobs=5)

    def bits(done):
        return [(r.token_id, r.logprob, r.top) for r in done.logprobs]

    differences = [abs(a.logprob - b.logprob) for a, b in zip(hit.logprobs, fresh.logprobs) if a.token_id == b.token_id]
    return {
        **{k: timings[k] for k in ("ttft_s", "prefill_s", "prompt_tokens", "decode_tokens_per_s")},
        "long_prompt_tokens": long[0].prompt_tokens,
        "long_ttft_s": min(d.timings.time_to_first_token for d in long),
        "resend_prompt_tokens": hit.prompt_tokens,
        "resend_cached_tokens": hit.cached_tokens,
        "resend_same_tokens": hit.token_ids == fresh.token_ids,
        "resend_same_bits": bits(hit) == bits(fresh),
        "resend_max_logprob_difference": max(differences, default=0.0),
        "resend_tokens_compared": len(differences),
        # the code before reported no logprob for a token without text: its bits compare fewer tokens
        "resend_logprobs_reported": min(len(hit.logprobs), len(fresh.logprobs)),
    }


def main(argv=None) -> int:
    p = parser(__doc__, baseline=BASELINE)
    p.add_argument("--rounds", type=int, default=2, help="of A B B A")
    args = parse(p, argv)
    model_path = args.model_path
    kinds = ["before", "now"]
    kwargs = {kind: {"model_path": str(model_path), "threads": args.threads} for kind in kinds}
    with tree_at(args.baseline) as base_tree:
        results = interleaved("bench.records.bench_exactness:measure", kwargs, args.rounds, {"before": base_tree})
    keys = ("ttft_s", "prefill_s", "long_ttft_s", "decode_tokens_per_s")
    med = medians(results, keys)
    label = {"before": f"before ({short_rev(args.baseline)})", "now": "now"}
    timing_rows = [
        [
            label[kind],
            results[kind][0]["prompt_tokens"],
            med[kind]["prefill_s"],
            med[kind]["ttft_s"],
            results[kind][0]["long_prompt_tokens"],
            med[kind]["long_ttft_s"],
            med[kind]["decode_tokens_per_s"],
        ]
        for kind in kinds
    ]
    ratio = {key: med["now"][key] / med["before"][key] for key in keys}
    timing_rows.append(
        [
            "now / before",
            "",
            f"{ratio['prefill_s']:.3f}",
            f"{ratio['ttft_s']:.3f}",
            "",
            f"{ratio['long_ttft_s']:.3f}",
            f"{ratio['decode_tokens_per_s']:.3f}",
        ]
    )
    exact_rows = [
        [
            label[kind],
            f"{r['resend_cached_tokens']} of {r['resend_prompt_tokens']}",
            "yes" if r["resend_same_tokens"] else "no",
            "yes" if r["resend_same_bits"] and r["resend_same_tokens"] else "no",
            r["resend_logprobs_reported"],
            f"{r['resend_max_logprob_difference']:.3g}",
        ]
        for kind in kinds
        for r in results[kind][:1]
    ]
    consistent = all(r["resend_same_bits"] == results[k][0]["resend_same_bits"] for k in kinds for r in results[k])
    body = (
        markdown_table(
            [
                "code",
                "W1 prompt tokens",
                "W1 prefill (s)",
                "W1 first token (s)",
                "long prompt tokens",
                "long prompt first token (s)",
                "decode (tok/s)",
            ],
            timing_rows,
        )
        + f"\n\nMedians over {2 * args.rounds} processes per kind (order A B B A), each the median of 3 "
        "requests (the long prompt: the best of 2). Target: first token within 1.05x of before: "
        f"{ratio['ttft_s']:.3f} ({'met' if ratio['ttft_s'] <= 1.05 else 'missed'}); decode no loss: "
        f"{ratio['decode_tokens_per_s']:.3f} ({'met' if ratio['decode_tokens_per_s'] >= 0.97 else 'missed'}, "
        "0.97 being this machine's run-to-run spread).\n\n"
        + markdown_table(
            [
                "code",
                "turn 2 tokens from the cache",
                "same answer, cache hit vs fresh",
                "same bits (every logprob and top-5)",
                "logprobs reported (of 32 tokens)",
                "largest logprob difference (tokens in common)",
            ],
            exact_rows,
        )
        + "\n\nThe stateless client of the exactness issue, 32 greedy tokens per turn, turn 2 answered by the "
        "engine holding turn 1 and by one with nothing cached"
        + ("" if consistent else " (NOT the same verdict in every process of a kind)")
        + "."
    )
    return report(
        args,
        "Exact by construction: its cost, and a cache hit against a fresh server",
        {
            "MODEL_PATH": model_path.name,
            "THREADS": args.threads,
            "settings": "the defaults (INT8, KV_DTYPE=bfloat16)",
            **Session.described(),
        },
        body,
    )


if __name__ == "__main__":
    raise SystemExit(main())
