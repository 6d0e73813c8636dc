"""Translation out: the `GenerationRequest` every API's serving module builds — its messages, sampling
and answer shape, as its context's tenant sends it — with the one check of a request's token limit
against the server's cap."""

from __future__ import annotations

from ..errors import BadRequest
from ..generation import GenerationRequest, SamplingParams
from ..limits import RequestLimits
from ..model.prompts import ChatMessage
from .answer_shapes import AnswerShape
from .context import RequestContext


def checked_max_tokens(value: int | None, limits: RequestLimits, param: str) -> None:
    """A request's token limit must be within the server's cap (MAX_NEW_TOKENS): else a 400 naming the cap,
    as OpenAI answers a max_tokens beyond the model's. (The engine clips to the cap, for its other callers.)"""
    if value is not None and value > limits.max_new_tokens:
        raise BadRequest(
            f"{param} is {value}; this server generates at most {limits.max_new_tokens} tokens (MAX_NEW_TOKENS)",
            param=param,
            code="max_tokens_too_large",
        )


def generation_request(
    context: RequestContext,
    messages: list[ChatMessage],
    params: SamplingParams,
    limits: RequestLimits,
    *,
    shape: AnswerShape,
    max_tokens_param: str = "max_tokens",
    conversation_id: str | None = None,
    remembered: int = 0,
    cache_salt: str | None = None,
    speculative: bool | None = None,
    enable_thinking: bool = True,
    max_thinking_tokens: int | None = None,
    priority: int = 0,
) -> GenerationRequest:
    """The engine's request: `params.max_tokens` within the server's cap (the body's field, named in
    the 400, is `max_tokens_param`), with the context's id, arrival and fair share, and its cache
    namespace narrowed by `cache_salt`."""
    checked_max_tokens(params.max_tokens, limits, max_tokens_param)
    return GenerationRequest(
        messages=messages,
        params=params,
        received_at=context.received_at,
        request_id=context.request_id,
        conversation_id=conversation_id,
        remembered=remembered,
        grammar=shape.grammar,
        tools=shape.prompt_tools,
        speculative=speculative is not False,
        enable_thinking=enable_thinking,
        max_thinking_tokens=max_thinking_tokens,
        priority=priority,
        tenant=context.share,
        cache_namespace=context.cache_namespace(cache_salt),
    )
