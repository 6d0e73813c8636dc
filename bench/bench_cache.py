"""Conversation KV cache and vision-feature cache, through the HTTP API: time to first token.

Two Gunicorn servers side by side, one with the caches and one with CACHE_ENABLED=false (the
same checkpoint, quantization and threads), taking the requests alternately. On each: a
conversation whose second turn is ~500 tokens holding one 448x448 picture (native endpoint,
`conversation_id`, streaming); the second turn's time to first token is the figure. Then, on the
caching server only, new conversations opening with the picture already seen versus a picture
never seen, the picture first (its KV prefix can be reused) and after some text (only its vision
features can), and one prompt sent twice. Times are measured by the client (request sent → first
text line) and by the server (`timings.time_to_first_token`). Prints the table and writes it to
bench/RESULTS.md. Then the disk tier's runs (service/caches/kv_disk/), each a section of its own:

1. Second turns of a ~3,000-token text conversation and of a one-picture conversation, each (a) from
   memory, (b) from disk after memory evicted it (a one-entry memory tier; the files in the page
   cache, as after a recent eviction), (c) after a restart (a new server on the same store, the
   files dropped from the page cache first: read from the device), (d) recomputed (the same prompt
   with its first token changed: nothing to reuse). Stateless requests (the whole history sent), so
   the same request works after the restart.
2. Low memory: the memory tier holding about three of the conversations, 20 three-turn picture
   conversations visited round-robin; where each turn's cached tokens came from, with the disk tier
   and without it.

    flock /tmp/heavy.lock python -m bench.bench_cache     # the 2B-shaped random checkpoint, int8, 2 threads
    python -m bench.bench_cache --model-path /path/to/Qwen3-VL-2B-Instruct --threads 4
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from bench.core.client import Reply, chat
from bench.core.harness import parse, parser
from bench.core.inputs import message, photo_url, text_of_tokens, user
from bench.core.results import markdown_table, report
from bench.core.servers import gunicorn_server, metric


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


# -- the disk tier ----------------------------------------------------------------------------


def resend(base: str, messages: list[dict], max_tokens: int) -> Reply:
    """One stateless native request (no conversation_id, the whole history sent), greedy."""
    return chat(base, {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": False}, timeout=1800)


def drop_from_page_cache(folder: Path) -> int:
    """Ask the kernel to forget the files' cached pages (no root needed): the next read is the
    device's. The bytes of the files."""
    total = 0
    for path in folder.glob("*/*.kv"):
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        total += path.stat().st_size
    return total


def device_read_rate(folder: Path) -> float:
    """Bytes per second reading the store's files from the device (dropped from the page cache first)."""
    total = drop_from_page_cache(folder)
    t0 = time.perf_counter()
    for path in folder.glob("*/*.kv"):
        with open(path, "rb") as f:
            while f.read(8 << 20):
                pass
    return total / (time.perf_counter() - t0)


def disk_loads(base: str) -> tuple[float, float]:
    """The server's disk-tier loads so far: (seconds in all, bytes read)."""
    return metric(base, "qwen3vl_kv_disk_load_seconds_sum"), metric(base, "qwen3vl_kv_disk_read_bytes_total")


FOLLOW_UPS = [
    "Which part of it matters most, and why?",
    "Summarise it in one sentence, please.",
    "What would you ask next about it?",
]


TIERS = ("memory", "disk, after eviction", "disk, after a restart (read from the device)", "recomputed")


def disk_ask(base: str, messages: list[dict], max_tokens: int) -> dict:
    """`resend`'s done line, with the server's disk-tier load time and bytes read for it."""
    seconds, read = disk_loads(base)
    done = resend(base, messages, max_tokens).done
    after_seconds, after_read = disk_loads(base)
    done["disk_load"], done["disk_read"] = after_seconds - seconds, after_read - read
    return done


def second_turns(env: dict, logs: Path, long_text: str, picture: str, repeats: int) -> tuple[list, str]:
    """Part 1: rows (conversation, tier, prompt and cached tokens, tier used, read, load, TTFT,
    × recompute, target) and a note."""
    store = Path(tempfile.mkdtemp(prefix="bench-kv-store-"))
    env = {**env, "KV_DISK_DIR": str(store), "CONVERSATION_CACHE_MAX_ENTRIES": "1"}
    conversations = {
        "~3,000-token text": [message("user", long_text + " What is this text about?")],
        "one picture": [message("user", picture, "What is in this picture? Describe it.")],
    }
    filler = [message("user", "Say hello.")]  # evicts the one conversation memory holds
    results: dict[tuple[str, str], list[dict]] = {}
    bar = tqdm(total=2 + 2 * 5 * repeats + 1 + 2 * (repeats + 1), desc="disk tier: second turns", unit="req")

    asked = iter(range(1, 1000))

    def follow(name: str, first: dict, i: int, question: str | None = None) -> list[dict]:
        """The second turn: a question no request asked before (each tier's hit reuses the same prefix)."""
        said = [*conversations[name], message("assistant", first["text"])]
        return [*said, message("user", f"Question {next(asked)}: {question or FOLLOW_UPS[i % len(FOLLOW_UPS)]}")]

    with gunicorn_server(env, logs / "tiers-1.log", timeout=1800) as (base, _):
        firsts = {}
        for name in conversations:
            firsts[name] = resend(base, conversations[name], 16).done
            bar.update()
        for name in conversations:
            for i in range(repeats):
                resend(base, filler, 1)  # memory now holds the filler only
                resend(base, follow(name, firsts[name], i, "Go on."), 1)  # and now this conversation
                # (a) from memory: right after a turn of its own conversation
                results.setdefault((name, TIERS[0]), []).append(resend(base, follow(name, firsts[name], i), 4).done)
                resend(base, filler, 1)
                # (b) from disk: another conversation came in between, memory evicted it
                results.setdefault((name, TIERS[1]), []).append(disk_ask(base, follow(name, firsts[name], i + 1), 4))
                bar.update(5)
    rate = device_read_rate(store)
    bar.update()
    with gunicorn_server(env, logs / "tiers-2.log", timeout=1800) as (base, _):
        resend(base, filler, 1)  # first-call costs, not measured
        for name in conversations:
            for i in range(repeats):
                resend(base, filler, 1)  # from the second repeat on, the conversation is in memory: evicted
                drop_from_page_cache(store)
                # (c) after a restart, the store's files on the device
                results.setdefault((name, TIERS[2]), []).append(disk_ask(base, follow(name, firsts[name], i + 2), 4))
                bar.update()
            # (d) recomputed: the same prompt with another first token, nothing to reuse
            changed = follow(name, firsts[name], 0)  # (its own question too)
            changed[0] = {**changed[0], "content": [{"type": "text", "text": "Note."}, *changed[0]["content"]]}
            results[(name, TIERS[3])] = [resend(base, changed, 4).done]
            bar.update()
    bar.close()

    def ttft(done: dict) -> float:
        return done["timings"]["time_to_first_token"]

    rows, verdicts = [], []
    for name in conversations:
        median = {tier: sorted(results[(name, tier)], key=ttft)[len(results[(name, tier)]) // 2] for tier in TIERS}
        recompute, memory = ttft(median[TIERS[3]]), ttft(median[TIERS[0]])
        for tier, done in median.items():
            target = ""
            if tier.startswith("disk"):
                allowed = 1.5 * memory + done["disk_read"] / rate
                target = f"{'met' if ttft(done) <= allowed else 'missed'} (<= {allowed:.2f} s)"
                verdicts.append(f"{name}, {tier}: {ttft(done) / recompute:.3f}x recompute")
            rows.append(
                [
                    name,
                    tier,
                    done["usage"]["prompt_tokens"],
                    done["usage"]["cached_tokens"],
                    done["usage"]["cached_from"] or "-",
                    f"{done['disk_read'] / 1e6:.0f}" if "disk_read" in done else "",
                    f"{done['disk_load']:.3f}" if "disk_load" in done else "",
                    ttft(done),
                    f"{ttft(done) / recompute:.3f}",
                    target,
                ]
            )
    note = (
        f"Device read rate of the store's files (dropped from the page cache, read in order): {rate / 1e9:.2f} GB/s. "
        f"Medians of {repeats} second turns per tier (one recompute each). The memory tier holds one conversation "
        "(CONVERSATION_CACHE_MAX_ENTRIES=1): a request of another conversation evicts it. Target: a disk hit "
        "<= 1.5x the memory hit + its bytes at the device's rate (last column); <= 0.1x recompute for the "
        "3,000-token conversation and after a restart: " + "; ".join(verdicts) + "."
    )
    return rows, note


def low_memory(env: dict, logs: Path, pictures: list[str], keep_bytes: int, with_disk: bool) -> dict:
    """Part 2: 20 three-turn picture conversations round-robin; per turn, how many came from each tier."""
    store = Path(tempfile.mkdtemp(prefix="bench-kv-low-"))
    env = {
        **env,
        "KV_DISK_DIR": str(store),
        "KV_DISK_MB": "4096" if with_disk else "0",
        "CONVERSATION_CACHE_MAX_BYTES": str(keep_bytes),
    }
    histories = [[message("user", p, "What is in this picture?")] for p in pictures]
    counts: dict[tuple[int, str], int] = {}
    ttfts: dict[int, list[float]] = {}
    label = "with" if with_disk else "without"
    with gunicorn_server(env, logs / f"low-memory-{label}.log", timeout=1800) as (base, _):
        bar = tqdm(total=3 * len(histories), desc=f"low memory, {label} the disk tier", unit="req")
        for turn in range(3):
            for history in histories:
                done = resend(base, history, 8).done
                history += [message("assistant", done["text"]), message("user", FOLLOW_UPS[turn])]
                tier = done["usage"]["cached_from"] or "recomputed"
                counts[(turn, tier)] = counts.get((turn, tier), 0) + 1
                ttfts.setdefault(turn, []).append(done["timings"]["time_to_first_token"])
                bar.update()
        bar.close()
    return {"counts": counts, "ttft": {t: statistics.median(v) for t, v in ttfts.items()}}


TIER_NAMES = ("memory", "disk", "recomputed")


def server_env(args) -> dict[str, str]:
    return {
        "MODEL_PATH": str(args.model_path),
        "QUANTIZATION": args.quantization,
        "THREADS": str(args.threads),
        "LOG_LEVEL": "warning",
    }


def disk_tier(args) -> None:
    """The disk tier's two sections."""
    from transformers import AutoConfig

    from service.memory import kv_cache_bytes

    logs = Path(tempfile.mkdtemp(prefix="bench-cache-tiers-"))
    env = server_env(args)
    long_text = text_of_tokens(args.model_path, args.long_tokens)
    rows, note = second_turns(env, logs, long_text, photo_url(7), args.repeats)
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
        "Conversation cache on disk: second turns by tier",
        settings,
        markdown_table(header, rows) + "\n\n" + note,
    )
    # The memory tier holding about three conversations of a picture and three short turns.
    keep = 3 * kv_cache_bytes(AutoConfig.from_pretrained(args.model_path), 300, 2)
    pictures = [photo_url(500 + i) for i in range(args.conversations)]
    runs = {label: low_memory(env, logs, pictures, keep, label == "on") for label in ("on", "off")}
    header = ["disk tier", "turn", "from memory", "from disk", "recomputed", "median TTFT (s)"]
    rows = [
        [label, turn + 1, *(run["counts"].get((turn, t), 0) for t in TIER_NAMES), run["ttft"][turn]]
        for label, run in runs.items()
        for turn in range(3)
    ]
    report(
        args,
        "Conversation cache on disk: low memory, round-robin conversations",
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
        help="the disk tier's runs: with the memory caches' table, alone, or not",
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
        "Conversation and vision caches: time to first token",
        settings,
        body,
    )


if __name__ == "__main__":
    sys.exit(main())
