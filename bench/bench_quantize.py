"""`python -m service quantize SRC DST` as a user runs it: wall time, the process's peak RSS, sizes.

    flock /tmp/heavy.lock python -m bench.bench_quantize   # CACHE_DIR/qwen3vl-2b-random into its -int8 copy
    python -m bench.bench_quantize --tiny --no-save        # the embedded model: a quick check

The copy (--int8-path, else <model-path>-int8) is replaced. The measurement is bench/core/int8_suite.py's:
bench_fidelity and bench_pixels make the copy with it when it is missing.
"""

from __future__ import annotations

import sys

from bench.core import int8_suite


def main(argv=None) -> int:
    int8_suite.quantize(int8_suite.parse(int8_suite.parser(__doc__), argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
