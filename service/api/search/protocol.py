"""Search requests and answers, typed: OpenAI's embeddings (with the official Qwen3-VL-Embedding input
objects and vLLM's `messages` form), the Cohere/Jina rerank as vLLM serves it, vLLM's score."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints, model_validator

from ...generation import Priority
from ..schemas import MAX_TEXT, ContentPart, Lenient, Message

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
Media = Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]


class SearchInput(Lenient):
    """The official code's input (Qwen3VLEmbedder.process, Qwen3VLReranker.process): texts, pictures and
    clips (data: URLs or bare base64: this server fetches nothing), read clips first, then pictures, then
    texts; `instruction` for this input alone (embeddings)."""

    text: Text | list[Text] | None = None
    image: Media | list[Media] | None = None
    video: Media | list[Media] | None = None
    instruction: Text | None = None


class ContentInput(Lenient):
    """vLLM's multimodal item: OpenAI content parts in the order they are to be read."""

    content: list[ContentPart] = Field(min_length=1)


Item = Text | SearchInput | ContentInput


class Cached(Lenient):
    priority: Priority = 0
    cache_salt: Annotated[str, StringConstraints(max_length=256)] | None = Field(
        None, description="narrows the request's cache namespace (shared heads, pictures) beyond its tenant's"
    )
    model: str | None = Field(None, description="ignored: the loaded model answers")
    instruction: Text | None = Field(
        None, description="the task's instruction for every item (embedding default: \"Represent the user's input.\")"
    )


class EmbeddingsRequest(Cached):
    """`input`: a string, a list of strings, an official input object or a list of them (and of vLLM's
    {content: [...]}); or vLLM's `messages` (one vector for that conversation: a system turn, the
    instruction, then one user turn)."""

    input: Item | list[Item] | None = None
    messages: list[Message] | None = Field(None, min_length=1, max_length=2)
    dimensions: int | None = Field(None, description="the vector's leading values kept (Matryoshka), re-normalised")
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    @model_validator(mode="after")
    def _one_form(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("give either input or messages")
        return self


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32 values")


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage


class RerankRequest(Cached):
    """The Cohere/Jina rerank as vLLM and llama.cpp serve it; items as in embeddings (pictures too)."""

    query: Item
    documents: list[Item] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1, description="the best this many (default: all)")
    return_documents: bool = True


class RerankDocument(BaseModel):
    text: str | None = None
    multi_modal: dict | None = Field(None, description="an item with pictures or clips, as it was sent")


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreRequest(Cached):
    """vLLM's score: `text_1` against each of `text_2` (or pair by pair when both are lists of one length).
    A reranker scores each pair; an embedding model gives the cosine similarity of their vectors."""

    text_1: Item | list[Item]
    text_2: Item | list[Item]


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    model: str
    data: list[ScoreData]
    usage: RerankUsage
