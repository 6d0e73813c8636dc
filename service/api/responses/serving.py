"""OpenAI's Responses API onto the one engine path: its input items (and a stored conversation it
continues) as the engine's GenerationRequest; the engine's events as output items — reasoning,
message, function calls — whole or as the typed events of its stream (streaming.StreamEncoder)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator

from ...answer.logprobs import TokenLogprob
from ...answer.tools import ToolCall, ToolCallDelta, ToolCallParser
from ...errors import BadRequest, ServiceError
from ...generation import Completion, GenerationRequest, SamplingParams, TextDelta
from ...limits import RequestLimits
from ...model.prompts import ChatMessage, ImagePart, TextPart
from ..answer_shapes import AnswerShape, answer_shape
from ..context import RequestContext
from ..engine_requests import generation_request
from ..inputs import checked_text, decode_data_url, detail_budget
from ..schemas import (
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    dump,
    logprob_entries,
)
from ..streaming import sse
from . import protocol as rp


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# -- in: input items as the engine's messages ------------------------------------------------------


def _message(item: rp.InputMessageItem, limits: RequestLimits, param: str) -> ChatMessage:
    role = "system" if item.role == "developer" else item.role
    if isinstance(item.content, str):
        return ChatMessage(role, [TextPart(checked_text(item.content, f"{param}.content"))])
    parts = []
    for j, part in enumerate(item.content):
        where = f"{param}.content[{j}]"
        if isinstance(part, rp.InputImagePart):
            parts.append(
                ImagePart(decode_data_url(part.image_url, detail_budget(limits.image, part.detail, where), where))
            )
        else:
            parts.append(TextPart(checked_text(part.text, where)))
    return ChatMessage(role, parts)


def input_messages(body: rp.ResponsesRequest, limits: RequestLimits) -> list[ChatMessage]:
    """The request's input as messages (`item_messages`)."""
    if isinstance(body.input, str):
        return [ChatMessage("user", [TextPart(checked_text(body.input, "input"))])]
    return item_messages(body.input, limits)


def item_messages(items: list, limits: RequestLimits, field: str = "input") -> list[ChatMessage]:
    """Input items as messages: calls join the assistant message before them (or make one), a call's
    output is a tool message, reasoning goes with the assistant message after it. `field`: the items'
    name in a 400."""
    out: list[ChatMessage] = []
    reasoning = None
    for i, item in enumerate(items):
        param = f"{field}[{i}]"
        if isinstance(item, rp.ReasoningItem):
            reasoning = "".join(c.text for c in item.content or ())
        elif isinstance(item, rp.FunctionCallItem):
            call = ToolCall(item.name, checked_text(item.arguments, f"{param}.arguments"), item.call_id)
            last = out[-1] if out and out[-1].role == "assistant" else None
            if last is None:
                out.append(ChatMessage("assistant", [TextPart("")], tool_calls=(call,), reasoning=reasoning))
            else:
                out[-1] = ChatMessage(
                    "assistant", last.parts, tool_calls=(*last.tool_calls, call), reasoning=last.reasoning
                )
            reasoning = None
        elif isinstance(item, rp.FunctionCallOutputItem):
            text = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append(ChatMessage("tool", [TextPart(checked_text(text, f"{param}.output"))]))
        else:
            message = _message(item, limits, param)
            if message.role == "assistant" and reasoning is not None:
                message = ChatMessage("assistant", message.parts, reasoning=reasoning)
                reasoning = None
            out.append(message)
    return out


def _shape(body: rp.ResponsesRequest, form: str) -> AnswerShape:
    fmt = body.text.format if body.text else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        schema = JSONSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict) if fmt.schema_ else None
        response_format = ResponseFormat(type=fmt.type, json_schema=schema)
    tools = [
        Tool(
            type="function",
            function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict is not False
            ),
        )
        for t in body.tools or ()
    ]
    choice = body.tool_choice
    if isinstance(choice, rp.FunctionChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return answer_shape(response_format, tools or None, choice, body.parallel_tool_calls is not False, form)


# -- the input items a response was made from -----------------------------------------------------

IMAGE_URLS = "message.input_image.image_url"  # the `include` that lists pictures with their data: URLs
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _input_message(item: rp.InputMessageItem) -> rp.InputMessageOut | rp.ResponseOutputMessage:
    """A message as input items list it: an assistant's as the output message it was, the others' parts
    as input parts."""
    item_id = item.id or _item_id("msg")
    parts = [rp.InputTextPart(type="input_text", text=item.content)] if isinstance(item.content, str) else item.content
    if item.role == "assistant":  # its text parts (pictures are the user's only: refused before)
        texts = [rp.ResponseOutputText(text=p.text) for p in parts if not isinstance(p, rp.InputImagePart)]
        return rp.ResponseOutputMessage(id=item_id, status="completed", content=texts)
    content = [
        rp.InputImageOut(detail=p.detail or "auto", image_url=p.image_url)
        if isinstance(p, rp.InputImagePart)
        else rp.InputTextOut(text=p.text)
        for p in parts
    ]
    return rp.InputMessageOut(id=item_id, role=item.role, content=content)


def _input_item(item) -> rp.InputItemOut:
    if isinstance(item, rp.InputMessageItem):
        return _input_message(item)
    if isinstance(item, rp.FunctionCallItem):
        return rp.ResponseFunctionCall(
            id=item.id or _item_id("fc"),
            call_id=item.call_id,
            name=item.name,
            arguments=item.arguments,
            status="completed",
        )
    if isinstance(item, rp.FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else [rp.InputTextOut(text=p.text) for p in item.output]
        return rp.FunctionCallOutputOut(id=item.id or _item_id("fco"), call_id=item.call_id, output=output)
    texts = [rp.ResponseReasoningText(text=c.text) for c in item.content or ()]
    return rp.ResponseReasoning(id=item.id or _item_id("rs"), content=texts)


def input_items(earlier: list[dict], body: rp.ResponsesRequest) -> list[dict]:
    """What a response is made from, as GET …/input_items lists it: the `earlier` items of the stored
    conversation it continues (inputs and outputs), then its own input (`listed_items`)."""
    own = [rp.InputMessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    return listed_items(earlier, own)


def listed_items(earlier: list[dict], own: list) -> list[dict]:
    """The `earlier` items, then `own` input items as listed, each with an id — the one sent, or a new one
    where none was sent or it is taken (`after` finds one item)."""
    items, taken = list(earlier), {item["id"] for item in earlier}
    for item in own:
        out = _input_item(item).model_dump(mode="json")
        if out["id"] in taken:
            out["id"] = _item_id(_ITEM_PREFIX[out["type"]])
        taken.add(out["id"])
        items.append(out)
    return items


def _without_image_urls(item: dict) -> dict:
    if item["type"] != "message" or not any(part["type"] == "input_image" for part in item["content"]):
        return item
    parts = [{**part, "image_url": None} if part["type"] == "input_image" else part for part in item["content"]]
    return {**item, "content": parts}


def input_items_query(args) -> rp.InputItemsQuery:
    """A list of input items' query string (`args`: its multi-valued arguments): `after`, `limit`,
    `order`, and `include` — or `include[]`, as the official client sends it."""
    given = {"after": args.get("after"), "limit": args.get("limit"), "order": args.get("order")}
    include = args.getlist("include[]") + args.getlist("include")
    return rp.InputItemsQuery.model_validate({k: v for k, v in given.items() if v is not None} | {"include": include})


def input_item_page(items: list[dict], query: rp.InputItemsQuery) -> rp.InputItemList:
    """A page of a response's input items, as OpenAI's: in `order`, after the item `after` names, at most
    `limit`; the pictures' URLs only when `include` asks for them."""
    ordered = items if query.order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    if query.after is not None and query.after not in ids:
        raise BadRequest(f"after is {query.after!r}, no input item of this response", param="after")
    start = ids.index(query.after) + 1 if query.after is not None else 0
    page = ordered[start : start + query.limit]
    if IMAGE_URLS not in query.include:
        page = [_without_image_urls(item) for item in page]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return rp.InputItemList(data=page, first_id=first, last_id=last, has_more=start + len(page) < len(ordered))


def responses_request(
    body: rp.ResponsesRequest,
    limits: RequestLimits,
    history: list[ChatMessage],
    conversation_id: str,
    context: RequestContext,
) -> tuple[GenerationRequest, AnswerShape, list[ChatMessage]]:
    """The engine's request for `body` continuing `history` (a stored conversation, or none), its
    answer shape, and the conversation without the instructions (what a stored response keeps)."""
    shape = _shape(body, limits.tool_form)
    conversation = history + input_messages(body, limits)
    instructions = body.instructions
    prefix = [ChatMessage("system", [TextPart(checked_text(instructions, "instructions"))])] if instructions else []
    params = SamplingParams(
        max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, logprobs=body.logprobs
    )
    request = generation_request(
        context,
        prefix + conversation,
        params,
        limits,
        shape=shape,
        max_tokens_param="max_output_tokens",
        conversation_id=conversation_id,
        remembered=len(prefix) + len(history),
        **body.thinking(),
    )
    return request, shape, conversation


# The fields of the request the engine's and the shared answer shapes' names stand for (the prompt's
# messages are made of the input, the stored conversation and the instructions: `input` holds a fault).
_RESPONSES_FIELDS = (
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].parameters"),
    (re.compile(r"^messages\b.*"), "input"),
)


def responses_field(param: str) -> str:
    """The Responses request's name of a field the engine names as Chat Completions does."""
    for pattern, name in _RESPONSES_FIELDS:
        if pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param


# -- out: the engine's events as output items -------------------------------------------------------


class OutputItems:
    """Builds the response's output items from reasoning, text and call pieces, returning the stream
    events each step makes (a whole answer is fed the same way and its events dropped)."""

    def __init__(self, parser: ToolCallParser | None):
        self.parser = parser
        self.items: list[rp.ResponseReasoning | rp.ResponseOutputMessage | rp.ResponseFunctionCall] = []
        self.open = False  # the last item is still being written

    def reasoning(self, text: str) -> list:
        events = self._open_item("reasoning") if not self._open_is("reasoning") else []
        item = self.items[-1]
        item.content[0].text += text
        return events + [_reasoning_delta(item.id, len(self.items) - 1, text)]

    def text(self, text: str, logprobs: list[dict] | None = None) -> list:
        """Events of a piece of the answer; `logprobs` (its tokens', when asked) go with its text: on the
        message's text and on its delta event (with a tool-call parser, on its first piece of text)."""
        return self._pieces(self.parser.feed(text) if self.parser else [text], logprobs)

    def finish(self, status: str) -> list:
        events = self._pieces(self.parser.flush() if self.parser else [])
        events += self._close(status)
        forced = self.parser is not None and self.parser.forced  # cut before its call's name: no item
        if not self.items and not forced:  # an empty answer is still a message, as OpenAI's
            events += self._open_item("message") + self._close(status)
        return events

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls if self.parser else []

    def _pieces(self, pieces: list, logprobs: list[dict] | None = None) -> list:
        events = []
        for piece in pieces:
            if isinstance(piece, ToolCallDelta):
                if piece.name is not None:
                    events += self._close("completed") + self._open_item("function_call", piece)
                if piece.arguments:
                    item = self.items[-1]
                    item.arguments += piece.arguments
                    events.append(
                        rp.ResponseArgumentsDeltaEvent(
                            item_id=item.id, output_index=len(self.items) - 1, delta=piece.arguments
                        )
                    )
            elif piece:
                if not self._open_is("message"):
                    events += self._close("completed") + self._open_item("message")
                item = self.items[-1]
                item.content[0].text += piece
                index = len(self.items) - 1
                delta = rp.ResponseTextDeltaEvent(item_id=item.id, output_index=index, content_index=0, delta=piece)
                if logprobs:
                    item.content[0].logprobs += logprobs
                    delta.logprobs, logprobs = logprobs, None
                events.append(delta)
        return events

    def _open_is(self, kind: str) -> bool:
        return self.open and self.items[-1].type == kind

    def _open_item(self, kind: str, call: ToolCallDelta | None = None) -> list:
        events = self._close("completed")
        index = len(self.items)
        if kind == "reasoning":
            item = rp.ResponseReasoning(id=_item_id("rs"), content=[])
            added = item.model_copy(deep=True)
            item.content = [rp.ResponseReasoningText(text="")]
            self.items.append(item)
            self.open = True
            return events + [
                rp.ResponseOutputItemEvent(type="response.output_item.added", output_index=index, item=added)
            ]
        if kind == "function_call":
            item = rp.ResponseFunctionCall(
                id=_item_id("fc"), call_id=call.id, name=call.name, arguments="", status="in_progress"
            )
            self.items.append(item)
            self.open = True
            return events + [
                rp.ResponseOutputItemEvent(
                    type="response.output_item.added", output_index=index, item=item.model_copy()
                )
            ]
        item = rp.ResponseOutputMessage(id=_item_id("msg"), status="in_progress", content=[])
        added = item.model_copy(deep=True)
        part = rp.ResponseOutputText(text="")
        item.content = [part]
        self.items.append(item)
        self.open = True
        return events + [
            rp.ResponseOutputItemEvent(type="response.output_item.added", output_index=index, item=added),
            rp.ResponseContentPartEvent(
                type="response.content_part.added",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=part.model_copy(),
            ),
        ]

    def _close(self, status: str) -> list:
        if not self.open:
            return []
        self.open = False
        item, index = self.items[-1], len(self.items) - 1
        events: list = []
        if item.type == "reasoning":
            text = item.content[0].text
            events.append(
                rp.ResponseReasoningDoneEvent(item_id=item.id, output_index=index, content_index=0, text=text)
            )
        elif item.type == "function_call":
            item.status = status
            events.append(
                rp.ResponseArgumentsDoneEvent(
                    item_id=item.id, output_index=index, name=item.name, arguments=item.arguments
                )
            )
        else:
            item.status = status
            part = item.content[0]
            events.append(
                rp.ResponseTextDoneEvent(
                    item_id=item.id, output_index=index, content_index=0, text=part.text, logprobs=part.logprobs
                )
            )
            events.append(
                rp.ResponseContentPartEvent(
                    type="response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part
                )
            )
        return events + [rp.ResponseOutputItemEvent(type="response.output_item.done", output_index=index, item=item)]


def _reasoning_delta(item_id: str, index: int, text: str) -> rp.ResponseReasoningDeltaEvent:
    return rp.ResponseReasoningDeltaEvent(item_id=item_id, output_index=index, content_index=0, delta=text)


def usage(done: Completion) -> rp.ResponseUsage:
    return rp.ResponseUsage(
        input_tokens=done.prompt_tokens,
        input_tokens_details=rp.InputTokensDetails(cached_tokens=done.cached_tokens, cache_write_tokens=0),
        output_tokens=done.completion_tokens,
        output_tokens_details=rp.OutputTokensDetails(reasoning_tokens=done.reasoning_tokens),
        total_tokens=done.prompt_tokens + done.completion_tokens,
    )


class ResponseHead:
    """What a response says of its request, whatever its output: the fields OpenAI echoes."""

    def __init__(self, response_id: str, model: str, body: rp.ResponsesRequest):
        self.id, self.model, self.body, self.created_at = response_id, model, body, int(time.time())

    def response(self, status: str, items: list, done: Completion | None) -> rp.Response:
        body, choice = self.body, self.body.tool_choice
        fmt = body.text.format if body.text and body.text.format else rp.ResponseTextFormat(type="text")
        return rp.Response(
            id=self.id,
            created_at=self.created_at,
            status=status,
            incomplete_details=rp.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.model,
            output=items,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            reasoning={"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            store=body.store,
            temperature=body.temperature,
            top_p=body.top_p,
            text={"format": fmt.echoed()},
            tool_choice=choice.model_dump() if isinstance(choice, rp.FunctionChoice) else choice or "auto",
            tools=[t.model_dump(exclude_none=True) for t in body.tools or ()],
            usage=usage(done) if done is not None else None,
            user=body.user,
            metadata=body.metadata or {},
            conversation=rp.ConversationOut(id=body.conversation_id) if body.conversation_id else None,
            answer_digest=done.answer_digest if done is not None else None,
        )


def answer_logprobs(records: list[TokenLogprob] | None) -> list[dict] | None:
    """The answer tokens' logprobs as an output_text lists them (its reasoning's apart), or None."""
    entries = logprob_entries([r for r in records if not r.reasoning] if records is not None else None)
    return [dump(e) for e in entries] if entries is not None else None


def status_of(done: Completion) -> str:
    return "incomplete" if done.finish_reason in ("length", "deadline") else "completed"


def whole_response(head: ResponseHead, done: Completion, shape: AnswerShape) -> tuple[rp.Response, list[ToolCall]]:
    """The non-streamed response (and the calls in it), built as the stream builds it."""
    output = OutputItems(shape.tool_call_parser())
    if done.reasoning is not None:
        output.reasoning(done.reasoning)
    output.text(done.text, answer_logprobs(done.logprobs))
    status = status_of(done)
    output.finish(status)
    return head.response(status, output.items, done), output.calls


class ResponsesEvents:
    """The Responses stream (streaming.StreamEncoder): response.created and response.in_progress, each
    output item added, filled by its deltas and done, then response.completed (or .incomplete) with the
    whole response — remembered first when stored; or an error event."""

    def __init__(
        self,
        head: ResponseHead,
        parser: ToolCallParser | None,
        remember: Callable[[rp.Response, Completion, list[ToolCall]], None],
    ):
        self.response_head, self.output, self.remember = head, OutputItems(parser), remember
        self.sequence = 0

    def head(self) -> Iterator[bytes]:
        snapshot = self.response_head.response("in_progress", [], None)
        yield from self._emit(
            [
                rp.ResponseLifecycleEvent(type="response.created", response=snapshot),
                rp.ResponseLifecycleEvent(type="response.in_progress", response=snapshot),
            ]
        )

    def delta(self, event: TextDelta) -> Iterator[bytes]:
        if event.reasoning:
            yield from self._emit(self.output.reasoning(event.text))
        else:
            yield from self._emit(self.output.text(event.text, answer_logprobs(event.logprobs or None)))

    def done(self, event: Completion) -> Iterator[bytes]:
        status = status_of(event)
        yield from self._emit(self.output.finish(status))
        response = self.response_head.response(status, self.output.items, event)
        self.remember(response, event, self.output.calls)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield from self._emit([rp.ResponseLifecycleEvent(type=kind, response=response)])

    def error(self, exc: ServiceError) -> Iterator[bytes]:
        param = responses_field(exc.param) if exc.param is not None else None
        yield from self._emit([rp.ResponseErrorEvent(code=exc.code, message=exc.message, param=param)])

    def _emit(self, events: list) -> Iterator[bytes]:
        for event in events:
            event.sequence_number = self.sequence
            self.sequence += 1
            yield sse(event.model_dump_json(by_alias=True), event.type)


def answer_message(done: Completion, calls: list[ToolCall], items: list) -> ChatMessage:
    """The answer as a stored conversation keeps it: with its generated ids, so the next turn's prompt
    extends this one's KV cache token for token; with calls, as the template renders them back."""
    if not calls:
        return ChatMessage(
            "assistant", [TextPart(done.text)], token_ids=done.answer_token_ids, reasoning=done.reasoning
        )
    text = "".join(i.content[0].text for i in items if i.type == "message")
    return ChatMessage("assistant", [TextPart(text)], tool_calls=tuple(calls), reasoning=done.reasoning)
