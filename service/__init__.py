"""A CPU-only inference service for Qwen3-VL."""

import os

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
