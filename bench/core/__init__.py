"""What every benchmark uses: one `/v1/chat` client (`client`), one in-process engine session
(`session`), the server launchers (`servers`), fresh processes and checkpoints (`harness`), the
benchmarks' inputs (`inputs`) and bench/RESULTS.md (`results`).

Benchmarks run from the repository's root as `python -m bench.X`, so `service` and `bench` import
as they are; nothing here edits sys.path.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
