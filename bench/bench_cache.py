"""Conversation KV cache and vision-feature cache, through the HTTP API: time to first token.

Two Gunicorn servers side by side, one with the caches and one with CACHE_ENABLED=false (the
same checkpoint, quantization and threads), taking the requests alternately. On each: a
conversation whose second turn is ~500 tokens holding one 448x448 picture (native endpoint,
`conversation_id`, streaming); the second turn's time to first token is the figure. Then, on the
caching server only, new conversations opening with the picture already seen versus a picture
never seen, the picture first (its KV prefix can be reused) and after some text (only its vision
features can), and one prompt sent twice. Times are measured by the client (request sent → first
text line) and by the server (`timings.time_to_first_token`). Prints the table and writes it to
bench/RESULTS.md. Then the disk tier's runs (bench/cache_tiers.py): second turns from memory, from
disk after an eviction and after a restart, and recomputed; a low-memory round robin.

    flock /tmp/heavy.lock python -m bench.bench_cache     # the 2B-shaped random checkpoint, int8, 2 threads
    python -m bench.bench_cache --model-path /path/to/Qwen3-VL-2B-Instruct --threads 4
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import requests
from tqdm import tqdm

from bench import cache_tiers
from bench.core.client import Reply, chat
from bench.core.harness import parse, parser
from bench.core.inputs import photo_url, text_of_tokens, user
from bench.core.results import markdown_table, report
from bench.core.servers import gunicorn_server


def ask(base: str, messages: list[dict], conversation_id: str, max_tokens: int) -> Reply:
    """One streamed native-endpoint request of a conversation, greedy."""
    body = {"messages": messages, "conversation_id": conversation_id, "max_tokens": max_tokens, "temperature": 0}
    return chat(base, body)


def run_servers(
    env: dict, logs: Path, steps: list[tuple[str, list[dict], str, int, tuple[str, ...]]], bar: tqdm
) -> dict[str, dict]:
    """Start the caching and the cache-free server (one after the other: loading peaks in memory),
    warm both up, then run each step on the servers it names, alternating between them, so that
    the machine's other load affects both alike. Done lines by server and step name."""
    servers = {"on": {"CACHE_ENABLED": "true"}, "off": {"CACHE_ENABLED": "false"}}
    results: dict[str, dict] = {name: {} for name in servers}
    with (
        gunicorn_server({**env, **servers["on"]}, logs / "cached.log", timeout=900) as (on, _),
        gunicorn_server({**env, **servers["off"]}, logs / "uncached.log", timeout=900) as (off, _),
    ):
        bases = {"on": on, "off": off}
        for base in bases.values():
            ask(base, [user(photo_url(999, 224), "Warm-up.")], "warm-up", 2)  # first-call costs, not measured
            bar.update()
        for name, messages, conversation_id, max_tokens, where in steps:
            for server in where:
                results[server].setdefault(name, []).append(ask(bases[server], messages, conversation_id, max_tokens))
                bar.update()
        results["on"]["metrics"] = requests.get(on + "/metrics", timeout=30).text
    return results


def median_run(runs: list[Reply]) -> Reply:
    """The run whose time to first token is the median (an odd count: the middle one)."""
    return sorted(runs, key=lambda r: r.ttft)[len(runs) // 2]


def cache_counters(metrics_text: str) -> str:
    keep = ("qwen3vl_cache_hits_total", "qwen3vl_cache_misses_total", "qwen3vl_cache_reused_tokens_total")
    lines = [line for line in metrics_text.splitlines() if line.startswith(keep)]
    return "; ".join(line.replace("qwen3vl_cache_", "") for line in lines)


TIER_NAMES = ("memory", "disk", "recomputed")


def server_env(args) -> dict[str, str]:
    return {
        "MODEL_PATH": str(args.model_path),
        "QUANTIZATION": args.quantization,
        "THREADS": str(args.threads),
        "LOG_LEVEL": "warning",
    }


def disk_tier(args) -> None:
    """The disk tier's two sections (bench/cache_tiers.py)."""
    from transformers import AutoConfig

    from service.memory import kv_cache_bytes

    logs = Path(tempfile.mkdtemp(prefix="bench-cache-tiers-"))
    env = server_env(args)
    long_text = text_of_tokens(args.model_path, args.long_tokens)
    rows, note = cache_tiers.second_turns(env, logs, long_text, photo_url(7), args.repeats)
    header = [
        "conversation",
        "second turn's cache",
        "prompt tokens",
        "cached tokens",
        "cached_from",
        "read (MB)",
        "disk load (s)",
        "TTFT (s)",
        "x recompute",
        "target",
    ]
    settings = {
        "MODEL_PATH": args.model_path.name,
        "QUANTIZATION": args.quantization,
        "THREADS": args.threads,
        "KV_DTYPE": "bfloat16",
        "client": "requests, native endpoint, stateless (the whole history sent)",
    }
    report(
        args,
        "Conversation cache on disk: second turns by tier (bench/bench_cache.py)",
        settings,
        markdown_table(header, rows) + "\n\n" + note,
    )
    # The memory tier holding about three conversations of a picture and three short turns.
    keep = 3 * kv_cache_bytes(AutoConfig.from_pretrained(args.model_path), 300, 2)
    pictures = [photo_url(500 + i) for i in range(args.conversations)]
    runs = {label: cache_tiers.low_memory(env, logs, pictures, keep, label == "on") for label in ("on", "off")}
    header = ["disk tier", "turn", "from memory", "from disk", "recomputed", "median TTFT (s)"]
    rows = [
        [label, turn + 1, *(run["counts"].get((turn, t), 0) for t in TIER_NAMES), run["ttft"][turn]]
        for label, run in runs.items()
        for turn in range(3)
    ]
    report(
        args,
        "Conversation cache on disk: low memory, round-robin conversations (bench/bench_cache.py)",
        {**settings, "CONVERSATION_CACHE_MAX_BYTES": keep, "conversations": args.conversations, "max_tokens": 8},
        markdown_table(header, rows)
        + f"\n\n{args.conversations} conversations of a 448x448 picture, three turns each, visited round-robin; "
        f"the memory tier's budget ({keep / 2**20:.0f} MiB) holds about three of them. With the disk tier "
        "(KV_DISK_MB=4096) and without (KV_DISK_MB=0), one server each, the same requests.",
    )


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--prompt-tokens", type=int, default=500, help="size of the second turn's prompt")
    p.add_argument("--first-answer-tokens", type=int, default=24, help="max_tokens of the first turn")
    p.add_argument("--measured-tokens", type=int, default=4, help="max_tokens of the measured requests")
    p.add_argument("--repeats", type=int, default=3, help="of every measurement (odd: the median is reported)")
    p.add_argument(
        "--disk-tier",
        choices=["also", "only", "no"],
        default="also",
        help="the disk tier's runs (bench/cache_tiers.py): with the memory caches' table, alone, or not",
    )
    p.add_argument("--long-tokens", type=int, default=3000, help="the long conversation's first prompt, in tokens")
    p.add_argument("--conversations", type=int, default=20, help="picture conversations of the low-memory run")
    args = parse(p, argv)
    if args.disk_tier != "no":
        disk_tier(args)
    if args.disk_tier == "only":
        return 0

    seen = photo_url(1)
    follow_up = "Now tell me which part of the picture is the brightest, and why."
    # Turn 1 = picture + prose + question; turn 2 adds the answer and a follow-up: ~prompt_tokens in all.
    prose = text_of_tokens(args.model_path, args.prompt_tokens - 196 - args.first_answer_tokens - 40)
    conversation, openings = [], []
    for r in range(args.repeats):
        both = ("on", "off")
        conversation += [
            (
                "turn 1",
                [user(seen, prose + " What is in this picture?")],
                f"bench-talk-{r}",
                args.first_answer_tokens,
                both,
            ),
            ("turn 2", [user(follow_up)], f"bench-talk-{r}", args.measured_tokens, both),
        ]
        # A different opening sentence each time, so "after text" shares no KV prefix with earlier runs.
        intro = f"Look at photograph number {r + 1} from my holiday, please."
        openings += [
            (
                "seen first",
                [user(seen, "Describe the colours you see.")],
                f"bench-seen-first-{r}",
                args.measured_tokens,
                ("on",),
            ),
            (
                "new first",
                [user(photo_url(100 + r), "Describe the colours you see.")],
                f"bench-new-first-{r}",
                args.measured_tokens,
                ("on",),
            ),
            (
                "seen after text",
                [user(intro, seen, "Describe the colours.")],
                f"bench-seen-text-{r}",
                args.measured_tokens,
                ("on",),
            ),
            (
                "new after text",
                [user(intro, photo_url(200 + r), "Describe the colours.")],
                f"bench-new-text-{r}",
                args.measured_tokens,
                ("on",),
            ),
            # The very same prompt twice (a client retrying): all but its last token is cached.
            (
                "original",
                [user(photo_url(300 + r), f"{intro} Describe the colours.")],
                f"bench-original-{r}",
                args.measured_tokens,
                ("on",),
            ),
            (
                "resent",
                [user(photo_url(300 + r), f"{intro} Describe the colours.")],
                f"bench-resent-{r}",
                args.measured_tokens,
                ("on",),
            ),
        ]
    env = server_env(args)
    env["KV_DISK_DIR"] = tempfile.mkdtemp(prefix="bench-cache-kv-")  # the caching server starts with none
    logs = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    bar = tqdm(total=2 + len(conversation) * 2 + len(openings), desc="requests", unit="req")
    results = run_servers(env, logs, conversation + openings, bar)
    bar.close()
    on, off = results["on"], results["off"]

    def row(label, runs, baseline_runs=None):
        median = median_run(runs)
        done = median.done
        speed_up = median_run(baseline_runs).ttft / median.ttft if baseline_runs else ""
        texts = [r.first_text for r in runs if r.first_text is not None]
        return [
            label,
            done["usage"]["prompt_tokens"],
            done["usage"]["cached_tokens"],
            done["vision_cache_hits"],
            done["timings"].get("vision_encode", 0.0),
            done["timings"]["prefill"],
            median.ttft,
            speed_up,
            done["timings"]["decode_tokens_per_s"],
            statistics.median(texts) if len(texts) == len(runs) else "no text",
            statistics.median(r.total for r in runs),
            f"{median.text_events}/{median.tokens}",
        ]

    header = [
        "request",
        "prompt tokens",
        "cached tokens",
        "vision cache hits",
        "vision encode (s)",
        "prefill (s)",
        "TTFT (s)",
        "speed-up (TTFT)",
        "decode (tok/s)",
        "client: first text line (s)",
        "client: done line (s)",
        "text lines / tokens",
    ]
    rows = [
        row("turn 2, caching disabled", off["turn 2"]),
        row("turn 2, reusing turn 1", on["turn 2"], off["turn 2"]),
        row("new conversation, never-seen picture first", on["new first"]),
        row("new conversation, seen picture first", on["seen first"], on["new first"]),
        row("new conversation, never-seen picture after text", on["new after text"]),
        row("new conversation, seen picture after text", on["seen after text"], on["new after text"]),
        row("a prompt sent for the first time", on["original"]),
        row("the identical prompt resent (another conversation)", on["resent"], on["original"]),
    ]
    second_turn, repeated, resent = rows[1][7], rows[3][7], rows[7][6]
    same = all(a.done["text"] == b.done["text"] for step in ("turn 1", "turn 2") for a, b in zip(on[step], off[step]))
    body = markdown_table(header, rows) + (
        f"\n\nMedians of {args.repeats} runs. TTFT = the server's `timings.time_to_first_token` (request "
        "arrival to first token), sent in the `done` line. The client's first text line comes with the first "
        'token that decodes to text: a random model\'s tokens often decode to none ("no text"), so the client '
        "sees the done line only.\n"
        f"Targets (this run): second turn {second_turn:.1f}x faster to first token (target >= 25x, "
        f"{'met' if second_turn >= 25 else 'missed'}); repeated picture {repeated:.1f}x (target >= 5x, "
        f"{'met' if repeated >= 5 else 'missed'}); identical resent prompt {resent:.3g} s to first token (target "
        f"<= 0.3 s, {'met' if resent <= 0.3 else 'missed'}). The cached second turn computed "
        f"{rows[1][1] - rows[1][2]} tokens in one forward pass (the native endpoint keeps the first answer's "
        f"generated ids, so its KV is reused too), and a pass costs at least a decode step "
        f"(1/{rows[1][8]:.3g} s here). "
        "Turn 1 answered "
        f"{on['turn 1'][0].tokens} tokens; greedy answers with and without the caches "
        f"identical: {same}.\nCaching server's /metrics after the run: {cache_counters(on['metrics'])}."
    )
    settings = {
        "MODEL_PATH": args.model_path.name,
        "QUANTIZATION": args.quantization,
        "THREADS": args.threads,
        "first-turn max_tokens": args.first_answer_tokens,
        "measured max_tokens": args.measured_tokens,
        "client": "requests, streaming NDJSON, loopback, native endpoint",
    }
    return report(
        args,
        "Conversation and vision caches: time to first token (bench/bench_cache.py)",
        settings,
        body,
    )


if __name__ == "__main__":
    sys.exit(main())
