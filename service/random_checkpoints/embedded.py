"""The embedded test model: the `tiny` random checkpoint, built once under CACHE_DIR, which the service
loads when MODEL_PATH is unset.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from ..settings import EMBEDDED_MODEL_DIRNAME
from .make import make_checkpoint

log = logging.getLogger(__name__)


def embedded_model_dir(cache_dir: Path) -> Path:
    """The embedded tiny checkpoint under `cache_dir`, built once (atomically) on first use."""
    target = Path(cache_dir) / EMBEDDED_MODEL_DIRNAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning("building the embedded random test model in %s (once)", target)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        make_checkpoint("tiny", staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
