"""What a request says its answer must look like — response_format, tools, tool_choice — turned into
what the engine takes: the grammar it enforces and the tools the prompt shows the model."""

from __future__ import annotations

import json
from dataclasses import dataclass

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from ..answer.grounding import GROUNDING_SCHEMA
from ..answer.structured import OutputGrammar, closed_objects, json_grammar, json_rule
from ..answer.tool_forms import JSON_FORM, ToolForm
from ..answer.tools import ToolCall, ToolCallParser
from ..errors import BadRequest
from .schemas import NamedToolChoice, ResponseFormat, Tool


@dataclass(frozen=True)
class AnswerShape:
    grammar: OutputGrammar | None = None
    prompt_tools: list[dict] | None = None  # rendered into the prompt; their calls are parsed out of the answer
    max_calls: int | None = None  # parallel_tool_calls false: the first call only
    forced_calls: bool = False  # tool_choice required or named: the grammar makes the answer calls only
    form: ToolForm = JSON_FORM  # how the model writes a call: Qwen3-VL's JSON object or Qwen3.5's XML form

    @property
    def parse_tool_calls(self) -> bool:
        return self.prompt_tools is not None

    def tool_call_parser(self) -> ToolCallParser | None:
        """What finds the calls in a streamed answer (None: the answer holds none)."""
        if not self.parse_tool_calls:
            return None
        return self.form.parser(self.max_calls, self.forced_calls, [t["function"] for t in self.prompt_tools])

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole answer's content and its tool calls, as its stream's parser finds them (none looked
        for: the text as it is)."""
        parser = self.tool_call_parser()
        if parser is None:
            return text, []
        pieces = parser.feed(text) + parser.flush()
        return "".join(p for p in pieces if isinstance(p, str)), parser.calls


def checked_schema(schema: dict, param: str) -> dict:
    """`schema` if it is a valid JSON Schema (by its own $schema, else draft 2020-12) the tokenizer can
    take (JSON escapes may carry lone surrogates); 400 if not."""
    try:
        validator_for(schema).check_schema(schema)
        json.dumps(schema, ensure_ascii=False).encode()
    except SchemaError as exc:
        raise BadRequest(f"not a valid JSON Schema: {exc.message}", param=param, code="invalid_schema") from None
    except UnicodeEncodeError:
        raise BadRequest("the schema's text holds a lone surrogate", param=param, code="invalid_schema") from None
    except RecursionError:
        raise BadRequest("the JSON Schema is nested too deeply", param=param, code="invalid_schema") from None
    return schema


def answer_schema(response_format: ResponseFormat | None) -> dict | None:
    """The schema an answer in `response_format` must match, or None for free text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "grounding":
        return GROUNDING_SCHEMA
    spec = response_format.json_schema
    if response_format.type == "json_object" or spec is None or spec.schema_ is None:
        return {"type": "object"}
    schema = checked_schema(spec.schema_, "response_format.json_schema.schema")
    return closed_objects(schema) if spec.strict else schema


def answer_shape(
    response_format: ResponseFormat | None,
    tools: list[Tool] | None = None,
    tool_choice: str | NamedToolChoice | None = None,
    parallel_tool_calls: bool = True,
    form: ToolForm = JSON_FORM,
) -> AnswerShape:
    """auto: the model may call tools (with a response_format: a tool call or JSON in that format);
    required / a named function: it must, and the grammar makes the call parse; none: tools are
    left out of the prompt. `form`: how the checkpoint's model writes a call (RequestLimits.tool_form)."""
    rules = form.call_rules
    schema = answer_schema(response_format)
    answer = None if schema is None else json_grammar(schema, "response_format")
    choice = tool_choice or "auto"
    if not tools:
        if choice not in ("none", "auto"):
            raise BadRequest("tool_choice names a tool but no tools were given", param="tool_choice")
        return AnswerShape(answer)
    if choice == "none":
        return AnswerShape(answer)
    functions = [_function(t, i) for i, t in enumerate(tools)]
    if len({f["name"] for f in functions}) < len(functions):
        raise BadRequest("two tools have the same name", param="tools")
    prompt_tools = [{"type": "function", "function": f} for f in functions]
    max_calls = None if parallel_tool_calls else 1
    if choice == "auto":
        if schema is None:
            return AnswerShape(None, prompt_tools, max_calls, form=form)
        lark = f"start: answer | calls\nanswer: {json_rule(schema)}\n" + rules(functions, parallel_tool_calls)
        return AnswerShape(OutputGrammar(lark, "response_format"), prompt_tools, max_calls, form=form)
    if choice == "required":
        forced, parallel = functions, parallel_tool_calls
    else:
        forced, parallel = [f for f in functions if f["name"] == choice.function.name], False
        if not forced:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice")
    lark = "start: calls\n" + rules(forced, parallel)
    return AnswerShape(OutputGrammar(lark, "tools"), prompt_tools, max_calls, forced_calls=True, form=form)


def _function(tool: Tool, index: int) -> dict:
    """The function as the prompt shows it: name, description, parameters (a checked schema)."""
    function = tool.function.model_dump(exclude_none=True, exclude={"strict"})
    parameters = checked_schema(
        tool.function.parameters or {"type": "object", "properties": {}}, f"tools[{index}].function.parameters"
    )
    function["parameters"] = closed_objects(parameters) if tool.function.strict else parameters
    return function  # its declared strings pydantic has checked; the schema, checked_schema
