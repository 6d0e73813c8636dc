"""What a request says its answer must look like — response_format, tools, tool_choice — turned into
what the engine takes: the grammar it enforces and the tools the prompt shows the model."""

from __future__ import annotations

from dataclasses import dataclass

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from ..errors import BadRequest
from ..structured import OutputGrammar, json_rule
from ..tools import call_rules
from .protocol import NamedToolChoice, ResponseFormat, Tool


@dataclass(frozen=True)
class AnswerShape:
    grammar: OutputGrammar | None = None
    prompt_tools: list[dict] | None = None  # rendered into the prompt
    parse_tool_calls: bool = False  # look for <tool_call> blocks in the answer


def checked_schema(schema: dict, param: str) -> dict:
    """`schema` if it is a valid JSON Schema (by its own $schema, else draft 2020-12); 400 if not."""
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise BadRequest(f"not a valid JSON Schema: {exc.message}", param=param, code="invalid_schema") from None
    except RecursionError:
        raise BadRequest("the JSON Schema is nested too deeply", param=param, code="invalid_schema") from None
    return schema


def answer_rule(response_format: ResponseFormat | None, param: str = "response_format") -> str | None:
    """The Lark rule body an answer in `response_format` must match, or None for free text."""
    if response_format is None or response_format.type == "text":
        return None
    spec = response_format.json_schema
    if response_format.type == "json_object" or spec is None or spec.schema_ is None:
        return json_rule({"type": "object"})
    return json_rule(checked_schema(spec.schema_, f"{param}.json_schema.schema"))


def answer_grammar(response_format: ResponseFormat | None) -> OutputGrammar | None:
    rule = answer_rule(response_format)
    return None if rule is None else OutputGrammar(f"start: {rule}\n", "response_format")


def answer_shape(
    response_format: ResponseFormat | None,
    tools: list[Tool] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool,
) -> AnswerShape:
    """auto: the model may call tools (with a response_format: a tool call or JSON in that format);
    required / a named function: it must, and the grammar makes the call parse; none: tools are
    left out of the prompt."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice names a tool but no tools were given", param="tool_choice")
        return AnswerShape(answer_grammar(response_format))
    functions = [
        {**t.function.model_dump(exclude_none=True), "parameters": _parameters(t, i)} for i, t in enumerate(tools)
    ]
    if len({f["name"] for f in functions}) < len(functions):
        raise BadRequest("two tools have the same name", param="tools")
    choice = tool_choice or "auto"
    if choice == "none":
        return AnswerShape(answer_grammar(response_format))
    prompt_tools = [{"type": "function", "function": f} for f in functions]
    if choice == "auto":
        rule = answer_rule(response_format)
        if rule is None:
            return AnswerShape(None, prompt_tools, True)
        lark = f"start: answer | calls\nanswer: {rule}\n" + call_rules(functions, parallel_tool_calls)
        return AnswerShape(OutputGrammar(lark, "response_format"), prompt_tools, True)
    if choice == "required":
        forced, parallel = functions, parallel_tool_calls
    else:
        forced, parallel = [f for f in functions if f["name"] == choice.function.name], False
        if not forced:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice")
    lark = "start: calls\n" + call_rules(forced, parallel)
    return AnswerShape(OutputGrammar(lark, "tools"), prompt_tools, True)


def _parameters(tool: Tool, index: int) -> dict:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return checked_schema(parameters, f"tools[{index}].function.parameters")
