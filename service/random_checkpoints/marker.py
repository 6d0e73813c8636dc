"""How a random checkpoint says it is one: a mark in its config, and the warning it is served with."""

from __future__ import annotations

RANDOM_MODEL_MARKER = "random_test_model"
RANDOM_MODEL_WARNING = (
    "This is a RANDOM-WEIGHT test model: its answers are noise (the embedded one, or one `make-model` "
    "wrote for tests and benchmarks). Set MODEL_PATH to a Qwen3-VL checkpoint directory for real answers."
)


def is_random_test_model(config) -> bool:
    """Whether `config` (a loaded checkpoint's) carries the mark `make_checkpoint` gives it."""
    return bool(getattr(config, RANDOM_MODEL_MARKER, False))
