"""The chat templates of the random checkpoints: Qwen3-VL's Instruct and Thinking prompt formats, written
as each checkpoint's chat_template.jinja (service/random_checkpoints/tokenizer.py).
"""

from __future__ import annotations

# The Qwen3-VL Instruct prompt format: ChatML turns, each image as
# <|vision_start|><|image_pad|><|vision_end|>, no default system prompt; with `tools`, Qwen's
# function-calling system block (signatures in <tools>, calls answered in <tool_call> tags), an
# assistant's calls rendered back as those tags and tool results as <tool_response> user turns.
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
_TOOL_CALLS = (
    "{% for call in message['tool_calls'] %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}"
)
# No whitespace control: every newline here is part of the prompt, as in Qwen's; one right after a
# block tag is written {{ '\\n' }} (transformers renders with trim_blocks, which would drop it).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{% set message = messages[0] %}" + _CONTENT + "{{ '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if not tools %}<|im_start|>system\n" + _CONTENT + "<|im_end|>\n{% endif %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n" + _CONTENT + "{{ '\\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n"
    + _CONTENT
    + "{% if message['tool_calls'] %}"
    + _TOOL_CALLS
    + "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The Qwen3-VL Thinking prompt format (service/model/thinking.py): the same turns, but the assistant
# turn opens `<think>\n`, and an assistant message renders without its reasoning unless it follows
# the latest user message (a tool-calling turn still in progress keeps it), as Qwen's does. Its
# reasoning comes as `reasoning_content`, or before a `</think>` in its content.
_ASSISTANT_THINKING = (
    "{% set content = message['content'] if message['content'] is string else '' %}"
    "{% set reasoning = message['reasoning_content'] if message['reasoning_content'] is string else '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and reasoning %}<think>\n{{ reasoning.strip('\\n') }}\n</think>\n\n"
    "{{ content.lstrip('\\n') }}{% else %}{{ content.lstrip('\\n') }}{% endif %}"
    "{% if message['tool_calls'] %}" + _TOOL_CALLS + "{% endif %}<|im_end|>\n"
)
THINKING_CHAT_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    + CHAT_TEMPLATE.replace(
        "{% else %}<|im_start|>{{ message['role'] }}",
        "{% elif message['role'] == 'assistant' %}"
        + _ASSISTANT_THINKING
        + "{% else %}<|im_start|>{{ message['role'] }}",
    ).replace(
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
    )
)
