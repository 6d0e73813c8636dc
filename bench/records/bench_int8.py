"""Per-token INT8 against the code before it: time to first token and single-stream decode, one run.

Decision record, frozen at commit c1f5f5d (bench/RESULTS.md § "Per-token INT8 against per-tensor"):
the service's Linears quantize activations per token since. Rerun it as it was there:

    git worktree add /tmp/int8-record c1f5f5d && cd /tmp/int8-record
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

import statistics

from bench.core.harness import interleaved, parse, parser, short_rev, tree_at
from bench.core.results import markdown_table, report
from bench.core.session import Session

BASELINE = "6ed1729"  # the last commit with torch's per-tensor dynamic Linear


def measure(model_path: str, threads: int, activations: str | None = None, kv_dtype: str | None = None) -> dict:
    """W1 time to first token and decode tokens/s of one engine (this process's `service`).
    `activations`: switch the Int8Linears (per_token, per_tensor); `kv_dtype`: KV_DTYPE (None: the default)."""
    settings = {"kv_dtype": kv_dtype} if kv_dtype else {}
    if activations:
        settings["int8_kernel"] = "fbgemm"  # per-tensor activations: torch's kernels only
    session = Session(model_path, threads, **settings)
    if activations is not None:
        from service.quant.int8_linear import set_activations

        set_activations(session.model, activations)
    return session.first_token_and_decode()


def main(argv=None) -> int:
    p = parser(__doc__, baseline=BASELINE)
    p.add_argument("--rounds", type=int, default=2, help="of A B C D D C B A")
    args = parse(p, argv)
    model_path = args.model_path
    # (activations, KV_DTYPE): fp32 keys and values as the baseline has, so the rows compare the Linears;
    # the last row is the shipped default (bf16 keys and values), whose cost bench_decode measures too.
    kinds = {
        "baseline": (None, None),
        "fused, per-tensor": ("per_tensor", "float32"),
        "fused, per-token": ("per_token", "float32"),
        "fused, per-token, bf16 KV (the defaults)": ("per_token", "bfloat16"),
    }
    kwargs = {k: {"model_path": str(model_path), "threads": args.threads, "activations": a, "kv_dtype": kv}
              for k, (a, kv) in kinds.items()}  # fmt: skip
    with tree_at(args.baseline) as base_tree:
        results = interleaved("bench.records.bench_int8:measure", kwargs, args.rounds, {"baseline": base_tree})
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
        f"\n\nMedians over {2 * args.rounds} processes per kind (order A B C D D C B A), each the median of 3 "
        f"requests. Targets (fp32 keys and values, as the baseline): per-token TTFT <= 1.10x the baseline's: "
        f"{per_token[5]} ({'met' if float(per_token[5]) <= 1.10 else 'missed'}); decode >= the baseline's: "
        f"{per_token[7]} ({'met' if float(per_token[7]) >= 1.0 else 'missed'})."
    )
    return report(
        args,
        "Per-token INT8 against per-tensor: time to first token and decode",
        {
            "MODEL_PATH": model_path.name,
            "THREADS": args.threads,
            "caches": "off",
            "KV_DTYPE": "float32 but in the last row",
            **Session.described(),
        },
        body,
    )


if __name__ == "__main__":
    raise SystemExit(main())
