"""Guessed tokens for exact speculative decoding, without a second model.

A decode step on these CPUs is bound by reading the weights: verifying a few guessed tokens in one
pass (several rows of the same forward) costs about as much as making one. Each running sequence
may bring up to `max_tokens` guesses per step, from:

- its grammar (structured outputs, tool calls): the tokens it forces next (llguidance's
  fast-forward) — keys, quotes, punctuation, the rest of an enum value; always right;
- the checkpoint's multi-token prediction head, where it has one (Qwen3.5's `mtp.*`, MTP_DRAFTING):
  service/engine/mtp_drafts.py makes them for the whole batch at once, how many each sequence asks
  for (`DraftBudget.head_drafts`);
- otherwise the text so far (prompt lookup): the tokens that followed the last place where the
  answer's latest n-gram (3, then 2, then 1 tokens) appeared before, in the prompt or the answer —
  answers that copy (extracting fields, reformatting, correcting an earlier turn) are guessed well.

The scheduler verifies them (service/engine/scheduler.py); `DraftBudget` keeps guessing where it pays:
each sequence's recent acceptance decides how many it guesses, and a run of misses pauses its
head or prompt lookup for a while (doubling each time), so a sequence whose guesses keep failing
costs next to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..answer.structured import Constraint

NGRAMS = (3, 2, 1)  # the n-gram lengths prompt lookup tries, longest first
LOOKBACK = 4096  # tokens of the text so far searched for the n-gram (its most recent occurrence wins)


def prompt_lookup(token_ids: list[int], count: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the text's last n-gram."""
    if count <= 0 or len(token_ids) < 2:
        return []
    window = torch.tensor(token_ids[-LOOKBACK:])
    for n in NGRAMS:
        if len(window) < 2 * n:  # no earlier place for it to have appeared
            continue
        tail = window[-n:]
        hits = (window[:-n].unfold(0, n, 1) == tail).all(-1).nonzero()
        if len(hits):
            at = int(hits[-1]) + n  # the token after the most recent earlier occurrence
            return window[at : at + count].tolist()
    return []


@dataclass
class Guesses:
    """One sequence's guesses for a decode step: `tokens`, from `source` — "grammar" (certain: its
    grammar's or its reasoning budget's forced tokens), "lookup" or "mtp" (the head: `wanted` of them,
    made for the whole batch before the step and put in `tokens`)."""

    tokens: list[int]
    source: str = "grammar"
    wanted: int = 0

    @property
    def certain(self) -> bool:
        return self.source == "grammar"


def forced_tokens(constraint: Constraint | None, count: int) -> list[int]:
    """Up to `count` tokens the grammar allows as the only continuation (none without a grammar)."""
    return constraint.forced()[:count] if constraint is not None and count > 0 else []


@dataclass
class DraftBudget:
    """How many tokens one sequence guesses per step (see the module docstring)."""

    max_tokens: int
    guess: int = 0  # how many prompt lookup guesses next (grows with acceptance, shrinks with misses)
    pause: int = 0  # steps left without prompt lookup
    misses: int = 0  # consecutive lookup steps that accepted nothing
    drafted: int = 0  # tokens guessed (counted for the request's report and /metrics)
    accepted: int = 0  # of them, the ones the model made too

    def __post_init__(self):
        self.guess = min(2, self.max_tokens)

    def drafts(self, token_ids: list[int], constraint: Constraint | None, room: int) -> tuple[list[int], bool]:
        """This step's guesses (at most `room`: what the step and the answer's token limit leave),
        and whether they came from prompt lookup (not certain). No room: nothing is looked up."""
        room = min(room, self.max_tokens)
        if room <= 0:
            return [], False
        forced = forced_tokens(constraint, room)
        if forced:
            return forced, False
        if self.pause > 0:
            self.pause -= 1
            return [], False
        return prompt_lookup(token_ids, min(self.guess, room)), True

    def head_drafts(self, constraint: Constraint | None, room: int) -> tuple[list[int], int]:
        """This step's guesses for a sequence that drafts with the multi-token prediction head: the
        tokens its grammar forces, or how many the head is to guess (at most `room`)."""
        room = min(room, self.max_tokens)
        if room <= 0:
            return [], 0
        forced = forced_tokens(constraint, room)
        if forced:
            return forced, 0
        if self.pause > 0:
            self.pause -= 1
            return [], 0
        return [], min(self.guess, room)

    def record(self, drafted: int, accepted: int, looked_up: bool) -> None:
        """A step's outcome: `looked_up`, the guesses were not certain (prompt lookup, the head)."""
        self.drafted += drafted
        self.accepted += accepted
        if not looked_up or not drafted:
            return
        if accepted == drafted:  # all right: guess more next time
            self.guess, self.misses = min(self.max_tokens, self.guess + 1), 0
        elif accepted == 0:  # all wrong: fewer; after two such steps in a row, pause lookup
            self.guess = max(1, self.guess - 1)
            self.misses += 1
            if self.misses >= 2:
                self.pause = min(64, 2 ** (self.misses - 1))
        else:
            self.guess, self.misses = max(1, accepted), 0
