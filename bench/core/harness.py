"""Fresh processes, interleaved runs, memory probes and the benchmark checkpoints.

`python -m bench.core.harness MODULE:FUNCTION JSON_KWARGS OUT_JSON` runs one measurement function in
this (fresh) process and writes its result to OUT_JSON; `isolated(...)` is how benchmarks call it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from tqdm import tqdm

from bench.core import ROOT

GIB = 1024**3
MIB = 1024**2


def isolated(target: str, tree: Path | None = None, **kwargs) -> dict:
    """`target` ("bench.module:function") called with kwargs in a fresh Python process, so its RSS
    figures are its own; its stderr (progress bars, logs) passes through. With `tree` (see
    `tree_at`), the process imports that tree's `service` and this tree's `bench`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        root = tree or ROOT
        env = {k: v for k, v in os.environ.items() if k != "MODEL_PATH"}
        env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
        run = subprocess.run(
            [sys.executable, "-m", "bench.core.harness", target, json.dumps(kwargs), str(out)],
            cwd=root,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        if run.returncode != 0:
            raise RuntimeError(f"{target}({kwargs}) failed with exit code {run.returncode}")
        return json.loads(out.read_text())


def interleaved(target: str, kinds: dict[str, dict], rounds: int = 1, trees: dict | None = None) -> dict:
    """kind → its results: `target` run in a fresh process per kind (`kinds[kind]`: its kwargs;
    `trees[kind]`: the tree it imports, see `tree_at`), in the order A B C … C B A per round, so
    drift in the machine's speed falls on every kind alike."""
    order = [*kinds, *reversed(kinds)] * rounds
    results: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for kind in tqdm(order, desc="engines", unit="process"):
        results[kind].append(isolated(target, tree=(trees or {}).get(kind), **kinds[kind]))
    return results


def medians(results: dict[str, list[dict]], keys) -> dict[str, dict[str, float]]:
    """kind → key → the median over the kind's runs."""
    return {kind: {key: statistics.median(r[key] for r in runs) for key in keys} for kind, runs in results.items()}


def percentile(values: list[float], q: float) -> float:
    """The inclusive `q`th percentile (1–99) of `values`; NaN for none."""
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def concurrently(calls: list) -> tuple[list, float]:
    """Every call (no arguments) at once, each on its own thread: their results in order, and the
    wall time from the first start to the last end."""
    results = [None] * len(calls)

    def run(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - began


@contextlib.contextmanager
def tree_at(rev: str, extra: tuple[str, ...] = ()):
    """A directory importing `service` (and the `extra` paths) as they were at git revision `rev`,
    and `bench` as it is now: for measuring today's code against a change in one run
    (`isolated(tree=...)`, or a Gunicorn started there)."""
    with tempfile.TemporaryDirectory(prefix="baseline-") as tmp:
        archive = subprocess.run(
            ["git", "archive", rev, "service", *extra], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        os.symlink(ROOT / "bench", Path(tmp) / "bench")
        yield Path(tmp)


def short_rev(rev: str) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def peak_rss_bytes() -> int:
    """The process's RSS high-water mark since it started (kernel's ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def tree_memory(process) -> int:
    """A server's resident memory: the PSS of its processes (a page Gunicorn's master shares with its
    worker counted once, not twice as summed RSS would)."""
    root = psutil.Process(process.pid)
    return sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)])


def tree_mapped_memory(process, paths: list[Path]) -> int:
    """The PSS of a server's mappings of the files under `paths` (its weights, mapped from the page
    cache: what instances on one machine share), over its processes."""
    prefixes = tuple(str(Path(p).resolve()) for p in paths)
    root = psutil.Process(process.pid)
    return sum(
        m.pss for p in [root, *root.children(recursive=True)] for m in p.memory_maps() if m.path.startswith(prefixes)
    )


def default_model_path() -> Path:
    """The 2B-shaped random checkpoint under CACHE_DIR (`python -m service make-model --preset 2b ...`)."""
    return preset_model_path("2b")


def preset_model_path(preset: str) -> Path:
    """The random checkpoint of a `make-model` preset under CACHE_DIR: qwen3vl-PRESET-random, or
    PRESET-random for a preset that names its family (qwen3.5-2b-random)."""
    from service.settings import load_settings

    return load_settings().cache_dir / f"{preset if preset.startswith('qwen') else 'qwen3vl-' + preset}-random"


def tiny_model_path() -> Path:
    """The embedded tiny checkpoint under CACHE_DIR, built on first use."""
    from service.random_checkpoints.embedded import embedded_model_dir
    from service.settings import load_settings

    return embedded_model_dir(load_settings().cache_dir)


def default_int8_path() -> Path:
    """Its pre-quantized copy (`python -m service quantize`) if made, else the checkpoint itself
    (quantized at load: the same weights, a slower start)."""
    source = default_model_path()
    int8 = source.with_name(source.name + "-int8")
    return int8 if (int8 / "config.json").exists() else source


def parser(doc: str, quantization: bool = True, baseline: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring's first line, and what every model benchmark takes:
    --model-path, --quantization (unless not `quantization`), --threads, --tiny (see `parse`), --no-save;
    with a `baseline`, --baseline (the git revision of the code to compare with, that by default)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    if baseline:
        p.add_argument("--baseline", default=baseline, help="git revision of the code to compare with")
    p.add_argument(
        "--model-path",
        type=Path,
        default=None,
        help="default: CACHE_DIR/qwen3vl-2b-random (its -int8 copy for INT8, when made)",
    )
    if quantization:
        p.add_argument("--quantization", default="int8", choices=["int8", "fp32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--tiny", action="store_true", help="the embedded tiny model: a quick check, its figures meaningless"
    )
    p.add_argument("--no-save", action="store_true", help="print the tables, leave bench/RESULTS.md alone")
    add_speculation(p)
    return p


def add_speculation(p: argparse.ArgumentParser) -> None:
    """--speculative: exact speculative decoding in every engine and server the benchmark starts (`parse`
    exports it as SPECULATIVE). Off by default: on random weights prompt lookup accepts far more guesses
    than a real model's answers allow, so a decode figure with it on is not raw decode."""
    p.add_argument(
        "--speculative",
        choices=["off", "on"],
        default="off",
        help="exact speculative decoding in what the benchmark serves (default off: a token a forward)",
    )


def serve_with_speculation(setting: str) -> None:
    """SPECULATIVE for every Session, fresh process and Gunicorn server this benchmark starts (each reads
    the environment); a scenario's explicit setting (bench_speculative's) still wins."""
    os.environ["SPECULATIVE"] = setting


def parse(p: argparse.ArgumentParser, argv=None, source: bool = False) -> argparse.Namespace:
    """`p`'s arguments, `model_path` the checkpoint they name: --tiny's, --model-path, a --model preset's
    (where the parser has one: `preset_model_path`), or by default the 2B-shaped one (its INT8 copy for
    INT8, unless `source`: the checkpoint the copies are made from).
    Exits with how to make it if it is missing."""
    args = p.parse_args(argv)
    serve_with_speculation(args.speculative)
    if args.tiny:
        args.model_path = tiny_model_path()
    elif args.model_path is None and getattr(args, "model", None):
        args.model_path = preset_model_path(args.model)
    elif args.model_path is None:
        source = source or getattr(args, "quantization", "int8") != "int8"
        args.model_path = default_model_path() if source else default_int8_path()
    args.model_path = require_checkpoint(args.model_path.resolve())
    return args


def require_checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        preset = path.name.removeprefix("qwen3vl-").removesuffix("-random")
        raise SystemExit(
            f"no checkpoint at {path}: create it with\n"
            f"  flock /tmp/heavy.lock python -m service make-model --preset {preset} {path}\n"
            "or pass --model-path (a Qwen3-VL checkpoint directory)"
        )
    return path


def main(argv: list[str]) -> int:
    target, kwargs, out = argv
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(**json.loads(kwargs))
    Path(out).write_text(json.dumps(result))
    # No interpreter teardown: a daemon thread still inside torch (the engine's scheduler) can make
    # it abort ("terminate called without an active exception") after the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
