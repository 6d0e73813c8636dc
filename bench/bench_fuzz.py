"""The long fuzz run: tests/test_fuzz.py (schemathesis + hypothesis hostile inputs) with many
examples against one real Gunicorn; tallies every response status and writes it to RESULTS.md.

    python -m bench.bench_fuzz                  # ~2,000 examples per test: > 10,000 requests
    python -m bench.bench_fuzz --examples 200 --no-save
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.core import ROOT
from bench.core.results import markdown_table, report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="hypothesis examples per test")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)  # the test process writes it
    tally_file = Path(name)
    env = {**os.environ, "FUZZ_EXAMPLES": str(args.examples), "FUZZ_TALLY_FILE": str(tally_file)}
    t0 = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz.py"], cwd=ROOT, env=env
    )
    elapsed = time.perf_counter() - t0
    tally = json.loads(tally_file.read_text() or "{}")
    tally_file.unlink()
    statuses = {k: int(v) for k, v in sorted(tally.get("statuses", {}).items())}
    server_errors = sum(v for k, v in statuses.items() if int(k) >= 500)
    table = markdown_table(
        [
            "requests",
            "by status",
            "5xx",
            "errors after a 200",
            "worker restarts",
            "same answer after",
            "pytest",
            "minutes",
        ],
        [
            [
                sum(statuses.values()),
                statuses,
                server_errors,
                int(tally.get("stream_errors", 0)),
                "yes" if tally.get("worker_restarted") else "none",
                "yes" if tally.get("same_answer") else "NO",
                "passed" if result.returncode == 0 else "FAILED",
                elapsed / 60,
            ]
        ],
    )
    settings = {
        "examples_per_test": args.examples,
        "weights": "embedded tiny random",
    }
    report(args, "Fuzz: schemathesis and hostile inputs", settings, table, threads=2)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
