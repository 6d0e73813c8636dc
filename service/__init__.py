"""A CPU-only inference service for Qwen3-VL."""

import os
import sys
import warnings

# The settings below this process's environment did not make: set here (a launcher of other programs,
# bench's llama.cpp, leaves them out of theirs)
SETTINGS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULTED = [name for name in SETTINGS if name not in os.environ]

# oneDNN keeps every kernel it builds for a new shape, up to 1,024 by default: prompt pieces and
# pictures of ever new lengths made that tens of MiB of a long-running worker's memory, growing for
# hours (`python -m bench soak` measures the growth). 64 holds every decode batch size and the full
# prefill pieces in use at once; only odd lengths (a prompt's last piece, a picture) rebuild.
# Set here, before torch is imported by any service module; the environment still wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
# Threads compute on one core unless they ask for more (service/threads.py: only the engine's
# scheduler does for long; another team of threads would make libgomp sleep its threads between the
# decode step's parallel regions, halving decode speed on 2 cores). Also before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The scheduler's team is not the process's first thread's, so libgomp counts one thread more than the
# cores (2 + the idle main thread on 2 cores) and spins only 100 rounds before sleeping between two
# parallel regions: every one of a decode step's ~300 paid a wake-up. OMP_WAIT_POLICY=active makes that
# 1,000 rounds (~20 µs) and GOMP_SPINCOUNT keeps the unthrottled spin at libgomp's own default (~3 ms):
# an idle server still sleeps. Scheduling only: the same bits. What it changed: `bench_peer --model
# qwen3.5-2b` read 4-bit decode 32.3 tok/s at 2da4d48 and 40.0 after (bench/RESULTS.md and its history).
os.environ.setdefault("OMP_WAIT_POLICY", "active")
os.environ.setdefault("GOMP_SPINCOUNT", "300000")

# libgomp and oneDNN read these when torch loads: a program that imported torch before this package
# runs with their defaults, and a decode step's threads sleep between its parallel regions (measured:
# an in-process 2B 4-bit decode at 26-28 tok/s against 36-49 with the package imported first).
if "torch" in sys.modules and DEFAULTED:
    warnings.warn(
        f"torch was imported before the service: {', '.join(DEFAULTED)} came too late to take effect, so "
        "decoding may run a third slower; import service (or set them) before torch",
        RuntimeWarning,
        stacklevel=2,
    )
