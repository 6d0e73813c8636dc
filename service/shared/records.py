"""One kind of record in the shared store, per tenant: bounded in count and bytes (the least recently
used go first), each record kept `ttl` seconds after it was last written or read. Every change is one
Lua script, so instances on many machines never see a record half-changed nor the bounds overrun.

Keys, under `qwen3vl:s:<kind>:<owner>` (owner "-" without API keys): `:r:<id>` the record (with its
TTL), `:used` (ids by last use, Redis's clock in microseconds: the least recently used and the expired
are found there), `:sizes` (id → bytes) and `:bytes` (their sum). One Redis, not Redis Cluster: a
script touches any of a tenant's keys.
"""

from __future__ import annotations

from .link import SharedLink

# Forget the index entries of records that expired; make room; write. KEYS: used, sizes, bytes.
# ARGV: prefix of record keys, id, blob, ttl, max count, max bytes. Returns the evictions, or -1.
_PUT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local prefix, id, blob = ARGV[1], ARGV[2], ARGV[3]
local ttl, max_count, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local function forget(victim)
  local size = tonumber(redis.call('HGET', KEYS[2], victim) or '0')
  redis.call('DECRBY', KEYS[3], size)
  redis.call('HDEL', KEYS[2], victim)
  redis.call('ZREM', KEYS[1], victim)
  redis.call('DEL', prefix .. victim)
end
for _, victim in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl)) do forget(victim) end
if redis.call('HEXISTS', KEYS[2], id) == 1 then forget(id) end
if #blob > max_bytes then return -1 end
redis.call('SET', prefix .. id, blob, 'EX', ttl)
redis.call('ZADD', KEYS[1], now, id)
redis.call('HSET', KEYS[2], id, #blob)
local total = redis.call('INCRBY', KEYS[3], #blob)
local evicted = 0
while redis.call('ZCARD', KEYS[1]) > max_count or total > max_bytes do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  forget(oldest)
  evicted = evicted + 1
  total = tonumber(redis.call('GET', KEYS[3]))
end
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl) end
return evicted
"""

# The record (its TTL and its place in the LRU renewed), or nil. KEYS: used, sizes, bytes. ARGV: prefix, id, ttl.
_GET = """
local blob = redis.call('GET', ARGV[1] .. ARGV[2])
if not blob then
  if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
    redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[2], ARGV[2])))
    redis.call('HDEL', KEYS[2], ARGV[2])
    redis.call('ZREM', KEYS[1], ARGV[2])
  end
  return false
end
redis.call('EXPIRE', ARGV[1] .. ARGV[2], tonumber(ARGV[3]))
local clock = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(clock[1]) + tonumber(clock[2]) / 1e6, ARGV[2])
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, tonumber(ARGV[3])) end
return blob
"""

# 1 if the record was there (and is gone), else 0. KEYS: used, sizes, bytes. ARGV: prefix, id.
_DELETE = """
local existed = redis.call('DEL', ARGV[1] .. ARGV[2])
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[2], ARGV[2])))
  redis.call('HDEL', KEYS[2], ARGV[2])
end
redis.call('ZREM', KEYS[1], ARGV[2])
return existed
"""


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
        return [f"{base}:used", f"{base}:sizes", f"{base}:bytes"], f"{base}:r:"

    def put(self, owner: str, record_id: str, blob: bytes) -> bool:
        """Write (replacing it); False if it alone is larger than the bytes a tenant may keep."""
        keys, prefix = self._keys(owner)
        args = [prefix, record_id, blob, self.ttl, self.max_count, self.max_bytes]
        return self.link.run(lambda r: self._put(keys=keys, args=args, client=r)) >= 0

    def get(self, owner: str, record_id: str) -> bytes | None:
        keys, prefix = self._keys(owner)
        return self.link.run(lambda r: self._get(keys=keys, args=[prefix, record_id, self.ttl], client=r))

    def delete(self, owner: str, record_id: str) -> bool:
        keys, prefix = self._keys(owner)
        return bool(self.link.run(lambda r: self._delete(keys=keys, args=[prefix, record_id], client=r)))

    def count(self, owner: str) -> int:
        keys, _ = self._keys(owner)
        return self.link.run(lambda r: r.zcard(keys[0]))
