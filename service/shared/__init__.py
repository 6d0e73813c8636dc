"""The shared room: what many machines' instances share of interactive traffic, in the Redis that
JOB_STORE_URL names (SHARED_STATE on) — so any instance continues any conversation with the same bits.
`link` is the connection, looked at before each use and set aside for a few seconds when Redis fails
(each instance then serves from its own state: /ready degraded, qwen3vl_shared_state_usable 0);
`records` keeps one kind of record per tenant, bounded in count and bytes, each with its TTL and its
version (Lua scripts, atomic; a write may be made only over the version it was made from); `pictures`
puts a picture or a clip in few bytes that decode to the very pixels the model saw; `codec` a
conversation (messages, their pictures, the answers' token ids) and its record as bytes; `layered` a
store that reads and writes through the shared records — a change made in one step, never lost to a
concurrent one — and keeps a local copy to serve from while they cannot be reached; `affinity` the key
the proxy routes a conversation by (in the ids the service makes) and the count of requests whose
conversation ran on another instance; `setup` the link from the settings. May import caches, model,
answer, media and the basic top-level modules.
"""
