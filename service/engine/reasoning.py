"""One sequence's reasoning, token by token, on a thinking checkpoint (service/model/thinking.py).

The answer of a thinking model is reasoning, `</think>`, the template's separator, then the answer.
`ReasoningPhase` follows the tokens the scheduler chooses and says, before each, whether a token is
forced and whether a grammar applies:

- while reasoning, tokens are free (a grammar waits for the answer); each counts against the
  thinking budget, and when it is spent the service closes the reasoning itself: `</think>` and the
  separator are forced, as llama.cpp and vLLM do;
- after a `</think>` the model wrote, the separator is forced too, so the answer (and its grammar)
  starts at the same place whichever way the reasoning ended;
- a model that may open `<think>` itself (a hybrid template) is reasoning if its first token is
  `<think>`, answering otherwise.

A forced token is still chosen by the sampler (every other token masked off), so logprobs and a
seeded generator's draws go on as for any token, and speculation verifies forced tokens like a
grammar's. Nothing here depends on the batch or the caches: the same tokens give the same phases.
"""

from __future__ import annotations

import torch

from ..model.thinking import Opening, ThinkingTokens


class ReasoningPhase:
    """Where one sequence's answer is: reasoning, closing (forced tokens pending), or the answer.
    The scheduler calls `advance` for every token it chooses; the request's thread reads
    `furniture` and `answer_start` (set before the token is streamed) to split the text."""

    def __init__(self, tokens: ThinkingTokens, opening: Opening, budget: int | None):
        self.tokens = tokens
        self.budget = budget  # reasoning tokens before the service closes the block (None: no limit)
        self.reasoning = opening is Opening.REASONING
        self.undecided = opening is Opening.MAY_REASON  # the first token decides
        self.thought = 0  # reasoning tokens so far, the tags and separator apart
        self.spent = 0  # every token before the answer (the tags and separator included)
        self.forced: list[int] = []  # the next tokens, forced: `</think>`, then the separator
        self.furniture: set[int] = set()  # answer positions of the tags and the separator
        self.answer_start: int | None = None if self.reasoning or self.undecided else 0
        self._close_if_spent()

    @property
    def answering(self) -> bool:
        """The next token belongs to the answer (its grammar applies)."""
        return self.answer_start is not None

    def allowed(self, vocab_size: int, grammar_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask for the next token: the forced one only, none while reasoning, the grammar's
        for the answer (with `<think>` allowed too while the model may still open it)."""
        if self.forced:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[self.forced[0]] = True
            return mask
        if self.undecided and grammar_mask is not None:
            grammar_mask = grammar_mask.clone()
            grammar_mask[self.tokens.open_id] = True
            return grammar_mask
        return grammar_mask if self.answering else None

    def advance(self, token: int, position: int) -> bool:
        """Record the token chosen at answer `position` (0-based); True if it is part of the answer."""
        if self.answering:
            return True
        if self.undecided:
            self.undecided = False
            if token != self.tokens.open_id:
                self.answer_start = position
                return True
            self.reasoning = True
            self.furniture.add(position)
        elif self.forced or token == self.tokens.close_id:
            self.forced = self.forced[1:]
            self.furniture.add(position)
            if token == self.tokens.close_id:
                self.reasoning = False
                self.forced = list(self.tokens.separator_ids)
        else:
            self.thought += 1
        self.spent += 1
        self._close_if_spent()
        if not self.reasoning and not self.forced:
            self.answer_start = position + 1
        return False

    def _close_if_spent(self) -> None:
        if self.reasoning and not self.forced and self.budget is not None and self.thought >= self.budget:
            self.forced = [self.tokens.close_id]
