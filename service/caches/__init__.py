"""The caches room: what spares recomputation, above the model's own KV storage — `conversation`
(finished generations' KV caches, matched by token prefix), `kv_disk` (its disk tier: every kept
conversation's keys and values in content-addressed blocks shared by the machine's instances;
`block_files`: what may stand under a block's name; `readers`: its reads with a deadline),
`tiers` (the two as one lookup), `vision_features` (encoder outputs per picture), `lru` (the
byte-budgeted LRU under both), `setup` (the caches built from the settings and the memory budget).
May import model, answer, vision, native and the basic top-level modules.
"""
