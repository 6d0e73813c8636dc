"""Search throughput through the HTTP API: embeddings of short texts and ~500-token documents (texts/s)
and 448² pictures (pictures/s), one input a request against all of them in one request, INT8 and
4-bit; rerank (documents/s) and score (pairs/s) rows; beside llama.cpp's `llama-server --embeddings`
on the same weights (Q8_0, Q4_0) where its converter takes them.

    python -m service make-model --preset 2b-embedding $C/qwen3vl-2b-embedding-random   # ~4.3 GB
    python -m service make-model --preset 2b-reranker $C/qwen3vl-2b-reranker-random     # the rerank rows
    flock /tmp/heavy.lock python -m bench.bench_embeddings [--count 32] [--no-peer]
    python -m bench.bench_embeddings --tiny --no-peer --no-save                          # a quick check

One Gunicorn instance at a time (bench/core/servers.py, 2 threads): the INT8 one quantizes the checkpoint
at load, the 4-bit one serves its `quantize --bits 4` copy (written once beside it). Each input is new
to the server (the vision cache never hits; the instruction's head, shared by every input, is computed
once and kept, as in use). Inputs go in the official embedding prompt (system: "Represent the user's
input.", the input, the assistant's turn opened); llama.cpp embeds that same text (its special tokens
parsed) with last-token pooling, L2-normalised — the same tokens through the same layers (the table gives
the cosine of one text's vectors from both). Its
/v1/embeddings takes text only: it has no picture rows. Its converter takes the 2B-shaped checkpoint
(Qwen3VLForConditionalGeneration); not Qwen3-VL-Embedding-8B's files, which hold no lm_head
(QwenLM/Qwen3-VL-Embedding#89). llama.cpp's weight repacking crashed on a Xeon with AMX: a server that
crashes is started again with `-nr`, and the table says so.
"""

from __future__ import annotations

import base64
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from bench.core.harness import parser, preset_model_path, require_checkpoint
from bench.core.inputs import SENTENCE, encoded_photo, text_of_tokens
from bench.core.results import markdown_table, report
from bench.core.servers import gunicorn_server, llama_embedding_server, without_repacking_if_it_crashes

WORDS = SENTENCE.split()
TIMEOUT = 3600


def short_texts(count: int, seed: int) -> list[str]:
    """`count` short texts (~12 words), none sent before in this run (`seed`)."""
    return [f"{seed}-{i}: " + " ".join(WORDS[(i * 7 + seed) % 20 : (i * 7 + seed) % 20 + 12]) for i in range(count)]


def documents(model_path: Path, count: int, seed: int) -> list[str]:
    """`count` documents of ~500 tokens each, each beginning with its own number."""
    body = text_of_tokens(model_path, 490)
    return [f"Document {seed}-{i}. {body}" for i in range(count)]


def pictures(count: int, seed: int) -> list[dict]:
    """`count` 448² photo-like pictures as official input objects, none seen before."""
    return [
        {"image": base64.b64encode(encoded_photo(".png", 448, 448, seed=seed + i)).decode("ascii")}
        for i in range(count)
    ]


def per_second(send, items: list, many: bool) -> float:
    """Items a second: all `items` in one call of `send`, or one call per item, one after another."""
    started = time.perf_counter()
    if many:
        send(items)
    else:
        for item in items:
            send([item])
    return len(items) / (time.perf_counter() - started)


def _post(base: str, path: str, body: dict) -> dict:
    response = requests.post(base + path, json=body, timeout=TIMEOUT)
    response.raise_for_status()
    return response.json()


def embed(base: str):
    return lambda items: _post(base, "/v1/embeddings", {"input": items})


PROBE = "A probe: " + SENTENCE  # one text both embed, to see that they compute the same thing


def measure_ours(base: str, model_path: Path, count: int, reranker: str | None) -> dict:
    """Our rows on a server of the embedding checkpoint (and of the reranker at `reranker`, if given),
    and the probe's vector (`probe`)."""
    send, rows = embed(base), {}
    rows["probe"] = send([PROBE])["data"][0]["embedding"]  # and warm: the instruction's head kept
    for many in (False, True):
        mode = "many" if many else "one"
        rows[f"short texts, {mode}"] = per_second(send, short_texts(count, 10 + many), many)
        rows[f"~500-token documents, {mode}"] = per_second(send, documents(model_path, count // 4 or 1, many), many)
        rows[f"448² pictures, {mode}"] = per_second(send, pictures(count // 4 or 1, 1000 * (1 + many)), many)

        def score(items, seed=many):
            return _post(base, "/v1/score", {"text_1": f"query {seed}", "text_2": items})

        rows[f"score pairs (cosine), {mode}"] = per_second(score, short_texts(count, 30 + many), many)
    if reranker is not None:
        for many in (False, True):

            def rerank(items, seed=many):
                return _post(reranker, "/v1/rerank", {"query": f"a harbour {seed}", "documents": items})

            rerank(short_texts(2, 998))
            rows[f"rerank documents, {'many' if many else 'one'}"] = per_second(
                rerank, short_texts(count, 50 + many), many
            )
    return rows


def rendered(processor, text: str) -> str:
    """The official embedding prompt of `text`, as text (what llama.cpp is sent)."""
    from service.model.prompts import TextPart, rendered_chat
    from service.model.search_prompts import embedding_prompt

    return rendered_chat(processor, embedding_prompt([TextPart(text)], None).messages)


def measure_peer(base: str, model_path: Path, count: int) -> dict:
    """llama.cpp's text rows, and the probe's vector: the same prompts' texts to its /v1/embeddings."""
    from service.model.loading import load_processor

    processor = load_processor(model_path)

    def send(items):
        return _post(base, "/v1/embeddings", {"input": [rendered(processor, t) for t in items]})

    rows = {"probe": send([PROBE])["data"][0]["embedding"]}
    for many in (False, True):
        mode = "many" if many else "one"
        rows[f"short texts, {mode}"] = per_second(send, short_texts(count, 10 + many), many)
        rows[f"~500-token documents, {mode}"] = per_second(send, documents(model_path, count // 4 or 1, many), many)
    return rows


@contextmanager
def ours(model_path: Path, threads: int, log: Path, task: str = "embedding"):
    env = {
        "MODEL_PATH": str(model_path),
        "MODEL_TASK": task,
        "THREADS": str(threads),
        "SEARCH_MAX_ITEMS": "4096",
        "SEARCH_MAX_PICTURES": "1024",  # a "many" row of --count up to 4096 sends count // 4 pictures at once
        "CONVERSATION_CACHE_MAX_BYTES": "0",
        "KV_DISK_MB": "0",
    }
    with gunicorn_server(env, log, timeout=900) as (base, _):
        yield base


def four_bit_copy(model_path: Path) -> Path:
    from service.quant.writer import write_quantized

    copy = model_path.with_name(model_path.name + "-int4")
    if not (copy / "config.json").exists():
        write_quantized(model_path, copy, progress=True, bits=4)
    return copy


def main(argv=None) -> int:
    p = parser(__doc__, quantization=False)
    p.add_argument("--count", type=int, default=32, help="short texts a row (documents and pictures: a quarter)")
    p.add_argument("--reranker-path", type=Path, default=None, help="default: CACHE_DIR/qwen3vl-2b-reranker-random")
    p.add_argument("--no-peer", action="store_true", help="leave llama.cpp out")
    args = p.parse_args(argv)
    if args.tiny:
        from service.random_checkpoints.make import make_checkpoint
        from service.settings import load_settings

        cache = load_settings().cache_dir
        for preset in ("tiny-embedding", "tiny-reranker"):
            if not (cache / f"embedded-{preset}" / "config.json").exists():
                make_checkpoint(preset, cache / f"embedded-{preset}")
        args.model_path, args.reranker_path = cache / "embedded-tiny-embedding", cache / "embedded-tiny-reranker"
    model_path = require_checkpoint((args.model_path or preset_model_path("2b-embedding")).resolve())
    reranker = args.reranker_path or preset_model_path("2b-reranker")
    reranker = reranker if (reranker / "config.json").exists() else None
    logs = Path("/tmp") / "bench_embeddings"
    logs.mkdir(exist_ok=True)
    columns: dict[str, dict[str, float]] = {}
    for kind, path, rerank_path in (
        ("ours INT8", model_path, reranker),
        ("ours 4-bit", four_bit_copy(model_path), reranker and four_bit_copy(reranker)),
    ):
        with ours(path, args.threads, logs / "ours.log") as base:
            if rerank_path is None:
                columns[kind] = measure_ours(base, model_path, args.count, None)
                continue
            with ours(rerank_path, args.threads, logs / "reranker.log", task="rerank") as rerank_base:
                columns[kind] = measure_ours(base, model_path, args.count, rerank_base)
    no_repack: set[str] = set()
    if not args.no_peer:
        from bench.core.llama_cpp import gguf_weights, llama_cpp
        from service.settings import load_settings

        peer_dir = load_settings().cache_dir / "peer"
        peer_dir.mkdir(parents=True, exist_ok=True)
        llama = llama_cpp(peer_dir, logs / "llama-build.log")
        gguf = gguf_weights(model_path, llama, peer_dir / f"gguf-{model_path.name}", logs / "convert.log", q4=True)
        for kind, file in (("llama.cpp Q8_0", gguf["q8_0"]), ("llama.cpp Q4_0", gguf["q4_0"])):

            def run(without_repacking: bool, file=file):
                with llama_embedding_server(llama, file, args.threads, logs / "llama.log", without_repacking) as (
                    base,
                    _,
                ):
                    return measure_peer(base, model_path, args.count)

            columns[kind] = without_repacking_if_it_crashes(run, kind, no_repack)
    kinds = list(columns)
    probes = {k: columns[k].pop("probe") for k in kinds}
    names = list(columns["ours INT8"])
    rows = [[name, *(f"{columns[k][name]:.2f}" if name in columns[k] else "—" for k in kinds)] for name in names]
    ratios = [
        [name.removesuffix(", many") + ": many / one", *(_ratio(columns[k], name) for k in kinds)]
        for name in names
        if name.endswith(", many")
    ]
    body = (
        f"Items a second ({args.count} short texts a row, {args.count // 4 or 1} documents and pictures; "
        "one = an input a request, one after another; many = all in one request):\n\n"
        + markdown_table(["row", *kinds], rows)
        + "\n\n"
        + markdown_table(["many / one", *kinds], ratios)
    )
    pairs = [(a, b) for a, b in (("ours INT8", "llama.cpp Q8_0"), ("ours 4-bit", "llama.cpp Q4_0")) if b in columns]
    if pairs:
        shared = [name for name in columns[pairs[0][1]]]
        against = [[name, *(f"{columns[a][name] / columns[b][name]:.2f}×" for a, b in pairs)] for name in shared]
        against.append(["cosine of one text's vectors", *(f"{_cosine(probes[a], probes[b]):.5f}" for a, b in pairs)])
        body += "\n\nOurs against llama.cpp on the same weights (its text rows):\n\n" + markdown_table(
            ["row", *(f"{a} / {b}" for a, b in pairs)], against
        )
    if no_repack:
        body += "\n\nllama.cpp started with -nr (no repacking: the default crashed) for " + ", ".join(sorted(no_repack))
    settings = {
        "checkpoint": str(model_path),
        "reranker": str(reranker) if reranker else "none (no rerank rows)",
        "ours": "Gunicorn, SEARCH_BATCH_TOKENS 512 (default), conversation cache and disk tier off",
        "llama.cpp": "off" if args.no_peer else "llama-server --embeddings --pooling last -b/-ub 4096 -np 8 -kvu",
    }
    return report(args, "Embeddings, rerank and score throughput", settings, body)


def _ratio(column: dict, many: str) -> str:
    one = many.removesuffix(", many") + ", one"
    return f"{column[many] / column[one]:.2f}×" if many in column and one in column else "—"


def _cosine(a: list[float], b: list[float]) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


if __name__ == "__main__":
    raise SystemExit(main())
