"""The caches room: what spares recomputation, above the model's own KV storage — `conversation`
(finished generations' KV caches, matched by token prefix), `kv_disk` (its disk tier, a package:
every kept conversation's keys and values in content-addressed blocks shared by the machine's
instances — `names` the blocks' chained names, `block_format` a block file and its checks,
`block_files` what may stand under a block's name, `readers` reads with a deadline, `writer` the
writer thread, `sweep` the budget's eviction, `states` a hybrid model's recurrent states beside the blocks, `store`
the `KVDiskStore` over them), `tiers` (the
two as one lookup), `vision_features` (encoder outputs per picture), `prefixes` (shared prompt heads of embedding
and rerank requests), `lru` (the byte-budgeted LRU
under both), `setup` (the caches built from the settings and the memory budget). May import model,
answer, vision, quant, media, native and the basic top-level modules.
"""
