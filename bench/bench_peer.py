"""This service side by side with llama.cpp on the same weights, in one run.

    flock /tmp/heavy.lock python -m bench.bench_peer                # 2B-shaped checkpoint, 2 threads
    python -m bench.bench_peer --rounds 1 --no-q4 --no-save          # a quicker look
    flock /tmp/heavy.lock python -m bench.bench_peer --model 30b-a3b-e32   # the MoE, 32 experts (docs/models.md)
    flock /tmp/heavy.lock python -m bench.bench_peer --model qwen3.5-2b    # Qwen3.5 (a service that has its presets)

The peer is llama.cpp as llama-cpp-python ships it: its sdist (`pip download`, version
LLAMA_CPP_PYTHON) is unpacked under CACHE_DIR/peer and its vendored llama.cpp built with cmake for
this CPU (`llama-server`, `llama-quantize`; a few minutes, once). The weights are the service's
2B-shaped random checkpoint converted by that copy's convert_hf_to_gguf.py: Q8_0 text and F16 vision
(mmproj), and Q4_0 text by llama-quantize from F16 — cached beside it. The checkpoint's tokenizer
was trained by the service, so the converter does not know its pre-tokenizer's hash: it is told
Qwen2's (the same regex; Qwen3.5's for a Qwen3.5 checkpoint), and needs `sentencepiece` installed.
Nothing of llama.cpp is kept in git, and this never runs in CI.

`--model PRESET` takes the random checkpoint of that `make-model` preset (CACHE_DIR/qwen3vl-PRESET-random,
a Qwen3.5 one CACHE_DIR/PRESET-random: bf16, what the converter reads); 2B by default. The full 30B-A3B
has no bf16 checkpoint here (62 GB), so its reduced-expert twin `30b-a3b-e32` (the same per-token shapes,
32 experts) is what both sides run; `--model 30b-a3b` runs ours alone, on its 4-bit checkpoint (`-int4`,
written straight by `make-model --bits 4` if missing: ~17 GB, about an hour here), the same rows without
a peer column; Qwen3.5's 35B-A3B and its `-e32` twin likewise. A preset the service does not have
(Qwen3.5's, before it serves Qwen3.5) stops the run at once.

Ours runs twice: the INT8 checkpoint (`-int8`, `python -m service quantize`) and the 4-bit one (`-int4`,
`--bits 4`), each written if missing: a server quantizing at load would put that into start → ready, and
the bf16 file's bytes into the ceiling.
Each server runs alone on the machine, in the order ours, ours 4-bit, Q8_0, Q4_0, then reversed per
round, all with 2 threads (`llama-server -t 2 -tb 2 -np 4`), and gets the same requests on the OpenAI
endpoint, greedy, end of turn biased away so answers run to max_tokens. Ours decodes with its exact
speculative decoding off (`"speculative": false` in every request): a token a forward, as llama.cpp
without a draft model. One row has it on, with the share of its guesses the model made too: what it adds
on these weights — a random model may repeat itself, and its guesses be right, far more often than a
real model's answers would allow — not what a user would see. Per server start (a run):
- start → ready (client-side): process start to the first 200 of /ready (ours) or /health;
- first token with a picture (client-side): a 448×448 JPEG and a question, max_tokens 1, a new
  picture each time (no cache may help), median of 3;
- decode (server-side, each server's own count: our `timings.decode_tokens_per_s` from the native
  endpoint, llama.cpp's `timings.predicted_per_second`), 128 tokens after a short (~43-token) prompt,
  after a ~1,000-token one and after a ~8,000-token one (a long conversation: a fixed recurrent state,
  Qwen3.5's, against a growing KV cache; both servers get 16,384 tokens of context for it); ours once
  more after the short prompt with speculation on, its guesses drafted and accepted from the done line;
- decode after ~8,000 tokens as a share of decode after the short prompt, that one decoded again just
  before and just after it (their mean): a ratio of the same minutes, where the two rows above may be
  minutes apart on a machine whose speed drifts by a third in ten;
- second turn (client-side): a picture and a question (32 tokens), then the whole history resent
  with a follow-up, max_tokens 1: what a chat client waits for its next answer to start;
- 4 concurrent text streams of 64 tokens (client-side): all tokens over the wall time;
- the server's resident memory after the runs, read before the ~8,000-token one (PSS of its processes:
  Gunicorn's master and worker share the weights copy-on-write, which summed RSS would count twice; our
  conversation cache may keep that conversation's keys and values, llama.cpp allocates its cache at start);
- decode's bandwidth ceiling (bench/core/ceiling.py): the weight bytes a token reads (its experts only,
  in a mixture of experts) ÷ this machine's read bandwidth, probed just before and just after the short
  prompt's decode, the higher of the two taken (a shared VM's bandwidth moves by half within minutes: one
  probe before the runs read 45 GB/s where a decode had just streamed 57, and the best of a run's probes
  came from other minutes than most decodes); each run's decode after the short prompt, speculation off,
  as a share of its own weights' ceiling at that run's bandwidth.
Each figure is the median of the runs, with their spread (min–max) and their count. A llama.cpp server
that crashes is started again with `-nr` (no weight repacking, which segfaulted on a Xeon with AMX), and
the table says so. It writes its section in bench/RESULTS.md and its plot (each figure against llama.cpp
Q8_0) in bench/plots/, e.g. peer-4b-amx-xeon.png for `--model 4b` on a Xeon with AMX.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from bench.core.ceiling import checkpoint_active_bytes, gguf_active_bytes, model_experts, read_bandwidth
from bench.core.client import chat, openai_chat
from bench.core.harness import concurrently, parse, parser, preset_model_path, serve_with_speculation, tree_memory
from bench.core.inputs import DECODE_PROMPT, QUESTION, message, photo_url, text_of_tokens
from bench.core.llama_cpp import LLAMA_CPP_PYTHON, gguf_weights, llama_cpp
from bench.core.results import cpu_model, markdown_table, plot_file, plot_link, report
from bench.core.servers import (
    LLAMA_CONTEXT,
    gunicorn_server,
    llama_server,
    llama_settings,
    without_repacking_if_it_crashes,
)

# make-model presets (bf16 checkpoints, but OURS_ONLY's); Qwen3.5's need a service that has them
MODELS = ("2b", "4b", "8b", "30b-a3b-e32", "30b-a3b")
MODELS += ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-35b-a3b-e32", "qwen3.5-35b-a3b-e16")
MODELS += ("qwen3.5-35b-a3b",)
OURS_ONLY = ("30b-a3b", "qwen3.5-35b-a3b")  # no bf16 checkpoint for llama.cpp's converter to read: ours alone, 4-bit
OURS_4BIT = "this service 4-bit"
KINDS = ("this service", OURS_4BIT, "llama.cpp Q8_0", "llama.cpp Q4_0")
CONVERSATION_TOKENS = 8000  # the long conversation's prompt (both servers' context: LLAMA_CONTEXT)
TIMEOUT = 3600  # seconds a request may take (our REQUEST_DEADLINE): a 30B model's long prefill on 2 cores


@contextmanager
def our_server(model_path: Path, threads: int, log: Path):
    started = time.perf_counter()
    env = {
        "MODEL_PATH": str(model_path),
        "THREADS": str(threads),
        "MAX_BATCH_SIZE": "4",
        "QUEUE_TIMEOUT": "600",
        "CONTEXT_LIMIT": str(LLAMA_CONTEXT),  # the context llama-server has
        "MAX_PROMPT_TOKENS": str(LLAMA_CONTEXT),  # clipped to CONTEXT_LIMIT - 1
        "REQUEST_DEADLINE": str(TIMEOUT),
    }
    with gunicorn_server(env, log, timeout=900, poll=0.05) as (base, process):
        yield base, process, time.perf_counter() - started


@contextmanager
def peer_server(llama: Path, text: Path, mmproj: Path, threads: int, log: Path, no_repack: bool):
    started = time.perf_counter()
    with llama_server(llama, text, mmproj, threads, log, no_repack) as (base, process):
        yield base, process, time.perf_counter() - started


# -- the requests --------------------------------------------------------------------------------


class Client:
    """The same OpenAI-endpoint requests to either server, ours with its exact speculative decoding off
    (llama.cpp speculates only when given a draft model); `ours` also has the native endpoint."""

    def __init__(self, base: str, ours: bool, end_of_turn: list[int]):
        self.base, self.ours = base, ours
        self.no_end = {str(t): -100 for t in end_of_turn}

    def chat(self, messages: list[dict], max_tokens: int):
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "logit_bias": self.no_end}
        if not self.ours:
            return openai_chat(self.base, body, timeout=TIMEOUT)
        reply = openai_chat(self.base, {**body, "speculative": False}, timeout=TIMEOUT)
        self._guesses(reply.done["usage"]["speculation"], speculative=False)
        return reply

    def decode(self, prompt: str, tokens: int, speculative: bool = False) -> dict:
        """`tokens` tokens after `prompt`: {"rate": decode tokens/s as the server counts it}, and for ours
        (its native endpoint; exact speculative decoding on if `speculative`) the guesses it "drafted" and
        the ones it "accepted"."""
        messages = [message("user", prompt)]
        if not self.ours:
            return {"rate": float(self.chat(messages, tokens).done["timings"]["predicted_per_second"])}
        body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "logit_bias": self.no_end}
        if speculative:  # not the cache of the same prompt asked with it off: that one holds no MTP head part,
            body["cache_salt"] = "speculative"  # and a turn reusing it would guess by prompt lookup alone
        done = chat(self.base, {**body, "stream": False, "speculative": speculative}, timeout=TIMEOUT).done
        return {"rate": float(done["timings"]["decode_tokens_per_s"]), **self._guesses(done["usage"], speculative)}

    @staticmethod
    def _guesses(usage: dict, speculative: bool) -> dict:
        """The guesses an answer's usage counts; none where speculation was asked off, or the figure
        would not be what its row says."""
        if usage["drafted_tokens"] and not speculative:
            raise RuntimeError(f"asked with speculation off, the server guessed {usage['drafted_tokens']} tokens")
        return {"drafted": usage["drafted_tokens"], "accepted": usage["accepted_tokens"]}


def measure(client: Client, prompts: dict[str, str], round_: int, memory, probe) -> dict:
    """Every row of one server; `memory()` its PSS, read before the ~8,000-token conversation (whose keys and
    values our conversation cache may keep afterwards, where llama.cpp's cache is allocated from the start);
    `probe()` the machine's read bandwidth, just before and after the short prompt's decode (its ceiling)."""
    # a new picture each time: nothing cached can help
    first = [client.chat([message("user", photo_url(100 * round_ + i), QUESTION)], 1).total for i in range(3)]
    turn1 = [message("user", photo_url(1000 + round_), "Describe the picture.")]
    said = client.chat(turn1, 32).done["choices"][0]["message"]["content"] or ""
    second_turn = client.chat([*turn1, message("assistant", said), message("user", "And what colour is it?")], 1)
    streams, wall = concurrently(
        [lambda i=i: client.chat([message("user", f"{DECODE_PROMPT} ({i})")], 64) for i in range(4)]
    )
    result = {
        "first_token_s": statistics.median(first),
        "second_turn_s": second_turn.total,
        "streams_tok_s": sum(r.done["usage"]["completion_tokens"] for r in streams) / wall,
    }
    for name, prompt in prompts.items():
        if name == "short":  # the higher probe: a slow minute may not make the ceiling look closer
            before = probe()
            result["decode_short"] = client.decode(prompt, 128)["rate"]
            result["bandwidth"] = max(before, probe())
            continue
        if name == "conversation":
            result["memory_gib"] = memory()
            around = [client.decode(prompts["short"], 128)["rate"]]
        result[f"decode_{name}"] = client.decode(prompt, 128)["rate"]
        if name == "conversation":  # against a short prompt's decode of the same minutes: a shared VM's
            around.append(client.decode(prompts["short"], 128)["rate"])  # speed drifts by a third in ten
            result["conversation_share"] = result["decode_conversation"] / statistics.mean(around)
    result.setdefault("memory_gib", memory())
    if client.ours:  # the same short-prompt request with its guesses: what speculation adds on these weights
        on = client.decode(prompts["short"], 128, speculative=True)
        result.update(decode_speculative=on["rate"], drafted=on["drafted"], accepted=on["accepted"])
    return result


# -- the run -------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = parser(__doc__, quantization=False)
    p.add_argument("--model", choices=MODELS, default="2b", help="the make-model preset whose checkpoint both run")
    p.add_argument("--rounds", type=int, default=3, help="server starts per kind, in the order of KINDS, then reversed")
    p.add_argument("--no-q4", action="store_true", help="leave llama.cpp Q4_0 out")
    p.add_argument("--no-int4", action="store_true", help="leave this service's 4-bit checkpoint out")
    p.add_argument(
        "--no-8k", action="store_true", help="leave out decode after ~8,000 tokens (its prefill: minutes a server)"
    )
    given = p.parse_known_args(argv)[0]
    _served_preset(given.model)
    argv = _ours_only_checkpoint(given, argv)
    args = parse(p, argv, source=True)
    serve_with_speculation("on")  # our servers may speculate; each request says whether it does
    from service.model.loading import load_processor
    from service.quant.writer import write_quantized
    from service.settings import load_settings

    cache_dir = load_settings().cache_dir
    source = args.model_path
    int8, int4 = source.with_name(source.name + "-int8"), source.with_name(source.name + "-int4")
    ours_only = args.model in OURS_ONLY
    if ours_only:  # the 4-bit checkpoint is the source: tokenizer, config, prompts
        int4 = ours_path = source
    else:
        for copy, bits, wanted in ((int8, 8, True), (int4, 4, not args.no_int4)):
            if wanted and not (copy / "config.json").exists():
                write_quantized(source, copy, bits=bits)
        ours_path = int8  # served from its file, as every model: quantizing at load would be timed as start
        if shutil.which("cmake") is None:
            raise SystemExit("cmake is needed to build llama.cpp (apt-get install cmake)")
    peer_dir = cache_dir / "peer"
    peer_dir.mkdir(parents=True, exist_ok=True)
    log = peer_dir / "bench_peer.log"
    kinds = [k for k in KINDS if not (args.no_q4 and "Q4" in k) and not (args.no_int4 and k == OURS_4BIT)]
    if ours_only:
        kinds = [OURS_4BIT]
    steps = (2 if ours_only else 3) + 2 * len(kinds) * args.rounds
    no_repack: set[str] = set()  # llama.cpp kinds that crashed with repacking: started with -nr since
    with tqdm(total=steps, desc="bench_peer", unit="step") as bar:
        llama, weights = None, {}
        if not ours_only:
            bar.set_postfix_str("building llama.cpp (once: a few minutes)")
            llama = llama_cpp(peer_dir, log)
            bar.update()
            bar.set_postfix_str("converting the checkpoint to GGUF (once)")
            weights = gguf_weights(source, llama, peer_dir / f"gguf-{source.name}", log, q4=not args.no_q4)
        bar.update()
        bar.set_postfix_str("the weight bytes a token reads")
        experts = model_experts(source)
        active = {"this service": checkpoint_active_bytes(ours_path), OURS_4BIT: checkpoint_active_bytes(int4)}
        for kind in (k for k in kinds if k.startswith("llama.cpp")):
            active[kind] = gguf_active_bytes(weights["q8_0" if "Q8" in kind else "q4_0"], llama, experts)
        bar.update()
        tokenizer = load_processor(source).tokenizer
        end_of_turn = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        prompts = {"short": DECODE_PROMPT, "long": text_of_tokens(source, 1000)}
        if not args.no_8k:
            prompts["conversation"] = text_of_tokens(source, CONVERSATION_TOKENS)
        results: dict[str, list[dict]] = {k: [] for k in kinds}
        for round_ in range(args.rounds):
            for kind in kinds if round_ % 2 == 0 else list(reversed(kinds)):
                bar.set_postfix_str(f"{kind}, round {round_ + 1}")
                results[kind].append(serve_and_measure(kind, args, ours_path, int4, llama, weights, peer_dir,
                                                       end_of_turn, prompts, round_, no_repack))  # fmt: skip
                bar.update(2)
    for kind, runs in results.items():
        for run in runs:  # a token a forward: what the ceiling bounds, at the bandwidth of its minutes
            run["ceiling_share"] = run["decode_short"] * active[kind] / run["bandwidth"]
    probes = [run["bandwidth"] for runs in results.values() for run in runs]
    ceiling = {kind: statistics.median(run["bandwidth"] for run in results[kind]) / active[kind] for kind in kinds}
    med = {k: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for k, runs in results.items()}
    plot_path = None if ours_only else plot_file(f"peer-{args.model}")
    if not args.no_save and plot_path is not None:
        plot(med, kinds, plot_path)
    title = f"This service side by side with llama.cpp: {args.model}"
    if ours_only:
        title = f"This service on {args.model}, 4-bit, no peer"
    return report(
        args,
        title,
        {
            "model": f"{args.model}, random weights ({source.name})"
            + (f"; {experts[1]} of {experts[0]} experts a token" if experts[0] > 1 else ""),
            "ours": f"{ours_path.name}"
            + ("" if args.no_int4 or ours_only else f" and {int4.name}")
            + f", INT8_KERNEL=auto, CONTEXT_LIMIT={LLAMA_CONTEXT}",
            "llama.cpp": (
                "not run: its converter reads a bf16 checkpoint, too large to write here for this model (the "
                f"{args.model}-e32 table is the side by side on the same per-token shapes)"
                if ours_only
                else f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist, {llama_settings(args.threads)}"
                + (f"; -nr (no repacking: the default crashed) for {', '.join(sorted(no_repack))}" if no_repack else "")
            ),
            "GGUF": ", ".join(p.name for p in weights.values()) or "—",
            "read bandwidth": f"{statistics.median(probes) / 1e9:.1f} GB/s, median of the runs ({args.threads} "
            f"threads summing 2 GiB, best of 5, just before and after each short-prompt decode, the higher taken; "
            f"{min(probes) / 1e9:.1f}–{max(probes) / 1e9:.1f} over the runs)",
            "CPU": cpu_model(),
        },
        table(med, results, kinds, ceiling, ours_path, weights, int4, active, plot_path),
        speculation="off in every row but the one labelled “exact speculation on” (each request says so; "
        "--speculative has no say)",
    )


def _served_preset(model: str) -> None:
    """Stop at once if this service has no make-model preset `model` (MODELS names Qwen3.5's before it does)."""
    from service.random_checkpoints.presets import PRESETS

    if model not in PRESETS:
        raise SystemExit(f"--model {model}: this service has no such make-model preset (it has {', '.join(PRESETS)})")


def _ours_only_checkpoint(given, argv: list[str] | None) -> list[str] | None:
    """For a preset run without a peer, --model-path at its 4-bit checkpoint (`preset_model_path`'s,
    -int4), written straight by make-model --bits 4 if missing; `given`: the arguments as parsed so far."""
    from service.random_checkpoints.make import make_checkpoint

    if given.model not in OURS_ONLY or given.model_path is not None or given.tiny:
        return argv
    source = preset_model_path(given.model)
    int4 = source.with_name(source.name + "-int4")
    if not (int4 / "config.json").exists():
        make_checkpoint(given.model, int4, bits=4, progress=True)
    return [*(sys.argv[1:] if argv is None else argv), "--model-path", str(int4)]


def serve_and_measure(kind, args, ours_path, int4, llama, weights, peer_dir, end_of_turn, prompts, round_,
                      no_repack: set[str]) -> dict:  # fmt: skip
    """One server of `kind` started, warmed and measured (a llama.cpp one that crashes: again with -nr)."""

    def run(no_repack_now: bool) -> dict:
        if kind.startswith("this service"):
            server = our_server(int4 if kind == OURS_4BIT else ours_path, args.threads, peer_dir / "ours.log")
        else:
            text = weights["q8_0" if "Q8" in kind else "q4_0"]
            server = peer_server(llama, text, weights["mmproj"], args.threads, peer_dir / "llama.log", no_repack_now)
        with server as (base, process, ready_s):
            client = Client(base, kind.startswith("this service"), end_of_turn)
            client.chat([message("user", photo_url(99999), "Hi.")], 2)  # first-call costs, not measured
            result = measure(client, prompts, round_, lambda: tree_memory(process) / 1024**3,
                             lambda: read_bandwidth(args.threads))  # fmt: skip
            result["ready_s"] = ready_s
            return result

    if kind.startswith("this service"):
        return run(False)
    return without_repacking_if_it_crashes(run, kind, no_repack)


ROWS = [  # (label, key, unit, better, side): one figure a run (server start), their median and spread
    ("start → ready", "ready_s", "s", "lower", "client"),
    ("first token, 448×448 picture + question", "first_token_s", "s", "lower", "client"),
    ("decode after a short prompt, speculation off", "decode_short", "tok/s", "higher", "server"),
    ("decode after ~1,000 prompt tokens, speculation off", "decode_long", "tok/s", "higher", "server"),
    ("decode after ~8,000 tokens of conversation, speculation off", "decode_conversation", "tok/s", "higher", "server"),
    (
        "decode after ~8,000 tokens ÷ a short prompt's just before and after it",
        "conversation_share",
        "",
        "higher",
        "server",
    ),
    ("decode after a short prompt, exact speculation on", "decode_speculative", "tok/s", "higher", "server"),
    ("second turn (history resent), first token", "second_turn_s", "s", "lower", "client"),
    ("4 concurrent streams, aggregate, speculation off", "streams_tok_s", "tok/s", "higher", "client"),
    ("resident memory after the runs but the ~8,000-token one (PSS)", "memory_gib", "GiB", "lower", "—"),
    ("decode after a short prompt, speculation off, share of its ceiling", "ceiling_share", "", "higher", "—"),
]
CEILING_ROW = "decode ceiling: read bandwidth (its runs' median) ÷ weight bytes a token reads (tok/s)"
# What the plot compares with llama.cpp: the measured figures both sides have (not what its weights bound).
PLOTTED = [row for row in ROWS if row[1] not in ("decode_speculative", "ceiling_share", "conversation_share")]


def table(
    med: dict,
    results: dict,
    kinds: list[str],
    ceiling: dict,
    ours_path: Path,
    weights: dict,
    int4: Path,
    active: dict,
    plot_path: Path,
) -> str:
    ratios = [
        (name, a, b)
        for name, a, b in (
            ("ours / Q8_0", "this service", "llama.cpp Q8_0"),
            ("4-bit / ours INT8", OURS_4BIT, "this service"),
            ("4-bit / Q4_0", OURS_4BIT, "llama.cpp Q4_0"),
        )
        if a in kinds and b in kinds
    ]

    def ratio_cells(figures: dict) -> list[str]:
        return [f"{figures[a] / figures[b]:.2f}x" if a in figures and b in figures else "" for _, a, b in ratios]

    runs = len(next(iter(results.values())))
    rows = []
    for label, key, unit, _, side in ROWS:
        has = [k for k in kinds if key in med[k]]
        if not has:
            continue  # a row this run left out
        form = {"ceiling_share": "{:.0%}", "conversation_share": "{:.2f}"}.get(key, "{:.3g}")
        cells = [spread([r[key] for r in results[k]], form) if k in has else "—" for k in kinds]
        if key == "ceiling_share":  # the ceiling first: what the weights bound, whatever the run
            rows.append([CEILING_ROW, "—", "—", *[f"{ceiling[k]:.3g}" for k in kinds], *ratio_cells(ceiling)])
        name = f"{label} ({unit})" if unit else label
        rows.append([name, side, runs, *cells, *ratio_cells({k: med[k][key] for k in has})])
        if key == "decode_speculative":
            rows.append(["its guesses the model made too, all runs: accepted / drafted", "server", runs,
                         *[acceptance(results[k]) if k in has else "—" for k in kinds], *ratio_cells({})])  # fmt: skip
    rows.append(["weight bytes a decoded token reads (GB)", "files", "—", *[f"{active[k] / 1e9:.2f}" for k in kinds],
                 *ratio_cells({})])  # fmt: skip
    table = markdown_table(["", "measured", "runs", *kinds, *[name for name, _, _ in ratios]], rows)
    ours = ours_path.name + (f" and {int4.name}" if OURS_4BIT in kinds and int4 != ours_path else "")
    return (
        table
        + "\n\nEach figure the median of its runs (min–max), a run a server start, each alone on the machine (in the "
        "order of the columns, then reversed); first token each run's median of 3 pictures. Client-side: the "
        "request's wall time at the client, on the same OpenAI-endpoint request for all; server-side: each server's "
        'own decode count. Ours decodes with its exact speculative decoding off (`"speculative": false` in every '
        "request): a token a forward, what the ceiling bounds, as llama.cpp's without a draft model (it has none "
        "here). The speculation-on row is ours on the short prompt's request again with its guesses: what they add "
        "on these weights, whose answers may repeat themselves far more than a real model's would. "
        f"Ours: {ours}; llama.cpp: {', '.join(p.name for p in weights.values()) or 'not run'}."
        + (f" [Plot: each figure against llama.cpp Q8_0]({plot_link(plot_path)})." if plot_path else "")
    )


def spread(values: list[float], form: str) -> str:
    """The median of a figure's runs, and their min–max when there are several."""
    text = form.format(statistics.median(values))
    return text + (f" ({form.format(min(values))}–{form.format(max(values))})" if len(values) > 1 else "")


def acceptance(runs: list[dict]) -> str:
    """The guesses the model made too, of those drafted, over all runs."""
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    return f"{accepted}/{drafted} ({accepted / drafted:.0%})" if drafted else "none drafted"


def plot(med: dict, kinds: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = [row for row in PLOTTED if row[1] in med["llama.cpp Q8_0"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        # how many times better than llama.cpp Q8_0 (> 1: better), whatever the direction of the figure
        ratios = [
            (med[kind][key] / med["llama.cpp Q8_0"][key]) ** (1 if better == "higher" else -1)
            for _, key, _, better, _ in plotted
        ]
        ax.barh([y + i * width for y in range(len(plotted))], ratios, height=width, label=kind)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks([y + width * (len(kinds) - 1) / 2 for y in range(len(plotted))], [row[0] for row in plotted])
    ax.invert_yaxis()
    ax.set_xlabel("times better than llama.cpp Q8_0 (same machine, same run)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
