"""The `make-model` presets: each one model's shapes and how its random checkpoint is made, one entry
of PRESETS apiece, and `model_config` building a preset's transformers config.

The releases' shapes are as their published config.json files give them (docs/models.md names the
sources). `tiny` and `tiny-moe` are the test models: the same structure, a few units of each.
`30b-a3b-e32`: 30B-A3B's every per-token shape with 32 experts instead of 128 (the top 8 kept), for
the steps the full one does not fit (a bf16 checkpoint for llama.cpp's GGUF conversion: ~19 GB, not
~62). `tiny-thinking` and `2b-thinking`: the Thinking twins of `tiny` and `2b`, with a Thinking chat
template and the <think> tags in the tokenizer. `tiny-embedding`, `tiny-reranker`, `2b-`/`8b-embedding`
and `2b-`/`8b-reranker`: Qwen3-VL-Embedding's and -Reranker's (the chat model's shapes; a directory named
after the preset is recognised by its name). A preset of another model family is one more entry.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from . import qwen35

# The released checkpoints' ids of the special tokens the configs name.
REAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}


@dataclass(frozen=True)
class Preset:
    """One preset: its config's values and how its checkpoint is written."""

    text: dict  # text_config values (the vocabulary and special tokens come from the tokenizer)
    vision: dict  # vision_config values
    tied: bool  # tie_word_embeddings
    moe: bool = False  # a mixture of experts: Qwen3VLMoeConfig, not Qwen3VLConfig
    thinking: bool = False  # a Thinking chat template and the <think> tags in the tokenizer
    tiny: bool = False  # a test model: fp32, its vocabulary exactly its (1024-token) tokenizer's
    whole_model_init: bool = False  # transformers' init after torch.manual_seed(0), not seeded per tensor
    quantized_only: bool = False  # written only straight into the INT8 / 4-bit format (too large in bf16)
    family: str = "qwen3_vl"  # or "qwen3_5": its config class, tokens and prompt format (qwen35.py)
    task: str = "chat"  # or "embedding", "rerank": Qwen3-VL-Embedding's / -Reranker's (service/model/task.py)
    headless: bool = False  # its files hold no lm_head though its config is untied (Qwen3-VL-Embedding-8B)


_ROPE = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
# A preset's shapes, in this order: the text decoder's, then the vision tower's.
_TEXT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
_VISION_FIELDS = ("depth", "hidden_size", "intermediate_size", "num_heads", "deepstack_visual_indexes")


def _configs(text: tuple, vision: tuple, initializer_range: float, **text_values) -> tuple[dict, dict]:
    """text_config and vision_config values: `text` the decoder's hidden, MLP width, layers, query heads,
    KV heads; `vision` the tower's depth, hidden, MLP width, heads, DeepStack layers (its out_hidden_size
    is the text hidden); `text_values` the decoder's others."""
    text_config = dict(zip(_TEXT_FIELDS, text), **text_values, initializer_range=initializer_range)
    vision_config = dict(zip(_VISION_FIELDS, vision), out_hidden_size=text[0], initializer_range=initializer_range)
    return text_config, vision_config


def _release(text: tuple, vision: tuple, tied: bool, experts: dict | None = None, **how) -> Preset:
    """A released model's preset (head_dim 128 for all releases); `experts`: a mixture of experts'
    counts, every layer sparse."""
    text_config, vision_config = _configs(
        text, vision, 0.02, head_dim=128, max_position_embeddings=262144, rope_parameters=dict(_ROPE)
    )
    if experts:
        text_config.update(experts, decoder_sparse_step=1, mlp_only_layers=[])
    return Preset(text_config, vision_config, tied, moe=bool(experts), **how)


# Large init so greedy tokens vary: at 0.02 a random model emits one constant token.
_TINY_TEXT, _TINY_VISION = _configs(
    (64, 128, 3, 4, 2),
    (2, 64, 128, 4, [0, 1]),
    0.3,
    head_dim=16,
    max_position_embeddings=32768,
    rope_parameters={**_ROPE, "mrope_section": [4, 2, 2]},
)
_TINY = Preset(_TINY_TEXT, _TINY_VISION, tied=True, tiny=True, whole_model_init=True)
_2B = _release((2048, 6144, 28, 16, 8), (24, 1024, 4096, 16, [5, 11, 17]), tied=True)
_8B = _release((4096, 12288, 36, 32, 8), (27, 1152, 4304, 16, [8, 16, 24]), tied=False)
# 30B-A3B: 128 experts, the top 8 per token (their probabilities renormalised over the 8), expert MLP
# 2048 → 768 → 2048, every layer sparse (decoder_sparse_step 1, mlp_only_layers []); its MLP width unused.
_30B_A3B_TEXT = (2048, 6144, 48, 32, 4)
_30B_A3B_VISION = (27, 1152, 4304, 16, [8, 16, 24])

PRESETS: dict[str, Preset] = {
    "tiny": _TINY,
    # 8 experts, the top 4 per token; layer 1 a dense MLP (mlp_only_layers), as a checkpoint may have.
    # Expert width 96: no expert tensor is square (the layout on disk would be ambiguous), and it
    # splits into 4-bit groups (of 32).
    "tiny-moe": Preset(
        {
            **_TINY_TEXT,
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 96,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
        _TINY_VISION,
        tied=False,
        moe=True,
        tiny=True,
    ),
    "tiny-thinking": replace(_TINY, thinking=True),
    "2b": _2B,
    "2b-thinking": replace(_2B, thinking=True),
    "4b": _release((2560, 9728, 36, 32, 8), (24, 1024, 4096, 16, [5, 11, 17]), tied=True),
    "8b": _8B,
    "30b-a3b": _release(
        _30B_A3B_TEXT,
        _30B_A3B_VISION,
        tied=False,
        experts=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
        quantized_only=True,
    ),
    "30b-a3b-e32": _release(
        _30B_A3B_TEXT,
        _30B_A3B_VISION,
        tied=False,
        experts=dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=768),
    ),
}
# Search: Qwen3-VL-Embedding and -Reranker are Qwen3-VL-2B / -8B fine-tuned, the same shapes and config
# (their directories' names tell them: service/model/task.py); Embedding-8B's files hold no lm_head.
PRESETS.update(
    {
        "tiny-embedding": replace(_TINY, task="embedding"),
        "tiny-reranker": replace(_TINY, task="rerank"),
        "2b-embedding": replace(_2B, task="embedding"),
        "8b-embedding": replace(_8B, task="embedding", headless=True),
        "2b-reranker": replace(_2B, task="rerank"),
        "8b-reranker": replace(_8B, task="rerank"),
    }
)
PRESETS.update({name: Preset(**fields, family="qwen3_5") for name, fields in qwen35.PRESETS.items()})
BUILT = tuple(name for name, preset in PRESETS.items() if not preset.quantized_only)  # in bf16 (fp32: tiny) too


def preset_of(name: str) -> Preset:
    """The preset `name`; ValueError naming the presets if there is none."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def model_config(preset: str, ids: dict[str, int] | None = None, vocab_size: int = 151936, shapes: dict | None = None):
    """The preset's config (a Qwen3VLConfig, or a Qwen3VLMoeConfig for the mixtures of experts);
    `ids`: the special tokens' ids (the real tokenizer's when None); `shapes`: {"text": {...},
    "vision": {...}} values that replace the preset's (tests scale a preset down with it)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    recipe = preset_of(preset)
    if recipe.family == "qwen3_5":
        return qwen35.model_config(recipe, ids, vocab_size, shapes)
    ids = ids or REAL_IDS
    text = {"vocab_size": vocab_size, **copy.deepcopy(recipe.text)}  # the config keeps (and may change) them
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
        hidden_act="silu",
        rms_norm_eps=1e-6,
        attention_bias=False,
        tie_word_embeddings=recipe.tied,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    return (Qwen3VLMoeConfig if recipe.moe else Qwen3VLConfig)(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=recipe.tied,
    )
