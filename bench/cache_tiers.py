"""bench_cache's disk-tier runs (service/caches/kv_disk/), through Gunicorn and the native endpoint.

1. Second turns of a ~3,000-token text conversation and of a one-picture conversation, each (a) from
   memory, (b) from disk after memory evicted it (a one-entry memory tier; the files in the page
   cache, as after a recent eviction), (c) after a restart (a new server on the same store, the
   files dropped from the page cache first: read from the device), (d) recomputed (the same prompt
   with its first token changed: nothing to reuse). Stateless requests (the whole history sent), so
   the same request works after the restart.
2. Low memory: the memory tier holding about three of the conversations, 20 three-turn picture
   conversations visited round-robin; where each turn's cached tokens came from, with the disk tier
   and without it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from bench.core.client import Reply, chat
from bench.core.inputs import message
from bench.core.servers import gunicorn_server, metric


def ask(base: str, messages: list[dict], max_tokens: int) -> Reply:
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
    """`ask`'s done line, with the server's disk-tier load time and bytes read for it."""
    seconds, read = disk_loads(base)
    done = ask(base, messages, max_tokens).done
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
            firsts[name] = ask(base, conversations[name], 16).done
            bar.update()
        for name in conversations:
            for i in range(repeats):
                ask(base, filler, 1)  # memory now holds the filler only
                ask(base, follow(name, firsts[name], i, "Go on."), 1)  # and now this conversation
                # (a) from memory: right after a turn of its own conversation
                results.setdefault((name, TIERS[0]), []).append(ask(base, follow(name, firsts[name], i), 4).done)
                ask(base, filler, 1)
                # (b) from disk: another conversation came in between, memory evicted it
                results.setdefault((name, TIERS[1]), []).append(disk_ask(base, follow(name, firsts[name], i + 1), 4))
                bar.update(5)
    rate = device_read_rate(store)
    bar.update()
    with gunicorn_server(env, logs / "tiers-2.log", timeout=1800) as (base, _):
        ask(base, filler, 1)  # first-call costs, not measured
        for name in conversations:
            for i in range(repeats):
                ask(base, filler, 1)  # from the second repeat on, the conversation is in memory: evicted
                drop_from_page_cache(store)
                # (c) after a restart, the store's files on the device
                results.setdefault((name, TIERS[2]), []).append(disk_ask(base, follow(name, firsts[name], i + 2), 4))
                bar.update()
            # (d) recomputed: the same prompt with another first token, nothing to reuse
            changed = follow(name, firsts[name], 0)  # (its own question too)
            changed[0] = {**changed[0], "content": [{"type": "text", "text": "Note."}, *changed[0]["content"]]}
            results[(name, TIERS[3])] = [ask(base, changed, 4).done]
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
                done = ask(base, history, 8).done
                history += [message("assistant", done["text"]), message("user", FOLLOW_UPS[turn])]
                tier = done["usage"]["cached_from"] or "recomputed"
                counts[(turn, tier)] = counts.get((turn, tier), 0) + 1
                ttfts.setdefault(turn, []).append(done["timings"]["time_to_first_token"])
                bar.update()
        bar.close()
    return {"counts": counts, "ttft": {t: statistics.median(v) for t, v in ttfts.items()}}
