"""The same answer on every CPU: what the fixed-order float operations cost (decode, the first token
with a picture, its vision encoding and prefill), this tree against the code before them, in one run.

Decision record: every float operation of an answer's path became the service's own, in one fixed
order on every instruction set (service/native/float_ops.py, docs/engine.md "The same answer on
every CPU"). Each engine runs in a fresh process, in the order A B B A per round, on the 2B-shaped
4-bit checkpoint (its vision tower INT8; `--model-path` another, e.g. the INT8 one) with the service's
defaults but speculation off (a token a forward), caches off:
- W1: one 448×448 JPEG and a question: time to first token, its vision encoding and its prefill
  (medians of 3);
- decode: 64 greedy tokens of a short text prompt, the engine's own decode tokens/s (median of 3).
The before side is `--baseline` (default: the main branch before the change) exported by git, as
bench.core.harness.tree_at does; both import this tree's bench.

    python -m service make-model --preset 2b --bits 4 $CACHE_DIR/qwen3vl-2b-random-int4
    flock /tmp/heavy.lock python -m bench.records.bench_every_cpu [--rounds 2] [--model-path DIR]
"""

from __future__ import annotations

import sys

from bench.core.harness import interleaved, medians, parse, parser, preset_model_path, short_rev, tree_at
from bench.core.results import SPECULATION, markdown_table, report
from bench.core.session import Session

BASELINE = "215d2ba"  # main before the fixed-order float operations: torch's norms, activations, softmax, GEMMs
KEYS = ("ttft_s", "vision_s", "prefill_s", "decode_tokens_per_s")
TARGET = 1.03  # the issue's: decode and first token within 3 % of before


def measure(model_path: str, threads: int) -> dict:
    """First token with a picture and decode of one engine (this process's `service`)."""
    timings = Session(model_path, threads, speculative="off").first_token_and_decode()
    return {key: timings[key] for key in (*KEYS, "prompt_tokens")}


def main(argv=None) -> int:
    p = parser(__doc__, quantization=False, baseline=BASELINE)
    p.add_argument("--rounds", type=int, default=2, help="of A B B A")
    given = p.parse_args(argv)
    if given.model_path is None and not given.tiny:  # the 4-bit copy, not the INT8 one parse() picks
        int4 = preset_model_path("2b").with_name("qwen3vl-2b-random-int4")
        argv = [*(sys.argv[1:] if argv is None else argv), "--model-path", str(int4)]
    args = parse(p, argv)
    kinds = ["before", "now"]
    kwargs = {kind: {"model_path": str(args.model_path), "threads": args.threads} for kind in kinds}
    with tree_at(args.baseline) as base_tree:
        results = interleaved("bench.records.bench_every_cpu:measure", kwargs, args.rounds, {"before": base_tree})
    med = medians(results, KEYS)
    label = {"before": f"torch's float ops ({short_rev(args.baseline)})", "now": "fixed-order float ops (now)"}
    rows = [[label[kind], results[kind][0]["prompt_tokens"], *(med[kind][key] for key in KEYS)] for kind in kinds]
    # slower is a ratio above 1: time now / before, decode rate before / now
    cost = {key: med["now"][key] / med["before"][key] for key in KEYS[:3]}
    cost["decode_tokens_per_s"] = med["before"]["decode_tokens_per_s"] / med["now"]["decode_tokens_per_s"]
    rows.append(["cost (now / before; decode: time per token)", "", *(f"{cost[key]:.3f}" for key in KEYS)])
    verdict = {key: "met" if cost[key] <= TARGET else "missed" for key in ("ttft_s", "decode_tokens_per_s")}
    body = (
        markdown_table(
            ["code", "W1 prompt tokens", "W1 first token (s)", "W1 vision (s)", "W1 prefill (s)", "decode (tok/s)"],
            rows,
        )
        + f"\n\nMedians over {2 * args.rounds} processes per kind (order A B B A), each the median of 3 requests. "
        f"Target: first token and decode within {TARGET:.2f}x of before: first token {cost['ttft_s']:.3f} "
        f"({verdict['ttft_s']}), decode {cost['decode_tokens_per_s']:.3f} ({verdict['decode_tokens_per_s']})."
    )
    return report(
        args,
        f"The same answer on every CPU: the fixed-order float operations' cost, {args.model_path.name}",
        {
            "MODEL_PATH": args.model_path.name,
            "THREADS": args.threads,
            "settings": "the defaults (INT8 vision, KV_DTYPE=bfloat16), SPECULATIVE=off, caches off",
            **Session.described(),
        },
        body,
        speculation=SPECULATION["off"],  # each Session is made with it off, whatever --speculative says
    )


if __name__ == "__main__":
    raise SystemExit(main())
