"""An answer's fingerprint: a digest of what the model computed for it, which any instance on any CPU
kind can recompute by replaying the request (docs/engine.md, "The same answer on every CPU").

`answer_digest` is "ad_" and BLAKE2b-128 over the numerics' identity (the checkpoint's identity and the
settings that change numbers: service/model/identity.py's `numerics_identity`) and, for each generated
token in order, its id (int32) and the float32 log-probability the model gave it (little-endian). Two
answers have the same digest when they are the same tokens with the same logprob bits.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def answer_digest(identity: str, token_ids: Sequence[int], logprobs: Sequence[float]) -> str:
    """The digest of an answer's tokens and their logprobs under `identity` (equal lengths)."""
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(token_ids)} tokens, {len(logprobs)} logprobs")
    digest = hashlib.blake2b(identity.encode(), digest_size=16)
    pairs = [value for pair in zip(token_ids, logprobs) for value in pair]
    digest.update(struct.pack(f"<{'if' * len(token_ids)}", *pairs))
    return "ad_" + digest.hexdigest()
