"""The caches room: what spares recomputation — `conversation` (finished generations' KV caches,
matched by token prefix), `kv_disk` (its disk tier: every kept conversation's keys and values in
content-addressed blocks shared by the machine's instances), `tiers` (the two as one lookup),
`vision_features` (encoder outputs per picture), `kv` (KV storage that grows in place), `lru` (the
byte-budgeted LRU under both). May import vision, native and the basic top-level modules.
"""
