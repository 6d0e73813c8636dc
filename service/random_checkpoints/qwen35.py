"""Qwen3.5's random checkpoints: the releases' shapes, their tokens and their prompt format.

The shapes are those of the published config.json files (docs/models.md names the sources; every
size's parameter count, vision and MTP head included, equals the release's to the digit): the dense
0.8B, 2B, 4B and 9B and the 35B-A3B mixture of experts (256 experts, the top 8, and a shared expert),
`-e32` its per-token shapes with 32 experts for llama.cpp's bf16 conversion. `tiny-qwen35` and
`tiny-qwen35-moe` are the test models: the same structure (three linear-attention layers to one
full-attention layer, the MTP head), a few units of each.
"""

from __future__ import annotations

import copy

# Qwen3.5's added tokens in the real tokenizer's order (ids 248044…248076); (token, special). The tool
# and thinking tags are plain tokens there, so decoding keeps them in the text.
TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]
TOKENIZER_CLASS = "Qwen3_5Tokenizer"


def pretokenize_regex() -> str:
    """Qwen3.5's pre-tokenizer (letters with their combining marks), as transformers writes it."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    return PRETOKENIZE_REGEX


FIRST_ID = 248044
REAL_IDS = {token: FIRST_ID + i for i, (token, _) in enumerate(TOKENS)}
VOCAB_SIZE = 248320  # the embedding's rows (the tokenizer's 248,077 padded)

# The Qwen3.5 prompt format (its releases' chat template, written anew): ChatML turns; the answer opens
# `<think>\n` (thinking on by default; `enable_thinking=False` closes the block at once); an assistant
# turn after the latest user query keeps its reasoning, earlier ones their content only; tools in a
# system block, calls in the XML form (service/answer/xml_tools.py: arguments a mapping); tool results
# as <tool_response> blocks of one user turn.
CHAT_TEMPLATE = """\
{%- macro render(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}\
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif part.type == 'video' or 'video' in part -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif 'text' in part -%}{{- part.text -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_query=messages | length - 1, tools_only=true) -%}
{%- for message in messages[::-1] -%}
{%- if ns.tools_only and message.role == 'user' -%}
{%- set text = render(message.content) | trim -%}
{%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
{%- set ns.tools_only = false -%}{%- set ns.last_query = messages | length - 1 - loop.index0 -%}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if tools -%}
{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nTo call a function, reply with only:\\n\\n<tool_call>\\n<function=NAME>\\n' -}}
{{- '<parameter=ARGUMENT>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>' -}}
{%- if messages[0].role == 'system' -%}{{- '\\n\\n' + render(messages[0].content) | trim -}}{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' + render(messages[0].content) | trim + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- set content = render(message.content) | trim -%}
{%- if message.role == 'user' -%}
{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
{%- if message.reasoning_content is not string and '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if loop.index0 > ns.last_query -%}{{- '<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' -}}{%- endif -%}
{{- content -}}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- '\\n' -}}{%- elif content -%}{{- '\\n\\n' -}}{%- endif -%}
{{- '<tool_call>\\n<function=' + call.name + '>\\n' -}}
{%- for name, value in (call.arguments or {}) | items -%}
{{- '<parameter=' + name + '>\\n' -}}
{{- value | tojson if value is mapping or (value is sequence and value is not string) else value | string -}}
{{- '\\n</parameter>\\n' -}}
{%- endfor -%}
{{- '</function>\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else -%}{{- '<think>\\n' -}}{%- endif -%}
{%- endif -%}
"""

_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}


def _release(text: tuple, vision: tuple, tied: bool, experts: int = 0, **how) -> dict:
    """A release's preset (head_dim 256, 16 key heads of 128 in linear attention): `text` its hidden,
    MLP width, layers, query heads, KV heads and linear-attention value heads; `vision` its tower's
    depth, hidden, MLP width and heads (out_hidden_size: the text hidden; no DeepStack); `experts`:
    a mixture of experts' count (the top 8 of them and a shared expert, widths 512)."""
    hidden, width, layers, heads, kv_heads, value_heads = text
    text_config = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=262144,
        rope_parameters=dict(_ROPE),
        initializer_range=0.02,
    )
    if experts:
        text_config.update(
            num_experts=experts, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512
        )
    else:
        text_config["intermediate_size"] = width
    depth, vision_hidden, vision_width, vision_heads = vision
    vision_config = dict(
        depth=depth,
        hidden_size=vision_hidden,
        intermediate_size=vision_width,
        num_heads=vision_heads,
        out_hidden_size=hidden,
        initializer_range=0.02,
    )
    return dict(text=text_config, vision=vision_config, tied=tied, moe=bool(experts), **how)


# The test models: three linear-attention layers to one full-attention layer, heads of 16 and 32 (the
# kernels' vectors), the MTP head; large init, so that greedy tokens vary.
_TINY_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    max_position_embeddings=32768,
    rope_parameters={**_ROPE, "mrope_section": [2, 1, 1]},
    initializer_range=0.3,
)
_TINY_VISION = dict(
    depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64, initializer_range=0.3
)
_VISION_S, _VISION_M, _VISION_L = (12, 768, 3072, 12), (24, 1024, 4096, 16), (27, 1152, 4304, 16)

# name → the Preset fields (service/random_checkpoints/presets.py makes the Preset)
PRESETS = {
    "tiny-qwen35": dict(text=_TINY_TEXT, vision=_TINY_VISION, tied=True, tiny=True),
    # 8 experts, the top 4, and a shared expert; widths of 96: no expert tensor is square, 4-bit groups of 32
    "tiny-qwen35-moe": dict(
        text={
            **_TINY_TEXT,
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 96,
            "shared_expert_intermediate_size": 96,
        },
        vision=_TINY_VISION,
        tied=False,
        moe=True,
        tiny=True,
    ),
    "qwen3.5-0.8b": _release((1024, 3584, 24, 8, 2, 16), _VISION_S, tied=True),
    "qwen3.5-2b": _release((2048, 6144, 24, 8, 2, 16), _VISION_M, tied=True),
    "qwen3.5-4b": _release((2560, 9216, 32, 16, 4, 32), _VISION_M, tied=True),
    "qwen3.5-9b": _release((4096, 12288, 32, 16, 4, 32), _VISION_L, tied=False),
    # ~72 GB in bf16: written straight into the 4-bit format
    "qwen3.5-35b-a3b": _release((2048, 0, 40, 16, 2, 32), _VISION_L, tied=False, experts=256, quantized_only=True),
    "qwen3.5-35b-a3b-e32": _release((2048, 0, 40, 16, 2, 32), _VISION_L, tied=False, experts=32),
    # the same with 16 experts: its bf16 checkpoint (~10 GB), ours and the GGUFs fit a machine with ~35 GB free
    "qwen3.5-35b-a3b-e16": _release((2048, 0, 40, 16, 2, 32), _VISION_L, tied=False, experts=16),
}


def model_config(recipe, ids: dict[str, int] | None, vocab_size: int, shapes: dict | None = None):
    """A Qwen3.5 preset's config (a Qwen3_5Config, or Qwen3_5MoeConfig); `ids`: the added tokens' ids
    (the real tokenizer's when None); `shapes`: {"text": {...}, "vision": {...}} values replacing the preset's."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    ids = ids or REAL_IDS
    text = copy.deepcopy(recipe.text)
    vision = copy.deepcopy(recipe.vision)
    vision.update(
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
        num_position_embeddings=2304,
        hidden_act="gelu_pytorch_tanh",
    )
    text.update((shapes or {}).get("text", {}))
    vision.update((shapes or {}).get("vision", {}))
    text.update(
        vocab_size=vocab_size if ids is not REAL_IDS else VOCAB_SIZE,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        attention_bias=False,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        mtp_num_hidden_layers=1,
        tie_word_embeddings=recipe.tied,
        eos_token_id=ids["<|endoftext|>"],
    )
    return (Qwen3_5MoeConfig if recipe.moe else Qwen3_5Config)(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=recipe.tied,
    )
