"""The HTTP layer: thin routes over the engine. Nothing outside this package imports it."""

from .app import create_app

__all__ = ["create_app"]
