"""Search bodies onto the engine's search requests (service/engine/search.py), and their vectors and
scores into each API's answer — for the routes and for a batch line alike (no Flask here)."""

from __future__ import annotations

import base64
import uuid

import torch

from ...engine.engine import Engine
from ...engine.search import SearchRequest, SearchResult, check_count
from ...errors import BadRequest
from ...limits import RequestLimits
from ...model.prompts import ImagePart, TextPart, VideoPart
from ...model.search_prompts import Part, SearchPrompt, embedding_prompt, official_order, rerank_prompt
from ..context import RequestContext
from ..inputs import checked_text, decode_inline_image, decode_inline_video, to_chat_messages
from ..schemas import ImageURLPart, VideoURLPart
from .protocol import (
    ContentInput,
    Embedding,
    EmbeddingList,
    EmbeddingsRequest,
    EmbeddingsUsage,
    Item,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    SearchInput,
)


def _listed(value) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


class PictureBudget:
    """The pictures and clip frames one search request may decode (SEARCH_MAX_PICTURES), counted together:
    the pictures of a field's items before any is decoded (`pictures`), a clip's frames once its container
    is read and before they are decoded (`clip`) — so a request's decoded pixels stay bounded whatever its
    item count."""

    def __init__(self, limit: int):
        self.limit, self.taken = limit, 0

    def take(self, count: int, param: str) -> None:
        """Count `count` more; a 400 naming `param` past the limit."""
        self.taken += count
        if self.taken > self.limit:
            raise BadRequest(
                f"{self.taken} pictures and clip frames so far; this server decodes at most {self.limit} in one "
                "search request (SEARCH_MAX_PICTURES)",
                param=param,
                code="too_many_pictures",
            )

    def pictures(self, items: list, param: str) -> None:
        """Count the pictures of `items` (official objects, vLLM's content parts, messages) as `param`'s."""
        self.take(sum(_picture_count(item) for item in items), param)

    def clip(self, param: str):
        """What counts the clip at `param`'s sampled frames (media/video.py calls it before decoding them)."""
        return lambda frames: self.take(frames, param)


def _picture_count(item) -> int:
    if isinstance(item, SearchInput):
        return len(_listed(item.image))
    content = getattr(item, "content", None)  # vLLM's {content: [...]} and a message
    return sum(isinstance(part, ImageURLPart) for part in content) if isinstance(content, list) else 0


def item_parts(item: Item, limits: RequestLimits, param: str, budget: PictureBudget) -> tuple[list[Part], str | None]:
    """An item's parts in reading order (pictures and clips decoded, its clips' frames counted against
    `budget` first) and its own instruction, if any; 400 naming `param` for an item with nothing in it."""
    if isinstance(item, str):
        parts: list[Part] = [TextPart(checked_text(item, param))] if item else []
        instruction = None
    elif isinstance(item, SearchInput):
        parts = [TextPart(checked_text(t, f"{param}.text")) for t in _listed(item.text) if t]
        parts += [ImagePart(decode_inline_image(i, limits.image, f"{param}.image")) for i in _listed(item.image)]
        clips = _listed(item.video)
        where = f"{param}.video"
        parts += [VideoPart(decode_inline_video(v, limits.video, where, budget.clip(where))) for v in clips]
        parts, instruction = official_order(parts), item.instruction
    else:
        parts, instruction = _content_parts(item, limits, param, budget), None
    if not parts:
        raise BadRequest(f"{param} is empty: give a text, a picture or a clip", param=param, code="empty_input")
    return parts, instruction


def _content_parts(item: ContentInput, limits: RequestLimits, param: str, budget: PictureBudget) -> list[Part]:
    parts: list[Part] = []
    for j, part in enumerate(item.content):
        where = f"{param}.content[{j}]"
        if isinstance(part, ImageURLPart):
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            parts.append(ImagePart(decode_inline_image(url, limits.image, where)))
        elif isinstance(part, VideoURLPart):
            url = part.video_url if isinstance(part.video_url, str) else part.video_url.url
            parts.append(VideoPart(decode_inline_video(url, limits.video, where, budget.clip(where))))
        elif part.text:
            parts.append(TextPart(checked_text(part.text, where)))
    return parts


def _search_request(kind: str, body, prompts: list[SearchPrompt], context: RequestContext, param: str, **more):
    return SearchRequest(
        kind,
        prompts,
        context.received_at,
        item_param=param,
        priority=body.priority,
        tenant=context.share,
        cache_namespace=context.cache_namespace(body.cache_salt),
        **more,
    )


def embeddings_request(body: EmbeddingsRequest, limits: RequestLimits, context: RequestContext) -> SearchRequest:
    """An embeddings body as the engine's search request: one prompt per input (or one for `messages`)."""
    budget = PictureBudget(limits.max_search_pictures)
    if body.messages is not None:
        budget.pictures(body.messages, "messages")
        prompt = _messages_prompt(body, limits, budget)
        return _search_request("embedding", body, [prompt], context, "messages", dimensions=body.dimensions)
    items = body.input if isinstance(body.input, list) else [body.input]
    if not items:
        raise BadRequest("input must not be empty", param="input", code="empty_input")
    check_count(len(items), limits.max_search_items, "input")  # before any picture is decoded
    budget.pictures(items, "input")
    listed = isinstance(body.input, list)
    prompts = [
        _embedding(item_parts(item, limits, f"input[{i}]" if listed else "input", budget), body)
        for i, item in enumerate(items)
    ]
    return _search_request("embedding", body, prompts, context, "input", dimensions=body.dimensions)


def _messages_prompt(body: EmbeddingsRequest, limits: RequestLimits, budget: PictureBudget) -> SearchPrompt:
    """vLLM's chat-shaped embedding input: [system,] user — the system turn is the instruction."""
    messages = to_chat_messages(body.messages, limits, before_frames=budget.clip)
    roles = [m.role for m in messages]
    if roles not in (["user"], ["system", "user"]):
        raise BadRequest("messages must be a user message, after at most one system message", param="messages")
    parts = messages[-1].parts
    if not any(not isinstance(p, TextPart) or p.text for p in parts):
        raise BadRequest("the user message is empty", param="messages", code="empty_input")
    instruction = messages[0].text if len(messages) == 2 else body.instruction
    return embedding_prompt(parts, instruction)


def embedding_list(body: EmbeddingsRequest, model: str, result: SearchResult) -> dict:
    """OpenAI's list of embeddings: floats, or base64 of their little-endian float32 bytes."""
    data = []
    for i, vector in enumerate(result.vectors):
        if body.encoding_format == "base64":
            encoded = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
            data.append(Embedding(index=i, embedding=encoded))
        else:
            data.append(Embedding(index=i, embedding=vector.tolist()))
    usage = EmbeddingsUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
    return EmbeddingList(data=data, model=model, usage=usage).model_dump(mode="json")


def rerank_request(body: RerankRequest, limits: RequestLimits, context: RequestContext) -> SearchRequest:
    """A rerank body as the engine's search request: one prompt per (query, document) pair."""
    check_count(len(body.documents), limits.max_search_items, "documents")  # before any picture is decoded
    budget = PictureBudget(limits.max_search_pictures)
    budget.pictures([body.query], "query")
    budget.pictures(body.documents, "documents")
    query, _ = item_parts(body.query, limits, "query", budget)
    prompts = []
    for i, document in enumerate(body.documents):
        parts, _ = item_parts(document, limits, f"documents[{i}]", budget)
        prompts.append(rerank_prompt(query, parts, body.instruction))
    return _search_request("rerank", body, prompts, context, "documents")


def _document(item: Item) -> RerankDocument:
    if isinstance(item, str):
        return RerankDocument(text=item)
    if isinstance(item, SearchInput) and not item.image and not item.video:
        return RerankDocument(text=" ".join(_listed(item.text)))
    return RerankDocument(multi_modal=item.model_dump(mode="json", exclude_none=True))


def rerank_response(body: RerankRequest, model: str, result: SearchResult) -> dict:
    """The documents by relevance, best first (the first `top_n`), each with its index and score."""
    order = sorted(range(len(result.scores)), key=lambda i: (-result.scores[i], i))[: body.top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=result.scores[i],
            document=_document(body.documents[i]) if body.return_documents else None,
        )
        for i in order
    ]
    usage = RerankUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
    response = RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results, usage=usage)
    return response.model_dump(mode="json", exclude_none=True)


def _pairs(body: ScoreRequest, limits: RequestLimits) -> tuple[list, list]:
    """vLLM's pairing — one text_1 against each text_2, or pair by pair (lists of one length) — checked
    and counted before anything is decoded; then each item's parts and own instruction, each decoded once."""
    first, second = _listed(body.text_1), _listed(body.text_2)
    if len(first) != 1 and len(first) != len(second):
        raise BadRequest(
            f"text_1 has {len(first)} items and text_2 {len(second)}: give one text_1, or lists of one length",
            param="text_2",
        )
    if not second:
        raise BadRequest("text_2 must not be empty", param="text_2", code="empty_input")
    check_count(len(second), limits.max_search_items, "text_2")
    budget = PictureBudget(limits.max_search_pictures)
    budget.pictures(first, "text_1")
    budget.pictures(second, "text_2")
    return (
        [item_parts(item, limits, f"text_1[{i}]", budget) for i, item in enumerate(first)],
        [item_parts(item, limits, f"text_2[{i}]", budget) for i, item in enumerate(second)],
    )


def score(engine: Engine, body: ScoreRequest, context: RequestContext) -> tuple[dict, int]:
    """vLLM's score response (and the prompt tokens it took): a reranker scores each pair; an embedding
    model gives each pair's cosine similarity (its vectors' dot product, summed in a fixed order) — text_1's
    vectors and text_2's made by a request each, so a 4xx names the field and each is within the item limit."""
    firsts, seconds = _pairs(body, engine.limits)
    if engine.info.task == "embedding":
        results = [
            engine.run_search(_search_request("embedding", body, [_embedding(i, body) for i in items], context, name))
            for name, items in (("text_1", firsts), ("text_2", seconds))
        ]
        ones, twos = (r.vectors for r in results)
        scores = [_cosine(a, b) for a, b in zip(ones * len(twos) if len(ones) == 1 else ones, twos)]
        tokens = sum(r.prompt_tokens for r in results)
    else:
        queries = [parts for parts, _ in firsts]
        pairs = zip(queries * len(seconds) if len(queries) == 1 else queries, seconds)
        prompts = [rerank_prompt(query, document, body.instruction) for query, (document, _) in pairs]
        result = engine.run_search(_search_request("rerank", body, prompts, context, "text_2"))
        scores, tokens = result.scores, result.prompt_tokens
    data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
    usage = RerankUsage(prompt_tokens=tokens, total_tokens=tokens)
    response = ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=engine.info.name, data=data, usage=usage)
    return response.model_dump(mode="json"), tokens


def _embedding(item: tuple[list[Part], str | None], body) -> SearchPrompt:
    """An item's embedding prompt: its parts, under its own instruction or else the body's."""
    parts, own = item
    return embedding_prompt(parts, own if own is not None else body.instruction)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The dot product of two unit vectors, summed one product after another in float64."""
    return float(torch.cumsum(a.double() * b.double(), 0)[-1])
