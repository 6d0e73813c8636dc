"""The shared store from the settings: the Redis JOB_STORE_URL names, where SHARED_STATE is on."""

from __future__ import annotations

from ..settings import Settings
from .link import SharedLink


def shared_link(settings: Settings) -> SharedLink | None:
    """The link to the shared store, or None: state stays on each instance (SQLite job store, or
    SHARED_STATE off)."""
    url = settings.job_store_url
    if settings.shared_state and url and not url.startswith("sqlite:///"):
        return SharedLink(url)
    return None
