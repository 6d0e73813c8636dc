"""A CPU-only inference service for Qwen3-VL."""

import os

# oneDNN keeps every kernel it builds for a new shape, up to 1,024 by default: prompt pieces and
# pictures of ever new lengths made that tens of MiB of a long-running worker's memory, growing for
# hours (bench.soak: +9 % after warm-up; capped at 16, +1 %). 64 holds every decode batch size and
# prefill piece in use at once; a rebuilt kernel costs little (30 picture turns on 2B: same time).
# Set here, before torch is imported by any service module; the environment still wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
