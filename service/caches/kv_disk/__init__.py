"""The conversation cache's disk tier: the keys and values of every kept conversation, in files under
KV_DISK_DIR that outlive evictions, restarts and crashes, shared by the instances of a machine.

Content-addressed blocks (`names`). A conversation's keys and values are cut into blocks of BLOCK_TOKENS
tokens (and a shorter tail at its end); a block's file is named by a hash chained over everything
its keys and values depend on — the store's fingerprint (checkpoint, quantization, vision encoder,
KV layout), every token before and in it, and the picture (pixels and grid) behind each image or
video that starts there, the M-RoPE positions of its tokens — and the request's cache namespace (its
tenant and cache_salt, an opaque keyed hash: service/api/access/tenants.py), which seeds the chain: one tenant's
lookups never find another's files, and a file name holds a tenant only as a hash keyed with that hash
(a header not at all). The name alone finds a prefix: a lookup hashes the prompt block by block and
stats names until one is missing, so there is no index to rebuild or to keep consistent between
instances, a prefix shared by conversations (a system prompt, a picture) is stored once, and a second
turn writes only its new blocks. Keys and values are the same bits whichever path computed them
(service/model/forward.py), so a block written by any instance serves any other.

A file is written whole or not at all (temporary file, then rename) and read only after its header
shows everything its name stands for as the request needs it (format version, fingerprint, KV layout,
the chain key before it, its tokens, their positions, its pictures and clips) and a CRC-32 of all its
bytes checks out: a foreign, truncated, corrupted or misplaced file is removed and counted, never
used (`block_format`). Only regular files are opened (`block_files`). Writes run on a writer thread of
low priority (`writer`), reads on a few reader threads with a deadline (`readers`), never on the
scheduler's; the budget (KV_DISK_MB) is kept by removing the least recently used files (a hit
refreshes a file's time), under a lock file so that two instances do not both evict (`sweep`). A
folder that cannot be written (not a folder, read-only, not ours, out of inodes) turns the tier off,
at the start or when a write meets it. A hybrid model's (Qwen3.5) recurrent states are kept beside its
blocks, named by the same chain (`states`); a multi-token prediction head's keys and values ride in the
blocks as one more layer, its hidden state in each state file (service/model/mtp.py).
`store.KVDiskStore` puts these together: the tier's one interface, imported from here.
"""

from .block_format import MAGIC, KVLayout
from .names import BLOCK_TOKENS
from .store import KVDiskStore
from .sweep import default_budget_bytes, held_bytes

__all__ = ["BLOCK_TOKENS", "MAGIC", "KVDiskStore", "KVLayout", "default_budget_bytes", "held_bytes"]
