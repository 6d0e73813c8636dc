"""What the INT8 / start-up / latency benchmarks share: a fresh process per measurement, memory and
bandwidth probes, the benchmark's checkpoints and a 1080p test photo.

`python -m bench.harness MODULE:FUNCTION JSON_KWARGS OUT_JSON` runs one measurement function in this
(fresh) process and writes its result to OUT_JSON; `isolated(...)` is how the scenarios call it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
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
            [sys.executable, "-m", "bench.harness", target, json.dumps(kwargs), str(out)],
            cwd=root,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        if run.returncode != 0:
            raise RuntimeError(f"{target}({kwargs}) failed with exit code {run.returncode}")
        return json.loads(out.read_text())


@contextlib.contextmanager
def tree_at(rev: str, extra: tuple[str, ...] = ()):
    """A directory importing `service` (and the `extra` paths) as they were at git revision `rev`,
    and `bench` and `tests` as they are now: for benchmarks that measure today's code against a
    change in one run (`isolated(tree=...)`, or a Gunicorn started there)."""
    with tempfile.TemporaryDirectory(prefix="baseline-") as tmp:
        archive = subprocess.run(
            ["git", "archive", rev, "service", *extra], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        for name in ("bench", "tests"):
            os.symlink(ROOT / name, Path(tmp) / name)
        yield Path(tmp)


def short_rev(rev: str) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def peak_rss_bytes() -> int:
    """The process's RSS high-water mark since it started (kernel's ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tree_memory(process) -> int:
    """A server's resident memory: the PSS of its processes (a page Gunicorn's master shares with its
    worker counted once, not twice as summed RSS would)."""
    import psutil

    root = psutil.Process(process.pid)
    return sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)])


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def seconds_since_process_start() -> float:
    return time.time() - psutil.Process().create_time()


def read_bandwidth_gbps(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Memory read bandwidth (GB/s) with `threads` threads: summing a tensor far larger than the caches."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(int(gib * GIB) // 4)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    nbytes = data.numel() * 4
    del data
    return nbytes / best / 1e9


def image_limits_of(engine):
    """An engine's image limits, in today's code (`engine.limits.image`) and in a `tree_at` of older
    code (`engine.loaded.image_limits`)."""
    limits = getattr(engine, "limits", None)
    return limits.image if limits is not None else engine.loaded.image_limits


def timing(done, name: str) -> float:
    """One of a Completion's timings: a Timings field today, a dict entry in older code."""
    return done.timings[name] if isinstance(done.timings, dict) else getattr(done.timings, name)


def photo(width: int = 1920, height: int = 1080, seed: int = 0) -> np.ndarray:
    """A photo-like BGR picture: smooth gradients, shapes with edges, and sensor-like noise."""
    import cv2

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([x / width, y / height, 0.5 + 0.5 * np.sin(x / 90 + y / 140)], axis=-1) * 200
    for _ in range(24):
        center = (int(rng.integers(width)), int(rng.integers(height)))
        color = tuple(int(c) for c in rng.integers(0, 255, 3))
        cv2.circle(img, center, int(rng.integers(20, height // 4)), color, -1, lineType=cv2.LINE_AA)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encoded_photo(ext: str = ".jpg", width: int = 1920, height: int = 1080, seed: int = 0) -> bytes:
    import cv2

    params = (
        [cv2.IMWRITE_JPEG_QUALITY, 90] if ext == ".jpg" else [cv2.IMWRITE_WEBP_QUALITY, 90] if ext == ".webp" else []
    )
    ok, buf = cv2.imencode(ext, photo(width, height, seed), params)
    assert ok
    return buf.tobytes()


def default_model_path() -> Path:
    """The 2B-shaped random checkpoint under CACHE_DIR (`python -m service make-model --preset 2b ...`)."""
    from service.settings import load_settings

    return load_settings().cache_dir / "qwen3vl-2b-random"


def default_int8_path() -> Path:
    """Its pre-quantized copy (`python -m service quantize`) if made, else the checkpoint itself
    (quantized at load: the same weights, a slower start)."""
    source = default_model_path()
    int8 = source.with_name(source.name + "-int8")
    return int8 if (int8 / "config.json").exists() else source


def add_checkpoint_args(parser) -> None:
    """--model-path, --quantization, --threads: what every model benchmark takes (see `checkpoint_of`)."""
    parser.add_argument(
        "--model-path",
        type=Path,
        default=None,
        help="default: CACHE_DIR/qwen3vl-2b-random (its -int8 copy for INT8, when made)",
    )
    parser.add_argument("--quantization", default="int8", choices=["int8", "fp32"])
    parser.add_argument("--threads", type=int, default=2)


def checkpoint_of(args) -> Path:
    """The checkpoint `add_checkpoint_args`' flags name; exits with how to make it if it is missing."""
    default = default_int8_path() if args.quantization == "int8" else default_model_path()
    return require_checkpoint(args.model_path or default)


def require_checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        raise SystemExit(
            f"no checkpoint at {path}: create it with\n"
            f"  flock /tmp/heavy.lock python -m service make-model --preset 2b {path}\n"
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
