"""How a checkpoint's model writes a tool call, as its chat template and tokenizer show: Qwen3-VL's JSON
object (tools.py) or Qwen3.5's XML form (xml_tools.py), the `<tool_call>` tags tokens of their own or
text. `ToolForm` gives the grammar that forces calls and the parser that reads them, in that form."""

from __future__ import annotations

from dataclasses import dataclass

from . import tools, xml_tools


@dataclass(frozen=True)
class ToolForm:
    xml: bool = False  # <function=NAME> and <parameter=ARG> blocks (Qwen3.5), not a JSON object
    tag_tokens: bool = False  # <tool_call> and </tool_call> are tokens of their own (the releases' tokenizers)

    def call_rules(self, functions: list[dict], parallel: bool) -> str:
        """Lark rules defining `calls` (tools.call_rules: one call, or with `parallel` one or more)."""
        rules = xml_tools.call_rules if self.xml else tools.call_rules
        return rules(functions, parallel, self.tag_tokens)

    def parser(self, max_calls: int | None, forced: bool, functions: list[dict]) -> tools.ToolCallParser:
        """What finds the calls in a streamed answer (tools.ToolCallParser's contract)."""
        if self.xml:
            return xml_tools.XMLToolCallParser(max_calls, forced, functions)
        return tools.ToolCallParser(max_calls, forced)


JSON_FORM = ToolForm()
