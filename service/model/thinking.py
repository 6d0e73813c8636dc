"""Thinking checkpoints, recognised from their chat template and tokenizer (never configured).

A Thinking checkpoint (Qwen3-VL-2B-Thinking, …) writes its reasoning first and closes it with
`</think>`, then the answer. Its chat template opens the assistant turn with `<think>\\n` (so the
model's first token is already reasoning) and drops earlier turns' reasoning when it renders a
history. A hybrid template (Qwen3's) reacts to `enable_thinking`: false renders an empty, closed
block; true leaves the model to open `<think>` itself. Instruct checkpoints share the vocabulary
(their tokenizers hold `<think>` and `</think>` too): what makes a model a thinking one is a
template that opens the block or reacts to the switch, with both tags single tokens.

Each request's rendered prompt says how its answer starts (`opening`): inside the reasoning, free
to open it, or straight at the answer (the template closed the block: thinking switched off).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
SEPARATOR = "\n\n"  # what the templates put between `</think>` and the answer
ASSISTANT_HEADER = "<|im_start|>assistant"
SWITCH = "enable_thinking"  # the Qwen3 templates' variable: false renders an empty, closed block


class Opening(enum.Enum):
    """How a prompt leaves the answer to start."""

    REASONING = "reasoning"  # the template opened <think>: the first token is reasoning
    MAY_REASON = "may_reason"  # the model may open <think> itself (a hybrid template, switch on)
    ANSWER = "answer"  # the template closed the block (thinking off): no reasoning


@dataclass(frozen=True)
class ThinkingTokens:
    """What the service needs of a thinking checkpoint: its tags' ids, the separator's ids, and
    whether its template takes `enable_thinking`."""

    open_id: int
    close_id: int
    separator_ids: tuple[int, ...]
    has_switch: bool  # the template renders otherwise with enable_thinking false

    def opening(self, prompt_text: str) -> Opening:
        """How this rendered prompt's answer starts (what follows its last assistant header)."""
        tail = prompt_text.rpartition(ASSISTANT_HEADER)[2]
        if CLOSE_TAG in tail:
            return Opening.ANSWER
        return Opening.REASONING if OPEN_TAG in tail else Opening.MAY_REASON


def template_variables(template: str) -> set[str]:
    """The variables a Jinja chat template reads from its caller."""
    from jinja2 import Environment, meta

    return meta.find_undeclared_variables(Environment().parse(template))


def detect_thinking(processor) -> ThinkingTokens | None:
    """The checkpoint's ThinkingTokens if it is a thinking one (see the module docstring), else None."""
    tokenizer = processor.tokenizer
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN_TAG, CLOSE_TAG)]
    if any(len(i) != 1 for i in ids):
        return None
    probe = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]

    def render(**kwargs) -> str:
        text = processor.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, **kwargs)
        return text.rpartition(ASSISTANT_HEADER)[2]

    default = render()
    has_switch = SWITCH in template_variables(processor.chat_template) and render(**{SWITCH: False}) != default
    if OPEN_TAG not in default and not has_switch:
        return None
    separator = tuple(tokenizer.encode(SEPARATOR, add_special_tokens=False))
    return ThinkingTokens(ids[0][0], ids[1][0], separator, has_switch)
