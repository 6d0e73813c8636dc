"""The INT8 suite: quantize, fidelity, pixels — one command each, `all` for every one.

    flock /tmp/heavy.lock python -m bench all          # CACHE_DIR/qwen3vl-2b-random (or --model-path)
    python -m bench quantize|fidelity|pixels [--threads 2] [--no-save]
    python -m bench all --tiny          # the embedded tiny model: a quick run of the whole suite

Every model measurement runs in a fresh process (RSS figures are its own). Each scenario prints its
table and appends it to bench/RESULTS.md with date, CPU, threads, weights and settings. The other
benchmarks are modules of their own (docs/benchmarks.md).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench import fidelity, pixels, quantizing
from bench.core.harness import isolated, parse, parser, tiny_model_path
from bench.core.results import report

SCENARIOS = ["quantize", "fidelity", "pixels"]


def _int8(args) -> Path:
    """The pre-quantized copy of the source checkpoint, written (and measured) if missing."""
    if not (args.int8_path / "config.json").exists():
        quantize(args)
    return args.int8_path


def _save(args, title: str, body: str, **extra) -> None:
    settings = {
        "weights": args.model_path.name,
        "INT8 checkpoint": args.int8_path.name,
        "THREADS": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "quantized engine": torch.backends.quantized.engine,
        **extra,
    }
    report(args, title, settings, body)


def quantize(args) -> None:
    result = quantizing.measure(args.model_path, args.int8_path)
    _save(args, "INT8 quantize (`python -m service quantize`)", quantizing.table(result))


def _quantized(args, kind: str) -> Path:
    """The source's quantized copy of fidelity.CHECKPOINTS `kind` (INT8: --int8-path), written if missing."""
    if kind == "int8":
        return _int8(args)
    path = args.model_path.with_name(f"{args.model_path.name}-{kind}")
    if not (path / "config.json").exists():
        from service.quant.writer import write_quantized

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


def pixels_(args) -> None:
    results = isolated("bench.pixels:sweep", model_path=str(_int8(args)), threads=args.threads, budgets=pixels.BUDGETS)
    title = f"{args.int8_path.name}, {args.threads} threads: time to first token vs visual tokens"
    plot = pixels.plot(results, title, Path(tempfile.gettempdir()) / pixels.PLOT.name if args.no_save else pixels.PLOT)
    _save(
        args,
        "Pixel budget → visual tokens → time to first token",
        pixels.table(results) + f"\n\n![time to first token versus visual tokens]({plot.name})",
    )


COMMANDS = {"quantize": quantize, "fidelity": fidelity_, "pixels": pixels_}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, quantization=False)
    p.prog = "python -m bench"
    p.add_argument("scenario", choices=[*SCENARIOS, "all"])
    p.add_argument("--int8-path", type=Path, help="the source's pre-quantized copy (default: <model-path>-int8)")
    p.add_argument("--fidelity-tokens", type=int, default=16)
    p.add_argument(
        "--fidelity-bits",
        choices=["all", "int8", "int4"],
        default="all",
        help="fidelity: which variants (int4: the 4-bit ones beside the shipped INT8)",
    )
    args = parse(p, argv, source=True)
    args.int8_path = (args.int8_path or args.model_path.with_name(args.model_path.name + "-int8")).resolve()
    if args.scenario != "all":
        COMMANDS[args.scenario](args)
        return 0
    for name in SCENARIOS:
        COMMANDS[name](args)
    if not args.tiny:  # the tiny model too: its large random weights stress INT8 harder
        args.model_path = tiny_model_path()
        args.int8_path = args.model_path.with_name(args.model_path.name + "-int8")
        fidelity_(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
