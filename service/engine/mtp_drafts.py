"""Guesses from the checkpoint's multi-token prediction head (Qwen3.5's `mtp.*`: service/model/mtp.py)
for the exact speculative decoding the scheduler verifies (service/engine/scheduler.py).

Each sequence that drafts with the head carries the head's part of its cache (`DraftCache`): the
model's forward hands it the final hidden state and input embedding of every row it computes, and
`HeadDrafts` turns them into the head's entries — in the prefill after each piece (`settle`: every
prompt position whose next token the piece holds), when the sequence leaves (`settle`, so that a kept
cache carries an entry for every position but the last), and in a decode step (`propose`): the rows
the head has not read yet, up to the last token made, then a chain of guesses — each the argmax of the
head's logits, fed back with the head's own output as the next hidden state, one position further. The
guesses' own entries are taken back at once: the head keeps entries for accepted tokens only, added
at the next step from the model's hidden states of the verified rows. All sequences of a step run in
one call of the head per chain link, each row computed as it would be alone.
"""

from __future__ import annotations

import torch

from ..model.mtp import DraftCache, MTPHead

# Unread rows a sequence that does not guess (its budget paused, a grammar forcing its tokens) may
# gather before the head reads them anyway: reading many at once reads the head's weights once.
MAX_UNREAD = 64


class HeadDrafts:
    """The head's work for the scheduler's steps; see the module docstring."""

    def __init__(self, head: MTPHead):
        self.head = head

    def settle(self, drafts: list[DraftCache]) -> None:
        """Entries for every unread position whose next token's embedding is at hand (all but the last)."""
        reads = [(d, d.pending - 1) for d in drafts if d.pending > 1]
        if not reads:
            return
        taken = [d.take(n) for d, n in reads]
        self.head(*_rows(taken), [d for d, _ in reads], [n for _, n in reads])

    def propose(self, drafts: list[DraftCache], last_tokens: list[int], wanted: list[int]) -> list[list[int]]:
        """For each sequence: `wanted[i]` guesses after its last token made (`last_tokens[i]`, not fed to
        the model yet), its unread rows read first — also, without guessing, for one that has gathered
        MAX_UNREAD of them."""
        guesses: list[list[int]] = [[] for _ in drafts]
        reading = [i for i, d in enumerate(drafts) if d.pending and (wanted[i] > 0 or d.pending >= MAX_UNREAD)]
        if not reading:
            return guesses
        taken, counts = [], []
        for i in reading:
            hidden, embedded, positions = drafts[i].take(drafts[i].pending)
            last = self.head.embed(torch.tensor([last_tokens[i]]))
            taken.append((hidden, torch.cat([embedded, last]), positions))
            counts.append(len(hidden))
        out = self.head(*_rows(taken), [drafts[i] for i in reading], counts)
        ends = torch.tensor(counts).cumsum(0) - 1
        chain = [(i, out[int(end)], taken[k][2][:, -1:]) for k, (i, end) in enumerate(zip(reading, ends))]
        chain = [link for link in chain if wanted[link[0]] > 0]
        lengths = {i: drafts[i].entries for i, _, _ in chain}  # the entries of made tokens: kept
        while chain:
            tokens = self.head.logits(torch.stack([h for _, h, _ in chain])).argmax(-1).tolist()
            for (i, _, _), token in zip(chain, tokens):
                guesses[i].append(token)
            chain = [link for link in chain if len(guesses[link[0]]) < wanted[link[0]]]
            if not chain:
                break
            hidden = torch.stack([h for _, h, _ in chain])
            embedded = self.head.embed(torch.tensor([guesses[i][-1] for i, _, _ in chain]))
            positions = torch.cat([p + 1 for _, _, p in chain], 1)
            out = self.head(hidden, embedded, positions, [drafts[i] for i, _, _ in chain], [1] * len(chain))
            chain = [(i, row, p + 1) for (i, _, p), row in zip(chain, out)]
        for i, entries in lengths.items():  # the guesses' own entries go: they were never made
            drafts[i].layer.crop(entries - drafts[i].entries)
        return guesses


def _rows(taken: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """The sequences' rows side by side: hidden states, embeddings, positions (3 × rows)."""
    return (
        torch.cat([h for h, _, _ in taken]),
        torch.cat([e for _, e, _ in taken]),
        torch.cat([p for _, _, p in taken], 1),
    )
