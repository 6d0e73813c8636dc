"""One kind of record in the shared store, per tenant: bounded in count and bytes (the least recently
used go first), each record kept `ttl` seconds after it was last written or read, each write given a new
version. Every change is one Lua script, so instances on many machines never see a record half-changed
nor the bounds overrun; a write may name the version it was made from (`based_on`) and is then made only
if the store still holds that one — how a change is never lost to another instance's (layered.py).

Keys, under `qwen3vl:s:<kind>:<owner>` (owner "-" without API keys): `:r:<id>` the record (with its
TTL), `:used` (ids by last use, Redis's clock in microseconds: the least recently used and the expired
are found there), `:sizes` (id → bytes) and `:bytes` (their sum), `:versions` (id → its version) and
`:clock` (the tenant's last version given: versions never repeat while any of its records lives). One
Redis, not Redis Cluster: a script touches any of a tenant's keys.
"""

from __future__ import annotations

from .link import SharedLink

ABSENT = 0  # `based_on` for a record the store must not hold (versions start at 1)

# Forget the index entries of records that expired; check the version written over; make room; write.
# KEYS: used, sizes, bytes, versions, clock. ARGV: prefix of record keys, id, blob, ttl, max count, max
# bytes, based on ("" any; else the version the store must hold, "0" none). Returns the new version, 0 if
# the blob alone is over max bytes, -1 if the store holds another version than `based on`.
_PUT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local prefix, id, blob = ARGV[1], ARGV[2], ARGV[3]
local ttl, max_count, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local function forget(victim)
  local size = tonumber(redis.call('HGET', KEYS[2], victim) or '0')
  redis.call('DECRBY', KEYS[3], size)
  redis.call('HDEL', KEYS[2], victim)
  redis.call('HDEL', KEYS[4], victim)
  redis.call('ZREM', KEYS[1], victim)
  redis.call('DEL', prefix .. victim)
end
for _, victim in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl)) do forget(victim) end
if ARGV[7] ~= '' then
  local held = '0'
  if redis.call('EXISTS', prefix .. id) == 1 then held = redis.call('HGET', KEYS[4], id) or '0' end
  if held ~= ARGV[7] then return -1 end
end
if redis.call('HEXISTS', KEYS[2], id) == 1 then forget(id) end
if #blob > max_bytes then return 0 end
redis.call('SET', prefix .. id, blob, 'EX', ttl)
local version = redis.call('INCR', KEYS[5])
redis.call('HSET', KEYS[4], id, version)
redis.call('ZADD', KEYS[1], now, id)
redis.call('HSET', KEYS[2], id, #blob)
local total = redis.call('INCRBY', KEYS[3], #blob)
while redis.call('ZCARD', KEYS[1]) > max_count or total > max_bytes do
  forget(redis.call('ZRANGE', KEYS[1], 0, 0)[1])
  total = tonumber(redis.call('GET', KEYS[3]))
end
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl) end
return version
"""

# The record and its version (its TTL and its place in the LRU renewed; a record written before versions
# given one), or nil. KEYS: used, sizes, bytes, versions, clock. ARGV: prefix, id, ttl.
_GET = """
local blob = redis.call('GET', ARGV[1] .. ARGV[2])
if not blob then
  if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
    redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[2], ARGV[2])))
    redis.call('HDEL', KEYS[2], ARGV[2])
    redis.call('HDEL', KEYS[4], ARGV[2])
    redis.call('ZREM', KEYS[1], ARGV[2])
  end
  return false
end
local version = redis.call('HGET', KEYS[4], ARGV[2])
if not version then
  version = redis.call('INCR', KEYS[5])
  redis.call('HSET', KEYS[4], ARGV[2], version)
end
redis.call('EXPIRE', ARGV[1] .. ARGV[2], tonumber(ARGV[3]))
local clock = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(clock[1]) + tonumber(clock[2]) / 1e6, ARGV[2])
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, tonumber(ARGV[3])) end
return {blob, tonumber(version)}
"""

# 1 if the record was there (and is gone), else 0. KEYS: used, sizes, bytes, versions, clock. ARGV: prefix, id.
_DELETE = """
local existed = redis.call('DEL', ARGV[1] .. ARGV[2])
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[2], ARGV[2])))
  redis.call('HDEL', KEYS[2], ARGV[2])
end
redis.call('HDEL', KEYS[4], ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[2])
return existed
"""


class VersionConflict(Exception):
    """The shared store holds another version of the record (or none) than the write was made from."""


class SharedRecords:
    """The records of one `kind` ("history", "responses", "conversations"), `max_count` and `max_bytes`
    per tenant, each kept `ttl` seconds after its last use. Raises SharedUnavailable (link.py)."""

    def __init__(self, link: SharedLink, kind: str, max_count: int, max_bytes: int, ttl: float):
        self.link, self.kind = link, kind
        self.max_count, self.max_bytes, self.ttl = max_count, max_bytes, max(1, round(ttl))
        client = link.client
        self._put, self._get, self._delete = (client.register_script(s) for s in (_PUT, _GET, _DELETE))

    def _keys(self, owner: str) -> tuple[list[str], str]:
        base = f"qwen3vl:s:{self.kind}:{owner or '-'}"
        return [f"{base}:{name}" for name in ("used", "sizes", "bytes", "versions", "clock")], f"{base}:r:"

    def put(self, owner: str, record_id: str, blob: bytes, based_on: int | None = None) -> int:
        """Write (replacing it) and return its new version; 0 (nothing kept) if it alone is larger than the
        bytes a tenant may keep. With `based_on`, only if the store holds that version of the record
        (ABSENT: none): else VersionConflict, and nothing is written."""
        keys, prefix = self._keys(owner)
        expected = "" if based_on is None else str(based_on)
        args = [prefix, record_id, blob, self.ttl, self.max_count, self.max_bytes, expected]
        version = self.link.run(lambda r: self._put(keys=keys, args=args, client=r))
        if version < 0:
            raise VersionConflict(f"{self.kind} record {record_id} is not at version {based_on} in the store")
        return version

    def read(self, owner: str, record_id: str) -> tuple[bytes, int] | None:
        """The record and its version, or None."""
        keys, prefix = self._keys(owner)
        found = self.link.run(lambda r: self._get(keys=keys, args=[prefix, record_id, self.ttl], client=r))
        return (found[0], int(found[1])) if found else None

    def get(self, owner: str, record_id: str) -> bytes | None:
        found = self.read(owner, record_id)
        return found[0] if found else None

    def delete(self, owner: str, record_id: str) -> bool:
        keys, prefix = self._keys(owner)
        return bool(self.link.run(lambda r: self._delete(keys=keys, args=[prefix, record_id], client=r)))

    def count(self, owner: str) -> int:
        keys, _ = self._keys(owner)
        return self.link.run(lambda r: r.zcard(keys[0]))
