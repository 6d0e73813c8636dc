"""What the benchmarks share: one `/v1/chat` client (`client`), one in-process engine session (`session`),
the server launchers (`servers`), a loopback cluster of them behind the proxy (`cluster`), llama.cpp
built and its GGUF files (`llama_cpp`), fresh processes and checkpoints (`harness`), the benchmarks'
inputs (`inputs`), the decode ceiling (`ceiling`), what the INT8 suite's scenarios share (`int8_suite`)
and bench/RESULTS.md (`results`).

Benchmarks run from the repository's root as `python -m bench NAME` (or `python -m bench.bench_NAME`),
so `service` and `bench` import as they are; nothing here edits sys.path.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
