"""Tenants: who a request's API key belongs to, and what is theirs alone.

A tenant is a name with one or more keys — `API_KEYS=name:key,…` (a key without a name is a tenant
of its own, named `key1`, `key2`… by its place in the list) and the `API_KEYS_FILE`, one `name key
[slots=N] [queue=N] [rpm=N] [tpm=N]` a line, re-read by `reload()` (SIGHUP: gunicorn.conf.py). Keys
are kept only as digests; a key is never logged, never in an error, never in a file name.

What a tenant owns is named by its `owner`, a hash (never a key): its conversations (the native
endpoint's histories), its batch files and batches (service/jobs/), and — keyed with a secret of the
machine's — its cache namespace (`cache_namespace`), which the engine's caches, memory and disk, match
on: one tenant's requests never reuse, nor learn of, what another sent. A request's `cache_salt`
narrows it further. Without keys there is one tenant, named "", owning everything, as before tenants.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ... import metrics
from ...generation import TenantShare
from ...jobs.store import owner_of
from ...settings import Settings, SettingsError

log = logging.getLogger("service.tenants")

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
LIMITS = ("slots", "queue", "rpm", "tpm")
# Under CACHE_DIR: what cache namespaces are keyed with, the same for the instances of a machine.
SECRET_FILE = "tenant-secret"


@dataclass(frozen=True)
class Tenant:
    """A tenant: its name, what it owns (`owner`, a hash) and its own limits (None: the default)."""

    name: str
    owner: str
    slots: int | None = None  # batch places its requests may hold while another tenant's wait
    queue: int | None = None  # queue places its requests may take
    rpm: int | None = None  # requests a minute
    tpm: int | None = None  # tokens a minute (prompt and answer)


NO_KEYS = Tenant("", "")


def key_digest(key: str) -> bytes:
    """What is kept of a key in memory."""
    return hashlib.blake2b(key.encode(), digest_size=32, person=b"qwen3vl-apikey").digest()


def _named_owner(name: str) -> str:
    # An unnamed key never holds ':' (it would name it), so no key's owner_of can be a name's.
    return owner_of(f"tenant:{name}")


@dataclass(frozen=True)
class TenantTable:
    """The keys in force: key digest → tenant, and the tenants by name and by owner."""

    by_digest: dict[bytes, Tenant] = field(default_factory=dict)
    by_name: dict[str, Tenant] = field(default_factory=dict)
    by_owner: dict[str, Tenant] = field(default_factory=dict)


def parse_api_keys(text: str) -> list[tuple[str | None, str]]:
    """API_KEYS: comma-separated `key` or `name:key` entries → (name or None, key)."""
    entries = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, key = entry.partition(":")
        entries.append((name.strip(), key.strip()) if sep else (None, entry))
    return entries


def parse_keys_file(path: Path) -> list[tuple[str, str, dict[str, int]]]:
    """API_KEYS_FILE: `name key [slots=N] [queue=N] [rpm=N] [tpm=N]` lines ('#' starts a comment) →
    (name, key, limits). A bad line raises SettingsError naming its line number, never its key."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"API_KEYS_FILE {str(path)!r} cannot be read: {exc.strerror}") from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) < 2:
            raise SettingsError(f"API_KEYS_FILE line {number}: expected `name key [limits]`")
        limits = {}
        for word in words[2:]:
            limit, _, value = word.partition("=")
            if limit not in LIMITS or not value.isdigit() or int(value) < 1:
                raise SettingsError(
                    f"API_KEYS_FILE line {number}: limits are {', '.join(f'{k}=N' for k in LIMITS)} with N >= 1"
                )
            limits[limit] = int(value)
        entries.append((words[0], words[1], limits))
    return entries


def build_table(api_keys: str, keys_file: Path | None) -> TenantTable:
    """The tenants of API_KEYS and API_KEYS_FILE (keys numbered in that order in errors); SettingsError
    for an empty key or one given twice, a bad or taken name, or one tenant's lines giving two limits."""
    entries = [(name, key, {}) for name, key in parse_api_keys(api_keys)]
    if keys_file is not None:
        entries += parse_keys_file(keys_file)
    owners: dict[str, str] = {}
    limits_of: dict[str, dict[str, int]] = {}
    names_of: dict[bytes, str] = {}
    for place, (name, key, limits) in enumerate(entries, 1):
        digest = key_digest(key)
        if not key or digest in names_of:
            raise SettingsError(f"API key {place} is empty or given twice")
        if name is None:
            name, owner = f"key{place}", owner_of(key)
        elif NAME.match(name):
            owner = _named_owner(name)
        else:
            raise SettingsError(f"API key {place}: a tenant name is 1 to 64 of A-Z, a-z, 0-9, '.', '_', '-'")
        if owners.setdefault(name, owner) != owner:
            raise SettingsError(f"API key {place}: the tenant name {name} is an unnamed key's, choose another")
        if limits and limits_of.setdefault(name, limits) != limits:
            raise SettingsError(f"API key {place}: tenant {name}'s keys give different limits")
        names_of[digest] = name
    by_name = {name: Tenant(name, owner, **limits_of.get(name, {})) for name, owner in owners.items()}
    by_digest = {digest: by_name[name] for digest, name in names_of.items()}
    return TenantTable(by_digest, by_name, {t.owner: t for t in by_name.values()})


class Tenants:
    """The tenant table in force (swapped whole by `reload`: a request keeps the tenant it was given),
    the requests' fair shares, and their cache namespaces."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.required = settings.keys_required
        self.table = self._read()
        self._secret: bytes | None = None
        self._secret_lock = threading.Lock()

    def _read(self) -> TenantTable:
        table = build_table(self.settings.api_keys.get_secret_value(), self.settings.api_keys_file)
        metrics.show_tenants(list(table.by_name))
        return table

    def reload(self) -> bool:
        """Read the keys again (SIGHUP); a bad file keeps the table in force (logged). Whether it changed."""
        if not self.required:
            return False
        try:
            table = self._read()
        except SettingsError as exc:
            log.error("API keys not reloaded, the ones in force stay: %s", exc)
            return False
        changed, self.table = table != self.table, table
        if changed:
            log.info("API keys reloaded: %d tenants (%s)", len(table.by_name), ", ".join(sorted(table.by_name)))
        return changed

    def resolve(self, key: str) -> Tenant | None:
        """The tenant of a presented key (NO_KEYS when no keys are required), or None."""
        if not self.required:
            return NO_KEYS
        # A dict lookup on the digest: its timing tells nothing of a key (an attacker chooses keys, not digests).
        return self.table.by_digest.get(key_digest(key)) if key else None

    def by_owner(self, owner: str) -> Tenant:
        """The tenant owning `owner`'s batches now (one no longer configured keeps its owner, no bounds)."""
        return self.table.by_owner.get(owner) or Tenant("", owner)

    def share(self, tenant: Tenant) -> TenantShare:
        """The tenant's fair share of the engine: bounded only when there are several tenants."""
        if len(self.table.by_name) < 2 or tenant.name not in self.table.by_name:
            return TenantShare(tenant.name)
        s = self.settings
        slots = tenant.slots or s.tenant_max_slots or max(1, s.max_batch_size // 2)
        queue = tenant.queue or s.tenant_max_queue or max(1, s.queue_size // 2)
        return TenantShare(tenant.name, slots, queue)

    def cache_namespace(self, tenant: Tenant, cache_salt: str | None) -> str:
        """The caches' namespace of a request: an HMAC of its tenant's owner and cache_salt, keyed with
        the machine's secret; "" with neither (no keys, no salt: the caches as before tenants)."""
        if not tenant.owner and cache_salt is None:
            return ""
        message = f"{tenant.owner}\0{cache_salt or ''}".encode()
        return hmac.new(self._machine_secret(), message, hashlib.sha256).hexdigest()[:32]

    def _machine_secret(self) -> bytes:
        """CACHE_DIR/tenant-secret: 32 random bytes made by the first instance that needs them (the disk
        tier, shared by the machine's instances, needs the same namespaces in all of them)."""
        with self._secret_lock:
            if self._secret is None:
                self._secret = _read_or_make_secret(self.settings.cache_dir / SECRET_FILE)
            return self._secret


def _read_or_make_secret(path: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        staging = path.with_name(f".{path.name}-{os.getpid()}-{threading.get_native_id()}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(staging, path)  # the first instance's secret wins; the others read it
        except FileExistsError:
            pass
        finally:
            staging.unlink()
    secret = path.read_bytes()
    if len(secret) < 16:
        raise SettingsError(f"{path} holds no secret: remove it, the next start makes one")
    return secret
