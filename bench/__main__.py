"""The benchmarks' registry: `python -m bench list` names every scenario (each a module bench/bench_*.py);
`python -m bench NAME ARGS` runs bench.bench_NAME with ARGS, exactly as `python -m bench.bench_NAME ARGS`
does (its parser takes them: `python -m bench NAME --help`).

    python -m bench list
    flock /tmp/heavy.lock python -m bench peer --model 4b
    flock /tmp/heavy.lock python -m bench all           # the INT8 suite, on CACHE_DIR/qwen3vl-2b-random
    python -m bench all --tiny --no-save                # the same on the embedded model: a quick check

Each scenario prints its tables and writes its section of bench/RESULTS.md (docs/benchmarks.md).
"""

from __future__ import annotations

import runpy
import sys

# name → what it measures; `python -m bench NAME` runs the module bench.bench_NAME.
SCENARIOS = {
    # the service as it is: rerun after a change
    "peer": "this service against llama.cpp on the same weights (--model: 2b, …, 30b-a3b, qwen3.5-2b, …)",
    "start": "start → ready, warm and cold, beside llama.cpp; the first request; two instances' memory",
    "batching": "concurrent streams: throughput, first token, the longest pause",
    "priorities": "a picture question's first token while batch jobs run; the batch's throughput",
    "cache": "second turns and repeated pictures with the caches and without; the disk tier",
    "kernels": "INT8_KERNEL=auto against each kernel forced: first token and decode",
    "speculative": "exact speculative decoding on against off: JSON, tool calls, right and wrong guesses",
    "structured": "what a JSON-Schema constraint costs; llguidance against xgrammar",
    "deploy": "threads per instance, start-up, the memory budget, worker recovery, mapped weights",
    "cluster": "three loopback machines: second turns' KV hits with affinity, round-robin, one; a machine lost",
    "int4": "4-bit weights: group size, zero point and kernel; --memory: served in a 2 GiB cgroup",
    "vision": "the vision encoder: torch against ONNX Runtime, fp32 and INT8",
    "video": "a 10-second clip: decoding and sampling, visual tokens, first token",
    "batch_exactness": "logits in a decode batch against alone, fp32 and INT8",
    "embeddings": "search: texts/s, pictures/s, rerank and score, one a request against many, beside llama.cpp",
    # the INT8 suite: `all` runs the three
    "quantize": "`python -m service quantize` as a user runs it: time, peak memory, sizes",
    "fidelity": "INT8 and 4-bit against fp32: logit cosine, greedy agreement, with activation spikes",
    "pixels": "pixel budget → visual tokens → time to first token, and its plot",
    # long runs on the embedded model
    "soak": "1,000 requests of every kind: memory, threads and files must not grow",
    "load": "more clients than the queue holds: every request answered or refused, none hung",
    "fuzz": "schemathesis and hostile inputs against one real server",
}
INT8_SUITE = ("quantize", "fidelity", "pixels")
ALL = "the INT8 suite: quantize, fidelity, pixels, then fidelity on the embedded model"


def listing() -> str:
    width = max(map(len, SCENARIOS))
    lines = [f"  {name:<{width}}  {about}" for name, about in [*SCENARIOS.items(), ("all", ALL)]]
    return "python -m bench NAME [ARGS...]   (python -m bench NAME --help: its options)\n\n" + "\n".join(lines)


def run(name: str, args: list[str]) -> None:
    """The module bench.bench_NAME run as the program (`__main__`, its arguments `args`), as `python -m` runs
    it: its section records the command `python -m bench.bench_NAME ARGS`. A failure exits."""
    argv = sys.argv
    sys.argv = [argv[0], *args]
    try:
        runpy.run_module(f"bench.bench_{name}", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
    finally:
        sys.argv = argv


def run_all(args: list[str]) -> None:
    """The INT8 suite with one command line; then, unless it ran --tiny, fidelity on the embedded tiny
    model too: its large random weights stress INT8 harder."""
    from bench.core import int8_suite

    for name in INT8_SUITE:
        run(name, args)
    if not int8_suite.parser(ALL).parse_known_args(args)[0].tiny:
        run("fidelity", [*args, "--tiny"])


def main(argv: list[str] | None = None) -> int:
    name, *args = (sys.argv[1:] if argv is None else argv) or ["list"]
    if name in ("list", "-h", "--help"):
        print(listing())
    elif name == "all":
        run_all(args)
    elif name in SCENARIOS:
        run(name, args)
    else:
        print(f"no scenario {name!r}\n\n{listing()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
