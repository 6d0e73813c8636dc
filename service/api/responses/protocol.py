"""OpenAI's Responses API, typed: the request (`POST /v1/responses`), the response object it answers
(and GET /v1/responses/{id} returns), and the typed events of its stream.
responses/serving.py translates them to and from the engine's request and events."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints, field_validator

from ...generation import MaxTokens, Temperature, TopP
from ..schemas import MAX_TEXT, REASONING_EFFORT, FunctionName, JSONSchema, Lenient, known_part_types

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
_URL = Annotated[str, StringConstraints(max_length=64 * 1024 * 1024)]
_ID = Annotated[str, StringConstraints(max_length=256)]
RESPONSE_ID_PATTERN = r"^resp_[A-Za-z0-9]{1,64}$"
CONVERSATION_ID_PATTERN = r"^conv_[A-Za-z0-9]{1,64}$"  # OpenAI's Conversations (service/api/conversations/)
LOGPROBS = "message.output_text.logprobs"  # the `include` that reports each answer token's log-probability


class InputTextPart(Lenient):
    type: Literal["input_text"]
    text: Text


class InputImagePart(Lenient):
    type: Literal["input_image"]
    image_url: _URL = Field(description="a data:image/...;base64, URL (the server fetches nothing)")
    detail: Literal["low", "high", "auto"] | None = None


class OutputTextPart(Lenient):
    """An assistant message's text, sent back as history."""

    type: Literal["output_text"]
    text: Text


PART_TYPES = ("input_text", "input_image", "output_text")
InputPart = Annotated[InputTextPart | InputImagePart | OutputTextPart, Field(discriminator="type")]


class InputMessageItem(Lenient):
    type: Literal["message"] = "message"
    id: _ID | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputPart]

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value):
        return known_part_types(value, PART_TYPES)


class FunctionCallItem(Lenient):
    """A call the model made (from an earlier output), sent back as history."""

    type: Literal["function_call"]
    id: _ID | None = None
    call_id: _ID
    name: FunctionName
    arguments: Text


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    id: _ID | None = None
    call_id: _ID
    output: Text | list[InputTextPart]


class ReasoningTextIn(Lenient):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: Text


class ReasoningItem(Lenient):
    """A thinking model's reasoning (from an earlier output), sent back as history."""

    type: Literal["reasoning"]
    id: _ID | None = None
    content: list[ReasoningTextIn] | None = None


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[
    InputMessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")
]


def typed_items(value):
    """Input items as the API takes them: messages may come without their type (EasyInputMessage); an
    unknown item or part type is named in a 400 (here, where the 400 names the field, not a union member)."""
    if not isinstance(value, list):
        return value
    items = [{"type": "message", **v} if isinstance(v, dict) and "type" not in v else v for v in value]
    for item in items:
        if isinstance(item, dict) and item.get("type") == "message":
            known_part_types(item.get("content"), PART_TYPES)
    return known_part_types(items, ITEM_TYPES, "input item")


class ConversationRef(Lenient):
    id: Annotated[str, StringConstraints(pattern=CONVERSATION_ID_PATTERN)]


class ResponseTextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName = "response"
    description: Text | None = None
    schema_: JSONSchema | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="objects allow no keys beyond their properties (OpenAI's strict)")

    def echoed(self) -> dict:
        """The format as a response echoes it: text and json_object are a bare type, as OpenAI's."""
        if self.type != "json_schema":
            return {"type": self.type}
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ResponseTextConfig(Lenient):
    format: ResponseTextFormat | None = None


class FunctionTool(Lenient):
    type: Literal["function"] = Field(description="function tools only: hosted tools are not run here")
    name: FunctionName
    description: Text | None = None
    parameters: JSONSchema | None = None
    strict: bool | None = Field(None, description="default true, as OpenAI's: objects allow no other keys")


class FunctionChoice(Lenient):
    type: Literal["function"]
    name: FunctionName


class ReasoningConfig(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="thinking checkpoints: a thinking budget (none off, minimal 0, low 256, medium 1024)"
    )
    summary: str | None = None


class ResponsesRequest(Lenient):
    model: Annotated[str, StringConstraints(max_length=256)] | None = None
    input: Text | list[InputItem] = Field(description="a string (one user message) or items")
    instructions: Text | None = Field(None, description="a system message (not carried on by previous_response_id)")
    previous_response_id: Annotated[str, StringConstraints(pattern=RESPONSE_ID_PATTERN)] | None = None
    store: bool = Field(True, description="false: nothing is kept, and the response cannot be continued")
    text: ResponseTextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    metadata: dict[str, Annotated[str, StringConstraints(max_length=512)]] | None = Field(None, max_length=16)
    user: Annotated[str, StringConstraints(max_length=256)] | None = None
    background: bool | None = Field(None, description="not supported: false only")
    conversation: Annotated[str, StringConstraints(pattern=CONVERSATION_ID_PATTERN)] | ConversationRef | None = Field(
        None,
        description="a conversation of /v1/conversations: its items come before the input, and the input and "
        "output are added to it (not with previous_response_id)",
    )
    include: list[Annotated[str, StringConstraints(max_length=256)]] | None = Field(
        None, max_length=16, description=f"{LOGPROBS}: each answer token's log-probability (others are ignored)"
    )
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives reported with each token's logprob")
    prompt_cache_key: Annotated[str, StringConstraints(max_length=256)] | None = Field(
        None, description="what the proxy keeps a client's requests together by (nginx/affinity.js)"
    )

    @field_validator("input", mode="before")
    @classmethod
    def _typed_items(cls, value):
        return typed_items(value)

    @field_validator("background")
    @classmethod
    def _unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported here")
        return value

    @property
    def conversation_id(self) -> str | None:
        """The conversation's id, whichever form it came in."""
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @property
    def logprobs(self) -> int | None:
        """The alternatives to report with each answer token's logprob, or None: not asked (`include`)."""
        return (self.top_logprobs or 0) if LOGPROBS in (self.include or ()) else None

    def thinking(self) -> dict:
        """reasoning.effort as the engine's thinking switches (as Chat Completions' reasoning_effort)."""
        effort = self.reasoning.effort if self.reasoning else None
        if effort is None:
            return {}
        return {"enable_thinking": effort != "none", "max_thinking_tokens": REASONING_EFFORT[effort]}


# -- what it answers ------------------------------------------------------------------------------


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText]


class ResponseFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="the model's JSON text, verbatim")
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = Field(default_factory=list)
    content: list[ResponseReasoningText]


OutputItem = ResponseOutputMessage | ResponseFunctionCall | ResponseReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose keys and values came from the cache")
    cache_write_tokens: int = Field(0, description="0: the cache keeps every prompt by itself, at no charge")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ConversationOut(BaseModel):
    id: str


class Response(BaseModel):
    """A response: whole (`stream: false`, GET), or its snapshot in the lifecycle events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict
    tool_choice: Any
    tools: list[dict]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None
    user: str | None = None
    metadata: dict[str, str]
    conversation: ConversationOut | None = None
    answer_digest: str | None = Field(
        None,
        description="an extension, once the answer is done: a digest of its token ids and logprob floats and the "
        "checkpoint's identity — any instance, on any CPU, replaying the request gives the same",
    )


class InputTextOut(BaseModel):
    type: Literal["input_text"] = "input_text"
    text: str


class InputImageOut(BaseModel):
    type: Literal["input_image"] = "input_image"
    detail: Literal["low", "high", "auto"]
    image_url: str | None = Field(description="the data: URL sent, with include=message.input_image.image_url")


class InputMessageOut(BaseModel):
    """A user's, system's or developer's message of a response's input (an assistant's is an output
    message, as the response that wrote it had it)."""

    type: Literal["message"] = "message"
    id: str
    role: Literal["user", "system", "developer"]
    status: Literal["completed"] = "completed"
    content: list[InputTextOut | InputImageOut]


class FunctionCallOutputOut(BaseModel):
    type: Literal["function_call_output"] = "function_call_output"
    id: str
    call_id: str
    output: str | list[InputTextOut]
    status: Literal["completed"] = "completed"


InputItemOut = (
    InputMessageOut | ResponseOutputMessage | ResponseFunctionCall | FunctionCallOutputOut | ResponseReasoning
)


class InputItemList(BaseModel):
    """GET /v1/responses/{id}/input_items: a page of what the response was made from — the stored
    conversation it continues (earlier inputs and outputs) and its own input."""

    object: Literal["list"] = "list"
    data: list[InputItemOut]
    first_id: str | None = Field(description="the page's first item (null: an empty page)")
    last_id: str | None = Field(description="the page's last item: `after` for the next page")
    has_more: bool


class InputItemsQuery(Lenient):
    """The query of GET /v1/responses/{id}/input_items, as OpenAI's."""

    after: _ID | None = Field(None, description="the id of the item the page starts after")
    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = Field("desc", description="desc: the newest item first")
    include: list[Annotated[str, StringConstraints(max_length=256)]] = Field(
        default_factory=list, max_length=16, description="message.input_image.image_url: the pictures' data: URLs"
    )


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True


# -- the stream's events (each also has its sequence_number) --------------------------------------


class _Event(BaseModel):
    sequence_number: int = 0


class ResponseLifecycleEvent(_Event):
    """response.created, response.in_progress, response.completed, response.incomplete."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: Response


class ResponseOutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ResponseContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: ResponseOutputText


class ResponseTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list = Field(default_factory=list)


class ResponseTextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list = Field(default_factory=list)


class ResponseArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ResponseArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseReasoningDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ResponseReasoningDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


class ResponseErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None


STREAM_EVENTS = (
    ResponseLifecycleEvent,
    ResponseOutputItemEvent,
    ResponseContentPartEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseArgumentsDeltaEvent,
    ResponseArgumentsDoneEvent,
    ResponseReasoningDeltaEvent,
    ResponseReasoningDoneEvent,
    ResponseErrorEvent,
)
