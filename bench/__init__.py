"""The benchmarks (`python -m bench list`)."""

# The service before anything of a benchmark's imports torch: its thread settings must be in place when
# torch loads (service/__init__.py), or an in-process benchmark times libgomp's defaults instead.
import service  # noqa: F401
