"""The INT8 / latency benchmark suite: one command per scenario, `all` for every one.

    flock /tmp/heavy.lock python -m bench all          # CACHE_DIR/qwen3vl-2b-random (or --model-path)
    python -m bench start|ttft|decode|compare|quantize|fidelity|images|pixels [--threads 2] [--no-save]
    python -m bench all --tiny          # the embedded tiny model: a quick run of the whole suite

Every model measurement runs in a fresh process (RSS figures are its own). Each scenario prints its
table and appends it to bench/RESULTS.md with date, CPU, threads, weights and settings.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench import fidelity, image_decoding, pixels, quantizing, serving
from bench.harness import default_model_path, isolated, require_checkpoint
from bench.results import append_section

SCENARIOS = ["quantize", "start", "ttft", "decode", "compare", "fidelity", "images", "pixels"]


def _int8(args) -> Path:
    """The pre-quantized copy of the source checkpoint, written (and measured) if missing."""
    if not (args.int8_path / "config.json").exists():
        quantize(args)
    return args.int8_path


def _settings(args, **extra) -> dict:
    return {
        "weights": args.model_path.name,
        "INT8 checkpoint": args.int8_path.name,
        "THREADS": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "quantized engine": torch.backends.quantized.engine,
        **extra,
    }


def _save(args, title: str, body: str, **extra) -> None:
    if args.no_save:
        print(f"\n## {title}\n\n{body}\n")
    else:
        append_section(title, _settings(args, **extra), body, threads=args.threads)


def quantize(args) -> None:
    result = quantizing.measure(args.model_path, args.int8_path)
    _save(args, "INT8 quantize (`python -m service quantize`)", quantizing.table(result))


def _serving(args, kinds: list[str], scenarios: list[str], title: str) -> None:
    int8 = _int8(args)
    results = serving.run_kinds(kinds, args.model_path, int8, args.threads, args.image_max_pixels, args.decode_tokens)
    _save(
        args,
        title,
        serving.table(results, scenarios),
        IMAGE_MAX_PIXELS=args.image_max_pixels,
        decode_tokens=args.decode_tokens,
        caches="off",
    )


def start(args) -> None:
    _serving(args, ["int8 pre-quantized", "int8 quantized at load"], ["start"], "Start → ready and RSS")


def ttft(args) -> None:
    _serving(args, ["int8 pre-quantized"], ["ttft"], "Time to first token: image decode / vision encode / prefill")


def decode(args) -> None:
    _serving(args, ["int8 pre-quantized"], ["decode"], "Decode tokens/s against the memory-bandwidth ceiling")


def compare(args) -> None:
    _serving(args, list(serving.KINDS), ["start", "ttft", "decode"], "fp32 versus INT8, side by side")


def _quantized(args, kind: str) -> Path:
    """The source's quantized copy of fidelity.CHECKPOINTS `kind` (INT8: --int8-path), written if missing."""
    if kind == "int8":
        return _int8(args)
    path = args.model_path.with_name(f"{args.model_path.name}-{kind}")
    if not (path / "config.json").exists():
        from service.quant.quantized import write_quantized

        write_quantized(args.model_path, path, **fidelity.CHECKPOINTS[kind])
    return path


def fidelity_(args) -> None:
    variants = fidelity.select(args.fidelity_bits)
    checkpoints = {kind: _quantized(args, kind) for kind in {v[0] for v in variants.values()}}
    body = fidelity.run(args.model_path, checkpoints, args.threads, args.fidelity_tokens, variants)
    _save(
        args,
        f"{'INT8' if args.fidelity_bits == 'int8' else 'INT8 and 4-bit'} fidelity against fp32 "
        f"({args.model_path.name})",
        body,
        greedy_tokens=args.fidelity_tokens,
        prompts=f"{len(fidelity.TEXT_PROMPTS)} text + {len(fidelity.IMAGE_PROMPTS)} with a 1080p photo",
    )


def images(args) -> None:
    rows = isolated(
        "bench.image_decoding:measure",
        threads=args.threads,
        repeats=args.repeats,
        image_max_pixels=args.image_max_pixels,
    )
    _save(
        args,
        "Image decoding: OpenCV versus PIL (1920×1080)",
        image_decoding.table(rows, args.image_max_pixels),
        repeats=f"median of {args.repeats}",
    )


def pixels_(args) -> None:
    results = isolated("bench.pixels:sweep", model_path=str(_int8(args)), threads=args.threads, budgets=pixels.BUDGETS)
    title = f"{args.int8_path.name}, {args.threads} threads: time to first token vs visual tokens"
    plot = pixels.plot(results, title, Path(tempfile.gettempdir()) / pixels.PLOT.name if args.no_save else pixels.PLOT)
    _save(
        args,
        "Pixel budget → visual tokens → time to first token",
        pixels.table(results) + f"\n\n![time to first token versus visual tokens]({plot.name})",
    )


COMMANDS = {
    "quantize": quantize,
    "start": start,
    "ttft": ttft,
    "decode": decode,
    "compare": compare,
    "fidelity": fidelity_,
    "images": images,
    "pixels": pixels_,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    parser.add_argument("--model-path", type=Path, help="source checkpoint (default: CACHE_DIR/qwen3vl-2b-random)")
    parser.add_argument("--int8-path", type=Path, help="its pre-quantized copy (default: <model-path>-int8)")
    parser.add_argument("--tiny", action="store_true", help="use the embedded tiny model (quick, numbers meaningless)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--image-max-pixels", type=int, help="IMAGE_MAX_PIXELS (default: the service's)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--fidelity-tokens", type=int, default=16)
    parser.add_argument(
        "--fidelity-bits",
        choices=["all", "int8", "int4"],
        default="all",
        help="fidelity: which variants (int4: the 4-bit ones beside the shipped INT8)",
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-save", action="store_true", help="print only; do not append to bench/RESULTS.md")
    args = parser.parse_args(argv)
    from service.model.checkpoints import embedded_model_dir
    from service.settings import load_settings

    settings = load_settings()
    if args.tiny:
        args.model_path = embedded_model_dir(settings.cache_dir)
    args.model_path = require_checkpoint((args.model_path or default_model_path()).resolve())
    args.int8_path = (args.int8_path or args.model_path.with_name(args.model_path.name + "-int8")).resolve()
    args.image_max_pixels = args.image_max_pixels or settings.image_max_pixels
    if args.scenario != "all":
        COMMANDS[args.scenario](args)
        return 0
    quantize(args)
    for name in ["compare", "fidelity", "images", "pixels"]:  # compare covers start, ttft and decode
        COMMANDS[name](args)
    if not args.tiny and (tiny := embedded_model_dir(settings.cache_dir)) != args.model_path:
        args.model_path, args.int8_path = tiny, tiny.with_name(tiny.name + "-int8")
        fidelity_(args)  # the tiny model too: its large random weights stress INT8 harder
    return 0


if __name__ == "__main__":
    sys.exit(main())
