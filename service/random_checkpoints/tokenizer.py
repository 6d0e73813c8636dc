"""The random checkpoints' tokenizer: a Qwen2-style byte-level BPE trained on a fixed corpus, Qwen's
special tokens after its learned ones (the <think> tags too for a Thinking checkpoint), written with
its config and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .chat_templates import CHAT_TEMPLATE, THINKING_CHAT_TEMPLATE

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


def train_bpe(texts, vocab_size: int, added: list[tuple[str, bool]] | None = None, regex: str | None = None):
    """A Qwen2-style byte-level BPE (Qwen's pre-tokenizer regex — or `regex` — byte alphabet, NFC) trained
    on `texts`, with Qwen's special tokens (or `added`: (token, special) pairs, in their order) after its
    `vocab_size` learned ones."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex or PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if added is None:
        tokenizer.add_special_tokens(SPECIAL_TOKENS)
        return tokenizer
    for token, special in added:  # one at a time: their ids follow the list's order
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)])
    return tokenizer


def train_tokenizer(
    out_dir: Path, vocab_size: int, thinking: bool = False, family=None, words: tuple[str, ...] = ()
) -> dict[str, int]:
    """Train the checkpoints' tokenizer on a fixed corpus; returns the special-token ids (and the
    thinking tags' with `thinking`, whose chat template is then the Thinking one). `family`: another
    model family's module (service/random_checkpoints/qwen35.py): its added tokens as (token, special)
    pairs in their order, pre-tokenizer regex, tokenizer class and chat template. `words`: lines of the
    corpus besides (a reranker's "yes" and "no", which must be tokens of their own)."""
    from tokenizers import AddedToken

    tokenizer_class = "Qwen2Tokenizer"
    if family is not None:
        corpus = _corpus() + list(words)
        tokenizer = train_bpe(corpus, vocab_size - len(family.TOKENS), family.TOKENS, family.pretokenize_regex())
        added, template = [token for token, _ in family.TOKENS], family.CHAT_TEMPLATE
        tokenizer_class = family.TOKENIZER_CLASS
    else:
        tokenizer = train_bpe(_corpus() + list(words), vocab_size - len(SPECIAL_TOKENS))
        thinking_tags = THINKING_TOKENS if thinking else []
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in thinking_tags])
        added, template = SPECIAL_TOKENS + thinking_tags, THINKING_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in added}
    tokenizer_config = {
        "tokenizer_class": tokenizer_class,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(template)
    return ids
