"""A CPU-only inference service for Qwen3-VL."""

import os

# oneDNN keeps every kernel it builds for a new shape, up to 1,024 by default: prompt pieces and
# pictures of ever new lengths made that tens of MiB of a long-running worker's memory, growing for
# hours (`python -m bench.soak` measures the growth). 64 holds every decode batch size and the full
# prefill pieces in use at once; only odd lengths (a prompt's last piece, a picture) rebuild.
# Set here, before torch is imported by any service module; the environment still wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
