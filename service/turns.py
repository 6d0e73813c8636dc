"""Where a chat prompt may be cut, in tokens: after each earlier turn's assistant header and after
each image.

The prompt of turn k is a token prefix of the prompt of turn k+1, ending with the chat template's
assistant header (`<|im_start|>assistant\\n` for Qwen); a picture ends at its `<|vision_end|>`.
Under INT8 the engine prefills a prompt piece by piece between these cuts and reuses KV caches
only up to one of them (see `Engine`), so the cuts depend on the tokens alone.
"""

from __future__ import annotations

import torch


def assistant_header_ids(processor) -> list[int]:
    """The tokens the chat template appends for `add_generation_prompt=True`."""
    chat = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
    bare = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    full = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if not full.startswith(bare) or full == bare:
        raise ValueError("the chat template's generation prompt is not a suffix of the rendered chat")
    return processor.tokenizer(full[len(bare):], add_special_tokens=False)["input_ids"]


def turn_ends(token_ids: torch.Tensor, header: list[int]) -> list[int]:
    """Positions (< len) right after each occurrence of `header` in 1-D `token_ids`: where the
    prompt of each earlier turn ended."""
    n = len(header)
    header_t = torch.tensor(header, dtype=token_ids.dtype)
    starts = (token_ids[: len(token_ids) - n] == header[0]).nonzero().flatten().tolist()
    return [s + n for s in starts if torch.equal(token_ids[s:s + n], header_t)]


def cut_points(token_ids: torch.Tensor, header: list[int], image_ends: list[int]) -> list[int]:
    """Earlier turns' ends and images' ends, ascending, each leaving at least one token after it."""
    return sorted({*turn_ends(token_ids, header), *(e for e in image_ends if e < len(token_ids))})
