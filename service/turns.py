"""Where the turns of a chat prompt end, in tokens: the positions right after each assistant header.

The prompt of turn k is a token prefix of the prompt of turn k+1, ending with the chat template's
assistant header (`<|im_start|>assistant\\n` for Qwen). Those ends are where INT8 prefill is cut
and where INT8 KV reuse may stop (see `Engine`).
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
