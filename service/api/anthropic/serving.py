"""Anthropic's Messages API onto the one engine path: its request as the engine's GenerationRequest,
the engine's events as its message or its stream of typed events (streaming.StreamEncoder)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

from ...answer.tools import ToolCall, ToolCallDelta, ToolCallParser
from ...errors import BadRequest, ServiceError
from ...generation import Completion, GenerationRequest, SamplingParams, TextDelta
from ...limits import RequestLimits
from ...model.prompts import ChatMessage, ImagePart, TextPart
from ..answer_shapes import AnswerShape, answer_shape
from ..context import RequestContext
from ..engine_requests import generation_request
from ..error_shapes import anthropic_error
from ..inputs import checked_text, decode_base64_image, decode_data_url
from ..schemas import (
    REASONING_EFFORT,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)
from ..streaming import sse
from . import protocol as ap


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _image(block: ap.ImageBlock, limits: RequestLimits, param: str) -> ImagePart:
    source = block.source
    if isinstance(source, ap.URLSource):  # a data: URL decodes; a remote one is refused with the reason
        return ImagePart(decode_data_url(source.url, limits.image, param))
    if not source.media_type.lower().startswith("image/"):
        raise BadRequest(f"media_type {source.media_type!r} is not an image", param=f"{param}.source.media_type")
    return ImagePart(decode_base64_image(source.data, limits.image, param))


def _user_messages(content: list, limits: RequestLimits, param: str) -> list[ChatMessage]:
    """A user turn's blocks: each tool result as a tool message (first, as they answer the turn
    before), then the text and pictures as one user message."""
    results, parts = [], []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        if isinstance(block, ap.ToolResultBlock):
            text = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content or ())
            results.append(ChatMessage("tool", [TextPart(checked_text(text, where))]))
        elif isinstance(block, ap.TextBlock):
            parts.append(TextPart(checked_text(block.text, where)))
        elif isinstance(block, ap.ImageBlock):
            parts.append(_image(block, limits, where))
        else:
            raise BadRequest(f"a user message may not hold a {block.type} block", param=where)
    return results + ([ChatMessage("user", parts)] if parts else [])


def _assistant_message(content: list, param: str) -> ChatMessage:
    texts, calls, reasoning = [], [], None
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        if isinstance(block, ap.TextBlock):
            texts.append(checked_text(block.text, where))
        elif isinstance(block, ap.ToolUseBlock):
            arguments = checked_text(json.dumps(block.input, ensure_ascii=False), f"{where}.input")
            calls.append(ToolCall(block.name, arguments, block.id))
        elif isinstance(block, ap.ThinkingBlock):
            reasoning = checked_text(block.thinking, where)
        else:
            raise BadRequest(f"an assistant message may not hold a {block.type} block", param=where)
    return ChatMessage("assistant", [TextPart("".join(texts))], tool_calls=tuple(calls), reasoning=reasoning)


def chat_messages(body: ap.CountTokensRequest, limits: RequestLimits) -> list[ChatMessage]:
    """The system prompt and the messages as the engine's ChatMessages (pictures decoded)."""
    out = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        out.append(ChatMessage("system", [TextPart(checked_text(system, "system"))]))
    for i, m in enumerate(body.messages):
        param = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append(ChatMessage(m.role, [TextPart(checked_text(m.content, f"{param}.content"))]))
        elif m.role == "user":
            out.extend(_user_messages(m.content, limits, param))
        else:
            out.append(_assistant_message(m.content, param))
    return out


def _shape(body: ap.CountTokensRequest, form: str) -> AnswerShape:
    """Anthropic's tools and tool_choice as the service's answer shape (the grammar, the prompt's tools)."""
    tools = [
        Tool(
            type="function",
            function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema),
        )
        for t in body.tools or ()
    ]
    choice = body.tool_choice or ap.ToolChoice(type="auto")
    if choice.type == "tool" and choice.name is None:
        raise BadRequest("tool_choice of type tool needs the tool's name", param="tool_choice.name")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or NamedToolChoice(
        type="function", function=NamedFunction(name=choice.name)
    )
    output = body.output_config.format if body.output_config else None
    if output is not None and body.output_format is not None:
        raise BadRequest("send output_config.format or output_format (its beta form), not both", param="output_format")
    output = output or body.output_format
    response_format = None
    if output is not None:  # Anthropic's structured outputs close every object, as OpenAI's strict mode does
        response_format = ResponseFormat(
            type="json_schema", json_schema=JSONSchemaFormat(schema=output.schema_, strict=True)
        )
    return answer_shape(response_format, tools or None, mapped, not choice.disable_parallel_tool_use, form)


def _thinking(body: ap.CountTokensRequest) -> dict:
    if body.thinking is not None and body.thinking.type == "disabled":
        return {"enable_thinking": False}
    if body.thinking is not None and body.thinking.type == "enabled":
        return {"max_thinking_tokens": body.thinking.budget_tokens}
    effort = body.output_config.effort if body.output_config else None
    return {"max_thinking_tokens": REASONING_EFFORT.get(effort)}  # high and max: no budget but max_tokens


def messages_request(
    body: ap.CountTokensRequest, limits: RequestLimits, context: RequestContext
) -> tuple[GenerationRequest, AnswerShape]:
    """The engine's request for a Messages body (a count_tokens body: the same prompt, nothing to sample)."""
    shape = _shape(body, limits.tool_form)
    params = SamplingParams()
    if isinstance(body, ap.MessagesRequest):
        thinking = body.thinking
        if isinstance(thinking, ap.ThinkingEnabled) and body.max_tokens <= thinking.budget_tokens:
            raise BadRequest(
                f"max_tokens ({body.max_tokens}) must be greater than thinking.budget_tokens "
                f"({thinking.budget_tokens}): the reasoning and the answer share it",
                param="max_tokens",
            )
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences or [],
        )
    request = generation_request(context, chat_messages(body, limits), params, limits, shape=shape, **_thinking(body))
    return request, shape


def _stop_reason(done: Completion, calls: list) -> str:
    if done.finish_reason in ("length", "deadline"):
        return "max_tokens"
    if done.stop_string is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def _usage(done: Completion) -> ap.MessagesUsage:
    return ap.MessagesUsage(
        input_tokens=done.prompt_tokens - done.cached_tokens,
        output_tokens=done.completion_tokens,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=done.cached_tokens,
    )


def _input(arguments: str) -> dict:
    """A call's arguments as the input object (a call cut short by max_tokens may not parse: {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_id(call_id: str) -> str:
    """Anthropic's id of a call the parser named OpenAI's way: `toolu_` and the same digits."""
    return "toolu_" + call_id.removeprefix("call_")


def message_body(message_id: str, model: str, done: Completion, shape: AnswerShape) -> dict:
    """The non-streamed answer: Anthropic's message (a forced call cut before its name: no block)."""
    text, calls = shape.split(done.text)
    content: list = []
    if done.reasoning is not None:
        content.append(ap.ThinkingOut(thinking=done.reasoning, signature=""))
    if text or not (calls or shape.forced_calls):
        content.append(ap.TextOut(text=text))
    content += [ap.ToolUseOut(id=tool_use_id(c.id), name=c.name, input=_input(c.arguments)) for c in calls]
    message = ap.MessageOut(
        id=message_id,
        model=model,
        content=content,
        stop_reason=_stop_reason(done, calls),
        stop_sequence=done.stop_string,
        usage=_usage(done),
        answer_digest=done.answer_digest,
    )
    return message.model_dump(mode="json")


def _event(event) -> bytes:
    return sse(event.model_dump_json(), event.type)


class AnthropicEvents:
    """Anthropic's stream (streaming.StreamEncoder): message_start, then content blocks — thinking, text,
    tool_use — each opened, filled by deltas and stopped, then message_delta (why it ended, the usage)
    and message_stop; or an error event."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int, parser: ToolCallParser | None):
        self.message_id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self.parser = parser
        self.index = -1  # the open block's (or the last one's)
        self.open_kind: str | None = None

    def head(self) -> Iterator[bytes]:
        usage = ap.MessagesUsage(input_tokens=self.prompt_tokens, output_tokens=0, cache_read_input_tokens=0)
        message = ap.MessageOut(
            id=self.message_id, model=self.model, content=[], stop_reason=None, stop_sequence=None, usage=usage
        )
        yield _event(ap.MessageStart(message=message))
        yield _event(ap.Ping())

    def delta(self, event: TextDelta) -> Iterator[bytes]:
        if event.reasoning:
            yield from self._open("thinking", ap.ThinkingOut(thinking="", signature=""))
            yield _event(ap.ContentBlockDelta(index=self.index, delta=ap.ThinkingDeltaOut(thinking=event.text)))
            return
        yield from self._pieces(self.parser.feed(event.text) if self.parser else [event.text])

    def done(self, event: Completion) -> Iterator[bytes]:
        yield from self._pieces(self.parser.flush() if self.parser else [])
        yield from self._close()
        calls = self.parser.calls if self.parser else []
        stop = ap.StopDelta(stop_reason=_stop_reason(event, calls), stop_sequence=event.stop_string)
        yield _event(ap.MessageDelta(delta=stop, usage=_usage(event), answer_digest=event.answer_digest))
        yield _event(ap.MessageStop())

    def error(self, exc: ServiceError) -> Iterator[bytes]:
        yield sse(json.dumps(anthropic_error(exc)), "error")

    def _pieces(self, pieces: list) -> Iterator[bytes]:
        for piece in pieces:
            if isinstance(piece, ToolCallDelta) and piece.name is not None:
                yield from self._close()
                yield from self._open("tool_use", ap.ToolUseOut(id=tool_use_id(piece.id), name=piece.name, input={}))
            if isinstance(piece, ToolCallDelta):
                if piece.arguments:
                    delta = ap.InputJSONDelta(partial_json=piece.arguments)
                    yield _event(ap.ContentBlockDelta(index=self.index, delta=delta))
            elif piece:
                yield from self._open("text", ap.TextOut(text=""))
                yield _event(ap.ContentBlockDelta(index=self.index, delta=ap.TextDeltaOut(text=piece)))

    def _open(self, kind: str, block) -> Iterator[bytes]:
        """Open a block of `kind` unless one is open (a tool_use block is always a new one)."""
        if self.open_kind == kind and kind != "tool_use":
            return
        yield from self._close()
        self.index += 1
        self.open_kind = kind
        yield _event(ap.ContentBlockStart(index=self.index, content_block=block))

    def _close(self) -> Iterator[bytes]:
        if self.open_kind is not None:
            self.open_kind = None
            yield _event(ap.ContentBlockStop(index=self.index))
