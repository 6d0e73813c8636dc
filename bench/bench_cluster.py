"""Many machines as one service, on loopback: second turns' KV cached share and first token with
affinity, round-robin and one machine; what a lost machine costs.

    flock /tmp/heavy.lock python -m bench.bench_cluster                 # the 2B-shaped 4-bit checkpoint
    flock /tmp/heavy.lock python -m bench.bench_cluster --tiny --no-save   # a quick check of the scenario

Three "machines" (bench/core/cluster.py: Gunicorn instances on 127.0.0.2–127.0.0.4, each its own
CACHE_DIR, THREADS=1 — three instances share this machine's 2 cores, so no figure here is a machine's
throughput) behind the proxy service.deploy renders, one Redis. Three arms, each a fresh cluster:
affinity (nginx/affinity.js, `hash … consistent`), round-robin (the same proxy, no key), one machine.
The mixed workload, the same in each arm: conversations on every API — Chat Completions and Anthropic
Messages resending their history, Responses by `previous_response_id` and by `conversation`, the native
endpoint by `conversation_id` with a picture — two turns each, streamed; a stateless client resending
its first turn; and a batch of lines running at batch priority the whole time. Per arm: the second
turns' (and resends') cached share of their prompt tokens, and their first token (client-side, median;
those turns ask for one token, and a random model's token may render as no text, so it is the answer's
whole wait).
Then, in the affinity arm, a machine is killed (SIGKILL): the next turn of a conversation it held (it
lands on another machine and recomputes its KV) against a warm next turn of one it did not.
Throughput scaling cannot be measured on 2 cores: the per-machine figure (one instance alone on the
machine, its decode rate) is what a user multiplies by the machines they add. Every instance runs
THREADS=1 (the one machine too, for comparison), and the section says so.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import anthropic
import requests
from tqdm import tqdm

from bench.core.cluster import loopback_cluster
from bench.core.harness import parse, parser
from bench.core.inputs import photo_url
from bench.core.results import markdown_table, report

ARMS = ("affinity", "round-robin", "one machine")
MACHINES = 3
CONVERSATIONS = 2  # of each kind
BATCH_LINES = 12
ENV = {"MAX_BATCH_SIZE": "4", "QUEUE_SIZE": "16", "QUEUE_TIMEOUT": "600", "BATCH_LEASE_SECONDS": "60"}
SYSTEM = "You are a careful assistant. Answer in two sentences."


def _openai(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


class Turns:
    """One conversation of one API: `turn(text)` streams the next turn through `url`, returning its first
    token's time (client-side), its prompt tokens and those taken from the KV cache."""

    def __init__(self, kind: str, url: str, answer_tokens: int, picture: str):
        self.kind, self.url, self.tokens, self.picture = kind, url, answer_tokens, picture
        self.max_tokens = answer_tokens
        self.tag = uuid.uuid4().hex[:8]
        self.history: list[dict] = []
        self.last_id: str | None = None  # previous_response_id, conversation id, native conversation_id
        self.request_id = ""

    def turn(self, text: str, answer_tokens: int | None = None) -> tuple[float, int, int]:
        """(first token, client-side: the first visible text, else — a random model's tokens may render
        as nothing — the whole answer's time; prompt tokens; cached ones). The measured turns ask for
        one token, so the two are the same wait: what a client waits for its next answer to start."""
        self.request_id = "req-" + uuid.uuid4().hex[:20]
        self.max_tokens = answer_tokens or self.tokens
        started = time.perf_counter()
        first, prompt, cached = getattr(self, "_" + self.kind.replace(" ", "_"))(text, started)
        return first if first is not None else time.perf_counter() - started, prompt, cached

    def _headers(self) -> dict:
        return {"X-Request-Id": self.request_id}

    def _chat(self, text: str, started: float):
        if not self.history:
            self.history = [{"role": "system", "content": f"({self.tag}) {SYSTEM}"}]
        self.history.append({"role": "user", "content": text})
        stream = _openai(self.url).chat.completions.create(
            model="m", messages=self.history, max_tokens=self.max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_headers=self._headers(),
        )  # fmt: skip
        first, parts, usage = None, [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - started
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        self.history.append({"role": "assistant", "content": "".join(parts)})
        return first, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    def _messages(self, text: str, started: float):
        self.history.append({"role": "user", "content": text})
        client = anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=600)
        first = None
        with client.messages.stream(
            model="m", max_tokens=self.max_tokens, system=f"({self.tag}) {SYSTEM}", messages=self.history,
            extra_headers=self._headers(),
        ) as stream:  # fmt: skip
            for _ in stream.text_stream:
                first = first or time.perf_counter() - started
            final = stream.get_final_message()
        self.history.append({"role": "assistant", "content": final.content[0].text if final.content else ""})
        usage = final.usage
        return first, usage.input_tokens + usage.cache_read_input_tokens, usage.cache_read_input_tokens

    def _responses(self, text: str, started: float, by_conversation: bool = False):
        client = _openai(self.url)
        extra = {}
        if by_conversation:
            if self.last_id is None:
                made = client.conversations.create(items=[{"role": "system", "content": f"({self.tag}) {SYSTEM}"}])
                self.last_id = made.id
            extra = {"conversation": self.last_id}
        else:  # instructions are not carried on by previous_response_id: a client sends them each turn
            extra = {"instructions": f"({self.tag}) {SYSTEM}"}
            if self.last_id is not None:
                extra["previous_response_id"] = self.last_id
        first, usage = None, None
        stream = client.responses.create(
            model="m",
            input=text,
            max_output_tokens=self.max_tokens,
            stream=True,
            extra_headers=self._headers(),
            **extra,
        )
        for event in stream:
            if event.type == "response.output_text.delta":
                first = first or time.perf_counter() - started
            elif event.type in ("response.completed", "response.incomplete"):
                usage = event.response.usage
                if not by_conversation:
                    self.last_id = event.response.id
        return first, usage.input_tokens, usage.input_tokens_details.cached_tokens

    def _conversation(self, text: str, started: float):
        return self._responses(text, started, by_conversation=True)

    def _native(self, text: str, started: float):
        body = {"prompt": text, "max_tokens": self.max_tokens}
        if self.last_id is None:
            body["images"] = [self.picture]
            body["prompt"] = f"({self.tag}) {text}"
        else:
            body["conversation_id"] = self.last_id
        first, done = None, None
        with requests.post(self.url + "/v1/chat", json=body, stream=True, timeout=600, headers=self._headers()) as r:
            r.raise_for_status()
            for raw in r.iter_lines():
                line = json.loads(raw)
                if "delta" in line:
                    first = first or time.perf_counter() - started
                elif "conversation_id" in line and self.last_id is None:
                    self.last_id = line["conversation_id"]
                if line.get("done"):
                    done = line
        return first, done["usage"]["prompt_tokens"], done["usage"]["cached_tokens"]


KINDS = ("chat", "messages", "responses", "conversation", "native")


def start_batch(url: str, tokens: int) -> str:
    """A batch of chat lines running beside the conversations (at BATCH_PRIORITY)."""
    client = _openai(url)
    lines = [
        {"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "max_tokens": tokens, "messages": [{"role": "user", "content": f"Batch line {i}."}]}}
        for i in range(BATCH_LINES)
    ]  # fmt: skip
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("lines.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id


def workload(url: str, tokens: int, bar) -> dict:
    """The mixed workload through `url`: second turns' and resends' cached shares and first tokens, and
    the conversations (for the machine-loss step). Each conversation its own words and picture from its
    first token: what one shares with another is nothing but the template's first tokens."""
    batch = start_batch(url, tokens)
    kinds = [kind for kind in KINDS for _ in range(CONVERSATIONS)]
    conversations = [Turns(kind, url, tokens, photo_url(seed=i)) for i, kind in enumerate(kinds)]
    for c in conversations:
        c.turn("Describe what a lighthouse does and why it matters.")
        bar.update()
    seconds, shares = {}, {}
    # second turns in a shuffled order (the same in every arm): clients do not come back in lock-step,
    # and in the first turns' order round-robin would send some back to their machine by the order alone
    for c in random.Random(0).sample(conversations, len(conversations)):
        first, prompt, cached = c.turn("And what would change without it?", answer_tokens=1)
        seconds.setdefault(c.kind, []).append(first)
        shares.setdefault(c.kind, []).append(cached / prompt)
        bar.update()
    # a stateless client resending its first turn whole (a retry): the first messages find their machine
    for c in conversations[:CONVERSATIONS]:
        resend = Turns("chat", url, tokens, c.picture)
        resend.tag, resend.history = c.tag, c.history[:2]
        first, prompt, cached = resend.turn(c.history[1]["content"], answer_tokens=1)
        seconds.setdefault("resend", []).append(first)
        shares.setdefault("resend", []).append(cached / prompt)
    batch_state = _openai(url).batches.retrieve(batch)
    return {"seconds": seconds, "shares": shares, "conversations": conversations, "batch": batch_state}


def machine_loss(cluster, conversations: list[Turns]) -> dict:
    """Kill the machine that holds one native conversation: its next turn (recomputed elsewhere) against
    a warm next turn of a conversation held by a machine still up."""
    moved = next(c for c in conversations if c.kind == "native")
    home = cluster.served_by(moved.request_id)
    elsewhere = [c for c in conversations if c is not moved and cluster.served_by(c.request_id) is not home]
    warm = next((c for c in elsewhere if c.kind == moved.kind), elsewhere[0])
    home.kill()
    moved_first, moved_prompt, moved_cached = moved.turn("Summarise it in one line.", answer_tokens=1)
    warm_first, warm_prompt, warm_cached = warm.turn("Summarise it in one line.", answer_tokens=1)
    return {
        "moved": (moved_first, moved_cached / moved_prompt, cluster.served_by(moved.request_id).name),
        "warm": (warm_first, warm_cached / warm_prompt, cluster.served_by(warm.request_id).name),
        "killed": home.name,
    }


def per_machine_rate(url: str, tokens: int) -> float:
    """One instance alone on the machine (THREADS=1): its decode rate on one stream."""
    done = requests.post(
        url + "/v1/chat", json={"prompt": "Count slowly from one.", "max_tokens": tokens, "stream": False}, timeout=600
    ).json()
    return done["timings"]["decode_tokens_per_s"]


def run_arm(arm: str, model: Path, logs: Path, tokens: int, bar) -> dict:
    machines = 1 if arm == "one machine" else MACHINES
    balance = "round-robin" if arm == "round-robin" else "affinity"
    env = {**ENV, "THREADS": "1"}  # three instances share 2 cores; the one machine alike, for comparison
    from service import native
    from service.settings import load_settings

    cache = load_settings().cache_dir
    native.prebuild(cache)  # the machines' image: kernels built once, copied into each machine's CACHE_DIR
    where = logs / arm.replace(" ", "-")
    with loopback_cluster(where, model, env, machines, balance=balance, cache_template=cache) as cluster:
        bar.set_postfix_str(arm)
        result = workload(cluster.proxy_url, tokens, bar)
        if arm == "affinity":
            result["loss"] = machine_loss(cluster, result["conversations"])
        if arm == "one machine":
            result["rate"] = per_machine_rate(cluster.proxy_url, tokens)
        del result["conversations"]
    return result


def pooled(values: dict[str, list[float]]) -> list[float]:
    return [v for kind in values for v in values[kind]]


def main(argv=None) -> int:
    p = parser(__doc__, quantization=False)
    p.add_argument(
        "--model", default="2b", help="the make-model preset whose 4-bit checkpoint (-int4) the machines serve"
    )
    p.add_argument("--tokens", type=int, default=48, help="tokens each answer generates at most")
    args = parse(p, argv, source=True)
    model = args.model_path
    if not args.tiny and not model.name.endswith("-int4"):
        from service.quant.writer import write_quantized

        int4 = model.with_name(model.name + "-int4")
        if not (int4 / "config.json").exists():
            write_quantized(model, int4, bits=4)
        model = int4
    logs = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    steps = len(ARMS) * 2 * len(KINDS) * CONVERSATIONS
    results = {}
    with tqdm(total=steps, desc="bench_cluster", unit="turn") as bar:
        for arm in ARMS:
            results[arm] = run_arm(arm, model, logs, args.tokens, bar)
    one = statistics.mean(pooled(results["one machine"]["shares"]))
    rows = []
    for arm in ARMS:
        shares, seconds = results[arm]["shares"], results[arm]["seconds"]
        share = statistics.mean(pooled(shares))
        by_kind = ", ".join(f"{k} {statistics.mean(v):.2f}" for k, v in shares.items())
        rows.append(
            [
                arm,
                f"{share:.2f}",
                f"{share / one:.2f}×" if one else "-",
                f"{statistics.median(pooled(seconds)):.3f}",
                by_kind,
            ]
        )
    table = markdown_table(
        ["arm", "second turns' cached share", "of one machine's", "first token, median (s)", "by API"], rows
    )
    loss = results["affinity"]["loss"]
    rows = [
        ["of a conversation whose machine was killed (moved)", *loss["moved"]],
        ["of one whose machine is up (warm)", *loss["warm"]],
    ]
    loss_table = markdown_table(["next turn", "first token (s)", "cached share", "machine"], rows)
    batches = {arm: results[arm]["batch"].request_counts for arm in ARMS}
    body = (
        f"{table}\n\nMachine loss ({loss['killed']} killed with SIGKILL, affinity arm):\n\n{loss_table}\n\n"
        f"Per machine: one instance alone decodes {results['one machine']['rate']:.1f} tok/s on one stream "
        "(THREADS=1). Throughput scaling cannot be measured on 2 cores: every instance here has THREADS=1 "
        "and the three of the other arms share the 2 cores, so their first tokens are slower than on three "
        "machines; a user multiplies one machine's throughput (bench_peer, bench_batching) by the machines, "
        "which share nothing but Redis and the proxy.\n\n"
        "Batch lines done while the workload ran (of "
        f"{BATCH_LINES}): " + ", ".join(f"{arm} {c.completed}" for arm, c in batches.items()) + "."
    )
    settings = {
        "model": f"{model.name}" + (" (tiny: figures meaningless)" if args.tiny else ""),
        "machines": f"{MACHINES} on 127.0.0.2-4 sharing 2 cores, THREADS=1 each (one machine: THREADS=1 too)",
        "answers": f"{args.tokens} tokens at most",
        "conversations": f"{CONVERSATIONS} per API ({', '.join(KINDS)}), two turns, streamed; {CONVERSATIONS} resends",
        "batch": f"{BATCH_LINES} lines running beside them",
    }
    return report(args, "Many machines: affinity, round-robin, one machine", settings, body, threads=1)


if __name__ == "__main__":
    import sys

    sys.exit(main())
