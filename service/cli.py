"""Command line: `python -m service chat|make-model|quantize|compare-search ...`. Flags override environment
settings."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path


def _settings_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("settings (override the environment variables of the same name)")
    g.add_argument("--model-path", help="Qwen3-VL checkpoint directory (MODEL_PATH); default: embedded random model")
    g.add_argument("--quantization", choices=["int8", "fp32"], help="QUANTIZATION (default int8)")
    g.add_argument("--threads", type=int, help="THREADS: torch threads (default: the CPUs this process may use)")
    g.add_argument("--image-max-pixels", type=int, help="IMAGE_MAX_PIXELS: pixel budget per image")
    g.add_argument("--max-new-tokens", type=int, help="MAX_NEW_TOKENS: cap on generated tokens")
    g.add_argument("--context-limit", type=int, help="CONTEXT_LIMIT: prompt + answer tokens")
    g.add_argument("--cache-dir", help="CACHE_DIR: where the embedded model is built")


def _settings(args):
    from .settings import load_settings

    names = [
        "model_path",
        "quantization",
        "threads",
        "image_max_pixels",
        "max_new_tokens",
        "context_limit",
        "cache_dir",
    ]
    return load_settings(**{n: getattr(args, n, None) for n in names})


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def cmd_chat(args) -> int:
    from pydantic import ValidationError

    from .answer.grounding import GROUNDING_SCHEMA
    from .answer.structured import check_grammar, json_grammar
    from .errors import ServiceError

    settings = _settings(args)
    grammar = None
    try:  # a bad schema is refused before the model loads
        if args.json_schema is not None:
            schema = json.loads(Path(args.json_schema).read_text()) if args.json_schema else {"type": "object"}
            grammar = json_grammar(schema, "--json-schema")
            check_grammar(grammar)
        elif args.boxes:
            grammar = json_grammar(GROUNDING_SCHEMA, "--boxes")  # a list of labelled boxes, always well formed
    except (ServiceError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from .engine.engine import Completion, Engine, GenerationRequest, SamplingParams
    from .media.images import decode_image
    from .model.loading import load_model
    from .model.prompts import ChatMessage, ImagePart, TextPart
    from .random_checkpoints.marker import RANDOM_MODEL_WARNING

    loaded = load_model(settings)
    if loaded.is_random:
        print(f"\n*** {RANDOM_MODEL_WARNING} ***\n", file=sys.stderr)
    engine = Engine(loaded, settings)
    dim = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    if engine.info.thinking:
        shown = "dimmed" if dim[0] else "first"
        print(f"{loaded.name} is a thinking checkpoint: its reasoning {shown}, then the answer", file=sys.stderr)
    try:
        t0 = time.perf_counter()
        parts = [ImagePart(decode_image(Path(p).read_bytes(), engine.limits.image)) for p in args.image]
        parts.append(TextPart(args.prompt))
        messages = ([ChatMessage("system", [TextPart(args.system)])] if args.system else []) + [
            ChatMessage("user", parts)
        ]
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop or [],
        )
        request = GenerationRequest(
            messages,
            params,
            received_at=t0,
            grammar=grammar,
            enable_thinking=not args.no_thinking,
            max_thinking_tokens=args.max_thinking_tokens,
        )
        reasoned = False
        for event in engine.generate(request):
            if isinstance(event, Completion):
                done = event
            elif event.reasoning:
                print(f"{dim[0]}{event.text}{dim[1]}", end="", flush=True)
                reasoned = True
            else:
                if reasoned:  # the reasoning apart from the answer
                    print("\n")
                    reasoned = False
                print(event.text, end="", flush=True)
    except (ServiceError, ValidationError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    t = done.timings
    print("\n")
    print(
        f"load {loaded.load_seconds:.2f} s | image decode {t.image_decode * 1000:.1f} ms | "
        f"vision encode {t.vision_encode:.2f} s | prefill {t.prefill:.2f} s | "
        f"time to first token {t.time_to_first_token:.2f} s | decode {t.decode_tokens_per_s:.1f} tok/s | "
        f"{done.prompt_tokens} prompt + {done.completion_tokens} new tokens ({done.finish_reason}) | "
        f"peak RSS {_peak_rss_gib():.2f} GiB",
        file=sys.stderr,
    )
    if loaded.kernels is not None:
        print(f"INT8 kernels: {loaded.kernels.describe()}", file=sys.stderr)
    if args.boxes:
        return _write_boxes(args.boxes, args.image, done.boxes)
    return 0


def _write_boxes(out: str, images: list[str], boxes) -> int:
    """Print the answer's boxes and draw them over the pictures: `out` for the first, `out` with -2,
    -3 ... before its suffix for the others."""
    import cv2

    from .media.drawing import draw_boxes

    for box in boxes:
        print(json.dumps({"label": box.label, f"{box.kind}_2d": box.written, "pixels": box.pixels, "image": box.image}))
    if not images:
        print("error: --boxes needs an --image to draw on", file=sys.stderr)
        return 2
    path = Path(out)
    for i, image in enumerate(images):
        picture = cv2.imread(image, cv2.IMREAD_COLOR)  # EXIF orientation applied: the picture as one sees it
        target = path if i == 0 else path.with_name(f"{path.stem}-{i + 1}{path.suffix}")
        if picture is None or not cv2.imwrite(str(target), draw_boxes(picture, [b for b in boxes if b.image == i])):
            print(f"error: could not draw on {image} into {target}", file=sys.stderr)
            return 2
        print(f"{sum(b.image == i for b in boxes)} boxes drawn on {image} → {target}", file=sys.stderr)
    return 0


def cmd_make_model(args) -> int:
    from .random_checkpoints.make import make_checkpoint
    from .random_checkpoints.marker import RANDOM_MODEL_WARNING
    from .random_checkpoints.presets import PRESETS

    t0 = time.perf_counter()
    try:
        out = make_checkpoint(args.preset, args.out_dir, bits=args.bits, progress=True)
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kind = {None: "", 8: " INT8", 4: " 4-bit"}[args.bits]
    family = "Qwen3.5" if PRESETS[args.preset].family == "qwen3_5" else "Qwen3-VL"
    print(
        f"wrote the {args.preset} random-weight {family}{kind} checkpoint to {out} in {time.perf_counter() - t0:.1f} s "
        f"(peak RSS {_peak_rss_gib():.2f} GiB)" + (f"; serve it with MODEL_PATH={out}" if args.bits else "")
    )
    print(f"note: {RANDOM_MODEL_WARNING}")
    return 0


def cmd_quantize(args) -> int:
    from .quant.writer import GROUP_SIZE, KEEP_8BIT, write_quantized

    t0 = time.perf_counter()
    keep = KEEP_8BIT if args.keep_8bit is None else tuple(p for p in args.keep_8bit if p != "none")
    out = write_quantized(
        args.src,
        args.dst,
        bits=args.bits,
        group_size=args.group_size or GROUP_SIZE,
        symmetric=args.symmetric,
        keep_8bit=keep,
    )
    print(
        f"wrote the {'4-bit' if args.bits == 4 else 'INT8'} checkpoint {out} in {time.perf_counter() - t0:.1f} s "
        f"(peak RSS {_peak_rss_gib():.2f} GiB); "
        f"serve it with MODEL_PATH={out}"
    )
    return 0


def cmd_export_onnx(args) -> int:
    from tqdm import tqdm

    from .settings import load_settings
    from .vision.onnx import EXPORT_STEPS, default_export_dir, export_vision_onnx

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"error: {model_dir} is not a Hugging Face checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    out_dir = (
        Path(args.out_dir)
        if args.out_dir
        else default_export_dir(model_dir, load_settings(cache_dir=args.cache_dir).cache_dir)
    )
    t0 = time.perf_counter()
    with tqdm(total=len(EXPORT_STEPS), desc="export-onnx", unit="step") as bar:

        def step_done(step: str) -> None:
            bar.set_postfix_str(step)
            bar.update()

        try:
            export_vision_onnx(model_dir, out_dir, progress=step_done)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    where = f" VISION_ONNX_DIR={out_dir}" if args.out_dir else ""
    print(
        f"wrote the ONNX vision encoder (fp32 and int8) of {model_dir} to {out_dir} in "
        f"{time.perf_counter() - t0:.1f} s (peak RSS {_peak_rss_gib():.2f} GiB); "
        f"use it with VISION_BACKEND=onnxruntime{where}"
    )
    return 0


def cmd_batch(args) -> int:
    """Batch jobs on a running server (OpenAI's Batch API): submit a JSONL file, follow a batch with a
    progress bar, fetch its results."""
    import os

    import requests
    from tqdm import tqdm

    base = args.url.rstrip("/")
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or ""
    session = requests.Session()
    if key:
        session.headers["Authorization"] = f"Bearer {key}"

    def call(method: str, path: str, **kwargs):
        try:
            reply = session.request(method, base + path, timeout=600, **kwargs)
        except requests.RequestException as exc:
            raise SystemExit(f"error: {base} did not answer: {exc}") from None
        if reply.status_code >= 400:
            try:
                message = reply.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = reply.text[:300]
            raise SystemExit(f"error: {reply.status_code} {message}")
        return reply

    def follow(batch: dict) -> dict:
        counts = batch["request_counts"]
        with tqdm(total=counts["total"], desc=batch["id"], unit="line", file=sys.stderr) as bar:
            while True:
                counts = batch["request_counts"]
                bar.n = counts["completed"] + counts["failed"]
                bar.set_postfix_str(f"{batch['status']}, {counts['failed']} failed")
                bar.refresh()
                if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                    return batch
                time.sleep(1)
                batch = call("GET", f"/v1/batches/{batch['id']}").json()

    if args.batch_command == "submit":
        path = Path(args.file)
        with path.open("rb") as f:
            uploaded = call("POST", "/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"}).json()
        body = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": args.window}
        batch = call("POST", "/v1/batches", json=body).json()
        print(batch["id"])
        if args.wait:
            follow(batch)
        return 0
    if args.batch_command == "status":
        batch = call("GET", f"/v1/batches/{args.batch_id}").json()
        if args.wait:
            batch = follow(batch)
        print(json.dumps(batch, indent=2))
        return 0
    if args.batch_command == "cancel":
        print(json.dumps(call("POST", f"/v1/batches/{args.batch_id}/cancel").json(), indent=2))
        return 0
    batch = call("GET", f"/v1/batches/{args.batch_id}").json()
    if batch["status"] not in ("completed", "expired", "cancelled"):
        print(f"error: {args.batch_id} is {batch['status']}: its results are not written yet", file=sys.stderr)
        return 1
    out = Path(args.output).open("w") if args.output else sys.stdout
    for key_name, target in (("output_file_id", out), ("error_file_id", sys.stderr if not args.errors else None)):
        file_id = batch.get(key_name)
        if file_id is None:
            continue
        text = call("GET", f"/v1/files/{file_id}/content").text
        if target is None:
            Path(args.errors).write_text(text)
        else:
            target.write(text)
    if args.output:
        out.close()
    counts = batch["request_counts"]
    print(f"{counts['completed']} answered, {counts['failed']} failed, of {counts['total']}", file=sys.stderr)
    return 0


COMPARE_TEXTS = (
    "A woman playing with her dog on a beach at sunset.",
    "Quarterly revenue grew 12 % on strong cloud demand.",
    "如何在家里种植番茄？",
    "def add(a, b):\n    return a + b",
)
COMPARE_LIMIT = 1e-4  # cosine (1 − it) or score difference past which compare-search fails


def cmd_compare_search(args) -> int:
    """An embedding or reranker checkpoint: the service's fp32 vectors (scores) against the official
    code's reading on transformers' backbone (service/engine/search_reference.py), a few texts and a
    picture; prints each difference and the worst, exits 1 past COMPARE_LIMIT."""
    import numpy as np
    import torch

    from .engine.engine import Engine
    from .engine.search import SearchRequest
    from .engine.search_reference import official_embedding, official_score, reference_model
    from .media.images import decode_image
    from .model.loading import load_model
    from .model.prompts import ImagePart, TextPart, prepare_prompt
    from .model.search_prompts import embedding_prompt, rerank_prompt
    from .settings import load_settings

    overrides = {"cache_dir": args.cache_dir} if args.cache_dir else {}
    settings = load_settings(
        model_path=args.model_path,
        quantization="fp32",
        kv_dtype="float32",
        model_task=args.task,
        threads=args.threads,
        **overrides,
    )
    engine = Engine(load_model(settings), settings)
    task = engine.info.task
    if task == "chat":
        print(f"error: {args.model_path} is a chat checkpoint; name its task with --task", file=sys.stderr)
        return 2
    import cv2

    gradient = np.linspace(0, 255, 448 * 448 * 3).reshape(448, 448, 3).astype(np.uint8)
    picture = decode_image(cv2.imencode(".png", gradient)[1].tobytes(), engine.limits.image)
    items = [[TextPart(t)] for t in COMPARE_TEXTS] + [[ImagePart(picture)], [ImagePart(picture), TextPart("a chart")]]
    if task == "embedding":
        prompts = [embedding_prompt(parts, None) for parts in items]
    else:
        prompts = [rerank_prompt([TextPart(COMPARE_TEXTS[0])], parts, None) for parts in items]
    result = engine.run_search(SearchRequest(task, prompts, time.perf_counter(), item_param="items"))
    engine.close()
    reference = reference_model(engine.loaded.path)
    vocab = engine.processor.tokenizer.get_vocab()
    worst = 0.0
    for i, prompt in enumerate(prompts):
        prepared = prepare_prompt(engine.processor, prompt.messages, engine.limits.prompt)
        if task == "embedding":
            gap = 1 - float(torch.dot(result.vectors[i], official_embedding(reference, prepared)))
            print(f"input {i}: cosine {1 - gap:.8f}")
        else:
            gap = abs(result.scores[i] - official_score(reference, prepared, vocab["yes"], vocab["no"]))
            print(f"pair {i}: score {result.scores[i]:.6f}, |difference| {gap:.2e}")
        worst = max(worst, abs(gap))
    print(
        f"worst: {'1 - cosine' if task == 'embedding' else '|score difference|'} = {worst:.2e} (limit {COMPARE_LIMIT})"
    )
    return 0 if worst <= COMPARE_LIMIT else 1


def build_parser() -> argparse.ArgumentParser:
    from .random_checkpoints.presets import PRESETS

    parser = argparse.ArgumentParser(prog="python -m service", description="Qwen3-VL CPU inference service")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="answer one question about images, streaming to the terminal")
    chat.add_argument("prompt")
    chat.add_argument("--image", action="append", default=[], help="an image file (repeatable)")
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--max-tokens", type=int)
    chat.add_argument("--temperature", type=float, help="0 = greedy (default: the checkpoint's setting)")
    chat.add_argument("--top-p", type=float)
    chat.add_argument("--top-k", type=int)
    chat.add_argument("--seed", type=int)
    chat.add_argument("--stop", action="append", help="a stop string (repeatable)")
    chat.add_argument("--no-thinking", action="store_true", help="thinking checkpoints: answer without reasoning")
    chat.add_argument(
        "--max-thinking-tokens", type=int, help="thinking checkpoints: close the reasoning after this many tokens"
    )
    chat.add_argument(
        "--json-schema",
        nargs="?",
        const="",
        metavar="FILE",
        help="answer in JSON valid against the JSON Schema in FILE (no FILE: any JSON object)",
    )
    chat.add_argument(
        "--boxes",
        metavar="OUT.png",
        help="grounding: answer with a list of labelled boxes (the `grounding` response format, unless "
        "--json-schema), print them in the picture's pixels and draw them over it into OUT.png",
    )
    _settings_flags(chat)
    chat.set_defaults(func=cmd_chat)

    make = sub.add_parser("make-model", help="write a random-weight Qwen3-VL checkpoint (tests, benchmarks)")
    make.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="tiny",
        help="the test models (tiny, tiny-moe: a mixture of experts, tiny-thinking: a Thinking twin) or a "
        "release's shapes, in bf16 (2b ~4.3 GB, 4b ~8.9 GB, 8b ~17.5 GB, 30b-a3b-e32 ~18.6 GB; 30b-a3b only "
        "with --bits): docs/models.md",
    )
    make.add_argument(
        "--bits",
        type=int,
        choices=[8, 4],
        help="write the random weights straight into `quantize`'s INT8 (8) or 4-bit (4) format, tensor by "
        "tensor in bounded memory: the same files as make-model then quantize (30b-a3b --bits 4: ~17 GB)",
    )
    make.add_argument("out_dir")
    make.set_defaults(func=cmd_make_model)

    quantize = sub.add_parser("quantize", help="write a pre-quantized INT8 checkpoint that loads in seconds")
    quantize.add_argument("src", help="a Qwen3-VL checkpoint directory (bf16 or fp32 safetensors)")
    quantize.add_argument("dst", help="the new checkpoint directory (must not exist or be empty)")
    quantize.add_argument(
        "--bits",
        type=int,
        choices=[8, 4],
        default=8,
        help="8: every Linear INT8 (the default); 4: 4-bit groups (half the memory, faster decode). "
        "A GPTQ or AWQ SRC converts exactly with --bits 4",
    )
    quantize.add_argument(
        "--group-size", type=int, choices=(32, 64, 128, 256), help="--bits 4: inputs per scale (default 128)"
    )
    quantize.add_argument("--symmetric", action="store_true", help="--bits 4: zero point 8 (default: per group)")
    quantize.add_argument(
        "--keep-8bit",
        action="append",
        metavar="PREFIX",
        help="--bits 4: Linears whose names start with PREFIX stay INT8 (repeatable; default: model.visual.; "
        "none: every Linear 4-bit)",
    )
    quantize.set_defaults(func=cmd_quantize)

    export = sub.add_parser("export-onnx", help="export the vision encoder to ONNX (fp32 and INT8) for ONNX Runtime")
    export.add_argument("model_dir", help="a Qwen3-VL checkpoint directory (bf16 or fp32 weights)")
    export.add_argument(
        "out_dir",
        nargs="?",
        help="where to write it; default: the cache directory the service looks in for this checkpoint",
    )
    export.add_argument("--cache-dir", help="CACHE_DIR, for the default out_dir")
    export.set_defaults(func=cmd_export_onnx)

    batch = sub.add_parser("batch", help="batch jobs on a running server: submit, status, cancel, results")
    batch.add_argument("--url", default="http://localhost:8080", help="the server (default: make run's Nginx)")
    batch.add_argument("--api-key", help="its API key (default: OPENAI_API_KEY)")
    verbs = batch.add_subparsers(dest="batch_command", required=True)
    submit = verbs.add_parser("submit", help="upload a JSONL file of /v1/chat/completions requests and start it")
    submit.add_argument("file")
    submit.add_argument("--window", default="24h", help="its completion window (default 24h)")
    submit.add_argument("--wait", action="store_true", help="follow it with a progress bar until it ends")
    status = verbs.add_parser("status", help="a batch's status and counts")
    status.add_argument("batch_id")
    status.add_argument("--wait", action="store_true", help="follow it with a progress bar until it ends")
    cancel = verbs.add_parser("cancel", help="stop a batch (finished lines are kept)")
    cancel.add_argument("batch_id")
    results = verbs.add_parser("results", help="an ended batch's answers (JSONL), its errors on stderr")
    results.add_argument("batch_id")
    results.add_argument("-o", "--output", help="write the answers here (default: stdout)")
    results.add_argument("--errors", help="write the failed lines here (default: stderr)")
    batch.set_defaults(func=cmd_batch)

    compare = sub.add_parser(
        "compare-search", help="an embedding or reranker checkpoint: the service's fp32 results vs the official code's"
    )
    compare.add_argument("model_path", help="a Qwen3-VL-Embedding or -Reranker checkpoint directory")
    compare.add_argument("--task", default="auto", choices=["auto", "embedding", "rerank"], help="MODEL_TASK")
    compare.add_argument("--threads", type=int, default=2)
    compare.add_argument("--cache-dir", help="CACHE_DIR: where the service's kernels are built")
    compare.set_defaults(func=cmd_compare_search)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)
