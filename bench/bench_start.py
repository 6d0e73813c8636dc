"""Start → ready, warm and cold, beside llama.cpp on the same weights; the first request after ready
against the tenth; two instances' memory.

    flock /tmp/heavy.lock python -m bench.bench_start            # 2B-shaped checkpoint, 2 threads
    python -m bench.bench_start --rounds 1 --no-cold --no-save   # a quicker look

Kinds: this service on the embedded tiny model (quantized at load, as a fresh install serves), on the
2B-shaped INT8 checkpoint (`-int8`) and on its 4-bit one (`-int4`); llama.cpp's `llama-server` on the
same weights as Q8_0 and Q4_0 text with the F16 vision projector (built and converted once by
bench/bench_peer.py's code, under CACHE_DIR/peer). Every server runs alone on the machine with 2 threads.

Per start (client-side): the process's start to the first 200 of /ready (ours) or /health (llama.cpp);
then ten short text requests one after another on the OpenAI endpoint (8 greedy tokens, each prompt
its own so no cache answers it): the first's wall time against the tenth's. Warm: the page cache
holds the files (each kind's are read before its warm start: a cold start drops every file). Cold:
the page cache dropped before each start (`echo 3 > /proc/sys/vm/drop_caches`, root only: without it
the cold rows say so). Kinds
alternate A B C … C B A per round; each figure is the median of the rounds. Last, two instances of
each INT8 kind at once: the PSS of both against one's (weights shared through the page cache count
once). It prints and writes its section in bench/RESULTS.md.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import requests
from tqdm import tqdm

from bench.core.harness import parse, parser, tree_mapped_memory, tree_memory
from bench.core.llama_cpp import gguf_weights, llama_cpp
from bench.core.results import cpu_model, markdown_table, report
from bench.core.servers import gunicorn_server, llama_server, llama_settings, without_repacking_if_it_crashes
from service.settings import EMBEDDED_MODEL_DIRNAME

TINY, INT8, INT4, Q8, Q4 = (
    "this service, tiny",
    "this service INT8",
    "this service 4-bit",
    "llama.cpp Q8_0",
    "llama.cpp Q4_0",
)
KINDS = (TINY, INT8, INT4, Q8, Q4)
PAIRED = ((INT8, Q8), (INT4, Q4))  # the rows compared: ours against llama.cpp on the same bits per weight
REQUESTS = 10


def drop_page_cache() -> bool:
    """Drop the page cache (root only): whether it was dropped."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def fill_page_cache(kind: str, files: dict, cache_dir: Path) -> None:
    """Read every file `kind` serves from, so that a warm start finds them in the page cache: a cold
    start of another kind dropped it. Reading what is cached already costs a fraction of a second."""
    if kind == TINY:
        paths = [p for p in (cache_dir / EMBEDDED_MODEL_DIRNAME).iterdir() if p.is_file()]
    elif kind.startswith("this service"):
        paths = [p for p in files[kind].iterdir() if p.is_file()]
    else:
        paths = [files[kind], files["mmproj"]]
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass


@contextmanager
def server(kind: str, files: dict, llama: Path, threads: int, logs: Path, no_repack: bool = False):
    """(base, process, seconds from the start to ready) of a server of `kind`; `no_repack`: llama.cpp's -nr."""
    started = time.perf_counter()
    if kind.startswith("this service"):
        env = {"THREADS": str(threads), "MAX_BATCH_SIZE": "4"}
        if kind != TINY:
            env["MODEL_PATH"] = str(files[kind])
        with gunicorn_server(env, logs / "ours.log", timeout=900, poll=0.02) as (base, process):
            yield base, process, time.perf_counter() - started
    else:
        log = logs / "llama.log"
        with llama_server(llama, files[kind], files["mmproj"], threads, log, no_repack) as (base, process):
            yield base, process, time.perf_counter() - started


def measured(measure, kind: str, no_repack: set[str], *args) -> dict:
    """measure(kind, *args, no_repack=…): a llama.cpp server that crashes runs again with -nr."""
    if kind.startswith("this service"):
        return measure(kind, *args)
    return without_repacking_if_it_crashes(lambda nr: measure(kind, *args, no_repack=nr), kind, no_repack)


def request_seconds(base: str, index: int) -> float:
    started = time.perf_counter()
    reply = requests.post(
        base + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": f"Request {index}: name a colour and a shape."}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=600,
    )
    reply.raise_for_status()
    return time.perf_counter() - started


def start_and_measure(kind: str, files: dict, llama: Path, threads: int, logs: Path, no_repack=False) -> dict:
    with server(kind, files, llama, threads, logs, no_repack) as (base, process, ready_s):
        times = [request_seconds(base, i) for i in range(REQUESTS)]
        return {"ready_s": ready_s, "first_s": times[0], "tenth_s": times[-1], "pss_gib": tree_memory(process) / 2**30}


def two_instances(kind: str, files: dict, llama: Path, threads: int, logs: Path, no_repack=False) -> dict:
    """PSS of one instance, then of two running at once (each after one request): all of it, and
    that of their mappings of the weights' files."""
    weights = [files[kind]] if kind.startswith("this service") else [files[kind], files["mmproj"]]
    with server(kind, files, llama, threads, logs, no_repack) as (base, process, _):
        request_seconds(base, 0)
        one, one_mapped = tree_memory(process), tree_mapped_memory(process, weights)
        with server(kind, files, llama, threads, logs, no_repack) as (base2, process2, _):
            request_seconds(base2, 1)
            both = tree_memory(process) + tree_memory(process2)
            both_mapped = tree_mapped_memory(process, weights) + tree_mapped_memory(process2, weights)
    return {"one": one, "two": both, "one_mapped": one_mapped, "two_mapped": both_mapped}


def main(argv=None) -> int:
    p = parser(__doc__, quantization=False)
    p.add_argument("--rounds", type=int, default=3, help="starts per kind and mode, alternating kinds")
    p.add_argument("--no-cold", action="store_true", help="leave the cold starts out")
    args = parse(p, argv, source=True)
    from service.quant.writer import write_quantized
    from service.settings import load_settings

    source = args.model_path  # the 2B-shaped checkpoint (parse says how to make it when missing)
    files = {INT8: source.with_name(source.name + "-int8"), INT4: source.with_name(source.name + "-int4")}
    for bits, kind in ((8, INT8), (4, INT4)):
        if not (files[kind] / "config.json").exists():
            write_quantized(source, files[kind], bits=bits)
    cache_dir = load_settings().cache_dir
    peer_dir = cache_dir / "peer"
    peer_dir.mkdir(parents=True, exist_ok=True)
    log = peer_dir / "bench_start.log"
    llama = llama_cpp(peer_dir, log)
    weights = gguf_weights(source, llama, peer_dir / f"gguf-{source.name}", log, q4=True)
    files.update({Q8: weights["q8_0"], Q4: weights["q4_0"], "mmproj": weights["mmproj"]})
    modes = ["warm"] if args.no_cold else ["warm", "cold"]
    can_drop = args.no_cold or drop_page_cache()
    if not can_drop:
        modes = ["warm"]
    results = {(kind, mode): [] for kind in KINDS for mode in modes}
    no_repack: set[str] = set()  # llama.cpp kinds that crashed with repacking: started with -nr since
    steps = len(KINDS) * (1 + args.rounds * len(modes)) + 2 * len(PAIRED)
    with tqdm(total=steps, desc="bench_start", unit="start") as bar:
        for kind in KINDS:  # warm-up: the files into the page cache, kernels built and chosen
            bar.set_postfix_str(f"{kind}, unmeasured")
            measured(start_and_measure, kind, no_repack, files, llama, args.threads, peer_dir)
            bar.update()
        for round_ in range(args.rounds):
            for mode in modes:
                for kind in KINDS if round_ % 2 == 0 else reversed(KINDS):
                    bar.set_postfix_str(f"{kind}, {mode}, round {round_ + 1}")
                    if mode == "cold":
                        drop_page_cache()
                    else:
                        fill_page_cache(kind, files, cache_dir)
                    run = measured(start_and_measure, kind, no_repack, files, llama, args.threads, peer_dir)
                    results[kind, mode].append(run)
                    bar.update()
        pairs = {}
        for ours, theirs in PAIRED:
            for kind in (ours, theirs):
                bar.set_postfix_str(f"{kind}, two instances")
                pairs[kind] = measured(two_instances, kind, no_repack, files, llama, args.threads, peer_dir)
                bar.update()
    med = {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for key, runs in results.items()}
    return report(
        args,
        "Start → ready, warm and cold, beside llama.cpp",
        {
            "model": f"2B-shaped random weights ({source.name}: -int8, -int4; GGUF Q8_0, Q4_0 + F16 mmproj), "
            "and the embedded tiny model",
            "threads": args.threads,
            "llama.cpp": llama_settings(args.threads)
            + (f"; -nr (no repacking: the default crashed) for {', '.join(sorted(no_repack))}" if no_repack else ""),
            "cold": "page cache dropped before each start" if "cold" in modes else "not measured (needs root)",
            "CPU": cpu_model(),
        },
        table(med, modes, args.rounds, pairs),
    )


def table(med: dict, modes: list[str], rounds: int, pairs: dict) -> str:
    rows = []
    for kind in KINDS:
        row = [kind]
        for mode in modes:
            m = med[kind, mode]
            row += [
                f"{m['ready_s']:.2f}",
                f"{m['first_s']:.2f}",
                f"{m['tenth_s']:.2f}",
                f"{m['first_s'] / m['tenth_s']:.2f}",
            ]
        rows.append(row)
    head = ["server"]
    for mode in modes:
        head += [f"{mode}: start → ready (s)", "first request (s)", "tenth request (s)", "first ÷ tenth"]
    ratios = [
        f"- {ours} ÷ {theirs}, start → ready: "
        + ", ".join(f"{mode} {med[ours, mode]['ready_s'] / med[theirs, mode]['ready_s']:.2f}×" for mode in modes)
        for ours, theirs in PAIRED
    ]
    memory = [
        [kind]
        + [f"{m[key] / 2**30:.2f}" for key in ("one", "two")]
        + [f"{m['two'] / m['one']:.2f}"]
        + [f"{m[key] / 2**30:.2f}" for key in ("one_mapped", "two_mapped")]
        + [f"{m['two_mapped'] / m['one_mapped']:.2f}" if m["one_mapped"] else "—"]
        for kind, m in pairs.items()
    ]
    memory_head = ["server", "one instance (GiB)", "two instances (GiB)", "two ÷ one"]
    memory_head += ["mapped weights, one (GiB)", "mapped weights, two (GiB)", "two ÷ one"]
    return (
        f"Medians of {rounds} start(s) per kind and mode, kinds alternating; client-side times. "
        f"A request: a short text prompt of its own, 8 greedy tokens.\n\n"
        + markdown_table(head, rows)
        + "\n\n"
        + "\n".join(ratios)
        + "\n\nTwo instances at once (each after one request), PSS of their processes, and of their "
        "mappings of the weights' files alone:\n\n" + markdown_table(memory_head, memory) + "\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
