"""The prompts of Qwen3-VL-Embedding and Qwen3-VL-Reranker, as their official code writes them
(QwenLM/Qwen3-VL-Embedding at 8ce3aab: src/models/qwen3_vl_embedding.py, qwen3_vl_reranker.py and
examples/reranker_template.jinja), and the part of a prompt that many share.

Embedding: the instruction as the system turn (default "Represent the user's input.", a full stop added
when it does not end in punctuation), the input as the user turn — its clips, then its pictures, then
its texts, or "NULL" when empty — and the assistant's turn opened; the vector is the last token's
final-normed hidden state. Reranker: a fixed system turn (judge, answer "yes" or "no"), the user turn
`<Instruct>: {instruction}<Query>:{query}\n<Document>:{document}`, the assistant's turn opened; the
score is sigmoid(logit("yes") − logit("no")) at the last position.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from .prompts import ChatMessage, ImagePart, TextPart, VideoPart, rendered_chat

EMBEDDING_INSTRUCTION = "Represent the user's input."
RERANK_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
RERANK_TOKENS = ("yes", "no")  # the scoring tokens: logit("yes") − logit("no")
_EMPTY = "NULL"  # the official code's text for an input with nothing in it
_HOLE = "\x00item\x00"  # where an item's own content goes, to find the part before it

Part = TextPart | ImagePart | VideoPart


def official_order(parts: list[Part]) -> list[Part]:
    """An input's parts as the official embedder lays them out: clips, then pictures, then texts."""
    return [p for kind in (VideoPart, ImagePart, TextPart) for p in parts if isinstance(p, kind)]


def embedding_instruction(instruction: str | None) -> str:
    """The system turn's text: the instruction stripped and ending in punctuation, or the default."""
    text = (instruction or "").strip()
    if text and not unicodedata.category(text[-1]).startswith("P"):
        text += "."
    return text or EMBEDDING_INSTRUCTION


@dataclass(frozen=True)
class SearchPrompt:
    """One input's (or one pair's) chat messages, and how many parts at the end of its user turn are the
    item's own (the rest — the instruction, a reranker's query — is what inputs share)."""

    messages: list[ChatMessage]
    item_parts: int


def embedding_prompt(parts: list[Part], instruction: str | None) -> SearchPrompt:
    """One input's prompt for an embedding model (`parts` in the order they are to be read)."""
    content = list(parts) or [TextPart(_EMPTY)]
    system = ChatMessage("system", [TextPart(embedding_instruction(instruction))])
    return SearchPrompt([system, ChatMessage("user", content)], len(content))


def rerank_prompt(query: list[Part], document: list[Part], instruction: str | None) -> SearchPrompt:
    """One (query, document) pair's prompt for a reranker."""
    content = list(document) or [TextPart(_EMPTY)]
    user = [
        TextPart("<Instruct>: " + (instruction or RERANK_INSTRUCTION)),
        TextPart("<Query>:"),
        *(query or [TextPart(_EMPTY)]),
        TextPart("\n<Document>:"),
        *content,
    ]
    return SearchPrompt([ChatMessage("system", [TextPart(RERANK_SYSTEM)]), ChatMessage("user", user)], len(content))


def head_ids(processor, prompt: SearchPrompt) -> list[int]:
    """The token ids of the prompt's text before the item's own parts: the instruction's (a reranker's:
    and the query's) part that inputs of one request — and requests with the same instruction — share.
    Pictures before them stay placeholders here: a caller matches these ids against a prompt's own, up
    to the first that differs."""
    *before, user = prompt.messages
    holed = ChatMessage(user.role, [*user.parts[: len(user.parts) - prompt.item_parts], TextPart(_HOLE)])
    text = rendered_chat(processor, [*before, holed])
    return processor.tokenizer(text[: text.index(_HOLE)], add_special_tokens=False)["input_ids"]
