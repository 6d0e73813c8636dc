"""Vision encoder: torch vs ONNX Runtime, fp32 vs INT8, at 448² and 896², side by side.

Memory: each backend alone in a fresh subprocess that loads the checkpoint as the service does
(`load_model` + `make_vision_encoder`) and encodes each image once: RSS after loading, peak RSS
while encoding (sampled), the process's peak RSS, and its features' cosine with torch fp32's.
Speed: one fresh subprocess per precision holds both backends and times them alternately
(`--repeats` runs each after a warm-up; the fastest counts), so that load from other processes on
this shared machine falls on both alike. The ONNX export is built first if the checkpoint has
none. Prints the table and writes it to bench/RESULTS.md.

    flock /tmp/heavy.lock python -m bench.bench_vision        # the 2B-shaped checkpoint, 2 threads
    python -m bench.bench_vision --model-path /path/to/Qwen3-VL-2B-Instruct --threads 4
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.core import ROOT
from bench.core.harness import GIB, isolated, parse, parser, peak_rss_bytes, rss_bytes
from bench.core.inputs import photo
from bench.core.results import markdown_table, report

BACKENDS = [("torch", "fp32"), ("torch", "int8"), ("onnxruntime", "fp32"), ("onnxruntime", "int8")]


class PeakRss:
    """Samples this process's RSS every 10 ms while in the `with` block."""

    def __enter__(self):
        import psutil

        self._process, self._stop, self.peak = psutil.Process(), threading.Event(), 0
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(0.01)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def image_inputs(processor, side: int):
    """Patches and grid of a side × side test picture, through the checkpoint's own processor."""
    batch = processor.image_processor(images=[photo(side, side)], return_tensors="pt")
    return batch["pixel_values"], batch["image_grid_thw"]


def load_backend(config: dict, backend: str, precision: str):
    """The checkpoint and the encoder `backend` names, loaded as the service loads them."""
    from service.model.loading import load_model
    from service.settings import load_settings
    from service.vision.encoders import make_vision_encoder

    settings = load_settings(
        model_path=config["model_path"],
        quantization=precision,
        threads=config["threads"],
        vision_backend=backend,
        vision_onnx_dir=config["export_dir"],
        image_max_pixels=max(config["sizes"]) ** 2,
        cache_dir=config["cache_dir"],
    )
    loaded = load_model(settings)
    encoder = make_vision_encoder(loaded, settings)
    if encoder.name != backend:
        raise SystemExit(f"asked for {backend}, got {encoder.name}: is the export missing?")
    return loaded, encoder


def memory_worker(config: dict, backend: str, precision: str, features_out: str) -> dict:
    """One backend alone in this fresh process: load time, RSS, peak RSS while encoding, features."""
    t0 = time.perf_counter()
    loaded, encoder = load_backend(config, backend, precision)
    result = {"load_seconds": time.perf_counter() - t0, "rss_after_load": rss_bytes()}
    peak = 0
    for side in sorted(config["sizes"]):
        pixels, grid = image_inputs(loaded.processor, side)
        with PeakRss() as rss:
            features = encoder(pixels, grid)
        peak = max(peak, rss.peak)
        if side == min(config["sizes"]):
            np.savez(features_out, *[t.numpy() for t in (features[0].pooler, *features[0].deepstack)])
    result["peak_rss_encoding"] = peak
    result["ru_maxrss"] = peak_rss_bytes()
    return result


def speed_worker(config: dict, precision: str) -> dict:
    """torch and ONNX Runtime in one process at one precision, timed alternately, so that load
    from other processes on the machine falls on both alike."""
    from service.vision.features import TorchVisionEncoder

    loaded, onnx_encoder = load_backend(config, "onnxruntime", precision)
    encoders = {"torch": TorchVisionEncoder(loaded.model), "onnxruntime": onnx_encoder}
    times = {name: {} for name in encoders}
    for side in config["sizes"]:
        pixels, grid = image_inputs(loaded.processor, side)
        for name, encoder in encoders.items():
            encoder(pixels, grid)  # warm-up: first-call allocations and kernel choices
            times[name][side] = []
        for _ in range(config["repeats"]):
            for name, encoder in encoders.items():
                t = time.perf_counter()
                encoder(pixels, grid)
                times[name][side].append(time.perf_counter() - t)
    return {
        "times": times,
        "tokens": {side: int(image_inputs(loaded.processor, side)[1].prod()) // 4 for side in config["sizes"]},
    }


def cosines(reference: Path, other: Path) -> float:
    """The smallest cosine similarity over the pooler and deepstack outputs."""
    a, b = np.load(reference), np.load(other)
    return min(
        float(np.dot(a[k].ravel(), b[k].ravel()) / (np.linalg.norm(a[k]) * np.linalg.norm(b[k]))) for k in a.files
    )


def ensure_export(model_path: Path, export_dir: Path, fresh: bool = False) -> str:
    """Build the export unless a current one exists (or `fresh`); what it cost, for the table's note."""
    from service.vision.onnx import StaleExport, check_export

    if not fresh:
        try:
            check_export(export_dir, model_path)
            return "existing"
        except StaleExport as exc:
            print(f"{exc}: exporting (python -m service export-onnx)")
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "service", "--log-level", "WARNING", "export-onnx", str(model_path), str(export_dir)],
        check=True,
        cwd=ROOT,
    )
    # The export is this process's first child: the children's peak RSS is its own.
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2
    return f"built in {time.perf_counter() - t0:.0f} s, peak RSS {peak_gib:.1f} GiB"


def main(argv=None) -> int:
    p = parser(__doc__, quantization=False)
    p.add_argument("--sizes", type=int, nargs="+", default=[448, 896])
    p.add_argument("--repeats", type=int, default=3, help="timed encodes per size and backend, after a warm-up")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-vision-cache")
    p.add_argument("--export-dir", type=Path, help="default: the cache directory the service looks in")
    p.add_argument("--fresh-export", action="store_true", help="rebuild the export (measures its time and peak)")
    args = parse(p, argv, source=True)
    from service.vision.onnx import default_export_dir

    args.export_dir = args.export_dir or default_export_dir(args.model_path, args.cache_dir)
    export_note = ensure_export(args.model_path, args.export_dir, args.fresh_export)
    config = {
        "model_path": str(args.model_path),
        "threads": args.threads,
        "sizes": args.sizes,
        "repeats": args.repeats,
        "cache_dir": str(args.cache_dir),
        "export_dir": str(args.export_dir),
    }
    memory, speed = {}, {}
    jobs = [("memory", b, p) for b, p in BACKENDS] + [("speed", p) for p in ("fp32", "int8")]
    with tempfile.TemporaryDirectory() as tmp, tqdm(jobs, desc="fresh processes", unit="process") as bar:
        for job in bar:
            bar.set_postfix_str(" ".join(job))
            if job[0] == "memory":
                features = str(Path(tmp) / f"{job[1]}-{job[2]}.npz")
                memory[job[1:]] = isolated("bench.bench_vision:memory_worker", config=config, backend=job[1],
                                           precision=job[2], features_out=features)  # fmt: skip
                memory[job[1:]]["cosine"] = cosines(Path(tmp) / "torch-fp32.npz", Path(features))
            else:
                speed[job[1]] = isolated("bench.bench_vision:speed_worker", config=config, precision=job[1])

    best = {(b, p): {s: min(speed[p]["times"][b][str(s)]) for s in args.sizes} for b, p in BACKENDS}
    tokens = speed["int8"]["tokens"]
    header = [
        "backend",
        "precision",
        *[f"{s}² encode s ({tokens[str(s)]} tokens)" for s in args.sizes],
        *[f"{s}² ÷ torch same precision" for s in args.sizes],
        *[f"{s}² ÷ torch int8" for s in args.sizes],
        "RSS after load GiB",
        "peak RSS encoding GiB",
        "process peak RSS GiB",
        "load s",
        "cosine vs torch fp32",
    ]
    rows = []
    for backend, precision in BACKENDS:
        b, m = best[backend, precision], memory[backend, precision]
        rows.append(
            [
                backend,
                precision,
                *[b[s] for s in args.sizes],
                *[f"{b[s] / best['torch', precision][s]:.2f}×" for s in args.sizes],
                *[f"{b[s] / best['torch', 'int8'][s]:.2f}×" for s in args.sizes],
                m["rss_after_load"] / GIB,
                m["peak_rss_encoding"] / GIB,
                m["ru_maxrss"] / GIB,
                m["load_seconds"],
                f"{m['cosine']:.5f}",
            ]
        )
    body = (
        markdown_table(header, rows) + f"\n\nEncode: the fastest of {args.repeats} runs after a warm-up; torch "
        "and ONNX Runtime of one precision share a fresh process and run alternately, so load from other "
        "processes falls on both alike. Memory: each backend alone in a fresh process loading the checkpoint "
        "as the service does (`load_model` + `make_vision_encoder`; the ONNX rows also hold the torch "
        "model, as the service does). Cosine: the smallest over the pooler and deepstack outputs of the "
        f"{min(args.sizes)}² image."
    )
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    return report(
        args,
        "Vision encoder: torch vs ONNX Runtime",
        {
            "checkpoint": args.model_path.name,
            "threads": args.threads,
            "onnx export": export_note,
            "load average at the end": load,
        },
        body,
    )


if __name__ == "__main__":
    sys.exit(main())
