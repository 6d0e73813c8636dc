"""A memory-limited cgroup for tests: bench/core/servers.py's (v2 or v1, whichever this machine's
own cgroup is in), the test skipped where none can be made (it needs root and a writable memory
controller)."""

from __future__ import annotations

from functools import partial

import pytest

from bench.core import servers

memory_cgroup = partial(servers.memory_cgroup, unavailable=pytest.skip)
