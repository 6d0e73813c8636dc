"""Random-weight Qwen3-VL checkpoints: the embedded tiny test model and a 2B-shaped benchmark model.

Both are real checkpoints (config, safetensors, a trained byte-level BPE tokenizer, chat template,
image-processor config) that load through the same loader as a downloaded Qwen3-VL. Their weights
are random, so their answers are noise.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import torch

from ..settings import EMBEDDED_MODEL_DIRNAME

log = logging.getLogger(__name__)

RANDOM_MODEL_MARKER = "random_test_model"
RANDOM_MODEL_WARNING = (
    "This is a RANDOM-WEIGHT test model: its answers are noise (the embedded one, or one `make-model` "
    "wrote for tests and benchmarks). Set MODEL_PATH to a Qwen3-VL checkpoint directory for real answers."
)

# The released checkpoints' ids of the special tokens the configs name.
REAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}

# Qwen's special tokens, in the order (and so with the relative ids) of the real tokenizer.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

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
THINKING_TOKENS = ["<think>", "</think>"]  # added after the special tokens, as plain (not special) tokens

# Deterministic text the tiny tokenizer is trained on: enough English to give real merges.
_CORPUS_WORDS = (
    "the a an is are was were be been this that these those what which who where when why how "
    "picture image photo cat dog bird car house tree sky sun water road person people man woman child "
    "red green blue yellow black white orange purple brown gray color colour shape square circle line "
    "left right top bottom middle center front back above below near far big small large tiny many few "
    "describe tell me show answer question please thank you yes no there here in on at of to from with "
    "and or but not can could would should will do does did have has had one two three four five six "
    "seven eight nine ten zero hello world test model random noise assistant user system text video frame"
).split()


def _corpus() -> list[str]:
    generator = torch.Generator().manual_seed(1234)
    lines = []
    for _ in range(2000):
        idx = torch.randint(len(_CORPUS_WORDS), (12,), generator=generator).tolist()
        sentence = " ".join(_CORPUS_WORDS[i] for i in idx)
        lines.append(sentence.capitalize() + ("?" if idx[0] % 3 == 0 else ".") + f" {idx[1]} {idx[2] * 7}")
    return lines


def train_bpe(texts, vocab_size: int):
    """A Qwen2-style byte-level BPE (Qwen's pre-tokenizer regex, byte alphabet, NFC) trained on
    `texts`, with Qwen's special tokens after its `vocab_size` learned ones."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def train_tokenizer(out_dir: Path, vocab_size: int, thinking: bool = False) -> dict[str, int]:
    """Train the checkpoints' tokenizer on a fixed corpus; returns the special-token ids (and the
    thinking tags' with `thinking`, whose chat template is then the Thinking one)."""
    from tokenizers import AddedToken

    tokenizer = train_bpe(_corpus(), vocab_size - len(SPECIAL_TOKENS))
    added = THINKING_TOKENS if thinking else []
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS + added}
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(THINKING_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE)
    return ids


def write_image_processor_config(out_dir: Path) -> None:
    """The Qwen3-VL-2B-Instruct preprocessor settings (patch 16, merge 2, mean/std 0.5)."""
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


# The releases' shapes, as their published config.json files give them (docs/models.md names the
# sources). `tiny` and `tiny-moe` are the test models: the same structure, a few units of each.
# `30b-a3b-e32`: 30B-A3B's every per-token shape with 32 experts instead of 128 (the top 8 kept), for
# the steps the full one does not fit (a bf16 checkpoint for llama.cpp's GGUF conversion: ~19 GB, not ~62).
# `tiny-thinking` and `2b-thinking`: the Thinking twins of `tiny` and `2b` (THINKING: their shapes'
# preset), with a Thinking chat template and the <think> tags in the tokenizer.
PRESETS = ("tiny", "tiny-moe", "tiny-thinking", "2b", "2b-thinking", "4b", "8b", "30b-a3b", "30b-a3b-e32")
THINKING = {"tiny-thinking": "tiny", "2b-thinking": "2b"}
TINY = ("tiny", "tiny-moe", "tiny-thinking")
WHOLE_MODEL_INIT = ("tiny", "tiny-thinking")  # transformers' init after torch.manual_seed(0), as ever
MOE = ("tiny-moe", "30b-a3b", "30b-a3b-e32")
QUANTIZED_ONLY = ("30b-a3b",)  # make_checkpoint writes these only straight into the INT8 / 4-bit format
BUILT = tuple(p for p in PRESETS if p not in QUANTIZED_ONLY)  # and these in bf16 (fp32: the tiny ones) too

_ROPE = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
_TEXT = {  # text decoder: hidden, MLP width, layers, query heads, KV heads (head_dim 128 for all releases)
    "2b": (2048, 6144, 28, 16, 8),
    "4b": (2560, 9728, 36, 32, 8),
    "8b": (4096, 12288, 36, 32, 8),
    "30b-a3b": (2048, 6144, 48, 32, 4),  # MLP width unused: every layer is a mixture of experts
    "30b-a3b-e32": (2048, 6144, 48, 32, 4),
}
_VISION = {  # vision tower: depth, hidden, MLP width, heads, DeepStack layers (out_hidden_size = the text hidden)
    "2b": (24, 1024, 4096, 16, [5, 11, 17]),
    "4b": (24, 1024, 4096, 16, [5, 11, 17]),
    "8b": (27, 1152, 4304, 16, [8, 16, 24]),
    "30b-a3b": (27, 1152, 4304, 16, [8, 16, 24]),
    "30b-a3b-e32": (27, 1152, 4304, 16, [8, 16, 24]),
}
TIED = {"tiny": True, "tiny-moe": False, "2b": True, "4b": True, "8b": False, "30b-a3b": False, "30b-a3b-e32": False}
# 30B-A3B: 128 experts, the top 8 per token (their probabilities renormalised over the 8), expert MLP
# 2048 → 768 → 2048, every layer sparse (decoder_sparse_step 1, mlp_only_layers []).
_EXPERTS = {
    "30b-a3b": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "30b-a3b-e32": dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=768),
}


def model_config(preset: str, ids: dict[str, int] | None = None, vocab_size: int = 151936, shapes: dict | None = None):
    """The preset's config (a Qwen3VLConfig, or a Qwen3VLMoeConfig for the mixtures of experts);
    `ids`: the special tokens' ids (the real tokenizer's when None); `shapes`: {"text": {...},
    "vision": {...}} values that replace the preset's (tests scale a preset down with it)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    ids = ids or REAL_IDS
    shaped = THINKING.get(preset, preset)
    if preset in TINY:
        text = dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=32768,
            rope_parameters={**_ROPE, "mrope_section": [4, 2, 2]},
            # Large init so greedy tokens vary: at 0.02 a random model emits one constant token.
            initializer_range=0.3,
        )
        vision = dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=64,
            deepstack_visual_indexes=[0, 1],
            initializer_range=0.3,
        )
        if preset == "tiny-moe":
            # 8 experts, the top 4 per token; layer 1 a dense MLP (mlp_only_layers), as a checkpoint may have.
            # Expert width 96: no expert tensor is square (the layout on disk would be ambiguous), and it
            # splits into 4-bit groups (of 32).
            text.update(
                num_experts=8,
                num_experts_per_tok=4,
                moe_intermediate_size=96,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
            )
    else:
        hidden, width, layers, heads, kv_heads = _TEXT[shaped]
        text = dict(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=128,
            max_position_embeddings=262144,
            rope_parameters=dict(_ROPE),
            initializer_range=0.02,
        )
        text.update(_EXPERTS.get(preset, {}))
        if preset in MOE:
            text.update(decoder_sparse_step=1, mlp_only_layers=[])
        depth, vision_hidden, vision_width, vision_heads, deepstack = _VISION[shaped]
        vision = dict(
            depth=depth,
            hidden_size=vision_hidden,
            intermediate_size=vision_width,
            num_heads=vision_heads,
            out_hidden_size=hidden,
            deepstack_visual_indexes=deepstack,
            initializer_range=0.02,
        )
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
        tie_word_embeddings=TIED[shaped],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    return (Qwen3VLMoeConfig if preset in MOE else Qwen3VLConfig)(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=TIED[shaped],
    )


def make_checkpoint(
    preset: str,
    out_dir: str | os.PathLike,
    bits: int | None = None,
    progress: bool = False,
    per_tensor_seeds: bool | None = None,
    shapes: dict | None = None,
    **quantization,
) -> Path:
    """Write a random-weight Qwen3-VL checkpoint to `out_dir`, deterministically (seeded).

    `tiny` is the embedded test model (fp32, ~1 MB, ~1 s), `tiny-moe` its mixture-of-experts
    twin (8 experts, top 4, untied embedding) and `tiny-thinking` its Thinking twin (`2b-thinking`
    likewise for 2B: a Thinking chat template and the <think> tags); `2b`, `4b` and `8b` have the exact shapes of
    Qwen3-VL-2B, -4B and -8B, stored in bf16 like the real checkpoints (~4.3, ~8.9 and ~17.5 GB),
    and `30b-a3b-e32` 30B-A3B's with 32 experts (~18.6 GB).

    bits=8 or 4: the same weights written straight into `python -m service quantize`'s INT8 or 4-bit
    format (`quantization`: its group_size, symmetric, keep_8bit), each tensor generated, quantized and
    written, then freed — the only way to write `30b-a3b` (~62 GB in bf16). Either way the weights come
    from service/model/random_weights.py, seeded per tensor (`per_tensor_seeds`, by default every preset
    but `tiny`, which keeps its whole-model initialisation), so `make-model --bits 4` writes the very
    tensors `make-model` then `quantize --bits 4` would.
    """
    from ..quant import estimates, writer
    from . import random_weights

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    if bits is None and preset in QUANTIZED_ONLY:
        config = model_config(preset, shapes=shapes)
        raise ValueError(
            f"preset {preset!r} would be ~{estimates.estimated_bytes(config, None) / 1e9:.0f} GB in bf16: write it "
            f"straight into the 4-bit format (~{estimates.estimated_bytes(config, 4) / 1e9:.1f} GB), "
            f"`python -m service make-model --preset {preset} --bits 4 DIR`, or take `30b-a3b-e32` "
            "(its shapes with 32 experts) where a bf16 checkpoint is needed"
        )
    out_dir = Path(out_dir)
    if bits is not None:
        spec = writer.quantization_spec(
            bits,
            quantization.get("group_size", writer.GROUP_SIZE),
            quantization.get("symmetric", False),
            quantization.get("keep_8bit", writer.KEEP_8BIT),
        )
        writer.check_empty(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tiny = preset in TINY
    ids = train_tokenizer(out_dir, 1024 if tiny else 4096, thinking=preset in THINKING)
    write_image_processor_config(out_dir)
    # The tiny models' vocabulary is exactly their tokenizer's, so every sampled id decodes to text.
    config = model_config(preset, ids, max(ids.values()) + 1 if tiny else 151936, shapes)
    dtype = torch.float32 if tiny else torch.bfloat16
    config.dtype = dtype
    setattr(config, RANDOM_MODEL_MARKER, True)
    per_tensor = preset not in WHOLE_MODEL_INIT if per_tensor_seeds is None else per_tensor_seeds
    if bits is None and not per_tensor:  # the embedded tiny model, as it has always been written
        model = random_weights.legacy_model(config, dtype)
        model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
        model.generation_config.pad_token_id = ids["<|endoftext|>"]
        model.save_pretrained(out_dir, max_shard_size="2GB")
        return out_dir
    write_generation_config(config, ids, out_dir)
    if per_tensor:
        source, how = random_weights.RandomTensors(config, dtype), "seeded per tensor"
    else:
        source, how = random_weights.legacy_tensors(config, dtype), "torch.manual_seed(0), whole model"
    config_dict = config_json(config)
    if bits is None:
        write_safetensors(source, out_dir, progress=progress)
        (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    else:
        marker = writer.write_quantized_tensors(
            source,
            config,
            out_dir,
            spec,
            made_by=f"python -m service make-model --preset {preset} --bits {bits}",
            source_path=f"random weights ({how}: service/model/random_weights.py)",
            source_dtype=str(dtype).removeprefix("torch."),
            progress=progress,
            **({"shard_bytes": quantization["shard_bytes"]} if "shard_bytes" in quantization else {}),
        )
        writer.write_config(out_dir, config_dict, marker)
    log.info("wrote %s random Qwen3-VL checkpoint to %s in %.1f s", preset, out_dir, time.perf_counter() - start)
    return out_dir


def write_generation_config(config, ids: dict[str, int], out_dir: Path) -> None:
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    generation.pad_token_id = ids["<|endoftext|>"]
    generation.save_pretrained(out_dir)


def config_json(config) -> dict:
    """config.json's contents, as save_pretrained writes them for the model of `config`."""
    from ..quant.fusion import model_class

    config.architectures = [model_class(config).__name__]
    return json.loads(config.to_json_string(use_diff=True))


SHARD_BYTES = 2 * 1024**3


def write_safetensors(source, out_dir: Path, shard_bytes: int = SHARD_BYTES, progress: bool = False) -> None:
    """`source`'s tensors into Hugging Face safetensors shards (model.safetensors, or model-0000i-of-N
    and their index), each tensor generated and written in pieces of at most ~64 MB: memory stays
    that, whatever the model's size."""
    from tqdm import tqdm

    from ..quant.packing import _DTYPE_NAMES

    names = sorted(source.shapes)
    size = {n: math.prod(source.shape(n)) * source.dtype.itemsize for n in names}
    shards, current = [], []
    for n in names:
        if current and sum(size[m] for m in current) + size[n] > shard_bytes:
            shards.append(current)
            current = []
        current.append(n)
    shards.append(current)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    with tqdm(total=sum(size.values()), desc="writing", unit="B", unit_scale=True, disable=not progress) as bar:
        for file, shard in zip(files, shards):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for n in shard:
                header[n] = {
                    "dtype": _DTYPE_NAMES[source.dtype],
                    "shape": list(source.shape(n)),
                    "data_offsets": [offset, offset + size[n]],
                }
                offset += size[n]
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            with open(out_dir / file, "wb") as f:
                f.write(struct.pack("<Q", len(text)) + text)
                for n in shard:
                    shape = source.shape(n)
                    rows = max(1, (64 << 20) // max(1, size[n] // shape[0]))
                    for start in range(0, shape[0], rows):
                        piece = source.read_rows(n, start, start + rows)
                        f.write(piece.contiguous().reshape(-1).view(torch.uint8).numpy())
                        bar.update(piece.numel() * piece.element_size())
                        del piece
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(size.values())},
            "weight_map": {n: file for file, shard in zip(files, shards) for n in shard},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# transformers 5 keeps a layer's experts as [experts, 2·width, hidden] (gate_up) and [experts, hidden,
# width] (down) and saves them so; the released Qwen3-VL-MoE checkpoints store each transposed
# (transformers' conversion mapping for qwen3_vl_moe turns them at load). The random checkpoints are
# generated in the releases' layout, so the tests load what a downloaded checkpoint holds.


def embedded_model_dir(cache_dir: Path) -> Path:
    """The embedded tiny checkpoint under `cache_dir`, built once (atomically) on first use."""
    target = Path(cache_dir) / EMBEDDED_MODEL_DIRNAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning("building the embedded random test model in %s (once)", target)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        make_checkpoint("tiny", staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def is_random_test_model(config) -> bool:
    return bool(getattr(config, RANDOM_MODEL_MARKER, False))
