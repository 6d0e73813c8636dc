"""INT8_KERNEL=auto against each kernel forced: does the measurement at start pick the fastest?

    flock /tmp/heavy.lock python -m bench.bench_kernels [--rounds 2]

Each kind (auto, fbgemm, onednn, native) is an engine in a fresh process, in the order A B C D D C B A
per round, on the pre-quantized 2B-shaped checkpoint, caches off: the first token of a 448×448 JPEG
and a question (median of 3, a new picture each time), and the engine's own decode tokens/s over 128
greedy tokens of a short text prompt (end of turn biased away; median of 3). `auto` reads the
measurement kept in CACHE_DIR (the first process measures it), as a restarted server does.
"""

from __future__ import annotations

from bench.core.harness import interleaved, medians, parse, parser
from bench.core.results import markdown_table, report
from bench.core.session import Session

KINDS = ("auto", "fbgemm", "onednn", "native")


def measure(model_path: str, threads: int, kernel: str) -> dict:
    session = Session(model_path, threads, int8_kernel=kernel)
    kernels = session.loaded.kernels
    return {
        "decoder": kernels.decoder,
        "vision": kernels.vision,
        **session.first_token_and_decode(decode_tokens=128, new_pictures=True),
    }


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=2, help="of A B C D D C B A")
    args = parse(p, argv)
    model_path = args.model_path
    kwargs = {kind: {"model_path": str(model_path), "threads": args.threads, "kernel": kind} for kind in KINDS}
    results = interleaved("bench.bench_kernels:measure", kwargs, args.rounds)
    med = medians(results, ("ttft_s", "decode_tokens_per_s"))
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
    return report(
        args,
        "INT8 kernels: the measured choice against each forced",
        {"MODEL_PATH": model_path.name, "THREADS": args.threads, "caches": "off", **Session.described(128)},
        body,
    )


if __name__ == "__main__":
    raise SystemExit(main())
