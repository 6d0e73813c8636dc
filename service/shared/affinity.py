"""Affinity: the key the proxy routes a conversation by (nginx/affinity.js computes it from what the
client sends and passes it as X-Affinity-Key), written into every id the service makes — so a request
that names an id (`conversation_id`, `previous_response_id`, `conversation`, a URL's id) lands where the
request that made the id did, where its KV cache is. And the ledger of which instance served each key
last: a request whose key was last served elsewhere is an affinity miss (its KV was computed there)."""

from __future__ import annotations

import re
import secrets

from .. import metrics
from .link import SharedLink, SharedUnavailable

KEY = re.compile(r"^[0-9a-f]{16}$")


def checked_key(header: str | None) -> str | None:
    """The X-Affinity-Key header if it is one (16 hex digits), else None."""
    return header if header is not None and KEY.fullmatch(header) else None


def new_id(prefix: str, key: str | None, random_hex: int) -> str:
    """`prefix`, the affinity key (a random one without), then `random_hex` random hex digits: the
    proxy finds the key again in the id (nginx/affinity.js, ID_KEY)."""
    return prefix + (key or secrets.token_hex(8)) + secrets.token_hex((random_hex + 1) // 2)[:random_hex]


class AffinityLedger:
    """Which instance served each affinity key last (in the shared store, `ttl` seconds), and the
    metrics of the requests that followed one served elsewhere."""

    def __init__(self, link: SharedLink, instance: str, ttl: float):
        self.link, self.instance, self.ttl = link, instance, max(1, round(ttl))
        metrics.show_affinity()

    def note(self, key: str | None, api: str) -> None:
        """This instance serves a request of `key` (on `api`, one of metrics.AFFINITY_APIS)."""
        if key is None:
            return
        try:
            last = self.link.run(lambda r: r.set(f"qwen3vl:a:{key}", self.instance, ex=self.ttl, get=True))
        except SharedUnavailable:
            return
        if last is not None:
            metrics.AFFINITY_CONTINUATIONS.labels(api).inc()
            if last.decode() != self.instance:
                metrics.AFFINITY_MISSES.labels(api).inc()
